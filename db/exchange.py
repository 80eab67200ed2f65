"""Winners as JSON with provenance, for `rewy-tune export FILE` and `rewy-tune import FILE`.

Each winner carries its device, its software environment (with the fingerprint, re-checked on
import) and a summary of the campaign that produced it. Import validates the whole document
before writing anything and names the offending field when it rejects one.
"""

from __future__ import annotations

import importlib.metadata
import math
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from rewy_tune.device import Device, Environment
from rewy_tune.problem import Bucket
from rewy_tune.schedule import Schedule
from rewy_tune.validation import MAX_HEAD_DIM_TRITON

from .models import CampaignRow, WinnerRow, utcnow
from .queries import WinnerExistsError, _put_winner, device_of, environment_of, record_environment, winners

FORMAT = "rewy-tune-winners"
FORMAT_VERSION = 1
_BUCKET_FIELDS = ("op", "policy", "dtype", "K", "V", "t_bucket", "bh_bucket")
_CAMPAIGN_FIELDS = ("id", "op", "policies", "workload", "budget", "started_at", "finished_at", "status", "study_name")


class ImportFormatError(ValueError):
    """The file is not a valid winners export; the message names the field."""


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def export_winners(session: Session, *, device: str | None = None, op: str | None = None) -> dict[str, Any]:
    rows = winners(session, device=device, op=op)
    campaigns = {c.id: c for c in session.scalars(
        select(CampaignRow).where(CampaignRow.id.in_({w.campaign_id for w in rows if w.campaign_id})))}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "exported_at": utcnow().isoformat(),
        "exported_by": _rewy_tune_version(),
        "winners": [_winner_entry(w, campaigns.get(w.campaign_id)) for w in rows],
    }


def _rewy_tune_version() -> str:
    try:
        return importlib.metadata.version("rewy-tune")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _winner_entry(w: WinnerRow, campaign: CampaignRow | None) -> dict[str, Any]:
    env = w.environment
    summary = None
    if campaign is not None:
        summary = {name: getattr(campaign, name) for name in _CAMPAIGN_FIELDS}
        summary.update(started_at=_iso(campaign.started_at), finished_at=_iso(campaign.finished_at))
    return {
        **{name: getattr(w, name) for name in _BUCKET_FIELDS},
        "schedule": w.schedule,
        "latency_ms": w.latency_ms,
        "fla_latency_ms": w.fla_latency_ms,
        "speedup": w.speedup,
        "created_at": _iso(w.created_at),
        "device": device_of(env.device).to_dict(),
        "environment": {**environment_of(env).to_dict(), "fingerprint": env.fingerprint},
        "campaign": summary,
    }


def import_winners(session: Session, data: Any, *, replace: bool = False) -> int:
    """Add the winners of an export; an existing winner for the same key is kept unless `replace`.
    Returns how many winners were written."""
    parsed = _parse_document(data)
    written = 0
    imported_campaigns: dict[tuple[str, Any], int] = {}
    for device, environment, bucket, entry in parsed:
        env_row = record_environment(session, device, environment)
        campaign_id = None
        if (summary := entry["campaign"]) is not None:
            source = (env_row.fingerprint, summary.get("id"))
            if source not in imported_campaigns:
                imported_campaigns[source] = _imported_campaign(session, env_row, summary)
            campaign_id = imported_campaigns[source]
        winner = WinnerRow(
            environment_id=env_row.id, device_id=env_row.device_id,
            **{name: getattr(bucket, name) for name in _BUCKET_FIELDS},
            schedule=entry["schedule"], latency_ms=float(entry["latency_ms"]),
            fla_latency_ms=float(entry["fla_latency_ms"]),
            speedup=float(entry["fla_latency_ms"]) / float(entry["latency_ms"]), campaign_id=campaign_id,
            kernel_source_hash=environment.kernel_source_hash,
            compute_capability="{}.{}".format(*device.compute_capability),
            created_at=entry["created_at"] or utcnow())
        try:
            _put_winner(session, winner, replace=replace)
            written += 1
        except WinnerExistsError:
            continue
    return written


def _imported_campaign(session: Session, env_row, summary: dict[str, Any]) -> int:
    campaign = CampaignRow(
        device_id=env_row.device_id, environment_id=env_row.id, op=summary["op"], policies=summary["policies"],
        workload=summary["workload"], budget=summary["budget"], status="imported",
        started_at=summary["started_at"] or utcnow(), finished_at=summary["finished_at"],
        study_name=summary.get("study_name"))
    session.add(campaign)
    session.flush()
    return campaign.id


# -- validation ---------------------------------------------------------------------------------

def _fail(path: str, problem: str) -> ImportFormatError:
    return ImportFormatError(f"invalid winners file: {path}: {problem}")


def _get(obj: dict, key: str, kinds: type | tuple[type, ...], path: str, *, optional: bool = False):
    if key not in obj:
        if optional:
            return None
        raise _fail(f"{path}.{key}", "missing")
    value = obj[key]
    if value is None and optional:
        return None
    names = kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise _fail(f"{path}.{key}", f"expected {names}, got {value!r}")
    if not isinstance(value, kinds):
        raise _fail(f"{path}.{key}", f"expected {names}, got {type(value).__name__}")
    return value


def _get_time(obj: dict, key: str, path: str) -> datetime | None:
    text = _get(obj, key, str, path, optional=True)
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text).replace(tzinfo=None)
    except ValueError:
        raise _fail(f"{path}.{key}", f"not an ISO time: {text!r}") from None


def _parse_document(data: Any) -> list[tuple[Device, Environment, Bucket, dict[str, Any]]]:
    if not isinstance(data, dict):
        raise _fail("(top level)", f"expected an object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise _fail("format", f"expected {FORMAT!r}, got {data.get('format')!r}")
    version = _get(data, "format_version", int, "(top level)")
    if version > FORMAT_VERSION:
        raise _fail("format_version", f"{version} is newer than this rewy-tune reads ({FORMAT_VERSION})")
    entries = _get(data, "winners", list, "(top level)")
    return [_parse_entry(entry, f"winners[{i}]") for i, entry in enumerate(entries)]


def _parse_entry(entry: Any, path: str) -> tuple[Device, Environment, Bucket, dict[str, Any]]:
    if not isinstance(entry, dict):
        raise _fail(path, f"expected an object, got {type(entry).__name__}")
    try:
        bucket = Bucket(**{name: _get(entry, name, (str if name in ("op", "policy", "dtype") else int), path)
                           for name in _BUCKET_FIELDS})
    except ValueError as exc:
        if isinstance(exc, ImportFormatError):
            raise
        raise _fail(path, str(exc)) from None
    for name in ("K", "V"):
        if getattr(bucket, name) > MAX_HEAD_DIM_TRITON:
            raise _fail(f"{path}.{name}",
                        f"{getattr(bucket, name)} is not supported; accepted: 1 to {MAX_HEAD_DIM_TRITON}")
    # what the dispatcher reads (dispatch._schedule_of): a schedule it would skip is refused here instead
    schedule = _get(entry, "schedule", dict, path)
    try:
        Schedule.from_dict(schedule).validate_for(bucket.K, bucket.V)
    except (ValueError, TypeError) as exc:
        raise _fail(f"{path}.schedule", str(exc)) from None
    for name in ("latency_ms", "fla_latency_ms"):
        value = _get(entry, name, (int, float), path)
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an integer too large for a float
            finite = False
        if not finite or value <= 0:  # NaN and inf would fail the database's checks (or store an inf speedup)
            raise _fail(f"{path}.{name}", f"expected a positive finite number, got {value!r}")
    device, environment = _parse_machine(entry, path)
    summary = _get(entry, "campaign", dict, path, optional=True)
    if summary is not None:
        cpath = f"{path}.campaign"
        summary = {"id": summary.get("id"), "op": _get(summary, "op", str, cpath),
                   "policies": _get(summary, "policies", list, cpath),
                   "workload": _get(summary, "workload", dict, cpath), "budget": _get(summary, "budget", dict, cpath),
                   "started_at": _get_time(summary, "started_at", cpath),
                   "finished_at": _get_time(summary, "finished_at", cpath),
                   "study_name": _get(summary, "study_name", str, cpath, optional=True)}
    return device, environment, bucket, {
        "schedule": schedule,
        "latency_ms": entry["latency_ms"], "fla_latency_ms": entry["fla_latency_ms"],
        "created_at": _get_time(entry, "created_at", path), "campaign": summary,
    }


def _parse_machine(entry: dict, path: str) -> tuple[Device, Environment]:
    dev = _get(entry, "device", dict, path)
    dpath = f"{path}.device"
    cc = _get(dev, "compute_capability", list, dpath)
    if len(cc) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in cc):
        raise _fail(f"{dpath}.compute_capability", f"expected [major, minor], got {cc!r}")
    device = Device(_get(dev, "gpu_name", str, dpath), tuple(cc), _get(dev, "sm_count", int, dpath),
                    _get(dev, "memory_bytes", int, dpath))
    env = _get(entry, "environment", dict, path)
    epath = f"{path}.environment"
    environment = Environment(*(_get(env, name, str, epath) for name in
                                ("driver", "cuda", "torch", "triton", "fla_core", "rewy_tune", "kernel_source_hash")))
    claimed = _get(env, "fingerprint", str, epath, optional=True)
    if claimed is not None and claimed != environment.fingerprint(device):
        raise _fail(f"{epath}.fingerprint", f"{claimed} does not match the device and environment given "
                                            f"({environment.fingerprint(device)})")
    return device, environment
