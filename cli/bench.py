"""`rewy-tune bench`: our backward against FLA's, side by side in one process (rewy_tune.measure)."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rewy_tune import autotune_parts, measure
from rewy_tune.cli.files import write_text_atomic


def parse_shapes(text: list[str] | None) -> list[tuple[int, int, int]]:
    """'1,512,4' strings → (B, T, H) tuples; a clear ValueError for anything else."""
    if not text:
        return list(measure.DEFAULT_SHAPES)
    shapes = []
    for item in text:
        for part in item.split():
            try:
                B, T, H = (int(x) for x in part.split(","))
            except ValueError:
                raise ValueError(f"--shapes: {part!r} is not B,T,H (three integers, e.g. 1,2048,16)") from None
            if min(B, T, H) <= 0:
                raise ValueError(f"--shapes: {part!r} must have positive B, T and H")
            shapes.append((B, T, H))
    if not shapes:  # --shapes "": an empty list would run nothing (and a campaign still create its database)
        raise ValueError("--shapes: no shape given; accepted: B,T,H (three positive integers, e.g. 1,2048,16)")
    return shapes


def parse_overrides(items: list[str] | None) -> dict[str, int | str]:
    """'FIELD=VALUE' strings (a stage's member as STAGE.MEMBER; several in one quoted string) → flat schedule
    parameters, integers as int; a clear ValueError for anything else. Field names and values are checked when
    the parameters are applied (`apply_overrides`)."""
    params: dict[str, int | str] = {}
    for item in items or []:
        for part in item.split():
            name, sep, text = part.partition("=")
            if not sep or not name or not text:
                raise ValueError(f"--set: {part!r} is not FIELD=VALUE (e.g. side_stream=reverse_scan, "
                                 "reverse_scan.block_v=16)")
            params[name] = int(text) if text.lstrip("-").isdigit() else text
    return params


def apply_overrides(schedule, params: dict[str, int | str]):
    """The schedule with `parse_overrides`' parameters changed, every operator alike (e.g. a candidate default
    timed on top of each operator's own); a ValueError naming --set for an unknown field or a refused value."""
    import dataclasses

    from rewy_tune.schedule import STAGES, StageConfig
    from rewy_tune.search_spaces import schedule_from_params

    members = {f.name for f in dataclasses.fields(StageConfig)}
    for name in params:
        stage, dot, member = name.partition(".")
        if dot and (stage not in STAGES or member not in members):
            raise ValueError(f"--set: {name!r} is not a stage member; accepted: STAGE.MEMBER with STAGE one of "
                             f"{', '.join(STAGES)} and MEMBER one of {', '.join(sorted(members))}")
    try:
        return schedule_from_params(params, schedule)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--set: {exc}") from None


def candidate_schedule(spec: str, capability):
    """'OP POLICY FIELD=VALUE ...' → OP's built-in POLICY default for a GPU of `capability` with those fields set:
    a candidate default for the GPU tests to gate (REWY_TEST_GPU_SCHEDULE, benchmarks/device_check.sh's
    TEST_CANDIDATE) before it is adopted. A ValueError names what is accepted."""
    from rewy_tune.search_spaces import default_schedule

    parts = spec.split()
    if len(parts) < 2 or parts[0] not in ("deltanet", "gdn", "kda", "gdn2") or parts[1] not in ("R", "A"):
        raise ValueError(f"candidate {spec!r}: expected 'OP POLICY FIELD=VALUE ...' with OP one of deltanet, gdn, "
                         "kda, gdn2 and POLICY R or A")
    op, policy, *sets = parts
    return apply_overrides(default_schedule(capability, op=op, policy=policy), parse_overrides(sets))


def load_schedule(spec: str, op: str, *, policy: str = "R", K: int = 128, V: int = 128):
    """'default' → the built-in default for this GPU; a path → a Schedule JSON file. ('db' is resolved per shape:
    `shape_schedules`.)"""
    import torch

    from rewy_tune.schedule import Schedule
    from rewy_tune.search import default_schedule

    if spec == "default":
        cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        return default_schedule(op, cc, K, V, policy=policy)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--schedule: {spec!r} is neither 'default', 'db' nor a readable JSON file")
    try:
        return Schedule.from_json(path.read_text())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--schedule {spec}: not a valid schedule: {exc}") from None


# the dispatcher's reasons for a stored winner (the others name a built-in schedule)
TUNED_REASONS = ("exact:", "nearest:", "same-cc:")


def dispatched_schedules(op: str, policy: str, shapes, K: int, V: int, *, device=None, environment=None,
                         db_url=None) -> list[tuple]:
    """'--schedule db': per shape, the (schedule, reason) that the runtime dispatcher (`rewy_tune.lookup`) picks on
    this GPU, so the bench times what `enable()` and backend "auto" run at each shape, not one winner for all. A
    ValueError if no shape gets a stored winner: every one would time a built-in schedule. device, environment,
    db_url: as `lookup` takes them (tests)."""
    from rewy_tune.dispatch import lookup
    from rewy_tune.problem import Problem

    picked = [lookup(Problem(op, policy, "bf16", B=B, T=T, H=H, K=K, V=V), device, environment=environment,
                     db_url=db_url) for B, T, H in shapes]
    if not any(reason.startswith(TUNED_REASONS) for _, reason in picked):
        raise ValueError(f"--schedule db: no stored winner for {op} policy {policy} K={K} V={V} on this device "
                         f"({picked[0][1]}); run `rewy-tune --device auto --op {op}` first")
    return picked


def shape_schedules(spec: str, op: str, policy: str, shapes, K: int, V: int, params: dict) -> list[tuple]:
    """(schedule, where it came from) per shape for --schedule SPEC, with the --set parameters applied to each."""
    if spec == "db":
        picked = dispatched_schedules(op, policy, shapes, K, V)
    else:
        origin = "default: the built-in schedule for this GPU" if spec == "default" else f"file: {spec}"
        picked = [(load_schedule(spec, op, policy=policy, K=K, V=V), origin)] * len(shapes)
    return [(apply_overrides(s, params), origin) for s, origin in picked]


def run_bench(op: str, policy: str, schedules, shapes, K: int, V: int, rounds: int, seed: int,
              console: Console) -> dict:
    """schedules: (schedule, where it came from) per shape (`shape_schedules`)."""
    from rewy_tune import fla_baseline

    bypassed = fla_baseline.bypass_hopper_guard() if op == "gdn" else False
    fla = fla_baseline.fla_op(op, policy)
    results = []
    for shape, (schedule, origin) in zip(shapes, schedules, strict=True):
        console.print(f"measuring {op} policy {policy} shape (B,T,H)={shape} K={K} V={V}, schedule {origin} ...",
                      soft_wrap=True)
        ours = measure.rewy_op_fn(op, policy, schedule)
        results.append(measure.measure_shape(op, ours, fla, shape, K=K, V=V, rounds=rounds, seed=seed))
    geo = measure.geometric_mean([r.speedup for r in results])
    versions = measure.software_versions()

    table = Table(title=f"{op} policy {policy}: complete backward (CUDA graph), {rounds} interleaved rounds")
    for col in ("B,T,H", "FLA ms", "ours ms", "FLA/ours", "spread ours/FLA", "FB ratio", "eager ratio",
                "peak MiB ours/FLA"):
        table.add_column(col, justify="right")
    for r in results:
        fb = measure.statistics.median(r.fla.fwd_bwd_ms) / measure.statistics.median(r.ours.fwd_bwd_ms)
        eager = measure.statistics.median(r.fla.eager_ms) / measure.statistics.median(r.ours.eager_ms)
        table.add_row(",".join(map(str, r.shape)), f"{r.fla.median:.4f}", f"{r.ours.median:.4f}",
                      f"{r.speedup:.3f}x", f"{r.ours.spread:.1%}/{r.fla.spread:.1%}", f"{fb:.3f}x",
                      f"{eager:.3f}x", f"{r.ours.peak_backward_mib:.1f}/{r.fla.peak_backward_mib:.1f}")
    console.print(table)
    console.print(f"geometric mean FLA/ours: [bold]{geo:.3f}x[/bold]   " +
                  "  ".join(f"{k}={v}" for k, v in versions.items()))
    if bypassed:
        console.print("note: FLA's Hopper guard for gated chunk_bwd_dqkwg (FLA issue 640, Triton < 3.7.1) "
                      "was bypassed for timing only")
    return {
        "op": op, "policy": policy, "K": K, "V": V, "rounds": rounds,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # one schedule for every shape, or None where --schedule db picked them per shape (then each shape's own)
        "schedule": schedules[0][0].to_dict() if len({s for s, _ in schedules}) == 1 else None,
        "versions": versions, "fla_guard_bypassed": bypassed, "geomean_speedup": geo,
        "shapes": [{**r.to_dict(), "schedule": s.to_dict(), "schedule_origin": origin}
                   for r, (s, origin) in zip(results, schedules)],
        # FLA's configurations as its autotuners picked them in this process: they can differ from run to run
        "fla_autotune_picks": autotune_parts.picks(),
    }


def json_path(json_out: str, op: str, policy: str, many: bool) -> str:
    """Where --json puts one run: a directory (several runs, or an existing directory) holds
    bench-OP-POLICY.json; otherwise the path itself is the file."""
    if many or Path(json_out).is_dir():
        return str(Path(json_out) / f"bench-{op}-{policy}.json")
    return json_out


def write_json(path: str, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))


def run_many(runs, shapes, K: int, V: int, rounds: int, seed: int, jobs: int | None, json_out: str | None,
             console: Console) -> int:
    """Bench each (op, policy, per-shape schedules) in turn after compiling all of them ahead in parallel; a run
    that fails is reported and the others go on. Exit code 1 if any failed."""
    from rewy_tune import fla_baseline, warmup

    fla_baseline.autotune_here()  # FLA's picks are timed here, on an idle GPU, not read from the disk cache
    jobs = warmup.default_jobs() if jobs is None else jobs
    if jobs > 1:
        t0 = time.perf_counter()
        # One task per schedule and head count: H is a compile-time constant, so shapes that share it (and the
        # schedule) share kernels and are better compiled once, in one process, than concurrently in several.
        tasks = []
        for op, policy, scheds in runs:
            groups: dict[tuple, list] = {}
            for shape, (sched, _) in zip(shapes, scheds):
                groups.setdefault((sched, shape[2]), []).append(shape)
            tasks += [warmup.WarmTask(op, policy, sched.to_dict(), group, K, V)
                      for (sched, _), group in groups.items()]
        console.print(f"compiling ahead: {len(tasks)} (operator, policy, schedule, head count) tasks in {jobs} processes ...")
        for r in warmup.warm(tasks, jobs):
            if r.status != "ok":
                console.print(f"[yellow]warm-up {r.task.op} {r.task.policy} {r.task.shapes}: {r.status}[/yellow] "
                              f"{r.message}", soft_wrap=True)
        console.print(f"compiled ahead in {time.perf_counter() - t0:.0f} s")
    failed, summary = 0, []
    many = len(runs) > 1
    if json_out and many:
        Path(json_out).mkdir(parents=True, exist_ok=True)
    for op, policy, sched in runs:
        try:
            data = run_bench(op, policy, sched, shapes, K, V, rounds, seed, console)
        except Exception as exc:  # noqa: BLE001 - one operator's failure must not hide the others' numbers
            failed += 1
            console.print(f"[red]{op} policy {policy} failed:[/red] {type(exc).__name__}: {exc}", soft_wrap=True)
            summary.append((op, policy, None))
            continue
        summary.append((op, policy, data["geomean_speedup"]))
        if json_out:
            path = json_path(json_out, op, policy, many)
            try:
                write_json(path, data)
            except OSError as exc:  # the numbers are printed above; the other runs still go on
                failed += 1
                console.print(f"[red]--json {path}: cannot write it ({exc.strerror})[/red]", soft_wrap=True)
                continue
            console.print(f"wrote {path}")
    if many:
        table = Table(title="geometric mean FLA/ours, complete backward")
        for col in ("operator", "policy", "FLA/ours"):
            table.add_column(col)
        for op, policy, geo in summary:
            table.add_row(op, policy, "failed" if geo is None else f"{geo:.3f}x")
        console.print(table)
    return 1 if failed else 0
