"""`rewy-tune bench` on the CPU: option checking (one clear line, exit 2), shape parsing, schedule loading.
The timing itself needs a GPU (`-m gpu` runs it with the compile-ahead pool on a tiny workload)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rewy_tune.cli.bench import load_schedule, parse_shapes
from rewy_tune.schedule import Schedule
from rewy_tune.search import default_schedule


def _bench(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "rewy_tune.cli.main", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["--op", "mamba"], "--op: unknown operator 'mamba'"),
    (["--op", "gdn", "--policy", "C"], "--policy: got 'C'; accepted: R, A, both"),
    (["--op", "gdn", "--rounds", "5"], "at least 30, got 5"),
    (["--op", "gdn", "--jobs", "0"], "--jobs must be at least 1, got 0"),
])
def test_bad_options_one_line_exit_2(args, needle):
    proc = _bench(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stdout


def test_cpu_only_machine_is_told_bench_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = _bench("--op", "all", "--policy", "both")
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout


def test_parse_shapes_accepts_quoted_lists_and_rejects_garbage():
    assert parse_shapes(["1,512,4 1,2048,16", "2,64,1"]) == [(1, 512, 4), (1, 2048, 16), (2, 64, 1)]
    with pytest.raises(ValueError, match="is not B,T,H"):
        parse_shapes(["1,512"])
    with pytest.raises(ValueError, match="positive"):
        parse_shapes(["0,512,4"])


def test_default_schedule_is_the_operators_own(tmp_path):
    for op in ("deltanet", "gdn", "kda", "gdn2"):
        assert load_schedule("default", op, K=64, V=64) == default_schedule(op, None, 64, 64)
    f = tmp_path / "s.json"
    s = default_schedule("gdn", None, 64, 64).replace(consumer="separate")
    f.write_text(s.to_json())
    assert load_schedule(str(f), "gdn") == s
    f.write_text(json.dumps({"consumer": "sideways"}))
    with pytest.raises(ValueError, match="not a valid schedule"):
        load_schedule(str(f), "gdn")
    with pytest.raises(ValueError, match="neither 'default', 'db'"):
        load_schedule(str(tmp_path / "missing.json"), "gdn")
    assert isinstance(load_schedule("default", "kda"), Schedule)


@pytest.mark.gpu
def test_bench_all_policies_with_compile_ahead_writes_one_json_per_run(tmp_path):
    proc = _bench("--op", "gdn", "--policy", "both", "--shapes", "1,256,2", "--jobs", "2", "--json",
                  str(tmp_path / "out"), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled ahead" in proc.stdout
    for policy in ("R", "A"):
        data = json.loads((tmp_path / "out" / f"bench-gdn-{policy}.json").read_text())
        assert data["policy"] == policy and data["geomean_speedup"] > 0
