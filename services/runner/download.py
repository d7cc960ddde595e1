"""Getting a checkpoint onto local disk through huggingface_hub (or taking a local directory as it is)."""

from __future__ import annotations

import hashlib
import time
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

from services.runner.failures import RunFailure
from shared.enums import ErrorClass
from shared.hub.client import TRANSPORT_ERRORS

# What from_pretrained reads; weights, READMEs, ONNX or GGUF copies and the like are not fetched.
_CONFIG_AND_TOKENIZER = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]


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
    fetches the repo's ``*.py`` (trust_remote_code), from the same pinned commit as its weights.
    """
    if local_dir is not None:
        if not local_dir.is_dir():
            raise RunFailure(ErrorClass.not_found, f"--local-dir {local_dir} is not a directory")
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
    try:
        info = HfApi().model_info(model, revision=revision)
        files = [s.rfilename for s in info.siblings or []]
        # Safetensors when the repo has them; the PyTorch .bin copy only when it has nothing else.
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["*.bin"]
        code = ["*.py"] if with_code else []
        path = snapshot_download(model, revision=info.sha, allow_patterns=_CONFIG_AND_TOKENIZER + weights + code)
    except GatedRepoError as exc:  # before RepositoryNotFoundError: it is a subclass
        raise RunFailure(ErrorClass.gated, f"{model} is gated: {exc}") from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise RunFailure(ErrorClass.not_found, f"{model}@{revision or 'main'}: {exc}") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        unavailable = status >= 500 or status == 429
        error_class = ErrorClass.hub_unavailable if unavailable else ErrorClass.download
        raise RunFailure(error_class, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    except (LocalEntryNotFoundError, *TRANSPORT_ERRORS) as exc:  # no connection to the Hub at all
        raise RunFailure(ErrorClass.hub_unavailable, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    except OSError as exc:
        raise RunFailure(ErrorClass.download, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    return Checkpoint(path=Path(path), sha=info.sha)
