"""FLA (fla-core 0.6.0) as the baseline, on its Triton paths, for the benchmark and the tuner.

- Triton paths only: FlashQLA and TileLang backends are switched off before fla is imported
  (`FLA_FLASH_QLA=0`, `FLA_TILELANG=0`), as architecture.md's measurement protocol requires.
- Hopper with Triton < 3.7.1: fla-core refuses gated `chunk_bwd_dqkwg` (FLA issue 640, a miscompile).
  `bypass_hopper_guard()` lifts that refusal for timing only; the benchmark says so in its output.
- Autotuning on an idle GPU: fla-core keeps its autotuners' picks in Triton's on-disk cache (`cache_results`), and
  a pick made while other processes share the GPU (compile-ahead workers, the GPU tests' pytest workers) would be
  read back by the measuring process instead of chosen there. `autotune_here()` makes this process choose its own.
- Policy A: KDA and GDN2 use fla's own `disable_recompute=True`. DeltaNet and GDN have no such switch,
  so `FlaSaveAll` runs fla's forward pieces, keeps w, h and v_new, and runs fla's backward pieces
  without the recompute stages (the paper's "matched wrapper" that caches the same intermediates).
"""

from __future__ import annotations

import os

import torch

os.environ["FLA_FLASH_QLA"] = "0"
os.environ["FLA_TILELANG"] = "0"

_GUARD_BYPASSED = False


def autotune_here() -> int:
    """Make fla-core's autotuners in this process time their configurations themselves on first use (as FLA does in
    a training process) instead of reading picks from Triton's on-disk cache, which other processes may have timed
    on a shared GPU; the compiled binaries are still read from the cache. Covers the autotuners already defined and
    those defined later (fla-core reads its `FLA_CACHE_RESULTS` into `autotune_cache_kwargs` when imported; the
    variable also reaches processes started from here). Returns how many existing autotuners were switched."""
    import sys

    import triton

    from rewy_tune import autotune_parts

    os.environ["FLA_CACHE_RESULTS"] = "0"
    triton.knobs.autotuning.cache = False  # TRITON_CACHE_AUTOTUNING would turn caching back on for later autotuners
    env = sys.modules.get("fla.utils.env")
    if env is not None and "cache_results" in getattr(env, "autotune_cache_kwargs", {}):
        env.autotune_cache_kwargs["cache_results"] = False  # the dict later decorators unpack
    switched = 0
    for tuner in autotune_parts.autotuners():
        if getattr(tuner, "cache_results", False):
            tuner.cache_results = False
            switched += 1
    return switched


def discard_autotune_picks(ops) -> int:
    """Delete the autotuning picks of fla-core's kernels for these operators from Triton's on-disk cache (the
    compiled binaries stay), so the next process to run them times its configurations again. For a tuning
    campaign, whose measuring process then times them alone and leaves them for its gate processes: picks already
    on disk may have been timed on a shared GPU (the GPU tests' pytest workers, an earlier compile-ahead). Returns
    how many files were removed."""
    import importlib

    import triton
    from triton.runtime.jit import JITFunction

    from rewy_tune import autotune_parts

    for op in ops:
        importlib.import_module(autotune_parts.FLA_PACKAGES[op])
    names = set()
    for tuner in autotune_parts.autotuners():
        fn = tuner.fn
        while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):  # as Autotuner.check_disk_cache names it
            fn = fn.fn
        names.add(f"{getattr(fn, '__name__', '')[:150]}.autotune.json")
    removed = 0
    for folder, _, files in os.walk(triton.knobs.cache.dir):
        for name in files:
            if name in names:
                os.remove(os.path.join(folder, name))
                removed += 1
    return removed


def bypass_hopper_guard() -> bool:
    """Let fla's gated dqkwg run on Hopper with Triton < 3.7.1 (timing only). True if it was needed."""
    global _GUARD_BYPASSED
    import fla.ops.common.chunk_o as chunk_o

    needed = bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)
    if needed:
        chunk_o.TRITON_ABOVE_3_7_1 = True
        _GUARD_BYPASSED = True
    return needed


def guard_bypassed() -> bool:
    return _GUARD_BYPASSED


class FlaSaveAll(torch.autograd.Function):
    """DeltaNet / GDN through fla's kernels with every intermediate saved (policy A)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o

        if g is None:
            from fla.ops.delta_rule.wy_fast import prepare_wy_repr_fwd

            w, u, A = prepare_wy_repr_fwd(k=k, v=v, beta=beta, cu_seqlens=None)
            g_cum = None
        else:
            from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
            from fla.ops.utils import chunk_local_cumsum
            from fla.ops.utils.constant import RCP_LN2

            g_cum = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
            w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta)
        h, v_new, final_state = chunk_gated_delta_rule_fwd_h(
            k=k, w=w, u=u, g=g_cum, initial_state=initial_state, output_final_state=output_final_state)
        o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=scale)
        ctx.save_for_backward(q, k, v, g_cum, beta, A, w, h, v_new, initial_state)
        ctx.scale = scale
        ctx.gated = g is not None
        return o.to(q.dtype), final_state

    @staticmethod
    def backward(ctx, do, dht):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local

        q, k, v, g_cum, beta, A, w, h, v_new, initial_state = ctx.saved_tensors
        scale = ctx.scale
        dv = chunk_bwd_dv_local(q=q, k=k, g=g_cum, do=do, scale=scale)
        dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(
            q=q, k=k, w=w, g=g_cum, h0=initial_state, dht=dht, do=do, dv=dv, scale=scale)
        dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g_cum, h=h, dv=dv, do=do, dh=dh, scale=scale)
        if ctx.gated:
            from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
            from fla.ops.utils import chunk_local_cumsum

            dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g_cum, A=A, dw=dw, du=dv)
            dk.add_(dk2)
            dg.add_(dg2)
            dg = chunk_local_cumsum(dg, chunk_size=64, reverse=True)
        else:
            from fla.ops.delta_rule.wy_fast import prepare_wy_repr_bwd

            dk2, dv, db = prepare_wy_repr_bwd(k=k, v=v, beta=beta, A=A, dw=dw, du=dv, cu_seqlens=None)
            dk.add_(dk2)
            dg = None
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db.to(beta.dtype), dh0, None, None)


def fla_op(op: str, policy: str):
    """A callable `(q, k, v, g, erase, write, scale, initial_state, output_final_state) -> (o, ht)` on FLA."""
    if op in ("deltanet", "gdn"):
        if policy == "A":
            def run(q, k, v, g, erase, write, scale, initial_state, output_final_state):
                return FlaSaveAll.apply(q, k, v, g, erase, initial_state, scale, output_final_state)
            return run
        if op == "deltanet":
            from fla.ops.delta_rule import chunk_delta_rule

            def run(q, k, v, g, erase, write, scale, initial_state, output_final_state):
                return chunk_delta_rule(q, k, v, erase, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state)
            return run
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        def run(q, k, v, g, erase, write, scale, initial_state, output_final_state):
            return chunk_gated_delta_rule(q, k, v, g, erase, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state)
        return run
    save_all = policy == "A"
    if op == "kda":
        from fla.ops.kda import chunk_kda

        def run(q, k, v, g, erase, write, scale, initial_state, output_final_state):
            return chunk_kda(q, k, v, g, erase, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, disable_recompute=save_all)
        return run
    if op == "gdn2":
        from fla.ops.gdn2 import chunk_gdn2

        def run(q, k, v, g, erase, write, scale, initial_state, output_final_state):
            return chunk_gdn2(q, k, v, g, erase, write, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, disable_recompute=save_all)
        return run
    raise ValueError(f"op: unknown operator {op!r}; accepted: deltanet, gdn, kda, gdn2")
