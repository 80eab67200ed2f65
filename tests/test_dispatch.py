"""The dispatcher's fallback chain on temporary SQLite databases, its cache, concurrency with a writer, and
missing or corrupt database files (defaults with one warning, never a crash, no file created)."""

from __future__ import annotations

import threading
import warnings

import pytest

from rewy_tune import dispatch
from rewy_tune.db import open_db, queries
from rewy_tune.device import Device, Environment
from rewy_tune.dispatch import DispatchWarning, choose_schedule, clear_cache, lookup
from rewy_tune.problem import Problem
from rewy_tune.search_spaces import default_schedule

H200 = Device("NVIDIA H200", (9, 0), 132, 150_013_493_248)
H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 85_000_000_000)
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_100_000_000)
RUN = Environment("570.86.15", "12.8", "2.8.0", "3.6.0", "0.6.0", "0.1.0", "aaaaaaaaaaaaaaaa")
STALE = Environment("570.86.15", "12.8", "2.8.0", "3.6.0", "0.6.0", "0.1.0", "bbbbbbbbbbbbbbbb")
K = V = 64
BASE = default_schedule((9, 0), K=K, V=V)
S1 = BASE.replace(cumsum={"num_warps": 1})
S2 = BASE.replace(cumsum={"num_warps": 2})


def problem(T=2048, B=1, H=16, op="gdn", dtype="bf16"):
    return Problem(op, "R", dtype, B=B, T=T, H=H, K=K, V=V)


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def make_db(path, winners):
    """winners: [(device, environment, problem, schedule)]; returns the path."""
    db = open_db(str(path))
    try:
        for device, env, prob, schedule in winners:
            with db.session() as s:
                cid = queries.create_campaign(s, device=device, environment=env, op=prob.op, policies=("R",),
                                              workload={}, budget={}).id
                queries.promote_winner(s, campaign_id=cid, bucket=prob.bucket(), schedule=schedule.to_dict(),
                                       latency_ms=1.0, fla_latency_ms=1.5)
    finally:
        db.close()
    return str(path)


def test_fallback_chain(tmp_path):
    url = make_db(tmp_path / "w.db", [(H200, RUN, problem(T=2048), S1)])

    s, reason = lookup(problem(T=2000), H200, environment=RUN, db_url=url)  # same bucket T2048, BH16
    assert s == S1 and reason.startswith("exact:"), reason

    s, reason = lookup(problem(T=8192, B=2), H200, environment=RUN, db_url=url)
    assert s == S1 and reason.startswith("nearest:") and "log distance 3" in reason, reason

    s, reason = lookup(problem(T=2048), H100, environment=RUN, db_url=url)  # another fingerprint, cc 9.0
    assert s == S1 and reason.startswith("same-cc:") and "NVIDIA H200" in reason, reason

    s, reason = lookup(problem(op="deltanet"), H100, environment=RUN, db_url=url)  # no winner of this family
    assert s == default_schedule((9, 0), K=K, V=V, op="deltanet", dtype="bf16", policy="R"), s
    assert reason.startswith("default:") and "9.0" in reason, reason

    s, reason = lookup(problem(), A100, environment=RUN, db_url=url)  # only winners of another cc
    assert s == default_schedule(None, K=K, V=V) and reason.startswith("generic:"), reason
    assert "compute capability 9.0" in reason, reason


def test_the_default_step_takes_the_problems_policy(tmp_path):
    # KDA's H200 default differs between policies (policy A's lone reverse scan takes 64-wide tiles): the lookup
    # with no winner returns the one of the call's policy
    url = make_db(tmp_path / "w.db", [])
    for policy in ("R", "A"):
        kda = Problem("kda", policy, "bf16", B=1, T=4096, H=8, K=128, V=128)
        s, reason = lookup(kda, H200, environment=RUN, db_url=url)
        assert s == default_schedule((9, 0), K=128, V=128, op="kda", dtype="bf16", policy=policy)
        assert reason.startswith("default:"), reason
        assert s.reverse_scan.block_v == {"R": 32, "A": 64}[policy]


def test_stale_kernel_hash_not_used(tmp_path):
    url = make_db(tmp_path / "w.db", [(H200, STALE, problem(T=2048), S2)])
    s, reason = lookup(problem(T=2048), H200, environment=RUN, db_url=url)
    assert s == default_schedule((9, 0), K=K, V=V) and reason.startswith("default:"), reason
    assert "stale kernel source hash" in reason, reason
    # with a usable winner too, the stale one (exact bucket) still loses to the nearest fresh one
    url2 = make_db(tmp_path / "w2.db", [(H200, STALE, problem(T=2048), S2), (H200, RUN, problem(T=4096), S1)])
    s, reason = lookup(problem(T=2048), H200, environment=RUN, db_url=url2)
    assert s == S1 and reason.startswith("nearest:") and "stale kernel source hash" in reason, reason


def test_explicit_schedule_overrides():
    assert choose_schedule(problem(), S2, H200) == (S2, "explicit")


def test_cached_after_first_call(tmp_path, monkeypatch):
    url = make_db(tmp_path / "w.db", [(H200, RUN, problem(T=2048), S1)])
    first = lookup(problem(T=2048), H200, environment=RUN, db_url=url)
    n = dispatch.cache_size()

    def boom(*a, **k):
        raise AssertionError("a cached lookup must not reach the database")

    monkeypatch.setattr(dispatch, "_resolve", boom)
    assert lookup(problem(T=1500), H200, environment=RUN, db_url=url) is first  # same bucket: a dict hit
    assert dispatch.cache_size() == n


def test_missing_db_defaults_with_one_warning_and_creates_nothing(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "missing.db"
    monkeypatch.setenv("REWY_DB", str(path))
    with pytest.warns(DispatchWarning, match="no rewy-tune database"):
        s, reason = lookup(problem(), H200, environment=RUN)
    assert s == default_schedule((9, 0), K=K, V=V) and reason.startswith("default:") and "no database" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lookup(problem(T=64), H200, environment=RUN)  # another bucket: no second warning
    assert not path.exists() and not path.parent.exists()


def test_corrupt_db_defaults_with_a_warning(tmp_path):
    path = tmp_path / "corrupt.db"
    garbage = bytes(range(256)) * 64
    path.write_bytes(garbage)
    with pytest.warns(DispatchWarning):
        s, reason = lookup(problem(), A100, environment=RUN, db_url=str(path))
    assert s == default_schedule(None, K=K, V=V) and reason.startswith("generic:") and "unreadable" in reason
    assert path.read_bytes() == garbage
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.db"]


def test_lookups_while_the_database_is_written(tmp_path):
    path = tmp_path / "w.db"
    url = make_db(path, [(H200, RUN, problem(T=2048), S1)])
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer():
        try:
            db = open_db(url)
            with db.session() as s:
                cid = queries.create_campaign(s, device=H200, environment=RUN, op="gdn", policies=("R",),
                                              workload={}, budget={}).id
            for i in range(12):
                with db.session() as s:
                    queries.promote_winner(s, campaign_id=cid, bucket=problem(T=2 ** (i % 6 + 6), B=2 ** (i // 6)
                                                                              ).bucket(),
                                           schedule=S2.to_dict(), latency_ms=1.0, fla_latency_ms=2.0,
                                           replace=True)
            db.close()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    def reader(seed):
        try:
            i = 0
            while not stop.is_set() or i < 20:
                s, reason = lookup(problem(T=2 ** ((seed + i) % 8 + 6)), H200, environment=RUN, db_url=url)
                assert s in (S1, S2) and reason.split(":")[0] in ("exact", "nearest"), reason
                i += 1
                if i % 5 == 0:
                    clear_cache()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    clear_cache()
    s, reason = lookup(problem(T=64), H200, environment=RUN, db_url=url)
    assert s == S2 and reason.startswith("exact:"), reason


def test_measured_speedup_of_the_chosen_winner(tmp_path):
    # make_db promotes at 1.0 ms against FLA's 1.5 ms: 1.5x; a second family is slower than FLA
    url = make_db(tmp_path / "w.db", [(H200, RUN, problem(T=2048), S1)])
    db = open_db(url)
    try:
        with db.session() as s:
            cid = queries.create_campaign(s, device=H200, environment=RUN, op="kda", policies=("R",), workload={},
                                          budget={}).id
            queries.promote_winner(s, campaign_id=cid, bucket=problem(op="kda").bucket(), schedule=S2.to_dict(),
                                   latency_ms=2.0, fla_latency_ms=1.0)
    finally:
        db.close()
    assert dispatch.measured_speedup(problem(T=2000), H200, environment=RUN, db_url=url) == pytest.approx(1.5)
    assert dispatch.measured_speedup(problem(T=8192, B=2), H200, environment=RUN, db_url=url) == pytest.approx(1.5)
    assert dispatch.measured_speedup(problem(T=2048), H100, environment=RUN, db_url=url) == pytest.approx(1.5)
    assert dispatch.measured_speedup(problem(op="kda"), H200, environment=RUN, db_url=url) == pytest.approx(0.5)
    assert dispatch.measured_speedup(problem(op="deltanet"), H200, environment=RUN, db_url=url) is None  # default
    assert lookup(problem(op="kda"), H200, environment=RUN, db_url=url)[0] == S2


def test_bad_arguments_are_named():
    # a dict or a device string failed with AttributeError deep in the key; K over the kernels' limit failed inside
    # StageConfig naming block_k
    with pytest.raises(TypeError, match="problem: expected a rewy_tune.Problem, got dict"):
        lookup({"op": "gdn", "T": 2048})
    with pytest.raises(TypeError, match=r"device: expected a rewy_tune.device.Device or None \(the current GPU\), "
                                        r"got str"):
        lookup(problem(), "cuda")
    big = Problem("gdn", "R", "bf16", B=1, T=2048, H=16, K=1000, V=64)
    with pytest.raises(ValueError, match=r"problem: K=1000, V=64: schedules exist for K, V <= 256"):
        lookup(big, H200, environment=RUN)
