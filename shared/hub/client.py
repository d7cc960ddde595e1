"""Talking to the Hub (or to the stand-in that HF_ENDPOINT names) about a model, before any download."""

from __future__ import annotations

import importlib
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from cachetools import TTLCache
from huggingface_hub import HfApi, hf_hub_download, set_client_factory
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from shared.contracts.enums import SweepView
from shared.hub.sizing import ModelShape, config_dtype, parameters_from_file_sizes, shape_from_config
from shared.settings import get_settings


def _transport_errors() -> tuple[type[Exception], ...]:
    """Connection-level failures of the HTTP client huggingface_hub uses (httpx, or httpx2 since 2.x)."""
    found = []
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


TRANSPORT_ERRORS = _transport_errors()
# The Hub out of reach (connection refused, DNS, timeouts), and what a listing may raise. Each is a tuple with its
# type written: mypy reads no starred tuple in an ``except`` clause.
UNREACHABLE: tuple[type[Exception], ...] = (OSError, *TRANSPORT_ERRORS)
_LISTING_ERRORS: tuple[type[Exception], ...] = (HfHubHTTPError, *UNREACHABLE)

# The Hub's repo-id grammar, narrowed to "org/name": letters, digits, '-', '_', '.', at most 96 each,
# not starting or ending with '-' or '.', no '--' or '..'.
_PART = r"(?!.*(?:--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
MODEL_ID_PATTERN = rf"^{_PART}/{_PART}$"
_MODEL_ID_RE = re.compile(MODEL_ID_PATTERN)
# A branch, tag or commit sha: no whitespace, no control characters, no "..".
REVISION_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$"
_REVISION_RE = re.compile(REVISION_PATTERN)


def is_model_id(value: str) -> bool:
    return bool(_MODEL_ID_RE.fullmatch(value)) and not value.endswith(".git")


def is_revision(value: str) -> bool:
    return bool(_REVISION_RE.fullmatch(value))


class HubError(Exception):
    """Base of what the Hub answered that stops a submission."""


class ModelNotFound(HubError):
    pass


class RevisionNotFound(HubError):
    pass


class HubUnavailable(HubError):
    pass


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str
    sha: str
    gated: bool
    pipeline_tag: str | None
    parameters: dict[str, int] = field(default_factory=dict)  # safetensors parameter counts per dtype
    files: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    library_name: str | None = None  # transformers, peft, mlx, gguf, ...

    @property
    def needs_remote_code(self) -> bool:
        """The Hub tags repos whose config maps classes to code in the repo (trust_remote_code)."""
        return "custom_code" in self.tags


EXPAND = ["sha", "siblings", "safetensors", "gated", "pipeline_tag", "library_name", "tags"]


@lru_cache
def _model_info_cache() -> TTLCache[tuple[str, str | None], ResolvedModel]:
    # A branch moves, so an answer is kept only a few minutes; failures are not kept (a repo may appear).
    return TTLCache(maxsize=4096, ttl=get_settings().hub_info_cache_s)


# cachetools caches are not thread-safe, and submissions resolve from several threads at once.
_model_info_lock = threading.Lock()


def resolve_model(
    model_id: str, revision: str | None = None, timeout_s: float | None = None, fresh: bool = False
) -> ResolvedModel:
    """The commit a (model, revision) points at, as the Hub said at most ``hub_info_cache_s`` ago (``fresh``:
    now — a sweep must see a commit pushed a minute ago); raises a HubError subclass with a reason.
    ``timeout_s`` defaults to ``hub_timeout_s``."""
    cache = _model_info_cache()
    with _model_info_lock:
        cached = None if fresh else cache.get((model_id, revision))
    if cached is not None:
        return cached
    model = _fetch_model_info(model_id, revision, timeout_s or get_settings().hub_timeout_s)
    with _model_info_lock:
        cache[(model_id, revision)] = model
    return model


def _fetch_model_info(model_id: str, revision: str | None, timeout_s: float) -> ResolvedModel:
    try:
        info = HfApi().model_info(model_id, revision=revision, timeout=timeout_s, expand=EXPAND)  # type: ignore[arg-type]
    except RevisionNotFoundError as exc:
        raise RevisionNotFound(f"revision {revision!r} of {model_id} does not exist on the Hub") from exc
    except GatedRepoError as exc:  # a subclass of RepositoryNotFoundError: test it first
        raise ModelNotFound(f"{model_id} is gated and the configured token may not read it") from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFound(f"{model_id} does not exist on the Hub, or is private") from exc
    except OfflineModeIsEnabled as exc:
        raise HubUnavailable("HF_HUB_OFFLINE is set: the Hub cannot be asked about models") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        # A 404 without the Hub's error code (a revision with a '/' that routes nowhere): not found all the same.
        if status == 404 and revision is not None:
            raise RevisionNotFound(f"revision {revision!r} of {model_id} does not exist on the Hub") from exc
        if status == 404:
            raise ModelNotFound(f"{model_id} does not exist on the Hub, or is private") from exc
        raise HubUnavailable(f"the Hub answered {status or '?'}") from exc
    except UNREACHABLE as exc:
        raise HubUnavailable(f"the Hub is unreachable: {exc.__class__.__name__}: {exc}") from exc
    if not info.sha:
        raise HubUnavailable(f"the Hub gave no commit sha for {model_id}")
    return ResolvedModel(
        model_id=info.id or model_id,
        sha=info.sha,
        gated=bool(info.gated),
        pipeline_tag=info.pipeline_tag,
        parameters=dict(info.safetensors.parameters) if info.safetensors else {},
        files=tuple(s.rfilename for s in info.siblings or []),
        tags=tuple(info.tags or []),
        library_name=info.library_name,
    )


# The sweep views the Hub ranks, each by its sort (list_models' sort, also the score's ModelInfo attribute); the
# selected view is the configured list, not the Hub's.
HubSort = Literal["trending_score", "downloads"]  # the sorts list_models takes that these views use
HUB_RANKINGS: dict[SweepView, HubSort] = {SweepView.trending: "trending_score", SweepView.downloads: "downloads"}


@dataclass(frozen=True)
class Listed:
    model_id: str
    view: SweepView  # one of HUB_RANKINGS
    rank: int  # 1-based


def list_top(pipeline_tags: Sequence[str], view: SweepView, limit: int) -> list[Listed]:
    """The Hub's top ``limit`` models over ``pipeline_tags`` (one task's) by ``view``'s score (``HUB_RANKINGS``): one
    ranking — each tag's top ``limit`` merged by the score the Hub sorted them by, a model listed under two tags
    once — as the Hub's model pages rank them."""
    sort = HUB_RANKINGS[view]
    scored: dict[str, float] = {}
    try:
        for tag in pipeline_tags:
            for m in HfApi().list_models(pipeline_tag=tag, sort=sort, limit=limit):
                scored[m.id] = max(scored.get(m.id, 0.0), float(getattr(m, sort) or 0))
    except _LISTING_ERRORS as exc:
        raise HubUnavailable(f"listing {', '.join(pipeline_tags)} by {view}: {exc}") from exc
    ranked = sorted(scored, key=lambda model_id: -scored[model_id])[:limit]  # stable: the Hub's order breaks ties
    return [Listed(model_id, view, rank) for rank, model_id in enumerate(ranked, start=1)]


class Unsizable(HubError):
    pass


class Gated(HubError):
    pass


def read_json(model: ResolvedModel, filename: str, timeout_s: float | None = None) -> dict[str, Any]:
    """A small JSON file of the repo at the resolved commit, read-only. Raises Gated, or Unsizable when it is
    missing or unreadable. ``timeout_s`` defaults to ``hub_timeout_s``. A file at a commit never changes: what was
    read once is kept (``_pinned_json``), so that a second submission of a model reads no file."""
    return _pinned_json(model.model_id, model.sha, filename, timeout_s)


@lru_cache(maxsize=4096)  # exceptions are not kept: a missing file is asked for again
def _pinned_json(model_id: str, sha: str, filename: str, timeout_s: float | None) -> dict[str, Any]:
    try:
        path = hf_hub_download(model_id, filename, revision=sha, etag_timeout=timeout_s or get_settings().hub_timeout_s)
        content = json.loads(Path(path).read_text())
    except GatedRepoError as exc:
        raise Gated(f"{model_id} is gated and the configured token (HF_TOKEN) may not read it") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise Unsizable(f"{model_id} has no readable {filename}: {exc}") from exc
    if not isinstance(content, dict):
        raise Unsizable(f"{model_id}: {filename} is not a JSON object")
    return content


def adapter_base(model: ResolvedModel) -> str | None:
    """The base model an adapter repo names (adapter_config.json's base_model_name_or_path), if it says."""
    try:
        base = read_json(model, "adapter_config.json").get("base_model_name_or_path")
    except HubError:
        return None
    return base if isinstance(base, str) and base else None


def model_shape(
    model: ResolvedModel, config: dict[str, Any] | None = None, timeout_s: float | None = None
) -> ModelShape:
    """Size inputs without downloading weights: safetensors metadata (or weight file sizes) + config.json
    (read here unless given). ``timeout_s`` defaults to ``hub_timeout_s``."""
    if config is None:
        config = read_json(model, "config.json", timeout_s)
    parameters = sum(model.parameters.values())
    if parameters:
        return shape_from_config(parameters, config, model.parameters)
    weights = [f for f in model.files if f.endswith((".bin", ".pt", ".pth", ".safetensors"))]
    if not weights:
        raise Unsizable(f"{model.model_id} has neither safetensors metadata nor weight files")
    infos = HfApi().get_paths_info(model.model_id, weights, revision=model.sha)
    total = sum(getattr(i, "size", 0) or 0 for i in infos)
    if not total:
        raise Unsizable(f"{model.model_id}: the Hub gives no size for {weights}")
    return shape_from_config(parameters_from_file_sizes(total, config_dtype(config)), config)


def bound_hub_requests(timeout_s: float) -> None:
    """Give every Hub request of this process a timeout. huggingface_hub's shared client has none
    (``timeout=None``), and some calls (``get_paths_info``) take no timeout argument, so without this a
    Hub that accepts a connection and never answers holds the calling thread for good. For processes that
    only ask the Hub about models (the API): a download's pauses can be longer."""
    # The default factory adds huggingface_hub's request hooks (offline mode, request ids); it has no public
    # name, so it is wrapped rather than rebuilt.
    from huggingface_hub.utils._http import default_client_factory

    def bounded_client():
        client = default_client_factory()
        client.timeout = timeout_s
        return client

    set_client_factory(bounded_client)
