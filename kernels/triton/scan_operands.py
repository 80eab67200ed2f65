"""The vector-gate scans' gated operands, formed once per chunk before the scans (Schedule.scan_operands "pregated").

Both scans of a vector gate (KDA, GDN2) contract the state with gated copies of K and Q (rewy-math §§3–4):
    K_t = K ⊙ exp(G_n − G)      (forward: S1 += K_tᵀ R; reverse: R̄ = dv_local + K_t dS1)
    Q_g = s · Q ⊙ exp(G)        (reverse: dS0 += Q_gᵀ dO)
Inline, every program of a scan forms them anew in its serial chunk loop: per chunk step it loads G's [C, K] tile
in fp32 (twice in the reverse scan: rows for K_t, transposed for Q_g) and takes 2·C·K exponentials, on the critical
path of a latency-bound loop, and each of the V / BV programs of a head repeats them. Here one parallel kernel
forms both in the input dtype, the values the scans cast to before their products anyway, so the scans give the
same bits and load two 16-bit tiles and G's last row per step (FLA's KDA backward hands its state scan gated q and
k in the same way).

With ``with_range=True`` the kernel also writes each chunk's per-channel maximum and minimum of G over its valid rows
([B, NT, H, 2, K] fp32), which the vector consumer's range guard reads instead of reducing its [C, BK] gate tile
across warps (`vector_local.RANGE_FROM_OPERANDS`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .recompute import GATE_VECTOR, gate_kind, validate_chunk_size, validate_launch, validate_tile
from .vector_local import chunk_max_min, gate_range_shape


@triton.jit(do_not_specialize=["T", "H"])
def rewy_scan_operands_kernel(
    q, k, G, qg, kt, grange,
    T, scale,
    H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, RANGE: tl.constexpr,
):
    i_t, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_t * BT + tl.arange(0, BT)
    m_row = rows < T
    tok = (i_b * T + rows) * H + i_h
    tok_last = (i_b * T + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_rk = m_row[:, None] & m_k[None, :]
    p = tok[:, None] * K + o_k[None, :]
    b_g = tl.load(G + p, mask=m_rk, other=0.0).to(tl.float32)
    b_gl = tl.load(G + tok_last * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + p, mask=m_rk, other=0.0)
    b_q = tl.load(q + p, mask=m_rk, other=0.0)
    # The scans' own expressions (scan.py, GATE 2), operation for operation: the same fp32 values, the same casts.
    # Rows past T: the decay itself is masked (exp(G_n − 0) may overflow and 0·inf is NaN); they are not stored.
    b_kt = b_k.to(tl.float32) * tl.where(m_rk, tl.exp(b_gl[None, :] - b_g), 0.0)
    b_qg = b_q.to(tl.float32) * (tl.exp(b_g) * scale)
    tl.store(kt + p, b_kt.to(kt.dtype.element_ty), mask=m_rk)
    tl.store(qg + p, b_qg.to(qg.dtype.element_ty), mask=m_rk)
    if RANGE:  # the consumer's own reduction (`vector_local._tile_range`) over the same valid rows
        b_max, b_min = chunk_max_min(b_g, m_row)
        p_r = ((i_b * tl.cdiv(T, BT) + i_t) * H + i_h).to(tl.int64) * (2 * K) + o_k
        tl.store(grange + p_r, b_max, mask=m_k)
        tl.store(grange + p_r + K, b_min, mask=m_k)


def gated_scan_operands(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, *, scale: float, chunk_size: int = 64,
                        BK: int = 64, num_warps: int = 4, with_range: bool = False) -> tuple[torch.Tensor, ...]:
    """(Q_g, K_t), both [B,T,H,K] in q's dtype: Q_g = scale · q ⊙ exp(G), K_t = k ⊙ exp(G_n − G) with G_n the
    last row of each chunk of chunk_size rows (the last valid row in a tail chunk). q, k [B,T,H,K] of one dtype;
    G [B,T,H,K] fp32, the chunk-local cumulative gate. The scans take them with ``pregated=True``.
    with_range: also the gate's range per chunk and channel, (Q_g, K_t, range) with range [B, NT, H, 2, K] fp32:
    [..., 0, :] the maximum of G over the chunk's valid rows, [..., 1, :] the minimum."""
    for name, t in (("q", q), ("k", k), ("G", G)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B,T,H,K] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have one dtype, got {q.dtype} and {k.dtype}")
    if gate_kind(G, k) != GATE_VECTOR:
        raise ValueError(f"G must be a vector gate of shape {tuple(k.shape)} (per key channel), got "
                         f"{tuple(G.shape)}")
    if G.dtype != torch.float32:
        raise ValueError(f"G must be float32 (the chunk-local cumulative gate), got {G.dtype}")
    if not (q.device == k.device == G.device):
        raise ValueError(f"q, k and G must be on one device, got {q.device}, {k.device}, {G.device}")
    validate_chunk_size(chunk_size)
    validate_tile("BK", BK, hi=256)
    validate_launch(num_warps, 1)
    B, T, H, K = k.shape
    q, k, G = q.contiguous(), k.contiguous(), G.contiguous()
    qg, kt = torch.empty_like(q), torch.empty_like(k)
    NT = triton.cdiv(T, chunk_size)
    grange = (torch.empty(gate_range_shape(G.shape, chunk_size), dtype=torch.float32, device=G.device)
              if with_range else None)
    grid = (NT, B * H, triton.cdiv(K, BK))
    rewy_scan_operands_kernel[grid](q, k, G, qg, kt, grange if with_range else G, T, scale, H, K=K, BT=chunk_size,
                                    BK=BK, RANGE=with_range, num_warps=num_warps)
    return (qg, kt, grange) if with_range else (qg, kt)
