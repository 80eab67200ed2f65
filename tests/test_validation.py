"""Every validation error of the public ops names the argument, what was received and what is accepted."""

import pytest
import torch

import rewy_tune

B, T, H, K, V = 1, 8, 2, 4, 6


def tensors(dtype=torch.float32):
    q = torch.randn(B, T, H, K, dtype=dtype)
    return dict(q=q, k=torch.randn(B, T, H, K, dtype=dtype), v=torch.randn(B, T, H, V, dtype=dtype),
                beta=torch.rand(B, T, H, dtype=dtype), g_scalar=-torch.rand(B, T, H),
                g_vector=-torch.rand(B, T, H, K), b=torch.rand(B, T, H, K, dtype=dtype),
                w=torch.rand(B, T, H, V, dtype=dtype))


def call(op, **over):
    t = tensors()
    t.update(over)
    if op == "deltanet":
        return rewy_tune.chunk_deltanet(t["q"], t["k"], t["v"], t["beta"], **t.get("kw", {}))
    if op == "gdn":
        return rewy_tune.chunk_gdn(t["q"], t["k"], t["v"], t["g_scalar"], t["beta"], **t.get("kw", {}))
    if op == "kda":
        return rewy_tune.chunk_kda(t["q"], t["k"], t["v"], t["g_vector"], t["beta"], **t.get("kw", {}))
    return rewy_tune.chunk_gdn2(t["q"], t["k"], t["v"], t["g_vector"], t["b"], t["w"], **t.get("kw", {}))


@pytest.mark.parametrize("op", ["deltanet", "gdn", "kda", "gdn2"])
def test_wrong_rank_of_q(op):
    with pytest.raises(ValueError, match=r"q: expected rank 4 \[B, T, H, K\], got shape \[8, 2, 4\]"):
        call(op, q=torch.randn(T, H, K))


def test_mismatched_k():
    with pytest.raises(ValueError, match=r"k: expected shape \[1, 8, 2, 4\].*got \[1, 8, 2, 5\]"):
        call("gdn", k=torch.randn(B, T, H, K + 1))


def test_mismatched_v_heads():
    with pytest.raises(ValueError, match=r"v: expected shape \[1, 8, 2, V\].*got \[1, 8, 3, 6\]"):
        call("deltanet", v=torch.randn(B, T, H + 1, V))


def test_vector_gate_given_to_gdn():
    with pytest.raises(ValueError, match=r"g: expected rank 3 \[B, T, H\] \(scalar gate.*got shape \[1, 8, 2, 4\]"):
        call("gdn", g_scalar=-torch.rand(B, T, H, K))


@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_scalar_gate_given_to_vector_op(op):
    with pytest.raises(ValueError, match=r"g: expected rank 4 \[B, T, H, K\] \(vector gate.*got shape \[1, 8, 2\]"):
        call(op, g_vector=-torch.rand(B, T, H))


def test_gdn2_write_coefficient_shape():
    with pytest.raises(ValueError, match=r"w: expected shape \[1, 8, 2, 6\].*write coefficient w.*got \[1, 8, 2, 4\]"):
        call("gdn2", w=torch.rand(B, T, H, K))


def test_beta_shape():
    with pytest.raises(ValueError, match=r"beta: expected shape \[1, 8, 2\].*got \[1, 8, 3\]"):
        call("kda", beta=torch.rand(B, T, H + 1))


def test_initial_state_shape():
    with pytest.raises(ValueError, match=r"initial_state: expected shape \[1, 2, 4, 6\].*got \[1, 2, 6, 4\]"):
        call("gdn", kw=dict(initial_state=torch.randn(B, H, V, K)))


def test_unsupported_dtype():
    with pytest.raises(ValueError, match=r"q: dtype torch.int32 is not supported; accepted: float16, bfloat16"):
        call("deltanet", q=torch.zeros(B, T, H, K, dtype=torch.int32))


def test_mixed_qkv_dtypes():
    with pytest.raises(ValueError, match=r"q, k, v: must share one dtype, got q torch.float32, k torch.bfloat16"):
        call("deltanet", k=torch.randn(B, T, H, K, dtype=torch.bfloat16))


def test_unsupported_policy():
    with pytest.raises(ValueError, match=r"policy: got 'X'; accepted: 'R' \(recompute\) or 'A' \(save all\)"):
        call("gdn", kw=dict(policy="X"))


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"backend: got 'cuda'; accepted: 'auto', 'torch', 'triton'"):
        call("gdn", kw=dict(backend="cuda"))


@pytest.mark.parametrize("scale", [-1.0, 0, float("inf"), float("nan"), True, "0.5", torch.tensor(0.5)])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match=r"scale: expected a positive finite number \(Python or NumPy\) or None"):
        call("kda", kw=dict(scale=scale))


def test_numpy_scales_are_numbers():
    np = pytest.importorskip("numpy")
    t = {n: x for n, x in tensors().items() if n != "kw"}
    # 0.375 is exact in float32 and is not the default K^-0.5: a NumPy scale dropped for the default would show
    want = call("gdn", **t, kw=dict(scale=0.375))[0]
    assert not torch.equal(call("gdn", **t, kw=dict(scale=None))[0], want)
    for scale in (np.float32(0.375), np.float64(0.375)):
        assert torch.equal(call("gdn", **t, kw=dict(scale=scale))[0], want)


@pytest.mark.parametrize("name, value", [("output_final_state", "False"), ("output_final_state", 0),
                                         ("use_gate_in_kernel", "no")])
def test_switches_must_be_bools(name, value):
    # a string such as "False" is true: it must not switch the final state or the in-kernel gate on
    with pytest.raises(ValueError, match=f"{name}: expected True or False, got {value!r}"):
        call("kda", kw={name: value})


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_schedule_of_the_wrong_type_is_refused_on_every_backend(backend):
    # the torch backend does not read a schedule, but one of the wrong type is a caller's mistake all the same
    for bad in ("default", 5, {"chunk_size": 64}):
        with pytest.raises(ValueError, match=f"schedule: expected a rewy_tune.Schedule or None, got "
                                             f"{type(bad).__name__}"):
            call("gdn", kw=dict(backend=backend, schedule=bad))


def test_float64_on_the_triton_backend_is_refused_at_the_call(monkeypatch):
    # before: the forward returned and backward() raised, naming an internal argument (erase for beta)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t64 = {n: x.double() for n, x in tensors().items()}
    with pytest.raises(ValueError, match=r"q, k, v: dtype torch.float64 is not supported by the triton backend; "
                                         r"accepted: float16, bfloat16, float32 \(float64: backend='torch'\)"):
        call("deltanet", **t64, kw=dict(backend="triton"))
    with pytest.raises(ValueError, match=r"beta: dtype torch.float64 is not supported by the triton backend"):
        call("gdn", beta=tensors()["beta"].double(), kw=dict(backend="triton"))
    with pytest.raises(ValueError, match=r"^w: dtype torch.float64 is not supported"):
        call("gdn2", w=tensors()["w"].double(), kw=dict(backend="triton"))


def test_auto_on_cuda_keeps_what_triton_cannot_take_on_torch():
    from rewy_tune.ops import resolve_backend

    cuda = torch.device("cuda")
    assert resolve_backend("gdn", "auto", cuda, torch.float32, 128, 128) == "triton"
    assert resolve_backend("gdn", "auto", cuda, torch.float64, 128, 128) == "torch"
    assert resolve_backend("gdn", "auto", cuda, torch.float32, 257, 128) == "torch"
    assert resolve_backend("gdn", "auto", cuda, torch.float32, 128, 128, unfit="beta: float64") == "torch"
    assert resolve_backend("gdn", "torch", cuda, torch.float32, 128, 128) == "torch"


def test_mixed_devices():
    meta_v = torch.randn(B, T, H, V, device="meta")
    with pytest.raises(ValueError, match=r"tensors must all be on one device, got q on cpu, k on cpu, v on meta"):
        call("deltanet", v=meta_v)


def test_triton_head_dim_limit():
    big = 260
    t = dict(q=torch.randn(B, T, H, big), k=torch.randn(B, T, H, big))
    with pytest.raises(ValueError, match=r"the triton backend supports K, V <= 256, got K=260"):
        call("deltanet", **t, kw=dict(backend="triton"))
