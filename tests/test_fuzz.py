"""Schemathesis against the app in-process, with an admin token: no 5xx, every status documented.

The fuzzed app is a fresh `create_app()` whose state goes nowhere a worker looks: its database is a scratch
SQLite file, its producer Celery's in-memory transport (a message sent there is never delivered), and Hub
look-ups go to the suite's stand-in, where random model ids do not exist. So a fuzzed `POST /jobs` or
`POST /sweeps` can create rows, but none that the suite's workers or reconciler would ever run. The database is
seeded with rows of every verdict and every error class under two compiler and two library versions, and a
sweep's ranked views (``tests.history.seed_every_outcome``): errors that only data can cause have data to meet.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from sqlalchemy.orm import Session

from services.api.deps import get_rate_limiter, get_scan_limiter, get_session, producer
from services.api.main import create_app
from services.api.ratelimit import RateLimiter
from shared.auth.tokens import create_token
from shared.contracts.enums import ErrorClass, Scope
from shared.db.engine import make_engine
from shared.db.migrate import upgrade
from shared.jobs.broker import make_celery
from shared.settings import Settings, get_settings
from tests.history import SEED_ROWS, seed_every_outcome

# The schema is read at import (schemathesis parametrizes at collection); the app's state is set up below.
app = create_app()
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.fixture(scope="module")
def token(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Point the fuzzed app at a scratch database and a producer that never delivers; an admin token there."""
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.db'}"
    upgrade(url)
    engine = make_engine(url)
    with Session(engine) as session:
        assert seed_every_outcome(session) == 4 * (len(SEED_ROWS) + len(ErrorClass))
        token = create_token(session, "fuzz", Scope.admin)
        session.commit()

    def scratch_session() -> Iterator[Session]:
        with Session(engine, expire_on_commit=False) as session:
            yield session

    never_delivers = make_celery(Settings(redis_url="memory://"))
    # Rate limiting is tested in test_auth; here it would only turn most writes into 429s.
    limiter = RateLimiter(get_settings().redis_url, limit=1_000_000, window_s=60)
    app.dependency_overrides |= {
        get_session: scratch_session,
        producer: lambda: never_delivers,
        get_rate_limiter: lambda: limiter,
        get_scan_limiter: lambda: limiter,
    }
    yield token
    app.dependency_overrides.clear()
    engine.dispose()


@schema.parametrize()
@settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_every_status_is_documented(case: Any, token: str) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {token}"})
