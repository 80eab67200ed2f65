"""Correctness gates: every output and gradient against the float64 reference on fresh random inputs.

One implementation, used by `rewy-tune verify`, the tuner and the tests (architecture.md, Correctness gates):
- reference: the float64 pure-torch chunk implementation on the same (dtype-rounded) inputs;
- every tensor finite, relative RMS error <= 0.8 % (ordinary) or <= 2 % (gate, beta, b, w gradients);
  a tensor whose error is below an absolute floor passes (near-zero references, rewy-math §8);
- outputs and scratch buffers poisoned with NaN (`poison_allocations`), so tiles that never write fail;
- run twice on the same inputs: bitwise equal (`check_deterministic`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn.functional as F

# Relative-RMS thresholds and absolute floors (max |error|) per kind of tensor.
ORDINARY_RTOL = 0.008
GATE_RTOL = 0.02
ORDINARY_ATOL = 1e-6
GATE_ATOL = 1e-5
GATE_LIKE = frozenset({"dg", "dbeta", "db", "dw"})

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}

# Beyond the centring guard (rewy-math §7): per-token decay in [-8, -2] gives chunk ranges near 350.
STRONG_DECAY = (-8.0, -2.0)


@dataclass(frozen=True)
class GateCase:
    """One validation input: shape, dtype and the special conditions it exercises."""

    op: str
    B: int = 1
    T: int = 128
    H: int = 2
    K: int = 32
    V: int = 32
    dtype: str = "fp32"
    initial_state: bool = True
    final_grad: bool = True
    beta: str = "uniform"  # uniform | zero | tiny (exact zeros, 1e-12 and O(1) mixed)
    decay: str = "normal"  # normal (benchmark gates) | strong (past the centring guard)
    scale: float | None = None
    policy: str = "R"
    label: str = ""

    @property
    def name(self) -> str:
        base = f"{self.op}-{self.policy}-B{self.B}-T{self.T}-H{self.H}-K{self.K}-V{self.V}-{self.dtype}"
        return f"{base}-{self.label}" if self.label else base


@dataclass(frozen=True)
class TensorCheck:
    case: str
    tensor: str
    rel_rms: float
    max_abs: float
    rtol: float
    atol: float
    finite: bool

    @property
    def passed(self) -> bool:
        if not self.finite:
            return False
        return self.max_abs <= self.atol or self.rel_rms <= self.rtol


@dataclass
class CaseResult:
    case: GateCase
    checks: list[TensorCheck] = field(default_factory=list)
    error: str | None = None  # an exception raised by the implementation under test

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for c in self.checks)


def default_cases(op: str, policy: str = "R", *, device: str = "cpu") -> list[GateCase]:
    """The validation matrix: tail, initial state and final-state gradient, zero beta, strong decay."""
    gated = op != "deltanet"
    if device == "cpu":
        base = GateCase(op=op, policy=policy, T=128, K=32, V=32)
    else:
        base = GateCase(op=op, policy=policy, B=1, T=512, H=4, K=128, V=128, dtype="bf16")
    cases = [
        replace(base, label="base"),
        replace(base, T=base.T - 28, label="tail"),
        replace(base, T=10, initial_state=False, final_grad=False, label="short-no-h0"),
        replace(base, beta="zero", label="beta-zero"),
        replace(base, beta="tiny", scale=0.3, label="beta-tiny-scale"),
    ]
    if gated:
        cases.append(replace(base, decay="strong", label="strong-decay"))
    if device == "cpu":
        cases.append(replace(base, dtype="bf16", K=64, V=48, label="bf16-KneV"))
    return cases


def arg_names(op: str) -> tuple[str, ...]:
    """Names of the differentiable inputs, in the op's argument order."""
    return {
        "deltanet": ("q", "k", "v", "beta"),
        "gdn": ("q", "k", "v", "g", "beta"),
        "kda": ("q", "k", "v", "g", "beta"),
        "gdn2": ("q", "k", "v", "g", "b", "w"),
    }[op]


def make_inputs(case: GateCase, seed: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Fresh random inputs in the case's dtype (q, k L2-normalised; gates fp32 like the benchmark)."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V
    dt = DTYPES[case.dtype]
    gate_dt = torch.float64 if dt == torch.float64 else torch.float32

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def coefficient(*shape):
        if case.beta == "zero":
            return torch.zeros(*shape, dtype=torch.float64)
        x = torch.rand(*shape, generator=gen, dtype=torch.float64)
        if case.beta == "tiny":
            pick = torch.randint(0, 3, shape, generator=gen)
            x = torch.where(pick == 0, torch.zeros_like(x), torch.where(pick == 1, torch.full_like(x, 1e-12), x))
        return x

    out: dict[str, torch.Tensor] = {
        "q": F.normalize(randn(B, T, H, K), dim=-1).to(dt),
        "k": F.normalize(randn(B, T, H, K), dim=-1).to(dt),
        "v": randn(B, T, H, V).to(dt),
    }
    if case.op != "deltanet":
        gate_shape = (B, T, H) if case.op == "gdn" else (B, T, H, K)
        if case.decay == "strong":
            lo, hi = STRONG_DECAY
            g = lo + (hi - lo) * torch.rand(*gate_shape, generator=gen, dtype=torch.float64)
        else:
            g = F.logsigmoid(randn(*gate_shape))
            if case.op in ("kda", "gdn2"):
                g = g / 16
        out["g"] = g.to(gate_dt)
    if case.op == "gdn2":
        out["b"] = coefficient(B, T, H, K).to(dt)
        out["w"] = coefficient(B, T, H, V).to(dt)
    else:
        out["beta"] = coefficient(B, T, H).to(dt)
    if case.initial_state:
        out["initial_state"] = (0.5 * randn(B, H, K, V)).to(gate_dt)
    out["do"] = randn(B, T, H, V).to(dt)
    if case.final_grad:
        out["dht"] = randn(B, H, K, V).to(gate_dt)
    return {name: t.to(device) for name, t in out.items()}


# A runner computes o, ht and every gradient for one case's inputs.
Runner = Callable[[GateCase, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def op_runner(*, backend: str = "torch", schedule=None) -> Runner:
    """A runner that calls the public op forward and backward with the case's policy and scale."""

    def run(case: GateCase, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import rewy_tune

        fn = getattr(rewy_tune, f"chunk_{case.op}")
        names = arg_names(case.op)
        leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in names}
        h0 = inputs.get("initial_state")
        if h0 is not None:
            h0 = h0.detach().clone().requires_grad_(True)
        want_final = "dht" in inputs
        o, ht = fn(*(leaves[n] for n in names), scale=case.scale, initial_state=h0,
                   output_final_state=want_final, policy=case.policy, backend=backend, schedule=schedule)
        outputs = [o]
        grads = [inputs["do"]]
        if want_final:
            outputs.append(ht)
            grads.append(inputs["dht"])
        torch.autograd.backward(outputs, grads)
        result = {"o": o.detach()}
        if want_final:
            result["ht"] = ht.detach()
        for n in names:
            result["d" + n] = leaves[n].grad
        if h0 is not None:
            result["dh0"] = h0.grad
        return result

    return run


@contextlib.contextmanager
def poison_allocations():
    """Fill every floating-point tensor from torch.empty/empty_like/new_empty with NaN while active."""
    originals = (torch.empty, torch.empty_like, torch.Tensor.new_empty)

    def poisoned(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = lambda *a, **kw: poisoned(originals[0](*a, **kw))
    torch.empty_like = lambda *a, **kw: poisoned(originals[1](*a, **kw))
    torch.Tensor.new_empty = lambda self, *a, **kw: poisoned(originals[2](self, *a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = originals


def compare(case_name: str, name: str, ref: torch.Tensor | None, got: torch.Tensor | None) -> TensorCheck:
    gate_like = name in GATE_LIKE
    rtol, atol = (GATE_RTOL, GATE_ATOL) if gate_like else (ORDINARY_RTOL, ORDINARY_ATOL)
    if got is None or ref is None:
        missing = "missing" if got is None else "unexpected"
        return TensorCheck(case_name, f"{name} ({missing})", math.inf, math.inf, rtol, atol, False)
    got64 = got.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    if got64.shape != ref64.shape:
        return TensorCheck(case_name, f"{name} (shape {tuple(got64.shape)})", math.inf, math.inf, rtol, atol, False)
    finite = bool(torch.isfinite(got64).all())
    diff = got64 - ref64
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    ref_rms = float(ref64.pow(2).mean().sqrt()) if ref64.numel() else 0.0
    err_rms = float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0
    rel = err_rms / ref_rms if ref_rms > 0 else (0.0 if err_rms == 0 else math.inf)
    if not finite:
        rel, max_abs = math.nan, math.nan
    return TensorCheck(case_name, name, rel, max_abs, rtol, atol, finite)


def reference_outputs(case: GateCase, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float64 pure-torch chunk implementation on the same (already dtype-rounded) inputs, on the CPU."""
    inputs64 = {n: t.detach().to("cpu", torch.float64) for n, t in inputs.items()}
    return op_runner(backend="torch")(replace(case, policy="R"), inputs64)


def run_case(case: GateCase, runner: Runner, *, seed: int, device: str | torch.device = "cpu",
             poison: bool = True) -> CaseResult:
    """Check one case: fresh inputs, the runner under NaN poisoning, the float64 reference."""
    inputs = make_inputs(case, seed, device)
    result = CaseResult(case)
    try:
        with poison_allocations() if poison else contextlib.nullcontext():
            got = runner(case, inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of the implementation is a gate failure
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    ref = reference_outputs(case, inputs)
    for name in ref:
        result.checks.append(compare(case.name, name, ref[name], got.get(name)))
    return result


def check_deterministic(case: GateCase, runner: Runner, inputs: dict[str, torch.Tensor]) -> list[str]:
    """Run twice on the same inputs; return the names of tensors that differ bitwise."""
    first = runner(case, inputs)
    second = runner(case, inputs)
    return [n for n in first if first[n] is not None and not torch.equal(first[n], second[n])]
