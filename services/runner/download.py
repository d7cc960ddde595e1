"""Getting a checkpoint onto local disk through huggingface_hub (or taking a local directory as it is).

``python -m services.runner.download RUN-REQUEST-FLAGS`` only downloads (into HF_HOME): the worker runs it, as
its own user and with the Hub token, for a gated repo whose own code runs (services/worker/supervise.py); that
job's runner then never holds the token and finds the files offline (HF_HUB_OFFLINE=1) in the same Hub cache.
Exit status 0, or 3 with a RunReport of the failure at ``--report``.

With HF_HUB_OFFLINE set — by the worker for such a run, or by an operator for any — a download reads the Hub
cache only: the snapshot of the pinned commit, which must hold weights (and the repo's ``*.py`` when its code
runs), else ``RunFailure(download)``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from services.runner.failures import RunFailure, failure_report, stage_report
from shared.contracts.enums import ErrorClass, Verdict
from shared.contracts.handoffs import write_model
from shared.contracts.run import RunRequest
from shared.hub.client import TRANSPORT_ERRORS
from shared.hub.kinds import unknown_model_type
from shared.settings import get_runner_settings

# What from_pretrained reads; weights, READMEs, ONNX or GGUF copies and the like are not fetched.
_CONFIG_AND_TOKENIZER = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
# A diffusers pipeline's other copies of its weights (``unet/diffusion_pytorch_model.fp16.safetensors``), which
# from_pretrained without ``variant=`` does not load
PIPELINE_VARIANTS = ("fp16", "bf16", "fp32", "non_ema", "ema_only")
# No connection to the Hub at all (its type written: mypy reads no starred tuple in an ``except`` clause).
_NO_CONNECTION: tuple[type[Exception], ...] = (LocalEntryNotFoundError, *TRANSPORT_ERRORS)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    sha: str | None  # None for a local directory

    @property
    def content_id(self) -> str:
        """The commit, or for a local directory a digest of its files: what a stored reference is keyed by."""
        if self.sha:
            return self.sha
        digest = hashlib.sha1()
        for file in sorted(p for p in self.path.rglob("*") if p.is_file()):
            digest.update(file.relative_to(self.path).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(file.read_bytes()).digest())
        return digest.hexdigest()


def download(
    model: str, revision: str | None, local_dir: Path | None, retry_delays_s: list[float], with_code: bool = False
) -> Checkpoint:
    """The checkpoint on local disk; an unreachable Hub is retried after each of ``retry_delays_s``.

    ``model`` is always a Hub id — a directory of the same name in the working directory is not looked at;
    only an explicit ``local_dir`` runs a checkpoint directory (never a job's way in). ``with_code`` also
    fetches the repo's ``*.py`` (trust_remote_code), from the same pinned commit as its weights. A config whose
    model_type this transformers does not know ends the run before any weights are fetched:
    ``RunFailure(unsupported_architecture)``, naming it.
    """
    if local_dir is not None:
        if not local_dir.is_dir():
            raise RunFailure(ErrorClass.not_found, f"--local-dir {local_dir} is not a directory")
        check_architecture(local_dir / "config.json")
        return Checkpoint(path=local_dir.resolve(), sha=None)
    for delay in (*retry_delays_s, None):
        try:
            return _download(model, revision, with_code)
        except RunFailure as failure:
            if failure.error_class != ErrorClass.hub_unavailable or delay is None:
                raise
            time.sleep(delay)
    raise AssertionError("unreachable")


def _download(model: str, revision: str | None, with_code: bool) -> Checkpoint:
    if hub_constants.HF_HUB_OFFLINE:
        return _cached(model, revision, with_code)
    try:
        info = HfApi().model_info(model, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        # Safetensors when the repo has them; the PyTorch .bin copy only when it has nothing else.
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
        ignored = None
        if "model_index.json" in files:  # a diffusers pipeline: its components' default weights, one folder each
            weights = [f"*/{pattern}" for pattern in weights]
            ignored = [f"*.{variant}.*" for variant in PIPELINE_VARIANTS]
        code = ["*.py"] if with_code else []
        if "config.json" in files:  # judged before any weights come
            check_architecture(Path(hf_hub_download(model, "config.json", revision=info.sha)))
        path = snapshot_download(
            model, revision=info.sha, allow_patterns=_CONFIG_AND_TOKENIZER + weights + code, ignore_patterns=ignored
        )
    except GatedRepoError as exc:  # before RepositoryNotFoundError: it is a subclass
        raise RunFailure(ErrorClass.gated, f"{model} is gated: {exc}") from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise RunFailure(ErrorClass.not_found, f"{model}@{revision or 'main'}: {exc}") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        unavailable = status >= 500 or status == 429
        error_class = ErrorClass.hub_unavailable if unavailable else ErrorClass.download
        raise RunFailure(error_class, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    except _NO_CONNECTION as exc:
        raise RunFailure(ErrorClass.hub_unavailable, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    except OSError as exc:
        raise RunFailure(ErrorClass.download, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    return Checkpoint(path=Path(path), sha=info.sha)


# What a snapshot must hold for a run: weights in a format from_pretrained loads, and its code when that runs.
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _cached(model: str, revision: str | None, with_code: bool) -> Checkpoint:
    """Offline (HF_HUB_OFFLINE): the snapshot already in the Hub cache — what the worker downloaded for this run,
    the repo's code with it when it has some. Its folder is named by its commit. A snapshot without weights, or
    without the repo's ``*.py`` when its code runs (a config fetched alone, a download cut short), is no
    checkpoint: ``RunFailure(download)``."""
    try:
        path = Path(snapshot_download(model, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, OSError) as exc:
        raise RunFailure(ErrorClass.download, f"{model}@{revision or 'main'} is not in the Hub cache: {exc}") from exc
    missing = missing_from_snapshot({p.name for p in path.rglob("*") if p.is_file()}, with_code)
    if missing:
        raise RunFailure(ErrorClass.download, f"the Hub cache's snapshot of {model} at {path.name} has no {missing}")
    check_architecture(path / "config.json")
    return Checkpoint(path=path, sha=path.name)


def missing_from_snapshot(names: set[str], with_code: bool) -> str | None:
    """What a snapshot of these file names lacks to be run, said; None when it lacks nothing."""
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in names):
        return "weights (*.safetensors or *.bin)"
    if with_code and not any(name.endswith(".py") for name in names):
        return "code of its own (*.py), which its run needs"
    return None


def check_architecture(config_path: Path) -> None:
    """Raise RunFailure(unsupported_architecture) when config.json names a model_type this process's transformers
    does not know (``shared.hub.kinds.unknown_model_type``); a missing or unreadable config is left to the load."""
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(config, dict):
        return
    refusal = unknown_model_type(config, knows_model_type, version("transformers"))
    if refusal is not None:
        raise RunFailure(ErrorClass.unsupported_architecture, refusal)


def knows_model_type(model_type: str) -> bool:
    """Whether this transformers' AutoConfig builds ``model_type`` (``CONFIG_MAPPING_NAMES``)."""
    return model_type in _generated_model_types() or model_type in _all_model_types()


@cache
def _generated_model_types() -> frozenset[str]:
    """Most of the table, read without importing transformers (which imports torch: ~3 s before the first byte
    of a download). Since transformers 5 it is a generated module of literals, ``auto_mappings``, that
    configuration_auto extends with a few more; empty where there is no such module, or it is no longer one
    that stands alone (then every question goes to the whole table)."""
    spec = importlib.util.find_spec("transformers")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / "models" / "auto" / "auto_mappings.py"
        generated = importlib.util.spec_from_file_location("_supportmatrix_auto_mappings", path)
        if path.is_file() and generated is not None and generated.loader is not None:
            module = importlib.util.module_from_spec(generated)
            try:
                generated.loader.exec_module(module)
            except Exception:  # e.g. a relative import in a later version: the whole table answers instead
                return frozenset()
            return frozenset(getattr(module, "CONFIG_MAPPING_NAMES", ()))
    return frozenset()


@cache
def _all_model_types() -> frozenset[str]:
    """The whole table: asked only about a model_type the generated part does not hold."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


def main(argv: list[str]) -> int:
    """Download what ``RunRequest`` names (its repo's code with it when trust_remote_code) and exit 0; a
    failure is a RunReport at its ``--report`` (the stage's report, as the runner writes it) and exit 3."""
    request = RunRequest.from_argv(argv)
    settings = get_runner_settings()
    try:
        checkpoint = download(request.model_id, request.revision, request.local_dir, settings.hub_retry_delays_s,
                              with_code=request.trust_remote_code)  # fmt: skip
    except RunFailure as failure:
        started = stage_report(request, request.backend or settings.backend, settings.host_name)
        report = failure_report(started, failure, Verdict.ERROR)
        if request.report is not None:
            write_model(request.report, report)
        print(report.model_dump_json())
        return 3
    print(checkpoint.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
