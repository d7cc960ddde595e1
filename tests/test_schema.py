"""Migrations up and down on SQLite and PostgreSQL, and no drift between the models and the migrations."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command

from shared.db.engine import make_engine
from shared.db.migrate import alembic_config, downgrade, upgrade
from tests.conftest import PG_BASE, pg_url

TABLES = {"jobs", "results", "workers", "sweeps", "sweep_entries", "reference_runs", "queues_seen", "api_tokens"}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'schema.db'}"
        return
    schema = f"migr_{uuid.uuid4().hex[:10]}"
    plain = PG_BASE.replace("postgresql+psycopg", "postgresql")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield pg_url(schema)
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_migrations_go_up_and_down_and_match_the_models(empty_database: str) -> None:
    upgrade(empty_database)
    assert tables(empty_database) == TABLES
    command.check(alembic_config(empty_database))  # raises when models and migrations differ
    downgrade(empty_database)
    assert tables(empty_database) == set()
    upgrade(empty_database)
    assert tables(empty_database) == TABLES
