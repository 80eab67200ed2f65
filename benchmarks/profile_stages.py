"""Per-stage device time of our backward (torch.profiler), and a sweep of schedule variants against FLA.

    python -P benchmarks/profile_stages.py --op gdn --shapes 1,8192,4 1,8192,16

Kernel names map to stages (rewy_* kernels of kernels/triton). Timing of variants uses the project's
measurement module (CUDA-graph replay, interleaved with FLA). Prints a short table per shape.
"""

from __future__ import annotations

import argparse
import collections

import torch

from rewy_tune import fla_baseline, measure
from rewy_tune.search_spaces import default_schedule


def kernel_times(op, policy, schedule, shape, K=128, V=128, reps=5):
    inputs = measure.bench_inputs(op, shape, K, V, "cuda")
    side = measure._Side(op, measure.rewy_op_fn(op, policy, schedule), inputs)
    for _ in range(2):
        side.forward()
        side.backward()
    torch.cuda.synchronize()
    side.forward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            side.backward()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:48]] += ev.device_time / 1e3 / reps
    return totals


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gdn")
    p.add_argument("--policy", default="R")
    p.add_argument("--shapes", nargs="+", default=["1,8192,4", "1,8192,16"])
    args = p.parse_args()
    fla_baseline.bypass_hopper_guard()
    base = default_schedule(torch.cuda.get_device_capability(), K=128, V=128)
    variants = {
        "default": base,
        "state=input": base.replace(state_dtype="input"),
        "seg4": base.replace(forward_scan_segments=4, reverse_scan_segments=4),
        "seg8": base.replace(forward_scan_segments=8, reverse_scan_segments=8),
        "scanBV32": base.replace(forward_scan={"block_v": 32}, reverse_scan={"block_v": 32}),
        "scanBV32w2": base.replace(forward_scan={"block_v": 32, "num_warps": 2}, reverse_scan={"block_v": 32, "num_warps": 2}),
        "scanBV16": base.replace(forward_scan={"block_v": 16}, reverse_scan={"block_v": 16}),
        "cons_w4": base.replace(consumer_cfg={"num_warps": 4}),
        "cons_BV128": base.replace(consumer_cfg={"block_v": 128}),
        "separate": base.replace(consumer="separate"),
    }
    fla = fla_baseline.fla_op(args.op, args.policy)
    for s in args.shapes:
        shape = tuple(int(x) for x in s.split(","))
        print(f"== {args.op} {args.policy} {shape}: per-kernel ms (default schedule)")
        for name, ms in kernel_times(args.op, args.policy, base, shape).most_common(14):
            print(f"   {ms:8.4f}  {name}")
        for vname, sched in variants.items():
            try:
                r = measure.measure_shape(args.op, measure.rewy_op_fn(args.op, args.policy, sched), fla, shape,
                                          rounds=30)
                print(f"   {vname:12s} ours {r.ours.median:.4f} ms  FLA {r.fla.median:.4f} ms  "
                      f"FLA/ours {r.speedup:.3f}  peak {r.ours.peak_backward_mib:.0f}/{r.fla.peak_backward_mib:.0f} MiB")
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
                print(f"   {vname:12s} FAILED {type(exc).__name__}: {str(exc)[:120]}")


if __name__ == "__main__":
    main()
