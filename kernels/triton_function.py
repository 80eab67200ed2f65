"""autograd.Function joining a chunk forward with the ReWY Triton backward, for DeltaNet and GDN.

Forward:
- CUDA: fla-core 0.6.0's Triton forward pieces. Policy R keeps what FLA itself keeps (A = M^{-1} in the
  input dtype); policy A also keeps the per-chunk entering states h (= S0, [B,NT,H,K,V], input dtype) and
  v_new (= R, the corrections u − w h before gating), which FLA computes in its forward anyway but, for
  DeltaNet/GDN, drops (FLA has no save-all switch for these two operators); with ``schedule.w_source ==
  "forward"`` also w (W = A E, [B,T,H,K] in the input dtype), as FLA's own save-all keeps it, so the backward runs
  no recompute stage. For DeltaNet and GDN policy R runs FLA's state scan V-first (`state_v_first`, as FLA's own
  layers do: faster on the H200), transposing an initial and a final state on the way; so do KDA and GDN2
  (V_FIRST_VECTOR).
    DeltaNet: `prepare_wy_repr_fwd(k, v, beta)` -> (w, u, A); `chunk_gated_delta_rule_fwd_h(k, w, u, g=None,
              initial_state)` -> (h, v_new, final_state); `chunk_fwd_o(q, k, v_new, h, g=None, scale)` -> o.
    GDN:      `chunk_local_cumsum(g, scale=RCP_LN2)` -> G·log2(e) (fp32); `chunk_gated_delta_rule_fwd_intra(k, v,
              g=G·log2e, beta)` -> (w, u, A); then fwd_h and chunk_fwd_o with the log2 gate as above.
  The natural-log G the backward needs is recomputed by the backward's own chunk cumsum (one small kernel,
  no ln 2 round trip).
- CPU (TRITON_INTERPRET=1 tests): the pure-torch reference `chunk_forward` (FLA's state scans do not run
  in Triton 3.6's interpreter, fla-baseline §13).
- KDA / GDN2 with ``schedule.dv_local_source == "forward"`` also keep the forward's A_qk (fla-core's Aqk,
  out[3] of chunk_kda_fwd / chunk_gdn2_fwd, [B,T,H,C] in the input dtype; on CPU the reference forward's
  ``ChunkForward.Aqk`` in the same convention), which FLA's own backward keeps as well; dv_local then reads it
  instead of recomputing A_qk. Otherwise it is dropped as before. Under policy A with ``schedule.scan_operands ==
  "forward"`` they also keep qg = Q ⊙ exp(G) and kg = K ⊙ exp(G_n − G) (out[7], out[8], input dtype; on CPU the
  reference's ``QG``, ``KG``) and fla-core's gate cumsum G·log2 e (out[2], fp32; on CPU the reference's G·log2 e),
  which fla-core's save-all keeps for its own backward: the reverse scan reads them, the backward runs no
  scan-operands stage, and its chunk cumsum runs beside the scan (`pipeline._cumsum_beside`).

Backward: `rewy_backward_triton` with the given Schedule (default: `search_spaces.default_schedule` for the
device's compute capability).
"""

from __future__ import annotations

import functools
import warnings

import torch
from triton.runtime.errors import OutOfResources

from rewy_tune.kernels.reference.gate import activated_gate
from rewy_tune.kernels.triton.gate import GateActivation
from rewy_tune.kernels.triton.pipeline import rewy_backward_triton
from rewy_tune.schedule import Schedule

SUPPORTED_OPS = ("deltanet", "gdn", "kda", "gdn2")
LOG2_E = 1.4426950408889634  # fla-core's gates are in log2 units (its RCP_LN2)
# Operators that backend="auto" and `rewy_tune.enable()` route here: only those whose kernels have passed the
# GPU suite (tests/kernels/test_triton_{scalar,vector}.py -m gpu) on the H200 with the current kernels: all
# four, session 3 (benchmarks/RESULTS.md). An operator whose kernels change in a way the interpreter cannot
# vouch for leaves this list until the GPU suite has run again.
GPU_VERIFIED_OPS = ("deltanet", "gdn", "kda", "gdn2")


def op_of(g: torch.Tensor | None, erase: torch.Tensor) -> str:
    """The operator a call's gate and erase shapes describe (as `rewy_backward_triton` reads them)."""
    if g is None:
        return "deltanet"
    if g.dim() == 3:
        return "gdn"
    return "gdn2" if erase.dim() == 4 else "kda"


def default_schedule_for(q: torch.Tensor, K: int, V: int, op: str | None = None, policy: str | None = None
                         ) -> Schedule:
    from rewy_tune.problem import dtype_label
    from rewy_tune.search_spaces import default_schedule

    cc = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return default_schedule(cc, K=K, V=V, op=op, dtype=dtype_label(q.dtype), policy=policy)


def schedule_rejection(schedule: Schedule, q: torch.Tensor, K: int, V: int, op: str) -> str | None:
    """Why the tuner's gate before compiling (`search.constraint_violation`: head dims, tiles, the search space's
    constraint) would turn a caller's schedule away for this call's device, head dims and dtype; None: accepted.
    Only on CUDA: the interpreter has no shared-memory limit and no sm_90 miscompiles."""
    if not q.is_cuda:
        return None
    from rewy_tune.problem import dtype_label

    cc = tuple(torch.cuda.get_device_capability(q.device))
    return _constraint_violation_once(schedule, K, V, dtype_label(q.dtype), cc, op)


@functools.lru_cache(maxsize=256)
def _constraint_violation_once(schedule: Schedule, K: int, V: int, dtype: str, cc: tuple[int, int], op: str
                               ) -> str | None:
    # about 15 µs a call uncached; the dispatcher hands the same winner over on every call of a layer
    from rewy_tune.search import constraint_violation

    return constraint_violation(schedule, op=op, K=K, V=V, compute_capability=cc, dtype=dtype)


def _warn_rejected_schedule(schedule: Schedule, q: torch.Tensor, K: int, V: int, op: str) -> None:
    # A warning, not an error: the constraint's shared-memory and register figures are estimates and may turn away
    # a schedule that compiles; but its sm_90 miscompile rules name schedules that run and give wrong gradients,
    # which must not pass unnoticed. The dispatcher's winners pass through here too (the constraint accepted them
    # when they were tuned; cached, the check costs a dictionary lookup).
    reason = schedule_rejection(schedule, q, K, V, op)
    if reason:
        warnings.warn(f"schedule: the search space's constraint rejects this schedule for {op} K={K} V={V} "
                      f"{q.dtype} on this GPU; it may fail to compile or compute wrong gradients: {reason}",
                      RuntimeWarning, stacklevel=7)  # the line that called the public op


# KDA/GDN2 under policy R: FLA's forward state scan V-first (as FLA's layers call it). On since session 20: the KDA/GDN2
# GPU layer calls passed with it, and FLA's KDA model step saved 0.158 ms with it against 0.107-0.124 without (the
# same scan kernel, 345 against 369 µs per four layers). A switch so that model_check and the tests can compare.
V_FIRST_VECTOR = True
# KDA/GDN2 under policy A: the same V-first scan, its h kept as it is (S0 a transposed view; the vector consumer reads
# it in place, vector_local S0_VK). FLA's layers run that scan V-first while ours under A ran it K-first (session 20:
# the step's forward lost about 5 µs per layer more than the bare op's). On since session 21: its GPU tests passed,
# and FLA's KDA model step under A saved 0.784 and 0.790 ms in two runs, at least the operator's gain as the layers
# call it (0.777, 0.782 ms; benchmarks/RESULTS.md). A switch so that model_check and the tests can compare.
V_FIRST_SAVED_STATES = True


def _v_first(state):
    """[B, H, K, V] <-> [B, H, V, K] (a copy; None stays None)."""
    return state.transpose(-1, -2).contiguous() if state is not None else None


def _fla_forward_vector(q, k, v, g, erase, write, initial_state, scale, chunk_size, policy, output_final_state,
                        gate=None):
    """KDA (erase is write, [B,T,H]) / GDN2 (b [B,T,H,K], w [B,T,H,V]) through fla-core's chunk_kda_fwd /
    chunk_gdn2_fwd. Returns (o, final_state, A = Akk, S0 = h, R = v_new, Aqk, W = w, (qg, kg, gk)), gk the gate's
    chunk cumsum in log2 units; policy A uses their disable_recompute path, which keeps h, v_new, w, qg, kg and gk
    (policy R: None for the four). Aqk (out[3]) is FLA's
    A_qk: see kernels/triton/vector_local.py (dv_local_aqk) for its convention. gate (a GateActivation): g is the
    raw gate input, activated by FLA's fused gate-and-cumsum kernel (its use_gate_in_kernel).
    Under policy R the state scan runs V-first (V_FIRST_VECTOR), as FLA's layers run it: in the KDA model step it
    took 345 µs for the four layers' scans where K-first took 369 (session 19). Under policy A so it does with
    V_FIRST_SAVED_STATES, and S0 is then h's transposed view, which the vector consumer reads in place."""
    v_first = V_FIRST_VECTOR if policy == "R" else V_FIRST_SAVED_STATES
    common = dict(scale=scale, initial_state=_v_first(initial_state) if v_first else initial_state,
                  output_final_state=output_final_state, chunk_size=chunk_size, disable_recompute=policy == "A",
                  state_v_first=v_first)
    if gate is not None:
        common.update(use_gate_in_kernel=True, A_log=gate.A_log, dt_bias=gate.dt_bias, lower_bound=gate.lower_bound)
    if erase.dim() == 3:
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd

        out = chunk_kda_fwd(q=q, k=k, v=v, g=g, beta=erase, **common)
    else:
        from fla.ops.gdn2.chunk_fwd import chunk_gdn2_fwd

        out = chunk_gdn2_fwd(q=q, k=k, v=v, g=g, b=erase, w_gate=write, **common)
    o, final_state, Aqk, Akk, w, v_new, h = out[0], out[1], out[3], out[4], out[5], out[9], out[10]
    final_state = _v_first(final_state) if v_first else final_state
    if policy == "A":  # out[7], out[8]: qg = Q ⊙ exp(G), kg = K ⊙ exp(G_n − G), and out[2]: its cumsum G·log2 e,
        # kept by the save-all path
        return o, final_state, Akk, h.transpose(-1, -2) if v_first else h, v_new, Aqk, w, (out[7], out[8], out[2])
    return o, final_state, Akk, None, None, Aqk, None, None


def _fla_forward(q, k, v, g, beta, initial_state, scale, chunk_size, policy, output_final_state):
    """(o, final_state, A, S0, R, W) through fla-core's forward kernels; S0, R, W (= w) None under policy R, whose
    state scan runs V-first as in `_fla_forward_vector`."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o

    if g is None:
        from fla.ops.delta_rule.wy_fast import prepare_wy_repr_fwd

        g_log2 = None
        w, u, A = prepare_wy_repr_fwd(k=k, v=v, beta=beta, cu_seqlens=None, chunk_size=chunk_size)
    else:
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        g_log2 = chunk_local_cumsum(g, chunk_size=chunk_size, scale=RCP_LN2)
        w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_log2, beta=beta, chunk_size=chunk_size)
    v_first = policy == "R"
    h, v_new, final_state = chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=g_log2, initial_state=_v_first(initial_state) if v_first else initial_state,
        output_final_state=output_final_state, chunk_size=chunk_size, state_v_first=v_first)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_log2, scale=scale, chunk_size=chunk_size, state_v_first=v_first)
    if policy == "A":
        return o, final_state, A, h, v_new, w
    return o, _v_first(final_state), A, None, None, None


class RewyTritonFunction(torch.autograd.Function):
    """``RewyTritonFunction.apply(q, k, v, g, erase, write, initial_state, scale, chunk_size, policy,
    output_final_state, schedule, gate_in_kernel, A_log, dt_bias, lower_bound) -> (o, final_state)``

    Same argument order as ``RewyTorchFunction`` plus ``schedule`` (a Schedule or None for the device
    default). DeltaNet: g None; GDN: g [B,T,H] natural-log per-token gate. erase and write are [B,T,H]; on CUDA
    they must be the same β tensor (FLA's forward has one β); autograd then sums d_erase + d_write into dβ.
    ``gate_in_kernel`` (KDA/GDN2): g is the raw gate input of FLA's in-kernel gate with A_log [H], dt_bias [H·K]
    or None and lower_bound (`kernels/reference/gate.py`); the activation runs inside FLA's forward cumsum and
    the backward's (`kernels/triton/gate.py`), and A_log and dt_bias get their gradients.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, erase, write, initial_state, scale, chunk_size, policy, output_final_state,
                schedule=None, gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None):
        if policy not in ("R", "A"):
            raise ValueError(f"policy must be 'R' or 'A', got {policy!r}")
        if g is not None and g.dim() not in (3, 4):
            raise ValueError(f"g must be None (DeltaNet), [B,T,H] (GDN) or [B,T,H,K] (KDA/GDN2), got "
                             f"{tuple(g.shape)}")
        K, V = q.shape[-1], v.shape[-1]
        op = op_of(g, erase)
        vector_gate = op in ("kda", "gdn2")
        given = schedule is not None
        schedule = schedule if given else default_schedule_for(q, K, V, op, policy)
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule or None, got {type(schedule).__name__}")
        if schedule.chunk_size != chunk_size:
            raise ValueError(f"schedule.chunk_size={schedule.chunk_size} differs from chunk_size={chunk_size}")
        if given:
            _warn_rejected_schedule(schedule, q, K, V, op)
        scale = K ** -0.5 if scale is None else float(scale)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        erase, write = erase.contiguous(), write.contiguous()
        g = g.contiguous() if g is not None else None
        gate = None
        if gate_in_kernel:
            if not vector_gate:
                raise ValueError("gate_in_kernel: the fused gate activation is for KDA and GDN2 (g [B,T,H,K])")
            gate = GateActivation(A_log, dt_bias, lower_bound)
            gate.check(g)
        keep_aqk = vector_gate and schedule.dv_local_source == "forward"
        Aqk = None
        if q.is_cuda and vector_gate:
            if erase.dim() == 3 and erase.data_ptr() != write.data_ptr():
                raise ValueError("on CUDA, KDA takes one β: pass the same tensor as erase and write")
            h0 = initial_state.float().contiguous() if initial_state is not None else None
            o, final_state, A, S0, R, Aqk, W, scan_qk = _fla_forward_vector(q, k, v, g, erase, write, h0, scale,
                                                                            chunk_size, policy, output_final_state,
                                                                            gate)
        elif q.is_cuda:
            if erase.data_ptr() != write.data_ptr() or erase.shape != write.shape:
                raise ValueError("on CUDA, DeltaNet/GDN take one β: pass the same tensor as erase and write")
            h0 = initial_state.float().contiguous() if initial_state is not None else None
            o, final_state, A, S0, R, W = _fla_forward(q, k, v, g, erase, h0, scale, chunk_size, policy,
                                                       output_final_state)
            scan_qk = None
        else:
            from rewy_tune.kernels.reference.chunk_forward import chunk_forward

            g_act = g if gate is None else activated_gate(g, A_log, dt_bias, lower_bound)
            fwd = chunk_forward(q, k, v, g_act, erase, write, scale=scale, initial_state=initial_state,
                                chunk_size=chunk_size, save_states=policy == "A")
            # kept in the input dtype, as fla-core's forward keeps A, h, v_new, w and Aqk on CUDA: the interpreter
            # tests and the sm_90 compiles of benchmarks/compile_times.py then see the GPU's argument types
            A, S0, R, Aqk, W = (t.to(q.dtype) if t is not None else None
                                for t in (fwd.A, fwd.S0, fwd.R, fwd.Aqk, fwd.W))
            o, final_state = fwd.o, fwd.final_state
            # fla-core's gate cumsum is in log2 units (G·log2 e, fp32): so is the one kept here
            scan_qk = (fwd.QG, fwd.KG, (fwd.G * LOG2_E).float()) if policy == "A" and vector_gate else None
            if S0 is not None and vector_gate and V_FIRST_SAVED_STATES:  # the layout FLA's V-first h has on CUDA
                S0 = S0.transpose(-1, -2).contiguous().transpose(-1, -2)
        Aqk = Aqk if keep_aqk else None  # saved only when the schedule's dv_local reads it
        W = W if schedule.w_source == "forward" else None  # policy A only (None under R)
        # the forward's gated q and k: policy A with scan_operands "forward" (vector gates) only
        qg, kg, gk = (scan_qk if vector_gate and schedule.scan_operands == "forward" and scan_qk is not None
                      else (None,) * 3)
        ctx.save_for_backward(q, k, v, g, erase, write, initial_state, A, S0, R, Aqk, W, A_log, dt_bias, qg, kg, gk)
        ctx.scale, ctx.schedule, ctx.gate_in_kernel, ctx.lower_bound = scale, schedule, gate is not None, lower_bound
        ctx.op = op  # for the backward's OutOfResources message
        ctx.set_materialize_grads(False)
        return o, (final_state if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, erase, write, initial_state, A, S0, R, Aqk, W, A_log, dt_bias, qg, kg, gk = ctx.saved_tensors
        gate = GateActivation(A_log, dt_bias, ctx.lower_bound) if ctx.gate_in_kernel else None
        do = torch.zeros_like(v) if do is None else do.to(v.dtype)
        h0 = initial_state.float() if initial_state is not None else None
        # DeltaNet/GDN/KDA's one β passed as erase and write: its gradient in one buffer (autograd sums the slots)
        gate_grads = {}  # the in-kernel gate's A_log and dt_bias gradients (KDA/GDN2 with gate_in_kernel)
        one_beta = (erase.dim() == 3 and erase.shape == write.shape and erase.dtype == write.dtype
                    and erase.data_ptr() == write.data_ptr())
        try:
            dq, dk, dv, dg, d_erase, d_write, dh0 = rewy_backward_triton(
                q, k, v, g, erase, write, A, do, dht, scale=ctx.scale, initial_state=h0, schedule=ctx.schedule,
                S0=S0, R=R, Aqk=Aqk, one_beta=one_beta, W=W, gate=gate, gate_grads=gate_grads,
                scan_qk=(qg, kg, gk) if qg is not None else None)
        except OutOfResources as e:  # Triton's message names a kernel, not the Schedule field to change
            K, V = q.shape[-1], v.shape[-1]
            reason = schedule_rejection(ctx.schedule, q, K, V, ctx.op)
            raise ValueError(f"schedule: a backward kernel needs more GPU resources than this device has "
                             f"({e}) for {ctx.op} K={K} V={V}; "
                             + (f"the search space's constraint says: {reason}" if reason else
                                "pass a schedule with smaller tiles or fewer stages, or schedule=None")) from e
        dA_log, ddt_bias = gate_grads.get("A_log"), gate_grads.get("dt_bias")
        if dh0 is not None and initial_state is not None:
            dh0 = dh0.to(initial_state.dtype)
        return (dq, dk, dv, dg, d_erase, d_write, dh0, None, None, None, None, None, None, dA_log, ddt_bias,
                None)


def run_triton_op(op, q, k, v, g, erase, write, *, initial_state, scale, policy, output_final_state,
                  schedule=None, gate: GateActivation | None = None):
    """Entry used by `rewy_tune.ops` for backend="triton" (gate: KDA/GDN2's in-kernel gate, g its raw input)."""
    if op not in SUPPORTED_OPS:
        raise ValueError(f"op: the Triton backward exists for {SUPPORTED_OPS}, got {op!r}")
    A_log, dt_bias, lower_bound = (gate.A_log, gate.dt_bias, gate.lower_bound) if gate is not None else (None,) * 3
    return RewyTritonFunction.apply(q, k, v, g, erase, write, initial_state, scale, 64, policy,
                                    output_final_state, schedule, gate is not None, A_log, dt_bias, lower_bound)
