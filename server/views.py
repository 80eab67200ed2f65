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
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from rewy_tune.db import queries as q
from rewy_tune.db.models import TRIAL_STATUSES, CampaignRow, TrialRow, WinnerRow
from rewy_tune.device import Environment, current_environment
from rewy_tune.problem import next_power_of_two
from rewy_tune.schedule import Schedule

ENV_FIELDS = ("driver", "cuda", "torch", "triton", "fla_core", "rewy_tune", "kernel_source_hash")
MIN_TRIALS_FOR_IMPORTANCE = 8


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


_SHAPE_RE = re.compile(r"B(\d+)-T(\d+)-H(\d+)")


def shape_numbers(label: str) -> tuple[int, int, int] | None:
    m = _SHAPE_RE.search(label)
    return tuple(int(x) for x in m.groups()) if m else None


def _shape_sort_key(label: str) -> tuple:
    nums = shape_numbers(label)
    return (0, nums[1], nums[0] * nums[2], label) if nums else (1, 0, 0, label)


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


def campaign_json(c: CampaignRow, counts: dict[tuple[int, str], int] | None = None) -> dict[str, Any]:
    out = {"id": c.id, "device": c.environment.device.short_name, "gpu_name": c.environment.device.gpu_name,
           "op": c.op, "policies": list(c.policies), "status": c.status, "started_at": _iso(c.started_at),
           "finished_at": _iso(c.finished_at), "budget": c.budget, "workload": c.workload,
           "fingerprint": c.environment.fingerprint, "study_name": c.study_name}
    if counts is not None:
        by_status = {s: n for (cid, s), n in counts.items() if cid == c.id}
        out["trials"] = sum(by_status.values())
        out["trials_by_status"] = by_status
    return out


def winner_json(w: WinnerRow, short_name: str) -> dict[str, Any]:
    return {"id": w.id, "device": short_name, "op": w.op, "policy": w.policy, "dtype": w.dtype, "K": w.K,
            "V": w.V, "t_bucket": w.t_bucket, "bh_bucket": w.bh_bucket,
            "bucket": f"{w.op}-{w.policy}-{w.dtype}-K{w.K}-V{w.V}-T{w.t_bucket}-BH{w.bh_bucket}",
            "schedule": w.schedule, "latency_ms": w.latency_ms, "fla_latency_ms": w.fla_latency_ms,
            "speedup": w.speedup, "campaign_id": w.campaign_id, "kernel_source_hash": w.kernel_source_hash,
            "compute_capability": w.compute_capability, "created_at": _iso(w.created_at),
            "freshness": freshness(w.environment)}


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
            "stale_fields": [], "trials": 0, "ok_trials": 0, "campaigns": 0, "last_campaign": None})

    for c in camps:
        for policy in c.policies:
            r = row(names[c.device_id], c.op, policy)
            r["campaigns"] += 1
            r["trials"] += sum(n for (cid, _), n in counts.items() if cid == c.id)
            r["ok_trials"] += counts.get((c.id, "ok"), 0)
            r["last_campaign"] = {"id": c.id, "status": c.status, "started_at": _iso(c.started_at)}
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
            "campaigns": [campaign_json(c, counts) for c in reversed(camps[-20:])],
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
    """The untuned default schedule of each campaign (the tuner's, for its op, device and K, V)."""
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
        try:
            sched = default_schedule(c.op, (device.cc_major, device.cc_minor), K, V).to_dict()
        except Exception:  # noqa: BLE001 - a default the tuner cannot build is simply not shown
            continue
        if sched not in out:
            out.append(sched)
    return out


def device_op(session: Session, device: str, op: str, shape: str | None = None,
              param: str | None = None) -> dict[str, Any]:
    ids = _device_ids(session, device)
    camps = [c for c in q.all_campaigns(session) if c.device_id in ids and c.op == op]
    camp_ids = [c.id for c in camps]
    points, flats = _points_and_flats(session, camps)
    fla: dict[str, float] = {}
    for b in q.baselines_of(session, camp_ids):
        fla[b.shape] = b.median_ms  # the newest campaign's measurement wins
    shapes = sorted(set(fla) | {s for p in points for s in p.medians_ms}, key=_shape_sort_key)
    if shape is not None and shape not in shapes:
        raise NotFound(f"no shape {shape!r} measured for {op} on {device} (measured: {', '.join(shapes) or 'none'})")
    chosen_shape = shape or (shapes[0] if shapes else None)

    status_counts = Counter(p.status for p in points)
    defaults = _default_schedules(camps)
    table = []
    best_ids = []
    for s in shapes:
        best, default = None, None
        for p in points:
            y = p.medians_ms.get(s)
            if p.status != "ok" or y is None:
                continue
            if best is None or y < best.medians_ms[s]:
                best = p
            if p.schedule in defaults:
                default = p
        table.append({"shape": s, "fla_ms": fla.get(s),
                      "default_ms": default.medians_ms[s] if default else None,
                      "best_ms": best.medians_ms[s] if best else None,
                      "best_trial": {"campaign_id": best.campaign_id, "number": best.number, "id": best.id}
                      if best else None,
                      "best_schedule": best.schedule if best else None})
        if best:
            best_ids.append(best.id)
    samples = q.trial_samples(session, best_ids)
    for r in table:
        r["spread"] = _spread(samples.get(r["best_trial"]["id"], {}).get(r["shape"], [])) if r["best_trial"] else None
        r["speedup"] = r["fla_ms"] / r["best_ms"] if r["fla_ms"] and r["best_ms"] else None
        r["default_speedup"] = r["fla_ms"] / r["default_ms"] if r["fla_ms"] and r["default_ms"] else None
        if r["best_trial"]:
            del r["best_trial"]["id"]

    ok = [(f, p.medians_ms[chosen_shape]) for f, p in zip(flats, points)
          if p.status == "ok" and chosen_shape and (p.medians_ms.get(chosen_shape) or 0) > 0]
    importance = _importance(ok)
    parameters = sorted({k for f in flats for k in f}, key=lambda k: (k not in SCHEDULE_PARAMETERS, k))
    if param is not None and param not in parameters and points:
        raise NotFound(f"no schedule parameter {param!r} in these trials")
    chosen_param = param or (importance[0]["parameter"] if importance else (parameters[0] if parameters else None))

    best_so_far, best = [], math.inf
    for i, p in enumerate(points):
        y = p.medians_ms.get(chosen_shape) if chosen_shape else None
        if p.status == "ok" and y is not None and 0 < y < best:
            best = y
            best_so_far.append({"index": i, "campaign_id": p.campaign_id, "number": p.number, "latency_ms": y})

    winners = [winner_json(w, device) for w in q.winners(session, device=device, op=op)]
    return {"device": device, "op": op, "shapes": shapes, "shape": chosen_shape, "parameters": parameters,
            "parameter": chosen_param, "table": table, "winners": winners,
            "campaigns": [campaign_json(c) for c in reversed(camps)], "trials": len(points),
            "status_counts": {s: status_counts[s] for s in TRIAL_STATUSES if status_counts[s]}
            | {s: n for s, n in status_counts.items() if s not in TRIAL_STATUSES},
            "importance": importance, "importance_trials": len(ok), "best_so_far": best_so_far,
            "_points": points, "_flats": flats}


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
    env = c.environment
    points = _points_and_flats(session, [c])[0]
    shapes = sorted({s for p in points for s in p.medians_ms}, key=_shape_sort_key)
    best: dict[str, float] = {}
    for p in points:
        if p.status == "ok":
            for s, y in p.medians_ms.items():
                best[s] = min(best.get(s, math.inf), y)
    baselines = {b.shape: b.median_ms for b in q.baselines(session, c.id)}
    end = c.finished_at or (max((p.created_at for p in points), default=c.started_at))
    return {
        "campaign": campaign_json(c, counts),
        "provenance": {"gpu_name": env.device.gpu_name, "device": env.device.short_name,
                       "compute_capability": f"{env.device.cc_major}.{env.device.cc_minor}",
                       "sm_count": env.device.sm_count, "memory_bytes": env.device.memory_bytes,
                       **{f: getattr(env, f) for f in ENV_FIELDS}, "fingerprint": env.fingerprint,
                       "freshness": freshness(env)},
        "duration_s": (end - c.started_at).total_seconds() if end and c.started_at else None,
        "shapes": [{"shape": s, "best_ms": best.get(s), "fla_ms": baselines.get(s),
                    "speedup": baselines[s] / best[s] if s in baselines and best.get(s) else None}
                   for s in sorted(set(shapes) | set(baselines), key=_shape_sort_key)],
        "_points": points, "_shape": shapes[0] if shapes else None,
    }


def public(data: dict[str, Any]) -> dict[str, Any]:
    """The API form of a page: without the private (underscore) plotting fields."""
    return {k: v for k, v in data.items() if not k.startswith("_")}
