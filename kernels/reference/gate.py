"""The gate activations FLA's layers ask their chunk ops to apply (``use_gate_in_kernel``), in torch.

For a raw gate input x (per token, per head; KDA/GDN2 per key channel too), with a = exp(A_log[h]) and the bias
b = dt_bias[h(, k)] added first:
- softplus form (GDN, KDA, GDN2 without a lower bound): g = −a · softplus(x + b);
- lower-bound form (KDA, GDN2 with ``lower_bound`` L < 0): g = L · sigmoid(a · (x + b)) (a = 1 without A_log).

The result is the per-token natural-log decay the ops take as ``g``. Computed in float32 (float64 for a
float64 input), differentiable by autograd: the float64 references of the gates, and the torch backend's path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activated_gate(g: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   lower_bound: float | None = None) -> torch.Tensor:
    """g [B, T, H] (A_log, dt_bias [H]) or [B, T, H, K] (A_log [H], dt_bias [H·K]) → the activated gate, fp32 or
    fp64 (the wider of g's dtype and float32)."""
    ct = torch.promote_types(g.dtype, torch.float32)
    x = g.to(ct)
    H = g.shape[2]
    per_channel = g.dim() == 4
    shape = (H, g.shape[3]) if per_channel else (H,)
    scale_shape = (H, 1) if per_channel else (H,)
    if dt_bias is not None:
        x = x + dt_bias.to(ct).reshape(shape)
    if lower_bound is None:
        return -A_log.to(ct).reshape(scale_shape).exp() * F.softplus(x)
    if A_log is not None:
        x = A_log.to(ct).reshape(scale_shape).exp() * x
    return lower_bound * x.sigmoid()
