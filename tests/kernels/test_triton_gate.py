"""KDA/GDN2's in-kernel gate activation fused into the ReWY backward (`kernels/triton/gate.py`, the chunk cumsum's
``gate``, ``ops.chunk_kda(use_gate_in_kernel=True)``) against float64: the formulas of `kernels/reference/gate.py`
differentiated by autograd, and the torch backend's op. CPU runs use the Triton interpreter; the `gpu` test repeats
the op check at a benchmark shape in bf16 on CUDA (FLA's fused forward, our backward). Allocations are NaN-poisoned.
"""

import os

if not os.environ.get("REWY_TEST_NO_INTERPRET"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import rewy_tune
from rewy_tune.gates import GATE_RTOL, ORDINARY_RTOL, poison_allocations
from rewy_tune.kernels.reference.gate import activated_gate
from rewy_tune.kernels.triton.cumsum import chunk_cumsum
from rewy_tune.kernels.reference.chunk_forward import chunk_forward, chunk_local_cumsum
from rewy_tune.kernels.triton import vector_local
from rewy_tune.kernels.triton.gate import GateActivation, gate_backward
from rewy_tune.schedule import Schedule, StageConfig

from kernel_gates import rel_rms

# (lower_bound, with A_log, with dt_bias): the softplus form needs A_log; the lower-bound form takes either
FORMS = [(None, True, True), (None, True, False), (-5.0, True, True), (-1.0, False, True), (-5.0, False, False)]
FORM_IDS = ["softplus-bias", "softplus", "lb5-A-bias", "lb1-bias", "lb5-bare"]


def _params(H, K, form, gen, dtype=torch.float32):
    lower_bound, with_a, with_bias = form
    A_log = (torch.randn(H, generator=gen) * 0.5).to(dtype) if with_a else None
    dt_bias = torch.randn(H * K, generator=gen).to(dtype) if with_bias else None
    return A_log, dt_bias, lower_bound


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_cumsum_applies_the_gate(form):
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, C = 2, 100, 3, 40, 64  # T a tail, K not a power of two
    x = (torch.randn(B, T, H, K, generator=gen) * 3).to(torch.bfloat16)
    A_log, dt_bias, lb = _params(H, K, form, gen)
    with poison_allocations():
        G = chunk_cumsum(x, chunk_size=C, BK=32, num_warps=2, gate=GateActivation(A_log, dt_bias, lb))
    act = activated_gate(x.double(), None if A_log is None else A_log.double(),
                         None if dt_bias is None else dt_bias.double(), lb)
    ref = chunk_local_cumsum(act.transpose(1, 2), C).transpose(1, 2)  # the reference's [B, H, T, K] layout
    assert G.dtype == torch.float32 and not G.isnan().any()
    assert rel_rms(G, ref) <= 1e-6


@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
def test_gate_backward_matches_autograd(form):
    gen = torch.Generator().manual_seed(4)
    B, T, H, K = 2, 70, 3, 24
    x = (torch.randn(B, T, H, K, generator=gen) * 3).to(torch.bfloat16)
    A_log, dt_bias, lb = _params(H, K, form, gen)
    dy = torch.randn(B, T, H, K, generator=gen)
    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, A_log, dt_bias)]
    activated_gate(leaves[0], leaves[1], leaves[2], lb).backward(dy.double())
    with poison_allocations():
        dx, dA, db = gate_backward(x, GateActivation(A_log, dt_bias, lb), dy)
    assert dx.dtype == x.dtype and not dx.isnan().any()
    assert rel_rms(dx, leaves[0].grad) <= ORDINARY_RTOL  # bf16 rounding of dx only
    for got, leaf, name in ((dA, leaves[1], "A_log"), (db, leaves[2], "dt_bias")):
        assert (got is None) == (leaf is None), name
        if got is not None:
            assert got.shape == leaf.shape and rel_rms(got, leaf.grad) <= 1e-5, name


def _op_inputs(op, B, T, H, K, V, dtype, device, gen):
    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device=device, dtype=dtype)

    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    q, k = (torch.nn.functional.normalize(t.float(), dim=-1).to(dtype) for t in (q, k))
    v = rnd(B, T, H, V)
    g = rnd(B, T, H, K, s=2.0)  # raw gate input
    if op == "kda":
        betas = (torch.rand(B, T, H, generator=gen).to(device=device, dtype=dtype),)
    else:
        betas = (torch.rand(B, T, H, K, generator=gen).to(device=device, dtype=dtype),
                 torch.rand(B, T, H, V, generator=gen).to(device=device, dtype=dtype))
    return q, k, v, g, betas


def _run(op, tensors, gate, backend, h0, dtype=None, policy="R"):
    """(o, gradients of q, k, v, g, the betas, A_log and dt_bias where given, h0) of the gated op."""
    q, k, v, g, betas = tensors
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    leaves = [cast(t).detach().requires_grad_() for t in (q, k, v, g, *betas)]
    params = [cast(t).detach().requires_grad_() if t is not None else None for t in gate[:2]]
    lb = gate[2]
    h = cast(h0).detach().requires_grad_() if h0 is not None else None
    fn = rewy_tune.chunk_kda if op == "kda" else rewy_tune.chunk_gdn2
    o, ht = fn(*leaves, initial_state=h, output_final_state=True, backend=backend, use_gate_in_kernel=True,
               A_log=params[0], dt_bias=params[1], lower_bound=lb, policy=policy)
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(ht.shape, generator=gen).to(ht)
    wrt = leaves + [p for p in params if p is not None] + ([h] if h is not None else [])
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), wrt)
    return o, grads


@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["kda", "gdn2"])
@pytest.mark.parametrize("form", [FORMS[0], FORMS[2]], ids=[FORM_IDS[0], FORM_IDS[2]])
def test_op_with_the_gate_in_kernel_matches_float64(op, form, policy):
    _check_gated_op(op, form, (1, 80, 2, 32, 32), torch.float32, "cpu", seed=5, policy=policy)  # a tail chunk


def _check_gated_op(op, form, dims, dtype, device, seed, policy="R"):
    """The gated op on the Triton backend against the float64 torch backend: o and every gradient, at the gates."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = dims
    tensors = _op_inputs(op, B, T, H, K, V, dtype, device, gen)
    gate = [t.to(device) if isinstance(t, torch.Tensor) else t for t in _params(H, K, form, gen)]
    h0 = (torch.randn(B, H, K, V, generator=gen) * 0.1).to(device)
    o_ref, ref = _run(op, tensors, gate, "torch", h0, dtype=torch.float64, policy=policy)
    with poison_allocations():
        o, got = _run(op, tensors, gate, "triton", h0, policy=policy)
    assert rel_rms(o, o_ref) <= ORDINARY_RTOL
    names = ["dq", "dk", "dv", "dg", *(("dbeta",) if op == "kda" else ("db", "dw")), "dA_log", "ddt_bias", "dh0"]
    for name, a, r in zip(names, got, ref, strict=True):
        assert not a.isnan().any(), name
        rtol = GATE_RTOL if name in ("dg", "dbeta", "db", "dw", "dA_log", "ddt_bias") else ORDINARY_RTOL
        assert rel_rms(a, r) <= rtol, (name, rel_rms(a, r))


SMALL = Schedule(
    recompute=StageConfig(32, 32, 4, 2), forward_scan=StageConfig(64, 32, 4, 2), dv_local=StageConfig(32, 32, 4, 2),
    reverse_scan=StageConfig(64, 32, 4, 2), producer=StageConfig(32, 32, 4, 2),
    consumer_cfg=StageConfig(16, 32, 4, 2), cumsum=StageConfig(32, 32, 4, 1),
)


def test_bad_gate_arguments_are_named():
    q = k = torch.zeros(1, 64, 2, 16)
    v = torch.zeros(1, 64, 2, 16)
    g = torch.zeros(1, 64, 2, 16)
    beta = torch.zeros(1, 64, 2)
    with pytest.raises(ValueError, match="A_log"):  # the softplus form without A_log
        rewy_tune.chunk_kda(q, k, v, g, beta, backend="torch", use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"dt_bias must have shape \[32\] or \[2, 16\] \(H\*K or \[H, K\] for g "
                                         r"\[B, T, H, K\] = \[1, 64, 2, 16\]\), got \[2\]"):
        rewy_tune.chunk_kda(q, k, v, g, beta, backend="torch", use_gate_in_kernel=True, A_log=torch.zeros(2),
                            dt_bias=torch.zeros(2))
    # [K, H] has H·K elements but would be read as [H, K]
    with pytest.raises(ValueError, match=r"dt_bias must have shape .*, got \[16, 2\]"):
        rewy_tune.chunk_kda(q, k, v, g, beta, backend="torch", use_gate_in_kernel=True, A_log=torch.zeros(2),
                            dt_bias=torch.zeros(16, 2))
    with pytest.raises(ValueError, match=r"A_log must have shape \[2\] \(H for g .*\), got \[3\]"):
        rewy_tune.chunk_kda(q, k, v, g, beta, backend="torch", use_gate_in_kernel=True, A_log=torch.zeros(3))
    with pytest.raises(ValueError, match=r"A_log must be a floating-point tensor, got dtype torch.int64"):
        rewy_tune.chunk_kda(q, k, v, g, beta, backend="torch", use_gate_in_kernel=True,
                            A_log=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="use_gate_in_kernel"):  # A_log without the flag would be ignored
        rewy_tune.chunk_kda(q, k, v, g, beta, backend="torch", A_log=torch.zeros(2))
    # L·sigmoid(...) decays only for L < 0: a positive bound grows the state to inf
    for lb in (float("nan"), 5.0, 0.0, "x", True):
        with pytest.raises(ValueError, match=f"lower_bound must be a negative finite number or None, got {lb!r}"):
            rewy_tune.chunk_kda(q, k, v, g, beta, backend="torch", use_gate_in_kernel=True, lower_bound=lb)
    with pytest.raises(ValueError, match="g: the in-kernel gate"):
        gate_backward(torch.zeros(1, 64, 2), GateActivation(torch.zeros(2), None), torch.zeros(1, 64, 2))


def test_a_strided_dt_bias_is_read_as_its_shape_says():
    # the kernels index dt_bias[h·K + k] in memory: an [H, K] view of a [K, H] tensor (checked shape, other strides)
    # must give what its contiguous copy gives, and its gradient must reach the caller's tensor
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, (beta,) = _op_inputs("kda", 1, 64, 2, 16, 16, torch.float32, "cpu", gen)
    base = torch.randn(16, 2, generator=gen, requires_grad=True)
    A_log = torch.randn(2, generator=gen)
    outs = []
    for dt_bias in (base.t(), base.t().contiguous()):
        o, _ = rewy_tune.chunk_kda(q, k, v, g, beta, backend="triton", use_gate_in_kernel=True, A_log=A_log,
                                   dt_bias=dt_bias)
        outs.append((o, torch.autograd.grad(o.sum(), base)[0]))
    assert not base.t().is_contiguous()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_gate_grads_and_scalar_gates_are_refused_clearly():
    # the backward needs somewhere to put dA_log / ddt_bias; a scalar gate (GDN) has no in-op activation here
    from rewy_tune.kernels.triton_function import run_triton_op

    gen = torch.Generator().manual_seed(2)
    q, k, v, g, (beta,) = _op_inputs("kda", 1, 64, 2, 16, 16, torch.float32, "cpu", gen)
    fwd = chunk_forward(q, k, v, g, beta, beta, scale=0.25, initial_state=None, chunk_size=64)
    gate = GateActivation(torch.zeros(2), None)
    with pytest.raises(ValueError, match="gate_grads: the in-kernel gate's parameter gradients need a dict"):
        vector_local.rewy_backward_triton_vector(q, k, v, g, beta, beta, fwd.A, v, None, scale=0.25,
                                                 initial_state=None, schedule=SMALL, gate=gate)
    with pytest.raises(ValueError, match="gate_in_kernel: the fused gate activation is for KDA and GDN2"):
        run_triton_op("gdn", q, k, v, g[..., 0], beta, beta, initial_state=None, scale=None, policy="R",
                      output_final_state=False, gate=gate)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["kda", "gdn2"])
@pytest.mark.parametrize("form", [FORMS[0], FORMS[2]], ids=[FORM_IDS[0], FORM_IDS[2]])
def test_gpu_op_with_the_gate_in_kernel(op, form):
    _check_gated_op(op, form, (1, 512, 4, 128, 128), torch.bfloat16, "cuda", seed=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_gpu_op_with_the_gate_in_kernel_policy_a(op):
    # policy A: FLA's save-all forward (disable_recompute) with its fused gate, our backward without a recompute
    _check_gated_op(op, FORMS[0], (1, 512, 4, 128, 128), torch.bfloat16, "cuda", seed=7, policy="A")
