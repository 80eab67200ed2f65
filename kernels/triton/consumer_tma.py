"""The joint scalar-gate consumer (DeltaNet, GDN) with tensor-descriptor loads: ``Schedule.consumer ==
"joint_tma"``.

Same mathematics, phases and outputs as ``local.rewy_bwd_kernel_consumer`` with ``JOINT`` (rewy-math §§5–6.2;
read that kernel's docstring first). What differs is how tiles reach the tensor cores. It is the cc-9.0 default
for DeltaNet/GDN since session 12: GDN's backward 3–4 % faster than with the pointer kernel at B·H ≥ 16, DeltaNet
within 1 % (benchmarks/RESULTS.md). It was written when the pointer kernel seemed spill- and address-bound; that
reading came from a compile without the GPU's alignment hints, and with them both kernels issue about 3 100
sm_90 instructions. Here every input tile comes through a host-built tensor descriptor:

- on sm_90 a descriptor load is one TMA copy into shared memory (no per-thread addresses, no boundary masks:
  rows past T read as zero), which the MMA reads in place; elsewhere (and under the interpreter) Triton lowers it
  to ordinary loads, so the kernel runs everywhere;
- a transposed operand is the same loaded tile under ``tl.trans`` (R for Rᵀ, S0 for S0ᵀ, Q for Qᵀ, ...): one load
  serves both orientations. No ``tl.trans`` touches an MMA result (FLA issue 640): the column side of dk goes
  through the fp32 scratch ``dk_col`` as in ``local.py`` (column_side "scratch"), or is formed as rows from Γ
  stored and read back transposed ("gamma_t", below);
- dq, dk, dv are stored through descriptors too (TMA stores clip rows past T).

``Schedule.consumer_order == "dq_first"`` (``dq_first=True``) runs phase 2 in another order: Q̄_g gets its own V
pass, and dq and dk's column side are finished before Ē_dir and K̄_t are formed, so two [C, BK] fp32 accumulators
are live instead of three. sm_90 at 64 × 64 (alignment hints): at 8 warps GDN's stack 112 → 0 B (255 → 240
registers), DeltaNet 250 → 214 registers; at 4 warps (two CTAs per SM) GDN 744 → 232 B, DeltaNet 472 → 120 B.
``Schedule.column_side == "gamma_t"`` (``gamma_t=True``) stores Γ_q and Γ_r once per chunk into a scratch in the
operand dtype, reads them back transposed after a CTA barrier, and forms dk's column side as rows, Γ_qᵀ Q + Γ_rᵀ
(eK): no fp32 dk_col round trip and no barrier per K tile. sm_90 (hints) spills nothing in either order at 8 or 4
warps (GDN 8 warps: 254 registers, 2 856 instructions against 255, 112 B of stack and 3 176).
"fused" with "scratch" compiles to session 12's timed code. Timed in session 13 at (2, 2048, 16): at 8 warps
"dq_first" was 9–14 % slower and "gamma_t" 2–7 % faster; both at 4 warps ran GDN 0.427 → 0.340 ms and DeltaNet
0.374 → 0.310 ms, and became the cc-9.0 default (benchmarks/RESULTS.md).

``Schedule.p_tiles == "stored"`` (``store_p=True``): phase 1 writes each P = AᵀR̄ tile, cast to the operand dtype,
into a per-chunk [C, V] scratch (the size of v), and phase 2 reads those tiles back (after the CTA barrier that
"gamma_t" already takes) instead of forming P again in every K tile: per chunk one [C, C] × [C, BV] product and one
R̄ tile load fewer per (K tile, V tile) pair, and Aᵀ need not stay live through phase 2. Phase 2 uses P only as a
product operand in that dtype, so the results are the same bits. Not yet timed on the H200.

``Schedule.consumer_k_split`` (``k_split`` > 1): each chunk gets ``k_split`` programs (a third grid axis; no more
than its K tiles, the launcher lowers it to that), each
running phase 1 whole (it makes Γ, which every K tile needs) and phase 2 over its own share of the K tiles. dq and
dk rows are per K tile and go straight out; the row gradients are sums over K tiles, so each program writes its
part of d_erase, d_write and dg (the reverse cumsum is linear, so per part too) to fp32 part buffers, which the
launcher sums and casts (fixed order: the same bits every run). dv and d_write's phase-1 term come from part 0;
the Γ and "stored" P scratches are the chunk's, shared by its programs (each stores the same bits there).
Where B·H is small the grid of one program per chunk leaves most SMs idle (32 programs at (1, 512, 4) on 132
SMs); the split trades a repeated phase 1 (6 of the chunk's 30 tile products at K = V = 128) for twice the
programs and half the serial chain each. sm_90 (the GDN H200 default at 4 warps): 255 registers either way, stack
0 → 48 B with k_split 2. Not yet timed.

``Schedule.dq_stage == "separate"`` (``dq`` given, ``DQ_GIVEN``): dq, dk's query part (Γ_qᵀ Q + s⟨dO, R⟩ Q, in
the dk buffer) and Ḡ's query side come from the query-side stage (``query_side.py``), which ran beside the reverse
scan. This kernel forms neither H nor Γ_q, nor any product with dO or Q (10 of its 30 tile products at
K = V = 128), reads neither dO nor Q, adds the rest of dk to the given part, and adds the given Ḡ_q to its row sums
(program 0 of a chunk under k_split). sm_90 (DeltaNet A, 4 warps): 254 → 252 registers, 82 → 74 KB of shared
memory. Session 34 timed DeltaNet A 1.203 → 1.274–1.282×, but dk changed from run to run beside the scan on the
H200: the query-side stage and this kernel's GDN path each read a loaded tile both in a product and in registers,
which Triton 3.6's pipeliner leaves in a one-slot buffer that the next tile's copy overwrites under the product
(`rewy_tune/ir_hazards.py`). Since session 35 no tile is read both ways (⟨dO, R⟩ is H's diagonal, ⟨S0, dS1⟩ reads
S0 and dS1 by loads of its own); DeltaNet A's Hopper default, 1.283× (benchmarks/RESULTS.md).

``Schedule.consumer_ranges`` (``chunk_ranges``): the grid's chunk axis starts at ``c_off``, so the launcher can
launch a range of chunks at a time, each as soon as the reverse scan has finished it (`pipeline.py`). Every
buffer is allocated once for all the launches and the fp32 row parts are summed after the last, so the results
are the bits of one launch.

``chase`` (`pipeline.CONSUMER_CHASES_SCAN`, off since session 32 measured it slower): one launch while the reverse
scan still runs, as its programmatic dependent; each program takes a chunk from the last (`local._chased_chunk`)
and waits for the scan's count of it (`local._wait_for_scan`) before its first R̄ tile.

``Schedule.consumer_loads`` (``loads``): "at_use" loads every tile through its descriptor where it is used. Outside a
pipelined loop the sm_90 IR waits for a descriptor copy where it is issued, so each such load is a memory round trip
on the chunk's path: A, and each v tile of phase 1 (used in registers, not by a product, so not pipelined), and per
K tile K and Q or dk's query part after the V loop, whose first copies also start cold. "ahead" loads A and v by
pointer loads (their latency runs beside phase 1's products) and K with Q or dk's query part before the K tile's V
loop; "flat" loads A and v so and runs phase 2 as one loop over (K tile, V tile) pairs (`_phase2_flat`, the
query-side-given Γᵀ-rows path of one program a chunk; "ahead" elsewhere), so the next K tile's copies are in flight
during the dk epilogue. sm_90, DeltaNet A: 74 -> 98 KB of shared memory, 252 -> 238 registers. Session 41 sweep
(H100): the consumer 92.7 -> 89.7 µs at (2, 2048, 16), the backward 1.5-2.7 % shorter at B·H >= 16. The gradients are
the same bits but d_write, whose row sums the v tile's layout orders otherwise on a GPU.

Descriptors are 4-D over the [B, T, H, D] tensors, block [1, BT, 1, BD], so a chunk never reads another
sequence's rows; the states' descriptors are 3-D over [B·NT·H, K, V]. TMA needs 16-byte aligned base addresses
and row strides (`tma_supported`); the pipeline takes the pointer kernel otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .local import (_chased_chunk, _check_consumer_args, _chunk_prologue, _chunk_rows, _diagonal, _dk_rows,
                    _dq_rows, _gamma_matrices, _row_gates, _store_row_grads, _wait_for_scan, checked_ranges,
                    output_buffer, programs_per_chunk, sum_row_parts)
from .recompute import dot_precision
from .recompute import mm as _mma

# Schedule.consumer_loads as the kernel's EARLY bits: 1 A and the v tiles by pointer loads, 2 K and Q or dk's query
# part before a K tile's V loop, 4 phase 2 as one flat loop (`_phase2_flat`)
LOAD_BITS = {"at_use": 0, "ahead": 3, "flat": 5}


@triton.jit
def _tile(desc, i_b, t0, i_h, col, BT: tl.constexpr, BD: tl.constexpr):
    """The [BT, BD] tile at rows t0.. and columns col.. of head (i_b, i_h) of a [B, T, H, D] descriptor."""
    return desc.load([i_b, t0, i_h, col]).reshape(BT, BD)


@triton.jit
def _row_tile(x, bos, T, H, D: tl.constexpr, t0, i_d, BT: tl.constexpr, BD: tl.constexpr):
    """Block pointer to the [BT, BD] tile at rows t0.. and column tile i_d of the [B, T, H, D] tensor x, head bos."""
    return tl.make_block_ptr(x + bos * D, (T, D), (H * D, 1), (t0, i_d * BD), (BT, BD), (1, 0))


@triton.jit
def _p_tile(pst, i_v, BT: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Block pointer to P's i_v-th [BT, BV] tile in this chunk's [BT, V] scratch (p_tiles "stored")."""
    return tl.make_block_ptr(pst, (BT, V), (V, 1), (0, i_v * BV), (BT, BV), (1, 0))


@triton.jit
def _dq_epilogue(dq_d, b_qg, b_gq, b_k, b_qf, b_kf, b_hd, b_gamma, b_gb, scale, i_b, t0, i_h, i_k,
                 BT: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, USE_G: tl.constexpr):
    """A_Q = Γ_q K, the dq rows, their store; returns Ḡ's accumulator with the query side added."""
    b_aq = _mma(b_gq, b_k.to(DT), PREC)
    b_dq, b_gb = _dq_rows(b_qg, b_aq, b_qf, b_kf, b_hd, b_gamma, b_gb, scale, USE_G)
    dq_d.store([i_b, t0, i_h, i_k * BK], b_dq.to(dq_d.dtype).reshape(1, BT, 1, BK))
    return b_gb


@triton.jit
def _column_side(dk_col, b_q, b_kf, b_e, b_gq, b_gr, b_gb_col, T, H, K: tl.constexpr, t0, i_k, BT: tl.constexpr,
                 BK: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, USE_G: tl.constexpr, WITH_Q: tl.constexpr):
    """dk's column side B_Qᵀ + B_Kᵀ = Qᵀ Γ_q + (eK)ᵀ Γ_r, stored transposed into the fp32 scratch (read back as rows
    after a CTA barrier, never through tl.trans of an MMA result); returns Ḡ's column-side accumulator. WITH_Q
    False: (eK)ᵀ Γ_r alone (the query-side stage made Γ_qᵀ Q; b_q and b_gq are not read)."""
    if WITH_Q:
        b_bt = _mma(tl.trans(b_q).to(DT), b_gq, PREC)
        b_bt += _mma(tl.trans(b_kf * b_e[:, None]).to(DT), b_gr, PREC)
    else:
        b_bt = _mma(tl.trans(b_kf * b_e[:, None]).to(DT), b_gr, PREC)
    p_ct = tl.make_block_ptr(dk_col, (K, T), (1, H * K), (i_k * BK, t0), (BK, BT), (0, 1))
    tl.store(p_ct, b_bt, boundary_check=(0, 1))
    if USE_G:
        b_gb_col += tl.sum(tl.trans(b_kf) * b_bt, axis=0)
    return b_gb_col


@triton.jit
def _column_rows(b_gqt, b_grt, b_q, b_kf, b_e, b_gb_col, DT: tl.constexpr, PREC: tl.constexpr,
                 USE_G: tl.constexpr, WITH_Q: tl.constexpr):
    """dk's column side as rows, Γ_qᵀ Q + Γ_rᵀ (eK), from Γ_qᵀ and Γ_rᵀ loaded transposed (column_side "gamma_t");
    returns it and Ḡ's column-side accumulator. WITH_Q False: Γ_rᵀ (eK) alone (b_gqt and b_q are not read)."""
    if WITH_Q:
        b_brow = _mma(b_gqt, b_q.to(DT), PREC)
        b_brow += _mma(b_grt, (b_kf * b_e[:, None]).to(DT), PREC)
    else:
        b_brow = _mma(b_grt, (b_kf * b_e[:, None]).to(DT), PREC)
    if USE_G:
        b_gb_col += tl.sum(b_kf * b_brow, axis=1)
    return b_brow, b_gb_col


@triton.jit
def _state_frob(s0, ds1, i_s, i_k, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """⟨S0, dS1⟩ over one [BK, BV] tile of chunk state i_s, per key row, from pointer loads of its own (the descriptor
    tiles feed products only, `local._diagonal`)."""
    base = i_s.to(tl.int64) * (K * V)
    p_s0 = tl.make_block_ptr(s0 + base, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV), (1, 0))
    p_ds1 = tl.make_block_ptr(ds1 + base, (K, V), (V, 1), (i_k * BK, i_v * BV), (BK, BV), (1, 0))
    return tl.sum(tl.load(p_s0, boundary_check=(0, 1)).to(tl.float32)
                  * tl.load(p_ds1, boundary_check=(0, 1)).to(tl.float32), axis=1)


@triton.jit
def _phase2_flat(r_d, rb_d, s0_d, ds1_d, dk_d, k, dkq, s0, ds1, b_at, b_gr, b_grt, b_e, b_gamma, b_tau, is_last, b_der,
                 b_gb, b_gb_col, b_frob, b_tail, scale, T, H, i_b, t0, i_h, i_s, bos, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr,
                 USE_G: tl.constexpr):
    """Phase 2 of the query-side-given consumer (dq_stage "separate", column_side "gamma_t", one program per chunk)
    as one loop over the (K tile, V tile) pairs, so the pipeliner copies the next K tile's first tiles while this
    K tile's last products and its dk epilogue run (nested loops restart the copies cold each K tile). The epilogue
    runs at a K tile's last V tile and reads K and dk's query part by pointer loads."""
    NV: tl.constexpr = (V + BV - 1) // BV
    NK: tl.constexpr = (K + BK - 1) // BK
    b_pe = tl.zeros([BT, BK], dtype=tl.float32)  # P S0ᵀ (= −Ē_dir)
    b_kt = tl.zeros([BT, BK], dtype=tl.float32)  # K̄_t = R dS1ᵀ
    for it in range(0, NK * NV):
        i_k = it // NV
        i_v = it % NV
        # the accumulators start over at a K tile's first V tile, before its products: reset after the dk epilogue
        # (session 41), the select lands between the loop's warpgroup products and ptxas serializes all of them
        # (C7515 "non wgmma instructions defining accumulator registers"; session 42, DeltaNet A 0-2 % per shape)
        b_pe = tl.where(i_v == 0, 0.0, b_pe)
        b_kt = tl.where(i_v == 0, 0.0, b_kt)
        b_r = _tile(r_d, i_b, t0, i_h, i_v * BV, BT, BV).to(DT)
        b_p = _mma(b_at, _tile(rb_d, i_b, t0, i_h, i_v * BV, BT, BV).to(DT), PREC)
        b_s0 = s0_d.load([i_s, i_k * BK, i_v * BV]).reshape(BK, BV)
        b_ds1 = ds1_d.load([i_s, i_k * BK, i_v * BV]).reshape(BK, BV)
        if USE_G:  # its own pointer loads (see the nested loop)
            b_frob += _state_frob(s0, ds1, i_s, i_k, i_v, K, V, BK, BV)
        b_pe += _mma(b_p.to(DT), tl.trans(b_s0).to(DT), PREC)
        b_kt += _mma(b_r, tl.trans(b_ds1).to(DT), PREC)
        if i_v == NV - 1:
            b_k = tl.load(_row_tile(k, bos, T, H, K, t0, i_k, BT, BK), boundary_check=(0, 1))
            b_dkq = tl.load(_row_tile(dkq, bos, T, H, K, t0, i_k, BT, BK), boundary_check=(0, 1))
            b_kf = b_k.to(tl.float32)
            b_ak = _mma(b_gr, b_k.to(DT), PREC)
            b_dkr, b_der, b_gb, b_tail = _dk_rows(b_pe, b_ak, b_kt, b_kf, b_kf, b_e, b_gamma, b_tau, b_gamma, is_last,
                                                  b_der, b_gb, b_tail, scale, USE_G, False)
            b_dkr += b_dkq.to(tl.float32)
            b_brow, b_gb_col = _column_rows(b_grt, b_grt, b_k, b_kf, b_e, b_gb_col, DT, PREC, USE_G, False)
            b_dkr += b_brow
            dk_d.store([i_b, t0, i_h, i_k * BK], b_dkr.to(dk_d.dtype).reshape(1, BT, 1, BK))
    return b_der, b_gb, b_gb_col, b_frob, b_tail


@triton.jit(do_not_specialize=["T", "NT", "H", "n_tok", "c_off"])
def rewy_bwd_kernel_consumer_tma(
    q_d, k_d, v_d, r_d, rb_d, do_d, a_d, s0_d, ds1_d, dq_d, dk_d, dv_d,
    G, erase, write, dk_col, gam, pst, dg, derase, dwrite, gbq, dkq, s0, ds1, progress, a, v, k, q,
    T, NT, scale, n_tok, c_off,
    H, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, PREC: tl.constexpr, ONE_BETA: tl.constexpr, SPLIT_DQ: tl.constexpr, GAMMA_T: tl.constexpr,
    STORE_P: tl.constexpr, KSPLIT: tl.constexpr, DQ_GIVEN: tl.constexpr, CHASE: tl.constexpr,
    SCAN_PROGRAMS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = 0,
):
    FLAT: tl.constexpr = (EARLY & 4) != 0
    # CHASE (launched with the reverse scan still running, `scan.reverse_state_scan_ranges(progress=)`): the
    # programs take the chunks from the last and wait for the scan's count of their chunk before the first tile
    # it writes (R̄) is read; PDL: launched as the scan's programmatic dependent (on a GPU)
    if CHASE:
        i_tc, i_bhc = _chased_chunk(NT, tl.num_programs(1))
        i_t, i_b, i_h, t0, o_i, m_row, tok, n_rows, is_last = _chunk_rows(i_tc, i_bhc, T, H, BT)
    else:
        i_t, i_b, i_h, t0, o_i, m_row, tok, n_rows, is_last = _chunk_prologue(T, H, BT, c_off)
    i_s = (i_b * NT + i_t) * H + i_h  # this chunk's state in the [B·NT·H, K, V] view
    i_ks = tl.program_id(2)  # this program's share of the K tiles (consumer_k_split)
    NK: tl.constexpr = (K + BK - 1) // BK
    NKP: tl.constexpr = (NK + KSPLIT - 1) // KSPLIT
    # the chunk's slot in the scratches (gam, pst). Under KSPLIT the chunk's programs share it: phase 1 is the same
    # code on the same inputs in each of them, so they store the same bits there, and a program reading the slot
    # after its own barrier reads its own values whichever store landed last (a slot per program cost KSPLIT times
    # the memory: DeltaNet A peak 0.4 % over FLA's at B·H = 4, session 17)
    i_scr = i_s.to(tl.int64)
    bos = (i_b * T * H + i_h).to(tl.int64)
    if not GAMMA_T:
        dk_col += bos * K
    if STORE_P:
        pst += i_scr * BT * V
    DT = k_d.dtype

    b_e = tl.load(erase + tok, mask=m_row, other=0.0).to(tl.float32)
    b_w = tl.load(write + tok, mask=m_row, other=0.0).to(tl.float32)
    b_g, b_gn, b_gamma, b_tau = _row_gates(G, tok, m_row, is_last, BT, USE_G)
    # Aᵀ, keeping j ≤ i (FLA's buffer is not guaranteed zero above the diagonal of a tail chunk)
    if EARLY & 1:  # a pointer load: in flight beside phase 1's first copies (A is [B, T, H, BT])
        b_at = tl.trans(tl.load(_row_tile(a, bos, T, H, BT, t0, 0, BT, BT), boundary_check=(0,)))
    else:
        b_at = tl.trans(_tile(a_d, i_b, t0, i_h, 0, BT, BT))
    b_at = tl.where(o_i[:, None] <= o_i[None, :], b_at, 0.0).to(DT)
    if CHASE:  # (the loads above read nothing of the scan's)
        _wait_for_scan(progress, i_bhc, i_tc, NT, SCAN_PROGRAMS, PDL)

    # Phase 1: P = AᵀR̄ per V tile, H = dO Rᵀ, D = −L_<(P Rᵀ), dv, d_write, ⟨dO, R⟩
    b_D = tl.zeros([BT, BT], dtype=tl.float32)
    b_H = tl.zeros([BT, BT], dtype=tl.float32)
    b_dwr = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, (V + BV - 1) // BV):
        b_r = _tile(r_d, i_b, t0, i_h, i_v * BV, BT, BV)
        b_p = _mma(b_at, _tile(rb_d, i_b, t0, i_h, i_v * BV, BT, BV).to(DT), PREC)
        b_D += _mma(b_p.to(DT), tl.trans(b_r).to(DT), PREC)
        if not DQ_GIVEN:  # (given: the query-side stage formed H and its diagonal; dO is not read here)
            b_do = _tile(do_d, i_b, t0, i_h, i_v * BV, BT, BV)
            b_H += _mma(b_do.to(DT), tl.trans(b_r).to(DT), PREC)
        if EARLY & 1:
            b_vt = tl.load(_row_tile(v, bos, T, H, V, t0, i_v, BT, BV), boundary_check=(0, 1))
        else:
            b_vt = _tile(v_d, i_b, t0, i_h, i_v * BV, BT, BV)
        b_dwr += tl.sum(b_vt.to(tl.float32) * b_p, axis=1)
        if KSPLIT == 1:  # (constexpr branches: k_split 1 compiles to the unsplit kernel)
            dv_d.store([i_b, t0, i_h, i_v * BV], (b_w[:, None] * b_p).to(dv_d.dtype).reshape(1, BT, 1, BV))
        elif i_ks == 0:
            dv_d.store([i_b, t0, i_h, i_v * BV], (b_w[:, None] * b_p).to(dv_d.dtype).reshape(1, BT, 1, BV))
        if STORE_P:  # phase 2 reads these back instead of forming P again per K tile
            tl.store(_p_tile(pst, i_v, BT, V, BV), b_p.to(DT), boundary_check=(1,))

    # ⟨dO, R⟩ from H, not from the loaded tiles: those feed products only (`local._diagonal`)
    b_hd = tl.zeros([BT], dtype=tl.float32) if DQ_GIVEN else _diagonal(b_H, o_i)
    m_lt = (o_i[:, None] > o_i[None, :]) & m_row[:, None] & m_row[None, :]
    b_D = tl.where(m_lt, -b_D, 0.0)
    # (DQ_GIVEN: Γ_q is the query-side stage's; the stand-in Γ_q formed from D here is never read)
    b_gq, b_gr = _gamma_matrices(b_D if DQ_GIVEN else b_H, b_D, b_g, m_lt, scale, DT, USE_G)
    if GAMMA_T:
        # Γ_q, Γ_r once through this chunk's scratch, read back transposed (a loaded tile, not tl.trans of an MMA
        # result: FLA issue 640): dk's column side then comes out as rows, without the fp32 dk_col round trip
        gam += i_scr * 2 * BT * BT
        o_c = tl.arange(0, BT)
        if not DQ_GIVEN:
            tl.store(gam + o_i[:, None] * BT + o_c[None, :], b_gq)
        tl.store(gam + BT * BT + o_i[:, None] * BT + o_c[None, :], b_gr)
    if GAMMA_T or STORE_P:
        tl.debug_barrier()  # the scratch tiles are read back by other threads of this CTA
    b_gqt = b_gq  # (a stand-in where Γ_qᵀ is not read: DQ_GIVEN, or column_side "scratch")
    if GAMMA_T:
        if not DQ_GIVEN:
            b_gqt = tl.load(tl.make_block_ptr(gam, (BT, BT), (1, BT), (0, 0), (BT, BT), (0, 1)))
        b_grt = tl.load(tl.make_block_ptr(gam + BT * BT, (BT, BT), (1, BT), (0, 0), (BT, BT), (0, 1)))

    b_der = tl.zeros([BT], dtype=tl.float32)
    b_gb = tl.zeros([BT], dtype=tl.float32)
    b_gb_col = tl.zeros([BT], dtype=tl.float32)
    b_frob = tl.zeros([BK], dtype=tl.float32)  # ⟨S0, dS1⟩_F, partial per key row
    b_tail = tl.zeros([BT], dtype=tl.float32)

    # Phase 2: per K tile the three [C, BK] products over V, then the dq / dk epilogue. SPLIT_DQ ("dq_first"): Q̄_g
    # gets its own V pass, and dq and dk's column side are finished before Ē_dir and K̄_t are formed (three [C, BK]
    # fp32 accumulators next to the epilogue spill; S0 and Q, K are loaded twice instead).
    if FLAT:  # (DQ_GIVEN, GAMMA_T, KSPLIT 1: the launcher checks, `flat_applies`)
        b_der, b_gb, b_gb_col, b_frob, b_tail = _phase2_flat(
            r_d, rb_d, s0_d, ds1_d, dk_d, k, dkq, s0, ds1, b_at, b_gr, b_grt, b_e, b_gamma, b_tau, is_last, b_der, b_gb,
            b_gb_col, b_frob, b_tail, scale, T, H, i_b, t0, i_h, i_s, bos, K, V, BT, BK, BV, DT, PREC, USE_G)
    else:
        if KSPLIT == 1:
            k_lo = 0
            k_hi = NK
        else:
            k_lo = i_ks * NKP
            k_hi = tl.minimum(k_lo + NKP, NK)
        for i_k in range(k_lo, k_hi):
            b_qg = tl.zeros([BT, BK], dtype=tl.float32)  # Q̄_g = dO S0ᵀ
            if SPLIT_DQ:
                b_k = _tile(k_d, i_b, t0, i_h, i_k * BK, BT, BK)
                if DQ_GIVEN:  # (Q is not read: K stands in for it)
                    b_q = b_k
                else:
                    b_q = _tile(q_d, i_b, t0, i_h, i_k * BK, BT, BK)
                if not DQ_GIVEN:
                    for i_v in range(0, (V + BV - 1) // BV):
                        b_s0 = s0_d.load([i_s, i_k * BK, i_v * BV]).reshape(BK, BV)
                        b_qg += _mma(_tile(do_d, i_b, t0, i_h, i_v * BV, BT, BV).to(DT), tl.trans(b_s0).to(DT), PREC)
                    b_gb = _dq_epilogue(dq_d, b_qg, b_gq, b_k, b_q.to(tl.float32), b_k.to(tl.float32), b_hd, b_gamma,
                                        b_gb, scale, i_b, t0, i_h, i_k, BT, BK, DT, PREC, USE_G)
                if not GAMMA_T:
                    b_gb_col = _column_side(dk_col, b_q, b_k.to(tl.float32), b_e, b_gq, b_gr, b_gb_col, T, H, K, t0,
                                            i_k, BT, BK, DT, PREC, USE_G, not DQ_GIVEN)
            if EARLY & 2:  # in flight through the V loop below
                b_k_early = tl.load(_row_tile(k, bos, T, H, K, t0, i_k, BT, BK), boundary_check=(0, 1))
                if DQ_GIVEN:
                    b_dkq_early = tl.load(_row_tile(dkq, bos, T, H, K, t0, i_k, BT, BK), boundary_check=(0, 1))
                else:
                    b_q_early = tl.load(_row_tile(q, bos, T, H, K, t0, i_k, BT, BK), boundary_check=(0, 1))
            b_pe = tl.zeros([BT, BK], dtype=tl.float32)  # P S0ᵀ (= −Ē_dir)
            b_kt = tl.zeros([BT, BK], dtype=tl.float32)  # K̄_t = R dS1ᵀ
            for i_v in range(0, (V + BV - 1) // BV):
                b_r = _tile(r_d, i_b, t0, i_h, i_v * BV, BT, BV).to(DT)
                if not SPLIT_DQ and not DQ_GIVEN:
                    b_do = _tile(do_d, i_b, t0, i_h, i_v * BV, BT, BV).to(DT)
                if STORE_P:
                    b_p = tl.load(_p_tile(pst, i_v, BT, V, BV), boundary_check=(1,))
                else:
                    b_p = _mma(b_at, _tile(rb_d, i_b, t0, i_h, i_v * BV, BT, BV).to(DT), PREC)
                b_s0 = s0_d.load([i_s, i_k * BK, i_v * BV]).reshape(BK, BV)  # rows past K read as zero
                b_ds1 = ds1_d.load([i_s, i_k * BK, i_v * BV]).reshape(BK, BV)
                if USE_G:  # its own pointer loads: the descriptor-loaded tiles feed products only (`local._diagonal`)
                    b_frob += _state_frob(s0, ds1, i_s, i_k, i_v, K, V, BK, BV)
                b_pe += _mma(b_p.to(DT), tl.trans(b_s0).to(DT), PREC)
                if not SPLIT_DQ and not DQ_GIVEN:
                    b_qg += _mma(b_do, tl.trans(b_s0).to(DT), PREC)
                b_kt += _mma(b_r, tl.trans(b_ds1).to(DT), PREC)

            # loaded after the V loop: shorter live ranges (the split path loads them again for dk's rows; EARLY & 2
            # loaded them before it). DQ_GIVEN reads no Q: K stands in for it where it is not read
            if EARLY & 2:
                b_k = b_k_early
            else:
                b_k = _tile(k_d, i_b, t0, i_h, i_k * BK, BT, BK)
            b_kf = b_k.to(tl.float32)
            if DQ_GIVEN:
                b_q = b_k
                b_qf = b_kf
            else:
                if EARLY & 2:
                    b_q = b_q_early
                else:
                    b_q = _tile(q_d, i_b, t0, i_h, i_k * BK, BT, BK)
                b_qf = b_q.to(tl.float32)
            if not SPLIT_DQ:
                if not GAMMA_T:
                    b_gb_col = _column_side(dk_col, b_q, b_kf, b_e, b_gq, b_gr, b_gb_col, T, H, K, t0, i_k, BT, BK, DT,
                                            PREC, USE_G, not DQ_GIVEN)
                if not DQ_GIVEN:
                    b_gb = _dq_epilogue(dq_d, b_qg, b_gq, b_k, b_qf, b_kf, b_hd, b_gamma, b_gb, scale, i_b, t0, i_h,
                                        i_k, BT, BK, DT, PREC, USE_G)

            b_ak = _mma(b_gr, b_k.to(DT), PREC)
            b_dkr, b_der, b_gb, b_tail = _dk_rows(b_pe, b_ak, b_kt, b_kf, b_qf, b_e, b_gamma, b_tau, b_hd, is_last,
                                                  b_der, b_gb, b_tail, scale, USE_G, not DQ_GIVEN)
            if DQ_GIVEN:  # dk's query part, which the query-side stage wrote into dk (read by a block pointer, not
                # through the descriptor this kernel stores dk with; session 34 timed both, and both raced under R)
                if EARLY & 2:
                    b_dkr += b_dkq_early.to(tl.float32)
                else:
                    b_dkq = tl.load(_row_tile(dkq, bos, T, H, K, t0, i_k, BT, BK), boundary_check=(0, 1))
                    b_dkr += b_dkq.to(tl.float32)

            if GAMMA_T:
                b_brow, b_gb_col = _column_rows(b_gqt, b_grt, b_q, b_kf, b_e, b_gb_col, DT, PREC, USE_G, not DQ_GIVEN)
                b_dkr += b_brow
            else:
                tl.debug_barrier()
                p_c = tl.make_block_ptr(dk_col, (T, K), (H * K, 1), (t0, i_k * BK), (BT, BK), (1, 0))
                b_dkr += tl.load(p_c, boundary_check=(0, 1))
            dk_d.store([i_b, t0, i_h, i_k * BK], b_dkr.to(dk_d.dtype).reshape(1, BT, 1, BK))

    if DQ_GIVEN and USE_G:  # Ḡ's query side from the query-side stage (query_side.py), counted once per chunk
        b_gb += tl.where(i_ks == 0, tl.load(gbq + tok, mask=m_row, other=0.0), 0.0)
    if KSPLIT > 1:  # this program's part of the sums over K tiles, into the fp32 part buffers (see the docstring)
        derase += i_ks * n_tok
        if not ONE_BETA:
            dwrite += i_ks * n_tok
        if USE_G:
            dg += i_ks * n_tok
        b_dwr = tl.where(i_ks == 0, b_dwr, 0.0)
    _store_row_grads(derase, dwrite, dg, tok, m_row, is_last, b_der, b_dwr, b_gb, b_gb_col, b_tail, b_frob, b_gn,
                     ONE_BETA, USE_G)
    if PDL:  # this grid ends after the scan's (its dh0 stores), whatever runs after it on the stream
        tl.extra.cuda.gdc_wait()


def flat_applies(dq_given: bool, gamma_t: bool, k_split: int) -> bool:
    """Whether consumer_loads "flat" runs its flat phase 2: dq from the query-side stage, column_side "gamma_t" and
    one program per chunk (k_split as launched); elsewhere it runs as "ahead"."""
    return dq_given and gamma_t and k_split == 1


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Whether every tensor meets TMA's layout rules: 16-byte aligned base and 16-byte multiple strides (but the
    last, which must be 1). The pipeline uses the pointer consumer when this is False."""
    for t in tensors:
        esize = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * esize) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _desc4(t: torch.Tensor, BT: int, BD: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, [1, BT, 1, BD])


def consumer_tma(q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, *, scale: float, P=None, D=None,
                 chunk_size: int = 64, BK: int = 64, BV: int = 64, num_warps: int = 4, num_stages: int = 2,
                 one_beta: bool = False, dq_first: bool = False, gamma_t: bool = False, store_p: bool = False,
                 k_split: int = 1, dq=None, gbq=None, dk=None, chunk_ranges=None, dv_out=None, chase=None,
                 loads: str = "at_use"):
    """``local.consumer``'s joint mode through tensor descriptors (same arguments, same returns); ``dq_first``:
    phase 2 in the "dq_first" order; ``gamma_t``: dk's column side as rows from Γ_qᵀ, Γ_rᵀ; ``store_p``: P's tiles
    kept from phase 1 for phase 2; ``k_split``: programs per chunk, each over its share of the K tiles (module
    docstring); ``dq``, ``dk`` (dk's query part) and with a gate ``gbq`` (Ḡ's query side): made by the query-side stage
    (``query_side.py``); dq is returned as given, dk completed in place, and the kernel forms no product with dO or Q
    (nor H or Γ_q) and reads neither. ``chunk_ranges``: an iterable of chunk
    ranges (c0, c1) covering the chunks once, one launch each (Schedule.consumer_ranges: the pipeline's iterator
    runs the reverse scan of each range first); None: one launch over every chunk. Same bits either way. ``dv_out``:
    the buffer dv is written to (v's shape and dtype, contiguous; None: a new one). Under consumer ranges the
    pipeline passes dv_local's: the reverse scan has read a range's rows of it before that range's consumer
    writes them, so dv_local is not held beside a dv of its own while the scan goes on. ``chase``: a
    `scan.ScanProgress` (`pipeline.CONSUMER_CHASES_SCAN`): the reverse scan was the last launch on this stream and
    may still run, publishing its chunks into chase.flags; this one launch waits for each chunk's count (on a GPU as
    the scan's programmatic dependent). Same bits as a launch after the scan. ``loads``: Schedule.consumer_loads
    ("at_use", "ahead", "flat"; same bits)."""
    if loads not in LOAD_BITS:
        raise ValueError(f"loads must be one of {tuple(LOAD_BITS)}, got {loads!r}")
    if P is not None or D is not None:
        raise ValueError("consumer 'joint_tma' fuses the producer: P and D must be None")
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    k_split = programs_per_chunk(k_split, K, BK, chunks=NT * B * H, num_warps=num_warps, device=q.device)
    _check_consumer_args(q, v, G, erase, write, S0, dS1, chunk_size, one_beta)
    if not tma_supported(q, k, v, R, Rbar, do, A, S0, dS1):
        raise ValueError("consumer 'joint_tma' needs 16-byte aligned tensors with 16-byte multiple strides "
                         "(contiguous, head dims a multiple of 8 elements)")
    dq_given = dq is not None
    if dq_given and (tuple(dq.shape) != tuple(q.shape) or (G is not None) != (gbq is not None)):
        raise ValueError(f"a given dq must have q's shape {tuple(q.shape)}, and gbq be given exactly when G is; got "
                         f"{tuple(dq.shape)}, gbq {'given' if gbq is not None else None}, G "
                         f"{'given' if G is not None else None}")
    if dq_given != (dk is not None) or (dk is not None and (tuple(dk.shape) != tuple(k.shape) or dk.dtype != k.dtype
                                                            or not dk.is_contiguous())):
        raise ValueError(f"dk (the query-side stage's query part) must be given exactly when dq is, contiguous with "
                         f"k's shape {tuple(k.shape)} and dtype {k.dtype}; got "
                         f"{None if dk is None else (tuple(dk.shape), dk.dtype)} with dq "
                         f"{'given' if dq_given else None}")
    if not dq_given:
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
    dv = output_buffer(dv_out, v, "dv_out")
    C = chunk_size
    if gamma_t:  # Γ_q, Γ_r per chunk in the operand dtype, read back transposed
        dk_col, gam = None, torch.empty(B * NT * H, 2, C, C, dtype=k.dtype, device=q.device)
    else:
        dk_col, gam = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device), None
    # P per chunk in the operand dtype (the size of v), not kept past this call
    pst = torch.empty(B * NT * H, C, V, dtype=k.dtype, device=q.device) if store_p else None
    dg = torch.empty(B, T, H, dtype=torch.float32, device=q.device) if G is not None else None
    derase = torch.empty_like(erase)
    dwrite = None if one_beta else torch.empty_like(write)
    if k_split > 1:  # the kernel writes fp32 parts of the sums over K tiles, summed below
        def parts(out):
            return torch.empty(k_split, B, T, H, dtype=torch.float32, device=q.device) if out is not None else None

        dgp, derp, dwp = parts(dg), parts(derase), parts(dwrite)
    else:
        dgp, derp, dwp = dg, derase, dwrite
    descs = (_desc4(q, C, BK), _desc4(k, C, BK), _desc4(v, C, BV), _desc4(R, C, BV), _desc4(Rbar, C, BV),
             _desc4(do, C, BV), _desc4(A, C, C),
             TensorDescriptor.from_tensor(S0.view(-1, K, V), [1, BK, BV]),
             TensorDescriptor.from_tensor(dS1.view(-1, K, V), [1, BK, BV]),
             _desc4(dq, C, BK), _desc4(dk, C, BK), _desc4(dv, C, BV))
    if chase is not None:
        chase.check(B * H, NT, q.device)
        if chunk_ranges is not None:
            raise ValueError("chase: the chasing consumer runs in one launch; pass no chunk_ranges with it")
    # (the flat phase 2 is written for the query-side-given Γᵀ-rows path of one program a chunk; elsewhere "ahead")
    early = LOAD_BITS["ahead" if loads == "flat" and not flat_applies(dq_given, gamma_t, k_split) else loads]
    for c0, c1 in checked_ranges(chunk_ranges, NT):
        rewy_bwd_kernel_consumer_tma[(c1 - c0, B * H, k_split)](
            *descs, G, erase, write, dk_col, gam, pst, dgp, derp, dwp, gbq, dk if dq_given else None,
            S0 if G is not None else None, dS1 if G is not None else None, chase.flags if chase is not None else None,
            A if early & 1 else None, v if early & 1 else None, k if early & 6 else None,
            q if early & 2 and not dq_given else None,
            T, NT, float(scale), B * T * H, c0,
            H=H, K=K, V=V, BT=C, BK=BK, BV=BV, USE_G=G is not None, PREC=dot_precision(k.dtype), ONE_BETA=one_beta,
            SPLIT_DQ=bool(dq_first), GAMMA_T=bool(gamma_t), STORE_P=bool(store_p), KSPLIT=k_split,
            DQ_GIVEN=dq_given, CHASE=chase is not None, SCAN_PROGRAMS=chase.programs if chase is not None else 0,
            PDL=chase is not None and chase.pdl, EARLY=early, num_warps=num_warps, num_stages=num_stages,
            launch_pdl=chase is not None and chase.pdl,
        )
    if k_split > 1:
        sum_row_parts(derp, dwp, dgp, derase, dwrite, dg)
    return dq, dk, dv, dg, derase, dwrite
