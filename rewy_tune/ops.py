"""Public operators, FLA-compatible in argument order and return value `(o, final_state)`.

Each op checks its inputs, picks a backend and applies one autograd Function:
- "torch": the pure-torch chunk forward and hand-written ReWY backward (`kernels/reference`), any device;
- "triton": the ReWY Triton backward (`kernels/triton`); on CUDA, and on CPU under TRITON_INTERPRET=1;
- "auto": "triton" on CUDA where the operator's Triton kernels exist, "torch" elsewhere.
"""

from __future__ import annotations

import os

import torch

from rewy_tune.schedule import Schedule
from rewy_tune.validation import check_flag, triton_unsupported, validate_inputs



def _triton_ops() -> frozenset[str]:
    """Operators whose complete backward exists as Triton kernels (backend="triton", the tuner)."""
    from rewy_tune.kernels.triton_function import SUPPORTED_OPS

    return frozenset(SUPPORTED_OPS)


def _auto_ops() -> frozenset[str]:
    """Operators that backend="auto" and enable() send to Triton: those verified on a GPU."""
    from rewy_tune.kernels.triton_function import GPU_VERIFIED_OPS

    return frozenset(GPU_VERIFIED_OPS)


# 16-bit inputs run the backward's chained intra products (P = AᵀR̄ fed to P Rᵀ and P S0ᵀ) on tensor cores.
# On the H200 they have passed only with head dims >= 64 (64/128/256-wide tiles); at K = 16, V = 32 (block_v 32)
# an FLA DeltaNet layer call gave wrong dk / dbeta (rel-RMS ~0.4) while o, dq, dv, dh0 and the fp32 run at the
# same dims were right (fp32 products do not use tensor cores). Until smaller 16-bit tiles pass on a GPU,
# backend="auto" and enable() keep such calls off the Triton backward.
MIN_HEAD_DIM_16BIT_GPU = 64


def gpu_unverified_dims(dtype: torch.dtype, K: int, V: int) -> str | None:
    """Why the Triton backward is not GPU-verified for these head dims and dtype, or None when it is."""
    if dtype in (torch.bfloat16, torch.float16) and min(K, V) < MIN_HEAD_DIM_16BIT_GPU:
        return (f"{str(dtype).removeprefix('torch.')} with head dim K={K}, V={V} below {MIN_HEAD_DIM_16BIT_GPU} "
                "(16-bit tensor-core tiles below 64 are not GPU-verified: wrong dk/dbeta on the H200)")
    return None


def resolve_backend(op: str, backend: str, device: torch.device, dtype: torch.dtype | None = None,
                    K: int | None = None, V: int | None = None, unfit: str | None = None) -> str:
    """Turn the requested backend into the one that runs, or raise a clear ValueError. With dtype, K and V,
    "auto" also keeps on torch the CUDA calls the Triton backward cannot take (float64, K or V over its limit:
    `validation.triton_unsupported`) or whose 16-bit tiles are not GPU-verified (`gpu_unverified_dims`); so does
    `unfit`, the caller's reason from the call's other tensors (a float64 gate)."""
    if backend == "torch":
        return "torch"
    available = _triton_ops()
    on_cuda = device.type == "cuda"
    if backend == "auto":
        if unfit or (dtype is not None and K is not None and V is not None
                     and (triton_unsupported(K, V, dtype) or gpu_unverified_dims(dtype, K, V))):
            return "torch"
        return "triton" if on_cuda and op in _auto_ops() else "torch"
    # backend == "triton"
    if op not in available:
        raise ValueError(
            f"backend: 'triton' is not available for operator {op!r} yet; "
            f"accepted: 'torch' or 'auto' (triton exists for: {', '.join(sorted(available)) or 'none'})"
        )
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend: 'triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 for the CPU interpreter"
        )
    return "triton"


def _gate_activation(use_gate_in_kernel, A_log, dt_bias, lower_bound, g):
    """KDA/GDN2's in-kernel gate (FLA's ``use_gate_in_kernel``) as a checked GateActivation, or None."""
    check_flag("use_gate_in_kernel", use_gate_in_kernel)
    if not use_gate_in_kernel:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if value is not None:
                raise ValueError(f"{name} is read only with use_gate_in_kernel=True (g is then the raw gate input)")
        return None
    from rewy_tune.kernels.triton.gate import GateActivation

    gate = GateActivation(A_log, dt_bias, lower_bound)
    gate.check(g)
    # the kernels read A_log[h] and dt_bias[h·K + k] from memory: a strided view (a checked shape) is copied,
    # through autograd, so its gradient still reaches the caller's tensor
    return GateActivation(*(t.contiguous() if t is not None else None for t in (gate.A_log, gate.dt_bias)),
                          None if lower_bound is None else float(lower_bound))


def _apply(op, q, k, v, g, erase, write, *, scale, initial_state, output_final_state, policy, backend,
           schedule=None, names=("g", "beta", "beta"), gate_args=(False, None, None, None)):
    validate_inputs(op, q, k, v, g, erase, write, scale=scale, initial_state=initial_state,
                    policy=policy, backend=backend, names=names)
    check_flag("output_final_state", output_final_state)
    if schedule is not None and not isinstance(schedule, Schedule):  # whichever backend runs: never ignored
        raise ValueError(f"schedule: expected a rewy_tune.Schedule or None, got {type(schedule).__name__}")
    gate = _gate_activation(*gate_args, g)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # (backend "triton" had this check in validate_inputs; "auto" reads it to stay on torch)
    unfit = triton_unsupported(q.shape[-1], v.shape[-1], q.dtype, zip(names, (g, erase, write))) \
        if backend == "auto" else None
    chosen = resolve_backend(op, backend, q.device, q.dtype, q.shape[-1], v.shape[-1], unfit=unfit)
    if chosen == "torch":
        from rewy_tune.kernels.reference.function import RewyTorchFunction

        if gate is not None:  # the reference takes the activated gate; autograd carries A_log, dt_bias
            from rewy_tune.kernels.reference.gate import activated_gate

            g = activated_gate(g, gate.A_log, gate.dt_bias, gate.lower_bound)

        return RewyTorchFunction.apply(q, k, v, g, erase, write, initial_state, scale, 64, policy,
                                       output_final_state)
    from rewy_tune.kernels.triton_function import run_triton_op

    if schedule is None and q.is_cuda:  # tuned schedule from the winners database (rewy_tune.dispatch)
        from rewy_tune.device import current_device
        from rewy_tune.dispatch import lookup, problem_for_call

        problem = problem_for_call(op, q, v, policy, initial_state)
        if problem is not None:
            schedule = lookup(problem, current_device(q.device.index))[0]
    return run_triton_op(op, q, k, v, g, erase, write, initial_state=initial_state, scale=scale,
                         policy=policy, output_final_state=output_final_state, schedule=schedule, gate=gate)


def chunk_deltanet(q, k, v, beta, scale=None, initial_state=None, output_final_state=False, *,
                   policy="R", backend="auto", schedule=None):
    """DeltaNet: S_t = S_{t-1} + k_t u_tᵀ, u_t = β_t (v_t − S_{t-1}ᵀ k_t); o_t = S_tᵀ (s q_t).

    q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V].
    Returns (o [B, T, H, V], final_state [B, H, K, V] fp32 or None).
    """
    return _apply("deltanet", q, k, v, None, beta, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, policy=policy, backend=backend, schedule=schedule)


def chunk_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
              policy="R", backend="auto", schedule=None):
    """Gated DeltaNet: S' = e^{g_t} S_{t-1}; u_t = β_t (v_t − S'ᵀ k_t); S_t = S' + k_t u_tᵀ.

    g: [B, T, H] per-token natural-log decay (not cumulative); other shapes as `chunk_deltanet`.
    """
    return _apply("gdn", q, k, v, g, beta, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, policy=policy, backend=backend, schedule=schedule)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
              policy="R", backend="auto", schedule=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              lower_bound=None):
    """Kimi Delta Attention: GDN with a per-key-channel gate S' = Diag(e^{g_t}) S_{t-1}.

    g: [B, T, H, K] per-token natural-log decay; beta: [B, T, H]. With ``use_gate_in_kernel`` (as FLA's
    chunk_kda) g is the raw gate input and the op applies −exp(A_log)·softplus(g + dt_bias), or with
    ``lower_bound`` L: L·sigmoid(exp(A_log)·(g + dt_bias)); A_log [H], dt_bias [H·K] (optional) get gradients.
    """
    return _apply("kda", q, k, v, g, beta, beta, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, policy=policy, backend=backend, schedule=schedule,
                  gate_args=(use_gate_in_kernel, A_log, dt_bias, lower_bound))


def chunk_gdn2(q, k, v, g, b, w, scale=None, initial_state=None, output_final_state=False, *,
               policy="R", backend="auto", schedule=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
               lower_bound=None):
    """Gated DeltaNet-2: S' = Diag(e^{g_t}) S_{t-1}; u_t = w_t⊙v_t − S'ᵀ(b_t⊙k_t); S_t = S' + k_t u_tᵀ.

    g, b: [B, T, H, K]; w: [B, T, H, V]. ``use_gate_in_kernel``, A_log, dt_bias, lower_bound: as `chunk_kda`.
    """
    return _apply("gdn2", q, k, v, g, b, w, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, policy=policy, backend=backend, schedule=schedule,
                  names=("g", "b", "w"), gate_args=(use_gate_in_kernel, A_log, dt_bias, lower_bound))
