"""Serial state scans of the ReWY backward (rewy-math §3 forward recompute, §4 reverse scan).

Forward (policy R), per chunk:   R = U − W S0,   S1 = Γ_n S0 + K_tᵀ R            (K_t = K ⊙ τ)
Reverse, per chunk (c = N..1):   R̄ = dv_local + K_t dS1,   dS0 = Γ_n dS1 + Q_gᵀ dO − Wᵀ R̄   (Q_g = s Q ⊙ γ)

State tile. One program owns all K rows of a BV-wide column slice of the state ([BK ≥ K] × BV, fp32 in
registers). Columns of the state are independent in both scans, so the V split is free. A K split is not:
R = U − W S0 and R̄ = dv_local + K_t dS1 contract over all K rows every chunk, so K-slices would have to exchange
partial sums every step (a grid-wide barrier per chunk, or atomics) or recompute the other slices (which is
the unsplit scan). The scans therefore take BK ≥ K, and extra parallelism at small B·H comes from the V split
(BV down to 16) and from splitting the sequence (num_segments).

Sequence split (num_segments = NS > 1). Both chunk maps are affine in the carried state,
    forward   S1  = (Γ_n − K_tᵀW) S0  + K_tᵀU
    reverse   dS0 = (Γ_n − WᵀK_t) dS1 + (Q_gᵀdO − Wᵀdv_local),
and act on each state column independently. Phase 1 (parallel over segments): each segment scans from a
zero state to get its bias b_s, and from the K identity columns with the bias terms dropped to get its K×K
transfer matrix Ψ_s; both are plain columns of one augmented scan of width V + K, run by the same kernel.
Phase 2 (serial over segments, NS small steps): entering states X_{s+1} = Ψ_s X_s + b_s (reverse: from the
end). Phase 3 (parallel over segments): the ordinary scan of each segment from its true entering state,
storing the outputs. Latency ≈ 2·NT/NS chunk steps + NS small steps instead of NT steps, for ≈ (2 + K/V)×
the scan's FLOPs. Exact in exact arithmetic; in floating point it re-associates the state recursion
(Ψ_s products are contractions for |β k|² ≤ 2 and g ≤ 0, so errors do not grow).

State blocks. The K rows of the state tile are held as NB register blocks of KB = min(64, K) rows (K ≤ 64: one,
≤ 128: two, ≤ 256: four; with state_rows=128, Schedule.scan_state_rows, blocks of up to 128 rows: `schedule.state_blocks`),
so every per-step product is a [BT, KB] × [KB, BV] or [KB, BT] × [BT, BV] tile with
input-dtype operands and fp32 accumulation (tl.dot with the accumulator passed in). The scalar gate scales the
[BT, BV] rows (R, K dS, dO) instead of the [K, BT] operands: K_tᵀR = Kᵀ(diag(exp(G_n − G)) R), K_t dS =
diag(exp(G_n − G)) K dS, Q_gᵀdO = Qᵀ diag(s·exp(G)) dO — the same products up to rounding.

Compile report (ahead-of-time sm_90a, Triton 3.6 + its ptxas, bf16 inputs, K = V = 128, BT = 64, scalar gate,
4 warps, 2 stages; registers/spill-store bytes/shared bytes; per-chunk state storage fp32 | bf16; not a speed
measurement, only the H200 can give that). Compiled without a GPU launch's 16-byte alignment hints (session 12
found the gap): with them the BV 16 scans took 66 / 72 registers, no spills, 67 844 / 109 060 B of shared memory
(cp.async-pipelined tile loads), matching ncu on the H200. Since session 13 the forward scan subtracts its
products from U afterwards (U's tile pipelined too, S staged once for its store and its product): GDN 71
registers, 73 988 B; the 16-bit default's reverse scan is BV 32 at 3 stages: 132 registers, 177 160 B. Since
session 14 its forward scan is BV 32 at 4 stages (FLA's pick): DeltaNet 102 registers, 155 648 B; GDN 130,
156 428 B (one CTA per SM).

    kernel      BV   before (one 128-row tile)            after (two 64-row register blocks)
    fwd scan    16   255 / 0    / 20 740 | 255 / 0    / 22 788     255 / 0   / 10 500 | 255 / 0   / 10 500
    fwd scan    32   255 / 0    / 24 836 | 255 / 0    / 28 932     254 / 0   / 12 548 | 254 / 0   / 12 548
    fwd scan    64   255 / 780  / 33 028 | 255 / 744  / 41 220     255 / 0   / 16 644 | 255 / 0   / 16 644
    bwd scan    16   255 / 640  / 41 476 | 255 / 580  / 41 476     255 / 0   / 20 996 | 255 / 0   / 20 996
    bwd scan    32   255 / 968  / 49 668 | 255 / 944  / 49 668     255 / 0   / 25 092 | 255 / 4   / 25 092
    bwd scan    64   255 / 1696 / 66 052 | 255 / 1528 / 66 052     255 / 300 / 33 284 | 255 / 156 / 33 284
    combine  NS=4    BV 64: 255 / 112 / 196 608 (4 warps; 245 760 B at the launcher's default 3 stages on the
                     H200)                                         BV 16, 1 stage: 71-123 / 0 / 24 576 (NS 2-8)
All variants use wgmma (16 per fwd step, 24 per bwd step in the PTX). Open: the reverse scan still spills at
BV = 64 (and 4 B at BV = 32 with bf16 state storage); BV = 16 (the sm_90 default) and the forward scan are
spill-free. Block pointers (tl.make_block_ptr) for the tiles were tried and spilled more (fwd BV 64: 184 B).

Transposed operands (K_tᵀ, Wᵀ, Q_gᵀ) are loaded transposed from memory, never made with tl.trans in
registers (Triton 3.6 on Hopper miscompiles tl.trans of wgmma-layout values; FLA issue 640).

Vector gates (GATE 2) form K_t = K ⊙ exp(G_n − G) and Q_g = s·Q ⊙ exp(G) per element in the chunk loop, casting
them to the input dtype for the products. With ``pregated=True`` (GATE 3, Schedule.scan_operands "pregated") the
launchers take K_t for k and Q_g for q as `scan_operands.gated_scan_operands` formed them, with the same expressions,
and the loop loads G's last row only (Γ_n), at the top of each chunk step (EARLY_GATE_ROW): the same bits, fewer
loads and registers in the serial loop. GATE 4
(the reverse scan with ``q_scaled=False``, Schedule.scan_operands "forward"): q is fla-core's saved qg = Q ⊙ exp(G)
without s, and the scan scales dO by s before its Q_gᵀ dO product, as it does without a gate (GATE 0).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from rewy_tune.schedule import REVERSE_SCAN_LAYOUTS, REVERSE_SCAN_QDO, SCAN_STATE_ROWS, state_blocks

from .recompute import GATE_VECTOR, dot_precision, gate_kind, validate_chunk_size, validate_launch, validate_tile

# EARLY_GATE_ROW (pregated vector gates, GATE 3 and 4): both scans load Γ_n, the chunk's last gate row, at the top of
# each chunk step instead of right before the state update that multiplies by it. There the load sat in the step's
# serial chain: the sm_90 TTGIR shows a plain global load (not pipelined) between R̄ and the update's products, a
# memory latency every step, twice at K = 128. (FLA's reverse scan loads it first as well.) The same bits.
EARLY_GATE_ROW = True
# The kernels' GATE code for a vector gate whose scan operands K_t and Q_g were formed beforehand (scan_operands.py)
GATE_VECTOR_PREGATED = 3
# ... and whose Q_g comes without the scale s (fla-core's qg = Q ⊙ exp(G), kept by its save-all forward)
GATE_VECTOR_PREGATED_UNSCALED_Q = 4


@triton.jit
def _mma(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b with fp32 accumulation (PREC from dot_precision; "upcast" widens 16-bit operands)."""
    if PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _state_block_init(h_in, off, cols, is_bias, i_kb: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      VP: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, PHASE: tl.constexpr,
                      USE_IN: tl.constexpr):
    # Rows [i_kb·KB, i_kb·KB + KB) of the entering state (PHASE 0) or of the augmented identity (PHASE 1).
    o_k = i_kb * KB + tl.arange(0, KB)
    if PHASE == 0:
        if USE_IN:
            b = tl.load(h_in + off + o_k[:, None] * V + cols[None, :], mask=(o_k < K)[:, None] & is_bias[None, :],
                        other=0.0).to(tl.float32)
        else:
            b = tl.zeros([KB, BV], dtype=tl.float32)
    else:
        id_col = cols - VP
        is_id = (cols >= VP) & (id_col < K)
        b = tl.where(is_id[None, :] & (o_k[:, None] == id_col[None, :]), 1.0, 0.0).to(tl.float32)
    return b


@triton.jit
def _state_block_store(p, b, cols, m_col, ld: tl.constexpr, i_kb: tl.constexpr, K: tl.constexpr,
                       KB: tl.constexpr):
    o_k = i_kb * KB + tl.arange(0, KB)
    tl.store(p + o_k[:, None] * ld + cols[None, :], b.to(p.dtype.element_ty),
             mask=(o_k < K)[:, None] & m_col[None, :])


@triton.jit
def _state_blocks_init(h_in, off, cols, is_bias, K: tl.constexpr, V: tl.constexpr, VP: tl.constexpr,
                       KB: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr, PHASE: tl.constexpr,
                       USE_IN: tl.constexpr):
    # _state_block_init for each of the NB blocks; blocks past NB repeat the first and are never read
    b0 = _state_block_init(h_in, off, cols, is_bias, 0, K, V, VP, KB, BV, PHASE, USE_IN)
    b1, b2, b3 = b0, b0, b0
    if NB > 1:
        b1 = _state_block_init(h_in, off, cols, is_bias, 1, K, V, VP, KB, BV, PHASE, USE_IN)
    if NB > 2:
        b2 = _state_block_init(h_in, off, cols, is_bias, 2, K, V, VP, KB, BV, PHASE, USE_IN)
    if NB > 3:
        b3 = _state_block_init(h_in, off, cols, is_bias, 3, K, V, VP, KB, BV, PHASE, USE_IN)
    return b0, b1, b2, b3


@triton.jit
def _state_blocks_store(p, b0, b1, b2, b3, cols, m_col, ld: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
                        NB: tl.constexpr):
    # the state's first NB blocks to p (row stride ld)
    _state_block_store(p, b0, cols, m_col, ld, 0, K, KB)
    if NB > 1:
        _state_block_store(p, b1, cols, m_col, ld, 1, K, KB)
    if NB > 2:
        _state_block_store(p, b2, cols, m_col, ld, 2, K, KB)
    if NB > 3:
        _state_block_store(p, b3, cols, m_col, ld, 3, K, KB)


@triton.jit
def _transfer_store(X, i_bh, i_s, b0, b1, b2, b3, cols, is_bias, K: tl.constexpr, VP: tl.constexpr, NS: tl.constexpr,
                    KB: tl.constexpr, NB: tl.constexpr):
    # PHASE 1's output: segment i_s's end state [K, VP + K] (its bias columns, then the identity's image) in X[bh, s]
    XW: tl.constexpr = VP + K
    id_col = cols - VP
    m_x = is_bias | ((cols >= VP) & (id_col < K))
    _state_blocks_store(X + (i_bh * NS + i_s) * K * XW, b0, b1, b2, b3, cols, m_x, XW, K, KB, NB)


@triton.jit
def _last_gate_row(G, tok_last, i_kb: tl.constexpr, K: tl.constexpr, KB: tl.constexpr):
    # the chunk's last gate row G_n at state rows [i_kb·KB, i_kb·KB + KB), fp32
    o_k = i_kb * KB + tl.arange(0, KB)
    return tl.load(G + tok_last * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)


@triton.jit
def _early_gate_rows(G, tok_last, K: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, GATE: tl.constexpr,
                     EARLY_GN: tl.constexpr):
    # G_n per state block where EARLY_GN loads it at the top of a chunk step (pregated vector gates; else 1.0, unread).
    # Its exp is taken where the state update uses it, so that nothing waits for the loads before then; blocks past NB
    # repeat the first and are never read.
    b0, b1, b2, b3 = 1.0, 1.0, 1.0, 1.0
    if GATE >= 3 and EARLY_GN:
        b0 = _last_gate_row(G, tok_last, 0, K, KB)
        b1, b2, b3 = b0, b0, b0
        if NB > 1:
            b1 = _last_gate_row(G, tok_last, 1, K, KB)
        if NB > 2:
            b2 = _last_gate_row(G, tok_last, 2, K, KB)
        if NB > 3:
            b3 = _last_gate_row(G, tok_last, 3, K, KB)
    return b0, b1, b2, b3


@triton.jit
def _fwd_w_dot(acc, W, tok, m_row, b_s, i_kb: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
               PREC: tl.constexpr):
    # acc + W[:, block] · S[block]. S enters the product as the same cast value the per-chunk store writes (with
    # 16-bit states), so the compiler stages it in shared memory once for both (a negated operand needed its own
    # copy and two more CTA barriers per step).
    o_k = i_kb * KB + tl.arange(0, KB)
    b_w = tl.load(W + tok[:, None] * K + o_k[None, :], mask=m_row[:, None] & (o_k < K)[None, :], other=0.0)
    return _mma(b_w, b_s.to(W.dtype.element_ty), acc, PREC)


@triton.jit
def _fwd_state_update(b_s, k, G, tok, tok_last, m_row, b_rd, b_egl, b_gn, i_kb: tl.constexpr, K: tl.constexpr,
                      KB: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr, EARLY_GN: tl.constexpr):
    # S[block] ← Γ_n S[block] + K_t[:, block]ᵀ R, with K_tᵀ loaded transposed ([KB, BT]) from memory.
    # Scalar gate: b_rd already carries the row decay exp(G_n − G), b_egl = exp(G_n). GATE 3 (vector, pregated):
    # k is K_t already (`scan_operands.py`), only Γ_n is left (EARLY_GN: its G_n as b_gn, loaded at the step's top).
    o_k = i_kb * KB + tl.arange(0, KB)
    m_k = o_k < K
    m_kr = m_k[:, None] & m_row[None, :]
    b_ktt = tl.load(k + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0)
    if GATE == 1:
        b_s = b_s * b_egl
    elif GATE == 2:
        b_g = tl.load(G + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0).to(tl.float32)
        b_gl = tl.load(G + tok_last * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        # rows past T: mask the decay itself, exp(G_n − 0) may overflow and 0·inf is NaN.
        b_ktt = (b_ktt.to(tl.float32) * tl.where(m_kr, tl.exp(b_gl[:, None] - b_g), 0.0)).to(k.dtype.element_ty)
        b_s = b_s * tl.exp(b_gl)[:, None]
    elif GATE >= 3:
        if EARLY_GN:
            b_gl = b_gn
        else:
            b_gl = _last_gate_row(G, tok_last, i_kb, K, KB)
        b_s = b_s * tl.exp(b_gl)[:, None]
    return _mma(b_ktt, b_rd, b_s, PREC)


@triton.jit
def _bwd_k_dot(acc, k, G, tok, tok_last, m_row, b_ds, i_kb: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
               GATE: tl.constexpr, PREC: tl.constexpr):
    # acc + K[:, block] · dS[block]; vector gate: K_t = K ⊙ exp(G_n − G) per element (scalar gate: the caller
    # scales the rows of the sum instead; GATE 3: k is K_t already).
    o_k = i_kb * KB + tl.arange(0, KB)
    m_k = o_k < K
    m_rk = m_row[:, None] & m_k[None, :]
    b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0)
    if GATE == 2:
        b_g = tl.load(G + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        b_gl = tl.load(G + tok_last * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = (b_k.to(tl.float32) * tl.where(m_rk, tl.exp(b_gl[None, :] - b_g), 0.0)).to(k.dtype.element_ty)
    return _mma(b_k, b_ds.to(k.dtype.element_ty), acc, PREC)


@triton.jit
def _bwd_state_update(b_ds, q, W, G, tok, tok_last, m_row, b_dod, b_nrb, b_egl, b_gn, scale, i_kb: tl.constexpr,
                      K: tl.constexpr, KB: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr,
                      G_LOG2: tl.constexpr, EARLY_GN: tl.constexpr):
    # dS[block] ← Γ_n dS[block] + Q_g[:, block]ᵀ dO − W[:, block]ᵀ R̄, Q_gᵀ and Wᵀ loaded transposed.
    # b_dod: dO (scalar gate / no gate: rows already scaled by s·exp(G)); b_nrb = −R̄ (input dtype).
    # GATE 3 (vector, pregated): q is Q_g = s·Q ⊙ exp(G) already (`scan_operands.py`), only Γ_n is left; GATE 4: q
    # is Q ⊙ exp(G) (fla-core's qg) and b_dod carries s. G_LOG2 (GATE ≥ 3 only): G is fla-core's own chunk cumsum in
    # log2 units (G·log2 e), so Γ_n = exp2(G_n): the scan need not wait for the backward's chunk cumsum.
    # EARLY_GN (GATE ≥ 3): G_n comes as b_gn, loaded at the top of the step.
    o_k = i_kb * KB + tl.arange(0, KB)
    m_k = o_k < K
    m_kr = m_k[:, None] & m_row[None, :]
    b_qt = tl.load(q + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0)
    b_wt = tl.load(W + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0)
    if GATE == 1:
        b_ds = b_ds * b_egl
    elif GATE == 2:
        b_g = tl.load(G + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0).to(tl.float32)
        b_gl = tl.load(G + tok_last * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_qt = (b_qt.to(tl.float32) * (tl.exp(b_g) * scale)).to(q.dtype.element_ty)
        b_ds = b_ds * tl.exp(b_gl)[:, None]
    elif GATE >= 3:
        if EARLY_GN:
            b_gl = b_gn
        else:
            b_gl = _last_gate_row(G, tok_last, i_kb, K, KB)
        if G_LOG2:
            b_ds = b_ds * tl.exp2(b_gl)[:, None]
        else:
            b_ds = b_ds * tl.exp(b_gl)[:, None]
    b_ds = _mma(b_qt, b_dod, b_ds, PREC)
    return _mma(b_wt, b_nrb, b_ds, PREC)


@triton.jit
def _q_do_block(q, tok, m_row, b_dod, i_kb: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr):
    # Q[:, block]ᵀ b_dod [KB, BV] from a zero accumulator, Qᵀ loaded transposed
    o_k = i_kb * KB + tl.arange(0, KB)
    m_k = o_k < K
    b_qt = tl.load(q + tok[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_row[None, :], other=0.0)
    return _mma(b_qt, b_dod, tl.zeros([KB, b_dod.shape[1]], dtype=tl.float32), PREC)


@triton.jit
def _q_do_ahead(q, k, do, i_t, c0, i_b, i_h, T, H, cols, m_col, scale, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, HAS_DVL: tl.constexpr, PREC: tl.constexpr):
    # QDO_AHEAD: Qᵀ dO of chunk i_t per state block (none where i_t is before the range's first chunk c0), blocks past
    # NB repeating the first (never read), and with HAS_DVL 3 its dv_local = A_qkᵀ dO (else the first block stands in)
    m_row, tok = _reverse_chunk_rows(i_t, i_b, i_h, T, H, BT)
    m_row = m_row & (i_t >= c0)
    # dO as stored: a product operand straight from its pipelined shared-memory copy (a tile scaled in registers
    # would be staged again, and Triton 3.6 would wait for its product at once)
    b_do = tl.load(do + tok[:, None] * V + cols[None, :], mask=m_row[:, None] & m_col[None, :], other=0.0)
    b0 = _q_do_block(q, tok, m_row, b_do, 0, K, KB, PREC)
    b1, b2, b3, b_dvl = b0, b0, b0, b0
    if NB > 1:
        b1 = _q_do_block(q, tok, m_row, b_do, 1, K, KB, PREC)
    if NB > 2:
        b2 = _q_do_block(q, tok, m_row, b_do, 2, K, KB, PREC)
    if NB > 3:
        b3 = _q_do_block(q, tok, m_row, b_do, 3, K, KB, PREC)
    if HAS_DVL == 3:  # K Qᵀ is waited for (its mask is applied in registers); A_qkᵀ dO takes it as a register operand
        b_at = _kq_product(q, k, tok, m_row, BT, K, KB, NB, PREC)  # (Qᵀ: the tile the products above load)
        b_at = _aqk_from_kq(b_at, q, tok, m_row, tl.arange(0, BT), scale, 0, do.dtype.element_ty)  # (no gate: G
        b_dvl = _mma(b_at, b_do, tl.zeros([BT, b_do.shape[1]], dtype=tl.float32), PREC)  # unread, q stands in)
    return b0, b1, b2, b3, b_dvl


@triton.jit
def _w_state_update(b_ds, W, tok, m_row, b_nrb, i_kb: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
                    PREC: tl.constexpr):
    # dS[block] ← b_ds + W[:, block]ᵀ (−R̄), Wᵀ loaded transposed (b_ds: Γ_n dS + Q_gᵀ dO, formed by the caller)
    o_k = i_kb * KB + tl.arange(0, KB)
    m_k = o_k < K
    b_wt = tl.load(W + tok[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_row[None, :], other=0.0)
    return _mma(b_wt, b_nrb, b_ds, PREC)


@triton.jit(do_not_specialize=["T", "NT", "CPS", "SEG_OFFSET", "H"])
def rewy_fwd_scan_kernel(
    k, W, U, G, h_in, Hs, R, X,
    T, NT, CPS, SEG_OFFSET,
    H, K: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, NS: tl.constexpr,
    BT: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, PHASE: tl.constexpr, USE_H_IN: tl.constexpr, PREC: tl.constexpr, EARLY_GN: tl.constexpr,
):
    # PHASE 0: scan chunks of segment s from the entering state h_in[bh, s] (or zero), storing S0 and R.
    # PHASE 1: augmented transfer scan of segment s (columns < V: bias from zero; VP + j: identity column j),
    #          storing only the segment's end state into X[bh, s].
    # The state's K rows live in NB register blocks of KB rows (64, or 128: state_rows): b_s0 .. b_s3.
    i_c, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2) + SEG_OFFSET
    i_b, i_h = i_bh // H, i_bh % H
    cols = i_c * BV + tl.arange(0, BV)
    is_bias = cols < V
    dt = k.dtype.element_ty
    p_in = (i_bh * NS + i_s) * K * V
    b_s0, b_s1, b_s2, b_s3 = _state_blocks_init(h_in, p_in, cols, is_bias, K, V, VP, KB, NB, BV, PHASE, USE_H_IN)

    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NT)
    o_t = tl.arange(0, BT)
    for i_t in range(c0, c1):
        rows = i_t * BT + o_t
        m_row = rows < T
        tok = (i_b * T + rows) * H + i_h
        tok_last = (i_b * T + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
        if PHASE == 0:
            p_h = Hs + ((i_b * NT + i_t) * H + i_h) * K * V
            _state_blocks_store(p_h, b_s0, b_s1, b_s2, b_s3, cols, is_bias, V, K, KB, NB)
        m_rv = m_row[:, None] & is_bias[None, :]
        # R = U − W S0, one [BT, KB] × [KB, BV] product per state block, accumulated in fp32. U is added after the
        # products, not passed as their accumulator: the products then start without waiting for U's load, which
        # would otherwise sit in the serial chain of every step (session 13: FLA's scan adds v after its dot too).
        b_u = tl.load(U + tok[:, None] * V + cols[None, :], mask=m_rv, other=0.0)
        if GATE == 1:  # issued before the products for the same reason
            b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
            b_gl = tl.load(G + tok_last).to(tl.float32)
        b_gn0, b_gn1, b_gn2, b_gn3 = _early_gate_rows(G, tok_last, K, KB, NB, GATE, EARLY_GN)  # also issued first
        b_r = tl.zeros([BT, BV], dtype=tl.float32)
        b_r = _fwd_w_dot(b_r, W, tok, m_row, b_s0, 0, K, KB, PREC)
        if NB > 1:
            b_r = _fwd_w_dot(b_r, W, tok, m_row, b_s1, 1, K, KB, PREC)
        if NB > 2:
            b_r = _fwd_w_dot(b_r, W, tok, m_row, b_s2, 2, K, KB, PREC)
        if NB > 3:
            b_r = _fwd_w_dot(b_r, W, tok, m_row, b_s3, 3, K, KB, PREC)
        b_r = b_u.to(tl.float32) - b_r
        if PHASE == 0:
            tl.store(R + tok[:, None] * V + cols[None, :], b_r.to(R.dtype.element_ty), mask=m_rv)
        b_egl = 1.0
        if GATE == 1:
            # K_tᵀR = Kᵀ(diag(exp(G_n − G)) R): decay the [BT, BV] rows, not the [K, BT] operand.
            # rows past T: mask the decay itself, exp(G_n − 0) may overflow and 0·inf is NaN.
            b_r = b_r * tl.where(m_row, tl.exp(b_gl - b_g), 0.0)[:, None]
            b_egl = tl.exp(b_gl)
        b_rd = b_r.to(dt)
        b_s0 = _fwd_state_update(b_s0, k, G, tok, tok_last, m_row, b_rd, b_egl, b_gn0, 0, K, KB, GATE, PREC,
                                 EARLY_GN)
        if NB > 1:
            b_s1 = _fwd_state_update(b_s1, k, G, tok, tok_last, m_row, b_rd, b_egl, b_gn1, 1, K, KB, GATE, PREC,
                                     EARLY_GN)
        if NB > 2:
            b_s2 = _fwd_state_update(b_s2, k, G, tok, tok_last, m_row, b_rd, b_egl, b_gn2, 2, K, KB, GATE, PREC,
                                     EARLY_GN)
        if NB > 3:
            b_s3 = _fwd_state_update(b_s3, k, G, tok, tok_last, m_row, b_rd, b_egl, b_gn3, 3, K, KB, GATE, PREC,
                                     EARLY_GN)

    if PHASE == 1:
        _transfer_store(X, i_bh, i_s, b_s0, b_s1, b_s2, b_s3, cols, is_bias, K, VP, NS, KB, NB)


@triton.jit
def _cta_sync():
    # a CTA barrier as inline PTX: tl.debug_barrier in the chunk loop stops Triton 3.6's software pipeliner (the
    # sm_90 reverse scan's shared memory 176 128 -> 24 576 B: no tile prefetched); this one leaves it alone. Named
    # barrier 15, which Triton's own code does not use here (it syncs on barrier 0), all threads of the CTA.
    tl.inline_asm_elementwise("bar.sync 15; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _publish(p_count, PDL: tl.constexpr):
    # every thread's stores of the chunk (dS1, R̄) before one thread's release add to its count
    if PDL:
        _cta_sync()
    else:
        tl.debug_barrier()
    tl.atomic_add(p_count, 1, sem="release", scope="gpu")


@triton.jit
def _reverse_scan_program(SEG_OFFSET, H, NS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                          CARRY: tl.constexpr, IN_CARRY: tl.constexpr):
    """This program's (value tile, b, h, segment), its columns and their mask, and the offset of its entering state:
    segment s's in dh_in [BH, NS, K, V], or with CARRY (chunk ranges: two carry slots per state, used in turn; this
    launch reads slot s % 2 and writes the other) slot s % 2 of the carry, or for the first range (not IN_CARRY)
    dht [BH, K, V] itself."""
    i_c, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2) + SEG_OFFSET
    i_b, i_h = i_bh // H, i_bh % H
    cols = i_c * BV + tl.arange(0, BV)
    is_col = cols < V
    p_in = (i_bh * NS + i_s) * K * V
    if CARRY:
        if IN_CARRY:
            p_in = (i_bh * 2 + i_s % 2) * K * V
        else:
            p_in = i_bh * K * V
    return i_bh, i_b, i_h, i_s, cols, is_col, p_in


@triton.jit
def _reverse_chunk_rows(i_t, i_b, i_h, T, H, BT: tl.constexpr):
    """Rows of chunk i_t: their mask (past T) and token offsets (b, t, h) into [B, T, H, ...] tensors."""
    rows = i_t * BT + tl.arange(0, BT)
    return rows < T, (i_b * T + rows) * H + i_h


@triton.jit
def _kq_product(q, k, tok, m_row, BT: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr,
                PREC: tl.constexpr):
    # K Qᵀ [BT, BT] in fp32 over the state's NB blocks of KB features, Qᵀ loaded transposed (no tl.trans of a product)
    b_at = tl.zeros([BT, BT], dtype=tl.float32)
    for i_kb in tl.static_range(NB):
        o_k = i_kb * KB + tl.arange(0, KB)
        m_k = o_k < K
        b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)
        b_qt = tl.load(q + tok[None, :] * K + o_k[:, None], mask=m_k[:, None] & m_row[None, :], other=0.0)
        b_at = _mma(b_k, b_qt, b_at, PREC)
    return b_at


@triton.jit
def _aqk_from_kq(b_at, G, tok, m_row, o_t, scale, GATE: tl.constexpr, dt: tl.constexpr):
    # A_qkᵀ[j, i] = s Σ_f k_jf q_if Λ_ij for i ≥ j (Λ_ij = exp(G_i − G_j), 1 without a gate), in dt, from K Qᵀ: masked
    # before exponentiating, as `local.rewy_bwd_kernel_dv_local` forms it
    m_at = (o_t[:, None] <= o_t[None, :]) & m_row[:, None] & m_row[None, :]
    if GATE == 1:
        b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
        b_at = tl.where(m_at, b_at * tl.exp(tl.where(m_at, b_g[None, :] - b_g[:, None], 0.0)) * scale, 0.0)
    else:
        b_at = tl.where(m_at, b_at * scale, 0.0)
    return b_at.to(dt)


@triton.jit
def _qk_transposed(q, k, G, tok, m_row, o_t, scale, K: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr,
                   GATE: tl.constexpr, PREC: tl.constexpr):
    # A_qkᵀ [BT, BT] in k's dtype (HAS_DVL 3)
    b_at = _kq_product(q, k, tok, m_row, o_t.shape[0], K, KB, NB, PREC)
    return _aqk_from_kq(b_at, G, tok, m_row, o_t, scale, GATE, k.dtype.element_ty)


@triton.jit(do_not_specialize=["T", "NT", "CPS", "SEG_OFFSET", "H"])
def rewy_bwd_scan_kernel(
    q, k, W, G, do, dvl, dh_in, dS1, Rbar, dh0, X, carry, progress,
    scale, T, NT, CPS, SEG_OFFSET,
    H, K: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, NS: tl.constexpr,
    BT: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, PHASE: tl.constexpr, USE_DH_IN: tl.constexpr, HAS_DVL: tl.constexpr,
    STORE_DH0: tl.constexpr, PREC: tl.constexpr, CARRY: tl.constexpr, G_LOG2: tl.constexpr,
    IN_CARRY: tl.constexpr, PUBLISH: tl.constexpr, PDL: tl.constexpr, EARLY_GN: tl.constexpr,
    QDO_AHEAD: tl.constexpr = False,
):
    # PHASE 0: reverse scan of segment s from dh_in[bh, s] (gradient at the segment's end; zero if absent),
    #          storing dS1 per chunk, R̄, and dh0 for segment 0. CARRY (chunk ranges, one launch each from the
    #          last): carry is [BH, 2, K, V]; the launch leaves the state at the segment's start in slot (s - 1) % 2,
    #          the next launch's entering state. IN_CARRY: it enters from slot s % 2 of dh_in (the carry), else
    #          (the first range) from dh_in = dht [BH, K, V] itself (or zero).
    # HAS_DVL: 1 dvl is dv_local [B,T,H,V]; 2 dvl is the forward's A_qk [B,T,H,BT] (fla-core's Aqk: column j ≤ row i
    #          written) and each chunk step forms dv_local = A_qkᵀ dO itself, on the dO tile it loads anyway.
    #          3 (no gate or a scalar gate): no dvl; each chunk step forms A_qkᵀ = s·K Qᵀ ⊙ Λᵀ from its own q, k
    #          and G tiles, off the state's chain, then dv_local = A_qkᵀ dO (as `local.dv_local`'s kernel does).
    # PHASE 1: augmented transfer scan (bias columns from zero, identity columns without bias terms);
    #          stores the gradient at the segment's start into X[bh, s].
    # PUBLISH (PHASE 0; the consumer chases the scan, `reverse_state_scan_ranges(progress=)`): once a chunk's dS1
    #          and R̄ are stored, the program adds 1 to progress[bh, chunk] (int32, zeroed) with release semantics,
    #          at the top of the next chunk's step (so that the release need not wait for stores just issued; on the
    #          H200 that was slower still: session 33's timeline at DeltaNet A (1, 2048, 16) had the scan at 72.7 µs,
    #          session 32's add right after the stores 63.1, no publishing 49.2); the consumer of that chunk waits
    #          until all cdiv(V, BV) programs of its head have. PDL (on a GPU): the consumer is launched as this
    #          kernel's programmatic dependent, and may start once every program of this grid has started
    #          (griddepcontrol.launch_dependents here): a consumer CTA that waits never holds an SM a scan program
    #          still needs.
    # QDO_AHEAD (no gate; `reverse_state_scan(qdo="ahead")`): each step adds s·Qᵀ dO, whose products the step
    #          before formed for its chunk (b_x0 .. b_x3), and forms the next step's at its end from a zero
    #          accumulator and the loaded q and dO tiles: Triton then waits for them at the next step's first product,
    #          not before this one's −WᵀR̄. With HAS_DVL 3 the same for dv_local (b_dvl, from A_qk as a register
    #          operand; its K Qᵀ is waited for at the step's end, off the state's chain: formed a step earlier still,
    #          the tiles held for it took 300 KB).
    # The state's K rows live in NB register blocks of KB rows (64, or 128: state_rows): b_d0 .. b_d3.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i_bh, i_b, i_h, i_s, cols, is_bias, p_in = _reverse_scan_program(SEG_OFFSET, H, NS, K, V, BV, CARRY, IN_CARRY)
    dt = k.dtype.element_ty
    b_d0, b_d1, b_d2, b_d3 = _state_blocks_init(dh_in, p_in, cols, is_bias, K, V, VP, KB, NB, BV, PHASE, USE_DH_IN)

    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NT)
    o_t = tl.arange(0, BT)
    if QDO_AHEAD:  # the first step's Qᵀ dO (the range's last chunk), and with HAS_DVL 3 its dv_local
        b_x0, b_x1, b_x2, b_x3, b_dvl = _q_do_ahead(q, k, do, c1 - 1, c0, i_b, i_h, T, H, cols, is_bias, scale, K, V,
                                                    BT, KB, NB, HAS_DVL, PREC)
    for i_r in range(0, c1 - c0):
        i_t = c1 - 1 - i_r
        m_row, tok = _reverse_chunk_rows(i_t, i_b, i_h, T, H, BT)
        tok_last = (i_b * T + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
        if PHASE == 0:
            if PUBLISH:  # the chunk before (i_t + 1), whose stores had this chunk's loads and products to drain
                if i_r > 0:
                    _publish(progress + i_bh * NT + i_t + 1, PDL)
            p_d = dS1 + ((i_b * NT + i_t) * H + i_h) * K * V
            _state_blocks_store(p_d, b_d0, b_d1, b_d2, b_d3, cols, is_bias, V, K, KB, NB)
        m_rv = m_row[:, None] & is_bias[None, :]
        if HAS_DVL == 3 and not QDO_AHEAD:  # A_qkᵀ first: it reads no state, so its products need not wait for the
            b_at = _qk_transposed(q, k, G, tok, m_row, o_t, scale, K, KB, NB, GATE, PREC)  # chain's
        # G_n per state block (EARLY_GN), issued before the products, whose time then hides the loads' latency
        b_gn0, b_gn1, b_gn2, b_gn3 = _early_gate_rows(G, tok_last, K, KB, NB, GATE, EARLY_GN)
        # R̄ = dv_local + K_t dS1, one [BT, KB] × [KB, BV] product per state block
        # (with one 128-row block, state_rows=128, a zero accumulator plus dv_local would be folded into the
        # product's accumulator, whose load the pipeliner then leaves unpipelined: the zeros are not a constant there.
        # K ≤ 64 keeps its untouched code, timed as it is)
        b_rb = tl.zeros([BT, BV], dtype=tl.float32) * scale if KB > 64 else tl.zeros([BT, BV], dtype=tl.float32)
        b_rb = _bwd_k_dot(b_rb, k, G, tok, tok_last, m_row, b_d0, 0, K, KB, GATE, PREC)
        if NB > 1:
            b_rb = _bwd_k_dot(b_rb, k, G, tok, tok_last, m_row, b_d1, 1, K, KB, GATE, PREC)
        if NB > 2:
            b_rb = _bwd_k_dot(b_rb, k, G, tok, tok_last, m_row, b_d2, 2, K, KB, GATE, PREC)
        if NB > 3:
            b_rb = _bwd_k_dot(b_rb, k, G, tok, tok_last, m_row, b_d3, 3, K, KB, GATE, PREC)
        # dO and the gates are loaded after the products: loading them first (as the forward scan loads U) made
        # GDN's reverse scan slower on the H200, 55.8 -> 59.9 µs at (2, 2048, 16) (session 13, call 5)
        b_do = tl.load(do + tok[:, None] * V + cols[None, :], mask=m_rv, other=0.0)
        b_egl = 1.0
        if GATE == 1:
            b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
            b_gl = tl.load(G + tok_last).to(tl.float32)
            # K_t dS = diag(exp(G_n − G)) K dS and Q_gᵀdO = Qᵀ diag(s·exp(G)) dO: the gates scale [BT, BV] rows.
            # rows past T: mask the decay itself, exp(G_n − 0) may overflow and 0·inf is NaN.
            b_rb = b_rb * tl.where(m_row, tl.exp(b_gl - b_g), 0.0)[:, None]
            b_dod = (b_do.to(tl.float32) * (tl.exp(b_g) * scale)[:, None]).to(dt)
            b_egl = tl.exp(b_gl)
        elif GATE == 2 or GATE == 3:
            b_dod = b_do.to(dt)  # the vector gate (and s) scale Q_gᵀ per element
        else:
            b_dod = (b_do.to(tl.float32) * scale).to(dt)
        if HAS_DVL == 1:
            b_rb += tl.load(dvl + tok[:, None] * V + cols[None, :], mask=m_rv, other=0.0).to(tl.float32)
        elif HAS_DVL == 2:  # A_qk's whole rows (a row mask only: vectorised loads), then its columns j ≤ i (the
            # rest is unwritten); its transpose is the dot's view of a loaded tile, not of a dot result (FLA issue 640)
            b_a = tl.load(dvl + tok[:, None] * BT + o_t[None, :], mask=m_row[:, None], other=0.0)
            b_a = tl.where(o_t[None, :] <= o_t[:, None], b_a, 0.0).to(b_a.dtype)
            b_rb = _mma(tl.trans(b_a), b_do, b_rb, PREC)
        elif HAS_DVL == 3:
            if QDO_AHEAD:  # formed in the step before
                b_rb += b_dvl
            else:
                b_rb = _mma(b_at, b_do.to(dt), b_rb, PREC)
        if PHASE == 0:
            tl.store(Rbar + tok[:, None] * V + cols[None, :], b_rb.to(Rbar.dtype.element_ty), mask=m_rv)
        b_nrb = (-b_rb).to(dt)
        if QDO_AHEAD:  # (no gate: Q_gᵀ dO = s·Qᵀ dO)
            b_d0 = _w_state_update(b_d0 + b_x0 * scale, W, tok, m_row, b_nrb, 0, K, KB, PREC)
            if NB > 1:
                b_d1 = _w_state_update(b_d1 + b_x1 * scale, W, tok, m_row, b_nrb, 1, K, KB, PREC)
            if NB > 2:
                b_d2 = _w_state_update(b_d2 + b_x2 * scale, W, tok, m_row, b_nrb, 2, K, KB, PREC)
            if NB > 3:
                b_d3 = _w_state_update(b_d3 + b_x3 * scale, W, tok, m_row, b_nrb, 3, K, KB, PREC)
            # the next step's (chunk i_t − 1, none past the range's first)
            b_x0, b_x1, b_x2, b_x3, b_dvl = _q_do_ahead(q, k, do, i_t - 1, c0, i_b, i_h, T, H, cols, is_bias, scale,
                                                        K, V, BT, KB, NB, HAS_DVL, PREC)
        else:
            b_d0 = _bwd_state_update(b_d0, q, W, G, tok, tok_last, m_row, b_dod, b_nrb, b_egl, b_gn0, scale, 0, K,
                                     KB, GATE, PREC, G_LOG2, EARLY_GN)
            if NB > 1:
                b_d1 = _bwd_state_update(b_d1, q, W, G, tok, tok_last, m_row, b_dod, b_nrb, b_egl, b_gn1, scale, 1,
                                         K, KB, GATE, PREC, G_LOG2, EARLY_GN)
            if NB > 2:
                b_d2 = _bwd_state_update(b_d2, q, W, G, tok, tok_last, m_row, b_dod, b_nrb, b_egl, b_gn2, scale, 2,
                                         K, KB, GATE, PREC, G_LOG2, EARLY_GN)
            if NB > 3:
                b_d3 = _bwd_state_update(b_d3, q, W, G, tok, tok_last, m_row, b_dod, b_nrb, b_egl, b_gn3, scale, 3,
                                         K, KB, GATE, PREC, G_LOG2, EARLY_GN)

    if PHASE == 0:
        if PUBLISH:  # the range's first chunk, the loop's last
            _publish(progress + i_bh * NT + c0, PDL)
        if CARRY:
            if i_s > 0:  # fp32 as the registers hold it: the ranges give the unsplit scan's bits
                p_c = carry + (i_bh * 2 + (i_s - 1) % 2) * K * V
                _state_blocks_store(p_c, b_d0, b_d1, b_d2, b_d3, cols, is_bias, V, K, KB, NB)
        if STORE_DH0:
            if i_s == 0:
                p_0 = dh0 + i_bh * K * V
                _state_blocks_store(p_0, b_d0, b_d1, b_d2, b_d3, cols, is_bias, V, K, KB, NB)
    else:
        _transfer_store(X, i_bh, i_s, b_d0, b_d1, b_d2, b_d3, cols, is_bias, K, VP, NS, KB, NB)


# The reverse scan with the state kept transposed, dSᵀ [BV, K] (Schedule.reverse_scan_layout "vk"; scalar or no gate,
# PHASE 0 only: a split scan's transfer pass and combine stay with the kernel above, which has the same segments).
# Both products a chunk step chains through take their A operand from registers: R̄ᵀ = dSᵀ K_tᵀ, then
# dSᵀ ← Γ_n dSᵀ + (s·dO)ᵀ Q − R̄ᵀ W. The "kv" kernel's state and R̄ are B operands, staged in shared memory (a store, a
# fence and a CTA barrier each) every step; here neither is, and with K ≤ 128 the state is one register block, so a
# step chains three tensor-core products instead of six (sm_90, K = 128). Value tiles of 64 fill wgmma's M.
# The same products up to the order of their sums.


@triton.jit
def _vk_block_init(h_in, off, cols, is_col, i_kb: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr,
                   BV: tl.constexpr, USE_IN: tl.constexpr):
    # columns [i_kb·KB, i_kb·KB + KB) of the entering dSᵀ (from a [K, V] state; zero without one)
    o_k = i_kb * KB + tl.arange(0, KB)
    if USE_IN:
        b = tl.load(h_in + off + o_k[None, :] * V + cols[:, None], mask=is_col[:, None] & (o_k < K)[None, :],
                    other=0.0).to(tl.float32)
    else:
        b = tl.zeros([BV, KB], dtype=tl.float32)
    return b


@triton.jit
def _vk_block_store(p, b, cols, is_col, i_kb: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    # dSᵀ's columns of block i_kb into a [K, V] state at p
    o_k = i_kb * KB + tl.arange(0, KB)
    tl.store(p + o_k[None, :] * V + cols[:, None], b.to(p.dtype.element_ty), mask=is_col[:, None] & (o_k < K)[None, :])


@triton.jit
def _vk_blocks_store(p, b0, b1, cols, is_col, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr):
    # the state's first NB (≤ 2) transposed blocks to p [K, V]
    _vk_block_store(p, b0, cols, is_col, 0, K, V, KB)
    if NB > 1:
        _vk_block_store(p, b1, cols, is_col, 1, K, V, KB)


@triton.jit
def _vk_rbar_dot(acc, k, tok, m_row, b_d, i_kb: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr):
    # acc + dSᵀ[:, block] · K[:, block]ᵀ = (K dS)ᵀ, Kᵀ loaded transposed [KB, BT]
    o_k = i_kb * KB + tl.arange(0, KB)
    b_kt = tl.load(k + tok[None, :] * K + o_k[:, None], mask=(o_k < K)[:, None] & m_row[None, :], other=0.0)
    return _mma(b_d.to(k.dtype.element_ty), b_kt, acc, PREC)


@triton.jit
def _vk_state_update(b_d, q, W, tok, m_row, b_dot, b_nrbt, b_egl, i_kb: tl.constexpr, K: tl.constexpr,
                     KB: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr):
    # dSᵀ[:, block] ← Γ_n dSᵀ[:, block] + (s·dO)ᵀ Q[:, block] − R̄ᵀ W[:, block] (b_dot: dOᵀ with its columns scaled by
    # s, or s·exp(G) with a scalar gate; b_nrbt = −R̄ᵀ, both in the input dtype)
    o_k = i_kb * KB + tl.arange(0, KB)
    m_rk = m_row[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0)
    b_w = tl.load(W + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0)
    if GATE == 1:
        b_d = b_d * b_egl
    b_d = _mma(b_dot, b_q, b_d, PREC)
    return _mma(b_nrbt, b_w, b_d, PREC)


@triton.jit(do_not_specialize=["T", "NT", "CPS", "SEG_OFFSET", "H"])
def rewy_bwd_scan_vk_kernel(
    q, k, W, G, do, dvl, dh_in, dS1, Rbar, dh0, carry,
    scale, T, NT, CPS, SEG_OFFSET,
    H, K: tl.constexpr, V: tl.constexpr, NS: tl.constexpr,
    BT: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, USE_DH_IN: tl.constexpr, HAS_DVL: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr,
    CARRY: tl.constexpr, IN_CARRY: tl.constexpr,
):
    # rewy_bwd_scan_kernel's PHASE 0 (its segments, carry slots and outputs), the state as dSᵀ in NB register blocks
    # of [BV, KB] (KB ≤ 128). GATE 0 (none) or 1 (scalar); HAS_DVL 0 or 1 (dv_local read).
    i_bh, i_b, i_h, i_s, cols, is_col, p_in = _reverse_scan_program(SEG_OFFSET, H, NS, K, V, BV, CARRY, IN_CARRY)
    dt = k.dtype.element_ty
    b_d0 = _vk_block_init(dh_in, p_in, cols, is_col, 0, K, V, KB, BV, USE_DH_IN)
    b_d1 = b_d0  # never read where NB == 1
    if NB > 1:
        b_d1 = _vk_block_init(dh_in, p_in, cols, is_col, 1, K, V, KB, BV, USE_DH_IN)

    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NT)
    for i_r in range(0, c1 - c0):
        i_t = c1 - 1 - i_r
        m_row, tok = _reverse_chunk_rows(i_t, i_b, i_h, T, H, BT)
        p_d = dS1 + ((i_b * NT + i_t) * H + i_h) * K * V
        _vk_blocks_store(p_d, b_d0, b_d1, cols, is_col, K, V, KB, NB)
        m_vr = is_col[:, None] & m_row[None, :]
        # R̄ᵀ = dv_localᵀ + (K_t dS1)ᵀ
        b_rbt = tl.zeros([BV, BT], dtype=tl.float32)
        b_rbt = _vk_rbar_dot(b_rbt, k, tok, m_row, b_d0, 0, K, KB, PREC)
        if NB > 1:
            b_rbt = _vk_rbar_dot(b_rbt, k, tok, m_row, b_d1, 1, K, KB, PREC)
        b_dot = tl.load(do + tok[None, :] * V + cols[:, None], mask=m_vr, other=0.0).to(tl.float32)
        b_egl = 1.0
        if GATE == 1:
            tok_last = (i_b * T + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
            b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
            b_gl = tl.load(G + tok_last).to(tl.float32)
            # as the "kv" kernel: the gates scale R̄ᵀ's and dOᵀ's columns (tokens); past T the decay itself is masked
            b_rbt = b_rbt * tl.where(m_row, tl.exp(b_gl - b_g), 0.0)[None, :]
            b_dot = (b_dot * (tl.exp(b_g) * scale)[None, :]).to(dt)
            b_egl = tl.exp(b_gl)
        else:
            b_dot = (b_dot * scale).to(dt)
        if HAS_DVL:
            b_rbt += tl.load(dvl + tok[None, :] * V + cols[:, None], mask=m_vr, other=0.0).to(tl.float32)
        tl.store(Rbar + tok[None, :] * V + cols[:, None], b_rbt.to(Rbar.dtype.element_ty), mask=m_vr)
        b_nrbt = (-b_rbt).to(dt)
        b_d0 = _vk_state_update(b_d0, q, W, tok, m_row, b_dot, b_nrbt, b_egl, 0, K, KB, GATE, PREC)
        if NB > 1:
            b_d1 = _vk_state_update(b_d1, q, W, tok, m_row, b_dot, b_nrbt, b_egl, 1, K, KB, GATE, PREC)

    if CARRY:
        if i_s > 0:
            p_c = carry + (i_bh * 2 + (i_s - 1) % 2) * K * V
            _vk_blocks_store(p_c, b_d0, b_d1, cols, is_col, K, V, KB, NB)
    if STORE_DH0:
        if i_s == 0:
            p_0 = dh0 + i_bh * K * V
            _vk_blocks_store(p_0, b_d0, b_d1, cols, is_col, K, V, KB, NB)


@triton.jit
def _combine_first_block(h_first, h_dst, i_bh, cols, m_c, ib: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         KB: tl.constexpr, BV: tl.constexpr, USE_FIRST: tl.constexpr):
    # rows [ib·KB, ib·KB + KB) of the first segment's entering state (h0 / dht, or zero), stored and returned
    o_f = ib * KB + tl.arange(0, KB)
    m_f = (o_f < K)[:, None] & m_c[None, :]
    if USE_FIRST:
        b_f = tl.load(h_first + i_bh * K * V + o_f[:, None] * V + cols[None, :], mask=m_f, other=0.0)
        b_f = b_f.to(tl.float32)
    else:
        b_f = tl.zeros([KB, BV], dtype=tl.float32)
    tl.store(h_dst + o_f[:, None] * V + cols[None, :], b_f, mask=m_f)
    return b_f


@triton.jit
def _combine_next_block(p_x, p_dst, cols, m_c, b0, b1, b2, b3, ib: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        XW: tl.constexpr, VP: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, PREC: tl.constexpr):
    # rows [ib·KB, ib·KB + KB) of the next entering state: the bias rows plus Σ_j Ψ[ib, j] · state block j, summed in
    # block order j (the same bits at any number of stages); stored and returned
    o_i = ib * KB + tl.arange(0, KB)
    m_i = o_i < K
    m_ic = m_i[:, None] & m_c[None, :]
    acc = tl.load(p_x + o_i[:, None] * XW + cols[None, :], mask=m_ic, other=0.0)
    for jb in tl.static_range(NB):
        o_j = jb * KB + tl.arange(0, KB)
        b_t = tl.load(p_x + o_i[:, None] * XW + VP + o_j[None, :], mask=m_i[:, None] & (o_j < K)[None, :],
                      other=0.0)
        if jb == 0:
            acc = _mma(b_t, b0, acc, PREC)
        elif jb == 1:
            acc = _mma(b_t, b1, acc, PREC)
        elif jb == 2:
            acc = _mma(b_t, b2, acc, PREC)
        else:
            acc = _mma(b_t, b3, acc, PREC)
    tl.store(p_dst + o_i[:, None] * V + cols[None, :], acc, mask=m_ic)
    return acc


@triton.jit(do_not_specialize=["H"])
def rewy_segment_combine_carry_kernel(
    X, h_first, h_in,
    H, K: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, NS: tl.constexpr,
    KB: tl.constexpr, NB: tl.constexpr, BV: tl.constexpr, USE_FIRST: tl.constexpr, REVERSE: tl.constexpr,
    PREC: tl.constexpr,
):
    # Serial over segments: entering state of each segment from its neighbour's transfer matrix and bias.
    # forward: h_in[0] = h0,  h_in[s+1] = Ψ_s h_in[s] + b_s;  reverse: h_in[NS-1] = dht, h_in[s-1] = Φ_s h_in[s] + b_s.
    # Tiles are [KB, KB] blocks of Ψ times [KB, BV] blocks of the entering state, which is carried in registers
    # (NB ≤ 4 blocks): shared memory is then (KB² + (NB + 1)·KB·BV)·4 B at one stage, at any K, instead of the K×K
    # transfer matrix. A step's loads (Ψ_s and b_s) depend only on the segment index, so the loop's num_stages > 1
    # prefetches the next segments' Ψ tiles (cp.async) while this one multiplies. (Until session 23 a kernel that
    # re-read the state from h_in after a CTA barrier did this, 1.2-3.5 µs slower per launch on the H200.)
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    XW: tl.constexpr = VP + K
    cols = i_c * BV + tl.arange(0, BV)
    m_c = cols < V
    p_first = h_in + (i_bh * NS + (NS - 1 if REVERSE else 0)) * K * V
    b0 = _combine_first_block(h_first, p_first, i_bh, cols, m_c, 0, K, V, KB, BV, USE_FIRST)
    b1 = b0  # blocks past NB are never read (_combine_next_block's static jb < NB)
    b2 = b0
    b3 = b0
    if NB > 1:
        b1 = _combine_first_block(h_first, p_first, i_bh, cols, m_c, 1, K, V, KB, BV, USE_FIRST)
    if NB > 2:
        b2 = _combine_first_block(h_first, p_first, i_bh, cols, m_c, 2, K, V, KB, BV, USE_FIRST)
    if NB > 3:
        b3 = _combine_first_block(h_first, p_first, i_bh, cols, m_c, 3, K, V, KB, BV, USE_FIRST)
    for i in range(0, NS - 1):
        if REVERSE:
            s_src = NS - 1 - i
            s_dst = s_src - 1
        else:
            s_src = i
            s_dst = i + 1
        p_x = X + (i_bh * NS + s_src) * K * XW
        p_dst = h_in + (i_bh * NS + s_dst) * K * V
        n0 = _combine_next_block(p_x, p_dst, cols, m_c, b0, b1, b2, b3, 0, K, V, XW, VP, KB, NB, PREC)
        n1 = n0
        n2 = n0
        n3 = n0
        if NB > 1:
            n1 = _combine_next_block(p_x, p_dst, cols, m_c, b0, b1, b2, b3, 1, K, V, XW, VP, KB, NB, PREC)
        if NB > 2:
            n2 = _combine_next_block(p_x, p_dst, cols, m_c, b0, b1, b2, b3, 2, K, V, XW, VP, KB, NB, PREC)
        if NB > 3:
            n3 = _combine_next_block(p_x, p_dst, cols, m_c, b0, b1, b2, b3, 3, K, V, XW, VP, KB, NB, PREC)
        b0, b1, b2, b3 = n0, n1, n2, n3


def _check_scan_args(K, V, chunk_size, BK, BV, num_warps, num_stages, state_dtype, num_segments, dtype):
    validate_chunk_size(chunk_size)
    validate_tile("BK", BK, hi=256, covers=K)
    validate_tile("BV", BV, hi=256)
    validate_launch(num_warps, num_stages)
    if state_dtype not in (torch.float32, dtype):
        raise ValueError(f"state_dtype must be torch.float32 or the input dtype {dtype}, got {state_dtype}")
    if not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"num_segments must be a positive int, got {num_segments!r}")


# Rows per state register block of both scans ("kv" layout, every gate form; Schedule.scan_state_rows): 64 as FLA's
# kernels hold them, or 128. At K = 128 one block makes each reverse chunk step three tensor-core products (K_t dS,
# Q_gᵀ dO, Wᵀ R̄, each m64 x k128 or m128 x k64) instead of six, each waited for and fenced once, and each forward step
# two (W S, K_tᵀ R) instead of four. sm_90 loop bodies (`benchmarks/compile_times.py --schedule FILE`), no hazards in
# any: DeltaNet A's reverse scan 6 -> 3 product waits, MEMBARs and proxy fences, 498 -> 530 instructions, 104 -> 128
# registers; KDA/GDN2 A 7 -> 4 waits (212 -> 225 registers), R 6 -> 3; the forward scans under R 4 -> 2 (DeltaNet 362
# -> 360 instructions). Timed on an H100 in session 38 (`scan_bench.py`, profile variants "rows128*"): DeltaNet's sm_90
# default takes 128 rows; the other operators' keep 64. The rows allowed: schedule.SCAN_STATE_ROWS.


def _check_state_rows(state_rows) -> None:
    if type(state_rows) is not int or state_rows not in SCAN_STATE_ROWS:
        raise ValueError(f"state_rows must be one of {SCAN_STATE_ROWS} (rows per register block of the state), "
                         f"got {state_rows!r}")


# Value tile of the segment-combine kernel, independent of the scans' BV: 16 columns keep it at ~100 registers
# without spills (BV = 64 spilled) and its shared memory at 24 KiB (sm_90, K = 128).
COMBINE_BV = 16


# Pipeline stages of the segment combine (rewy_segment_combine_carry_kernel), at least 1. benchmarks/combine_bench.py
# on the H200 (session 22), µs per launch at K = 128, the reload kernel it replaced / 1, 2, 3 stages, the same bits:
# B·H 4, NS 4: 9.13 / 7.77 / 7.44 / 7.72; NS 8: 18.90 / 15.95 / 15.43 / 15.12; B·H 16, NS 4: 9.34 / 8.42 / 8.14 /
# 8.17. Two stages (143 KB, against 209 KB at three, which would keep a scan CTA of the side stream off the SM).
# End to end (session 23, rewy-tune bench, policy A): KDA (1, 512, 4) 0.0952 -> 0.0916 ms, (1, 2048, 4) 0.1576 ->
# 0.1530; GDN2 0.0977 -> 0.0926, 0.1643 -> 0.1589.
COMBINE_CARRY_STAGES = 2


def combine_carry_shared_memory(K: int, stages: int) -> int:
    """Shared-memory bytes of rewy_segment_combine_carry_kernel, exact for the sm_90 compiles at K = 64, 128, 256
    and one to three stages (K = 128: 28 672 B at one stage, 143 360 at two, 208 896 at three): one [KB, KB] Ψ
    block at one stage, else all NB² of a step per stage, plus NB + 1 fp32 [KB, BV] tiles (the state blocks as dot
    operands and the bias)."""
    KB, NB = state_blocks(K)
    psi = KB * KB if stages <= 1 else stages * NB * NB * KB * KB
    return (psi + (NB + 1) * KB * COMBINE_BV) * 4


@functools.lru_cache(maxsize=None)
def _cuda_smem(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def combine_carry_stages(K: int, device: torch.device, stages: int | None = None) -> int:
    """The combine kernel's stages for head dim K on `device` (stages None: COMBINE_CARRY_STAGES): the most ≤ stages
    whose shared memory fits the device's opt-in limit, at least one."""
    stages = max(1, COMBINE_CARRY_STAGES if stages is None else stages)
    if stages == 1 or device.type != "cuda":
        return stages
    limit = _cuda_smem(device.index if device.index is not None else torch.cuda.current_device())
    while stages > 1 and combine_carry_shared_memory(K, stages) > limit:
        stages -= 1
    return stages


def _segment_combine(X, first, h_in, *, H, K, V, VP, NS, reverse, prec, num_warps):
    """Entering states h_in [B·H, NS, K, V] of every segment from their transfer matrices and biases X. The combine
    takes its own register blocks (`state_blocks` at 64 rows), whatever the scans' (state_rows): its shared memory is
    sized from them (`combine_carry_shared_memory`)."""
    KB, NB = state_blocks(K)
    grid = (triton.cdiv(V, COMBINE_BV), h_in.shape[0])
    args = dict(H=H, K=K, V=V, VP=VP, NS=NS, KB=KB, NB=NB, BV=COMBINE_BV, USE_FIRST=first is not None,
                REVERSE=reverse, PREC=prec, num_warps=num_warps)
    rewy_segment_combine_carry_kernel[grid](X, first, h_in, num_stages=combine_carry_stages(K, h_in.device), **args)


# A segment spans at least this many chunks. Latency ≈ 2·NT/NS + NS chunk steps is lowest near NS = sqrt(2·NT),
# i.e. at most NT/2 for NT ≥ 8, and a one-chunk segment's transfer buffer ([K, V + K] fp32) is twice the state it
# stands for: at T = 512 (eight chunks) the eight one-chunk segments of the KDA/GDN2 H200 default put KDA's peak
# backward memory 1-2 MiB above FLA's (benchmarks/RESULTS.md, session 5).
MIN_SEGMENT_CHUNKS = 2


# A split that the occupancy limit cuts to fewer segments than this is dropped: by the latency model above, two
# segments (NT + 2 chunk steps, plus two extra launches) never beat one.
MIN_CAPPED_SEGMENTS = 3
# Under an occupancy limit (Schedule.scan_split_waves > 0) a split must also pay by the latency model: 2·CPS + NS
# chunk steps plus this many for the two extra launches and the combine, against NT unsplit. GDN at (1, 512, 4)
# (eight chunks, split 4 / 4 of two chunks: 8 + 4 steps against 8) ran 1.08× FLA unsplit and 0.90× split
# (benchmarks/RESULTS.md, session 8); at 32 chunks and more the split won.
SPLIT_OVERHEAD_STEPS = 4
# The rule above was measured on scalar-gate scans. Vector-gate scans (KDA, GDN2) do more work per chunk step, and
# there the split paid even where the rule forbids it: KDA at (1, 512, 4), 4 / 4 segments of two chunks, ran 0.64x
# FLA split (session 7) and 0.54x unsplit (session 11); GDN2 0.67x and 0.58x (benchmarks/RESULTS.md). They take
# the occupancy limit only, which at B·H = 32 (four reverse segments instead of eight) made KDA 6 % faster.
VECTOR_SPLIT_OVERHEAD_STEPS = None
# The SM count the occupancy limit assumes for tensors that are not on a GPU (the Triton interpreter): small, so that
# the CPU tests see the limit both cut and keep a split.
INTERPRETER_SMS = 8


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The SM count of the tensors' GPU; INTERPRETER_SMS for tensors on the CPU (the Triton interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def split_program_limit(waves: int, device: torch.device) -> int:
    """Most programs a sequence-split scan grid may have under `Schedule.scan_split_waves` (0: no limit): waves × the
    device's SM count. A split scan does about twice a plain scan's work (transfer matrices, then the re-scan),
    so it pays only where the plain scan's grid leaves most SMs idle (small B·H, as in GDN's (1, 8192, 4)); at
    B·H = 32 the same split made GDN's backward 1.4x slower on the H200 (benchmarks/RESULTS.md, session 7)."""
    if waves <= 0:
        return 0
    return waves * device_sms(device)


def _gate_code(gk: int, pregated: bool, q_scaled: bool = True) -> int:
    """The kernels' GATE constexpr: gate_kind's, or 3 for a vector gate whose K_t and Q_g come pregated (4: Q_g
    without the scale s, q_scaled False)."""
    for name, val in (("pregated", pregated), ("q_scaled", q_scaled)):
        if not isinstance(val, bool):
            raise TypeError(f"{name} must be a bool, got {type(val).__name__}")
    if not pregated:
        if not q_scaled:
            raise ValueError("q_scaled=False describes a pregated Q_g: pass pregated=True with it")
        return gk
    if gk != GATE_VECTOR:
        raise ValueError("pregated=True needs a vector gate G [B,T,H,K] (K_t and Q_g are per key channel), got "
                         + ("no G" if gk == 0 else "a scalar gate G [B,T,H]"))
    return GATE_VECTOR_PREGATED if q_scaled else GATE_VECTOR_PREGATED_UNSCALED_Q


def _split_overhead(gk: int) -> int | None:
    return VECTOR_SPLIT_OVERHEAD_STEPS if gk == GATE_VECTOR else SPLIT_OVERHEAD_STEPS


def _segments(NT: int, num_segments: int, programs: int = 1, max_programs: int = 0,
              overhead_steps: int | None = SPLIT_OVERHEAD_STEPS) -> tuple[int, int]:
    """(segments actually used, chunks per segment): at most num_segments, each of at least MIN_SEGMENT_CHUNKS
    chunks (one segment when NT is smaller), none empty. With max_programs > 0 (a `split_program_limit`), also at
    most max_programs // programs segments (programs: the grid of one segment), none when that limit leaves
    fewer than MIN_CAPPED_SEGMENTS, and none unless 2·CPS + NS + overhead_steps < NT (the split pays; None: no
    such rule, as for vector gates)."""
    if max_programs > 0 and num_segments > 1:
        fit = max_programs // max(1, programs)
        if fit < num_segments:
            num_segments = fit if fit >= MIN_CAPPED_SEGMENTS else 1
    cps = triton.cdiv(NT, max(1, min(num_segments, NT // MIN_SEGMENT_CHUNKS)))
    ns = triton.cdiv(NT, cps)
    if max_programs > 0 and ns > 1 and overhead_steps is not None and 2 * cps + ns + overhead_steps >= NT:
        return 1, NT
    return ns, cps


def forward_state_scan(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    *,
    chunk_size: int = 64,
    BK: int = 128,
    BV: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    state_dtype: torch.dtype = torch.float32,
    num_segments: int = 1,
    split_max_programs: int = 0,
    pregated: bool = False,
    state_rows: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy-R forward state pass. Returns (S0 per chunk [B,NT,H,K,V] in state_dtype, R [B,T,H,V] in k's dtype).

    k, W [B,T,H,K]; U [B,T,H,V]; G None | [B,T,H] | [B,T,H,K] (fp32, natural log, chunk-local cumsum);
    initial_state None | [B,H,K,V]. Grid: cdiv(V,BV) × B·H × num_segments programs (see the module docstring);
    split_max_programs > 0 limits that grid (`split_program_limit`, `_segments`). pregated (vector G only): k is
    K_t = K ⊙ exp(G_n − G) from `scan_operands.gated_scan_operands`, and the scan reads G's last rows alone.
    state_rows (Schedule.scan_state_rows): the state's register blocks hold up to 64 or 128 rows (`schedule.state_blocks`;
    the same code where K ≤ 64).
    """
    B, T, H, K = k.shape
    V = U.shape[-1]
    _check_scan_args(K, V, chunk_size, BK, BV, num_warps, num_stages, state_dtype, num_segments, k.dtype)
    _check_state_rows(state_rows)
    if tuple(W.shape) != (B, T, H, K) or tuple(U.shape[:3]) != (B, T, H):
        raise ValueError(f"W must be {(B, T, H, K)} and U [B,T,H,V]; got {tuple(W.shape)}, {tuple(U.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ValueError(f"initial_state must have shape {(B, H, K, V)}, got {tuple(initial_state.shape)}")
    gk = gate_kind(G, k)
    code = _gate_code(gk, pregated)
    k, W, U = k.contiguous(), W.contiguous(), U.contiguous()
    G = G.contiguous() if G is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    NT = triton.cdiv(T, chunk_size)
    NV = triton.cdiv(V, BV)
    NS, CPS = _segments(NT, num_segments, NV * B * H, split_max_programs, _split_overhead(gk))
    VP = NV * BV
    prec = dot_precision(k.dtype)
    Hs = torch.empty(B, NT, H, K, V, dtype=state_dtype, device=k.device)
    R = torch.empty(B, T, H, V, dtype=k.dtype, device=k.device)
    KB, NB = state_blocks(K, state_rows)
    common = dict(H=H, K=K, V=V, VP=VP, BT=chunk_size, KB=KB, NB=NB, BV=BV, GATE=code, PREC=prec,
                  EARLY_GN=EARLY_GATE_ROW, num_warps=num_warps, num_stages=num_stages)
    h_in = h0
    if NS > 1:
        X = torch.empty(B * H, NS, K, VP + K, dtype=torch.float32, device=k.device)
        grid1 = (triton.cdiv(VP + K, BV), B * H, NS - 1)  # the last segment's transfer is never used
        rewy_fwd_scan_kernel[grid1](k, W, U, G, None, Hs, R, X, T, NT, CPS, 0, NS=NS, PHASE=1, USE_H_IN=False,
                                    **common)
        h_in = torch.empty(B * H, NS, K, V, dtype=torch.float32, device=k.device)
        _segment_combine(X, h0, h_in, H=H, K=K, V=V, VP=VP, NS=NS, reverse=False,
                         prec=prec, num_warps=num_warps)
    rewy_fwd_scan_kernel[(NV, B * H, NS)](k, W, U, G, h_in, Hs, R, None, T, NT, CPS, 0, NS=NS, PHASE=0,
                                          USE_H_IN=h_in is not None, **common)
    return Hs, R


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched as programmatic dependents (griddepcontrol: compute
    capability 9.0 and later)."""
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@dataclass(frozen=True)
class ScanProgress:
    """The reverse scan's per-chunk counters, for a consumer launched while the scan runs, which waits for each
    chunk (`reverse_state_scan_ranges(progress=)`). flags: int32 [B·H, NT], zero before the scan; programs: the scan
    programs per head (cdiv(V, BV)), each adding 1 to a chunk's count once it has stored that chunk; pdl: the
    consumer is launched as the scan's programmatic dependent (`pdl_supported`). reads: the tensors the scan
    launch reads, which the scan puts here: whoever holds this object until the consumer is launched keeps their
    memory from being handed to the consumer's buffers while the scan still reads it."""

    flags: torch.Tensor
    programs: int
    pdl: bool
    reads: list = field(default_factory=list)

    def check(self, BH: int, NT: int, device: torch.device) -> None:
        f = self.flags
        if tuple(f.shape) != (BH, NT) or f.dtype != torch.int32 or f.device != device or not f.is_contiguous():
            raise ValueError(f"ScanProgress.flags must be a contiguous int32 [B·H, NT]={(BH, NT)} tensor on {device}, "
                             f"got {tuple(f.shape)} in {f.dtype} on {f.device}")


def scan_progress(k: torch.Tensor, V: int, *, chunk_size: int, BV: int) -> ScanProgress:
    """Zeroed counters for the reverse scan of k [B,T,H,K] at state tiles BV wide (`ScanProgress`)."""
    B, T, H, _ = k.shape
    flags = torch.zeros(B * H, triton.cdiv(T, chunk_size), dtype=torch.int32, device=k.device)
    return ScanProgress(flags, triton.cdiv(V, BV), pdl_supported(k.device))


def _held_by_current_stream(*tensors) -> None:
    """Keep the scratch and inputs of a scan launch from being allocated again until the launch has run on the current
    stream. The launches may run on another stream than the one that allocated them (the pipeline's side stream), and
    once the launch iterator is exhausted nothing holds its carry, scratch or contiguous() copies: the allocator would
    hand their memory to the allocating stream's next request while the scan still reads it. Session 36: the pipeline
    queued every range on its side stream, then allocated the query-side stage's buffers on the main stream (NaN in
    the tests), and dS1 of the first chunks came out NaN under load."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def reverse_state_scan(q, k, W, G, do, dv_local, dht, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reverse state scan (§4) in one go: `reverse_state_scan_ranges` (same arguments) run to the end. Returns
    (dS1, R̄, dh0)."""
    dS1, Rbar, dh0, launches = reverse_state_scan_ranges(q, k, W, G, do, dv_local, dht, **kw)
    for _ in launches:
        pass
    return dS1, Rbar, dh0


def reverse_scan_segment_count(k: torch.Tensor, G: torch.Tensor | None, V: int, *, chunk_size: int, BV: int,
                               num_segments: int, split_max_programs: int) -> int:
    """How many segments `reverse_state_scan` splits the sequence into for these arguments (1: it does not)."""
    B, T, H, _ = k.shape
    NS, _ = _segments(triton.cdiv(T, chunk_size), num_segments, triton.cdiv(V, BV) * B * H, split_max_programs,
                      _split_overhead(gate_kind(G, k)))
    return NS


def chunk_ranges(NT: int, num_ranges: int) -> list[tuple[int, int]]:
    """`num_ranges` (at most NT) chunk ranges [c0, c1) of equal length but the first, from the last range to the
    first: the order the reverse scan finishes them."""
    per = triton.cdiv(NT, max(1, min(num_ranges, NT)))
    return [(c0, min(NT, c0 + per)) for c0 in reversed(range(0, NT, per))]


def reverse_state_scan_ranges(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    G: torch.Tensor | None,
    do: torch.Tensor,
    dv_local: torch.Tensor | None,
    dht: torch.Tensor | None,
    *,
    scale: float,
    chunk_size: int = 64,
    BK: int = 128,
    BV: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    state_dtype: torch.dtype = torch.float32,
    want_dh0: bool = True,
    num_segments: int = 1,
    split_max_programs: int = 0,
    num_ranges: int = 1,
    pregated: bool = False,
    q_scaled: bool = True,
    gate_log2: bool = False,
    aqk: torch.Tensor | None = None,
    progress: ScanProgress | None = None,
    layout: str = "kv",
    dv_local_from_qk: bool = False,
    state_rows: int = 64,
    qdo: str = "in_step",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Iterator[tuple[int, int]]]:
    """Reverse state scan (§4), a range of chunks at a time (Schedule.consumer_ranges). Returns its outputs, dS1 per
    chunk [B,NT,H,K,V] in state_dtype, R̄ [B,T,H,V] in do's dtype and dh0 [B,H,K,V] fp32 (None when want_dh0 is
    False), allocated but not yet written, and an iterator that launches the scan. q, k, W [B,T,H,K]; do, dv_local
    [B,T,H,V] (dv_local None means zero); dht None | [B,H,K,V].

    Each step of the iterator launches the scan of one chunk range (`chunk_ranges`, from the last) on the current
    stream and yields it (c0, c1); once it has run, dS1 and R̄ of those chunks are final, so a consumer can start on
    them while the scan goes on with the earlier ones. The scan must be run to the end (the iterator exhausted)
    before dh0 or the other chunks are read.

    Each range is one launch of the plain scan's kernel over its chunks, entering with the state the launch before
    left in an fp32 carry buffer (the registers' own values): the same bits as one launch. Where the scan splits
    (`num_segments`, `_segments`) it already runs its chunks side by side: it runs whole and yields (0, NT) once.

    pregated (vector G only): q is Q_g = s·Q ⊙ exp(G) and k is K_t = K ⊙ exp(G_n − G), both from
    `scan_operands.gated_scan_operands`; the scan reads G's last rows alone. The same bits as q, k and G.
    q_scaled False (with pregated): q is Q ⊙ exp(G) without s (fla-core's saved qg), and dO is scaled by s instead.
    gate_log2 (with pregated): G is in log2 units, G·log2 e (fla-core's own chunk cumsum, which its save-all forward
    keeps): the scan reads only its last rows, as exp2.
    aqk: the forward's A_qk [B,T,H,chunk_size] in do's dtype (fla-core's Aqk: column j ≤ row i of each chunk
    written, the rest not read), with dv_local None: each chunk step forms dv_local = A_qkᵀ dO itself, on the dO tile
    it loads anyway, so no dv_local stage runs before the scan.
    dv_local_from_qk (no gate or a scalar gate, with dv_local and aqk None; Schedule.dv_local_source "scan"): each chunk
    step forms A_qk from the q, k (and G) tiles of its chunk itself, then dv_local = A_qkᵀ dO, so no dv_local stage
    runs before the scan. q is then Q unscaled, as the scalar scan always reads it.
    progress: a `ScanProgress` (`scan_progress`), for a consumer that chases the scan in one launch
    (`pipeline.consumer_chases_scan`): each program adds 1 to progress.flags[bh, chunk] once that chunk's dS1 and R̄
    are stored. With progress.pdl the scan lets the next launch on its stream start as its programmatic dependent:
    that launch must be the chasing consumer. Only where the scan runs unsplit in one range.
    layout (Schedule.reverse_scan_layout): "kv" keeps the state as dS [K, BV] register blocks, "vk" as dSᵀ [BV, K]
    (`rewy_bwd_scan_vk_kernel`: no gate or a scalar gate, dv_local read or none; not with aqk or progress). A split
    scan's transfer pass and combine run the "kv" kernel either way.
    state_rows (Schedule.scan_state_rows): the "kv" kernel's state blocks hold up to 64 or 128 rows
    (`schedule.state_blocks`; the same code where K ≤ 64). The "vk" kernel takes its own blocks.
    qdo (Schedule.reverse_scan_qdo; no gate, "kv" layout): "ahead" forms each chunk step's Qᵀ dO (with
    dv_local_from_qk its dv_local too) at the end of the step before, from the q and dO tiles as loaded, so
    that Triton waits for those products at the next step's first one rather than before −Wᵀ R̄ (the "kv" loop
    waits for every product at once, Triton 3.6 on sm_90). The same sums in another order. A gate scales dO's rows
    first, and Triton then waits for the product at once (its operand staged from registers): with a gate, and in
    the "vk" layout, the step forms its own, as with "in_step". "split": "ahead" where the scan splits along the
    sequence (`_segments` gives more than one segment), "in_step" where it runs whole.
    """
    B, T, H, K = k.shape
    V = do.shape[-1]
    _check_scan_args(K, V, chunk_size, BK, BV, num_warps, num_stages, state_dtype, num_segments, k.dtype)
    if not isinstance(num_ranges, int) or isinstance(num_ranges, bool) or num_ranges < 1:
        raise ValueError(f"num_ranges must be a positive int, got {num_ranges!r}")
    for name, x in (("q", q), ("W", W)):
        if tuple(x.shape) != (B, T, H, K):
            raise ValueError(f"{name} must have shape {(B, T, H, K)}, got {tuple(x.shape)}")
    if tuple(do.shape[:3]) != (B, T, H) or (dv_local is not None and dv_local.shape != do.shape):
        raise ValueError("do and dv_local must have shape [B,T,H,V] matching q/k")
    if dht is not None and tuple(dht.shape) != (B, H, K, V):
        raise ValueError(f"dht must have shape {(B, H, K, V)}, got {tuple(dht.shape)}")
    gk = gate_kind(G, k)
    code = _gate_code(gk, pregated, q_scaled)
    if layout not in REVERSE_SCAN_LAYOUTS:
        raise ValueError(f"layout must be one of {REVERSE_SCAN_LAYOUTS}, got {layout!r}")
    if layout == "vk" and (code > 1 or aqk is not None or progress is not None):
        raise ValueError("layout 'vk' (the transposed state) scans with no gate or a scalar gate [B,T,H], reading "
                         "dv_local or none: not a vector gate, aqk= or progress=")
    if not isinstance(gate_log2, bool):
        raise TypeError(f"gate_log2 must be a bool, got {type(gate_log2).__name__}")
    if qdo not in REVERSE_SCAN_QDO:
        raise ValueError(f"qdo must be one of {REVERSE_SCAN_QDO} (when a chunk step's Qᵀ dO is formed), got {qdo!r}")
    _check_state_rows(state_rows)
    if gate_log2 and not pregated:
        raise ValueError("gate_log2=True: only a pregated scan reads G's last rows alone; pass pregated=True with it")
    q, k, W, do = q.contiguous(), k.contiguous(), W.contiguous(), do.contiguous()
    G = G.contiguous() if G is not None else None
    if not isinstance(dv_local_from_qk, bool):
        raise TypeError(f"dv_local_from_qk must be a bool, got {type(dv_local_from_qk).__name__}")
    if dv_local_from_qk and (code > 1 or dv_local is not None or aqk is not None or layout != "kv"):
        raise ValueError("dv_local_from_qk=True forms A_qk from q, k and a scalar gate (or none) in the 'kv' scan: "
                         "not with a vector gate, dv_local=, aqk= or layout 'vk'")
    if aqk is not None:
        if dv_local is not None:
            raise ValueError("pass dv_local or aqk (the scan then forms dv_local from it), not both")
        if tuple(aqk.shape) != (B, T, H, chunk_size) or aqk.dtype != do.dtype or aqk.device != do.device:
            raise ValueError(f"aqk must be [B,T,H,chunk_size]={(B, T, H, chunk_size)} in do's dtype {do.dtype} on "
                             f"{do.device}, got {tuple(aqk.shape)} in {aqk.dtype} on {aqk.device}")
    dvl = dv_local.contiguous() if dv_local is not None else aqk.contiguous() if aqk is not None else None
    dht = dht.contiguous() if dht is not None else None
    NT = triton.cdiv(T, chunk_size)
    NV = triton.cdiv(V, BV)
    NS, CPS = _segments(NT, num_segments, NV * B * H, split_max_programs, _split_overhead(gk))
    VP = NV * BV
    prec = dot_precision(k.dtype)
    dS1 = torch.empty(B, NT, H, K, V, dtype=state_dtype, device=k.device)
    Rbar = torch.empty(B, T, H, V, dtype=do.dtype, device=k.device)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device) if want_dh0 else None
    KB, NB = state_blocks(K, state_rows)
    dvl_kind = 3 if dv_local_from_qk else 0 if dvl is None else 2 if aqk is not None else 1  # the kernel's HAS_DVL
    ahead = code == 0 and (qdo == "ahead" or (qdo == "split" and NS > 1))  # (a gate's scan forms Qᵀ dO in its step)
    common = dict(H=H, K=K, V=V, VP=VP, BT=chunk_size, KB=KB, NB=NB, BV=BV, GATE=code, HAS_DVL=dvl_kind,
                  PREC=prec, G_LOG2=gate_log2, EARLY_GN=EARLY_GATE_ROW, QDO_AHEAD=ahead,
                  num_warps=num_warps, num_stages=num_stages)
    ranges = chunk_ranges(NT, num_ranges) if NS == 1 else [(0, NT)]
    if progress is not None:
        if NS > 1 or len(ranges) > 1:
            raise ValueError(f"progress: a chasing consumer follows the scan in one unsplit launch; these arguments "
                             f"give {NS} segments and {len(ranges)} ranges")
        progress.check(B * H, NT, k.device)
        if progress.programs != NV:
            raise ValueError(f"progress counts {progress.programs} programs per head; this scan has {NV}")
        progress.reads.extend((q, k, W, G, do, dvl, dht))  # (as launched: the copies contiguous() made, if any)
    flags = progress.flags if progress is not None else None
    pdl = progress is not None and progress.pdl
    # Scratch is allocated here, on the caller's stream, not in the launches, which the pipeline runs on its side
    # stream. It lives as long as the iterator: the pipeline takes this path only where the scan does not split
    # (`reverse_scan_segment_count`), since a split scan's X and entering states held beside the consumer put
    # DeltaNet A's peak at (1, 8192, 4) up 56.1 -> 62.1 MiB (session 18); the carry is two [K, V] states per B·H.
    X = torch.empty(B * H, NS, K, VP + K, dtype=torch.float32, device=k.device) if NS > 1 else None
    dh_in = torch.empty(B * H, NS, K, V, dtype=torch.float32, device=k.device) if NS > 1 else dht
    carry = torch.empty(B * H, 2, K, V, dtype=torch.float32, device=k.device) if len(ranges) > 1 else None

    vk = None  # the "vk" kernel's launch arguments beyond the shared tensors and sizes
    if layout == "vk":
        KBv = min(128, max(16, triton.next_power_of_2(K)))
        vk = dict(H=H, K=K, V=V, BT=chunk_size, KB=KBv, NB=triton.cdiv(K, KBv), BV=BV, GATE=code,
                  HAS_DVL=dvl_kind, PREC=prec, num_warps=num_warps, num_stages=num_stages)

    def whole():
        _held_by_current_stream(q, k, W, G, do, dvl, dht, X, dh_in)
        if NS > 1:
            grid1 = (triton.cdiv(VP + K, BV), B * H, NS - 1)  # segment 0's transfer is never used
            rewy_bwd_scan_kernel[grid1](q, k, W, G, do, dvl, None, dS1, Rbar, dh0, X, None, None, scale, T, NT,
                                        CPS, 1, NS=NS, PHASE=1, USE_DH_IN=False, STORE_DH0=False, CARRY=False,
                                        IN_CARRY=False, PUBLISH=False, PDL=False, **common)
            _segment_combine(X, dht, dh_in, H=H, K=K, V=V, VP=VP, NS=NS, reverse=True,
                             prec=prec, num_warps=num_warps)
        if vk is not None:
            rewy_bwd_scan_vk_kernel[(NV, B * H, NS)](q, k, W, G, do, dvl, dh_in, dS1, Rbar, dh0, None, scale, T, NT,
                                                     CPS, 0, NS=NS, USE_DH_IN=dh_in is not None, STORE_DH0=want_dh0,
                                                     CARRY=False, IN_CARRY=False, **vk)
        else:
            rewy_bwd_scan_kernel[(NV, B * H, NS)](q, k, W, G, do, dvl, dh_in, dS1, Rbar, dh0, None, None, flags,
                                                  scale, T, NT, CPS, 0, NS=NS, PHASE=0, USE_DH_IN=dh_in is not None,
                                                  STORE_DH0=want_dh0, CARRY=False, IN_CARRY=False,
                                                  PUBLISH=flags is not None, PDL=pdl, **common)
        yield 0, NT

    def in_ranges():
        NR, per = len(ranges), ranges[-1][1]  # the first range is the longest
        for i_s, (c0, c1) in zip(reversed(range(NR)), ranges):
            _held_by_current_stream(q, k, W, G, do, dvl, dht, carry)
            # carry: two slots, used in turn; the first range enters from dht itself (no copy into the carry)
            first = i_s == NR - 1
            step = dict(USE_DH_IN=dht is not None or not first, STORE_DH0=want_dh0, CARRY=True, IN_CARRY=not first)
            if vk is not None:
                rewy_bwd_scan_vk_kernel[(NV, B * H, 1)](q, k, W, G, do, dvl, dht if first else carry, dS1, Rbar,
                                                        dh0, carry, scale, T, NT, per, i_s, NS=NR, **step, **vk)
            else:
                rewy_bwd_scan_kernel[(NV, B * H, 1)](q, k, W, G, do, dvl, dht if first else carry, dS1, Rbar, dh0,
                                                     None, carry, None, scale, T, NT, per, i_s, NS=NR, PHASE=0,
                                                     PUBLISH=False, PDL=False, **step, **common)
            yield c0, c1

    return dS1, Rbar, dh0, (whole() if len(ranges) == 1 else in_ranges())
