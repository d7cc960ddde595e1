"""`python -m services.runner MODEL_ID [--revision R] [--backend cpu] ...`: test one model, print a report.

MODEL_ID is a Hub id, downloaded through huggingface_hub (honouring HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE);
`--local-dir DIR` runs a checkpoint directory instead. The flags are the fields of ``RunRequest``
(``shared.contracts.run``). By default the whole test runs (`--stage full`); a job runs it as its stages
(`accelerator` on the pinned cores, then `verdict` and for sharded runs `judge` on the host's CPUs), handing
over through `--artifacts`. Every model runs in child processes; this process downloads, launches, compares and
reports. The report is one JSON object on the last line of stdout (and in --report PATH). Exit status:
0 PASS (or an accelerator stage that leaves the verdict to come), 1 FAIL, 2 bad usage, 3 ERROR or SKIPPED.

The runner is a pure child: it opens no database and no broker, and its environment is the allow-listed
one the worker gives it.
"""

from __future__ import annotations

import sys

from services.runner.stages import run
from shared.contracts.enums import ErrorClass, Verdict
from shared.contracts.handoffs import write_model
from shared.contracts.report import Failure, RunReport, Subject
from shared.contracts.run import RunRequest
from shared.settings import get_runner_settings

EXIT_CODES = {None: 0, Verdict.PASS: 0, Verdict.FAIL: 1, Verdict.ERROR: 3, Verdict.SKIPPED: 3}


def main(argv: list[str] | None = None) -> int:
    request = RunRequest.from_argv(sys.argv[1:] if argv is None else argv)  # argparse exits 2 on bad usage
    settings = get_runner_settings()
    try:
        report = run(request, settings)
    except Exception as exc:  # a bug of ours still ends in a report, never in a silent exit
        report = RunReport(
            subject=Subject(model_id=request.model_id, task=request.task, backend=request.backend or settings.backend),
            verdict=Verdict.ERROR,
            failure=Failure(error_class=ErrorClass.internal, error_message=f"runner: {type(exc).__name__}: {exc}"),
        )
    if request.report:
        write_model(request.report, report)
    print(report.model_dump_json())
    return EXIT_CODES[report.verdict]


if __name__ == "__main__":
    sys.exit(main())
