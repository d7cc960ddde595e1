"""`python -m services.runner.describe [--backend B]`: the runtime this machine serves, as one JSON line.

The worker asks this once at start (it never imports torch itself); the answer comes from a runner child.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from services.runner.backends import BACKENDS
from services.runner.launch import run_child
from services.runner.specs import DescribeSpec
from shared.contracts.run import RuntimeInfo
from shared.settings import get_runner_settings, inherited_environment

# Importing the backend's packages, not running a model: the job's own limit (seconds, in some tests) does not
# apply, and a loaded host may take a while to import torch.
DESCRIBE_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    settings = get_runner_settings()
    parser = argparse.ArgumentParser(prog="python -m services.runner.describe", description=__doc__)
    parser.add_argument("--backend", choices=sorted(BACKENDS), default=settings.backend)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="describe-") as tmp:
        spec = DescribeSpec(backend=args.backend)
        info = run_child(spec, RuntimeInfo, inherited_environment({}), DESCRIBE_TIMEOUT_S, Path(tmp))
    print(info.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
