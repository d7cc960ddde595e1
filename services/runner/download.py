"""Getting a checkpoint onto local disk through huggingface_hub (or taking a local directory as it is)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from services.runner.failures import RunFailure
from shared.contracts.enums import ErrorClass
from shared.hub.client import TRANSPORT_ERRORS
from shared.hub.kinds import unknown_model_type

# What from_pretrained reads; weights, READMEs, ONNX or GGUF copies and the like are not fetched.
_CONFIG_AND_TOKENIZER = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]
# A diffusers pipeline's other copies of its weights (``unet/diffusion_pytorch_model.fp16.safetensors``), which
# from_pretrained without ``variant=`` does not load
PIPELINE_VARIANTS = ("fp16", "bf16", "fp32", "non_ema", "ema_only")


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
    except (LocalEntryNotFoundError, *TRANSPORT_ERRORS) as exc:  # no connection to the Hub at all
        raise RunFailure(ErrorClass.hub_unavailable, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    except OSError as exc:
        raise RunFailure(ErrorClass.download, f"{type(exc).__name__}: {exc}"[:4000]) from exc
    return Checkpoint(path=Path(path), sha=info.sha)


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
