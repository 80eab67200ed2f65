"""Measure every schedule of a small space once on the GPU: the exhaustive table that
`benchmarks/tpe_convergence.py` replays to test the tuner's search efficiency (issue #5).

    python -P benchmarks/enumerate_space.py --op gdn --shape 1,8192,4 --jobs 14 --out table.json

The space is a handful of schedule fields around the operator's built-in default for this GPU (below: the scan
state tiles and warps, the state storage dtype, joint or separate consumer), their full Cartesian product.
Each combination is checked by the tuner's constraint function first (status "constraint", not compiled),
compiled ahead in parallel (`rewy_tune.warmup`; a failure is "compile_error"), then timed in this one process
with the project's measurement module (CUDA-graph replay, MIN_ROUNDS observations, median) in a shuffled
order, so drift over the run does not follow the enumeration order. FLA is timed once beside the first
combination for reference. Timings only: the tuner's correctness gates are not run here (a replay asks only
"which schedule is fastest", and every field below is one the GPU gate suite has passed with).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch

from rewy_tune import fla_baseline, measure, search, warmup
from rewy_tune.search_spaces import default_schedule

# name -> choices; a dotted name is "<stage>.<field>" of a StageConfig, otherwise a Schedule field.
SPACES = {
    "scalar": {
        "forward_scan.block_v": [16, 32, 64],
        "reverse_scan.block_v": [16, 32, 64],
        "reverse_scan.num_warps": [4, 8],
        "state_dtype": ["input", "fp32"],
        "consumer": ["joint", "separate"],
    },
}


def apply(base, params: dict):
    """The default with the named fields replaced."""
    stages: dict[str, dict] = {}
    plain: dict = {}
    for name, value in params.items():
        if "." in name:
            stage, field = name.split(".")
            stages.setdefault(stage, {})[field] = value
        else:
            plain[name] = value
    return base.replace(**stages, **plain)


def value_of(schedule, name: str):
    """The field a space parameter names ("<stage>.<field>" or a Schedule field)."""
    obj = schedule
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gdn", choices=["deltanet", "gdn"])
    p.add_argument("--policy", default="R")
    p.add_argument("--shape", default="1,8192,4")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    fla_baseline.bypass_hopper_guard()
    shape = tuple(int(x) for x in args.shape.split(","))
    cc = torch.cuda.get_device_capability()
    base = default_schedule(cc, K=128, V=128, op=args.op, dtype="bf16", policy=args.policy)
    space = SPACES["scalar"]
    names = list(space)
    combos = [dict(zip(names, values)) for values in itertools.product(*space.values())]
    results: list[dict] = []
    todo = []
    for params in combos:
        sched = apply(base, params)
        reason = search.constraint_violation(sched, op=args.op, K=128, V=128, compute_capability=cc)
        row = {"params": params, "status": "constraint" if reason else "pending", "median_ms": None}
        if reason:
            row["message"] = reason
        else:
            todo.append((row, sched))
        results.append(row)
    t0 = time.perf_counter()
    # FLA is compiled (and autotuned) by the first task only: it is timed once
    warm = warmup.warm([warmup.WarmTask(args.op, args.policy, s.to_dict(), [shape], with_fla=i == 0)
                        for i, (_, s) in enumerate(todo)], jobs=args.jobs)
    compile_s = time.perf_counter() - t0
    for (row, _), w in zip(todo, warm):
        if w.status != "ok":
            row["status"], row["message"] = "compile_error", (w.message or "")[:300]
    fla = fla_baseline.fla_op(args.op, args.policy)
    fla_ms = None
    order = [(row, s) for row, s in todo if row["status"] == "pending"]
    random.Random(0).shuffle(order)
    t1 = time.perf_counter()
    for row, sched in order:
        try:
            r = measure.measure_shape(args.op, measure.rewy_op_fn(args.op, args.policy, sched),
                                      fla if fla_ms is None else None, shape)
            row["status"], row["median_ms"] = "ok", r.ours.median
            if fla_ms is None:
                fla_ms = r.fla.median
        except Exception as exc:  # noqa: BLE001 - a combination that fails is recorded, the table goes on
            row["status"], row["message"] = "runtime_error", f"{type(exc).__name__}: {str(exc)[:200]}"
    bench_s = time.perf_counter() - t1
    default_params = {n: value_of(base, n) for n in names}
    table = {
        "op": args.op, "policy": args.policy, "shape": list(shape), "device": torch.cuda.get_device_name(),
        "command": f"python -P benchmarks/enumerate_space.py --op {args.op} --shape {args.shape}",
        "versions": measure.software_versions(), "fla_ms": fla_ms, "compile_s": compile_s, "bench_s": bench_s,
        "space": space, "results": results,
        "default": default_params if all(default_params[n] in space[n] for n in names) else None,
    }
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    ok = sorted((r for r in results if r["status"] == "ok"), key=lambda r: r["median_ms"])
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"{args.op} {args.policy} {shape}: {len(results)} combinations {counts}; compile {compile_s:.0f} s, "
          f"timing {bench_s:.0f} s; FLA {fla_ms} ms")
    for r in ok[:5] + ok[-2:]:
        print(f"  {r['median_ms']:.4f} ms  {r['params']}")


if __name__ == "__main__":
    main()
