"""Problem validation, buckets and the distance between buckets."""

import math

import pytest
import torch

from rewy_tune.problem import Bucket, Problem, log_distance, next_power_of_two


def problem(**overrides) -> Problem:
    fields = dict(op="gdn", policy="R", dtype="bf16", B=2, T=1000, H=12, K=128, V=64)
    return Problem(**(fields | overrides))


def test_bucket_rounds_t_and_bh_up_to_powers_of_two():
    assert problem().bucket() == Bucket("gdn", "R", "bf16", K=128, V=64, t_bucket=1024, bh_bucket=32)
    assert problem(B=1, T=2048, H=16).bucket().t_bucket == 2048
    assert problem(B=1, T=1, H=1).bucket().bh_bucket == 1
    assert [next_power_of_two(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert problem().bucket().label == "gdn-R-bf16-K128-V64-T1024-BH32"


@pytest.mark.parametrize("overrides, message", [
    (dict(op="mamba"), "op must be one of deltanet, gdn, kda, gdn2; got 'mamba'"),
    (dict(policy="X"), "policy must be one of R, A; got 'X'"),
    (dict(dtype="fp8"), "dtype must be one of bf16, fp16, fp32; got 'fp8'"),
    (dict(T=0), "T must be a positive integer; got 0"),
    (dict(K=64.0), "K must be a positive integer; got 64.0"),
    (dict(B=True), "B must be a positive integer; got True"),
    (dict(varlen=1), "varlen must be a bool; got 1"),
])
def test_validation_names_the_field(overrides, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        problem(**overrides)


def test_bucket_validation():
    with pytest.raises(ValueError, match="t_bucket must be a power of two; got 1000"):
        Bucket("gdn", "R", "bf16", 128, 128, 1000, 16)


def test_from_tensors():
    q = torch.empty(2, 100, 4, 64, dtype=torch.bfloat16)
    v = torch.empty(2, 100, 4, 32, dtype=torch.bfloat16)
    p = Problem.from_tensors("kda", q, v, "A", initial_state=torch.zeros(2, 4, 64, 32))
    assert p == Problem("kda", "A", "bf16", 2, 100, 4, 64, 32, has_initial_state=True, varlen=False)
    assert Problem.from_tensors("gdn", q.float(), v.float(), "R", None, cu_seqlens=torch.tensor([0, 100])).varlen
    with pytest.raises(ValueError, match="q and v must agree on B, T, H"):
        Problem.from_tensors("gdn", q, v[:, :50], "R", None)
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16, float32; got float64"):
        Problem.from_tensors("gdn", q.double(), v, "R", None)


def test_log_distance():
    a = problem(B=1, T=2048, H=16).bucket()
    assert log_distance(a, a) == 0
    assert log_distance(a, problem(B=1, T=8192, H=4).bucket()) == 2 + 2
    assert log_distance(problem(B=1, T=512, H=16).bucket(), a) == 2
    for other in (dict(op="kda"), dict(policy="A"), dict(dtype="fp16"), dict(K=64), dict(V=128)):
        assert log_distance(a, problem(B=1, T=2048, H=16, **other).bucket()) == math.inf
