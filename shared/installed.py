"""What this machine has installed, read without importing it, and the cpu backend's name for its compiler."""

from __future__ import annotations

import subprocess
from importlib import metadata


def installed_version(dist: str) -> str | None:
    """An installed distribution's version from its metadata, without importing it (torch takes seconds)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def debian_package_version(name: str) -> str | None:
    """A Debian package's installed version (the Neuron runtime libraries are apt packages), or None."""
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True)
    except OSError:
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


NEURON_RUNTIME_PACKAGE = "aws-neuronx-runtime-lib"


def neuron_versions() -> dict[str, str]:
    """TorchNeuron's and the Neuron runtime's versions, as a runtime identity names them ("" where absent)."""
    return {
        "torch_neuronx_version": installed_version("torch-neuronx") or "",
        "neuron_runtime_version": debian_package_version(NEURON_RUNTIME_PACKAGE) or "",
    }


def cpu_compiler(compile_backend: str, torch_version: str, dtype: str) -> tuple[str, str]:
    """The cpu backend's compiler name and version: what its runner reports, and what the API plans a job for
    when no worker is live. A bf16 run is another configuration of the same compiler: its cells stay apart."""
    suffix = "" if dtype == "float32" else "-bf16"
    return compile_backend, f"{compile_backend}-{torch_version}{suffix}"
