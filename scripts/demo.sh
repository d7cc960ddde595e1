#!/usr/bin/env bash
# Set up, then run the main job on embedded defaults (SQLite, a local Redis started if none answers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
