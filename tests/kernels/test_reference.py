"""The pure-torch chunk forward and hand-written ReWY backward against autograd through the token recurrence.

float64: forward ≤ 1e-12 and every gradient ≤ 1e-10 relative Frobenius error (rewy-math §12).
float32: the correctness-gate thresholds of architecture.md (0.8 % relative RMS, 2 % for gate/β/b/w grads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from rewy_tune.kernels.reference.chunk_forward import chunk_forward
from rewy_tune.kernels.reference.function import RewyTorchFunction
from rewy_tune.kernels.reference.recurrence import (
    recurrent_delta,
    recurrent_deltanet,
    recurrent_gdn,
    recurrent_gdn2,
    recurrent_kda,
)
from rewy_tune.kernels.reference.rewy_backward import CENTRED_MAX_RANGE, rewy_backward

B, H = 2, 2
OPS = ("deltanet", "gdn", "kda", "gdn2")
GATED = ("gdn", "kda", "gdn2")
VECTOR_GATED = ("kda", "gdn2")
GRAD_NAMES = ("q", "k", "v", "g", "erase", "write", "h0")
GATE_LIKE = ("g", "erase", "write")  # gate, β, b, w gradients: the looser fp32 threshold


@dataclass
class Case:
    op: str
    T: int
    C: int
    K: int
    V: int
    h0: bool = True  # initial state and final-state gradient present
    coef: str = "uniform"  # erase/write values: uniform [0,1) | zero | mixed (exact 0, 1e-12, O(1))
    gate: str = "normal"  # normal | strong (g ∈ [−8,−2], chunk range past the centring guard)
    scale: float | None = None

    def id(self, *extra):
        parts = [self.op, f"B{B}", f"T{self.T}", f"C{self.C}", f"K{self.K}", f"V{self.V}",
                 "h0" if self.h0 else "noh0", self.coef, self.gate]
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        if self.gate == "strong" and self.op in VECTOR_GATED:
            parts.append("subchunk")  # the guard must route these through the sub-chunk fallback
        return "-".join(parts + list(extra))


def make_inputs(case: Case, dtype=torch.float64, seed=0):
    """Inputs in float64 (cast afterwards), keys-normalised as FLA's l2norm would, gates ≤ 0."""
    gen = torch.Generator().manual_seed(seed)
    T, K, V = case.T, case.K, case.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    def coefficient(*shape):
        if case.coef == "zero":
            return torch.zeros(*shape, dtype=torch.float64)
        x = rand(*shape)
        if case.coef == "mixed":
            pick = torch.randint(0, 3, shape, generator=gen)
            x = torch.where(pick == 0, 0.0, torch.where(pick == 1, 1e-12, x))
        return x

    gate_shape = {"deltanet": None, "gdn": (B, T, H), "kda": (B, T, H, K), "gdn2": (B, T, H, K)}[case.op]
    if gate_shape is None:
        g = None
    elif case.gate == "strong":
        g = -8 + 6 * rand(*gate_shape)
    else:
        g = F.logsigmoid(randn(*gate_shape)) / (4 if len(gate_shape) == 4 else 1)
    if case.op == "gdn2":
        erase, write = coefficient(B, T, H, K), coefficient(B, T, H, V)
    else:
        erase = coefficient(B, T, H)
        write = erase.clone()  # same values; separate tensors so the reference yields d_erase and d_write
    x = dict(q=randn(B, T, H, K), k=F.normalize(randn(B, T, H, K), dim=-1), v=randn(B, T, H, V),
             g=g, erase=erase, write=write, h0=randn(B, H, K, V) if case.h0 else None)
    do = randn(B, T, H, V)
    dht = randn(B, H, K, V) if case.h0 else None
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return {name: cast(t) for name, t in x.items()}, cast(do), cast(dht)


def reference(x, do, dht, scale):
    """o, final state and autograd gradients through the float64 token recurrence."""
    leaves = {name: (t.double().requires_grad_() if t is not None else None) for name, t in x.items()}
    o, S = recurrent_delta(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["erase"], leaves["write"],
                           scale=scale, initial_state=leaves["h0"], output_final_state=True)
    loss = (o * do.double()).sum()
    if dht is not None:
        loss = loss + (S * dht.double()).sum()
    present = [name for name in GRAD_NAMES if leaves[name] is not None]
    grads = torch.autograd.grad(loss, [leaves[name] for name in present])
    return o.detach(), S.detach(), dict(zip(present, grads))


def rewy(x, do, dht, case: Case, policy="R", intra="auto"):
    fwd = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["erase"], x["write"], scale=case.scale,
                        initial_state=x["h0"], chunk_size=case.C, save_states=(policy == "A"))
    grads = rewy_backward(x["q"], x["k"], x["v"], x["g"], x["erase"], x["write"], fwd, do, dht, scale=case.scale,
                          initial_state=x["h0"], chunk_size=case.C, policy=policy, intra=intra)
    named = dict(q=grads.dq, k=grads.dk, v=grads.dv, g=grads.dg, erase=grads.d_erase, write=grads.d_write,
                 h0=grads.dh0)
    return fwd, {name: t for name, t in named.items() if t is not None}, grads.intra_paths


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius (= relative RMS) error; absolute where the reference is exactly zero."""
    diff = (a.double() - ref.double()).norm().item()
    scale = ref.double().norm().item()
    return diff / scale if scale > 0 else diff


# ---------------------------------------------------------------- float64: exact agreement with autograd

def fp64_cases():
    cases = []
    for op in OPS:
        cases += [
            Case(op, T=128, C=64, K=16, V=24),
            Case(op, T=100, C=32, K=16, V=24),
            Case(op, T=100, C=32, K=8, V=12, h0=False),
            Case(op, T=10, C=64, K=16, V=24),
            Case(op, T=100, C=32, K=8, V=12, coef="zero"),
            Case(op, T=100, C=32, K=8, V=12, coef="mixed"),
            Case(op, T=37, C=16, K=16, V=24, scale=0.3),
        ]
        if op in GATED:
            cases.append(Case(op, T=128, C=64, K=16, V=24, gate="strong"))
    return cases


@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("case", fp64_cases(), ids=lambda c: c.id())
def test_fp64_matches_recurrence(case: Case, policy: str):
    x, do, dht = make_inputs(case)
    o_ref, S_ref, g_ref = reference(x, do, dht, case.scale)
    fwd, grads, paths = rewy(x, do, dht, case, policy=policy)

    assert rel_err(fwd.o, o_ref) <= 1e-12
    assert rel_err(fwd.final_state, S_ref) <= 1e-12
    assert grads.keys() == g_ref.keys()
    errors = {name: rel_err(grads[name], g_ref[name]) for name in g_ref}
    assert max(errors.values()) <= 1e-10, errors
    if case.gate == "strong" and case.op in VECTOR_GATED:
        assert paths["subchunk"] > 0, paths


@pytest.mark.parametrize("gate", ["normal", "strong"])
@pytest.mark.parametrize("op", VECTOR_GATED)
def test_fp64_intra_modes_agree(op: str, gate: str):
    case = Case(op, T=100, C=64, K=16, V=24, gate=gate)
    x, do, dht = make_inputs(case, seed=1)
    _, g_ref = reference(x, do, dht, None)[1:]
    results = {}
    for mode in ("auto", "centred", "subchunk"):
        _, grads, paths = rewy(x, do, dht, case, intra=mode)
        results[mode] = grads
        if mode != "auto":
            other = "subchunk" if mode == "centred" else "centred"
            assert paths[other] == 0 and paths[mode] > 0
        errors = {name: rel_err(grads[name], g_ref[name]) for name in g_ref}
        assert max(errors.values()) <= 1e-10, (mode, errors)
    for name in g_ref:
        assert rel_err(results["centred"][name], results["subchunk"][name]) <= 1e-12


# ---------------------------------------------------------------- float32: the correctness gates

FP32_CASES = [Case(op, T=100, C=32, K=16, V=24) for op in OPS] + [
    Case(op, T=128, C=64, K=16, V=24, gate="strong") for op in GATED]


@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: c.id("fp32"))
def test_fp32_within_gates(case: Case):
    x64, do64, dht64 = make_inputs(case)
    o_ref, _, g_ref = reference(x64, do64, dht64, case.scale)
    x, do, dht = make_inputs(case, dtype=torch.float32)
    fwd, grads, paths = rewy(x, do, dht, case)
    assert fwd.o.dtype == torch.float32 and rel_err(fwd.o, o_ref) <= 8e-3
    for name, ref in g_ref.items():
        assert grads[name].dtype == torch.float32
        assert torch.isfinite(grads[name]).all(), name
        limit = 2e-2 if name in GATE_LIKE else 8e-3
        assert rel_err(grads[name], ref) <= limit, (name, rel_err(grads[name], ref))
    if case.gate == "strong" and case.op in VECTOR_GATED:
        assert paths["subchunk"] > 0, paths


@pytest.mark.parametrize("op", VECTOR_GATED)
def test_fp32_centred_overflows_past_guard(op: str):
    """Why the guard exists (rewy-math §7, FLAG 3): forcing the centred products at a chunk gate range
    Δ ≈ 300+ overflows exp(Δ/2) in fp32, and 0·∞ on the masked entries makes the gradients non-finite."""
    case = Case(op, T=64, C=64, K=16, V=24, gate="strong")
    x, do, dht = make_inputs(case, dtype=torch.float32)
    G = x["g"].cumsum(1)
    delta = (G.amax(1) - G.amin(1)).max().item()
    assert delta > 2 * math.log(torch.finfo(torch.float32).max) and delta > CENTRED_MAX_RANGE
    _, forced, _ = rewy(x, do, dht, case, intra="centred")
    assert not all(torch.isfinite(forced[name]).all() for name in ("q", "k", "g"))
    _, guarded, paths = rewy(x, do, dht, case, intra="auto")
    assert paths["centred"] == 0 and paths["subchunk"] > 0
    assert all(torch.isfinite(t).all() for t in guarded.values())


# ---------------------------------------------------------------- the autograd.Function

RECURRENT = {"deltanet": recurrent_deltanet, "gdn": recurrent_gdn, "kda": recurrent_kda, "gdn2": recurrent_gdn2}


@pytest.mark.parametrize("final_state", [True, False], ids=["final", "nofinal"])
@pytest.mark.parametrize("op", OPS)
def test_function_shared_beta(op: str, final_state: bool):
    """Through RewyTorchFunction.apply with one β tensor as erase and write (autograd sums the two)."""
    case = Case(op, T=70, C=32, K=8, V=12, h0=final_state)
    x, do, dht = make_inputs(case)
    beta_args = (x["erase"], x["write"]) if op == "gdn2" else (x["erase"],)
    names = ["q", "k", "v"] + (["g"] if x["g"] is not None else []) + ["beta"] * (op != "gdn2") + \
        ["b", "w"] * (op == "gdn2") + (["h0"] if x["h0"] is not None else [])
    tensors = [x["q"], x["k"], x["v"]] + ([x["g"]] if x["g"] is not None else []) + list(beta_args) + \
        ([x["h0"]] if x["h0"] is not None else [])

    def run(use_function: bool):
        leaves = [t.clone().requires_grad_() for t in tensors]
        named = dict(zip(names, leaves))
        g = named.get("g")
        erase = named["b"] if op == "gdn2" else named["beta"]
        write = named["w"] if op == "gdn2" else named["beta"]
        h0 = named.get("h0")
        if use_function:
            o, S = RewyTorchFunction.apply(named["q"], named["k"], named["v"], g, erase, write, h0, None,
                                           case.C, "R", final_state)
        else:
            args = [named["q"], named["k"], named["v"]] + ([g] if g is not None else []) + \
                ([erase, write] if op == "gdn2" else [erase])
            o, S = RECURRENT[op](*args, initial_state=h0, output_final_state=final_state)
        assert (S is None) == (not final_state)
        loss = (o * do).sum() + ((S * dht).sum() if final_state else 0)
        return torch.autograd.grad(loss, leaves)

    for name, mine, ref in zip(names, run(True), run(False)):
        assert rel_err(mine, ref) <= 1e-10, name


def test_function_fp32_dtypes():
    case = Case("gdn2", T=40, C=16, K=8, V=12)
    x, do, dht = make_inputs(case, dtype=torch.float32)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "erase", "write", "h0")]
    o, S = RewyTorchFunction.apply(*leaves, None, case.C, "A", True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    ((o * do).sum() + (S * dht).sum()).backward()
    for leaf in leaves:
        assert leaf.grad is not None and leaf.grad.dtype == torch.float32 and torch.isfinite(leaf.grad).all()
