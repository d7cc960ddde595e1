"""What this machine has installed, read without importing it, and the cpu backend's name for its compiler."""

from __future__ import annotations

from importlib import metadata


def installed_version(dist: str) -> str | None:
    """An installed distribution's version from its metadata, without importing it (torch takes seconds)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_compiler(compile_backend: str, torch_version: str, dtype: str) -> tuple[str, str]:
    """The cpu backend's compiler name and version: what its runner reports, and what the API plans a job for
    when no worker is live. A bf16 run is another configuration of the same compiler: its cells stay apart."""
    suffix = "" if dtype == "float32" else "-bf16"
    return compile_backend, f"{compile_backend}-{torch_version}{suffix}"
