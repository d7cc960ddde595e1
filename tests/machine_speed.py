"""How fast this machine starts what the fault tests wait on, measured once per test run.

Their bounds (how late a lost job may start again, how long one job's two stages may take) were tuned on the 2-CPU
machine the suite runs on; each start they wait for is dominated by a fresh interpreter importing torch and
transformers (a worker's zygote, a runner, a rank). The import is measured before any test loads the machine
(``scripts/test.sh``), and the bounds scale by its ratio to the tuned machine's: a slower machine waits longer, a
faster one never less than the tuned bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import cache

# A fresh interpreter's `import torch, transformers` on the machine the bounds were tuned on, idle (the median of 3
# on 2026-12-05, x86_64 with 2 CPUs: 2.09 s and 1.97 s).
TUNED_IMPORT_S = 2.0
# Where the measurement is handed to the suite: scripts/test.sh measures before anything else runs (the machine idle,
# once for pytest-xdist's workers, who inherit it); a pytest run without it measures when a bound is first asked for.
ENVIRONMENT = "SUPPORTMATRIX_TEST_IMPORT_S"


def measure_import_s() -> float:
    """The median of 3 fresh interpreters' imports of torch and transformers, in seconds."""
    seconds = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch, transformers"], check=True, capture_output=True)
        seconds.append(time.monotonic() - started)
    return sorted(seconds)[1]


@cache
def slowdown() -> float:
    """This machine's import time over the tuned machine's, at least 1: what every timing bound is multiplied by."""
    measured = float(os.environ.get(ENVIRONMENT) or measure_import_s())
    return max(1.0, measured / TUNED_IMPORT_S)


def bound(tuned_s: float) -> float:
    """A timing bound tuned on the suite's machine, for this one."""
    return tuned_s * slowdown()
