"""What each dashboard page shows, as plain JSON-ready dicts: the HTML pages render them, the API returns them.

All database access goes through `rewy_tune.db.queries`; request values only ever reach bound parameters.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import threading
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.orm import Session

from rewy_tune.db import queries as q
from rewy_tune.db.models import TRIAL_STATUSES, CampaignRow, TrialRow, WinnerRow
from rewy_tune.device import Environment, current_environment
from rewy_tune.problem import next_power_of_two
from rewy_tune.schedule import Schedule

ENV_FIELDS = ("driver", "cuda", "torch", "triton", "fla_core", "rewy_tune", "kernel_source_hash")
MIN_TRIALS_FOR_IMPORTANCE = 8
# A campaign killed mid-run (SIGKILL, a job's time limit, a crash) stays "running" in the database: only the
# tuner marks it finished or interrupted. The dashboard never writes, so it says what the rows show: when
# the campaign's run last recorded anything, and, past this much silence, that it has most likely stopped.
# A healthy run records a trial at least every few minutes (each gate and each measurement has a 300 s
# timeout by default), so an hour without a row is far outside normal.
STALE_AFTER_S = 3600.0
RUN_WINDOW_S = 600.0  # campaigns of one tuner invocation are created within seconds of one another


class NotFound(LookupError):
    """An id or name the database does not hold (HTTP 404)."""


def flatten(schedule: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"consumer_cfg": {"num_warps": 4}} -> {"consumer_cfg.num_warps": 4} (stage dicts are one level deep)."""
    out: dict[str, Any] = {}
    for key, value in schedule.items():
        if type(value) is dict:
            for sub, v in value.items():
                if type(v) is dict:
                    out.update(flatten(v, f"{prefix}{key}.{sub}."))
                else:
                    out[f"{prefix}{key}.{sub}"] = v
        else:
            out[prefix + key] = value
    return out


DEFAULT_SCHEDULE = Schedule().to_dict()
SCHEDULE_PARAMETERS = tuple(flatten(DEFAULT_SCHEDULE))


def _iso(value: datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") if value is not None else None


def _utcnow() -> datetime:
    """Now, naive UTC like the database's times (tests replace it)."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def utc_text(value: datetime | str | None) -> str:
    """'2026-11-30 07:19:31 UTC' (the database stores naive UTC)."""
    if value is None:
        return "—"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.strftime("%Y-%m-%d %H:%M:%S UTC")


def ago_text(seconds: float) -> str:
    """A duration for people: '40 s', '12 min', '3 h 5 min', '2 d 4 h'."""
    s = max(0, int(round(seconds)))
    if s < 90:
        return f"{s} s"
    m = s // 60
    if m < 90:
        return f"{m} min"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"


def finite(value: Any) -> float | None:
    """A number fit to show or compare: None for None, NaN, ±inf and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


_SHAPE_RE = re.compile(r"B(\d+)-T(\d+)-H(\d+)")


def shape_numbers(label: str) -> tuple[int, int, int] | None:
    m = _SHAPE_RE.search(label)
    return tuple(int(x) for x in m.groups()) if m else None


def _shape_sort_key(label: str) -> tuple:
    nums = shape_numbers(label)
    return (0, nums[1], nums[0] * nums[2], label) if nums else (1, 0, 0, label)


def shape_label(shape: Any) -> str | None:
    """[B, T, H] -> 'B1-T2048-H4', the tuner's label; None for anything else."""
    if isinstance(shape, (list, tuple)) and len(shape) == 3 and all(type(x) is int for x in shape):
        return "B{}-T{}-H{}".format(*shape)
    return None


def workload_shapes(c: CampaignRow) -> list[str]:
    """The shape labels a campaign set out to measure (its workload), whether or not any trial timed them."""
    shapes = c.workload.get("shapes") if isinstance(c.workload, dict) else None
    out = []
    for shape in shapes if isinstance(shapes, list) else ():
        label = shape_label(shape)
        if label is not None and label not in out:
            out.append(label)
    return out


def bucket_of(c: CampaignRow) -> str | None:
    label = c.workload.get("bucket") if isinstance(c.workload, dict) else None
    return label if isinstance(label, str) else None


def _trial_target(c: CampaignRow) -> int | None:
    n = c.budget.get("trials") if isinstance(c.budget, dict) else None
    return n if type(n) is int and n > 0 else None


def budget_text(budget: Any) -> str:
    """{"trials": 8, "time_budget_s": null} -> '8 trials, no time limit'."""
    if not isinstance(budget, dict):
        return "—"
    parts = []
    n, t = budget.get("trials"), finite(budget.get("time_budget_s"))
    parts.append(f"{n} trials" if type(n) is int else "no trial limit")
    parts.append(f"time limit {ago_text(t)}" if t else "no time limit")
    return ", ".join(parts)


# -- freshness ---------------------------------------------------------------------------------------

def _now_environment() -> Environment:
    return current_environment()


def freshness(env_row) -> dict[str, Any]:
    """Whether a result was recorded under the software this server runs with.

    Driver and CUDA are compared only where this machine has them (a dashboard on a laptop still
    tells whether Triton, torch, fla-core or the kernel sources moved on)."""
    now = _now_environment().to_dict()
    then = {f: getattr(env_row, f) for f in ENV_FIELDS}
    changed = []
    for field in ENV_FIELDS:
        if field in ("driver", "cuda") and now[field] == "none":
            continue
        if then[field] != now[field]:
            changed.append({"field": field, "recorded": then[field], "current": now[field]})
    return {"fresh": not changed, "changed": changed, "fingerprint": env_row.fingerprint}


def current_software() -> dict[str, str]:
    return _now_environment().to_dict()


# -- serialisers -------------------------------------------------------------------------------------

def device_json(row) -> dict[str, Any]:
    return {"id": row.id, "short_name": row.short_name, "gpu_name": row.gpu_name,
            "compute_capability": f"{row.cc_major}.{row.cc_minor}", "sm_count": row.sm_count,
            "memory_bytes": row.memory_bytes}


def campaign_json(c: CampaignRow, counts: dict[tuple[int, str], int] | None = None,
                  activity: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    out = {"id": c.id, "device": c.environment.device.short_name, "gpu_name": c.environment.device.gpu_name,
           "op": c.op, "policies": list(c.policies), "status": c.status, "started_at": _iso(c.started_at),
           "finished_at": _iso(c.finished_at), "budget": c.budget, "workload": c.workload,
           "bucket": bucket_of(c), "shapes": workload_shapes(c),
           "fingerprint": c.environment.fingerprint, "study_name": c.study_name}
    if counts is not None:
        by_status = {s: n for s in TRIAL_STATUSES if (n := counts.get((c.id, s)))}
        by_status |= {s: n for (cid, s), n in counts.items() if cid == c.id and s not in TRIAL_STATUSES}
        out["trials"] = sum(by_status.values())
        out["trials_by_status"] = by_status
    if activity is not None and c.id in activity:
        out["activity"] = activity[c.id]
    return out


def activities(session: Session, camps: Sequence[CampaignRow], counts: dict[tuple[int, str], int],
               every: Sequence[CampaignRow] | None = None) -> dict[int, dict[str, Any]]:
    """Per campaign: finished or not, trials recorded of its budget, when it last recorded a trial and, for
    one still marked running, how long its run has been silent and whether that means it stopped.

    A run is the unfinished campaigns that one tuner invocation created (same environment and study
    storage, started within RUN_WINDOW_S): the tuner works through their buckets in turn, so a bucket
    still waiting for its first batch is alive as long as its siblings record trials."""
    every = q.all_campaigns(session) if every is None else every
    running = [c for c in every if c.status == "running"]
    times = q.campaign_activity(session, sorted({c.id for c in camps} | {c.id for c in running}))
    recorded: Counter = Counter()
    for (cid, _), n in counts.items():
        recorded[cid] += n

    def last_of(c: CampaignRow) -> datetime:
        return max(t for t in (c.started_at, *times.get(c.id, (None, None)), datetime.min) if t is not None)

    now = _utcnow()
    out: dict[int, dict[str, Any]] = {}
    for c in camps:
        last_trial = times.get(c.id, (None, None))[0]
        a: dict[str, Any] = {"finished": c.status != "running", "state": c.status, "last_trial_at": _iso(last_trial),
                             "last_activity_at": _iso(last_of(c)), "trials_recorded": recorded[c.id],
                             "trials_target": _trial_target(c), "idle_s": None, "stalled": False}
        if c.status == "running":
            run = [d for d in running if d.environment_id == c.environment_id and d.storage_url == c.storage_url
                   and d.started_at and c.started_at
                   and abs((d.started_at - c.started_at).total_seconds()) <= RUN_WINDOW_S] or [c]
            run_last = max(last_of(d) for d in run)
            idle = max(0.0, (now - run_last).total_seconds())  # a writer's clock ahead of ours: not idle
            a.update(idle_s=idle, stalled=idle > STALE_AFTER_S, run_campaigns=sorted(d.id for d in run),
                     run_last_activity_at=_iso(run_last), stale_after_s=STALE_AFTER_S)
            a["state"] = "stalled" if a["stalled"] else "running"
        a["label"], a["summary"] = _activity_text(c, a, last_trial, now)
        out[c.id] = a
    return out


def _activity_text(c: CampaignRow, a: dict[str, Any], last_trial: datetime | None, now: datetime) -> tuple[str, str]:
    n, target = a["trials_recorded"], a["trials_target"]
    progress = f"{n} of {target} trials recorded" if target else f"{n} trial{'' if n == 1 else 's'} recorded"
    if a["finished"]:
        if c.finished_at is None:
            return c.status, f"{c.status}; {progress}."
        took = f" after {ago_text((c.finished_at - c.started_at).total_seconds())}" if c.started_at else ""
        return c.status, f"{c.status} {utc_text(c.finished_at)}{took}; {progress}."
    if last_trial is not None:
        seen = f"last trial recorded {utc_text(last_trial)} ({ago_text((now - last_trial).total_seconds())} ago)"
    else:
        seen = (f"no trial recorded since it started {utc_text(c.started_at)} "
                f"({ago_text((now - c.started_at).total_seconds())} ago)" if c.started_at else "no trial recorded")
    parts = [f"not finished: {progress}", seen]
    if target and n >= target:
        parts.append("its trial budget is spent but it was never marked finished, so promotion (the step that "
                     "writes winners) has not completed")
    if a["stalled"]:
        parts.append(f"its run has recorded nothing for {ago_text(a['idle_s'])}, so the tuner most likely stopped "
                     "without finishing (killed, e.g. at a job's time limit, or crashed); the same rewy-tune "
                     "command with --resume continues it")
        return "stalled", "; ".join(parts) + "."
    parts.append("the tuner may still be running: a killed run looks the same until it has been silent for "
                 f"{ago_text(STALE_AFTER_S)}")
    return "not finished", "; ".join(parts) + "."


def winner_json(w: WinnerRow, short_name: str) -> dict[str, Any]:
    return {"id": w.id, "device": short_name, "op": w.op, "policy": w.policy, "dtype": w.dtype, "K": w.K,
            "V": w.V, "t_bucket": w.t_bucket, "bh_bucket": w.bh_bucket,
            "bucket": f"{w.op}-{w.policy}-{w.dtype}-K{w.K}-V{w.V}-T{w.t_bucket}-BH{w.bh_bucket}",
            "schedule": w.schedule, "latency_ms": w.latency_ms, "fla_latency_ms": w.fla_latency_ms,
            "speedup": w.speedup, "campaign_id": w.campaign_id, "kernel_source_hash": w.kernel_source_hash,
            "compute_capability": w.compute_capability, "created_at": _iso(w.created_at),
            "freshness": freshness(w.environment)}


def gate_summary(errors: Any) -> str:
    """A trial's gate checks in a few words: '27 passed, worst rel. RMS 4.9e-03' or '1 of 9 failed: tail/dq'."""
    checks = {k: v for k, v in errors.items() if isinstance(v, dict)} if isinstance(errors, dict) else {}
    if not checks:
        return "—"
    failed = [k for k, v in checks.items() if v.get("passed") is False]
    if failed:
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        return f"{len(failed)} of {len(checks)} failed: {', '.join(failed[:3])}{more}"
    worst = max((y for v in checks.values() if (y := finite(v.get("rel_rms"))) is not None), default=None)
    return f"{len(checks)} passed" + (f", worst rel. RMS {worst:.1e}" if worst is not None else "")


def trial_json(t: TrialRow) -> dict[str, Any]:
    return {"id": t.id, "campaign_id": t.campaign_id, "number": t.number, "status": t.status,
            "schedule": t.schedule, "medians_ms": t.medians_ms, "samples_ms": t.samples_ms, "errors": t.errors,
            "compile_s": t.compile_s, "bench_s": t.bench_s, "message": t.message, "created_at": _iso(t.created_at)}


# -- pages -------------------------------------------------------------------------------------------

def _short_names(session: Session) -> dict[int, str]:
    return {d.id: d.short_name for d in q.devices(session)}


def is_empty(session: Session) -> bool:
    return not q.devices(session)


def device_list(session: Session) -> list[dict[str, Any]]:
    camps = q.all_campaigns(session)
    winners = q.winners(session)
    out = []
    for d in q.devices(session):
        out.append(device_json(d) | {
            "campaigns": sum(1 for c in camps if c.device_id == d.id),
            "ops": sorted({c.op for c in camps if c.device_id == d.id} | {w.op for w in winners
                                                                          if w.device_id == d.id}),
            "winners": sum(1 for w in winners if w.device_id == d.id)})
    return out


def overview(session: Session) -> dict[str, Any]:
    camps = q.all_campaigns(session)
    counts = q.trial_counts(session)
    names = _short_names(session)
    winners = q.winners(session)
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}

    def row(device: str, op: str, policy: str) -> dict[str, Any]:
        return rows.setdefault((device, op, policy), {
            "device": device, "op": op, "policy": policy, "best_speedup": None, "winners": 0, "fresh": 0,
            "stale_fields": [], "trials": 0, "ok_trials": 0, "campaigns": 0, "unfinished": 0,
            "last_campaign": None})

    recent = camps[-20:]
    last: dict[tuple[str, str, str], CampaignRow] = {}
    for c in camps:
        for policy in c.policies:
            r = row(names[c.device_id], c.op, policy)
            r["campaigns"] += 1
            r["trials"] += sum(n for (cid, _), n in counts.items() if cid == c.id)
            r["ok_trials"] += counts.get((c.id, "ok"), 0)
            r["unfinished"] += c.status == "running"
            last[names[c.device_id], c.op, policy] = c
    act = activities(session, list({c.id: c for c in [*recent, *last.values()]}.values()), counts, every=camps)
    for key, c in last.items():
        a = act[c.id]
        rows[key]["last_campaign"] = {"id": c.id, "status": c.status, "started_at": _iso(c.started_at),
                                      "bucket": bucket_of(c), "state": a["state"], "label": a["label"],
                                      "last_trial_at": a["last_trial_at"], "summary": a["summary"]}
    for w in winners:
        r = row(names[w.device_id], w.op, w.policy)
        r["winners"] += 1
        r["best_speedup"] = max(r["best_speedup"] or 0.0, w.speedup)
        fr = freshness(w.environment)
        r["fresh"] += fr["fresh"]
        for ch in fr["changed"]:
            if ch["field"] not in r["stale_fields"]:
                r["stale_fields"].append(ch["field"])
    return {"rows": [rows[k] for k in sorted(rows)], "devices": device_list(session),
            "campaigns": [campaign_json(c, counts, act) for c in reversed(recent)],
            "current_software": current_software(), "empty": not names}


def _device_ids(session: Session, device: str) -> list[int]:
    rows = q.device_rows_named(session, device)
    if not rows:
        known = ", ".join(sorted({d.short_name for d in q.devices(session)})) or "none yet"
        raise NotFound(f"no device named {device!r} in the database (known: {known})")
    return [d.id for d in rows]


def _importance(ok: list[tuple[dict[str, Any], float]]) -> list[dict[str, Any]]:
    """Share of the variance of log latency that each parameter alone explains (adjusted eta squared).

    A one-way analysis per parameter over the timed ok trials: it ignores interactions and is confounded
    when the sampler correlates parameters, so it ranks rather than proves."""
    n = len(ok)
    if n < MIN_TRIALS_FOR_IMPORTANCE:
        return []
    logs = [math.log(y) for _, y in ok]
    mean = sum(logs) / n
    total = sum((v - mean) ** 2 for v in logs)
    if total <= 0:
        return []
    out = []
    keys = sorted({k for flat, _ in ok for k in flat})
    for key in keys:
        values = [flat.get(key) for flat, _ in ok]
        sums: dict[Any, list[float]] = {}
        for value, lv in zip(values, logs):
            if not isinstance(value, (int, float, str, bool, type(None))):
                value = repr(value)
            acc = sums.get(value)
            if acc is None:
                sums[value] = [lv, 1]
            else:
                acc[0] += lv
                acc[1] += 1
        k = len(sums)
        if k < 2 or n - k < 1:
            continue
        between = sum(c * (t / c - mean) ** 2 for t, c in sums.values())
        eta2 = between / total
        adjusted = max(0.0, 1 - (1 - eta2) * (n - 1) / (n - k))
        out.append({"parameter": key, "importance": adjusted, "eta_squared": eta2, "levels": k})
    out.sort(key=lambda r: (-r["importance"], r["parameter"]))
    return out


def _spread(samples: list[float]) -> dict[str, float] | None:
    if len(samples) < 2:
        return None
    qs = statistics.quantiles(samples, n=4)
    med = statistics.median(samples)
    return {"n": len(samples), "q1": qs[0], "q3": qs[2], "min": min(samples), "max": max(samples),
            "iqr_pct": 100 * (qs[2] - qs[0]) / med if med else None}


_POINTS_CACHE: OrderedDict[tuple, tuple[list, list]] = OrderedDict()
_POINTS_CACHE_SIZE = 8
_CACHE_LOCK = threading.Lock()


def _points_and_flats(session: Session, camps: list[CampaignRow]) -> tuple[list, list]:
    """Trial plot columns and flattened schedules of these campaigns.

    Campaigns that are no longer running do not change (a resumed one is running again), so their
    decoded trials are kept, keyed on the database URL, ids, statuses, end times and trial counts."""
    ids = [c.id for c in camps]
    if not ids or any(c.status == "running" for c in camps):
        points = q.trial_points(session, ids)
        return points, [flatten(p.schedule) for p in points]
    counts = Counter()
    for (cid, _), n in q.trial_counts(session, ids).items():
        counts[cid] += n
    key = (str(session.get_bind().url),) + tuple((c.id, c.status, c.finished_at, counts[c.id]) for c in camps)
    with _CACHE_LOCK:
        if key in _POINTS_CACHE:
            _POINTS_CACHE.move_to_end(key)
            return _POINTS_CACHE[key]
    points = q.trial_points(session, ids)
    value = (points, [flatten(p.schedule) for p in points])
    with _CACHE_LOCK:
        _POINTS_CACHE[key] = value
        while len(_POINTS_CACHE) > _POINTS_CACHE_SIZE:
            _POINTS_CACHE.popitem(last=False)
    return value


def _default_schedules(camps: list[CampaignRow]) -> list[dict[str, Any]]:
    """The untuned default schedules of each campaign (the tuner's, for its op, device, K, V and each policy)."""
    out = [DEFAULT_SCHEDULE]
    try:
        from rewy_tune.search import default_schedule
    except ImportError:
        return out
    for c in camps:
        K, V = c.workload.get("K"), c.workload.get("V")
        if not (isinstance(K, int) and isinstance(V, int)):
            continue
        device = c.environment.device
        for policy in c.policies:
            try:
                sched = default_schedule(c.op, (device.cc_major, device.cc_minor), K, V,
                                         c.workload.get("dtype"), policy).to_dict()
            except Exception:  # noqa: BLE001 - a default the tuner cannot build is simply not shown
                continue
            if sched not in out:
                out.append(sched)
    return out


def _timed_by_shape(points) -> dict[str, dict[int, float]]:
    """Per shape label, trial id -> median latency, for the trials with a finite positive time there
    (one pass: the device page's hot path runs over 10 000 trials)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    isfinite = math.isfinite
    for p in points:
        for label, y in p.medians_ms.items():
            if type(y) is float and isfinite(y) and y > 0 or type(y) is int and y > 0:
                out[label][p.id] = y
    return out


def _shape_members(camps: list[CampaignRow], points: list, timed: dict[str, dict[int, float]],
                   shape: str) -> list:
    """The trials meant to measure `shape`, in plot order: every trial of a campaign whose workload lists
    it (timed or not: a constraint trial of that bucket belongs there), and any trial with a time there."""
    planned = {c.id for c in camps if shape in workload_shapes(c)}
    ys = timed.get(shape, {})
    return [p for p in points if p.campaign_id in planned or p.id in ys]


def _first_varying(parameters: list[str], flats: list[dict[str, Any]]) -> str | None:
    """The first parameter that takes more than one value in these trials (a chart against a constant
    says nothing); the first parameter when none varies."""
    for key in parameters:
        seen = set()
        for f in flats:
            v = f.get(key)
            seen.add(v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
            if len(seen) > 1:
                return key
    return parameters[0] if parameters else None


def _status_counts(points) -> dict[str, int]:
    counts = Counter(p.status for p in points)
    return ({s: counts[s] for s in TRIAL_STATUSES if counts[s]}
            | {s: n for s, n in counts.items() if s not in TRIAL_STATUSES})


def device_op(session: Session, device: str, op: str, shape: str | None = None,
              param: str | None = None) -> dict[str, Any]:
    ids = _device_ids(session, device)
    every = q.all_campaigns(session)
    camps = [c for c in every if c.device_id in ids and c.op == op]
    camp_ids = [c.id for c in camps]
    points, flats = _points_and_flats(session, camps)
    fla: dict[str, float] = {}
    for b in q.baselines_of(session, camp_ids):
        if finite(b.median_ms):
            fla[b.shape] = b.median_ms  # the newest campaign's measurement wins
    timed = _timed_by_shape(points)
    shape_campaigns: dict[str, list[int]] = defaultdict(list)
    for c in camps:
        for label in workload_shapes(c):
            shape_campaigns[label].append(c.id)
    shapes = sorted(set(fla) | set(timed) | set(shape_campaigns), key=_shape_sort_key)
    if shape is not None and shape not in shapes:
        raise NotFound(f"no shape {shape!r} in the {op} campaigns on {device} "
                       f"(their shapes: {', '.join(shapes) or 'none'})")
    defaults = _default_schedules(camps)
    members = {s: _shape_members(camps, points, timed, s) for s in shapes}
    table = []
    best_ids = []
    for s in shapes:
        best, default = None, None
        ys = timed.get(s, {})
        mine = members[s]
        ok_timed = [p for p in mine if p.status == "ok" and p.id in ys]
        for p in ok_timed:
            if best is None or ys[p.id] < ys[best.id]:
                best = p
            if p.schedule in defaults:
                default = p
        table.append({"shape": s, "fla_ms": fla.get(s),
                      "default_ms": default.medians_ms[s] if default else None,
                      "best_ms": best.medians_ms[s] if best else None,
                      "best_trial": {"campaign_id": best.campaign_id, "number": best.number, "id": best.id}
                      if best else None,
                      "best_schedule": best.schedule if best else None,
                      "trials": len(mine), "timed_ok_trials": len(ok_timed),
                      "trials_by_status": _status_counts(mine),
                      "campaigns": sorted(set(shape_campaigns.get(s, [])) | {p.campaign_id for p in mine})})
        if best:
            best_ids.append(best.id)
    samples = q.trial_samples(session, best_ids)
    for r in table:
        r["spread"] = _spread(samples.get(r["best_trial"]["id"], {}).get(r["shape"], [])) if r["best_trial"] else None
        r["speedup"] = r["fla_ms"] / r["best_ms"] if r["fla_ms"] and r["best_ms"] else None
        r["default_speedup"] = r["fla_ms"] / r["default_ms"] if r["fla_ms"] and r["default_ms"] else None
        if r["best_trial"]:
            del r["best_trial"]["id"]

    # the charts' shape: the one asked for, else the first with a timed ok trial, else the first
    timed_shapes = [r["shape"] for r in table if r["timed_ok_trials"]]
    chosen_shape = shape or (timed_shapes[0] if timed_shapes else (shapes[0] if shapes else None))
    chart_ids = {p.id for p in members.get(chosen_shape, ())}
    chart_points = [(p, f) for p, f in zip(points, flats) if p.id in chart_ids]
    chart_ys = timed.get(chosen_shape, {}) if chosen_shape else {}
    ok = [(f, chart_ys[p.id]) for p, f in chart_points if p.status == "ok" and p.id in chart_ys]
    importance = _importance(ok)
    parameters = sorted({k for f in flats for k in f}, key=lambda k: (k not in SCHEDULE_PARAMETERS, k))
    if param is not None and param not in parameters and points:
        raise NotFound(f"no schedule parameter {param!r} in these trials")
    chosen_param = param or (importance[0]["parameter"] if importance else
                             _first_varying(parameters, [f for _, f in chart_points] or flats))

    best_so_far, best = [], math.inf
    for i, (p, _) in enumerate(chart_points):
        y = chart_ys.get(p.id)
        if p.status == "ok" and y is not None and y < best:
            best = y
            best_so_far.append({"index": i, "campaign_id": p.campaign_id, "number": p.number, "latency_ms": y})

    winners = [winner_json(w, device) for w in q.winners(session, device=device, op=op)]
    counts = q.trial_counts(session, camp_ids)
    act = activities(session, camps, counts, every=every)
    return {"device": device, "op": op, "shapes": shapes, "shape": chosen_shape, "parameters": parameters,
            "parameter": chosen_param, "table": table, "winners": winners,
            "campaigns": [campaign_json(c, counts, act) for c in reversed(camps)], "trials": len(points),
            "unfinished_campaigns": sum(c.status == "running" for c in camps),
            "status_counts": _status_counts(points),
            "shape_trials": len(chart_points), "shape_status_counts": _status_counts([p for p, _ in chart_points]),
            "importance": importance, "importance_trials": len(ok), "best_so_far": best_so_far,
            "_points": [p for p, _ in chart_points], "_flats": [f for _, f in chart_points],
            "_timed": chart_ys}


def _schedule_key(schedule: dict[str, Any]) -> str:
    return json.dumps(schedule, sort_keys=True)


def _bucket_cost(by_schedule: dict[str, list], schedule: dict[str, Any], w: WinnerRow) -> float | None:
    """Median latency of the ok trials of `schedule` over the shapes that fall in w's bucket."""
    values = []
    for p in by_schedule.get(_schedule_key(schedule), ()):
        for label, y in p.medians_ms.items():
            nums = shape_numbers(label)
            if nums and next_power_of_two(nums[1]) == w.t_bucket and next_power_of_two(nums[0] * nums[2]) == w.bh_bucket:
                values.append(y)
    return statistics.median(values) if values else None


def compare(session: Session, op: str, devices: list[str]) -> dict[str, Any]:
    for d in devices:
        _device_ids(session, d)
    camps = q.all_campaigns(session)
    per_device: dict[str, dict[tuple, WinnerRow]] = {}
    points: dict[str, list] = {}
    for d in devices:
        chosen: dict[tuple, WinnerRow] = {}
        for w in q.winners(session, device=d, op=op):  # newest environment's winner per bucket
            key = (w.policy, w.dtype, w.K, w.V, w.t_bucket, w.bh_bucket)
            if key not in chosen or (w.created_at, w.id) > (chosen[key].created_at, chosen[key].id):
                chosen[key] = w
        per_device[d] = chosen
        ids = {c.id for c in camps if c.environment.device.short_name == d and c.op == op}
        by_schedule: dict[str, list] = defaultdict(list)
        for p in q.trial_points(session, sorted(ids)):
            if p.status == "ok":
                by_schedule[_schedule_key(p.schedule)].append(p)
        points[d] = by_schedule
    buckets = []
    for key in sorted({k for m in per_device.values() for k in m}):
        policy, dtype, K, V, t_b, bh_b = key
        entries = {d: per_device[d].get(key) for d in devices}
        flats = {d: flatten(w.schedule) for d, w in entries.items() if w is not None}
        fields = sorted({f for fl in flats.values() for f in fl},
                        key=lambda k: (k not in SCHEDULE_PARAMETERS, SCHEDULE_PARAMETERS.index(k)
                                       if k in SCHEDULE_PARAMETERS else 0, k))
        differing = [f for f in fields if len({json.dumps(fl.get(f)) for fl in flats.values()}) > 1]
        cross = []
        for a, wa in entries.items():
            if wa is None:
                continue
            for b, wb in entries.items():
                if b == a:
                    continue
                cost = _bucket_cost(points[b], wa.schedule, wb or wa)
                cross.append({"schedule_of": a, "measured_on": b, "latency_ms": cost,
                              "own_winner_ms": wb.latency_ms if wb else None,
                              "slowdown": cost / wb.latency_ms if cost and wb else None})
        buckets.append({
            "bucket": f"{op}-{policy}-{dtype}-K{K}-V{V}-T{t_b}-BH{bh_b}", "policy": policy, "dtype": dtype,
            "K": K, "V": V, "t_bucket": t_b, "bh_bucket": bh_b,
            "winners": {d: winner_json(w, d) if w is not None else None for d, w in entries.items()},
            "fields": [{"name": f, "values": {d: flats[d].get(f) if d in flats else None for d in devices},
                        "differs": f in differing} for f in fields],
            "differing": differing, "cross_device": cross})
    return {"op": op, "devices": devices, "buckets": buckets}


def campaign_detail(session: Session, campaign_id: int) -> dict[str, Any]:
    c = q.get_campaign(session, campaign_id)
    if c is None:
        raise NotFound(f"no campaign with id {campaign_id}")
    counts = q.trial_counts(session, [c.id])
    act = activities(session, [c], counts)
    env = c.environment
    points = _points_and_flats(session, [c])[0]
    timed = _timed_by_shape(points)
    ok = {p.id: p.number for p in points if p.status == "ok"}
    best: dict[str, tuple[float, int]] = {}
    timed_ok: Counter = Counter()
    for s, ys in timed.items():
        for tid, y in ys.items():
            if tid in ok:
                timed_ok[s] += 1
                if s not in best or y < best[s][0]:
                    best[s] = (y, ok[tid])
    baselines = {b.shape: b.median_ms for b in q.baselines(session, c.id) if finite(b.median_ms)}
    planned = workload_shapes(c)
    shapes = sorted(set(planned) | {s for p in points for s in p.medians_ms} | set(baselines), key=_shape_sort_key)
    chart_shape = next((s for s in shapes if timed.get(s)), None)
    return {
        "campaign": campaign_json(c, counts, act),
        "activity": act[c.id],
        "provenance": {"gpu_name": env.device.gpu_name, "device": env.device.short_name,
                       "compute_capability": f"{env.device.cc_major}.{env.device.cc_minor}",
                       "sm_count": env.device.sm_count, "memory_bytes": env.device.memory_bytes,
                       **{f: getattr(env, f) for f in ENV_FIELDS}, "fingerprint": env.fingerprint,
                       "freshness": freshness(env)},
        # only a finished campaign has a duration; an unfinished one has `activity` (when it last recorded)
        "duration_s": (c.finished_at - c.started_at).total_seconds() if c.finished_at and c.started_at else None,
        "shapes": [{"shape": s, "planned": s in planned, "best_ms": best[s][0] if s in best else None,
                    "best_trial": best[s][1] if s in best else None, "timed_ok_trials": timed_ok[s],
                    "fla_ms": baselines.get(s),
                    "speedup": baselines[s] / best[s][0] if s in baselines and s in best else None}
                   for s in shapes],
        "_points": points, "_shape": chart_shape, "_timed": timed.get(chart_shape, {}),
    }


def trials_page(session: Session, campaign_id: int, *, status: str | None = None, offset: int = 0,
                limit: int = 50) -> dict[str, Any]:
    """One page of a campaign's trials in Optuna order, as the API's trial JSON."""
    page = q.campaign_trials(session, campaign_id, status=status, offset=offset, limit=limit)
    return {"items": [trial_json(t) for t in page.items], "total": page.total, "limit": page.limit,
            "offset": page.offset}


def public(data: dict[str, Any]) -> dict[str, Any]:
    """The API form of a page: without the private (underscore) plotting fields."""
    return {k: v for k, v in data.items() if not k.startswith("_")}
