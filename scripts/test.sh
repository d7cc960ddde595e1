#!/usr/bin/env bash
# Set up, lint, then run the whole test suite against real Redis and PostgreSQL (started if they do not answer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
