"""The query side of the scalar-gate consumer (DeltaNet, GDN) as its own stage: ``Schedule.dq_stage == "separate"``.

dq and the query side of Ḡ read no output of the reverse scan (rewy-math §§5–6.2; the consumer's docstring in
``local.py``):

    H   = dO Rᵀ                       (its strict lower part, scaled and gated: Γ_q = s H_< ⊙ Λ)
    dq  = s γ (dO S0ᵀ) + Γ_q K + s ⟨dO, R⟩ K     (the last term: H's diagonal, the self-term split)
    Ḡ_q = ⟨Q, s γ (dO S0ᵀ) + Γ_q K⟩             (per row; GDN only)

Only dO, R, S0, Q, K and G: under policy R they exist once the forward scan is done, under A from the start. So
this stage can run on the main stream while the side stream runs dv_local and the reverse scan
(``Schedule.side_stream``), and the joint_tma consumer, given dq and Ḡ_q, skips its dO S0ᵀ products and the
A_Q = Γ_q K product (6 of its 30 tile products per chunk at K = V = 128, 64 × 64 tiles). H is formed twice (here
and in the consumer, which needs Γ_q for dk's column side): 2 of those products, off the critical path.

One program per (chunk, batch·head), the consumer's tiles (``consumer_cfg``): phase 1 a V loop for H and ⟨dO, R⟩,
phase 2 per K tile a V loop for dO S0ᵀ, then the dq rows (``local._dq_rows``, the consumer's own epilogue). Block
pointers: the kernel runs on any GPU and under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .local import _chunk_prologue, _dq_rows, _gamma_matrices, _row_gates
from .recompute import dot_precision
from .recompute import mm as _mma


@triton.jit(do_not_specialize=["T", "NT", "H"])
def rewy_bwd_kernel_query_side(
    q, k, R, do, S0, G, dq, gbq,
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
    R += bos * V
    do += bos * V
    DT = k.dtype.element_ty
    b_g, b_gn, b_gamma, b_tau = _row_gates(G, tok, m_row, is_last, BT, USE_G)

    # Phase 1: H = dO Rᵀ and its diagonal ⟨dO, R⟩ per row
    b_H = tl.zeros([BT, BT], dtype=tl.float32)
    b_hd = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, (V + BV - 1) // BV):
        p_do = tl.make_block_ptr(do, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_rt = tl.make_block_ptr(R, (V, T), (1, H * V), (i_v * BV, t0), (BV, BT), (0, 1))
        p_r = tl.make_block_ptr(R, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_do = tl.load(p_do, boundary_check=(0, 1))
        b_H += _mma(b_do.to(DT), tl.load(p_rt, boundary_check=(0, 1)).to(DT), PREC)
        b_hd += tl.sum(b_do.to(tl.float32) * tl.load(p_r, boundary_check=(0, 1)).to(tl.float32), axis=1)
    m_lt = (o_i[:, None] > o_i[None, :]) & m_row[:, None] & m_row[None, :]
    # Γ_q = s H_< ⊙ Λ, by the consumer's own helper; its Γ_r (here formed from a stand-in, b_H) is not used, and
    # the compiler drops it
    b_gq, _ = _gamma_matrices(b_H, b_H, b_g, m_lt, scale, DT, USE_G)

    # Phase 2: per K tile Q̄_g = dO S0ᵀ over V, then the consumer's dq epilogue
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
        b_aq = _mma(b_gq, b_k.to(DT), PREC)
        b_dq, b_gb = _dq_rows(b_qg, b_aq, b_q.to(tl.float32), b_k.to(tl.float32), b_hd, b_gamma, b_gb, scale, USE_G)
        p_dq = tl.make_block_ptr(dq, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))
    if USE_G:
        tl.store(gbq + tok, tl.where(m_row, b_gb, 0.0), mask=m_row)


def query_side(q, k, R, S0, G, do, *, scale: float, chunk_size: int = 64, BK: int = 64, BV: int = 64,
               num_warps: int = 4, num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dq [B,T,H,K] in q's dtype and Ḡ's query side [B,T,H] fp32 (None without a gate: G None).

    q, k [B,T,H,K]; R, do [B,T,H,V]; S0 [B,NT,H,K,V] (the forward scan's per-chunk states); G None | [B,T,H] fp32
    (the chunk-local cumulative gate)."""
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
    dq = torch.empty_like(q)
    gbq = torch.empty(B, T, H, dtype=torch.float32, device=q.device) if G is not None else None
    rewy_bwd_kernel_query_side[(NT, B * H)](
        q, k, R, do, S0, G, dq, gbq, T, NT, float(scale),
        H=H, K=K, V=V, BT=C, BK=BK, BV=BV, USE_G=G is not None, PREC=dot_precision(k.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return dq, gbq
