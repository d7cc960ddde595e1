"""The shared compile cache: sync through a directory and an fsspec remote, by compiler-version namespace; warm
sharded compiles that hit inductor's cache in every rank."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.runner.compile_cache import Remote, namespace, remote_for
from shared.processes import free_port

# Not tests.conftest's ROOT: the rank processes import this module, and conftest sets the suite's environment.
ROOT = Path(__file__).resolve().parent.parent


def fill(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


@pytest.mark.parametrize("kind", ["directory", "fsspec"])
def test_entries_travel_between_hosts_through_the_remote(tmp_path: Path, kind: str) -> None:
    url = str(tmp_path / "remote") if kind == "directory" else f"memory://cache-{tmp_path.name}"
    ns = namespace("neuronx-cc", "2.21.33363.0+6dfecc895")
    assert ns == "neuronxcc-2.21.33363.0+6dfecc895"
    host_a, host_b = tmp_path / "a", tmp_path / "b"
    fill(host_a, {"ab/cd/k1.neff": b"one", "ef/gh/k2.neff": b"two", ".k3.neff.123.tmp": b"half", "x.lock": b""})
    remote = remote_for(url, ns)
    assert isinstance(remote, Remote)
    pushed = remote.push(host_a)
    assert (pushed.copied, pushed.skipped) == (2, 0)  # temporaries and locks stay home
    assert remote.files() == {"ab/cd/k1.neff", "ef/gh/k2.neff"}

    fill(host_b, {"ab/cd/k1.neff": b"local copy"})
    pulled = remote.pull(host_b)
    assert (pulled.copied, pulled.skipped) == (1, 1)
    assert (host_b / "ef/gh/k2.neff").read_bytes() == b"two"
    assert (host_b / "ab/cd/k1.neff").read_bytes() == b"local copy"  # never overwritten
    assert not [p for p in host_b.rglob("*.tmp")]

    # another compiler version sees none of it
    assert remote_for(url, namespace("neuronx-cc", "2.22.0+abc")).files() == set()


def compile_tensor_parallel_rank() -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_* from the environment) of a two-layer MLP sharded column- then
    row-wise over a DeviceMesh, compiled by the cpu backend as the runner compiles; prints its cache outcome."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from services.runner.backends import get_backend
    from shared.settings import get_settings

    backend = get_backend("cpu", get_settings())
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    with torch.inference_mode():
        backend.compile(mlp)(torch.ones(2, 8))
    round_trips = pickle.loads(pickle.dumps(mesh)) == mesh
    print(json.dumps({"cache": backend.cache_lookups().outcome, "mesh_round_trips": round_trips}))
    torch.distributed.destroy_process_group()


def compile_two_ranks(env: dict[str, str]) -> list[dict[str, Any]]:
    """Both ranks of ``compile_tensor_parallel_rank``, each a fresh process: their reports, rank 0 first."""
    code = "from tests.test_compile_cache import compile_tensor_parallel_rank as rank; rank()"
    common = env | {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    ranks = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=common | {"RANK": str(r)}, **pipes)
        for r in range(2)
    ]
    outputs = [proc.communicate(timeout=300) for proc in ranks]
    assert all(proc.returncode == 0 for proc in ranks), [err[-2000:] for _, err in outputs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.mark.slow
def test_a_warm_two_rank_compile_hits_inductors_cache_in_every_rank(tmp_path: Path) -> None:
    """A tensor-parallel graph takes its DeviceMesh as an input; before the runner keyed meshes by value,
    every fresh process missed inductor's FX-graph cache, as the mesh's pickled hash differs per process."""
    # Inductor's cache, without the backend's TMPDIR: the host's precompiled header (built once per torch
    # version, 20 s) is not what this test is about.
    env = os.environ | {"SUPPORTMATRIX_CPU_COMPILE_BACKEND": "inductor", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    cold = compile_two_ranks(env)
    warm = compile_two_ranks(env)
    assert [r["cache"] for r in cold] == ["miss", "miss"]
    assert [r["cache"] for r in warm] == ["hit", "hit"]
    assert all(r["mesh_round_trips"] for r in cold + warm)  # the mesh still pickles as itself
