"""The policy-A baseline (`fla_baseline.FlaSaveAll`) calls fla-core's internal functions directly; their
signatures are not a public API and change between releases (fla-core 0.6.0 made `cu_seqlens` of the
DeltaNet `prepare_wy_repr_bwd` a required argument, which broke the H200 bench). FLA's kernels need a GPU, so
here every fla-core function FlaSaveAll calls is replaced by a fake that binds the call to the pinned
fla-core's real signature (a missing or unknown argument fails) and returns zeros of the right shapes."""

from __future__ import annotations

import importlib
import inspect
import os

import pytest
import torch

pytest.importorskip("fla")

B, T, H, K, V, C = 1, 128, 2, 16, 16, 64
NT = T // C

# module, function, outputs (shapes) in FLA's return order
FAKES = [
    ("fla.ops.delta_rule.wy_fast", "prepare_wy_repr_fwd", [(B, T, H, K), (B, T, H, V), (B, T, H, C)]),
    ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_intra",
     [(B, T, H, K), (B, T, H, V), (B, T, H, C)]),
    ("fla.ops.utils", "chunk_local_cumsum", [(B, T, H)]),
    ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_h",
     [(B, NT, H, K, V), (B, T, H, V), (B, H, K, V)]),
    ("fla.ops.common.chunk_o", "chunk_fwd_o", [(B, T, H, V)]),
    ("fla.ops.common.chunk_o", "chunk_bwd_dv_local", [(B, T, H, V)]),
    ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_dhu",
     [(B, NT, H, K, V), (B, H, K, V), (B, T, H, V)]),
    ("fla.ops.common.chunk_o", "chunk_bwd_dqkwg", [(B, T, H, K), (B, T, H, K), (B, T, H, K), (B, T, H)]),
    ("fla.ops.delta_rule.wy_fast", "prepare_wy_repr_bwd", [(B, T, H, K), (B, T, H, V), (B, T, H)]),
    ("fla.ops.gated_delta_rule.wy_fast", "prepare_wy_repr_bwd",
     [(B, T, H, K), (B, T, H, V), (B, T, H), (B, T, H)]),
]


@pytest.fixture
def bound_calls(monkeypatch):
    calls = []
    for mod_name, fn_name, shapes in FAKES:
        mod = importlib.import_module(mod_name)
        sig = inspect.signature(getattr(mod, fn_name))

        def fake(*args, _sig=sig, _name=f"{mod_name}.{fn_name}", _shapes=shapes, **kwargs):
            _sig.bind(*args, **kwargs)  # TypeError on a missing or unknown argument, as the real call would
            calls.append(_name)
            outs = [torch.zeros(s) for s in _shapes]
            return outs[0] if len(outs) == 1 else tuple(outs)

        monkeypatch.setattr(mod, fn_name, fake)
    return calls


@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_policy_a_baseline_calls_match_the_pinned_fla_core(op, bound_calls):
    from rewy_tune import fla_baseline

    q, k = torch.randn(B, T, H, K, requires_grad=True), torch.randn(B, T, H, K, requires_grad=True)
    v, beta = torch.randn(B, T, H, V, requires_grad=True), torch.rand(B, T, H, requires_grad=True)
    g = torch.randn(B, T, H, requires_grad=True) if op == "gdn" else None
    h0 = torch.randn(B, H, K, V, requires_grad=True)
    o, _ = fla_baseline.fla_op(op, "A")(q, k, v, g, beta, None, K ** -0.5, h0, False)
    leaves = [t for t in (q, k, v, g, beta, h0) if t is not None]
    grads = torch.autograd.grad(o.sum(), leaves)
    assert all(gr.shape == t.shape for gr, t in zip(grads, leaves))
    wy = "gated_delta_rule" if op == "gdn" else "delta_rule"
    assert f"fla.ops.{wy}.wy_fast.prepare_wy_repr_bwd" in bound_calls
    assert "fla.ops.common.chunk_o.chunk_bwd_dqkwg" in bound_calls


_AUTOTUNE_HERE = r"""
import os
os.environ["TRITON_CACHE_AUTOTUNING"] = "1"  # a user's setting must not turn the disk cache back on
import triton
from rewy_tune import autotune_parts, fla_baseline
import fla.ops.gated_delta_rule  # noqa: F401 - its autotuners exist before the call
before = [t.cache_results for t in autotune_parts.autotuners()]
switched = fla_baseline.autotune_here()
from fla.utils import env
print(len(before), sum(before), switched, sum(t.cache_results for t in autotune_parts.autotuners()),
      env.autotune_cache_kwargs.get("cache_results"), os.environ["FLA_CACHE_RESULTS"], triton.knobs.autotuning.cache)
"""


def test_autotune_here_stops_reading_picks_from_the_disk_cache():
    # fla-core's autotuners keep their picks in Triton's on-disk cache; a measuring process must time its own (the
    # compile-ahead workers and the GPU tests' pytest workers time them on a shared GPU). In a fresh process, so the
    # switches do not leak into the other tests.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _AUTOTUNE_HERE], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert out.returncode == 0, out.stderr[-3000:]
    n, cached_before, switched, cached_after, kwarg, env_var, knob = out.stdout.split()
    assert int(n) > 10 and int(cached_before) == int(n) == int(switched)  # every fla-core autotuner cached before
    assert int(cached_after) == 0 and kwarg == "False" and env_var == "0" and knob == "False"


def test_discard_autotune_picks_removes_only_fla_core_picks(tmp_path, monkeypatch):
    # A campaign's measuring process must time FLA's configurations itself: fla-core's cached picks go, its
    # binaries and everything else stay.
    from rewy_tune import fla_baseline

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fla_pick = tmp_path / "h1" / "chunk_fwd_kernel_o.autotune.json"
    keep = [tmp_path / "h1" / "chunk_fwd_kernel_o.cubin", tmp_path / "h2" / "some_other_kernel.autotune.json"]
    for f in (fla_pick, *keep):
        f.parent.mkdir(exist_ok=True)
        f.write_text("{}")
    assert fla_baseline.discard_autotune_picks(["gdn"]) == 1
    assert not fla_pick.exists() and all(f.exists() for f in keep)
