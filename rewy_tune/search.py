"""Optuna space <-> Schedule: suggest a schedule in a trial, and turn a schedule back into trial params.

The space is conditional (Optuna groups): producer tiles and `pd_dtype` exist only when
``consumer == "separate"``; `intra` only for the vector-gate operators (KDA, GDN2). The scans' block_k
is pinned to cover K. When `rewy_tune.search_spaces` provides `space`, `conditions`, `constraint` or
`default_schedule`, those are used (their keyword arguments are matched by name, `op=` included), so the
tuner needs no change as the per-operator spaces grow: `search_spaces` dispatches on `op` (scalar space
for DeltaNet/GDN, vector space for KDA/GDN2).

Test-only: with `REWY_TUNE_TEST_FAULTS=1` the space gains a `test_fault` parameter (none, hang, crash,
wrong, nondet, compile) that the trial worker acts on; it is never part of a Schedule.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from rewy_tune.schedule import Schedule, StageConfig

FAULTS = ("none", "hang", "crash", "wrong", "nondet", "compile")
VECTOR_GATE_OPS = ("kda", "gdn2")


def faults_enabled() -> bool:
    return os.environ.get("REWY_TUNE_TEST_FAULTS") == "1"


def _pow2_at_least(n: int) -> int:
    p = 16
    while p < n:
        p *= 2
    return p


def _search_spaces():
    try:
        import rewy_tune.search_spaces as ss
    except ImportError:  # pragma: no cover
        return None
    return ss


def _call(fn, **kwargs):
    """Call `fn` with the keyword arguments its signature names (aliases for the compute capability)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(**kwargs)
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    cc = kwargs.get("compute_capability")
    aliases = {"cc": cc, "capability": cc}
    return fn(**{name: kwargs.get(name, aliases.get(name)) for name in params if name in kwargs or name in aliases})


def default_schedule(op: str, compute_capability: tuple[int, int] | None, K: int, V: int,
                     dtype: str | None = None, policy: str | None = None) -> Schedule:
    """The search space's default for this compute capability, input dtype (None: 16-bit) and policy (None: R's),
    else a generic one that covers K and V."""
    ss = _search_spaces()
    if ss is not None and hasattr(ss, "default_schedule"):
        try:
            cc = compute_capability if compute_capability not in (None, (0, 0)) else None
            sched = _call(ss.default_schedule, compute_capability=cc, K=K, V=V, op=op, dtype=dtype, policy=policy)
            sched.validate_for(K, V)
            return sched
        except Exception:  # noqa: BLE001 - fall back to the generic default below
            pass
    small = max(K, V) <= 64
    tile = 32 if small else 64
    scan = StageConfig(_pow2_at_least(K), tile, 4, 2)
    cfg = StageConfig(tile, tile, 4, 2)
    return Schedule(recompute=cfg, forward_scan=scan, dv_local=cfg, reverse_scan=scan, producer=cfg,
                    consumer_cfg=cfg, cumsum=StageConfig(tile, tile, 4, 1))


def constraint_violation(schedule: Schedule, *, op: str, K: int, V: int,
                         compute_capability: tuple[int, int] | None, dtype: str = "bf16") -> str | None:
    """None when the schedule may be compiled for (op, K, V); else the reason it cannot."""
    try:
        schedule.validate_for(K, V)
    except ValueError as exc:
        return str(exc)
    C = schedule.chunk_size
    for name in ("recompute", "dv_local", "consumer_cfg"):
        cfg = getattr(schedule, name)
        if cfg.block_k > _pow2_at_least(K) or cfg.block_v > _pow2_at_least(V):
            return f"{name}: tile {cfg.block_k}x{cfg.block_v} larger than K={K}, V={V} needs"
    if schedule.consumer == "separate" and schedule.producer.block_v > _pow2_at_least(V):
        return f"producer.block_v={schedule.producer.block_v} larger than V={V} needs"
    if C < 16:
        return f"chunk_size {C} below the tl.dot minimum"
    ss = _search_spaces()
    if ss is not None and hasattr(ss, "constraint"):
        dims = {"K": K, "V": V, "dtype": dtype, "op": op}
        if compute_capability not in (None, (0, 0)):
            dims["compute_capability"] = tuple(compute_capability)
        try:
            verdict = _call(ss.constraint, schedule=schedule, problem_dims=dims, op=op, K=K, V=V,
                            compute_capability=compute_capability)
        except ValueError as exc:
            return str(exc)
        if verdict is False:
            return "rejected by search_spaces.constraint"
        if isinstance(verdict, str) and verdict:
            return verdict
        if isinstance(verdict, (list, tuple)) and verdict:
            return "; ".join(map(str, verdict))
    return None


def declarative_space(op: str, K: int, V: int, interpreter: bool, policy: str | None = None):
    """(choices, conditions) from `search_spaces.space` / `CONDITIONS`, or None, for the policy's trials (None:
    every choice; a space may leave out what one policy runs as another choice). On the interpreter the tile
    choices are capped at 32 (keeping at least one), so the CPU demo stays small."""
    ss = _search_spaces()
    if ss is None or not hasattr(ss, "space") or not hasattr(ss, "schedule_from_params"):
        return None
    choices = {k: list(v) for k, v in _call(ss.space, K=K, V=V, op=op, policy=policy).items()}
    if interpreter:
        for name, vals in choices.items():
            if name.endswith((".block_k", ".block_v")) and len(vals) > 1:
                small = [v for v in vals if v <= 32]
                choices[name] = small or vals[:1]
            elif name.endswith("_segments"):
                choices[name] = [v for v in vals if v <= 2] or vals[:1]
            elif name == "scan_split_waves":  # counts SMs of a GPU: nothing to tune on the interpreter
                choices[name] = [0] if 0 in vals else vals[:1]
            elif name == "consumer_v_stages":  # a pipeline depth: the interpreter does not pipeline
                choices[name] = [1] if 1 in vals else vals[:1]
    if hasattr(ss, "conditions"):
        return choices, dict(_call(ss.conditions, op=op))
    return choices, dict(getattr(ss, "CONDITIONS", {}))


def _stage(trial, prefix: str, blocks: tuple[int, ...], *, block_k: int | None = None, warps=(2, 4, 8),
           stages=(1, 2, 3)) -> StageConfig:
    bk = block_k if block_k is not None else trial.suggest_categorical(f"{prefix}.block_k", blocks)
    bv = trial.suggest_categorical(f"{prefix}.block_v", blocks)
    nw = trial.suggest_categorical(f"{prefix}.num_warps", warps)
    ns = trial.suggest_categorical(f"{prefix}.num_stages", stages)
    return StageConfig(bk, bv, nw, ns)


def blocks_for(K: int, V: int, interpreter: bool) -> tuple[int, ...]:
    top = min(_pow2_at_least(min(K, V)), 32 if interpreter else 128)
    return tuple(b for b in (16, 32, 64, 128) if b <= top)


def suggest_schedule(trial, *, op: str, K: int, V: int, compute_capability: tuple[int, int] | None,
                     interpreter: bool, policy: str | None = None) -> Schedule:
    """Sample a Schedule in an Optuna trial (define-by-run, conditional groups); the fields the space does not
    sample are the policy's default's."""
    decl = declarative_space(op, K, V, interpreter, policy)
    if decl is not None:
        choices, conditions = decl
        params = {}
        for name, vals in choices.items():
            cond = conditions.get(name)
            if cond is not None and params.get(cond[0]) != cond[1]:
                continue  # conditional group: only sampled when its condition holds
            params[name] = vals[0] if len(vals) == 1 else trial.suggest_categorical(name, vals)
        base = default_schedule(op, compute_capability, K, V, policy=policy)
        return _search_spaces().schedule_from_params(params, base)
    blocks = blocks_for(K, V, interpreter)
    scan_k = _pow2_at_least(K)
    segments = (1, 2) if interpreter else (1, 2, 4, 8)
    values: dict[str, Any] = dict(
        recompute=_stage(trial, "recompute", blocks),
        forward_scan=_stage(trial, "forward_scan", blocks, block_k=scan_k),
        dv_local=_stage(trial, "dv_local", blocks),
        reverse_scan=_stage(trial, "reverse_scan", blocks, block_k=scan_k),
        consumer_cfg=_stage(trial, "consumer_cfg", blocks),
        forward_scan_segments=trial.suggest_categorical("forward_scan_segments", segments),
        reverse_scan_segments=trial.suggest_categorical("reverse_scan_segments", segments),
        state_dtype=trial.suggest_categorical("state_dtype", ("fp32", "input")),
    )
    cumsum_warps = trial.suggest_categorical("cumsum.num_warps", (1, 2, 4))
    values["cumsum"] = StageConfig(blocks[-1], blocks[-1], cumsum_warps, 1)
    consumer = trial.suggest_categorical(
        "consumer", ("joint", "separate") if op in VECTOR_GATE_OPS else ("joint", "separate", "joint_tma"))
    values["consumer"] = consumer
    if consumer == "separate":  # conditional group: only exists for the separate consumer
        values["pd_dtype"] = trial.suggest_categorical("pd_dtype", ("fp32", "input"))
        bv = trial.suggest_categorical("producer.block_v", blocks)
        nw = trial.suggest_categorical("producer.num_warps", (2, 4, 8))
        ns = trial.suggest_categorical("producer.num_stages", (1, 2, 3))
        values["producer"] = StageConfig(blocks[-1], bv, nw, ns)
    else:
        values["producer"] = StageConfig(blocks[-1], blocks[-1], 4, 2)
    if op in VECTOR_GATE_OPS:
        # "centred" without the range guard overflows fp32 on strong decays: only the guarded "auto" and the
        # always-safe "subchunk" are searched.
        values["intra"] = trial.suggest_categorical("intra", ("auto", "subchunk"))
    return Schedule(**values)


def schedule_params(schedule: Schedule, *, op: str, K: int, V: int, interpreter: bool,
                    policy: str | None = None) -> dict[str, Any] | None:
    """Trial params that make `suggest_schedule` return `schedule` (for enqueueing defaults and winners);
    None when the schedule lies outside the built-in space of the policy's trials (None: of either policy; it is
    then skipped, not forced)."""
    decl = declarative_space(op, K, V, interpreter, policy)
    if decl is not None:
        choices, conditions = decl
        flat = {}
        for name, val in schedule.to_dict().items():
            if isinstance(val, dict):
                flat.update({f"{name}.{m}": v for m, v in val.items()})
            else:
                flat[name] = val
        p = {}
        for name, vals in choices.items():
            cond = conditions.get(name)
            if cond is not None and flat.get(cond[0]) != cond[1]:
                continue
            if len(vals) == 1:
                continue
            if flat.get(name) not in vals:
                return None  # outside the space: not enqueued
            p[name] = flat[name]
        return p
    p: dict[str, Any] = {}
    for name in ("recompute", "dv_local", "consumer_cfg", "forward_scan", "reverse_scan"):
        cfg = getattr(schedule, name)
        if name not in ("forward_scan", "reverse_scan"):
            p[f"{name}.block_k"] = cfg.block_k
        p[f"{name}.block_v"] = cfg.block_v
        p[f"{name}.num_warps"] = cfg.num_warps
        p[f"{name}.num_stages"] = cfg.num_stages
    p["forward_scan_segments"] = schedule.forward_scan_segments
    p["reverse_scan_segments"] = schedule.reverse_scan_segments
    p["state_dtype"] = schedule.state_dtype
    p["cumsum.num_warps"] = schedule.cumsum.num_warps
    p["consumer"] = schedule.consumer
    if schedule.consumer == "separate":
        p["pd_dtype"] = schedule.pd_dtype
        p["producer.block_v"] = schedule.producer.block_v
        p["producer.num_warps"] = schedule.producer.num_warps
        p["producer.num_stages"] = schedule.producer.num_stages
    if op in VECTOR_GATE_OPS:
        p["intra"] = schedule.intra
    # Check that the values lie in the space (categorical choices) by replaying them.
    import optuna

    fixed = optuna.trial.FixedTrial({**p, **({"test_fault": "none"} if faults_enabled() else {})})
    try:
        suggest_schedule(fixed, op=op, K=K, V=V, compute_capability=None, interpreter=interpreter)
    except ValueError:
        return None
    return p
