"""Search space of the ReWY backward for the vector-gate operators: KDA and GDN2 (per-channel gates G [B,T,H,K]).

Same layout as `scalar.py` (whose helpers it imports): `space(K, V)`, `CONDITIONS`, `schedule_from_params`,
`constraint(schedule, problem_dims)`, `default_schedule(compute_capability)`. What differs is what the
vector-gate pipeline compiles (`kernels/triton/pipeline.py` → `vector_local.py`):

- vector-only choices the kernels read: ``intra`` (``dv_local_vector`` and ``consumer_vector``: "auto" = the
  guarded centred products with the 16-row sub-chunk fallback, "subchunk" = always the fallback; "centred"
  alone drops the range guard and overflows fp32 on strong decays, so it is not in the space and
  `constraint` rejects it) and ``cumsum.block_k`` (the feature tile of the vector chunk cumsum and of the
  reverse cumsum of Ḡ). The sub-chunk row block BC = 16 is a kernel constant, not a schedule field.
- the resource model. The scans load the gate in fp32 twice per chunk (G and Gᵀ [C, K], the vector-gate
  decays), dv_local and the consumer multiply fp32 working matrices (α/ζ-scaled operands, H, D) with
  ``input_precision="ieee"``, and the consumer's sub-chunk fallback walks the BC diagonal offsets in a
  run-time loop. The scalar model does not see the fp32 gate tiles: the H200 gdn2 campaign
  (benchmarks/results/h200-campaign-gdn2-2026-11-30.db) lost trials 5 and 7 to the reverse scan's shared
  memory (Triton: 283 648 B and 248 832 B > 232 448 B), which the scalar model put at 180 224 B and 163 840 B;
  this model says 287 744 B and 275 456 B.

Calibration. The shared-memory formulas are upper bounds fitted to Triton 3.6's own numbers: each vector-gate
kernel compiled ahead of time for sm_90 (`triton.compile` with GPUTarget("cuda", 90, 32), bf16 inputs, the
launches' constexprs, 16-byte pointer alignment as torch allocations have it — that is what lets Triton
pipeline the loads with cp.async) over tiles × warps × stages at K = V = 128 (every stage, joint and separate,
fp32 and bf16 state and P/D), plus K = V = 64 and 256, K ≠ V, KDA's scalar β and fp32 inputs — about 1 600
compiles of the kernels as of the commit "Compile once per schedule" (run-time H and feature loops). That
compile reproduces both H200 failures to the byte. No compiled size exceeds its estimate; 36 of the ~1 450
configurations that fit in 232 448 B are estimated above it (they compile to 164 to 230 KB: fp32-input scans,
separate-mode, K = 256 and 2-warp consumers). The terms follow the kernels:

- loads inside a run-time loop that feeds tl.dot get (num_stages − 1) extra buffers: the scans' chunk loop,
  the consumer's V loops, dv_local's V loop, the producer's V loop; a loop with one trip (BV ≥ V) is not a
  loop after constant folding, so it pipelines nothing. The consumer's sub-chunk diagonal loop (no tl.dot) is
  not multi-buffered;
- tl.dot operands staged through shared memory: the scans' state and [C, BV] operands, the fp32 intra products
  of dv_local ([C, BK] × [BK, C]) and of the consumer (H and D on both sides of a product: two layouts each);
- the largest phase of a kernel counts, not the sum (Triton reuses shared memory across phases).

The bounds are tightest for bf16 at 4 and 8 warps (exact for the largest scans and joint consumers), loosest
for 2 warps (up to 1.8× for the consumer, whose 2-warp layouts the register estimate rejects anyway).
"""

from __future__ import annotations

from typing import Any

from rewy_tune.schedule import Schedule, StageConfig, state_blocks
from rewy_tune.search_spaces import scalar
from rewy_tune.search_spaces.scalar import (
    _dims,
    _pow2_ceil,
    _tiles_for,
    compute_capability_of,
    recompute_fault_reasons,
    resource_reasons,
    schedule_from_params,
    segment_reasons,
    tile_reasons,
)

# `intra` values searched: the guarded centred products ("auto") and the always-safe sub-chunk fallback.
INTRA_CHOICES = ["auto", "subchunk"]
# Precision of the fp32 intra products: exact fp32 FMAs ("ieee") or three tf32 tensor-core products per product
# ("tf32x3", fp32-level error; compiles 2-3x faster). The correctness gates decide per trial.
INTRA_PRECISION_CHOICES = ["ieee", "tf32x3"]
# Source of dv_local's A_qk: recomputed from q, k, G ("recompute", the GPU-verified default) or the forward's saved
# Aqk ("forward": one [C, C] x [C, BV] product per V tile; FLA keeps the same buffer). The gates decide per trial.
DV_LOCAL_SOURCE_CHOICES = ["recompute", "forward"]
# The scans' gated operands K_t, Q_g: formed in each scan program's chunk loop ("inline"), once before the scans
# ("pregated", kernels/triton/scan_operands.py: two [B,T,H,K] tensors more, the same bits), or read from the save-all
# forward ("forward": fla-core's qg, kg; policy A, where no scan-operands stage runs; under R the same as "pregated",
# so `space(policy="R")` leaves it out).
SCAN_OPERAND_CHOICES = ["inline", "pregated", "forward"]
# Pipeline depth of the vector consumers' two V loops (Schedule.consumer_v_stages; 0, "as consumer_cfg.num_stages",
# duplicates one of these and is not searched).
CONSUMER_V_STAGE_CHOICES = [1, 2, 3]
# Row block of the sub-chunk fallback (kernels/triton/vector_local.py SUBCHUNK_ROWS; a test keeps them equal).
SUBCHUNK_ROWS = 16

__all__ = ["CONDITIONS", "CONSUMER_V_STAGE_CHOICES", "DV_LOCAL_SOURCE_CHOICES", "INTRA_CHOICES",
           "INTRA_PRECISION_CHOICES", "SCAN_OPERAND_CHOICES", "constraint", "default_schedule", "gpu_fault_reasons",
           "register_estimate", "schedule_from_params", "shared_memory_estimate", "space"]


# dv_local's feature tile is read only when dv_local recomputes A_qk: with dv_local_source="forward" the tuner does
# not sample it (each such trial would otherwise have duplicates that differ in an unread field).
CONDITIONS: dict[str, tuple[str, str]] = {**{n: c for n, c in scalar.CONDITIONS.items()
                                             if n not in (*scalar.TMA_ONLY_FIELDS, "consumer_k_split",
                                                          "reverse_scan_qdo")
                                             and not n.startswith("dv_local.")},  # (dv_local runs either way)
                                          "dv_local.block_k": ("dv_local_source", "recompute"),
                                          # the joint vector consumer runs in chunk ranges; the separate one does not
                                          "consumer_ranges": ("consumer", "joint")}


def space(K: int = 128, V: int = 128, policy: str | None = None, op: str | None = None) -> dict[str, list[Any]]:
    """Flat parameter name -> choices, for head dims K, V: the scalar space plus `intra`, `intra_precision`,
    `dv_local_source` and the vector cumsum's feature tile. Under policy "R" scan_operands "forward" is left out:
    nothing is saved for it there and it runs as "pregated", so its trials would repeat those (None: both). op ("kda",
    "gdn2"; None: either) changes no choice: KDA and GDN2 run the same kernels."""
    scalar.check_default_policy(policy)
    if op not in (None, "kda", "gdn2"):
        raise ValueError(f"op must be 'kda', 'gdn2' or None for the vector space, got {op!r}")
    # dv_local_source first (it is in the scalar space): the tuner samples in this order and dv_local.block_k is
    # conditional on it
    out = scalar.space(K, V)
    out["dv_local_source"] = list(DV_LOCAL_SOURCE_CHOICES)
    out["consumer"] = ["joint", "separate"]  # "joint_tma" is a scalar-gate consumer
    for name in scalar.TMA_ONLY_FIELDS:  # read by joint_tma only
        del out[name]
    del out["reverse_scan_layout"]  # the transposed reverse scan takes scalar gates only
    del out["reverse_scan_qdo"]  # read by the no-gate (DeltaNet) reverse scan only
    out["intra"] = list(INTRA_CHOICES)
    out["intra_precision"] = list(INTRA_PRECISION_CHOICES)
    out["scan_operands"] = [c for c in SCAN_OPERAND_CHOICES if not (policy == "R" and c == "forward")]
    out["consumer_v_stages"] = list(CONSUMER_V_STAGE_CHOICES)
    out["cumsum.block_k"] = _tiles_for(K)
    return out


def _state_rows(schedule: Schedule, K: int) -> int:
    """Rows of the scans' state as compiled: NB blocks of KB rows (`schedule.state_blocks`)."""
    kb, nb = state_blocks(K, schedule.scan_state_rows)
    return nb * kb


def shared_memory_estimate(schedule: Schedule, K: int, V: int, e: int) -> dict[str, int]:
    """Shared-memory bytes per vector-gate kernel: upper bounds of Triton 3.6's sm_90 numbers (see the module
    docstring), exact for the largest configurations. e: bytes of the input dtype; the gate G, the state (fp32
    unless state_dtype is "input") and the intra working matrices have their own widths."""
    C = schedule.chunk_size
    Kp = _state_rows(schedule, K)
    est: dict[str, int] = {}

    # recompute_wu: A [C, C] (two dot-operand copies) and the widest [C, BK] / [C, BV] operand; static loops.
    rc = schedule.recompute
    est["recompute"] = 2 * C * C * e + 2 * C * max(rc.block_k, rc.block_v) * e

    # Scans. Every chunk step loads, per pipeline stage beyond the first (num_stages − 1 extra buffers): the
    # forward scan's K_tᵀ and W (input dtype), Gᵀ (fp32: the vector gate) for all Kp state rows, G_n, and U's
    # [C, BV] tile (prefetched since the forward loop of session 13: the session-16 recompiles); the
    # reverse scan's k, qᵀ, Wᵀ (input dtype), G and Gᵀ (fp32), G_n, dO and dv_local [C, BV]. Besides: the
    # current state-block tiles (a [C, KB] fp32 gate block, a [C, Kp] input-dtype tile, the [C, BV] dot
    # operands; the forward scan's fitted 3/2·C·BV·e covers U and R).
    KB = state_blocks(K, schedule.scan_state_rows)[0]
    fs, rs = schedule.forward_scan, schedule.reverse_scan
    if schedule.scan_operands in ("pregated", "forward"):
        # No [C, K] gate tile: per stage the forward scan's K_tᵀ and W, the reverse scan's K_t, Q_gᵀ and Wᵀ (input
        # dtype) and the [C, BV] tiles; from two stages on, one more staging of the state operands. Fitted to the
        # session-24 sm_90 compiles (bf16, K = 64..256, BV 16..128, 4 and 8 warps: exact at K = 128 and 256, 16 KB
        # over at K = 64; tests/test_search_spaces_vector.py AOT_SM90); with fp32 inputs a loose upper bound.
        states = e * KB * (schedule.state_dtype == "input")  # × BV: 16-bit states (one compile each, at BV 64)
        bump_f = (C * (2 * Kp - KB) * e + C * fs.block_v * e) if fs.num_stages > 1 else 0
        bump_r = (2 * C * Kp * e + C * rs.block_v * e) if rs.num_stages > 1 else 0
        est["forward_scan"] = (C * KB * e + C * fs.block_v * e + bump_f + states * fs.block_v
                               + (fs.num_stages - 1) * (2 * C * Kp * e + C * fs.block_v * e))
        est["reverse_scan"] = (C * Kp * e + 2 * C * rs.block_v * e + bump_r + states * rs.block_v
                               + (rs.num_stages - 1) * (3 * C * Kp * e + 2 * C * rs.block_v * e))
    else:
        est["forward_scan"] = (C * KB * e + C * Kp * e + 3 * C * fs.block_v * e // 2
                               + (fs.num_stages - 1) * (2 * C * Kp * e + C * Kp * 4 + Kp * 4 + C * fs.block_v * e))
        est["reverse_scan"] = (C * KB * 4 + C * Kp * e + 2 * C * rs.block_v * e
                               + (rs.num_stages - 1) * (3 * C * Kp * e + 2 * C * Kp * 4 + Kp * 4
                                                        + 2 * C * rs.block_v * e))

    # dv_local_vector: the fp32 intra product [C, BK] × [BK, C]; then A_qkᵀ (fp32 [C, C]) × dO [C, BV], dO
    # multi-buffered when the V loop has more than one tile.
    # (fp32 inputs: 1.5 copies of the dO tile per stage in the sm_90 compiles, their "ieee" products run without
    # tensor cores.)
    dl = schedule.dv_local
    do_stage = e if e < 4 else 3 * e // 2
    do_loop = (dl.num_stages - 1) * C * dl.block_v * do_stage * (V > dl.block_v)
    if schedule.dv_local_source == "forward":
        # the saved A_qk tile [C, C] (input dtype) × dO: no intra product. Not calibrated against sm_90 compiles
        # (the fp32 [C, C] term of the recompute form is kept as its bound).
        est["dv_local"] = C * C * 4 + C * dl.block_v * 4 + do_loop
    else:
        est["dv_local"] = max(2 * C * dl.block_k * 4, C * C * 4 + C * dl.block_v * 4 + do_loop)

    # producer (separate consumer only; local.py, gate-independent): Aᵀ [C, C], R̄ and Rᵀ tiles per stage, and
    # the P tile in pd_dtype on its way out (the scalar model counts P in the input dtype: 8 KiB short at BV = 64
    # with fp32 P, D).
    if schedule.consumer == "separate":
        pr = schedule.producer
        pd = 4 if schedule.pd_dtype == "fp32" else e
        stages = pr.num_stages if V > pr.block_v else 1  # one V tile: no loop to pipeline
        est["producer"] = C * C * e + 2 * C * pr.block_v * e * stages + C * pr.block_v * pd

    est["consumer_cfg"] = consumer_shared_memory(schedule, V, e)

    # chunk cumsum of G and reverse cumsum of Ḡ: one fp32 [C, BK] tile.
    est["cumsum"] = C * schedule.cumsum.block_k * 4
    return est


def consumer_shared_memory(schedule: Schedule, V: int, e: int) -> int:
    """consumer_vector: the larger of its two phases, plus reduction and barrier scratch (8 KB; 2 KB with one V tile).

    Intra (per feature tile): the fp32 products take BC = 16-row slices of H, D, Hᵀ, Dᵀ ([C, 16] each) and
    three [16, BK] fp32 operands per step; each pipeline stage of the feature loop holds a copy.
    V loops (per feature tile): the joint mode's resident Aᵀ (C² in the input dtype), three [C, BV] tiles (R, dO
    and R̄ or P; P in pd_dtype) and the tensor-core B operands S0ᵀ, dS1ᵀ [BV, BK] in the input dtype; each stage of
    their pipeline beyond the first adds prefetched operands, 7/2·C·BV·e + 3/2·BV·BK·(state bytes) (fitted). Their
    depth is Schedule.consumer_v_stages (0: the consumer's num_stages); with one V tile (BV ≥ V) the loop folds away
    and the feature loop prefetches its operands at the consumer's num_stages instead, 4·C·BV·e + 2·BV·BK·(state
    bytes) per stage (fitted; tight at 16 × 128 and 64 × 128, where campaign-gated consumers compile to 224 384 B at
    3 stages and 219 392 B at 2). Not modelled: at 128 × 128 and 2 stages Triton pipelines nothing (78 336 B;
    rejected here). Since session 35 (⟨S0, dS1⟩ in a loop of its own, no R tile in phase 1) 128-wide feature tiles
    stage one [BV, BK] operand, not two, and beyond the first stage only [C, BV] tiles, 4·C·BV·e per stage.
    Fitted to Triton 3.6's sm_90 compiles of the session-35 kernel (tests/test_search_spaces_vector.py AOT_SM90:
    an upper bound within 40 KB on every row).
    """
    C = schedule.chunk_size
    cc = schedule.consumer_cfg
    BK, BV, stages = cc.block_k, cc.block_v, cc.num_stages
    joint = schedule.consumer == "joint"
    s_state = 4 if schedule.state_dtype == "fp32" else e
    p_bytes = e if joint else (4 if schedule.pd_dtype == "fp32" else e)
    bc = min(16, C)
    intra = stages * (4 * C * bc * 4 + 3 * bc * BK * 4)
    wide = BK > 64  # (session 35's kernel: 128-wide state tiles are not staged beyond the first, fitted)
    if V > BV:  # the V loops' own pipeline
        per_stage = 4 * C * BV * e if wide else (7 * C * BV * e + 3 * BV * BK * s_state) // 2
        depth, scratch = schedule.consumer_v_loop_stages, 8192
    else:  # one V tile: the feature loop prefetches its operands
        per_stage, depth, scratch = 4 * C * BV * e + 2 * BV * BK * s_state, stages, 2048
    v_loop = ((C * C * e if joint else 0) + 2 * C * BV * e + C * BV * p_bytes + (1 if wide else 2) * BV * BK * e
              + (depth - 1) * per_stage)
    return max(intra, v_loop) + scratch


def register_estimate(schedule: Schedule, K: int, V: int) -> dict[str, float]:
    """Live fp32 values per thread (rough), per vector-gate kernel; > MAX_ACC_PER_THREAD rejects.

    Checked against ptxas (spill-store bytes of the sm_90 compiles, K = 64..256): the accepted configurations
    spill at most 6.0 KB (dv_local at BK = 128 with 4 warps, which the H200 default uses and which ran there;
    the default's consumer spills 1.5 KB), and every configuration that spills more is rejected (7 KB to
    175 KB: consumers with 2 warps, with 4 warps at BK >= 64 and with 8 warps at BK = 128; dv_local and
    recompute with 2 warps at a 128-wide tile; scans with 2 warps at BV = 128, with 4 at K = 256, BV = 128).
    Also rejected, spilling less: every 2-warp consumer (>= 1.9 KB; the slow layout) and 2-warp recompute at
    a 128-wide value tile (0.7 KB)."""
    C = schedule.chunk_size
    out: dict[str, float] = {}
    cc = schedule.consumer_cfg
    # H, D [C, C] fp32 (the phase-1 accumulators; since session 7 they leave for a scratch before the feature
    # loop, so this over-counts the feature loop and stays on the safe side); per feature tile the V loop's
    # three [C, BK] accumulators (P S0ᵀ, dO S0ᵀ, R dS1ᵀ), the three intra results and two elementwise factors.
    out["consumer_cfg"] = (2 * C * C + 8 * C * cc.block_k) / (32 * cc.num_warps)
    # Scans: the fp32 state block [Kp, BV] and the [C, BV] correction (R or R̄) — as for scalar gates. (128-row
    # blocks, scan_state_rows, hold the same values: sm_90, KDA A's reverse scan 212 -> 225 registers, no spills.)
    Kp = _state_rows(schedule, K)
    for name in ("forward_scan", "reverse_scan"):
        cfg = getattr(schedule, name)
        out[name] = (Kp * cfg.block_v + C * cfg.block_v) / (32 * cfg.num_warps)
    # dv_local: A_qkᵀ [C, C] fp32 accumulated over feature tiles with the fp32 operand pair [C, BK], [BK, C];
    # then the [C, BV] product.
    # (dv_local_source "forward": no intra operand pair, block_k unread.)
    dl = schedule.dv_local
    operands = C * dl.block_v if schedule.dv_local_source == "forward" else max(2 * C * dl.block_k, C * dl.block_v)
    out["dv_local"] = (C * C + operands) / (32 * dl.num_warps)
    # recompute: A [C, C] in the input dtype (two values per register) and the fp32 operand + result tiles.
    rc = schedule.recompute
    out["recompute"] = (C * C / 2 + 2 * C * max(rc.block_k, rc.block_v)) / (32 * rc.num_warps)
    if schedule.consumer == "separate":
        pr = schedule.producer
        out["producer"] = (C * C + C * pr.block_v) / (32 * pr.num_warps)
    return out


def constraint(schedule: Schedule, problem_dims: Any, op: str | None = None) -> list[str]:
    """Reasons this schedule cannot compile or run for a KDA/GDN2 problem (empty list: worth a trial).

    problem_dims: as for `scalar.constraint` (K, V; optional dtype, compute_capability or smem_limit). op: taken as
    `scalar.constraint` takes it; KDA and GDN2 share this model."""
    K, V, e, smem_limit = _dims(problem_dims)
    reasons = tile_reasons(schedule, K, V)
    if schedule.consumer == "joint_tma":
        reasons.append("consumer 'joint_tma' is a DeltaNet/GDN consumer; KDA/GDN2 take 'joint' or 'separate'")
    if schedule.reverse_scan_layout != "kv":
        reasons.append(f"reverse_scan_layout={schedule.reverse_scan_layout!r}: the transposed reverse scan takes no "
                       "gate or a scalar gate (DeltaNet/GDN); KDA/GDN2 take 'kv'")
    if schedule.reverse_scan_qdo != "in_step":
        reasons.append(f"reverse_scan_qdo={schedule.reverse_scan_qdo!r} is read by DeltaNet's reverse scan alone (no "
                       "gate); KDA/GDN2's scans form Qᵀ dO in their step ('in_step')")
    if schedule.intra not in INTRA_CHOICES:
        reasons.append(f"intra={schedule.intra!r} skips the range guard: exp(ΔG/2) overflows fp32 on strong "
                       f"decays (searched: {INTRA_CHOICES})")
    if schedule.cumsum.block_k > max(16, _pow2_ceil(K)):
        reasons.append(f"cumsum.block_k={schedule.cumsum.block_k} exceeds K={K} rounded up to a power of two")
    if schedule.intra_precision not in INTRA_PRECISION_CHOICES:
        reasons.append(f"intra_precision={schedule.intra_precision!r} is not one of {INTRA_PRECISION_CHOICES}")
    if schedule.dv_local_source not in DV_LOCAL_SOURCE_CHOICES:
        reasons.append(f"dv_local_source={schedule.dv_local_source!r} is not one of {DV_LOCAL_SOURCE_CHOICES}")
    reasons += resource_reasons(shared_memory_estimate(schedule, K, V, e), register_estimate(schedule, K, V),
                                smem_limit)
    reasons += segment_reasons(schedule, K, smem_limit)
    reasons += gpu_fault_reasons(schedule, K, V, e, compute_capability_of(problem_dims))
    return reasons


# Wrong gradients on the H200 (16-bit inputs, sm_90). Session 3's campaign gated one schedule wrong (dq, dk, dg, db
# rel-RMS 0.8-1.1; o, ht, dv, dw, dh0 right) that is right on the interpreter; sessions 4 and 5 gated three more
# with the same signature. Two suspects were rejected meanwhile (forward scan at block_v = 32 < V; a 4-warp
# separate tf32x3 consumer at block_k = 16); the session-4 bisection showed neither explains it, and the session-5
# stage test (tests/kernels/test_triton_shared_stages.py -k wrong_h200) found the stage: the recompute at
# block_k = 128 with 4 warps gives a wrong U (the forward scan at block_v = 32 passed there). All four wrong
# schedules share that recompute configuration, so it alone is rejected now (`scalar.recompute_fault_reasons`,
# every operator), and the two suspects are back in the space (the gates still check every trial).
def gpu_fault_reasons(schedule: Schedule, K: int, V: int, e: int,
                      compute_capability: tuple[int, int] | None = (9, 0)) -> list[str]:
    """Stage configurations that gave wrong gradients on a GPU: 16-bit inputs on compute capability 9.x (wgmma
    tiles; other GPUs compile other tensor-core paths and are not implicated)."""
    reasons = recompute_fault_reasons(schedule, e, compute_capability)
    if (e == 2 and compute_capability is not None and compute_capability[0] == 9
            and schedule.intra_precision == "tf32x3"):
        reasons.append(f"intra_precision='tf32x3' with 16-bit inputs: {H200_TF32X3_FAULT}")
    return reasons


# Session 7: the sliced-intra consumer with intra_precision="tf32x3" and bf16 inputs stops with an illegal memory
# access on the H200 (KDA, consumer 64 x 64 and 32 x 64 at 8 warps, 1 stage, (1, 8192, 4) and (1, 512, 4), every
# case; one process per case, CUDA_LAUNCH_BLOCKING=1). The same products with fp32 inputs pass the fp32 gate tests
# on the H200 (test_gpu_fp32_gate, joint and separate, normal and strong decay). ieee is the default and the
# faster of the two in every measurement so far (session 6: 2.68 against 3.41 ms), so 16-bit tf32x3 leaves the
# space on sm_9x. The fault follows the consumer's code, not only the schedule: session 34's consumer ran session
# 7's case clean, session 25's schedule faulted again, and session 35's (⟨dO, R⟩ from H, ⟨S0, dS1⟩ in a loop of its
# own) ran that one clean too, so the reproducer test was dropped; the rejection stays (it was slower where it ran).
H200_TF32X3_FAULT = ("Triton 3.6 on sm_90 stops the sliced-intra consumer with an illegal memory access "
                     "(H200, session 7)")
# Session 22 wrote the three tf32 products out (a = a_hi + a_lo, a_hi with the 13 low mantissa bits cleared; commit
# 08d7584, reverted). fp32 inputs passed the gate; with bf16 inputs at 8 consumer warps dk came out wrong (rel RMS
# 0.95) or the kernel read shared memory out of bounds (compute-sanitizer: the second warpgroup), and so did one plain
# tf32 product. At 4 warps the gates passed on the torch forward's inputs, but FLA's forward's inputs faulted again at
# 32 x 64, and the 4-warp consumers that ran were slower than ieee at 8 warps: KDA A (1, 2048, 16) 0.5273 (64 x 64)
# and 0.5121 (32 x 32) against 0.4580 ms (RESULTS.md, session 22; results/session22-call-{1,2,3}).


# KDA and GDN2 on the H200 (K = V = 128, 16-bit inputs). Consumer: session 7's sliced-intra consumer at 64 x 64,
# 8 warps, 1 stage (`profile_stages.py --op kda`, KDA (1, 8192, 16) R: 2.21 ms against 3.41 ms at the session-6
# tiles 32 x 128 / 2 stages, whose pipelined slices cost more than they hide; FLA 2.21 ms). The other stages: the
# winner of the session-6 one-worker GDN2 campaign
# (benchmarks/RESULTS.md, session 6; `rewy-tune --device h200 --op gdn2 --policy R --trials 60 --workers 1
# --compile-jobs 8 --time-budget 7m --seed 0`, trial 49 of bucket T8192·BH16, the winner of every bucket).
# Promotion re-measured it paired against FLA and the previous default (session 5's schedule, itself session 3's
# campaign winner with dv_local reading the forward's A_qk): 13-21 % faster on every GDN2 shape, beyond the
# measured spread (0.3-0.8 %). It changes four stages of that schedule: the recompute at 8 warps (was 2), dv_local
# at block_v 16 and 8 warps (was 64, 4), the reverse scan's state tile 128 x 64 (was 128 x 128), the joint
# consumer's feature tile 32 (was 16). Sequence-split scans (4 / 8 segments of >= 2 chunks), fp32 states, and
# dv_local from the forward's saved A_qk (FLA's own backward reads the same buffer in the input dtype, rewy-math
# §8.1) stay. KDA runs the same kernels as GDN2 (scalar β instead of vector b, w), so it takes the same schedule.
VECTOR_H200 = {
    "recompute": StageConfig(64, 16, 8, 3),
    # 32-wide state tiles (FLA's width; 4x the programs, no spills on sm_90): session 17 sweep, KDA R (1, 512, 4)
    # 0.1214 -> 0.1093 ms, (1, 2048, 16) 0.5149 -> 0.4786; bench KDA R 1.034 -> 1.128x, GDN2 1.188 -> 1.239x
    "forward_scan": StageConfig(128, 32, 4, 3),
    "dv_local": StageConfig(32, 16, 8, 3),
    "reverse_scan": StageConfig(128, 32, 4, 2),
    "producer": StageConfig(64, 64, 4, 2),
    "consumer_cfg": StageConfig(64, 64, 8, 1),
    "cumsum": StageConfig(64, 64, 4, 1),
    # bf16 per-chunk states (S0 of the forward scan, dS1 of the reverse scan), as FLA stores h and dh (under A the
    # forward's S0 is fla-core's bf16 h already). The scans accumulate in fp32; the consumer casts both to bf16 for its
    # products either way, and only the fp32 rowsum of S0 ⊙ dS1 (the gate adjoint) reads the rounded values. Session
    # 33, benchmarks/scan_bench.py on the H200 (the policy-A reverse scan, one launch, T = 2048, 32 chunk steps):
    # 101.5 -> 83.4 µs at B·H = 4, 118.7 -> 103.9 at B·H = 16 (FLA's reverse scan 45.6 and 48.3); with the early gate
    # row the six-shape benches went KDA R 1.518 -> 1.653x, A 1.573 -> 1.670x, GDN2 R 1.644 -> 1.790x, A 1.772 ->
    # 1.853x (benchmarks/RESULTS.md). test_gpu_bench_shapes gates both state dtypes at the six shapes, both policies.
    # (Session 17's sweep had them 2.4 % faster at KDA R (1, 2048, 16) already.)
    "state_dtype": "input", "consumer": "joint", "pd_dtype": "fp32", "intra": "auto", "intra_precision": "ieee",
    "forward_scan_segments": 4, "reverse_scan_segments": 8, "dv_local_source": "forward",
    # The split limited to waves of programs (vector scans skip the "split pays" rule, scan.py). Two waves
    # (session 11): at B·H = 32 the reverse scan ran four segments instead of eight (KDA (2, 2048, 16) 1.120 -> 1.047
    # ms under R). One wave (session 15): the reverse scan four segments at B·H = 16 and none at B·H = 32, as the
    # scalar default; with w_source below, KDA's policy-A backward at (2, 2048, 16) 0.873 -> 0.763 ms, (1, 2048, 16)
    # 0.493 -> 0.452 ms, against 3-5 % from W alone at B·H = 4 (RESULTS.md; not timed apart, nor under R).
    "scan_split_waves": 1,
    # Policy A keeps the forward's W (fla-core's w, out[5]): no recompute stage. Policy R does not read the field.
    "w_source": "forward",
    # Policy R: the reverse scan on a second stream beside the forward scan, each split on half the SMs. Bench,
    # session 16 (this schedule with --set side_stream=reverse_scan): KDA R 0.874 -> 1.034x FLA (session 15's
    # bench), GDN2 R 1.188x (0.963x in session 11) (RESULTS.md).
    "side_stream": "reverse_scan",
    # Two consumer programs per chunk where twice the grid fits in one wave of the 8-warp consumer's CTAs (auto,
    # local.programs_per_chunk): session 16 sweep, KDA (1, 512, 4) R 0.1666 -> 0.1428 ms with 2 (RESULTS.md).
    "consumer_k_split": 0,
    # The scans' gated operands K_t, Q_g formed once before them ("pregated", kernels/triton/scan_operands.py): no fp32
    # gate tiles and exponentials in their serial chunk loops (sm_90: 148 -> 113 registers forward, 156 -> 117
    # reverse; 215 -> 167 for policy A's 64-wide reverse scan). The same bits as "inline" (GPU tests, both policies:
    # session 24, and session 25's whole vector suite with it as the default). Side by side (session 25 sweep), KDA R
    # (1, 2048, 16) 0.4760 -> 0.4187 ms (1.230 -> 1.394x FLA); session 24, KDA A the same shape 0.4519 -> 0.3967.
    # Six-shape benches with it (session 25; RESULTS.md): KDA R 1.454x, A 1.355x; GDN2 R 1.588x, A 1.500x (last
    # benched inline: R 1.128 / 1.239 in session 17, A 1.154 / 1.272, before session 24's narrowed consumer split).
    "scan_operands": "pregated",
    # The consumer's two V loops software-pipelined at 2 stages (the rest of it at 1), with the flags LAST_ROW_LOAD and
    # RANGE_FROM_OPERANDS (vector_local.py). Session 26 sweep, all three against none: KDA A (1, 2048, 16) 0.3968 ->
    # 0.3757 ms, (1, 8192, 4) 0.4241 -> 0.4030; GDN2 A 0.4155 -> 0.3861, 0.4443 -> 0.4125; KDA R (2, 2048, 16) 0.8134 ->
    # 0.7590, GDN2 R 0.8520 -> 0.7922. The two loops at 2 stages alone: KDA A (1, 2048, 16) 0.3940 ms.
    "consumer_v_stages": 2,
}


# Policy A's reverse scan runs alone: no forward scan beside it (policy R's side stream), and the consumer only after
# it. 64-wide state tiles then beat the 32-wide ones policy R takes. Session 21 sweep, KDA A (one-wave split limit):
# (1, 4096, 8) 0.548 -> 0.467 ms (scan 246 -> 150 us: 8 segments of 8 chunks against 4 of 16), (1, 8192, 4)
# 0.566 -> 0.500, (1, 2048, 16) 0.455 -> 0.453 (benchmarks/RESULTS.md, session 21).
# Three stages (pregated operands: 204 800 B of shared memory): session 25 sweep 1.7-2.0 % faster at (1, 2048, 16) and
# (1, 8192, 4), KDA and GDN2; gated on the H200 at the six bench shapes in session 26; session 27 sweep (KDA) (1, 2048,
# 16) 0.3799 -> 0.3711 ms, (1, 8192, 16) 1.3831 -> 1.3467.
# consumer_ranges auto (pipeline.consumer_range_count): where the scan would split in at most 4 segments (B·H >= 16),
# it runs unsplit and the consumer of the chunks it has finished runs beside it, in ranges of at least 8 chunks
# (session 27 sweep, KDA A: (1, 2048, 16) -3.9 %, (2, 2048, 16) -3.8 %, (1, 8192, 16) -8.4 %).
# scan_operands "forward": the reverse scan reads fla-core's saved qg, kg (the save-all forward keeps them), so no
# scan-operands stage runs (15.6 us at (1, 2048, 16)); dv_local at block_v 64, 4 warps (the forward's A_qk: one
# [C, C] x [C, BV] product per V tile; 11.9 -> 7.1 us). Sweeps against the pregated default, both changes together:
# session 28, KDA A (1, 2048, 16) 0.3665 -> 0.3473 ms, (1, 8192, 4) 0.3958 -> 0.3797, (1, 512, 4) 0.0645 -> 0.0621;
# session 29, GDN2 A 0.3778 -> 0.3592, 0.4057 -> 0.3892, 0.0634 -> 0.0632 (peak backward memory at (1, 2048, 16)
# 147 -> 131 MiB: the two pregated tensors are gone). Gated on the H200 at the six bench shapes, both policies
# (session 29, REWY_TEST_GPU_SET). Policy R keeps dv_local 32 x 16 at 8 warps (not swept with 64 x 4).
VECTOR_H200_POLICY_A = {"reverse_scan": StageConfig(128, 64, 4, 3), "consumer_ranges": 0, "scan_operands": "forward",
                        "dv_local": StageConfig(32, 64, 4, 3)}


def default_schedule(compute_capability: tuple[int, int] | None = None, *, K: int = 128, V: int = 128,
                     op: str | None = None, dtype: str | None = None, policy: str | None = None) -> Schedule:
    """Built-in schedule for KDA/GDN2: the scalar default (it passes this model) with the joint pointer
    consumer, and the vector cumsum's feature tile no wider than K; on compute capability 9.0 at K = V = 128 with
    16-bit inputs (dtype None: 16-bit assumed) the campaign-measured one (`VECTOR_H200`, with
    `VECTOR_H200_POLICY_A` under policy "A"; None: policy R's). With fp32 inputs its scans do not fit the H200's
    232 448 B of shared memory (`constraint`; session 4's fp32 gate tests met it on the device), so fp32 inputs take
    the scalar-derived one."""
    scalar.check_default_dtype(dtype)
    scalar.check_default_policy(policy)
    if (op in ("kda", "gdn2") and compute_capability is not None and tuple(compute_capability) == (9, 0)
            and K == V == 128 and dtype in (None, "bf16", "fp16")):
        return Schedule(**{**VECTOR_H200, **(VECTOR_H200_POLICY_A if policy == "A" else {})})
    # the descriptor consumer is scalar-gate only: vector gates take the pointer kernel
    base = scalar.default_schedule(compute_capability, K=K, V=V, dtype=dtype, vector_gates=True)
    # the V loops at the consumer's own depth, written out (the tuner's space holds 1-3, not 0's "follow")
    return base.replace(cumsum={"block_k": min(64, max(16, _pow2_ceil(K)))},
                        consumer_v_stages=base.consumer_cfg.num_stages)
