"""autograd.Function joining the pure-torch chunk forward and the hand-written ReWY backward (CPU backend)."""
from __future__ import annotations

import torch

from .chunk_forward import ChunkForward, chunk_forward
from .rewy_backward import rewy_backward


class RewyTorchFunction(torch.autograd.Function):
    """``RewyTorchFunction.apply(q, k, v, g, erase, write, initial_state, scale, chunk_size, policy,
    output_final_state) -> (o, final_state)``

    Positional arguments, in this exact order:

    - ``q, k``: ``[B,T,H,K]``; ``v``: ``[B,T,H,V]``
    - ``g``: None (DeltaNet) | ``[B,T,H]`` (GDN) | ``[B,T,H,K]`` (KDA, GDN2); per-token natural-log gate
    - ``erase``: ``[B,T,H]`` (β) | ``[B,T,H,K]`` (GDN2 b); ``write``: ``[B,T,H]`` (β) | ``[B,T,H,V]`` (GDN2 w).
      DeltaNet/GDN/KDA pass the same β tensor twice; autograd then sums d_erase + d_write into dβ.
    - ``initial_state``: None | ``[B,H,K,V]``
    - ``scale``: float or None (K**-0.5); ``chunk_size``: int; ``policy``: "R" (recompute) | "A" (save-all)
    - ``output_final_state``: bool; when False ``final_state`` is None.

    Returns ``o`` in v's dtype and ``final_state`` in float32 (float64 for float64 inputs). Gradients flow
    from both outputs; absent inputs (g, initial_state) get None.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, erase, write, initial_state, scale, chunk_size, policy, output_final_state):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        fwd = chunk_forward(q, k, v, g, erase, write, scale=scale, initial_state=initial_state,
                            chunk_size=chunk_size, save_states=(policy == "A"))
        ctx.save_for_backward(q, k, v, g, erase, write, initial_state, fwd.G, fwd.A, fwd.S0, fwd.R)
        ctx.scale, ctx.chunk_size, ctx.policy = scale, chunk_size, policy
        # Unused outputs must reach backward as None rather than zero tensors.
        ctx.set_materialize_grads(False)
        return fwd.o, (fwd.final_state if output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, erase, write, initial_state, G, A, S0, R = ctx.saved_tensors
        fwd = ChunkForward(o=None, final_state=None, G=G, A=A, S0=S0, R=R)
        grads = rewy_backward(q, k, v, g, erase, write, fwd, do, dht, scale=ctx.scale,
                              initial_state=initial_state, chunk_size=ctx.chunk_size, policy=ctx.policy)
        return (grads.dq, grads.dk, grads.dv, grads.dg, grads.d_erase, grads.d_write, grads.dh0,
                None, None, None, None)
