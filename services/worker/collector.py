"""`python -m services.worker.collector [--every SECONDS]`: export all results to Parquet, once or repeatedly.

Workers ask for an export after each result (``request_export``); the `supportmatrix.export` Celery task
serves those requests together, at most one run per export window (``EXPORT_WINDOW_S``), and rewrites
only the files and cells of the results that came in (``export_jobs``). This command rebuilds every file
(``export_results``). Either way, with SUPPORTMATRIX_PUBLISH_REPO set, what changed is then pushed to that
Hub dataset repo in one commit. One export runs at a time (a lock in the broker's Redis).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session

from shared.db.engine import session_scope
from shared.jobs.broker import PendingExports
from shared.results.export import ExportSummary, export_jobs, export_results
from shared.results.publish import publish
from shared.settings import get_settings


def _export_and_publish(export: Callable[[Session, Path], ExportSummary]) -> str:
    settings = get_settings()
    with session_scope() as session:
        summary = export(session, settings.export_path)
    said = f"{summary.data_dir}: {len(summary.written)} written, {len(summary.unchanged)} unchanged"
    if settings.publish_repo:
        pushed = publish(settings.export_path, settings.publish_repo, settings.publish_token)
        said += f"; {settings.publish_repo}: " + (f"pushed {pushed.commit}" if pushed.pushed else "up to date")
    print(said, flush=True)
    return said


def export_once() -> str:
    """Rebuild every file from SQL, then push what changed. Returns what it did."""
    with PendingExports(get_settings().redis_url).exclusive(wait=True):
        return _export_and_publish(export_results)


def export_requested() -> str | None:
    """Export the files of the jobs that asked for it since the last run, then push what changed; None when
    another export is running (try again later: it may have read the jobs' rows before they were written)."""
    pending = PendingExports(get_settings().redis_url)
    with pending.exclusive(wait=False) as held:
        if not held:
            return None
        job_ids = pending.take()
        if not job_ids:
            return "nothing to export"  # an earlier run took these jobs
        said = _export_and_publish(lambda session, export_dir: export_jobs(session, export_dir, job_ids))
        pending.done(job_ids)
        return f"{len(job_ids)} jobs: {said}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.worker.collector", description=__doc__)
    parser.add_argument("--every", type=float, help="repeat every this many seconds until interrupted")
    args = parser.parse_args(argv)
    export_once()
    while args.every:
        time.sleep(args.every)
        export_once()
    return 0


if __name__ == "__main__":
    sys.exit(main())
