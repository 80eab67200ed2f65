"""Route fla-core 0.6.0's chunk ops through the ReWY backward: `enable()`, `disable()`, `with enabled():`.

`enable()` replaces `chunk_delta_rule`, `chunk_gated_delta_rule`, `chunk_kda` and `chunk_gdn2` in their
defining modules and in every loaded module that holds the original function object under some name
(`fla.ops`, `fla.ops.kda`, FLA's layers when flash-linear-attention is installed, user modules that did
`from fla.ops import chunk_kda`). `disable()` puts back exactly the objects it replaced.

A call runs the ReWY op (schedule from `dispatch.lookup`) only inside the supported envelope: CUDA
tensors, an operator whose Triton backward is GPU-verified (`kernels.triton_function.GPU_VERIFIED_OPS`), equal-length
sequences (no cu_seqlens / context parallel), v heads == q heads (no GVA), K, V in [16, 256], dtype
bf16/fp16/fp32, and every other FLA option at its default (no in-kernel l2norm, gate or beta activation,
chunk_size 64). Any other call goes to the original FLA function unchanged; both are counted in `report()`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
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
_DTYPES = {"torch.bfloat16", "torch.float16", "torch.float32"}
_NAMED_REASONS = {
    "cu_seqlens": "varlen (cu_seqlens)", "cu_seqlens_cpu": "varlen (cu_seqlens)",
    "chunk_indices": "varlen (chunk_indices)", "cp_context": "context parallel (cp_context)",
    "use_qk_l2norm_in_kernel": "in-kernel q/k l2norm", "use_gate_in_kernel": "in-kernel gate activation",
    "use_beta_sigmoid_in_kernel": "in-kernel beta sigmoid", "allow_neg_eigval": "allow_neg_eigval",
    "state_v_first": "state_v_first layout",
}
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256

_lock = threading.RLock()
_state = {"active": False, "policy": "R"}
_originals: dict[str, object] = {}  # op -> original FLA function
_wrappers: dict[str, object] = {}  # op -> our replacement
_patched: list[tuple[object, str, object]] = []  # (module, attribute, original) in patch order


def _triton_ops() -> frozenset[str]:
    from rewy_tune.ops import _auto_ops

    return _auto_ops()


def envelope_reason(op: str, arguments: dict, extra: dict) -> str | None:
    """Why this FLA call cannot run on ReWY, or None when it can. `arguments` are the bound parameters
    (defaults not applied), `extra` the **kwargs FLA received."""
    import torch

    q, v = arguments.get("q"), arguments.get("v")
    tensors = [arguments.get(n) for n in _DATA_ARGS[op]]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "a data argument is not a tensor"
    for name, value in arguments.items():
        if name in _DATA_ARGS[op] or name in _PASSED or name == "kwargs":
            continue
        if value is not None and value is not False:
            return _NAMED_REASONS.get(name, f"option {name}={value!r}")
    for name, value in extra.items():
        if name == "chunk_size" and value == 64:
            continue
        if name in ("A_log", "dt_bias") and value is None:
            continue
        return _NAMED_REASONS.get(name, f"option {name}")
    if q.ndim != 4 or v.ndim != 4:
        return "not [B, T, H, D] tensors"
    if v.shape[2] != q.shape[2]:
        return f"GVA (v heads {v.shape[2]} != q heads {q.shape[2]})"
    K, V = q.shape[-1], v.shape[-1]
    if not (MIN_HEAD_DIM <= K <= MAX_HEAD_DIM and MIN_HEAD_DIM <= V <= MAX_HEAD_DIM):
        return f"head dim K={K}, V={V} outside [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if str(q.dtype) not in _DTYPES:
        return f"dtype {str(q.dtype).removeprefix('torch.')}"
    if any(t.dtype != q.dtype for t in (arguments.get("k"), v)):
        return "q, k, v dtypes differ"
    h0 = arguments.get("initial_state")
    if h0 is not None and (not isinstance(h0, torch.Tensor) or tuple(h0.shape) != (q.shape[0], q.shape[2], K, V)):
        return "initial_state is not [B, H, K, V]"
    if not all(t.is_cuda for t in tensors):
        return "not CUDA"
    if op not in _triton_ops():
        return f"no ReWY Triton backward for {op} yet"
    return None


def _route(op: str, arguments: dict):
    from rewy_tune import ops
    from rewy_tune.device import current_device
    from rewy_tune.dispatch import lookup
    from rewy_tune.problem import Problem

    q, v = arguments["q"], arguments["v"]
    policy = _state["policy"]
    h0 = arguments.get("initial_state")
    problem = Problem.from_tensors(op, q, v, policy, initial_state=h0)
    schedule, reason = lookup(problem, current_device(q.device.index))
    _report.record_routed(op, problem.bucket().label, schedule, reason)
    common = dict(scale=arguments.get("scale"), initial_state=h0,
                  output_final_state=bool(arguments.get("output_final_state", False)),
                  policy=policy, backend="triton", schedule=schedule)
    a = arguments
    if op == "deltanet":
        return ops.chunk_deltanet(a["q"], a["k"], a["v"], a["beta"], **common)
    if op == "gdn":
        return ops.chunk_gdn(a["q"], a["k"], a["v"], a["g"], a["beta"], **common)
    if op == "kda":
        return ops.chunk_kda(a["q"], a["k"], a["v"], a["g"], a["beta"], **common)
    return ops.chunk_gdn2(a["q"], a["k"], a["v"], a["g"], a["b"], a["w"], **common)


def _make_wrapper(op: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def rewy_dispatch(*args, **kwargs):
        if not _state["active"]:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            reason = "arguments not recognised"
        else:
            arguments = dict(bound.arguments)
            extra = arguments.pop("kwargs", {}) or {}
            reason = envelope_reason(op, arguments, extra)
        if reason is not None:
            _report.record_fallback(op, reason)
            return original(*args, **kwargs)
        return _route(op, arguments)

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
