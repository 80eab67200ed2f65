"""Runtime dispatch: which Schedule a call runs, and why (`lookup`).

Fallback chain (architecture.md, Dispatcher), over the winners of the problem's family (same op, policy,
dtype, K, V):

1. ``exact``    the winner of this bucket under this device's environment fingerprint;
2. ``nearest``  the winner of the nearest bucket under this fingerprint (log distance in T and B·H);
3. ``same-cc``  a winner of another fingerprint with the same compute capability and kernel-source hash
                (same GPU model preferred, then nearest bucket, then newest);
4. ``default``  the built-in schedule for this compute capability (`search_spaces.default_schedule`);
5. ``generic``  the generic built-in schedule.

Winners whose kernel-source hash or compute capability differ from the running code are never used; the
reason says how many were skipped. `measured_speedup` gives FLA / ours as the chosen winner's promotion
measured it (None for built-in schedules): `enable()` leaves a call to FLA when it is below 1. Results are
cached per process per (bucket, fingerprint): after the first call a lookup is one dictionary hit; a lock is
taken only on a miss. The database (``REWY_DB`` or the default data directory) is opened read-only, never
created; a missing or corrupt database gives the built-in defaults with one warning, never an exception.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import threading
import warnings
from collections import Counter
from typing import Any

from rewy_tune.device import Device, Environment, current_device, current_environment
from rewy_tune.problem import Bucket, Problem, log_distance
from rewy_tune.schedule import Schedule

__all__ = ["DispatchWarning", "cache_size", "choose_schedule", "clear_cache", "lookup", "measured_speedup",
           "print_report", "record_fallback", "record_routed", "report", "reset_report", "schedule_hash"]


class DispatchWarning(UserWarning):
    """The winners database could not be read: the dispatcher uses built-in schedules."""


_cache: dict[tuple, tuple[Schedule, str]] = {}
_speedups: dict[tuple, float | None] = {}  # same keys: the chosen winner's measured FLA / ours
_lock = threading.Lock()
_fingerprints: dict[tuple[Device, Environment], str] = {}
_default_fp: list[str] = []  # [fingerprint of current_device() under current_environment()], set on first use
_handles: dict[str, Any] = {}  # db url -> open read-only Database
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class _Winner:
    bucket: Bucket
    schedule: dict
    fingerprint: str
    kernel_source_hash: str
    compute_capability: str
    gpu_name: str
    id: int
    speedup: float | None = None


def clear_cache() -> None:
    """Forget cached lookups, fingerprints and open database handles (the next lookup re-reads `REWY_DB`)."""
    with _lock:
        _cache.clear()
        _speedups.clear()
        _fingerprints.clear()
        _default_fp.clear()
        for db in _handles.values():
            try:
                db.close()
            except Exception:
                pass
        _handles.clear()
        _warned.clear()


def cache_size() -> int:
    return len(_cache)


def _fingerprint(device: Device | None, environment: Environment | None) -> tuple[str, Device, Environment]:
    device = current_device() if device is None else device
    environment = current_environment() if environment is None else environment
    key = (device, environment)
    fp = _fingerprints.get(key)
    if fp is None:
        fp = _fingerprints[key] = environment.fingerprint(device)
    return fp, device, environment


def lookup(problem: Problem, device: Device | None = None, *, environment: Environment | None = None,
           db_url: str | None = None) -> tuple[Schedule, str]:
    """(Schedule, reason) for `problem` on `device` (default: the current GPU, or the CPU interpreter).

    `environment` (default: the running software) and `db_url` (default: `REWY_DB` or the data directory)
    exist for tests and tools. The reason starts with exact, nearest, same-cc, default or generic."""
    if not isinstance(problem, Problem):  # (two isinstance checks: ~0.1 µs of the ~1 µs cached lookup)
        raise TypeError(f"problem: expected a rewy_tune.Problem, got {type(problem).__name__}")
    if device is not None and not isinstance(device, Device):
        raise TypeError(f"device: expected a rewy_tune.device.Device or None (the current GPU), got "
                        f"{type(device).__name__}")
    key = _key(problem, device, environment, db_url)
    hit = _cache.get(key)
    return hit if hit is not None else _fill(key, problem, device, environment, db_url)


def measured_speedup(problem: Problem, device: Device | None = None, *, environment: Environment | None = None,
                     db_url: str | None = None) -> float | None:
    """FLA / ours of the winner `lookup` chooses for `problem`, as its promotion measured it (on this device
    for exact and nearest, on another machine of the same compute capability for same-cc); None for the
    built-in schedules, which carry no measurement."""
    key = _key(problem, device, environment, db_url)
    if key not in _cache:
        _fill(key, problem, device, environment, db_url)
    return _speedups[key]


def _fill(key: tuple, problem: Problem, device: Device | None, environment: Environment | None,
          db_url: str | None) -> tuple[Schedule, str]:
    """The miss path of `lookup`: resolve once under the lock; the speedup is stored beside the entry."""
    from rewy_tune.validation import MAX_HEAD_DIM_TRITON

    if max(problem.K, problem.V) > MAX_HEAD_DIM_TRITON:  # a Problem may describe it; no schedule runs it
        raise ValueError(f"problem: K={problem.K}, V={problem.V}: schedules exist for K, V <= {MAX_HEAD_DIM_TRITON} "
                         "(the Triton backward's limit; larger heads run on backend='torch')")
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            _, dev, env = _fingerprint(device, environment)
            schedule, reason, _speedups[key] = _resolve(problem.bucket(), dev, env, key[-2], db_url)
            hit = _cache[key] = (schedule, reason)
        return hit


def _key(problem: Problem, device: Device | None, environment: Environment | None, db_url: str | None) -> tuple:
    if device is None and environment is None:
        fp = _default_fp[0] if _default_fp else _init_default_fp()
    else:
        fp = _fingerprint(device, environment)[0]
    T, BH = problem.T, problem.B * problem.H
    return (problem.op, problem.policy, problem.dtype, problem.K, problem.V,
            1 << (T - 1).bit_length() if T > 1 else 1, 1 << (BH - 1).bit_length() if BH > 1 else 1, fp, db_url)


def choose_schedule(problem: Problem, schedule: Schedule | None = None, device: Device | None = None
                    ) -> tuple[Schedule, str]:
    """An explicit `schedule` wins (reason "explicit"); otherwise `lookup(problem, device)`."""
    if schedule is not None:
        return schedule, "explicit"
    return lookup(problem, device)


def _init_default_fp() -> str:
    with _lock:
        if not _default_fp:
            _default_fp.append(_fingerprint(None, None)[0])
        return _default_fp[0]


# -- the miss path (under the lock) -----------------------------------------------------------------

def _warn_once(url: str, message: str) -> None:
    if url in _warned:
        return
    _warned.add(url)
    warnings.warn(f"rewy-tune dispatch: {message}; using built-in schedules", DispatchWarning, stacklevel=4)


def _load_family(bucket: Bucket, db_url: str | None) -> tuple[list[_Winner], str | None]:
    """Winners of the bucket's family (op, policy, dtype, K, V); (winners, note on why none could be read)."""
    from rewy_tune.db import DatabaseError, default_db_url, open_db
    from rewy_tune.db.engine import as_db_url
    from rewy_tune.db.queries import all_winners_for_ops, bucket_of

    try:
        url = as_db_url(db_url) if db_url is not None else default_db_url()
    except Exception as exc:  # a malformed REWY_DB
        _warn_once(str(db_url), f"bad database location: {exc}")
        return [], "database unavailable"
    try:
        db = _handles.get(url)
        if db is None:
            db = _handles[url] = open_db(url, read_only=True)
        family = (bucket.op, bucket.policy, bucket.dtype, bucket.K, bucket.V)
        out = []
        with db.session() as s:
            for row in all_winners_for_ops(s, [bucket.op]):
                if (row.op, row.policy, row.dtype, row.K, row.V) != family:
                    continue
                env = row.environment
                out.append(_Winner(bucket_of(row), dict(row.schedule), env.fingerprint, row.kernel_source_hash,
                                   row.compute_capability, env.device.gpu_name, row.id, row.speedup))
        return out, None
    except DatabaseError as exc:
        _drop_handle(url)
        _warn_once(url, str(exc))
        return [], "no database" if "no rewy-tune database" in str(exc) else "database unreadable"
    except Exception as exc:  # corrupt pages found late, a file removed under us, ...
        _drop_handle(url)
        _warn_once(url, f"cannot read the winners database at {url}: {str(exc).splitlines()[0] if str(exc) else exc!r}")
        return [], "database unreadable"


def _drop_handle(url: str) -> None:
    db = _handles.pop(url, None)
    if db is not None:
        try:
            db.close()
        except Exception:
            pass


def _cc_str(cc: tuple[int, int]) -> str:
    return "{}.{}".format(*cc)


def _schedule_of(w: _Winner) -> Schedule | None:
    try:
        s = Schedule.from_dict(w.schedule)
        s.validate_for(w.bucket.K, w.bucket.V)
        return s
    except (ValueError, TypeError):
        return None


def _resolve(bucket: Bucket, device: Device, environment: Environment, fp: str, db_url: str | None
             ) -> tuple[Schedule, str, float | None]:
    from rewy_tune.search_spaces import default_schedule

    winners, db_note = _load_family(bucket, db_url)
    cc = _cc_str(device.compute_capability)
    khash = environment.kernel_source_hash
    stale = [w for w in winners if w.kernel_source_hash != khash]
    other_cc = [w for w in winners if w.kernel_source_hash == khash and w.compute_capability != cc]
    usable, invalid = [], 0
    for w in winners:
        if w.kernel_source_hash == khash and w.compute_capability == cc:
            s = _schedule_of(w)
            if s is None:
                invalid += 1
            else:
                usable.append((w, s))

    notes = []
    if stale:
        notes.append(f"skipped {len(stale)} winner(s) with a stale kernel source hash "
                     f"({', '.join(sorted({w.kernel_source_hash for w in stale}))} != running {khash})")
    if other_cc:
        notes.append(f"skipped {len(other_cc)} winner(s) of compute capability "
                     f"{', '.join(sorted({w.compute_capability for w in other_cc}))} (running {cc})")
    if invalid:
        notes.append(f"skipped {invalid} winner(s) whose schedule this code cannot read")
    if db_note:
        notes.append(db_note)
    suffix = "".join(f"; {n}" for n in notes)

    mine = [(w, s) for w, s in usable if w.fingerprint == fp]
    for w, s in mine:
        if w.bucket == bucket:
            return s, f"exact: winner #{w.id} for {bucket.label} on this device{suffix}", w.speedup
    if mine:
        w, s = min(mine, key=lambda ws: (log_distance(ws[0].bucket, bucket), -ws[0].id))
        return s, (f"nearest: winner #{w.id} of {w.bucket.label} on this device "
                   f"(log distance {log_distance(w.bucket, bucket):g}){suffix}"), w.speedup
    others = [(w, s) for w, s in usable if w.fingerprint != fp]
    if others:
        w, s = min(others, key=lambda ws: (ws[0].gpu_name != device.gpu_name,
                                            log_distance(ws[0].bucket, bucket), -ws[0].id))
        d = log_distance(w.bucket, bucket)
        return s, (f"same-cc: winner #{w.id} of {w.bucket.label} from {w.gpu_name} (fingerprint {w.fingerprint}, "
                   f"compute capability {cc}, log distance {d:g}){suffix}"), w.speedup
    generic = default_schedule(None, K=bucket.K, V=bucket.V, op=bucket.op, dtype=bucket.dtype, policy=bucket.policy)
    if not device.is_cpu and device.compute_capability != (0, 0):
        specific = default_schedule(device.compute_capability, K=bucket.K, V=bucket.V, op=bucket.op,
                                    dtype=bucket.dtype, policy=bucket.policy)
        if specific != generic:
            return specific, f"default: built-in schedule for compute capability {cc}{suffix}", None
    return generic, f"generic: built-in generic schedule (no tuned winner for {bucket.label}){suffix}", None


def problem_for_call(op: str, q, v, policy: str, initial_state=None) -> Problem | None:
    """The Problem of an FLA-layout call, or None when it cannot be described (e.g. float64)."""
    try:
        return Problem.from_tensors(op, q, v, policy, initial_state=initial_state)
    except ValueError:
        return None


# -- the dispatch report: what enable() routed to ReWY and what went to FLA unchanged -------------------

_report_lock = threading.Lock()
_routed: Counter = Counter()  # (op, bucket label, schedule hash, reason) -> calls
_fallbacks: Counter = Counter()  # (op, reason) -> calls
_hashes: dict[Schedule, str] = {}


def schedule_hash(schedule: Schedule) -> str:
    """Short (8 hex digit) hash of a schedule's JSON, as shown in the report."""
    h = _hashes.get(schedule)
    if h is None:
        h = _hashes[schedule] = hashlib.sha256(schedule.to_json().encode()).hexdigest()[:8]
    return h


def record_routed(op: str, bucket_label: str, schedule: Schedule, reason: str) -> None:
    key = (op, bucket_label, schedule_hash(schedule), reason)
    with _report_lock:
        _routed[key] += 1


def record_fallback(op: str, reason: str) -> None:
    with _report_lock:
        _fallbacks[(op, reason)] += 1


def reset_report() -> None:
    with _report_lock:
        _routed.clear()
        _fallbacks.clear()


def report() -> dict:
    """{"routed": [{op, bucket, calls, schedule, reason}], "fallbacks": [{op, reason, calls}],
    "routed_calls": n, "fallback_calls": n}, rows sorted by operator then bucket / reason."""
    with _report_lock:
        routed = [dict(op=op, bucket=b, calls=n, schedule=h, reason=r) for (op, b, h, r), n in _routed.items()]
        fallbacks = [dict(op=op, reason=r, calls=n) for (op, r), n in _fallbacks.items()]
    routed.sort(key=lambda d: (d["op"], d["bucket"], d["schedule"], d["reason"]))
    fallbacks.sort(key=lambda d: (d["op"], -d["calls"], d["reason"]))
    return dict(routed=routed, fallbacks=fallbacks, routed_calls=sum(d["calls"] for d in routed),
                fallback_calls=sum(d["calls"] for d in fallbacks))


def print_report(file=None) -> None:
    """Print `report()` as rich tables (to stderr by default)."""
    from rich.console import Console
    from rich.table import Table

    data = report()
    console = Console(file=file if file is not None else sys.stderr, soft_wrap=False, width=160)
    console.print(f"[bold]rewy-tune dispatch report[/bold]: {data['routed_calls']} call(s) routed to ReWY, "
                  f"{data['fallback_calls']} to FLA")
    if data["routed"]:
        table = Table(title="routed to ReWY")
        for col in ("operator", "bucket", "calls", "schedule", "reason"):
            table.add_column(col, justify="right" if col == "calls" else "left", overflow="fold")
        for d in data["routed"]:
            table.add_row(d["op"], d["bucket"], str(d["calls"]), d["schedule"], d["reason"])
        console.print(table)
    if data["fallbacks"]:
        table = Table(title="fell back to FLA")
        for col in ("operator", "calls", "reason"):
            table.add_column(col, justify="right" if col == "calls" else "left", overflow="fold")
        for d in data["fallbacks"]:
            table.add_row(d["op"], str(d["calls"]), d["reason"])
        console.print(table)
