"""Run one operator's forward and backward a few times on the GPU with a given schedule: the program to put
under a profiler (`ncu`, `nsys`, `compute-sanitizer`; `STEPS=ncu` in benchmarks/device_check.sh).

    python -P benchmarks/one_backward.py --op kda --shape 1,8192,16 [--policy R] [--schedule FILE] [--reps 3]
"""

from __future__ import annotations

import argparse

import torch

from rewy_tune import measure
from rewy_tune.schedule import Schedule
from rewy_tune.search_spaces import default_schedule


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="kda", choices=["deltanet", "gdn", "kda", "gdn2"])
    p.add_argument("--policy", default="R", choices=["R", "A"])
    p.add_argument("--shape", default="1,8192,16", help="B,T,H (K = V = 128, bf16)")
    p.add_argument("--schedule", default=None, help="a Schedule JSON file (default: the GPU's built-in one)")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("one_backward.py needs a CUDA GPU")
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.schedule:
        with open(args.schedule) as f:
            schedule = Schedule.from_json(f.read())
    else:
        schedule = default_schedule(torch.cuda.get_device_capability(), K=128, V=128, op=args.op, dtype="bf16")
    for _ in range(args.reps):
        measure.run_once(args.op, measure.rewy_op_fn(args.op, args.policy, schedule), shape)
    print(f"{args.op} {args.policy} {shape}: {args.reps} forward+backward passes; schedule {schedule.to_json()}")


if __name__ == "__main__":
    main()
