"""Chunkwise forward of the generic delta rule (rewy-math §2–3), readable pure torch.

Per chunk of n ≤ C rows (the last chunk may be short), with G the chunk-local inclusive cumsum of g,
γ = exp(G), τ = exp(G_n − G), E = e⊙K⊙γ, Z = ω⊙V, Q_g = sQ⊙γ, K_t = K⊙τ:

    L    = L_<(Σ_f e_if k_if k_jf Λ_ijf),   A = (I + L)^{-1}
    W    = A E,  U = A Z,  R = U − W S0        (R = the corrections, FLA's v_new)
    O    = Q_g S0 + A_qk R,   A_qk = L_≤(s Σ_f q_if k_jf Λ_ijf)
    S1   = Γ_n S0 + K_tᵀ R

Computation runs in float32 (float64 for float64 inputs), whatever the input dtype. Internally tensors are
head-major ``[B,H,T,X]`` where X is the feature axis, and per-token scalars carry a trailing axis of size 1,
so scalar and vector gates/coefficients share one code path through broadcasting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkForward:
    """What the forward returns and what the ReWY backward reads (rewy-math §3)."""

    o: torch.Tensor  # [B,T,H,V], input dtype
    final_state: torch.Tensor  # [B,H,K,V], working dtype (fp32 / fp64)
    G: torch.Tensor | None  # chunk-local inclusive cumsum of g, shape of g, working dtype; None without a gate
    A: torch.Tensor  # M^{-1} in FLA layout [B,T,H,C], working dtype; columns past a chunk's length are 0
    S0: torch.Tensor | None = None  # policy A: state entering each chunk [B,NT,H,K,V]
    R: torch.Tensor | None = None  # policy A: corrections (v_new) [B,T,H,V]
    W: torch.Tensor | None = None  # policy A: W = A E [B,T,H,K] in k's dtype (FLA's w, which its save-all keeps)
    # A_qk in fla-core 0.6.0's Aqk convention (what chunk_kda_fwd / chunk_gdn2_fwd return as out[3]): [B,T,H,C] in
    # k's dtype, row t = query i of its chunk, column c = key j = c of the same chunk, scale folded in,
    # Aqk[t, c] = s Σ_f q_if k_jf exp(G_if − G_jf) for j ≤ i (diagonal included), G the natural-log chunk cumsum.
    # Entries with j > i are 0 here; FLA leaves them unwritten (torch.empty), so readers must mask them.
    Aqk: torch.Tensor | None = None
    # policy A: Q ⊙ γ (no scale) and K ⊙ τ [B,T,H,K] in k's dtype: fla-core's qg and kg, which the save-all forward of
    # its KDA / GDN2 keeps (Schedule.scan_operands "forward" reads them)
    QG: torch.Tensor | None = None
    KG: torch.Tensor | None = None


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (the oracle); every other dtype is computed in float32 (rewy-math §8.1)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_heads(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``[B,T,H]`` or ``[B,T,H,X]`` -> ``[B,H,T,X]`` (X = 1 for per-token scalars) in the working dtype."""
    if x is None:
        return None
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    return x.transpose(1, 2).to(dtype)


def from_heads(x: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of :func:`to_heads`, back to ``like``'s shape and to ``dtype`` (default ``like``'s dtype)."""
    x = x.transpose(1, 2)
    if like.dim() == 3:
        x = x.squeeze(-1)
    return x.to(like.dtype if dtype is None else dtype)


def chunk_slices(T: int, chunk_size: int) -> list[slice]:
    return [slice(start, min(start + chunk_size, T)) for start in range(0, T, chunk_size)]


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Inclusive cumsum along T (axis 2 of ``[B,H,T,X]``) restarting at every chunk (FLA chunk_local_cumsum)."""
    return torch.cat([g[:, :, sl].cumsum(2) for sl in chunk_slices(g.shape[2], chunk_size)], dim=2)


def decay_matrix(G: torch.Tensor, *, strict: bool = False) -> torch.Tensor:
    """Λ_ij = exp(G_i − G_j) for i ≥ j (i > j when strict), else 0: ``[B,H,n,X]`` -> ``[B,H,n,n,X]``.

    The mask is applied to the exponent before exponentiating: for i < j the exponent is positive and
    would overflow under strong decay."""
    n = G.shape[2]
    keep = torch.ones(n, n, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    diff = G.unsqueeze(3) - G.unsqueeze(2)
    return diff.masked_fill(~keep[:, :, None], float("-inf")).exp()


def gated_product(X: torch.Tensor, Y: torch.Tensor, G: torch.Tensor, *, strict: bool) -> torch.Tensor:
    """``Σ_f X_if Y_jf Λ_ijf`` masked lower (strict or inclusive), ``[B,H,n,n]``.

    Scalar gates (X axis of G is 1) use one dense K-contraction times the n×n decay matrix; vector gates
    contract the per-channel Λ pairwise, which is exact at any decay strength (the forward is not the
    stage being optimised here)."""
    lam = decay_matrix(G, strict=strict)
    if G.shape[-1] == 1:
        return (X @ Y.transpose(-1, -2)) * lam[..., 0]
    return torch.einsum("bhik,bhjk,bhijk->bhij", X, Y, lam)


def erase_matrix(K: torch.Tensor, e: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """L = L_<(E Yᵀ): L_ij = Σ_f e_if k_if k_jf Λ_ijf for i > j (FLA's Akk before solve_tril)."""
    return gated_product(e * K, K, G, strict=True)


def output_matrix(Q: torch.Tensor, K: torch.Tensor, G: torch.Tensor, scale: float) -> torch.Tensor:
    """A_qk = L_≤(Q_g Yᵀ): s Σ_f q_if k_jf Λ_ijf for i ≥ j (FLA's Aqk, scale included)."""
    return scale * gated_product(Q, K, G, strict=False)


def invert_unit_lower(L: torch.Tensor) -> torch.Tensor:
    """A = (I + L)^{-1} for strictly lower L (FLA solve_tril)."""
    n = L.shape[-1]
    eye = torch.eye(n, dtype=L.dtype, device=L.device).expand_as(L)
    return torch.linalg.solve_triangular(L + eye, eye, upper=False, unitriangular=True)


def chunk_forward(q, k, v, g, erase, write, *, scale=None, initial_state=None, chunk_size=64,
                  save_states=False) -> ChunkForward:
    """Chunkwise forward. Shapes as in :func:`rewy_tune.kernels.reference.recurrence.recurrent_delta`.
    ``save_states=True`` (policy A) also keeps the per-chunk entering states S0, the corrections R, W and the gated
    Q ⊙ γ, K ⊙ τ (QG, KG)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K ** -0.5 if scale is None else scale
    wd = working_dtype(q.dtype)
    Q, Kh, Vh = to_heads(q, wd), to_heads(k, wd), to_heads(v, wd)
    e, w = to_heads(erase, wd), to_heads(write, wd)
    # No gate is the zero gate: one code path, Λ becomes the lower-triangular ones matrix.
    G = chunk_local_cumsum(to_heads(g, wd), C) if g is not None else Q.new_zeros(B, H, T, 1)

    S = Q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(wd)
    O = Q.new_empty(B, H, T, V)
    A_all = Q.new_zeros(B, H, T, C)
    Aqk_all = Q.new_zeros(B, H, T, C)
    S0_all, R_all, W_all, QG_all, KG_all = [], [], [], [], []
    for sl in chunk_slices(T, C):
        n = sl.stop - sl.start
        Qc, Kc, Vc, ec, wc, Gc = Q[:, :, sl], Kh[:, :, sl], Vh[:, :, sl], e[:, :, sl], w[:, :, sl], G[:, :, sl]
        gamma = Gc.exp()
        gamma_n = gamma[:, :, -1:]  # [B,H,1,X]
        tau = (Gc[:, :, -1:] - Gc).exp()
        A = invert_unit_lower(erase_matrix(Kc, ec, Gc))
        W = A @ (ec * Kc * gamma)
        U = A @ (wc * Vc)
        R = U - W @ S
        Aqk = output_matrix(Qc, Kc, Gc, scale)
        O[:, :, sl] = (scale * Qc * gamma) @ S + Aqk @ R
        A_all[:, :, sl, :n] = A
        Aqk_all[:, :, sl, :n] = Aqk
        S0_all.append(S)
        R_all.append(R)
        W_all.append(W)
        KG = Kc * tau
        QG_all.append(Qc * gamma)
        KG_all.append(KG)
        S = gamma_n.transpose(-1, -2) * S + KG.transpose(-1, -2) @ R

    return ChunkForward(
        o=from_heads(O, v),
        final_state=S,
        G=from_heads(G, g, wd) if g is not None else None,
        A=A_all.transpose(1, 2),
        S0=torch.stack(S0_all, dim=1) if save_states else None,
        R=torch.cat(R_all, dim=2).transpose(1, 2) if save_states else None,
        W=torch.cat(W_all, dim=2).transpose(1, 2).to(k.dtype) if save_states else None,
        Aqk=Aqk_all.transpose(1, 2).to(k.dtype),
        QG=torch.cat(QG_all, dim=2).transpose(1, 2).to(k.dtype) if save_states else None,
        KG=torch.cat(KG_all, dim=2).transpose(1, 2).to(k.dtype) if save_states else None,
    )
