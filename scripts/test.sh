#!/usr/bin/env bash
# Set up, lint, then run the whole suite against real Redis and PostgreSQL (started if they do not answer), with the
# type check and the docs build beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The machine's speed, measured idle before anything else runs: the fault tests' timing bounds scale with it
# (tests/machine_speed.py).
SUPPORTMATRIX_TEST_IMPORT_S="$(.venv/bin/python -c 'from tests.machine_speed import measure_import_s as m; print(m())')"
export SUPPORTMATRIX_TEST_IMPORT_S
# The type check (a minute and more on a fresh clone: no cache yet) and the docs build run beside the suite, whose
# first minute builds checkpoints and starts services; each writes its own log, shown, and failing this script, when
# it fails.
checks=.data/checks
rm -rf "$checks" && mkdir -p "$checks"
(
    .venv/bin/mypy shared services tasks >"$checks/mypy.log" 2>&1 || echo mypy >>"$checks/failed" # [tool.mypy] in pyproject.toml
    # docs/: a broken link or an unlisted page fails
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir .data/site >"$checks/mkdocs.log" 2>&1 ||
        echo mkdocs >>"$checks/failed"
) &
static=$!
# An interrupted run leaves none behind. Each command ends in `|| true`: under `set -e` a trap's failing command (pkill
# finding nothing, as after a whole run) would make the script exit 1 whatever the suite said.
trap 'pkill -P "$static" 2>/dev/null || true; kill "$static" 2>/dev/null || true' EXIT
# Two test processes (pytest-xdist), a file each at a time: the suite's runners and workers keep one CPU busy on
# average, so a 2-CPU machine runs it in about two thirds of the time. SUPPORTMATRIX_TEST_PROCESSES=0: serial.
# --durations: every run's log says where its time went (the suite's budget is 15 minutes on a fresh clone).
status=0
.venv/bin/python -m pytest -n "${SUPPORTMATRIX_TEST_PROCESSES:-2}" --dist loadfile --durations=25 "$@" || status=$?
wait "$static"
if [ -f "$checks/failed" ]; then
    for check in $(cat "$checks/failed"); do
        echo "=== $check failed:" && cat "$checks/$check.log"
    done
    status=1
fi
exit "$status"
