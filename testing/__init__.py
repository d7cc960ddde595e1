"""Test and demo support that needs no network: tiny checkpoints, a Hub stand-in, local services."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def build_main(module: str, doc: str | None, build: Callable[[Path], list[Path]], argv: list[str] | None) -> int:
    """A fixture builder's command line, ``python -m testing.<module> OUT_DIR``: builds its repos into OUT_DIR and
    prints their paths."""
    parser = argparse.ArgumentParser(prog=f"python -m testing.{module}", description=doc)
    parser.add_argument("out_dir", type=Path)
    for path in build(parser.parse_args(argv).out_dir):
        print(path)
    return 0
