"""Does a programmatic dependent launch (PDL) start before its primary grid ends, on this GPU, eagerly and in a CUDA
graph? Session 32's chasing consumer (pipeline.CONSUMER_CHASES_SCAN) ran no faster than after the scan, as if it
were launched only once the scan had ended; this separates PDL itself from the kernels.

    python benchmarks/pdl_check.py

A primary grid of 64 programs spins for about 50 µs (global timer) after griddepcontrol.launch_dependents; the
secondary, launched with launch_pdl, records the time its programs start. Printed: the secondary's first start
relative to the primary's last end (negative: it overlapped), eager and replayed in a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _primary(stamps, SPIN_NS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t0 = tl.extra.cuda.globaltimer()
    t = t0
    while t - t0 < SPIN_NS:
        t = tl.extra.cuda.globaltimer()
    tl.store(stamps + tl.program_id(0), t)


@triton.jit
def _secondary(stamps, PDL: tl.constexpr):
    tl.store(stamps + tl.program_id(0), tl.extra.cuda.globaltimer())
    if PDL:
        tl.extra.cuda.gdc_wait()


def run(pdl: bool, graph: bool) -> float:
    ends = torch.zeros(64, dtype=torch.int64, device="cuda")
    starts = torch.zeros(64, dtype=torch.int64, device="cuda")

    def launch():
        _primary[(64,)](ends, SPIN_NS=50_000, PDL=pdl)
        _secondary[(64,)](starts, PDL=pdl, launch_pdl=pdl)

    launch()  # compile
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch()
        g.replay()
    else:
        launch()
    torch.cuda.synchronize()
    return (starts.min().item() - ends.max().item()) / 1000.0


def main() -> None:
    for graph in (False, True):
        for pdl in (False, True):
            print(f"{'graph' if graph else 'eager':5s} pdl={pdl!s:5s}: secondary's first start - primary's last end "
                  f"= {run(pdl, graph):+8.1f} µs")


if __name__ == "__main__":
    main()
