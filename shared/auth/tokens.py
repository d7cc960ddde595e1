"""API tokens: created once (the caller sees the token then, and never again), stored as their SHA-256,
looked up by that hash, revoked by name.

The write routes check the token of every request; a valid token's check is kept in memory for
``CHECK_SNAPSHOT_S`` (``recent_caller``), since a token only ever changes by being revoked.

A token is 256 random bits, so a fast hash is enough: there is nothing to brute-force that a slow password
hash (bcrypt, argon2) would protect. The lookup goes through the hash's unique index, and the found hash is
compared again in constant time, so no timing of the comparison tells an attacker how much of a guess matched.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
import threading
from dataclasses import dataclass

import sqlalchemy as sa
from cachetools import TTLCache
from sqlalchemy.orm import Session

from shared.contracts.enums import Scope
from shared.db.models import TOKEN_NAME_WIDTH, ApiToken, utcnow

# The prefix lets secret scanners (and people) recognise a leaked token.
TOKEN_PREFIX = "smx_"
NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{TOKEN_NAME_WIDTH - 1}}}$"
# How fresh a token's last use is kept. A last use says whether a token is still in use (before revoking it),
# to the minute; writing it on every request would cost each one a commit (a WAL flush), the write routes'
# largest fixed cost.
LAST_USE_RESOLUTION = dt.timedelta(minutes=1)
# How long a valid token's check is kept, per process and engine: a token revoked elsewhere (the CLI, another
# API process) is refused within this many seconds; in the process that revokes it, at once. Unknown and revoked
# tokens are never kept, so each of their requests is checked in SQL.
CHECK_SNAPSHOT_S = 1.0


class TokenExists(ValueError):
    pass


class TokenNotFound(LookupError):
    pass


@dataclass(frozen=True)
class Caller:
    """Who a valid token says is calling: its name and scope, and a key for per-token state (the rate limit)
    that is stable for the token's life and says nothing usable about the token itself."""

    name: str
    scope: Scope
    key: str

    def may(self, needed: Scope) -> bool:
        return self.scope.covers(needed)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# Valid tokens' callers by (engine, token hash), as checked at most CHECK_SNAPSHOT_S ago. Keyed by the engine
# object, not its URL: a URL's hash renders it as a string, each time.
_recent_callers: TTLCache[tuple[sa.Engine, str], Caller] = TTLCache(maxsize=4096, ttl=CHECK_SNAPSHOT_S)
_recent_callers_lock = threading.Lock()


def _recent_key(session: Session, digest: str) -> tuple[sa.Engine, str]:
    return session.get_bind().engine, digest


def create_token(session: Session, name: str, scope: Scope) -> str:
    """Add a token and return it: the only time it exists outside the caller's hands is this return value."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(f"token name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    if session.scalar(sa.select(ApiToken.id).where(ApiToken.name == name)) is not None:
        raise TokenExists(f"a token named {name!r} exists (revoked ones keep their name); pick another name")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(name=name, scope=scope, token_hash=token_hash(token)))
    session.flush()
    return token


def list_tokens(session: Session) -> list[ApiToken]:
    return list(session.scalars(sa.select(ApiToken).order_by(ApiToken.id)))


def revoke_token(session: Session, name: str) -> ApiToken:
    """Revoke a token by name; revoking a revoked token keeps its first revocation time."""
    token = session.scalar(sa.select(ApiToken).where(ApiToken.name == name))
    if token is None:
        raise TokenNotFound(f"no token named {name!r}")
    if token.revoked_at is None:
        token.revoked_at = utcnow()
    with _recent_callers_lock:
        _recent_callers.pop(_recent_key(session, token.token_hash), None)
    return token


def authenticate(session: Session, token: str) -> Caller | None:
    """The caller a presented token stands for, or None for an unknown or revoked one; marks it used.

    The last use is written when the stored one is older than ``LAST_USE_RESOLUTION`` (or absent), so the
    session has something to commit at most once a minute per token, not on every request.
    """
    digest = token_hash(token)
    found = session.scalar(sa.select(ApiToken).where(ApiToken.token_hash == digest, ApiToken.revoked_at.is_(None)))
    if found is None or not hmac.compare_digest(found.token_hash, digest):
        return None
    now = utcnow()
    if found.last_used_at is None or now - found.last_used_at >= LAST_USE_RESOLUTION:
        found.last_used_at = now
    return Caller(name=found.name, scope=found.scope, key=digest[:32])


def recent_caller(session: Session, token: str) -> Caller | None:
    """``authenticate``'s answer, for a valid token as it was at most ``CHECK_SNAPSHOT_S`` ago: the write
    routes' check, which then costs a request no SQL (and its last use is still stamped to the minute)."""
    key = _recent_key(session, token_hash(token))
    with _recent_callers_lock:
        caller = _recent_callers.get(key)
    if caller is None:
        caller = authenticate(session, token)
        if caller is not None:
            with _recent_callers_lock:
                _recent_callers[key] = caller
    return caller
