"""The correctness gate passes the reference backend and catches wrong, unwritten and non-finite results."""

import subprocess
import sys

import torch

from rewy_tune import gates


def case(op="gdn", **kw):
    return gates.GateCase(op=op, T=70, H=1, K=16, V=16, **kw)


def test_torch_backend_passes_every_tensor():
    result = gates.run_case(case(), gates.op_runner(backend="torch"), seed=1)
    assert result.passed, [c for c in result.checks if not c.passed]
    names = {c.tensor for c in result.checks}
    assert names == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}


def _tampered(change):
    base = gates.op_runner(backend="torch")

    def run(c, inputs):
        out = base(c, inputs)
        change(out)
        return out

    return run


def test_wrong_gradient_fails():
    def bump(out):
        out["dk"] = out["dk"] * 1.05

    result = gates.run_case(case(), _tampered(bump), seed=2)
    failed = {c.tensor for c in result.checks if not c.passed}
    assert failed == {"dk"}


def test_unwritten_output_is_caught_by_nan_poisoning():
    def forget(out):
        out["dv"] = torch.empty_like(out["dv"])  # poisoned with NaN inside the gate

    result = gates.run_case(case(), _tampered(forget), seed=3)
    bad = [c for c in result.checks if c.tensor == "dv"]
    assert not bad[0].finite and not result.passed


def test_missing_gradient_fails():
    def drop(out):
        out["dh0"] = None

    result = gates.run_case(case(), _tampered(drop), seed=4)
    assert not result.passed and any("missing" in c.tensor for c in result.checks)


def test_exception_is_recorded():
    def boom(c, inputs):
        raise RuntimeError("kernel exploded")

    result = gates.run_case(case(), boom, seed=5)
    assert not result.passed and "kernel exploded" in result.error


def test_gate_like_thresholds():
    check = gates.compare("c", "dg", torch.ones(10), torch.ones(10) * 1.015)
    assert check.passed and check.rtol == gates.GATE_RTOL
    check = gates.compare("c", "dq", torch.ones(10), torch.ones(10) * 1.015)
    assert not check.passed and check.rtol == gates.ORDINARY_RTOL


def test_default_cases_cover_the_special_conditions():
    cases = gates.default_cases("kda")
    labels = {c.label for c in cases}
    assert {"tail", "beta-zero", "strong-decay", "short-no-h0"} <= labels
    assert any(c.T % 64 for c in cases) and any(c.initial_state and c.final_grad for c in cases)


def test_inputs_are_fresh_per_seed():
    a = gates.make_inputs(case(), 1)
    b = gates.make_inputs(case(), 2)
    assert not torch.equal(a["q"], b["q"])


def test_check_deterministic_flags_differences():
    c = case()
    inputs = gates.make_inputs(c, 0)
    assert gates.check_deterministic(c, gates.op_runner(backend="torch"), inputs) == []
    flip = iter([0.0, 1e-3])

    def noisy(cc, inp):
        out = gates.op_runner(backend="torch")(cc, inp)
        out["dq"] = out["dq"] + next(flip)
        return out

    assert gates.check_deterministic(c, noisy, inputs) == ["dq"]


def test_verify_command_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "rewy_tune.cli.main", "verify", "--op", "deltanet",
                         "--policy", "A"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "all gates passed" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "rewy_tune.cli.main", "verify", "--op", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--op: unknown operator 'nope'; accepted: deltanet, gdn, kda, gdn2, all" in bad.stdout
    bad = subprocess.run([sys.executable, "-m", "rewy_tune.cli.main", "verify", "--op", "gdn", "--policy", "C"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--policy: got 'C'; accepted: R, A, both" in bad.stdout
