"""The campaign engine: one Optuna study per (device, operator, policy, shape bucket).

Flow (architecture.md, Tuner):
1. `plan_campaign` groups the workload's shapes into buckets; each (op, policy, bucket) gets a study and a
   campaign row. A fresh study is seeded (enqueued) with the default schedule and the winners already
   known for the same compute capability. `--resume` reopens the newest campaign of the same study.
2. Worker loops (`--workers N`, each with its own `TrialWorker` process and, on CUDA, its own GPU) ask
   the shared study for a trial (TPE, multivariate, conditional groups), reject constraint violations
   before compiling (status `constraint`, recorded, never compiled), run the gates and then time the
   workload shape by shape, reporting the running sum so `CannotBeatBestPruner` stops a trial that
   cannot beat the best. The trial row is written to the database, then the result is told to Optuna.
   With `--compile-jobs N` (N > 1, the GPU default) a worker keeps N gate processes busy, each asking for
   its next trial as soon as it is free (each gate also runs every workload shape once, filling Triton's
   on-disk cache), and its single measuring process times the gated trials as they arrive: compilation,
   not timing, is what a GPU trial spends its time on. A schedule that passed
   its gates is then also timed on the other buckets of the same operator and policy and recorded there as
   a trial of their studies (`share_trials`): the kernels compile once for every shape, so one compilation
   buys a trial in every bucket.
3. Budget: `--trials` (per study) and/or `--time-budget`. Ctrl-C abandons running trials (they are
   re-enqueued) and marks the campaign interrupted. A SIGKILLed campaign's running trials are
   reconciled on `--resume`: a trial whose row reached the database is told its recorded result; one
   that did not is marked abandoned and re-enqueued. So no trial is lost or duplicated.
4. Promotion (`promotion.py`) re-measures the best few and is the only step that writes winners.

Study storage: a journal file beside the database by default, any Optuna storage URL with `--storage`.
"""

from __future__ import annotations

import math
import os
import queue
import socket
import statistics
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from rewy_tune import search, warmup
from rewy_tune.device import Device, Environment
from rewy_tune.problem import OPS, Bucket, Problem
from rewy_tune.schedule import Schedule
from rewy_tune.trial_worker import TrialWorker

STATUSES = ("ok", "constraint", "compile_error", "runtime_error", "timeout", "incorrect", "nondeterministic")
CPU_SHAPES = ((1, 64, 1), (1, 128, 1))
HOST = socket.gethostname()

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def available_ops() -> frozenset[str]:
    """Operators whose Triton backward exists (the test-only reference kernel makes all available)."""
    if os.environ.get("REWY_TUNE_TEST_KERNEL") == "reference":
        return frozenset(OPS)
    from rewy_tune.ops import _triton_ops

    return _triton_ops()


def kernel_backend() -> str:
    return "torch" if os.environ.get("REWY_TUNE_TEST_KERNEL") == "reference" else "triton"


def shape_label(shape) -> str:
    B, T, H = shape
    return f"B{B}-T{T}-H{H}"


def parse_duration(text: str | None) -> float | None:
    """'30m', '90s', '1h30m', '45' (seconds) → seconds (positive); None for None; ValueError otherwise."""
    if text is None:
        return None
    import re

    s = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        seconds = float(s)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", s)
        if not parts or "".join(n + u for n, u in parts) != s:
            raise ValueError(f"--time-budget: {text!r} is not a duration such as 30m, 90s or 1h30m")
        seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if seconds <= 0:  # a zero budget would record a campaign that ran no trial
        raise ValueError(f"--time-budget: {text!r} is not positive; give a duration such as 30m, 90s or 1h30m")
    return seconds


@dataclass
class CampaignConfig:
    device: Device
    environment: Environment
    ops: list[str]
    policies: list[str]
    shapes: list[tuple[int, int, int]]
    K: int
    V: int
    dtype: str
    trials: int | None
    time_budget_s: float | None
    db_url: str
    storage_url: str | None = None
    workers: int = 1
    resume: bool = False
    trial_timeout_s: float = 300.0
    reps: int = 3
    promote_top: int = 3
    seed: int | None = None
    # Gate processes per worker. Above 1 the worker asks that many trials at once, gates them in
    # parallel (each gate also runs every workload shape once, so Triton's on-disk cache holds the
    # compiled kernels) and then times them one by one in its measuring process: compilation is
    # CPU-bound and dominates a GPU trial, timing must not share the GPU.
    compile_jobs: int = 1
    # A schedule that passed its gates is also timed on the other buckets of its operator and policy and
    # recorded there as a trial: one compilation (minutes) buys a trial in every bucket (seconds each).
    share_trials: bool = True

    @property
    def device_kind(self) -> str:
        return "cpu" if self.device.is_cpu else "cuda"


@dataclass
class StudyState:
    """What the live display shows for one (op, policy, bucket)."""

    op: str
    policy: str
    bucket: Bucket
    shapes: list[tuple[int, int, int]]
    study_name: str
    campaign_id: int
    target: int | None
    study: Any = None
    done: int = 0
    running: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    best_ms: float | None = None
    best_speedup: float | None = None
    best_number: int | None = None
    default_ms: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def label(self) -> str:
        return f"{self.op} {self.policy} {self.bucket.label}"


def storage_for(storage_url: str | None, db_url: str) -> tuple[Any, str]:
    """The Optuna storage and its label: a journal file beside the database by default."""
    from rewy_tune.db.engine import sqlite_file

    if storage_url is None:
        path = sqlite_file(db_url)
        if path is None:
            import platformdirs

            path = Path(platformdirs.user_data_dir("rewy-tune")) / "rewy-tune.db"
        storage_url = str(path.with_name(path.stem + "-optuna.journal"))
    if "://" not in storage_url or storage_url.startswith("journal://"):
        path = Path(storage_url.removeprefix("journal://")).expanduser().resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        return JournalStorage(JournalFileBackend(str(path))), str(path)
    return optuna.storages.get_storage(storage_url), storage_url


class CannotBeatBestPruner(optuna.pruners.BasePruner):
    """Prune when the running sum of per-shape medians is worse than the best finished trial's at the
    same step by more than `margin` (a trial that cannot beat the best is not timed to the end)."""

    def __init__(self, margin: float = 0.15):
        self.margin = margin

    def prune(self, study, trial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        value = trial.intermediate_values[step]
        best = [t.intermediate_values[step] for t in study.get_trials(deepcopy=False, states=(
            optuna.trial.TrialState.COMPLETE,)) if step in t.intermediate_values]
        return bool(best) and value > min(best) * (1 + self.margin)


WARM_TIMEOUT_S = 600.0  # floor of a warm-up request's timeout (see Campaign._warm_timeout_s)


def _sampler(seed: int | None):
    # constant_liar: trials asked together (parallel gates, several workers) are spread out, not repeated.
    return optuna.samplers.TPESampler(multivariate=True, group=True, n_startup_trials=5, seed=seed,
                                      constant_liar=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


class Campaign:
    """One `rewy-tune --op ...` run: plans the studies, runs the worker loops, promotes."""

    def __init__(self, config: CampaignConfig, db, *, on_event=None):
        self.config = config
        self.db = db
        self.storage, self.storage_label = storage_for(config.storage_url, config.db_url)
        self.states: list[StudyState] = []
        self.skipped: dict[str, str] = {}
        self.stop = threading.Event()
        self.interrupted = False
        self.started = time.monotonic()
        self.workers: list[TrialWorker] = []
        self.on_event = on_event
        self.promotions: list[Any] = []
        # throughput of the search (what --workers and --compile-jobs buy): schedules gated, trials timed,
        # rejections; `search_s` is set when the worker loops end
        self.stats: dict[str, int] = {"gated": 0, "timed": 0, "rejected": 0}
        self.search_s: float | None = None
        self.errors: list[str] = []
        self._in_flight: dict[int, int] = {}  # id(StudyState) -> trials asked there, not yet settled
        self._ask_lock = threading.Lock()  # one ask at a time over all workers: targets count asked trials
        self._warm_lock = threading.Lock()  # worker slots warm the machine's caches one after the other
        # seconds each worker slot spent warming (CUDA: "default gate", "FLA baselines"), and when the last slot
        # finished: a cold machine spends minutes there (fla-core's first-use autotuning), so the rate after it
        # is what --workers changes
        self.warm_s: dict[int, dict[str, float]] = {}
        self.warmed_at: float | None = None
        self._timed_at_warm = 0

    # -- planning ---------------------------------------------------------------------------------
    def plan(self) -> list[StudyState]:
        from rewy_tune.db import queries

        cfg = self.config
        avail = available_ops()
        fp = cfg.environment.fingerprint(cfg.device)
        for op in cfg.ops:
            if op not in avail:
                self.skipped[op] = "no Triton kernels for this operator yet"
                continue
            for policy in cfg.policies:
                buckets: dict[Bucket, list] = {}
                for shape in cfg.shapes:
                    b = Problem(op, policy, cfg.dtype, *shape, cfg.K, cfg.V).bucket()
                    buckets.setdefault(b, []).append(tuple(shape))
                for bucket, shapes in buckets.items():
                    base = f"rewy-{cfg.device.short_name}-{fp}-{bucket.label}"
                    with self.db.session() as s:
                        row = None
                        if cfg.resume:
                            for c in queries.campaigns(s, device=cfg.device.short_name, op=op, limit=1000):
                                if (c.study_name or "").startswith(base + "-") and \
                                        c.storage_url == self.storage_label:
                                    row = c
                                    break
                        if row is None:
                            row = queries.create_campaign(
                                s, device=cfg.device, environment=cfg.environment, op=op, policies=[policy],
                                workload={"shapes": [list(x) for x in shapes], "K": cfg.K, "V": cfg.V,
                                          "dtype": cfg.dtype, "chunk_size": 64, "bucket": bucket.label,
                                          "timing": "interpreter" if cfg.device.is_cpu else "cuda-graph"},
                                budget={"trials": cfg.trials, "time_budget_s": cfg.time_budget_s},
                                storage_url=self.storage_label,
                                study_name=f"{base}-{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:6]}")
                        st = StudyState(op, policy, bucket, shapes, row.study_name, row.id, cfg.trials)
                    st.study = optuna.create_study(
                        study_name=st.study_name, storage=self.storage, direction="minimize",
                        # one seed per study: with the same seed every bucket's TPE proposed the same
                        # schedules, and (trials being shared) the same schedule was compiled six times
                        sampler=_sampler(None if cfg.seed is None else cfg.seed + len(self.states)),
                        pruner=CannotBeatBestPruner(0.5 if cfg.device.is_cpu else 0.15), load_if_exists=True)
                    self._reconcile(st)
                    # Shared trials carry the seeds (default, known winners) from the first bucket to the others.
                    first = not any((o.op, o.policy) == (op, policy) for o in self.states)
                    if not st.study.get_trials(deepcopy=False) and (first or not cfg.share_trials):
                        self._seed(st)
                    self._refresh(st)
                    self.states.append(st)
        return self.states

    def _space_kwargs(self, op: str) -> dict[str, Any]:
        cfg = self.config
        return dict(op=op, K=cfg.K, V=cfg.V, interpreter=cfg.device.is_cpu)

    def default_schedule(self, op: str, policy: str) -> Schedule:
        """The built-in schedule calls run without a winner: this device, head dims, input dtype and policy."""
        cfg = self.config
        return search.default_schedule(op, cfg.device.compute_capability, cfg.K, cfg.V, cfg.dtype, policy)

    def task(self, op: str, policy: str, schedule: dict[str, Any], *, seed: int, fault: str = "none"
             ) -> dict[str, Any]:
        """The fields of a worker request (gate, measure) for one schedule of this campaign."""
        cfg = self.config
        return dict(op=op, policy=policy, K=cfg.K, V=cfg.V, schedule=schedule, fault=fault, device=cfg.device_kind,
                    backend=kernel_backend(), seed=seed, reps=cfg.reps)

    def _seed(self, st: StudyState) -> None:
        """Enqueue the default schedule and the winners known for the same compute capability."""
        from rewy_tune.db import queries

        cfg = self.config
        cc = cfg.device.compute_capability
        seeds: list[Schedule] = [self.default_schedule(st.op, st.policy)]
        with self.db.session() as s:
            for w in queries.winners(s, op=st.op, policy=st.policy):
                if w.compute_capability == "{}.{}".format(*cc) and (w.K, w.V, w.dtype) == (cfg.K, cfg.V, cfg.dtype):
                    try:
                        seeds.append(Schedule.from_dict(w.schedule))
                    except ValueError:
                        continue
        faults = [f for f in search.FAULTS if f != "none"] if search.faults_enabled() else []
        seen = set()
        for fault in faults:  # test-only: one trial per fault, before the clean default
            params = search.schedule_params(seeds[0], policy=st.policy, **self._space_kwargs(st.op))
            if params is not None:
                st.study.enqueue_trial({**params, "test_fault": fault}, user_attrs={"seed": f"fault-{fault}"})
        for i, sched in enumerate(seeds):
            params = search.schedule_params(sched, policy=st.policy, **self._space_kwargs(st.op))
            if params is None or tuple(sorted(params.items())) in seen:
                continue
            seen.add(tuple(sorted(params.items())))
            if faults:
                params["test_fault"] = "none"
            st.study.enqueue_trial(params, user_attrs={"seed": "default" if i == 0 else "known-winner"})

    def _reconcile(self, st: StudyState) -> None:
        """Running trials of a dead campaign process on this host: told their recorded result, or
        abandoned and re-enqueued (nothing lost, nothing duplicated)."""
        from rewy_tune.db import queries

        storage = st.study._storage
        for t in st.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            host, pid = t.user_attrs.get("host"), t.user_attrs.get("pid")
            if host != HOST or pid is None or (_pid_alive(pid) and pid != os.getpid()):
                continue
            with self.db.session() as s:
                row = next((r for r in queries.campaign_trials(s, st.campaign_id, limit=100000).items
                            if r.number == t.number), None)
                recorded = None if row is None else (row.status, dict(row.medians_ms), row.message)
            if recorded is not None:
                status, medians, message = recorded
                storage.set_trial_user_attr(t._trial_id, "status", status)
                if status == "ok" and medians and len(medians) == len(st.shapes) and "pruned" not in (message or ""):
                    storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.COMPLETE,
                                                   [geomean(list(medians.values()))])
                else:
                    storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
            else:
                storage.set_trial_user_attr(t._trial_id, "abandoned", True)
                storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
                st.study.enqueue_trial(dict(t.params), user_attrs={"seed": f"re-run of {t.number}"})

    def _counted(self, st: StudyState) -> list:
        return [t for t in st.study.get_trials(deepcopy=False)
                if t.state != optuna.trial.TrialState.WAITING and not t.user_attrs.get("abandoned")]

    def _refresh(self, st: StudyState) -> None:
        trials = self._counted(st)
        with st.lock:
            st.done = sum(t.state.is_finished() for t in trials)
            st.running = sum(t.state == optuna.trial.TrialState.RUNNING for t in trials)
            counts: dict[str, int] = {}
            for t in trials:
                if t.state.is_finished() and "status" in t.user_attrs:
                    counts[t.user_attrs["status"]] = counts.get(t.user_attrs["status"], 0) + 1
            st.counts = counts
            complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
            if complete:
                best = min(complete, key=lambda t: t.value)
                st.best_ms, st.best_number = best.value, best.number
                st.best_speedup = best.user_attrs.get("speedup")
                default = [t for t in complete if t.user_attrs.get("seed") == "default"]
                st.default_ms = default[0].value if default else None

    # -- running ----------------------------------------------------------------------------------
    def _budget_left(self) -> bool:
        cfg = self.config
        return cfg.time_budget_s is None or time.monotonic() - self.started < cfg.time_budget_s

    def _next_study(self) -> StudyState | None:
        open_ = []
        for st in self.states:
            n = len(self._counted(st)) + self._promised(st)
            if st.target is None or n < st.target:
                open_.append((n, st))
        return min(open_, key=lambda x: x[0])[1] if open_ else None

    def _promised(self, st: StudyState) -> int:
        """Trials in flight in the other buckets of st's operator and policy: each that passes its gates will
        be recorded in st too (share_trials), so asking st for more now would waste a compilation."""
        if not self.config.share_trials:
            return 0
        return sum(self._in_flight.get(id(o), 0) for o in self.states
                   if o is not st and (o.op, o.policy) == (st.op, st.policy))

    def _next_task(self, st: StudyState) -> dict[str, Any] | None:
        """Ask until the study gives a schedule worth compiling (None: target reached, stopping, or a bounded
        number of asks all rejected). A constraint violation is a recorded trial (it counts toward the target)
        but takes no compile slot: on the H200 five of the first eight asks were rejected."""
        for _ in range(64):  # bounded: a space that is almost all constraint still returns
            if self.stop.is_set() or (st.target is not None and len(self._counted(st)) >= st.target):
                return None
            task = self._ask(st)
            if task is not None:
                return task
        return None

    def run(self) -> None:
        """Run the worker loops to the budget; returns when done or stopped (Ctrl-C: `stop_now`)."""
        if self.config.device_kind == "cuda":
            # FLA's baseline picks are timed by this campaign's measuring process alone (`_warm_machine`), not read
            # from picks that other processes left on disk after timing them on a shared GPU
            from rewy_tune import fla_baseline

            fla_baseline.discard_autotune_picks(sorted({st.op for st in self.states}))
        threads = []
        for slot in range(max(1, self.config.workers)):
            th = threading.Thread(target=self._loop, args=(slot,), daemon=True, name=f"rewy-worker-{slot}")
            th.start()
            threads.append(th)
        self._threads = threads

    def throughput(self) -> str:
        """One line: search time and what it produced per minute (compare --workers 1 and 2 with it)."""
        elapsed = self.search_s if self.search_s is not None else time.monotonic() - self.started
        g, t, r = self.stats["gated"], self.stats["timed"], self.stats["rejected"]
        rate = 60.0 / max(elapsed, 1e-9)
        line = (f"search {elapsed:.0f} s, {self.config.workers} worker(s) x {self.config.compile_jobs} gate "
                f"process(es): {g} schedules gated ({g * rate:.2f}/min), {t} timed ({t * rate:.2f}/min), "
                f"{r} rejected before compiling")
        if self.warm_s:
            parts = "; ".join(f"slot {slot}: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
                              for slot, phases in sorted(self.warm_s.items()))
            line += f"; warm-up ({parts})"
        if self.warmed_at is not None:
            after = self.started + elapsed - self.warmed_at
            if after > 0:
                line += (f"; after the warm-up ({after:.0f} s): {(t - self._timed_at_warm) * 60.0 / after:.2f} "
                         "timed/min")
        return line

    def running(self) -> bool:
        return any(th.is_alive() for th in getattr(self, "_threads", []))

    def join(self, timeout: float | None = None) -> None:
        for th in getattr(self, "_threads", []):
            th.join(timeout)

    def stop_now(self) -> None:
        """Ctrl-C: stop asking, kill the trial processes; their trials are abandoned and re-enqueued."""
        self.interrupted = True
        self.stop.set()
        for w in list(self.workers):
            w.stop()

    def _loop(self, slot: int) -> None:
        cfg = self.config
        gpu = slot if (cfg.device_kind == "cuda" and cfg.workers > 1) else None
        # every process of every worker shares the host's cores (compiles, float64 gate references)
        threads = max(1, (os.cpu_count() or 2) // (max(1, cfg.workers) * (cfg.compile_jobs + 1)))
        worker = TrialWorker(device=cfg.device_kind, gpu_index=gpu, threads=threads)
        gaters = [TrialWorker(device=cfg.device_kind, gpu_index=gpu, threads=threads)
                  for _ in range(cfg.compile_jobs)] if cfg.compile_jobs > 1 else []
        self.workers.extend([worker, *gaters])
        try:
            if gaters:
                self._stream(worker, gaters, slot)
            else:
                self._serial(worker)
        except Exception as exc:  # noqa: BLE001 - a bug in the loop must not pass silently
            import traceback

            self.errors.append(f"worker {slot}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            self.stop.set()
        finally:
            for w in [worker, *gaters]:
                w.stop()

    def _serial(self, worker: TrialWorker) -> None:
        """One process gates and times each trial in turn (the CPU demo, --compile-jobs 1)."""
        while not self.stop.is_set() and self._budget_left():
            st = self._next_study()
            if st is None:
                break
            pending = self._next_task(st)
            if pending is None:
                continue
            gate = self._gate(pending, worker, warm=False)
            self._settle(st, pending, gate, worker)

    def _stream(self, worker: TrialWorker, gaters: list[TrialWorker], slot: int = 0) -> None:
        """Gate processes compile and check trials continuously, each asking for its next trial as soon as it
        is free; the measuring process times each gated trial as it arrives. A batch that waited for its
        slowest compile, then for the timing of all its trials (and, on the first trial, for FLA's
        autotuning: 138 s on the H200), left the compile processes idle half of the time. Gate processes
        touch the GPU only briefly (small checks, one warm-up launch per shape); timings are medians of at
        least 30 observations, and promotion re-measures the best with the GPU to itself."""
        done: queue.Queue = queue.Queue()
        ask_lock = self._ask_lock

        def feed(gater: TrialWorker) -> None:
            try:
                while not self.stop.is_set() and self._budget_left():
                    with ask_lock:
                        st = self._next_study()
                        pending = self._next_task(st) if st is not None else None
                        if pending is not None:
                            self._in_flight[id(st)] = self._in_flight.get(id(st), 0) + 1
                        waiting = st is None and any(self._in_flight.values())
                    if st is None and not waiting:
                        break
                    if pending is None:  # all targets met, or promised by trials in flight that may still fail
                        time.sleep(0.2 if waiting else 0.0)
                        continue
                    done.put((st, pending, self._gate(pending, gater, warm=self.config.device_kind == "cuda")))
            except Exception as exc:  # noqa: BLE001 - reported by the measuring loop
                done.put(exc)
            finally:
                done.put(None)

        if self.config.device_kind == "cuda":
            self._warm_machine(worker, slot, gaters)
        feeders = [threading.Thread(target=feed, args=(g,), daemon=True) for g in gaters]
        for th in feeders:
            th.start()
        finished, cut = 0, False
        while finished < len(feeders):
            try:
                item = done.get(timeout=1.0)
            except queue.Empty:
                if not cut and not self._budget_left():
                    # the budget is a bound: trials still compiling would only be re-enqueued, so stop them
                    # now (on the H200 they ran 165 s past a 380 s budget)
                    cut = True
                    for g in gaters:
                        g.kill()
                continue
            if item is None:
                finished += 1
                continue
            if isinstance(item, Exception):
                raise item
            try:
                self._settle(*item, worker)
            finally:
                with ask_lock:
                    self._in_flight[id(item[0])] -= 1

    def _warm_machine(self, worker: TrialWorker, slot: int = 0, gaters: list[TrialWorker] | None = None) -> None:
        """Before the gate processes start gating (CUDA): compile and autotune what every process of the campaign
        needs, once, into Triton's on-disk caches (kernels, and autotuning results: TRITON_CACHE_AUTOTUNING=1 in
        the workers). First the gate processes compile fla-core's autotuning configurations at the workload
        shapes, each its share (`_precompile_fla`); then the measuring process gates the built-in default
        (fla-core's forward at the gate shapes, our default pipeline: the first trial anyway) and runs FLA's
        forward and backward at the workload shapes (`_warm_baselines`), autotuning over the full lists with
        every binary already compiled. On two H200s, sixteen gate processes autotuning fla-core at once
        (session 5) made the first gates take ~150 s; one process doing it all (session 6) took ~7 minutes.
        Worker slots take turns, so the second finds everything cached. Outcomes are not recorded: the trials
        themselves are gated and timed as usual."""
        cfg = self.config
        with self._warm_lock:
            phases = self.warm_s.setdefault(slot, {})
            t0 = time.monotonic()
            if gaters:
                self._precompile_fla(gaters)
                phases["FLA precompile"] = time.monotonic() - t0
                t0 = time.monotonic()
            for op, policy in self._groups():
                if self.stop.is_set() or not self._budget_left():
                    return
                default = self.default_schedule(op, policy).to_dict()
                worker.request({"kind": "gate", **self.task(op, policy, default, seed=0)}, self._warm_timeout_s())
            t1 = time.monotonic()
            phases["default gate"] = t1 - t0
            self._warm_baselines(worker)
            phases["FLA baselines"] = time.monotonic() - t1
            self.warmed_at = time.monotonic()
            self._timed_at_warm = self.stats["timed"]

    def _precompile_fla(self, gaters: list[TrialWorker]) -> None:
        """The gate processes compile fla-core's autotuning configurations at the workload shapes, each its share,
        all at once (`warmup.precompile_fla_shares`)."""
        cfg = self.config
        groups = {(op, policy, cfg.K, cfg.V): shapes for (op, policy), shapes in self._groups().items()}
        warmup.precompile_fla_shares(groups, gaters, self._warm_timeout_s(),
                                     go_on=lambda: not self.stop.is_set() and self._budget_left())

    def _groups(self) -> dict[tuple[str, str], list[tuple[int, ...]]]:
        """(operator, policy) -> every workload shape of its buckets."""
        groups: dict[tuple[str, str], set[tuple[int, ...]]] = {}
        for st in self.states:
            groups.setdefault((st.op, st.policy), set()).update(tuple(x) for x in st.shapes)
        return {key: sorted(shapes) for key, shapes in groups.items()}

    def _warm_baselines(self, worker: TrialWorker) -> None:
        """FLA autotunes at its first call for each shape. In the measuring process that happened when the first
        gated trial arrived, with every core busy compiling: on two H200s (session 5) the first timing took
        148 s and a later one 37 s, and 36 of 38 gated schedules were still waiting at the end of the budget.
        A failure is left to the measurements to report."""
        cfg = self.config
        for (op, policy), shapes in self._groups().items():
            if self.stop.is_set() or not self._budget_left():
                return
            worker.request(warmup.fla_warm_request(op, policy, shapes, cfg.K, cfg.V), self._warm_timeout_s())

    def _warm_timeout_s(self) -> float:
        """A warm-up request compiles what a cold machine lacks (minutes of fla-core autotuning in one process):
        the trial timeout would kill it and throw its progress away, so it gets at least ten minutes. A hang is
        still cut off."""
        return max(self.config.trial_timeout_s, WARM_TIMEOUT_S)

    def _settle(self, st: StudyState, pending: dict[str, Any], gate, worker: TrialWorker) -> None:
        # Ctrl-C or budget spent: the trial is re-enqueued (a gate cut short at the budget's end has no
        # result; one that finished is simply run again by a resumed campaign).
        if self.stop.is_set() or not self._budget_left():
            self._abandon(st, pending["trial"])
        else:
            self._measure_and_tell(st, pending, gate, worker)

    def _record(self, st: StudyState, trial, schedule: dict, status: str, *, message=None, errors=None,
                samples=None, compile_s=None, bench_s=None) -> None:
        from rewy_tune.db import queries

        with self.db.session() as s:
            queries.add_trial(s, st.campaign_id, number=trial.number, schedule=schedule, status=status,
                              errors=errors, samples_ms=samples, compile_s=compile_s, bench_s=bench_s,
                              message=message)
        trial.set_user_attr("status", status)

    def _abandon(self, st: StudyState, trial) -> None:
        trial.set_user_attr("abandoned", True)
        st.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        st.study.enqueue_trial(dict(trial.params), user_attrs={"seed": f"re-run of {trial.number}"})

    def _reject(self, st: StudyState, trial, schedule: dict, reason: str) -> None:
        """A constraint violation: recorded, and told to the sampler as an infeasible trial (Optuna's trial
        constraints; the value counts the violated limits), so TPE learns where the feasible schedules are. A
        FAIL would be invisible to it: on the H200 29 of 30 asks of a two-worker campaign were rejections,
        the sampler never left the prior."""
        self._record(st, trial, schedule, "constraint", message=reason)
        self.stats["rejected"] += 1  # under _ask_lock (streaming) or in the only thread (serial)
        trial.set_constraint("limits", float(max(1, reason.count("; ") + 1)))
        st.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        self._done(st)

    def _ask(self, st: StudyState) -> dict[str, Any] | None:
        """Ask the study for a trial and build its task; a constraint violation is recorded and told
        here (never compiled) and gives None."""
        cfg = self.config
        trial = st.study.ask()
        trial.set_user_attr("host", HOST)
        trial.set_user_attr("pid", os.getpid())
        self._refresh(st)
        self._emit(st)
        try:
            schedule = search.suggest_schedule(trial, compute_capability=cfg.device.compute_capability,
                                               policy=st.policy, **self._space_kwargs(st.op))
            fault = trial.suggest_categorical("test_fault", search.FAULTS) if search.faults_enabled() else "none"
        except ValueError as exc:  # the space produced an invalid Schedule: a constraint violation
            self._reject(st, trial, dict(trial.params), str(exc))
            return None
        sched = schedule.to_dict()
        reason = search.constraint_violation(schedule, op=st.op, K=cfg.K, V=cfg.V, dtype=cfg.dtype,
                                             compute_capability=cfg.device.compute_capability)
        if reason is not None:  # rejected before compiling, recorded, never compiled
            self._reject(st, trial, sched, reason)
            return None
        task = self.task(st.op, st.policy, sched, seed=trial.number, fault=fault)
        return {"trial": trial, "schedule": sched, "task": task, "shapes": st.shapes}

    def _gate(self, pending: dict[str, Any], gater: TrialWorker, *, warm: bool):
        """Gate one trial in a gate process. warm: also run every workload shape once, so the measuring
        process finds the kernels compiled in Triton's on-disk cache."""
        msg = {"kind": "gate", **pending["task"]}
        if warm:
            msg["warm_shapes"] = [list(x) for x in pending["shapes"]]
        out = gater.request(msg, self.config.trial_timeout_s)
        with self._ask_lock:
            self.stats["gated"] += 1
        return out

    def _measure_and_tell(self, st: StudyState, pending: dict[str, Any], gate, worker: TrialWorker) -> None:
        from rewy_tune.db import queries

        cfg = self.config
        trial, sched, task = pending["trial"], pending["schedule"], pending["task"]
        if gate.status != "ok":
            self._record(st, trial, sched, gate.status, message=gate.message, errors=gate.errors,
                         compile_s=gate.data.get("compile_s"))
            st.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return self._done(st)
        samples: dict[str, list[float]] = {}
        baseline: dict[str, list[float]] = {}
        bench_s = 0.0
        running_sum = 0.0
        for step, shape in enumerate(st.shapes):
            m = worker.request({"kind": "measure", "shape": list(shape), **task}, cfg.trial_timeout_s)
            if self.stop.is_set():
                return self._abandon(st, trial)
            if m.status != "ok":
                self._record(st, trial, sched, m.status, message=f"{shape_label(shape)}: {m.message}",
                             errors=gate.errors, samples=samples, compile_s=gate.data.get("compile_s"))
                st.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                return self._done(st)
            samples[shape_label(shape)] = m.data["ours_ms"]
            if m.data.get("baseline_ms"):
                baseline[shape_label(shape)] = m.data["baseline_ms"]
            bench_s += m.data.get("bench_s", 0.0)
            running_sum += statistics.median(m.data["ours_ms"])
            if step < len(st.shapes) - 1:
                trial.report(running_sum, step)
                if trial.should_prune():
                    self._record(st, trial, sched, "ok", errors=gate.errors, samples=samples,
                                 compile_s=gate.data.get("compile_s"), bench_s=bench_s,
                                 message=f"pruned after {step + 1}/{len(st.shapes)} shapes: cannot beat the best")
                    st.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    return self._done(st)
        trial.report(running_sum, len(st.shapes) - 1)
        value = geomean([statistics.median(x) for x in samples.values()])
        if baseline:
            trial.set_user_attr("speedup", geomean([statistics.median(x) for x in baseline.values()]) / value)
            trial.set_user_attr("baseline", m.data.get("baseline"))
            with self.db.session() as s:
                for label, xs in baseline.items():
                    queries.add_baseline(s, st.campaign_id, shape=label, samples_ms=xs)
        self._record(st, trial, sched, "ok", errors=gate.errors, samples=samples,
                     compile_s=gate.data.get("compile_s"), bench_s=bench_s,
                     message="interpreter timings" if cfg.device.is_cpu else None)
        st.study.tell(trial, value)
        self.stats["timed"] += 1
        self._done(st)
        if cfg.share_trials:
            self._share(st, trial, pending, gate, worker)

    def _share(self, st: StudyState, trial, pending: dict[str, Any], gate, worker: TrialWorker) -> None:
        """Time a gated schedule on the other buckets of the same operator and policy and record it in each
        bucket's study as a trial of its own (same parameters, that bucket's shapes). The trial is created
        RUNNING with host and pid, so a campaign killed midway reconciles it like any other."""
        from rewy_tune.db import queries

        cfg = self.config
        for other in self.states:
            if other is st or (other.op, other.policy) != (st.op, st.policy):
                continue
            if other.target is not None and len(self._counted(other)) >= other.target:
                continue
            if self.stop.is_set() or not self._budget_left():
                return
            storage = other.study._storage
            tid = storage.create_new_trial(other.study._study_id)
            for name, dist in trial.distributions.items():
                storage.set_trial_param(tid, name, dist.to_internal_repr(trial.params[name]), dist)
            for key, val in (("host", HOST), ("pid", os.getpid()), ("seed", f"shared from {st.bucket.label} trial {trial.number}")):
                storage.set_trial_user_attr(tid, key, val)
            number = storage.get_trial_number_from_id(tid)
            samples: dict[str, list[float]] = {}
            baseline: dict[str, list[float]] = {}
            bench_s, failure = 0.0, None
            for shape in other.shapes:
                m = worker.request({"kind": "measure", "shape": list(shape), **pending["task"]}, cfg.trial_timeout_s)
                if self.stop.is_set():
                    storage.set_trial_user_attr(tid, "abandoned", True)
                    storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
                    return
                if m.status != "ok":
                    failure = (m.status, f"{shape_label(shape)}: {m.message}")
                    break
                samples[shape_label(shape)] = m.data["ours_ms"]
                if m.data.get("baseline_ms"):
                    baseline[shape_label(shape)] = m.data["baseline_ms"]
                bench_s += m.data.get("bench_s", 0.0)
            status, message = failure if failure else ("ok", "interpreter timings" if cfg.device.is_cpu else None)
            message = "; ".join(x for x in (message, f"shared from {st.bucket.label} trial {trial.number}") if x)
            with self.db.session() as s:
                queries.add_trial(s, other.campaign_id, number=number, schedule=pending["schedule"], status=status,
                                  errors=gate.errors, samples_ms=samples, compile_s=None, bench_s=bench_s,
                                  message=message)
                for label, xs in baseline.items():
                    queries.add_baseline(s, other.campaign_id, shape=label, samples_ms=xs)
            storage.set_trial_user_attr(tid, "status", status)
            if failure is None:
                value = geomean([statistics.median(x) for x in samples.values()])
                if baseline:
                    storage.set_trial_user_attr(tid, "speedup", geomean(
                        [statistics.median(x) for x in baseline.values()]) / value)
                storage.set_trial_state_values(tid, optuna.trial.TrialState.COMPLETE, [value])
            else:
                storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
            self._done(other)

    def _done(self, st: StudyState) -> None:
        self._refresh(st)
        self._emit(st)

    def _emit(self, st: StudyState) -> None:
        if self.on_event is not None:
            self.on_event(st)

    # -- finishing --------------------------------------------------------------------------------
    def promote(self) -> list:
        from rewy_tune import promotion

        worker = TrialWorker(device=self.config.device_kind)
        try:
            self.promotions = [promotion.promote(self, st, worker) for st in self.states]
        finally:
            worker.stop()
        return self.promotions

    def finish(self) -> None:
        from rewy_tune.db import queries

        status = "interrupted" if self.interrupted else "finished"
        with self.db.session() as s:
            for st in self.states:
                queries.finish_campaign(s, st.campaign_id, status)

    def eta_s(self) -> float | None:
        cfg = self.config
        elapsed = time.monotonic() - self.started
        done = sum(st.done for st in self.states)
        total = sum(st.target for st in self.states) if all(st.target for st in self.states) else None
        left = []
        if cfg.time_budget_s is not None:
            left.append(max(0.0, cfg.time_budget_s - elapsed))
        if total is not None and done > 0:
            left.append(elapsed / done * max(0, total - done))
        return min(left) if left else None
