"""Every read and write of the database, as typed functions over a `Session`.

Writers flush but do not commit: the caller's `with db.session() as s:` owns the transaction.
Only the promotion step calls `promote_winner`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, func, select, type_coerce
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rewy_tune.device import Device, Environment
from rewy_tune.problem import Bucket

from .models import (CAMPAIGN_STATUSES, TRIAL_STATUSES, BaselineRow, CampaignRow, DeviceRow, EnvironmentRow,
                     TrialRow, WinnerRow, utcnow)


class WinnerExistsError(ValueError):
    """A winner exists for this key and the caller did not ask to replace it."""


# -- devices and environments -----------------------------------------------------------------

def _get_or_create(session: Session, model: type, key: dict[str, Any], values: dict[str, Any]):
    query = select(model).filter_by(**key)
    if (row := session.scalars(query).first()) is not None:
        return row
    try:
        with session.begin_nested():  # another process may insert the same key between the two
            row = model(**key, **values)
            session.add(row)
    except IntegrityError:
        row = session.scalars(query).one()
    return row


def record_device(session: Session, device: Device) -> DeviceRow:
    key = dict(gpu_name=device.gpu_name, cc_major=device.compute_capability[0],
               cc_minor=device.compute_capability[1], sm_count=device.sm_count, memory_bytes=device.memory_bytes)
    return _get_or_create(session, DeviceRow, key, dict(short_name=device.short_name))


def record_environment(session: Session, device: Device, environment: Environment) -> EnvironmentRow:
    device_row = record_device(session, device)
    return _get_or_create(session, EnvironmentRow, dict(fingerprint=environment.fingerprint(device)),
                          dict(device_id=device_row.id, **environment.to_dict()))


def device_of(row: DeviceRow) -> Device:
    return Device(row.gpu_name, row.compute_capability, row.sm_count, row.memory_bytes)


def environment_of(row: EnvironmentRow) -> Environment:
    return Environment(row.driver, row.cuda, row.torch, row.triton, row.fla_core, row.rewy_tune,
                       row.kernel_source_hash)


def devices(session: Session) -> list[DeviceRow]:
    return list(session.scalars(select(DeviceRow).order_by(DeviceRow.short_name, DeviceRow.id)))


# -- campaigns, trials, baselines ----------------------------------------------------------------

def create_campaign(session: Session, *, device: Device, environment: Environment, op: str,
                    policies: Sequence[str], workload: dict[str, Any], budget: dict[str, Any],
                    storage_url: str | None = None, study_name: str | None = None) -> CampaignRow:
    env_row = record_environment(session, device, environment)
    campaign = CampaignRow(device_id=env_row.device_id, environment_id=env_row.id, op=op, policies=list(policies),
                           workload=workload, budget=budget, status="running", storage_url=storage_url,
                           study_name=study_name)
    session.add(campaign)
    session.flush()
    return campaign


def finish_campaign(session: Session, campaign_id: int, status: str = "finished") -> CampaignRow:
    if status not in CAMPAIGN_STATUSES:
        raise ValueError(f"campaign status must be one of {', '.join(CAMPAIGN_STATUSES)}; got {status!r}")
    campaign = _campaign(session, campaign_id)
    campaign.status, campaign.finished_at = status, utcnow()
    session.flush()
    return campaign


def _campaign(session: Session, campaign_id: int) -> CampaignRow:
    campaign = session.get(CampaignRow, campaign_id)
    if campaign is None:
        raise KeyError(f"no campaign with id {campaign_id}")
    return campaign


def get_campaign(session: Session, campaign_id: int) -> CampaignRow | None:
    if not -2**63 <= campaign_id < 2**63:  # no such row; SQLite would raise OverflowError on the bound id
        return None
    return session.get(CampaignRow, campaign_id)


def _filter_campaigns(query, *, device: str | None, op: str | None, status: str | None):
    """The campaign filters shared by the list and the count (device by short name)."""
    if device is not None:
        query = query.join(DeviceRow, DeviceRow.id == CampaignRow.device_id).where(DeviceRow.short_name == device)
    if op is not None:
        query = query.where(CampaignRow.op == op)
    if status is not None:
        query = query.where(CampaignRow.status == status)
    return query


def campaigns(session: Session, *, device: str | None = None, op: str | None = None, status: str | None = None,
              offset: int = 0, limit: int = 100) -> list[CampaignRow]:
    """Newest first; `device` is a short name such as 'h200'."""
    query = select(CampaignRow).order_by(CampaignRow.id.desc()).offset(offset).limit(limit)
    query = _filter_campaigns(query, device=device, op=op, status=status)
    return list(session.scalars(query))


def add_trial(session: Session, campaign_id: int, *, number: int, schedule: dict[str, Any], status: str,
              errors: dict[str, Any] | None = None, samples_ms: dict[str, list[float]] | None = None,
              compile_s: float | None = None, bench_s: float | None = None,
              message: str | None = None) -> TrialRow:
    """Record (or, for a resumed campaign, overwrite) Optuna trial `number`; medians come from the samples."""
    if status not in TRIAL_STATUSES:
        raise ValueError(f"trial status must be one of {', '.join(TRIAL_STATUSES)}; got {status!r}")
    _campaign(session, campaign_id)
    samples = {shape: [float(x) for x in xs] for shape, xs in (samples_ms or {}).items()}
    values = dict(schedule=schedule, status=status, errors=errors or {}, samples_ms=samples,
                  medians_ms={shape: statistics.median(xs) for shape, xs in samples.items() if xs},
                  compile_s=compile_s, bench_s=bench_s, message=message)
    trial = session.scalars(select(TrialRow).filter_by(campaign_id=campaign_id, number=number)).first()
    if trial is None:
        trial = TrialRow(campaign_id=campaign_id, number=number, **values)
        session.add(trial)
    else:
        for name, value in values.items():
            setattr(trial, name, value)
    session.flush()
    return trial


@dataclass(frozen=True)
class Page:
    items: list[Any]
    total: int
    offset: int
    limit: int


def campaign_trials(session: Session, campaign_id: int, *, status: str | None = None,
                    offset: int = 0, limit: int = 100) -> Page:
    """Trials of a campaign in Optuna order, one page at a time."""
    where = [TrialRow.campaign_id == campaign_id] + ([TrialRow.status == status] if status else [])
    total = session.scalar(select(func.count()).select_from(TrialRow).where(*where)) or 0
    query = select(TrialRow).where(*where).order_by(TrialRow.number).offset(offset).limit(limit)
    return Page(items=list(session.scalars(query)), total=total, offset=offset, limit=limit)


def add_baseline(session: Session, campaign_id: int, *, shape: str, samples_ms: Sequence[float]) -> BaselineRow:
    """FLA samples for one shape of the campaign's workload (replaces an earlier measurement)."""
    _campaign(session, campaign_id)
    samples = [float(x) for x in samples_ms]
    if not samples:
        raise ValueError(f"baseline {shape}: samples_ms is empty")
    row = session.scalars(select(BaselineRow).filter_by(campaign_id=campaign_id, shape=shape)).first()
    if row is None:
        row = BaselineRow(campaign_id=campaign_id, shape=shape, samples_ms=samples, median_ms=0.0)
        session.add(row)
    row.samples_ms, row.median_ms = samples, statistics.median(samples)
    session.flush()
    return row


def baselines(session: Session, campaign_id: int) -> list[BaselineRow]:
    return list(session.scalars(select(BaselineRow).filter_by(campaign_id=campaign_id).order_by(BaselineRow.id)))


# -- winners ------------------------------------------------------------------------------------

def _bucket_key(bucket: Bucket) -> dict[str, Any]:
    return dict(op=bucket.op, policy=bucket.policy, dtype=bucket.dtype, K=bucket.K, V=bucket.V,
                t_bucket=bucket.t_bucket, bh_bucket=bucket.bh_bucket)


def bucket_of(winner: WinnerRow) -> Bucket:
    return Bucket(winner.op, winner.policy, winner.dtype, winner.K, winner.V, winner.t_bucket, winner.bh_bucket)


def promote_winner(session: Session, *, campaign_id: int, bucket: Bucket, schedule: dict[str, Any],
                   latency_ms: float, fla_latency_ms: float, replace: bool = False) -> WinnerRow | None:
    """Make `schedule` the winner for `bucket` on the campaign's environment; returns the previous winner.

    An existing winner is replaced only with `replace=True` (else WinnerExistsError); the previous
    row is returned detached, with its values still readable.
    """
    campaign = _campaign(session, campaign_id)
    if bucket.op != campaign.op or bucket.policy not in campaign.policies:
        raise ValueError(f"bucket {bucket.label} is not covered by campaign {campaign_id} "
                         f"(op {campaign.op}, policies {campaign.policies})")
    if latency_ms <= 0 or fla_latency_ms <= 0:
        raise ValueError(f"latencies must be positive; got {latency_ms} ms and FLA {fla_latency_ms} ms")
    env = campaign.environment
    return _put_winner(session, WinnerRow(
        environment_id=env.id, device_id=env.device_id, **_bucket_key(bucket), schedule=schedule,
        latency_ms=latency_ms, fla_latency_ms=fla_latency_ms, speedup=fla_latency_ms / latency_ms,
        campaign_id=campaign_id, kernel_source_hash=env.kernel_source_hash,
        compute_capability="{}.{}".format(*env.device.compute_capability)), replace=replace)


def _put_winner(session: Session, winner: WinnerRow, *, replace: bool) -> WinnerRow | None:
    key = dict(environment_id=winner.environment_id, op=winner.op, policy=winner.policy, dtype=winner.dtype,
               K=winner.K, V=winner.V, t_bucket=winner.t_bucket, bh_bucket=winner.bh_bucket)
    previous = session.scalars(select(WinnerRow).filter_by(**key)).first()
    if previous is not None:
        if not replace:
            raise WinnerExistsError(f"a winner exists for {bucket_of(previous).label} on "
                                    f"{previous.environment.fingerprint}; pass replace=True to replace it")
        session.delete(previous)
        session.flush()
    session.add(winner)
    session.flush()
    return previous


def winners(session: Session, *, device: str | None = None, op: str | None = None,
            policy: str | None = None, fingerprint: str | None = None) -> list[WinnerRow]:
    """Winners, filtered by device short name ('h200'), op, policy and environment fingerprint."""
    query = select(WinnerRow).join(DeviceRow, DeviceRow.id == WinnerRow.device_id)
    if device is not None:
        query = query.where(DeviceRow.short_name == device)
    if op is not None:
        query = query.where(WinnerRow.op == op)
    if policy is not None:
        query = query.where(WinnerRow.policy == policy)
    if fingerprint is not None:
        query = query.where(WinnerRow.environment.has(EnvironmentRow.fingerprint == fingerprint))
    order = (DeviceRow.short_name, WinnerRow.op, WinnerRow.policy, WinnerRow.dtype, WinnerRow.K, WinnerRow.V,
             WinnerRow.t_bucket, WinnerRow.bh_bucket, WinnerRow.id)
    return list(session.scalars(query.order_by(*order)).unique())


def winner_for(session: Session, bucket: Bucket, *, fingerprint: str | None = None,
               device: Device | None = None) -> WinnerRow | None:
    """The winner for exactly this bucket: under one environment fingerprint, or (newest first) under
    any environment of the same hardware `device`."""
    if (fingerprint is None) == (device is None):
        raise ValueError("winner_for needs exactly one of fingerprint= or device=")
    query = select(WinnerRow).filter_by(**_bucket_key(bucket)).order_by(WinnerRow.created_at.desc(),
                                                                       WinnerRow.id.desc())
    if fingerprint is not None:
        query = query.where(WinnerRow.environment.has(EnvironmentRow.fingerprint == fingerprint))
    else:
        query = query.join(DeviceRow, DeviceRow.id == WinnerRow.device_id).where(
            DeviceRow.gpu_name == device.gpu_name, DeviceRow.cc_major == device.compute_capability[0],
            DeviceRow.cc_minor == device.compute_capability[1], DeviceRow.sm_count == device.sm_count,
            DeviceRow.memory_bytes == device.memory_bytes)
    return session.scalars(query).unique().first()


def all_winners_for_ops(session: Session, ops: Iterable[str]) -> list[WinnerRow]:
    """Every winner of these ops, on every device: what the dispatcher loads once per process."""
    query = select(WinnerRow).where(WinnerRow.op.in_(list(ops))).order_by(WinnerRow.id)
    return list(session.scalars(query).unique())


# -- dashboard reads (the `serve` dashboard and its JSON API; read-only) ------------------------------
# Every filter below is a bound parameter of an ORM query; nothing a request sends becomes SQL text.

def device_rows_named(session: Session, short_name: str) -> list[DeviceRow]:
    """Every device row with this short name (one name can cover several memory / SM variants)."""
    query = select(DeviceRow).where(DeviceRow.short_name == short_name).order_by(DeviceRow.id)
    return list(session.scalars(query))


def all_campaigns(session: Session) -> list[CampaignRow]:
    """Every campaign, oldest first, with its environment (and device) loaded."""
    return list(session.scalars(select(CampaignRow).order_by(CampaignRow.id)).unique())


def campaign_count(session: Session, *, device: str | None = None, op: str | None = None,
                   status: str | None = None) -> int:
    query = select(func.count()).select_from(CampaignRow)
    query = _filter_campaigns(query, device=device, op=op, status=status)
    return session.scalar(query) or 0


def trial_counts(session: Session, campaign_ids: Sequence[int] | None = None) -> dict[tuple[int, str], int]:
    """Number of trials per (campaign id, status); all campaigns when `campaign_ids` is None."""
    query = select(TrialRow.campaign_id, TrialRow.status, func.count()).group_by(TrialRow.campaign_id,
                                                                                 TrialRow.status)
    if campaign_ids is not None:
        query = query.where(TrialRow.campaign_id.in_(list(campaign_ids)))
    return {(cid, status): n for cid, status, n in session.execute(query)}


def campaign_activity(session: Session, campaign_ids: Sequence[int]) -> dict[int, tuple[Any, Any]]:
    """When each campaign last wrote: (newest trial row's time, newest FLA baseline's time), None where it
    has none. A campaign killed mid-run stays 'running' in the database; this is how a reader tells."""
    if not campaign_ids:
        return {}
    ids = list(campaign_ids)
    # Trial rows are only appended (a resumed trial overwrites its row and keeps its time), so the newest
    # row is the one with the largest id: found in the (campaign_id, status) index without reading the rows.
    newest = (select(func.max(TrialRow.id)).where(TrialRow.campaign_id.in_(ids))
              .group_by(TrialRow.campaign_id).scalar_subquery())
    trials = dict(session.execute(select(TrialRow.campaign_id, TrialRow.created_at)
                                  .where(TrialRow.id.in_(newest))).all())
    base = dict(session.execute(select(BaselineRow.campaign_id, func.max(BaselineRow.created_at))
                                .where(BaselineRow.campaign_id.in_(ids)).group_by(BaselineRow.campaign_id)).all())
    return {cid: (trials.get(cid), base.get(cid)) for cid in ids if cid in trials or cid in base}


@dataclass(frozen=True)
class TrialPoint:
    """The columns of a trial that the dashboard plots (no raw samples)."""

    id: int
    campaign_id: int
    number: int
    status: str
    schedule: dict[str, Any]
    medians_ms: dict[str, Any]
    created_at: Any


def _json_value(raw: Any, memo: dict[str, Any]) -> Any:
    if not isinstance(raw, str):  # drivers that decode JSON themselves (psycopg) or NULL
        return raw
    value = memo.get(raw)
    if value is None:
        value = memo[raw] = json.loads(raw)
    return value


def trial_points(session: Session, campaign_ids: Sequence[int]) -> list[TrialPoint]:
    """Plot columns of every trial of these campaigns, in campaign then Optuna order.

    The JSON columns are fetched as text and decoded here, once per distinct value: this is the
    dashboard's hot path (10 000 trials), and equal schedules share one (read-only) dict."""
    if not campaign_ids:
        return []
    query = (select(TrialRow.id, TrialRow.campaign_id, TrialRow.number, TrialRow.status,
                    type_coerce(TrialRow.schedule, Text), type_coerce(TrialRow.medians_ms, Text), TrialRow.created_at)
             .where(TrialRow.campaign_id.in_(list(campaign_ids)))
             .order_by(TrialRow.campaign_id, TrialRow.number))
    schedules: dict[str, Any] = {}
    medians: dict[str, Any] = {}
    return [TrialPoint(tid, cid, number, status, _json_value(schedule, schedules), _json_value(med, medians), created)
            for tid, cid, number, status, schedule, med, created in session.execute(query)]


def trial_samples(session: Session, trial_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Raw timing samples (per shape label) of a few trials, by trial id."""
    if not trial_ids:
        return {}
    query = select(TrialRow.id, TrialRow.samples_ms).where(TrialRow.id.in_(list(trial_ids)))
    return {tid: samples for tid, samples in session.execute(query)}


def baselines_of(session: Session, campaign_ids: Sequence[int]) -> list[BaselineRow]:
    """FLA baselines of these campaigns, oldest campaign first."""
    if not campaign_ids:
        return []
    query = (select(BaselineRow).where(BaselineRow.campaign_id.in_(list(campaign_ids)))
             .order_by(BaselineRow.campaign_id, BaselineRow.id))
    return list(session.scalars(query))
