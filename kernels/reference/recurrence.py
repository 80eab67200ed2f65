"""Token-by-token recurrences of the four delta-rule operators: the ground truth of rewy-tune.

Per (batch, head), with state ``S: [K, V]``, scale ``s`` (default ``K**-0.5``) and per-token log gate g
(natural log, per token, not cumulative):

    S'  = Diag(exp(g_t)) S                     (decay; scalar g broadcasts, no gate: S' = S)
    u_t = w_t ⊙ v_t − S'ᵀ (e_t ⊙ k_t)          (correction; e = erase, w = write)
    S_t = S' + k_t u_tᵀ
    o_t = S_tᵀ (s q_t)                          (read after token t's update)

| operator | g | erase e_t | write w_t |
|---|---|---|---|
| DeltaNet | none | β_t (scalar) | β_t |
| GDN | scalar ``[B,T,H]`` | β_t | β_t |
| KDA | vector ``[B,T,H,K]`` | β_t | β_t |
| GDN2 | vector ``[B,T,H,K]`` | b_t ∈ R^K | w_t ∈ R^V |

(rewy-math §1.) Everything is computed in the inputs' dtype with plain differentiable torch ops, so that
``torch.autograd`` through this loop is the reference every gradient is checked against; it is slow by design.
"""
from __future__ import annotations

import torch


def _channels_last(x: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token scalars ``[B,T,H]`` become ``[B,T,H,1]`` so they broadcast like per-channel tensors."""
    if x is None or x.dim() == 4:
        return x
    return x.unsqueeze(-1)


def recurrent_delta(q, k, v, g, erase, write, *, scale=None, initial_state=None, output_final_state=False):
    """Generic delta-rule recurrence. Layout: q, k ``[B,T,H,K]``, v ``[B,T,H,V]``, g None | ``[B,T,H]`` |
    ``[B,T,H,K]``, erase ``[B,T,H]`` | ``[B,T,H,K]``, write ``[B,T,H]`` | ``[B,T,H,V]``, initial_state
    ``[B,H,K,V]``. Returns ``(o [B,T,H,V], final_state [B,H,K,V] or None)``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    g, erase, write = _channels_last(g), _channels_last(erase), _channels_last(write)
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(q.dtype)
    outputs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp().unsqueeze(-1)  # [B,H,K|1,1]: decays the key rows
        k_t = k[:, t]
        u = write[:, t] * v[:, t] - torch.einsum("bhkv,bhk->bhv", S, erase[:, t] * k_t)
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    o = torch.stack(outputs, dim=1)
    return o, (S if output_final_state else None)


def recurrent_deltanet(q, k, v, beta, **kwargs):
    """DeltaNet: no gate, beta ``[B,T,H]`` is both erase and write."""
    return recurrent_delta(q, k, v, None, beta, beta, **kwargs)


def recurrent_gdn(q, k, v, g, beta, **kwargs):
    """Gated DeltaNet: scalar log gate g ``[B,T,H]``, beta ``[B,T,H]``."""
    return recurrent_delta(q, k, v, g, beta, beta, **kwargs)


def recurrent_kda(q, k, v, g, beta, **kwargs):
    """Kimi Delta Attention: vector log gate g ``[B,T,H,K]``, beta ``[B,T,H]``."""
    return recurrent_delta(q, k, v, g, beta, beta, **kwargs)


def recurrent_gdn2(q, k, v, g, b, w, **kwargs):
    """Gated DeltaNet-2: vector log gate g ``[B,T,H,K]``, erase b ``[B,T,H,K]``, write w ``[B,T,H,V]``."""
    return recurrent_delta(q, k, v, g, b, w, **kwargs)
