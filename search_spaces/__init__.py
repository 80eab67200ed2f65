"""Per-operator declarative search spaces, constraints and default schedules.

Two spaces: `scalar` (DeltaNet, GDN: no gate or a scalar gate) and `vector` (KDA, GDN2: per-channel gates,
whose kernels differ: `kernels/triton/vector_local.py` and the vector-gate variants of the scans). The
package-level functions dispatch on the operator: `op=` ("deltanet" | "gdn" | "kda" | "gdn2"; None means
the scalar space, which is what callers that predate the vector space get). `rewy_tune/search.py` passes
`op=` by keyword, so the tuner reaches the right space without knowing that there are two.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rewy_tune.schedule import Schedule
from rewy_tune.search_spaces import scalar, vector
from rewy_tune.search_spaces.scalar import CONDITIONS, schedule_from_params

SCALAR_OPS = ("deltanet", "gdn")
VECTOR_OPS = ("kda", "gdn2")
OPS = SCALAR_OPS + VECTOR_OPS


def module_for(op: str | None) -> ModuleType:
    """The search-space module of an operator (None: the scalar one)."""
    if op is None or op in SCALAR_OPS:
        return scalar
    if op in VECTOR_OPS:
        return vector
    raise ValueError(f"op must be one of {OPS} (or None for the scalar space), got {op!r}")


def _op_of(problem_dims: Any, op: str | None) -> str | None:
    return op if op is not None else scalar.op_of(problem_dims)


def space(K: int = 128, V: int = 128, op: str | None = None, policy: str | None = None) -> dict[str, list[Any]]:
    """Flat parameter name -> choices for the operator's space, head dims K, V, and policy (None: every choice of
    both policies; the vector space drops what policy R runs as another choice). The scalar space pins what one of
    its operators does not read (GDN: reverse_scan_qdo)."""
    return module_for(op).space(K, V, policy=policy, op=op)


def conditions(op: str | None = None) -> dict[str, tuple[str, str]]:
    """Conditional parameters of the operator's space (sampled only when their condition holds)."""
    return dict(module_for(op).CONDITIONS)


def constraint(schedule: Schedule, problem_dims: Any, op: str | None = None) -> list[str]:
    """Reasons the schedule cannot compile or run for the problem (empty: worth a trial), in the operator's
    model. The operator comes from `op` or from problem_dims["op"] (None: scalar)."""
    op = _op_of(problem_dims, op)
    return module_for(op).constraint(schedule, problem_dims, op=op)


def default_schedule(compute_capability: tuple[int, int] | None = None, *, K: int = 128, V: int = 128,
                     op: str | None = None, dtype: str | None = None, policy: str | None = None) -> Schedule:
    """Built-in schedule of the operator's space for a compute capability (None: generic), input dtype
    ("bf16", "fp16", "fp32"; None: 16-bit) and policy ("R", "A"; None: R's; the vector H200 default differs)."""
    if op in VECTOR_OPS:
        return vector.default_schedule(compute_capability, K=K, V=V, op=op, dtype=dtype, policy=policy)
    return module_for(op).default_schedule(compute_capability, K=K, V=V, dtype=dtype, policy=policy, op=op)


__all__ = ["CONDITIONS", "OPS", "SCALAR_OPS", "VECTOR_OPS", "conditions", "constraint", "default_schedule",
           "module_for", "schedule_from_params", "space"]
