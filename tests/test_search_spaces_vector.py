"""The vector-gate (KDA, GDN2) search space: its choices, default, per-operator dispatch, and the calibration of
its resource model against the H200 gdn2 campaign and against Triton's own sm_90 shared-memory numbers."""

from __future__ import annotations

import json
import os
import re
import sqlite3
from pathlib import Path

import optuna
import pytest

from rewy_tune import search
from rewy_tune import search_spaces as ss
from rewy_tune.schedule import DV_LOCAL_SOURCES, INTRA_MODES, INTRA_PRECISIONS, Schedule, StageConfig
from rewy_tune.search_spaces import scalar, vector

DB = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200-campaign-gdn2-2026-11-30.db"
H200 = {"K": 128, "V": 128, "dtype": "bf16", "compute_capability": (9, 0)}


def _campaign_trials(campaign_id: int = 1) -> list[tuple[int, Schedule, str, str]]:
    con = sqlite3.connect(f"file:{DB}?immutable=1", uri=True)  # read-only, never writes -wal/-shm beside it
    try:
        rows = con.execute("SELECT number, schedule, status, message FROM trials WHERE campaign_id = ? "
                           "ORDER BY number", (campaign_id,)).fetchall()
    finally:
        con.close()
    return [(n, Schedule.from_dict(json.loads(s)), status, msg or "") for n, s, status, msg in rows]


# ----------------------------------------------------------------------------------------------------------
# calibration against the H200 gdn2 campaign (K = V = 128, bf16, chunk 64, sm_90: 232 448 B per block)


def test_h200_campaign_compile_errors_rejected_and_every_compiled_schedule_accepted():
    trials = _campaign_trials()
    failed = [t for t in trials if t[2] == "compile_error"]
    compiled = [t for t in trials if t[2] not in ("constraint", "compile_error")]  # ok / incorrect / ...: compiled
    assert [n for n, *_ in failed] == [5, 7]
    assert len(compiled) >= 3
    for n, sched, _, msg in failed:
        required = int(re.search(r"Required: (\d+)", msg).group(1))  # Triton's own number on the H200
        reasons = vector.constraint(sched, H200)
        assert any(r.startswith("reverse_scan: shared memory") for r in reasons), (n, reasons)
        assert vector.shared_memory_estimate(sched, 128, 128, 2)["reverse_scan"] >= required, n
        # through the package, as the tuner calls it (op from the keyword or from problem_dims)
        assert ss.constraint(sched, H200, op="gdn2") == reasons
        assert ss.constraint(sched, {**H200, "op": "kda"}) == reasons
        assert search.constraint_violation(sched, op="gdn2", K=128, V=128, compute_capability=(9, 0)) is not None
    for n, sched, status, _ in compiled:
        # This campaign ran the kernels from before H became a run-time argument (commit f14dbd3). Its trial 1 passed
        # with the recompute configuration that has miscompiled on sm_90 since (scalar.recompute_fault_reasons):
        # apart from that rejection, every compiled schedule is accepted.
        reasons = _without_tf32x3(vector.constraint(sched, H200))
        assert [r for r in reasons if not r.startswith("recompute.block_k=128 with 4 warps")] == [], (n, reasons)
        if not reasons:
            assert search.constraint_violation(sched, op="gdn2", K=128, V=128, compute_capability=(9, 0)) is None
        assert max(vector.shared_memory_estimate(sched, 128, 128, 2).values()) <= 232448



SESSION3_DB = DB.with_name("h200-campaign-gdn2-session3.db")


H200_CAMPAIGNS = [SESSION3_DB, *(DB.with_name(f"h200x2-campaign-gdn2-{n}.db") for n in ("session4", "session5a",
                                                                                         "session5b", "session6"))]


def _gated(db):
    con = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
    try:
        return con.execute("SELECT schedule, status FROM trials WHERE status IN ('ok', 'incorrect')").fetchall()
    finally:
        con.close()


def test_h200_wrong_gradients_rejected_and_every_gated_schedule_accepted():
    # Four H200 campaigns (sessions 3-5, the kernels' current structure) gated schedules wrong (dq/dk/dg/db rel-RMS
    # 0.8-1.3) that are right on the interpreter. The session-5 stage test found the stage (recompute at
    # block_k = 128 with 4 warps: wrong U); every wrong schedule has it and the constraint rejects exactly that,
    # for 16-bit inputs on compute capability 9.x, while accepting every schedule that passed the H200 gates.
    wrong, passed = set(), set()
    for db in H200_CAMPAIGNS:
        rows = _gated(db)
        wrong |= {s for s, st in rows if st == "incorrect"}
        passed |= {s for s, st in rows if st == "ok"}
    assert len(wrong) == 6 and len(passed) >= 45  # distinct schedules (one was gated wrong in two campaigns)
    for text in wrong:
        bad = Schedule.from_dict(json.loads(text))
        r = bad.recompute
        assert r.num_warps == 4 and r.block_k > r.block_v, r  # the one stage configuration they all share
        reasons = _without_tf32x3(vector.constraint(bad, H200))
        assert [x.split(":")[0] for x in reasons] == [
            "recompute.block_k=128 with 4 warps and 16-bit inputs" if r.block_k == 128 else
            f"recompute.block_k={r.block_k} > block_v={r.block_v} with 4 warps and 16-bit inputs"], reasons
        assert search.constraint_violation(bad, op="gdn2", K=128, V=128, compute_capability=(9, 0)) is not None
        # the stage is shared: the scalar operators reject it too; 8 warps, fp32 inputs and other GPUs do not
        assert scalar.recompute_fault_reasons(bad, 2, (9, 0)) and not scalar.recompute_fault_reasons(bad, 4, (9, 0))
        assert not scalar.recompute_fault_reasons(bad, 2, (8, 0)) and not scalar.recompute_fault_reasons(bad, 2, None)
        assert not scalar.recompute_fault_reasons(bad.replace(recompute={"num_warps": 8}), 2, (9, 0))
        assert vector.gpu_fault_reasons(bad, 128, 128, 4) == []
    for text in passed:
        sched = Schedule.from_dict(json.loads(text))
        reasons = _without_tf32x3(vector.constraint(sched, H200))
        if _no_longer_fits(sched):  # today's kernel needs more shared memory than the one the campaign gated
            assert reasons == ["consumer_cfg: shared memory estimate 239616 B > device limit 232448 B"], reasons
            continue
        assert reasons == [], text


def _no_longer_fits(sched):
    """The separate 4-warp 16 x 128 consumer at 3 stages with fp32 P, D passed a campaign's gates (session 3, an older
    consumer); today's compiles to 237 696 B for sm_90 (AOT_SM90, session 26), over the H200's 232 448."""
    return (sched.consumer == "separate" and sched.pd_dtype == "fp32" and sched.state_dtype == "fp32"
            and sched.consumer_cfg == StageConfig(16, 128, 4, 3))


def _without_tf32x3(reasons):
    """These campaigns ran the consumer from before session 7, whose 16-bit tf32x3 products worked on the H200;
    the sliced consumer's tf32x3 fault (vector.gpu_fault_reasons) is a rejection they could not have met."""
    return [r for r in reasons if not r.startswith("intra_precision='tf32x3'")]


def test_tf32x3_with_16bit_inputs_is_rejected_on_sm9x_only():
    base = vector.default_schedule((9, 0), K=128, V=128, op="kda")
    assert vector.gpu_fault_reasons(base, 128, 128, 2, (9, 0)) == []
    t3 = base.replace(intra_precision="tf32x3")
    assert any("tf32x3" in r for r in vector.gpu_fault_reasons(t3, 128, 128, 2, (9, 0)))
    assert vector.gpu_fault_reasons(t3, 128, 128, 4, (9, 0)) == []  # fp32 inputs: GPU-tested, kept
    assert vector.gpu_fault_reasons(t3, 128, 128, 2, (8, 0)) == []
    dims = {"K": 128, "V": 128, "dtype": "bf16", "compute_capability": (9, 0)}
    assert any("tf32x3" in r for r in vector.constraint(t3, dims))
    assert not any("tf32x3" in r for r in vector.constraint(t3, {**dims, "dtype": "fp32"}))


def test_scalar_constraint_rejects_the_miscompiled_recompute_stage():
    base = scalar.default_schedule((9, 0))
    bad = base.replace(recompute={"block_k": 128, "num_warps": 4})
    assert scalar.constraint(base, H200) == []
    assert any(r.startswith("recompute.block_k=128 with 4 warps") for r in scalar.constraint(bad, H200))
    assert not any(r.startswith("recompute.block_k=128") for r in scalar.constraint(bad, {**H200, "dtype": "fp32"}))
    assert search.constraint_violation(bad, op="gdn", K=128, V=128, compute_capability=(9, 0)) is not None


def test_scalar_constraint_takes_dv_local_in_the_kv_scan_only():
    # dv_local_source "scan": the "kv" reverse scan forms A_qk; the transposed one does not (it would refuse at launch)
    base = scalar.default_schedule((9, 0)).replace(dv_local_source="scan")
    assert scalar.constraint(base, H200) == []
    assert "dv_local_source 'scan': only the 'kv' reverse scan forms dv_local (reverse_scan_layout 'vk')" in \
        scalar.constraint(base.replace(reverse_scan_layout="vk"), H200)


def test_scalar_space_offers_the_scan_step_forms_where_a_scan_reads_them():
    # scan_state_rows changes code only where K > 64; reverse_scan_qdo is read by DeltaNet's "kv" reverse scan alone
    for K in (32, 64, 100, 128, 256):
        for op in (None, "deltanet", "gdn"):
            sp = scalar.space(K, K, op=op)
            assert sp["scan_state_rows"] == ([64, 128] if K > 64 else [64])
            assert sp["reverse_scan_qdo"] == (["in_step"] if op == "gdn" else ["in_step", "ahead", "split"])
            assert list(sp).index("reverse_scan_layout") < list(sp).index("reverse_scan_qdo")  # sampled after it
    assert scalar.CONDITIONS["reverse_scan_qdo"] == ("reverse_scan_layout", "kv")
    with pytest.raises(ValueError, match="op must be 'deltanet', 'gdn' or None for the scalar space and default, "
                                         "got 'kda'"):
        scalar.space(128, 128, op="kda")
    ahead = scalar.default_schedule((9, 0), op="deltanet").replace(reverse_scan_qdo="ahead")
    assert scalar.constraint(ahead, H200) == scalar.constraint(ahead, {**H200, "op": "deltanet"}) == []
    gdn = "reverse_scan_qdo 'ahead' is read by DeltaNet's reverse scan alone (no gate): gdn's gated scan forms Qᵀ dO"
    assert any(r.startswith(gdn) for r in scalar.constraint(ahead, {**H200, "op": "gdn"}))
    assert gdn in search.constraint_violation(ahead, op="gdn", K=128, V=128, compute_capability=(9, 0))
    assert any(r.startswith(gdn) for r in ss.constraint(ahead, H200, op="gdn"))  # the op by keyword reaches it too
    assert any(r.startswith(gdn) for r in scalar.constraint(ahead, H200, op="gdn"))
    assert search.constraint_violation(ahead, op="deltanet", K=128, V=128, compute_capability=(9, 0)) is None
    assert "reverse_scan_qdo 'ahead': only the 'kv' reverse scan forms Qᵀ dO a step ahead (reverse_scan_layout " \
           "'vk')" in scalar.constraint(ahead.replace(reverse_scan_layout="vk"), H200)
    rows = scalar.default_schedule((9, 0), op="gdn").replace(scan_state_rows=128)
    assert scalar.constraint(rows, {**H200, "op": "gdn"}) == []


def test_scalar_space_offers_small_grid_widths_the_constraint_accepts():
    # reverse_scan_small_grid_block_v: the space offers 0 and the widths below V that divide it; the constraint
    # names a width not below reverse_scan.block_v (it would change nothing) and one that does not divide V
    assert scalar.space(128, 128)["reverse_scan_small_grid_block_v"] == [0, 16, 32]
    assert scalar.space(32, 32)["reverse_scan_small_grid_block_v"] == [0, 16]
    assert scalar.space(16, 16)["reverse_scan_small_grid_block_v"] == [0]
    base = scalar.default_schedule((9, 0), op="gdn")  # reverse_scan.block_v 32
    assert scalar.constraint(base.replace(reverse_scan_small_grid_block_v=16), H200) == []
    assert ("reverse_scan_small_grid_block_v=32 is not narrower than reverse_scan.block_v=32: it changes nothing "
            "(0 turns it off)") in scalar.constraint(base.replace(reverse_scan_small_grid_block_v=32), H200)
    assert "reverse_scan_small_grid_block_v=16 does not divide V=40" in scalar.tile_reasons(
        base.replace(reverse_scan_small_grid_block_v=16), 40, 40)



def test_consumer_loads_in_the_scalar_space_alone_and_flat_where_it_runs():
    # consumer_loads: offered to joint_tma (conditional on it), not to the vector gates; the constraint rejects "flat"
    # wherever it would run as "ahead", naming each field that keeps it from its one-loop phase 2
    assert scalar.space(128, 128)["consumer_loads"] == ["at_use", "ahead", "flat"]
    assert scalar.CONDITIONS["consumer_loads"] == ("consumer", "joint_tma")
    assert "consumer_loads" not in vector.space(128, 128)
    flat = scalar.default_schedule((9, 0), op="deltanet", policy="A")
    assert flat.consumer_loads == "flat" and scalar.constraint(flat, H200) == []
    assert scalar.constraint(flat.replace(consumer_k_split=1), H200) == []
    assert scalar.default_schedule((9, 0), op="gdn", policy="A").consumer_loads == "at_use"
    assert scalar.default_schedule(None, op="deltanet", policy="A").consumer_loads == "at_use"
    assert ("consumer_loads 'flat' runs its one-loop phase 2 only with dq_stage 'separate' (got 'consumer'), "
            "column_side 'gamma_t' (got 'scratch'), consumer_k_split 0 or 1 (got 2); elsewhere it is 'ahead'") in \
        scalar.constraint(flat.replace(dq_stage="consumer", column_side="scratch", consumer_k_split=2), H200)
    assert scalar.constraint(flat.replace(dq_stage="consumer", consumer_loads="ahead"), H200) == []
    assert scalar.flat_loads_reasons(flat.replace(consumer="joint", dq_stage="consumer")) == []  # not read there

# DeltaNet A's reverse scan compiled ahead for sm_90 (K = V = 128, bf16; compile_times.py --op deltanet --policy A
# --kernels rewy_bwd_scan, session 37's table in benchmarks/RESULTS.md and session 38's BV 64 rows): changes to the
# H200 default's (BV 32, 4 warps, 3 stages), bytes of shared memory. "ahead" holds the next chunk's q tile and a third
# dO tile; with dv_local formed in the scan as well, 3 stages exceed the H200's 232 448 B.
STEP_FORMS_SM90 = [
    ({}, 176128),
    (dict(scan_state_rows=128), 176128),
    (dict(reverse_scan_qdo="ahead"), 200704),
    (dict(scan_state_rows=128, reverse_scan_qdo="ahead"), 200704),
    (dict(scan_state_rows=128, reverse_scan_qdo="split"), 200704),  # (session 38's DeltaNet A default) where it splits
    (dict(scan_state_rows=128, reverse_scan_qdo="ahead", reverse_scan=StageConfig(128, 32, 4, 2)), 143360),
    (dict(scan_state_rows=128, reverse_scan=StageConfig(128, 32, 8, 3)), 180224),
    (dict(scan_state_rows=128, reverse_scan_qdo="ahead", reverse_scan=StageConfig(128, 32, 8, 3)), 204800),
    (dict(reverse_scan=StageConfig(128, 16, 4, 3)), 161792),
    (dict(scan_state_rows=128, reverse_scan_qdo="ahead", reverse_scan=StageConfig(128, 16, 4, 3)), 182272),
    (dict(scan_state_rows=128, reverse_scan=StageConfig(128, 16, 8, 3)), 163840),
    (dict(dv_local_source="scan"), 217088),
    (dict(dv_local_source="scan", scan_state_rows=128, reverse_scan_qdo="ahead",
          reverse_scan=StageConfig(128, 32, 4, 2)), 172032),
    (dict(dv_local_source="scan", scan_state_rows=128, reverse_scan_qdo="ahead"), 241664),  # over the limit
    (dict(scan_state_rows=128, reverse_scan=StageConfig(128, 64, 4, 3)), 204800),
    (dict(scan_state_rows=128, reverse_scan_qdo="ahead", reverse_scan=StageConfig(128, 64, 4, 3)), 237568),  # over
]


@pytest.mark.parametrize("changes, compiled", STEP_FORMS_SM90)
def test_scalar_estimate_bounds_the_reverse_scan_step_forms(changes, compiled):
    # an upper bound within 16 KB, and the constraint's verdict is the compile's on the H200
    # (from session 37's forms, 64-row blocks and Qᵀ dO in step, as the table's compiles were)
    base = scalar.default_schedule((9, 0), op="deltanet", policy="A").replace(scan_state_rows=64,
                                                                               reverse_scan_qdo="in_step")
    sched = base.replace(**changes)
    est = scalar.shared_memory_estimate(sched, 128, 128, 2)["reverse_scan"]
    assert 0 <= est - compiled <= 16384, (changes, est, compiled)
    rejected = [r for r in scalar.constraint(sched, {**H200, "op": "deltanet"}) if r.startswith("reverse_scan: shared")]
    assert bool(rejected) == (compiled > 232448), (changes, rejected)


def test_scalar_constraint_accepts_the_query_side_stage_on_sm90_16bit():
    # session 34 rejected it there: dk changed from run to run beside the reverse scan (H200, bf16). Session 35 found
    # the cause, a loaded tile left in a one-slot buffer under an asynchronous product (rewy_tune/ir_hazards.py),
    # and removed it; tests/test_ir_hazards.py compiles the stage for sm_90 and finds no such buffer.
    sep = scalar.default_schedule((9, 0)).replace(dq_stage="separate")
    assert sep.consumer == "joint_tma"
    assert scalar.constraint(sep, H200) == []
    assert search.constraint_violation(sep, op="deltanet", K=128, V=128, compute_capability=(9, 0)) is None


def test_scalar_model_is_what_let_the_failures_through():
    # The reason for the vector model: the scalar one (which the gdn2 campaign used) accepted both failures —
    # and it still holds for scalar gates, whose scans load no fp32 [C, K] gate tiles.
    for n, sched, status, _ in _campaign_trials():
        if status == "compile_error":
            assert scalar.constraint(sched, H200) == [], n
            assert search.constraint_violation(sched, op="gdn", K=128, V=128, compute_capability=(9, 0)) is None


# Triton 3.6 shared-memory bytes of the vector-gate kernels compiled ahead of time for sm_90 (16-byte aligned
# pointers as torch gives them; see search_spaces/vector.py): (stage, K = V, input bytes, schedule changes,
# bytes). The first two are the H200 failures (the device said the same numbers); the others are the H200
# default's kernels and the largest configurations of each stage, joint and separate, K = 64..256, fp32 inputs.
SEP = dict(consumer="separate", state_dtype="input")
AOT_SM90 = [
    ("reverse_scan", 128, 2, dict(reverse_scan=StageConfig(128, 32, 8, 3)), 283648),  # trial 5 (H200: 283 648)
    ("reverse_scan", 128, 2, dict(reverse_scan=StageConfig(128, 16, 2, 3)), 248832),  # trial 7 (H200: 248 832)
    ("reverse_scan", 128, 2, dict(reverse_scan=StageConfig(128, 16, 4, 2)), 147968),
    ("reverse_scan", 128, 2, dict(reverse_scan=StageConfig(128, 32, 4, 2)), 156160),  # H200 default (session 17)
    ("reverse_scan", 128, 2, dict(reverse_scan=StageConfig(128, 128, 8, 2)), 213504),
    ("reverse_scan", 128, 2, dict(reverse_scan=StageConfig(128, 64, 8, 3)), 308224),
    ("reverse_scan", 128, 2, dict(state_dtype="input", reverse_scan=StageConfig(128, 64, 4, 2)), 180736),
    ("reverse_scan", 64, 2, dict(reverse_scan=StageConfig(64, 64, 8, 3)), 172544),
    ("reverse_scan", 256, 2, dict(reverse_scan=StageConfig(256, 16, 4, 1)), 20480),  # H200 default at K = 256
    ("reverse_scan", 256, 2, dict(reverse_scan=StageConfig(256, 16, 8, 2)), 283648),
    ("reverse_scan", 128, 4, dict(reverse_scan=StageConfig(128, 16, 4, 2)), 193024),  # fp32 inputs
    # the forward scan recompiled in session 16 (benchmarks/compile_times.py --kernels fwd_scan): since the loop of
    # session 13 it prefetches U's [C, BV] tile per stage; BV 32 at 4 stages failed on the H200 at 239 104 B
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 16, 4, 2)), 94720),
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 16, 4, 4)), 230912),
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 32, 4, 2)), 98816),
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 32, 4, 3)), 168960),  # H200 default
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 32, 4, 4)), 239104),  # H200: 239 104
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 64, 4, 3)), 181248),
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 64, 4, 4)), 255488),
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 128, 4, 2)), 131584),
    ("forward_scan", 128, 2, dict(forward_scan=StageConfig(128, 128, 4, 3)), 214016),  # H200 default to session 16
    ("forward_scan", 128, 2, dict(state_dtype="input", forward_scan=StageConfig(128, 32, 4, 4)), 239104),
    ("forward_scan", 64, 2, dict(forward_scan=StageConfig(64, 64, 4, 3)), 107008),
    ("forward_scan", 64, 2, dict(forward_scan=StageConfig(64, 32, 4, 4)), 131840),
    ("forward_scan", 256, 2, dict(forward_scan=StageConfig(256, 64, 8, 2)), 189440),
    ("forward_scan", 256, 2, dict(forward_scan=StageConfig(256, 128, 8, 2)), 214016),
    ("forward_scan", 128, 4, dict(forward_scan=StageConfig(128, 16, 4, 2)), 123392),  # fp32 inputs
    # session 24: the scans reading K_t and Q_g pregated (no fp32 gate tiles; compile_times.py --kernels scan)
    ("forward_scan", 128, 2, dict(scan_operands="pregated", forward_scan=StageConfig(128, 32, 4, 1)), 12288),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 32, 4, 1)), 24576),
    ("forward_scan", 128, 2, dict(scan_operands="pregated", forward_scan=StageConfig(128, 32, 4, 2)), 77824),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 32, 4, 2)), 118784),
    ("forward_scan", 128, 2, dict(scan_operands="pregated", forward_scan=StageConfig(128, 32, 4, 4)), 151552),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 32, 4, 4)), 233472),
    ("forward_scan", 128, 2, dict(scan_operands="pregated", forward_scan=StageConfig(128, 64, 4, 3)), 131072),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 64, 4, 2)), 139264),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 64, 4, 3)), 204800),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 64, 4, 4)), 270336),
    ("forward_scan", 128, 2, dict(scan_operands="pregated", forward_scan=StageConfig(128, 64, 4, 4)), 172032),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 32, 8, 3)), 176128),
    ("forward_scan", 128, 2, dict(scan_operands="pregated", forward_scan=StageConfig(128, 128, 8, 2)), 114688),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(128, 128, 8, 2)), 180224),
    ("forward_scan", 256, 2, dict(scan_operands="pregated", forward_scan=StageConfig(256, 16, 4, 2)), 137216),
    ("reverse_scan", 256, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(256, 16, 4, 2)), 206848),
    ("forward_scan", 256, 2, dict(scan_operands="pregated", forward_scan=StageConfig(256, 64, 8, 2)), 155648),
    ("reverse_scan", 256, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(256, 64, 8, 2)), 237568),
    ("forward_scan", 64, 2, dict(scan_operands="pregated", forward_scan=StageConfig(64, 64, 4, 3)), 81920),
    ("reverse_scan", 64, 2, dict(scan_operands="pregated", reverse_scan=StageConfig(64, 64, 4, 3)), 114688),
    ("forward_scan", 128, 2, dict(scan_operands="pregated", state_dtype="input", forward_scan=StageConfig(128, 64, 4, 2)), 98304),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", state_dtype="input", reverse_scan=StageConfig(128, 64, 4, 2)), 147456),
    # session 38 (compile_times.py --op kda --kernels scan --schedule FILE): the H200 defaults' scans with
    # scan_state_rows 128, one 128-row state block: policy A's reverse scan, policy R's two
    ("reverse_scan", 128, 2, dict(scan_operands="forward", state_dtype="input", scan_state_rows=128,
                                  reverse_scan=StageConfig(128, 64, 4, 3)), 204800),
    ("forward_scan", 128, 2, dict(scan_operands="pregated", state_dtype="input", scan_state_rows=128,
                                  forward_scan=StageConfig(128, 32, 4, 3)), 118784),
    ("reverse_scan", 128, 2, dict(scan_operands="pregated", state_dtype="input", scan_state_rows=128,
                                  reverse_scan=StageConfig(128, 32, 4, 2)), 122880),
    # the consumer recompiled in session 26 (compile_times.py --op gdn2 --H 16 --kernels consumer_vector): since session
    # 25 its two V loops take their own depth (consumer_v_stages; 0: the consumer's num_stages, as the loops did
    # before). Recompiled in session 35 (--H 1): ⟨S0, dS1⟩ in a loop of its own and no R tile in phase 1, equal or
    # smaller but for one separate consumer (+8 KB)
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 64, 8, 2)), 98304),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(32, 128, 8, 2)), 167040),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(32, 128, 8, 3)), 270592),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(16, 128, 8, 3)), 224384),  # both gated in campaigns
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 128, 8, 2)), 219392),
    ("consumer_cfg", 128, 2, dict(consumer="separate", consumer_cfg=StageConfig(16, 128, 4, 3)), 237696),  # no fit now
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(32, 64, 8, 1)), 32768),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 64, 8, 3)), 122880),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(128, 64, 8, 2)), 81920),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(128, 64, 8, 3)), 122880),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(32, 64, 8, 3)), 122880),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(128, 16, 8, 1)), 26624),
    ("consumer_cfg", 128, 2, dict(state_dtype="input", consumer_cfg=StageConfig(64, 64, 8, 3)), 122880),
    ("consumer_cfg", 128, 2, dict(**SEP, consumer_cfg=StageConfig(64, 64, 8, 3)), 114688),
    ("consumer_cfg", 128, 2, dict(**SEP, pd_dtype="input", consumer_cfg=StageConfig(128, 128, 8, 1)), 65536),
    ("consumer_cfg", 256, 2, dict(consumer_cfg=StageConfig(64, 128, 8, 2)), 188416),
    ("consumer_cfg", 256, 2, dict(**SEP, consumer_cfg=StageConfig(64, 64, 8, 3)), 131072),
    ("consumer_cfg", 128, 4, dict(consumer_cfg=StageConfig(64, 64, 8, 1)), 81920),  # fp32 inputs
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 64, 8, 1), consumer_v_stages=1), 32768),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 64, 8, 1), consumer_v_stages=2), 81920),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 64, 4, 1), consumer_v_stages=2), 81920),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 64, 8, 1), consumer_v_stages=3), 122880),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 64, 8, 3), consumer_v_stages=1), 57600),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(32, 64, 8, 1), consumer_v_stages=2), 81920),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(32, 64, 8, 1), consumer_v_stages=3), 122880),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(32, 128, 8, 1), consumer_v_stages=3), 57344),  # one V tile
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(128, 64, 8, 1), consumer_v_stages=1), 32768),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(128, 64, 8, 1), consumer_v_stages=2), 81920),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(128, 64, 8, 1), consumer_v_stages=3), 122880),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 32, 8, 1), consumer_v_stages=1), 26624),
    ("consumer_cfg", 128, 2, dict(consumer_cfg=StageConfig(64, 32, 8, 1), consumer_v_stages=3), 65536),
    ("consumer_cfg", 128, 2, dict(**SEP, consumer_cfg=StageConfig(64, 64, 8, 1), consumer_v_stages=3), 114688),
    # the H200 default's consumer (KDA A, pregated operands with G's range read in: --op kda --policy A)
    ("consumer_cfg", 128, 2, dict(scan_operands="pregated", consumer_cfg=StageConfig(64, 64, 8, 1),
                                  consumer_v_stages=2), 81920),
    ("dv_local", 128, 2, dict(dv_local=StageConfig(128, 128, 4, 2)), 65536),  # H200 default
    ("dv_local", 128, 2, dict(dv_local=StageConfig(16, 64, 4, 3)), 49152),
    ("dv_local", 128, 4, dict(dv_local=StageConfig(64, 64, 8, 3)), 81920),  # fp32 inputs
    ("recompute", 128, 2, dict(recompute=StageConfig(128, 128, 8, 3)), 49152),
    ("recompute", 128, 2, dict(recompute=StageConfig(64, 64, 4, 2)), 32768),  # H200 default
    ("producer", 128, 2, dict(**SEP, pd_dtype="fp32", producer=StageConfig(64, 64, 4, 3)), 73728),
    ("producer", 128, 2, dict(**SEP, pd_dtype="input", producer=StageConfig(64, 64, 8, 3)), 65536),
    ("cumsum", 128, 2, dict(cumsum=StageConfig(128, 64, 4, 1)), 32768),
]


@pytest.mark.parametrize("stage, KV, e, changes, compiled", AOT_SM90)
def test_shared_memory_estimate_bounds_the_sm90_compile(stage, KV, e, changes, compiled):
    # the table was compiled around the H200 default with fp32 states (rows that say so use input-dtype states)
    # (consumer_v_stages 0: the V loops at the row's num_stages, unless the row sets them)
    sched = vector.default_schedule((9, 0), K=KV, V=KV).replace(state_dtype="fp32", consumer_v_stages=0)
    sched = sched.replace(**changes)
    est = vector.shared_memory_estimate(sched, KV, KV, e)[stage]
    assert 0 <= est - compiled <= 40960, (stage, changes, est, compiled)  # an upper bound, and a close one
    dims = {"K": KV, "V": KV, "dtype": {2: "bf16", 4: "fp32"}[e], "compute_capability": (9, 0)}
    rejected = [r for r in vector.constraint(sched, dims) if r.startswith(f"{stage}: shared")]
    assert bool(rejected) == (compiled > 232448), (stage, changes, rejected)


# ----------------------------------------------------------------------------------------------------------
# the space


def _flat(schedule: Schedule) -> dict:
    flat = {}
    for name, val in schedule.to_dict().items():
        flat.update({f"{name}.{m}": v for m, v in val.items()} if isinstance(val, dict) else {name: val})
    return flat


def test_vector_space_holds_only_values_the_schedule_and_kernels_accept():
    for K, V in ((64, 64), (128, 128), (256, 256), (128, 64)):
        sp = vector.space(K, V)
        base = vector.default_schedule((9, 0), K=K, V=V)
        # the vector space is the scalar one without joint_tma's own fields (vector gates never run joint_tma) and
        # the transposed reverse scan (scalar gates only: the vector constraint rejects it)
        tma_only = {"consumer_order", "column_side", "p_tiles", "dq_stage", "consumer_loads", "query_side_block_v"}
        assert set(scalar.TMA_ONLY_FIELDS) == tma_only
        no_gate_only = {"reverse_scan_layout", "reverse_scan_qdo"}  # scalar-gate (qdo: no-gate) reverse scan forms
        assert set(scalar.space(K, V)) - tma_only - no_gate_only <= set(sp) and not tma_only & set(sp)
        assert not no_gate_only & set(sp) and scalar.space(K, V)["reverse_scan_layout"] == ["kv", "vk"]
        dims = {"K": K, "V": V, "dtype": "bf16", "compute_capability": (9, 0)}
        assert any("the transposed reverse scan takes no gate or a scalar gate" in r
                   for r in vector.constraint(base.replace(reverse_scan_layout="vk"), dims))
        assert any("reverse_scan_qdo='ahead' is read by DeltaNet's reverse scan alone" in r
                   for r in vector.constraint(base.replace(reverse_scan_qdo="ahead"), dims))
        # both scans read scan_state_rows, at K > 64 only
        assert sp["scan_state_rows"] == ([64, 128] if K > 64 else [64])
        assert not (tma_only | no_gate_only) & set(vector.CONDITIONS)
        # both vector consumers read consumer_k_split; of the scalar ones only joint_tma does
        assert "consumer_k_split" in sp and "consumer_k_split" not in vector.CONDITIONS
        assert scalar.CONDITIONS["consumer_k_split"] == ("consumer", "joint_tma")
        # consumer_ranges: joint_tma among the scalar consumers, the joint one among the vector consumers
        assert "consumer_ranges" in sp and vector.CONDITIONS["consumer_ranges"] == ("consumer", "joint")
        assert scalar.CONDITIONS["consumer_ranges"] == ("consumer", "joint_tma")
        # (query_side_block_v on dq_stage "separate", itself sampled only for joint_tma)
        assert all(scalar.CONDITIONS[n] == ("consumer", "joint_tma") for n in tma_only - {"query_side_block_v"})
        assert sp["intra"] == ["auto", "subchunk"] and set(sp["intra"]) <= set(INTRA_MODES)
        assert "centred" not in sp["intra"]  # unguarded: overflows on strong decays
        assert sp["intra_precision"] == ["ieee", "tf32x3"] and set(sp["intra_precision"]) <= set(INTRA_PRECISIONS)
        # the forward's saved Aqk is searched; the default keeps the GPU-verified recompute
        assert sp["dv_local_source"] == ["recompute", "forward"]  # ("scan": the scalar scan forms A_qk)
        assert set(sp["dv_local_source"]) | {"scan"} == set(DV_LOCAL_SOURCES)
        assert base.dv_local_source == "recompute"
        assert scalar.space(K, V)["dv_local_source"] == ["recompute", "scan"]  # the scalar scan forms it
        assert sp["cumsum.block_k"] and all(16 <= bk <= max(16, K) for bk in sp["cumsum.block_k"])
        for name, choices in sp.items():
            for c in choices:
                s = vector.schedule_from_params({name: c}, base=base)  # raises on a value Schedule rejects
                assert _flat(s)[name] == c


def test_subchunk_rows_match_the_kernel():
    from rewy_tune.kernels.triton import vector_local

    assert vector.SUBCHUNK_ROWS == vector_local.SUBCHUNK_ROWS
    assert set(vector.INTRA_CHOICES) <= set(vector_local.INTRA_CODES)


@pytest.mark.parametrize("op", ["kda", "gdn2"])
@pytest.mark.parametrize("cc", [(9, 0), None, (8, 0), (8, 6)])
@pytest.mark.parametrize("KV", [32, 64, 128, 256])
def test_default_passes_its_own_constraint_and_round_trips(cc, KV, op):
    d = vector.default_schedule(cc, K=KV, V=KV, op=op)
    dims = {"K": KV, "V": KV, "dtype": "bf16", "compute_capability": cc or (8, 6)}
    assert vector.constraint(d, dims) == []
    # the default of each 16-bit dtype fits it; fp32 inputs get the scalar-derived default, which passed the
    # H200 fp32 gates (session 3: VECTOR_H200 did not, its fp32 scans need 246 784 B of shared memory; the model's
    # fp32 terms are upper bounds, not calibrated, so fp32 is pinned to the GPU-tested schedule rather than to
    # the model)
    for dtype in ("bf16", "fp16"):
        dd = ss.default_schedule(cc, K=KV, V=KV, op=op, dtype=dtype)
        assert vector.constraint(dd, {**dims, "dtype": dtype}) == [], (dtype, op, cc, KV)
        assert search.default_schedule(op, cc, KV, KV, dtype) == dd
    d32 = ss.default_schedule(cc, K=KV, V=KV, op=op, dtype="fp32")
    assert d32 == ss.default_schedule(cc, K=KV, V=KV, op="kda", dtype="fp32") == search.default_schedule(
        op, cc, KV, KV, "fp32")
    assert ss.default_schedule(cc, K=KV, V=KV, op=op) == d
    # flat parameters -> Schedule gives the default back; so does the tuner's params -> suggest replay
    assert vector.schedule_from_params(_flat(d)) == d
    assert Schedule.from_json(d.to_json()) == d
    assert search.default_schedule(op, cc, KV, KV) == d
    params = search.schedule_params(d, op=op, K=KV, V=KV, interpreter=False)
    assert params is not None, (op, cc, KV)
    replay = search.suggest_schedule(optuna.trial.FixedTrial(params), op=op, K=KV, V=KV, compute_capability=cc,
                                     interpreter=False)
    assert replay == d


def test_the_scalar_h200_default_takes_the_descriptor_consumer_where_tma_can_address_the_rows():
    assert scalar.default_schedule((9, 0)).consumer == "joint_tma"
    assert scalar.default_schedule((9, 0), K=100, V=128).consumer == "joint"  # 200-byte rows: not 16-byte multiples
    assert scalar.default_schedule((8, 0)).consumer == "joint"
    for KV in (64, 100, 128, 256):
        for op in ("kda", "gdn2"):
            assert vector.default_schedule((9, 0), K=KV, V=KV, op=op).consumer != "joint_tma"


def test_the_scalar_h200_default_by_input_dtype():
    # joint_tma at 4 warps with dq_first and gamma_t (session 13); both scans at FLA's 32-wide settings (forward 4
    # stages, session 14; reverse 3, session 13) with 16-bit inputs only: with fp32 tiles those stages would not fit
    # the H200's shared memory
    for dtype in (None, "bf16", "fp16", "fp32"):
        d = scalar.default_schedule((9, 0), dtype=dtype)
        assert (d.consumer, d.consumer_cfg.num_warps, d.consumer_order, d.column_side) == \
            ("joint_tma", 4, "dq_first", "gamma_t")
        e = "fp32" if dtype == "fp32" else "bf16"
        assert scalar.constraint(d, {"K": 128, "V": 128, "dtype": e, "compute_capability": (9, 0)}) == []
        rs, fs = d.reverse_scan, d.forward_scan
        assert (rs.block_v, rs.num_stages) == ((16, 2) if dtype == "fp32" else (32, 3))
        assert (fs.block_v, fs.num_stages) == ((16, 2) if dtype == "fp32" else (32, 4))
        assert d.scan_split_waves == (2 if dtype == "fp32" else 1)
    wide = scalar.default_schedule((9, 0), dtype="bf16")
    too_big = scalar.constraint(wide, {"K": 128, "V": 128, "dtype": "fp32", "compute_capability": (9, 0)})
    assert any("reverse_scan: shared memory" in r for r in too_big)
    assert any("forward_scan: shared memory" in r for r in too_big)
    # where TMA cannot address the rows, the pointer consumer keeps its 8 warps and the session-12 order
    p = scalar.default_schedule((9, 0), K=100, V=128)
    assert (p.consumer, p.consumer_cfg.num_warps, p.consumer_order, p.column_side) == ("joint", 8, "fused", "scratch")
    # the dtype reaches the scalar space through the package entry point, as the op asks for it
    from rewy_tune.search_spaces import default_schedule
    assert default_schedule((9, 0), op="gdn", dtype="fp32") == scalar.default_schedule((9, 0), dtype="fp32")
    # an unknown dtype is an error, not the 16-bit schedule
    for op in ("gdn", "kda"):
        with pytest.raises(ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\] or None .*'int8'"):
            default_schedule((9, 0), op=op, dtype="int8")


def test_the_h200_vector_defaults():
    # KDA and GDN2 at K = V = 128 with 16-bit inputs: the campaign-measured schedule, dv_local from the forward's
    # A_qk; other head dims, fp32 inputs and other GPUs: the scalar-derived one
    for op in ("kda", "gdn2"):
        assert vector.default_schedule((9, 0), op=op) == Schedule(**vector.VECTOR_H200)
        assert vector.default_schedule((9, 0), op=op, dtype="bf16") == Schedule(**vector.VECTOR_H200)
        assert vector.default_schedule((9, 0), op=op).dv_local_source == "forward"
        assert vector.default_schedule((9, 0), op=op).scan_operands == "pregated"
        # the scalar-derived one, less the scalar-only descriptor consumer and its settings: the pointer consumer at
        # 8 warps and the 16-wide scans the vector default was measured with (session 11)
        pointer = {"consumer": "joint", "consumer_cfg": {"num_warps": 8}, "consumer_order": "fused",
                   "column_side": "scratch", "reverse_scan": {"block_v": 16, "num_stages": 2},
                   "forward_scan": {"block_v": 16, "num_stages": 2}, "scan_split_waves": 2}
        # and the consumer's V loops at its own depth, written out (consumer_v_stages; the scalar default's 0 follows
        # it)
        own_v = lambda sch: sch.replace(consumer_v_stages=sch.consumer_cfg.num_stages)
        fp32 = vector.default_schedule((9, 0), op=op, dtype="fp32")
        assert fp32 == own_v(scalar.default_schedule((9, 0), dtype="fp32").replace(**pointer))
        assert scalar.default_schedule((9, 0), dtype="fp32").consumer_v_stages == 0
        for KV in (64, 128):
            for dtype in (None, "bf16"):
                if KV == 128 and dtype is not None:
                    continue  # K = V = 128 with 16-bit inputs: VECTOR_H200 above
                got = vector.default_schedule((9, 0), K=KV, V=KV, op=op, dtype=dtype if KV != 128 else "fp32")
                want = scalar.default_schedule((9, 0), K=KV, V=KV, dtype=dtype if KV != 128 else "fp32")
                assert got == own_v(want.replace(**pointer, cumsum={"block_k": min(64, KV)}))
        assert vector.default_schedule((9, 0), K=256, V=256, op=op) == own_v(scalar.default_schedule(
            (9, 0), K=256, V=256).replace(**{**pointer, "reverse_scan": {"block_v": 16, "num_stages": 1},
                                             "forward_scan": {"block_v": 16, "num_stages": 1}}))
    assert vector.default_schedule((8, 0), op="gdn2") == vector.default_schedule((8, 0), op="kda")
    assert vector.default_schedule(None, op="gdn2").dv_local_source == "recompute"


def test_the_h200_vector_default_under_policy_a_widens_the_lone_reverse_scan():
    # Policy A's reverse scan runs alone (no forward scan beside it): 64-wide state tiles (session 21 sweep), 3 stages
    # and the consumer's chunk ranges beside it (session 27); it reads the forward's qg, kg and runs dv_local 64 wide
    # (session 29). R and None keep the 32-wide tiles and the pregated operands; every other field, and every other
    # default, is the same under both policies.
    from rewy_tune import search
    from rewy_tune.search_spaces import default_schedule

    for op in ("kda", "gdn2"):
        r = vector.default_schedule((9, 0), op=op, policy="R")
        a = vector.default_schedule((9, 0), op=op, policy="A")
        assert r == vector.default_schedule((9, 0), op=op) == Schedule(**vector.VECTOR_H200)
        assert (r.reverse_scan.block_v, a.reverse_scan.block_v) == (32, 64)
        # and at 3 stages, with the consumer in chunk ranges beside it where it would split in few segments (auto)
        # and, from session 29, the forward's qg, kg for the scans and dv_local 64 wide at 4 warps; since session 33
        # both keep bf16 per-chunk states
        assert a == r.replace(reverse_scan={"block_v": 64, "num_stages": 3}, consumer_ranges=0,
                              scan_operands="forward", dv_local={"block_v": 64, "num_warps": 4})
        assert (r.state_dtype, a.state_dtype) == ("input", "input")
        assert (r.scan_operands, a.scan_operands) == ("pregated", "forward")
        assert vector.constraint(a, {"K": 128, "V": 128, "dtype": "bf16", "compute_capability": (9, 0)}) == []
        params = search.schedule_params(a, op=op, K=128, V=128, interpreter=False)
        assert params == search.schedule_params(a, op=op, K=128, V=128, interpreter=False, policy="A")
        assert search.suggest_schedule(optuna.trial.FixedTrial(params), op=op, K=128, V=128,
                                       compute_capability=(9, 0), interpreter=False, policy="A") == a
        # policy R's trials do not sample scan_operands "forward" (test_policy_r_space_leaves_out_...)
        assert search.schedule_params(a, op=op, K=128, V=128, interpreter=False, policy="R") is None
        r_params = search.schedule_params(r, op=op, K=128, V=128, interpreter=False, policy="R")
        for policy in ("A", "R"):  # a replayed trial is its parameters, whatever the base
            assert search.suggest_schedule(optuna.trial.FixedTrial(r_params), op=op, K=128, V=128,
                                           compute_capability=(9, 0), interpreter=False, policy=policy) == r
        assert default_schedule((9, 0), op=op, policy="A") == a == search.default_schedule(op, (9, 0), 128, 128,
                                                                                          None, "A")
        for cc, dtype, KV in (((8, 0), None, 128), ((9, 0), "fp32", 128), ((9, 0), None, 64), (None, None, 128)):
            assert (vector.default_schedule(cc, K=KV, V=KV, op=op, dtype=dtype, policy="A")
                    == vector.default_schedule(cc, K=KV, V=KV, op=op, dtype=dtype, policy="R"))
    # the scalar defaults on Hopper with 16-bit inputs: DeltaNet's the same under both policies but for its Qᵀ dO a
    # step ahead where the reverse scan splits (A, session 38); both take the query-side stage with the flat consumer
    # loads (A: sessions 35 and 41; R: session 46), a 16-wide reverse scan on a small grid (session 39) and 128-row
    # state blocks (session 38). GDN's take the query-side stage (session 42) and the small-grid scan (session 40)
    # under A alone. The generic and fp32 defaults do not differ
    dn_a = default_schedule((9, 0), op="deltanet", policy="A")
    dn_r = default_schedule((9, 0), op="deltanet", policy="R")
    assert (dn_a.dq_stage, dn_r.dq_stage) == ("separate", "separate")
    assert (dn_a.reverse_scan_qdo, dn_r.reverse_scan_qdo) == ("split", "in_step")
    assert (dn_a.consumer_loads, dn_r.consumer_loads) == ("flat", "flat")
    assert dn_a == dn_r.replace(reverse_scan_qdo="split")
    gdn_a = default_schedule((9, 0), op="gdn", policy="A")
    gdn_r = default_schedule((9, 0), op="gdn", policy="R")
    assert dn_r.reverse_scan_small_grid_block_v == 16 and gdn_r.reverse_scan_small_grid_block_v == 0
    assert dn_r.scan_state_rows == 128 and gdn_r.scan_state_rows == 64
    assert dn_r == default_schedule((9, 0), op="deltanet")
    assert dn_r.replace(scan_state_rows=64, reverse_scan_small_grid_block_v=0, dq_stage="consumer",
                        consumer_loads="at_use") == gdn_r
    assert scalar.constraint(dn_r, H200) == []
    assert (gdn_a.dq_stage, gdn_r.dq_stage) == ("separate", "consumer")
    assert gdn_a == gdn_r.replace(reverse_scan_small_grid_block_v=16, dq_stage="separate")
    assert default_schedule((9, 0), op="gdn") == gdn_r  # (no policy: R's)
    for cc, dtype, KV in (((8, 0), None, 128), ((9, 0), "fp32", 128), ((9, 0), None, 100), (None, None, 128)):
        for op in ("deltanet", "gdn"):  # (K = 100: the pointer consumer, which has no query-side stage)
            a = default_schedule(cc, K=KV, V=KV, op=op, dtype=dtype, policy="A")
            assert a == default_schedule(cc, K=KV, V=KV, op=op, dtype=dtype, policy="R") and a.dq_stage == "consumer"
    assert scalar.constraint(dn_a, H200) == []
    with pytest.raises(ValueError, match="op must be 'deltanet', 'gdn' or None for the scalar space and default, "
                                         "got 'kda'"):
        scalar.default_schedule((9, 0), op="kda")
    for bad in ("B", "a", ""):
        with pytest.raises(ValueError, match=r"policy must be 'R', 'A' or None, got"):
            default_schedule((9, 0), op="kda", policy=bad)
        with pytest.raises(ValueError, match=r"policy must be 'R', 'A' or None, got"):
            default_schedule((9, 0), op="gdn", policy=bad)


def test_the_h200_defaults_overlap_the_scans_and_choose_k_split_from_the_grid():
    # session 16: every H200 default runs the reverse scan beside the forward scan, and the consumers that read
    # consumer_k_split (joint_tma, both vector ones) take "auto" (0); the generic defaults keep both off
    for op in ("kda", "gdn2"):
        d = vector.default_schedule((9, 0), op=op)
        assert (d.side_stream, d.consumer_k_split) == ("reverse_scan", 0)
    d = scalar.default_schedule((9, 0))
    assert (d.consumer, d.side_stream, d.consumer_k_split) == ("joint_tma", "reverse_scan", 0)
    for cc in (None, (8, 0)):
        for d in (scalar.default_schedule(cc), vector.default_schedule(cc, op="kda")):
            assert (d.side_stream, d.consumer_k_split) == ("none", 1), cc


def test_every_builtin_default_keeps_the_forward_w_under_policy_a():
    # w_source "forward" (session 15): policy A runs no recompute stage with any built-in default; the dataclass
    # default (old stored schedules) still recomputes
    assert Schedule().w_source == "recompute"
    for cc in (None, (8, 0), (9, 0)):
        for dtype in (None, "fp32"):
            for KV in (64, 128, 256):
                assert scalar.default_schedule(cc, K=KV, V=KV, dtype=dtype).w_source == "forward", (cc, dtype, KV)
                for op in ("kda", "gdn2"):
                    got = vector.default_schedule(cc, K=KV, V=KV, op=op, dtype=dtype)
                    assert got.w_source == "forward", (op, cc, dtype, KV)


def test_the_h200_vector_default_splits_the_reverse_scan_where_b_h_is_small():
    # one wave of programs (session 15). With 32-wide state tiles (session 17) each scan runs 4·B·H programs unsplit.
    # Policy A (the reverse scan alone): it splits 8 ways at B·H = 4, not at B·H = 16 or 32. Policy R runs it beside
    # the forward scan (session 16), each on half the SMs: both 4 ways at B·H = 4 (64 programs each), unsplit above
    from rewy_tune.kernels.triton.scan import VECTOR_SPLIT_OVERHEAD_STEPS, _segments

    d = vector.default_schedule((9, 0), op="kda")
    assert d.side_stream == "reverse_scan"
    alone = d.scan_split_waves * 132

    def segments(BH, cfg, asked, limit):
        return _segments(2048 // 64, asked, (128 // cfg.block_v) * BH, limit, VECTOR_SPLIT_OVERHEAD_STEPS)[0]

    policy_a = {BH: segments(BH, d.reverse_scan, d.reverse_scan_segments, alone) for BH in (4, 16, 32)}
    assert policy_a == {4: 8, 16: 1, 32: 1}
    policy_r = {BH: (segments(BH, d.forward_scan, d.forward_scan_segments, alone // 2),
                     segments(BH, d.reverse_scan, d.reverse_scan_segments, alone // 2)) for BH in (4, 16, 32)}
    assert policy_r == {4: (4, 4), 16: (1, 1), 32: (1, 1)}


def test_every_call_site_asks_for_the_operators_default():
    # the op, the dispatcher and the tuner must all reach the GDN2-specific default (they once asked without op)
    import torch

    from rewy_tune.kernels.triton_function import op_of

    q = torch.zeros(1, 8, 1, 16)
    assert op_of(None, q[..., 0]) == "deltanet" and op_of(q[..., 0], q[..., 0]) == "gdn"
    assert op_of(q, q[..., 0]) == "kda" and op_of(q, q) == "gdn2"
    assert search.default_schedule("gdn2", (9, 0), 128, 128) == Schedule(**vector.VECTOR_H200)


# ----------------------------------------------------------------------------------------------------------
# per-operator dispatch, as the tuner reaches it (rewy_tune/search.py, op= by keyword)


def test_policy_r_space_leaves_out_the_forward_scan_operands():
    # Under R nothing is saved for scan_operands "forward" and it runs as "pregated": R's trials would repeat those.
    # A's space and the policy-free one keep it; only that choice differs.
    from rewy_tune import search

    for K in (64, 128):
        both, a, r = (vector.space(K, K, policy=p) for p in (None, "A", "R"))
        assert both == a and "forward" in a["scan_operands"]
        assert r["scan_operands"] == ["inline", "pregated"]
        assert {n: c for n, c in r.items() if n != "scan_operands"} == {n: c for n, c in a.items()
                                                                        if n != "scan_operands"}
        assert ss.space(K, K, op="kda", policy="R") == r
        assert ss.space(K, K, op="gdn", policy="R") == scalar.space(K, K, op="gdn")
    for policy in ("R", "A"):
        choices, _ = search.declarative_space("gdn2", 128, 128, False, policy)
        assert ("forward" in choices["scan_operands"]) == (policy == "A")
    sampled = set()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(40):
        trial = study.ask()
        sampled.add(search.suggest_schedule(trial, op="kda", K=128, V=128, compute_capability=(9, 0),
                                            interpreter=False, policy="R").scan_operands)
        study.tell(trial, 1.0)
    assert sampled == {"inline", "pregated"}
    for space in (vector.space, scalar.space):
        with pytest.raises(ValueError, match=r"policy must be 'R', 'A' or None, got 'B'"):
            space(128, 128, policy="B")


def test_package_dispatches_on_the_operator():
    assert ss.module_for("kda") is vector and ss.module_for("gdn2") is vector
    assert ss.module_for("gdn") is scalar and ss.module_for("deltanet") is scalar and ss.module_for(None) is scalar
    with pytest.raises(ValueError, match="op must be one of"):
        ss.module_for("mamba")
    assert ss.space(128, 128, op="gdn2") == vector.space(128, 128)
    assert ss.space(128, 128, op="gdn") == scalar.space(128, 128, op="gdn")
    assert ss.space(128, 128, op="deltanet") == scalar.space(128, 128) == ss.space(128, 128)
    assert ss.conditions("kda") == vector.CONDITIONS and ss.conditions() == ss.CONDITIONS
    # callers without an operator (dispatch.py, triton_function.py) keep the scalar default
    assert ss.default_schedule((9, 0)) == scalar.default_schedule((9, 0))


def _sample(op: str, seed: int = 0, n: int = 8, interpreter: bool = False):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        out.append((search.suggest_schedule(trial, op=op, K=128, V=128, compute_capability=(9, 0),
                                            interpreter=interpreter), dict(trial.params)))
        study.tell(trial, 1.0)
    return out


def test_tuner_suggest_path_samples_the_vector_space_for_kda_and_gdn2_only():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for op in ("kda", "gdn2"):
        sampled = _sample(op, n=24)
        assert all("intra" in p and "cumsum.block_k" in p for _, p in sampled)
        assert {s.intra for s, _ in sampled} == {"auto", "subchunk"}
        assert {s.intra_precision for s, _ in sampled} == {"ieee", "tf32x3"}
        assert {s.dv_local_source for s, _ in sampled} == {"recompute", "forward"}
        # dv_local.block_k is read only when A_qk is recomputed: not sampled otherwise
        assert all(("dv_local.block_k" in p) == (s.dv_local_source == "recompute") for s, p in sampled)
        assert {s.cumsum.block_k for s, _ in sampled} <= set(vector.space(128, 128)["cumsum.block_k"])
        assert len({s.cumsum.block_k for s, _ in sampled}) > 1
        assert {s.consumer_v_stages for s, _ in sampled} == {1, 2, 3}
    for op in ("gdn", "deltanet"):
        sampled = _sample(op, n=8)
        assert all("intra" not in p and "cumsum.block_k" not in p for _, p in sampled)
        assert {s.intra for s, _ in sampled} == {"auto"}  # pinned
        assert {s.intra_precision for s, _ in sampled} == {"ieee"}
        assert {s.dv_local_source for s, _ in sampled} <= {"recompute", "scan"}  # the scalar space's two
        # the dv_local stage's fields are sampled only where it runs
        assert all(("dv_local.block_v" in p) == (s.dv_local_source == "recompute") for s, p in sampled)
        # DeltaNet's reverse scan reads reverse_scan_qdo in the "kv" layout; GDN's never: pinned "in_step"
        assert all(("reverse_scan_qdo" in p) == (op == "deltanet" and s.reverse_scan_layout == "kv")
                   for s, p in sampled)
        assert op == "deltanet" or {s.reverse_scan_qdo for s, _ in sampled} == {"in_step"}
    # the interpreter demo keeps the vector choices (tiles capped at 32)
    # and pins the V loops' depth (the interpreter does not pipeline: samples there would time the same code)
    for s, p in _sample("kda", n=4, interpreter=True):
        assert "intra" in p and s.cumsum.block_k <= 32
        assert s.consumer_v_stages == 1 and "consumer_v_stages" not in p


def test_tuner_constraint_uses_the_operators_model():
    # A reverse scan that fits for scalar gates but not with the vector gate's fp32 G tiles.
    sched = scalar.default_schedule((9, 0)).replace(reverse_scan={"num_stages": 3})
    kw = dict(K=128, V=128, compute_capability=(9, 0))
    assert search.constraint_violation(sched, op="gdn", **kw) is None
    for op in ("kda", "gdn2"):
        reason = search.constraint_violation(sched, op=op, **kw)
        assert reason is not None and "reverse_scan: shared memory" in reason
    assert "intra" in search.constraint_violation(sched.replace(reverse_scan={"num_stages": 2}, intra="centred"),
                                                  op="kda", **kw)
    assert search.constraint_violation(sched.replace(reverse_scan={"num_stages": 2}, intra="centred"),
                                       op="gdn", **kw) is None  # scalar gates never read intra


# ----------------------------------------------------------------------------------------------------------
# slow: compile the two H200 failures ahead of time for sm_90 and compare with the device and the model

_AOT_SCRIPT = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rewy_tune.kernels.triton import scan

kernel = scan.rewy_bwd_scan_kernel
ptr = {"q": "*bf16", "k": "*bf16", "W": "*bf16", "G": "*fp32", "do": "*bf16", "dvl": "*bf16", "dS1": "*fp32",
       "Rbar": "*bf16", "X": "*fp32"}
out = []
for BV, warps, stages in json.loads(sys.argv[1]):
    consts = dict(dh_in=None, dh0=None, carry=None, progress=None, K=128, V=128, VP=128, NS=2, BT=64, KB=64, NB=2,
                  BV=BV, GATE=2, PHASE=1, USE_DH_IN=False, HAS_DVL=1, STORE_DH0=False, PREC="tf32", CARRY=False,
                  G_LOG2=False, IN_CARRY=False, PUBLISH=False, PDL=False, QDO_AHEAD=False)
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptr:
            sig[name] = ptr[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    out.append(c.metadata.shared)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sm90_compile_reproduces_the_h200_failures_and_the_model_bounds_them():
    import shutil
    import subprocess
    import sys

    from rewy_tune.ir_hazards import bundled_tool

    if not (bundled_tool("ptxas") or shutil.which("ptxas")):
        pytest.skip("no ptxas to compile for sm_90")
    failed = {n: (s, int(re.search(r"Required: (\d+)", m).group(1)))
              for n, s, st, m in _campaign_trials() if st == "compile_error"}
    cfgs = [(s.reverse_scan.block_v, s.reverse_scan.num_warps, s.reverse_scan.num_stages) for s, _ in failed.values()]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _AOT_SCRIPT, json.dumps(cfgs)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    shared = json.loads(res.stdout.strip().splitlines()[-1])
    for (n, (sched, required)), got in zip(failed.items(), shared):
        assert got == required, (n, got, required)  # the offline compile says what the H200 said
        assert vector.shared_memory_estimate(sched, 128, 128, 2)["reverse_scan"] >= got


def test_joint_tma_is_a_scalar_gate_consumer():
    # the descriptor consumer exists for DeltaNet/GDN only: searched there, rejected for KDA/GDN2 by the space,
    # the constraint and the pipeline
    import torch

    from rewy_tune.kernels.triton.pipeline import rewy_backward_triton

    assert "joint_tma" in scalar.space(128, 128)["consumer"]
    assert "joint_tma" not in vector.space(128, 128)["consumer"]
    tma = vector.default_schedule((9, 0), K=128, V=128, op="kda", dtype="bf16").replace(consumer="joint_tma")
    assert any("joint_tma" in r for r in vector.constraint(tma, H200))
    scalar_tma = scalar.default_schedule((9, 0)).replace(consumer="joint_tma")
    assert not scalar.constraint(scalar_tma, H200)
    assert any("multiples of 8" in r for r in scalar.constraint(scalar_tma, {"K": 100, "V": 128}))
    q = torch.zeros(1, 64, 1, 16)
    v, g, beta = torch.zeros(1, 64, 1, 16), torch.zeros(1, 64, 1, 16), torch.zeros(1, 64, 1)
    A = torch.zeros(1, 64, 1, 64)
    with pytest.raises(ValueError, match="joint_tma"):
        rewy_backward_triton(q, q, v, g, beta, beta, A, v, None, scale=1.0, initial_state=None, schedule=tma)


def test_register_model_counts_descriptor_tiles_in_shared_memory():
    # joint_tma's [C, BV] tiles arrive by TMA in shared memory: at 4 warps it is searchable (the H200 ran DeltaNet
    # faster with it, session 12), where the pointer kernel's register-passed tiles still count as spilling
    four = {"num_warps": 4}
    tma = scalar.default_schedule((9, 0)).replace(consumer="joint_tma", consumer_cfg=four, consumer_order="fused")
    ptr = tma.replace(consumer="joint")
    assert not [r for r in scalar.constraint(tma, H200) if r.startswith("consumer_cfg")]
    assert any(r.startswith("consumer_cfg") and "spill" in r for r in scalar.constraint(ptr, H200))
    regs = {s.consumer: scalar.register_estimate(s, 128, 128)["consumer_cfg"] for s in (tma, ptr)}
    assert regs["joint_tma"] < regs["joint"]
    # "dq_first" keeps two of the three [C, BK] accumulators live
    dq_first = tma.replace(consumer_order="dq_first")
    assert scalar.register_estimate(dq_first, 128, 128)["consumer_cfg"] < regs["joint_tma"]


def test_scan_stages_reach_four_only_for_the_scans():
    sp = scalar.space(128, 128)
    assert 4 in sp["forward_scan.num_stages"] and 4 in sp["reverse_scan.num_stages"]
    assert 4 not in sp["consumer_cfg.num_stages"] and 4 not in sp["dv_local.num_stages"]
    fla_like = scalar.default_schedule((9, 0)).replace(forward_scan={"block_v": 32, "num_stages": 4},
                                                       reverse_scan={"block_v": 32, "num_stages": 3})
    assert scalar.constraint(fla_like, H200) == []
    # reverse BV 32 with 4 stages compiles to 235 020 B of shared memory for sm_90 (over the H200's 232 448 B)
    too_deep = fla_like.replace(reverse_scan={"num_stages": 4})
    assert any(r.startswith("reverse_scan: shared memory") for r in scalar.constraint(too_deep, H200))


def test_gamma_t_shared_memory_bounds_the_sm90_compile():
    # joint_tma with column_side "gamma_t", compiled for sm_90 with alignment hints (benchmarks/compile_times.py):
    # fp32 inputs, fused order 245 816 B (over the H200's 232 448 B), dq_first 213 032 B; bf16 90 168 B either way
    base = scalar.default_schedule((9, 0)).replace(consumer="joint_tma", column_side="gamma_t")
    fp32 = {**H200, "dtype": "fp32"}
    for order, compiled32 in (("fused", 245816), ("dq_first", 213032)):
        s = base.replace(consumer_order=order)
        assert scalar.shared_memory_estimate(s, 128, 128, 4)["consumer_cfg"] >= compiled32
        assert any(r.startswith("consumer_cfg: shared") for r in scalar.constraint(s, fp32)) == (compiled32 > 232448)
        assert scalar.shared_memory_estimate(s, 128, 128, 2)["consumer_cfg"] >= 90168
        assert not [r for r in scalar.constraint(s, H200) if "shared" in r]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_h200_default_splits_the_scans_only_where_b_h_is_small(dtype):
    # The sequence split pays at B·H = 4 (GDN (1, 8192, 4) 0.603 -> 0.403 ms) and costs at B·H = 32; with the 32-wide
    # 16-bit scans (half the programs) B·H = 16 split under two waves and GDN's (1, 2048, 16) fell below FLA
    # (session 14). On the H200's 132 SMs, per bench shape: segments of the forward and the reverse scan.
    from rewy_tune.kernels.triton.scan import SPLIT_OVERHEAD_STEPS, _segments

    # Policy R runs the two scans side by side (session 16), each split on half the SMs; under policy A the reverse
    # scan runs alone on all of them.
    d = scalar.default_schedule((9, 0), dtype=dtype)
    assert d.side_stream == "reverse_scan"
    alone = d.scan_split_waves * 132

    def segments(T, BH, cfg, asked, limit):
        return _segments(T // 64, asked, (128 // cfg.block_v) * BH, limit, SPLIT_OVERHEAD_STEPS)[0]

    shapes = ((512, 4), (2048, 4), (8192, 4), (2048, 16), (2048, 32), (8192, 16))
    policy_r = {(T, BH): (segments(T, BH, d.forward_scan, d.forward_scan_segments, alone // 2),
                          segments(T, BH, d.reverse_scan, d.reverse_scan_segments, alone // 2)) for T, BH in shapes}
    policy_a = {(T, BH): segments(T, BH, d.reverse_scan, d.reverse_scan_segments, alone) for T, BH in shapes}
    assert policy_r == {(512, 4): (1, 1), (2048, 4): (4, 4), (8192, 4): (4, 4), (2048, 16): (1, 1),
                        (2048, 32): (1, 1), (8192, 16): (1, 1)}
    assert policy_a == {(512, 4): 1, (2048, 4): 8, (8192, 4): 8, (2048, 16): 1, (2048, 32): 1, (8192, 16): 1}


def test_query_side_block_v_only_where_the_stage_runs():
    # Schedule.query_side_block_v (session 44): offered at widths that divide V (0: the consumer's), sampled only
    # under dq_stage "separate", and rejected where no query-side stage runs or where it repeats the consumer's width
    assert scalar.space(128, 128)["query_side_block_v"] == [0, 16, 32, 64, 128]
    assert scalar.space(32, 32)["query_side_block_v"] == [0, 16, 32]
    assert scalar.space(40, 40)["query_side_block_v"] == [0, 64]  # one tile covering V
    assert scalar.CONDITIONS["query_side_block_v"] == ("dq_stage", "separate")
    base = scalar.default_schedule((9, 0), K=128, V=128, policy="A", op="deltanet")
    assert base.dq_stage == "separate" and base.consumer_cfg.block_v == 64
    assert scalar.constraint(base.replace(query_side_block_v=32), H200) == []
    assert ("query_side_block_v=64 is the consumer's block_v: it changes nothing (0 takes that)"
            in scalar.constraint(base.replace(query_side_block_v=64), H200))
    assert any(r.startswith("query_side_block_v=32: no query-side stage runs")
               for r in scalar.constraint(base.replace(query_side_block_v=32, dq_stage="consumer"), H200))
    assert "query_side_block_v=32 must divide V=48 or cover it once" in scalar.tile_reasons(
        base.replace(query_side_block_v=32, consumer_cfg={"block_v": 16}), 48, 48)
    with pytest.raises(ValueError, match=r"query_side_block_v must be one of \(0, 16, 32, 64, 128\), got 24"):
        base.replace(query_side_block_v=24)
