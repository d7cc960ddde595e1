"""The main job on embedded defaults, end to end on real parts (`bash scripts/demo.sh`).

Uses the Redis that answers at the configured URL or starts one, SQLite under .data/demo, starts the API
(uvicorn), the host launcher (its workers of both stages), a collector and beat (the reconciler), builds
tiny checkpoints and serves them through the local Hub
stand-in, creates an admin token (`supportmatrix tokens create`), submits the models and follows them to
their verdicts with `supportmatrix submit ... --wait` (the command a user runs), prints the results table
(`supportmatrix results`) and the Parquet path, then stops everything it started. Exit status 0 when every
model ends PASS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.processes import free_port  # noqa: E402
from testing.hub_standin import use_hub_standin  # noqa: E402
from testing.services import CLI, Started, admin_token, ensure_redis, spawn, wait_until  # noqa: E402

DEMO_MODELS = ("tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-qwen3-moe")  # testing/tiny_models.py's
SPEECH_MODEL = "tiny-whisper"  # testing/tiny_speech.py's: the automatic-speech-recognition task on the same stack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".data" / "demo")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="what the cpu backend gives torch.compile; aot_eager skips C++ codegen (~5 s instead of ~45 s)",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds to wait for all results")
    parser.add_argument(
        "--keep", action="store_true", help="keep the stack running after the results (Ctrl-C stops it), to browse /"
    )
    args = parser.parse_args(argv)

    data_dir = args.data_dir.resolve()
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    hub_port, api_port = free_port(), free_port()
    os.environ.update(
        {"SUPPORTMATRIX_DATA_DIR": str(data_dir), "SUPPORTMATRIX_CPU_COMPILE_BACKEND": args.compile_backend}
    )
    use_hub_standin(f"http://127.0.0.1:{hub_port}", data_dir / "hf-home")

    from shared.settings import get_settings

    settings = get_settings()
    started = Started()
    try:
        step(f"Redis at {settings.redis_url}")
        ensure_redis(settings.redis_url, started)
        step(f"SQLite at {settings.database_url}: migrating")
        from shared.db.migrate import upgrade

        upgrade()
        step("an admin token for the demo's submissions: supportmatrix tokens create demo --scope admin")
        os.environ["SUPPORTMATRIX_API_TOKEN"] = admin_token("demo")

        step("building tiny checkpoints")
        from testing.hub_standin import HubStandin
        from testing.tiny_models import build
        from testing.tiny_speech import whisper

        build(data_dir / "models", list(DEMO_MODELS))
        speech = whisper(data_dir / "models" / SPEECH_MODEL)
        models = [f"demo/{model}" for model in (*DEMO_MODELS, SPEECH_MODEL)]
        hub = HubStandin(port=hub_port)
        hub.add_dir(data_dir / "models", org="demo")
        # served with its task's tag, as the Hub tags a Whisper (submission picks the task by it)
        hub.add(models[-1], speech, pipeline_tag="automatic-speech-recognition", library_name="transformers")
        hub.start()
        step(f"Hub stand-in at {hub.url} serving {', '.join(models)}")

        logs = data_dir / "logs"
        logs.mkdir()
        host_cores = os.cpu_count() or 1
        started.processes += [
            spawn(logs / "api.log", "-m", "uvicorn", "services.api.main:app", "--port", str(api_port)),
            # one worker per core group of this host (two 1-core groups on a 2-CPU machine)
            spawn(logs / "workers.log", "-m", "services.worker.host", "--cores", str(host_cores)),
            spawn(
                logs / "collector.log", "-m", "celery", "-A", "services.worker.celery_app:app", "worker",
                "--queues", "supportmatrix.control", "--pool", "solo", "--hostname", "demo-collector@%h",
            ),
            # beat sends the reconciler: whatever a lost message strands is sent again
            spawn(
                logs / "beat.log", "-m", "celery", "-A", "services.worker.celery_app:app", "beat",
                "--scheduler", "services.worker.beat:LockedScheduler", "--schedule", str(data_dir / "beat-schedule"),
            ),
        ]  # fmt: skip
        api = os.environ["SUPPORTMATRIX_API_URL"] = f"http://127.0.0.1:{api_port}"
        wait_until(lambda: get(api, "/healthz", ok=True), 60, "the API to answer /healthz")
        step(f"API at {api}")
        wait_until(lambda: get(api, "/workers"), 300, "the workers to register")
        workers = get(api, "/workers")
        worker = workers[0]
        names = ", ".join(f"{w['name']} (cores {w['cores']})" for w in workers)
        step(f"workers {names} serve {worker['compiler_version']}, transformers {worker['library_version']}")

        # The user's way in: SUPPORTMATRIX_API_URL and SUPPORTMATRIX_API_TOKEN are set above, in the environment.
        step(f"supportmatrix submit {' '.join(models)} --wait   (logs in {logs})")
        submitted = cli("submit", *models, "--wait", "--timeout", str(args.timeout))

        rows = get(api, "/results", params={"compiler": worker["compiler_version"]})["items"]
        export = settings.export_path / "data"
        wait_until(lambda: len(parquet_rows(export)) >= len(rows), 60, "the collector's Parquet export")
        step(f"supportmatrix results --compiler {worker['compiler_version']}")
        cli("results", "--compiler", worker["compiler_version"])
        step(f"Parquet: {export}")
        import pandas as pd

        df = pd.read_parquet(export)
        seed = df[df.model_id == "demo/tiny-llama"][
            ["neuronx_cc", "library", "library_version", "neuron_cores", "result"]
        ]
        print(f'    df = pd.read_parquet("{export}")')
        print('    df[df.model_id == "demo/tiny-llama"][["neuronx_cc", "library", "library_version", '
              '"neuron_cores", "result"]]')  # fmt: skip
        print("    " + seed.to_string(index=False).replace("\n", "\n    "))
        passed = submitted == 0 and len(rows) == len(models) and all(r["result"] == "PASS" for r in rows)
        step("every model PASS" if passed else "not every model passed: see the table and the logs")
        step(f"results page: {api}/  (a model: {api}/model/demo/tiny-llama)")
        if args.keep:
            step("--keep: the stack keeps running; Ctrl-C (or SIGTERM) stops it")
            # A shell starts a background job with SIGINT ignored: take both signals back, so either stops it cleanly.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return 0 if passed else 1
    finally:
        step("stopping what the demo started")
        started.stop()


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


def get(api: str, path: str, params: dict[str, Any] | None = None, ok: bool = False) -> Any:
    import httpx

    try:
        response = httpx.get(api + path, params=params, timeout=10)
    except httpx.HTTPError:
        return None
    if ok:
        return response.status_code == 200
    response.raise_for_status()
    return response.json()


def cli(*args: str) -> int:
    """Run `supportmatrix ARGS` as a user would, its output on this terminal; its exit status."""
    return subprocess.run([str(CLI), *args], cwd=ROOT).returncode


def parquet_rows(export: Path) -> Any:
    import pandas as pd

    if not any(export.glob("*.parquet")):
        return pd.DataFrame()
    df = pd.read_parquet(export)
    return df[["model_id", "neuronx_cc", "library", "library_version", "neuron_cores", "result"]]


if __name__ == "__main__":
    sys.exit(main())
