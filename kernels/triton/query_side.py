"""The query side of the scalar-gate consumer (DeltaNet, GDN) as its own stage: ``Schedule.dq_stage == "separate"``.

Every term of the backward that reads dO reads no output of the reverse scan (rewy-math §§5–6.2; the consumer's
docstring in ``local.py``):

    H    = dO Rᵀ                         (its strict lower part, scaled and gated: Γ_q = s H_< ⊙ Λ)
    dq   = s γ (dO S0ᵀ) + Γ_q K + s ⟨dO, R⟩ K      (the last term: H's diagonal, the self-term split)
    dk_q = Γ_qᵀ Q + s ⟨dO, R⟩ Q                    (dk's query part: its column side's Γ_q half and the self term)
    Ḡ_q  = ⟨Q, s γ (dO S0ᵀ) + Γ_q K⟩ − ⟨K, Γ_qᵀ Q⟩  (per row; GDN only)

Only dO, R, S0, Q, K and G: under policy R they exist once the forward scan is done, under A once dv_local has run
(which the reverse scan needs first). So this stage runs on the main stream while the side stream runs the reverse
scan (``Schedule.side_stream``). It writes dk_q into the dk buffer in dk's dtype; the joint_tma consumer, given dq,
Ḡ_q and that buffer, adds the rest of dk to it and forms neither H, Γ_q nor any product with dO or Q (10 of its 30
tile products per chunk at K = V = 128, 64 × 64 tiles), and reads neither dO nor Q.

Γ_qᵀ comes from its own product Hᵀ = R dOᵀ on the same loaded tiles (dOᵀ a transposed view of dO's shared
buffer; a transposed dot result is never an operand, FLA issue 640): no scratch round trip, no CTA barrier. ⟨dO, R⟩
is H's diagonal, so no loaded tile is also read in registers (`rewy_tune/ir_hazards.py`). With 32 KB of shared memory
and 168 registers (sm_90, DeltaNet, 64 × 64 tiles, 4 warps, 2 stages) one of its CTAs fits beside a reverse-scan
program (176 KB) on an SM, so it does not keep the scan from its SMs.

One program per (chunk, batch·head), the consumer's tiles (``consumer_cfg``): phase 1 a V loop for H and Hᵀ
(⟨dO, R⟩ is H's diagonal), phase 2 per K tile a V loop for dO S0ᵀ, then the dq rows (``local._dq_rows``, the
consumer's own epilogue) and dk_q. Block pointers: the kernel runs on any GPU and under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .local import _chunk_prologue, _diagonal, _dq_rows, _gamma_matrices, _row_gates
from .recompute import dot_precision
from .recompute import mm as _mma


@triton.jit(do_not_specialize=["T", "NT", "H"])
def rewy_bwd_kernel_query_side(
    q, k, R, do, S0, G, dq, dk, gbq,
    T, NT, scale,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, PREC: tl.constexpr,
):
    i_t, i_b, i_h, t0, o_i, m_row, tok, n_rows, is_last = _chunk_prologue(T, H, BT, 0)
    bos = (i_b * T * H + i_h).to(tl.int64)  # token (b, 0, h)
    S0 += ((i_b * NT + i_t) * H + i_h).to(tl.int64) * (K * V)
    q += bos * K
    k += bos * K
    dq += bos * K
    dk += bos * K
    R += bos * V
    do += bos * V
    DT = k.dtype.element_ty
    b_g, b_gn, b_gamma, b_tau = _row_gates(G, tok, m_row, is_last, BT, USE_G)

    # Phase 1: H = dO Rᵀ, Hᵀ = R dOᵀ and H's diagonal ⟨dO, R⟩ per row
    b_H = tl.zeros([BT, BT], dtype=tl.float32)
    b_Ht = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, (V + BV - 1) // BV):
        # each loaded tile feeds the two products only, once as itself and once transposed (a view of the same
        # shared buffer): a tile that also fed ⟨dO, R⟩ in registers was left in a one-slot buffer that the next
        # tile's copy overwrote under the product still reading it (rewy_tune/ir_hazards.py; dk changed from run to
        # run beside the reverse scan, session 34)
        p_do = tl.make_block_ptr(do, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_r = tl.make_block_ptr(R, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
        b_r = tl.load(p_r, boundary_check=(0, 1)).to(DT)
        b_H += _mma(b_do, tl.trans(b_r), PREC)
        b_Ht += _mma(b_r, tl.trans(b_do), PREC)
    b_hd = _diagonal(b_H, o_i)  # ⟨dO, R⟩ per row
    m_lt = (o_i[:, None] > o_i[None, :]) & m_row[:, None] & m_row[None, :]
    # Γ_q = s H_< ⊙ Λ by the consumer's own helper (its Γ_r, here formed from a stand-in, is dropped); Γ_qᵀ by the
    # same helper from Hᵀ on the transposed mask, with Λᵀ[i, j] = exp(g_j − g_i), which is Λ of −g
    b_gq, _ = _gamma_matrices(b_H, b_H, b_g, m_lt, scale, DT, USE_G)
    m_ut = (o_i[:, None] < o_i[None, :]) & m_row[:, None] & m_row[None, :]
    b_gqt, _ = _gamma_matrices(b_Ht, b_Ht, -b_g, m_ut, scale, DT, USE_G)

    # Phase 2: per K tile Q̄_g = dO S0ᵀ over V, then the consumer's dq epilogue and dk_q
    b_gb = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, (K + BK - 1) // BK):
        b_qg = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(0, (V + BV - 1) // BV):
            p_do = tl.make_block_ptr(do, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
            p_s0t = tl.make_block_ptr(S0, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK), (0, 1))
            b_qg += _mma(tl.load(p_do, boundary_check=(0, 1)).to(DT),
                         tl.load(p_s0t, boundary_check=(0, 1)).to(DT), PREC)
        p_q = tl.make_block_ptr(q, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_qf = b_q.to(tl.float32)
        b_kf = b_k.to(tl.float32)
        b_aq = _mma(b_gq, b_k.to(DT), PREC)
        b_dq, b_gb = _dq_rows(b_qg, b_aq, b_qf, b_kf, b_hd, b_gamma, b_gb, scale, USE_G)
        p_dq = tl.make_block_ptr(dq, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))
        b_bq = _mma(b_gqt, b_q.to(DT), PREC)  # Γ_qᵀ Q, dk's column side from the query
        if USE_G:
            b_gb -= tl.sum(b_kf * b_bq, axis=1)  # Ḡ's column side, −⟨K, Γ_qᵀ Q⟩
        b_dkq = b_bq + (scale * b_hd)[:, None] * b_qf
        p_dk = tl.make_block_ptr(dk, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_dk, b_dkq.to(p_dk.dtype.element_ty), boundary_check=(0, 1))
    if USE_G:
        tl.store(gbq + tok, tl.where(m_row, b_gb, 0.0), mask=m_row)


def query_side(q, k, R, S0, G, do, *, scale: float, chunk_size: int = 64, BK: int = 64, BV: int = 64,
               num_warps: int = 4, num_stages: int = 2,
               out=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dq and dk_q [B,T,H,K] in q's and k's dtype, and Ḡ's query side [B,T,H] fp32 (None without a gate: G None).

    q, k [B,T,H,K]; R, do [B,T,H,V]; S0 [B,NT,H,K,V] (the forward scan's per-chunk states); G None | [B,T,H] fp32
    (the chunk-local cumulative gate). dk_q is dk's query part, which the joint_tma consumer completes in place.
    out: (dq, dk_q, Ḡ_q) buffers to write (`query_side_buffers`), for a caller that hands them to the consumer
    before this stage is launched (the consumer's chunk ranges, `pipeline.run_stages`)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    C = chunk_size
    NT = triton.cdiv(T, C)
    if tuple(k.shape) != (B, T, H, K) or tuple(R.shape) != (B, T, H, V):
        raise ValueError(f"k must be {(B, T, H, K)} and R {(B, T, H, V)}; got {tuple(k.shape)}, {tuple(R.shape)}")
    if tuple(S0.shape) != (B, NT, H, K, V):
        raise ValueError(f"S0 must have shape {(B, NT, H, K, V)}, got {tuple(S0.shape)}")
    if G is not None and tuple(G.shape) != (B, T, H):
        raise ValueError(f"G must be None or a scalar gate [B,T,H]={(B, T, H)}, got {tuple(G.shape)}")
    if out is None:
        dq, dk, gbq = query_side_buffers(q, k, G)
    else:
        # (described, not allocated: two [B,T,H,K] buffers made only to compare with took 64 MiB more at the
        # backward's peak, DeltaNet A (1, 8192, 16) in consumer ranges, session 36)
        want = [(tuple(q.shape), q.dtype), (tuple(k.shape), k.dtype), ((B, T, H), torch.float32) if G is not None
                else None]
        if len(out) != 3 or any((o is None) != (w is None) or (w is not None and (
                (tuple(o.shape), o.dtype) != w or o.device != q.device or not o.is_contiguous()))
                for o, w in zip(out, want)):
            raise ValueError(f"out must be (dq, dk_q, Ḡ_q) as query_side_buffers(q, k, G) makes them: {want}")
        dq, dk, gbq = out
    rewy_bwd_kernel_query_side[(NT, B * H)](
        q, k, R, do, S0, G, dq, dk, gbq, T, NT, float(scale),
        H=H, K=K, V=V, BT=C, BK=BK, BV=BV, USE_G=G is not None, PREC=dot_precision(k.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return dq, dk, gbq


def query_side_buffers(q, k, G) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Empty (dq, dk_q, Ḡ_q) for `query_side`: q's and k's shape and dtype, and [B,T,H] fp32 with a gate (else None)."""
    B, T, H, _ = q.shape
    gbq = torch.empty(B, T, H, dtype=torch.float32, device=q.device) if G is not None else None
    return torch.empty_like(q), torch.empty_like(k), gbq
