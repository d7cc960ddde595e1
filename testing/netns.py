"""Hosts for tests, made of Linux network namespaces (root only): each one is joined to this machine by a
veth pair and sees nothing but its own loopback and this machine's side of the pair (``gateway``). A test
serves the dependencies to it through proxies listening on ``gateway`` (testing.tcp_proxy), runs processes
in it (``command``), and cuts it off by taking its link down.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

SUBNET = "10.213"  # 10.213.<index>.0/30 per host: .1 this machine's side, .2 the namespace's


def ip(*args: str, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    done = subprocess.run([*prefix, "ip", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass
class NetnsHost:
    """One namespace and its veth pair; names carry this process's pid so that parallel runs never meet."""

    label: str
    index: int

    def __post_init__(self) -> None:
        tag = f"{os.getpid() % 100000}{self.label}"
        self.netns = f"smtest-{tag}"
        self.outside = f"smo{tag}"[:15]  # interface names are at most 15 characters
        self.inside = f"smi{tag}"[:15]
        self.gateway = f"{SUBNET}.{self.index}.1"
        self.address = f"{SUBNET}.{self.index}.2"

    def create(self) -> NetnsHost:
        ip("netns", "add", self.netns)
        try:
            ip("link", "add", self.outside, "type", "veth", "peer", "name", self.inside)
            ip("link", "set", self.inside, "netns", self.netns)
            ip("addr", "add", f"{self.gateway}/30", "dev", self.outside)
            ip("link", "set", self.outside, "up")
            ip("addr", "add", f"{self.address}/30", "dev", self.inside, netns=self.netns)
            ip("link", "set", self.inside, "up", netns=self.netns)
            ip("link", "set", "lo", "up", netns=self.netns)
        except RuntimeError:
            self.remove()
            raise
        return self

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def cut(self) -> None:
        """Cut the host off: its link goes down, and every packet to or from it is dropped."""
        ip("link", "set", self.outside, "down")

    def restore(self) -> None:
        ip("link", "set", self.outside, "up")

    def remove(self) -> None:
        """Delete the namespace (and with it both ends of the veth pair); safe to call twice."""
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.outside], capture_output=True, check=False)
