"""Where the database lives and how it is opened: writers create and migrate it, readers never write.

SQLite (the default, a file in the user data directory) runs in WAL mode so readers never block
the writer, with a 30 s busy timeout so concurrent writers wait instead of failing. Writers start
their transactions with BEGIN IMMEDIATE: a transaction that reads and then writes would otherwise
fail at once with 'database is locked' when another process committed in between.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from . import migrations
from .errors import DatabaseError

BUSY_TIMEOUT_MS = 30_000


def default_db_url() -> str:
    """`REWY_DB` (a URL or a file path), else `rewy-tune.db` in the user data directory."""
    configured = os.environ.get("REWY_DB", "").strip()
    if configured:
        return as_db_url(configured)
    return as_db_url(str(Path(platformdirs.user_data_dir("rewy-tune")) / "rewy-tune.db"))


def as_db_url(path_or_url: str) -> str:
    """A SQLAlchemy URL stays as it is; a plain path becomes a SQLite URL."""
    if "://" in path_or_url:
        return path_or_url
    return f"sqlite:///{Path(path_or_url).expanduser().resolve()}"


def display_url(url: str | URL) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return str(url)


def sqlite_file(url: str | URL) -> Path | None:
    """The file behind a SQLite URL; None for other databases and in-memory SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    database = parsed.database
    if database.startswith("file:"):
        database = database[len("file:"):]
    return Path(database.split("?")[0])


def make_engine(url: str, *, read_only: bool = False) -> Engine:
    """An engine for any SQLAlchemy URL; SQLite gets WAL, the busy timeout and foreign keys."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    path = sqlite_file(parsed)
    if read_only and path is not None:
        parsed = parsed.set(database=f"file:{quote(str(path))}?mode=ro", query={**parsed.query, "uri": "true"})
    engine = create_engine(parsed)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # transactions are begun explicitly below
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if not read_only and path is not None:
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


@dataclass
class Database:
    """An open database: `with db.session() as s:` commits on success and rolls back on error."""

    url: str
    engine: Engine
    read_only: bool
    schema_version: int

    def __post_init__(self) -> None:
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if self.read_only:
            event.listen(self._sessions, "before_flush", self._refuse_writes)

    def _refuse_writes(self, session, _context, _instances) -> None:
        if session.new or session.dirty or session.deleted:
            raise DatabaseError(f"{display_url(self.url)} is open read-only")

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    def close(self) -> None:
        self.engine.dispose()


def open_db(url: str | None = None, *, read_only: bool = False) -> Database:
    """Open (writers: create and migrate) the database at `url` (default: `default_db_url()`).

    Raises DatabaseError, one line naming the URL, when it is missing (read-only), unreachable,
    corrupt, not a rewy-tune database, or too old for a reader / too new for this code.
    """
    url = default_db_url() if url is None else as_db_url(url)
    label = display_url(url)
    try:
        path = sqlite_file(url)
    except ArgumentError as exc:
        raise DatabaseError(f"{label} is not a database URL: {exc}") from None
    if path is not None and read_only and not path.is_file():
        raise DatabaseError(f"no rewy-tune database at {label} (a read-only open does not create one)")
    if path is not None and not read_only:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a parent that is a file, not writable, or under /proc
            raise DatabaseError(f"cannot create the folder of the rewy-tune database at {label}: "
                                f"{exc.strerror or exc}") from None
    engine = None
    try:
        engine = make_engine(url, read_only=read_only)
        with engine.begin() as conn:
            if read_only:
                version = migrations.stored_version(conn)
                migrations.check_version(version, label)
                if version < migrations.CURRENT_VERSION:
                    raise DatabaseError(f"{label} has schema v{version}, older than v{migrations.CURRENT_VERSION}; "
                                        "open it once with a writer (e.g. `rewy-tune tune`) to migrate it")
            else:
                version = migrations.upgrade(conn, label=label)[1]
    except (DatabaseError, SQLAlchemyError, ImportError, OSError) as exc:
        if engine is not None:
            engine.dispose()
        if isinstance(exc, DatabaseError):
            raise
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise DatabaseError(f"cannot open the rewy-tune database at {label}: {reason}") from exc
    return Database(url=url, engine=engine, read_only=read_only, schema_version=version)
