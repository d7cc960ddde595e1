#!/usr/bin/env bash
# Set up, lint, then run the whole test suite against real Redis and PostgreSQL (started if they do not answer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir .data/site  # docs/: a broken link or an unlisted page fails
# Two test processes (pytest-xdist), a file each at a time: the suite's runners and workers keep one CPU busy on
# average, so a 2-CPU machine runs it in about two thirds of the time. SUPPORTMATRIX_TEST_PROCESSES=0: serial.
exec .venv/bin/python -m pytest -n "${SUPPORTMATRIX_TEST_PROCESSES:-2}" --dist loadfile "$@"
