"""The tuner end to end on the CPU: campaigns into a temporary SQLite database through the real CLI.

When the Triton op for GDN is not wired yet, the worker uses the test-only reference kernel
(`REWY_TUNE_TEST_KERNEL=reference`); the search, gates, worker isolation, database and promotion are the
same code either way. Fault injection uses `REWY_TUNE_TEST_FAULTS=1` (a `test_fault` parameter the worker
acts on: hang, segfault, wrong gradients, nondeterminism, compile error).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rewy_tune.db import open_db, queries


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("REWY_DB", None)
    from rewy_tune.ops import _triton_ops

    if "gdn" not in _triton_ops():
        env["REWY_TUNE_TEST_KERNEL"] = "reference"
    env.update(extra)
    return env


def cli(*args, env=None, timeout=240, check=True):
    proc = subprocess.run([sys.executable, "-m", "rewy_tune.cli.main", *args], capture_output=True, text=True,
                          env=env or _env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"rewy-tune {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def _trials(db_url):
    db = open_db(db_url, read_only=True)
    with db.session() as s:
        out = {c.id: [(t.number, t.status, dict(t.schedule)) for t in queries.campaign_trials(s, c.id, limit=10000).items]
               for c in queries.campaigns(s, limit=1000)}
    db.close()
    return out


def _study_trials(storage_path, study_name):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(study_name=study_name, storage=JournalStorage(JournalFileBackend(storage_path)))
    return [t for t in study.get_trials(deepcopy=False)
            if t.state.is_finished() and not t.user_attrs.get("abandoned")]


def test_end_to_end_campaign_show_trials_export_import(tmp_path):
    db = str(tmp_path / "t.db")
    out = cli("--device", "cpu", "--op", "gdn", "--trials", "3", "--db", db, "--seed", "0")
    assert "database:" in out.stdout and "promoted" in out.stdout
    import re

    # the throughput line (how --workers / --compile-jobs are compared): gated = compiled-and-checked schedules
    m = re.search(r"search \d+ s, 1 worker\(s\) x 1 gate process\(es\): (\d+) schedules gated .*?(\d+) timed",
                  out.stdout)
    assert m and int(m.group(1)) >= 1 and int(m.group(2)) >= 1, out.stdout
    trials = _trials(db)
    assert len(trials) == 2  # the two tiny shapes fall into two T buckets: one study (campaign) each
    for rows in trials.values():
        assert len(rows) == 3 and len({n for n, _, _ in rows}) == 3
        assert any(status == "ok" for _, status, _ in rows)
    dbo = open_db(db, read_only=True)
    with dbo.session() as s:
        winners = queries.winners(s, op="gdn")
        assert len(winners) == 2 and all(w.environment.device.short_name == "cpu-interpreter" for w in winners)
        assert queries.baselines(s, winners[0].campaign_id)
    dbo.close()
    shown = cli("show", "--db", db, "--op", "gdn")
    assert "gdn" in shown.stdout and "no winners" not in shown.stdout
    cid = next(iter(trials))
    listed = cli("trials", str(cid), "--db", db)
    assert "ok" in listed.stdout
    exported = tmp_path / "w.json"
    cli("export", str(exported), "--db", db)
    data = json.loads(exported.read_text())
    assert len(data["winners"]) == 2
    other = str(tmp_path / "other.db")
    cli("import", str(exported), "--db", other)
    dbo = open_db(other, read_only=True)
    with dbo.session() as s:
        assert sorted(w.schedule == e["schedule"] for w, e in zip(queries.winners(s), data["winners"])) == [True, True]
    dbo.close()
    # A second campaign seeds itself with the known winners and keeps or replaces them by measured gain.
    def stored():
        dbo = open_db(db, read_only=True)
        with dbo.session() as s:
            got = {queries.bucket_of(w).label: dict(w.schedule) for w in queries.winners(s, op="gdn")}
        dbo.close()
        return got

    before, old_campaigns = stored(), set(_trials(db))
    out = cli("--device", "cpu", "--op", "gdn", "--trials", "2", "--db", db, "--shapes", "1,64,1")
    assert "kept" in out.stdout or "promoted" in out.stdout
    (new_cid, rows), = ((c, r) for c, r in _trials(db).items() if c not in old_campaigns)
    dbo = open_db(db, read_only=True)
    with dbo.session() as s:
        campaign = queries.get_campaign(s, new_cid)
        study_name, storage = campaign.study_name, campaign.storage_url
    dbo.close()
    (bucket,) = (label for label in before if label in study_name)  # the study is named after its bucket
    seeds = {t.user_attrs.get("seed") for t in _study_trials(storage, study_name)}
    assert "default" in seeds  # (a winner equal to the default is enqueued once, as the default)
    assert before[bucket] in [schedule for _, _, schedule in rows]  # the stored winner ran as one of its trials
    after = stored()[bucket]
    assert after == before[bucket] or after in [schedule for _, status, schedule in rows if status == "ok"]


@pytest.mark.slow
def test_fault_injection_each_status_recorded_and_winner_correct(tmp_path):
    db = str(tmp_path / "f.db")
    env = _env(REWY_TUNE_TEST_FAULTS="1")
    out = cli("--device", "cpu", "--op", "gdn", "--shapes", "1,64,1", "--trials", "7", "--db", db,
              "--trial-timeout", "25", "--seed", "1", env=env)
    (rows,) = _trials(db).values()
    statuses = {s for _, s, _ in rows}
    assert {"timeout", "runtime_error", "incorrect", "nondeterministic", "compile_error", "ok"} <= statuses, out.stdout
    dbo = open_db(db, read_only=True)
    with dbo.session() as s:
        (w,) = queries.winners(s)
        ok_schedules = [sch for _, st, sch in rows if st == "ok"]
        assert w.schedule in ok_schedules
    dbo.close()


def test_sigkill_midway_then_resume_loses_and_duplicates_nothing(tmp_path):
    db = str(tmp_path / "k.db")
    args = ["--device", "cpu", "--op", "gdn", "--shapes", "1,64,1", "--trials", "6", "--db", db, "--seed", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "rewy_tune.cli.main", *args], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, counts = time.monotonic() + 120, []
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if os.path.exists(db):
            try:
                counts = [len(r) for r in _trials(db).values()]
            except Exception:  # noqa: BLE001 - the schema may not exist yet
                continue
            if counts and counts[0] >= 2:
                break
    proc.send_signal(signal.SIGKILL)
    # killed midway, or the resume below would have nothing to recover and the test would prove nothing
    assert proc.wait() == -signal.SIGKILL and counts and 2 <= counts[0] < 6, counts
    cli(*args, "--resume")
    trials = _trials(db)
    assert len(trials) == 1  # the same campaign continued
    (cid, rows), = trials.items()
    numbers = [n for n, _, _ in rows]
    assert len(numbers) == len(set(numbers))
    dbo = open_db(db, read_only=True)
    with dbo.session() as s:
        study_name = queries.get_campaign(s, cid).study_name
        storage = queries.get_campaign(s, cid).storage_url
    dbo.close()
    finished = _study_trials(storage, study_name)
    assert sorted(t.number for t in finished) == sorted(numbers)
    assert len(numbers) >= 6


@pytest.mark.slow
def test_two_worker_processes_share_one_journal_study(tmp_path):
    db = str(tmp_path / "w.db")
    storage = str(tmp_path / "shared.journal")
    args = ["--device", "cpu", "--op", "gdn", "--shapes", "1,64,1", "--trials", "6", "--db", db,
            "--storage", storage]
    first = subprocess.Popen([sys.executable, "-m", "rewy_tune.cli.main", *args], env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not os.path.exists(db) or not _safe_trials(db):
        time.sleep(0.3)
        assert first.poll() is None or first.returncode == 0
    second = subprocess.Popen([sys.executable, "-m", "rewy_tune.cli.main", *args, "--resume"], env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, errors, stop = [], [], threading.Event()

    def reader():  # a reader stays consistent while the two processes write
        try:
            while not stop.is_set():
                dbo = open_db(db, read_only=True)
                with dbo.session() as s:
                    for c in queries.campaigns(s):
                        page = queries.campaign_trials(s, c.id, limit=10000)
                        assert page.total == len(page.items), (page.total, len(page.items))
                        seen.append(page.total)
                dbo.close()
                time.sleep(0.2)
        except BaseException as exc:  # noqa: BLE001 - a failure in a thread only warns: handed to the test
            errors.append(exc)

    th = threading.Thread(target=reader)
    th.start()
    try:
        assert first.wait(240) == 0, first.stderr.read()
        assert second.wait(240) == 0, second.stderr.read()
    finally:
        stop.set()
        th.join()
    (cid, rows), = _trials(db).items()
    numbers = [n for n, _, _ in rows]
    assert len(numbers) == len(set(numbers)) and len(numbers) >= 6
    dbo = open_db(db, read_only=True)
    with dbo.session() as s:
        study_name = queries.get_campaign(s, cid).study_name
    dbo.close()
    finished = _study_trials(storage, study_name)
    assert sorted(t.number for t in finished) == sorted(numbers)
    assert not errors, errors
    assert len(seen) >= 2 and seen == sorted(seen)
    assert len({t.user_attrs["pid"] for t in finished}) == 2  # both processes ran trials of the one study


def _safe_trials(db):
    try:
        return _trials(db)
    except Exception:  # noqa: BLE001
        return {}


@pytest.mark.parametrize("args, needle", [
    (["--device", "cpu", "--op", "mamba"], "unknown operator"),
    (["--device", "cpu", "--op", "gdn", "--shapes", "1,x,4"], "is not B,T,H"),
    (["--device", "h100", "--op", "gdn"], "--device h100 needs a GPU but none is present"),
    (["--device", "cpu", "--op", "gdn", "--db", "postgresql://nobody@127.0.0.1:1/none"],
     "cannot open the rewy-tune database at postgresql://nobody@127.0.0.1:1/none: "),
    (["--device", "cpu", "--op", "gdn", "--db", "FILE/sub/x.db"], "cannot create the folder of the rewy-tune database"),
    (["--device", "cpu", "--op", "gdn", "--workload", "WL"], "K=500"),
    (["--device", "cpu", "--op", "gdn", "--compile-jobs", "0"], "--compile-jobs must be at least 1"),
    (["--device", "cpu", "--op", "gdn", "--time-budget", "0"], "--time-budget: '0' is not positive"),
    (["--device", "cpu", "--op", "gdn", "--time-budget", "0s"], "--time-budget: '0s' is not positive"),
    (["--device", "cpu", "--op", "gdn", "--shapes", ""], "--shapes: no shape given; accepted: B,T,H"),
    (["--device", "cpu", "--op", "gdn", "--trial-timeout", "-5"], "--trial-timeout must be a number of seconds >= 1"),
    (["--device", "cpu", "--op", "gdn", "--trial-timeout", "0"], "--trial-timeout must be a number of seconds >= 1"),
    (["--device", "cpu", "--op", "gdn", "--trial-timeout", "0.001"], "--trial-timeout must be a number of seconds >= 1"),
    (["--device", "cpu", "--op", "gdn", "--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    (["--device", "cpu", "--op", "gdn", "--workload", "LATIN1"], "not UTF-8 text (byte 14); expected a JSON file"),
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, args, needle):
    wl = tmp_path / "wl.json"
    wl.write_text(json.dumps({"shapes": [[1, 64, 1]], "K": 500, "V": 32}))
    (tmp_path / "file").write_text("")  # a file where --db wants a folder
    (tmp_path / "latin1.json").write_bytes('{"dtype": "café"}'.encode("latin-1"))
    args = [str(wl) if a == "WL" else str(tmp_path / "latin1.json") if a == "LATIN1" else
            a.replace("FILE", str(tmp_path / "file")) for a in args]
    before = set(os.listdir(tmp_path))
    proc = cli(*args, "--db", str(tmp_path / "bad.db"), check=False, timeout=60) if "--db" not in args else \
        cli(*args, check=False, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stdout
    assert set(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("args, needle", [
    (["export", "OUT", "--op", "NotAnOp"], "--op: unknown operator 'NotAnOp'; accepted: deltanet, gdn, kda, gdn2"),
    (["export", "/nonexistent_dir/e.json"], "/nonexistent_dir/e.json: cannot write it (No such file or directory)"),
    (["export", "DIR"], "cannot write it (Is a directory)"),
    (["export", "/dev/full"], "/dev/full: cannot write it (No space left on device)"),
    (["trials", "99999999999999999999999"], "no campaign with id 99999999999999999999999"),
    (["import", "LATIN1"], "not UTF-8 text (byte 15); expected a JSON file written by export"),
])
def test_read_and_exchange_commands_bad_input_one_line_exit_2(tmp_path, args, needle):
    if "/dev/full" in args and not Path("/dev/full").is_char_device():
        pytest.skip("this machine has no /dev/full")
    db = tmp_path / "r.db"
    open_db(str(db)).close()
    (tmp_path / "dir").mkdir()
    (tmp_path / "latin1.json").write_bytes('{"format": "café"}'.encode("latin-1"))
    subs = {"OUT": str(tmp_path / "out.json"), "DIR": str(tmp_path / "dir"), "LATIN1": str(tmp_path / "latin1.json")}
    # import must not create its database before the file is read
    target = tmp_path / "new.db" if args[0] == "import" else db
    before = set(os.listdir(tmp_path))
    proc = cli(*[subs.get(a, a) for a in args], "--db", str(target), check=False, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stdout
    assert set(os.listdir(tmp_path)) - before <= {"r.db-shm", "r.db-wal"}


@pytest.mark.slow
def test_parallel_gates_record_every_fault_once_and_promote_a_correct_winner(tmp_path):
    """--compile-jobs 3: trials are asked three at a time and gated in three processes at once (a hang, a
    segfault and good trials side by side); every trial is recorded exactly once with its status."""
    db = str(tmp_path / "p.db")
    env = _env(REWY_TUNE_TEST_FAULTS="1")
    storage = str(tmp_path / "p.journal")
    out = cli("--device", "cpu", "--op", "gdn", "--shapes", "1,64,1", "--trials", "8", "--db", db,
              "--storage", storage, "--trial-timeout", "25", "--seed", "2", "--compile-jobs", "3", env=env)
    (rows,) = _trials(db).values()
    numbers = [n for n, _, _ in rows]
    assert len(rows) == 8 and len(set(numbers)) == 8, out.stdout
    statuses = {s for _, s, _ in rows}
    assert {"timeout", "runtime_error", "incorrect", "nondeterministic", "compile_error", "ok"} <= statuses, out.stdout
    dbo = open_db(db, read_only=True)
    with dbo.session() as s:
        (c,) = queries.campaigns(s)
        (w,) = queries.winners(s)
        assert w.schedule in [sch for _, st, sch in rows if st == "ok"]
    dbo.close()
    finished = _study_trials(storage, c.study_name)
    assert sorted(t.number for t in finished) == sorted(numbers)


def test_budget_spent_during_a_batch_re_enqueues_gated_trials_and_resume_times_them(tmp_path):
    """--compile-jobs 2 --time-budget 1s: the first batch is gated past the budget; its passed trials are
    re-enqueued instead of timed (nothing recorded as ok), and --resume times exactly those trials."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    db, storage = str(tmp_path / "b.db"), str(tmp_path / "b.journal")
    common = ["--device", "cpu", "--op", "gdn", "--shapes", "1,64,1", "--db", db, "--storage", storage,
              "--seed", "3", "--compile-jobs", "2"]
    cli(*common, "--trials", "2", "--time-budget", "1s")
    assert all(status != "ok" for rows in _trials(db).values() for _, status, _ in rows)

    def study_trials():
        (summary,) = optuna.get_all_study_summaries(JournalStorage(JournalFileBackend(storage)))
        return optuna.load_study(study_name=summary.study_name,
                                 storage=JournalStorage(JournalFileBackend(storage))).get_trials(deepcopy=False)

    abandoned = [t for t in study_trials() if t.user_attrs.get("abandoned")]
    assert abandoned  # at least the enqueued default passed its gate and was put back
    cli(*common, "--trials", "2", "--resume")
    (rows,) = _trials(db).values()
    status_of = {n: status for n, status, _ in rows}
    assert len(status_of) == len(rows) == 2
    reruns = {t.user_attrs.get("seed"): t for t in study_trials()}
    for t in abandoned:
        rerun = reruns[f"re-run of {t.number}"]
        assert rerun.params == t.params and status_of[rerun.number] == "ok"


def _rows_with_messages(db_url):
    db = open_db(db_url, read_only=True)
    with db.session() as s:
        out = {c.id: [(t.number, t.status, dict(t.schedule), t.message or "", t.compile_s)
                      for t in queries.campaign_trials(s, c.id, limit=10000).items]
               for c in queries.campaigns(s, limit=1000)}
    db.close()
    return out


def test_a_gated_schedule_is_timed_and_recorded_in_every_bucket(tmp_path):
    """Two buckets (the CPU default shapes), --trials 3: schedules compiled and gated in one bucket are
    recorded in the other as trials of its own study ("shared from ..."), with that bucket's timings; with
    --no-share-trials every trial is gated in its own bucket."""
    db = str(tmp_path / "s.db")
    # a seed whose first samples pass the constraint in one bucket (4 since reverse_scan_small_grid_block_v joined the
    # scalar space in session 39; 3 after dv_local_source in session 36; with others, e.g. 1 and 2 now, every sample
    # beyond the default is a constraint rejection and nothing is shared)
    cli("--device", "cpu", "--op", "gdn", "--trials", "3", "--db", db, "--seed", "4", "--compile-jobs", "2")
    camps = _rows_with_messages(db)
    assert len(camps) == 2 and all(len(rows) == 3 for rows in camps.values())
    shared = [r for rows in camps.values() for r in rows if "shared from" in r[3]]
    gated = [r for rows in camps.values() for r in rows if "shared from" not in r[3]]
    assert shared and all(r[4] is None and r[1] == "ok" for r in shared)
    all_gated_schedules = [r[2] for r in gated]
    assert all(r[2] in all_gated_schedules for r in shared)
    assert len(gated) < 6  # fewer compilations than trials
    db2 = str(tmp_path / "n.db")
    cli("--device", "cpu", "--op", "gdn", "--trials", "2", "--db", db2, "--seed", "7", "--no-share-trials")
    assert not any("shared from" in r[3] for rows in _rows_with_messages(db2).values() for r in rows)


def test_a_gate_process_asks_past_constraint_rejections_up_to_the_target():
    # On the H200 five of eight asks were constraint rejections and took compile slots. A gate process now
    # asks on (each rejection still a recorded trial) until it holds a schedule worth compiling, the study
    # reaches its target, or a bounded number of asks.
    import types

    from rewy_tune import tuner

    def stub(answers, target):
        asked = []
        it = iter(answers)

        def ask(st):
            asked.append(1)
            return next(it, None)

        obj = types.SimpleNamespace(_ask=ask, _counted=lambda st: asked, stop=threading.Event())
        st = types.SimpleNamespace(target=target)
        return tuner.Campaign._next_task(obj, st), len(asked)

    # None = a constraint rejection; dicts = schedules worth compiling
    answers = [None, None, {"n": 1}, None, {"n": 2}]
    task, asks = stub(answers, target=None)
    assert task == {"n": 1} and asks == 3
    task, asks = stub(answers, target=2)  # the target counts rejections too
    assert task is None and asks == 2
    task, asks = stub([None] * 100, target=None)  # all rejected: bounded
    assert task is None and asks == 64


def test_a_constraint_rejection_is_an_infeasible_trial_for_tpe():
    # Told FAIL, rejections were invisible to TPE (29 of 30 asks rejected on the H200); now PRUNED with a positive
    # trial constraint, which Optuna's TPE puts among the bad trials.
    import types

    import optuna

    from rewy_tune import tuner

    study = optuna.create_study(sampler=tuner._sampler(0))
    recorded = []
    obj = types.SimpleNamespace(_record=lambda st, trial, sched, status, message=None: recorded.append(
        (status, message)), _done=lambda st: None, stats={"rejected": 0})
    st = types.SimpleNamespace(study=study)
    tuner.Campaign._reject(obj, st, study.ask(), {}, "consumer_cfg: too big; reverse_scan: too big")
    (t,) = study.get_trials()
    assert t.state == optuna.trial.TrialState.PRUNED and t.constraints == {"limits": 2.0}
    assert recorded == [("constraint", "consumer_cfg: too big; reverse_scan: too big")]
    assert obj.stats == {"rejected": 1}


def test_every_study_of_a_campaign_has_its_own_sampler_seed(tmp_path, monkeypatch):
    # one seed for all buckets made every bucket propose the same schedules (compiled six times on the H200)
    from rewy_tune import tuner
    from rewy_tune.cli.campaign import build_config
    from rewy_tune.db import open_db

    seeds = []
    real = tuner._sampler
    monkeypatch.setattr(tuner, "_sampler", lambda seed: seeds.append(seed) or real(seed))
    config = build_config(device="cpu", op="gdn", policy="both", shapes=None, workload=None, head_dim=32,
                          trials=2, time_budget=None, db=str(tmp_path / "s.db"), storage=None, workers=1,
                          resume=False, trial_timeout=None, seed=7)
    db = open_db(config.db_url)
    try:
        states = tuner.Campaign(config, db).plan()
    finally:
        db.close()
    assert len(states) == 4 and len(set(seeds)) == len(seeds) == 4 and seeds[0] == 7


def test_the_time_budget_stops_gates_still_running(tmp_path):
    """A gate still running when --time-budget is spent is killed (its trial re-enqueued), not waited for:
    on two H200s the gates ran 165 s past a 380 s budget."""
    import time

    from rewy_tune import tuner
    from rewy_tune.cli.campaign import build_config
    from rewy_tune.db import open_db
    from rewy_tune.trial_worker import Outcome

    class BlockingGater:
        def __init__(self):
            self.killed = threading.Event()

        def request(self, msg, timeout):
            self.killed.wait(60)
            return Outcome("runtime_error", "worker process died (exit code -9)")

        def kill(self):
            self.killed.set()

    config = build_config(device="cpu", op="gdn", policy="R", shapes=None, workload=None, head_dim=32, trials=None,
                          time_budget="1s", db=str(tmp_path / "k.db"), storage=None, workers=1, resume=False,
                          trial_timeout=None, seed=0)
    db = open_db(config.db_url)
    try:
        campaign = tuner.Campaign(config, db)
        campaign.plan()
        asked, abandoned = [], []
        campaign._next_task = lambda st: None if asked else asked.append(1) or {
            "trial": "t", "task": {}, "shapes": [], "schedule": {}}
        campaign._abandon = lambda st, trial: abandoned.append(trial)
        campaign._measure_and_tell = lambda *a: pytest.fail("a gate cut short must not be timed")
        gater = BlockingGater()
        campaign.started = time.monotonic()
        t0 = time.monotonic()
        campaign._stream(worker=None, gaters=[gater])
        elapsed = time.monotonic() - t0
    finally:
        db.close()
    assert gater.killed.is_set() and abandoned == ["t"] and elapsed < 10, elapsed
    assert campaign.stats["gated"] == 1
