"""Time the reverse state scan alone on a GPU, per chunk step, against FLA's reverse scan on the same inputs.

    python -P benchmarks/scan_bench.py [--json OUT] [--jobs 14] [--only deltanet,gdn] [--heads 4 16 32]
                                       [--no-combine]

Why: in the policy-A KDA/GDN2 backward the reverse scan (unsplit, 64-wide state tiles) took about 3.7 µs per chunk
step on the H200 (session 31: 119 µs for 32 chunks at (1, 2048, 16)), where FLA's own reverse scan, fed the same
gated operands, takes about 1.5 µs (fla-baseline.md §14: 188 µs for 128 chunks). This times one launch of the scan
(CUDA graph of 10 launches, medians of 15 replays) over state-tile widths, warps, pipeline stages, the per-chunk
state's storage dtype and dv_local formed in the scan or read, at B·H = 4 and 16 and T = 2048, K = V = 128, bf16,
unsplit (one program per state tile for the whole sequence). Also the DeltaNet and GDN scans (no gate, scalar gate),
in both state layouts (Schedule.reverse_scan_layout), beside FLA's on the same inputs, and the segment combine at
several warp counts. Every configuration is compiled ahead in worker processes (one launch at a small
shape each) so that the timing process only loads binaries.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp

import torch

K = V = 128
C = 64
T = 2048
HEADS = (4, 16)
# (name, gate, BV, warps, stages, state dtype, dv_local in the scan[, options]): options a tuple of (name, value),
# ("early", False) for scan.EARLY_GATE_ROW off, ("layout", "vk") for the transposed state
# (Schedule.reverse_scan_layout), ("rows", 128) for state_rows=128 (Schedule.scan_state_rows: one 128-row state block
# at K = 128), ("ahead", True) for qdo="ahead" (Schedule.reverse_scan_qdo "ahead": DeltaNet's Qᵀ dO formed a step
# ahead), ("qk", True) for dv_local formed in the scan from q and k (dv_local_from_qk).
# The KDA/GDN2 policy-A default (session 32's, with fp32 states) first; session 33's first call timed these before
# EARLY_GATE_ROW
LATE = (("early", False),)
VK = (("layout", "vk"),)
ROWS128 = (("rows", 128),)
AHEAD = (("ahead", True),)
ROWS128_AHEAD = (("rows", 128), ("ahead", True))
QK = (("qk", True),)  # dv_local formed in the scan from q and k (Schedule.dv_local_source "scan"; no gate, scalar)
SCANS = [
    ("kda-A default", "kda", 64, 4, 3, "fp32", True),
    ("kda-A late G_n", "kda", 64, 4, 3, "fp32", True, LATE),
    ("kda-A bf16 late G_n", "kda", 64, 4, 3, "bf16", True, LATE),
    ("kda-A BV32 bf16 late G_n", "kda", 32, 4, 3, "bf16", True, LATE),
    ("kda-A bf16 states", "kda", 64, 4, 3, "bf16", True),
    ("kda-A 8 warps", "kda", 64, 8, 3, "fp32", True),
    ("kda-A 2 stages", "kda", 64, 4, 2, "fp32", True),
    ("kda-A dvl read", "kda", 64, 4, 3, "fp32", False),
    ("kda-A BV32", "kda", 32, 4, 3, "fp32", True),
    ("kda-A BV32 s2", "kda", 32, 4, 2, "fp32", True),
    ("kda-A BV32 bf16", "kda", 32, 4, 3, "bf16", True),
    ("kda-A BV32 dvl read", "kda", 32, 4, 3, "fp32", False),
    ("kda-A BV32 bf16 read", "kda", 32, 4, 3, "bf16", False),
    ("kda-A BV16", "kda", 16, 4, 3, "fp32", True),
    ("deltanet BV32 bf16", "none", 32, 4, 3, "bf16", False),
    ("deltanet BV64 bf16", "none", 64, 4, 3, "bf16", False),
    ("deltanet BV32 fp32", "none", 32, 4, 3, "fp32", False),
    # session 35: the transposed state (rewy_bwd_scan_vk_kernel), DeltaNet and GDN (scalar gate)
    ("deltanet vk BV64 bf16", "none", 64, 4, 3, "bf16", False, VK),
    ("deltanet vk BV64 s2", "none", 64, 4, 2, "bf16", False, VK),
    ("deltanet vk BV64 8 warps", "none", 64, 8, 3, "bf16", False, VK),
    ("deltanet vk BV32 bf16", "none", 32, 4, 3, "bf16", False, VK),
    ("gdn BV32 bf16", "gdn", 32, 4, 3, "bf16", False),
    ("gdn vk BV64 bf16", "gdn", 64, 4, 3, "bf16", False, VK),
    # session 37: the state in one 128-row register block (three products a chunk step instead of six), and 16-wide
    # value tiles (twice the programs: 128 at B·H = 16)
    ("deltanet rows128 BV32 bf16", "none", 32, 4, 3, "bf16", False, ROWS128),
    ("deltanet rows128 BV32 s2", "none", 32, 4, 2, "bf16", False, ROWS128),
    ("deltanet rows128 BV64 bf16", "none", 64, 4, 3, "bf16", False, ROWS128),
    ("deltanet rows128 BV16 bf16", "none", 16, 4, 3, "bf16", False, ROWS128),
    ("deltanet rows128 BV32 w8", "none", 32, 8, 3, "bf16", False, ROWS128),
    ("deltanet rows128 BV16 w8", "none", 16, 8, 3, "bf16", False, ROWS128),
    ("deltanet BV16 bf16", "none", 16, 4, 3, "bf16", False),
    ("gdn rows128 BV32 bf16", "gdn", 32, 4, 3, "bf16", False, ROWS128),
    ("kda-A rows128 bf16 states", "kda", 64, 4, 3, "bf16", True, ROWS128),
    ("kda-A rows128 BV32 bf16", "kda", 32, 4, 3, "bf16", True, ROWS128),
    # session 37: DeltaNet's Qᵀ dO formed a step ahead (reverse_scan_qdo "ahead"), alone and with the 128-row block
    ("deltanet ahead BV32 bf16", "none", 32, 4, 3, "bf16", False, AHEAD),
    ("deltanet rows128 ahead BV32", "none", 32, 4, 3, "bf16", False, ROWS128_AHEAD),
    ("deltanet rows128 ahead BV16", "none", 16, 4, 3, "bf16", False, ROWS128_AHEAD),
    ("deltanet rows128 ahead BV32 s2", "none", 32, 4, 2, "bf16", False, ROWS128_AHEAD),
    ("deltanet rows128 ahead BV32 w8", "none", 32, 8, 3, "bf16", False, ROWS128_AHEAD),
    ("deltanet rows128 ahead BV16 w8", "none", 16, 8, 3, "bf16", False, ROWS128_AHEAD),
    # dv_local formed in the scan (no dv_local stage before it): as session 36 timed it, and a step ahead (its
    # products waited for at the step's end; 3 stages of its tiles exceed the H200's shared memory)
    ("deltanet qk BV32", "none", 32, 4, 3, "bf16", False, QK),
    ("deltanet qk rows128 ahead BV32 s2", "none", 32, 4, 2, "bf16", False, QK + ROWS128_AHEAD),
    ("deltanet qk rows128 ahead BV16 s2", "none", 16, 4, 2, "bf16", False, QK + ROWS128_AHEAD),
]
COMBINE_WARPS = (1, 2, 4, 8)
COMBINE_CASES = ((4, 4), (4, 8))  # (B·H, segments)


def _inputs(BH: int, T_: int, gate: str, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, H = 1, BH

    def rn(*s, dtype=torch.bfloat16, scale=0.05):
        return (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)
    x = dict(q=rn(B, T_, H, K), k=rn(B, T_, H, K), W=rn(B, T_, H, K), do=rn(B, T_, H, V),
             dvl=rn(B, T_, H, V), aqk=rn(B, T_, H, C), dht=rn(B, H, K, V, dtype=torch.float32, scale=1.0))
    if gate == "kda":  # fla-core's gate cumsum in log2 units: decreasing within each chunk, small
        step = -torch.rand(B, T_, H, K, device="cuda", generator=g) * 0.02
        x["G"] = step.view(B, T_ // C, C, H, K).cumsum(2).view(B, T_, H, K).contiguous()
    elif gate == "gdn":  # a scalar gate's chunk cumsum (natural log)
        step = -torch.rand(B, T_, H, device="cuda", generator=g) * 0.02
        x["G"] = step.view(B, T_ // C, C, H).cumsum(2).view(B, T_, H).contiguous()
    else:
        x["G"] = None
    return x


def _scan_fn(cfg, x):
    from rewy_tune.kernels.triton import scan

    _, gate, BV, warps, stages, state, in_scan, *opts = cfg
    opts = dict(opts[0]) if opts else {}
    kw = dict(scale=K ** -0.5, chunk_size=C, BK=K, BV=BV, num_warps=warps, num_stages=stages,
              state_dtype=torch.float32 if state == "fp32" else torch.bfloat16, num_segments=1,
              layout=opts.get("layout", "kv"), dv_local_from_qk=opts.get("qk", False),
              state_rows=opts.get("rows", 64), qdo="ahead" if opts.get("ahead", False) else "in_step")
    if gate == "kda":
        kw.update(pregated=True, q_scaled=False, gate_log2=True)
    dvl, aqk = (None, x["aqk"]) if in_scan else (None, None) if kw["dv_local_from_qk"] else (x["dvl"], None)

    def fn():  # (the flag is read at launch time)
        scan.EARLY_GATE_ROW = opts.get("early", True)
        return scan.reverse_state_scan(x["q"], x["k"], x["W"], x["G"], x["do"], dvl, x["dht"], aqk=aqk, **kw)
    return fn


def _combine_fn(warps, bh, ns, gen_seed=0):
    import triton

    from rewy_tune.kernels.triton import scan
    from rewy_tune.schedule import state_blocks

    g = torch.Generator(device="cuda").manual_seed(gen_seed + bh * 10 + ns)
    X = torch.randn(bh, ns, K, V + K, device="cuda", generator=g) * 0.05
    first = torch.randn(bh, K, V, device="cuda", generator=g)
    h_in = torch.full((bh, ns, K, V), float("nan"), device="cuda")
    KB, NB = state_blocks(K)

    def fn():
        scan.rewy_segment_combine_carry_kernel[(triton.cdiv(V, scan.COMBINE_BV), bh)](
            X, first, h_in, H=bh, K=K, V=V, VP=V, NS=ns, KB=KB, NB=NB, BV=scan.COMBINE_BV, USE_FIRST=True,
            REVERSE=True, PREC="tf32", num_warps=warps, num_stages=scan.combine_carry_stages(K, h_in.device))
    return fn, h_in


def _fla_fn(x, gate="kda"):
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu

    gates = {"kda": dict(gk=x["G"]), "gdn": dict(g=x["G"]), "none": {}}[gate]
    return lambda: chunk_gated_delta_rule_bwd_dhu(q=x["q"], k=x["k"], w=x["W"], do=x["do"], dv=x["dvl"],
                                                  dht=x["dht"], scale=K ** -0.5, chunk_size=C, **gates)


def _compile_one(job) -> str:
    """Worker: one launch at a small shape, so Triton's cache holds the binary (T, H are not specialized on)."""
    kind, arg = job
    try:
        if kind == "scan":
            _scan_fn(arg, _inputs(4, 128, arg[1]))()
        elif kind == "combine":
            _combine_fn(*arg)[0]()
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the timing process
        return f"{type(exc).__name__}: {exc}"[:200]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--jobs", type=int, default=14)
    p.add_argument("--only", default=None, metavar="WORDS",
                   help="comma-separated words: only the configurations whose name contains one, an underscore "
                        "standing for a space (e.g. rows128,kda-A_bf16_states); FLA's rows stay")
    p.add_argument("--heads", type=int, nargs="+", default=list(HEADS), help="the B·H values (default: 4 16)")
    p.add_argument("--no-combine", action="store_true", help="skip the segment combine's timings")
    args = p.parse_args()
    words = [w.replace("_", " ") for w in args.only.split(",")] if args.only else None
    scans = [c for c in SCANS if words is None or any(w in c[0] for w in words)]
    if not scans:
        raise SystemExit(f"--only {args.only!r} matches no configuration's name (see SCANS in this file)")
    if not torch.cuda.is_available():
        raise SystemExit("scan_bench.py needs a CUDA GPU")
    from rewy_tune import fla_baseline, measure

    fla_baseline.autotune_here()
    combines = () if args.no_combine else COMBINE_CASES
    jobs = [("scan", c) for c in scans] + [("combine", (w, bh, ns)) for w in COMBINE_WARPS for bh, ns in combines]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        compiled = dict(zip([j[1] for j in jobs], pool.map(_compile_one, jobs)))
    out = {"scan": {}, "combine": {}}
    NT = T // C
    for BH in args.heads:
        print(f"== reverse scan, B·H = {BH}, T = {T} ({NT} chunks), unsplit: µs per launch, per chunk step")
        xs = {gate: _inputs(BH, T, gate) for gate in ("kda", "gdn", "none")}
        rows = [("FLA dhu (gated q, k, gk)", lambda: _fla_fn(xs["kda"])),
                ("FLA dhu (DeltaNet)", lambda: _fla_fn(xs["none"], "none")),
                ("FLA dhu (GDN g)", lambda: _fla_fn(xs["gdn"], "gdn"))]
        rows += [(c[0], (lambda c=c: _scan_fn(c, xs[c[1]]))) for c in scans if compiled[c] == "ok"]
        for c in scans:
            if compiled[c] != "ok":
                print(f"   {c[0]:26s} not compiled: {compiled[c]}")
        for name, make in rows:
            try:
                us = measure.launch_time_us(make())
            except Exception as exc:  # noqa: BLE001 - one failing configuration does not end the run
                print(f"   {name:26s} FAILED {type(exc).__name__}: {str(exc)[:120]}")
                continue
            out["scan"].setdefault(name, {})[BH] = us
            print(f"   {name:26s} {us:8.1f} µs  {us / NT:6.2f} µs/step")
    print("== segment combine (tf32, 16-wide value tiles): µs per launch")
    for bh, ns in combines:
        ref = None
        for w in COMBINE_WARPS:
            if compiled[(w, bh, ns)] != "ok":
                print(f"   B·H {bh} NS {ns} warps {w}: not compiled: {compiled[(w, bh, ns)]}")
                continue
            fn, h_in = _combine_fn(w, bh, ns)
            us = measure.launch_time_us(fn)
            same = ref is None or torch.allclose(h_in, ref, rtol=1e-3, atol=1e-3)
            ref = h_in.clone() if ref is None else ref
            out["combine"][f"{bh},{ns},{w}"] = us
            print(f"   B·H {bh} NS {ns} warps {w}: {us:6.2f} µs {'' if same else '(differs from 1 warp!)'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
