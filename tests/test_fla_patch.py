"""`enable()` / `disable()` patch fla-core's chunk ops everywhere they are bound and restore them exactly;
calls outside the envelope (on CPU: every call) go to FLA unchanged and are counted in the report;
`rewy-tune run` enables the routing in a child and returns its exit code."""

from __future__ import annotations

import functools
import importlib
import subprocess
import sys
import types

import pytest
import torch

import rewy_tune
from rewy_tune import fla_patch

pytest.importorskip("fla")


def _holders(fn) -> list[tuple[types.ModuleType, str]]:
    out = []
    for module in list(sys.modules.values()):
        try:
            items = list(vars(module).items())
        except TypeError:
            continue
        out += [(module, attr) for attr, value in items if value is fn]
    return out


@pytest.fixture(scope="module")
def originals():
    fns = {}
    for op, (module_name, name) in fla_patch.TARGETS.items():
        fns[op] = getattr(importlib.import_module(module_name), name)
    for name in fla_patch.EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    return fns


@pytest.fixture
def stubs(originals, monkeypatch):
    """Replace each FLA original, wherever it is bound, with a recording stub of the same signature."""
    calls: list[tuple[str, tuple, dict]] = []
    made = {}
    for op, fn in originals.items():
        @functools.wraps(fn)
        def stub(*args, __op=op, **kwargs):
            calls.append((__op, args, kwargs))
            return ("fla", __op)

        made[op] = stub
        for module, attr in _holders(fn):
            monkeypatch.setattr(module, attr, stub)
    rewy_tune.reset_report()
    yield made, calls
    rewy_tune.disable()
    rewy_tune.reset_report()


def test_enable_disable_restore_exactly(originals, stubs):
    made, _ = stubs
    user = types.ModuleType("user_model_module")  # a module that did `from fla.ops import chunk_kda as kda`
    user.kda = made["kda"]
    sys.modules[user.__name__] = user
    try:
        before = {op: _holders(fn) for op, fn in made.items()}
        assert all(before.values())
        assert (importlib.import_module("fla.ops.kda.chunk"), "chunk_kda") in before["kda"]
        rewy_tune.enable()
        assert rewy_tune.is_enabled()
        for op, places in before.items():
            for module, attr in places:
                patched = getattr(module, attr)
                assert patched is not made[op] and patched.__rewy_original__ is made[op], (module.__name__, attr)
        rewy_tune.enable()  # idempotent
        rewy_tune.disable()
        assert not rewy_tune.is_enabled()
        for op, places in before.items():
            for module, attr in places:
                assert getattr(module, attr) is made[op], (module.__name__, attr)
        with rewy_tune.enabled():
            assert user.kda is not made["kda"]
        assert user.kda is made["kda"] and not rewy_tune.is_enabled()
    finally:
        del sys.modules[user.__name__]


def test_real_functions_restored(originals):
    before = {op: _holders(fn) for op, fn in originals.items()}
    with rewy_tune.enabled():
        for op, places in before.items():
            assert all(getattr(m, a) is not originals[op] for m, a in places)
    for op, places in before.items():
        assert all(getattr(m, a) is originals[op] for m, a in places)
        assert _holders(originals[op]) == places


def _inputs(B=1, T=32, H=2, K=32, V=32, HV=None, dtype=torch.bfloat16):
    HV = HV or H
    q, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    return q, k, v


def test_fallbacks_call_fla_and_are_counted(stubs):
    made, calls = stubs
    rewy_tune.enable()
    fla_ops = importlib.import_module("fla.ops")
    gdn_mod = importlib.import_module("fla.ops.gated_delta_rule")
    q, k, v = _inputs()
    beta = torch.rand(1, 32, 2, dtype=torch.bfloat16)
    g = -torch.rand(1, 32, 2)
    assert gdn_mod.chunk_gated_delta_rule(q, k, v, g, beta) == ("fla", "gdn")  # CPU tensors
    assert fla_ops.chunk_delta_rule(q, k, v, beta, output_final_state=True) == ("fla", "deltanet")
    cu = torch.tensor([0, 32])
    assert gdn_mod.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu) == ("fla", "gdn")
    assert gdn_mod.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True) == ("fla", "gdn")  # no A_log
    q2, k2, v2 = _inputs(HV=4)
    assert gdn_mod.chunk_gated_delta_rule(q2, k2, v2, -torch.rand(1, 32, 4), torch.rand(1, 32, 4)) == ("fla", "gdn")
    q3, k3, v3 = _inputs(dtype=torch.float64)
    assert fla_ops.chunk_delta_rule(q3, k3, v3, beta.double()) == ("fla", "deltanet")
    gk = -torch.rand(1, 32, 2, 32)
    assert importlib.import_module("fla.ops.kda").chunk_kda(q, k, v, gk, beta) == ("fla", "kda")
    assert [c[0] for c in calls] == ["gdn", "deltanet", "gdn", "gdn", "gdn", "deltanet", "kda"]
    assert calls[1][2] == {"output_final_state": True}  # arguments passed through unchanged
    rep = rewy_tune.report()
    assert rep["routed"] == [] and rep["routed_calls"] == 0 and rep["fallback_calls"] == 7
    got = {(d["op"], d["reason"]): d["calls"] for d in rep["fallbacks"]}
    assert got == {("gdn", "not CUDA"): 1, ("deltanet", "not CUDA"): 1, ("kda", "not CUDA"): 1,
                   ("gdn", "varlen (cu_seqlens)"): 1,
                   ("gdn", "in-kernel gate without A_log (FLA rejects it)"): 1,
                   ("gdn", "GVA (v heads 4 != q heads 2)"): 1, ("deltanet", "dtype float64"): 1}
    rewy_tune.disable()
    gdn_mod.chunk_gated_delta_rule(q, k, v, g, beta)  # after disable: FLA directly, not counted
    assert rewy_tune.report()["fallback_calls"] == 7


def test_print_report(stubs, capsys):
    rewy_tune.enable()
    q, k, v = _inputs()
    importlib.import_module("fla.ops").chunk_delta_rule(q, k, v, torch.rand(1, 32, 2, dtype=torch.bfloat16))
    rewy_tune.print_report(file=sys.stdout)
    out = capsys.readouterr().out
    assert "fell back to FLA" in out and "not CUDA" in out and "deltanet" in out


def test_run_command_prints_report_and_returns_exit_code(tmp_path):
    code = "import rewy_tune, sys; sys.exit(3 if rewy_tune.is_enabled() else 5)"
    env = {**__import__("os").environ, "REWY_DB": str(tmp_path / "none.db")}
    proc = subprocess.run([sys.executable, "-m", "rewy_tune.cli.main", "run", "--", sys.executable, "-c", code],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "rewy-tune dispatch report" in proc.stderr
    assert not (tmp_path / "none.db").exists()


def test_routed_call_runs_rewy_and_is_reported(monkeypatch, tmp_path):
    """The routing itself (CUDA in real use) on the Triton interpreter: same output and gradients as the
    torch reference, and one routed row in the report."""
    import os
    import warnings

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    monkeypatch.setenv("REWY_DB", str(tmp_path / "none.db"))
    rewy_tune.clear_cache()
    rewy_tune.reset_report()
    torch.manual_seed(0)
    B, T, H, K, V = 1, 64, 1, 16, 16
    q = torch.randn(B, T, H, K, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).requires_grad_()
    v = torch.randn(B, T, H, V, requires_grad=True)
    beta = torch.rand(B, T, H, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o, _ = fla_patch._route("deltanet", dict(q=q, k=k, v=v, beta=beta))
    grads = torch.autograd.grad(o.square().sum(), (q, k, v, beta))
    ref, _ = rewy_tune.chunk_deltanet(q, k, v, beta, backend="torch")
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, beta))
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    rows = rewy_tune.report()["routed"]
    assert len(rows) == 1 and rows[0]["op"] == "deltanet" and rows[0]["calls"] == 1
    assert rows[0]["bucket"] == "deltanet-R-fp32-K16-V16-T64-BH1" and rows[0]["reason"].startswith("generic:")
    rewy_tune.reset_report()
    rewy_tune.clear_cache()
