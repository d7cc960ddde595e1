"""What a runner is asked to do (``RunRequest``), and what runs it (``RuntimeInfo``).

The worker writes a ``RunRequest``; the runner's command line, the worker's command and the reproduce command
are all derived from it (``to_argv`` / ``from_argv``), so a flag is spelled once.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from shared.contracts.enums import BackendName, Stage, Task
from shared.contracts.fields import Str16, Str32, Str64, Str100

LIBRARY = "transformers"
RUNNER_MODULE = "services.runner"
# The core-group sizes a job may ask for and sizing hands out: the widths a model is sharded over.
CoreCount = Literal[1, 2, 4, 8, 16]
CORE_SIZES: tuple[CoreCount, ...] = get_args(CoreCount)


class RuntimeVersions(BaseModel):
    """The versions of what ran, as the runner found them installed: the part of a runtime a result row keeps.

    A release of any but the compiler's build string is a new test (``IDENTITY_VERSIONS``, the ``Stack``): a
    TorchNeuron or torch build on the same neuronx-cc, or another runtime library, is never "already tested".
    """

    compiler_version: Str100  # as published: what users type (neuronx-cc's package version, inductor-<torch>)
    library_version: Str64
    torch_version: Str64 | None = None  # None on a job settled before any runner said
    torch_neuronx_version: Str64 = ""  # TorchNeuron's package (neuron; "" elsewhere)
    neuron_runtime_version: Str64 = ""  # aws-neuronx-runtime-lib (neuron; "" elsewhere)
    # The compiler's full build string (neuronx-cc's with its +hash, as the NEFF cache namespaces it): provenance;
    # the published version above names the release.
    compiler_build: Str100 = ""


class Stack(BaseModel):
    """The whole software stack a job is planned for and runs on: neuronx-cc (or inductor-<torch>), torch,
    TorchNeuron, the Neuron runtime and transformers, by version ("" where a backend has none: the Neuron fields on
    cpu, or a torch no runner has said). It routes a job (its queue), keys its cell, its diff and its Parquet file,
    and a worker runs only the jobs of its own."""

    model_config = ConfigDict(frozen=True)

    compiler_version: Str100
    torch_version: Str64 = ""
    torch_neuronx_version: Str64 = ""
    neuron_runtime_version: Str64 = ""
    library_version: Str64

    @property
    def digest(self) -> str:
        """A short name of the stack, stable across processes and releases of this code: the first
        ``STACK_DIGEST_LENGTH`` hex digits of the SHA-256 of its versions in field order, each followed by a
        newline. Queue and file names carry it, so that they stay short and safe whatever a version holds."""
        text = "".join(f"{getattr(self, name)}\n" for name in type(self).model_fields)
        return hashlib.sha256(text.encode()).hexdigest()[:STACK_DIGEST_LENGTH]

    @property
    def name(self) -> str:
        """``stack-<digest>``: the stack in queue and file names."""
        return f"{STACK_NAME_PREFIX}{self.digest}"

    def label(self) -> str:
        """The stack as a person reads it: every version that is not empty, by its package's name."""
        parts = zip(STACK_PACKAGES, (getattr(self, name) for name in type(self).model_fields), strict=True)
        return " · ".join(f"{package} {version}" for package, version in parts if version)


STACK_DIGEST_LENGTH = 12  # 48 bits: no two of a fleet's handful of stacks share one
STACK_NAME_PREFIX = "stack-"  # before the digest in a stack's name (``Stack.name``)
# Each stack field's package, as users name it (``Stack.label``); the compiler's is the backend's.
STACK_PACKAGES = ("compiler", "torch", "torch-neuronx", "neuron-runtime", LIBRARY)
# The versions that make a job another test: with the model, task, test config and cores, its identity.
IDENTITY_VERSIONS = tuple(Stack.model_fields)


def safe_name(part: str) -> str:
    """A version, library or host name as one part of a queue or file name: versions like "2.21.33363.0+6dfecc895"
    and host names are kept as they are; anything odd is flattened to "_"."""
    return re.sub(r"[^A-Za-z0-9.+_-]", "_", part)


class RuntimeInfo(RuntimeVersions):
    """What runs a job: the backend, its compiler, the library, and their versions. A job's identity, and what a
    worker serves."""

    backend: Str16
    compiler_name: Str32
    library: Str64 = LIBRARY

    def stack(self) -> Stack:
        """The versions that route this runtime's jobs and key their results (a torch nobody said is "")."""
        return stack_of(self)


def stack_of(source: object) -> Stack:
    """The stack of anything that has its fields as attributes (a ``RuntimeInfo``, a job or worker row, a SQL row
    of its columns): the one place where a version nobody said (None) becomes the stack's "" ."""
    return Stack(**{name: getattr(source, name) or "" for name in IDENTITY_VERSIONS})


# The runtime fields a stored CPU reference depends on (the rest say what compiled the accelerator run).
LIBRARY_FIELDS = ("library", "library_version", "torch_version")


class RunRequest(BaseModel):
    """One runner invocation. Field names are the runner's flags (``--core-range`` for ``core_range``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str = Field(description="Hub id (org/name); with --local-dir, a label for that directory")
    revision: str | None = Field(None, description="branch, tag or commit sha (Hub ids only)")
    local_dir: Path | None = Field(
        None, description="run this checkpoint directory instead of downloading MODEL_ID (never used by jobs)"
    )
    backend: BackendName | None = Field(None, description="default: SUPPORTMATRIX_BACKEND")
    task: Task = Field(Task.text_generation, description="what is run and how it is compared")
    cores: CoreCount | None = Field(None, description="shard over this many cores (default: sized)")
    trust_remote_code: bool = Field(False, description="run the repo's own code (its *.py), at the pinned commit")
    core_range: str | None = Field(None, description="the cores this run is pinned to, recorded as provenance")
    stage: Stage = Field(Stage.full, description="the whole test, or one stage of a job")
    artifacts: Path | None = Field(None, description="the job's artifact directory, where its stages hand over")
    timeout_s: float | None = Field(None, gt=0, description="seconds per child process (default: the job timeout)")
    report: Path | None = Field(None, description="also write the JSON report to this file")

    # What a person needs to run the same test again; the rest says where this run's files go.
    REPRODUCIBLE: typing.ClassVar[frozenset[str]] = frozenset(
        {"model_id", "revision", "local_dir", "backend", "task", "cores", "trust_remote_code"}
    )

    def to_argv(self) -> list[str]:
        """The runner's arguments for this request: MODEL_ID, then every field that is not its default."""
        argv = [self.model_id]
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if name == "model_id" or value == field.default:
                continue
            if isinstance(value, bool):  # a switch: present means True
                argv.append(_flag(name))
                continue
            argv += [_flag(name), str(value.value if isinstance(value, Enum) else value)]
        return argv

    @classmethod
    def from_argv(cls, argv: list[str]) -> RunRequest:
        return cls.model_validate(vars(cls.parser().parse_args(argv)))

    @classmethod
    def parser(
        cls, prog: str = f"python -m {RUNNER_MODULE}", description: str | None = None
    ) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=description)
        for name, field in cls.model_fields.items():
            if name == "model_id":
                parser.add_argument("model_id", metavar="MODEL_ID", help=field.description)
                continue
            if field.annotation is bool:
                parser.add_argument(_flag(name), dest=name, action="store_true", help=field.description)
                continue
            choices = _choices(field.annotation)
            parser.add_argument(
                _flag(name),
                dest=name,
                default=field.default,
                choices=choices,
                type=type(choices[0]) if choices else str,
                help=field.description,
            )
        return parser

    def reproduce_command(self, env: dict[str, str]) -> str:
        """How a person runs the same test: the settings that changed what ran, then the runner's command."""
        request = RunRequest.model_validate(self.model_dump(include=set(self.REPRODUCIBLE)))
        parts = [f"{k}={v}" for k, v in sorted(env.items())]
        return shlex.join([*parts, "python", "-m", RUNNER_MODULE, *request.to_argv()])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choices(annotation: Any) -> list[Any] | None:
    """The allowed values of a Literal or Enum annotation (optional or not), as the command line spells them."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    for arg in args:
        if typing.get_origin(arg) is Literal:
            return list(typing.get_args(arg))
        if isinstance(arg, type) and issubclass(arg, Enum):
            return [str(m.value) for m in arg]
    return None
