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
"""

from __future__ import annotations

import os
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path

LOCAL_NAMES = {"cpu": "inductor", "cuda": "inductor-cuda", "neuron": "neff"}


def local_cache_dir(cache_root: Path, backend: str) -> Path:
    return cache_root / LOCAL_NAMES[backend]


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


def remote_for(url: str, ns: str, token: str | None = None) -> Remote | BucketRemote:
    if url.startswith("hf://buckets/"):
        return BucketRemote(url, ns, token)
    return Remote(url, ns)
