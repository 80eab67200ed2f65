"""Policy-R recompute stage of the ReWY backward (rewy-math §3): W = A E and U = A Z per chunk.

E = e ⊙ K ⊙ γ (γ = exp(G), G the chunk-local cumulative natural-log gate) and Z = ω ⊙ V, with A = M^{-1}
stored in FLA layout [B, T, H, C]. Shared by DeltaNet (no gate), GDN (scalar gate), KDA and GDN2 (vector gate);
the gate, erase and write shapes are compile-time switches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Gate kinds (compile-time): no gate, scalar gate [B,T,H], vector gate [B,T,H,K].
GATE_NONE, GATE_SCALAR, GATE_VECTOR = 0, 1, 2
SUPPORTED_CHUNK_SIZES = (16, 32, 64)


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


def validate_tile(name: str, value: int, *, lo: int = 16, hi: int | None = None, covers: int | None = None) -> None:
    """Raise ValueError naming `name` unless it is a power of two in [lo, hi] (and >= covers when given)."""
    if not _is_pow2(value):
        raise ValueError(f"{name} must be a power of two, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo} (tl.dot needs 16-wide tiles), got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    if covers is not None and value < covers:
        raise ValueError(f"{name}={value} must cover the whole dimension ({covers}) for this stage")


def validate_chunk_size(chunk_size: int) -> None:
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES}, got {chunk_size!r}")


def validate_launch(num_warps: int, num_stages: int | None = None) -> None:
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps!r}")
    if num_stages is not None and (not isinstance(num_stages, int) or not 1 <= num_stages <= 8):
        raise ValueError(f"num_stages must be an int in [1, 8], got {num_stages!r}")


def gate_kind(G: torch.Tensor | None, q_or_k: torch.Tensor) -> int:
    """Gate kind from G's shape; ValueError on a shape that is neither [B,T,H] nor [B,T,H,K]."""
    if G is None:
        return GATE_NONE
    B, T, H, K = q_or_k.shape
    if tuple(G.shape) == (B, T, H):
        return GATE_SCALAR
    if tuple(G.shape) == (B, T, H, K):
        return GATE_VECTOR
    raise ValueError(f"G must have shape {(B, T, H)} or {(B, T, H, K)}, got {tuple(G.shape)}")


def dot_precision(dtype: torch.dtype) -> str:
    """Value of the kernels' PREC constexpr.

    fp32 inputs promise fp32 results: tl.dot would otherwise round fp32 operands to tf32 on the GPU.
    Under TRITON_INTERPRET=1, Triton 3.6's interpreter returns garbage from tl.dot on bf16/fp16 operands, so
    "upcast" makes the kernels widen the (already input-dtype-rounded) operands to fp32 first; the product
    is the same as the GPU's 16-bit MMA with fp32 accumulation up to summation order.
    """
    if os.environ.get("TRITON_INTERPRET") == "1" and dtype in (torch.bfloat16, torch.float16):
        return "upcast"
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation (PREC from dot_precision)."""
    if PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit(do_not_specialize=["T", "H"])
def rewy_recompute_wu_kernel(
    k, v, G, erase, write, A, W, U,
    T,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_ERASE: tl.constexpr, ERASE_VEC: tl.constexpr,
    HAS_WRITE: tl.constexpr, WRITE_VEC: tl.constexpr, PREC: tl.constexpr, WANT_U: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    rows = t0 + tl.arange(0, BT)
    m_row = rows < T
    tok = (i_b * T + rows) * H + i_h  # token index into [B, T, H]
    cols_c = tl.arange(0, BT)

    # A rows beyond T (tail chunk) are unspecified in FLA's buffer; zero rows and columns past the last token.
    m_a = m_row[:, None] & ((t0 + cols_c) < T)[None, :]
    b_a = tl.load(A + tok[:, None] * BT + cols_c[None, :], mask=m_a, other=0.0)

    if HAS_ERASE and not ERASE_VEC:
        b_e = tl.load(erase + tok, mask=m_row, other=0.0).to(tl.float32)
    if GATE == 1:
        b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)

    for i_k in tl.static_range(0, (K + BK - 1) // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_row[:, None] & (o_k < K)[None, :]
        p_k = tok[:, None] * K + o_k[None, :]
        b_x = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
        if HAS_ERASE:
            if ERASE_VEC:
                b_x = b_x * tl.load(erase + p_k, mask=m_k, other=0.0).to(tl.float32)
            else:
                b_x = b_x * b_e[:, None]
        if GATE == 1:
            b_x = b_x * tl.exp(b_g)[:, None]
        elif GATE == 2:
            b_x = b_x * tl.exp(tl.load(G + p_k, mask=m_k, other=0.0).to(tl.float32))
        b_w = mm(b_a, b_x.to(b_a.dtype), PREC)
        tl.store(W + p_k, b_w.to(W.dtype.element_ty), mask=m_k)

    if WANT_U:
        _recompute_u(v, write, U, b_a, tok, m_row, V, BV, HAS_WRITE, WRITE_VEC, PREC)


@triton.jit
def _recompute_u(v, write, U, b_a, tok, m_row, V: tl.constexpr, BV: tl.constexpr, HAS_WRITE: tl.constexpr,
                 WRITE_VEC: tl.constexpr, PREC: tl.constexpr):
    # U = A (ω ⊙ V), one [BT, BV] column tile at a time (b_a: the chunk's A, masked past T)
    if HAS_WRITE and not WRITE_VEC:
        b_om = tl.load(write + tok, mask=m_row, other=0.0).to(tl.float32)
    for i_v in tl.static_range(0, (V + BV - 1) // BV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_row[:, None] & (o_v < V)[None, :]
        p_v = tok[:, None] * V + o_v[None, :]
        b_z = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
        if HAS_WRITE:
            if WRITE_VEC:
                b_z = b_z * tl.load(write + p_v, mask=m_v, other=0.0).to(tl.float32)
            else:
                b_z = b_z * b_om[:, None]
        b_u = mm(b_a, b_z.to(b_a.dtype), PREC)
        tl.store(U + p_v, b_u.to(U.dtype.element_ty), mask=m_v)


def recompute_wu(
    k: torch.Tensor,
    v: torch.Tensor,
    G: torch.Tensor | None,
    erase: torch.Tensor | None,
    write: torch.Tensor | None,
    A: torch.Tensor,
    *,
    chunk_size: int = 64,
    BK: int = 64,
    BV: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    want_u: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W = A (e ⊙ K ⊙ γ) and U = A (ω ⊙ V) per chunk, in k's dtype; want_u=False: W only (U None), for policy A,
    whose forward already gave the backward R = U − W S0.

    k [B,T,H,K]; v [B,T,H,V]; G None | [B,T,H] | [B,T,H,K] (fp32 chunk-local cumsum, natural log);
    erase None | [B,T,H] | [B,T,H,K]; write None | [B,T,H] | [B,T,H,V] (None means 1); A [B,T,H,chunk_size].
    One program per (chunk, batch·head); BK/BV are the column tiles of the two products.
    """
    validate_chunk_size(chunk_size)
    B, T, H, K = k.shape
    V = v.shape[-1]
    validate_tile("BK", BK, hi=256)
    validate_tile("BV", BV, hi=256)
    validate_launch(num_warps, num_stages)
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v must have shape [B,T,H,V] matching k's {(B, T, H)}, got {tuple(v.shape)}")
    if tuple(A.shape) != (B, T, H, chunk_size):
        raise ValueError(f"A must have shape {(B, T, H, chunk_size)}, got {tuple(A.shape)}")
    gk = gate_kind(G, k)
    if erase is not None and tuple(erase.shape) not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"erase must have shape {(B, T, H)} or {(B, T, H, K)}, got {tuple(erase.shape)}")
    if write is not None and tuple(write.shape) not in ((B, T, H), (B, T, H, V)):
        raise ValueError(f"write must have shape {(B, T, H)} or {(B, T, H, V)}, got {tuple(write.shape)}")
    k, v, A = k.contiguous(), v.contiguous(), A.contiguous()
    G = G.contiguous() if G is not None else None
    erase = erase.contiguous() if erase is not None else None
    write = write.contiguous() if write is not None else None
    W = torch.empty_like(k)
    U = torch.empty(B, T, H, V, dtype=k.dtype, device=k.device) if want_u else None
    NT = triton.cdiv(T, chunk_size)
    rewy_recompute_wu_kernel[(NT, B * H)](
        k, v, G, erase, write, A, W, U, T,
        H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
        GATE=gk, HAS_ERASE=erase is not None, ERASE_VEC=erase is not None and erase.dim() == 4,
        HAS_WRITE=write is not None, WRITE_VEC=write is not None and write.dim() == 4,
        PREC=dot_precision(k.dtype), WANT_U=want_u,
        num_warps=num_warps, num_stages=num_stages,
    )
    return W, U
