"""Which outputs of dq_stage "separate" change from run to run, and where? (Session 34: beside the reverse scan on
the H200, bf16 policy R at (2, 2048, 16), dk and GDN's dg differed from the in-order run; in order every run repeated
its bits, and so did the query-side stage called alone.)

    python benchmarks/query_side_race.py [--runs 8]
    python benchmarks/query_side_race.py --ranges 2 [--shape 1,8152,16]


Per operator: the query-side stage alone, run repeatedly (dq and dk's query part against the first run), then the
whole backward in order and beside the scan under both policies (each output: how many runs differ from in-order).
--ranges N (session 36: the stage before explicit consumer ranges, policy A, differed from in-order on the H200):
the in-order run against the ranged one as it runs, with the ranges in order on one stream, with the stage
synchronized on both sides, and without the stage; outputs from torch.empty start as NaN, as in the tests.
Needs a CUDA GPU; reads the test suite's input and schedule helpers (tests/kernels).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["REWY_TEST_NO_INTERPRET"] = "1"  # (before the test helpers are imported: compiled kernels)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels"))

import torch  # noqa: E402

import test_triton_scalar as T  # noqa: E402
from rewy_tune.kernels.reference.chunk_forward import chunk_forward  # noqa: E402
from rewy_tune.gates import poison_allocations  # noqa: E402
from rewy_tune.kernels.triton.query_side import query_side  # noqa: E402


def where(a: torch.Tensor, b: torch.Tensor) -> str:
    """'same', or how many elements differ, by how much, and in which chunks, heads and 16-column groups."""
    bad = a != b
    if not bad.any():
        return "same"
    idx = bad.nonzero()
    return (f"{int(bad.sum())} differ ({int(b.isnan().sum())} NaN) "
            f"(max {(a.float() - b.float()).abs().max().item():.3g}) in chunks "
            f"{sorted(set((idx[:, 1] // 64).tolist()))[:12]} heads {sorted(set(idx[:, 2].tolist()))[:8]} "
            f"columns {sorted(set((idx[:, 3] // 16 * 16).tolist()))[:8]}")


def ranges_check(B: int, Tn: int, H: int, n_ranges: int, runs: int) -> None:
    from rewy_tune.kernels.triton import pipeline

    scan_beside = pipeline._scan_beside_consumer

    def synchronized(launches, streams, gate_made=None, before_ranges=None):
        def stage():
            torch.cuda.synchronize()
            before_ranges()
            torch.cuda.synchronize()
        return scan_beside(launches, streams, gate_made, stage if before_ranges is not None else None)

    variants = {"as it runs": {}, "ranges on one stream": {"chase_streams": lambda device: None},
                "stage synchronized": {"_scan_beside_consumer": synchronized}}
    for op in ("deltanet", "gdn"):
        x = T.make_inputs(op, B, Tn, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=n_ranges, gate_div=1.0)
        s = T._gpu_default().replace(consumer="joint_tma", dq_stage="separate", consumer_ranges=n_ranges,
                                     w_source="forward")
        for stage in ("separate", "consumer"):
            s = s.replace(dq_stage=stage)
            ref = T.run_triton(x, s.replace(side_stream="none", consumer_ranges=1), "A")
            for name, patches in variants.items():
                saved = {k: getattr(pipeline, k) for k in patches}
                for k, v in patches.items():
                    setattr(pipeline, k, v)
                try:
                    outs = [T.run_triton(x, s, "A") for _ in range(runs)]
                finally:
                    for k, v in saved.items():
                        setattr(pipeline, k, v)
                for n in T.NAMES:
                    if ref[n] is not None:
                        print(f"{op} dq_stage {stage} {n_ranges} ranges, {name}, {n}: "
                              f"{[where(ref[n], o[n]) for o in outs]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--shape", default="2,2048,16")
    ap.add_argument("--ranges", type=int, default=0)
    args = ap.parse_args()
    B, Tn, H = (int(v) for v in args.shape.split(","))
    if args.ranges:
        with poison_allocations():  # (as the tests' nan_poison: a tile read before it is written shows as NaN)
            return ranges_check(B, Tn, H, args.ranges, args.runs)
    for op in ("deltanet", "gdn"):
        x = T.make_inputs(op, B, Tn, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=4103, gate_div=1.0)
        scale = 128 ** -0.5
        fwd = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=scale,
                            initial_state=x["h0"], chunk_size=64, save_states=True)
        R = fwd.R.to(x["q"].dtype).contiguous()
        alone = [query_side(x["q"], x["k"], R, fwd.S0.contiguous(), fwd.G if op == "gdn" else None, x["do"],
                            scale=scale) for _ in range(args.runs)]
        for i, name in ((0, "dq"), (1, "dk's query part")):
            print(op, "query side alone,", name, [where(alone[0][i], o[i]) for o in alone[1:]], flush=True)
        s = T._gpu_default().replace(consumer="joint_tma", dq_stage="separate", scan_split_waves=0)
        for policy in ("A", "R"):
            ref = T.run_triton(x, s.replace(side_stream="none"), policy)
            for mode, sched in (("in order", s.replace(side_stream="none")), ("beside", s)):
                diff = {n: 0 for n in T.NAMES if ref[n] is not None}
                first = {}
                for _ in range(args.runs):
                    out = T.run_triton(x, sched, policy)
                    for n in diff:
                        if not torch.equal(ref[n], out[n]):
                            diff[n] += 1
                            first.setdefault(n, where(ref[n], out[n]))
                print(f"{op} {policy} {mode}: runs of {args.runs} that differ from in-order {diff}", flush=True)
                for n, w in first.items():
                    print(f"   {n}: {w}")


if __name__ == "__main__":
    main()
