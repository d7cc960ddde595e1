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
# kubectl with kustomize 5 renders deploy/kubernetes/ in tests/test_kubernetes.py; a machine without one gets the
# pinned kubectl 1.32 binary beside the venv's python (deploy/kubernetes/install_kubectl.py says from where).
if ! command -v kubectl >/dev/null && [ ! -x .venv/bin/kubectl ]; then
    .venv/bin/python deploy/kubernetes/install_kubectl.py .venv/bin
fi
# The policy checker tests/test_kubernetes.py runs over the rendered manifests, pinned, in a venv of its own.
if [ ! -x .venv/tools/checkov/bin/checkov ]; then
    python3 -m venv .venv/tools/checkov
    .venv/tools/checkov/bin/pip install -q --disable-pip-version-check -r deploy/kubernetes/policy-check.txt 2>&1 | grep -v "is ignored: it is neither" || true
fi
.venv/tools/checkov/bin/checkov --version >/dev/null  # an install that failed above fails here
# The user transformers' code runs as when the worker is root (shared/isolation.py); a repo's own code runs as a
# uid of its job's own, which no account holds (SUPPORTMATRIX_SANDBOX_UIDS).
if [ "$(id -u)" = 0 ]; then
    id -u supportmatrix-runner >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin supportmatrix-runner
    # Runners must reach the interpreter and the checkout: a venv made from a Python under /root (pyenv's) needs the
    # directories above it searchable by others (o+x: entered by a known path, not listed).
    for dir in "$(readlink -f .venv/bin/python)" "$PWD"; do
        while dir="$(dirname "$dir")" && [ "$dir" != / ]; do
            if [ $(( $(stat -c %#a "$dir") & 1 )) = 0 ]; then echo "setup: chmod o+x $dir (for the runner users)"; chmod o+x "$dir"; fi
        done
    done
fi
.venv/bin/python -c "import torch, transformers, celery, fastapi; print('torch', torch.__version__, '| transformers', transformers.__version__)"
