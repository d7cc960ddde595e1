"""The refusals routes and dependencies share, with the headers their status needs."""

from __future__ import annotations

from fastapi import HTTPException, status

from shared.contracts.enums import Scope
from shared.settings import get_settings


def unavailable(reason: str) -> HTTPException:
    """503: a dependency (Hub, database, broker) is down; the client may retry after a while."""
    headers = {"Retry-After": str(get_settings().api_retry_after_s)}
    return HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, reason, headers=headers)


def unauthorized(reason: str, invalid: bool = False) -> HTTPException:
    """401, with the challenge RFC 6750 asks for (and its error code when a token was presented)."""
    challenge = 'Bearer error="invalid_token"' if invalid else "Bearer"
    return HTTPException(status.HTTP_401_UNAUTHORIZED, reason, headers={"WWW-Authenticate": challenge})


def forbidden(needed: Scope, what: str) -> HTTPException:
    return HTTPException(
        status.HTTP_403_FORBIDDEN,
        f"{what} needs a token of scope {needed.value}",
        headers={"WWW-Authenticate": f'Bearer error="insufficient_scope", scope="{needed.value}"'},
    )


def rate_limited(
    wait_s: int, limit: int, window_s: int, spent: str = "this token made its {limit} write requests"
) -> HTTPException:
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        f"{spent.format(limit=limit)} of the last {window_s} s; retry in {wait_s} s",
        headers={"Retry-After": str(wait_s)},
    )
