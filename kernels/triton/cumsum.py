"""Chunk-local cumulative sums of the gate (rewy-math §1, §6 step (b)).

Forward: G_i = Σ_{t ≤ i, same chunk} g_t (natural log, fp32) — the cumulative gate every stage reads.
Reverse: dg_i = Σ_{t ≥ i, same chunk} Ḡ_t — the last step of every consumer's gate gradient. Rows past T are
loaded as zeros, so the tail chunk sums to its last valid row. Scalar [B,T,H] and vector [B,T,H,K] inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .recompute import validate_chunk_size, validate_launch, validate_tile


@triton.jit(do_not_specialize=["T", "H"])
def rewy_chunk_cumsum_kernel(
    x, y, T,
    H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    VECTOR: tl.constexpr, REVERSE: tl.constexpr,
):
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_t * BT + tl.arange(0, BT)
    m_row = rows < T
    tok = (i_b * T + rows) * H + i_h
    if VECTOR:
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_row[:, None] & (o_k < K)[None, :]
        p = tok[:, None] * K + o_k[None, :]
    else:
        m = m_row
        p = tok
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_y = tl.cumsum(b_x, axis=0, reverse=REVERSE)
    tl.store(y + p, b_y, mask=m)


def _launch(x: torch.Tensor, chunk_size: int, BK: int, num_warps: int, reverse: bool) -> torch.Tensor:
    validate_chunk_size(chunk_size)
    validate_launch(num_warps)
    if x.dim() not in (3, 4):
        raise ValueError(f"x must be [B,T,H] or [B,T,H,K], got shape {tuple(x.shape)}")
    vector = x.dim() == 4
    B, T, H = x.shape[:3]
    K = x.shape[3] if vector else 1
    if vector:
        validate_tile("BK", BK, lo=1, hi=256)
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    NK = triton.cdiv(K, BK) if vector else 1
    grid = (NK, triton.cdiv(T, chunk_size), B * H)
    rewy_chunk_cumsum_kernel[grid](x, y, T, H=H, K=K, BT=chunk_size, BK=BK if vector else 1,
                                   VECTOR=vector, REVERSE=reverse, num_warps=num_warps)
    return y


def reverse_chunk_cumsum(x: torch.Tensor, *, chunk_size: int = 64, BK: int = 64, num_warps: int = 4) -> torch.Tensor:
    """dg_i = Σ_{t ≥ i, same chunk} x_t, fp32, for x [B,T,H] or [B,T,H,K] (BK tiles K; ignored for scalars)."""
    return _launch(x, chunk_size, BK, num_warps, reverse=True)


def chunk_cumsum(g: torch.Tensor, *, chunk_size: int = 64, BK: int = 64, num_warps: int = 4) -> torch.Tensor:
    """G_i = Σ_{t ≤ i, same chunk} g_t, fp32 natural log, for g [B,T,H] or [B,T,H,K]."""
    return _launch(g, chunk_size, BK, num_warps, reverse=False)
