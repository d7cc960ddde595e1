#!/usr/bin/env bash
# Create .venv and install the project (cpu torch pinned) with its test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch==2.13.0 first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import torch, transformers, celery, fastapi; print('torch', torch.__version__, '| transformers', transformers.__version__)"
