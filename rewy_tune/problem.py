"""One call of a delta-rule backward (`Problem`) and the group of shapes that share a schedule (`Bucket`)."""

from __future__ import annotations

import dataclasses
import math

OPS = ("deltanet", "gdn", "kda", "gdn2")
POLICIES = ("R", "A")  # R: recompute intermediates in the backward; A: save all in the forward
DTYPES = ("bf16", "fp16", "fp32")
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def dtype_label(dtype) -> str | None:
    """The label (bf16, fp16, fp32) of a torch dtype the kernels accept; None for any other."""
    return _TORCH_DTYPES.get(str(dtype).removeprefix("torch."))


def next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _check_choice(field: str, value: object, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"{field} must be one of {', '.join(accepted)}; got {value!r}")


def _check_positive_int(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a positive integer; got {value!r}")


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Shapes that share a schedule: exact op, policy, dtype, K, V; T and B*H to the next power of two."""

    op: str
    policy: str
    dtype: str
    K: int
    V: int
    t_bucket: int
    bh_bucket: int

    def __post_init__(self) -> None:
        _check_choice("op", self.op, OPS)
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("dtype", self.dtype, DTYPES)
        for field in ("K", "V", "t_bucket", "bh_bucket"):
            _check_positive_int(field, getattr(self, field))
        for field in ("t_bucket", "bh_bucket"):
            value = getattr(self, field)
            if value != next_power_of_two(value):
                raise ValueError(f"{field} must be a power of two; got {value}")

    @property
    def label(self) -> str:
        return f"{self.op}-{self.policy}-{self.dtype}-K{self.K}-V{self.V}-T{self.t_bucket}-BH{self.bh_bucket}"


@dataclasses.dataclass(frozen=True)
class Problem:
    op: str
    policy: str
    dtype: str
    B: int
    T: int
    H: int
    K: int
    V: int
    has_initial_state: bool = False
    varlen: bool = False

    def __post_init__(self) -> None:
        _check_choice("op", self.op, OPS)
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("dtype", self.dtype, DTYPES)
        for field in ("B", "T", "H", "K", "V"):
            _check_positive_int(field, getattr(self, field))
        for field in ("has_initial_state", "varlen"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be a bool; got {getattr(self, field)!r}")

    def bucket(self) -> Bucket:
        return Bucket(
            op=self.op, policy=self.policy, dtype=self.dtype, K=self.K, V=self.V,
            t_bucket=next_power_of_two(self.T), bh_bucket=next_power_of_two(self.B * self.H),
        )

    @classmethod
    def from_tensors(cls, op: str, q, v, policy: str, initial_state=None, cu_seqlens=None) -> Problem:
        """From FLA-layout tensors: q is [B, T, H, K], v is [B, T, H, V]."""
        if q.ndim != 4 or v.ndim != 4:
            raise ValueError(f"q and v must be [B, T, H, K] and [B, T, H, V]; got {tuple(q.shape)} and {tuple(v.shape)}")
        if tuple(q.shape[:3]) != tuple(v.shape[:3]):
            raise ValueError(f"q and v must agree on B, T, H; got {tuple(q.shape)} and {tuple(v.shape)}")
        dtype = dtype_label(q.dtype)
        if dtype is None:
            got = str(q.dtype).removeprefix("torch.")
            raise ValueError(f"dtype must be one of {', '.join(_TORCH_DTYPES)}; got {got}")
        B, T, H, K = (int(x) for x in q.shape)
        return cls(
            op=op, policy=policy, dtype=dtype, B=B, T=T, H=H, K=K, V=int(v.shape[-1]),
            has_initial_state=initial_state is not None, varlen=cu_seqlens is not None,
        )


def log_distance(a: Bucket, b: Bucket) -> float:
    """|log2 T ratio| + |log2 B*H ratio|; infinite when op, policy, dtype, K or V differ."""
    if (a.op, a.policy, a.dtype, a.K, a.V) != (b.op, b.policy, b.dtype, b.K, b.V):
        return math.inf
    return abs(math.log2(a.t_bucket / b.t_bucket)) + abs(math.log2(a.bh_bucket / b.bh_bucket))
