"""The kinds of repo the Hub's lists hold that we do not run, each decided from metadata before any weights are
downloaded, and the row each gets:

- a PEFT adapter without weights of its own (``adapter_config.json``) → SKIPPED(adapter), naming its base model;
- weights only as GGUF, ONNX or MLX, which ``from_pretrained`` does not load → SKIPPED(format), naming it;
- a quantized checkpoint (config.json's ``quantization_config``) whose method the backend does not load →
  SKIPPED(quantized), naming the method; one it loads is sized from its stored dtypes and runs
  (``QUANTIZATION_LOADS`` says which backend loads which);
- a ``model_type`` the worker's transformers does not know → ERROR(unsupported_architecture), naming it. The
  worker's transformers is what counts, so the runner decides this one (``unknown_model_type``), after fetching
  config.json and before any weights; the API, which never imports transformers, enqueues such a model.

Pipeline tags we have no test for are refused by the submission itself (``shared.jobs.submission``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from typing import Any, NamedTuple

from shared.contracts.enums import ErrorClass, Verdict
from shared.hub.sizing import config_view


class Refusal(NamedTuple):
    """Why a model gets a row without running: the row's verdict, class and message."""

    verdict: Verdict
    error_class: ErrorClass
    reason: str


# Which backend loads which quantization method (``quantization_config.quant_method``; bitsandbytes under the
# names transformers gives its two modes, ``bitsandbytes_4bit`` and ``bitsandbytes_8bit``) — only where a test
# shows it load and run; every other method, and every method on a backend not listed, is SKIPPED(quantized).
# The backend is the service's (SUPPORTMATRIX_BACKEND): the API decides at submission, where it cannot ask the
# runner's backends, so their answers are kept here.
QUANTIZATION_LOADS: dict[str, frozenset[str]] = {
    # transformers dequantizes block-wise FP8 to the run dtype as it loads when no GPU or XPU is visible
    # (tests/test_repo_kinds.py runs one to a PASS through a worker). MXFP4 takes the same road on a CPU but
    # has not been run here; GPTQ (optimum, gptqmodel), AWQ (gptqmodel), bitsandbytes, compressed-tensors,
    # torchao and the rest need packages that neither image installs.
    "cpu": frozenset({"fp8"}),
    # Nothing has been run on trn2 yet: scripts/trn2-check.sh is where a method would be proven first.
    "neuron": frozenset(),
    "cuda": frozenset(),
}

# Weights from_pretrained loads, at the repo's top level (what the runner downloads).
_WEIGHTS_RE = re.compile(r"^(?!adapter_model\.)[^/]+\.safetensors$|^(pytorch_)?model[^/]*\.bin$")
_PIPELINE_WEIGHTS_RE = re.compile(r"^[^/]+/[^/]+\.(safetensors|bin)$")  # unet/diffusion_pytorch_model.safetensors
# Weight formats from_pretrained does not load, by file suffix.
_FOREIGN_FORMATS = {".gguf": "GGUF", ".onnx": "ONNX", ".onnx_data": "ONNX", ".onnx.data": "ONNX"}


def has_loadable_weights(files: Iterable[str]) -> bool:
    """Weights from_pretrained loads: at the top of the repo, or in a diffusers pipeline's component folders."""
    names = list(files)
    pipeline = "model_index.json" in names
    return any(_WEIGHTS_RE.match(f) or (pipeline and _PIPELINE_WEIGHTS_RE.match(f)) for f in names)


def is_adapter_only(files: Collection[str]) -> bool:
    """A PEFT adapter repo: its adapter_config.json, and no weights of a whole model beside it."""
    return "adapter_config.json" in files and not has_loadable_weights(files)


def adapter_refusal(model_id: str, base_model: str | None) -> Refusal:
    base = f" of {base_model}" if base_model else ""
    hint = f": test {base_model} itself" if base_model else ""
    reason = f"{model_id} is a PEFT adapter{base} (adapter_config.json) without weights of its own{hint}"
    return Refusal(Verdict.SKIPPED, ErrorClass.adapter, reason)


def format_refusal(model_id: str, files: Collection[str], library: str | None, tags: Collection[str]) -> Refusal | None:
    """SKIPPED(format) for a repo whose weights are only in a format from_pretrained does not load, else None."""
    if library == "mlx" or "mlx" in tags:
        reason = f"{model_id} holds MLX weights (library {library or 'mlx'}), which transformers does not load"
        return Refusal(Verdict.SKIPPED, ErrorClass.weights_format, reason)
    if has_loadable_weights(files):
        return None
    found: dict[str, list[str]] = {}
    for f in sorted(files):
        fmt = next((name for suffix, name in _FOREIGN_FORMATS.items() if f.endswith(suffix)), None)
        if fmt is not None:
            found.setdefault(fmt, []).append(f)
    if not found:
        return None  # no weights at all: sizing says so (unsizable)
    listed = "; ".join(f"{fmt} ({', '.join(names[:3])}{', ...' * (len(names) > 3)})" for fmt, names in found.items())
    reason = f"{model_id} has weights only as {listed}, which from_pretrained does not load (safetensors or .bin)"
    return Refusal(Verdict.SKIPPED, ErrorClass.weights_format, reason)


def quantization_method(config: dict[str, Any]) -> str | None:
    """The quantization method of a config.json (``quantization_config.quant_method``), or None."""
    quant = config_view(config).get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method") or "unknown").lower()
    if method == "bitsandbytes":
        bits = "4bit" if quant.get("load_in_4bit") else "8bit" if quant.get("load_in_8bit") else None
        method = f"bitsandbytes_{bits}" if bits else method
    return method


def quantization_refusal(model_id: str, method: str, backend: str) -> Refusal | None:
    """SKIPPED(quantized) naming the method when ``backend`` does not load it, else None."""
    loads = QUANTIZATION_LOADS.get(backend, frozenset())
    if method in loads:
        return None
    known = ", ".join(sorted(loads)) or "none"
    reason = (
        f"{model_id} is quantized with {method} (config.json quantization_config), which the {backend} backend "
        f"does not load (it loads: {known})"
    )
    return Refusal(Verdict.SKIPPED, ErrorClass.quantized, reason)


def unknown_model_type(config: dict[str, Any], knows: Callable[[str], bool], transformers_version: str) -> str | None:
    """Why transformers cannot build this config — ``knows`` says its ``model_type`` is not one it has — or None.

    A repo with code of its own (``auto_map``) is not judged here: its classes come with it, and whether that
    code may run is the remote-code rule's question.
    """
    model_type = config.get("model_type")
    if "auto_map" in config or not isinstance(model_type, str) or knows(model_type):
        return None
    architectures = ", ".join(config.get("architectures") or []) or "none given"
    return (
        f"model_type {model_type!r} (architectures: {architectures}) is not an architecture transformers "
        f"{transformers_version} knows"
    )
