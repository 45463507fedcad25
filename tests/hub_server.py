"""A local Hugging Face Hub on 127.0.0.1 for tests: pull through olah, push into git.

One base URL serves both directions, so the real ``huggingface_hub`` client (and diffusers through it) talks to
it exactly as it talks to the Hub, with ``HfApi(endpoint=...)`` or ``HF_ENDPOINT``:

* **Reads** (``repo_info``, tree listings, ``paths-info``, ``resolve`` downloads) are answered by ``olah`` in
  offline mode, which serves the bare git repositories under ``ROOT/repos/<type>s/<namespace>/<name>``.
  Two read cases olah does not cover are answered here instead: byte ranges (olah's local mirror ignores the
  ``Range`` header, but resumed downloads and safetensors header reads rely on ``206 Partial Content``) and
  missing files, revisions or repos (answered with the Hub's ``X-Error-Code`` headers so the client raises
  ``EntryNotFoundError`` / ``RevisionNotFoundError`` / ``RepositoryNotFoundError``).
* **Writes** are handled here: ``POST /api/repos/create``, ``DELETE /api/repos/delete``, ``POST /api/validate-yaml``,
  ``GET /api/whoami-v2`` (accepts ``TOKEN`` with write and ``READ_TOKEN`` with read access, else 401),
  ``POST /api/<type>s/<ns>/<name>/preupload/<rev>`` (every file is answered ``"regular"``, so no LFS or Xet
  endpoint is needed; clients set ``HF_HUB_DISABLE_XET=1``) and the NDJSON
  ``POST /api/<type>s/<ns>/<name>/commit/<rev>`` (inline base64 files, deleted files and folders), which becomes
  a git commit on the branch that olah then serves.

Every request is appended to ``ROOT/requests.jsonl`` (method, path, ``Range`` header, status, whether the response
was sent completely) so tests can check
what went over the wire. ``POST /_local_hub/throttle`` with ``{"bytes_per_second": N, "after_bytes": M}`` slows
every file download down after its first M bytes (``null``: full speed), so a test can interrupt one part-way;
``POST /_local_hub/drop`` with ``{"after_bytes": M}`` closes the connection of the next download after M bytes.

Run standalone: ``python tests/hub_server.py --port 0 --root DIR`` prints the base URL on its first stdout line
and serves until terminated. In pytest, use the ``local_hub`` fixture (see :func:`local_hub`).
"""

import argparse
import asyncio
import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

HOST = "127.0.0.1"
REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
STARTUP_TIMEOUT_S = 60.0
GITATTRIBUTES = "*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "local-hub",
    "GIT_AUTHOR_EMAIL": "local-hub@localhost",
    "GIT_COMMITTER_NAME": "local-hub",
    "GIT_COMMITTER_EMAIL": "local-hub@localhost",
}


# --------------------------------------------------------------------------------------------------------------
# Git storage: one bare repository per Hub repo, written with git plumbing (no working tree).
# --------------------------------------------------------------------------------------------------------------
class HubError(Exception):
    """A Hub-style error: HTTP status plus the ``X-Error-Code`` the client maps to an exception class."""

    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class GitStore:
    """Bare git repositories laid out as olah's ``mirrors-path`` expects: ``<root>/<type>s/<namespace>/<name>``."""

    root: Path
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def path(self, repo_type: str, repo_id: str) -> Path:
        namespace, _, name = repo_id.partition("/")
        if not namespace or not name or "/" in name or ".." in repo_id:
            raise HubError(400, None, f"repo id must look like 'namespace/name', got {repo_id!r}")
        return self.root / repo_type / namespace / name

    def exists(self, repo_type: str, repo_id: str) -> bool:
        return (self.path(repo_type, repo_id) / "HEAD").is_file()

    def _git(self, repo: Path, *args: str, data: bytes | None = None, env: dict | None = None) -> bytes:
        full_env = {**os.environ, **_GIT_IDENTITY, "GIT_DIR": str(repo), **(env or {})}
        result = subprocess.run(["git", *args], input=data, capture_output=True, env=full_env)
        if result.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} failed: {result.stderr.decode(errors='replace')}")
        return result.stdout

    def create(self, repo_type: str, repo_id: str) -> None:
        """Create the repo with an initial ``.gitattributes`` commit on ``main``, as the Hub does."""
        path = self.path(repo_type, repo_id)
        with self._lock:
            if self.exists(repo_type, repo_id):
                raise HubError(409, None, f"You already created this {REPO_TYPES[repo_type]} repo: {repo_id}")
            path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "init", "--quiet", "--bare", "-b", "main", str(path)], check=True)
        self.commit(repo_type, repo_id, "main", {".gitattributes": GITATTRIBUTES.encode()}, summary="initial commit")

    def delete(self, repo_type: str, repo_id: str) -> None:
        if not self.exists(repo_type, repo_id):
            raise HubError(404, "RepoNotFound", f"Repository not found: {repo_id}")
        shutil.rmtree(self.path(repo_type, repo_id))

    def resolve(self, repo_type: str, repo_id: str, revision: str) -> str:
        """Commit sha of a branch, tag or commit; Hub-style errors if the repo or revision is missing."""
        if not self.exists(repo_type, repo_id):
            raise HubError(401, "RepoNotFound", f"Repository not found: {repo_id}")
        try:
            return (
                self._git(self.path(repo_type, repo_id), "rev-parse", "--verify", f"{revision}^{{commit}}")
                .decode()
                .strip()
            )
        except RuntimeError:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}") from None

    def files(self, repo_type: str, repo_id: str, commit: str) -> dict[str, str]:
        """``{path: blob sha}`` of every file at ``commit``."""
        out = self._git(self.path(repo_type, repo_id), "ls-tree", "-r", "-z", "--full-tree", commit)
        files = {}
        for entry in filter(None, out.decode().split("\0")):
            meta, path = entry.split("\t", 1)
            files[path] = meta.split()[2]
        return files

    def read(self, repo_type: str, repo_id: str, revision: str, path: str) -> tuple[str, str, bytes]:
        """``(commit sha, blob sha, content)`` of one file; Hub-style errors if anything is missing."""
        commit = self.resolve(repo_type, repo_id, revision)
        blob = self.files(repo_type, repo_id, commit).get(path)
        if blob is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on {revision!r}")
        return commit, blob, self._git(self.path(repo_type, repo_id), "cat-file", "blob", blob)

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        additions: dict[str, bytes],
        deletions: tuple[str, ...] = (),
        summary: str = "update",
        description: str = "",
        parent_commit: str | None = None,
    ) -> str:
        """Apply additions and deletions (files, or folders ending in ``/``) on top of ``branch``; return the sha."""
        repo = self.path(repo_type, repo_id)
        for path in [*additions, *deletions]:
            if path.startswith("/") or ".." in path.split("/") or not path.strip("/"):
                raise HubError(400, None, f"invalid path in repo: {path!r}")
        with self._lock, tempfile.TemporaryDirectory() as tmp:
            index = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
            try:
                parent = self._git(repo, "rev-parse", "--verify", f"refs/heads/{branch}").decode().strip()
            except RuntimeError:
                parent = None
                if self.has_refs(repo):  # only a freshly created repo may lack the branch
                    raise HubError(404, "RevisionNotFound", f"Invalid rev id: {branch}") from None
            if parent_commit is not None and parent_commit != parent:
                raise HubError(412, None, f"parent commit {parent_commit} is not the head of {branch} ({parent})")
            if parent:
                self._git(repo, "read-tree", parent, env=index)
            current = self._git(repo, "ls-files", "-z", env=index).decode().split("\0")
            lines = []
            for path in deletions:
                doomed = [p for p in current if p == path or (path.endswith("/") and p.startswith(path))]
                if not doomed:
                    raise HubError(404, "EntryNotFound", f"cannot delete {path!r}: not in {repo_id}@{branch}")
                lines.extend(f"0 {'0' * 40}\t{p}" for p in doomed)  # mode 0 removes the entry
            for path, content in additions.items():
                blob = self._git(repo, "hash-object", "-w", "--stdin", data=content).decode().strip()
                lines.append(f"100644 {blob}\t{path}")
            if lines:
                self._git(repo, "update-index", "--index-info", data="\n".join(lines).encode() + b"\n", env=index)
            tree = self._git(repo, "write-tree", env=index).decode().strip()
            message = summary + (f"\n\n{description}" if description else "")
            args = ["commit-tree", tree, "-m", message] + (["-p", parent] if parent else [])
            sha = self._git(repo, *args).decode().strip()
            self._git(repo, "update-ref", f"refs/heads/{branch}", sha, *([parent] if parent else []))
            return sha

    def has_refs(self, repo: Path) -> bool:
        return bool(self._git(repo, "for-each-ref").strip())

    def seed(self, repo_type: str, repo_id: str, folder: str | os.PathLike, summary: str = "seed") -> str:
        """Create the repo if needed and commit every file under ``folder`` to ``main`` (no HTTP involved)."""
        if not self.exists(repo_type, repo_id):
            self.create(repo_type, repo_id)
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.commit(repo_type, repo_id, "main", files, summary=summary)


# --------------------------------------------------------------------------------------------------------------
# HTTP: write endpoints + range/missing-file reads here, everything else to olah.
# --------------------------------------------------------------------------------------------------------------
_API_WRITE = re.compile(r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)/(preupload|commit)/(.+)$")
_RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_REPO_INFO = re.compile(r"^/api/(models|datasets|spaces)/[^/]+/[^/]+$")
_CHUNK = 64 * 1024
LOCAL_USER = "local-user"
TOKEN, READ_TOKEN = "hf_localhubwritetoken", "hf_localhubreadtoken"  # the tokens `whoami` accepts
TOKENS = {TOKEN: "write", READ_TOKEN: "read"}


def build_app(root: Path):
    """The ASGI application: a dispatcher in front of olah's FastAPI app."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from olah.configs import OlahConfig
    from olah.server import AppSettings
    from olah.server import app as olah_app

    store = GitStore(root / "repos")
    store.root.mkdir(parents=True, exist_ok=True)
    config = OlahConfig()
    config.host, config.offline = HOST, True
    config.mirrors_path = [str(store.root)]
    config.repos_path = str(root / "olah-cache")
    olah_app.state.app_settings = AppSettings(config=config)
    state = {"bytes_per_second": None, "after_bytes": 0, "drop_after_bytes": None}
    log_lock = threading.Lock()
    log_path = root / "requests.jsonl"

    hub = FastAPI()

    @hub.exception_handler(HubError)
    async def _hub_error(_request, exc: HubError):
        headers = {"X-Error-Message": exc.message} | ({"X-Error-Code": exc.code} if exc.code else {})
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)

    def _repo_from_payload(payload: dict) -> tuple[str, str]:
        repo_type = (payload.get("type") or "model") + "s"
        if repo_type not in REPO_TYPES:
            raise HubError(400, None, f"unknown repo type {payload.get('type')!r}")
        return repo_type, f"{payload.get('organization') or ''}/{payload.get('name') or ''}"

    @hub.post("/api/repos/create")
    async def create_repo(request: Request):
        repo_type, repo_id = _repo_from_payload(await request.json())
        prefix = "" if repo_type == "models" else f"{repo_type}/"
        body = {"url": f"{str(request.base_url).rstrip('/')}/{prefix}{repo_id}", "name": repo_id}
        try:
            store.create(repo_type, repo_id)
        except HubError as exc:  # the Hub names the existing repo in its 409 answer
            return JSONResponse({**body, "error": exc.message}, status_code=exc.status)
        return body

    @hub.delete("/api/repos/delete")
    async def delete_repo(request: Request):
        store.delete(*_repo_from_payload(await request.json()))
        return Response(status_code=200)

    @hub.post("/api/{repo_type}/{namespace}/{name}/preupload/{revision:path}")
    async def preupload(repo_type: str, namespace: str, name: str, revision: str, request: Request):
        repo_id = f"{namespace}/{name}"
        remote = store.files(repo_type, repo_id, store.resolve(repo_type, repo_id, unquote(revision)))
        files = (await request.json()).get("files", [])
        return {
            "files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": remote.get(f["path"])}
                for f in files
            ]
        }

    @hub.post("/api/{repo_type}/{namespace}/{name}/commit/{revision:path}")
    async def commit(repo_type: str, namespace: str, name: str, revision: str, request: Request):
        repo_id, branch = f"{namespace}/{name}", unquote(revision)
        if request.query_params.get("create_pr"):
            raise HubError(400, None, "this local Hub does not support pull requests")
        store.resolve(repo_type, repo_id, branch)
        header, additions, deletions = {}, {}, []
        for line in (await request.body()).splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubError(400, None, f"unsupported encoding {value.get('encoding')!r}")
                additions[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                deletions.append(value["path"])
            elif key == "deletedFolder":
                deletions.append(value["path"].rstrip("/") + "/")
            else:
                raise HubError(400, None, f"unsupported commit operation {key!r} (only regular uploads are accepted)")
        sha = await asyncio.to_thread(
            store.commit,
            repo_type,
            repo_id,
            branch,
            additions,
            tuple(deletions),
            header.get("summary") or "update",
            header.get("description") or "",
            header.get("parentCommit"),
        )
        prefix = "" if repo_type == "models" else f"{repo_type}/"
        base = str(request.base_url).rstrip("/")
        return {"commitUrl": f"{base}/{prefix}{repo_id}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}

    @hub.get("/api/whoami-v2")
    async def whoami(request: Request):
        """Who a token belongs to; a missing or unknown token is answered 401 as by the Hub."""
        token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if token not in TOKENS:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        return {"type": "user", "name": LOCAL_USER, "auth": {"accessToken": {"role": TOKENS[token]}}}

    @hub.post("/api/validate-yaml")
    async def validate_yaml(request: Request):
        """The client checks a README's metadata before committing it."""
        import yaml

        content = (await request.json()).get("content", "")
        match = re.match(r"^---\s*\n(.*?)\n---\s*$", content, flags=re.S | re.M)
        try:
            metadata = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as error:
            return JSONResponse({"errors": [{"message": f"invalid YAML: {error}"}]}, status_code=400)
        if metadata is not None and not isinstance(metadata, dict):
            return JSONResponse({"errors": [{"message": "metadata must be a YAML mapping"}]}, status_code=400)
        return {"errors": [], "warnings": []}

    @hub.post("/_local_hub/drop")
    async def drop(request: Request):
        state["drop_after_bytes"] = (await request.json())["after_bytes"]
        return state

    @hub.post("/_local_hub/throttle")
    async def throttle(request: Request):
        payload = await request.json()
        state.update(bytes_per_second=payload.get("bytes_per_second"), after_bytes=payload.get("after_bytes", 0))
        return state

    async def serve_range(scope, send, repo_type, repo_id, revision, path, range_header):
        commit, blob, content = await asyncio.to_thread(store.read, repo_type, repo_id, revision, path)
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header.strip())
        size = len(content)
        if match is None or match.groups() == ("", ""):
            raise HubError(416, None, f"unsupported Range header {range_header!r}")
        first, last = match.groups()
        if first == "":  # suffix range: the last N bytes
            start, end = max(size - int(last), 0), size - 1
        else:
            start, end = int(first), min(int(last) if last else size - 1, size - 1)
        if start >= size or start > end:
            headers = [(b"content-range", f"bytes */{size}".encode())]
            await send({"type": "http.response.start", "status": 416, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return 416
        body = content[start : end + 1]
        headers = {
            "content-length": str(len(body)),
            "content-range": f"bytes {start}-{end}/{size}",
            "accept-ranges": "bytes",
            "etag": f'"{blob}"',
            "x-repo-commit": commit,
        }
        await send({"type": "http.response.start", "status": 206, "headers": _encode(headers)})
        await _send_body(send, body if scope["method"] == "GET" else b"")
        return 206

    async def _send_body(send, body: bytes) -> None:
        for offset in range(0, max(len(body), 1), _CHUNK):
            chunk = body[offset : offset + _CHUNK]
            await send({"type": "http.response.body", "body": chunk, "more_body": offset + _CHUNK < len(body)})

    def _encode(headers: dict) -> list:
        return [(k.encode(), v.encode()) for k, v in headers.items()]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await hub(scope, receive, send)
        path, method = scope["path"], scope["method"]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        status, sent = {}, [0]

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body" and path_is_resolve:
                sent[0] += len(message.get("body", b""))
                if state["drop_after_bytes"] is not None and sent[0] > state["drop_after_bytes"]:
                    state["drop_after_bytes"] = None  # once: the client sees the connection close mid-body
                    raise ConnectionAbortedError("local Hub: connection dropped on request")
                if state["bytes_per_second"] and sent[0] > state["after_bytes"]:  # throttled file download
                    await asyncio.sleep(len(message.get("body", b"")) / state["bytes_per_second"])
            await send(message)

        resolve = _RESOLVE.match(path) if method in ("GET", "HEAD") else None
        path_is_resolve = resolve is not None
        try:
            if resolve is not None:
                repo_type = resolve.group(1) or "models"
                repo_id, revision, file_path = resolve.group(2), unquote(resolve.group(3)), unquote(resolve.group(4))
                if "range" in headers:
                    status["code"] = await serve_range(
                        scope, logged_send, repo_type, repo_id, revision, file_path, headers["range"]
                    )
                    return
                # Let olah serve the file, after checking it exists (olah answers a missing path with a 500).
                await asyncio.to_thread(store.read, repo_type, repo_id, revision, file_path)
                return await olah_app(scope, receive, logged_send)
            if path.startswith(
                ("/_local_hub/", "/api/repos/", "/api/validate-yaml", "/api/whoami-v2")
            ) or _API_WRITE.match(path):
                return await hub(scope, receive, logged_send)
            if _REPO_INFO.match(path) and method in ("GET", "HEAD"):
                # olah offline answers repo info only for an explicit revision; the Hub's default is main.
                path_main = f"{path}/revision/main"
                scope = {**scope, "path": path_main, "raw_path": path_main.encode()}
            return await olah_app(scope, receive, logged_send)
        except HubError as exc:
            response = await _hub_error(None, exc)
            status["code"] = exc.status
            await response(scope, receive, send)
        except BaseException:
            status["complete"] = False
            raise
        finally:
            entry = {"method": method, "path": path, "range": headers.get("range"), "status": status.get("code")}
            entry["complete"] = status.get("complete", True)
            with log_lock, open(log_path, "a") as log:
                log.write(json.dumps(entry) + "\n")

    return app


def serve(root: Path, port: int = 0) -> None:
    """Bind 127.0.0.1:``port`` (0: any free port), print the base URL, then serve until terminated."""
    import uvicorn

    root.mkdir(parents=True, exist_ok=True)
    app = build_app(root)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))
    # Idle keep-alive connections stay open far longer than uvicorn's 5 s: a client that reuses a pooled connection
    # just as the server closes it gets "connection reset" (seen once on a loaded 2-core machine); real Hubs keep
    # connections open for minutes.
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=300)
    server = uvicorn.Server(config)
    print(f"http://{HOST}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


# --------------------------------------------------------------------------------------------------------------
# The pytest fixture.
# --------------------------------------------------------------------------------------------------------------
class LocalHub:
    """Handle on a running local Hub: ``endpoint``, ``seed_repo``, ``env``, ``requests``, ``throttle``, ``drop_next_download``."""

    def __init__(self, endpoint: str, root: Path, process: subprocess.Popen):
        self.endpoint = endpoint
        self.root = root
        self.process = process
        self.store = GitStore(root / "repos")

    def seed_repo(self, repo_id: str, folder: str | os.PathLike, repo_type: str = "model") -> str:
        """Commit every file of ``folder`` to ``main`` of ``repo_id`` (created if missing), without the client.

        Returns the commit sha. The repo is served at once (olah reads git on every request)."""
        return self.store.seed(f"{repo_type}s", repo_id, folder, summary=f"seed from {Path(folder).name}")

    def env(self, hub_cache: str | os.PathLike | None = None) -> dict[str, str]:
        """Environment for a subprocess that should talk to this Hub (``HF_ENDPOINT`` is read at import).

        ``hub_cache`` sets ``HF_HUB_CACHE`` (and, beside it, the ``datasets`` and code-module caches) so the subprocess
        writes nothing under the user's ``HF_HOME``, which may be read-only."""
        env = {**os.environ, "HF_ENDPOINT": self.endpoint, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0"}
        env["HF_TOKEN"] = TOKEN
        env.update(HF_HUB_DISABLE_TELEMETRY="1", DIFFUSERS_NO_ADVISORY_WARNINGS="1")
        if hub_cache is not None:
            env["HF_HUB_CACHE"] = str(hub_cache)
            env["HF_DATASETS_CACHE"] = f"{hub_cache}-datasets"
            env["HF_MODULES_CACHE"] = f"{hub_cache}-modules"
        return env

    def requests(self) -> list[dict]:
        """Requests served so far: ``{"method", "path", "range", "status", "complete"}`` in arrival order."""
        log = self.root / "requests.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def drop_next_download(self, after_bytes: int) -> None:
        """Close the connection of the next file download once it has sent ``after_bytes`` bytes."""
        import httpx

        httpx.post(f"{self.endpoint}/_local_hub/drop", json={"after_bytes": after_bytes}).raise_for_status()

    def throttle(self, bytes_per_second: float | None, after_bytes: int = 0) -> None:
        """Send each file download's bytes beyond ``after_bytes`` at ``bytes_per_second`` (``None``: full speed)."""
        import httpx

        httpx.post(
            f"{self.endpoint}/_local_hub/throttle",
            json={"bytes_per_second": bytes_per_second, "after_bytes": after_bytes},
        ).raise_for_status()


def start_local_hub(root: Path, timeout: float = STARTUP_TIMEOUT_S) -> LocalHub:
    """Start ``hub_server.py`` as a subprocess and wait (at most ``timeout`` s) for its URL."""
    root.mkdir(parents=True, exist_ok=True)
    stderr = open(root / "server.log", "wb")
    process = subprocess.Popen(
        [sys.executable, __file__, "--port", "0", "--root", str(root)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    stderr.close()
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline().decode()), daemon=True)
    reader.start()
    reader.join(timeout)
    url = lines[0].strip() if lines else ""
    if not url.startswith("http://"):
        process.kill()
        log = (root / "server.log").read_text(errors="replace")
        raise RuntimeError(f"local Hub did not start within {timeout:.0f} s:\n{log[-4000:]}")
    _wait_until_serving(url, timeout)
    return LocalHub(url, root, process)


def _wait_until_serving(url: str, timeout: float) -> None:
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"local Hub at {url} does not accept connections") from None
            time.sleep(0.05)


def stop_local_hub(hub: LocalHub) -> None:
    hub.process.terminate()
    try:
        hub.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        hub.process.kill()
        hub.process.wait()


try:
    import pytest
except ImportError:  # running standalone without pytest installed
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def local_hub(tmp_path_factory) -> LocalHub:
        """A real Hub on 127.0.0.1 for the whole test session (one server, started once).

        Use it like the Hub, through the real client::

            def test_push_pull(local_hub, tmp_path):
                api = HfApi(endpoint=local_hub.endpoint)
                api.create_repo("me/model", exist_ok=True)
                api.upload_folder(repo_id="me/model", folder_path=folder)
                path = snapshot_download("me/model", revision="main", endpoint=local_hub.endpoint,
                                         cache_dir=tmp_path / "cache")

        * ``local_hub.endpoint``: base URL for ``HfApi(endpoint=...)``, ``endpoint=`` arguments and ``HF_ENDPOINT``.
        * ``local_hub.seed_repo(repo_id, folder)``: commit a local folder to ``main`` without the client.
        * ``local_hub.env(hub_cache=...)``: environment for a subprocess; code that reads ``HF_ENDPOINT`` at
          import (diffusers ``from_pretrained("ns/name", revision="main")``) must run in such a subprocess.
        * ``local_hub.requests()``: the request log; ``local_hub.throttle(bytes_per_second, after_bytes)``: slow
          downloads; ``local_hub.drop_next_download(after_bytes)``: cut the next download's connection once.

        Repos persist for the session: give each test its own repo id. Pass ``cache_dir`` (or ``hub_cache``) so
        nothing is written to the user's Hugging Face cache.
        """
        hub = start_local_hub(tmp_path_factory.mktemp("local_hub"))
        try:
            yield hub
        finally:
            stop_local_hub(hub)

    @pytest.fixture
    def hub_online(monkeypatch) -> None:
        """This test's own Hub calls are online whatever ``HF_HUB_OFFLINE`` says (offline CI machines export it).

        ``huggingface_hub`` reads the variable once, at import, into ``constants.HF_HUB_OFFLINE``: both are set here
        and restored by ``monkeypatch`` when the test ends. Subprocesses get ``HF_HUB_OFFLINE=0`` from
        :meth:`LocalHub.env`. conftest.py applies this to every test that uses ``local_hub``.
        """
        from huggingface_hub import constants

        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a local Hugging Face Hub (olah for reads, git for writes).")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: pick a free one)")
    parser.add_argument("--root", type=Path, required=True, help="folder for the git repositories and logs")
    args = parser.parse_args(argv)
    serve(args.root, args.port)


if __name__ == "__main__":
    main()
