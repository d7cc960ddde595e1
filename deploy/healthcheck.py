"""The containers' healthchecks: `python deploy/healthcheck.py host|control|beat`; exit 0 when healthy.

- host: this host's workers (``<name>@HOST_NAME``) answer a Celery ping — at least one core-group worker
  (``cores-…``) and every verdict-stage worker the launcher keeps (``verdict-…``, SUPPORTMATRIX_VERDICT_WORKERS of
  them);
- control: the control worker of this machine (``control@<hostname>``) answers a ping;
- beat: some beat holds the scheduler lock in Redis, i.e. the reconciler and the sweeps are being sent.

Run from the project root (the images' working directory). The API's own check is GET /healthz.
"""

from __future__ import annotations

import socket
import sys

PING_TIMEOUT_S = 5.0


def answering(timeout: float = PING_TIMEOUT_S) -> set[str]:
    """The Celery node names (``name@host``) that answered a ping."""
    from services.worker.celery_app import app

    return {name for reply in app.control.ping(timeout=timeout) for name in reply}


def host_problem() -> str | None:
    from shared.settings import get_settings

    here = get_settings().host_name
    mine = {name.partition("@")[0] for name in answering() if name.endswith(f"@{here}")}
    cores = sorted(n for n in mine if n.startswith("cores-"))
    verdict = sorted(n for n in mine if n.startswith("verdict-"))
    wanted = get_settings().verdict_workers
    if not cores:
        return f"no core-group worker of {here} answers (answering: {sorted(mine)})"
    if len(verdict) < wanted:
        return f"{len(verdict)} of {wanted} verdict workers of {here} answer (answering: {sorted(mine)})"
    return None


def control_problem() -> str | None:
    name = f"control@{socket.gethostname()}"
    return None if name in answering() else f"{name} does not answer"


def beat_problem() -> str | None:
    import redis

    from services.worker.beat import LOCK_KEY
    from shared.settings import get_settings

    client = redis.Redis.from_url(get_settings().redis_url, socket_connect_timeout=5, socket_timeout=5)
    holder = client.get(LOCK_KEY)
    return None if holder else f"no beat holds {LOCK_KEY}"


CHECKS = {"host": host_problem, "control": control_problem, "beat": beat_problem}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: python deploy/healthcheck.py {'|'.join(CHECKS)}", file=sys.stderr)
        return 2
    try:
        problem = CHECKS[argv[0]]()
    except Exception as exc:  # a broker or database that does not answer is a failed check, said plainly
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
