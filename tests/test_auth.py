"""Who may write: bearer tokens stored hashed, scopes, revocation, the token command, and the per-token rate
limit that Redis keeps for every API process."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from services.api.deps import get_rate_limiter
from services.api.ratelimit import RateLimiter
from shared.auth.tokens import CHECK_SNAPSHOT_S, LAST_USE_RESOLUTION, authenticate, create_token, revoke_token
from shared.contracts.enums import Scope
from shared.db.engine import new_session, session_scope
from shared.db.models import ApiToken, utcnow
from shared.settings import get_settings

MISSING_JOB = "/jobs/987654321"  # a write that passes auth answers 404, and changes nothing


def new_token(scope: Scope) -> tuple[str, str]:
    name = f"t-{uuid.uuid4().hex[:10]}"
    with session_scope() as session:
        return name, create_token(session, name, scope)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def anonymous(api: Any) -> Iterator[TestClient]:
    """The suite's app, through a client that holds no token."""
    yield TestClient(api.app)


def test_writes_without_a_token_are_401_with_a_bearer_challenge_and_reads_stay_public(anonymous: TestClient) -> None:
    writes = [
        anonymous.post("/jobs", json={"model_id": "org/tiny-llama"}),
        anonymous.delete(MISSING_JOB),
        anonymous.post("/sweeps"),
        anonymous.post("/sweeps", headers={"Authorization": "Basic dXNlcjpwYXNz"}),
    ]
    for response in writes:
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer" and "bearer token" in response.json()["detail"]
    assert anonymous.get("/jobs").status_code == 200 and anonymous.get("/results").status_code == 200


def test_a_submit_token_cancels_only_its_own_jobs_and_an_admin_token_any(anonymous: TestClient) -> None:
    (alice, alice_token), (_, bob_token), (_, admin_token) = (
        new_token(s) for s in (Scope.submit,) * 2 + (Scope.admin,)
    )
    [job] = anonymous.post("/jobs", json={"model_id": "auth/tiny-gpt2"}, headers=bearer(alice_token)).json()["jobs"]
    assert job["created"] and job["submitted_by"] == alice
    # the same test asked for by another token is still alice's job
    again = anonymous.post("/jobs", json={"model_id": "auth/tiny-gpt2"}, headers=bearer(bob_token))
    assert again.status_code == 200 and again.json()["jobs"][0]["submitted_by"] == alice
    refused = anonymous.delete(f"/jobs/{job['id']}", headers=bearer(bob_token))
    assert refused.status_code == 403
    assert refused.json()["detail"] == (
        f"job {job['id']} was submitted by token {alice!r}; a submit token cancels only the jobs it submitted "
        "(an admin token cancels any)"
    )
    assert anonymous.get(f"/jobs/{job['id']}").json()["state"] != "cancelled"
    assert anonymous.delete(f"/jobs/{job['id']}", headers=bearer(alice_token)).json()["state"] == "cancelled"
    [bobs] = anonymous.post("/jobs", json={"model_id": "auth/tiny-llama"}, headers=bearer(bob_token)).json()["jobs"]
    cancelled = anonymous.delete(f"/jobs/{bobs['id']}", headers=bearer(admin_token))
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"


def test_an_unknown_or_revoked_token_is_401_invalid_token(anonymous: TestClient) -> None:
    name, token = new_token(Scope.submit)
    assert anonymous.delete(MISSING_JOB, headers=bearer(token)).status_code == 404
    with session_scope() as session:
        revoke_token(session, name)
    for presented in (token, token + "x", "smx_" + "A" * 43):
        response = anonymous.delete(MISSING_JOB, headers=bearer(presented))
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == 'Bearer error="invalid_token"'


def test_a_token_revoked_by_another_process_is_refused_once_the_check_snapshot_has_aged(
    anonymous: TestClient,
) -> None:
    name, token = new_token(Scope.submit)
    assert anonymous.delete(MISSING_JOB, headers=bearer(token)).status_code == 404  # its check is now kept
    # Revoked the way another process (the CLI) does: in SQL, which this process's snapshot does not hear of.
    with session_scope() as session:
        session.execute(sa.update(ApiToken).where(ApiToken.name == name).values(revoked_at=utcnow()))
    time.sleep(CHECK_SNAPSHOT_S)
    refused = anonymous.delete(MISSING_JOB, headers=bearer(token))
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == 'Bearer error="invalid_token"'


def test_a_submit_token_may_submit_and_cancel_but_not_force_or_sweep(anonymous: TestClient) -> None:
    _, token = new_token(Scope.submit)
    missing = anonymous.post("/jobs", json={"model_id": "org/no-such-model"}, headers=bearer(token))
    assert missing.status_code == 404  # past auth: the Hub was asked
    assert anonymous.delete(MISSING_JOB, headers=bearer(token)).status_code == 404
    forced = anonymous.post("/jobs", json={"model_id": "org/tiny-llama", "force": True}, headers=bearer(token))
    sweep = anonymous.post("/sweeps", headers=bearer(token))
    for response in (forced, sweep):
        assert response.status_code == 403 and "scope admin" in response.json()["detail"]
        assert 'error="insufficient_scope"' in response.headers["www-authenticate"]


def test_tokens_are_stored_as_their_hash_and_record_their_last_use(anonymous: TestClient) -> None:
    name, token = new_token(Scope.admin)
    with new_session() as session:
        row = session.scalar(sa.select(ApiToken).where(ApiToken.name == name))
        assert row is not None and row.last_used_at is None and row.scope is Scope.admin
        stored = " ".join(str(getattr(row, c.key)) for c in ApiToken.__table__.columns)
    assert token not in stored and token[4:] not in stored and len(token) >= 40
    anonymous.delete(MISSING_JOB, headers=bearer(token))
    with new_session() as session:
        used = session.scalar(sa.select(ApiToken.last_used_at).where(ApiToken.name == name))
    assert used is not None


def test_a_tokens_last_use_is_written_at_most_once_a_minute() -> None:
    name, token = new_token(Scope.submit)

    def use_after(last_used_at: dt.datetime) -> dt.datetime | None:
        """The last use stored after a request with the token, when the stored one was ``last_used_at``."""
        with session_scope() as session:
            session.execute(sa.update(ApiToken).where(ApiToken.name == name).values(last_used_at=last_used_at))
        with session_scope() as session:
            assert authenticate(session, token) is not None
        with new_session() as session:
            return session.scalar(sa.select(ApiToken.last_used_at).where(ApiToken.name == name))

    recent = utcnow() - LAST_USE_RESOLUTION / 2
    assert use_after(recent) == recent  # used within the minute: nothing written
    stale = utcnow() - LAST_USE_RESOLUTION * 2
    restamped = use_after(stale)
    assert restamped is not None and restamped > stale + LAST_USE_RESOLUTION


def test_the_rate_limit_is_per_token_shared_by_api_processes_and_answers_429_with_retry_after(
    anonymous: TestClient,
) -> None:
    # Two limiters on one Redis: two API processes.
    url = get_settings().redis_url
    one, two = RateLimiter(url, limit=3, window_s=60), RateLimiter(url, limit=3, window_s=60)
    _, token = new_token(Scope.submit)
    _, other = new_token(Scope.submit)
    statuses = []
    try:
        for limiter in (one, two, one, two):
            anonymous.app.dependency_overrides[get_rate_limiter] = returning(limiter)
            statuses.append(anonymous.delete(MISSING_JOB, headers=bearer(token)))
        refused = statuses[-1]
        assert [r.status_code for r in statuses] == [404, 404, 404, 429]
        assert 1 <= int(refused.headers["retry-after"]) <= 60 and "retry in" in refused.json()["detail"]
        assert anonymous.delete(MISSING_JOB, headers=bearer(other)).status_code == 404  # a budget per token
        assert anonymous.get("/jobs").status_code == 200  # reads are not counted
    finally:
        anonymous.app.dependency_overrides.pop(get_rate_limiter, None)


def returning(limiter: RateLimiter) -> Callable[[], RateLimiter]:
    return lambda: limiter


def test_the_window_slides_and_refusals_are_not_counted() -> None:
    limiter = RateLimiter(get_settings().redis_url, limit=2, window_s=1)
    key = uuid.uuid4().hex
    assert [limiter.wait_s(key) for _ in range(4)] == [0, 0, 1, 1]
    time.sleep(1.1)
    assert limiter.wait_s(key) == 0


def test_without_redis_the_limit_fails_open_quickly() -> None:
    limiter = RateLimiter("redis://127.0.0.1:1/0", limit=1, window_s=60)
    started = time.monotonic()
    assert [limiter.wait_s("k") for _ in range(3)] == [0, 0, 0]
    assert time.monotonic() - started < 3
