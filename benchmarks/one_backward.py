"""Run one operator's forward and backward a few times on the GPU with a given schedule: the program to put
under a profiler (`ncu`, `nsys`, `compute-sanitizer`; `STEPS=ncu` in benchmarks/device_check.sh).

    python -P benchmarks/one_backward.py --op kda --shape 1,8192,16 [--policy R] [--schedule FILE] [--reps 3] [--fla]

`--fla` runs FLA's operator (the benchmark's baseline, same policy) instead of ours, so one profiler call can
put both sides' kernels under the same counters.
"""

from __future__ import annotations

import argparse

import torch

from rewy_tune import fla_baseline, measure
from rewy_tune.schedule import Schedule
from rewy_tune.search_spaces import default_schedule


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="kda", choices=["deltanet", "gdn", "kda", "gdn2"])
    p.add_argument("--policy", default="R", choices=["R", "A"])
    p.add_argument("--shape", default="1,8192,16", help="B,T,H (K = V = 128, bf16)")
    p.add_argument("--schedule", default=None, help="a Schedule JSON file (default: the GPU's built-in one)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fla", action="store_true", help="run FLA's operator (the baseline) instead of ours")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("one_backward.py needs a CUDA GPU")
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.schedule:
        with open(args.schedule) as f:
            schedule = Schedule.from_json(f.read())
    else:
        schedule = default_schedule(torch.cuda.get_device_capability(), K=128, V=128, op=args.op, dtype="bf16",
                                    policy=args.policy)
    if args.fla:
        fla_baseline.bypass_hopper_guard()  # timing only, as in the benchmark (FLA issue 640)
        fn, who = fla_baseline.fla_op(args.op, args.policy), "FLA"
    else:
        fn, who = measure.rewy_op_fn(args.op, args.policy, schedule), f"ours, schedule {schedule.to_json()}"
    # One pass before the profiled range: compiling and FLA's autotuning launch the kernels many times, and a
    # profiler started with `--profile-from-start off` (device_check.sh) would otherwise count those launches.
    measure.run_once(args.op, fn, shape)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(args.reps):
        measure.run_once(args.op, fn, shape)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{args.op} {args.policy} {shape}: {args.reps} forward+backward passes; {who}")


if __name__ == "__main__":
    main()
