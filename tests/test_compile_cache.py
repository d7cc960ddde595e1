"""The shared compile cache: sync through a directory and an fsspec remote, by compiler-version namespace."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.runner.compile_cache import Remote, namespace, remote_for


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
