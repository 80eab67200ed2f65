"""Gate assertions shared by the Triton kernel tests: the project thresholds of rewy_tune.gates, per tensor."""

import os

import torch

from rewy_tune.gates import GATE_RTOL as GATE
from rewy_tune.gates import ORDINARY_RTOL as ORDINARY

GATE_LIKE = ("dg", "d_erase", "d_write")
# Triton 3.6's interpreter converts fp32 -> bf16 by truncation (test_interpreter_quirks.py pins it): twice the error
# bound of the GPU's round-to-nearest. Small bf16 tests hold interpreter results to this many times the gate, so
# that they still fail on wrong gradients; on a GPU the gate applies unchanged.
INTERPRETER_BF16_FACTOR = 2
NAMES = ("dq", "dk", "dv", "dg", "d_erase", "d_write", "dh0")

__all__ = ["GATE", "ORDINARY", "GATE_LIKE", "INTERPRETER_BF16_FACTOR", "NAMES", "bf16_gate_factor", "rel_rms",
           "assert_gates", "assert_same_bits"]


def bf16_gate_factor() -> int:
    """The `factor` of `assert_gates` for bf16 results: INTERPRETER_BF16_FACTOR on the interpreter, 1 on a GPU."""
    return INTERPRETER_BF16_FACTOR if os.environ.get("TRITON_INTERPRET") == "1" else 1


def rel_rms(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    den = b.pow(2).mean().sqrt().item()
    num = (a - b).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


def assert_same_bits(out, want, *, ctx=""):
    """Every gradient of `want` that is not None equal bit for bit in `out` (a schedule field that only changes
    where or when the same kernels run)."""
    for n in NAMES:
        if want[n] is not None:
            assert torch.equal(out[n], want[n]), f"{ctx}: {n} differs"


def assert_gates(out, ref, *, ctx="", factor=1):
    """Every gradient of `ref` within the project gate of it (times `factor`: INTERPRETER_BF16_FACTOR only)."""
    errs = {}
    for n in NAMES:
        if ref[n] is None:
            assert out[n] is None, f"{ctx}: {n} should be None"
            continue
        assert out[n] is not None, f"{ctx}: {n} missing"
        assert out[n].shape == ref[n].shape, f"{ctx}: {n} shape {tuple(out[n].shape)} vs {tuple(ref[n].shape)}"
        assert torch.isfinite(out[n]).all(), f"{ctx}: {n} has non-finite values (unwritten tile?)"
        errs[n] = rel_rms(out[n], ref[n])
        tol = factor * (GATE if n in GATE_LIKE else ORDINARY)
        assert errs[n] <= tol, f"{ctx}: {n} rel RMS {errs[n]:.2e} > {tol} (all: {errs})"
    return errs
