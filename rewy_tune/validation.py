"""Input checks for the public ops: every error names the argument, what was received and what is accepted."""

from __future__ import annotations

import math
import numbers

import torch

OPS = ("deltanet", "gdn", "kda", "gdn2")
POLICIES = ("R", "A")
BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM_TRITON = 256
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_unsupported(K: int, V: int, dtype: torch.dtype, others=()) -> str | None:
    """Why the Triton backward cannot take a call, naming the argument; None if it can. others: (name, tensor or
    None) of the gate and coefficients, which must not be float64 either (the kernels take 16- and 32-bit)."""
    if K > MAX_HEAD_DIM_TRITON or V > MAX_HEAD_DIM_TRITON:
        return f"q/v: the triton backend supports K, V <= {MAX_HEAD_DIM_TRITON}, got K={K}, V={V}"
    accepted = "accepted: float16, bfloat16, float32 (float64: backend='torch')"
    if dtype not in TRITON_DTYPES:
        return f"q, k, v: dtype {dtype} is not supported by the triton backend; {accepted}"
    for name, t in others:
        if t is not None and t.dtype == torch.float64:
            return f"{name}: dtype {t.dtype} is not supported by the triton backend; {accepted}"
    return None


def check_flag(name: str, value) -> None:
    """A switch must be a bool: a string such as "False" would otherwise count as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {_shape(t)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name}: dtype {t.dtype} is not supported; accepted: float16, bfloat16, float32, float64"
        )


def _expect(name: str, t: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if tuple(t.shape) != expected:
        want = "[" + ", ".join(str(s) for s in expected) + "]"
        raise ValueError(f"{name}: expected shape {want} {layout}, got {_shape(t)}")


def validate_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    erase: torch.Tensor,
    write: torch.Tensor,
    *,
    scale,
    initial_state: torch.Tensor | None,
    policy: str,
    backend: str,
    names: tuple[str, str, str] = ("g", "beta", "beta"),
) -> None:
    """Raise ValueError for anything the ops cannot compute exactly.

    `names` gives the user-facing names of (gate, erase, write): ("g", "beta", "beta") for
    DeltaNet/GDN/KDA, ("g", "b", "w") for GDN2.
    """
    if op not in OPS:
        raise ValueError(f"op: unknown operator {op!r}; accepted: {', '.join(OPS)}")
    if policy not in POLICIES:
        raise ValueError(f"policy: got {policy!r}; accepted: 'R' (recompute) or 'A' (save all)")
    if backend not in BACKENDS:
        raise ValueError(f"backend: got {backend!r}; accepted: {', '.join(repr(b) for b in BACKENDS)}")
    g_name, e_name, w_name = names
    _check_tensor("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    _check_tensor("k", k, 4, "[B, T, H, K]")
    _expect("k", k, (B, T, H, K), "(must match q [B, T, H, K])")
    _check_tensor("v", v, 4, "[B, T, H, V]")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v: expected shape [{B}, {T}, {H}, V] (B, T, H of q), got {_shape(v)}")
    V = v.shape[3]
    if T == 0 or K == 0 or V == 0:
        raise ValueError(f"q/v: T, K and V must be positive, got q {_shape(q)} and v {_shape(v)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v: must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )

    scalar = (B, T, H)
    if op == "deltanet":
        if g is not None:
            raise ValueError("g: DeltaNet has no gate; pass g=None")
    else:
        if g is None:
            raise ValueError(f"{g_name}: operator {op!r} needs a gate")
        if op == "gdn":
            _check_tensor(g_name, g, 3, "[B, T, H] (scalar gate per token and head)")
            _expect(g_name, g, scalar, "[B, T, H] (GDN's gate is a scalar per token and head)")
        else:
            _check_tensor(g_name, g, 4, "[B, T, H, K] (vector gate per key channel)")
            _expect(g_name, g, (B, T, H, K), f"[B, T, H, K] ({op.upper()}'s gate is a vector over K)")
    if op == "gdn2":
        _check_tensor(e_name, erase, 4, "[B, T, H, K]")
        _expect(e_name, erase, (B, T, H, K), "[B, T, H, K] (GDN2's erase coefficient b)")
        _check_tensor(w_name, write, 4, "[B, T, H, V]")
        _expect(w_name, write, (B, T, H, V), "[B, T, H, V] (GDN2's write coefficient w)")
    else:
        _check_tensor(e_name, erase, 3, "[B, T, H]")
        _expect(e_name, erase, scalar, "[B, T, H] (one beta per token and head)")
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, "[B, H, K, V]")
        _expect("initial_state", initial_state, (B, H, K, V), "[B, H, K, V]")

    if scale is not None:
        # a Python or NumPy real (np.float32 included); a bool is not a scale
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (scale > 0) \
                or not math.isfinite(scale):
            raise ValueError(f"scale: expected a positive finite number (Python or NumPy) or None (K**-0.5), got "
                             f"{scale!r}")

    tensors = {"q": q, "k": k, "v": v, g_name: g, e_name: erase, w_name: write,
               "initial_state": initial_state}
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must all be on one device, got {listing}")

    if backend == "triton":  # here, not when the backward runs after a forward that took the call
        reason = triton_unsupported(K, V, q.dtype, ((g_name, g), (e_name, erase), (w_name, write)))
        if reason:
            raise ValueError(reason)
