"""A job's test: its task's test config (``tasks.<task>``, defined once there) and the settings that decide its
verdict, hashed into every job's identity.

A change of a task's test config (another prompt, more tokens, other sentences, any threshold of the verdict) is a
new test: jobs made under the old configuration do not count as done for the new one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from shared.contracts.enums import Task
from shared.settings import VERDICT_SETTINGS, Settings
from tasks import SHARDED_TASKS, declaration


def test_config(task: str) -> dict[str, object]:
    """Everything that decides what a ``task`` test runs and how it is judged, read from its declaration when asked
    (so that no copy of a threshold can fall behind)."""
    return declaration(task).config()


def verdict_settings(settings: Settings, task: str, cores: int) -> dict[str, object]:
    """The values of the settings that decide the verdict of a job of ``task`` over ``cores`` (``SettingRole.verdict``),
    as its identity hashes them: a sharded run's (a task that shards: text-generation); none for any other."""
    if Task(task) not in SHARDED_TASKS or cores <= 1:
        return {}
    return {name: getattr(settings, name) for name in VERDICT_SETTINGS}


def config_hash(task: str, deciding: Mapping[str, object] | None = None) -> str:
    """A job's test: ``task``'s test config and the settings that decide its verdict (``deciding``, from
    ``verdict_settings``: a sharded text-generation run's judge and MoE split). Without them (none decide it, or a
    CPU reference's key, which no setting changes), the test config's alone."""
    settings = {"settings": dict(deciding)} if deciding else {}
    body = json.dumps({"task": task, **test_config(task), **settings}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def planned_config_hash(task: str, cores: int, settings: Settings) -> str:
    """The test a job of ``task`` over ``cores`` is, as a process configured with ``settings`` plans or runs it: the
    API hashes it into the job's identity, and a worker runs only a job whose hash is its own (``shared.jobs.lease.
    refuse_other_test``), so that a row never says it ran the test it was planned as under another judge or split."""
    return config_hash(task, verdict_settings(settings, task, cores))


def reference_key(
    model_id: str, sha: str, task: str, dtype: str, library_version: str, torch_version: str, pipeline: str = ""
) -> str:
    """The key of a stored CPU reference: what determines its output — the commit, the task and its test config,
    the dtype, the library and torch versions, and the task's own pipeline library and version when it has one
    (sentence-transformers, diffusers: "diffusers 0.42.1")."""
    parts = [model_id, sha, task, config_hash(task), dtype, library_version, torch_version, pipeline]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()
