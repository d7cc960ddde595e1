"""Dependencies as Annotated aliases, so route signatures stay short."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, TypeVar

from celery import Celery
from fastapi import Depends, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field
from sqlalchemy.orm import Session

from services.api.answers import Answers
from services.api.errors import forbidden, rate_limited, unauthorized
from services.api.hub_pool import HubPool
from services.api.ratelimit import RateLimiter
from shared.auth.tokens import Caller, recent_caller
from shared.contracts.enums import Scope
from shared.db.engine import new_session
from shared.jobs.broker import get_producer
from shared.results.cells import DIFF_CURSOR_PATTERN, DiffKey, decode_cursor
from shared.settings import Settings, get_settings

T = TypeVar("T")


async def get_session() -> AsyncIterator[Session]:
    """The request's session, opened on the event loop (that needs no I/O; a sync dependency would cost a hop to the
    thread pool each way). Closed there too unless it is still in a transaction, whose connection is rolled back
    when given back to the pool: that close runs in the thread pool."""
    session = new_session()
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


def read_in_one_hop(route: Callable[..., T]) -> Callable[..., Awaitable[T]]:
    """A sync route that reads (from its ``session``), run in one hop to the thread pool.

    As a sync route, FastAPI would run it in the pool, then close its session (rolling its transaction back) in the
    pool: two hops, each a wait for a thread. Here the route and the close share one. Its connection is in
    autocommit: the driver sends no BEGIN before a statement and no ROLLBACK after it, two of a one-statement read's
    three round trips. For a route whose statements each stand on their own: each sees its own snapshot."""
    if "session" not in inspect.signature(route).parameters:
        raise TypeError(f"{route.__name__} takes no session")

    @functools.wraps(route)
    async def endpoint(**arguments: Any) -> T:  # FastAPI passes every parameter by name
        return await run_in_threadpool(_autocommit_read, route, arguments)

    return endpoint


def _autocommit_read(route: Callable[..., T], arguments: dict[str, Any]) -> T:
    session: Session = arguments["session"]
    try:
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
        return route(**arguments)
    finally:
        session.close()


def _built_once(build: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    """A dependency answering the one object ``build`` makes in this process. Async: building it does no I/O,
    and a sync dependency would cost every request a hop to the thread pool and back."""
    built = lru_cache(build)

    async def dependency() -> T:
        return built()

    return dependency


def _rate_limiter() -> RateLimiter:
    settings = get_settings()
    return RateLimiter(settings.redis_url, settings.api_rate_limit, settings.api_rate_window_s)


def _scan_limiter() -> RateLimiter:
    settings = get_settings()
    return RateLimiter(settings.redis_url, settings.api_scan_rate_limit, settings.api_rate_window_s)


def _answers() -> Answers:
    return Answers(get_settings().results_cache_bytes)


def _hub_pool() -> HubPool:
    settings = get_settings()
    return HubPool(settings.api_hub_lookups, settings.api_hub_wait_s)


async def current_settings() -> Settings:
    """The process's settings (``get_settings``, built once). Async: a sync dependency would cost every request a
    hop to the thread pool and back."""
    return get_settings()


async def producer() -> Celery:
    """The process's Celery producer (``get_producer``, built once); async for the same reason."""
    return get_producer()


get_rate_limiter = _built_once(_rate_limiter)
get_scan_limiter = _built_once(_scan_limiter)
get_hub_pool = _built_once(_hub_pool)
get_answers = _built_once(_answers)

SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(current_settings)]
ProducerDep = Annotated[Celery, Depends(producer)]
HubPoolDep = Annotated[HubPool, Depends(get_hub_pool)]
AnswersDep = Annotated[Answers, Depends(get_answers)]

# auto_error=False: a missing token is answered by get_caller, with the WWW-Authenticate challenge.
_bearer = HTTPBearer(
    auto_error=False, description="A token from `supportmatrix tokens create NAME --scope submit|admin`."
)


def get_caller(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    limiter: Annotated[RateLimiter, Depends(get_rate_limiter)],
) -> Caller:
    """The caller of a write route: 401 without a valid token, 429 when its rate limit is spent."""
    if credentials is None:
        raise unauthorized("this route needs a bearer token (Authorization: Bearer <token>)")
    caller = recent_caller(session, credentials.credentials)
    if caller is None:
        raise unauthorized("the bearer token is unknown or revoked", invalid=True)
    # Keeps the token's last use, when it was stamped, whatever the route does next; after a check in SQL with
    # nothing written, ends its transaction (no WAL flush) before the route asks the Hub; after one served from
    # the snapshot, there is no transaction and nothing is sent.
    session.commit()
    wait_s = limiter.wait_s(caller.key)
    if wait_s:
        raise rate_limited(wait_s, limiter.limit, limiter.window_s)
    return caller


def _needs(scope: Scope) -> Callable[[Caller], Awaitable[Caller]]:
    # async: a check that never blocks runs on the event loop, without a hop to the thread pool.
    async def check(caller: Annotated[Caller, Depends(get_caller)]) -> Caller:
        if not caller.may(scope):
            raise forbidden(scope, "this route")
        return caller

    return check


def scan_allowance(request: Request, limiter: Annotated[RateLimiter, Depends(get_scan_limiter)]) -> None:
    """A public read whose work grows with the data (a diff's page): each client address may make
    api_scan_rate_limit of them per window, counted in Redis like the write routes' limit; 429 past it."""
    client = request.client.host if request.client else "unknown"
    wait_s = limiter.wait_s(f"scan:{client}")
    if wait_s:
        spent = f"{client} made its {{limit}} reads that scan (diffs)"
        raise rate_limited(wait_s, limiter.limit, limiter.window_s, spent)


ScanDep = Annotated[None, Depends(scan_allowance)]


# The cursor's pattern has look-aheads (the Hub's grammar), which pydantic's regex engine lacks: it is published,
# and decoding checks it.
DiffCursor = Annotated[str, Field(max_length=400, json_schema_extra={"pattern": DIFF_CURSOR_PATTERN})]


@dataclass(frozen=True)
class DiffPage:
    after: DiffKey | None  # the cursor's key: this page starts after it
    limit: int


def diff_page(
    settings: SettingsDep,
    cursor: Annotated[DiffCursor | None, Query(description="next_cursor of the previous page")] = None,
    limit: Annotated[int | None, Query(ge=1, le=10000, description="cells of the newer version per page")] = None,
) -> DiffPage:
    """A diff's page: after the cursor, at most ``limit`` cells — never more than SUPPORTMATRIX_DIFF_PAGE_CELLS
    (and page_limit_max)."""
    try:
        after = decode_cursor(cursor) if cursor is not None else None
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(exc)) from exc
    cap = min(settings.diff_page_cells, settings.page_limit_max)
    return DiffPage(after, min(limit or cap, cap))


DiffPageDep = Annotated[DiffPage, Depends(diff_page)]
SubmitterDep = Annotated[Caller, Depends(_needs(Scope.submit))]
AdminDep = Annotated[Caller, Depends(_needs(Scope.admin))]
