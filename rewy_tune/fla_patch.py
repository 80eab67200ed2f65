"""Route fla-core 0.6.0's chunk ops through the ReWY backward: `enable()`, `disable()`, `with enabled():`.

`enable()` replaces `chunk_delta_rule`, `chunk_gated_delta_rule`, `chunk_kda` and `chunk_gdn2` in their
defining modules and in every loaded module that holds the original function object under some name
(`fla.ops`, `fla.ops.kda`, FLA's layers when flash-linear-attention is installed, user modules that did
`from fla.ops import chunk_kda`). `disable()` puts back exactly the objects it replaced.

A call runs the ReWY op (schedule from `dispatch.lookup`) only inside the supported envelope: CUDA
tensors, an operator whose Triton backward is GPU-verified (`kernels.triton_function.GPU_VERIFIED_OPS`),
equal-length sequences (no cu_seqlens / context parallel), v heads == q heads (no GVA), K, V in [16, 256],
dtype bf16/fp16/fp32 (bf16/fp16 only with K, V >= 64: `ops.gpu_unverified_dims`), chunk_size 64. Any other
call goes to the original FLA function unchanged; both are counted in `report()`. A call whose tuned winner
was measured slower than FLA (`dispatch.measured_speedup` < 1, from the winner's promotion against FLA) also
goes to FLA: enabling rewy-tune must not slow a model down. Set ``REWY_ALLOW_SLOWER=1`` to route such calls
anyway (to measure them); built-in schedules carry no measurement and are routed.

FLA's in-kernel activations, which its layers always request, are applied outside the op and the ReWY op runs
on the activated tensors (`Activations`, `activation_plan`, `apply_activations`):
- ``use_qk_l2norm_in_kernel``: q and k through FLA's `fla.modules.l2norm.l2norm` (eps 1e-6, input dtype out);
- ``use_beta_sigmoid_in_kernel`` (``allow_neg_eigval``: 2·sigmoid): FLA's `fla.ops.common.gate.fused_beta_sigmoid`
  (float32 out);
- ``use_gate_in_kernel`` with ``A_log`` / ``dt_bias`` (and ``lower_bound``, KDA and GDN2): GDN's through FLA's
  `fla.ops.gated_delta_rule.gate.fused_gdn_gate` (float32 out, [B, T, H]); KDA's and GDN2's are not applied
  outside: the op takes the raw gate with ``use_gate_in_kernel`` (`ops.chunk_kda`), FLA's forward fuses it into
  its chunk cumsum and the ReWY backward into its own (`kernels/triton/gate.py`). Outside the op it cost one more
  fp32 [B, T, H, K] tensor per layer and 0.06 ms of a 4-layer KDA model step (session 19);
- ``state_v_first``: initial and final state in FLA's [V, K] layout, transposed on the way in and out;
- ``safe_gate`` (KDA, GDN2): FLA's hint that its own kernels may use a faster path for gates bounded below;
  it does not change the function computed, so it needs nothing (invalid combinations still go to FLA).
These are FLA's own autograd functions, so the forward values and the gradients reaching q, k, g, beta,
``A_log`` and ``dt_bias`` are computed by the same kernels as inside FLA's op. Off CUDA (only reachable when a
test admits the Triton interpreter) the same formulas run as differentiable torch code. Calls FLA itself
rejects (``allow_neg_eigval`` without the in-kernel sigmoid, an in-kernel gate without ``A_log``, ``safe_gate``
with a ``lower_bound`` outside [-5, 0), KDA/GDN2 initial_state not float32) go to FLA, which raises its error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import sys
import threading
import warnings

from rewy_tune import dispatch as _report

# operator -> (defining module, public name)
TARGETS: dict[str, tuple[str, str]] = {
    "deltanet": ("fla.ops.delta_rule.chunk", "chunk_delta_rule"),
    "gdn": ("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule"),
    "kda": ("fla.ops.kda.chunk", "chunk_kda"),
    "gdn2": ("fla.ops.gdn2.chunk", "chunk_gdn2"),
}
# Modules imported (when present) before the scan so that the names they bound are patched too.
EXTRA_MODULES = ("fla.ops", "fla.ops.delta_rule", "fla.ops.gated_delta_rule", "fla.ops.kda", "fla.ops.gdn2",
                 "fla.layers", "fla.layers.delta_net", "fla.layers.gated_deltanet", "fla.layers.kda",
                 "fla.layers.gdn2")

_DATA_ARGS = {
    "deltanet": ("q", "k", "v", "beta"),
    "gdn": ("q", "k", "v", "g", "beta"),
    "kda": ("q", "k", "v", "g", "beta"),
    "gdn2": ("q", "k", "v", "g", "b", "w"),
}
_PASSED = {"scale", "initial_state", "output_final_state"}
# FLA options applied outside the op (see the module docstring), per operator; FLA 0.6.0's names, whether they
# are named parameters or read from **kwargs (GDN's use_gate_in_kernel, A_log and dt_bias; KDA/GDN2's A_log, dt_bias).
_HANDLED = {
    "deltanet": frozenset({"use_qk_l2norm_in_kernel"}),
    "gdn": frozenset({"use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
                      "use_gate_in_kernel", "A_log", "dt_bias"}),
    "kda": frozenset({"use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                      "allow_neg_eigval", "safe_gate", "lower_bound", "state_v_first", "A_log", "dt_bias"}),
    "gdn2": frozenset({"use_qk_l2norm_in_kernel", "use_gate_in_kernel", "safe_gate", "lower_bound", "state_v_first",
                       "A_log", "dt_bias"}),
}
_DTYPES = {"torch.bfloat16", "torch.float16", "torch.float32"}
_NAMED_REASONS = {
    "cu_seqlens": "varlen (cu_seqlens)", "cu_seqlens_cpu": "varlen (cu_seqlens)",
    "chunk_indices": "varlen (chunk_indices)", "cp_context": "context parallel (cp_context)",
    "use_graph": "varlen graph mode (use_graph)", "max_num_seqs": "varlen graph mode (max_num_seqs)",
    "return_intermediate_states": "return_intermediate_states (inference: FLA returns chunk states)",
    "disable_recompute": "disable_recompute (FLA's save-all mode; enable(policy='A') is ReWY's)",
    "transpose_state_layout": "deprecated transpose_state_layout (use state_v_first)",
    "use_qk_l2norm_in_kernel": "in-kernel q/k l2norm", "use_gate_in_kernel": "in-kernel gate activation",
    "use_beta_sigmoid_in_kernel": "in-kernel beta sigmoid", "allow_neg_eigval": "allow_neg_eigval",
    "state_v_first": "state_v_first layout", "safe_gate": "safe_gate", "lower_bound": "lower_bound",
}
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
L2NORM_EPS = 1e-6  # fla.modules.l2norm.l2norm's default, the one FLA's in-kernel l2norm uses

_lock = threading.RLock()
_state = {"active": False, "policy": "R"}
_originals: dict[str, object] = {}  # op -> original FLA function
_wrappers: dict[str, object] = {}  # op -> our replacement
_patched: list[tuple[object, str, object]] = []  # (module, attribute, original) in patch order


def _triton_ops() -> frozenset[str]:
    from rewy_tune.ops import _auto_ops

    return _auto_ops()


def _unverified_dims(dtype, K: int, V: int) -> str | None:
    """16-bit calls whose tensor-core tiles have not passed on a GPU (`ops.gpu_unverified_dims`) go to FLA."""
    from rewy_tune.ops import gpu_unverified_dims

    return gpu_unverified_dims(dtype, K, V)


def _device_reason(tensors) -> str | None:
    """Routing needs CUDA tensors (tests replace this to admit the Triton interpreter on a CPU)."""
    return None if all(t.is_cuda for t in tensors) else "not CUDA"


# -- FLA's in-kernel activations, applied outside the op ---------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)  # holds tensors: compared by identity
class Activations:
    """What an FLA call asks its kernel to compute before the recurrence (all off: a plain call)."""

    l2norm: bool = False  # use_qk_l2norm_in_kernel
    gate: bool = False  # use_gate_in_kernel: g is the raw gate input
    A_log: object = None  # [H] (gate only)
    dt_bias: object = None  # GDN [H], KDA/GDN2 [H*K] (gate only)
    lower_bound: float | None = None  # KDA/GDN2 gate: lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
    beta_sigmoid: bool = False  # use_beta_sigmoid_in_kernel
    beta_scale: float = 1.0  # 2.0 with allow_neg_eigval
    state_v_first: bool = False  # initial/final state [B, H, V, K]

    def describe(self, gate_in_op: bool = False) -> str:
        """'' for a plain call, else what is applied outside the op (for the report)."""
        parts = []
        if self.l2norm:
            parts.append("q/k l2norm")
        if self.gate and not gate_in_op:
            parts.append("gate" + (f" (lower_bound {self.lower_bound:g})" if self.lower_bound is not None else ""))
        if self.beta_sigmoid:
            parts.append("beta sigmoid" + (" x2" if self.beta_scale != 1.0 else ""))
        if self.state_v_first:
            parts.append("V-first state")
        return ", ".join(parts)


def _is_set(value) -> bool:
    return value is not None and value is not False


def activation_plan(op: str, arguments: dict, extra: dict) -> tuple[Activations | None, str | None]:
    """(Activations, None) when every FLA option of this call can be reproduced outside the op, else (None,
    reason). `arguments` are the bound named parameters (defaults not applied, data tensors included), `extra`
    the **kwargs FLA received. Checks options only, not tensors (see `envelope_reason`)."""
    import torch

    handled = _HANDLED[op]
    for name, value in arguments.items():
        if name in _DATA_ARGS[op] or name in _PASSED or name == "kwargs" or name in handled:
            continue
        if _is_set(value):
            return None, _NAMED_REASONS.get(name, f"option {name}={value!r}")
    for name, value in extra.items():  # FLA reads some **kwargs by presence: any other key goes to FLA
        if name in handled or (name == "chunk_size" and value == 64):
            continue
        return None, _NAMED_REASONS.get(name, f"option {name}")
    opts = {**{n: v for n, v in arguments.items() if n in handled}, **{n: v for n, v in extra.items() if n in handled}}
    beta_sigmoid = bool(opts.get("use_beta_sigmoid_in_kernel", False))
    if bool(opts.get("allow_neg_eigval", False)) and not beta_sigmoid:
        return None, "allow_neg_eigval without use_beta_sigmoid_in_kernel (FLA rejects it)"
    gate = bool(opts.get("use_gate_in_kernel", False))
    A_log, dt_bias, lower_bound = opts.get("A_log"), opts.get("dt_bias"), opts.get("lower_bound")
    if gate:
        if A_log is None and (op == "gdn" or lower_bound is None):
            return None, "in-kernel gate without A_log (FLA rejects it)"
        if opts.get("safe_gate") and (lower_bound is None or not -5 <= lower_bound < 0):
            return None, f"safe_gate with lower_bound={lower_bound!r} outside [-5, 0) (FLA rejects it)"
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None and not isinstance(t, torch.Tensor):
                return None, f"{name} is not a tensor"
        if lower_bound is not None and not isinstance(lower_bound, (int, float)):
            return None, f"lower_bound={lower_bound!r} is not a number"
        if lower_bound is not None and not lower_bound < 0:  # the op refuses it; FLA computes what it computes
            return None, f"lower_bound={lower_bound!r} is not negative (the routed gate takes L < 0)"
    else:  # FLA ignores them without the in-kernel gate
        A_log = dt_bias = lower_bound = None
    acts = Activations(
        l2norm=bool(opts.get("use_qk_l2norm_in_kernel", False)), gate=gate, A_log=A_log, dt_bias=dt_bias,
        lower_bound=None if lower_bound is None else float(lower_bound), beta_sigmoid=beta_sigmoid,
        beta_scale=2.0 if bool(opts.get("allow_neg_eigval", False)) else 1.0,
        state_v_first=bool(opts.get("state_v_first", False)))
    return acts, None


def _compute_dtype(x):
    import torch

    return torch.promote_types(x.dtype, torch.float32)


def _l2norm(x, fused: bool):
    if fused:
        from fla.modules.l2norm import l2norm

        return l2norm(x, eps=L2NORM_EPS)
    import torch

    xc = x.to(_compute_dtype(x))
    return (xc * torch.rsqrt(xc.square().sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def _beta_sigmoid(beta, scale: float, fused: bool):
    if fused:
        from fla.ops.common.gate import fused_beta_sigmoid

        return fused_beta_sigmoid(beta, scale=scale)
    return scale * beta.to(_compute_dtype(beta)).sigmoid()


def _gate(op: str, g, acts: Activations, fused: bool):
    import torch

    A_log, dt_bias, lower_bound = acts.A_log, acts.dt_bias, acts.lower_bound
    if fused and op == "gdn":  # KDA's and GDN2's gate runs inside the op when routed (`gate_in_op`)
        from fla.ops.gated_delta_rule.gate import fused_gdn_gate

        return fused_gdn_gate(g, A_log, dt_bias, output_dtype=torch.float32)
    from rewy_tune.kernels.reference.gate import activated_gate

    return activated_gate(g, A_log, dt_bias, lower_bound)


def gate_in_op(op: str, acts: Activations) -> bool:
    """Whether the routed op applies this call's gate activation itself (KDA, GDN2: `ops.chunk_kda`'s
    use_gate_in_kernel), so that `apply_activations(..., gate_in_op=True)` leaves g raw."""
    return acts.gate and op in ("kda", "gdn2")


def apply_activations(op: str, arguments: dict, acts: Activations, *, fused: bool | None = None,
                      gate_in_op: bool = False) -> dict:
    """The plain-call tensors {q, k, v, g?, beta | b, w, initial_state} of an FLA call: `acts` applied with
    FLA's autograd kernels (`fused`, default on CUDA) or the same formulas in torch, initial state in [K, V].
    gate_in_op: g is left raw, for an op that takes the gate activation itself (see `gate_in_op`)."""
    out = {name: arguments.get(name) for name in _DATA_ARGS[op]}
    if fused is None:
        fused = out["q"].is_cuda
    if acts.l2norm:
        out["q"], out["k"] = _l2norm(out["q"], fused), _l2norm(out["k"], fused)
    if acts.gate and not gate_in_op:
        out["g"] = _gate(op, out["g"], acts, fused)
    if acts.beta_sigmoid:
        out["beta"] = _beta_sigmoid(out["beta"], acts.beta_scale, fused)
    h0 = arguments.get("initial_state")
    if h0 is not None and acts.state_v_first:
        h0 = h0.transpose(-1, -2).contiguous()
    out["initial_state"] = h0
    return out


def restore_state(final_state, acts: Activations):
    """The op's [B, H, K, V] final state in the layout the FLA call asked for."""
    if final_state is not None and acts.state_v_first:
        return final_state.transpose(-1, -2).contiguous()
    return final_state


# -- the envelope and the routed call ------------------------------------------------------------------

def _plan(op: str, arguments: dict, extra: dict) -> tuple[Activations | None, str | None]:
    """(Activations, None) when this FLA call can run on ReWY, else (None, why not)."""
    import torch

    q, v = arguments.get("q"), arguments.get("v")
    tensors = [arguments.get(n) for n in _DATA_ARGS[op]]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None, "a data argument is not a tensor"
    acts, reason = activation_plan(op, arguments, extra)
    if reason is not None:
        return None, reason
    if q.ndim != 4 or v.ndim != 4:
        return None, "not [B, T, H, D] tensors"
    if v.shape[2] != q.shape[2]:
        return None, f"GVA (v heads {v.shape[2]} != q heads {q.shape[2]})"
    B, T, H, K = q.shape
    V = v.shape[-1]
    if not (MIN_HEAD_DIM <= K <= MAX_HEAD_DIM and MIN_HEAD_DIM <= V <= MAX_HEAD_DIM):
        return None, f"head dim K={K}, V={V} outside [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if str(q.dtype) not in _DTYPES:
        return None, f"dtype {str(q.dtype).removeprefix('torch.')}"
    if any(t.dtype != q.dtype for t in (arguments.get("k"), v)):
        return None, "q, k, v dtypes differ"
    expected = {"g": (B, T, H) if op == "gdn" else (B, T, H, K), "beta": (B, T, H), "b": (B, T, H, K),
                "w": (B, T, H, V), "k": (B, T, H, K)}
    for name in _DATA_ARGS[op]:
        t = arguments[name]
        if name in expected and tuple(t.shape) != expected[name]:
            return None, f"{name} shape {list(t.shape)} (FLA expects {list(expected[name])})"
    if acts.gate:
        want = {"A_log": H, "dt_bias": H if op == "gdn" else H * K}
        for name, t in (("A_log", acts.A_log), ("dt_bias", acts.dt_bias)):
            if t is not None and t.numel() != want[name]:
                return None, f"{name} has {t.numel()} elements (FLA expects {want[name]})"
        # KDA/GDN2's gate runs inside our op, which takes the shapes FLA's layers pass (`GateActivation.check`)
        from rewy_tune.kernels.triton.gate import param_shapes

        shapes = param_shapes(H, K)
        for name, t in (("A_log", acts.A_log), ("dt_bias", acts.dt_bias)):
            if op != "gdn" and t is not None and tuple(t.shape) not in shapes[name]:
                return None, f"{name} shape {list(t.shape)} (the routed gate takes " + \
                    " or ".join(str(list(x)) for x in shapes[name]) + ")"
    h0 = arguments.get("initial_state")
    if h0 is not None:
        layout = (B, H, V, K) if acts.state_v_first else (B, H, K, V)
        if not isinstance(h0, torch.Tensor) or tuple(h0.shape) != layout:
            return None, "initial_state is not " + ("[B, H, V, K] (state_v_first)" if acts.state_v_first
                                                    else "[B, H, K, V]")
        if op in ("kda", "gdn2") and h0.dtype != torch.float32:
            return None, f"initial_state dtype {str(h0.dtype).removeprefix('torch.')} (FLA requires float32)"
    reason = _device_reason(tensors)
    if reason is not None:
        return None, reason
    reason = _unverified_dims(q.dtype, K, V)
    if reason is not None:
        return None, reason
    if op not in _triton_ops():
        return None, f"no ReWY Triton backward for {op} yet"
    return acts, None


def envelope_reason(op: str, arguments: dict, extra: dict) -> str | None:
    """Why this FLA call cannot run on ReWY, or None when it can. `arguments` are the bound parameters
    (defaults not applied), `extra` the **kwargs FLA received."""
    return _plan(op, arguments, extra)[1]


class _PreferFla(Exception):
    """Raised by `_route` before running anything: this call is better left to FLA (the message says why)."""


def _route(op: str, arguments: dict, acts: Activations | None = None):
    from rewy_tune import ops
    from rewy_tune.device import current_device
    from rewy_tune.dispatch import lookup, measured_speedup
    from rewy_tune.problem import Problem

    acts = Activations() if acts is None else acts
    fused_gate = gate_in_op(op, acts)
    a = apply_activations(op, arguments, acts, gate_in_op=fused_gate)
    q, v, h0 = a["q"], a["v"], a["initial_state"]
    policy = _state["policy"]
    problem = Problem.from_tensors(op, q, v, policy, initial_state=h0)
    device = current_device(q.device.index)
    schedule, reason = lookup(problem, device)
    if not device.is_cpu and os.environ.get("REWY_ALLOW_SLOWER") != "1":
        speedup = measured_speedup(problem, device)
        if speedup is not None and speedup < 1.0:
            raise _PreferFla(f"measured slower than FLA ({speedup:.2f}x, {reason.split(':')[0]} winner for "
                             f"{problem.bucket().label}; REWY_ALLOW_SLOWER=1 routes it)")
    applied = acts.describe(gate_in_op=fused_gate)
    _report.record_routed(op, problem.bucket().label, schedule,
                          reason + (f"; applied outside the op: {applied}" if applied else "")
                          + ("; gate applied in the op" if fused_gate else ""))
    common = dict(scale=arguments.get("scale"), initial_state=h0,
                  output_final_state=bool(arguments.get("output_final_state", False)),
                  policy=policy, backend="triton", schedule=schedule)
    if fused_gate:
        common.update(use_gate_in_kernel=True, A_log=acts.A_log, dt_bias=acts.dt_bias, lower_bound=acts.lower_bound)
    if op == "deltanet":
        o, ht = ops.chunk_deltanet(a["q"], a["k"], a["v"], a["beta"], **common)
    elif op == "gdn":
        o, ht = ops.chunk_gdn(a["q"], a["k"], a["v"], a["g"], a["beta"], **common)
    elif op == "kda":
        o, ht = ops.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], **common)
    else:
        o, ht = ops.chunk_gdn2(a["q"], a["k"], a["v"], a["g"], a["b"], a["w"], **common)
    return o, restore_state(ht, acts)


def _make_wrapper(op: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def rewy_dispatch(*args, **kwargs):
        if not _state["active"]:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            acts, reason = None, "arguments not recognised"
        else:
            arguments = dict(bound.arguments)
            extra = arguments.pop("kwargs", {}) or {}
            acts, reason = _plan(op, arguments, extra)
        if reason is None:
            try:
                return _route(op, arguments, acts)
            except _PreferFla as prefer:
                reason = str(prefer)
        _report.record_fallback(op, reason)
        return original(*args, **kwargs)

    rewy_dispatch.__rewy_original__ = original
    rewy_dispatch.__rewy_op__ = op
    return rewy_dispatch


def _load_originals() -> None:
    """(Re)read the functions FLA defines now (unless a patch is active) and build their replacements."""
    if _state["active"] and len(_originals) == len(TARGETS):
        return
    for op, (module_name, name) in TARGETS.items():
        module = importlib.import_module(module_name)
        fn = getattr(module, name)
        fn = getattr(fn, "__rewy_original__", fn)
        if _originals.get(op) is not fn:
            _originals[op] = fn
            _wrappers[op] = _make_wrapper(op, fn)


def _bindings(targets: dict[str, object]):
    """(module, attribute, op) for every loaded module attribute that is one of `targets` (op -> object)."""
    by_id = {id(obj): op for op, obj in targets.items()}
    for module in list(sys.modules.values()):
        if module is None or module is sys.modules[__name__]:
            continue
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in items:
            op = by_id.get(id(value))
            if op is not None and value is targets[op]:
                yield module, attr, op


def _scan_and_patch() -> int:
    """Replace every reference to an original found in a loaded module; returns how many were replaced."""
    count = 0
    for module, attr, op in _bindings(_originals):
        setattr(module, attr, _wrappers[op])
        _patched.append((module, attr, _originals[op]))
        count += 1
    return count


def enable(policy: str = "R") -> None:
    """Route FLA's chunk ops through ReWY (idempotent; a second call rescans modules loaded since)."""
    if policy not in ("R", "A"):
        raise ValueError(f"policy must be 'R' or 'A', got {policy!r}")
    with _lock:
        _load_originals()
        for name in EXTRA_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # flash-linear-attention (fla.layers) is optional
                pass
        _state["policy"] = policy
        _scan_and_patch()
        _state["active"] = True


def disable() -> None:
    """Put back exactly the FLA function objects `enable()` replaced."""
    with _lock:
        _state["active"] = False
        while _patched:
            module, attr, original = _patched.pop()
            if getattr(module, attr, None) is _wrappers.get(_op_of(original)):
                setattr(module, attr, original)
        # modules that copied a wrapper by name while enabled (e.g. `from fla.ops import chunk_kda` then)
        for module, attr, op in _bindings(_wrappers):
            setattr(module, attr, _originals[op])


def _op_of(original) -> str | None:
    for op, fn in _originals.items():
        if fn is original:
            return op
    return None


def is_enabled() -> bool:
    return _state["active"]


@contextlib.contextmanager
def enabled(policy: str = "R"):
    """`with enabled():` routes FLA through ReWY inside the block (restores the previous state after)."""
    was, previous_policy = _state["active"], _state["policy"]
    enable(policy)
    try:
        yield
    finally:
        if was:
            _state["policy"] = previous_policy
        else:
            disable()


def enable_from_env() -> None:
    """`REWY_ENABLE=1`: enable at import of rewy_tune (a failure is a warning, never an import error)."""
    try:
        enable()
    except Exception as exc:
        warnings.warn(f"REWY_ENABLE=1 but rewy-tune could not patch fla-core: {exc}", RuntimeWarning, stacklevel=3)
