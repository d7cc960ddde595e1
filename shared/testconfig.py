"""What a test runs, per task: defined once, hashed into every job's identity.

A change here (another prompt, more tokens, other sentences) is a new test: jobs made under the old
configuration do not count as done for the new one.
"""

from __future__ import annotations

import hashlib
import json

from shared.contracts.enums import Task

PROMPT = "The history of the printing press begins in"
NEW_TOKENS = 32
SENTENCES = [
    "The history of the printing press begins in the fifteenth century.",
    "A quick brown fox jumps over the lazy dog.",
    "Compilers turn programs into instructions that a machine can run.",
    "Trainium is a machine learning accelerator built by AWS.",
    "Il pleut sur la ville depuis ce matin.",
]
VERDICT_RULE_VERSION = 1

CONFIGS: dict[str, dict[str, object]] = {
    Task.text_generation.value: {"prompt": PROMPT, "new_tokens": NEW_TOKENS, "rule": VERDICT_RULE_VERSION},
    Task.feature_extraction.value: {"sentences": SENTENCES, "pooling": "mean", "rule": VERDICT_RULE_VERSION},
}


def config_hash(task: str) -> str:
    body = json.dumps({"task": task, **CONFIGS[task]}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def reference_key(model_id: str, sha: str, task: str, dtype: str, library_version: str, torch_version: str) -> str:
    """The key of a stored CPU reference: what determines its output — the commit, the task and its test config,
    the dtype, the library and torch versions."""
    parts = [model_id, sha, task, config_hash(task), dtype, library_version, torch_version]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()
