"""Schema versions and the steps between them, applied when a writer opens the database.

`MIGRATIONS[n]` turns a version n-1 database into version n. Version 1 is frozen here as plain
tables, not as the ORM models, so that it stays what version-1 files really contain. A new
database is created straight from the models at `CURRENT_VERSION`; a test checks that both
paths give the same schema.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import (JSON, BigInteger, Column, Connection, DateTime, Float, ForeignKey, Integer, MetaData,
                        String, Table, Text, UniqueConstraint, inspect, select, text)

from .errors import DatabaseError
from .models import Base, CampaignRow, SchemaVersionRow, TrialRow, utcnow


def _v1_initial(conn: Connection) -> None:
    md = MetaData()
    pk = lambda: Column("id", Integer, primary_key=True)  # noqa: E731
    created = lambda: Column("created_at", DateTime, nullable=False)  # noqa: E731
    Table("schema_version", md, pk(), Column("version", Integer, nullable=False),
          Column("updated_at", DateTime, nullable=False))
    Table("devices", md, pk(), Column("gpu_name", String(200), nullable=False),
          Column("short_name", String(64), nullable=False, index=True),
          Column("cc_major", Integer, nullable=False), Column("cc_minor", Integer, nullable=False),
          Column("sm_count", Integer, nullable=False), Column("memory_bytes", BigInteger, nullable=False), created(),
          UniqueConstraint("gpu_name", "cc_major", "cc_minor", "sm_count", "memory_bytes"))
    Table("environments", md, pk(), Column("device_id", ForeignKey("devices.id"), nullable=False, index=True),
          Column("fingerprint", String(32), nullable=False, unique=True),
          *(Column(name, String(64), nullable=False)
            for name in ("driver", "cuda", "torch", "triton", "fla_core", "rewy_tune", "kernel_source_hash")),
          created())
    Table("campaigns", md, pk(), Column("device_id", ForeignKey("devices.id"), nullable=False, index=True),
          Column("environment_id", ForeignKey("environments.id"), nullable=False, index=True),
          Column("op", String(16), nullable=False), Column("policies", JSON, nullable=False),
          Column("workload", JSON, nullable=False), Column("budget", JSON, nullable=False),
          Column("started_at", DateTime, nullable=False), Column("finished_at", DateTime),
          Column("status", String(16), nullable=False), Column("storage_url", Text))
    Table("trials", md, pk(), Column("campaign_id", ForeignKey("campaigns.id"), nullable=False),
          Column("number", Integer, nullable=False), Column("schedule", JSON, nullable=False),
          Column("status", String(32), nullable=False), Column("errors", JSON, nullable=False),
          Column("samples_ms", JSON, nullable=False), Column("medians_ms", JSON, nullable=False),
          Column("compile_s", Float), Column("bench_s", Float), Column("message", Text), created(),
          UniqueConstraint("campaign_id", "number"))
    Table("baselines", md, pk(), Column("campaign_id", ForeignKey("campaigns.id"), nullable=False),
          Column("shape", String(64), nullable=False), Column("samples_ms", JSON, nullable=False),
          Column("median_ms", Float, nullable=False), created(), UniqueConstraint("campaign_id", "shape"))
    Table("winners", md, pk(), Column("environment_id", ForeignKey("environments.id"), nullable=False),
          Column("device_id", ForeignKey("devices.id"), nullable=False, index=True),
          Column("op", String(16), nullable=False), Column("policy", String(4), nullable=False),
          Column("dtype", String(8), nullable=False),
          *(Column(name, Integer, nullable=False) for name in ("K", "V", "t_bucket", "bh_bucket")),
          Column("schedule", JSON, nullable=False),
          *(Column(name, Float, nullable=False) for name in ("latency_ms", "fla_latency_ms", "speedup")),
          Column("campaign_id", ForeignKey("campaigns.id")),
          Column("kernel_source_hash", String(64), nullable=False),
          Column("compute_capability", String(8), nullable=False), created(),
          UniqueConstraint("environment_id", "op", "policy", "dtype", "K", "V", "t_bucket", "bh_bucket",
                           name="uq_winners_key"))
    md.create_all(conn)


def _v2_study_name_and_trial_index(conn: Connection) -> None:
    """Campaigns name their Optuna study; the dashboard's failure taxonomy groups trials by status."""
    column_type = CampaignRow.__table__.c.study_name.type.compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE campaigns ADD COLUMN study_name {column_type}"))
    index = next(i for i in TrialRow.__table__.indexes if i.name == "ix_trials_campaign_status")
    index.create(conn, checkfirst=True)


MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _v1_initial,
    2: _v2_study_name_and_trial_index,
}
CURRENT_VERSION = max(MIGRATIONS)


def stored_version(conn: Connection) -> int | None:
    """The schema version recorded in the database; None for an empty database, 0 for a foreign one."""
    inspector = inspect(conn)
    if not inspector.has_table("schema_version"):
        return None if not inspector.get_table_names() else 0
    version = conn.execute(select(SchemaVersionRow.version).where(SchemaVersionRow.id == 1)).scalar()
    return int(version or 0)


def _stamp(conn: Connection, version: int) -> None:
    table = SchemaVersionRow.__table__
    if conn.execute(select(table.c.id).where(table.c.id == 1)).first() is None:
        conn.execute(table.insert().values(id=1, version=version, updated_at=utcnow()))
    else:
        conn.execute(table.update().where(table.c.id == 1).values(version=version, updated_at=utcnow()))


def upgrade(conn: Connection, *, upto: int = CURRENT_VERSION, label: str = "database") -> tuple[int, int]:
    """Bring the schema to `upto` inside the caller's transaction; returns (version before, after)."""
    before = stored_version(conn)
    if before is None:
        if upto == CURRENT_VERSION:
            Base.metadata.create_all(conn)
        else:
            for version in range(1, upto + 1):
                MIGRATIONS[version](conn)
        _stamp(conn, upto)
        return 0, upto
    check_version(before, label)
    for version in range(before + 1, upto + 1):
        MIGRATIONS[version](conn)
        _stamp(conn, version)
    return before, max(before, upto)


def check_version(version: int | None, label: str) -> None:
    """Raise unless `version` is one this code can read (after migration, for old ones)."""
    if version is None:
        raise DatabaseError(f"{label} is empty: it has no rewy-tune schema")
    if version == 0:
        raise DatabaseError(f"{label} is not a rewy-tune database (it has tables but no schema_version)")
    if version > CURRENT_VERSION:
        raise DatabaseError(
            f"{label} has schema v{version}, newer than this rewy-tune (v{CURRENT_VERSION}); upgrade rewy-tune")
