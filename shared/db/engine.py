"""One engine per process, and sessions from it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import sqlalchemy as sa
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from shared.settings import get_settings

# How a database that is down or unreachable shows itself: worth retrying, unlike a refused statement.
DB_ERRORS = (OperationalError, InterfaceError)


def make_engine(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
            # WAL lets the API read while a worker writes; foreign keys are off by default in SQLite.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    # A database that stops answering (a partitioned host) must fail a heartbeat within seconds, not hang it:
    # a connect timeout, and TCP keepalives that give up on a silent peer after about half a minute.
    keepalive = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
                 "keepalives_count": 3}  # fmt: skip
    return sa.create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10, connect_args=keepalive)


@lru_cache
def get_engine() -> sa.Engine:
    settings = get_settings()
    if settings.database_url.startswith("sqlite:///"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return make_engine(settings.database_url)


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
