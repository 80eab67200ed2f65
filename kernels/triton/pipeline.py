"""The complete ReWY backward as a chain of Triton stages (`run_stages`); DeltaNet / GDN local stages here,
KDA / GDN2 through `vector_local.py`, which reuses the same stage order.

Order (rewy-math §§3–6): G = chunk cumsum of g → [policy R] W, U = recompute(A) and S0, R = forward scan
→ dv_local = A_qkᵀ dO → reverse scan (dS1, R̄, dh0) → [separate] producer P, D → consumer (dq, dk, dv,
d_erase, d_write, and dg: the reverse in-chunk cumsum of Ḡ, which each consumer program forms for its chunk).
Policy A passes S0 and R; W is recomputed in both policies (W alone under A; or taken from the forward, w_source)
because the reverse scan uses the −WᵀR̄ form (§4 (i)).

Every Schedule field is read here and passed to exactly one stage:
chunk_size → all stages; recompute → recompute_wu; forward_scan (+ forward_scan_segments, state_dtype) →
forward_state_scan; scan_split_waves → both scans; dv_local (+ dv_local_source for vector gates: A_qk
recomputed or the forward's Aqk) → dv_local; reverse_scan (+ reverse_scan_segments, state_dtype) →
reverse_state_scan (+ reverse_scan_layout: the state as dS or dSᵀ; reverse_scan_qdo: DeltaNet's Qᵀ dO formed in its
chunk step or the step before, or the step before where the scan splits; reverse_scan_small_grid_block_v: its value
tile where it runs whole on a small grid, `small_grid_block_v`); scan_state_rows → both scans (rows per register block
of the state);
producer + pd_dtype → producer (separate only); consumer_cfg + consumer → consumer (joint_tma: `consumer_tma.py`,
with consumer_order, column_side, p_tiles, consumer_k_split and consumer_loads); cumsum → chunk_cumsum; intra,
intra_precision and dv_local_source are validated but scalar gates form Λ exactly (and recompute A_qk in dv_local). w_source is read by
the autograd Function (`kernels/triton_function.py`): under policy A with "forward" it passes the forward's W here
and recompute_wu does not run. side_stream → which stages run on a second CUDA stream (`side_stream_mode`): dv_local
beside the recompute stage and the forward scan, and ("reverse_scan") the reverse scan beside the forward scan too.
dq_stage "separate" (joint_tma) → the query-side stage (`query_side.py`: dq, dk's query part and Ḡ's query side) on
the main stream once S0 and R exist, beside the reverse scan.
consumer_ranges > 1 (joint_tma; where the reverse scan runs last and alone) → the reverse scan in chunk ranges on
the side stream (`scan.reverse_state_scan_ranges`), each range's consumer on the main stream after its scan range
(`_scan_beside_consumer`); with the query-side stage (an explicit count, policy A with the forward's W) the stage runs
on the main stream beside the ranged scan, before the first consumer range. scan_operands "pregated" (vector
gates) → `scan_operands.gated_scan_operands` forms K_t and Q_g once, before the scans, which then read them (``pregated=True``); "forward" (policy A) → the autograd Function
passes fla-core's saved qg and kg (``scan_qk``), the reverse scan reads them (``q_scaled=False``), and the chunk
cumsum writes the consumer's gate range: no scan-operands stage runs.
"""

from __future__ import annotations

import functools

import torch
import triton

from rewy_tune.schedule import Schedule

from . import vector_local  # its flags: RANGE_FROM_OPERANDS (vector_local imports this module only inside a function)
from .consumer_tma import consumer_tma, tma_supported
from .cumsum import chunk_cumsum
from .local import consumer as run_consumer
from .local import dv_local as run_dv_local
from .local import producer as run_producer
from .query_side import query_side, query_side_buffers
from .recompute import recompute_wu
from .scan import (device_sms, forward_state_scan, pdl_supported, reverse_scan_segment_count, reverse_state_scan,
                   reverse_state_scan_ranges, scan_progress, split_program_limit)
from .scan_operands import gated_scan_operands

MAX_HEAD_DIM = 256
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _dtype_of(name: str, schedule_value: str, input_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if schedule_value == "fp32" else input_dtype


def _check(q, k, v, g, erase, write, A, do, dht, initial_state, S0, R, G, schedule) -> None:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a rewy_tune.schedule.Schedule, got {type(schedule).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("A", A), ("do", do), ("erase", erase), ("write", write)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q, k must be [B,T,H,K] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B,T,H,V] with B,T,H = {(B, T, H)}, got {tuple(v.shape)}")
    V = v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims K={K}, V={V}: the Triton kernels support K, V <= {MAX_HEAD_DIM}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"q/k/v dtype {q.dtype} is not supported by the Triton backward; accepted: float16, "
                         "bfloat16, float32 (float64: use the torch reference backend)")
    if k.dtype != q.dtype or v.dtype != q.dtype or do.dtype != q.dtype:
        raise ValueError(f"q, k, v, do must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}, {do.dtype}")
    if do.shape != v.shape:
        raise ValueError(f"do must have v's shape {tuple(v.shape)}, got {tuple(do.shape)}")
    for name, t in (("erase", erase), ("write", write)):
        if tuple(t.shape) != (B, T, H):
            raise ValueError(f"{name} must be a per-token scalar [B,T,H]={(B, T, H)} for DeltaNet/GDN, got "
                             f"{tuple(t.shape)} (vector erase/write is GDN2)")
        if not t.is_floating_point() or t.dtype == torch.float64:
            raise ValueError(f"{name} dtype {t.dtype} not supported; accepted: float16, bfloat16, float32")
    for name, t in (("g", g), ("G", G)):
        if t is not None:
            if tuple(t.shape) != (B, T, H):
                raise ValueError(f"{name} must be None or a scalar gate [B,T,H]={(B, T, H)} for DeltaNet/GDN, got "
                                 f"{tuple(t.shape)} (vector gates are KDA/GDN2)")
            if not t.is_floating_point() or t.dtype == torch.float64:
                raise ValueError(f"{name} dtype {t.dtype} not supported; accepted: float16, bfloat16, float32")
    C = schedule.chunk_size
    if tuple(A.shape) != (B, T, H, C):
        raise ValueError(f"A must be [B,T,H,chunk_size]={(B, T, H, C)}, got {tuple(A.shape)}")
    for name, t in (("initial_state", initial_state), ("dht", dht)):
        if t is not None and tuple(t.shape) != (B, H, K, V):
            raise ValueError(f"{name} must be [B,H,K,V]={(B, H, K, V)}, got {tuple(t.shape)}")
    if (S0 is None) != (R is None):
        raise ValueError("policy A passes both S0 and R; policy R passes neither")
    if S0 is not None:
        NT = -(-T // C)
        if tuple(S0.shape) != (B, NT, H, K, V):
            raise ValueError(f"S0 must be [B,NT,H,K,V]={(B, NT, H, K, V)}, got {tuple(S0.shape)}")
        if tuple(R.shape) != (B, T, H, V):
            raise ValueError(f"R must be [B,T,H,V]={(B, T, H, V)}, got {tuple(R.shape)}")
    devices = {t.device for t in (q, k, v, A, do, erase, write, g, G, dht, initial_state, S0, R) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    schedule.validate_for(K, V)


def rewy_backward_triton(q, k, v, g, erase, write, A, do, dht, *, scale, initial_state, schedule: Schedule,
                         S0=None, R=None, G=None, Aqk=None, one_beta=False, W=None, gate=None, gate_grads=None,
                         scan_qk=None):
    """ReWY backward of DeltaNet (g None) / GDN (g [B,T,H]) on Triton.

    q, k [B,T,H,K]; v, do [B,T,H,V] (one dtype: fp16/bf16/fp32); g, erase, write [B,T,H]; A = M^{-1}
    [B,T,H,chunk_size] (any float dtype, e.g. FLA's bf16 or the reference's fp32); dht, initial_state None or
    [B,H,K,V]; S0 [B,NT,H,K,V] and R [B,T,H,V] for policy A (None: policy R recomputes them); G the
    natural-log chunk cumsum of g (None: computed here); W [B,T,H,K] in k's dtype, policy A only: the forward's
    W = A E (FLA's w), so no recompute stage runs (None: recomputed). Non-contiguous tensors are made contiguous.

    Returns (dq, dk, dv, dg, d_erase, d_write, dh0): dq, dk, dv in q's dtype; dg in g's dtype (None without a
    gate); d_erase, d_write in erase's / write's dtypes (the erase and write paths of β, returned apart);
    dh0 fp32 (None without an initial state). one_beta=True (erase and write one [B,T,H] tensor, as DeltaNet's,
    GDN's and KDA's β): d_erase is the whole β gradient and d_write None, so one [B,T,H] buffer is held instead of
    two while the consumer runs (the backward's peak), and autograd has no two gradients to add.

    Vector gates (g [B,T,H,K]: KDA, GDN2) go to ``vector_local.rewy_backward_triton_vector`` (same contract, plus
    Aqk: the forward's A_qk [B,T,H,chunk_size] in FLA's convention, read when schedule.dv_local_source is
    "forward"). Scalar gates never read Aqk. gate (vector gates only, a `gate.GateActivation`): g is the raw gate
    input of KDA/GDN2's in-kernel gate, activated inside the chunk cumsum; dg is then the raw input's gradient (in
    g's dtype), and gate_grads (a dict) receives the gradients of the gate's parameters, "A_log" and "dt_bias".
    scan_qk (vector gates only): the forward's (qg, kg) = (Q ⊙ exp(G), K ⊙ exp(G_n − G)), [B,T,H,K] in k's dtype
    (fla-core's save-all keeps them; Schedule.scan_operands "forward"): the reverse scan reads them and no
    scan-operands stage runs. With it pass g, not G.
    """
    if isinstance(g, torch.Tensor) and g.dim() == 4 and g.shape == q.shape:
        from .vector_local import rewy_backward_triton_vector

        if isinstance(schedule, Schedule) and schedule.consumer == "joint_tma":
            raise ValueError("schedule.consumer 'joint_tma' is a DeltaNet/GDN consumer; KDA/GDN2 accept 'joint' or "
                             "'separate'")
        return rewy_backward_triton_vector(q, k, v, g, erase, write, A, do, dht, scale=scale,
                                           initial_state=initial_state, schedule=schedule, S0=S0, R=R, G=G,
                                           Aqk=Aqk, W=W, gate=gate, one_beta=one_beta, gate_grads=gate_grads,
                                           scan_qk=scan_qk)
    if gate is not None:
        raise ValueError("gate: the in-kernel gate activation is fused for vector gates (KDA, GDN2) only")
    _check(q, k, v, g, erase, write, A, do, dht, initial_state, S0, R, G, schedule)
    return run_stages(q, k, v, g, erase, write, A, do, dht, scale=scale, initial_state=initial_state,
                      schedule=schedule, S0=S0, R=R, G=G, W=W, scan_qk=scan_qk, dv_local=run_dv_local,
                      query_side=query_side if _separate_query_side(schedule) else None,
                      consumer=functools.partial(_scalar_consumer, tma=schedule.consumer == "joint_tma",
                                                 dq_first=schedule.consumer_order == "dq_first",
                                                 gamma_t=schedule.column_side == "gamma_t",
                                                 store_p=schedule.p_tiles == "stored",
                                                 k_split=schedule.consumer_k_split, loads=schedule.consumer_loads,
                                                 one_beta=one_beta))


def _separate_query_side(schedule: Schedule) -> bool:
    """Whether dq comes from its own stage: Schedule.dq_stage "separate", read by the joint_tma consumer only."""
    return schedule.dq_stage == "separate" and schedule.consumer == "joint_tma"


def _scalar_consumer(q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, *, tma: bool, dq_first: bool,
                     gamma_t: bool, store_p: bool, k_split: int, loads: str = "at_use", dq=None, gbq=None, dk=None,
                     chunk_ranges=None, dv_out=None, chase=None, **kw):
    """The scalar consumer the schedule names. A "joint_tma" schedule on tensors that TMA cannot address
    (unaligned base or strides) runs the pointer kernel: the same products, results equal to rounding (it forms dq
    itself; a dq from the query-side stage is then not used). The pointer kernel does not chase the scan: launched
    as usual, it runs after it (the scan's programmatic launch only lets a dependent launched as one start early)."""
    if tma and tma_supported(q, k, v, A, R, Rbar, S0, dS1, do):
        return consumer_tma(q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, dq_first=dq_first, gamma_t=gamma_t,
                            store_p=store_p, k_split=k_split, dq=dq, gbq=gbq, dk=dk, chunk_ranges=chunk_ranges,
                            dv_out=dv_out, chase=chase, loads=loads, **kw)
    for _ in chunk_ranges or ():  # the pointer kernel runs once, after the whole reverse scan
        pass
    return run_consumer(q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, **kw)


def side_stream_mode(schedule: Schedule, device: torch.device, stage_before: bool) -> str:
    """The schedule's `side_stream` where it applies, else "none": the tensors are on a GPU and a stage runs before
    the reverse scan for the side stream to overlap (stage_before: the recompute stage or the forward scan, i.e. not
    policy A with the forward's W), or the query-side stage runs beside it (Schedule.dq_stage "separate")."""
    return schedule.side_stream if device.type == "cuda" and stage_before else "none"


# consumer_ranges 0 ("auto"): ranges of at least this many chunks, and only where that gives 4 or more (at most
# 8). Session 18 sweep, DeltaNet A, the consumer's ranges on two streams: (1, 8192, 16) (128 chunks) 1.008x FLA
# in one launch, 1.116x in 4 ranges, 1.143x in 8; (1, 2048, 16) (32 chunks) 1.012x in one, 0.984x in 2, 1.017x in 4
# and 0.794x in 8 (benchmarks/RESULTS.md).
MIN_RANGE_CHUNKS = 16
# The vector consumer's CTA runs ~70 us (DeltaNet's ~30), so shorter ranges pay: session 27 sweep, KDA A, ranges
# with the reverse scan unsplit against the default (the scan split in 4 at B·H = 16, one launch): (1, 2048, 16)
# 0.3799 -> 0.3651 ms in 4 ranges (0.3700 in 8, 0.3881 in 2); (2, 2048, 16) 0.6588 -> 0.6338 in 4; (1, 8192, 16)
# 1.3831 -> 1.2667 in 8 (1.2964 in 4). Where the one-wave rule splits the scan in more than 4 segments (B·H <= 8 at
# 64-wide tiles) the split stays: the unsplit scan's few programs would run alone too long (session 21: KDA A
# (1, 8192, 4) 0.50 ms split, 0.91 unsplit).
VECTOR_MIN_RANGE_CHUNKS = 8
VECTOR_RANGES_MAX_SEGMENTS = 4
# With the query-side stage (dq_stage "separate", policy A with the forward's W), auto takes QUERY_SIDE_RANGES ranges
# where each has QUERY_SIDE_MIN_RANGE_CHUNKS chunks or more and the scan runs unsplit; elsewhere the stage runs beside
# the whole scan. Session 36 sweep, DeltaNet A (once the ranged scan held its carry for its own stream): (1, 8192, 16)
# (128 chunks) 1.159x FLA beside the whole scan, 1.238x in 4 ranges, 1.194x in 8; (1, 2048, 16) (32 chunks) 1.138x,
# 1.046x in 4; (2, 2048, 16) 1.054x, 0.986x in 4 (benchmarks/RESULTS.md).
QUERY_SIDE_RANGES = 4
QUERY_SIDE_MIN_RANGE_CHUNKS = 32


def consumer_range_count(schedule: Schedule, NT: int, *, vector: bool = False, scan_segments: int = 1,
                         query_side: bool = False) -> int:
    """How many chunk ranges the consumer runs in (Schedule.consumer_ranges; read by joint_tma and, for vector gates,
    the joint consumer; 1 for the others). The pipeline uses them only where the reverse scan runs last and alone
    (not beside the forward scan: side_stream "reverse_scan" with a stage before it). scan_segments: the segments the
    reverse scan would split into without ranges (`scan.reverse_scan_segment_count`); the ranges run it unsplit. An
    explicit count and scalar auto take no ranges where it splits; vector auto takes them in place of a split into at
    most VECTOR_RANGES_MAX_SEGMENTS. query_side: the query-side stage runs before the ranges (auto: QUERY_SIDE_RANGES
    where each has QUERY_SIDE_MIN_RANGE_CHUNKS chunks)."""
    if schedule.consumer != ("joint" if vector else "joint_tma"):
        return 1
    if schedule.consumer_ranges:
        return schedule.consumer_ranges if scan_segments == 1 else 1
    if scan_segments > (VECTOR_RANGES_MAX_SEGMENTS if vector else 1):
        return 1
    if query_side:
        return QUERY_SIDE_RANGES if NT >= QUERY_SIDE_RANGES * QUERY_SIDE_MIN_RANGE_CHUNKS else 1
    n = NT // (VECTOR_MIN_RANGE_CHUNKS if vector else MIN_RANGE_CHUNKS)
    return min(8, n) if n >= 4 else 1


# The reverse scan forming dv_local itself (run_stages(scan_aqk=...)) adds one [C, C] x [C, BV] product to every chunk
# step of both passes of a split scan. Session 31 sweep, KDA A: the backward 0.6-2.3 % faster at B·H >= 16 (the scan
# unsplit, in consumer ranges) and 2.4 % at (1, 2048, 4) (8 segments of 4 chunks), but 1.3 % slower at (1, 8192, 4),
# where the scan's 8 segments of 16 chunks took 90.4 -> 102.8 us for the 7.1 us dv_local launch saved
# (benchmarks/RESULTS.md, session 31). So not where the split leaves segments longer than this:
DV_LOCAL_IN_SCAN_MAX_SEGMENT_CHUNKS = 8


def dv_local_in_scan_pays(NT: int, segments: int, n_ranges: int) -> bool:
    """Whether the reverse scan over NT chunks forms dv_local itself rather than after a dv_local stage, given the
    segments it would split into and the consumer ranges that run in place of a split (`run_stages`' scan plan): not
    where it runs split in segments of more than DV_LOCAL_IN_SCAN_MAX_SEGMENT_CHUNKS."""
    return segments == 1 or n_ranges > 1 or triton.cdiv(NT, segments) <= DV_LOCAL_IN_SCAN_MAX_SEGMENT_CHUNKS


# The consumer chasing the reverse scan: where the scan runs last and alone and unsplit (or in consumer ranges in
# place of a split), it runs in one launch, publishing each chunk (`scan.ScanProgress`), and the consumer is launched
# at once after it, as its programmatic dependent, each program waiting for its chunk (`local._wait_for_scan`). The
# ranges' launches per range let consumer CTAs take the SMs the scan's next launch needed (session 18: DeltaNet A
# (1, 2048, 16) gained nothing from 4 ranges). DeltaNet and GDN (joint_tma) only. Off: on the H200 (session 32) it
# gave the bits of the consumer after the scan and replayed in CUDA graphs, and the consumer started with the scan,
# but DeltaNet A was 7-24 % slower. Publishing each chunk cost the scan 0.45 µs a step (48 -> 63 µs at
# (1, 2048, 16)), and on the 68 SMs the scan leaves the consumer still ended 58 µs after it (benchmarks/RESULTS.md).
CONSUMER_CHASES_SCAN = False


def consumer_chases_scan(schedule: Schedule, device: torch.device, *, vector: bool) -> bool:
    """Whether the consumer may chase the reverse scan (CONSUMER_CHASES_SCAN): the joint_tma consumer, on a GPU that
    launches programmatic dependents (`scan.pdl_supported`; a waiting CTA then never holds an SM a scan program
    needs), or off CUDA, where the interpreter runs the launches in order. The caller adds where: the scan last,
    alone and unsplit."""
    return (CONSUMER_CHASES_SCAN and not vector and schedule.consumer == "joint_tma"
            and (device.type != "cuda" or pdl_supported(device)))


# Schedule.reverse_scan_small_grid_block_v: a grid at reverse_scan.block_v of at most this share of the SMs is small.
# DeltaNet (1, 512, 4): 16 programs at 32 wide on 132 SMs; session 38's sweeps (H100, policy A) timed the backward
# 16 wide there 20 % faster, in the same call (RESULTS.md). At B·H = 16 (64 programs) the 16-wide grid takes 128 SMs
# and the query-side stage beside it lost them: level or slower.
SMALL_GRID_SM_SHARE = 4


def small_grid_block_v(schedule: Schedule, programs: int, sms: int, *, whole: bool) -> int:
    """The reverse scan's value-tile width: Schedule.reverse_scan_small_grid_block_v where it is set and narrower than
    reverse_scan.block_v, the scan runs whole (whole: no sequence split, no consumer ranges, no chase) and its grid
    at reverse_scan.block_v (programs) is at most 1 / SMALL_GRID_SM_SHARE of the device's SMs; else
    reverse_scan.block_v."""
    wide, narrow = schedule.reverse_scan.block_v, schedule.reverse_scan_small_grid_block_v
    if 0 < narrow < wide and whole and programs * SMALL_GRID_SM_SHARE <= sms:
        return narrow
    return wide


def chase_streams(device: torch.device):
    """(main, side, second) streams for the consumer ranges beside the reverse scan, or None: off CUDA, or where the
    caller already runs on one of the pipeline's streams (then every launch goes in order on it). The consumer
    ranges alternate between main and second: one range's CTAs (a chunk each, ~30 µs) need not wait for the
    previous range's last ones."""
    if device.type != "cuda":
        return None
    main, side = torch.cuda.current_stream(device), side_stream(device)
    second = _second_stream(device.index if device.index is not None else torch.cuda.current_device())
    return None if main in (side, second) else (main, side, second)


@functools.lru_cache(maxsize=None)
def _second_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def _scan_beside_consumer(launches, streams, gate_made=None, before_ranges=None):
    """The chunk ranges of `reverse_state_scan_ranges`' launches, each scan launch on the side stream, the main
    stream waiting for it before the range is yielded (the consumer launches it there). The scan runs from the last
    chunk, so the consumer of the chunks it has finished runs on the SMs its B·H·V/BV programs leave idle, beside
    the scan of the earlier chunks. streams None (`chase_streams`): all in order on the current stream. gate_made: the
    event of the deferred chunk cumsum on the second stream (`_cumsum_beside`); the main stream waits for it after
    the scan's launches are queued (before, the scan would wait for it too). before_ranges: a stage the consumer
    reads, launched on the main stream once the scan's launches are queued (so the scan does not wait for it) and
    before the first range; the second stream waits for it too (the query-side stage, `run_stages`).

    Memory: the scan's outputs and carry were allocated on the main stream before the fork, and the main stream
    waits for each range before anything it launches reads it, so no allocation crosses streams."""
    if streams is None:
        for i, chunk_range in enumerate(launches):
            if i == 0 and before_ranges is not None:  # (in order: after the first scan range, before its consumer)
                before_ranges()
            yield chunk_range
        return
    main, side, second = streams
    side.wait_stream(main)  # the scan reads dv_local, W, dO, made on the main stream
    second.wait_stream(main)  # the consumer's buffers were allocated (and its inputs made) there
    try:
        # every scan launch is queued first, each with its event: the scan never waits for the host to launch a
        # consumer range between two of its own
        with torch.cuda.stream(side):
            done = [(chunk_range, side.record_event()) for chunk_range in launches]
        if gate_made is not None:  # (the second stream's ranges come after the cumsum in its own order)
            main.wait_event(gate_made)
        if before_ranges is not None:
            before_ranges()  # on the main stream, beside the scan
            second.wait_stream(main)
        for i, (chunk_range, event) in enumerate(done):
            stream = (main, second)[i % 2]
            stream.wait_event(event)
            with torch.cuda.stream(stream):  # the caller launches the range while this generator waits here
                yield chunk_range
    finally:  # also when the consumer raised: nothing is freed while the other streams may still use it
        main.wait_stream(side)
        main.wait_stream(second)


def _cumsum_beside(g, cumsum_args, device):
    """Run the deferred chunk cumsum (`chunk_cumsum(g, **cumsum_args)`, its out buffers allocated on the main stream)
    on the second stream, from the main stream's work so far, and return its event; the consumer's stream must wait
    for it. None: nothing deferred, or no streams to overlap (`chase_streams`), when it runs here in order.

    Its buffers are made on the main stream and written on the second: record_stream keeps their memory from being
    handed out again while the second stream may still write them (also when the backward raises before the wait)."""
    if cumsum_args is None:
        return None
    streams = chase_streams(device)
    if streams is None:
        chunk_cumsum(g, **cumsum_args)
        return None
    main, _, second = streams
    second.wait_stream(main)  # g (and the gate's parameters) were made there
    with torch.cuda.stream(second):
        chunk_cumsum(g, **cumsum_args)
        for t in (cumsum_args["out"], cumsum_args["range_out"]):
            if t is not None and t.is_cuda:  # (the CPU order test drives this path with stand-in streams)
                t.record_stream(second)
        return second.record_event()


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    # torch hands streams out round-robin from a pool per priority: a high-priority one is far less likely to be
    # the caller's own (torch.cuda.graph and the benchmark capture on default-priority streams), and its programs
    # are dispatched first when both streams have work waiting
    return torch.cuda.Stream(device=index, priority=-1)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The pipeline's second stream on this GPU (one per device, reused: a fork costs two event records)."""
    return _side_stream(device.index if device.index is not None else torch.cuda.current_device())


def _check_scan_qk(scan_qk, k, G, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qg, kg, gk) as given for ``run_stages(scan_qk=...)``: [B,T,H,K] tensors qg, kg in k's dtype on its device, for a
    vector gate g whose G the cumsum forms here (it also writes the gate range the consumer's guard reads), and
    optionally gk, the forward's chunk cumsum in log2 units (fp32, same shape; None when the pair is given)."""
    if not isinstance(scan_qk, (tuple, list)) or len(scan_qk) not in (2, 3):
        raise TypeError(f"scan_qk must be a pair (qg, kg) or a triple (qg, kg, gk), got {type(scan_qk).__name__}"
                        + (f" of {len(scan_qk)}" if isinstance(scan_qk, (tuple, list)) else ""))
    if g is None or g.dim() != 4:
        raise ValueError("scan_qk: the forward's gated q and k are per key channel, for vector gates g [B,T,H,K]")
    if G is not None:
        raise ValueError("scan_qk: pass the gate g and no G (the chunk cumsum forms G and the gate range together)")
    for name, t, dtype, what in zip(("qg", "kg", "gk"), scan_qk, (k.dtype, k.dtype, torch.float32),
                                    ("k's dtype", "k's dtype", "fla-core's gate cumsum dtype")):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(k.shape) or t.dtype != dtype \
                or t.device != k.device:
            raise ValueError(f"scan_qk's {name} must be [B,T,H,K]={tuple(k.shape)} in {what} {dtype} on "
                             f"{k.device}, got " + (f"{tuple(t.shape)} in {t.dtype} on {t.device}"
                                                    if isinstance(t, torch.Tensor) else type(t).__name__))
    gk = scan_qk[2].contiguous() if len(scan_qk) == 3 else None
    return scan_qk[0].contiguous(), scan_qk[1].contiguous(), gk


def run_stages(q, k, v, g, erase, write, A, do, dht, *, scale, initial_state, schedule: Schedule, S0, R, G,
               dv_local, consumer, W=None, query_side=None, gate=None, scan_qk=None, dv_local_reads_gate=True,
               scan_aqk=None):
    """The stage order shared by every operator; the gate type only picks the two local stages.

    `dv_local(q, k, G, do, *, scale, chunk_size, BK, BV, num_warps, num_stages, out=None)` and
    `consumer(q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, *, scale, P, D, chunk_size, BK, BV,
    num_warps, num_stages) -> (dq, dk, dv, dg, d_erase, d_write)` (scalar: `local.py`, vector: `vector_local.py`).
    `query_side(q, k, R, S0, G, do, *, scale, chunk_size, BK, BV, num_warps, num_stages) -> (dq, dk_q, Ḡ_q)`
    (Schedule.dq_stage "separate": `query_side.py`): run on the main stream once S0 and R exist (and, policy A with
    the forward's W, after dv_local), beside the side stream's reverse scan; the consumer then takes dq=, dk=, gbq=.
    Policy A with the forward's W and an explicit consumer_ranges > 1: beside the ranged reverse scan instead, before
    the first consumer range (its buffers made first, `query_side(out=)`).
    Inputs are checked by the caller, but for W (policy A's forward W), checked here for both gate kinds. gate: g is the raw gate input (see `rewy_backward_triton`).
    scan_qk (vector gates, Schedule.scan_operands "forward"): (qg, kg), fla-core's saved Q ⊙ exp(G) and
    K ⊙ exp(G_n − G) in the input dtype; the scans read them in place of the scan-operands stage's Q_g, K_t. A
    triple (qg, kg, gk) adds fla-core's own chunk cumsum gk = G·log2 e (fp32, its save-all keeps it): the reverse
    scan then reads Γ_n from it, and where dv_local does not read G either (dv_local_reads_gate False: A_qk from the
    forward) the backward's chunk cumsum runs on a second stream beside dv_local and the scan (`_cumsum_beside`),
    off the path to the scan's first step; the consumer waits for it. scan_aqk (vector gates, the forward's A_qk in
    do's dtype): the reverse scan forms dv_local = A_qkᵀ dO itself, chunk by chunk (`reverse_state_scan(aqk=)`), and
    no dv_local stage runs. Scalar gates with Schedule.dv_local_source "scan": the reverse scan forms A_qk from q, k
    and G as well (`reverse_state_scan(dv_local_from_qk=True)`), and no dv_local stage runs.
    """
    if W is not None:
        if S0 is None:
            raise ValueError("W (the forward's w) comes with policy A: pass S0 and R with it")
        if tuple(W.shape) != tuple(k.shape) or W.dtype != k.dtype or W.device != k.device:
            raise ValueError(f"W must be [B,T,H,K]={tuple(k.shape)} in k's dtype {k.dtype} on {k.device}, got "
                             f"{tuple(W.shape)} in {W.dtype} on {W.device}")
    q, k, v, A, do = (t.contiguous() for t in (q, k, v, A, do))
    erase, write = erase.contiguous(), write.contiguous()
    dht = dht.contiguous() if dht is not None else None
    initial_state = initial_state.contiguous() if initial_state is not None else None
    sc = schedule
    C = sc.chunk_size
    state_dtype = _dtype_of("state_dtype", sc.state_dtype, q.dtype)

    if gate is not None and G is not None:
        raise ValueError("gate: pass the raw gate input g and no G (the cumsum applies the activation)")
    scan_gk = None  # the forward's log2 chunk cumsum: the reverse scan's Γ_n
    if scan_qk is not None:
        *scan_qk, scan_gk = _check_scan_qk(scan_qk, k, G, g)
    gate_range = cumsum_later = None
    if g is None:
        G = None
    elif G is None:
        # with the forward's qg, kg no scan-operands stage runs: the cumsum writes the consumer's gate range
        want_range = scan_qk is not None and vector_local.RANGE_FROM_OPERANDS
        cumsum_args = dict(chunk_size=C, BK=sc.cumsum.block_k, num_warps=sc.cumsum.num_warps, gate=gate,
                           with_range=want_range)
        if scan_gk is not None and not dv_local_reads_gate and vector_local.DEFER_GATE_CUMSUM:
            # only the consumer reads G: the cumsum runs beside dv_local and the scan (below)
            G = torch.empty(g.shape, dtype=torch.float32, device=g.device)
            if want_range:
                gate_range = torch.empty(vector_local.gate_range_shape(g.shape, C), dtype=torch.float32,
                                         device=g.device)
            cumsum_later = dict(cumsum_args, out=G, range_out=gate_range)
        else:
            G = chunk_cumsum(g, **cumsum_args)
            if want_range:
                G, gate_range = G
    else:
        G = G.to(torch.float32).contiguous()
    # Schedule.scan_operands "pregated" (vector gates): K_t and Q_g formed once, here, and read by both scans. They
    # are dropped with W below, after the join: the side stream's reverse scan may read them until then.
    scan_q, scan_k, pregated, q_scaled = q, k, False, True
    vector = G is not None and G.dim() == 4  # a per-channel gate (KDA, GDN2)
    if scan_qk is not None:  # fla-core's qg carries no s: the reverse scan scales dO instead
        (scan_q, scan_k), pregated, q_scaled = scan_qk, True, False
    elif sc.scan_operands in ("pregated", "forward") and vector:  # ("forward" without the forward's: as pregated)
        if vector_local.RANGE_FROM_OPERANDS:  # and the consumer's range guard reads G's per-chunk max and min
            scan_q, scan_k, gate_range = gated_scan_operands(q, k, G, scale=scale, chunk_size=C, with_range=True)
        else:
            scan_q, scan_k = gated_scan_operands(q, k, G, scale=scale, chunk_size=C)
        pregated = True

    # Stages on a second stream (Schedule.side_stream). Every tensor the side stream reads or writes is held here
    # until the join, which an exception takes too, and each fork waits on all the main stream's work so far.
    # dv_local's output is allocated on the main stream. The reverse scan's outputs come from the side stream's
    # pool: record_stream keeps their memory from being handed out again on the side stream while the consumer,
    # or the caller with dh0, may still read them on the main stream.
    # The query-side stage with consumer ranges (policy A with the forward's W; an explicit count, or auto's
    # QUERY_SIDE_RANGES where the scan runs unsplit): the reverse scan runs in chunk ranges as without it, and the
    # stage on the main stream beside them, before the first consumer range (`_scan_beside_consumer`); otherwise it
    # takes the side stream's scan beside it
    NT = triton.cdiv(q.shape[1], C)
    G_scan = scan_gk if scan_gk is not None else G  # the gate the scans read

    @functools.cache  # (asked once per split program limit)
    def reverse_segments(limit: int) -> int:
        """The segments the reverse scan would split into under this split program limit."""
        return reverse_scan_segment_count(k, G_scan, v.shape[-1], chunk_size=C, BV=sc.reverse_scan.block_v,
                                          num_segments=sc.reverse_scan_segments, split_max_programs=limit)

    query_in_ranges = (query_side is not None and W is not None and S0 is not None
                       and consumer_range_count(sc, NT, query_side=True) > 1)
    if query_in_ranges and not sc.consumer_ranges:  # auto: only where the scan runs unsplit, else beside it whole
        query_in_ranges = reverse_segments(split_program_limit(sc.scan_split_waves, k.device)) == 1
    mode = side_stream_mode(sc, k.device, W is None or S0 is None or (query_side is not None and not query_in_ranges))
    main = torch.cuda.current_stream(k.device) if mode != "none" else None
    side = side_stream(k.device) if mode != "none" else None
    if side is not None and side == main:  # the caller already runs on our stream: nothing to overlap
        mode, main, side = "none", None, None
    split_limit = split_program_limit(sc.scan_split_waves, k.device)
    if mode == "reverse_scan":
        # the two scans run at once and share the SMs: each splits as if it had half of them. Session 16 sweep,
        # DeltaNet (1, 2048, 4) R: reverse scan in 4 segments beside the forward's 4 (64 + 64 programs) 0.081 ms,
        # in 8 (64 + 128) 0.088 ms (benchmarks/RESULTS.md)
        split_limit = max(1, split_limit // 2) if split_limit > 0 else 0  # (0 means no limit)
    dl, rs = sc.dv_local, sc.reverse_scan

    # The reverse scan's plan: the segments it would split into, and the consumer's chunk ranges (Schedule.
    # consumer_ranges), which run it unsplit in place of such a split where it runs last and alone (not beside the
    # forward scan)
    n_ranges = (1 if mode == "reverse_scan"  # as if it did not split
                else consumer_range_count(sc, NT, vector=vector, query_side=query_in_ranges))
    may_chase = (mode != "reverse_scan" and sc.reverse_scan_layout == "kv"  # (only the "kv" scan publishes)
                 and consumer_chases_scan(sc, k.device, vector=vector))
    chase = None  # the scan's per-chunk counters, where the consumer chases it (one scan launch, unsplit)
    if n_ranges > 1 or scan_aqk is not None or may_chase:  # (only then: what it would split into)
        segments = reverse_segments(split_limit)
        if n_ranges > 1:  # whether its split rules them out
            n_ranges = consumer_range_count(sc, NT, vector=vector, scan_segments=segments, query_side=query_in_ranges)
        if scan_aqk is not None and not dv_local_in_scan_pays(NT, segments, n_ranges):
            scan_aqk = None  # dv_local runs as its own stage
        if may_chase and (segments == 1 or n_ranges > 1):  # in place of the ranges, unsplit as they are
            chase, n_ranges = scan_progress(k, v.shape[-1], chunk_size=C, BV=rs.block_v), 1
    # Schedule.reverse_scan_small_grid_block_v: a narrower value tile where the scan runs whole on a small grid (it
    # then stays whole: twice the programs would change what the split rule allows)
    scan_bv = rs.block_v
    if sc.reverse_scan_small_grid_block_v and n_ranges == 1 and chase is None:
        programs = triton.cdiv(v.shape[-1], rs.block_v) * q.shape[0] * q.shape[2]
        scan_bv = small_grid_block_v(sc, programs, device_sms(k.device), whole=reverse_segments(split_limit) == 1)
    # Schedule.dv_local_source "scan" (scalar gates): the reverse scan forms A_qk and dv_local in each chunk step
    qk_in_scan = not vector and sc.dv_local_source == "scan"
    dvl_in_scan = scan_aqk is not None or qk_in_scan
    scan_args = dict(scale=scale, chunk_size=C, BK=rs.block_k, BV=scan_bv, num_warps=rs.num_warps,
                     num_stages=rs.num_stages, state_dtype=state_dtype, want_dh0=initial_state is not None,
                     num_segments=1 if chase is not None or scan_bv != rs.block_v else sc.reverse_scan_segments,
                     split_max_programs=split_limit, pregated=pregated, q_scaled=q_scaled,
                     gate_log2=scan_gk is not None, aqk=scan_aqk, progress=chase, layout=sc.reverse_scan_layout,
                     dv_local_from_qk=qk_in_scan, state_rows=sc.scan_state_rows,
                     qdo=sc.reverse_scan_qdo)

    qc = sc.consumer_cfg  # the query-side stage takes the consumer's tiles, but for Schedule.query_side_block_v
    query_args = dict(scale=scale, chunk_size=C, BK=qc.block_k, BV=sc.query_side_block_v or qc.block_v,
                      num_warps=qc.num_warps, num_stages=qc.num_stages)

    def run_reverse_scan(dvl):
        return reverse_state_scan(scan_q, scan_k, W, G_scan, do, dvl, dht, **scan_args)

    gate_made = _cumsum_beside(g, cumsum_later, k.device)  # (None: in order, or nothing deferred)

    dS1 = Rbar = dh0 = None
    dq_made = None  # (dq, dk's query part, Ḡ_q) from the query-side stage
    # Policy A with the forward's W: only dv_local runs before the reverse scan, and the scan's first step needs it.
    # dv_local then runs first on the main stream, and the query-side stage after it, beside the scan: started
    # together with dv_local it held the SMs the scan's programs wait for (session 17, DeltaNet A (1, 2048, 16): the
    # stages' device times added up, 1 % faster in all)
    lone_scan = W is not None and S0 is not None
    try:
        dvl = None  # (scan_aqk, qk_in_scan: the reverse scan forms dv_local)
        if side is not None and not dvl_in_scan:  # fork: dv_local reads q, k, G and dO only
            dvl = torch.empty_like(do)
            if not lone_scan:
                side.wait_stream(main)
            with torch.cuda.stream(main if lone_scan else side):
                dv_local(q, k, G, do, scale=scale, chunk_size=C, BK=dl.block_k, BV=dl.block_v,
                         num_warps=dl.num_warps, num_stages=dl.num_stages, out=dvl)
        rc = sc.recompute
        if W is None:
            # policy A brings R = U − W S0 from the forward: only W is needed (the reverse scan's −WᵀR̄)
            W, U = recompute_wu(k, v, G, erase, write, A, chunk_size=C, BK=rc.block_k, BV=rc.block_v,
                                num_warps=rc.num_warps, num_stages=rc.num_stages, want_u=S0 is None)
        else:  # schedule.w_source "forward": the forward's W, no recompute stage
            W, U = W.contiguous(), None
        if mode == "reverse_scan":  # the reverse scan reads W and dv_local, never S0 or R: beside the forward scan
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dS1, Rbar, dh0 = run_reverse_scan(dvl)
        if S0 is None:
            fs = sc.forward_scan
            S0, R = forward_state_scan(scan_k, W, U, G, initial_state, chunk_size=C, BK=fs.block_k, BV=fs.block_v,
                                       num_warps=fs.num_warps, num_stages=fs.num_stages, state_dtype=state_dtype,
                                       num_segments=sc.forward_scan_segments, split_max_programs=split_limit,
                                       pregated=pregated, state_rows=sc.scan_state_rows)
        else:  # policy A: the vector consumer takes S0 as it comes (it reads FLA's V-first h in place)
            S0, R = (S0 if vector else S0.contiguous()), R.contiguous()
        del U
        if query_side is not None and not query_in_ranges:  # reads S0, R, never the reverse scan's outputs: beside
            dq_made = query_side(q, k, R, S0, G, do, **query_args)  # it on the main stream
    finally:
        if side is not None:
            main.wait_stream(side)  # join: the reverse scan (or, after it, the consumer) reads the side's results
    if mode == "reverse_scan":  # the side stream made them
        for t in (dS1, Rbar, dh0):
            if t is not None and t.is_cuda:  # (the CPU order test drives this path with stand-in streams)
                t.record_stream(main)
    if side is None and not dvl_in_scan:
        dvl = dv_local(q, k, G, do, scale=scale, chunk_size=C, BK=dl.block_k, BV=dl.block_v,
                       num_warps=dl.num_warps, num_stages=dl.num_stages)
    ranges = dv_out = None  # Schedule.consumer_ranges: the consumer's chunk ranges, each after the scan's
    if mode != "reverse_scan":
        if n_ranges > 1:
            # unsplit: the ranges run in place of a split (vector auto, `consumer_range_count`)
            dS1, Rbar, dh0, launches = reverse_state_scan_ranges(scan_q, scan_k, W, G_scan, do, dvl, dht,
                                                                 num_ranges=n_ranges,
                                                                 **{**scan_args, "num_segments": 1})
            run_query_side = None
            if query_in_ranges:  # its buffers made here, on the main stream, for the consumer call below
                dq_made = query_side_buffers(q, k, G)
                run_query_side = functools.partial(query_side, q, k, R, S0, G, do, out=dq_made, **query_args)
            ranges = _scan_beside_consumer(launches, chase_streams(k.device), gate_made, before_ranges=run_query_side)
            gate_made = None  # the first range waits for it
            dv_out = dvl  # dv over dv_local (do's dtype, which v shares), range by range (None: a new buffer)
        else:
            if query_in_ranges:  # (the scan's split ruled the ranges out: the stage in order, before the scan, whose
                dq_made = query_side(q, k, R, S0, G, do, **query_args)  # next launch may be a consumer chasing it)
            dS1, Rbar, dh0 = run_reverse_scan(dvl)
            if chase is not None:  # dv over dv_local, whose rows of a chunk the scan has read before publishing it
                dv_out = dvl
    # (chunk ranges: the scan's launches hold them until the last range has run; a chasing consumer's `chase` holds
    # what the scan reads until the consumer is launched, ScanProgress.reads)
    del dvl, W, scan_q, scan_k, scan_qk, scan_gk, G_scan
    if gate_made is not None:  # the deferred cumsum's G and gate range
        torch.cuda.current_stream(k.device).wait_event(gate_made)

    P = D = None
    if sc.consumer == "separate":
        pr = sc.producer
        P, D = run_producer(A, Rbar, R, chunk_size=C, BV=pr.block_v, num_warps=pr.num_warps,
                            num_stages=pr.num_stages, pd_dtype=_dtype_of("pd_dtype", sc.pd_dtype, q.dtype))
    cc = sc.consumer_cfg
    given = {} if dq_made is None else {"dq": dq_made[0], "dk": dq_made[1], "gbq": dq_made[2]}
    if ranges is not None:
        given.update(chunk_ranges=ranges, dv_out=dv_out)
    if chase is not None:  # the next launch on this stream: nothing may run between the scan and it
        given.update(chase=chase, dv_out=dv_out)
    if gate_range is not None:
        given["gate_range"] = gate_range
    dq, dk, dv, dg, d_erase, d_write = consumer(
        q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do, scale=scale, P=P, D=D, chunk_size=C,
        BK=cc.block_k, BV=cc.block_v, num_warps=cc.num_warps, num_stages=cc.num_stages, **given)

    # the consumers return dg itself: Ḡ's reverse in-chunk cumsum is formed in the program that holds the chunk
    if gate is None:  # with the in-kernel gate the caller takes dg on (vector_local: to the raw gate input)
        dg = dg.to(g.dtype) if g is not None else None
    return dq, dk, dv, dg, d_erase, d_write, dh0
