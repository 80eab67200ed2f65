"""Static sm_90 figures of FLA's forward state kernel, to set beside ours at equal settings.

    python benchmarks/fla_scan_sass.py --block-v 16 --warps 4 --stages 2 [--gated] [--sass-dump DIR]

Compiles fla-core's `chunk_gated_delta_rule_fwd_kernel_h_blockdim64` (K = V = 128, chunk 64, bf16, 16-byte aligned
pointers as a GPU launch specializes) for sm_90 on a CPU and prints shared memory, registers, stack and the SASS
opcode mix, like `compile_times.py --sass rewy_fwd_scan_kernel` prints ours. Session 13 used it to find that our
loop staged a negated state copy that FLA's does not (RESULTS.md). FLA's source is read here, not copied.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path


def _compile_times():
    spec = importlib.util.spec_from_file_location("compile_times", Path(__file__).with_name("compile_times.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-v", type=int, default=16)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--gated", action="store_true", help="with GDN's scalar gate (g); default: DeltaNet (no gate)")
    ap.add_argument("--sass-dump", metavar="DIR", help="also write the whole nvdisasm listing there")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # before FLA's kernels are defined: compiled, not interpreted
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as kernel

    while not hasattr(kernel, "constexprs"):  # past FLA's autotuner and heuristics wrappers
        kernel = kernel.fn
    ct = _compile_times()
    ptr = ("ptr", "bf16")
    values = {"k": ptr, "v": ptr, "w": ptr, "v_new": ptr, "h": ptr, "T": ("int", 2048),
              "g": ("ptr", "fp32") if args.gated else ("none", None)}
    values.update((n, ("const", v)) for n, v in dict(
        H=16, HV=16, K=128, V=128, BT=64, BV=args.block_v, USE_G=args.gated, USE_GK=False, USE_INITIAL_STATE=False,
        STORE_FINAL_STATE=False, SAVE_NEW_VALUE=True, STATE_V_FIRST=False, IS_VARLEN=False).items())
    opts = {"num_warps": args.warps, "num_stages": args.stages}
    c = ct.compile_sm90(kernel, *ct.sm90_signature(kernel, values), opts)
    cubin = c.asm["cubin"]
    print(f"FLA forward state kernel BV {args.block_v}, {args.warps} warps, {args.stages} stages, "
          f"{'gated' if args.gated else 'no gate'}: shared {c.metadata.shared} B  {ct._resource_usage(cubin)}")
    if args.sass_dump:
        os.environ["SASS_DUMP"] = args.sass_dump
    ct.print_sass(f"fla_fwd_h-bv{args.block_v}", opts, cubin)


if __name__ == "__main__":
    main()
