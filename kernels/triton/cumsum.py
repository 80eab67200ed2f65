"""Chunk-local cumulative sum of the gate (rewy-math §1): G_i = Σ_{t ≤ i, same chunk} g_t (natural log, fp32),
the cumulative gate every stage reads. Rows past T are loaded as zeros. Scalar [B,T,H] and vector [B,T,H,K] inputs.

The reverse sum of the backward (dg_i = Σ_{t ≥ i, same chunk} Ḡ_t, §6 step (b)) is no kernel of its own since
session 14: each consumer program holds its chunk's whole Ḡ and stores dg directly (`local._store_row_grads`,
`vector_local`).

With ``gate`` (KDA/GDN2's in-kernel gate, `gate.GateActivation`) the input is the raw gate x and the activation is
applied to each element before the sum: one pass over a 16-bit x instead of an fp32 activated copy.

With ``with_range=True`` (vector gates) the kernel also writes each chunk's per-channel maximum and minimum of G over
its valid rows ([B, NT, H, 2, K] fp32, the layout and bits of `scan_operands.gated_scan_operands(with_range=True)`),
for the consumer's range guard where no scan-operands stage runs (Schedule.scan_operands "forward").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gate import GateActivation, activate, gate_params
from .recompute import validate_chunk_size, validate_launch, validate_tile
from .vector_local import chunk_max_min, gate_range_shape


@triton.jit(do_not_specialize=["T", "H"])
def rewy_chunk_cumsum_kernel(
    x, y, grange, T, A_log, dt_bias, lower_bound,
    H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    VECTOR: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, LOWER: tl.constexpr,
    RANGE: tl.constexpr,
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
    if GATE:  # the raw gate input, activated (VECTOR only); rows past T are zeroed after it
        b_a, b_b = gate_params(A_log, dt_bias, i_h, o_k, o_k < K, K, BK, HAS_A, HAS_BIAS)
        b_x = tl.where(m, activate(b_x, b_a, b_b, lower_bound, HAS_BIAS, LOWER), 0.0)
    b_y = tl.cumsum(b_x, axis=0)
    tl.store(y + p, b_y, mask=m)
    if RANGE:  # VECTOR only: the stored values' max and min over the chunk's valid rows
        b_max, b_min = chunk_max_min(b_y, m_row)
        p_r = ((i_b * tl.cdiv(T, BT) + i_t) * H + i_h).to(tl.int64) * (2 * K) + o_k
        tl.store(grange + p_r, b_max, mask=o_k < K)
        tl.store(grange + p_r + K, b_min, mask=o_k < K)


def chunk_cumsum(g: torch.Tensor, *, chunk_size: int = 64, BK: int = 64, num_warps: int = 4,
                 gate: GateActivation | None = None, with_range: bool = False, out: torch.Tensor | None = None,
                 range_out: torch.Tensor | None = None):
    """G_i = Σ_{t ≤ i, same chunk} g_t, fp32 natural log, for g [B,T,H] or [B,T,H,K] (BK tiles K; ignored for
    scalars). With ``gate`` (vector g only), g is the raw gate input and g_t its activation. with_range (vector g
    only): (G, range) with range [B, NT, H, 2, K] fp32, [..., 0, :] G's maximum over each chunk's valid rows and
    [..., 1, :] its minimum. out, range_out: contiguous fp32 buffers of those shapes to write instead of new ones
    (the pipeline allocates them on its main stream and runs this kernel on another)."""
    validate_chunk_size(chunk_size)
    validate_launch(num_warps)
    if g.dim() not in (3, 4):
        raise ValueError(f"g must be [B,T,H] or [B,T,H,K], got shape {tuple(g.shape)}")
    vector = g.dim() == 4
    if not isinstance(with_range, bool):
        raise TypeError(f"with_range must be a bool, got {type(with_range).__name__}")
    if with_range and not vector:
        raise ValueError(f"with_range: the gate range is per key channel, g must be [B,T,H,K], got {tuple(g.shape)}")
    if gate is not None:
        gate.check(g)
    B, T, H = g.shape[:3]
    K = g.shape[3] if vector else 1
    if vector:
        validate_tile("BK", BK, lo=1, hi=256)
    g = g.contiguous()
    NK = triton.cdiv(K, BK) if vector else 1
    NT = triton.cdiv(T, chunk_size)
    if range_out is not None and not with_range:
        raise ValueError("range_out: pass with_range=True with it")
    y = _buffer(out, "out", g.shape, g.device)
    grange = _buffer(range_out, "range_out", gate_range_shape(g.shape, chunk_size), g.device) if with_range else None
    grid = (NK, NT, B * H)
    A_log, dt_bias = (gate.A_log, gate.dt_bias) if gate is not None else (None, None)
    lower = gate is not None and gate.lower_bound is not None
    rewy_chunk_cumsum_kernel[grid](g, y, grange if with_range else y, T, A_log, dt_bias,
                                   float(gate.lower_bound) if lower else 0.0,
                                   H=H, K=K, BT=chunk_size, BK=BK if vector else 1, VECTOR=vector,
                                   GATE=gate is not None, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
                                   LOWER=lower, RANGE=with_range, num_warps=num_warps)
    return (y, grange) if with_range else y


def _buffer(buf: torch.Tensor | None, name: str, shape, device) -> torch.Tensor:
    """A given output buffer, checked, or a new fp32 one."""
    if buf is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(buf.shape) != tuple(shape) or buf.dtype != torch.float32 or buf.device != device \
            or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 {tuple(shape)} on {device}, got {tuple(buf.shape)} "
                         f"{buf.dtype} on {buf.device}")
    return buf
