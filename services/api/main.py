"""The FastAPI app: `uvicorn services.api.main:app`. Run `python -m shared.db.migrate` before it starts."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy.exc import OperationalError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.metrics import StateCollector
from services.api.routes import health, jobs, results, sweeps, workers
from shared.settings import get_settings


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


def create_app() -> FastAPI:
    settings = get_settings()
    app = FastAPI(
        title="supportmatrix",
        summary="Which Hugging Face Hub models run unmodified on AWS Trainium2 (TorchNeuron), and how.",
        version="0.1.0",
    )
    app.add_middleware(BodySizeLimit, max_bytes=settings.api_max_body_bytes)
    app.include_router(jobs.router)
    app.include_router(results.router)
    app.include_router(workers.router)
    app.include_router(sweeps.router)
    app.include_router(health.router)

    @app.exception_handler(OperationalError)
    async def database_unavailable(_: Request, exc: OperationalError) -> JSONResponse:
        return JSONResponse({"detail": f"database unavailable: {exc.orig}"}, status_code=503)

    registry = CollectorRegistry()
    registry.register(StateCollector())

    @app.get("/metrics", response_class=PlainTextResponse, tags=["health"])
    def metrics() -> Any:
        """Prometheus exposition: jobs by state, results by verdict and error class, live workers."""
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


app = create_app()
