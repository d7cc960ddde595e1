"""Getting a checkpoint onto local disk through huggingface_hub (or taking a local directory as it is)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from services.worker.runner.failures import RunFailure
from shared.enums import ErrorClass

# What from_pretrained reads; weights, READMEs, ONNX or GGUF copies and the like are not fetched.
_CONFIG_AND_TOKENIZER = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    sha: str | None  # None for a local directory


def download(model: str, revision: str | None) -> Checkpoint:
    local = Path(model)
    if local.is_dir():
        return Checkpoint(path=local.resolve(), sha=None)
    try:
        info = HfApi().model_info(model, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        # Safetensors when the repo has them; the PyTorch .bin copy only when it has nothing else.
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
        path = snapshot_download(model, revision=info.sha, allow_patterns=_CONFIG_AND_TOKENIZER + weights)
    except GatedRepoError as exc:  # before RepositoryNotFoundError: it is a subclass
        raise RunFailure(ErrorClass.gated, f"{model} is gated: {exc}") from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise RunFailure(ErrorClass.not_found, f"{model}@{revision or 'main'}: {exc}") from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise RunFailure(ErrorClass.download, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    return Checkpoint(path=Path(path), sha=info.sha)
