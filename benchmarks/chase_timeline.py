"""When does each kernel of one backward start and end, replayed in a CUDA graph? (Session 32: the consumer
chasing the reverse scan ran no faster than after it; this shows whether it started before the scan ended.)

    python benchmarks/chase_timeline.py --op deltanet --policy A --shape 1,2048,16 [--chase] [--set FIELD=VALUE]
                                        [--flag MODULE.NAME=INT]

Prints, per kernel of the third of three profiled replays, its start and end in µs from the first kernel's start.
"""

from __future__ import annotations

import argparse

import torch

from rewy_tune import fla_baseline, measure
from rewy_tune.cli import bench
from rewy_tune.kernels.triton import pipeline
from rewy_tune.kernels.triton.flags import flag_home, parse_flag
from rewy_tune.search_spaces import default_schedule


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="deltanet")
    ap.add_argument("--policy", default="A")
    ap.add_argument("--shape", default="1,2048,16")
    ap.add_argument("--chase", action="store_true", help="pipeline.CONSUMER_CHASES_SCAN on")
    ap.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE",
                    help="change the default schedule (as rewy-tune bench --set)")
    ap.add_argument("--flag", action="append", default=None, metavar="MODULE.NAME=INT",
                    help="set a kernels/triton module flag (as profile_stages' flag variants), e.g. "
                         "pipeline.CONSUMER_CHASES_SCAN=1")
    args = ap.parse_args()
    for item in args.flag or ():  # (held for the process)
        try:
            key, value = parse_flag(item)
        except ValueError as err:
            raise SystemExit(f"--flag {err}") from None
        setattr(*flag_home(key), value)
    fla_baseline.bypass_hopper_guard()
    pipeline.CONSUMER_CHASES_SCAN = args.chase
    shape = tuple(int(x) for x in args.shape.split(","))
    sched = bench.apply_overrides(default_schedule(torch.cuda.get_device_capability(), op=args.op,
                                                   policy=args.policy), bench.parse_overrides(args.set))
    side = measure._Side(args.op, measure.rewy_op_fn(args.op, args.policy, sched),
                         measure.bench_inputs(args.op, shape, 128, 128, "cuda"))
    side.capture(fwd_bwd=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            side.bwd_graph.replay()
            torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    last = kernels[-len(kernels) // 3:]
    t0 = last[0].time_range.start
    for e in last:
        print(f"{e.time_range.start - t0:8.1f} {e.time_range.end - t0:8.1f}  {e.name[:60]}")


if __name__ == "__main__":
    main()
