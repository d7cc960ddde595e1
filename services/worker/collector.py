"""`python -m services.worker.collector [--every SECONDS]`: export results to Parquet, once or repeatedly.

The same export runs as the `supportmatrix.export` Celery task, which workers request after each result.
With SUPPORTMATRIX_PUBLISH_REPO set, what changed is then pushed to that Hub dataset repo.
"""

from __future__ import annotations

import argparse
import sys
import time

from shared.db.engine import session_scope
from shared.results.export import export_results
from shared.results.publish import publish
from shared.settings import get_settings


def export_once() -> str:
    """Export, then push to the configured Hub dataset when anything changed. Returns what it did."""
    settings = get_settings()
    with session_scope() as session:
        summary = export_results(session, settings.export_path)
    said = f"{summary.data_dir}: {len(summary.written)} written, {len(summary.unchanged)} unchanged"
    if settings.publish_repo:
        pushed = publish(settings.export_path, settings.publish_repo, settings.publish_token)
        said += f"; {settings.publish_repo}: " + (f"pushed {pushed.commit}" if pushed.pushed else "up to date")
    print(said, flush=True)
    return said


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
