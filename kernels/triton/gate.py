"""The in-kernel gate activation of KDA and GDN2 (FLA's ``use_gate_in_kernel``), fused into the backward.

FLA's layers hand the chunk op the raw gate input x with ``A_log``, ``dt_bias`` (and ``lower_bound``), and the op
applies the activation itself (`kernels/reference/gate.py` has the formulas). Applied outside the op, the
activated gate is one more fp32 [B,T,H,K] tensor written, read and kept for the backward per layer (session 19:
the routed KDA model step lost 0.06 ms of forward time that way). Fused:
- the backward's chunk cumsum (`cumsum.chunk_cumsum(gate=...)`) reads x and applies the activation (`activate`);
- the consumer's dg is the gradient of the activated gate; `gate_backward` turns it into dx and the parameter
  gradients dA_log, ddt_bias (per-block partial sums, then one sum over blocks: deterministic, no atomics).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
import triton
import triton.language as tl

from .recompute import validate_launch

GATE_BLOCK_T = 32  # token rows per gate_backward program


def param_shapes(H: int, K: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The shapes of A_log and dt_bias the in-kernel gate takes for a vector gate [B, T, H, K]: those FLA's layers
    pass (A_log [H], dt_bias [H·K]; [H, K] reads the same). A tensor with the right number of elements in another
    shape, e.g. [K, H], would be read in the wrong order."""
    return {"A_log": ((H,),), "dt_bias": ((H * K,), (H, K))}


@dataclasses.dataclass(frozen=True)
class GateActivation:
    """``A_log`` [H] (optional with a lower bound), ``dt_bias`` [H·K] or None, ``lower_bound`` a float or None
    (softplus form)."""

    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    lower_bound: float | None = None

    def check(self, g: torch.Tensor) -> None:
        """ValueError naming the argument unless this activation fits a vector gate input g [B, T, H, K]."""
        if g.dim() != 4:
            raise ValueError(f"g: the in-kernel gate takes a raw vector gate [B, T, H, K], got {tuple(g.shape)}")
        H, K = g.shape[2], g.shape[3]
        if self.A_log is None and self.lower_bound is None:
            raise ValueError("A_log: the softplus gate (no lower_bound) needs A_log [H]")
        accepted = param_shapes(H, K)
        for name, t in (("A_log", self.A_log), ("dt_bias", self.dt_bias)):
            shapes = accepted[name]
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a floating-point tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
            if tuple(t.shape) not in shapes:
                want = " or ".join(str(list(s)) for s in shapes)
                raise ValueError(f"{name} must have shape {want} ({'H' if name == 'A_log' else 'H*K or [H, K]'} "
                                 f"for g [B, T, H, K] = {list(g.shape)}), got {list(t.shape)}")
            if t.device != g.device:
                raise ValueError(f"{name} is on {t.device}, g on {g.device}: pass them on one device")
        lb = self.lower_bound
        # L·sigmoid(...) is a log decay only for L < 0 (L > 0 grows the state without bound)
        if lb is not None and (isinstance(lb, bool) or not isinstance(lb, numbers.Real) or not math.isfinite(lb)
                               or lb >= 0):
            raise ValueError(f"lower_bound must be a negative finite number or None, got {lb!r}")


@triton.jit
def gate_params(A_log, dt_bias, i_h, o_k, m_k, K: tl.constexpr, BK: tl.constexpr, HAS_A: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """(a, bias) of head i_h: a = exp(A_log[i_h]) (1.0 without A_log), bias the [1, BK] row dt_bias[i_h, o_k]."""
    bias = tl.zeros([1, BK], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
    a = 1.0
    if HAS_A:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    return a, bias


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's (threshold 20)


@triton.jit
def activate(x, a, bias, lower_bound, HAS_BIAS: tl.constexpr, LOWER: tl.constexpr):
    """The activated gate at the raw fp32 input x ((a, bias) from `gate_params`): see the module doc."""
    if HAS_BIAS:
        x = x + bias
    if LOWER:
        y = lower_bound * tl.sigmoid(a * x)
    else:
        y = -a * _softplus(x)
    return y


@triton.jit
def activation_grad(x, a, bias, dy, lower_bound, HAS_BIAS: tl.constexpr, LOWER: tl.constexpr):
    """(dx, dA) at the raw fp32 input x for dy, the gradient of the activated gate: dx its input's gradient, dA the
    terms that sum to A_log's (a = exp(A_log), 1.0 without A_log; bias broadcastable to x)."""
    if HAS_BIAS:
        x = x + bias
    if LOWER:
        z = a * x
        s = tl.sigmoid(z)
        dz = dy * lower_bound * s * (1.0 - s)
        dx = dz * a
        dA = dz * z  # d z / d A_log = a x = z
    else:
        dx = -dy * a * tl.sigmoid(x)
        dA = -dy * a * _softplus(x)  # d y / d A_log = y
    return dx, dA


@triton.jit(do_not_specialize=["N"])
def rewy_gate_backward_kernel(
    g, A_log, dt_bias, dy, dx, dA_parts, db_parts, N, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, LOWER: tl.constexpr,
):
    # program (block of BT tokens of the flattened B·T, head): dx for its rows, its share of dA_log[h], ddt_bias[h, :]
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    rows = i_n * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m = (rows < N)[:, None] & m_k[None, :]
    p = (rows.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_x = tl.load(g + p, mask=m, other=0.0).to(tl.float32)
    b_a, b_b = gate_params(A_log, dt_bias, i_h, o_k, m_k, K, BK, HAS_A, HAS_BIAS)
    b_dx, b_dA = activation_grad(b_x, b_a, b_b, b_dy, lower_bound, HAS_BIAS, LOWER)
    b_dx = tl.where(m, b_dx, 0.0)
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)
    if HAS_A:  # this block's term of dA_log[h]
        tl.store(dA_parts + i_n * H + i_h, tl.sum(tl.sum(tl.where(m, b_dA, 0.0), axis=1), axis=0))
    if HAS_BIAS:  # this block's column sums: its term of ddt_bias[h, :]
        tl.store(db_parts + (i_n * H + i_h) * K + o_k, tl.sum(b_dx, axis=0), mask=m_k)


def gate_backward(g: torch.Tensor, act: GateActivation, dy: torch.Tensor, *, num_warps: int = 4):
    """(dx in g's dtype, dA_log in A_log's dtype or None, ddt_bias in dt_bias's dtype or None) for the raw gate
    input g [B,T,H,K] and dy, the gradient of the activated gate (any float dtype, same shape)."""
    act.check(g)
    validate_launch(num_warps)
    if tuple(dy.shape) != tuple(g.shape):
        raise ValueError(f"dy must have g's shape {tuple(g.shape)}, got {tuple(dy.shape)}")
    B, T, H, K = g.shape
    N = B * T
    g, dy = g.contiguous(), dy.contiguous()
    NB = triton.cdiv(N, GATE_BLOCK_T)
    dx = torch.empty_like(g)
    dA = torch.empty(NB, H, dtype=torch.float32, device=g.device) if act.A_log is not None else None
    db = torch.empty(NB, H, K, dtype=torch.float32, device=g.device) if act.dt_bias is not None else None
    rewy_gate_backward_kernel[(NB, H)](
        g, act.A_log, act.dt_bias, dy, dx, dA, db, N,
        float(act.lower_bound) if act.lower_bound is not None else 0.0,
        H=H, K=K, BK=triton.next_power_of_2(K), BT=GATE_BLOCK_T,
        HAS_A=act.A_log is not None, HAS_BIAS=act.dt_bias is not None, LOWER=act.lower_bound is not None,
        num_warps=num_warps)
    # one sum over the blocks' parts (deterministic, no atomics), in the parameters' dtypes
    dA_log = dA.sum(0).reshape(act.A_log.shape).to(act.A_log.dtype) if dA is not None else None
    ddt_bias = db.reshape(NB, -1).sum(0).reshape(act.dt_bias.shape).to(act.dt_bias.dtype) if db is not None else None
    return dx, dA_log, ddt_bias
