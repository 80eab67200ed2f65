"""Local (per-chunk, all chunks in parallel) stages of the ReWY backward for no gate / scalar gate
(DeltaNet, GDN): rewy-math §§4–6.2.

- ``dv_local``  : dv_local = A_qkᵀ dO, A_qk = L_≤(s Q Kᵀ ⊙ Λ) recomputed from q, k, G (input of the reverse scan).
- ``producer``  : P = Aᵀ R̄ and D = −L_<(P Rᵀ) written to memory (the "separate" consumer mode).
- ``consumer``  : H = L_≤(dO Rᵀ) (self-term split), Q̄_g = dO S0ᵀ, K̄_t = R dS1ᵀ, Ē_dir = −P S0ᵀ and the four
                  intra products with Gram elimination → dq, dk, dv = ω⊙P, d_erase, d_write, Ḡ (per token,
                  before the reverse cumsum). ``joint=True`` fuses the producer (P, D never leave the chip).
                  Two phases: (1) one V loop for the n×n products H, D (and dv, d_write, ⟨dO, R⟩), then
                  Γ_q, Γ_r; (2) a run-time loop over K tiles, each a V loop for the three [C, BK] products
                  followed by the dq / dk epilogue. Only the n×n or only the [C, BK] accumulators are live at once.

Layout: q, k [B,T,H,K]; v, do, R, R̄ [B,T,H,V]; A [B,T,H,C]; G, erase, write [B,T,H]; per-chunk states
S0, dS1 [B,NT,H,K,V]. One program per (chunk, batch·head); K and V are walked in block_k / block_v tiles.

Transposes (FLA issue 640, fla-baseline §12.1): Triton 3.6.0 on Hopper miscompiles ``tl.trans`` of a
wgmma-layout accumulator. No kernel here transposes a ``tl.dot`` result in registers. Every transposed
operand is either loaded transposed from memory (Aᵀ, Qᵀ, Kᵀ, Rᵀ, S0ᵀ, dS1ᵀ) or avoided by computing the
transposed product instead (B_Qᵀ = Qᵀ Γ_q, B_Kᵀ = (eK)ᵀ Γ_r). The column-side part of dk, produced as a
[BK, C] tile, is turned into rows through global memory (a transposed store into an fp32 scratch, a CTA
barrier, a row load), never through ``tl.trans``.
"""

# Caveat (session 12): every figure below came from a compile without the 16-byte alignment hints that a GPU launch
# specializes on (benchmarks/compile_times.py lacked them until then). With them the joint consumer at the default
# compiles to 3 064 instructions, 8 B of stack and 108 544 B of shared memory. The spill story told here is an
# artifact of that compile; the timings quoted are real.
#
# Consumer registers / spills / shared memory, compiled ahead of time for sm_90a (Triton 3.6.0 + its ptxas, no
# GPU; `ptxas -v` on the kernel's PTX) at the cc-9.0 default schedule: bf16, K = V = 128, chunk 64, consumer
# block_k = block_v = 64, 8 warps, 2 stages, scalar gate. Stack = ptxas stack frame per thread; spill = bytes
# of spill stores / loads in the code (static). Speed not measured here (H200 only).
#
# | consumer kernel                          | regs | stack B | spill st / ld B | shared B |
# |------------------------------------------|------|---------|-----------------|----------|
# | joint, before (one K×V loop, static K)   | 255  | 1736    | 2780 / 4080     | 73728    |
# | joint, after (n×n phase + run-time K)    | 255  | 1000    | 1312 / 1592     | 98304    |
# | separate, before                         | 255  | 1824    | 3680 / 5048     | 90112    |
# | separate, after                          | 255  | 1064    | 1444 / 1816     | 106496   |
# | joint, after, 4 warps                    | 255  | 2792    | 5804 / 7744     | 81920    |
# | joint, after, num_stages 1               | 255  |  848    | 1156 / 1416     | 65536    |
# | joint, session 10: 4 epilogue row sums   | 255  |  976    |                 | 74752    |
#
# Session 10 (`compile_times.py --sass`): the epilogue's six per-token row sums became four (same products);
# SHFL 381 → 295, BAR 95 → 83, LDL/STL 446/352 → 378/299, 7 952 → 7 288 instructions. On the H200 (session 11)
# GDN's benchmark geomean went 1.018 → 1.053× FLA under R and 1.000 → 1.034× under A; its GPU gates pass.
# Session 11, tried and rejected: phase 1 writing P over R̄'s rows and phase 2 loading it instead of recomputing
# it per K tile (4 of 30 products fewer, no extra buffer). Stack 976 → 1 096 B, and the same speed within 0.6 %
# at every shape (GDN (2, 2048, 16) 0.4441 ms both ways): the consumer is bound by issuing instructions, not
# by its products (ncu, benchmarks/RESULTS.md session 11).
#
# Spills are reduced (−42 % stack), not removed. Tried and rejected (measured the same way): Γ_q/Γ_r and Aᵀ
# through a global scratch instead of registers (stack 1528 B: worse); without the ⟨S0, dS1⟩ sum 1024 B and
# without K̄_t or Ē_dir still ~800–970 B, so no single accumulator is the cause; the rest of the pressure
# is the per-K-tile epilogue (dq, dk rows, column side) next to the three [C, BK] accumulators.

from __future__ import annotations


import torch
import triton
import triton.language as tl

from rewy_tune.schedule import CONSUMER_K_SPLITS

# One definition of the dot precision rule (and its interpreter workaround) for every stage.
from .recompute import dot_precision
from .recompute import mm as _mma
from .scan import device_sms


# --------------------------------------------------------------------------------------------------
# dv_local = A_qkᵀ dO
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T", "H"])
def rewy_bwd_kernel_dv_local(
    q, k, G, do, dv,
    T, scale,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, PREC: tl.constexpr,
):
    i_t, i_b, i_h, t0, o_i, m_row, tok, _, _ = _chunk_prologue(T, H, BT, 0)
    DT = k.dtype.element_ty

    # A_qkᵀ[j, i] = s Σ_f k_jf q_if Λ_ij, formed directly as K Qᵀ with Qᵀ loaded transposed (no tl.trans).
    # Block pointers keep per-element 64-bit addresses out of registers.
    bos = (i_b * T * H + i_h).to(tl.int64)
    b_at = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, (K + BK - 1) // BK):
        p_k = tl.make_block_ptr(k + bos * K, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        p_qt = tl.make_block_ptr(q + bos * K, (K, T), (1, H * K), (i_k * BK, t0), (BK, BT), (0, 1))
        b_at += _mma(tl.load(p_k, boundary_check=(0, 1)), tl.load(p_qt, boundary_check=(0, 1)), PREC)
    # row index j, column index i; keep i ≥ j (mask before exponentiating)
    m_at = (o_i[:, None] <= o_i[None, :]) & m_row[:, None] & m_row[None, :]
    if USE_G:
        b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
        b_lam = tl.exp(tl.where(m_at, b_g[None, :] - b_g[:, None], 0.0))
        b_at = tl.where(m_at, b_at * b_lam * scale, 0.0)
    else:
        b_at = tl.where(m_at, b_at * scale, 0.0)
    b_at = b_at.to(DT)
    for i_v in range(0, (V + BV - 1) // BV):
        p_do = tl.make_block_ptr(do + bos * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv + bos * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_dv = _mma(b_at, tl.load(p_do, boundary_check=(0, 1)).to(DT), PREC)
        tl.store(p_dv, b_dv.to(p_dv.dtype.element_ty), boundary_check=(0, 1))


def _output_like(do: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A new tensor like do, or `out` when it is one (same shape, dtype, device, contiguous)."""
    if out is None:
        return torch.empty_like(do)
    if out.shape != do.shape or out.dtype != do.dtype or out.device != do.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(do.shape)} tensor in {do.dtype} on {do.device}, got "
                         f"{tuple(out.shape)} in {out.dtype} on {out.device} (contiguous: {out.is_contiguous()})")
    return out


def dv_local(q, k, G, do, *, scale: float, chunk_size: int = 64, BK: int = 64, BV: int = 64,
             num_warps: int = 4, num_stages: int = 2, out: torch.Tensor | None = None) -> torch.Tensor:
    """dv_local = A_qkᵀ dO per chunk, [B,T,H,V] in do's dtype. G None (DeltaNet) or [B,T,H] fp32 natural log.
    out: a contiguous buffer like do to write (the pipeline allocates it on its own stream, `run_stages`)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    _check_scalar_gate(G, (B, T, H))
    dv = _output_like(do, out)
    NT = triton.cdiv(T, chunk_size)
    rewy_bwd_kernel_dv_local[(NT, B * H)](
        q, k, G, do, dv, T, float(scale),
        H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, USE_G=G is not None, PREC=dot_precision(k.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return dv


# --------------------------------------------------------------------------------------------------
# Producer (separate mode): P = Aᵀ R̄, D = −L_<(P Rᵀ)
# --------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T", "H"])
def rewy_bwd_kernel_producer(
    A, Rbar, R, P, D,
    T,
    H, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_i = tl.arange(0, BT)
    rows = i_t * BT + o_i
    m_row = rows < T
    DT = R.dtype.element_ty
    t0 = i_t * BT
    bos = (i_b * T * H + i_h).to(tl.int64)
    # Aᵀ[j, i] = A[i, j], loaded transposed from memory, for j ≤ i only (A is unit lower triangular; do not
    # trust the buffer above it).
    p_at = tl.make_block_ptr(A + bos * BT, (BT, T), (1, H * BT), (0, t0), (BT, BT), (0, 1))
    b_at = tl.where(o_i[:, None] <= o_i[None, :], tl.load(p_at, boundary_check=(0, 1)), 0.0).to(DT)
    b_d = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, (V + BV - 1) // BV):
        p_rb = tl.make_block_ptr(Rbar + bos * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_p = tl.make_block_ptr(P + bos * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_rt = tl.make_block_ptr(R + bos * V, (V, T), (1, H * V), (i_v * BV, t0), (BV, BT), (0, 1))
        b_p = _mma(b_at, tl.load(p_rb, boundary_check=(0, 1)).to(DT), PREC)
        tl.store(p_p, b_p.to(p_p.dtype.element_ty), boundary_check=(0, 1))
        b_d += _mma(b_p.to(DT), tl.load(p_rt, boundary_check=(0, 1)).to(DT), PREC)
    m_lt = (o_i[:, None] > o_i[None, :]) & m_row[:, None] & m_row[None, :]
    b_d = tl.where(m_lt, -b_d, 0.0)
    p_d = tl.make_block_ptr(D + bos * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
    tl.store(p_d, b_d.to(p_d.dtype.element_ty), boundary_check=(0, 1))


def producer(A, Rbar, R, *, chunk_size: int = 64, BV: int = 64, num_warps: int = 4, num_stages: int = 2,
             pd_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """P = AᵀR̄ [B,T,H,V] and D = −L_<(P Rᵀ) [B,T,H,C] (FLA layout, zero outside the strict lower part)."""
    B, T, H, V = Rbar.shape
    P = torch.empty(B, T, H, V, dtype=pd_dtype, device=Rbar.device)
    D = torch.empty(B, T, H, chunk_size, dtype=pd_dtype, device=Rbar.device)
    NT = triton.cdiv(T, chunk_size)
    rewy_bwd_kernel_producer[(NT, B * H)](
        A, Rbar, R, P, D, T, H=H, V=V, BT=chunk_size, BV=BV, PREC=dot_precision(R.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return P, D


# --------------------------------------------------------------------------------------------------
# Consumer (joint or separate)
# --------------------------------------------------------------------------------------------------
# Row-level pieces shared by the two scalar consumers (this module's and consumer_tma.py's), which differ only in
# how tiles are loaded and stored. Triton inlines them: the pointer kernel's sm_90 code has the same instructions
# as before (opcode histogram; only register names, scheduling and commuted FMUL/FFMA operands differ). The chunk
# prologue serves vector_local.py's consumer and dv_local too.
@triton.jit
def _chunk_prologue(T, H, BT: tl.constexpr, c_off):
    """This program's chunk (program ids: chunk, batch·head): batch, head, first row t0, chunk-local rows o_i, their
    valid mask and token index [(b·T + t)·H + h], the number of valid rows and the last valid row (a tail chunk has
    fewer). Shared by all three consumers (scalar pointer, scalar descriptor, vector) and the dv_local kernels. In the
    vector consumer it only moves registers around: sm_90 stack KDA 176 → 168 B, GDN2 312 → 344 B (session 13, not
    timed). c_off: the first chunk of the launch's grid (joint_tma launched a chunk range at a time)."""
    return _chunk_rows(tl.program_id(0) + c_off, tl.program_id(1), T, H, BT)


@triton.jit
def _chunk_rows(i_t, i_bh, T, H, BT: tl.constexpr):
    """`_chunk_prologue`'s values for chunk i_t of batch·head i_bh."""
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    o_i = tl.arange(0, BT)
    rows = t0 + o_i
    m_row = rows < T
    tok = (i_b * T + rows) * H + i_h
    n_rows = tl.minimum(T - t0, BT)
    is_last = o_i == n_rows - 1
    return i_t, i_b, i_h, t0, o_i, m_row, tok, n_rows, is_last


# A consumer waiting for the reverse scan gives up after this many polls of its chunk's counter (seconds, where the
# scan takes at most milliseconds) and traps, so a scan that never publishes is an error, not a hang.
CHASE_MAX_POLLS = tl.constexpr(1 << 24)


@triton.jit
def _chased_chunk(NT, BH):
    """(chunk, batch·head) of this program where the consumer chases the reverse scan (`_wait_for_scan`): programs
    in launch order (program id 0 fastest, then 1) take the chunks from the last, which the scan finishes first,
    every head of a chunk before the chunk before it. The grid is (NT, B·H, programs per chunk)."""
    i_l = tl.program_id(0) + tl.program_id(1) * NT
    return NT - 1 - i_l // BH, i_l % BH


@triton.jit
def _wait_for_scan(progress, i_bh, i_t, NT, PROGRAMS: tl.constexpr, ON_GPU: tl.constexpr):
    """Wait until all PROGRAMS reverse-scan programs of head i_bh have published chunk i_t's dS1 and R̄
    (`scan.reverse_state_scan_ranges(progress=)`): acquire loads of its counter, then a CTA barrier, so every
    thread's later loads see the scan's stores. ON_GPU: the trap after CHASE_MAX_POLLS polls, and a proxy fence,
    since the tiles then come through TMA (the async proxy) and the counter through ordinary loads."""
    p_f = progress + i_bh * NT + i_t
    n = tl.atomic_add(p_f, 0, sem="acquire", scope="gpu")
    polls = 0
    while (n < PROGRAMS) & (polls < CHASE_MAX_POLLS):
        n = tl.atomic_add(p_f, 0, sem="acquire", scope="gpu")
        polls += 1
    if ON_GPU:
        if n < PROGRAMS:
            tl.inline_asm_elementwise("trap; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.debug_barrier()


@triton.jit
def _row_gates(G, tok, m_row, is_last, BT: tl.constexpr, USE_G: tl.constexpr):
    """Per row: G, its chunk-end value G_n (row n), γ = exp(G), τ = exp(G_n − G); zeros without a gate."""
    if USE_G:
        b_g = tl.load(G + tok, mask=m_row, other=0.0).to(tl.float32)
        b_gn = tl.sum(tl.where(is_last, b_g, 0.0), axis=0)
        b_gamma = tl.where(m_row, tl.exp(b_g), 0.0)
        b_tau = tl.where(m_row, tl.exp(b_gn - b_g), 0.0)
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
        b_gn = 0.0
        b_gamma = b_g
        b_tau = b_g
    return b_g, b_gn, b_gamma, b_tau


@triton.jit
def _gamma_matrices(b_H, b_D, b_g, m_lt, scale, DT: tl.constexpr, USE_G: tl.constexpr):
    """Γ_q = s H_< ⊙ Λ and Γ_r = D ⊙ Λ in the operand dtype (b_D: already −L_<(P Rᵀ)); the diagonal of H is added
    elementwise in the epilogue."""
    if USE_G:
        b_lam = tl.exp(tl.where(m_lt, b_g[:, None] - b_g[None, :], 0.0))
        b_gq = tl.where(m_lt, b_H * b_lam * scale, 0.0).to(DT)
        b_gr = tl.where(m_lt, b_D * b_lam, 0.0).to(DT)
    else:
        b_gq = tl.where(m_lt, b_H * scale, 0.0).to(DT)
        b_gr = b_D.to(DT)
    return b_gq, b_gr


@triton.jit
def _diagonal(b_H, o_i):
    """The diagonal of the [BT, BT] tile b_H (⟨dO_i, R_i⟩ from H = dO Rᵀ). Taken from the product rather than summed
    from the loaded dO and R tiles: a tile that feeds a product and is also read in registers is left by Triton 3.6's
    pipeliner in a one-slot shared buffer, which the next tile's copy overwrites while the product may still read it
    (rewy_tune/ir_hazards.py)."""
    return tl.sum(tl.where(o_i[:, None] == o_i[None, :], b_H, 0.0), axis=1)


@triton.jit
def _dq_rows(b_qg, b_aq, b_qf, b_kf, b_hd, b_gamma, b_gb, scale, USE_G: tl.constexpr):
    """dq = s γ Q̄_g + A_Q + s⟨dO, R⟩ K (self term); with a gate, Ḡ's query side ⟨Q, sγQ̄_g + A_Q⟩ added to b_gb."""
    if USE_G:
        # one row sum for Ḡ's query side (a row sum of an MMA-layout tile costs ~19 shuffles)
        b_dqg = (scale * b_gamma)[:, None] * b_qg + b_aq
        b_gb += tl.sum(b_qf * b_dqg, axis=1)
        b_dq = b_dqg + (scale * b_hd)[:, None] * b_kf
    else:
        b_dq = scale * b_qg + b_aq + (scale * b_hd)[:, None] * b_kf
    return b_dq, b_gb


@triton.jit
def _dk_rows(b_pe, b_ak, b_kt, b_kf, b_qf, b_e, b_gamma, b_tau, b_hd, is_last, b_der, b_gb, b_tail, scale,
             USE_G: tl.constexpr, SELF_Q: tl.constexpr = True):
    """dk's row side e γ Ē_dir + e A_K + τ K̄_t + s⟨dO, R⟩ Q (Ē_dir = −P S0ᵀ = −b_pe), accumulating d_erase, Ḡ and
    the τ⟨K, K̄_t⟩ tail terms. SELF_Q False leaves out the self term s⟨dO, R⟩ Q (the query-side stage made it;
    b_hd and b_qf are not read)."""
    b_edir = -b_pe
    if USE_G:
        # ⟨K, γĒ_dir + A_K⟩ is d_erase's and (times e) Ḡ's erase-side term: one row sum for both
        b_ea = b_gamma[:, None] * b_edir + b_ak
        b_kea = tl.sum(b_kf * b_ea, axis=1)
        b_kkt = tl.sum(b_kf * b_kt, axis=1)
        b_dkr = b_e[:, None] * b_ea + b_tau[:, None] * b_kt
        b_der += b_kea
        b_gb += b_e * b_kea
        b_tail += tl.where(is_last, 0.0, b_tau * b_kkt)
    else:
        b_dkr = b_e[:, None] * (b_edir + b_ak) + b_kt
        b_der += tl.sum(b_kf * (b_edir + b_ak), axis=1)
    if SELF_Q:
        b_dkr += (scale * b_hd)[:, None] * b_qf
    return b_dkr, b_der, b_gb, b_tail


@triton.jit
def _store_row_grads(derase, dwrite, dg, tok, m_row, is_last, b_der, b_dwr, b_gb, b_gb_col, b_tail, b_frob, b_gn,
                     ONE_BETA: tl.constexpr, USE_G: tl.constexpr):
    """d_erase and d_write (or, one β, their sum in one buffer) and the gate gradient dg per token: the reverse
    in-chunk cumsum of Ḡ (the adjoint of the chunk-local cumulative gate), formed here because this program holds
    the whole chunk's Ḡ (no separate cumsum kernel, no Ḡ round trip through memory)."""
    if ONE_BETA:
        tl.store(derase + tok, (b_der + b_dwr).to(derase.dtype.element_ty), mask=m_row)
    else:
        tl.store(derase + tok, b_der.to(derase.dtype.element_ty), mask=m_row)
        tl.store(dwrite + tok, b_dwr.to(dwrite.dtype.element_ty), mask=m_row)
    if USE_G:
        # Ḡ_i −= τ_i⟨K_i, K̄_t,i⟩ for i < n; the last row's own term cancels exactly (self-term split, §6/§8.2),
        # and the chunk-end decay of S0 and of the writes lands on row n.
        b_end = tl.sum(b_tail, axis=0) + tl.exp(b_gn) * tl.sum(b_frob, axis=0)
        b_out = b_gb - b_gb_col - b_tail + tl.where(is_last, b_end, 0.0)
        b_out = tl.where(m_row, b_out, 0.0)  # rows past T add nothing to the sums
        tl.store(dg + tok, tl.cumsum(b_out, axis=0, reverse=True), mask=m_row)


ROW_PARTS_BLOCK = 1024


# Registers of one SM (every NVIDIA GPU since Kepler): the consumers compile to 248-255 registers per thread, so
# 65 536 / (32 · num_warps · 256) of their CTAs fit per SM (2 at 4 warps, 1 at 8), whatever the shared memory allows.
REGISTERS_PER_SM = 65536


def programs_per_chunk(k_split: int, K: int, BK: int, *, chunks: int = 0, num_warps: int = 4,
                       device: torch.device | None = None) -> int:
    """A consumer's programs per chunk for Schedule.consumer_k_split: k_split, but at most one per K tile.

    k_split 0 ("auto") chooses from the grid: 2 where twice the `chunks` programs (NT · B·H) still fit in one wave of
    the consumer's CTAs on the device (SMs × REGISTERS_PER_SM / (32 · num_warps · 256)), else 1. Session 16 sweep,
    DeltaNet R (4 warps, 264 CTAs on the H200): 2 per chunk ran (1, 512, 4) (32 chunks) 0.0554 -> 0.0485 ms and
    (1, 2048, 4) (128) 0.1115 -> 0.1076, and (1, 2048, 16) (512) 0.1768 -> 0.1933; KDA (1, 512, 4) (8 warps, 132 CTAs)
    0.1666 -> 0.1428 ms (benchmarks/RESULTS.md)."""
    if k_split not in CONSUMER_K_SPLITS:
        raise ValueError(f"k_split must be one of {CONSUMER_K_SPLITS}, got {k_split!r}")
    if k_split == 0:
        k_split = 2 if 0 < 2 * chunks <= consumer_slots(num_warps, device) else 1
    return min(k_split, triton.cdiv(K, BK))


def consumer_slots(num_warps: int, device: torch.device | None = None) -> int:
    """CTAs of a consumer that one wave holds on the device: SMs × REGISTERS_PER_SM / (32 · num_warps · 256)."""
    return device_sms(device or torch.device("cpu")) * max(1, REGISTERS_PER_SM // (32 * num_warps * 256))


@triton.jit(do_not_specialize=["n_tok"])  # one binary whatever B·T·H
def rewy_bwd_kernel_row_parts(derp, dwp, dgp, derase, dwrite, dg, n_tok, KSPLIT: tl.constexpr,
                              HAS_WRITE: tl.constexpr, HAS_G: tl.constexpr, BLOCK: tl.constexpr):
    """d_erase, d_write and dg from a consumer's k_split programs' fp32 parts ([KSPLIT, n_tok] each), summed in
    part order (the same bits every run) and cast to the outputs' dtypes in one launch."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n_tok
    b_e = tl.zeros([BLOCK], dtype=tl.float32)
    b_w = tl.zeros([BLOCK], dtype=tl.float32)
    b_g = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(KSPLIT):
        b_e += tl.load(derp + i * n_tok + o, mask=m, other=0.0)
        if HAS_WRITE:
            b_w += tl.load(dwp + i * n_tok + o, mask=m, other=0.0)
        if HAS_G:
            b_g += tl.load(dgp + i * n_tok + o, mask=m, other=0.0)
    tl.store(derase + o, b_e.to(derase.dtype.element_ty), mask=m)
    if HAS_WRITE:
        tl.store(dwrite + o, b_w.to(dwrite.dtype.element_ty), mask=m)
    if HAS_G:
        tl.store(dg + o, b_g, mask=m)


def is_v_first(S0: torch.Tensor) -> bool:
    """S0 [B,NT,H,K,V] as a transposed view of [B,NT,H,V,K] storage (FLA's state_v_first h, which policy A keeps):
    the vector consumer reads that layout as it is (vector_local, S0_VK); every other consumer takes S0 K-first."""
    return S0.dim() == 5 and S0.shape[-1] > 1 and S0.stride(-2) == 1 and S0.transpose(-1, -2).is_contiguous()


def checked_ranges(chunk_ranges, NT: int):
    """A consumer launcher's chunk ranges (c0, c1), as given (None: one range over every chunk), each checked to be
    a range of the NT chunks that none before it covered; after the last, that they covered every chunk."""
    done = []
    for c0, c1 in ([(0, NT)] if chunk_ranges is None else chunk_ranges):
        if not 0 <= c0 < c1 <= NT:
            raise ValueError(f"chunk_ranges: ({c0}, {c1}) is not a range of the {NT} chunks")
        twice = [c for a, b in done for c in range(max(a, c0), min(b, c1))]
        if twice:
            raise ValueError(f"chunk_ranges covered chunk {twice[0]} twice")
        done.append((c0, c1))
        yield c0, c1
    if sum(b - a for a, b in done) != NT:
        raise ValueError(f"chunk_ranges covered {sum(b - a for a, b in done)} chunks, not the {NT} there are")


def output_buffer(given, like: torch.Tensor, name: str) -> torch.Tensor:
    """`given` checked to be a contiguous tensor of `like`'s shape and dtype, or a new one like it (None)."""
    if given is None:
        return torch.empty_like(like)
    if given.shape != like.shape or given.dtype != like.dtype or not given.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {tuple(like.shape)} tensor in {like.dtype}, got "
                         f"{tuple(given.shape)} in {given.dtype}")
    return given


def sum_row_parts(derp, dwp, dgp, derase, dwrite, dg) -> None:
    """Sum the [k, ...] fp32 parts derp (and dwp, dgp where not None) into derase (dwrite, dg), all [B,T,H]."""
    n_tok = derase.numel()
    rewy_bwd_kernel_row_parts[(triton.cdiv(n_tok, ROW_PARTS_BLOCK),)](
        derp, dwp, dgp, derase, dwrite, dg, n_tok, KSPLIT=derp.shape[0], HAS_WRITE=dwp is not None,
        HAS_G=dgp is not None, BLOCK=ROW_PARTS_BLOCK)


@triton.jit(do_not_specialize=["T", "NT", "H"])
def rewy_bwd_kernel_consumer(
    q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, P, D,
    dq, dk, dv, dk_col, dg, derase, dwrite,
    T, NT, scale,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, JOINT: tl.constexpr, PREC: tl.constexpr, ONE_BETA: tl.constexpr,
):
    # Tiles are addressed through block pointers: per-element pointer tensors of the ~10 tiles this kernel
    # walks would otherwise stay live across the V loop (2 registers per element) and spill.
    i_t, i_b, i_h, t0, o_i, m_row, tok, n_rows, is_last = _chunk_prologue(T, H, BT, 0)
    bos = (i_b * T * H + i_h).to(tl.int64)  # token (b, 0, h)
    s_off = ((i_b * NT + i_t) * H + i_h).to(tl.int64) * (K * V)
    DT = k.dtype.element_ty
    q += bos * K
    k += bos * K
    dq += bos * K
    dk += bos * K
    dk_col += bos * K
    v += bos * V
    R += bos * V
    Rbar += bos * V
    do += bos * V
    dv += bos * V
    A += bos * BT
    S0 += s_off
    dS1 += s_off

    b_e = tl.load(erase + tok, mask=m_row, other=0.0).to(tl.float32)
    b_w = tl.load(write + tok, mask=m_row, other=0.0).to(tl.float32)
    b_g, b_gn, b_gamma, b_tau = _row_gates(G, tok, m_row, is_last, BT, USE_G)
    if JOINT:
        # Aᵀ[j, i] = A[i, j], loaded transposed from memory; keep j ≤ i (A is unit lower triangular; FLA's
        # buffer is not guaranteed zero above the diagonal of a tail chunk).
        p_at = tl.make_block_ptr(A, (BT, T), (1, H * BT), (0, t0), (BT, BT), (0, 1))
        b_at = tl.load(p_at, boundary_check=(0, 1))
        b_at = tl.where(o_i[:, None] <= o_i[None, :], b_at, 0.0).to(DT)

    # Phase 1 (once per chunk): the n×n products H = dO Rᵀ and (joint) D = −L_<(P Rᵀ), with the per-token
    # sums and dv that read P. Only H, D and Aᵀ are live across this V loop.
    b_D = tl.zeros([BT, BT], dtype=tl.float32)  # accumulates P Rᵀ (joint)
    b_H = tl.zeros([BT, BT], dtype=tl.float32)  # accumulates dO Rᵀ
    b_dwr = tl.zeros([BT], dtype=tl.float32)  # d_write = ⟨V_i, P_i⟩
    for i_v in range(0, (V + BV - 1) // BV):
        p_do = tl.make_block_ptr(do, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        p_rt = tl.make_block_ptr(R, (V, T), (1, H * V), (i_v * BV, t0), (BV, BT), (0, 1))
        b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
        b_rt = tl.load(p_rt, boundary_check=(0, 1)).to(DT)
        if JOINT:
            p_rb = tl.make_block_ptr(Rbar, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
            b_p = _mma(b_at, tl.load(p_rb, boundary_check=(0, 1)).to(DT), PREC)
            b_D += _mma(b_p.to(DT), b_rt, PREC)
        else:
            p_p = tl.make_block_ptr(P + bos * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
            b_p = tl.load(p_p, boundary_check=(0, 1)).to(tl.float32)
        b_H += _mma(b_do, b_rt, PREC)
        p_v = tl.make_block_ptr(v, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        b_dwr += tl.sum(tl.load(p_v, boundary_check=(0, 1)).to(tl.float32) * b_p, axis=1)
        p_dv = tl.make_block_ptr(dv, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_dv, (b_w[:, None] * b_p).to(p_dv.dtype.element_ty), boundary_check=(0, 1))

    b_hd = _diagonal(b_H, o_i)  # ⟨dO_i, R_i⟩
    # n×n masks and Λ are formed only here, after the V loop, to keep them out of its live registers.
    m_lt = (o_i[:, None] > o_i[None, :]) & m_row[:, None] & m_row[None, :]  # strict lower (self-term split)
    if JOINT:
        b_D = tl.where(m_lt, -b_D, 0.0)
    else:
        p_d = tl.make_block_ptr(D + bos * BT, (T, BT), (H * BT, 1), (t0, 0), (BT, BT), (1, 0))
        b_D = tl.where(m_lt, tl.load(p_d, boundary_check=(0, 1)).to(tl.float32), 0.0)
    b_gq, b_gr = _gamma_matrices(b_H, b_D, b_g, m_lt, scale, DT, USE_G)

    b_der = tl.zeros([BT], dtype=tl.float32)  # d_erase
    b_gb = tl.zeros([BT], dtype=tl.float32)  # Ḡ (row side)
    b_gb_col = tl.zeros([BT], dtype=tl.float32)  # Ḡ (column side, from B_Q + B_K)
    b_frob = tl.zeros([BV], dtype=tl.float32)  # ⟨S0, dS1⟩_F, partial per value column
    b_tail = tl.zeros([BT], dtype=tl.float32)  # τ_j ⟨K_j, K̄_t,j⟩ for rows j < n

    # Phase 2: a run-time loop over K tiles (one copy of the body), the [C, BK] products over V per tile.
    for i_k in range(0, (K + BK - 1) // BK):
        b_pe = tl.zeros([BT, BK], dtype=tl.float32)  # P S0ᵀ  (= −Ē_dir)
        b_qg = tl.zeros([BT, BK], dtype=tl.float32)  # Q̄_g = dO S0ᵀ
        b_kt = tl.zeros([BT, BK], dtype=tl.float32)  # K̄_t = R dS1ᵀ
        for i_v in range(0, (V + BV - 1) // BV):
            p_r = tl.make_block_ptr(R, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
            p_do = tl.make_block_ptr(do, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
            b_r = tl.load(p_r, boundary_check=(0, 1)).to(DT)
            b_do = tl.load(p_do, boundary_check=(0, 1)).to(DT)
            if JOINT:
                # P tile recomputed per K tile: trades 2n²·BV FLOPs for no P round trip.
                p_rb = tl.make_block_ptr(Rbar, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
                b_p = _mma(b_at, tl.load(p_rb, boundary_check=(0, 1)).to(DT), PREC)
            else:
                p_p = tl.make_block_ptr(P + bos * V, (T, V), (H * V, 1), (t0, i_v * BV), (BT, BV), (1, 0))
                b_p = tl.load(p_p, boundary_check=(0, 1)).to(tl.float32)
            # S0ᵀ / dS1ᵀ tiles [BV, BK], loaded transposed from the [K, V] state.
            p_s0t = tl.make_block_ptr(S0, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK), (0, 1))
            p_ds1t = tl.make_block_ptr(dS1, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK), (0, 1))
            b_s0t = tl.load(p_s0t, boundary_check=(0, 1))
            b_ds1t = tl.load(p_ds1t, boundary_check=(0, 1))
            if USE_G:  # its own [BK, BV] loads: the product operands are never read in registers (`_diagonal`)
                p_s0 = tl.make_block_ptr(S0, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV), (1, 0))
                p_ds1 = tl.make_block_ptr(dS1, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV), (1, 0))
                b_frob += tl.sum(tl.load(p_s0, boundary_check=(0, 1)).to(tl.float32)
                                 * tl.load(p_ds1, boundary_check=(0, 1)).to(tl.float32), axis=0)
            b_pe += _mma(b_p.to(DT), b_s0t.to(DT), PREC)
            b_qg += _mma(b_do, b_s0t.to(DT), PREC)
            b_kt += _mma(b_r, b_ds1t.to(DT), PREC)

        p_q = tl.make_block_ptr(q, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        p_k = tl.make_block_ptr(k, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        p_qt = tl.make_block_ptr(q, (K, T), (1, H * K), (i_k * BK, t0), (BK, BT), (0, 1))
        p_kt = tl.make_block_ptr(k, (K, T), (1, H * K), (i_k * BK, t0), (BK, BT), (0, 1))
        # Ordered to keep few [C, BK] tiles live at once: column side first (to scratch), then dq, then dk rows.
        # Column side, computed transposed: B_Qᵀ + B_Kᵀ = Qᵀ Γ_q + (eK)ᵀ Γ_r, stored transposed into row-major
        # scratch and read back as rows after a CTA barrier: the register transpose that FLA issue 640
        # miscompiles, done through memory instead.
        b_ktr = tl.load(p_kt, boundary_check=(0, 1))
        b_bt = _mma(tl.load(p_qt, boundary_check=(0, 1)).to(DT), b_gq, PREC)
        b_bt += _mma((b_ktr.to(tl.float32) * b_e[None, :]).to(DT), b_gr, PREC)
        p_ct = tl.make_block_ptr(dk_col, (K, T), (1, H * K), (i_k * BK, t0), (BK, BT), (0, 1))
        tl.store(p_ct, b_bt, boundary_check=(0, 1))
        if USE_G:
            b_gb_col += tl.sum(b_ktr.to(tl.float32) * b_bt, axis=0)

        # dq = s γ Q̄_g + A_Q (+ self term), A_Q = Γ_q K
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_kf = b_k.to(tl.float32)
        b_qf = b_q.to(tl.float32)
        b_aq = _mma(b_gq, b_k.to(DT), PREC)
        b_dq, b_gb = _dq_rows(b_qg, b_aq, b_qf, b_kf, b_hd, b_gamma, b_gb, scale, USE_G)
        p_dq = tl.make_block_ptr(dq, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))

        # dk rows = e γ Ē_dir + e A_K + τ K̄_t (+ self term), A_K = Γ_r K
        b_ak = _mma(b_gr, b_k.to(DT), PREC)
        b_dkr, b_der, b_gb, b_tail = _dk_rows(b_pe, b_ak, b_kt, b_kf, b_qf, b_e, b_gamma, b_tau, b_hd, is_last,
                                              b_der, b_gb, b_tail, scale, USE_G)

        tl.debug_barrier()
        p_c = tl.make_block_ptr(dk_col, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        b_dkr += tl.load(p_c, boundary_check=(0, 1))
        p_dk = tl.make_block_ptr(dk, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
        tl.store(p_dk, b_dkr.to(p_dk.dtype.element_ty), boundary_check=(0, 1))

    _store_row_grads(derase, dwrite, dg, tok, m_row, is_last, b_der, b_dwr, b_gb, b_gb_col, b_tail, b_frob, b_gn,
                     ONE_BETA, USE_G)


def _check_scalar_gate(G, shape) -> None:
    if G is not None and tuple(G.shape) != tuple(shape):
        raise ValueError(f"G must be None or a scalar gate of shape {tuple(shape)} for DeltaNet/GDN kernels, "
                         f"got {tuple(G.shape)}")


def _check_consumer_args(q, v, G, erase, write, S0, dS1, chunk_size: int, one_beta: bool) -> None:
    """Shape and dtype rules shared by both consumer launchers (this module's and `consumer_tma`)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    _check_scalar_gate(G, (B, T, H))
    for name, t in (("erase", erase), ("write", write)):
        if tuple(t.shape) != (B, T, H):
            raise ValueError(f"{name} must be a per-token scalar [B,T,H]={(B, T, H)} here, got {tuple(t.shape)}")
    for name, t in (("S0", S0), ("dS1", dS1)):
        if tuple(t.shape) != (B, NT, H, K, V):
            raise ValueError(f"{name} must have shape {(B, NT, H, K, V)}, got {tuple(t.shape)}")
    if one_beta and erase.dtype != write.dtype:
        raise ValueError(f"one_beta: erase and write must share a dtype, got {erase.dtype} and {write.dtype}")


def consumer(q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, *, scale: float, P=None, D=None,
             chunk_size: int = 64, BK: int = 64, BV: int = 64, num_warps: int = 4, num_stages: int = 2,
             one_beta: bool = False):
    """ReWY consumer (§5–6.2). Joint when P and D are None (producer fused), separate otherwise.

    Returns (dq, dk, dv, dg, d_erase, d_write): dq, dk, dv in the input dtypes, d_erase/d_write in the
    dtypes of erase/write, dg fp32 [B,T,H] (the gradient w.r.t. the per-token gate g: the reverse in-chunk cumsum
    of the cumulative gate's adjoint Ḡ; None without gate).
    one_beta=True: d_erase = d_erase + d_write (the gradient of a β that is both), d_write None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    _check_consumer_args(q, v, G, erase, write, S0, dS1, chunk_size, one_beta)
    joint = P is None
    if joint != (D is None):
        raise ValueError("pass both P and D (separate consumer) or neither (joint consumer)")
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dk_col = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device)
    dg = torch.empty(B, T, H, dtype=torch.float32, device=q.device) if G is not None else None
    derase = torch.empty_like(erase)
    dwrite = None if one_beta else torch.empty_like(write)
    rewy_bwd_kernel_consumer[(NT, B * H)](
        q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, P, D,
        dq, dk, dv, dk_col, dg, derase, dwrite,
        T, NT, float(scale),
        H=H, K=K, V=V, BT=chunk_size, BK=BK, BV=BV, USE_G=G is not None, JOINT=joint,
        PREC=dot_precision(k.dtype), ONE_BETA=one_beta, num_warps=num_warps, num_stages=num_stages,
    )
    return dq, dk, dv, dg, derase, dwrite
