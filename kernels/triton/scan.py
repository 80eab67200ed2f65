"""Serial state scans of the ReWY backward (rewy-math §3 forward recompute, §4 reverse scan).

Forward (policy R), per chunk:   R = U − W S0,   S1 = Γ_n S0 + K_tᵀ R            (K_t = K ⊙ τ)
Reverse, per chunk (c = N..1):   R̄ = dv_local + K_t dS1,   dS0 = Γ_n dS1 + Q_gᵀ dO − Wᵀ R̄   (Q_g = s Q ⊙ γ)

State tile. One program owns all K rows of a BV-wide column slice of the state ([BK ≥ K] × BV, fp32 in
registers). Columns of the state are independent in both scans, so the V split is free. A K split is not:
R = U − W S0 and R̄ = dv_local + K_t dS1 contract over all K rows every chunk, so K-slices would have to exchange
partial sums every step (a grid-wide barrier per chunk, or atomics) or recompute the other slices (which is
the unsplit scan). The scans therefore take BK ≥ K, and extra parallelism at small B·H comes from the V split
(BV down to 16) and from splitting the sequence (num_segments).

Sequence split (num_segments = NS > 1). Both chunk maps are affine in the carried state,
    forward   S1  = (Γ_n − K_tᵀW) S0  + K_tᵀU
    reverse   dS0 = (Γ_n − WᵀK_t) dS1 + (Q_gᵀdO − Wᵀdv_local),
and act on each state column independently. Phase 1 (parallel over segments): each segment scans from a
zero state to get its bias b_s, and from the K identity columns with the bias terms dropped to get its K×K
transfer matrix Ψ_s; both are plain columns of one augmented scan of width V + K, run by the same kernel.
Phase 2 (serial over segments, NS small steps): entering states X_{s+1} = Ψ_s X_s + b_s (reverse: from the
end). Phase 3 (parallel over segments): the ordinary scan of each segment from its true entering state,
storing the outputs. Latency ≈ 2·NT/NS chunk steps + NS small steps instead of NT steps, for ≈ (2 + K/V)×
the scan's FLOPs. Exact in exact arithmetic; in floating point it re-associates the state recursion
(Ψ_s products are contractions for |β k|² ≤ 2 and g ≤ 0, so errors do not grow).

Transposed operands (K_tᵀ, Wᵀ, Q_gᵀ) are loaded transposed from memory, never made with tl.trans in
registers (Triton 3.6 on Hopper miscompiles tl.trans of wgmma-layout values; FLA issue 640).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .recompute import dot_precision, mm, gate_kind, validate_chunk_size, validate_launch, validate_tile


@triton.jit(do_not_specialize=["T", "NT", "CPS", "SEG_OFFSET"])
def rewy_fwd_scan_kernel(
    k, W, U, G, h_in, Hs, R, X,
    T, NT, CPS, SEG_OFFSET,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, NS: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, PHASE: tl.constexpr, USE_H_IN: tl.constexpr, PREC: tl.constexpr,
):
    # PHASE 0: scan chunks of segment s from the entering state h_in[bh, s] (or zero), storing S0 and R.
    # PHASE 1: augmented transfer scan of segment s (columns < V: bias from zero; VP + j: identity column j),
    #          storing only the segment's end state into X[bh, s].
    i_c, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2) + SEG_OFFSET
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    cols = i_c * BV + tl.arange(0, BV)
    is_bias = cols < V
    dt = k.dtype.element_ty

    if PHASE == 0:
        m_st = m_k[:, None] & is_bias[None, :]
        if USE_H_IN:
            p_in = h_in + (i_bh * NS + i_s) * K * V + o_k[:, None] * V + cols[None, :]
            b_s = tl.load(p_in, mask=m_st, other=0.0).to(tl.float32)
        else:
            b_s = tl.zeros([BK, BV], dtype=tl.float32)
    else:
        id_col = cols - VP
        is_id = (cols >= VP) & (id_col < K)
        b_s = tl.where(is_id[None, :] & (o_k[:, None] == id_col[None, :]), 1.0, 0.0).to(tl.float32)

    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NT)
    for i_t in range(c0, c1):
        rows = i_t * BT + tl.arange(0, BT)
        m_row = rows < T
        tok = (i_b * T + rows) * H + i_h
        tok_last = (i_b * T + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
        if PHASE == 0:
            p_h = Hs + ((i_b * NT + i_t) * H + i_h) * K * V + o_k[:, None] * V + cols[None, :]
            tl.store(p_h, b_s.to(Hs.dtype.element_ty), mask=m_st)
        m_rk = m_row[:, None] & m_k[None, :]
        m_rv = m_row[:, None] & is_bias[None, :]
        b_w = tl.load(W + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0)
        b_u = tl.load(U + tok[:, None] * V + cols[None, :], mask=m_rv, other=0.0).to(tl.float32)
        b_r = b_u - mm(b_w, b_s.to(dt), PREC)
        if PHASE == 0:
            tl.store(R + tok[:, None] * V + cols[None, :], b_r.to(R.dtype.element_ty), mask=m_rv)
        # K_tᵀ is loaded transposed ([BK, BT]) rather than transposed in registers (see module docstring).
        m_kr = m_k[:, None] & m_row[None, :]
        b_ktt = tl.load(k + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0).to(tl.float32)
        if GATE == 1:
            b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
            b_gl = tl.load(G + tok_last).to(tl.float32)
            # rows past T: mask the decay itself, exp(G_n − 0) may overflow and 0·inf is NaN.
            b_ktt = b_ktt * tl.where(m_row, tl.exp(b_gl - b_g), 0.0)[None, :]
            b_s = b_s * tl.exp(b_gl)
        elif GATE == 2:
            b_g = tl.load(G + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0).to(tl.float32)
            b_gl = tl.load(G + tok_last * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_ktt = b_ktt * tl.where(m_kr, tl.exp(b_gl[:, None] - b_g), 0.0)
            b_s = b_s * tl.exp(b_gl)[:, None]
        b_s += mm(b_ktt.to(dt), b_r.to(dt), PREC)

    if PHASE == 1:
        XW: tl.constexpr = VP + K
        m_x = m_k[:, None] & (is_bias | is_id)[None, :]
        tl.store(X + (i_bh * NS + i_s) * K * XW + o_k[:, None] * XW + cols[None, :], b_s, mask=m_x)


@triton.jit(do_not_specialize=["T", "NT", "CPS", "SEG_OFFSET"])
def rewy_bwd_scan_kernel(
    q, k, W, G, do, dvl, dh_in, dS1, Rbar, dh0, X,
    scale, T, NT, CPS, SEG_OFFSET,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, NS: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, PHASE: tl.constexpr, USE_DH_IN: tl.constexpr, HAS_DVL: tl.constexpr,
    STORE_DH0: tl.constexpr, PREC: tl.constexpr,
):
    # PHASE 0: reverse scan of segment s from dh_in[bh, s] (gradient at the segment's end; zero if absent),
    #          storing dS1 per chunk, R̄, and dh0 for segment 0.
    # PHASE 1: augmented transfer scan (bias columns from zero, identity columns without bias terms);
    #          stores the gradient at the segment's start into X[bh, s].
    i_c, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2) + SEG_OFFSET
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    cols = i_c * BV + tl.arange(0, BV)
    is_bias = cols < V
    dt = k.dtype.element_ty

    if PHASE == 0:
        m_st = m_k[:, None] & is_bias[None, :]
        if USE_DH_IN:
            p_in = dh_in + (i_bh * NS + i_s) * K * V + o_k[:, None] * V + cols[None, :]
            b_ds = tl.load(p_in, mask=m_st, other=0.0).to(tl.float32)
        else:
            b_ds = tl.zeros([BK, BV], dtype=tl.float32)
    else:
        id_col = cols - VP
        is_id = (cols >= VP) & (id_col < K)
        b_ds = tl.where(is_id[None, :] & (o_k[:, None] == id_col[None, :]), 1.0, 0.0).to(tl.float32)

    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NT)
    for i_r in range(0, c1 - c0):
        i_t = c1 - 1 - i_r
        rows = i_t * BT + tl.arange(0, BT)
        m_row = rows < T
        tok = (i_b * T + rows) * H + i_h
        tok_last = (i_b * T + tl.minimum(i_t * BT + BT, T) - 1) * H + i_h
        if PHASE == 0:
            p_d = dS1 + ((i_b * NT + i_t) * H + i_h) * K * V + o_k[:, None] * V + cols[None, :]
            tl.store(p_d, b_ds.to(dS1.dtype.element_ty), mask=m_st)
        m_rk = m_row[:, None] & m_k[None, :]
        m_rv = m_row[:, None] & is_bias[None, :]
        # Wᵀ and Q_gᵀ are loaded transposed ([BK, BT]) rather than transposed in registers.
        m_kr = m_k[:, None] & m_row[None, :]
        b_kt = tl.load(k + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        b_wt = tl.load(W + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0)
        b_qgt = tl.load(q + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0).to(tl.float32) * scale
        b_do = tl.load(do + tok[:, None] * V + cols[None, :], mask=m_rv, other=0.0)
        if GATE == 1:
            b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
            b_gl = tl.load(G + tok_last).to(tl.float32)
            # rows past T: mask the decay itself, exp(G_n − 0) may overflow and 0·inf is NaN.
            b_kt = b_kt * tl.where(m_row, tl.exp(b_gl - b_g), 0.0)[:, None]
            b_qgt = b_qgt * tl.exp(b_g)[None, :]
        elif GATE == 2:
            b_g = tl.load(G + tok[:, None] * K + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
            b_gl = tl.load(G + tok_last * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_kt = b_kt * tl.where(m_rk, tl.exp(b_gl[None, :] - b_g), 0.0)
            b_gt = tl.load(G + tok[None, :] * K + o_k[:, None], mask=m_kr, other=0.0).to(tl.float32)
            b_qgt = b_qgt * tl.exp(b_gt)
        b_rb = mm(b_kt.to(dt), b_ds.to(dt), PREC)
        if HAS_DVL:
            b_rb += tl.load(dvl + tok[:, None] * V + cols[None, :], mask=m_rv, other=0.0).to(tl.float32)
        if PHASE == 0:
            tl.store(Rbar + tok[:, None] * V + cols[None, :], b_rb.to(Rbar.dtype.element_ty), mask=m_rv)
        if GATE == 1:
            b_ds = b_ds * tl.exp(b_gl)
        elif GATE == 2:
            b_ds = b_ds * tl.exp(b_gl)[:, None]
        b_ds += mm(b_qgt.to(dt), b_do.to(dt), PREC)
        b_ds -= mm(b_wt, b_rb.to(dt), PREC)

    if PHASE == 0:
        if STORE_DH0:
            if i_s == 0:
                tl.store(dh0 + i_bh * K * V + o_k[:, None] * V + cols[None, :], b_ds, mask=m_st)
    else:
        XW: tl.constexpr = VP + K
        m_x = m_k[:, None] & (is_bias | is_id)[None, :]
        tl.store(X + (i_bh * NS + i_s) * K * XW + o_k[:, None] * XW + cols[None, :], b_ds, mask=m_x)


@triton.jit
def rewy_segment_combine_kernel(
    X, h_first, h_in,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, NS: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_FIRST: tl.constexpr, REVERSE: tl.constexpr, PREC: tl.constexpr,
):
    # Serial over segments: entering state of each segment from its neighbour's transfer matrix and bias.
    # forward: h_in[0] = h0,  h_in[s+1] = Ψ_s h_in[s] + b_s;  reverse: h_in[NS-1] = dht, h_in[s-1] = Φ_s h_in[s] + b_s.
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    XW: tl.constexpr = VP + K
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    cols = i_c * BV + tl.arange(0, BV)
    m_st = m_k[:, None] & (cols < V)[None, :]
    if USE_FIRST:
        b_x = tl.load(h_first + i_bh * K * V + o_k[:, None] * V + cols[None, :], mask=m_st, other=0.0).to(tl.float32)
    else:
        b_x = tl.zeros([BK, BV], dtype=tl.float32)
    s_first = NS - 1 if REVERSE else 0
    tl.store(h_in + (i_bh * NS + s_first) * K * V + o_k[:, None] * V + cols[None, :], b_x, mask=m_st)
    for i in range(0, NS - 1):
        if REVERSE:
            s_src = NS - 1 - i
            s_dst = s_src - 1
        else:
            s_src = i
            s_dst = i + 1
        p_x = X + (i_bh * NS + s_src) * K * XW + o_k[:, None] * XW
        b_t = tl.load(p_x + VP + o_k[None, :], mask=m_k[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_x + cols[None, :], mask=m_st, other=0.0)
        b_x = mm(b_t, b_x, PREC) + b_b
        tl.store(h_in + (i_bh * NS + s_dst) * K * V + o_k[:, None] * V + cols[None, :], b_x, mask=m_st)


def _check_scan_args(K, V, chunk_size, BK, BV, num_warps, num_stages, state_dtype, num_segments, dtype):
    validate_chunk_size(chunk_size)
    validate_tile("BK", BK, hi=256, covers=K)
    validate_tile("BV", BV, hi=256)
    validate_launch(num_warps, num_stages)
    if state_dtype not in (torch.float32, dtype):
        raise ValueError(f"state_dtype must be torch.float32 or the input dtype {dtype}, got {state_dtype}")
    if not isinstance(num_segments, int) or num_segments < 1:
        raise ValueError(f"num_segments must be a positive int, got {num_segments!r}")


def _segments(NT: int, num_segments: int) -> tuple[int, int]:
    """(segments actually used, chunks per segment); never leaves a segment empty."""
    cps = triton.cdiv(NT, min(num_segments, NT))
    return triton.cdiv(NT, cps), cps


def forward_state_scan(
    k: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    G: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    *,
    chunk_size: int = 64,
    BK: int = 128,
    BV: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    state_dtype: torch.dtype = torch.float32,
    num_segments: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy-R forward state pass. Returns (S0 per chunk [B,NT,H,K,V] in state_dtype, R [B,T,H,V] in k's dtype).

    k, W [B,T,H,K]; U [B,T,H,V]; G None | [B,T,H] | [B,T,H,K] (fp32, natural log, chunk-local cumsum);
    initial_state None | [B,H,K,V]. Grid: cdiv(V,BV) × B·H × num_segments programs (see the module docstring).
    """
    B, T, H, K = k.shape
    V = U.shape[-1]
    _check_scan_args(K, V, chunk_size, BK, BV, num_warps, num_stages, state_dtype, num_segments, k.dtype)
    if tuple(W.shape) != (B, T, H, K) or tuple(U.shape[:3]) != (B, T, H):
        raise ValueError(f"W must be {(B, T, H, K)} and U [B,T,H,V]; got {tuple(W.shape)}, {tuple(U.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ValueError(f"initial_state must have shape {(B, H, K, V)}, got {tuple(initial_state.shape)}")
    gk = gate_kind(G, k)
    k, W, U = k.contiguous(), W.contiguous(), U.contiguous()
    G = G.contiguous() if G is not None else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    NT = triton.cdiv(T, chunk_size)
    NS, CPS = _segments(NT, num_segments)
    NV = triton.cdiv(V, BV)
    VP = NV * BV
    prec = dot_precision(k.dtype)
    Hs = torch.empty(B, NT, H, K, V, dtype=state_dtype, device=k.device)
    R = torch.empty(B, T, H, V, dtype=k.dtype, device=k.device)
    common = dict(H=H, K=K, V=V, VP=VP, BT=chunk_size, BK=BK, BV=BV, GATE=gk, PREC=prec,
                  num_warps=num_warps, num_stages=num_stages)
    h_in = h0
    if NS > 1:
        X = torch.empty(B * H, NS, K, VP + K, dtype=torch.float32, device=k.device)
        grid1 = (triton.cdiv(VP + K, BV), B * H, NS - 1)  # the last segment's transfer is never used
        rewy_fwd_scan_kernel[grid1](k, W, U, G, None, Hs, R, X, T, NT, CPS, 0, NS=NS, PHASE=1, USE_H_IN=False,
                                    **common)
        h_in = torch.empty(B * H, NS, K, V, dtype=torch.float32, device=k.device)
        rewy_segment_combine_kernel[(NV, B * H)](
            X, h0, h_in, H=H, K=K, V=V, VP=VP, NS=NS, BK=BK, BV=BV, USE_FIRST=h0 is not None, REVERSE=False,
            PREC=prec, num_warps=num_warps)
    rewy_fwd_scan_kernel[(NV, B * H, NS)](k, W, U, G, h_in, Hs, R, None, T, NT, CPS, 0, NS=NS, PHASE=0,
                                          USE_H_IN=h_in is not None, **common)
    return Hs, R


def reverse_state_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    W: torch.Tensor,
    G: torch.Tensor | None,
    do: torch.Tensor,
    dv_local: torch.Tensor | None,
    dht: torch.Tensor | None,
    *,
    scale: float,
    chunk_size: int = 64,
    BK: int = 128,
    BV: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    state_dtype: torch.dtype = torch.float32,
    want_dh0: bool = True,
    num_segments: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reverse state scan (§4). Returns (dS1 per chunk [B,NT,H,K,V] in state_dtype, R̄ [B,T,H,V] in do's dtype,
    dh0 [B,H,K,V] fp32 or None when want_dh0 is False).

    q, k, W [B,T,H,K]; do, dv_local [B,T,H,V] (dv_local None means zero); dht None | [B,H,K,V].
    """
    B, T, H, K = k.shape
    V = do.shape[-1]
    _check_scan_args(K, V, chunk_size, BK, BV, num_warps, num_stages, state_dtype, num_segments, k.dtype)
    for name, x in (("q", q), ("W", W)):
        if tuple(x.shape) != (B, T, H, K):
            raise ValueError(f"{name} must have shape {(B, T, H, K)}, got {tuple(x.shape)}")
    if tuple(do.shape[:3]) != (B, T, H) or (dv_local is not None and dv_local.shape != do.shape):
        raise ValueError("do and dv_local must have shape [B,T,H,V] matching q/k")
    if dht is not None and tuple(dht.shape) != (B, H, K, V):
        raise ValueError(f"dht must have shape {(B, H, K, V)}, got {tuple(dht.shape)}")
    gk = gate_kind(G, k)
    q, k, W, do = q.contiguous(), k.contiguous(), W.contiguous(), do.contiguous()
    G = G.contiguous() if G is not None else None
    dvl = dv_local.contiguous() if dv_local is not None else None
    dht = dht.contiguous() if dht is not None else None
    NT = triton.cdiv(T, chunk_size)
    NS, CPS = _segments(NT, num_segments)
    NV = triton.cdiv(V, BV)
    VP = NV * BV
    prec = dot_precision(k.dtype)
    dS1 = torch.empty(B, NT, H, K, V, dtype=state_dtype, device=k.device)
    Rbar = torch.empty(B, T, H, V, dtype=do.dtype, device=k.device)
    dh0 = torch.empty(B, H, K, V, dtype=torch.float32, device=k.device) if want_dh0 else None
    common = dict(H=H, K=K, V=V, VP=VP, BT=chunk_size, BK=BK, BV=BV, GATE=gk, HAS_DVL=dvl is not None,
                  PREC=prec, num_warps=num_warps, num_stages=num_stages)
    dh_in = dht
    if NS > 1:
        X = torch.empty(B * H, NS, K, VP + K, dtype=torch.float32, device=k.device)
        grid1 = (triton.cdiv(VP + K, BV), B * H, NS - 1)  # segment 0's transfer is never used
        rewy_bwd_scan_kernel[grid1](q, k, W, G, do, dvl, None, dS1, Rbar, dh0, X, scale, T, NT, CPS, 1, NS=NS,
                                    PHASE=1, USE_DH_IN=False, STORE_DH0=False, **common)
        dh_in = torch.empty(B * H, NS, K, V, dtype=torch.float32, device=k.device)
        rewy_segment_combine_kernel[(NV, B * H)](
            X, dht, dh_in, H=H, K=K, V=V, VP=VP, NS=NS, BK=BK, BV=BV, USE_FIRST=dht is not None, REVERSE=True,
            PREC=prec, num_warps=num_warps)
    rewy_bwd_scan_kernel[(NV, B * H, NS)](q, k, W, G, do, dvl, dh_in, dS1, Rbar, dh0, None, scale, T, NT, CPS, 0,
                                          NS=NS, PHASE=0, USE_DH_IN=dh_in is not None, STORE_DH0=want_dh0,
                                          **common)
    return dS1, Rbar, dh0
