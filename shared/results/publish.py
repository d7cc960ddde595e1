"""Pushing the export to a Hub dataset repo: the Parquet files and a dataset card, one commit per export run.

The card's YAML lists one config per file (one library under one software stack: its name is the file's,
``<compiler version>--<library>-<library version>--stack-<digest>``), so the Hub's viewer and
`datasets.load_dataset(repo, config)` read each on its own; every row carries `schema_version`. The Hub
caps commits per repo per hour, so a push happens only when the files differ from what was last pushed
(a fingerprint kept beside the export), and it is one commit for all files.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi

from shared.results.records import SCHEMA_VERSION

PUSHED_MARKER = ".pushed"


def config_name(parquet: Path) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", parquet.stem)


def dataset_card(data_files: list[Path]) -> str:
    configs = "\n".join(f"- config_name: {config_name(p)}\n  data_files: data/{p.name}" for p in sorted(data_files))
    return f"""---
license: apache-2.0
tags:
- neuron
- trainium
- transformers
configs:
{configs}
---

# Which Hugging Face models run unmodified on AWS Trainium2

One row per (model, task) and per file; one file (and config) per library and software stack: neuronx-cc (or
inductor-<torch> on cpu), torch, torch-neuronx, the Neuron runtime and transformers. A config is named
`<compiler version>--<library>-<library version>--stack-<digest>`, the digest a short hash of the whole stack, so
one compiler version with two torch-neuronx builds is two configs; each row states its stack's versions
(`torch_version`, `torch_neuronx_version`, `neuron_runtime_version`).
Columns `model_id, neuronx_cc, library, library_version, neuron_cores, result` follow
`aws-neuron/torch-neuronx-model-support`; the rest are supportmatrix's evidence and provenance.
`result` is PASS, FAIL, ERROR, SKIPPED or FLAKY (repeated runs disagreed). Schema version {SCHEMA_VERSION}.
"""


def fingerprint(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@dataclass
class PushOutcome:
    pushed: bool
    commit: str | None
    files: int


def publish(export_dir: Path, repo_id: str, token: str | None, endpoint: str | None = None) -> PushOutcome:
    """Push ``<export_dir>/data/*.parquet`` and README.md to ``repo_id`` when they changed since the last push,
    in one commit: the collector calls it once per export run, so a window of results makes one commit.
    ``endpoint``: another Hub than HF_ENDPOINT's (which huggingface_hub reads once, at import)."""
    data_files = sorted((export_dir / "data").glob("*.parquet"))
    card = export_dir / "README.md"
    card.write_text(dataset_card(data_files))
    marker = export_dir / PUSHED_MARKER
    current = fingerprint([*data_files, card])
    if marker.exists() and marker.read_text() == current:
        return PushOutcome(pushed=False, commit=None, files=len(data_files))
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, repo_type="dataset", exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id,
        repo_type="dataset",
        folder_path=export_dir,
        allow_patterns=["README.md", "data/*.parquet"],
        delete_patterns=["data/*.parquet"],  # a file no longer exported leaves the repo too
        commit_message=f"supportmatrix export: {len(data_files)} files",
    )
    marker.write_text(current)
    return PushOutcome(pushed=True, commit=getattr(info, "oid", None), files=len(data_files))
