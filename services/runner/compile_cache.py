"""The compile cache, shared across hosts: pull a compiler version's namespace before a run, push after.

Local caches are the backends' own (TORCH_NEURONX_NEFF_CACHE_DIR on neuron, TORCHINDUCTOR_CACHE_DIR on
cpu and cuda), under ``<cache dir>/<backend cache name>``. A remote is one of
- a Hub bucket, ``hf://buckets/<ns>/<name>``: a thin adapter over huggingface_hub's bucket sync (bytes
  move through Xet; the public Space's cache is ``hf://buckets/aws-neuron/torch-neuronx-neff-cache``);
- any fsspec URL (``s3://…``, ``file:///…``, ``memory://…``);
- a shared directory path.
Each compiler version has its own namespace, ``<remote>/<compiler name>-<version>`` (``neuronxcc-<ver>``
for neuronx-cc, as the public cache names it), because cache keys do not reliably include the compiler's
version. Entries are content-addressed, so sync only adds what is missing, never overwrites or deletes;
each file lands under a temporary name and is renamed, so concurrent runs on a host share the local
cache safely.

Inductor keys its FX-graph and AOTAutograd cache entries by pickling what a graph depends on. A sharded
graph takes the model's DeviceMesh as an input, and the mesh's pickled state carries a hash that differs
in every process; ``key_device_meshes_by_value`` (called by ``Backend.compile`` in a sharded run) keeps it
out of the keys, so a warm sharded run hits.
"""

from __future__ import annotations

import copyreg
import os
import posixpath
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCAL_NAMES = {"cpu": "inductor", "cuda": "inductor-cuda", "neuron": "neff"}


def local_cache_dir(cache_root: Path, backend: str) -> Path:
    return cache_root / LOCAL_NAMES[backend]


def inductor_env(local: Path) -> dict[str, str]:
    """Inductor's cache directory, and TMPDIR inside it.

    Inductor builds its precompiled header (≈150 MB, once per torch version and compiler flags) under TMPDIR,
    whatever its cache directory says: kept with the cache, it travels with it. The directory must exist, or
    Python's tempfile silently falls back to /tmp, where the header outlives every cache and a cold run finds it.
    """
    scratch = local / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    return {"TORCHINDUCTOR_CACHE_DIR": str(local), "TMPDIR": str(scratch)}


def namespace(compiler_name: str, compiler_version: str) -> str:
    name = "neuronxcc" if compiler_name == "neuronx-cc" else compiler_name
    return f"{name}-{compiler_version}"


@dataclass
class SyncCount:
    copied: int = 0
    skipped: int = 0


def _files(root: Path) -> set[str]:
    """Relative paths of the cache's files, leaving out temporaries and lock files."""
    if not root.exists():
        return set()
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith((".lock", ".tmp"))
    }


class Remote:
    """An fsspec filesystem rooted at the namespace (a directory path is fsspec's local filesystem)."""

    def __init__(self, url: str, ns: str) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = f"{root.rstrip('/')}/{ns}"

    def files(self) -> set[str]:
        if not self.fs.exists(self.root):
            return set()
        prefix = self.root.rstrip("/") + "/"
        return {p[len(prefix) :] for p in self.fs.find(self.root) if p.startswith(prefix)}

    def pull(self, local: Path) -> SyncCount:
        count = SyncCount()
        have = _files(local)
        for rel in sorted(self.files()):
            if rel in have:
                count.skipped += 1
                continue
            target = local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
            self.fs.get_file(f"{self.root}/{rel}", str(tmp))
            os.replace(tmp, target)
            count.copied += 1
        return count

    def push(self, local: Path) -> SyncCount:
        count = SyncCount()
        there = self.files()
        for rel in sorted(_files(local)):
            if rel in there:
                count.skipped += 1
                continue
            target = f"{self.root}/{rel}"
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            self.fs.put_file(str(local / rel), target)
            count.copied += 1
        return count


class BucketRemote:
    """A Hub bucket: huggingface_hub's bucket sync does the work (Xet transfers, skip what exists)."""

    def __init__(self, url: str, ns: str, token: str | None) -> None:
        self.path = f"{url.rstrip('/')}/{ns}"
        self.token = token

    def pull(self, local: Path) -> SyncCount:
        from huggingface_hub import HfApi

        local.mkdir(parents=True, exist_ok=True)
        HfApi(token=self.token).sync_bucket(self.path, str(local), ignore_existing=True, quiet=True)
        return SyncCount()

    def push(self, local: Path) -> SyncCount:
        from huggingface_hub import HfApi

        HfApi(token=self.token).sync_bucket(str(local), self.path, ignore_existing=True, quiet=True)
        return SyncCount()


def key_device_meshes_by_value() -> None:
    """Pickle a DeviceMesh without its cached ``_hash``, so that cache keys of sharded graphs agree across
    processes.

    ``DeviceMesh._hash`` is Python's hash of a tuple holding None and the mesh's dimension names: salted
    per process for strings (PYTHONHASHSEED) and, before Python 3.12, the address of None. Inductor's key
    pickler (and AOTAutograd's, its subclass) starts from copyreg's dispatch table, so a reducer registered
    there reaches them. It rebuilds the mesh exactly as the default reduction does, less the hash, which
    the mesh recomputes on its next ``hash()``; the rank's own coordinates stay in the key.
    """
    from torch.distributed.device_mesh import DeviceMesh

    copyreg.pickle(DeviceMesh, _reduce_device_mesh)


def _reduce_device_mesh(mesh: Any) -> tuple[Callable[..., Any], tuple[type], dict[str, Any]]:
    state = mesh.__getstate__()  # DeviceMesh's own, which already leaves out its process groups
    state.pop("_hash", None)
    return copyreg.__newobj__, (type(mesh),), state  # type: ignore[attr-defined]  # in copyreg, not in typeshed


def remote_for(url: str, ns: str, token: str | None = None) -> Remote | BucketRemote:
    if url.startswith("hf://buckets/"):
        return BucketRemote(url, ns, token)
    return Remote(url, ns)
