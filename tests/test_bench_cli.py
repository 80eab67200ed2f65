"""`rewy-tune bench` on the CPU: option checking (one clear line, exit 2), shape parsing, schedule loading.
The timing itself needs a GPU (`-m gpu` runs it with the compile-ahead pool on a tiny workload)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rewy_tune.cli.bench import apply_overrides, candidate_schedule, load_schedule, parse_overrides, parse_shapes
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
    (["--op", "gdn", "--set", "side_stream"], "--set: 'side_stream' is not FIELD=VALUE"),
    (["--op", "gdn", "--set", "side_stream=async"], "side_stream must be one of ('none', 'dv_local', 'reverse_scan')"),
    (["--op", "gdn", "--set", "warp_count=4"], "--set: Schedule.replace: unknown field(s) ['warp_count']"),
    (["--op", "gdn", "--set", "reverse_scan.block_x=16"], "--set: 'reverse_scan.block_x' is not a stage member"),
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
    with pytest.raises(ValueError, match="--shapes: no shape given"):
        parse_shapes([""])


def test_overrides_change_each_operators_own_schedule():
    # --set applies the same change on top of each operator's schedule (a candidate default timed for all four)
    params = parse_overrides(["side_stream=reverse_scan", "reverse_scan.block_v=16 scan_split_waves=2"])
    assert params == {"side_stream": "reverse_scan", "reverse_scan.block_v": 16, "scan_split_waves": 2}
    for op in ("gdn", "kda"):
        base = default_schedule(op, (9, 0), 128, 128)
        got = apply_overrides(base, params)
        assert got == base.replace(side_stream="reverse_scan", reverse_scan={"block_v": 16}, scan_split_waves=2)
    assert apply_overrides(base, {}) == base
    with pytest.raises(ValueError, match=r"--set: Schedule.scan_split_waves must be one of \(0, 1, 2, 4\), got 3"):
        apply_overrides(base, {"scan_split_waves": 3})
    with pytest.raises(ValueError, match=r"--set: 'x=' is not FIELD=VALUE"):
        parse_overrides(["x="])


def test_candidate_schedule_is_the_operators_default_with_fields_set():
    # device_check.sh's TEST_CANDIDATE: the GPU tests gate this schedule (REWY_TEST_GPU_SCHEDULE) before it is adopted
    from rewy_tune.search_spaces import default_schedule as builtin

    got = candidate_schedule("deltanet A query_side_block_v=32", (9, 0))
    assert got == builtin((9, 0), op="deltanet", policy="A").replace(query_side_block_v=32)
    assert got != builtin((9, 0), op="deltanet", policy="A")
    assert candidate_schedule("gdn R", (9, 0)) == builtin((9, 0), op="gdn", policy="R")
    for bad in ("", "deltanet", "mamba A", "gdn B x=1"):
        with pytest.raises(ValueError, match="expected 'OP POLICY FIELD=VALUE"):
            candidate_schedule(bad, (9, 0))
    with pytest.raises(ValueError, match="--set"):
        candidate_schedule("deltanet A query_side_block_v=48", (9, 0))


def test_schedule_db_times_what_the_dispatcher_picks_per_shape(tmp_path):
    # --schedule db took the winner nearest the first shape for every shape; it now asks the runtime dispatcher for
    # each, so the bench times what enable() runs at each shape, and says where each schedule came from
    from rewy_tune.cli.bench import dispatched_schedules
    from rewy_tune.dispatch import clear_cache
    from rewy_tune.problem import Problem
    from test_dispatch import H200, RUN, make_db

    base = default_schedule("gdn", (9, 0), 64, 64)
    short, long = base.replace(cumsum={"num_warps": 1}), base.replace(cumsum={"num_warps": 2})
    url = make_db(tmp_path / "w.db", [(H200, RUN, Problem("gdn", "R", "bf16", 1, 512, 4, 64, 64), short),
                                      (H200, RUN, Problem("gdn", "R", "bf16", 1, 8192, 16, 64, 64), long)])
    clear_cache()
    try:
        got = dispatched_schedules("gdn", "R", [(1, 512, 4), (1, 8192, 16), (2, 8192, 16)], 64, 64, device=H200,
                                   environment=RUN, db_url=url)
        assert [s for s, _ in got] == [short, long, long]
        assert [r.split(":")[0] for _, r in got] == ["exact", "exact", "nearest"], got
        with pytest.raises(ValueError, match=r"--schedule db: no stored winner for kda policy R K=64 V=64 on this "
                                             r"device \(default: built-in schedule"):
            dispatched_schedules("kda", "R", [(1, 512, 4)], 64, 64, device=H200, environment=RUN, db_url=url)
    finally:
        clear_cache()


def test_shape_schedules_apply_the_overrides_to_each_shape(tmp_path):
    from rewy_tune.cli.bench import shape_schedules

    got = shape_schedules("default", "gdn", "A", [(1, 512, 4), (1, 2048, 16)], 64, 64, {"side_stream": "none"})
    want = default_schedule("gdn", None, 64, 64, policy="A").replace(side_stream="none")
    assert got == [(want, "default: the built-in schedule for this GPU")] * 2
    f = tmp_path / "s.json"
    f.write_text(want.to_json())
    assert shape_schedules(str(f), "gdn", "R", [(1, 64, 1)], 64, 64, {}) == [(want, f"file: {f}")]


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
    with pytest.raises(ValueError, match="neither 'default', 'db'"):
        load_schedule("db", "gdn")  # per shape only: shape_schedules


@pytest.mark.gpu
def test_bench_all_policies_with_compile_ahead_writes_one_json_per_run(tmp_path):
    proc = _bench("--op", "gdn", "--policy", "both", "--shapes", "1,256,2", "--jobs", "2", "--json",
                  str(tmp_path / "out"), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled ahead" in proc.stdout
    for policy in ("R", "A"):
        data = json.loads((tmp_path / "out" / f"bench-gdn-{policy}.json").read_text())
        assert data["policy"] == policy and data["geomean_speedup"] > 0


def test_bench_many_runs_compiles_ahead_then_writes_one_json_each(tmp_path, monkeypatch):
    """The CLI path end to end with the GPU parts replaced: the option plumbing, the compile-ahead tasks
    (one per head count), a failing run reported while the others go on, and the files written."""
    import torch
    from typer.testing import CliRunner

    from rewy_tune import warmup
    from rewy_tune.cli import bench as bench_mod
    from rewy_tune.cli.main import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    warmed = []
    monkeypatch.setattr(warmup, "warm", lambda tasks, jobs: warmed.extend(tasks) or
                        [warmup.WarmResult(t, "ok", 0.0) for t in tasks])

    def fake_run_bench(op, policy, schedule, shapes, K, V, rounds, seed, console):
        if op == "kda":
            raise RuntimeError("boom")
        return {"op": op, "policy": policy, "K": K, "V": V, "rounds": rounds, "geomean_speedup": 1.0,
                "shapes": [list(s) for s in shapes]}

    monkeypatch.setattr(bench_mod, "run_bench", fake_run_bench)
    out = tmp_path / "out"
    (out / "bench-gdn-R.json").mkdir(parents=True)  # one file that cannot be written: reported, the rest go on
    res = CliRunner().invoke(app, ["bench", "--op", "all", "--policy", "both", "--shapes", "1,512,4 1,2048,4 1,2048,16",
                                   "--head-dim", "64", "--jobs", "3", "--json", str(out)])
    assert res.exit_code == 1, res.output  # kda failed, the others ran
    assert "kda policy R failed" in res.output and "compiled ahead" in res.output
    assert "bench-gdn-R.json: cannot write it (Is a directory)" in " ".join(res.output.split())
    assert (out / "bench-gdn-R.json").is_dir() and "wrote" in res.output
    assert len(warmed) == 4 * 2 * 2 and {len(t.shapes) for t in warmed} == {1, 2}
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(f"bench-{o}-{p}.json" for o in ("deltanet", "gdn", "gdn2") for p in ("R", "A"))
    assert json.loads((out / "bench-gdn2-A.json").read_text())["K"] == 64


def test_run_bench_times_each_shape_with_its_own_schedule(monkeypatch):
    # the measuring part stood in: each shape's op is built from that shape's schedule, and the JSON says which
    # schedule and origin each shape had (top-level "schedule" only where one served every shape)
    from rich.console import Console

    from rewy_tune import autotune_parts, fla_baseline, measure
    from rewy_tune.cli.bench import run_bench, run_many

    base = default_schedule("gdn", (9, 0), 64, 64)
    other = base.replace(cumsum={"num_warps": 1})
    built, timed = [], []
    monkeypatch.setattr(fla_baseline, "fla_op", lambda op, policy: "fla")
    monkeypatch.setattr(fla_baseline, "bypass_hopper_guard", lambda: False)
    monkeypatch.setattr(autotune_parts, "picks", lambda: [])
    monkeypatch.setattr(measure, "rewy_op_fn", lambda op, policy, schedule: built.append(schedule) or schedule)

    def fake_measure(op, ours, fla, shape, *, K, V, rounds, seed):
        timed.append((shape, ours))
        side = measure.SideTiming([1.0, 1.0], [2.0], [3.0], 1.0)
        return measure.ShapeResult(shape, K, V, side, measure.SideTiming([1.5, 1.5], [3.0], [4.5], 2.0))

    monkeypatch.setattr(measure, "measure_shape", fake_measure)
    shapes = [(1, 512, 4), (1, 8192, 16)]
    data = run_bench("deltanet", "R", [(base, "exact: #1"), (other, "nearest: #2")], shapes, 64, 64, 30, 0,
                     Console(file=None, width=200, quiet=True))
    assert built == [base, other] and timed == list(zip(shapes, [base, other]))
    assert data["schedule"] is None and data["geomean_speedup"] == pytest.approx(1.5)
    assert [(d["schedule"], d["schedule_origin"]) for d in data["shapes"]] == [
        (base.to_dict(), "exact: #1"), (other.to_dict(), "nearest: #2")]
    data = run_bench("deltanet", "R", [(base, "default")] * 2, shapes, 64, 64, 30, 0, Console(quiet=True))
    assert data["schedule"] == base.to_dict()
    with pytest.raises(ValueError):  # one schedule per shape, never silently fewer
        run_bench("deltanet", "R", [(base, "default")], shapes, 64, 64, 30, 0, Console(quiet=True))

    # compile-ahead: one task per (schedule, head count), so a shape's own schedule is the one compiled
    from rewy_tune import warmup

    warmed = []
    monkeypatch.setattr(warmup, "warm", lambda tasks, jobs: warmed.extend(tasks) or [])
    monkeypatch.setattr(fla_baseline, "autotune_here", lambda: None)
    three = [(1, 512, 4), (1, 2048, 4), (1, 8192, 16)]
    run_many([("deltanet", "R", [(base, "a"), (other, "b"), (other, "c")])], three, 64, 64, 30, 0, 2, None,
             Console(quiet=True))
    assert sorted((t.schedule == other.to_dict(), t.shapes) for t in warmed) == [
        (False, [(1, 512, 4)]), (True, [(1, 2048, 4)]), (True, [(1, 8192, 16)])]


def test_json_into_an_existing_directory(tmp_path):
    # The H200 run of session 5 lost `bench --op gdn2 --policy A --json results/bench` (IsADirectoryError) because
    # an earlier run had made that directory: one run writes into an existing directory as several runs do.
    from rewy_tune.cli.bench import json_path

    assert json_path(str(tmp_path), "gdn2", "A", many=False) == str(tmp_path / "bench-gdn2-A.json")
    assert json_path(str(tmp_path / "out.json"), "gdn2", "A", many=False) == str(tmp_path / "out.json")
    assert json_path(str(tmp_path / "new"), "kda", "R", many=True) == str(tmp_path / "new" / "bench-kda-R.json")


def test_a_piped_console_keeps_table_cells_whole():
    # device logs are files: at rich's default 80 columns the bench table's cells were cut ("80.1/1…")
    import subprocess
    import sys

    code = ("from rich.table import Table\nfrom rewy_tune.cli.main import console\nt = Table()\n"
            "for i in range(6):\n    t.add_column(f'column {i}')\nt.add_row(*['x' * 20] * 6)\nconsole.print(t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.count("x" * 20) == 6 and "…" not in out
