"""Local (per-chunk) stages of the ReWY backward for vector gates (KDA, GDN2): rewy-math §§5, 6.3, 6.4, 7, 8.

Inputs: G [B,T,H,K] (chunk-local cumulative gate, natural log, fp32); erase e [B,T,H] (KDA β) or [B,T,H,K]
(GDN2 b); write ω [B,T,H] (KDA β) or [B,T,H,V] (GDN2 w).

- ``dv_local_vector``  dv_local = A_qkᵀ dO. A_qk is *recomputed* here from q, k, G with per-channel decay (same
                       guarded dispatch as the consumer: centred products when the tile's gate range allows,
                       16-row anchored blocks + pairwise diagonal blocks otherwise). Recomputing keeps the
                       backward's inputs equal to the scalar-gate pipeline's (A, not A_qk); the default
                       (Schedule.dv_local_source == "recompute").
- ``dv_local_aqk``     dv_local = A_qkᵀ dO from the forward's saved A_qk (Schedule.dv_local_source == "forward"):
                       fla-core's Aqk (chunk_kda_fwd / chunk_gdn2_fwd out[3]) or the torch forward's
                       ``ChunkForward.Aqk``, one [C, C] × [C, BV] product per V tile, no gate work.
- producer             P = AᵀR̄, D = −L_<(P Rᵀ): gate-independent, ``kernels/triton/local.py``'s producer serves
                       vector gates unchanged (separate consumer mode).
- ``consumer_vector``  centred matrix intra (§6.3/6.4) with the range guard (§7) → dq, dk, dv, d_erase, d_write,
                       dg per key channel (Ḡ's reverse in-chunk cumsum, formed in the kernel). Joint (producer
                       fused) or separate.

Range guard (§7), no host sync: every program (chunk × batch·head) walks K in block_k tiles; per tile it reduces
Δ_tile = max_k (max_i G_ik − min_i G_ik) over the chunk's valid rows and branches at run time (scf.if) between
the centred products (Δ_tile ≤ 128) and the sub-chunk products. The consumer writes the path it took per tile
into an int32 flag tensor (1 centred, 2 sub-chunk) so tests can check dispatch.

Precision (§8.1): every α/ζ-scaled operand and both coefficient adjoints H, D stay fp32, and all intra products
use ``tl.dot(..., input_precision=IPREC)`` on fp32 operands (no tf32/bf16 rounding of fp32 working matrices).
The input-side products (dO Rᵀ, AᵀR̄, P S0ᵀ, dO S0ᵀ, R dS1ᵀ) read input-dtype storage with fp32 accumulation.

Transposes: as in local.py (FLA issue 640, Triton 3.6 on Hopper), no ``tl.dot`` result is transposed in registers.
Transposed operands are loaded transposed from memory. The consumer writes H_< and D once per chunk to an fp32
scratch [B,T,H,2C] (CTA barrier) and reads them back in 16-row slices, Hᵀ and Dᵀ slices by transposed loads, so
the column side X_y = ζ⊙(HᵀQ̃ + DᵀẼ) comes out in row layout like X_q and X_e.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rewy_tune.schedule import CONSUMER_V_STAGES, INTRA_PRECISIONS, Schedule

from .gate import gate_backward
from .local import (_chunk_prologue, _diagonal, _output_like, checked_ranges, consumer_slots, is_v_first,
                    output_buffer, programs_per_chunk, sum_row_parts)
from .recompute import dot_precision, mm, validate_chunk_size, validate_launch, validate_tile

# Largest chunk × tile gate range for the centred products (§7): α, ζ ≤ e^64, ≈ e^24 of fp32 headroom left.
CENTRED_MAX_RANGE = 128.0
SUBCHUNK_ROWS = 16  # row block of the fallback (FLA chunk_kda_bwd_intra's BC)
INTRA_CODES = {"auto": 0, "centred": 1, "subchunk": 2}
PATH_CENTRED, PATH_SUBCHUNK = 1, 2
MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Small grids. Session 23 sweep (policy R, (1, 512, 4): 32 chunk programs of the 8-warp consumer on 132 SMs): four
# programs per chunk over 32-wide feature tiles ran KDA's backward 0.1093 -> 0.0887 ms and GDN2's 0.1100 -> 0.0908,
# against auto's two over 64-wide tiles; with one H_< | D scratch per program KDA's peak went over FLA's. Session 24
# gated both flags on the H200 (test_gpu_consumer_narrowed_split, 12 passed) and timed them at (1, 512, 4) against
# FLA (benchmarks/RESULTS.md, session 24): KDA A 0.969 -> 1.265x, R 0.933 -> 1.190x; GDN2 A 1.039 -> 1.484x,
# R 1.007 -> 1.215x; peak below FLA's (KDA 7 / 9 MiB under A, 10 / 12 under R).
# - AUTO_NARROW_TILES: consumer_k_split "auto" (0) may narrow the feature tile to reach four programs per chunk
#   (`consumer_split`);
# - SHARED_HD_SCRATCH: a chunk's k-split programs share one H_< | D scratch. Each computes the same phase 1 from
#   the same inputs and writes the same bits there, so whichever program's store a read meets, it reads the same
#   values; the scratch stays [B,T,H,2C] whatever the split.
AUTO_NARROW_TILES = True
SHARED_HD_SCRATCH = True
NARROW_TILE_MIN = 32  # the narrowest feature tile auto chooses (32 x 64 is the tile the sweep timed)

# LAST_ROW_LOAD: the consumer loads the chunk's last gate row G_n per feature tile ([BK], one masked load) instead of
# extracting it from the [C, BK] tile with a column sum (a cross-warp reduction, shared memory and barriers, every
# tile). The same bits (a sum of one value and zeros is that value). sm_90 compiles on a CPU (session 25,
# `compile_times.py --kernels consumer_vector`, H = 16): stack per thread KDA A 272 -> 64 B, R 280 -> 80, GDN2 A
# 328 -> 160, R 352 -> 152; KDA A 9 736 -> 9 424 instructions.
# RANGE_FROM_OPERANDS: with the scans' operands pregated, their kernel also writes each chunk's per-channel max and
# min of G (`scan_operands.gated_scan_operands(with_range=True)`), and the consumer's range guard reads them ([BK]
# loads) instead of reducing its [C, BK] gate tile across warps (`_tile_range`: two column reductions, barriers, and
# the wait for the tile's load before the centred products can start). The same bits.
# Both on since session 26: the H200 passed test_gpu_consumer_flags (the oracle's gate and the same bits as both off,
# both policies), and with Schedule.consumer_v_stages 2 they took KDA A (1, 2048, 16) 0.3968 -> 0.3757 ms, GDN2 A
# 0.4155 -> 0.3861, KDA R (2, 2048, 16) 0.8134 -> 0.7590 (benchmarks/RESULTS.md, session 26). Off, the reductions
# they replace run (tests/kernels/test_triton_vector.py::test_consumer_flag_same_bits).
LAST_ROW_LOAD = True
RANGE_FROM_OPERANDS = True
# STATE_ROWSUM_FIRST: where each feature tile forms rowsum_V(S0 ⊙ dS1) (Ḡ's last-row term), in a loop of its own since
# session 35 (the inter products' state tiles are then never read in registers: rewy_tune/ir_hazards.py). Off (the
# H200-gated placement): after the inter products, while their three [C, BK] accumulators are live; GDN2 A benched
# 1.857 -> 1.809x FLA with it (session 35; KDA A 1.670 -> 1.680x). On: at the top of the feature tile, where fewer
# tiles are live (sm_90, 8 warps: GDN2 A stack 216 -> 200 B). The same bits on the interpreter, but keep it off: at
# K = V = 256 with a bf16 S0 (policy R) the H200 gave wrong dk, because Triton 3.6's ptxas (CUDA 12.8, -O3) deletes
# phase 2's P and P S0ᵀ products from the binary once any [BK] value is live from the top of the tile across the inter
# products (session 36: `ir_hazards.dropped_products`, test_state_rowsum_first_sm90_products; CUDA 13.0's keeps them).
STATE_ROWSUM_FIRST = False
# DEFER_GATE_CUMSUM (policy A, Schedule.scan_operands "forward", A_qk from the forward): the reverse scan reads Γ_n
# from fla-core's own gate cumsum (log2 units, kept by its save-all forward), so the backward's chunk cumsum, which
# only the consumer then reads, runs on a second stream beside dv_local and the scan instead of before them
# (`pipeline._cumsum_beside`). Off: it runs first, in order (the scan still reads the forward's cumsum).
DEFER_GATE_CUMSUM = True
# DV_LOCAL_IN_SCAN (policy A, A_qk from the forward: Schedule.dv_local_source "forward"): the reverse scan forms
# dv_local = A_qkᵀ dO itself, one [C, C] × [C, BV] product per chunk step on the dO tile it loads anyway
# (`scan.reverse_state_scan(aqk=)`), and no dv_local stage runs before it (one launch and one [B,T,H,V] buffer fewer),
# except where the scan splits in long segments (`pipeline.dv_local_in_scan_pays`). On since session 31: the H200
# passed test_gpu_dv_local_in_scan (both policies, the six bench shapes and a tail) and the sweep timed KDA A 0.6-2.3 %
# faster where it applies (benchmarks/RESULTS.md). Policy R, whose dv_local runs beside the recompute stage on the
# side stream, keeps the stage (not timed with it).
DV_LOCAL_IN_SCAN = True
# (Session 30 timed the centred products in the chunk's row halves, leaving out the quarter of them that multiply
# H_<'s and D_<'s exact zeros: the same bits, 1-3 % slower on the H200 (more shared-memory operand loads and
# barriers); removed, the code is at commit 4d42cdb, benchmarks/RESULTS.md session 30.)


def gate_range_shape(shape, chunk_size: int) -> tuple[int, int, int, int, int]:
    """[B, NT, H, 2, K] of the consumer's gate range for a vector gate of `shape` [B,T,H,K] (fp32): per chunk and key
    channel, G's maximum ([..., 0, :]) and minimum ([..., 1, :]) over the chunk's valid rows (`chunk_max_min`)."""
    B, T, H, K = shape
    return B, triton.cdiv(T, chunk_size), H, 2, K


@triton.jit
def chunk_max_min(b_g, m_row):
    """Per-channel max and min of a [C, BK] gate tile over the chunk's valid rows (also scan_operands.py's range)."""
    b_max = tl.max(tl.where(m_row[:, None], b_g, float("-inf")), axis=0)
    b_min = tl.min(tl.where(m_row[:, None], b_g, float("inf")), axis=0)
    return b_max, b_min


@triton.jit
def _centre_and_range(b_max, b_min, m_k):
    """Per-channel mid-range c and the tile range Δ_tile over the tile's valid channels."""
    b_max = tl.where(m_k, b_max, 0.0)
    b_min = tl.where(m_k, b_min, 0.0)
    b_c = (b_max + b_min) * 0.5
    delta = tl.max(b_max - b_min, axis=0)
    return b_c, delta


@triton.jit
def _tile_range(b_g, m_row, m_k):
    """Per-channel mid-range c and the tile range Δ_tile over the chunk's valid rows / channels."""
    b_max, b_min = chunk_max_min(b_g, m_row)
    return _centre_and_range(b_max, b_min, m_k)


@triton.jit
def _use_centred(delta, INTRA: tl.constexpr, MAX_RANGE: tl.constexpr):
    # Δ ≥ 0 always: the forced modes stay run-time scalars of the same type as the auto decision.
    if INTRA == 1:
        ok = delta > -1.0
    elif INTRA == 2:
        ok = delta < -1.0
    else:
        ok = delta <= MAX_RANGE
    return ok


# --------------------------------------------------------------------------------------------------
# dv_local = A_qkᵀ dO, A_qk recomputed with per-channel decay
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T", "H"])
def rewy_bwd_kernel_dv_local_vector(
    q, k, G, do, dv,
    T, scale,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
    INTRA: tl.constexpr, MAX_RANGE: tl.constexpr, PREC: tl.constexpr, IPREC: tl.constexpr,
):
    i_t, i_b, i_h, t0, o_i, m_row, tok, n_rows, _ = _chunk_prologue(T, H, BT, 0)
    blk = (o_i // BC) * BC

    # b_at[j, i] = Σ_f k_jf q_if Λ_ijf (row j, column i), accumulated over K tiles in fp32.
    b_at = tl.zeros([BT, BT], dtype=tl.float32)
    # Run-time loops over feature tiles and sub-chunk blocks: one copy of each body in the binary (static
    # unrolling made this kernel the slowest of the pipeline to compile, ~33 s for sm_90 at K = 128).
    for i_k in range(0, (K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_rk = m_row[:, None] & m_k[None, :]
        m_kr = m_k[:, None] & m_row[None, :]
        p_rk = tok[:, None] * K + o_k[None, :]
        p_kr = tok[None, :] * K + o_k[:, None]
        b_g = tl.load(G + p_rk, mask=m_rk, other=0.0).to(tl.float32)
        b_gt = tl.load(G + p_kr, mask=m_kr, other=0.0).to(tl.float32)
        b_k = tl.load(k + p_rk, mask=m_rk, other=0.0).to(tl.float32)
        b_qt = tl.load(q + p_kr, mask=m_kr, other=0.0).to(tl.float32)
        b_c, delta = _tile_range(b_g, m_row, m_k)
        if _use_centred(delta, INTRA, MAX_RANGE):
            b_y = b_k * tl.exp(tl.where(m_rk, b_c[None, :] - b_g, 0.0))
            b_qa = b_qt * tl.exp(tl.where(m_kr, b_gt - b_c[:, None], 0.0))
            b_at += tl.dot(b_y, b_qa, input_precision=IPREC)
        else:
            # Off-diagonal blocks: column block I of i (the q side), anchored at its first row a.
            for ib in range(1, BT // BC):
                a = ib * BC
                b_ga = tl.sum(tl.where((o_i == a)[:, None], b_g, 0.0), axis=0)
                m_y = ((o_i < a) & m_row & (a < n_rows))[:, None] & m_k[None, :]
                b_y = b_k * tl.exp(tl.where(m_y, b_ga[None, :] - b_g, float("-inf")))
                m_q = m_k[:, None] & ((o_i >= a) & (o_i < a + BC) & m_row)[None, :]
                b_qa = b_qt * tl.exp(tl.where(m_q, b_gt - b_ga[:, None], float("-inf")))
                b_at += tl.dot(b_y, b_qa, input_precision=IPREC)
            # Diagonal blocks, exact pairwise Λ: row j meets column i(j) = block start + d.
            for d in range(0, BC):  # run-time loop: keeps compile time down (16 unrolled copies otherwise)
                o_c = blk + d
                m_c = (o_c >= o_i) & (o_c < n_rows)
                p_c = ((i_b * T + t0 + o_c) * H + i_h)[:, None] * K + o_k[None, :]
                m_ck = m_c[:, None] & m_k[None, :]
                b_qc = tl.load(q + p_c, mask=m_ck, other=0.0).to(tl.float32)
                b_gc = tl.load(G + p_c, mask=m_ck, other=0.0).to(tl.float32)
                b_val = tl.sum(b_k * b_qc * tl.exp(tl.where(m_ck, b_gc - b_g, float("-inf"))), axis=1)
                b_at += tl.where(o_i[None, :] == o_c[:, None], b_val[:, None], 0.0)
    # Centred tiles: the upper triangle holds α_i ζ_j with i < j, up to e^Δ (inf in fp32 for Δ > 88); tl.where
    # drops it (never a multiply by 0, which would give NaN).
    m_at = (o_i[:, None] <= o_i[None, :]) & m_row[:, None] & m_row[None, :]
    b_at = tl.where(m_at, b_at * scale, 0.0)
    for i_v in range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_row[:, None] & (o_v < V)[None, :]
        p_v = tok[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
        b_dv = tl.dot(b_at, b_do, input_precision=IPREC)
        tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_v)


def dv_local_vector(q, k, G, do, *, scale: float, chunk_size: int = 64, BK: int = 64, BV: int = 64,
                    num_warps: int = 4, num_stages: int = 2, intra: str = "auto",
                    intra_precision: str = "ieee", out: torch.Tensor | None = None) -> torch.Tensor:
    """dv_local = A_qkᵀ dO per chunk for a vector gate G [B,T,H,K] (fp32 natural log); [B,T,H,V] in do's dtype.
    out: a contiguous buffer like do to write (see `local.dv_local`)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    _check_vector_gate(G, (B, T, H, K))
    _check_tiles(chunk_size, BK, BV, num_warps, num_stages)
    dv = _output_like(do, out)
    NT = triton.cdiv(T, chunk_size)
    rewy_bwd_kernel_dv_local_vector[(NT, B * H)](
        q, k, G, do, dv, T, float(scale),
        H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, BC=min(SUBCHUNK_ROWS, chunk_size),
        INTRA=INTRA_CODES[intra], MAX_RANGE=CENTRED_MAX_RANGE, PREC=dot_precision(k.dtype),
        IPREC=_intra_precision(intra_precision),
        num_warps=num_warps, num_stages=num_stages,
    )
    return dv


# --------------------------------------------------------------------------------------------------
# dv_local = A_qkᵀ dO from the forward's A_qk (dv_local_source == "forward")
# --------------------------------------------------------------------------------------------------
# The saved A_qk follows fla-core 0.6.0's Aqk (fla/ops/kda/chunk_intra.py chunk_kda_fwd_intra; the same for
# fla/ops/gdn2/chunk_intra.py chunk_gdn2_fwd_intra): [B,T,H,C] in k's dtype, row = query token i, column = key
# j of the same chunk (t mod C), scale folded in, Aqk[i, j] = s Σ_f q_if k_jf exp2(g_i − g_j) with g FLA's
# chunk cumsum taken with scale=RCP_LN2, i.e. exp(G_i − G_j) in this file's natural-log G: it is the
# transpose of ``b_at`` above before masking (b_at[j, i] = A_qk[i, j]). Diagonal included (j ≤ i). FLA's
# buffer is torch.empty and only j ≤ i is written (off-diagonal 16-row blocks below the diagonal, the
# diagonal blocks' lower triangles), so the load masks j > i instead of multiplying it away.
@triton.jit(do_not_specialize=["T", "H"])
def rewy_bwd_kernel_dv_local_aqk(
    Aqk, do, dv,
    T, H, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_t, i_b, i_h, t0, o_i, m_row, tok, _, _ = _chunk_prologue(T, H, BT, 0)
    # b_at[j, i] = Aqk[row i, column j] for j ≤ i < n (a valid row i implies a valid column j ≤ i).
    m_at = (o_i[:, None] <= o_i[None, :]) & m_row[None, :]
    b_at = tl.load(Aqk + tok[None, :] * BT + o_i[:, None], mask=m_at, other=0.0)
    for i_v in range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_row[:, None] & (o_v < V)[None, :]
        p_v = tok[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_v, other=0.0)
        b_dv = mm(b_at, b_do, PREC)
        tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_v)


def dv_local_aqk(Aqk, do, *, chunk_size: int = 64, BV: int = 64, num_warps: int = 4,
                 num_stages: int = 2, out: torch.Tensor | None = None) -> torch.Tensor:
    """dv_local = A_qkᵀ dO per chunk from the forward's A_qk (FLA's Aqk convention, see above): Aqk
    [B,T,H,chunk_size] in do's dtype; returns [B,T,H,V] in do's dtype (into `out` when given, see
    `local.dv_local`). Entries with column > row are not read."""
    B, T, H, V = do.shape
    if tuple(Aqk.shape) != (B, T, H, chunk_size):
        raise ValueError(f"Aqk must be [B,T,H,chunk_size]={(B, T, H, chunk_size)}, got {tuple(Aqk.shape)}")
    if Aqk.dtype != do.dtype or Aqk.device != do.device:
        raise ValueError(f"Aqk must share do's dtype and device ({do.dtype}, {do.device}), got {Aqk.dtype}, "
                         f"{Aqk.device}")
    _check_tiles(chunk_size, 16, BV, num_warps, num_stages)
    Aqk, do = Aqk.contiguous(), do.contiguous()
    dv = _output_like(do, out)
    rewy_bwd_kernel_dv_local_aqk[(triton.cdiv(T, chunk_size), B * H)](
        Aqk, do, dv, T, H, V=V, BT=chunk_size, BV=BV, PREC=dot_precision(do.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return dv


# --------------------------------------------------------------------------------------------------
# Consumer (joint or separate), centred matrix intra with the sub-chunk fallback
# --------------------------------------------------------------------------------------------------
# Register budget. Triton lowers an fp32 "ieee" tl.dot to FMAs after loading each thread's whole rows of the
# left operand and columns of the right one into registers: a [C, C] × [C, BK] product at C = 64 holds
# ~400 values per thread and the consumer spilled 2.5 KB per thread on sm_90 (ncu: 15 M spill requests,
# 55 % of KDA's backward). So the intra products here never take a [C, C] register operand: H and D go to
# an fp32 scratch once per chunk, and every product walks the chunk in BC-row slices, each slice of H, Hᵀ,
# D, Dᵀ (a transposed load: no register transpose, FLA issue 640) and of the α/ζ-scaled operands loaded from
# memory (L1/L2) at the moment it is used.
@triton.jit
def _erase_rows(erase, tok_r, p_rk, m_rk, m_r, ERASE_VEC: tl.constexpr, BK: tl.constexpr):
    """Erase factor rows [R, BK] fp32: GDN2's b per channel, KDA's β broadcast over the feature tile."""
    if ERASE_VEC:
        b = tl.load(erase + p_rk, mask=m_rk, other=0.0).to(tl.float32)
    else:
        b = tl.load(erase + tok_r, mask=m_r, other=0.0).to(tl.float32)[:, None] + tl.zeros([1, BK], tl.float32)
    return b


@triton.jit
def _sub_rows(o, n_rows, i_b, T, t0, H, i_h, o_k, m_k, K: tl.constexpr):
    """Rows o of the chunk (chunk-local indices): valid mask, token index, [rows, BK] offsets and mask of the
    feature tile o_k."""
    m = o < n_rows
    tok = (i_b * T + t0 + o) * H + i_h
    return m, tok, tok[:, None] * K + o_k[None, :], m[:, None] & m_k[None, :]


@triton.jit
def _state_rowsum(S0, dS1, s_off, o_k, m_k, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                  S0_VK: tl.constexpr):
    """rowsum_V(S0 ⊙ dS1) over the feature tile's rows o_k, [BK] fp32, in a loop of its own: the consumer's inter
    products read S0 and dS1 as product operands only (`local._diagonal`). Summed inside the products' loop from loads
    of their own instead, K = V = 256 gave wrong dk on the H200 (session 35)."""
    b_frob = tl.zeros([o_k.shape[0]], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_sk = m_k[:, None] & (o_v < V)[None, :]
        if S0_VK:
            b_s0 = tl.load(S0 + s_off + o_k[:, None] + o_v[None, :] * K, mask=m_sk, other=0.0)
        else:
            b_s0 = tl.load(S0 + s_off + o_k[:, None] * V + o_v[None, :], mask=m_sk, other=0.0)
        b_ds1 = tl.load(dS1 + s_off + o_k[:, None] * V + o_v[None, :], mask=m_sk, other=0.0)
        b_frob += tl.sum(b_s0.to(tl.float32) * b_ds1.to(tl.float32), axis=1)
    return b_frob


@triton.jit(do_not_specialize=["T", "NT", "H", "n_tok", "c_off"])
def rewy_bwd_kernel_consumer_vector(
    q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, P, D, grange,
    dq, dk, dv, hd, dg, derase, dwrite, paths,
    T, NT, scale, n_tok, c_off,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
    ERASE_VEC: tl.constexpr, WRITE_VEC: tl.constexpr, JOINT: tl.constexpr,
    INTRA: tl.constexpr, MAX_RANGE: tl.constexpr, PREC: tl.constexpr, IPREC: tl.constexpr, KSPLIT: tl.constexpr,
    ONE_BETA: tl.constexpr, S0_VK: tl.constexpr, SHARED_HD: tl.constexpr, GN_LOAD: tl.constexpr,
    RANGE_IN: tl.constexpr, VSTAGES: tl.constexpr, ROWSUM_FIRST: tl.constexpr,
):
    # S0_VK: S0's storage is [V, K] per chunk (FLA's state_v_first h, kept by policy A); dS1's is [K, V].
    # KSPLIT > 1 (Schedule.consumer_k_split): this chunk's programs each run phase 1 and their share of phase 2's
    # feature tiles. dq, dk, dg and a vector erase path are per feature tile; dv and the write path come from part 0
    # alone; a scalar erase path (a sum over features) goes to fp32 parts that the launcher sums. SHARED_HD: they all
    # write the same H_< | D bits to one scratch (SHARED_HD_SCRATCH above), else each to its own.
    i_t, i_b, i_h, t0, o_i, m_row, tok, n_rows, is_last = _chunk_prologue(T, H, BT, c_off)
    i_bh = tl.program_id(1)
    i_ks = tl.program_id(2)
    s_off = ((i_b * NT + i_t) * H + i_h).to(tl.int64) * (K * V)
    r_off = ((i_b * NT + i_t) * H + i_h).to(tl.int64) * (2 * K)  # grange [B, NT, H, 2, K]
    DT = k.dtype.element_ty
    m_cc = m_row[:, None] & m_row[None, :]
    m_lt = (o_i[:, None] > o_i[None, :]) & m_cc
    blk = (o_i // BC) * BC
    NK: tl.constexpr = (K + BK - 1) // BK
    NC: tl.constexpr = BT // BC
    # H_< and D: rows of 2·BT fp32 in the scratch (H then D); the separate consumer reads D from the producer.
    HS: tl.constexpr = 2 * BT
    if KSPLIT > 1 and not SHARED_HD:  # one H_< | D scratch per program
        hd += i_ks * n_tok * HS
    if JOINT:
        d_base = hd + BT
        DS: tl.constexpr = 2 * BT
    else:
        d_base = D
        DS: tl.constexpr = BT

    if not WRITE_VEC:
        b_w = tl.load(write + tok, mask=m_row, other=0.0).to(tl.float32)
    if JOINT:
        b_at = tl.load(A + tok[None, :] * BT + o_i[:, None], mask=m_cc, other=0.0)

    b_D = tl.zeros([BT, BT], dtype=tl.float32)
    b_H = tl.zeros([BT, BT], dtype=tl.float32)
    b_dwr = tl.zeros([BT], dtype=tl.float32)  # KDA write path of β: ⟨V_i, P_i⟩
    b_der = tl.zeros([BT], dtype=tl.float32)  # KDA erase path of β

    # Phase 1, once per chunk: H = dO Rᵀ (and D = −P Rᵀ when joint), the self terms, dv and the write path.
    for i_v in tl.range(0, tl.cdiv(V, BV), num_stages=VSTAGES):  # Schedule.consumer_v_stages
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_rv = m_row[:, None] & m_v[None, :]
        p_v = tok[:, None] * V + o_v[None, :]
        b_do = tl.load(do + p_v, mask=m_rv, other=0.0)
        if JOINT:
            b_rb = tl.load(Rbar + p_v, mask=m_rv, other=0.0)
            b_p = mm(b_at.to(DT), b_rb.to(DT), PREC)
        else:
            b_p = tl.load(P + p_v, mask=m_rv, other=0.0).to(tl.float32)
        b_rt = tl.load(R + tok[None, :] * V + o_v[:, None], mask=m_v[:, None] & m_row[None, :], other=0.0)
        if JOINT:
            b_D += mm(b_p.to(DT), b_rt.to(DT), PREC)
        b_H += mm(b_do.to(DT), b_rt.to(DT), PREC)
        b_vv = tl.load(v + p_v, mask=m_rv, other=0.0).to(tl.float32)
        if KSPLIT == 1:
            m_out = m_rv
        else:  # dv and the write path: part 0 stores them
            m_out = m_rv & (i_ks == 0)
        if WRITE_VEC:
            b_wv = tl.load(write + p_v, mask=m_rv, other=0.0).to(tl.float32)
            tl.store(dv + p_v, (b_wv * b_p).to(dv.dtype.element_ty), mask=m_out)
            tl.store(dwrite + p_v, (b_vv * b_p).to(dwrite.dtype.element_ty), mask=m_out)
        else:
            b_dwr += tl.sum(b_vv * b_p, axis=1)
            tl.store(dv + p_v, (b_w[:, None] * b_p).to(dv.dtype.element_ty), mask=m_out)
    # ⟨dO_i, R_i⟩ (the self-term split) from H, not from the loaded tiles: those feed products only (`local._diagonal`)
    b_hd = _diagonal(b_H, o_i)
    p_hd = tok[:, None] * HS + o_i[None, :]
    tl.store(hd + p_hd, tl.where(m_lt, b_H, 0.0), mask=m_row[:, None])  # H_<: the diagonal enters elementwise
    if JOINT:
        tl.store(hd + p_hd + BT, tl.where(m_lt, -b_D, 0.0), mask=m_row[:, None])
    tl.debug_barrier()  # the slices below are read by other threads of this program

    # Phase 2, per feature tile (a run-time loop: one copy of the large body, whatever K / BK).
    if KSPLIT == 1:
        k_lo = 0
        k_hi = NK
    else:
        NKP: tl.constexpr = (NK + KSPLIT - 1) // KSPLIT
        k_lo = i_ks * NKP
        k_hi = tl.minimum(k_lo + NKP, NK)
    for i_k in range(k_lo, k_hi):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_rk = m_row[:, None] & m_k[None, :]
        p_rk = tok[:, None] * K + o_k[None, :]
        if ROWSUM_FIRST:  # rowsum_V(S0 ⊙ dS1) per key channel (STATE_ROWSUM_FIRST above)
            b_frob = _state_rowsum(S0, dS1, s_off, o_k, m_k, K, V, BV, S0_VK)

        # ---- intra contractions X_q, X_e, X_y, all [BT, BK] rows
        b_g = tl.load(G + p_rk, mask=m_rk, other=0.0).to(tl.float32)
        if RANGE_IN:  # the chunk's per-channel max and min of G, from the scan operands' kernel (RANGE_FROM_OPERANDS)
            b_max = tl.load(grange + r_off + o_k, mask=m_k, other=0.0)
            b_min = tl.load(grange + r_off + K + o_k, mask=m_k, other=0.0)
            b_c, delta = _centre_and_range(b_max, b_min, m_k)
        else:
            b_c, delta = _tile_range(b_g, m_row, m_k)
        use_centred = _use_centred(delta, INTRA, MAX_RANGE)
        tl.store(paths + (i_bh * NT + i_t) * NK + i_k, tl.where(use_centred, 1, 2))
        if use_centred:
            b_uq = tl.zeros([BT, BK], dtype=tl.float32)
            b_ue = tl.zeros([BT, BK], dtype=tl.float32)
            b_uy = tl.zeros([BT, BK], dtype=tl.float32)
            for i_c in range(0, NC):  # inner dimension of the four products, BC rows at a time
                o_j = i_c * BC + tl.arange(0, BC)
                m_j, tok_j, p_jk, m_jk = _sub_rows(o_j, n_rows, i_b, T, t0, H, i_h, o_k, m_k, K)
                b_cj = tl.where(m_jk, tl.load(G + p_jk, mask=m_jk, other=0.0) - b_c[None, :], 0.0)
                b_kj = tl.load(k + p_jk, mask=m_jk, other=0.0).to(tl.float32)
                b_qj = tl.load(q + p_jk, mask=m_jk, other=0.0).to(tl.float32)
                b_ej = _erase_rows(erase, tok_j, p_jk, m_jk, m_j, ERASE_VEC, BK)
                b_aj = tl.exp(b_cj)
                b_yj = b_kj * tl.exp(-b_cj)
                # H[:, J], D[:, J] (columns J of every row) and Hᵀ[:, J], Dᵀ[:, J] (rows J, loaded transposed).
                m_col = m_row[:, None] & m_j[None, :]
                m_up = (o_i[:, None] < o_j[None, :]) & m_col
                m_lo = (o_i[:, None] > o_j[None, :]) & m_col
                b_hc = tl.load(hd + tok[:, None] * HS + o_j[None, :], mask=m_lo, other=0.0)
                b_dc = tl.load(d_base + tok[:, None] * DS + o_j[None, :], mask=m_lo, other=0.0).to(tl.float32)
                b_hr = tl.load(hd + tok_j[None, :] * HS + o_i[:, None], mask=m_up, other=0.0)
                b_dr = tl.load(d_base + tok_j[None, :] * DS + o_i[:, None], mask=m_up, other=0.0).to(tl.float32)
                b_uq = tl.dot(b_hc, b_yj, b_uq, input_precision=IPREC)
                b_ue = tl.dot(b_dc, b_yj, b_ue, input_precision=IPREC)
                b_uy = tl.dot(b_hr, scale * b_qj * b_aj, b_uy, input_precision=IPREC)
                b_uy = tl.dot(b_dr, b_ej * b_kj * b_aj, b_uy, input_precision=IPREC)
            b_cr = tl.where(m_rk, b_g - b_c[None, :], 0.0)
            b_xq = tl.exp(b_cr) * b_uq
            b_xe = tl.exp(b_cr) * b_ue
            b_xy = tl.exp(-b_cr) * b_uy
        else:
            b_xq = tl.zeros([BT, BK], dtype=tl.float32)
            b_xe = tl.zeros([BT, BK], dtype=tl.float32)
            b_xy = tl.zeros([BT, BK], dtype=tl.float32)
            # Off-diagonal block pairs (I after J), anchored so that every exponent is ≤ 0 for g ≤ 0.
            for i_c in range(0, NC - 1):  # run-time loops: one copy of the four fp32 products (compile time)
                j0 = i_c * BC
                o_j = j0 + tl.arange(0, BC)
                m_j, tok_j, p_jk, m_jk = _sub_rows(o_j, n_rows, i_b, T, t0, H, i_h, o_k, m_k, K)
                b_gj = tl.load(G + p_jk, mask=m_jk, other=0.0)
                b_kj = tl.load(k + p_jk, mask=m_jk, other=0.0).to(tl.float32)
                # Column side anchor: the last row z of J.
                z = j0 + BC - 1
                b_gz = tl.load(G + ((i_b * T + t0 + z) * H + i_h) * K + o_k, mask=m_k & (z < n_rows), other=0.0)
                # (no row after J: ζ stays 0, so an unbounded exp(G_z - G) never meets a 0 product)
                m_rj = ((o_i >= j0) & (o_i <= z) & m_row & (z + 1 < n_rows))[:, None] & m_k[None, :]
                b_zr = tl.exp(tl.where(m_rj, b_gz[None, :] - b_g, float("-inf")))
                for i_i in range(i_c + 1, NC):
                    i0 = i_i * BC
                    o_ii = i0 + tl.arange(0, BC)
                    m_ii, tok_ii, p_ik, m_ik = _sub_rows(o_ii, n_rows, i_b, T, t0, H, i_h, o_k, m_k, K)
                    # Row side: rows of I against the columns of J, anchored at I's first row.
                    b_ga = tl.load(G + ((i_b * T + t0 + i0) * H + i_h) * K + o_k, mask=m_k & (i0 < n_rows),
                                   other=0.0)
                    b_yj = b_kj * tl.exp(tl.where(m_jk & (i0 < n_rows), b_ga[None, :] - b_gj, float("-inf")))
                    m_ri = (o_i >= i0) & (o_i < i0 + BC) & m_row
                    m_blk = m_ri[:, None] & m_j[None, :]
                    b_hc = tl.load(hd + tok[:, None] * HS + o_j[None, :], mask=m_blk, other=0.0)
                    b_dc = tl.load(d_base + tok[:, None] * DS + o_j[None, :], mask=m_blk, other=0.0).to(tl.float32)
                    b_al = tl.exp(tl.where(m_ri[:, None] & m_k[None, :], b_g - b_ga[None, :], float("-inf")))
                    b_xq += b_al * tl.dot(b_hc, b_yj, input_precision=IPREC)
                    b_xe += b_al * tl.dot(b_dc, b_yj, input_precision=IPREC)
                    # Column side: rows of J (as X_y rows) against the rows of I after them, anchored at z.
                    b_gi = tl.load(G + p_ik, mask=m_ik, other=0.0)
                    b_af = tl.exp(tl.where(m_ik, b_gi - b_gz[None, :], float("-inf")))
                    b_ki = tl.load(k + p_ik, mask=m_ik, other=0.0).to(tl.float32)
                    b_qi = tl.load(q + p_ik, mask=m_ik, other=0.0).to(tl.float32)
                    b_ei = _erase_rows(erase, tok_ii, p_ik, m_ik, m_ii, ERASE_VEC, BK)
                    m_bt = ((o_i >= j0) & (o_i <= z) & m_row)[:, None] & m_ii[None, :]
                    b_hr = tl.load(hd + tok_ii[None, :] * HS + o_i[:, None], mask=m_bt, other=0.0)
                    b_dr = tl.load(d_base + tok_ii[None, :] * DS + o_i[:, None], mask=m_bt, other=0.0).to(tl.float32)
                    b_u = tl.dot(b_hr, scale * b_qi * b_af, input_precision=IPREC)
                    b_u = tl.dot(b_dr, b_ei * b_ki * b_af, b_u, input_precision=IPREC)
                    b_xy += b_zr * b_u
            # Diagonal blocks, exact pairwise Λ: row i meets the row c = (its block start) + d of its own block.
            for d in range(0, BC):  # run-time loop: keeps compile time down (16 unrolled copies otherwise)
                o_c = blk + d
                m_c, tok_c, p_c, m_ck = _sub_rows(o_c, n_rows, i_b, T, t0, H, i_h, o_k, m_k, K)
                b_kc = tl.load(k + p_c, mask=m_ck, other=0.0).to(tl.float32)
                b_gc = tl.load(G + p_c, mask=m_ck, other=0.0)
                # Row side (c < i): X_q,i += H_ic k_c Λ_ic, X_e,i += D_ic k_c Λ_ic.
                m_ci = (o_c < o_i) & m_row
                b_lam = tl.exp(tl.where(m_ci[:, None] & m_k[None, :], b_g - b_gc, float("-inf")))
                b_hi = tl.load(hd + tok * HS + o_c, mask=m_ci, other=0.0)
                b_di = tl.load(d_base + tok * DS + o_c, mask=m_ci, other=0.0).to(tl.float32)
                b_xq += b_hi[:, None] * b_kc * b_lam
                b_xe += b_di[:, None] * b_kc * b_lam
                # Column side (c > i): X_y,i += Λ_ci (H_ci s q_c + D_ci e_c k_c).
                m_ic = (o_c > o_i) & m_c
                b_qc = tl.load(q + p_c, mask=m_ck, other=0.0).to(tl.float32)
                b_ec = _erase_rows(erase, tok_c, p_c, m_ck, m_c, ERASE_VEC, BK)
                b_lamt = tl.exp(tl.where(m_ic[:, None] & m_k[None, :], b_gc - b_g, float("-inf")))
                b_hc = tl.load(hd + tok_c * HS + o_i, mask=m_ic, other=0.0)
                b_dc = tl.load(d_base + tok_c * DS + o_i, mask=m_ic, other=0.0).to(tl.float32)
                b_xy += b_lamt * (b_hc[:, None] * scale * b_qc + b_dc[:, None] * b_ec * b_kc)

        # ---- inter (state) products of this feature tile over V
        b_pe = tl.zeros([BT, BK], dtype=tl.float32)  # P S0ᵀ (= −Ē_dir)
        b_qg = tl.zeros([BT, BK], dtype=tl.float32)  # Q̄_g = dO S0ᵀ
        b_kt = tl.zeros([BT, BK], dtype=tl.float32)  # K̄_t = R dS1ᵀ
        for i_v in tl.range(0, tl.cdiv(V, BV), num_stages=VSTAGES):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_rv = m_row[:, None] & m_v[None, :]
            p_v = tok[:, None] * V + o_v[None, :]
            b_r = tl.load(R + p_v, mask=m_rv, other=0.0)
            b_do = tl.load(do + p_v, mask=m_rv, other=0.0)
            if JOINT:
                # P tile recomputed per feature tile: 2n²·BV FLOPs instead of a P round trip through memory.
                b_rb = tl.load(Rbar + p_v, mask=m_rv, other=0.0)
                b_p = mm(b_at.to(DT), b_rb.to(DT), PREC)
            else:
                b_p = tl.load(P + p_v, mask=m_rv, other=0.0).to(tl.float32)
            p_s = s_off + o_k[None, :] * V + o_v[:, None]
            m_s = m_v[:, None] & m_k[None, :]
            if S0_VK:
                b_s0t = tl.load(S0 + s_off + o_v[:, None] * K + o_k[None, :], mask=m_s, other=0.0)
            else:
                b_s0t = tl.load(S0 + p_s, mask=m_s, other=0.0)
            b_ds1t = tl.load(dS1 + p_s, mask=m_s, other=0.0)
            b_pe += mm(b_p.to(DT), b_s0t.to(DT), PREC)
            b_qg += mm(b_do.to(DT), b_s0t.to(DT), PREC)
            b_kt += mm(b_r.to(DT), b_ds1t.to(DT), PREC)
        if not ROWSUM_FIRST:  # (STATE_ROWSUM_FIRST above)
            b_frob = _state_rowsum(S0, dS1, s_off, o_k, m_k, K, V, BV, S0_VK)

        # ---- chain rules of this feature tile
        b_q = tl.load(q + p_rk, mask=m_rk, other=0.0).to(tl.float32)
        b_k = tl.load(k + p_rk, mask=m_rk, other=0.0).to(tl.float32)
        b_ev = _erase_rows(erase, tok, p_rk, m_rk, m_row, ERASE_VEC, BK)
        if GN_LOAD:  # LAST_ROW_LOAD above
            b_gn = tl.load(G + ((i_b * T + t0 + n_rows - 1) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        else:
            b_gn = tl.sum(tl.where(is_last[:, None], b_g, 0.0), axis=0)
        b_gamma = tl.where(m_rk, tl.exp(b_g), 0.0)
        b_tau = tl.where(m_rk, tl.exp(b_gn[None, :] - b_g), 0.0)
        b_hs = (scale * b_hd)[:, None]
        b_dq = scale * b_gamma * b_qg + scale * b_xq + b_hs * b_k
        b_ge = b_xe - b_gamma * b_pe  # γ Ē_dir + X_e
        b_dk = b_ev * b_ge + b_xy + b_tau * b_kt + b_hs * b_q
        tl.store(dq + p_rk, b_dq.to(dq.dtype.element_ty), mask=m_rk)
        tl.store(dk + p_rk, b_dk.to(dk.dtype.element_ty), mask=m_rk)
        if ERASE_VEC:
            tl.store(derase + p_rk, (b_k * b_ge).to(derase.dtype.element_ty), mask=m_rk)
        else:
            b_der += tl.sum(b_k * b_ge, axis=1)
        # Ḡ per channel; the last row's tail term (τ_n = 1) cancels against its copy in Ḡ_n: both dropped (§8.2).
        b_tail = tl.where(is_last[:, None], 0.0, b_tau * b_k * b_kt)
        b_gb = (scale * b_gamma * b_q * b_qg + scale * b_q * b_xq + b_ev * b_k * b_ge
                - b_k * b_xy - b_tail)
        b_end = tl.sum(b_tail, axis=0) + tl.exp(b_gn) * b_frob
        b_gb += tl.where(is_last[:, None], b_end[None, :], 0.0)
        # dg: Ḡ's reverse in-chunk cumsum per channel, formed here (this program holds the chunk's rows of this tile)
        tl.store(dg + p_rk, tl.cumsum(tl.where(m_rk, b_gb, 0.0), axis=0, reverse=True), mask=m_rk)

    if not ERASE_VEC:
        if ONE_BETA:  # KDA's one β: the write path joins the erase path (part 0 carries it)
            if KSPLIT == 1:
                b_der += b_dwr
            elif i_ks == 0:
                b_der += b_dwr
        if KSPLIT > 1:  # this program's part of the sum over feature tiles (fp32 parts)
            derase += i_ks * n_tok
        tl.store(derase + tok, b_der.to(derase.dtype.element_ty), mask=m_row)
    if not WRITE_VEC and not ONE_BETA:
        if KSPLIT == 1:
            tl.store(dwrite + tok, b_dwr.to(dwrite.dtype.element_ty), mask=m_row)
        else:
            tl.store(dwrite + tok, b_dwr.to(dwrite.dtype.element_ty), mask=m_row & (i_ks == 0))


def consumer_split(k_split: int, K: int, BK: int, *, chunks: int, num_warps: int,
                   device: torch.device | None = None) -> tuple[int, int]:
    """(programs per chunk, feature tile) of the vector consumer. An explicit k_split, or auto without
    AUTO_NARROW_TILES: `local.programs_per_chunk` over the schedule's tile BK. Auto with AUTO_NARROW_TILES: the most
    programs per chunk s of 4 and 2 whose grid (s · chunks) fits one wave of the consumer's CTAs, the feature tile
    narrowed to K / s (not below NARROW_TILE_MIN) where BK would give fewer than s tiles; else one."""
    if k_split != 0 or not AUTO_NARROW_TILES:
        return programs_per_chunk(k_split, K, BK, chunks=chunks, num_warps=num_warps, device=device), BK
    for s in (4, 2):
        if 0 < s * chunks <= consumer_slots(num_warps, device):
            bk = min(BK, max(NARROW_TILE_MIN, triton.next_power_of_2(triton.cdiv(K, s))))
            return min(s, triton.cdiv(K, bk)), bk
    return 1, BK


def _check_vector_gate(G, shape) -> None:
    if G is None or tuple(G.shape) != tuple(shape):
        raise ValueError(f"G must be a vector gate of shape {tuple(shape)} for KDA/GDN2 kernels, "
                         f"got {None if G is None else tuple(G.shape)}")


def _intra_precision(name: str) -> str:
    """tl.dot precision of the fp32 intra products: "ieee" (FMA, exact fp32 products) or "tf32x3" (three
    tensor-core products of the split operands, ~fp32 accuracy, a fraction of the instructions). The
    Triton interpreter ignores it (numpy fp32 matmul), so only the GPU gate can tell them apart."""
    if name not in INTRA_PRECISIONS:
        raise ValueError(f"intra_precision must be one of {INTRA_PRECISIONS}, got {name!r}")
    return name


def _check_tiles(chunk_size, BK, BV, num_warps, num_stages) -> None:
    validate_chunk_size(chunk_size)
    validate_tile("BK", BK, hi=256)
    validate_tile("BV", BV, hi=256)
    validate_launch(num_warps, num_stages)


def consumer_vector(q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, *, scale: float, P=None, D=None,
                    chunk_size: int = 64, BK: int = 64, BV: int = 64, num_warps: int = 4, num_stages: int = 2,
                    intra: str = "auto", intra_precision: str = "ieee", k_split: int = 1, chunk_ranges=None,
                    dv_out=None, one_beta: bool = False, gate_range=None, v_stages: int = 0):
    """ReWY consumer for vector gates (§6.3–6.4, §7). Joint when P and D are None, separate otherwise. k_split:
    programs per chunk, each over its share of the feature tiles (at most one per tile; see the kernel).
    chunk_ranges, dv_out: as ``consumer_tma.consumer_tma``'s (Schedule.consumer_ranges: one launch per chunk range,
    each after the reverse scan's; dv written into a given buffer); the same bits as one launch. gate_range: the
    per-chunk, per-channel max and min of G, [B, NT, H, 2, K] fp32 (`scan_operands.gated_scan_operands(with_range=
    True)`), read by the range guard instead of reducing G's tile; None: reduced here. v_stages: software-pipeline
    depth of the two loops over V tiles (Schedule.consumer_v_stages; 0: num_stages, as the rest of the kernel).

    Returns (dq, dk, dv, dg, d_erase, d_write, paths): dq, dk, dv in the input dtypes; d_erase / d_write in
    the shapes and dtypes of erase / write (KDA: erase and write paths of β apart; GDN2: db, dw); dg fp32
    [B,T,H,K] (the gate's gradient: the reverse in-chunk cumsum of Ḡ, the cumulative gate's adjoint); paths int32
    [B·H, NT, cdiv(K, BK)]: 1 centred, 2 sub-chunk. one_beta (KDA, erase and write one β tensor): d_erase is
    the whole dβ and d_write None (no second [B,T,H] gradient for autograd to add).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    _check_vector_gate(G, (B, T, H, K))
    _check_tiles(chunk_size, BK, BV, num_warps, num_stages)
    if type(v_stages) is not int or v_stages not in CONSUMER_V_STAGES:
        raise ValueError(f"v_stages must be one of {CONSUMER_V_STAGES} (0: num_stages), got {v_stages!r}")
    if intra not in INTRA_CODES:
        raise ValueError(f"intra must be one of {tuple(INTRA_CODES)}, got {intra!r}")
    if tuple(erase.shape) not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"erase must be [B,T,H] or [B,T,H,K], got {tuple(erase.shape)}")
    if tuple(write.shape) not in ((B, T, H), (B, T, H, V)):
        raise ValueError(f"write must be [B,T,H] or [B,T,H,V], got {tuple(write.shape)}")
    for name, t in (("S0", S0), ("dS1", dS1)):
        if tuple(t.shape) != (B, NT, H, K, V):
            raise ValueError(f"{name} must have shape {(B, NT, H, K, V)}, got {tuple(t.shape)}")
    if gate_range is not None and (tuple(gate_range.shape) != (B, NT, H, 2, K) or gate_range.dtype != torch.float32
                                   or not gate_range.is_contiguous()):
        raise ValueError(f"gate_range must be a contiguous float32 [B, NT, H, 2, K]={(B, NT, H, 2, K)}, got "
                         f"{tuple(gate_range.shape)} {gate_range.dtype}")
    s0_vk = is_v_first(S0)
    S0, dS1 = (S0 if s0_vk else S0.contiguous()), dS1.contiguous()
    joint = P is None
    if joint != (D is None):
        raise ValueError("pass both P and D (separate consumer) or neither (joint consumer)")
    k_split, BK = consumer_split(k_split, K, BK, chunks=NT * B * H, num_warps=num_warps, device=q.device)
    NK = triton.cdiv(K, BK)
    shared_hd = SHARED_HD_SCRATCH and k_split > 1
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = output_buffer(dv_out, v, "dv_out")
    # H_< | D rows: one scratch per program of a chunk, or one the chunk's programs share (SHARED_HD_SCRATCH)
    hd = torch.empty(1 if shared_hd else k_split, B, T, H, 2 * chunk_size, dtype=torch.float32, device=q.device)
    dg = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
    if one_beta and not (erase.dim() == 3 and write.dim() == 3 and erase.dtype == write.dtype):
        raise ValueError("one_beta: erase and write must be one [B,T,H] β (KDA), got "
                         f"{tuple(erase.shape)} {erase.dtype} and {tuple(write.shape)} {write.dtype}")
    derase = torch.empty_like(erase)
    dwrite = None if one_beta else torch.empty_like(write)
    scalar_erase_parts = k_split > 1 and erase.dim() == 3
    derp = torch.empty(k_split, B, T, H, dtype=torch.float32, device=q.device) if scalar_erase_parts else derase
    paths = torch.empty(B * H, NT, NK, dtype=torch.int32, device=q.device)  # (every tile's program writes its flag)
    for c0, c1 in checked_ranges(chunk_ranges, NT):
        rewy_bwd_kernel_consumer_vector[(c1 - c0, B * H, k_split)](
            q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, P, D, G if gate_range is None else gate_range,
            dq, dk, dv, hd, dg, derp, dwrite, paths,
            T, NT, float(scale), B * T * H, c0,
            H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, BC=min(SUBCHUNK_ROWS, chunk_size),
            ERASE_VEC=erase.dim() == 4, WRITE_VEC=write.dim() == 4, JOINT=joint,
            INTRA=INTRA_CODES[intra], MAX_RANGE=CENTRED_MAX_RANGE, PREC=dot_precision(k.dtype),
            IPREC=_intra_precision(intra_precision), KSPLIT=k_split, ONE_BETA=one_beta, S0_VK=s0_vk,
            SHARED_HD=shared_hd, GN_LOAD=LAST_ROW_LOAD, RANGE_IN=gate_range is not None,
            VSTAGES=v_stages or num_stages, ROWSUM_FIRST=STATE_ROWSUM_FIRST, num_warps=num_warps,
            num_stages=num_stages,
        )
    if scalar_erase_parts:
        sum_row_parts(derp, None, None, derase, None, None)
    return dq, dk, dv, dg, derase, dwrite, paths


# --------------------------------------------------------------------------------------------------
# The whole vector-gate backward
# --------------------------------------------------------------------------------------------------
def rewy_backward_triton_vector(q, k, v, g, erase, write, A, do, dht, *, scale, initial_state, schedule: Schedule,
                                S0=None, R=None, G=None, Aqk=None, intra_paths: dict | None = None, W=None,
                                gate=None, one_beta=False, gate_grads: dict | None = None, scan_qk=None):
    """ReWY backward of KDA (erase = write = β [B,T,H]) / GDN2 (erase b [B,T,H,K], write w [B,T,H,V]) on Triton.

    Same contract as ``pipeline.rewy_backward_triton``: q, k [B,T,H,K]; v, do [B,T,H,V] (fp16/bf16/fp32);
    g [B,T,H,K] natural-log gate; A = M^{-1} [B,T,H,chunk_size]; dht, initial_state None or [B,H,K,V];
    S0 [B,NT,H,K,V] and R [B,T,H,V] for policy A; G the chunk cumsum of g (None: computed here); Aqk the
    forward's A_qk [B,T,H,chunk_size] in q's dtype (FLA's Aqk convention), required when
    ``schedule.dv_local_source == "forward"`` and not read otherwise; W the forward's W for policy A (None:
    recomputed). gate: KDA/GDN2's in-kernel gate (`gate.GateActivation`): g is its raw input, dg its gradient in g's
    dtype, and ``gate_grads`` (a dict, required with gate) receives "A_log" and "dt_bias" (see
    ``pipeline.rewy_backward_triton``). one_beta (KDA's one β as erase and write): d_erase is dβ and d_write None.
    ``intra_paths``: optional dict; receives ``"flags"``, the consumer's int32 per-tile path flags (1 centred,
    2 sub-chunk), with no host synchronisation. scan_qk: the forward's (qg, kg), see ``pipeline.rewy_backward_triton``.

    Returns (dq, dk, dv, dg, d_erase, d_write, dh0): dq, dk, dv in q's dtype; dg in g's dtype; d_erase, d_write
    in erase's / write's shapes and dtypes (KDA: dβ = d_erase + d_write); dh0 fp32 or None.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a rewy_tune.schedule.Schedule, got {type(schedule).__name__}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if g is None or tuple(g.shape) != (B, T, H, K):
        raise ValueError(f"g must be a vector gate [B,T,H,K]={(B, T, H, K)}, got "
                         f"{None if g is None else tuple(g.shape)}")
    if (S0 is None) != (R is None):
        raise ValueError("policy A passes both S0 and R; policy R passes neither")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims K={K}, V={V}: the Triton kernels support K, V <= {MAX_HEAD_DIM}")
    if q.dtype not in KERNEL_DTYPES or any(t.dtype != q.dtype for t in (k, v, do)):
        raise ValueError(f"q, k, v, do must share one dtype among float16, bfloat16, float32; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}, {do.dtype}")
    if tuple(A.shape) != (B, T, H, schedule.chunk_size):
        raise ValueError(f"A must be [B,T,H,chunk_size]={(B, T, H, schedule.chunk_size)}, got {tuple(A.shape)}")
    for name, t in (("initial_state", initial_state), ("dht", dht)):
        if t is not None and tuple(t.shape) != (B, H, K, V):
            raise ValueError(f"{name} must be [B,H,K,V]={(B, H, K, V)}, got {tuple(t.shape)}")
    schedule.validate_for(K, V)
    if schedule.dv_local_source == "scan":
        raise ValueError("schedule.dv_local_source='scan' (the reverse scan forms A_qk) is for scalar gates "
                         "(DeltaNet, GDN); KDA/GDN2 accept 'recompute' or 'forward'")
    from_forward = schedule.dv_local_source == "forward"
    if from_forward:
        if Aqk is None:
            raise ValueError("schedule.dv_local_source='forward' reads the forward's A_qk: pass Aqk "
                             f"[B,T,H,chunk_size]={(B, T, H, schedule.chunk_size)}")
        if tuple(Aqk.shape) != (B, T, H, schedule.chunk_size) or Aqk.dtype != q.dtype:
            raise ValueError(f"Aqk must be [B,T,H,chunk_size]={(B, T, H, schedule.chunk_size)} in {q.dtype}, got "
                             f"{tuple(Aqk.shape)} in {Aqk.dtype}")
    from .pipeline import run_stages

    def dv_local(q_, k_, G_, do_, *, scale, chunk_size, BK, BV, num_warps, num_stages, out=None):
        if from_forward:  # A_qk saved by the forward: q, k, G, scale and the feature tile BK are not read
            return dv_local_aqk(Aqk, do_, chunk_size=chunk_size, BV=BV, num_warps=num_warps, num_stages=num_stages,
                                out=out)
        return dv_local_vector(q_, k_, G_, do_, scale=scale, chunk_size=chunk_size, BK=BK, BV=BV,
                               num_warps=num_warps, num_stages=num_stages, intra=schedule.intra,
                               intra_precision=schedule.intra_precision, out=out)

    if gate is not None and not isinstance(gate_grads, dict):
        raise ValueError("gate_grads: the in-kernel gate's parameter gradients need a dict to go into")

    def consumer(*args, **kwargs):
        *grads, flags = consumer_vector(*args, intra=schedule.intra, intra_precision=schedule.intra_precision,
                                        k_split=schedule.consumer_k_split, one_beta=one_beta,
                                        v_stages=schedule.consumer_v_stages, **kwargs)
        if intra_paths is not None:
            intra_paths["flags"] = flags
        return grads

    dq, dk, dv, dg, d_erase, d_write, dh0 = run_stages(
        q, k, v, g, erase, write, A, do, dht, scale=scale, initial_state=initial_state, schedule=schedule, S0=S0,
        R=R, G=G, W=W, dv_local=dv_local, consumer=consumer, gate=gate, scan_qk=scan_qk,
        dv_local_reads_gate=not from_forward,
        scan_aqk=Aqk if from_forward and DV_LOCAL_IN_SCAN and S0 is not None else None)
    if gate is not None:  # dg is the activated gate's (fp32): through the activation to g, A_log and dt_bias
        dg, gate_grads["A_log"], gate_grads["dt_bias"] = gate_backward(g, gate, dg)
    return dq, dk, dv, dg, d_erase, d_write, dh0
