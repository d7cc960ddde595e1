"""The FastAPI app: `uvicorn services.api.main:app`. Run `python -m shared.db.migrate` before it starts."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.errors import unavailable
from services.api.metrics import Snapshot, StateCollector, instrument
from services.api.routes import failures, health, jobs, pages, results, sweeps, workers
from shared.hub.client import bound_hub_requests
from shared.settings import get_settings

log = logging.getLogger(__name__)


class BodySizeLimit:
    """413 for a request body over the limit, declared or streamed, before any route reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send)
            return
        received = 0
        too_large = False

        async def limited_receive() -> Message:
            # Past the limit, end the body there: the app answers something, which we replace by a 413.
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def replacing_send(message: Message) -> None:
            if not too_large:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._refuse(send)

        await self.app(scope, limited_receive, replacing_send)

    async def _refuse(self, send: Send) -> None:
        body = b'{"detail":"request body larger than %d bytes"}' % self.max_bytes
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    bound_hub_requests(get_settings().hub_timeout_s)
    # Started here, not in create_app: the app is built at import, before a server may fork its workers.
    snapshot: Snapshot = app.state.metrics_snapshot
    snapshot.start()
    try:
        yield
    finally:
        snapshot.stop()


def create_app() -> FastAPI:
    settings = get_settings()
    app = FastAPI(
        title="supportmatrix",
        summary="Which Hugging Face Hub models run unmodified on AWS Trainium2 (TorchNeuron), and how.",
        version="0.1.0",
        description="Reads are public. Write routes need `Authorization: Bearer <token>`: "
        "`supportmatrix tokens create NAME --scope submit|admin` makes one.",
        lifespan=lifespan,
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.api_max_body_bytes)
    app.include_router(jobs.router)
    app.include_router(results.router)
    app.include_router(failures.router)
    app.include_router(workers.router)
    app.include_router(sweeps.router)
    app.include_router(health.router)
    app.include_router(pages.router)

    # The database's own words (host, user, SQL) stay in the log: the client learns only that it is down.
    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)
    async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s: database unavailable: %s", request.method, request.url.path, exc)
        refusal = unavailable("the database is unavailable")
        return JSONResponse({"detail": refusal.detail}, status_code=refusal.status_code, headers=refusal.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            # Starlette lists the methods of the first route on the path only; a path with a GET and a POST route
            # would say "Allow: POST". The Allow of a 405 names every method of the resource (RFC 9110).
            allowed = {
                method
                for route in app.router.routes
                if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE
                for method in route.methods or ()
            }
            exc.headers = {**(exc.headers or {}), "Allow": ", ".join(sorted(allowed))}
        return await http_exception_handler(request, exc)

    snapshot = Snapshot(StateCollector(), settings.metrics_refresh_s)
    app.state.metrics_snapshot = snapshot
    http_registry = CollectorRegistry()
    instrument(app, http_registry)

    @app.get("/metrics", response_class=PlainTextResponse, tags=["health"])
    def metrics() -> Any:
        """Prometheus exposition: jobs by state, results by verdict and error class, live workers (a snapshot at
        most SUPPORTMATRIX_METRICS_REFRESH_S old: supportmatrix_metrics_snapshot_age_seconds), HTTP requests (live)."""
        exposition = snapshot.exposition() + generate_latest(http_registry)
        return PlainTextResponse(exposition, media_type=CONTENT_TYPE_LATEST)

    return app


app = create_app()
