"""Promotion against the built-in default, and the measuring process's FLA warm-up, without GPUs or kernels:
a real campaign plan on a temporary database, with a stand-in measuring worker whose timings the test sets."""

from __future__ import annotations

import json
import time
import types

import optuna
import pytest

from rewy_tune import promotion, search, tuner
from rewy_tune.cli.campaign import build_config
from rewy_tune.db import open_db, queries
from rewy_tune.trial_worker import Outcome


class TimedWorker:
    """Answers `measure` requests with per-schedule samples (ms): `times[json of schedule]`."""

    def __init__(self, times):
        self.times = times
        self.requests = []

    def request(self, msg, timeout):
        self.requests.append(msg)
        samples = self.times[json.dumps(msg["schedule"], sort_keys=True)]
        return Outcome("ok", data={"ours_ms": list(samples), "baseline_ms": [1.0] * 30})


def _key(schedule: dict) -> str:
    return json.dumps(schedule, sort_keys=True)


@pytest.fixture
def planned(tmp_path):
    config = build_config(device="cpu", op="gdn", policy="R", shapes=["1,64,1"], workload=None, head_dim=32,
                          trials=None, time_budget=None, db=str(tmp_path / "p.db"), storage=None, workers=1,
                          resume=False, trial_timeout=None, seed=0)
    db = open_db(config.db_url)
    campaign = tuner.Campaign(config, db)
    (st,) = campaign.plan()
    default = search.default_schedule(st.op, config.device.compute_capability, config.K, config.V,
                                      config.dtype).to_dict()
    yield campaign, st, default
    db.close()


def _add_ok_trial(campaign, st, schedule: dict, value: float) -> int:
    number = len(st.study.get_trials(deepcopy=False))
    st.study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"status": "ok"}))
    with campaign.db.session() as s:
        queries.add_trial(s, st.campaign_id, number=number, schedule=schedule, status="ok",
                          samples_ms={"B1-T64-H1": [value]})
    return number


def _other(default: dict) -> dict:
    other = dict(default)
    other["consumer"] = "separate" if default["consumer"] == "joint" else "joint"
    return other


def _winner(campaign, st):
    with campaign.db.session() as s:
        row = queries.winner_for(s, st.bucket, fingerprint=campaign.config.environment.fingerprint(
            campaign.config.device))
        return None if row is None else dict(row.schedule)


def test_a_trial_slower_than_the_default_never_becomes_the_first_winner(planned):
    # Two H200s, session 5: trials 1.4x slower than the default were promoted because the default's own trial had
    # not been timed; the default is now re-measured beside them and wins.
    campaign, st, default = planned
    slow = _other(default)
    _add_ok_trial(campaign, st, slow, 1.4)
    worker = TimedWorker({_key(slow): [1.4] * 30, _key(default): [1.0] * 30})
    result = promotion.promote(campaign, st, worker)
    assert result.decision == "promoted" and "built-in default" in result.reason
    assert result.schedule == default and _winner(campaign, st) == default
    assert {_key(r["schedule"]) for r in worker.requests} == {_key(slow), _key(default)}


def test_a_trial_faster_than_the_default_beyond_the_spread_is_promoted(planned):
    campaign, st, default = planned
    fast = _other(default)
    number = _add_ok_trial(campaign, st, fast, 0.7)
    result = promotion.promote(campaign, st, TimedWorker({_key(fast): [0.7] * 30, _key(default): [1.0] * 30}))
    assert result.decision == "promoted" and result.trial_number == number
    assert "over the built-in default" in result.reason and _winner(campaign, st) == fast


def test_a_gain_within_the_spread_keeps_the_default(planned):
    campaign, st, default = planned
    fast = _other(default)
    _add_ok_trial(campaign, st, fast, 0.99)
    noisy = [0.9, 1.1] * 15  # inter-quartile range 20 % of the median
    result = promotion.promote(campaign, st, TimedWorker({_key(fast): [0.99] * 30, _key(default): noisy}))
    assert result.decision == "promoted" and "within the measured spread" in result.reason
    assert _winner(campaign, st) == default


def test_the_default_among_the_trials_is_measured_once(planned):
    campaign, st, default = planned
    _add_ok_trial(campaign, st, default, 1.0)
    _add_ok_trial(campaign, st, _other(default), 1.2)
    worker = TimedWorker({_key(default): [1.0] * 30, _key(_other(default)): [1.2] * 30})
    result = promotion.promote(campaign, st, worker)
    assert result.schedule == default and "re-measured fastest" in result.reason
    assert [_key(r["schedule"]) for r in worker.requests].count(_key(default)) == 1


def test_a_current_winner_stays_the_incumbent(planned):
    campaign, st, default = planned
    other = _other(default)
    _add_ok_trial(campaign, st, other, 1.0)
    promotion.promote(campaign, st, TimedWorker({_key(other): [1.0] * 30, _key(default): [2.0] * 30}))
    assert _winner(campaign, st) == other
    # a second promotion compares against that winner, not the default: within spread -> kept
    _add_ok_trial(campaign, st, default, 0.99)
    result = promotion.promote(campaign, st, TimedWorker({_key(other): [0.9, 1.1] * 15, _key(default): [0.99] * 30}))
    assert result.decision == "kept" and _winner(campaign, st) == other


def _warm_stub(sent, lock=None):
    import threading

    worker = types.SimpleNamespace(request=lambda msg, timeout: sent.append({**msg, "_timeout": timeout})
                                   or Outcome("ok"))
    device = types.SimpleNamespace(compute_capability=(9, 0))
    config = types.SimpleNamespace(K=128, V=128, device_kind="cuda", trial_timeout_s=300, device=device,
                                   dtype="bf16", reps=3)
    states = [types.SimpleNamespace(op="gdn2", policy="R", shapes=[(1, 512, 4), (1, 2048, 4)]),
              types.SimpleNamespace(op="gdn2", policy="R", shapes=[(1, 2048, 16)]),
              types.SimpleNamespace(op="kda", policy="A", shapes=[(1, 512, 4)])]
    obj = types.SimpleNamespace(config=config, states=states, stop=threading.Event(), _budget_left=lambda: True,
                                _warm_lock=lock or threading.Lock(), warm_s={}, warmed_at=None, _timed_at_warm=0,
                                stats={"gated": 0, "timed": 0, "rejected": 0})
    obj._groups = lambda: tuner.Campaign._groups(obj)
    obj.default_schedule = lambda op, policy: tuner.Campaign.default_schedule(obj, op, policy)
    obj.task = lambda *a, **kw: tuner.Campaign.task(obj, *a, **kw)
    obj._warm_baselines = lambda w: tuner.Campaign._warm_baselines(obj, w)
    obj._warm_timeout_s = lambda: tuner.Campaign._warm_timeout_s(obj)
    return obj, worker


def test_the_measuring_process_warms_fla_for_every_shape_before_timing():
    # FLA's autotuning ran when the first gated trial reached the measuring process (148 s there on two H200s);
    # now one warm request per operator and policy, all of its buckets' shapes, FLA only, before any timing.
    sent = []
    obj, worker = _warm_stub(sent)
    tuner.Campaign._warm_baselines(obj, worker)
    assert [(m["kind"], m["op"], m["policy"], m["ours"], m["with_fla"]) for m in sent] == [
        ("warm", "gdn2", "R", False, True), ("warm", "kda", "A", False, True)]
    assert sent[0]["shapes"] == [[1, 512, 4], [1, 2048, 4], [1, 2048, 16]]


def test_the_machine_is_warmed_before_any_gate_process_starts():
    # Sixteen gate processes each autotuned fla-core's kernels at once on two H200s (first gates ~150 s). The
    # measuring process first gates the built-in default of each operator and policy (fla-core's forward at the
    # gate shapes, our default pipeline) and warms FLA at the workload shapes; only then do the gates start.
    sent = []
    obj, worker = _warm_stub(sent)
    tuner.Campaign._warm_machine(obj, worker)
    assert [(m["kind"], m["op"], m["policy"]) for m in sent] == [
        ("gate", "gdn2", "R"), ("gate", "kda", "A"), ("warm", "gdn2", "R"), ("warm", "kda", "A")]
    # each policy's own default (KDA's under A widens the reverse scan)
    assert sent[0]["schedule"] == search.default_schedule("gdn2", (9, 0), 128, 128, "bf16", "R").to_dict()
    assert sent[1]["schedule"] == search.default_schedule("kda", (9, 0), 128, 128, "bf16", "A").to_dict()
    assert sent[1]["schedule"] != search.default_schedule("kda", (9, 0), 128, 128, "bf16", "R").to_dict()
    # both phases are timed per worker slot, and the end of the warm-up is when the after-warm-up rate starts
    assert list(obj.warm_s[0]) == ["default gate", "FLA baselines"] and obj.warmed_at is not None


def test_the_gate_processes_precompile_fla_in_shares_before_the_measuring_process_warms():
    # One process compiling fla-core's autotuning configurations one after another took ~7 minutes on a fresh H200
    # host (session 6): the gate processes, idle until the warm-up ends, compile one share each first.
    log = []
    obj, worker = _warm_stub(log)
    obj._precompile_fla = lambda g: tuner.Campaign._precompile_fla(obj, g)
    gaters = [types.SimpleNamespace(request=lambda msg, timeout, i=i: log.append({**msg, "gater": i,
                                                                                 "_timeout": timeout})
                                    or Outcome("ok")) for i in range(2)]
    tuner.Campaign._warm_machine(obj, worker, 0, gaters)
    first_own = next(i for i, m in enumerate(log) if "gater" not in m)
    shares = log[:first_own]
    assert sorted((m["gater"], m["op"], m["policy"], tuple(m["autotune_part"])) for m in shares) == [
        (0, "gdn2", "R", (0, 2)), (0, "kda", "A", (0, 2)), (1, "gdn2", "R", (1, 2)), (1, "kda", "A", (1, 2))]
    assert all(m["kind"] == "warm" and m["with_fla"] and not m["ours"] for m in shares)
    assert all("gater" not in m for m in log[first_own:])  # then the measuring process: gates, FLA baselines
    assert list(obj.warm_s[0]) == ["FLA precompile", "default gate", "FLA baselines"]
    # a cold machine's compiling outlasts the 300 s trial timeout, which would kill it and lose its progress
    assert {m["_timeout"] for m in log} == {tuner.WARM_TIMEOUT_S}


def test_throughput_reports_the_warm_up_and_the_rate_after_it():
    # A cold H200 host spent 7 of a campaign's 7 minutes warming (session 6): the whole-run rate said nothing about
    # what two workers buy, the rate after the warm-up does.
    obj = types.SimpleNamespace(search_s=None, started=time.monotonic() - 600,
                                stats={"gated": 30, "timed": 20, "rejected": 5},
                                config=types.SimpleNamespace(workers=2, compile_jobs=8),
                                warm_s={0: {"default gate": 150.0, "FLA baselines": 210.0}, 1: {"default gate": 5.0,
                                                                                                 "FLA baselines": 4.0}},
                                warmed_at=time.monotonic() - 240, _timed_at_warm=0)
    line = tuner.Campaign.throughput(obj)
    assert "warm-up (slot 0: default gate 150 s, FLA baselines 210 s; slot 1: default gate 5 s, FLA baselines 4 s)" \
        in line
    assert "after the warm-up (240 s): 5.00 timed/min" in line, line


def test_stream_warms_before_the_gate_processes_ask(tmp_path):
    config = build_config(device="cpu", op="gdn", policy="R", shapes=None, workload=None, head_dim=32, trials=None,
                          time_budget=None, db=str(tmp_path / "w.db"), storage=None, workers=1, resume=False,
                          trial_timeout=None, seed=0)
    db = open_db(config.db_url)
    try:
        campaign = tuner.Campaign(config, db)
        campaign.plan()
        order = []
        campaign._warm_machine = lambda w, slot, gaters: order.append("warm")
        campaign._next_study = lambda: order.append("ask") or None  # nothing to ask: the gate loops end
        campaign.config = _CudaConfig(config)
        campaign._stream(worker=types.SimpleNamespace(), gaters=[types.SimpleNamespace(), types.SimpleNamespace()])
    finally:
        db.close()
    assert order[0] == "warm" and order.count("warm") == 1 and "ask" in order


class _CudaConfig:
    """The CPU campaign's config, reporting a CUDA device (what _stream branches on)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)

    device_kind = "cuda"


def test_a_fla_only_warm_request_compiles_none_of_ours(monkeypatch):
    # ours=False with FLA: FLA's op runs once per shape (stood in: no fla-core kernels on the CPU), ours never
    from rewy_tune import fla_baseline, measure, trial_worker

    ran = []
    monkeypatch.setattr(trial_worker, "_warm_shape", lambda *a: pytest.fail("ours must not run"))
    monkeypatch.setattr(fla_baseline, "fla_op", lambda op, policy: ("fla", op, policy))
    monkeypatch.setattr(fla_baseline, "bypass_hopper_guard", lambda: None)
    monkeypatch.setattr(measure, "run_once", lambda op, fn, shape, *, K, V: ran.append((op, fn, shape, K, V)))
    msg = {"op": "gdn", "policy": "A", "K": 64, "V": 32, "shapes": [[1, 64, 1], [2, 128, 4]], "ours": False,
           "with_fla": True}
    assert trial_worker._warm(msg) == {"status": "ok"}
    assert ran == [("gdn", ("fla", "gdn", "A"), (1, 64, 1), 64, 32), ("gdn", ("fla", "gdn", "A"), (2, 128, 4), 64, 32)]
    ran.clear()
    assert trial_worker._warm({**msg, "with_fla": False}) == {"status": "ok"} and ran == []
