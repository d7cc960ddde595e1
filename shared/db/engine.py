"""One engine per process, and sessions from it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import sqlalchemy as sa
from pydantic_core import from_json
from sqlalchemy.exc import InterfaceError, InvalidatePoolError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from shared.settings import get_settings


def _private(database: str | None) -> None:
    """The SQLite file readable by its owner alone (a runner runs as another user: shared.isolation); SQLite
    creates its -wal and -shm files with the database's mode."""
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if path.stat().st_uid == os.geteuid():
        path.chmod(0o600)


# How a database that is down or unreachable shows itself: worth retrying, unlike a refused statement.
DB_ERRORS = (OperationalError, InterfaceError)


# JSON columns (a run's token ids, its evidence) are parsed by pydantic-core's parser, one call in Rust per value:
# 1.4 µs for a list of 32 token ids against json.loads' 5.7 µs (timeit); a page of 100 records holds 200 of them.
def make_engine(url: str, io_timeout_s: float = 10.0) -> sa.Engine:
    if url.startswith("sqlite"):
        _private(sa.engine.make_url(url).database)
        engine = sa.create_engine(
            url, json_deserializer=from_json, connect_args={"timeout": 30, "check_same_thread": False}
        )

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:
            # WAL lets the API read while a worker writes; foreign keys are off by default in SQLite.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    # A database that stops answering (a partitioned host) must fail a heartbeat within seconds, not hang it:
    # a connect timeout; TCP keepalives for an idle connection; and tcp_user_timeout for a statement already
    # sent, whose unacknowledged bytes TCP would otherwise retransmit for a quarter of an hour.
    silent = {
        "connect_timeout": max(1, int(io_timeout_s)),
        "keepalives": 1,
        "keepalives_idle": max(1, int(io_timeout_s)),
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": int(io_timeout_s * 1000),
    }
    # Ten kept connections: a pool smaller than the requests an API process serves at once (its Hub lookups alone
    # are api_hub_lookups, 8) opens a connection for each request past it and closes it after, a backend forked by
    # PostgreSQL every time (a twelfth of the API's samples in a py-spy profile of bench/api_scale.py's POSTs). The
    # most recently returned connection is handed out first (LIFO), so that under a light load the same few stay in
    # use, below PING_IDLE_S, and the rest idle.
    engine = sa.create_engine(
        url, json_deserializer=from_json, pool_size=10, max_overflow=10, pool_use_lifo=True, connect_args=silent
    )
    _ping_when_idle(engine)
    return engine


# A pooled connection unused this long is pinged before it is handed out; one in steady use is not. SQLAlchemy's
# pool_pre_ping pings at every checkout, a round trip each time: a sixth of the API's samples in the same profile.
# A connection that a restarted or partitioned database dropped has usually idled longer than this by the time
# the database answers again. One that fails in use instead (a restart shorter than this, under load) fails its
# request (503), and SQLAlchemy then replaces the whole pool; a failed ping replaces the whole pool too.
PING_IDLE_S = 1.0


def _ping_when_idle(engine: sa.Engine) -> None:
    @sa.event.listens_for(engine, "checkin")
    def _checked_in(dbapi_conn: Any, record: Any) -> None:
        record.info["checked_in"] = time.monotonic()

    @sa.event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.pop("checked_in", None)  # none: a connection just opened
        if idle_since is None or time.monotonic() - idle_since < PING_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as exc:
            # the pool drops every connection it holds and checks out a new one (SQLAlchemy's recipe for a custom
            # ping), as pool_pre_ping does: the others are most likely gone too
            idle = time.monotonic() - idle_since
            raise InvalidatePoolError(f"a pooled connection idle {idle:.0f} s is gone") from exc


@lru_cache
def get_engine() -> sa.Engine:
    settings = get_settings()
    if settings.database_url.startswith("sqlite:///"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    # Below the lease timeout: a worker learns its database is gone while its lease still holds.
    return make_engine(settings.database_url, io_timeout_s=max(1.0, min(10.0, settings.lease_timeout_s / 3)))


@lru_cache
def _session_factory() -> sessionmaker[Session]:
    return sessionmaker(get_engine(), expire_on_commit=False)


def new_session() -> Session:
    return _session_factory()()


@contextmanager
def session_scope() -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with new_session() as session, session.begin():
        yield session


def rows_changed(session: Session, statement: sa.Executable) -> int:
    """How many rows an UPDATE or DELETE changed. ``Session.execute`` is typed as returning a ``Result``, which has no
    ``rowcount``: what it returns for a statement that changes rows is a ``CursorResult``."""
    return cast(sa.CursorResult[Any], session.execute(statement)).rowcount
