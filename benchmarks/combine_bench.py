"""Time the segment-combine kernel's pipeline stages on a GPU (issue #4's small shapes; scan.COMBINE_CARRY_STAGES).

    python -P benchmarks/combine_bench.py [--json OUT]

For each (B·H, segments) a split scan launches at the bench shapes, K = V = 128, fp32 transfer matrices and tf32
products (the bf16 pipeline's): the kernel at 1-3 stages (the default since session 22: 2), each replayed as a CUDA
graph of 20 launches, medians of 15 replays, and whether every output equals the one-stage bits. (Session 22 timed the
kernel that re-read the state after a barrier beside it, deleted in session 23: benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from rewy_tune import measure
from rewy_tune.kernels.triton import scan
from rewy_tune.schedule import state_blocks

# (B·H, NS): KDA/GDN2 A at (1, 512, 4) 64-wide reverse scan: 8 programs -> 4 segments of 2 chunks; (1, 4096, 8) and
# (1, 8192, 4): 8 segments; (1, 2048, 16): 4 segments; DeltaNet/GDN at B·H = 4: up to 8
CASES = [(4, 4), (4, 8), (8, 8), (16, 4)]
K = V = 128


def _launch(stages, X, first, h_in, NS):
    KB, NB = state_blocks(K)
    scan.rewy_segment_combine_carry_kernel[(triton.cdiv(V, scan.COMBINE_BV), h_in.shape[0])](
        X, first, h_in, H=h_in.shape[0], K=K, V=V, VP=V, NS=NS, KB=KB, NB=NB, BV=scan.COMBINE_BV,
        USE_FIRST=True, REVERSE=True, PREC="tf32", num_warps=4, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("combine_bench.py needs a CUDA GPU")
    variants = [(f"carry-s{n}", n) for n in (1, 2, 3)]
    rows = []
    print(f"{'B*H':>4} {'NS':>3} " + " ".join(f"{n:>12}" for n, _ in variants) + "   (µs per launch; = bits)")
    for bh, ns in CASES:
        gen = torch.Generator(device="cuda").manual_seed(bh * 10 + ns)
        X = torch.randn(bh, ns, K, V + K, device="cuda", generator=gen) * 0.05
        first = torch.randn(bh, K, V, device="cuda", generator=gen)
        ref = None
        cells, row = [], {"bh": bh, "ns": ns}
        for name, stages in variants:
            h_in = torch.full((bh, ns, K, V), float("nan"), device="cuda")
            try:
                us = measure.launch_time_us(lambda: _launch(stages, X, first, h_in, ns), launches=20)
            except Exception as exc:  # noqa: BLE001 - e.g. shared memory over the device's limit: recorded
                cells.append(f"{'failed':>12}")
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            same = ref is None or torch.equal(h_in, ref)
            ref = h_in.clone() if ref is None else ref
            cells.append(f"{us:>10.2f} {'=' if same else '!'}")
            row[name] = {"us": us, "same_bits": same}
        rows.append(row)
        print(f"{bh:>4} {ns:>3} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"K": K, "V": V, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
