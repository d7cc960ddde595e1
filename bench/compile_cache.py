"""Cold vs warm compile time of the same model, each in a fresh runner process, as a ratio.

    .venv/bin/python bench/compile_cache.py [CHECKPOINT_DIR] [--backend inductor] [--repeat 2]

Without a checkpoint it builds the tiny Llama. Each round: one run with an empty compile cache (cold),
then one with the cache that run left (warm), both fresh processes; it prints both compile times and
cold / warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(model: Path, cache: Path, backend: str) -> dict[str, object]:
    env = {**os.environ, "SUPPORTMATRIX_CACHE_DIR": str(cache), "SUPPORTMATRIX_CPU_COMPILE_BACKEND": backend,
           "SUPPORTMATRIX_DATA_DIR": str(cache.parent / "data")}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "services.runner", str(model), "--cores", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    if report["verdict"] != "PASS":
        raise SystemExit(f"run failed: {report['error_message'] or report['verdict_reason']}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(ROOT))
            from testing.tiny_models import build

            [model] = build(Path(tmp) / "models", ["tiny-llama"])
        ratios = []
        for i in range(args.repeat):
            cache = Path(tmp) / f"cache-{i}"
            cold = run(model, cache, args.backend)
            warm = run(model, cache, args.backend)
            ratio = cold["compile_s"] / max(warm["compile_s"], 1e-9)
            ratios.append(ratio)
            cold_s, warm_s = cold["compile_s"], warm["compile_s"]
            print(f"round {i + 1}: cold {cold_s:.2f} s ({cold['compile_cache']}), warm {warm_s:.2f} s "
                  f"({warm['compile_cache']}), cold/warm {ratio:.1f}x", flush=True)  # fmt: skip
        print(f"{args.backend}: cold/warm compile time, median of {args.repeat}: {statistics.median(ratios):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
