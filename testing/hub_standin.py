"""A local stand-in of the Hugging Face Hub HTTP API, for tests and the demo (no network needed).

It serves checkpoint directories as model repos on the routes huggingface_hub and transformers use
(model_info, list_models, tree listings, HEAD/GET /resolve/), with the headers and typed errors
(`X-Error-Code`) the client needs, so that `HF_ENDPOINT=http://127.0.0.1:PORT` runs the real download
path. No Xet, no LFS: files are served directly. Nothing here ever answers 5xx (the client would retry
for ~25 s): its own faults are 400s.

    python -m testing.hub_standin ROOT [--org org] [--port 0]    # serves ROOT/<dir> as org/<dir>
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import sys
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_DTYPE_KEYS = {
    "F32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "I64": "I64",
    "I32": "I32",
    "U8": "U8",
    "BOOL": "BOOL",
}


def use_hub_standin(endpoint: str, hf_home: Path) -> None:
    """This process and all it starts reach the Hub at ``endpoint`` (a stand-in), with a Hub cache of their own
    and no token or offline switch from the machine's environment. Before anything imports huggingface_hub: it
    reads HF_ENDPOINT once, at import."""
    os.environ.update(
        {
            "HF_ENDPOINT": endpoint,
            "HF_HOME": str(hf_home),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
    )
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        os.environ.pop(name, None)


@dataclass
class FileEntry:
    path: str
    size: int
    sha256: str
    git_oid: str


@dataclass
class Repo:
    repo_id: str
    root: Path
    # downloads, trendingScore, gated, likes, pipeline_tag, library_name, tags, safetensors (overrides), ...
    meta: dict[str, Any] = field(default_factory=dict)
    _cache: dict[str, tuple[tuple[float, int], FileEntry]] = field(default_factory=dict)

    def files(self) -> list[FileEntry]:
        entries = []
        for path in sorted(p for p in self.root.rglob("*") if p.is_file()):
            rel = path.relative_to(self.root).as_posix()
            if rel.startswith(".") or "/." in rel:
                continue
            stat = path.stat()
            key = (stat.st_mtime, stat.st_size)
            cached = self._cache.get(rel)
            if cached is None or cached[0] != key:
                data = path.read_bytes()
                oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                cached = (key, FileEntry(rel, len(data), hashlib.sha256(data).hexdigest(), oid))
                self._cache[rel] = cached
            entries.append(cached[1])
        return entries

    def sha(self, files: list[FileEntry]) -> str:
        digest = hashlib.sha1()
        for f in files:
            digest.update(f"{f.path}\0{f.git_oid}\n".encode())
        return digest.hexdigest()

    def config(self) -> dict[str, Any]:
        path = self.root / "config.json"
        try:
            full = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        # The Hub's model_info carries a small subset of config.json, as here.
        return {k: full[k] for k in ("architectures", "model_type", "auto_map") if k in full}

    def safetensors(self, files: list[FileEntry]) -> dict[str, Any] | None:
        params: dict[str, int] = {}
        found = False
        for f in files:
            if not f.path.endswith(".safetensors"):
                continue
            try:
                with (self.root / f.path).open("rb") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    if n > f.size - 8:  # no header of that length: not a safetensors file
                        continue
                    header = json.loads(fh.read(n))
            except (OSError, ValueError, struct.error):
                continue  # like the Hub: a file it cannot parse adds no metadata
            found = True
            for name, tensor in header.items():
                if name == "__metadata__":
                    continue
                count = 1
                for d in tensor["shape"]:
                    count *= d
                dtype = _DTYPE_KEYS.get(tensor["dtype"], tensor["dtype"])
                params[dtype] = params.get(dtype, 0) + count
        if not found:
            return None
        return {"parameters": params, "total": sum(params.values())}


class HubStandin:
    """Serve repos over HTTP on 127.0.0.1 in a background thread."""

    def __init__(self, port: int = 0, token: str | None = None, upload_dir: Path | None = None) -> None:
        self.repos: dict[str, Repo] = {}
        self.datasets: dict[str, Repo] = {}  # created through the API, written by commits
        self.upload_dir = upload_dir  # where they live; None: this stand-in takes no uploads
        self.commits: list[tuple[str, str]] = []  # (repo id, summary) of every commit
        self.token = token  # the one token that may read gated repos
        self.requests: list[tuple[str, str]] = []  # (method, path), for tests that count calls
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo_id: str, root: Path, **meta: Any) -> None:
        with self._lock:
            self.repos[repo_id] = Repo(repo_id, Path(root), meta)

    def add_dir(self, root: Path, org: str = "org") -> None:
        """Serve each sub-directory of ``root`` as ``org/<name>``."""
        for sub in sorted(Path(root).iterdir()):
            if sub.is_dir() and not sub.name.startswith("."):
                self.add(f"{org}/{sub.name}", sub)

    def start(self) -> HubStandin:
        self._thread = threading.Thread(target=self.server.serve_forever, name="hub-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> HubStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HubError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


_REPO = r"(?P<repo>[^/]+/[^/]+)"
_DATASET = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("POST", re.compile(rf"^/api/datasets/{_DATASET}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/datasets/{_DATASET}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("GET", re.compile(rf"^/api/datasets/{_DATASET}/revision/(?P<rev>[^/]+)$"), "dataset_info"),
    ("GET", re.compile(rf"^/api/datasets/{_DATASET}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "dataset_tree"),
    ("GET", re.compile(rf"^/api/datasets/{_DATASET}$"), "dataset_info"),
    ("HEAD", re.compile(rf"^/datasets/{_DATASET}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "dataset_resolve"),
    ("GET", re.compile(rf"^/datasets/{_DATASET}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "dataset_resolve"),
    ("GET", re.compile(r"^/api/models/?$"), "list_models"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$"), "model_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "tree"),
    ("GET", re.compile(rf"^/api/models/{_REPO}$"), "model_info"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/paths-info/(?P<rev>[^/]+)$"), "paths_info"),
    ("GET", re.compile(r"^/api/agent-harnesses$"), "harnesses"),
    ("HEAD", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandin
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else delayed ACKs add ~40 ms to every request

    def log_message(self, format: str, *args: Any) -> None:  # quiet; tests read hub.requests
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        # Always drain the body: on a kept-alive connection an unread body becomes the next request line.
        length = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(length) if length else b""
        self.dataset = False
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.query = parse_qs(url.query)
        self.hub.requests.append((method, path))
        try:
            for route_method, pattern, name in _ROUTES:
                match = pattern.match(path)
                if match and route_method == method:
                    getattr(self, name)(**match.groupdict())
                    return
            raise HubError(404, "EntryNotFound", f"no route for {method} {path}")
        except HubError as err:
            self._error(err, method)
        except Exception as exc:  # never a 5xx: the client would retry with backoff
            self._error(HubError(400, "BadRequest", f"{type(exc).__name__}: {exc}"), method)

    # --- helpers --------------------------------------------------------------------------------------

    def _error(self, err: HubError, method: str) -> None:
        body = json.dumps({"error": err.message}).encode()
        self.send_response(err.status)
        self.send_header("X-Error-Code", err.code)
        self.send_header("X-Error-Message", err.message)
        for k, v in err.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _json(self, payload: Any) -> None:
        self._json_status(200, payload)

    def _repo(self, repo_id: str) -> Repo:
        repo = self.hub.repos.get(repo_id) if not getattr(self, "dataset", False) else self.hub.datasets.get(repo_id)
        if repo is None or not repo.root.is_dir():
            raise HubError(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
        return repo

    def _check_revision(self, repo: Repo, rev: str, files: list[FileEntry]) -> str:
        sha = repo.sha(files)
        if unquote(rev) not in ("main", sha):
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    def _check_gated(self, repo: Repo) -> None:
        if not repo.meta.get("gated"):
            return
        auth = self.headers.get("Authorization", "")
        if self.hub.token and auth == f"Bearer {self.hub.token}":
            return
        status = 403 if auth else 401
        raise HubError(status, "GatedRepo", f"Access to model {repo.repo_id} is restricted.")

    def _info(self, repo: Repo, files: list[FileEntry], sha: str) -> dict[str, Any]:
        config = repo.config()
        archs = config.get("architectures") or []
        causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
        mtime = max((repo.root / f.path).stat().st_mtime for f in files) if files else 0.0
        when = dt.datetime.fromtimestamp(mtime, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        info: dict[str, Any] = {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "lastModified": when,
            "createdAt": when,
            "private": False,
            "disabled": False,
            "gated": repo.meta.get("gated", False),
            "downloads": repo.meta.get("downloads", 0),
            "likes": repo.meta.get("likes", 0),
            "trendingScore": repo.meta.get("trendingScore", 0),
            "library_name": repo.meta.get("library_name", "transformers"),
            "pipeline_tag": repo.meta.get("pipeline_tag", "text-generation" if causal else None),
            "tags": [
                "transformers",
                "safetensors",
                config.get("model_type", "unknown"),
                *(["custom_code"] if "auto_map" in config else []),  # as the Hub tags trust_remote_code repos
                *repo.meta.get("tags", []),
            ],
            "config": config,
            "siblings": [{"rfilename": f.path} for f in files],
            "safetensors": repo.meta.get("safetensors") or repo.safetensors(files),
            "transformersInfo": {"auto_model": "AutoModelForCausalLM"} if causal else None,
        }
        if self.query.get("blobs") == ["true"]:
            info["siblings"] = [{"rfilename": f.path, "size": f.size, "blobId": f.git_oid} for f in files]
        expand = self.query.get("expand")
        if expand:
            info = {k: v for k, v in info.items() if k in {"_id", "id", *expand}}
        return info

    # --- routes ---------------------------------------------------------------------------------------

    def harnesses(self) -> None:
        self._json({"standardEnvVars": [], "harnesses": {}})

    def model_info(self, repo: str, rev: str = "main") -> None:
        r = self._repo(repo)
        files = r.files()
        sha = self._check_revision(r, rev, files)
        self._json(self._info(r, files, sha))

    def list_models(self) -> None:
        q = self.query
        rows = []
        for r in list(self.hub.repos.values()):
            if not r.root.is_dir():
                continue
            files = r.files()
            info = self._info(r, files, r.sha(files))
            if "search" in q and q["search"][0].lower() not in r.repo_id.lower():
                continue
            if "author" in q and info["author"] != q["author"][0]:
                continue
            if "pipeline_tag" in q and info["pipeline_tag"] != q["pipeline_tag"][0]:
                continue
            rows.append(info)
        sort = (q.get("sort") or ["downloads"])[0]
        key = {"trending_score": "trendingScore", "trendingScore": "trendingScore"}.get(sort, sort)
        rows.sort(key=lambda i: i.get(key) or 0, reverse=True)
        limit = int((q.get("limit") or [len(rows)])[0])
        self._json(rows[:limit])

    def tree(self, repo: str, rev: str, path: str | None = None) -> None:
        r = self._repo(repo)
        files = r.files()
        self._check_revision(r, rev, files)
        prefix = (path or "").strip("/")
        recursive = self.query.get("recursive") == ["true"]
        entries: dict[str, dict[str, Any]] = {}
        for f in files:
            if prefix and not f.path.startswith(prefix + "/"):
                continue
            rest = f.path[len(prefix) + 1 :] if prefix else f.path
            if "/" in rest and not recursive:
                d = (f"{prefix}/" if prefix else "") + rest.split("/")[0]
                entries.setdefault(d, {"type": "directory", "oid": "0" * 40, "size": 0, "path": d})
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    d = "/".join(([prefix] if prefix else []) + parts[:i])
                    entries.setdefault(d, {"type": "directory", "oid": "0" * 40, "size": 0, "path": d})
            entries[f.path] = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.path}
        if prefix and not entries:
            raise HubError(404, "EntryNotFound", f"{prefix} does not exist in {repo}")
        self._json(list(entries.values()))

    # --- datasets: created, written by commits, read back -------------------------------------------

    def _authorized(self) -> None:
        if self.hub.token and self.headers.get("Authorization") != f"Bearer {self.hub.token}":
            raise HubError(401, "Unauthorized", "a write token is required")

    def create_repo(self) -> None:
        self._authorized()
        body = json.loads(self.body or b"{}")
        if body.get("type") != "dataset" or self.hub.upload_dir is None:
            raise HubError(400, "BadRequest", "this stand-in creates dataset repos only")
        repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
        url = f"http://{self.headers['Host']}/datasets/{repo_id}"
        if repo_id in self.hub.datasets:
            self._json_status(409, {"error": "You already created this dataset repo", "url": url})
            return
        root = self.hub.upload_dir / "datasets" / repo_id
        root.mkdir(parents=True, exist_ok=True)
        self.hub.datasets[repo_id] = Repo(repo_id, root)
        self._json({"url": url})

    def validate_yaml(self) -> None:
        self._json({"errors": [], "warnings": []})

    def preupload(self, repo: str, rev: str) -> None:
        self.dataset = True
        r = self._repo(repo)
        existing = {f.path: f.git_oid for f in r.files()}
        files = json.loads(self.body)["files"]
        self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                               "oid": existing.get(f["path"])} for f in files]})  # fmt: skip

    def commit(self, repo: str, rev: str) -> None:
        self._authorized()
        self.dataset = True
        r = self._repo(repo)
        lines = [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]
        header = next((ln["value"] for ln in lines if ln["key"] == "header"), {})
        writes, deletes = {}, []
        for line in lines:  # check every line before writing anything
            key, value = line["key"], line["value"]
            if key == "header":
                continue
            target = (r.root / value["path"]).resolve()
            if not str(target).startswith(str(r.root.resolve()) + os.sep):
                raise HubError(400, "BadRequest", f"unsafe path {value['path']!r}")
            if key == "file":
                writes[target] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deletes.append(target)
            else:
                raise HubError(422, "BadRequest", f"{key} operations are not served here (no LFS, no Xet)")
        with self.hub._lock:
            for target, data in writes.items():
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.tmp")
                tmp.write_bytes(data)
                os.replace(tmp, target)
            for target in deletes:
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
            sha = r.sha(r.files())
            self.hub.commits.append((repo, header.get("summary", "")))
        host = self.headers["Host"]
        self._json({"commitOid": sha, "commitUrl": f"http://{host}/datasets/{repo}/commit/{sha}"})

    def dataset_info(self, repo: str, rev: str = "main") -> None:
        self.dataset = True
        r = self._repo(repo)
        files = r.files()
        sha = self._check_revision(r, rev, files)
        self._json({"_id": hashlib.md5(repo.encode()).hexdigest()[:24], "id": repo, "sha": sha, "private": False,
                    "siblings": [{"rfilename": f.path} for f in files]})  # fmt: skip

    def dataset_tree(self, repo: str, rev: str, path: str | None = None) -> None:
        self.dataset = True
        self.tree(repo, rev, path)

    def dataset_resolve(self, repo: str, rev: str, path: str) -> None:
        self.dataset = True
        self.resolve(repo, rev, path)

    def _json_status(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def paths_info(self, repo: str, rev: str) -> None:
        r = self._repo(repo)
        files = r.files()
        self._check_revision(r, rev, files)
        wanted = set(parse_qs(self.body.decode()).get("paths", []))
        self._json(
            [{"type": "file", "path": f.path, "size": f.size, "oid": f.git_oid} for f in files if f.path in wanted]
        )

    def resolve(self, repo: str, rev: str, path: str) -> None:
        r = self._repo(repo)
        files = r.files()
        sha = self._check_revision(r, rev, files)
        self._check_gated(r)
        entry = next((f for f in files if f.path == path), None)
        if entry is None:
            raise HubError(404, "EntryNotFound", f"{path} not found in {repo}", {"X-Repo-Commit": sha})
        start, end = 0, entry.size - 1
        status = HTTPStatus.OK
        rng = self.headers.get("Range")
        if rng and self.command == "GET":
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if m and entry.size:
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), entry.size - 1) if m.group(2) else entry.size - 1
                else:
                    start = max(entry.size - int(m.group(2)), 0)
                status = HTTPStatus.PARTIAL_CONTENT
        self.send_response(status)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{entry.sha256}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(max(end - start + 1, 0)))
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end}/{entry.size}")
        self.end_headers()
        if self.command == "GET" and end >= start:
            with (r.root / path).open("rb") as fh:
                os.sendfile(self.wfile.fileno(), fh.fileno(), start, end - start + 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.hub_standin", description=__doc__)
    parser.add_argument("root", type=Path, help="a directory of checkpoint directories")
    parser.add_argument("--org", default="org")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    hub = HubStandin(port=args.port)
    hub.add_dir(args.root, args.org)
    hub.start()
    print(hub.url, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    hub.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
