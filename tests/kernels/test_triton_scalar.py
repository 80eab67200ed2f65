"""ReWY Triton backward for DeltaNet and GDN (`kernels/triton/pipeline.py`) against the float64 torch oracle
(`kernels/reference`: chunk_forward + rewy_backward). CPU runs go through the Triton interpreter; the `gpu`
tests repeat the checks at the benchmark shapes (K = V = 128, bf16) and check determinism and graph replay.

Thresholds are the project's gates (architecture.md): relative RMS ≤ 0.8 % for ordinary tensors, ≤ 2 % for
dg / d_erase / d_write (β). Never loosen them.
"""

import os

if not os.environ.get("REWY_TEST_NO_INTERPRET"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from rewy_tune.kernels.reference.chunk_forward import chunk_forward
from rewy_tune.kernels.reference.rewy_backward import rewy_backward
from rewy_tune.kernels.triton.pipeline import rewy_backward_triton
from rewy_tune.schedule import Schedule, StageConfig

from cuda_graphs import capture
from kernel_gates import GATE, GATE_LIKE, NAMES, ORDINARY, assert_gates, assert_same_bits, bf16_gate_factor, rel_rms
from launch_spy import spy_kernel_launches
from stand_in_streams import stand_in_streams

# Small tiles keep the interpreter fast; the scans hold all K rows (block_k >= K).
BASE = Schedule(
    recompute=StageConfig(32, 32, 4, 2), forward_scan=StageConfig(64, 32, 4, 2),
    dv_local=StageConfig(32, 32, 4, 2), reverse_scan=StageConfig(64, 32, 4, 2),
    producer=StageConfig(32, 32, 4, 2), consumer_cfg=StageConfig(32, 32, 4, 2), cumsum=StageConfig(32, 32, 4, 1),
)
OTHERS = {
    "separate-fp32-bk16": BASE.replace(consumer="separate", pd_dtype="fp32", consumer_cfg={"block_k": 16, "block_v": 16}),
    "separate-input-bv64": BASE.replace(consumer="separate", pd_dtype="input", producer={"block_v": 64},
                                        consumer_cfg={"block_k": 64, "block_v": 64}, dv_local={"block_k": 16, "block_v": 64}),
    "tma-bk16-bv32": BASE.replace(consumer="joint_tma", consumer_cfg={"block_k": 16, "block_v": 32}),
    "tma-dq-first": BASE.replace(consumer="joint_tma", consumer_order="dq_first", consumer_cfg={"block_k": 16}),
    "tma-gamma-t": BASE.replace(consumer="joint_tma", column_side="gamma_t", consumer_cfg={"block_k": 16}),
    "tma-p-stored": BASE.replace(consumer="joint_tma", consumer_order="dq_first", column_side="gamma_t",
                                 p_tiles="stored", consumer_cfg={"block_k": 16}),
    "tma-k-split": BASE.replace(consumer="joint_tma", consumer_order="dq_first", column_side="gamma_t",
                                consumer_k_split=2, consumer_cfg={"block_k": 16}),
    # the reverse scan's state transposed (scan.rewy_bwd_scan_vk_kernel), with the descriptor consumer
    "rscan-vk": BASE.replace(reverse_scan_layout="vk", consumer="joint_tma", consumer_cfg={"block_k": 16}),
    # dv_local formed in the reverse scan's chunk steps (no dv_local stage), also with the query-side stage and
    # chunk ranges (under A, where the scan runs last and alone) and with a split scan
    "dvl-in-scan": BASE.replace(dv_local_source="scan"),
    "dvl-in-scan-tma-ranges": BASE.replace(dv_local_source="scan", consumer="joint_tma", dq_stage="separate",
                                           consumer_ranges=2, chunk_size=32, consumer_cfg={"block_k": 16}),
    "dvl-in-scan-split": BASE.replace(dv_local_source="scan", reverse_scan_segments=2, scan_split_waves=0,
                                      chunk_size=32),
}


@pytest.fixture(autouse=True)
def nan_poison(monkeypatch):
    """Every torch.empty / empty_like inside the kernels' launchers starts as NaN (catches unwritten tiles)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(x):
        if x.is_floating_point():
            x.fill_(float("nan"))
        return x

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(empty_like(*a, **kw)))


def make_inputs(op, B, T, H, K, V, *, dtype=torch.float32, device="cpu", seed=0, h0=True, dht=True,
                beta_zero=False, gate_div=4.0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q = r(B, T, H, K)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    beta = torch.rand(B, T, H, generator=gen)
    if beta_zero:
        beta = beta * (torch.rand(B, T, H, generator=gen) < 0.5)  # exact zeros mixed with O(1)
        beta[:, : T // 2] = 0.0
    g = F.logsigmoid(r(B, T, H)) / gate_div if op == "gdn" else None
    do = r(B, T, H, V)
    h = r(B, H, K, V) if h0 else None
    dh = r(B, H, K, V) if dht else None
    cast = lambda x, dt=dtype: None if x is None else x.to(device=device, dtype=dt)
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g, torch.float32), beta=cast(beta), do=cast(do),
                h0=cast(h, torch.float32), dht=cast(dh, torch.float32))


def oracle(x, C=64):
    """float64 forward + ReWY backward of the torch reference (separate erase/write parts), on the inputs'
    device (on the GPU the float64 reference at the benchmark shapes takes seconds, on the host minutes)."""
    d = {n: (t.double() if t is not None else None) for n, t in x.items()}
    scale = d["q"].shape[-1] ** -0.5
    fwd = chunk_forward(d["q"], d["k"], d["v"], d["g"], d["beta"], d["beta"], scale=scale,
                        initial_state=d["h0"], chunk_size=C)
    gr = rewy_backward(d["q"], d["k"], d["v"], d["g"], d["beta"], d["beta"], fwd, d["do"], d["dht"], scale=scale,
                       initial_state=d["h0"], chunk_size=C, policy="R")
    return dict(dq=gr.dq, dk=gr.dk, dv=gr.dv, dg=gr.dg, d_erase=gr.d_erase, d_write=gr.d_write, dh0=gr.dh0)


def run_triton(x, schedule, policy="R"):
    """Forward through the torch reference in the input's working dtype (as the CPU autograd Function does),
    then the Triton backward."""
    scale = x["q"].shape[-1] ** -0.5
    fwd = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=scale, initial_state=x["h0"],
                        chunk_size=schedule.chunk_size, save_states=policy == "A")
    kw = dict(S0=fwd.S0, R=fwd.R.to(x["q"].dtype), G=fwd.G) if policy == "A" else {}
    if policy == "A" and schedule.w_source == "forward":  # as the autograd Function passes it
        kw["W"] = fwd.W
    out = rewy_backward_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], fwd.A, x["do"], x["dht"],
                               scale=scale, initial_state=x["h0"], schedule=schedule, **kw)
    return dict(zip(NAMES, out))


# ----------------------------------------------------------------------------------------------------------
# correctness against the oracle


@pytest.mark.parametrize("op,policy", [("gdn", "R"), ("deltanet", "A")])
def test_one_beta_returns_the_whole_beta_gradient(op, policy):
    # DeltaNet/GDN pass one β as erase and write: with one_beta the consumer stores d_erase + d_write in one buffer
    # (one [B,T,H] tensor fewer at the backward's peak) and d_write is None; the sum is held to the gate threshold.
    x = make_inputs(op, 1, 100, 2, 32, 32, seed=23)
    scale = 32 ** -0.5
    fwd = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=scale, initial_state=x["h0"],
                        chunk_size=BASE.chunk_size, save_states=policy == "A")
    kw = dict(S0=fwd.S0, R=fwd.R, G=fwd.G) if policy == "A" else {}
    out = rewy_backward_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], fwd.A, x["do"], x["dht"],
                               scale=scale, initial_state=x["h0"], schedule=BASE, one_beta=True, **kw)
    got = dict(zip(NAMES, out))
    ref = oracle(x)
    assert got["d_write"] is None
    assert rel_rms(got["d_erase"], ref["d_erase"] + ref["d_write"]) <= GATE
    for n in ("dq", "dk", "dv"):
        assert rel_rms(got[n], ref[n]) <= ORDINARY, n


def test_one_beta_bad_input_is_refused():
    x = make_inputs("gdn", 1, 64, 1, 32, 32, seed=3)
    fwd = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=1.0, initial_state=None)
    kw = dict(scale=1.0, initial_state=None, schedule=BASE, one_beta=True)
    g_vec = x["g"][..., None].expand_as(x["q"]).contiguous()
    b_vec = x["beta"][..., None].expand_as(x["q"]).contiguous()  # GDN2's b: a vector erase path
    with pytest.raises(ValueError, match="one_beta: erase and write must be one"):
        rewy_backward_triton(x["q"], x["k"], x["v"], g_vec, b_vec, b_vec, fwd.A, x["do"], None, **kw)
    with pytest.raises(ValueError, match="one_beta: erase and write must share a dtype"):
        rewy_backward_triton(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"].half(), fwd.A, x["do"], None,
                             **kw)


@pytest.mark.parametrize("K", [32, 64])
@pytest.mark.parametrize("T", [64, 100, 128])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_default_schedule(op, T, K):
    policy = "A" if (T + K) % 3 == 0 else "R"  # both policies across the grid; each also has its own test
    x = make_inputs(op, 1, T, 2, K, K, seed=T + K)
    out = run_triton(x, BASE, policy)
    for n in ("dq", "dk", "dv"):
        assert out[n].dtype == torch.float32
    assert_gates(out, oracle(x), ctx=f"{op} T{T} K{K} {policy}")


@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("name", list(OTHERS))
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_other_schedules(op, name, policy):
    x = make_inputs(op, 2, 100, 1, 32, 64, seed=7)  # K ≠ V, tail chunk of 36 rows
    assert_gates(run_triton(x, OTHERS[name], policy), oracle(x), ctx=f"{op} {name} {policy}")



@pytest.mark.parametrize("consumer", ["joint", "separate", "joint_tma"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_consumer_several_k_tiles(op, consumer):
    # The consumer's n×n phase runs once per chunk and its K loop is a run-time loop: several K tiles
    # (block_k 16 < K = 48), K ≠ V, a tail chunk, both consumer modes; joint and separate must agree closely.
    x = make_inputs(op, 1, 100, 2, 48, 32, seed=29)
    s = BASE.replace(consumer=consumer, consumer_cfg={"block_k": 16, "block_v": 16})
    out = run_triton(x, s)
    assert_gates(out, oracle(x), ctx=f"{op} {consumer} bk16 K48")
    other = run_triton(x, s.replace(consumer="separate" if consumer == "joint" else "joint"))
    for n in NAMES:
        if out[n] is not None:
            assert rel_rms(out[n], other[n]) <= 1e-4, n


def _consumer_args(gate, dtype, B=1, T=100, H=2, K=32, V=64, C=64):
    """Random inputs of the scalar consumer launchers: (q, k, v, G, erase, write, A, R, Rbar, S0, dS1, do)."""
    gen = torch.Generator().manual_seed(41)
    NT = -(-T // C)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    q, k = r(B, T, H, K), r(B, T, H, K)
    v, R, Rbar, do = (r(B, T, H, V) for _ in range(4))
    A, S0, dS1 = r(B, T, H, C), r(B, NT, H, K, V, dt=torch.float32), r(B, NT, H, K, V, dt=torch.float32)
    G = (-torch.rand(B, T, H, generator=gen)).cumsum(1) if gate else None
    e, w = torch.rand(B, T, H, generator=gen).to(dtype), torch.rand(B, T, H, generator=gen).to(dtype)
    return q, k, v, G, e, w, A, R, Rbar, S0, dS1, do


@pytest.mark.parametrize("dq_first, gamma_t, store_p, k_split", [
    (False, False, False, 1), (True, False, False, 1), (False, True, False, 1), (True, True, False, 1),
    (False, False, True, 1), (True, True, True, 1),
    (False, False, False, 2), (True, True, False, 2), (True, True, False, 4), (True, True, True, 2)])
@pytest.mark.parametrize("one_beta", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", [True, False])
def test_tma_consumer_equals_pointer_consumer(gate, dtype, one_beta, dq_first, gamma_t, store_p, k_split):
    # The descriptor kernel computes the pointer kernel's products (in its order, or "dq_first": dq and dk's column
    # side before Ē_dir and K̄_t; with P's tiles kept from phase 1 or formed again; with k_split programs per chunk,
    # each over its share of the K tiles, the row gradients summed from parts): on the interpreter the two agree
    # to fp32 rounding (numpy may pick another summation order for a transposed operand view; measured ≤ 3e-8),
    # tail chunk (T = 100), several K and V tiles and K ≠ V included. With k_split 2, K = 48 in three 16-wide tiles
    # (shares of two and one); with k_split 4, K = 80 in five (shares of two, two, one and none).
    from rewy_tune.kernels.triton.consumer_tma import consumer_tma
    from rewy_tune.kernels.triton.local import consumer

    args = _consumer_args(gate, dtype, K={1: 32, 2: 48, 4: 80}[k_split])
    kw = dict(scale=0.3, chunk_size=64, BK=16, BV=32, one_beta=one_beta)
    ours = consumer(*args, **kw)
    tma = consumer_tma(*args, **kw, dq_first=dq_first, gamma_t=gamma_t, store_p=store_p, k_split=k_split)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "d_erase", "d_write"), ours, tma):
        assert (a is None) == (b is None), name
        if a is not None:
            assert not a.isnan().any() and not b.isnan().any(), name
            assert rel_rms(b, a) <= 1e-6, name


def _tma_consumer_launches(monkeypatch) -> list:
    """The descriptor consumer's launches from here on, as (grid, positional arguments); the kernel still runs."""
    from rewy_tune.kernels.triton import consumer_tma as ct

    launches = []
    real = ct.rewy_bwd_kernel_consumer_tma

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, args))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ct, "rewy_bwd_kernel_consumer_tma", Spy())
    return launches


def test_k_split_programs_share_the_chunk_scratches(monkeypatch):
    # Γ's and P's scratches are one per chunk whatever k_split (the chunk's programs store the same bits there):
    # a slot per program put DeltaNet A's peak backward memory 0.4 % over FLA's at B·H = 4 (session 17)
    from rewy_tune.kernels.triton import consumer_tma as ct

    launches = _tma_consumer_launches(monkeypatch)
    args = _consumer_args(True, torch.bfloat16, K=48)
    kw = dict(scale=0.3, chunk_size=64, BK=16, BV=32, gamma_t=True, store_p=True)
    one = ct.consumer_tma(*args, **kw, k_split=1)
    two = ct.consumer_tma(*args, **kw, k_split=2)
    sizes = [(grid[2], a[16].numel(), a[17].numel()) for grid, a in launches]  # programs per chunk, gam, pst
    assert [k for k, _, _ in sizes] == [1, 2] and sizes[0][1:] == sizes[1][1:]
    for name, a, b in zip(("dq", "dk", "dv", "dg", "d_erase", "d_write"), one, two):
        if a is not None:
            assert not b.isnan().any() and rel_rms(b, a) <= 1e-6, name


def test_k_split_bad_arguments_and_clamp(monkeypatch):
    # k_split outside (0, 1, 2, 4) is refused; above the K tile count it is lowered to it (one program per tile)
    from rewy_tune.kernels.triton import consumer_tma as ct

    args = _consumer_args(True, torch.float32)
    kw = dict(scale=0.3, chunk_size=64, BK=16, BV=32)
    with pytest.raises(ValueError, match=r"k_split must be one of \(0, 1, 2, 4\), got 3"):
        ct.consumer_tma(*args, **kw, k_split=3)
    launches = _tma_consumer_launches(monkeypatch)
    ct.consumer_tma(*args, **kw, k_split=4)  # K = 32: two 16-wide tiles
    assert [grid for grid, _ in launches] == [(2, 2, 2)]


@pytest.mark.parametrize("chunks,num_warps,K,want", [
    (4, 4, 128, 2), (8, 4, 128, 2), (9, 4, 128, 1),  # 4 warps: 2 CTAs per SM, 16 on the interpreter's 8 "SMs"
    (4, 8, 128, 2), (5, 8, 128, 1),                   # 8 warps: 1 CTA per SM
    (4, 4, 16, 1),                                    # one K tile: nothing to share
])
def test_k_split_auto_chooses_from_the_grid(chunks, num_warps, K, want):
    # "auto" (0): two programs per chunk where twice the grid still fits in one wave of the consumer's CTAs
    from rewy_tune.kernels.triton.local import programs_per_chunk

    assert programs_per_chunk(0, K, 16, chunks=chunks, num_warps=num_warps, device=torch.device("cpu")) == want
    assert programs_per_chunk(2, K, 16, chunks=10 ** 6, num_warps=num_warps) == min(2, K // 16)  # explicit: kept


def test_k_split_auto_runs_split_on_small_grids(monkeypatch):
    # the launcher takes auto's choice: T = 100 at chunk 64, B·H = 2 (4 chunks) splits; the gates hold
    launches = _tma_consumer_launches(monkeypatch)
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=67)
    s = BASE.replace(consumer="joint_tma", consumer_k_split=0, consumer_cfg={"block_k": 16}, chunk_size=64)
    assert_gates(run_triton(x, s), oracle(x, C=64), ctx="k_split auto")
    assert [grid for grid, _ in launches] == [(2, 2, 2)]


def test_tma_consumer_falls_back_on_unaligned_tensors(monkeypatch):
    # TMA needs 16-byte aligned bases: q at a 4-byte offset runs the pointer kernel, with the same gates
    from rewy_tune.kernels.triton import consumer_tma as ct
    from rewy_tune.kernels.triton import pipeline

    x = make_inputs("gdn", 1, 100, 1, 32, 32, seed=43)
    flat = torch.empty(x["q"].numel() + 1)
    q = flat[1:].view_as(x["q"])
    q.copy_(x["q"])
    assert q.is_contiguous() and not ct.tma_supported(q) and ct.tma_supported(x["q"])
    calls = []
    monkeypatch.setattr(pipeline, "consumer_tma", lambda *a, **kw: calls.append(1))
    out = run_triton({**x, "q": q}, BASE.replace(consumer="joint_tma"))
    assert not calls
    assert_gates(out, oracle(x), ctx="joint_tma on an unaligned q")
    # called directly, the descriptor launcher refuses such a tensor by name of the rule
    args = list(_consumer_args(True, torch.float32))
    shifted = torch.empty(args[0].numel() + 1)[1:].view_as(args[0])
    with pytest.raises(ValueError, match="16-byte aligned"):
        ct.consumer_tma(shifted, *args[1:], scale=1.0)
    with pytest.raises(ValueError, match="P and D must be None"):
        ct.consumer_tma(*args, scale=1.0, P=args[7], D=args[6])


@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_no_initial_state_no_dht(op):
    x = make_inputs(op, 1, 100, 2, 32, 32, seed=3, h0=False, dht=False)
    out = run_triton(x, BASE)
    assert out["dh0"] is None
    assert_gates(out, oracle(x), ctx=f"{op} no h0/dht")


@pytest.mark.parametrize("name", ["separate-fp32-bk16", "tma-bk16-bv32", "tma-dq-first", "tma-gamma-t", "tma-p-stored"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_beta_zero(op, name):
    x = make_inputs(op, 1, 100, 1, 32, 32, seed=5, beta_zero=True)
    assert_gates(run_triton(x, OTHERS[name]), oracle(x), ctx=f"{op} beta zero {name}")


@pytest.mark.parametrize("consumer, order, column, p_tiles", [("joint", "fused", "scratch", "recompute"),
                                                            ("joint_tma", "fused", "scratch", "recompute"),
                                                            ("joint_tma", "dq_first", "scratch", "recompute"),
                                                            ("joint_tma", "dq_first", "gamma_t", "recompute"),
                                                            ("joint_tma", "fused", "scratch", "stored")])
def test_strong_decay_gdn(consumer, order, column, p_tiles):
    # g ≈ logsigmoid(N)·4: chunk gate ranges far past exp's fp32 range if Λ were split into exp(G_i)·exp(−G_j).
    x = make_inputs("gdn", 1, 128, 1, 32, 32, seed=11, gate_div=0.25)
    s = BASE.replace(consumer=consumer, consumer_order=order, column_side=column, p_tiles=p_tiles)
    assert_gates(run_triton(x, s), oracle(x), ctx=f"gdn strong decay {consumer} {order} {column} {p_tiles}")


def test_single_partial_chunk():
    x = make_inputs("gdn", 1, 10, 1, 32, 32, seed=2)
    assert_gates(run_triton(x, BASE, "A"), oracle(x), ctx="gdn T10")


# Each field changed alone from BASE (both values pass the gate). chunk_size is checked at 32.
FIELD_CHANGES = {
    "chunk_size": 32,
    "recompute": {"block_k": 16, "block_v": 64, "num_warps": 2},
    "forward_scan": {"block_k": 32, "block_v": 16},
    "dv_local": {"block_k": 16, "block_v": 16},
    "reverse_scan": {"block_v": 64, "num_warps": 8},
    "producer": {"block_v": 16},  # read in separate mode: paired with consumer="separate" below
    "consumer_cfg": {"block_k": 16, "block_v": 64},
    "cumsum": {"num_warps": 1},
    "state_dtype": "input",
    "consumer": "separate",
    "pd_dtype": "input",  # read in separate mode
    "intra": "centred",
    "intra_precision": "tf32x3",  # read by vector gates only (test_triton_vector.py)
    "dv_local_source": "scan",  # vector gates read "forward" too (test_triton_vector.py)
    "forward_scan_segments": 2,
    "reverse_scan_segments": 3,
    "scan_split_waves": 1,  # a limit on the split: its effect is asserted in test_split_waves_limit_the_split
    "consumer_order": "dq_first",  # read by joint_tma: paired with it below
    "column_side": "gamma_t",  # read by joint_tma: paired with it below
    "p_tiles": "stored",  # read by joint_tma: paired with it below
    "w_source": "forward",  # read under policy A only (POLICY_FOR); see also test_policy_a_takes_the_forward_w
    "side_stream": "reverse_scan",  # read on CUDA only (here every stage runs in order): test_gpu_side_stream
    "consumer_k_split": 2,  # read by joint_tma, and only where K has two tiles: both paired with it below
    "dq_stage": "separate",  # read by joint_tma: paired with it below; see also test_query_side_stage
    "consumer_ranges": 2,  # read by joint_tma: paired with it below; see also test_consumer_ranges_*
    "scan_operands": "pregated",  # read by vector gates only (test_triton_vector.py); scalar gates ignore it
    "consumer_v_stages": 2,  # read by the vector consumers only (test_triton_vector.py); scalar gates ignore it
    "reverse_scan_layout": "vk",  # see also test_reverse_state_scan_transposed (test_triton_shared_stages.py)
    "scan_state_rows": 128,  # at K = 128 (PROBLEM_FOR; K ≤ 64 keeps one block), its launches checked (LAUNCH_FOR)
    "reverse_scan_qdo": "ahead",  # DeltaNet's (PROBLEM_FOR; GDN's scan forms Qᵀ dO in its step), launches checked
    # at (1, 100, 1) the scan runs whole on 1 program of the interpreter's 8 "SMs": a small grid, its launch checked
    "reverse_scan_small_grid_block_v": 16,
    "consumer_loads": "flat",  # read by joint_tma: paired with it below, with the query-side stage (its flat phase 2)
    "query_side_block_v": 16,  # read by joint_tma's query-side stage: paired with both below, its launch checked
}


# fields read by one consumer only: changed on a base that runs it
READ_BY = {"producer": "separate", "pd_dtype": "separate", "consumer_order": "joint_tma", "column_side": "joint_tma",
           "p_tiles": "joint_tma", "consumer_k_split": "joint_tma", "dq_stage": "joint_tma",
           "consumer_ranges": "joint_tma", "consumer_loads": "joint_tma", "query_side_block_v": "joint_tma"}
# fields read only where another field allows it: both schedules take that value (K = 32 in two 16-wide tiles; the
# scans' state tiles cover K = 128)
BASE_FOR = {"consumer_k_split": {"consumer_cfg": {"block_k": 16}},
            "scan_state_rows": {"forward_scan": {"block_k": 128}, "reverse_scan": {"block_k": 128}},
            "consumer_loads": {"dq_stage": "separate", "column_side": "gamma_t", "consumer_k_split": 1,
                               "consumer_cfg": {"block_k": 16, "block_v": 16}},
            "query_side_block_v": {"dq_stage": "separate"}}
# fields read under one policy only: both schedules run under it
POLICY_FOR = {"w_source": "A"}
# fields read by one operator or at some head dims only: (op, K = V) of both runs (others: GDN at 32)
PROBLEM_FOR = {"scan_state_rows": ("gdn", 128), "reverse_scan_qdo": ("deltanet", 32)}
# fields whose change the gate alone would not notice if the pipeline dropped it (the same gradients in another form):
# the scan kernels' launch constexpr that carries it, {kernel: (constexpr, base's value, changed's value)}
LAUNCH_FOR = {"scan_state_rows": {"rewy_fwd_scan_kernel": ("KB", 64, 128), "rewy_bwd_scan_kernel": ("KB", 64, 128)},
              "reverse_scan_qdo": {"rewy_bwd_scan_kernel": ("QDO_AHEAD", False, True)},
              "reverse_scan_small_grid_block_v": {"rewy_bwd_scan_kernel": ("BV", 32, 16)},
              "consumer_loads": {"rewy_bwd_kernel_consumer_tma": ("EARLY", 0, 5)},
              "query_side_block_v": {"rewy_bwd_kernel_query_side": ("BV", 32, 16)}}
# the module of LAUNCH_FOR's kernels (others: the scans')
LAUNCH_MODULE = {"consumer_loads": "consumer_tma", "query_side_block_v": "query_side"}


def test_field_changes_cover_schedule():
    assert set(FIELD_CHANGES) == {f.name for f in dataclasses.fields(Schedule)}


@pytest.mark.parametrize("field", list(FIELD_CHANGES))
def test_each_field_one_at_a_time(field, monkeypatch):
    import importlib

    module = importlib.import_module(f"rewy_tune.kernels.triton.{LAUNCH_MODULE.get(field, 'scan')}")

    base = BASE.replace(consumer=READ_BY[field]) if field in READ_BY else BASE
    base = base.replace(**BASE_FOR.get(field, {}))
    changed = base.replace(**{field: FIELD_CHANGES[field]})
    assert changed != base
    op, KV = PROBLEM_FOR.get(field, ("gdn", 32))
    x = make_inputs(op, 1, 100, 1, KV, KV, seed=13)
    ref = oracle(x, C=changed.chunk_size)
    ref_base = oracle(x) if changed.chunk_size != base.chunk_size else ref
    policy = POLICY_FOR.get(field, "R")
    launched = {kernel: set() for kernel in LAUNCH_FOR.get(field, {})}
    for kernel, (name, *_) in LAUNCH_FOR.get(field, {}).items():
        spy_kernel_launches(monkeypatch, module, kernel, lambda a, kw, g, k=kernel, n=name: launched[k].add(kw[n]))
    assert_gates(run_triton(x, base, policy), ref_base, ctx=f"{field} base")
    assert launched == {k: {was} for k, (_, was, _) in LAUNCH_FOR.get(field, {}).items()}, field
    for seen in launched.values():
        seen.clear()
    assert_gates(run_triton(x, changed, policy), ref, ctx=f"{field} changed")
    assert launched == {k: {now} for k, (*_, now) in LAUNCH_FOR.get(field, {}).items()}, field


def test_side_stream_rule():
    # a side stream forks only on a GPU and only where a stage runs before the reverse scan for it to overlap
    from rewy_tune.kernels.triton.pipeline import side_stream_mode

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for mode in ("dv_local", "reverse_scan"):
        s = BASE.replace(side_stream=mode)
        assert side_stream_mode(s, cuda, True) == mode
        assert side_stream_mode(s, cuda, False) == "none"  # policy A with the forward's W: nothing to overlap
        assert side_stream_mode(s, cpu, True) == "none"
    assert BASE.side_stream == "none" and side_stream_mode(BASE, cuda, True) == "none"
    with pytest.raises(ValueError, match=r"side_stream must be one of \('none', 'dv_local', 'reverse_scan'\), "
                                         r"got 'async'"):
        BASE.replace(side_stream="async")


IN_ORDER = ["recompute on main", "forward_scan on main", "dv_local on main", "reverse_scan on main",
            "consumer on main"]


def _stand_in_streams(monkeypatch, log, *, caller_on_side=False):
    """`stand_in_streams` with the scalar path's stages logged and its side-stream mode as the schedule names it.
    Returns the pipeline module."""
    from rewy_tune.kernels.triton import pipeline

    logged = stand_in_streams(monkeypatch, pipeline, log, caller_on_side=caller_on_side)
    monkeypatch.setattr(pipeline, "side_stream_mode", lambda s, device, stage_before: s.side_stream)
    for attr, name in (("run_dv_local", "dv_local"), ("recompute_wu", "recompute"),
                       ("forward_state_scan", "forward_scan"), ("reverse_state_scan", "reverse_scan"),
                       ("_scalar_consumer", "consumer"), ("query_side", "query_side")):
        monkeypatch.setattr(pipeline, attr, logged(name, getattr(pipeline, attr)))
    return pipeline


@pytest.mark.parametrize("mode,policy,order", [
    ("dv_local", "R", ["side waits main", "dv_local on side", "recompute on main", "forward_scan on main",
                       "main waits side", "reverse_scan on main", "consumer on main"]),
    ("reverse_scan", "R", ["side waits main", "dv_local on side", "recompute on main", "side waits main",
                           "reverse_scan on side", "forward_scan on main", "main waits side", "consumer on main"]),
    # policy A recomputing W: no forward scan, the reverse scan still waits for W
    ("reverse_scan", "A", ["side waits main", "dv_local on side", "recompute on main", "side waits main",
                           "reverse_scan on side", "main waits side", "consumer on main"]),
    # the caller already runs on the pipeline's side stream: every stage in order, no wait
    ("same stream", "R", IN_ORDER),
])
def test_side_stream_forks_and_joins_in_order(mode, policy, order, monkeypatch):
    # every stage runs after what it reads, and the results pass the gate
    log = []
    same = mode == "same stream"
    _stand_in_streams(monkeypatch, log, caller_on_side=same)
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=41)
    s = BASE.replace(side_stream="reverse_scan" if same else mode)
    assert_gates(run_triton(x, s, policy), oracle(x), ctx=f"side stream {mode} {policy}")
    assert log == order


@pytest.mark.parametrize("policy,order", [
    ("R", ["side waits main", "dv_local on side", "recompute on main", "side waits main", "reverse_scan on side",
           "forward_scan on main", "query_side on main", "main waits side", "consumer on main"]),
    # policy A with the forward's W: dv_local first, in order, then the query-side stage beside the reverse scan
    ("A", ["dv_local on main", "side waits main", "reverse_scan on side", "query_side on main", "main waits side",
           "consumer on main"]),
])
def test_query_side_stage_runs_beside_the_reverse_scan(policy, order, monkeypatch):
    log = []
    _stand_in_streams(monkeypatch, log)
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=61)
    s = BASE.replace(side_stream="reverse_scan", consumer="joint_tma", dq_stage="separate", w_source="forward")
    assert_gates(run_triton(x, s, policy), oracle(x), ctx=f"query side beside the reverse scan, {policy}")
    assert log == order


def test_side_stream_joins_when_a_stage_raises(monkeypatch):
    # an exception between fork and join still joins: dv_local's buffer is freed only after the side stream's work
    log = []
    pipeline = _stand_in_streams(monkeypatch, log)

    def fails(*a, **kw):
        raise RuntimeError("forward scan failed")

    monkeypatch.setattr(pipeline, "forward_state_scan", fails)
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=43)
    with pytest.raises(RuntimeError, match="forward scan failed"):
        run_triton(x, BASE.replace(side_stream="reverse_scan"))
    assert log == ["side waits main", "dv_local on side", "recompute on main", "side waits main",
                   "reverse_scan on side", "main waits side"]


@pytest.mark.parametrize("mode,waves,limit", [("dv_local", 2, 16), ("reverse_scan", 2, 8), ("reverse_scan", 0, 0)])
def test_scans_side_by_side_split_on_half_the_sms(mode, waves, limit, monkeypatch):
    # beside each other the two scans share the SMs: each gets half the split limit (waves x 8 interpreter SMs);
    # waves 0 (no limit) stays unlimited
    pipeline = _stand_in_streams(monkeypatch, [])
    limits = {}

    def recorded(name):
        fn = getattr(pipeline, name)
        return lambda *a, **kw: limits.setdefault(name, kw["split_max_programs"]) is None or fn(*a, **kw)

    for name in ("forward_state_scan", "reverse_state_scan"):
        monkeypatch.setattr(pipeline, name, recorded(name))
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=47)
    assert_gates(run_triton(x, BASE.replace(side_stream=mode, scan_split_waves=waves)), oracle(x),
                 ctx=f"side stream {mode}, waves {waves}")
    assert limits == {"forward_state_scan": limit, "reverse_state_scan": limit}


@pytest.mark.parametrize("dvl", ["recompute", "scan"])
@pytest.mark.parametrize("rows,qdo", [(128, "in_step"), (64, "ahead"), (128, "ahead"), (128, "split")])
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_reverse_scan_step_forms_on_the_h200_default(op, policy, rows, qdo, dvl, monkeypatch):
    # Schedule.scan_state_rows 128 and reverse_scan_qdo "ahead" or "split" (session 37; DeltaNet's default takes 128
    # rows since session 38, and "split" under A) at K = V = 128, where they change the launches: the H200 default (DeltaNet A: the query-side stage beside the scan), also with
    # dv_local formed in the scan (dv_local_source "scan", with "ahead" a step ahead too), with a tail, initial state
    # and zero β on half the sequence, against the oracle; every scan launch in that form ("ahead": no gate only, GDN's
    # scan forms Qᵀ dO in its step; the forward scan, policy R, in 128-row blocks too)
    from rewy_tune.kernels.triton import scan
    from rewy_tune.search_spaces import default_schedule

    seen, forward = set(), set()
    spy_kernel_launches(monkeypatch, scan, "rewy_bwd_scan_kernel",
                        lambda args, kw, grid: seen.add((kw["KB"], kw["QDO_AHEAD"])))
    spy_kernel_launches(monkeypatch, scan, "rewy_fwd_scan_kernel", lambda args, kw, grid: forward.add(kw["KB"]))
    split = []  # the reverse scan's segment combine: launched where it splits ("split" is "ahead" there)
    spy_kernel_launches(monkeypatch, scan, "rewy_segment_combine_carry_kernel",
                        lambda args, kw, grid: split.append(kw["REVERSE"]) if kw["REVERSE"] else None)
    # ("split": T = 300, 10 chunks, and no occupancy limit on the split, which the interpreter's 8 SMs would keep from it)
    x = make_inputs(op, 1, 100 if qdo != "split" else 300, 2, 128, 128, seed=37, beta_zero=True)
    sched = default_schedule((9, 0), op=op, policy=policy).replace(
        chunk_size=32, dv_local_source=dvl, scan_state_rows=rows, reverse_scan_qdo=qdo)
    if qdo == "split":
        sched = sched.replace(scan_split_waves=0)
    out = run_triton(x, sched, policy)
    ahead = op == "deltanet" and (qdo == "ahead" or (qdo == "split" and bool(split)))
    assert seen == {(rows, ahead)}
    if qdo == "split":
        assert split
    assert forward == ({rows} if policy == "R" else set())  # (policy A takes S0 from the forward)
    assert_gates(out, oracle(x, C=32), ctx=f"{op} {policy} rows {rows} qdo {qdo}")


def test_small_grid_block_v_rule():
    # Schedule.reverse_scan_small_grid_block_v: narrower only where set, narrower than reverse_scan.block_v, the scan
    # whole and its grid at most a quarter of the SMs
    from rewy_tune.kernels.triton.pipeline import SMALL_GRID_SM_SHARE, small_grid_block_v

    s = BASE.replace(reverse_scan_small_grid_block_v=16)  # reverse_scan.block_v 32
    assert SMALL_GRID_SM_SHARE == 4
    assert small_grid_block_v(s, 33, 132, whole=True) == 16  # DeltaNet (1, 512, 4) at 32 wide: 16 programs
    assert small_grid_block_v(s, 34, 132, whole=True) == 32  # B·H = 16 at 32 wide: 64 programs
    assert small_grid_block_v(s, 16, 132, whole=False) == 32  # a split scan
    assert small_grid_block_v(BASE, 1, 132, whole=True) == 32  # off
    assert small_grid_block_v(s.replace(reverse_scan={"block_v": 16}), 1, 132, whole=True) == 16  # not narrower


@pytest.mark.parametrize("case", ["small", "wide_grid", "split", "ranges"])
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_reverse_scan_small_grid_block_v(op, policy, case, monkeypatch):
    # the reverse scan 16 wide where it runs whole on a small grid (the interpreter's 8 "SMs": at most 2 programs at
    # 32 wide), and 32 wide on a larger grid, where it splits along the sequence and where the consumer runs in chunk
    # ranges; the gradients against the oracle each time, with a tail, initial state and zero β on half the sequence
    from rewy_tune.kernels.triton import scan

    widths, combines = [], []
    spy_kernel_launches(monkeypatch, scan, "rewy_bwd_scan_kernel",
                        lambda args, kw, grid: widths.append((kw["BV"], grid[0] * grid[1] * grid[2])))
    spy_kernel_launches(monkeypatch, scan, "rewy_segment_combine_carry_kernel",
                        lambda args, kw, grid: combines.append(kw["REVERSE"]))
    H = {"small": 1, "wide_grid": 3, "split": 1, "ranges": 1}[case]
    x = make_inputs(op, 1, 300, H, 32, 32, seed=39, beta_zero=True)
    sched = BASE.replace(reverse_scan_small_grid_block_v=16)
    if case == "split":
        sched = sched.replace(reverse_scan_segments=3)
    if case == "ranges":
        sched = sched.replace(consumer="joint_tma", consumer_ranges=2)
    out = run_triton(x, sched, policy)
    narrow = case == "small"
    assert {bv for bv, _ in widths} == {16 if narrow else 32}, case
    assert any(combines) == (case == "split")  # (the narrow scan stays whole)
    if narrow:
        assert widths == [(16, 2)]  # one launch, twice the programs of 32 wide
    assert_gates(out, oracle(x), ctx=f"{op} {policy} small grid {case}")


@pytest.mark.parametrize("gate", ["none", "scalar", "vector"])
@pytest.mark.parametrize("dht", [False, True])
def test_reverse_scan_in_ranges_gives_the_scans_bits(gate, dht):
    # Schedule.consumer_ranges: the reverse scan one chunk range per launch, from the last, the state carried in
    # fp32 between launches: the same bits as one launch, and the ranges come out in the order they are final
    from rewy_tune.kernels.triton.scan import (chunk_ranges, reverse_scan_segment_count, reverse_state_scan,
                                               reverse_state_scan_ranges)

    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 100, 2, 32, 32
    q, k, W = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    do, dvl = torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, H, V, generator=gen)
    G = {"none": None, "scalar": -torch.rand(B, T, H, generator=gen).cumsum(1) * 0.1,
         "vector": -torch.rand(B, T, H, K, generator=gen).cumsum(1) * 0.1}[gate]
    dh = torch.randn(B, H, K, V, generator=gen) if dht else None
    kw = dict(scale=0.5, chunk_size=16, BK=32, BV=16)  # 7 chunks
    want = reverse_state_scan(q, k, W, G, do, dvl, dh, **kw)
    for n in (2, 3, 7, 8):
        dS1, Rbar, dh0, launches = reverse_state_scan_ranges(q, k, W, G, do, dvl, dh, num_ranges=n, **kw)
        for t in (dS1, Rbar, dh0):
            t.fill_(float("nan"))
        got = list(launches)
        assert got == chunk_ranges(7, n) and got[0][1] == 7 and got[-1][0] == 0
        assert all(a[0] == b[1] for a, b in zip(got, got[1:]))  # contiguous, each after the later chunks
        for name, a, b in zip(("dS1", "Rbar", "dh0"), want, (dS1, Rbar, dh0)):
            assert torch.equal(a, b), (n, name)
    assert chunk_ranges(7, 3) == [(6, 7), (3, 6), (0, 3)] and chunk_ranges(2, 8) == [(1, 2), (0, 1)]
    # a split scan already runs its chunks side by side: whole, one range
    *outs, launches = reverse_state_scan_ranges(q, k, W, G, do, dvl, dh, num_ranges=4, num_segments=3, **kw)
    assert list(launches) == [(0, 7)]
    for a, b in zip(outs, reverse_state_scan(q, k, W, G, do, dvl, dh, num_segments=3, **kw)):
        assert torch.equal(a, b)
    seg = dict(chunk_size=16, BV=16, split_max_programs=0)
    assert reverse_scan_segment_count(k, G, V, num_segments=3, **seg) == 3
    assert reverse_scan_segment_count(k, G, V, num_segments=1, **seg) == 1
    with pytest.raises(ValueError, match=r"num_ranges must be a positive int, got 0"):
        reverse_state_scan_ranges(q, k, W, G, do, dvl, dh, num_ranges=0, **kw)


@pytest.mark.parametrize("ranges,segments", [(1, 1), (3, 1), (1, 3)])
def test_reverse_scan_forms_dv_local_from_aqk(ranges, segments):
    # aqk=: the scan forms dv_local = A_qkᵀ dO per chunk from the forward's A_qk (fla-core leaves column j > row i
    # unwritten: NaN here) instead of reading dv_local: the scan's outputs with dv_local given, to fp32 rounding
    # (the products sum in another order), in one launch, in chunk ranges and split in segments
    from rewy_tune.kernels.triton.scan import reverse_state_scan, reverse_state_scan_ranges

    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V, C = 1, 100, 2, 32, 32, 16
    q, k, W = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    do = torch.randn(B, T, H, V, generator=gen)
    G = -torch.rand(B, T, H, K, generator=gen).cumsum(1) * 0.1
    dh = torch.randn(B, H, K, V, generator=gen)
    aqk = torch.randn(B, T, H, C, generator=gen)
    lower = torch.arange(C)[None, :] <= (torch.arange(T) % C)[:, None]  # [T, C]: column j <= row i in its chunk
    aqk = aqk.masked_fill(~lower[None, :, None, :], float("nan"))
    dvl = torch.zeros_like(do)
    for c0 in range(0, T, C):
        a = aqk[:, c0:c0 + C].nan_to_num(0.0)  # [B, n, H, C]
        n = a.shape[1]
        dvl[:, c0:c0 + C] = torch.einsum("bihj,bihv->bjhv", a[..., :n], do[:, c0:c0 + C])
    kw = dict(scale=0.5, chunk_size=C, BK=32, BV=16, num_segments=segments)
    want = reverse_state_scan(q, k, W, G, do, dvl, dh, **kw)
    *got, launches = reverse_state_scan_ranges(q, k, W, G, do, None, dh, num_ranges=ranges, aqk=aqk, **kw)
    list(launches)
    for name, a, b in zip(("dS1", "Rbar", "dh0"), want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {ranges} {segments}: {m}")
    with pytest.raises(ValueError, match="pass dv_local or aqk"):
        reverse_state_scan(q, k, W, G, do, dvl, dh, aqk=aqk, **kw)
    with pytest.raises(ValueError, match=r"aqk must be \[B,T,H,chunk_size\]=\(1, 100, 2, 16\) in do's dtype"):
        reverse_state_scan(q, k, W, G, do, None, dh, aqk=aqk[..., :8], **kw)
    with pytest.raises(ValueError, match=r"aqk must be .* in do's dtype torch.float32"):
        reverse_state_scan(q, k, W, G, do, None, dh, aqk=aqk.double(), **kw)


def _range_spy(monkeypatch, log):
    """Logs each joint_tma consumer launch's chunk range, and each reverse-scan range, with the stream it is on."""
    from rewy_tune.kernels.triton import consumer_tma, pipeline

    real_kernel, real_scan = consumer_tma.rewy_bwd_kernel_consumer_tma, pipeline.reverse_state_scan_ranges

    c_off = real_kernel.arg_names.index("c_off")

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                c0 = args[c_off]
                log.append(f"consumer {c0}-{c0 + grid[0]} on {pipeline.torch.cuda.current_stream().name}")
                return real_kernel[grid](*args, **kw)
            return launch

    def scan(*args, **kw):
        *outs, launches = real_scan(*args, **kw)

        def logged():
            for c0, c1 in launches:
                log.append(f"scan {c0}-{c1} on {pipeline.torch.cuda.current_stream().name}")
                yield c0, c1
        return (*outs, logged())

    monkeypatch.setattr(consumer_tma, "rewy_bwd_kernel_consumer_tma", Kernel())
    monkeypatch.setattr(pipeline, "reverse_state_scan_ranges", scan)


@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_consumer_ranges_follow_the_reverse_scan(op, monkeypatch):
    # policy A with the forward's W: every scan range on the side stream first, then each consumer range, on the main
    # and a second stream in turn, after the side stream's event for its scan range; both join the main stream. The
    # same bits as one scan and one consumer launch
    log = []
    _stand_in_streams(monkeypatch, log)
    _range_spy(monkeypatch, log)
    x = make_inputs(op, 1, 100, 2, 32, 32, seed=71)  # chunk 32: 4 chunks
    s = BASE.replace(consumer="joint_tma", chunk_size=32, w_source="forward")
    whole = run_triton(x, s, "A")
    assert log == ["dv_local on main", "reverse_scan on main", "consumer on main", "consumer 0-4 on main"]
    log.clear()
    ranged = run_triton(x, s.replace(consumer_ranges=2), "A")
    assert log == ["dv_local on main", "consumer on main", "side waits main", "second waits main",
                   "scan 2-4 on side", "side records", "scan 0-2 on side", "side records",
                   "main waits side's event", "consumer 2-4 on main", "second waits side's event",
                   "consumer 0-2 on second", "main waits side", "main waits second"]
    assert_same_bits(ranged, whole, ctx=f"{op} consumer ranges")
    assert_gates(ranged, oracle(x, C=32), ctx=f"{op} consumer ranges")


def test_query_side_writes_the_buffers_it_is_given():
    # query_side(out=): the consumer's ranged call holds the buffers before the stage is launched; they must be the
    # ones query_side_buffers makes, else a clear error
    from rewy_tune.kernels.reference.chunk_forward import chunk_forward
    from rewy_tune.kernels.triton.query_side import query_side, query_side_buffers

    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=83)
    fwd = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=0.2, initial_state=x["h0"],
                        chunk_size=64, save_states=True)
    args = (x["q"], x["k"], fwd.R.contiguous(), fwd.S0.contiguous(), fwd.G, x["do"])
    kw = dict(scale=0.2, BK=16, BV=16)
    out = query_side_buffers(x["q"], x["k"], fwd.G)
    got = query_side(*args, out=out, **kw)
    assert all(a is b for a, b in zip(got, out))
    for a, b in zip(got, query_side(*args, **kw)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"out must be \(dq, dk_q, Ḡ_q\) as query_side_buffers\(q, k, G\) makes them"):
        query_side(*args, out=(out[0], out[1], None), **kw)  # GDN's Ḡ_q buffer missing
    with pytest.raises(ValueError, match=r"out must be"):
        query_side(*args, out=(out[0], out[1][:, :50], out[2]), **kw)


@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_query_side_stage_runs_before_the_consumer_ranges(op, monkeypatch):
    # policy A with the forward's W, dq_stage "separate" and an explicit consumer_ranges: the reverse scan in ranges on
    # the side stream as without the stage, the stage on the main stream once the scan's launches are queued and
    # before the first consumer range, the second stream's ranges after it too. The same bits as the stage beside the
    # whole scan (consumer_ranges auto, which takes no ranges with the stage), and the gate
    log = []
    pipeline = _stand_in_streams(monkeypatch, log)
    # (the GPU's rule, not the schedule's field alone: the side stream only where a stage runs before the scan)
    monkeypatch.setattr(pipeline, "side_stream_mode", lambda s, device, stage_before: s.side_stream if stage_before
                        else "none")
    _range_spy(monkeypatch, log)
    x = make_inputs(op, 1, 100, 2, 32, 32, seed=79)  # chunk 32: 4 chunks
    s = BASE.replace(consumer="joint_tma", chunk_size=32, w_source="forward", dq_stage="separate",
                     side_stream="reverse_scan")
    whole = run_triton(x, s, "A")
    assert log == ["dv_local on main", "side waits main", "reverse_scan on side", "query_side on main",
                   "main waits side", "consumer on main", "consumer 0-4 on main"]
    log.clear()
    ranged = run_triton(x, s.replace(consumer_ranges=2), "A")
    assert log == ["dv_local on main", "consumer on main", "side waits main", "second waits main",
                   "scan 2-4 on side", "side records", "scan 0-2 on side", "side records",
                   "query_side on main", "second waits main",
                   "main waits side's event", "consumer 2-4 on main", "second waits side's event",
                   "consumer 0-2 on second", "main waits side", "main waits second"]
    assert_same_bits(ranged, whole, ctx=f"{op} query side and consumer ranges")
    assert_gates(ranged, oracle(x, C=32), ctx=f"{op} query side and consumer ranges")
    log.clear()  # auto takes 4 ranges with the stage where each has QUERY_SIDE_MIN_RANGE_CHUNKS (here 1) chunks
    monkeypatch.setattr(pipeline, "QUERY_SIDE_MIN_RANGE_CHUNKS", 1)
    auto = run_triton(x, s.replace(consumer_ranges=0), "A")
    assert [e for e in log if e.startswith("scan ")] == ["scan 3-4 on side", "scan 2-3 on side", "scan 1-2 on side",
                                                       "scan 0-1 on side"]
    assert log.index("query_side on main") < log.index("consumer 3-4 on main")
    assert_same_bits(auto, whole, ctx=f"{op} query side and auto consumer ranges")
    log.clear()  # ... and none where the scan would split (2 segments, no occupancy limit): beside it whole
    run_triton(x, s.replace(consumer_ranges=0, reverse_scan_segments=2, scan_split_waves=0), "A")
    assert not [e for e in log if e.startswith("scan ")] and "consumer 0-4 on main" in log
    monkeypatch.setattr(pipeline, "QUERY_SIDE_MIN_RANGE_CHUNKS", 32)
    log.clear()  # a scan that splits (2 segments of 2 chunks, no occupancy limit) rules the ranges out: in order
    split = s.replace(consumer_ranges=2, side_stream="none", reverse_scan_segments=2, scan_split_waves=0)
    assert_gates(run_triton(x, split, "A"), oracle(x, C=32), ctx=f"{op} query side, split scan")
    assert log == ["dv_local on main", "query_side on main", "reverse_scan on main", "consumer on main",
                   "consumer 0-4 on main"]


def test_consumer_ranges_apply_to_the_last_alone_reverse_scan(monkeypatch):
    # under R with the reverse scan beside the forward scan (side_stream "reverse_scan") there is nothing to chase:
    # one consumer launch; the pointer consumers run once after the whole scan
    log = []
    _stand_in_streams(monkeypatch, log)
    _range_spy(monkeypatch, log)
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=73)
    s = BASE.replace(consumer="joint_tma", chunk_size=32, side_stream="reverse_scan", consumer_ranges=4)
    assert_gates(run_triton(x, s, "R"), oracle(x, C=32), ctx="ranges beside the forward scan")
    assert [e for e in log if re.match(r"(scan|consumer) \d", e)] == ["consumer 0-4 on main"]
    log.clear()
    assert_gates(run_triton(x, s.replace(consumer="joint"), "A"), oracle(x, C=32), ctx="ranges, pointer consumer")
    assert not [e for e in log if re.match(r"(scan|consumer) \d", e)]
    log.clear()  # a reverse scan that splits (2 segments of 2 chunks, no occupancy limit) runs as one stage
    split = s.replace(side_stream="none", w_source="forward", reverse_scan_segments=2, scan_split_waves=0)
    assert_gates(run_triton(x, split, "A"), oracle(x, C=32), ctx="ranges, split scan")
    assert log == ["dv_local on main", "reverse_scan on main", "consumer on main", "consumer 0-4 on main"]


def test_consumer_range_count():
    # "auto" (0): ranges of at least 16 chunks where that makes 4 or more, at most 8; joint_tma only
    from rewy_tune.kernels.triton.pipeline import consumer_range_count

    tma = BASE.replace(consumer="joint_tma", consumer_ranges=0)
    assert [consumer_range_count(tma, nt) for nt in (8, 32, 63, 64, 100, 128, 512)] == [1, 1, 1, 4, 6, 8, 8]
    assert consumer_range_count(tma.replace(consumer_ranges=2), 4) == 2
    assert consumer_range_count(tma.replace(consumer="joint"), 512) == 1
    # with the query-side stage before them: 4 ranges of at least 32 chunks, none where the scan splits
    assert [consumer_range_count(tma, nt, query_side=True) for nt in (32, 127, 128, 512)] == [1, 1, 4, 4]
    assert consumer_range_count(tma, 512, query_side=True, scan_segments=2) == 1
    assert consumer_range_count(tma.replace(consumer_ranges=8), 32, query_side=True) == 8


def test_consumer_ranges_write_dv_over_dv_local(monkeypatch):
    # under ranges the consumer writes dv into dv_local's buffer (the scan has read each range's rows first), so
    # the two are never held at once: the dv returned is the buffer dv_local made
    from rewy_tune.kernels.triton import pipeline

    made = []
    real = pipeline.run_dv_local
    monkeypatch.setattr(pipeline, "run_dv_local", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=77)
    s = BASE.replace(consumer="joint_tma", chunk_size=32, w_source="forward")
    one = run_triton(x, s, "A")
    ranged = run_triton(x, s.replace(consumer_ranges=2), "A")
    assert ranged["dv"] is made[-1] and one["dv"] is not made[0]
    assert torch.equal(one["dv"], ranged["dv"])
    from rewy_tune.kernels.triton.consumer_tma import consumer_tma

    args = _consumer_args(True, torch.float32)
    with pytest.raises(ValueError, match=r"dv_out must be a contiguous \(1, 100, 2, 64\) tensor in torch.float32, got"):
        consumer_tma(*args, scale=0.3, chunk_size=64, BK=16, BV=32, dv_out=torch.empty(1, 100, 2, 32))


def test_consumer_ranges_join_when_the_consumer_raises(monkeypatch):
    # the main stream joins the side stream even when a consumer launch fails between the ranges
    log = []
    _stand_in_streams(monkeypatch, log)
    from rewy_tune.kernels.triton import consumer_tma

    calls = []

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append(grid)
                if len(calls) == 2:
                    raise RuntimeError("consumer launch failed")
            return launch

    monkeypatch.setattr(consumer_tma, "rewy_bwd_kernel_consumer_tma", Failing())
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=75)
    s = BASE.replace(consumer="joint_tma", chunk_size=32, w_source="forward", consumer_ranges=4)
    with pytest.raises(RuntimeError, match="consumer launch failed"):
        run_triton(x, s, "A")
    assert log[-2:] == ["main waits side", "main waits second"] and len(calls) == 2


def test_consumer_tma_rejects_bad_chunk_ranges():
    from rewy_tune.kernels.triton.consumer_tma import consumer_tma

    args = _consumer_args(True, torch.float32)
    kw = dict(scale=0.3, chunk_size=64, BK=16, BV=32)  # T = 100: two chunks
    with pytest.raises(ValueError, match=r"chunk_ranges: \(1, 3\) is not a range of the 2 chunks"):
        consumer_tma(*args, **kw, chunk_ranges=[(1, 3)])
    with pytest.raises(ValueError, match=r"chunk_ranges covered 1 chunks, not the 2 there are"):
        consumer_tma(*args, **kw, chunk_ranges=[(1, 2)])
    with pytest.raises(ValueError, match=r"chunk_ranges covered chunk 1 twice"):
        consumer_tma(*args, **kw, chunk_ranges=[(1, 2), (1, 2)])


def _chase_spy(monkeypatch) -> list:
    """Each reverse scan's progress counters (None: the scan publishes nothing) as the pipeline passes them."""
    from rewy_tune.kernels.triton import pipeline
    from rewy_tune.kernels.triton import scan as scan_module

    seen = []
    real = scan_module.reverse_state_scan_ranges

    def scan(*args, progress=None, **kw):
        seen.append(progress)
        return real(*args, progress=progress, **kw)

    for module in (pipeline, scan_module):  # (the one launch goes through scan.reverse_state_scan)
        monkeypatch.setattr(module, "reverse_state_scan_ranges", scan)
    return seen


@pytest.mark.parametrize("op,T,h0", [("deltanet", 100, True), ("gdn", 100, False), ("gdn", 64, True)])
def test_consumer_chases_the_scan(op, T, h0, monkeypatch):
    # pipeline.CONSUMER_CHASES_SCAN under policy A (the scan last and alone): one scan launch that publishes each
    # chunk, then one consumer launch whose programs take the chunks from the last and wait for each (the
    # interpreter runs the launches in order: the counts are all there). The same bits as the consumer after the
    # scan, dv over dv_local, every output written (NaN-poisoned), and the oracle's gates; a tail and no tail
    from rewy_tune.kernels.triton import pipeline

    x = make_inputs(op, 2, T, 2, 32, 32, seed=83, h0=h0)
    s = BASE.replace(consumer="joint_tma", chunk_size=32, w_source="forward")
    after = run_triton(x, s, "A")
    seen = _chase_spy(monkeypatch)
    launches = _tma_consumer_launches(monkeypatch)
    monkeypatch.setattr(pipeline, "CONSUMER_CHASES_SCAN", True)
    made = []
    real_dvl = pipeline.run_dv_local
    monkeypatch.setattr(pipeline, "run_dv_local", lambda *a, **kw: made.append(real_dvl(*a, **kw)) or made[-1])
    chased = run_triton(x, s, "A")
    assert len(seen) == 1 and seen[0] is not None and seen[0].programs == 1 and not seen[0].pdl
    assert any(t is x["do"] for t in seen[0].reads)  # the counters hold what the scan reads until the consumer runs
    NT = -(-T // 32)
    assert torch.equal(seen[0].flags, torch.ones(4, NT, dtype=torch.int32))  # one program per head published each
    (grid, args), = launches
    assert grid == (NT, 4, 1) and any(a is seen[0].flags for a in args)  # one launch, every chunk, the counters
    assert chased["dv"] is made[0]
    assert_same_bits(chased, after, ctx=f"{op} chase")
    assert_gates(chased, oracle(x, C=32), ctx=f"{op} chase")


def test_consumer_chases_the_scan_only_where_it_runs_last_alone_unsplit(monkeypatch):
    # with the flag on: with the reverse scan beside the forward scan (policy R, side_stream "reverse_scan"), with
    # the pointer consumer, and where the scan splits, nothing chases; consumer ranges in place of an unsplit scan
    # give way to the chase, and policy R in order is chased too (the scan then runs last and alone)
    pipeline = _stand_in_streams(monkeypatch, [])  # the side-stream mode as the schedule names it
    monkeypatch.setattr(pipeline, "CONSUMER_CHASES_SCAN", True)
    seen = _chase_spy(monkeypatch)
    x = make_inputs("gdn", 1, 200, 2, 32, 32, seed=89)  # chunk 32: 7 chunks
    s = BASE.replace(consumer="joint_tma", chunk_size=32, w_source="forward")
    ref = oracle(x, C=32)
    cases = {"R beside": (s.replace(side_stream="reverse_scan"), "R", False),
             "pointer": (s.replace(consumer="joint"), "A", False),
             "split": (s.replace(reverse_scan_segments=3, scan_split_waves=0), "A", False),
             "ranges": (s.replace(consumer_ranges=2), "A", True), "R in order": (s, "R", True)}
    for name, (sched, policy, chased) in cases.items():
        seen.clear()
        assert_gates(run_triton(x, sched, policy), ref, ctx=name)
        assert len(seen) == 1 and (seen[0] is not None) == chased, name
    assert not pipeline.consumer_chases_scan(s, torch.device("cpu"), vector=True)  # joint_tma only


def test_chase_bad_arguments():
    from rewy_tune.kernels.triton import scan
    from rewy_tune.kernels.triton.consumer_tma import consumer_tma

    x = make_inputs("gdn", 1, 200, 2, 32, 32, seed=97)
    q, k, do = x["q"], x["k"], x["do"]
    G = torch.zeros(1, 200, 2)
    kw = dict(scale=0.3, chunk_size=32, BK=32, BV=32)
    good = scan.scan_progress(k, 32, chunk_size=32, BV=32)
    assert good.flags.shape == (2, 7) and good.programs == 1 and not good.pdl
    with pytest.raises(ValueError, match=r"a chasing consumer follows the scan in one unsplit launch; these "
                                         r"arguments give 3 segments and 1 ranges"):
        scan.reverse_state_scan_ranges(q, k, k, G, do, None, None, **kw, num_segments=3, progress=good)
    with pytest.raises(ValueError, match=r"one unsplit launch; these arguments give 1 segments and 2 ranges"):
        scan.reverse_state_scan_ranges(q, k, k, G, do, None, None, **kw, num_ranges=2, progress=good)
    with pytest.raises(ValueError, match=r"ScanProgress.flags must be a contiguous int32 \[B·H, NT\]=\(2, 7\) "
                                         r"tensor on cpu, got \(2, 6\) in torch.int32"):
        scan.reverse_state_scan_ranges(q, k, k, G, do, None, None, **kw,
                                       progress=scan.ScanProgress(torch.zeros(2, 6, dtype=torch.int32), 1, False))
    with pytest.raises(ValueError, match=r"progress counts 2 programs per head; this scan has 1"):
        scan.reverse_state_scan_ranges(q, k, k, G, do, None, None, **kw,
                                       progress=scan.ScanProgress(good.flags, 2, False))
    args = _consumer_args(True, torch.float32)  # T = 100, B·H = 2: two chunks
    chase = scan.ScanProgress(torch.ones(2, 2, dtype=torch.int32), 1, False)
    with pytest.raises(ValueError, match=r"chase: the chasing consumer runs in one launch; pass no chunk_ranges"):
        consumer_tma(*args, scale=0.3, chunk_size=64, BK=16, BV=32, chase=chase, chunk_ranges=[(0, 2)])
    with pytest.raises(ValueError, match=r"ScanProgress.flags must be a contiguous int32 .* got \(2, 2\) in "
                                         r"torch.int64"):
        consumer_tma(*args, scale=0.3, chunk_size=64, BK=16, BV=32,
                     chase=scan.ScanProgress(torch.ones(2, 2, dtype=torch.int64), 1, False))


def test_dv_local_writes_a_given_buffer():
    # the side stream writes dv_local into a buffer the main stream allocated: same values, the buffer returned
    from rewy_tune.kernels.triton.local import dv_local

    x = make_inputs("deltanet", 1, 100, 2, 32, 32, seed=37)
    G = None  # DeltaNet: no gate
    kw = dict(scale=0.5, chunk_size=64, BK=32, BV=32)
    want = dv_local(x["q"], x["k"], G, x["do"], **kw)
    buf = torch.full_like(x["do"], float("nan"))
    got = dv_local(x["q"], x["k"], G, x["do"], **kw, out=buf)
    assert got is buf and torch.equal(got, want)
    with pytest.raises(ValueError, match=r"out must be a contiguous \(1, 100, 2, 32\) tensor in torch.float32 .*"
                                         r"got \(1, 100, 2, 16\)"):
        dv_local(x["q"], x["k"], G, x["do"], **kw, out=buf[..., :16])


@pytest.mark.parametrize("waves,used", [(0, 4), (4, 4), (1, 1)])
def test_split_waves_limit_the_split(monkeypatch, waves, used):
    # B·H = 4 heads × 2 value tiles = 8 programs per segment; the interpreter counts as INTERPRETER_SMS = 8 SMs:
    # one wave fits one segment (the split is dropped), four waves fit the four asked (25 chunks: 4 segments of
    # 7, and 2·7 + 4 + SPLIT_OVERHEAD_STEPS < 25, so the latency rule keeps the split too)
    from rewy_tune.kernels.triton import scan

    seen = []
    real = scan._segments
    monkeypatch.setattr(scan, "_segments", lambda *a: seen.append(real(*a)[0]) or real(*a))
    sched = BASE.replace(chunk_size=16, forward_scan_segments=4, reverse_scan_segments=4, scan_split_waves=waves,
                         forward_scan={"block_v": 16}, reverse_scan={"block_v": 16})
    x = make_inputs("gdn", 1, 400, 4, 32, 32, seed=17)
    assert_gates(run_triton(x, sched), oracle(x, C=16), ctx=f"waves={waves}")
    assert seen == [used, used]  # forward and reverse scan


# bf16 inputs are held to the project gate (0.8 % / 2 %), never a looser bound. Triton 3.6's interpreter converts
# fp32 → bf16 by truncation, not round-to-nearest (test_interpreter_quirks.py pins this): every bf16 rounding inside
# a kernel then costs twice the error, which puts interpreter bf16 results over the gate (dv_local alone: 0.60 %
# against 0.23 % for the same product with round-to-nearest). So bf16 tests are expected to fail under the
# interpreter only; on a GPU (round-to-nearest conversions) they must pass the gate unchanged.
BF16_ORDINARY, BF16_GATE = ORDINARY, GATE
BF16_ON_INTERPRETER = pytest.mark.xfail(
    condition=os.environ.get("TRITON_INTERPRET") == "1", strict=False, raises=AssertionError,  # a crash still fails
    reason="Triton 3.6's interpreter truncates fp32 -> bf16 (twice round-to-nearest's error); the gate applies on GPU")


def test_bf16_inputs_run():
    # bf16 inputs at a small shape: the project gate on a GPU; on the interpreter, whose truncating conversions
    # double every bf16 rounding's error, within twice it (INTERPRETER_BF16_FACTOR), so that wrong bf16 gradients
    # fail here too and not only on a GPU (this test was an xfail there, which passed whatever it computed)
    x = make_inputs("gdn", 1, 64, 1, 32, 32, dtype=torch.bfloat16, seed=17)
    out = run_triton(x, BASE)
    assert out["dq"].dtype == torch.bfloat16 and out["dg"].dtype == torch.float32 and out["dh0"].dtype == torch.float32
    assert_gates(out, oracle(x), ctx="gdn bf16", factor=bf16_gate_factor())


# ----------------------------------------------------------------------------------------------------------
# bad input


def test_bad_inputs():
    x = make_inputs("gdn", 1, 64, 1, 32, 32)
    A = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=1.0, chunk_size=64).A
    call = lambda **over: rewy_backward_triton(**{**dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], erase=x["beta"],
                                                      write=x["beta"], A=A, do=x["do"], dht=None, scale=1.0,
                                                      initial_state=None, schedule=BASE), **over})
    big = torch.zeros(1, 64, 1, 512)
    with pytest.raises(ValueError, match="K, V <= 256"):
        call(q=big, k=big)
    with pytest.raises(ValueError, match="dtype"):
        call(q=x["q"].double(), k=x["k"].double(), v=x["v"].double(), do=x["do"].double())
    with pytest.raises(ValueError, match="share one dtype"):
        call(k=x["k"].half())
    with pytest.raises(ValueError, match="scalar gate"):
        call(g=torch.zeros(1, 64, 1, 7))
    with pytest.raises(ValueError, match="per-token scalar"):
        call(erase=torch.zeros(1, 64, 1, 32))
    with pytest.raises(TypeError, match="Schedule"):
        call(schedule={"chunk_size": 64})
    with pytest.raises(ValueError, match="must cover K"):
        call(schedule=BASE.replace(forward_scan={"block_k": 16}))
    # Non-contiguous inputs are documented to be made contiguous: same result as contiguous ones.
    qn = torch.cat([x["q"], x["q"]], dim=-1)[..., : x["q"].shape[-1]]
    assert not qn.is_contiguous()
    a, b = call(), call(q=qn)
    for u, w in zip(a, b):
        if u is not None:
            assert torch.equal(u, w)


def test_schedule_json_roundtrip_and_validation():
    s = OTHERS["separate-input-bv64"]
    assert Schedule.from_json(s.to_json()) == s and hash(Schedule.from_json(s.to_json())) == hash(s)
    with pytest.raises(ValueError, match="consumer"):
        BASE.replace(consumer="fused")
    with pytest.raises(ValueError, match=r"consumer_order must be one of \('fused', 'dq_first'\)"):
        BASE.replace(consumer_order="joint")
    with pytest.raises(ValueError, match=r"column_side must be one of \('scratch', 'gamma_t'\)"):
        BASE.replace(column_side="rows")
    with pytest.raises(ValueError, match=r"p_tiles must be one of \('recompute', 'stored'\)"):
        BASE.replace(p_tiles="kept")
    for bad in (3, True, "2"):
        with pytest.raises(ValueError, match=r"consumer_k_split must be one of \(0, 1, 2, 4\), got"):
            BASE.replace(consumer_k_split=bad)
    with pytest.raises(ValueError, match=r"w_source must be one of \('recompute', 'forward'\), got 'saved'"):
        BASE.replace(w_source="saved")
    # a schedule stored before these fields existed reads as the timed code
    old = {k: v for k, v in BASE.to_dict().items()
           if k not in ("consumer_order", "column_side", "p_tiles", "w_source", "side_stream", "dq_stage")}
    assert Schedule.from_dict(old).consumer_order == "fused" and Schedule.from_dict(old).column_side == "scratch"
    assert Schedule.from_dict(old).p_tiles == "recompute" and Schedule.from_dict(old).w_source == "recompute"
    assert Schedule.from_dict(old).side_stream == "none" and Schedule.from_dict(old).dq_stage == "consumer"
    with pytest.raises(ValueError, match=r"dq_stage must be one of \('consumer', 'separate'\), got 'beside'"):
        BASE.replace(dq_stage="beside")
    for bad in (3, True, "2", 16):
        with pytest.raises(ValueError, match=r"consumer_ranges must be one of \(0, 1, 2, 4, 8\), got"):
            BASE.replace(consumer_ranges=bad)
    assert Schedule.from_dict({k: v for k, v in BASE.to_dict().items() if k != "consumer_ranges"}).consumer_ranges == 1
    # integer choices given as floats or bools (equal to a listed int, but not one): named and refused
    for name, bad in (("chunk_size", 64.0), ("consumer_ranges", 1.0), ("consumer_k_split", 2.0),
                      ("scan_split_waves", True), ("consumer_v_stages", 2.0),
                      ("reverse_scan_small_grid_block_v", 16.0), ("reverse_scan_small_grid_block_v", 64)):
        with pytest.raises(ValueError, match=rf"Schedule.{name} must be one of \(.*\), got {bad!r}"):
            BASE.replace(**{name: bad})
    assert Schedule.from_dict({k: v for k, v in BASE.to_dict().items() if k != "consumer_v_stages"}) == BASE
    with pytest.raises(ValueError, match="block_k"):
        StageConfig(block_k=48)
    with pytest.raises(ValueError, match="unknown"):
        Schedule.from_dict({"chunk": 64})


# ----------------------------------------------------------------------------------------------------------
# GPU (the lead engineer runs these on the device)

BENCH_SHAPES = [(1, 512, 4), (1, 2048, 4), (1, 8192, 4), (1, 2048, 16), (2, 2048, 16), (1, 8192, 16)]


def _gpu_default(dtype=None, *, op=None, policy=None):
    """The schedule the GPU tests gate: the device's built-in default for the inputs' dtype ("fp32" or None:
    16-bit), operator and policy (None: GDN's, which most tests take as their base), or a candidate default named by
    REWY_TEST_GPU_SCHEDULE (a Schedule JSON file), so a new default passes the GPU suite before it is adopted."""
    path = os.environ.get("REWY_TEST_GPU_SCHEDULE")
    if path:
        with open(path) as f:
            return Schedule.from_json(f.read())
    from rewy_tune.search_spaces import default_schedule

    return default_schedule(torch.cuda.get_device_capability(), dtype=dtype, op=op, policy=policy)


def _with_consumer(schedule, consumer):
    """The schedule with another consumer; the pointer consumers at their own 8 warps (the cc-9.0 default runs
    joint_tma at 4 warps, where the pointer kernels' register and shared-memory models reject it)."""
    if consumer == schedule.consumer:
        return schedule
    if consumer == "joint_tma":
        return schedule.replace(consumer=consumer)
    return schedule.replace(consumer=consumer, consumer_cfg={"num_warps": 8})


def test_gpu_tests_gate_a_candidate_schedule_file(tmp_path, monkeypatch):
    candidate = BASE.replace(forward_scan={"num_stages": 4}, reverse_scan={"block_v": 16, "num_stages": 3})
    path = tmp_path / "candidate.json"
    path.write_text(candidate.to_json())
    monkeypatch.setenv("REWY_TEST_GPU_SCHEDULE", str(path))
    assert _gpu_default() == candidate


def assert_bf16(out, ref, ctx):
    for n in NAMES:
        if ref[n] is None:
            continue
        assert torch.isfinite(out[n].float()).all(), f"{ctx}: {n} non-finite"
        err = rel_rms(out[n], ref[n])
        assert err <= (BF16_GATE if n in GATE_LIKE else BF16_ORDINARY), f"{ctx}: {n} rel RMS {err:.2e}"


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("consumer", ["joint", "joint_tma"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", BENCH_SHAPES + [(1, 1000, 4), (2, 500, 4)])
def test_gpu_bench_shapes_bf16(op, B, T, H, consumer):
    # each operator's own policy-R default (DeltaNet's differs from GDN's: 128-row scan blocks, the small-grid scan
    # at (1, 512, 4)); the policy-A defaults are gated below
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H, gate_div=1.0)
    ref = oracle({n: (t.float() if t is not None else None) for n, t in x.items()})
    base = _gpu_default(op=op, policy="R")
    for states in ("input", "fp32"):  # bf16 per-chunk states (the H200 default) and fp32 ones
        out = run_triton(x, _with_consumer(base, consumer).replace(state_dtype=states))
        assert_bf16(out, ref, f"gpu {op} {B},{T},{H} {consumer} {states} states")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("B,T,H", BENCH_SHAPES + [(1, 8192 - 40, 16)])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_gpu_policy_a_default_at_bench_shapes(op, B, T, H):
    # The policy-A H200 defaults: the query-side stage (DeltaNet since session 35, GDN since 42), since session 36
    # before 4 consumer ranges where each has 32 chunks (auto: (1, 8192, 16) here), beside the whole scan elsewhere.
    # The bf16 gate, the bits of one consumer launch (the ranges' promise), and run-twice bits. A candidate default
    # (REWY_TEST_GPU_SCHEDULE) is gated here before it is adopted
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 7, gate_div=1.0)
    s = _gpu_default(op=op, policy="A")
    assert s.dq_stage == "separate"
    out = run_triton(x, s, "A")
    ctx = f"gpu {op} A default {B},{T},{H}"
    assert_bf16(out, oracle({n: (t.float() if t is not None else None) for n, t in x.items()}), ctx)
    assert_same_bits(run_triton(x, s.replace(consumer_ranges=1), "A"), out, ctx=ctx + ", one consumer launch")
    assert_same_bits(run_triton(x, s, "A"), out, ctx=ctx + ", run twice")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("B,T,H", [(1, 2048, 16), (2, 2048, 16), (1, 8192, 16), (1, 1000, 4)])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_gpu_query_side_block_v(op, B, T, H, monkeypatch):
    # Schedule.query_side_block_v: the policy-A default's query-side stage at 32-wide value tiles beside the reverse
    # scan (its launch checked), the bf16 gate against the fp64 oracle, and run-twice bits
    from rewy_tune.kernels.triton import query_side

    s = _gpu_default(op=op, policy="A").replace(query_side_block_v=32)
    widths = []
    spy_kernel_launches(monkeypatch, query_side, "rewy_bwd_kernel_query_side",
                        lambda args, kw, grid: widths.append(kw["BV"]))
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 61, gate_div=1.0)
    out = run_triton(x, s, "A")
    ctx = f"gpu {op} A default, query_side_block_v 32, {B},{T},{H}"
    assert widths == [32], ctx
    assert_bf16(out, oracle({n: (t.float() if t is not None else None) for n, t in x.items()}), ctx)
    assert_same_bits(run_triton(x, s, "A"), out, ctx=ctx + ", run twice")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("B,T,H", [(1, 512, 4), (1, 500, 4), (1, 2048, 16)])
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_gpu_small_grid_scan_in_the_defaults(op, policy, B, T, H, monkeypatch):
    # Schedule.reverse_scan_small_grid_block_v in each operator's default under each policy: the reverse scan's
    # value-tile width the rule gives for this grid on this GPU, the bf16 gate, run-twice bits
    from rewy_tune.kernels.triton import scan
    from rewy_tune.kernels.triton.pipeline import small_grid_block_v

    s = _gpu_default(op=op, policy=policy)
    widths = []
    spy_kernel_launches(monkeypatch, scan, "rewy_bwd_scan_kernel", lambda args, kw, grid: widths.append(kw["BV"]))
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 40, gate_div=1.0)
    out = run_triton(x, s, policy)
    ctx = f"gpu {op} {policy} default {B},{T},{H} (small-grid width {s.reverse_scan_small_grid_block_v})"
    assert_bf16(out, oracle({n: (t.float() if t is not None else None) for n, t in x.items()}), ctx)
    programs = B * H * (128 // s.reverse_scan.block_v)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if T <= 512:  # 8 chunks: no split, no ranges, so the rule alone decides the width
        assert widths[-1] == small_grid_block_v(s, programs, sms, whole=True), ctx
    assert_same_bits(run_triton(x, s, policy), out, ctx=ctx + ", run twice")



@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("B,T,H", [(1, 500, 4), (1, 2048, 16), (2, 2048, 16), (1, 8192, 16)])
@pytest.mark.parametrize("op,policy", [("deltanet", "A"), ("deltanet", "R"), ("gdn", "A")])
def test_gpu_consumer_loads(op, policy, B, T, H):
    # Schedule.consumer_loads on the operator's default (DeltaNet A's takes "flat"; with GDN A's query-side stage since
    # session 42 "flat" is run for it too): each value passes the bf16 gate and gives the bits of "at_use" (pointer
    # loads and one flat loop feed the same products in the same order) but for the gradients made of row sums:
    # d_write's ⟨v, P⟩ are reduced in the pointer-loaded v tile's layout, in another order (session 41, H100: every
    # other gradient the same bits), and under "flat" GDN's dg, whose row sums (the dk epilogue's, inside the flat
    # loop) came out in another order at every B·H = 16/32 shape with dq, dk, dv the same bits (session 47, H100). So
    # these are held to a bf16 rounding step of "at_use"'s; run twice, the same bits beside the reverse scan
    s = _gpu_default(op=op, policy=policy)
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 41, gate_div=1.0)
    ref = oracle({n: (t.float() if t is not None else None) for n, t in x.items()})
    base = run_triton(x, s.replace(consumer_loads="at_use"), policy)
    for loads in ("ahead", "flat") if s.dq_stage == "separate" else ("ahead",):
        ctx = f"gpu {op} {policy} default {B},{T},{H} consumer_loads {loads}"
        out = run_triton(x, s.replace(consumer_loads=loads), policy)
        assert_bf16(out, ref, ctx)
        row_sums = ("d_write", "dg") if loads == "flat" else ("d_write",)
        assert_same_bits({**out, **dict.fromkeys(row_sums)}, {**base, **dict.fromkeys(row_sums)},
                         ctx=ctx + " against 'at_use'")
        for n in row_sums:
            if base[n] is not None:
                a, b = out[n].float(), base[n].float()
                assert torch.allclose(a, b, rtol=2 ** -7, atol=1e-6 * b.abs().max().item()), f"{ctx}: {n}"
        assert_same_bits(run_triton(x, s.replace(consumer_loads=loads), policy), out, ctx=ctx + ", run twice")


@pytest.mark.parametrize("order,column,k_split", [("fused", "scratch", 1), ("dq_first", "gamma_t", 1),
                                                    ("fused", "gamma_t", 2)])
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_query_side_stage(op, policy, order, column, k_split):
    # dq_stage "separate": dq and Ḡ's query side from their own stage, the descriptor consumer without them. The
    # gates on a tail chunk with an initial state; dq, dk and dg equal to the fused consumer's to rounding (the
    # same products, Ḡ's terms summed in another order)
    x = make_inputs(op, 1, 100, 2, 32, 32, seed=53)
    fused = BASE.replace(consumer="joint_tma", consumer_order=order, column_side=column, consumer_k_split=k_split,
                         consumer_cfg={"block_k": 16})
    apart = fused.replace(dq_stage="separate")
    a, b = run_triton(x, fused, policy), run_triton(x, apart, policy)
    assert_gates(b, oracle(x), ctx=f"{op} {policy} dq_stage separate {order} {column} k_split {k_split}")
    for n in NAMES:
        if a[n] is not None:
            # another summation order moves a sum by rounding of its largest terms, not of the (cancelled) result:
            # the absolute tolerance scales with the tensor (on this machine's numpy dg moved 1.9e-6 at |dg| 16)
            atol = 1e-6 * max(1.0, b[n].abs().max().item())
            assert torch.allclose(a[n], b[n], rtol=1e-5, atol=atol), n


def test_query_side_stage_runs_once_and_feeds_the_consumer(monkeypatch):
    # the stage runs once, after the forward scan (policy R) and before the consumer, and its dq is the one returned
    from rewy_tune.kernels.triton import pipeline

    log, made = [], {}
    real = pipeline.query_side

    def stage(*a, **kw):
        log.append("query_side")
        made["dq"], made["dk"], gbq = real(*a, **kw)
        return made["dq"], made["dk"], gbq

    monkeypatch.setattr(pipeline, "query_side", stage)
    for attr in ("forward_state_scan", "reverse_state_scan", "consumer_tma"):
        fn = getattr(pipeline, attr)
        monkeypatch.setattr(pipeline, attr, (lambda name, f: lambda *a, **kw: log.append(name) or f(*a, **kw))(attr, fn))
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=59)
    out = run_triton(x, BASE.replace(consumer="joint_tma", dq_stage="separate"))
    assert log == ["forward_state_scan", "query_side", "reverse_state_scan", "consumer_tma"]
    assert out["dq"] is made["dq"] and out["dk"] is made["dk"]  # dk: its query part completed in place
    log.clear()
    run_triton(x, BASE.replace(consumer="joint", dq_stage="separate"))  # the pointer consumer does not read it
    assert "query_side" not in log


def test_tma_consumer_rejects_a_mismatched_given_dq():
    # a dq from the query-side stage must have q's shape, and Ḡ's query side comes with it exactly when there is a gate
    from rewy_tune.kernels.triton.consumer_tma import consumer_tma

    args = _consumer_args(True, torch.float32)  # gated
    q = args[0]
    kw = dict(scale=0.3, chunk_size=64, BK=16, BV=32)
    with pytest.raises(ValueError, match=r"a given dq must have q's shape .*, and gbq be given exactly when G is"):
        consumer_tma(*args, **kw, dq=torch.zeros_like(q), gbq=None)
    with pytest.raises(ValueError, match=r"a given dq must have q's shape"):
        consumer_tma(*args, **kw, dq=torch.zeros_like(q)[:, :-1], gbq=torch.zeros(q.shape[:3]))
    # dk's query part comes with dq, in k's shape and dtype: the kernel adds the rest of dk to it in place
    gbq = torch.zeros(q.shape[:3])
    with pytest.raises(ValueError, match=r"dk \(the query-side stage's query part\) must be given exactly when dq is"):
        consumer_tma(*args, **kw, dq=torch.zeros_like(q), gbq=gbq)
    with pytest.raises(ValueError, match=r"must be given exactly when dq is, contiguous with k's shape"):
        consumer_tma(*args, **kw, dk=torch.zeros_like(args[1]))
    with pytest.raises(ValueError, match=r"and dtype torch.float32; got \(.*torch.float64\)"):
        consumer_tma(*args, **kw, dq=torch.zeros_like(q), gbq=gbq, dk=torch.zeros_like(args[1], dtype=torch.float64))


def test_query_side_rejects_bad_shapes():
    from rewy_tune.kernels.triton.query_side import query_side

    q = torch.zeros(1, 100, 2, 32)
    R, do = torch.zeros(1, 100, 2, 16), torch.zeros(1, 100, 2, 16)
    S0 = torch.zeros(1, 2, 2, 32, 16)
    with pytest.raises(ValueError, match=r"S0 must have shape \(1, 4, 2, 32, 16\)"):
        query_side(q, q, R, S0, None, do, scale=1.0, chunk_size=32)
    with pytest.raises(ValueError, match=r"R \(1, 100, 2, 16\)"):
        query_side(q, q, R[:, :50], S0, None, do, scale=1.0, chunk_size=64)
    with pytest.raises(ValueError, match=r"G must be None or a scalar gate"):
        query_side(q, q, R, torch.zeros(1, 2, 2, 32, 16), torch.zeros(1, 100, 2, 32), do, scale=1.0, chunk_size=64)


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", [(2, 2048, 16), (1, 1000, 4)])
def test_gpu_tma_dq_first_bf16(op, B, T, H):
    # joint_tma's "dq_first" phase-2 order at 8 and 4 warps (4: two CTAs per SM), and P's tiles kept from phase 1
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H, gate_div=1.0)
    ref = oracle({n: (t.float() if t is not None else None) for n, t in x.items()})
    for warps, column, p_tiles, k_split in ((8, "scratch", "recompute", 1), (4, "scratch", "recompute", 1),
                                            (8, "gamma_t", "recompute", 1), (4, "gamma_t", "stored", 1),
                                            (4, "gamma_t", "recompute", 2), (4, "scratch", "recompute", 2)):
        s = _gpu_default().replace(consumer="joint_tma", consumer_order="dq_first", column_side=column,
                                   p_tiles=p_tiles, consumer_cfg={"num_warps": warps}, consumer_k_split=k_split)
        assert_bf16(run_triton(x, s), ref,
                    f"gpu {op} {B},{T},{H} joint_tma dq_first {column} {p_tiles} {warps} warps k_split {k_split}")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", [(2, 2048, 16), (1, 1000, 4)])
def test_gpu_query_side_stage(op, B, T, H, policy):
    # dq_stage "separate" on the main stream beside the side stream's reverse scan: the same bits as in order (waves
    # 0: the scans split alike either way), the bf16 gate, and fp32 inputs to the project gate.
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 7, gate_div=1.0)
    s = _gpu_default().replace(consumer="joint_tma", dq_stage="separate", scan_split_waves=0)
    in_order, beside = run_triton(x, s.replace(side_stream="none"), policy), run_triton(x, s, policy)
    for n in NAMES:
        if in_order[n] is not None:
            assert torch.equal(in_order[n], beside[n]), n
    assert_bf16(beside, oracle({n: (t.float() if t is not None else None) for n, t in x.items()}),
                f"gpu {op} {B},{T},{H} {policy} dq_stage separate")
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.float32, device="cuda", seed=B * T + H + 8, gate_div=1.0)
    s = _gpu_default("fp32").replace(consumer="joint_tma", dq_stage="separate")
    assert_gates(run_triton(x, s, policy), oracle(x), ctx=f"gpu fp32 {op} {B},{T},{H} {policy} dq_stage separate")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_gpu_query_side_stage_race_beside(op, policy):
    # Session 34 (the same case as benchmarks/query_side_race.py): GDN policy R at (2, 2048, 16), 8 of 8 runs beside
    # the reverse scan differed from the in-order run in dk and dg (DeltaNet: 3 of 8, dk), while dq, dv and dh0
    # kept their bits. The stage's V loop fed dO and R to products and to ⟨dO, R⟩ in registers, and Triton 3.6 left
    # those tiles in one-slot buffers that the next copy overwrote under the products (rewy_tune/ir_hazards.py);
    # beside the scan's programs the products ran late enough to read it. Session 35 takes ⟨dO, R⟩ from H.
    x = make_inputs(op, 2, 2048, 16, 128, 128, dtype=torch.bfloat16, device="cuda", seed=4103, gate_div=1.0)
    s = _gpu_default().replace(consumer="joint_tma", dq_stage="separate", scan_split_waves=0)
    in_order = run_triton(x, s.replace(side_stream="none"), policy)
    for _ in range(8):
        beside = run_triton(x, s, policy)
        for n in NAMES:
            if in_order[n] is not None:
                assert torch.equal(in_order[n], beside[n]), n


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", [(1, 2048, 16), (2, 2048, 16), (1, 8192, 4), (1, 1000, 4)])
@pytest.mark.parametrize("variant", ["transposed", "dv_local_in_scan", "step_forms"])
def test_gpu_reverse_scan_variants(variant, op, B, T, H, policy):
    # "transposed": Schedule.reverse_scan_layout "vk" (session 35), 64-wide value tiles at 4 and 8 warps, 32-wide (no
    # wgmma there) at 4. "dv_local_in_scan": Schedule.dv_local_source "scan" (session 36), no dv_local stage, the
    # reverse scan's chunk steps form A_qk and dv_local, on each policy's default (DeltaNet A: the query-side stage)
    # with its consumer ranges and split scans. "step_forms": Schedule.scan_state_rows 128 and reverse_scan_qdo
    # "ahead" (session 37) from each policy's default with 64-row blocks in step (session 37's), alone, together,
    # together at 8 warps, and 128 rows with "split" (DeltaNet A's default since session 38).
    # The bf16 gate, with initial state and a tail at (1, 1000, 4), and run-twice bits
    from rewy_tune.search_spaces import constraint, default_schedule

    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 3, gate_div=1.0)
    ref = oracle({n: (t.float() if t is not None else None) for n, t in x.items()})
    default = default_schedule(torch.cuda.get_device_capability(), op=op, policy=policy)
    if variant == "transposed":
        schedules = {f"vk BV {bv} {warps} warps": _gpu_default().replace(
            reverse_scan_layout="vk", reverse_scan={"block_v": bv, "num_warps": warps})
            for bv, warps in ((64, 4), (64, 8), (32, 4))}
    elif variant == "dv_local_in_scan":
        in_scan = default.replace(dv_local_source="scan")
        dims = {"K": 128, "V": 128, "dtype": "bf16", "compute_capability": torch.cuda.get_device_capability()}
        if constraint(in_scan, dims, op):
            # DeltaNet A's default forms Qᵀ dO ahead where its reverse scan splits (session 38): with A_qk formed in
            # the scan too that needs 237 568 B at 3 stages (session 47, H100: OutOfResources at (1, 8192, 4)), which
            # the constraint rejects; at 2 stages it fits (147 456 B compiled unsplit on a CPU), and the constraint
            # accepts it
            in_scan = in_scan.replace(reverse_scan={"num_stages": 2})
        assert not constraint(in_scan, dims, op)  # one the tuner could run, not one it rejects before compiling
        schedules = {"dv_local in the scan": in_scan}
    else:
        plain = default.replace(scan_state_rows=64, reverse_scan_qdo="in_step")
        both = plain.replace(scan_state_rows=128, reverse_scan_qdo="ahead")
        schedules = {"64-row state": plain, "128-row state": plain.replace(scan_state_rows=128),
                     "Qᵀ dO ahead": plain.replace(reverse_scan_qdo="ahead"), "both": both,
                     "both, 8 warps": both.replace(reverse_scan={"num_warps": 8}),
                     "128-row state, ahead where split": plain.replace(scan_state_rows=128, reverse_scan_qdo="split")}
    for name, s in schedules.items():
        ctx = f"gpu {op} {B},{T},{H} {policy} {name}"
        out = run_triton(x, s, policy)
        assert_bf16(out, ref, ctx)
        assert_same_bits(run_triton(x, s, policy), out, ctx=ctx + ", run twice")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("ranges", [2, 4, 8])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_gpu_query_side_stage_with_consumer_ranges(op, ranges):
    # policy A with an explicit consumer_ranges: the query-side stage beside the ranged reverse scan, before the
    # consumer ranges (session 35, CPU-tested only until this runs): the in-order bits, 4 runs, and the bf16 gate
    x = make_inputs(op, 1, 8192 - 40, 16, 128, 128, dtype=torch.bfloat16, device="cuda", seed=ranges, gate_div=1.0)
    s = _gpu_default().replace(consumer="joint_tma", dq_stage="separate", consumer_ranges=ranges, w_source="forward")
    in_order = run_triton(x, s.replace(side_stream="none", consumer_ranges=1), "A")
    for _ in range(4):
        ranged = run_triton(x, s, "A")
        for n in NAMES:
            if in_order[n] is not None:
                assert torch.equal(in_order[n], ranged[n]), n
    assert_bf16(ranged, oracle({n: (t.float() if t is not None else None) for n, t in x.items()}),
                f"gpu {op} query side with {ranges} consumer ranges")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", [(1, 2048, 4), (2, 2000, 16)])
def test_gpu_fp32_gate(op, B, T, H, policy):
    # fp32 inputs at benchmark sizes: the project gate (0.8 % / 2 %), compiled kernels (tf32 never used: "ieee").
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.float32, device="cuda", seed=T + H, gate_div=1.0)
    base = _gpu_default("fp32")
    for name, s in (("default", base), ("separate", _with_consumer(base, "separate")),
                    ("joint_tma", _with_consumer(base, "joint_tma"))):
        assert_gates(run_triton(x, s, policy), oracle(x), ctx=f"gpu fp32 {op} {B},{T},{H} {policy} {name}")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("KV", [64, 256])
def test_gpu_head_dims(op, KV):
    from rewy_tune.search_spaces import default_schedule

    s = default_schedule(torch.cuda.get_device_capability(), K=KV, V=KV)
    x = make_inputs(op, 1, 1000, 4, KV, KV, dtype=torch.bfloat16, device="cuda", seed=KV, gate_div=1.0)
    assert_bf16(run_triton(x, s), oracle({n: (t.float() if t is not None else None) for n, t in x.items()}),
                f"gpu {op} K=V={KV} bf16")
    s = default_schedule(torch.cuda.get_device_capability(), K=KV, V=KV, dtype="fp32")
    x = make_inputs(op, 1, 1000, 4, KV, KV, dtype=torch.float32, device="cuda", seed=KV, gate_div=1.0)
    assert_gates(run_triton(x, s), oracle(x), ctx=f"gpu {op} K=V={KV} fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("consumer", ["joint", "separate", "joint_tma", "joint_tma-k2"])
def test_gpu_run_twice_bitwise(consumer):
    # joint_tma-k2: two programs per chunk, the row gradients summed from parts in a fixed order
    x = make_inputs("gdn", 2, 2048, 16, 128, 128, dtype=torch.bfloat16, device="cuda", seed=1, gate_div=1.0)
    s = _with_consumer(_gpu_default(), consumer.removesuffix("-k2"))
    s = s.replace(consumer_k_split=2) if consumer.endswith("-k2") else s
    a, b = run_triton(x, s), run_triton(x, s)
    for n in NAMES:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", [(1, 2048, 16), (1, 1000, 4)])
def test_gpu_side_stream(op, B, T, H):
    # dv_local (and the reverse scan) on a second stream beside the recompute stage and the forward scan: the same
    # kernels on the same inputs give the same bits as in order (a missing fork or join would race), and the gate
    # waves 0 (no split limit): the scans split alike in order and beside each other (with a limit, side by side
    # they split on half the SMs: test_scans_side_by_side_split_on_half_the_sms)
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H, gate_div=1.0)
    base = _gpu_default().replace(scan_split_waves=0)
    in_order = run_triton(x, base.replace(side_stream="none"))
    ref = oracle({n: (t.float() if t is not None else None) for n, t in x.items()})
    for mode in ("dv_local", "reverse_scan"):
        beside = run_triton(x, base.replace(side_stream=mode))
        for n in NAMES:
            if in_order[n] is not None:
                assert torch.equal(in_order[n], beside[n]), (mode, n)
        assert_bf16(beside, ref, f"gpu {op} {B},{T},{H} side stream {mode}")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", [(1, 2048, 16), (2, 2048, 16), (1, 1000, 4)])
def test_gpu_consumer_ranges(op, B, T, H):
    # policy A (the reverse scan runs last and alone): each consumer range on the main or the second stream after
    # the side stream's scan of it. The same bits as one scan then one consumer launch (a missing wait would race),
    # and the bf16 gate; (1, 1000, 4): the scan splits there and the ranges fall back to one
    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 11, gate_div=1.0)
    base = _gpu_default()
    one = run_triton(x, base.replace(consumer_ranges=1), "A")
    for n in (2, 4, 8):
        ranged = run_triton(x, base.replace(consumer_ranges=n), "A")
        assert_same_bits(ranged, one, ctx=f"{n} ranges")
    assert_bf16(ranged, oracle({n: (t.float() if t is not None else None) for n, t in x.items()}),
                f"gpu {op} {B},{T},{H} A consumer ranges")


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
@pytest.mark.parametrize("B,T,H", [(1, 2048, 16), (2, 2048, 16), (1, 8192, 16), (1, 1000, 4)])
def test_gpu_consumer_chases_scan(op, B, T, H, monkeypatch):
    # pipeline.CONSUMER_CHASES_SCAN under policy A: the consumer launched as the reverse scan's programmatic
    # dependent, each program waiting for its chunk's count. The same bits as the consumer launched after the scan
    # (a missing wait, release or proxy fence would read R̄ or dS1 before the scan wrote them), twice, and the bf16
    # gate. (1, 1000, 4) with the split off, so that the scan runs unsplit and is chased there too
    from rewy_tune.kernels.triton import pipeline

    x = make_inputs(op, B, T, H, 128, 128, dtype=torch.bfloat16, device="cuda", seed=B * T + H + 13, gate_div=1.0)
    base = _gpu_default() if H >= 16 else _gpu_default().replace(scan_split_waves=0, reverse_scan_segments=1)
    after = run_triton(x, base, "A")
    seen = _chase_spy(monkeypatch)
    monkeypatch.setattr(pipeline, "CONSUMER_CHASES_SCAN", True)
    for _ in range(2):
        chased = run_triton(x, base, "A")
        assert_same_bits(chased, after, ctx=f"gpu {op} {B},{T},{H} chase")
    assert len(seen) == 2 and all(p is not None and p.pdl for p in seen)
    assert bool((seen[-1].flags == seen[-1].programs).all())
    assert_bf16(chased, oracle({n: (t.float() if t is not None else None) for n, t in x.items()}),
                f"gpu {op} {B},{T},{H} A chase")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_gpu_cuda_graph_replay_chase(op, monkeypatch):
    # policy A with the consumer chasing the scan, captured in a CUDA graph (the programmatic launch becomes a
    # programmatic edge) and replayed on other inputs: the bits of an eager call on those inputs
    from rewy_tune.kernels.triton import pipeline

    monkeypatch.setattr(pipeline, "CONSUMER_CHASES_SCAN", True)
    s = _gpu_default()
    scale = 128 ** -0.5

    def inputs(seed):
        x = make_inputs(op, 1, 2048, 16, 128, 128, dtype=torch.bfloat16, device="cuda", seed=seed, gate_div=1.0)
        f = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=scale, initial_state=x["h0"],
                          save_states=True)
        return {**x, "A": f.A, "S0": f.S0, "R": f.R.to(x["q"].dtype), "G": f.G, "W": f.W.to(x["q"].dtype)}

    def bwd(t):
        return rewy_backward_triton(t["q"], t["k"], t["v"], t["g"], t["beta"], t["beta"], t["A"], t["do"], t["dht"],
                                    scale=scale, initial_state=t["h0"], schedule=s, S0=t["S0"], R=t["R"], G=t["G"],
                                    W=t["W"])

    static = {n: (t.clone() if t is not None else None) for n, t in inputs(1).items()}
    graph, outs = capture(lambda: bwd(static))
    y = inputs(2)
    for n, t in y.items():
        if t is not None:
            static[n].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    for n, a, b in zip(NAMES, outs, bwd(y)):
        if b is not None:
            assert torch.equal(a, b), n


@pytest.mark.gpu
@pytest.mark.parametrize("consumer,stream", [("joint", "none"), ("joint_tma", "none"), ("joint_tma", "dv_local"),
                                             ("joint_tma", "reverse_scan"), ("joint_tma", "none-ranges")])
def test_gpu_cuda_graph_replay(consumer, stream):
    # joint_tma: host-built descriptors captured in the graph; a side stream: the capture forks a second stream,
    # allocates on it ("reverse_scan": the reverse scan's outputs) and joins it; "none-ranges": the consumer in four
    # chunk ranges after the side stream's scan of each (events captured across the two streams)
    s = _with_consumer(_gpu_default(), consumer).replace(side_stream=stream.removesuffix("-ranges"))
    s = s.replace(consumer_ranges=4, scan_split_waves=0, reverse_scan_segments=1) if stream.endswith("-ranges") else s
    x = make_inputs("gdn", 1, 2048, 4, 128, 128, dtype=torch.bfloat16, device="cuda", seed=1, gate_div=1.0)
    y = make_inputs("gdn", 1, 2048, 4, 128, 128, dtype=torch.bfloat16, device="cuda", seed=2, gate_div=1.0)
    scale = 128 ** -0.5
    fx = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], scale=scale, initial_state=x["h0"])
    fy = chunk_forward(y["q"], y["k"], y["v"], y["g"], y["beta"], y["beta"], scale=scale, initial_state=y["h0"])
    static = {**{n: t.clone() for n, t in x.items()}, "A": fx.A.clone()}

    def bwd():
        return rewy_backward_triton(static["q"], static["k"], static["v"], static["g"], static["beta"], static["beta"],
                                    static["A"], static["do"], static["dht"], scale=scale, initial_state=static["h0"],
                                    schedule=s)

    graph, outs = capture(bwd)
    for n, t in y.items():
        static[n].copy_(t)
    static["A"].copy_(fy.A)
    graph.replay()
    torch.cuda.synchronize()
    eager = rewy_backward_triton(y["q"], y["k"], y["v"], y["g"], y["beta"], y["beta"], fy.A, y["do"], y["dht"],
                                 scale=scale, initial_state=y["h0"], schedule=s)
    for n, a, b in zip(NAMES, outs, eager):
        if b is not None:
            assert torch.equal(a, b), n


# ----------------------------------------------------------------------------------------------------------
# search space


def test_search_space_defaults_and_constraints():
    from rewy_tune.search_spaces import constraint, default_schedule, schedule_from_params, space

    for K in (64, 128, 256):
        s = default_schedule((9, 0), K=K, V=K)
        assert constraint(s, {"K": K, "V": K, "dtype": "bf16", "compute_capability": (9, 0)}) == []
    assert constraint(default_schedule(None), {"K": 128, "V": 128, "smem_limit": 101376}) == []
    # every single choice builds a valid Schedule
    sp = space(128, 128)
    for name, choices in sp.items():
        for c in choices:
            schedule_from_params({name: c}, base=default_schedule((9, 0)))
    huge = default_schedule((9, 0)).replace(consumer_cfg={"block_k": 128, "block_v": 128, "num_warps": 2,
                                                          "num_stages": 3})
    reasons = constraint(huge, {"K": 128, "V": 128, "dtype": "fp32"})
    assert any("shared memory" in r for r in reasons) and any("spill" in r for r in reasons)
    assert any("must cover" in r or "< K" in r for r in constraint(BASE, {"K": 128, "V": 128}))
    assert any("does not divide" in r for r in constraint(default_schedule((9, 0), K=96, V=96).replace(
        consumer_cfg={"block_k": 64}), {"K": 96, "V": 96}))


# ----------------------------------------------------------------------------------------------------------
# autograd Function (CPU: reference forward + Triton backward; CUDA: FLA forward + Triton backward)


def _function_grads(x, policy, schedule, device="cpu"):
    from rewy_tune.kernels.triton_function import RewyTritonFunction

    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "beta", "h0")}
    g = x["g"].detach().clone().requires_grad_(True) if x["g"] is not None else None
    o, ht = RewyTritonFunction.apply(leaves["q"], leaves["k"], leaves["v"], g, leaves["beta"], leaves["beta"],
                                     leaves["h0"], None, 64, policy, True, schedule)
    loss = (o.float() * x["do"].float()).sum() + (ht * x["dht"]).sum()
    loss.backward()
    return dict(dq=leaves["q"].grad, dk=leaves["k"].grad, dv=leaves["v"].grad, dg=g.grad if g is not None else None,
                dbeta=leaves["beta"].grad, dh0=leaves["h0"].grad)


@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_autograd_function_cpu(op, policy):
    x = make_inputs(op, 1, 100, 2, 32, 32, seed=21)
    got = _function_grads(x, policy, BASE)
    ref = oracle(x)
    ref["dbeta"] = ref["d_erase"] + ref["d_write"]
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        if ref.get(n) is None:
            assert got[n] is None
            continue
        tol = GATE if n in ("dg", "dbeta") else ORDINARY
        assert rel_rms(got[n], ref[n]) <= tol, n


@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_policy_a_takes_the_forward_w(op, monkeypatch):
    # w_source "forward": under policy A the Function keeps the forward's W and the backward runs no recompute stage;
    # under R the field is not read (W is recomputed, as FLA's policy R keeps no w)
    from rewy_tune.kernels.triton import pipeline

    x = make_inputs(op, 1, 100, 2, 32, 32, seed=29)
    ref = oracle(x)
    ref["dbeta"] = ref["d_erase"] + ref["d_write"]
    calls = []
    real = pipeline.recompute_wu
    monkeypatch.setattr(pipeline, "recompute_wu", lambda *a, **kw: calls.append(kw.get("want_u")) or real(*a, **kw))
    for policy, recomputed in (("A", []), ("R", [True])):
        calls.clear()
        got = _function_grads(x, policy, BASE.replace(w_source="forward"))
        assert calls == recomputed, policy
        for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
            if ref.get(n) is not None:
                assert rel_rms(got[n], ref[n]) <= (GATE if n in ("dg", "dbeta") else ORDINARY), (policy, n)
    calls.clear()
    _function_grads(x, "A", BASE)  # policy A recomputing W asks for W alone
    assert calls == [False]


def test_forward_w_is_checked():
    x = make_inputs("gdn", 1, 100, 2, 32, 32, seed=31)
    fwd = chunk_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], initial_state=x["h0"], save_states=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["beta"], fwd.A, x["do"], x["dht"])
    kw = dict(scale=1.0, initial_state=x["h0"], schedule=BASE)
    with pytest.raises(ValueError, match="W .* comes with policy A: pass S0 and R"):
        rewy_backward_triton(*args, **kw, W=fwd.W)
    with pytest.raises(ValueError, match=r"W must be \[B,T,H,K\]=\(1, 100, 2, 32\) in k's dtype torch.float32"):
        rewy_backward_triton(*args, **kw, S0=fwd.S0, R=fwd.R, W=fwd.W[:, :50])
    with pytest.raises(ValueError, match="W must be .* got .* in torch.bfloat16"):
        rewy_backward_triton(*args, **kw, S0=fwd.S0, R=fwd.R, W=fwd.W.bfloat16())


@pytest.mark.gpu
@BF16_ON_INTERPRETER
@pytest.mark.parametrize("w_source", ["recompute", "forward"])
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_autograd_function_gpu(op, policy, w_source):
    # FLA forward (bf16 A, h, v_new; w under A with w_source "forward") + ReWY backward, held to the project gate
    # (see BF16_ON_INTERPRETER).
    if policy == "R" and w_source == "forward":
        pytest.skip("w_source is read under policy A only")
    x = make_inputs(op, 2, 1000, 4, 128, 128, dtype=torch.bfloat16, device="cuda", seed=23, gate_div=1.0)
    sched = _gpu_default().replace(w_source=w_source)  # both explicit: the default takes "forward" (session 15)
    got = _function_grads(x, policy, sched)
    ref = oracle({n: (t.float() if t is not None else None) for n, t in x.items()})
    ref["dbeta"] = ref["d_erase"] + ref["d_write"]
    for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0"):
        if ref.get(n) is None:
            continue
        tol = BF16_GATE if n in ("dg", "dbeta") else BF16_ORDINARY
        assert torch.isfinite(got[n].float()).all() and rel_rms(got[n], ref[n]) <= tol, n


# ----------------------------------------------------------------------------------------------------------
# Hopper compile check without a GPU: the interpreter accepts code the compiler rejects (e.g. a non-constexpr
# static_range bound), so compile every kernel variant for sm_90 in a subprocess without TRITON_INTERPRET.

_COMPILE_SCRIPT = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rewy_tune.kernels.triton import consumer_tma, local

target = GPUTarget("cuda", 90, 32)
def compile_(fn, sig, consts, nw):
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                   options={"num_warps": nw, "num_stages": 2})

for dt in ("bf16",):  # the production dtype; fp32 differs only in dot precision
    p = "*" + dt
    for use_g in (True,):
        compile_(local.rewy_bwd_kernel_dv_local,
                 {"q": p, "k": p, "G": "*fp32", "do": p, "dv": p, "T": "i32", "scale": "fp32", "H": "i32",
                  "K": "constexpr", "V": "constexpr", "BT": "constexpr", "BK": "constexpr", "BV": "constexpr",
                  "USE_G": "constexpr", "PREC": "constexpr"},
                 {"K": 128, "V": 128, "BT": 64, "BK": 64, "BV": 64, "USE_G": use_g,
                  "PREC": "ieee" if dt == "fp32" else "tf32"}, 4)
    compile_(local.rewy_bwd_kernel_producer,
             {"A": p, "Rbar": p, "R": p, "P": "*fp32", "D": "*fp32", "T": "i32", "H": "i32", "V": "constexpr",
              "BT": "constexpr", "BV": "constexpr", "PREC": "constexpr"},
             {"V": 128, "BT": 64, "BV": 64, "PREC": "ieee" if dt == "fp32" else "tf32"}, 4)
    for joint, use_g in ((True, True), (False, False)):
        if True:
            sig = {n: p for n in ("q", "k", "v", "erase", "write", "A", "R", "Rbar", "do", "dq", "dk", "dv",
                                  "derase", "dwrite")}
            sig.update({n: "*fp32" for n in ("G", "S0", "dS1", "P", "D", "dk_col", "dg")})
            sig.update({"T": "i32", "NT": "i32", "H": "i32", "scale": "fp32"})
            sig.update({n: "constexpr" for n in ("K", "V", "BT", "BK", "BV", "USE_G", "JOINT", "PREC", "ONE_BETA")})
            compile_(local.rewy_bwd_kernel_consumer, sig,
                     {"K": 128, "V": 128, "BT": 64, "BK": 64, "BV": 64, "USE_G": use_g, "JOINT": joint,
                      "PREC": "ieee" if dt == "fp32" else "tf32", "ONE_BETA": joint}, 8)
    d4 = lambda bd, t=dt: f"tensordesc<{t}[1, 64, 1, {bd}]>"
    sig = {n: d4(64) for n in ("q_d", "k_d", "v_d", "r_d", "rb_d", "do_d", "dq_d", "dk_d", "dv_d")}
    sig.update({"a_d": d4(64), "s0_d": f"tensordesc<{dt}[1, 64, 64]>", "ds1_d": f"tensordesc<{dt}[1, 64, 64]>"})
    sig.update({"G": "*fp32", "erase": p, "write": p, "dg": "*fp32", "derase": p, "dwrite": p, "s0": p, "ds1": p})
    sig.update({"T": "i32", "NT": "i32", "H": "i32", "scale": "fp32", "n_tok": "i32", "c_off": "i32"})
    sig.update({n: "constexpr" for n in ("K", "V", "BT", "BK", "BV", "USE_G", "PREC", "ONE_BETA", "SPLIT_DQ",
                                         "GAMMA_T", "STORE_P", "KSPLIT")})
    for use_g, split, gamma_t, store_p, nw, ks, early in (
            (True, False, False, False, 8, 1, 0), (False, False, False, False, 8, 1, 0),
            (True, True, False, False, 8, 1, 0), (True, True, False, False, 4, 1, 0),
            (True, False, True, False, 8, 1, 0), (False, True, True, False, 4, 1, 0),
            (True, True, True, True, 4, 1, 0), (False, False, False, True, 8, 1, 0),
            (True, True, True, False, 4, 2, 0), (False, True, True, False, 4, 2, 0),
            # consumer_loads "ahead" (forming dq) and "flat" (dq, dk's query part and Ḡ_q given by the query side)
            (True, True, True, False, 4, 1, 3), (False, True, True, False, 4, 1, 5),
            (True, True, True, False, 4, 1, 5)):
        # the column-side scratch is one of two buffers: the other is passed as None (a constexpr); so is P's
        sig_g = {**sig, "dk_col": "constexpr" if gamma_t else "*fp32", "gam": p if gamma_t else "constexpr",
                 "pst": p if store_p else "constexpr"}
        given = bool(early & 4)  # the flat phase 2 is the query-side-given consumer's
        if early:
            sig_g.update({"a": p, "v": p, "k": p, **({"dkq": p, "gbq": "*fp32"} if given else {"q": p})})
        compile_(consumer_tma.rewy_bwd_kernel_consumer_tma, sig_g,
                 {"K": 128, "V": 128, "BT": 64, "BK": 64, "BV": 64, "USE_G": use_g, "PREC": "tf32",
                  "ONE_BETA": use_g, "SPLIT_DQ": split, "GAMMA_T": gamma_t, "STORE_P": store_p, "KSPLIT": ks,
                  "EARLY": early, "DQ_GIVEN": given,
                  **({"dk_col": None} if gamma_t else {"gam": None}), **({} if store_p else {"pst": None})}, nw)
    for has_w in (True, False):  # the k_split parts' sum (KDA-like two buffers, or one β)
        compile_(local.rewy_bwd_kernel_row_parts,
                 {"derp": "*fp32", "dwp": "*fp32" if has_w else "constexpr", "dgp": "*fp32", "derase": p,
                  "dwrite": p if has_w else "constexpr", "dg": "*fp32", "n_tok": "i32", "KSPLIT": "constexpr",
                  "HAS_WRITE": "constexpr", "HAS_G": "constexpr", "BLOCK": "constexpr"},
                 {"KSPLIT": 2, "HAS_WRITE": has_w, "HAS_G": True, "BLOCK": 1024,
                  **({} if has_w else {"dwp": None, "dwrite": None})}, 4)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    import shutil
    import subprocess
    import sys

    from rewy_tune.ir_hazards import bundled_tool

    if not (bundled_tool("ptxas") or shutil.which("ptxas")):
        pytest.skip("no ptxas to compile for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-4000:]


@pytest.mark.parametrize("dq_stage,k_split,loads,bits", [
    ("separate", 1, "ahead", 3), ("separate", 1, "flat", 5),
    ("separate", 2, "flat", 3),  # two programs a chunk: "flat" runs as "ahead"
    ("consumer", 1, "ahead", 3)])  # the consumer that forms dq too: Q ahead in place of dk's query part
@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn"])
def test_consumer_loads(op, policy, dq_stage, k_split, loads, bits, monkeypatch):
    # Schedule.consumer_loads: A, v, K and Q or dk's query part by pointer loads issued ahead of their use, and phase
    # 2 as one loop over (K tile, V tile) pairs. The same products in the same order: the bits of "at_use", and the
    # gates on a tail chunk with an initial state, two K tiles and two V tiles (the flat loop's index arithmetic);
    # the form each value launches
    from rewy_tune.kernels.triton import consumer_tma

    x = make_inputs(op, 1, 100, 2, 32, 32, seed=61)
    s = BASE.replace(consumer="joint_tma", consumer_order="dq_first", column_side="gamma_t", dq_stage=dq_stage,
                     consumer_k_split=k_split, consumer_cfg={"block_k": 16, "block_v": 16})
    ref = run_triton(x, s, policy)
    launched = set()
    spy_kernel_launches(monkeypatch, consumer_tma, "rewy_bwd_kernel_consumer_tma",
                        lambda a, kw, g: launched.add(kw["EARLY"]))
    out = run_triton(x, s.replace(consumer_loads=loads), policy)
    assert launched == {bits}
    assert_gates(out, oracle(x), ctx=f"{op} {policy} {dq_stage} k_split {k_split} {loads}")
    assert_same_bits(out, ref, ctx=f"{op} {policy} {dq_stage} k_split {k_split} {loads} against 'at_use'")


def test_consumer_loads_rejects_an_unknown_value():
    from rewy_tune.kernels.triton.consumer_tma import consumer_tma

    with pytest.raises(ValueError, match=r"consumer_loads must be one of \('at_use', 'ahead', 'flat'\), got 'early'"):
        BASE.replace(consumer_loads="early")
    with pytest.raises(ValueError, match=r"loads must be one of \('at_use', 'ahead', 'flat'\), got 'early'"):
        consumer_tma(*[None] * 12, scale=1.0, loads="early")  # refused before any tensor is read


def _public_deltanet(x, **kw):
    import rewy_tune

    q, k, v, beta = (x[n].clone().requires_grad_() for n in ("q", "k", "v", "beta"))
    o, _ = rewy_tune.chunk_deltanet(q, k, v, beta, initial_state=x["h0"], backend="triton", **kw)
    return o, (q, k, v, beta)


def test_caller_schedule_the_constraint_rejects_warns(monkeypatch):
    # A schedule passed to the public op goes through the search space's constraint (on CUDA; here its verdict is
    # stood in): the warning names the argument and every reason. The built-in default (schedule=None) is not checked.
    import warnings

    from rewy_tune.kernels import triton_function as tf

    seen = []
    monkeypatch.setattr(tf, "schedule_rejection", lambda s, q, K, V, op: seen.append((op, K, V)) or
                        "recompute.block_k=128 with 4 warps; shared memory 300000 B > 232448 B")
    x = make_inputs("deltanet", 1, 70, 1, 32, 32, seed=5)
    with pytest.warns(RuntimeWarning, match=r"schedule: the search space's constraint rejects this schedule for "
                                            r"deltanet K=32 V=32 .*recompute.block_k=128 with 4 warps; shared memory"
                      ) as caught:
        _public_deltanet(x, schedule=BASE)
    assert caught[0].filename == __file__  # points at the caller of rewy_tune.chunk_deltanet
    assert seen == [("deltanet", 32, 32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _public_deltanet(x)
    assert len(seen) == 1


def test_caller_schedule_rejection_on_sm90_and_off_cuda(monkeypatch):
    # a schedule with the sm_90 recompute fault (4 warps, block_k > block_v, 16-bit inputs): rejected for a CUDA
    # tensor on compute capability 9.0 (the device query stood in), not for a CPU tensor: the interpreter has no
    # shared-memory limit and no sm_90 miscompiles
    from types import SimpleNamespace

    from rewy_tune.kernels.triton_function import schedule_rejection
    from rewy_tune.search_spaces.scalar import recompute_fault_reasons

    faulty = BASE.replace(recompute={"block_k": 32, "block_v": 16, "num_warps": 4, "num_stages": 1})
    q = make_inputs("deltanet", 1, 70, 1, 32, 32, dtype=torch.bfloat16)["q"]
    assert schedule_rejection(faulty, q, 32, 32, "deltanet") is None
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    on_gpu = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device="cuda:1")
    reason = schedule_rejection(faulty, on_gpu, 32, 32, "deltanet")
    assert asked == ["cuda:1"] and reason.startswith("recompute.block_k=32 > block_v=16")
    assert reason == recompute_fault_reasons(faulty, 2, (9, 0))[0]  # that reason alone
    assert schedule_rejection(BASE, on_gpu, 32, 32, "deltanet") is None
    assert schedule_rejection(faulty, SimpleNamespace(is_cuda=True, dtype=torch.float32, device="cuda:0"),
                              32, 32, "deltanet") is None  # fp32 inputs compile another path


def test_out_of_resources_in_the_backward_names_the_schedule(monkeypatch):
    # Triton's OutOfResources names a kernel; the op's error names the argument to change and, on CUDA, the
    # constraint's reasons
    from triton.runtime.errors import OutOfResources

    from rewy_tune.kernels import triton_function as tf

    def over(*a, **kw):
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(tf, "rewy_backward_triton", over)
    x = make_inputs("deltanet", 1, 70, 1, 32, 32, seed=6)
    o, leaves = _public_deltanet(x, schedule=BASE)
    with pytest.raises(ValueError, match=r"schedule: a backward kernel needs more GPU resources than this device has "
                                         r"\(.*shared memory.*\) for deltanet K=32 V=32; pass a schedule with smaller"):
        torch.autograd.grad(o, leaves, x["do"])
    monkeypatch.setattr(tf, "schedule_rejection", lambda *a: "consumer: shared memory 300000 B > 232448 B")
    with pytest.warns(RuntimeWarning, match="consumer: shared memory"):  # the forward's warning came first
        o, leaves = _public_deltanet(x, schedule=BASE)
    with pytest.raises(ValueError, match=r"the search space's constraint says: consumer: shared memory 300000 B"):
        torch.autograd.grad(o, leaves, x["do"])


@pytest.mark.gpu
def test_gpu_caller_schedule_with_the_sm90_recompute_fault_warns():
    # the constraint's sm_90 rule (recompute at 4 warps with block_k > block_v gives a wrong U for 16-bit inputs):
    # a caller's schedule with it runs, but not unnoticed
    from rewy_tune.search_spaces import default_schedule

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the recompute fault rule is for compute capability 9.x")
    x = make_inputs("deltanet", 1, 128, 2, 64, 64, dtype=torch.bfloat16, device="cuda", seed=7)
    s = default_schedule((9, 0), K=64, V=64, op="deltanet", dtype="bf16", policy="R")
    s = s.replace(recompute={**s.recompute.to_dict(), "block_k": 64, "block_v": 16, "num_warps": 4})
    with pytest.warns(RuntimeWarning, match=r"recompute.block_k=64 > block_v=16 with 4 warps"):
        _public_deltanet(x, schedule=s)
