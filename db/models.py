"""SQLAlchemy models of the winners database (the current schema; `migrations.py` gets old files here).

Times are naive UTC. Latencies and timing samples are milliseconds. Status values are checked in
`queries.py` rather than by CHECK constraints, so adding one needs no table rebuild on SQLite.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

TRIAL_STATUSES = ("ok", "constraint", "compile_error", "runtime_error", "timeout", "incorrect", "nondeterministic")
CAMPAIGN_STATUSES = ("running", "finished", "interrupted", "failed", "imported")


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: DateTime}


class SchemaVersionRow(Base):
    __tablename__ = "schema_version"

    id: Mapped[int] = mapped_column(primary_key=True)  # a single row, id 1
    version: Mapped[int]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class DeviceRow(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("gpu_name", "cc_major", "cc_minor", "sm_count", "memory_bytes"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu_name: Mapped[str] = mapped_column(String(200))
    short_name: Mapped[str] = mapped_column(String(64), index=True)
    cc_major: Mapped[int]
    cc_minor: Mapped[int]
    sm_count: Mapped[int]
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    @property
    def compute_capability(self) -> tuple[int, int]:
        return (self.cc_major, self.cc_minor)


class EnvironmentRow(Base):
    """A software fingerprint on one device; `fingerprint` hashes both (`Environment.fingerprint`)."""

    __tablename__ = "environments"

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    fingerprint: Mapped[str] = mapped_column(String(32), unique=True)
    driver: Mapped[str] = mapped_column(String(64))
    cuda: Mapped[str] = mapped_column(String(64))
    torch: Mapped[str] = mapped_column(String(64))
    triton: Mapped[str] = mapped_column(String(64))
    fla_core: Mapped[str] = mapped_column(String(64))
    rewy_tune: Mapped[str] = mapped_column(String(64))
    kernel_source_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    device: Mapped[DeviceRow] = relationship(lazy="joined")


class CampaignRow(Base):
    __tablename__ = "campaigns"

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"), index=True)
    op: Mapped[str] = mapped_column(String(16))
    policies: Mapped[list[Any]]  # e.g. ["R", "A"]
    workload: Mapped[dict[str, Any]]  # shapes, dtype, chunk size, input distribution
    budget: Mapped[dict[str, Any]]  # e.g. {"trials": 200, "time_budget_s": 3600}
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(String(16), default="running")
    storage_url: Mapped[str | None] = mapped_column(Text)  # Optuna study storage
    study_name: Mapped[str | None] = mapped_column(String(200))  # added in schema v2

    environment: Mapped[EnvironmentRow] = relationship(lazy="joined")


class TrialRow(Base):
    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("campaign_id", "number"),
        Index("ix_trials_campaign_status", "campaign_id", "status"),  # added in schema v2
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    campaign_id: Mapped[int] = mapped_column(ForeignKey("campaigns.id"))
    number: Mapped[int]  # Optuna trial number
    schedule: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(32))
    errors: Mapped[dict[str, Any]]  # per tensor: {"dq": {"rel_rms": ..., "max_abs": ...}, ...}
    samples_ms: Mapped[dict[str, Any]]  # per shape label: [ms, ...]
    medians_ms: Mapped[dict[str, Any]]  # per shape label: ms
    compile_s: Mapped[float | None] = mapped_column(Float)
    bench_s: Mapped[float | None] = mapped_column(Float)
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BaselineRow(Base):
    """FLA timings measured in the same run as the campaign's trials."""

    __tablename__ = "baselines"
    __table_args__ = (UniqueConstraint("campaign_id", "shape"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    campaign_id: Mapped[int] = mapped_column(ForeignKey("campaigns.id"))
    shape: Mapped[str] = mapped_column(String(64))  # label such as "B1-T2048-H16"
    samples_ms: Mapped[list[Any]]
    median_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WinnerRow(Base):
    """The promoted schedule for one (environment fingerprint, op, policy, dtype, K, V, bucket)."""

    __tablename__ = "winners"
    __table_args__ = (
        UniqueConstraint("environment_id", "op", "policy", "dtype", "K", "V", "t_bucket", "bh_bucket",
                         name="uq_winners_key"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    environment_id: Mapped[int] = mapped_column(ForeignKey("environments.id"))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id"), index=True)
    op: Mapped[str] = mapped_column(String(16))
    policy: Mapped[str] = mapped_column(String(4))
    dtype: Mapped[str] = mapped_column(String(8))
    K: Mapped[int]
    V: Mapped[int]
    t_bucket: Mapped[int]
    bh_bucket: Mapped[int]
    schedule: Mapped[dict[str, Any]]
    latency_ms: Mapped[float] = mapped_column(Float)
    fla_latency_ms: Mapped[float] = mapped_column(Float)
    speedup: Mapped[float] = mapped_column(Float)
    campaign_id: Mapped[int | None] = mapped_column(ForeignKey("campaigns.id"))
    kernel_source_hash: Mapped[str] = mapped_column(String(64))
    compute_capability: Mapped[str] = mapped_column(String(8))  # "9.0"
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    environment: Mapped[EnvironmentRow] = relationship(lazy="joined")

    @property
    def fingerprint(self) -> str:
        return self.environment.fingerprint
