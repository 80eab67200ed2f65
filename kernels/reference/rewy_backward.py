"""Hand-written ReWY chunkwise backward (rewy-math §§4–8) for DeltaNet, GDN, KDA and GDN2, in pure torch.

Stages, in the order the math runs (one function each, named after the spec):

1. ``recompute_states``   policy R: W = AE, U = AZ, R = U − W S0, S1 = Γ_n S0 + K_tᵀR  (§3)
2. ``reverse_state_scan`` R̄ = A_qkᵀdO + K_t dS1, dS0 = Γ_n dS1 + Q_gᵀdO − WᵀR̄, chunks N..1  (§4)
3. ``producer``           P = AᵀR̄, D = −L_<(PRᵀ), Ē_dir = −PS0ᵀ  (§5, the three new products)
   ``shared_adjoints``    H = L_≤(dO Rᵀ), Q̄_g = dO S0ᵀ, K̄_t = R dS1ᵀ  (§5, shared with FLA)
4. intra contractions     X_q = Σ_j H_ij k_j Λ_ij,  X_e = Σ_j D_ij k_j Λ_ij,
                          X_y,j = Σ_i Λ_ij (H_ij s q_i + D_ij e_i k_i)
   ``intra_scalar_gate``  no/scalar gate: four dense products with the n×n decay matrix, Gram-eliminated (§6.1–6.2)
   ``intra_centred``      vector gate: centred whole-chunk products (§6.3)
   ``intra_subchunk``     vector gate: 16-row anchored blocks + pairwise diagonal blocks (§7 fallback)
   ``intra_vector_gate``  the range guard dispatching per chunk × head × feature tile (§7)
5. ``consumer``           chain rule to dq, dk, dv, d_erase, d_write, Ḡ (§6, with the self-term split §8.2)
6. ``reverse_chunk_cumsum`` dg from Ḡ (§6 (b))

All four operators share one path: per-token scalars carry a trailing axis of size 1 and broadcast, and the
consumer forms every quantity per key channel, reducing over channels only at the end for scalar gates,
scalar erase or scalar write. Gram elimination is then automatic: the residual gate/β terms are
⟨e_i k_i, X_e,i⟩ and ⟨k_i, X_y,i⟩ from products dk needs anyway; no K Kᵀ product is formed.

Works in float64 for float64 inputs and float32 otherwise; gradients come back in each input's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .chunk_forward import (
    ChunkForward,
    chunk_slices,
    decay_matrix,
    from_heads,
    output_matrix,
    to_heads,
    working_dtype,
)

# Largest chunk × tile gate range Δ for the centred products (§7): α, ζ reach exp(Δ/2); e^64 ≈ 6e27 leaves
# ≈ e^24 of fp32/bf16 exponent headroom for the n-term sums. Used for the fp32 and fp64 working dtypes alike.
CENTRED_MAX_RANGE = 128.0
SUBCHUNK_ROWS = 16  # FLA chunk_kda_bwd_intra's BC


@dataclass
class RewyGrads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor | None
    d_erase: torch.Tensor
    d_write: torch.Tensor
    dh0: torch.Tensor | None
    intra_paths: dict = field(default_factory=lambda: {"centred": 0, "subchunk": 0})


@dataclass
class Chunk:
    """One chunk's inputs in head-major layout ``[B,H,n,X]`` and its elementwise factors (rewy-math §2)."""

    Q: torch.Tensor  # unscaled q
    K: torch.Tensor
    V: torch.Tensor
    e: torch.Tensor  # erase, [.., 1] or [.., K]
    w: torch.Tensor  # write, [.., 1] or [.., V]
    G: torch.Tensor  # chunk-local cumulative gate, [.., 1] or [.., K] (zeros without a gate)
    scale: float

    @property
    def gamma(self):
        return self.G.exp()

    @property
    def gamma_n(self):  # whole-chunk decay as a column acting on the state's K rows: [B,H,X,1]
        return self.G[:, :, -1:].exp().transpose(-1, -2)

    @property
    def tau(self):
        return (self.G[:, :, -1:] - self.G).exp()

    @property
    def E(self):
        return self.e * self.K * self.gamma

    @property
    def Z(self):
        return self.w * self.V

    @property
    def Qg(self):
        return self.scale * self.Q * self.gamma

    @property
    def Kt(self):
        return self.K * self.tau

    @property
    def Aqk(self):
        return output_matrix(self.Q, self.K, self.G, self.scale)


# ---------------------------------------------------------------- §3: forward quantities (policy R)

def recompute_states(chunks: list[Chunk], A: list[torch.Tensor], h0: torch.Tensor):
    """Policy R: rerun the state pass from the saved A. Returns (W, R, S0) per chunk."""
    W_all, R_all, S0_all = [], [], []
    S = h0
    for ch, Ac in zip(chunks, A):
        W = Ac @ ch.E
        U = Ac @ ch.Z
        R = U - W @ S
        W_all.append(W)
        R_all.append(R)
        S0_all.append(S)
        S = ch.gamma_n * S + ch.Kt.transpose(-1, -2) @ R
    return W_all, R_all, S0_all


# ---------------------------------------------------------------- §4: reverse state scan

def reverse_state_scan(chunks: list[Chunk], W: list[torch.Tensor], dO: list[torch.Tensor], dht: torch.Tensor):
    """Serial over chunks N..1. Returns (R̄ per chunk, dS1 per chunk, dh0 = dS0 of the first chunk)."""
    n_chunks = len(chunks)
    Rbar, dS1_all = [None] * n_chunks, [None] * n_chunks
    dS = dht
    for c in reversed(range(n_chunks)):
        ch = chunks[c]
        dS1_all[c] = dS
        Rbar[c] = ch.Aqk.transpose(-1, -2) @ dO[c] + ch.Kt @ dS
        dS = ch.gamma_n * dS + ch.Qg.transpose(-1, -2) @ dO[c] - W[c].transpose(-1, -2) @ Rbar[c]
    return Rbar, dS1_all, dS


# ---------------------------------------------------------------- §5: local pullback

def producer(A: torch.Tensor, Rbar: torch.Tensor, R: torch.Tensor, S0: torch.Tensor):
    """The three ReWY products: P = AᵀR̄ (= Z̄), D = −L_<(PRᵀ) (= L̄), Ē_dir = −P S0ᵀ."""
    P = A.transpose(-1, -2) @ Rbar
    D = -(P @ R.transpose(-1, -2)).tril(-1)
    Ebar_dir = -P @ S0.transpose(-1, -2)
    return P, D, Ebar_dir


def shared_adjoints(dO: torch.Tensor, R: torch.Tensor, S0: torch.Tensor, dS1: torch.Tensor):
    """Products every consumer needs (unchanged from FLA): H = L_≤(dO Rᵀ) (unscaled), Q̄_g = dO S0ᵀ, K̄_t = R dS1ᵀ."""
    H = (dO @ R.transpose(-1, -2)).tril(0)
    Qbar_g = dO @ S0.transpose(-1, -2)
    Kbar_t = R @ dS1.transpose(-1, -2)
    return H, Qbar_g, Kbar_t


def split_self_term(H: torch.Tensor):
    """Self-term split (§6, §8.2): H = H_< + diag(h). The diagonal enters dq, dk elementwise and cancels
    exactly in Ḡ, so it is kept out of the intra contractions (saves fp32 accuracy under strong decay)."""
    return H.tril(-1), H.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)


# ---------------------------------------------------------------- §6–7: intra contractions

def intra_scalar_gate(H_lt: torch.Tensor, D: torch.Tensor, ch: Chunk):
    """No gate / scalar gate (§6.1–6.2): Γ_q = H_< ⊙ Λ, Γ_r = D ⊙ Λ with the n×n scalar decay matrix
    (never split into exp(G_i)·exp(−G_j)); four products A_Q = Γ_q K, B_Q = Γ_qᵀ sQ, A_K = Γ_r K,
    B_K = Γ_rᵀ (e⊙K). Returns X_q = A_Q (scale not applied), X_e = A_K, X_y = B_Q + B_K."""
    lam = decay_matrix(ch.G)[..., 0]
    gamma_q = H_lt * lam
    gamma_r = D * lam
    X_q = gamma_q @ ch.K
    X_e = gamma_r @ ch.K
    X_y = gamma_q.transpose(-1, -2) @ (ch.scale * ch.Q) + gamma_r.transpose(-1, -2) @ (ch.e * ch.K)
    return X_q, X_e, X_y


def intra_centred(H_lt: torch.Tensor, D: torch.Tensor, ch: Chunk):
    """Vector gate, centred whole-chunk products (§6.3): Λ_ijk = α_ik ζ_jk with c_k the mid-range of the
    chunk's G_k, so |exponent| ≤ Δ_k/2. Overflows (then 0·∞ = NaN on the masked entries) once Δ_k/2 exceeds
    the exponent range: callers go through the guard in :func:`intra_vector_gate`."""
    G = ch.G
    c = (G.amax(2, keepdim=True) + G.amin(2, keepdim=True)) / 2
    alpha = (G - c).exp()
    zeta = (c - G).exp()
    Q_tilde = ch.scale * ch.Q * alpha
    E_tilde = ch.e * ch.K * alpha
    Y_tilde = ch.K * zeta
    U_q = H_lt @ Y_tilde
    U_e = D @ Y_tilde
    U_y = H_lt.transpose(-1, -2) @ Q_tilde + D.transpose(-1, -2) @ E_tilde
    return alpha * U_q, alpha * U_e, zeta * U_y


def intra_subchunk(H_lt: torch.Tensor, D: torch.Tensor, ch: Chunk, block: int = SUBCHUNK_ROWS):
    """Vector gate fallback (§7, FLA chunk_kda_bwd_intra's structure): row blocks of ``block`` rows.
    Off-diagonal blocks are anchored at a block boundary so that, for g ≤ 0, every exponent is ≤ 0;
    diagonal blocks use the exact pairwise Λ."""
    G, K = ch.G, ch.K
    sQ = ch.scale * ch.Q
    eK = ch.e * K
    n = G.shape[2]
    X_q, X_e, X_y = torch.zeros_like(K), torch.zeros_like(K), torch.zeros_like(K)
    for a in range(0, n, block):
        b = min(a + block, n)
        I = slice(a, b)
        lam = decay_matrix(G[:, :, I])  # [B,H,m,m,K], exact within the block
        X_q[:, :, I] += torch.einsum("bhij,bhjk,bhijk->bhik", H_lt[:, :, I, I], K[:, :, I], lam)
        X_e[:, :, I] += torch.einsum("bhij,bhjk,bhijk->bhik", D[:, :, I, I], K[:, :, I], lam)
        X_y[:, :, I] += torch.einsum("bhij,bhik,bhijk->bhjk", H_lt[:, :, I, I], sQ[:, :, I], lam)
        X_y[:, :, I] += torch.einsum("bhij,bhik,bhijk->bhjk", D[:, :, I, I], eK[:, :, I], lam)
        if a > 0:  # row side: columns before the block, anchored at the block's first row
            c = G[:, :, a:a + 1]
            alpha = (G[:, :, I] - c).exp()
            Y = K[:, :, :a] * (c - G[:, :, :a]).exp()
            X_q[:, :, I] += alpha * (H_lt[:, :, I, :a] @ Y)
            X_e[:, :, I] += alpha * (D[:, :, I, :a] @ Y)
        if b < n:  # column side: rows after the block, anchored at the block's last row
            c = G[:, :, b - 1:b]
            alpha = (G[:, :, b:] - c).exp()
            zeta = (c - G[:, :, I]).exp()
            X_y[:, :, I] += zeta * (H_lt[:, :, b:, I].transpose(-1, -2) @ (sQ[:, :, b:] * alpha)
                                    + D[:, :, b:, I].transpose(-1, -2) @ (eK[:, :, b:] * alpha))
    return X_q, X_e, X_y


def centred_is_safe(G: torch.Tensor, tile_k: int, max_range: float = CENTRED_MAX_RANGE) -> torch.Tensor:
    """Range guard (§7): per chunk × (batch, head) × feature tile, Δ_tile = max_{k∈tile}(max_i G_ik − min_i G_ik)
    must be ≤ max_range. Returns a bool mask ``[B,H,1,K]`` constant over each tile."""
    delta = G.amax(2, keepdim=True) - G.amin(2, keepdim=True)
    safe = torch.empty_like(delta, dtype=torch.bool)
    for t0 in range(0, G.shape[-1], tile_k):
        tile = slice(t0, t0 + tile_k)
        safe[..., tile] = delta[..., tile].amax(-1, keepdim=True) <= max_range
    return safe


def intra_vector_gate(H_lt, D, ch: Chunk, *, mode: str, tile_k: int, counts: dict):
    """Vector-gate intra with the guarded dispatch. mode "auto" picks per tile (centred when safe, else
    subchunk); "centred" / "subchunk" force one path (tests). All paths give the same X (§7), so the
    chain rule downstream never knows which one ran."""
    B, H, _, K = ch.K.shape
    n_tiles = -(-K // tile_k)
    if mode == "auto":
        safe = centred_is_safe(ch.G, tile_k)
    else:
        safe = torch.full((B, H, 1, K), mode == "centred", dtype=torch.bool, device=ch.K.device)
    n_centred = int(safe[..., ::tile_k].sum())
    counts["centred"] += n_centred
    counts["subchunk"] += B * H * n_tiles - n_centred
    if bool(safe.all()):
        return intra_centred(H_lt, D, ch)
    if not bool(safe.any()):
        return intra_subchunk(H_lt, D, ch)
    # Mixed tiles: select per tile; the discarded centred values may be inf/NaN, torch.where drops them.
    centred, sub = intra_centred(H_lt, D, ch), intra_subchunk(H_lt, D, ch)
    return tuple(torch.where(safe, x_c, x_s) for x_c, x_s in zip(centred, sub))


# ---------------------------------------------------------------- §6: chain rule

def consumer(ch: Chunk, P, Ebar_dir, h, Qbar_g, Kbar_t, S0, dS1, X_q, X_e, X_y):
    """Assemble per-chunk gradients (§6.1–6.4), every term per key channel:

        dq = s γ⊙Q̄_g + s X_q + s h⊙K                (h⊙: self-term split)
        dk = e γ⊙Ē_dir + e X_e + X_y + τ⊙K̄_t + s h⊙Q
        dv = ω⊙P,  d_erase = K⊙(γ⊙Ē_dir + X_e),  d_write = V⊙P       (undivided, valid at β = 0)
        Ḡ  = Q_g⊙Q̄_g + sQ⊙X_q + E⊙Ē_dir + eK⊙X_e − K⊙X_y − K_t⊙K̄_t   (row n of the tail term dropped)
        Ḡ_n += Σ_{j<n} (K_t⊙K̄_t)_j + γ_n ⊙ rowsum_V(S0 ⊙ dS1)

    Returns per-channel tensors; the caller reduces d_erase, d_write, Ḡ to the inputs' shapes."""
    s, gamma = ch.scale, ch.gamma
    dq = s * gamma * Qbar_g + s * X_q + s * h * ch.K
    dk = ch.e * gamma * Ebar_dir + ch.e * X_e + X_y + ch.tau * Kbar_t + s * h * ch.Q
    dv = ch.w * P
    d_erase = ch.K * (gamma * Ebar_dir + X_e)
    d_write = ch.V * P
    # The last row's tail term has τ_n = 1 and cancels against its copy in Ḡ_n: drop both (§8.2).
    tail = ch.Kt * Kbar_t
    tail[:, :, -1] = 0
    Gbar = ch.Qg * Qbar_g + s * ch.Q * X_q + ch.E * Ebar_dir + ch.e * ch.K * X_e - ch.K * X_y - tail
    Gbar[:, :, -1] += tail.sum(2) + ch.gamma_n[..., 0] * (S0 * dS1).sum(-1)
    return dq, dk, dv, d_erase, d_write, Gbar


def reverse_chunk_cumsum(Gbar: torch.Tensor) -> torch.Tensor:
    """dg_i = Σ_{t=i}^{n} Ḡ_t inside the chunk (FLA chunk_local_cumsum(reverse=True))."""
    return Gbar.flip(2).cumsum(2).flip(2)


def reduce_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """Sum a per-channel gradient over the feature axis when the input was a per-token scalar (width 1)."""
    return x.sum(-1, keepdim=True) if width == 1 else x


# ---------------------------------------------------------------- top level

def rewy_backward(q, k, v, g, erase, write, fwd: ChunkForward, do, dht, *, scale=None, initial_state=None,
                  chunk_size=64, policy="R", intra="auto", tile_k=32) -> RewyGrads:
    """ReWY backward of :func:`chunk_forward`. ``do``: ``[B,T,H,V]`` (None = zero); ``dht``: gradient of the
    final state ``[B,H,K,V]`` (None = zero). policy "R" recomputes S0, R from fwd.A; "A" reads fwd.S0, fwd.R
    (W = AE is formed in both: the scan uses −WᵀR̄). intra: "auto" | "centred" | "subchunk" (vector gates).
    tile_k: feature-tile width of the range guard."""
    if policy not in ("R", "A"):
        raise ValueError(f"policy must be 'R' or 'A', got {policy!r}")
    if intra not in ("auto", "centred", "subchunk"):
        raise ValueError(f"intra must be 'auto', 'centred' or 'subchunk', got {intra!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    tile_k = min(tile_k, K)
    wd = working_dtype(q.dtype)
    slices = chunk_slices(T, chunk_size)

    Q, Kh, Vh = to_heads(q, wd), to_heads(k, wd), to_heads(v, wd)
    e, w = to_heads(erase, wd), to_heads(write, wd)
    G = to_heads(fwd.G, wd) if g is not None else Q.new_zeros(B, H, T, 1)
    A_heads = to_heads(fwd.A, wd)
    dO_heads = Q.new_zeros(B, H, T, V) if do is None else to_heads(do, wd)
    dht = Q.new_zeros(B, H, K, V) if dht is None else dht.to(wd)
    h0 = Q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(wd)

    chunks = [Chunk(Q[:, :, sl], Kh[:, :, sl], Vh[:, :, sl], e[:, :, sl], w[:, :, sl], G[:, :, sl], scale)
              for sl in slices]
    A = [A_heads[:, :, sl, : sl.stop - sl.start] for sl in slices]
    dO = [dO_heads[:, :, sl] for sl in slices]

    if policy == "R":
        W, R, S0 = recompute_states(chunks, A, h0)
    else:
        W = [Ac @ ch.E for ch, Ac in zip(chunks, A)]
        R_heads = to_heads(fwd.R, wd)
        R = [R_heads[:, :, sl] for sl in slices]
        S0 = [fwd.S0[:, c].to(wd) for c in range(len(slices))]

    Rbar, dS1, dh0 = reverse_state_scan(chunks, W, dO, dht)

    counts = {"centred": 0, "subchunk": 0}
    parts = {name: [] for name in ("dq", "dk", "dv", "de", "dw", "dg")}
    for c, ch in enumerate(chunks):
        P, D, Ebar_dir = producer(A[c], Rbar[c], R[c], S0[c])
        H_full, Qbar_g, Kbar_t = shared_adjoints(dO[c], R[c], S0[c], dS1[c])
        H_lt, h = split_self_term(H_full)
        if ch.G.shape[-1] == 1:
            X = intra_scalar_gate(H_lt, D, ch)
        else:
            X = intra_vector_gate(H_lt, D, ch, mode=intra, tile_k=tile_k, counts=counts)
        dq, dk, dv, de, dw, Gbar = consumer(ch, P, Ebar_dir, h, Qbar_g, Kbar_t, S0[c], dS1[c], *X)
        parts["dq"].append(dq)
        parts["dk"].append(dk)
        parts["dv"].append(dv)
        parts["de"].append(reduce_to(de, e.shape[-1]))
        parts["dw"].append(reduce_to(dw, w.shape[-1]))
        parts["dg"].append(reverse_chunk_cumsum(reduce_to(Gbar, G.shape[-1])))

    def out(name, like):
        return from_heads(torch.cat(parts[name], dim=2), like)

    return RewyGrads(
        dq=out("dq", q),
        dk=out("dk", k),
        dv=out("dv", v),
        dg=out("dg", g) if g is not None else None,
        d_erase=out("de", erase),
        d_write=out("dw", write),
        dh0=dh0.to(initial_state.dtype) if initial_state is not None else None,
        intra_paths=counts,
    )
