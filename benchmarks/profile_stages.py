"""Per-stage device time of our backward (torch.profiler), and a sweep of schedule variants against FLA.

    python -P benchmarks/profile_stages.py --op gdn --shapes 1,8192,4 1,8192,16
    python -P benchmarks/profile_stages.py --op all --jobs 8 --json sweep.json   # every operator, compiled ahead

Kernel names map to stages (rewy_* kernels of kernels/triton). Timing of variants uses the project's
measurement module (CUDA-graph replay, interleaved with FLA). Every variant is compiled ahead in parallel
(`rewy_tune.warmup`) before anything is timed, so the sweep costs one compile round, not one per variant.
Prints a short table per operator and shape; `--json` keeps the medians.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from rewy_tune import autotune_parts, fla_baseline, measure, warmup
from rewy_tune.cli import bench
from rewy_tune.kernels.triton.flags import module_flags
from rewy_tune.search_spaces import constraint, default_schedule

OPS = ("deltanet", "gdn", "kda", "gdn2")

# Variants that set module flags of kernels/triton (vector_local.py's by name, another module's as "module.NAME";
# kernel choices outside the Schedule): name ->
# (flags, changes to the default schedule). Name them in --variants; the flags hold while the variant is profiled and
# measured (a CUDA graph replays what its capture launched), and its kernels compile in this process, not ahead.
# Session 26 timed the three consumer changes of session 25 (then flags) on and made them the default: LAST_ROW_LOAD,
# RANGE_FROM_OPERANDS and Schedule.consumer_v_stages 2. "no-flags" times the consumer without them against it.
FLAG_VARIANTS = {
    "no-last-row": ({"LAST_ROW_LOAD": False}, {}),
    "no-range-in": ({"RANGE_FROM_OPERANDS": False}, {}),
    "no-flags": ({"LAST_ROW_LOAD": False, "RANGE_FROM_OPERANDS": False}, {"consumer_v_stages": 1}),
    # session 30: the chunk cumsum in order before dv_local and the scan, against the default (beside them)
    "cumsum-in-order": ({"DEFER_GATE_CUMSUM": False}, {}),
    # session 31 timed the reverse scan forming dv_local = A_qkᵀ dO from the forward's A_qk (no dv_local stage; the
    # policy-A default since then) as "dvl-in-scan"; this times the dv_local stage against it
    "dvl-stage": ({"DV_LOCAL_IN_SCAN": False}, {}),
    # session 32: the consumer chasing the reverse scan in one launch each (DeltaNet/GDN under A)
    "chase": ({"pipeline.CONSUMER_CHASES_SCAN": True}, {}),
    # session 33: the pregated vector scans load the chunk's last gate row where the state update uses it (the
    # default since then loads it at the top of the step), and the per-chunk states in fp32 (the default: bf16)
    "late-gate-row": ({"scan.EARLY_GATE_ROW": False}, {}),
    "late-gate-row-fp32": ({"scan.EARLY_GATE_ROW": False}, {"state_dtype": "fp32"}),
    # session 35: the consumer's ⟨S0, dS1⟩ loop at the top of the feature tile (fewer live tiles; GDN2 A lost 1-4 %
    # per shape with it after the products)
    "rowsum-first": ({"STATE_ROWSUM_FIRST": True}, {}),
}


def variant_flags(name: str):
    """`module_flags` of a flag variant; no flags for any other variant."""
    return module_flags(FLAG_VARIANTS.get(name, ({}, {}))[0])


def kernel_times(op, policy, schedule, shape, K=128, V=128, reps=5, fn=None):
    """Device time per kernel of one backward (ms, mean of `reps`): ours under `schedule`, or `fn` (FLA's op)."""
    inputs = measure.bench_inputs(op, shape, K, V, "cuda")
    side = measure._Side(op, fn or measure.rewy_op_fn(op, policy, schedule), inputs)
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


def variants_for(op: str, base):
    """Named schedule variants around the operator's default: one field group changed at a time."""
    other_states = "fp32" if base.state_dtype == "input" else "input"
    out = {
        "default": base,
        f"state={other_states}": base.replace(state_dtype=other_states),
        "seg4": base.replace(forward_scan_segments=4, reverse_scan_segments=4),
        "seg4/8": base.replace(forward_scan_segments=4, reverse_scan_segments=8),
        "scanBV32": base.replace(forward_scan={"block_v": 32}, reverse_scan={"block_v": 32}),
        "cons_w4": base.replace(consumer_cfg={"num_warps": 4}),
        "separate": base.replace(consumer="separate"),
    }
    if op in ("kda", "gdn2"):
        # Session 7's consumer takes its fp32 intra products in 16-row slices of H and D from an fp32 scratch
        # (no [C, C] register operand). sm_90 cubins read on a CPU (benchmarks/compile_times.py), stack frame per
        # thread at 32 x 128, 8 warps: 2 stages 2 080 B (the old consumer 2 600 B), 1 stage 1 016 B; 32 x 64:
        # 784 B / 248 B; 32 x 32, 1 stage: 208 B. Which of them is fastest is what these measure.
        # Session 7 sweep 1 (KDA (1, 8192, 16), R): 32 x 128 with 2 stages 3.41 ms, 1 stage 2.48; 32 x 64 1 stage
        # 2.54; 64 x 64 1 stage 2.21 (the new default); 4 warps 32 x 64 2.32. Around the new default:
        for name, cfg in (("cons-32x128", {"block_k": 32, "block_v": 128}), ("cons-128x64", {"block_k": 128}),
                          ("cons-64x32", {"block_v": 32}), ("cons-64x128", {"block_v": 128}),
                          ("cons-128x32", {"block_k": 128, "block_v": 32}), ("cons-w4", {"num_warps": 4})):
            out[name] = base.replace(consumer_cfg=cfg)
        # (tf32x3 with bf16 inputs: illegal memory access on the H200 since the sliced consumer; rejected on sm_9x)
        out["fscan-w8"] = base.replace(forward_scan={"num_warps": 8})
        # session 15: two programs per chunk, each over half the feature tiles (32 programs at (1, 512, 4))
        out["cons-k2"] = base.replace(consumer_k_split=2)
        out["cons-k1"] = base.replace(consumer_k_split=1)  # session 17: against the "auto" default (0)
        # session 18: the joint consumer in chunk ranges beside the reverse scan (policy A). The pipeline keeps one
        # launch where the reverse scan splits (under A at B·H = 16 the one-wave rule splits it in 4), so the
        # "rs-unsplit" variants time the ranges against an unsplit scan there (session 27)
        for n in (2, 4, 8):
            out[f"ranges{n}"] = base.replace(consumer_ranges=n)
            out[f"rs-unsplit-ranges{n}"] = base.replace(consumer_ranges=n, reverse_scan_segments=1)
        out["rs-unsplit"] = base.replace(reverse_scan_segments=1)
        out["fscan-bv64"] = base.replace(forward_scan={"block_v": 64})
        # session 16: FLA's KDA scans run 32-wide state tiles with 16-bit states, 12-13 us each at (1, 512, 4)
        # against ours at 128 x 128 / 128 x 64 in fp32, split, 28-32 us. FLA's stages do not fit the vector scans
        # (sm_90 compiles on a CPU: forward at 4 stages 239 104 B, reverse at 3 stages 287 744 B; the H200 has
        # 232 448 B): forward 3 stages (168 960 B), reverse 2 (156 160 B)
        fwd32, rev32 = {"block_v": 32, "num_stages": 3}, {"block_v": 32, "num_stages": 2}
        out["fscan-bv32"] = base.replace(forward_scan=fwd32)
        out["scans-bv32"] = base.replace(forward_scan=fwd32, reverse_scan=rev32)
        out["scans-bv32-bf16"] = base.replace(forward_scan=fwd32, reverse_scan=rev32, state_dtype="input")
        # session 20: KDA's policy-A backward at (1, 4096, 8) took 0.5445 ms where session 10's default took 0.4783.
        # Under A the reverse scan runs alone; at 32 wide the one-wave rule splits it in 4 segments of 16 chunks
        # there, where session 10's 64-wide tiles ran 8 segments of 8 (16 programs each)
        out["rscan-bv64"] = base.replace(reverse_scan={"block_v": 64})
        # session 22: at (1, 512, 4) KDA/GDN2 are still slower than FLA and the consumer's 32 chunk programs run two per
        # chunk (auto). 32-wide feature tiles allow four, 128 programs in one wave of 132 CTAs. Session 23 (R): k4
        # KDA 0.1093 -> 0.0887 ms, GDN2 0.1100 -> 0.0908; k2 0.1043 / 0.1069 (vector_local.AUTO_NARROW_TILES)
        out["cons-32x64-k4"] = base.replace(consumer_cfg={"block_k": 32}, consumer_k_split=4)
        out["cons-32x64-k2"] = base.replace(consumer_cfg={"block_k": 32}, consumer_k_split=2)
        # session 23 sweep (R, (1, 512, 4)): cons-32x64-k4 0.933 -> 1.122x FLA (KDA), unsplit 1.012x; not yet together
        out["cons-32x64-k4-unsplit"] = out["cons-32x64-k4"].replace(forward_scan_segments=1, reverse_scan_segments=1)
        # session 23: ncu of the 8-warp consumer (KDA A (1, 2048, 16)): 255 registers, one CTA (8 warps) per SM, 6.4
        # cycles per issued instruction, most of them waiting on loads (phase 1, the inter V loop) and barriers; the
        # fp32 intra products are 16.5 % of the stall samples. 16 warps: 128 registers (sm_90 compile on a CPU; stack
        # 400 B at 64 x 64, 160 B at 32 x 64), twice the warps per scheduler to hide the same latencies. Timed in
        # session 23 (KDA A): slower at every variant, (1, 2048, 16) 0.4563 -> 0.5424 ms at 64 x 64
        for name, cfg in (("cons-w16", {"num_warps": 16}), ("cons-w16-32x64", {"num_warps": 16, "block_k": 32}),
                          ("cons-w16-32x64-s2", {"num_warps": 16, "block_k": 32, "num_stages": 2}),
                          ("cons-w16-64x32", {"num_warps": 16, "block_v": 32})):
            out[name] = base.replace(consumer_cfg=cfg)
        # session 24: the scans' gated operands K_t, Q_g formed once before them (scan_operands.py), not per chunk
        # step in every program of the serial loop (FLA's KDA hands its reverse scan gated q and k the same way)
        out["pregated"] = base.replace(scan_operands="pregated")
        out["pregated-unsplit"] = out["pregated"].replace(forward_scan_segments=1, reverse_scan_segments=1)
        out["pregated-rscan-bv32"] = out["pregated"].replace(reverse_scan={"block_v": 32})
        # without the fp32 gate tiles the scans fit deeper prefetch (sm_90 compiles on a CPU, K = 128, bf16): reverse
        # 64 wide at 3 stages 204 800 B (inline 304 128), 32 wide 176 128 (279 552); forward 32 wide at 4 stages
        # 151 552 B (inline 239 104: over the H200's 232 448, FLA's pick); registers 215 -> 167 (reverse, 64 wide)
        out["pregated-rscan-s3"] = out["pregated"].replace(reverse_scan={"num_stages": 3})
        out["pregated-fscan-s4"] = out["pregated"].replace(forward_scan={"num_stages": 4})
        # session 25: pregated is the default under both policies; "inline" times the old path against it
        out["inline"] = base.replace(scan_operands="inline")
        # Policy R runs both scans at once (side stream), one CTA of each per SM at most: sm_90 compiles (K = V = 128,
        # bf16, pregated) forward 32 wide at 3 stages 114 688 B + reverse 118 784 B = 233 472 B, the SM's whole
        # 228 KiB with no room for the 1 KiB each CTA reserves. At 2 stages the forward scan takes 77 824 B, so a
        # forward and a reverse CTA can share an SM: at B·H = 32 (2, 2048, 16) their 2 × 128 programs then fit in one
        # wave of the 132 SMs instead of two.
        out["fscan-s2"] = base.replace(forward_scan={"num_stages": 2})
        # session 26: the consumer's two V loops software-pipelined (Schedule.consumer_v_stages, default 2 on the H200)
        out["vloop-s1"] = base.replace(consumer_v_stages=1)
        out["vloop-s3"] = base.replace(consumer_v_stages=3)
        # with the V loops at 2 stages and the flags the 4-warp 32 x 64 consumer compiles to 168 B of stack (sm_90, KDA
        # A; 344 without): two CTAs per SM. Session 26 (A): slower, KDA (1, 2048, 16) 0.3757 -> 0.4148 ms
        out["cons-w4-32x64"] = base.replace(consumer_cfg={"num_warps": 4, "block_k": 32})
        # session 28 (policy A): the scans read the save-all forward's qg, kg (scan_operands "forward": no scan-operands
        # stage, the gate range from the cumsum); dv_local from FLA's Aqk at wider V tiles (the default's 16 x 8 warps
        # was tuned for the recomputed A_qk)
        out["qk-forward"] = base.replace(scan_operands="forward")
        out["dvl-aqk-64"] = base.replace(dv_local={"block_v": 64, "num_warps": 4})
        out["qk-forward-dvl-aqk-64"] = out["qk-forward"].replace(dv_local={"block_v": 64, "num_warps": 4})
        # session 31: the reverse scan's split at B·H <= 8 (policy A splits it in up to 8 segments of >= 2 chunks)
        out["rseg16"] = base.replace(reverse_scan_segments=16)
        out["rseg4"] = base.replace(reverse_scan_segments=4)
        for name in ("seg4", "seg4/8", "scanBV32", "cons_w4", "state=input"):  # no speed gain (session 6)
            out.pop(name, None)  # (since session 33 the default's states are "input": its variant is "state=fp32")
    else:
        # sm_90 cubins read on a CPU (session 6, GDN default): consumer 64 x 64 at 8 warps 1 272 B of stack,
        # 32 x 64 360 B, 32 x 32 184 B; dv_local 320 B at 4 warps, none at 8
        out["cons32x64"] = base.replace(consumer_cfg={"block_k": 32, "block_v": 64})
        out["cons32x32"] = base.replace(consumer_cfg={"block_k": 32, "block_v": 32})
        out["dvl-w8"] = base.replace(dv_local={"num_warps": 8})
        # The joint scalar consumer with 16-bit states compiles to the same PTX at 1, 2 and 3 stages (session 9,
        # sm_90 compile on a CPU), so stage variants of it would time the default's binary again.
        out["cons64x128"] = base.replace(consumer_cfg={"block_v": 128})
        # Session 11: the joint consumer through tensor descriptors (consumer_tma.py); the H200 default since
        # session 12, so the pointer kernel is timed against it. Session 12 call 2, (2, 2048, 16): 4 warps (two CTAs per
        # SM) ran DeltaNet 0.3595 against 0.3739 ms, GDN 0.4681 against 0.4269; 1 stage and 64 x 128 were slower.
        # consumer_order "dq_first" keeps two [C, BK] accumulators live, not three, and column_side "gamma_t" drops
        # the fp32 dk_col round trip. sm_90 with alignment hints: the default spills 112 B for GDN; dq_first at 4
        # warps 232 B (GDN) / 120 B (DeltaNet), at 4 warps with block_k 32 96 B / none; with gamma_t nothing spills
        # (GDN / DeltaNet registers: 8 warps 254 / 214, with dq_first 224 / 167, 4 warps with dq_first 255 / 248).
        # Session 13 (call 2, (2, 2048, 16)): at 8 warps dq_first was 9-14 % slower and gamma_t 2-7 % faster; 4 warps
        # with both ran GDN 0.427 -> 0.340 ms and DeltaNet 0.374 -> 0.310 ms, and became the default. The names below
        # keep their session-12 meaning: each is a change to session 12's consumer ("tma-session12": 8 warps, fused,
        # scratch); a variant equal to the default is dropped at the end.
        s12 = base.replace(consumer="joint_tma", consumer_cfg={"num_warps": 8}, consumer_order="fused",
                           column_side="scratch")
        if base.consumer == "joint_tma":
            out["pointer"] = s12.replace(consumer="joint")
        else:
            out["tma"] = base.replace(consumer="joint_tma")
        out["tma-session12"] = s12
        if base.consumer == "joint_tma":  # session 14: P's tiles kept from phase 1 instead of formed per K tile
            out["tma-p-stored"] = base.replace(p_tiles="stored")
            # session 15: two programs per chunk, each over half the K tiles (32 programs at (1, 512, 4))
            out["tma-k2"] = base.replace(consumer_k_split=2)
            out["tma-k1"] = base.replace(consumer_k_split=1)  # session 17: against the "auto" default (0)
            # session 16: dq and Ḡ's query side in their own stage, beside the side stream's reverse scan; since
            # session 34 dk's query part too (the consumer skips 10 of its 30 tile products and reads no dO or Q)
            out["dq-sep"] = base.replace(dq_stage="separate")
            out["dq-sep-k2"] = base.replace(dq_stage="separate", consumer_k_split=2)
            # session 35: the stage is DeltaNet A's default (this times the consumer's own query side against it), and
            # with an explicit range count the stage runs before the consumer's chunk ranges beside the ranged scan
            out["dq-consumer"] = base.replace(dq_stage="consumer")
            for n in (2, 4, 8):
                out[f"dq-sep-ranges{n}"] = base.replace(dq_stage="separate", consumer_ranges=n)
            # session 18: the consumer in chunk ranges, each beside the reverse scan of the earlier chunks (policy A,
            # or R without the scan beside the forward scan). The scan at 3 stages takes 176 KB of shared memory and
            # the consumer 98 KB: at 2 stages (119 KB) or 1 (25 KB) one of each fits on an SM together.
            for n in (2, 4, 8):
                out[f"ranges{n}"] = base.replace(consumer_ranges=n)
            for st in (1, 2):
                out[f"ranges4-rscan-s{st}"] = base.replace(consumer_ranges=4, reverse_scan={"num_stages": st})
            out["rscan-s2"] = base.replace(reverse_scan={"num_stages": 2})
        # session 36: no dv_local stage (9 µs before DeltaNet A's scan at (1, 2048, 16)): the reverse scan's chunk steps
        # form A_qk from their q, k tiles and dv_local with it, off the state's chain; also at 2 stages (less shared
        # memory: the query-side stage's CTAs beside it) and with the consumer ranges
        out["dvl-scan"] = base.replace(dv_local_source="scan")
        out["dvl-scan-s2"] = base.replace(dv_local_source="scan", reverse_scan={"num_stages": 2})
        out["dvl-scan-bv16"] = base.replace(dv_local_source="scan", reverse_scan={"block_v": 16})
        if base.consumer == "joint_tma":
            out["dvl-scan-ranges4"] = base.replace(dv_local_source="scan", consumer_ranges=4)
        # session 35: the reverse scan's state transposed (dSᵀ: both chained products read it from registers)
        for name, rs in (("rscan-vk64", {"block_v": 64}), ("rscan-vk64-s2", {"block_v": 64, "num_stages": 2}),
                         ("rscan-vk64-w8", {"block_v": 64, "num_warps": 8}), ("rscan-vk32", {"block_v": 32})):
            out[name] = base.replace(reverse_scan_layout="vk", reverse_scan=rs)
        w4, w4k32 = {"num_warps": 4}, {"num_warps": 4, "block_k": 32}
        for name, changes in (("tma-1stage", dict(consumer_cfg={"num_stages": 1})),
                              ("tma-w4", dict(consumer_cfg=w4)),
                              ("tma-w4-1stage", dict(consumer_cfg={"num_warps": 4, "num_stages": 1})),
                              ("tma-64x128", dict(consumer_cfg={"block_v": 128})),
                              ("tma-dq-first", dict(consumer_order="dq_first")),
                              ("tma-w4-dq-first", dict(consumer_order="dq_first", consumer_cfg=w4)),
                              ("tma-w4-dq-first-32x64", dict(consumer_order="dq_first", consumer_cfg=w4k32)),
                              ("tma-gamma-t", dict(column_side="gamma_t")),
                              ("tma-gamma-t-dq-first", dict(column_side="gamma_t", consumer_order="dq_first")),
                              ("tma-w4-gamma-t-dq-first", dict(column_side="gamma_t", consumer_order="dq_first",
                                                               consumer_cfg=w4)),
                              ("tma-w4-gamma-t-dq-first-32x64", dict(column_side="gamma_t", consumer_order="dq_first",
                                                                     consumer_cfg=w4k32))):
            out[name] = s12.replace(**changes)
    # Session 12 (call 3, GDN / DeltaNet (2, 2048, 16)): each scan's value tile and warps on their own, at 2 stages:
    # BV 32 or 64 and 2, 4 or 8 warps were all as slow as or slower than the default's BV 16 (forward 64-114 µs, reverse
    # 73-191 µs, against FLA's 36-40 and 46-73 µs). FLA's autotuner picked BV 32, 4 warps with 4 stages (forward) and
    # 3 (reverse); compiled with a GPU launch's alignment hints the two forward kernels are alike at equal settings.
    # What is left to time is the pipeline depth. Session 13 (call 2): the reverse scan at BV 32, 3 stages ran 77 -> 55 µs
    # (GDN) and 73 -> 50 µs (DeltaNet), now the 16-bit default; the forward scan gained nothing from 3-4 stages or BV 32.
    # Session 14 (call 2), once the forward loop matched FLA's: forward BV 32 with 4 stages 55.8 -> 37.5 µs (DeltaNet),
    # 59.7 -> 43.5 µs (GDN), the 16-bit default since; it made (1, 2048, 16) slower (the split rule now splits it).
    for name, fwd, bwd in (("fscan-s3", {"num_stages": 3}, None), ("fscan-s4", {"num_stages": 4}, None),
                           ("fscan-bv32-s4", {"block_v": 32, "num_stages": 4}, None),
                           ("fscan-bv16-s2", {"block_v": 16, "num_stages": 2}, None),  # session 13's forward scan
                           ("bscan-s3", None, {"num_stages": 3}),
                           ("bscan-bv32-s3", None, {"block_v": 32, "num_stages": 3}),
                           ("bscan-bv16-s2", None, {"block_v": 16, "num_stages": 2}),  # session 12's reverse scan
                           # session 37: at B·H = 16 the 32-wide reverse scan holds 64 of 132 SMs; 16 wide, 128
                           ("bscan-bv16", None, {"block_v": 16}),
                           ("scans-fla", {"block_v": 32, "num_stages": 4}, {"block_v": 32, "num_stages": 3})):
        out[name] = base.replace(**{k: v for k, v in (("forward_scan", fwd), ("reverse_scan", bwd)) if v})
    # session 37's step forms (Schedule.scan_state_rows, reverse_scan_qdo; scan.py), named as absolute forms: from the
    # 64-row, in-step scan ("rows64-in-step", the default through session 37; DeltaNet's since session 38 takes 128
    # rows, and "split" under A). The state (both scans, every gate form) in one 128-row register block at K = 128,
    # three products a reverse chunk step instead of six; also with 16-wide value tiles (twice the programs), 2 stages
    # and 8 warps
    plain = base.replace(scan_state_rows=64, reverse_scan_qdo="in_step")
    out["rows64-in-step"] = plain
    rows128 = plain.replace(scan_state_rows=128)
    out["rows128"] = rows128
    out["rows128-bv16"] = rows128.replace(reverse_scan={"block_v": 16})
    out["rows128-s2"] = rows128.replace(reverse_scan={"num_stages": 2})
    out["rows128-w8"] = rows128.replace(reverse_scan={"num_warps": 8})
    if op == "deltanet":
        # and DeltaNet's Qᵀ dO formed a step ahead (Schedule.reverse_scan_qdo "ahead": its wait deferred to the next
        # step's first product), alone and with the 128-row block (two waited products a step). sm_90 loops: 8 warps
        # 429 instructions a step and 7 CTA barriers, 16-wide tiles 435 and 5, against the 4-warp 32-wide 586 and 9;
        # 2 stages leave room beside a scan CTA for the query-side stage's
        ahead = rows128.replace(reverse_scan_qdo="ahead")
        out["qdo-ahead"] = plain.replace(reverse_scan_qdo="ahead")
        out["rows128-qdo-split"] = rows128.replace(reverse_scan_qdo="split")  # ahead where the reverse scan splits
        out["rows128-qdo-ahead"] = ahead
        out["rows128-qdo-ahead-w8"] = ahead.replace(reverse_scan={"num_warps": 8})
        out["rows128-qdo-ahead-bv16"] = ahead.replace(reverse_scan={"block_v": 16})
        out["rows128-qdo-ahead-s2"] = ahead.replace(reverse_scan={"num_stages": 2})
        # with dv_local formed in the scan a step ahead too (no dv_local stage; 2 stages: 3 exceed the shared memory)
        out["dvl-scan-rows128-qdo-ahead-s2"] = ahead.replace(dv_local_source="scan", reverse_scan={"num_stages": 2})
    # session 39: the reverse scan 16 wide where it runs whole on a small grid (Schedule.reverse_scan_small_grid_block_v;
    # DeltaNet A's default takes it), and without it
    out["small-grid-off"] = base.replace(reverse_scan_small_grid_block_v=0)
    # session 41: the joint_tma consumer's loads outside its pipelined loops where used (the form before), ahead of
    # use, or ahead with phase 2 as one flat loop (Schedule.consumer_loads; DeltaNet A's default takes "flat")
    if base.consumer == "joint_tma":
        for loads in ("at_use", "ahead", "flat"):
            out[f"loads-{loads.replace('_', '-')}"] = base.replace(consumer_loads=loads)
        # session 42: the query-side stage with the flat consumer (its consumer compiles without serialized products;
        # the full consumer's are serialized for want of registers, C7512)
        out["dq-sep-flat"] = base.replace(dq_stage="separate", consumer_loads="flat")
        # session 42: 32-wide V tiles, where the full consumer under R compiles unserialized (its 64-wide tiles: C7512)
        out["cons-bv32"] = base.replace(consumer_cfg={"block_v": 32})
        # session 43: the consumer's own query side (dq in the consumer, S0 read once) at 32-wide V tiles, which
        # compiles unserialized under A too (64 wide: C7512, so session 34's comparison with the query-side stage
        # timed a serialized consumer); "flat" needs the stage, so its loads run "ahead". Session 43 (H100, DeltaNet A
        # at B·H >= 16): 6-19 % slower than the default, as was cons-bv32 (the narrower tiles cost more)
        out["dq-consumer-bv32"] = base.replace(
            dq_stage="consumer", consumer_cfg={"block_v": 32},
            consumer_loads="ahead" if base.consumer_loads == "flat" else base.consumer_loads)
        if base.dq_stage == "separate":
            # session 44: the query-side stage at 32-wide value tiles (24 KB of shared memory against 32): two of its
            # CTAs fit beside a 176 KB reverse-scan CTA on an SM, one at 64 wide (DeltaNet A at B·H >= 16)
            out["qs-bv32"] = base.replace(query_side_block_v=32)
            # session 46: the full consumer as DeltaNet R's default had it before it took the query-side stage (GDN R's
            # still does): dq in the consumer, its tiles loaded where used ("flat" needs the stage)
            out["full-consumer"] = base.replace(dq_stage="consumer", consumer_loads="at_use")
        else:
            # session 42's compile table: with dq in the consumer (GDN R's default), one consumer stage or the fused
            # phase-2 order also compile it without C7512 (255 registers, 48 / 448 B of stack; its default: 40 B)
            out["cons-1stage"] = base.replace(consumer_cfg={"num_stages": 1})
            if base.consumer_order != "fused":
                out["order-fused"] = base.replace(consumer_order="fused")
    out["small-grid-bv16"] = base.replace(reverse_scan_small_grid_block_v=16)
    # Session 9: a split kept only where it pays (scan._segments under scan_split_waves > 0) against no split at all,
    # and a default without that limit (waves 0: always split) under it. Since session 14 the 16-bit DeltaNet/GDN
    # default uses waves 1 (no split at B·H = 16): "waves2" is call 3's behaviour, its A/B.
    out["unsplit"] = base.replace(forward_scan_segments=1, reverse_scan_segments=1)
    # Session 14: with 32-wide forward tiles B·H = 16 gives 64 programs and the rule splits the forward scan, which
    # made (1, 2048, 16) slower; this isolates the forward split (the reverse scan keeps its own)
    out["fscan-unsplit"] = base.replace(forward_scan_segments=1)
    if base.scan_split_waves != 2:
        out["waves2"] = base.replace(scan_split_waves=2)
    # Session 15: stages on a second stream (policy R), on the SMs the scans' grids leave idle (at B·H = 16 each
    # 32-wide 16-bit scan runs 64 programs on 132 SMs, one CTA per SM): dv_local beside the recompute stage and the
    # forward scan; and the reverse scan beside the forward scan as well
    out["side-dvl"] = base.replace(side_stream="dv_local")
    out["side-rscan"] = base.replace(side_stream="reverse_scan")
    # side by side the two scans share the SMs that the split rule gives each one alone: at B·H = 4 the reverse
    # scan's 8 segments (128 programs) beside the forward scan's 64 oversubscribe 132 SMs
    out["side-rscan-rseg4"] = base.replace(side_stream="reverse_scan", reverse_scan_segments=4)
    return {name: s for name, s in out.items() if name == "default" or s != base}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gdn", help="an operator, several comma-separated (one process compiles them all), "
                                                "or 'all'")
    p.add_argument("--policy", default="R")
    p.add_argument("--shapes", nargs="+", default=["1,8192,4", "1,8192,16"])
    p.add_argument("--jobs", type=int, default=None, help="compile-ahead processes (default: warmup's)")
    p.add_argument("--no-profile", action="store_true", help="skip the per-kernel profiles")
    p.add_argument("--profile", default="default",
                   help="comma-separated variants whose per-kernel device times are printed (default: default); "
                        "'fla' prints FLA's kernels")
    p.add_argument("--json", default=None, help="write {op: {variant: {shape: [ours_ms, fla_ms]}}}")
    p.add_argument("--variants", default=None,
                   help="comma-separated variant names to run (default: all); names an operator lacks are skipped")
    p.add_argument("--set", action="append", default=None, metavar="FIELD=VALUE",
                   help="change each operator's default before its variants are formed (as rewy-tune bench --set)")
    args = p.parse_args()
    overrides = bench.parse_overrides(args.set)
    fla_baseline.bypass_hopper_guard()
    fla_baseline.autotune_here()  # FLA's picks are timed here, on an idle GPU, not read from the disk cache
    ops = OPS if args.op == "all" else tuple(args.op.split(","))
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    cc = torch.cuda.get_device_capability()
    plan = {op: variants_for(op, bench.apply_overrides(default_schedule(cc, K=128, V=128, op=op, policy=args.policy),
                                                          overrides))
            for op in ops}
    dims = {"K": 128, "V": 128, "dtype": "bf16", "compute_capability": cc}
    if args.variants:
        keep = {"default", *args.variants.split(",")}
        plan = {op: {n: s for n, s in variants.items() if n in keep} for op, variants in plan.items()}
        for op in ops:  # (a flag of a module the operator does not run times its default; a variant whose schedule
            # changes the operator does not take, e.g. a scalar-gate field for KDA, is left out)
            for n in sorted(keep & FLAG_VARIANTS.keys()):
                sched = plan[op]["default"].replace(**FLAG_VARIANTS[n][1])
                if not [r for r in constraint(sched, dims, op=op) if "shared memory" not in r]:
                    plan[op][n] = sched
    for op in ops:  # a variant over the shared-memory limit would only fail its compile (spill estimates still run)
        for name, sched in list(plan[op].items()):
            smem = [r for r in constraint(sched, dims, op=op) if "shared memory" in r]
            if smem:
                del plan[op][name]
                print(f"   {op} {name}: not run, {smem[0]}")
    # flag variants compile when measured, in this process (their flags are set there only)
    warmed = [(op, name) for op in ops for name in plan[op] if name not in FLAG_VARIANTS]
    tasks = [warmup.WarmTask(op, args.policy, plan[op][name].to_dict(), shapes) for op, name in warmed]
    # A variant that fails in its warm-up process (each runs in its own) is not run here: an illegal memory
    # access would poison this process's CUDA context and fail every variant after it (session 7's sweep).
    broken = {}
    for (op, name), r in zip(warmed, warmup.warm(tasks, jobs=args.jobs)):
        if r.status != "ok":
            broken[(op, name)] = r.status
            print(f"   warm {op} {name} failed ({r.status}): {(r.message or '')[:160]}")
    table: dict = {}
    for op in ops:
        fla = fla_baseline.fla_op(op, args.policy)
        for shape in shapes:
            print(f"== {op} {args.policy} {shape}")
            for pname in ([] if args.no_profile else args.profile.split(",")):
                if pname == "fla":
                    times = kernel_times(op, args.policy, None, shape, fn=fla)
                    for tuner in autotune_parts.autotuners():  # FLA's own picks at this shape
                        for key, cfg in tuner.cache.items():
                            print(f"   FLA pick {tuner.base_fn.__name__[:44]} {key[:6]}: {cfg}")
                elif pname not in plan[op] or (op, pname) in broken:
                    continue
                else:
                    with variant_flags(pname):
                        times = kernel_times(op, args.policy, plan[op][pname], shape)
                print(f"   per kernel, {pname}: total {sum(times.values()):.4f}")
                for name, ms in times.most_common(12):
                    print(f"   {ms:8.4f}  {name}")
            for vname, sched in plan[op].items():
                if (op, vname) in broken:
                    print(f"   {vname:18s} SKIPPED: failed in its warm-up process ({broken[op, vname]})")
                    continue
                try:
                    with variant_flags(vname):
                        r = measure.measure_shape(op, measure.rewy_op_fn(op, args.policy, sched), fla, shape,
                                                  rounds=30)
                    table.setdefault(op, {}).setdefault(vname, {})[",".join(map(str, shape))] = [
                        r.ours.median, r.fla.median]
                    print(f"   {vname:18s} ours {r.ours.median:.4f} ms  FLA {r.fla.median:.4f} ms  "
                          f"FLA/ours {r.speedup:.3f}  peak {r.ours.peak_backward_mib:.0f}/"
                          f"{r.fla.peak_backward_mib:.0f} MiB")
                except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the sweep goes on
                    print(f"   {vname:18s} FAILED {type(exc).__name__}: {str(exc)[:120]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": args.policy, "versions": measure.software_versions(), "table": table,
                       "fla_autotune_picks": autotune_parts.picks()}, f, indent=1)  # FLA's picks in this process


if __name__ == "__main__":
    main()
