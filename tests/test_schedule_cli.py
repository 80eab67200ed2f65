"""`rewy-tune schedule`: the dispatcher's pick for a call on this machine, or a compute capability's built-in default,
as JSON that bench --schedule FILE reads back; bad options in one line, exit 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rewy_tune.cli.bench import load_schedule
from rewy_tune.cli.main import app
from rewy_tune.dispatch import clear_cache
from rewy_tune.schedule import Schedule
from rewy_tune.search_spaces import default_schedule


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def _run(*args):
    return CliRunner().invoke(app, ["schedule", *args])


def test_a_compute_capabilitys_default_is_written_for_bench(tmp_path):
    out = tmp_path / "s.json"
    res = _run("--op", "kda", "--policy", "A", "--cc", "9.0", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert "built-in default for compute capability 9.0" in res.output
    want = default_schedule((9, 0), K=128, V=128, op="kda", dtype="bf16", policy="A")
    assert want != default_schedule((9, 0), K=128, V=128, op="kda", dtype="bf16", policy="R")  # the policy counts
    assert Schedule.from_json(out.read_text()) == want
    assert load_schedule(str(out), "kda") == want  # what `bench --schedule FILE` reads


def test_the_dispatchers_pick_on_this_machine_with_its_reason(tmp_path):
    # a winner stored for this machine's own device and software: the command shows it and says it is the exact one
    from rewy_tune.device import current_device, current_environment
    from rewy_tune.problem import Problem
    from test_dispatch import make_db

    mine = default_schedule(None, K=32, V=32, op="gdn").replace(cumsum={"num_warps": 1})
    url = make_db(tmp_path / "w.db", [(current_device(), current_environment(),
                                       Problem("gdn", "R", "fp32", 1, 256, 2, 32, 32), mine)])
    res = _run("--op", "gdn", "--shape", "1,200,2", "--head-dim", "32", "--dtype", "fp32", "--db", url)
    assert res.exit_code == 0, res.output
    reason, _, text = res.output.partition("\n")
    assert reason.startswith("schedule: exact: winner #1"), res.output
    assert Schedule.from_dict(json.loads(text)) == mine
    res = _run("--op", "kda", "--shape", "1,200,2", "--head-dim", "32", "--dtype", "fp32", "--db", url)
    assert res.exit_code == 0 and "schedule: generic: built-in generic schedule" in res.output  # no kda winner


@pytest.mark.parametrize("args, needle", [
    (["--op", "mamba"], "--op: op must be one of deltanet, gdn, kda, gdn2; got 'mamba'"),
    (["--op", "gdn", "--policy", "both"], "--policy: policy must be one of R, A; got 'both'"),
    (["--op", "gdn", "--dtype", "fp64"], "--dtype: dtype must be one of bf16, fp16, fp32; got 'fp64'"),
    (["--op", "gdn", "--shape", "1,2048"], "--shape: '1,2048' is not B,T,H"),
    (["--op", "gdn", "--shape", "1,64,1 1,64,2"], "--shape: give one B,T,H"),
    (["--op", "gdn", "--head-dim", "300"], "--head-dim: 300 has no schedule; accepted: 1 to 256"),
    (["--op", "gdn", "--cc", "nine"], "--cc: 'nine' is not a compute capability MAJOR.MINOR (e.g. 9.0)"),
    (["--op", "gdn", "--cc", "9.0", "--json", "/nonexistent_dir/s.json"], "--json /nonexistent_dir/s.json: cannot "
                                                                          "write it"),
])
def test_bad_options_one_line_exit_2(args, needle):
    res = _run(*args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip() and not ln.startswith("schedule:")]
    assert len(lines) == 1 and needle in lines[0], res.output
