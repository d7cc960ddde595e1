#!/usr/bin/env bash
# Create .venv and install the project (cpu torch pinned) with its test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# torch first, pinned by constraints/cpu.txt (as in the cpu image): an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check -c constraints/cpu.txt torch 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/pip install -q --disable-pip-version-check -c constraints/cpu.txt -e '.[test]' 2>&1 | grep -v "is ignored: it is neither" || true
# tests/test_deploy.py validates docker-compose.yml with Debian's docker-compose (v1; no daemon needed).
if ! command -v docker-compose >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
fi
# tests/test_metrics.py runs a real Prometheus against the stack and promtool over the config and alert rules.
if ! command -v prometheus >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# tests/test_pages.py drives Debian's chromium headless through Playwright (which cannot download its own browsers).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
.venv/bin/python -c "import torch, transformers, celery, fastapi; print('torch', torch.__version__, '| transformers', transformers.__version__)"
