"""The GPU gate's cases compile nothing beyond the tail case and the workload warm-up (CPU, interpreter).

Every distinct kernel specialization (constexprs, None-ness of optional pointers, pointer dtypes, launch options)
is one Triton compile on a GPU, and compiles are what a trial spends its time on. The launches are recorded on
the interpreter, where a specialization is the same set of values."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace

import pytest
import torch

from rewy_tune import gates, trial_worker
from rewy_tune.search import default_schedule

MODULES = ("recompute", "scan", "local", "vector_local", "cumsum")


def _key(kernel, args, kwargs) -> str:
    """What Triton compiles a launch for: constexpr values, None-ness and dtype of pointers, and for run-time
    ints not listed in do_not_specialize the value classes Triton specializes on (== 1, divisible by 16)."""
    import inspect

    params = inspect.signature(kernel.fn).parameters
    constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    loose = set(kernel.kwargs.get("do_not_specialize") or ())
    key = {}
    for name, x in [*zip(kernel.arg_names, args), *sorted(kwargs.items())]:
        if isinstance(x, torch.Tensor):
            key[name] = ["ptr", str(x.dtype)]
        elif x is None or name in constexprs or isinstance(x, (bool, str)) or name in ("num_warps", "num_stages"):
            key[name] = ["const", x]
        elif isinstance(x, int) and name not in loose:
            key[name] = ["int", x == 1, x % 16 == 0]
        else:
            key[name] = [type(x).__name__]
    return json.dumps(key, sort_keys=True)


@pytest.fixture
def recorded(monkeypatch):
    launches: list[tuple[str, str]] = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*a, **kw):
                launches.append((self.name, _key(self.kernel, a, kw)))
                return self.kernel[grid](*a, **kw)
            return launch

    for m in MODULES:
        mod = importlib.import_module(f"rewy_tune.kernels.triton.{m}")
        for name in dir(mod):
            if name.startswith("rewy_") and (name.endswith("_kernel") or name.startswith("rewy_bwd_kernel")):
                monkeypatch.setattr(mod, name, Recorder(name, getattr(mod, name)))
    return launches


@pytest.mark.parametrize("op", ["gdn", "gdn2"])
def test_the_gpu_gate_cases_add_only_the_initial_state_variants(recorded, op):
    K = V = 32
    sched = default_schedule(op, None, K, V).replace(forward_scan_segments=4, reverse_scan_segments=8)
    runner = gates.op_runner(backend="triton", schedule=sched)
    cases = [replace(c, H=1, dtype="fp32") for c in trial_worker.validation_cases(op, "R", K, V, "cuda")]
    assert [c.label for c in cases] == ["tail-h0", "beta-zero", "strong-decay"]
    tail, short = cases[0], cases[1:]
    assert tail.initial_state and tail.final_grad and tail.T % 64
    warm = replace(tail, T=512, initial_state=False, final_grad=False, label="warm")  # as measure.bench_inputs

    def specializations(case):
        recorded.clear()
        runner(case, gates.make_inputs(case, 0, "cpu"))
        return set(recorded)

    at_warm = specializations(warm)
    for case in short:
        assert specializations(case) <= at_warm, case.label  # nothing compiled that the warm-up does not compile
    # the tail case with its initial state and final-state gradient is what adds variants (and must: it gates them)
    assert specializations(tail) - at_warm
