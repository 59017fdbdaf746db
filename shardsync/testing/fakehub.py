"""A fake Hugging Face Hub: real HTTP on loopback, the Hub's protocol, faults on demand.

Two aiohttp servers run on one event loop: the *hub* (API, ``resolve`` URLs) and the *cdn* on
another loopback address, which the hub redirects LFS files to with signed-looking URLs. The
CDN being another host is what lets a test see whether a client forwards its token after a
redirect (`FakeHub.log` keeps every request's headers).

huggingface_hub itself downloads from it (``endpoint=hub.endpoint`` or ``HF_ENDPOINT``), so it
checks both our client and our assumptions about the protocol::

    async with FakeHub() as hub:
        commit = hub.add_checkpoint("org/model", build_checkpoint(tmp, total_bytes=..., n_shards=4))
        hub.faults.add(CutBody(path="model-00002-*"))
        ...  # download from hub.endpoint

The routes served:

- ``GET /api/models/{org}/{name}[/revision/{rev}][?blobs=true]``: repo info with ``siblings``
  (at most ``siblings_cap`` of them, as the Hub may cut a large repo's list short).
- ``GET /api/models/{org}/{name}/tree/{rev}[/{path}][?recursive=true&limit=N&cursor=C]``: file
  listing, paginated with a ``Link: <...>; rel="next"`` header.
- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}``: ``X-Repo-Commit`` and ``ETag`` always; LFS
  files (``*.safetensors``, ``*.bin``, ``*.pt`` and anything over 10 MiB) answer ``302`` to the
  CDN with ``X-Linked-Etag``/``X-Linked-Size``, small files answer 200 directly.
- CDN ``HEAD|GET /repos/{commit}/{sha256}?repo_path=...&Signature=...``; with
  ``FakeHub(cdn_base=URL)`` LFS files redirect to ``URL/{sha256}`` on a server of your own
  instead (benchmarks use a real nginx, so that the origin's bytes are never the bottleneck).

Revisions are branch or tag names (``refs/pr/1`` too, URL-encoded or not) or 40-hex commits.
Bodies honour ``Range`` (``a-b``, ``a-``, ``-n``; a multi-range is ignored), strong-ETag
``If-Range`` (compared with the ETag of the object the URL serves *now*, see `ReplaceObject`),
answer 206 with ``Content-Range`` or 416 with ``bytes */N``, and are never compressed. File
names are served verbatim, hostile ones included, so that a client's name validation can be
tested against a server that lies.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Protocol, TypeVar
from urllib.parse import quote, unquote, urlencode

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from shardsync.testing.checkpoints import Checkpoint
from shardsync.testing.faults import Effects, FaultPlan, FaultRequest

__all__ = ["LFS_SUFFIXES", "LFS_THRESHOLD", "FakeHub", "RequestRecord", "serve_in_thread"]

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")
"""Files with these suffixes are stored in LFS (served through the CDN) whatever their size."""

LFS_THRESHOLD = 10 * 1024 * 1024
"""Files larger than this are stored in LFS too."""

_CHUNK_SIZE = 1024 * 1024
_DEFAULT_TREE_PAGE_SIZE = 1000
_SHUTDOWN_TIMEOUT = 0.5
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_NUMBER_RE = re.compile(r"[0-9]+")
_TIMESTAMP = "2024-01-01T00:00:00.000Z"


# ---------------------------------------------------------------------------------------------
# What the hub stores


class _Blob(Protocol):
    """The bytes of one file, wherever they live."""

    @property
    def size(self) -> int:
        """Length in bytes."""

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Exactly `length` bytes from `offset`."""

    def close(self) -> None:
        """Release whatever reading needed."""


class _MemoryBlob:
    """Bytes held in memory; reads are zero-copy views."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)

    @property
    def size(self) -> int:
        return len(self._data)

    def read(self, offset: int, length: int) -> memoryview:
        return self._data[offset : offset + length]

    def close(self) -> None:
        """Nothing to release."""


class _FileBlob:
    """A file on disk, read with ``pread`` so a multi-GB checkpoint is never held in memory.

    Reads happen on the event loop: from the page cache a 1 MiB ``pread`` costs far less than a
    thread hop, and the fake hub has no other work to keep responsive.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._size = path.stat().st_size
        self._fd: int | None = None
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            fd = self._fd
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(f"{self._path} changed while being served")
        return data

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


@dataclass(frozen=True, slots=True)
class _File:
    path: str
    size: int
    sha256: str
    blob_id: str
    """git blob sha1 of the content, or of the LFS pointer for LFS files."""
    pointer_size: int | None
    """Size of the LFS pointer file; None for files stored in git."""
    blob: _Blob = field(compare=False)

    @property
    def lfs(self) -> bool:
        return self.pointer_size is not None

    @property
    def etag(self) -> str:
        return f'"{self.sha256 if self.lfs else self.blob_id}"'


@dataclass(frozen=True, slots=True)
class _Commit:
    sha: str
    files: Mapping[str, _File]
    """By path, sorted."""

    def tree(self, prefix: str, *, recursive: bool) -> list[dict[str, Any]]:
        """Tree-listing entries under `prefix` ("" for the root), directories included."""
        base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for path, file in self.files.items():
            if not path.startswith(base):
                continue
            parts = path[len(base) :].split("/")
            for depth in range(1, len(parts)):
                directory = base + "/".join(parts[:depth])
                entries.setdefault(directory, _directory_entry(directory))
                if not recursive:
                    break
            else:
                entries[path] = _file_entry(file)
        return [entries[path] for path in sorted(entries)]


@dataclass(slots=True)
class _Repo:
    repo_id: str
    gated: bool
    token: str | None
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)

    def commit(self, revision: str) -> _Commit | None:
        sha = self.refs.get(revision, revision)
        return self.commits.get(sha)

    def split_revision(self, rest: str, *, need_path: bool) -> tuple[str, str]:
        """Split ``{revision}/{path}`` where the revision may contain slashes (``refs/pr/1``).

        The longest known revision wins; if none is known the first segment is taken as the
        (missing) revision so the caller can report it.
        """
        parts = rest.split("/")
        longest = len(parts) - 1 if need_path else len(parts)
        for n in range(longest, 0, -1):
            revision = "/".join(parts[:n])
            if self.commit(revision) is not None:
                return revision, "/".join(parts[n:])
        return parts[0], "/".join(parts[1:])


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    lines = ("version https://git-lfs.github.com/spec/v1", f"oid sha256:{sha256}", f"size {size}")
    return ("\n".join(lines) + "\n").encode()


def _is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size > LFS_THRESHOLD


def _make_file(path: str, source: bytes | Path) -> _File:
    blob: _Blob
    if isinstance(source, Path):
        blob = _FileBlob(source)
        with source.open("rb") as f:
            sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    else:
        blob = _MemoryBlob(source)
        sha256 = hashlib.sha256(source).hexdigest()
    if _is_lfs(path, blob.size):
        pointer = _lfs_pointer(sha256, blob.size)
        return _File(path, blob.size, sha256, _git_blob_id(pointer), len(pointer), blob)
    content = source.read_bytes() if isinstance(source, Path) else source
    return _File(path, blob.size, sha256, _git_blob_id(content), None, blob)


def _file_entry(file: _File) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "path": file.path}
    entry |= {"oid": file.blob_id, "size": file.size}
    if file.pointer_size is not None:
        entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": file.pointer_size}
    return entry


def _directory_entry(path: str) -> dict[str, Any]:
    oid = hashlib.sha1(b"tree " + path.encode(), usedforsecurity=False).hexdigest()
    return {"type": "directory", "oid": oid, "size": 0, "path": path}


def _sibling(file: _File, *, blobs: bool) -> dict[str, Any]:
    sibling: dict[str, Any] = {"rfilename": file.path}
    if blobs:
        sibling["size"] = file.size
        sibling["blobId"] = file.blob_id
        if file.pointer_size is not None:
            sibling["lfs"] = {
                "sha256": file.sha256,
                "size": file.size,
                "pointerSize": file.pointer_size,
            }
    return sibling


def _content_commit(repo_id: str, files: Mapping[str, _File]) -> str:
    digest = hashlib.sha1(f"commit {repo_id}\n".encode(), usedforsecurity=False)
    for path, file in files.items():
        digest.update(f"{file.blob_id} {path}\n".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# HTTP details


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the fake hub saw it, and what it answered."""

    server: Literal["hub", "cdn"]
    method: str
    path: str
    """The raw (still percent-encoded) URL path."""
    query: Mapping[str, str]
    headers: Mapping[str, str]
    """The request headers, case-insensitive."""
    status: int
    """The status sent, or 0 when the client went away before any was."""
    range: str | None
    """The request's ``Range`` header."""
    bytes_sent: int
    """Body bytes written, up to a cut or a disconnect."""
    file: str | None
    """The repository file path the request was about, if any."""


@dataclass(eq=False, slots=True)
class _Exchange:
    """What a handler learns while answering, for the record written when it finishes."""

    file: str | None = None
    status: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True, slots=True)
class _Span:
    start: int
    stop: int


_UNSATISFIABLE: Final = "unsatisfiable"
_RANGE_RE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", re.ASCII | re.IGNORECASE)


def _parse_range(value: str, size: int) -> _Span | Literal["unsatisfiable"] | None:
    """Parse a ``Range`` header for a `size`-byte body; None means "ignore it, send 200".

    Syntax errors and multi-ranges are ignored, as RFC 9110 allows; a well-formed range that
    selects nothing is unsatisfiable.
    """
    match = _RANGE_RE.fullmatch(value)
    if match is None or not (match[1] or match[2]):
        return None
    if not match[1]:
        suffix = int(match[2])
        if suffix == 0 or size == 0:
            return _UNSATISFIABLE
        return _Span(max(size - suffix, 0), size)
    start = int(match[1])
    last = int(match[2]) if match[2] else None
    if last is not None and last < start:
        return None
    if start >= size:
        return _UNSATISFIABLE
    return _Span(start, size if last is None else min(last + 1, size))


def _if_match_matches(if_match: str, etag: str | None) -> bool:
    """``If-Match``: ``*`` or one of the listed strong ETags is the object's (RFC 9110 13.1.1)."""
    if etag is None:
        return False
    listed = [tag.strip() for tag in if_match.split(",")]
    return "*" in listed or etag in listed


def _if_range_matches(if_range: str | None, etag: str) -> bool:
    """Strong comparison; a weak ETag or a date never matches (we send no Last-Modified)."""
    return if_range is None or (not if_range.startswith("W/") and if_range.strip() == etag)


def _error(
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    all_headers = CIMultiDict(headers or {})
    all_headers["X-Error-Message"] = message
    if code is not None:
        all_headers["X-Error-Code"] = code
    return web.Response(
        status=status,
        body=json.dumps({"error": message}).encode(),
        content_type="application/json",
        headers=all_headers,
    )


def _bearer(request: web.BaseRequest) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _flag(request: web.BaseRequest, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true")


def _replaced(effects: Effects, blob: _Blob) -> _Blob:
    """What the URL serves now: a `ReplaceObject` fault's content, or the stored blob."""
    return blob if effects.replacement is None else _MemoryBlob(effects.replacement.content)


def _shifted(span: _Span, shift: int, size: int) -> _Span:
    """`span` moved by `shift` bytes and clipped to a `size`-byte body (never empty)."""
    if shift == 0:
        return span
    start = min(max(span.start + shift, 0), size - 1)
    return _Span(start, min(max(span.stop + shift, start + 1), size))


def _flipped(data: bytes | memoryview, index: int) -> bytes:
    changed = bytearray(data)
    changed[index] ^= 0xFF
    return bytes(changed)


# ---------------------------------------------------------------------------------------------
# The fake hub


class FakeHub:
    """A Hugging Face Hub and CDN on loopback; see the module docstring for the protocol.

    Safe to feed from another thread while it serves: `add_repo`, `faults`, `log`,
    `bytes_served` and `reset_log` all lock.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        cdn_host: str = "127.0.0.2",
        port: int = 0,
        cdn_port: int = 0,
        tree_page_size: int = _DEFAULT_TREE_PAGE_SIZE,
        siblings_cap: int | None = None,
        seed: int = 0,
        cdn_base: str | None = None,
        url_lifetime: float | None = None,
    ) -> None:
        self.host = host
        self.url_lifetime = url_lifetime
        """Seconds a CDN URL stays valid (None: for ever), like the real Hub's signed Xet
        bridge URLs (about an hour): an expired one answers 403 and must be resolved again."""
        self.cdn_host = cdn_host
        self.cdn_base = cdn_base.rstrip("/") if cdn_base else None
        """When set, LFS resolves redirect to ``{cdn_base}/{sha256}`` (an external server, e.g.
        nginx serving a directory of files named by their sha256) instead of the built-in CDN,
        which then serves nothing. Same ``X-Linked-Etag``/``X-Linked-Size``/``ETag`` headers;
        the bytes, and their faults and accounting, are that server's business."""
        self.tree_page_size = tree_page_size
        """Entries per tree-listing page (a ``limit`` query parameter can only lower it)."""
        self.siblings_cap = siblings_cap
        """List at most this many ``siblings`` in repo info, as the Hub may for large repos."""
        self.faults = FaultPlan(seed=seed)
        self._ports = (port, cdn_port)
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        self._store: dict[str, _Blob] = {}
        self._log: list[RequestRecord] = []
        self._answering: set[_Exchange] = set()  # bodies being sent, counted while they flow
        self._runners: list[web.BaseRunner] = []
        self._endpoints: tuple[str, str] | None = None
        self._secret = secrets.token_bytes(16)

    # --- content -----------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path],
        *,
        revision: str = "main",
        commit: str | None = None,
        gated: bool = False,
        token: str | None = None,
    ) -> str:
        """Point `revision` of `repo_id` at a commit holding `files`; return the commit sha.

        Bytes are kept in memory, paths are read from disk when served. Without `commit`, the
        sha is derived from the repo id and the content, so it is stable across runs. `token`
        makes the repo private (that bearer token is required), `gated` makes it gated (the
        token is then required too). Access settings belong to the repository: every call for
        the same repo must repeat them.
        """
        org, slash, name = repo_id.partition("/")
        if not org or not slash or not name or "/" in name:
            raise ValueError(f"repo_id must look like 'org/name', not {repo_id!r}")
        if gated and token is None:
            raise ValueError("a gated repository needs the token that has been granted access")
        if commit is not None and not _COMMIT_RE.fullmatch(commit):
            raise ValueError(f"commit must be 40 lowercase hex digits, not {commit!r}")
        if not revision:
            raise ValueError("revision must not be empty")
        built = {path: _make_file(path, files[path]) for path in sorted(files)}
        sha = commit or _content_commit(repo_id, built)
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(repo_id, gated=gated, token=token))
            if (repo.gated, repo.token) != (gated, token):
                raise ValueError(f"{repo_id} was added with other access settings")
            repo.commits[sha] = _Commit(sha, built)
            if revision != sha:
                repo.refs[revision] = sha
            for file in built.values():
                self._store.setdefault(file.sha256, file.blob)
        return sha

    def add_checkpoint(
        self,
        repo_id: str,
        checkpoint: Checkpoint,
        *,
        revision: str = "main",
        commit: str | None = None,
        gated: bool = False,
        token: str | None = None,
    ) -> str:
        """`add_repo` with every file of `checkpoint`, served from disk."""
        files = {rel: checkpoint.path(rel) for rel in checkpoint.files}
        return self.add_repo(
            repo_id, files, revision=revision, commit=commit, gated=gated, token=token
        )

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind both servers; `endpoint` and `cdn_endpoint` are valid afterwards."""
        if self._endpoints is not None:
            raise RuntimeError("FakeHub is already started")
        try:
            hub = await self._listen("hub", self.host, self._ports[0])
            cdn = await self._listen("cdn", self.cdn_host, self._ports[1])
        except BaseException:
            await self.close()
            raise
        self._endpoints = (hub, cdn)

    async def close(self) -> None:
        """Stop serving: cancels responses in flight (stalls included) and closes files."""
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()
        self._endpoints = None
        with self._lock:
            blobs = list(self._store.values())
        for blob in blobs:
            blob.close()

    async def __aenter__(self) -> FakeHub:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def endpoint(self) -> str:
        """``http://host:port`` of the hub, to pass as huggingface_hub's ``endpoint``."""
        return self._started()[0]

    @property
    def cdn_endpoint(self) -> str:
        """``http://host:port`` of the CDN that LFS files redirect to."""
        return self._started()[1]

    def _started(self) -> tuple[str, str]:
        if self._endpoints is None:
            raise RuntimeError("FakeHub is not started")
        return self._endpoints

    # --- the request log ---------------------------------------------------------------------

    @property
    def log(self) -> list[RequestRecord]:
        """Every request answered so far (a copy), oldest first."""
        with self._lock:
            return list(self._log)

    def reset_log(self) -> None:
        """Forget the requests seen so far."""
        with self._lock:
            self._log.clear()

    def bytes_served(self, path_glob: str = "*") -> int:
        """File-content bytes sent (CDN bodies and direct ``resolve`` bodies) for matching
        paths, bodies still being sent included (a kill "40% in" is timed by it)."""
        with self._lock:
            answering = [(e.file, e.status, e.bytes_sent) for e in self._answering]
            done = [(r.file, r.status, r.bytes_sent) for r in self._log]
        return sum(
            sent
            for file, status, sent in done + answering
            if file is not None and status in (200, 206) and fnmatchcase(file, path_glob)
        )

    # --- serving -----------------------------------------------------------------------------

    async def _listen(self, server: Literal["hub", "cdn"], host: str, port: int) -> str:
        route = self._route_hub if server == "hub" else self._route_cdn

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            exchange = _Exchange()
            with self._lock:
                self._answering.add(exchange)
            try:
                response = await route(request, exchange)
                if not response.prepared:
                    exchange.status = response.status
                    if request.method != "HEAD":
                        exchange.bytes_sent = response.content_length or 0
                return response
            finally:
                self._record(server, request, exchange)

        # Handler cancellation lets a client that hangs up end a stalled or paced response.
        web_server = web.Server(handle, handler_cancellation=True, access_log=None)
        runner = web.ServerRunner(web_server, shutdown_timeout=_SHUTDOWN_TIMEOUT)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, host, port).start()
        bound_port = runner.addresses[-1][1]
        return f"http://{host}:{bound_port}"

    def _record(
        self, server: Literal["hub", "cdn"], request: web.BaseRequest, exchange: _Exchange
    ) -> None:
        record = RequestRecord(
            server=server,
            method=request.method,
            path=request.rel_url.raw_path,
            query=dict(request.query),
            headers=CIMultiDictProxy(CIMultiDict(request.headers)),
            status=exchange.status,
            range=request.headers.get("Range"),
            bytes_sent=exchange.bytes_sent,
            file=exchange.file,
        )
        with self._lock:
            self._log.append(record)
            self._answering.discard(exchange)

    async def _route_hub(self, request: web.BaseRequest, exchange: _Exchange) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"{request.method} is not supported by the fake hub")
        parts = request.rel_url.raw_path.split("/")[1:]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return await self._api(request, exchange, parts[2:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return await self._resolve(request, exchange, parts)
        return _error(404, "Not Found")

    def _find(
        self, request: web.BaseRequest, repo_id: str, rest: str, *, need_path: bool
    ) -> _Target | web.Response:
        """Authorize the request for `repo_id` and resolve ``{revision}[/{path}]`` in it."""
        token = _bearer(request)
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                return _repo_not_found(repo_id, token)
            if repo.token is not None and not (token and hmac.compare_digest(token, repo.token)):
                if not repo.gated:
                    return _repo_not_found(repo_id, token)
                message = f"Access to model {repo_id} is restricted and you are not in the list."
                return _error(401 if token is None else 403, message, code="GatedRepo")
            revision, path = repo.split_revision(rest, need_path=need_path)
            commit = repo.commit(revision)
            gated, private = repo.gated, repo.token is not None and not repo.gated
        if commit is None:
            return _error(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return _Target(repo_id, commit, path, gated=gated, private=private)

    async def _api(
        self, request: web.BaseRequest, exchange: _Exchange, parts: list[str]
    ) -> web.StreamResponse:
        repo_id = f"{unquote(parts[0])}/{unquote(parts[1])}"
        if len(parts) == 2:
            kind, rest = "revision", "main"
        elif len(parts) > 3 and parts[2] in ("revision", "tree"):
            kind, rest = parts[2], "/".join(unquote(part) for part in parts[3:])
        else:
            return _error(404, "Not Found")
        found = self._find(request, repo_id, rest, need_path=False)
        if isinstance(found, web.Response):
            return found
        if kind == "revision":
            if found.path:
                return _error(404, f"Invalid rev id: {rest}", code="RevisionNotFound")
            info = found.info(blobs=_flag(request, "blobs"), cap=self.siblings_cap)
            return await self._send_json(request, exchange, info)
        entries = found.commit.tree(found.path, recursive=_flag(request, "recursive"))
        if found.path and not entries:
            message = f"{found.path} does not exist at {found.commit.sha}"
            return _error(404, message, code="EntryNotFound")
        return await self._send_tree_page(request, exchange, entries)

    async def _send_tree_page(
        self, request: web.BaseRequest, exchange: _Exchange, entries: list[dict[str, Any]]
    ) -> web.StreamResponse:
        limit = self.tree_page_size
        raw_limit = request.query.get("limit")
        if raw_limit is not None:
            if not _NUMBER_RE.fullmatch(raw_limit) or int(raw_limit) == 0:
                return _error(400, f"invalid limit {raw_limit!r}")
            limit = min(limit, int(raw_limit))
        offset = _decode_cursor(request.query.get("cursor"))
        if offset is None:
            return _error(400, "invalid cursor")
        headers: dict[str, str] = {}
        if offset + limit < len(entries):
            query = {**request.query, "cursor": _encode_cursor(offset + limit)}
            next_url = f"{self.endpoint}{request.rel_url.raw_path}?{urlencode(query)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        page = entries[offset : offset + limit]
        return await self._send_json(request, exchange, page, headers=headers)

    async def _resolve(
        self, request: web.BaseRequest, exchange: _Exchange, parts: list[str]
    ) -> web.StreamResponse:
        repo_id = f"{unquote(parts[0])}/{unquote(parts[1])}"
        rest = "/".join(unquote(part) for part in parts[3:])
        found = self._find(request, repo_id, rest, need_path=True)
        if isinstance(found, web.Response):
            return found
        exchange.file = found.path
        headers = {"X-Repo-Commit": found.commit.sha}
        file = found.commit.files.get(found.path)
        if file is None:
            message = f"{found.path} does not exist at {found.commit.sha}"
            return _error(404, message, code="EntryNotFound", headers=headers)
        has_body = request.method == "GET" and not file.lfs
        effects = await self._take_faults(
            FaultRequest("hub", file.path, has_body=has_body, has_range="Range" in request.headers)
        )
        if isinstance(effects, web.Response):
            return effects
        if not file.lfs:
            blob = _replaced(effects, file.blob)
            return await self._send_body(
                request, exchange, blob, effects, headers=headers, etag=file.etag, ranged=True
            )
        etag = effects.sent_etag(effects.etag(file.etag), status=302)
        if etag is not None:
            headers["ETag"] = etag
        if effects.replacement is not None:
            headers["X-Linked-Etag"] = effects.replacement.etag
            headers["X-Linked-Size"] = str(len(effects.replacement.content))
        else:
            headers["X-Linked-Etag"] = f'"{file.sha256}"'
            headers["X-Linked-Size"] = str(file.size)
        headers["Location"] = self._cdn_url(found.commit, file)
        return web.Response(status=302, headers=headers)

    def _cdn_url(self, commit: _Commit, file: _File) -> str:
        if self.cdn_base is not None:
            return f"{self.cdn_base}/{file.sha256}"
        path = f"/repos/{commit.sha}/{file.sha256}"
        expires = "" if self.url_lifetime is None else f"{time.time() + self.url_lifetime:.3f}"
        signature = self._sign(path, file.path, expires)
        fields = {"repo_path": file.path, "Expires": expires, "Signature": signature}
        query = urlencode({k: v for k, v in fields.items() if v})
        return f"{self.cdn_endpoint}{path}?{query}"

    def _sign(self, path: str, repo_path: str, expires: str = "") -> str:
        message = f"{path}\n{repo_path}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:40]

    async def _route_cdn(self, request: web.BaseRequest, exchange: _Exchange) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"{request.method} is not supported by the fake CDN")
        path = request.rel_url.raw_path
        parts = path.split("/")[1:]
        repo_path = request.query.get("repo_path", "")
        signature = request.query.get("Signature", "")
        expires = request.query.get("Expires", "")
        if len(parts) != 3 or parts[0] != "repos":
            return _error(404, "NoSuchKey")
        if not hmac.compare_digest(signature, self._sign(path, repo_path, expires)):
            return _error(403, "AccessDenied: the URL signature does not match")
        if expires and time.time() > float(expires):
            return _error(403, "AccessDenied: Request has expired")
        exchange.file = repo_path
        with self._lock:
            blob = self._store.get(parts[2])
        if blob is None:
            return _error(404, "NoSuchKey")
        has_body = request.method == "GET"
        effects = await self._take_faults(
            FaultRequest("cdn", repo_path, has_body=has_body, has_range="Range" in request.headers)
        )
        if isinstance(effects, web.Response):
            return effects
        name = repo_path.rsplit("/", 1)[-1]
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name)}; "
            f'filename="{quote(name)}";',
        }
        return await self._send_body(
            request,
            exchange,
            _replaced(effects, blob),
            effects,
            headers=headers,
            etag=f'"{parts[2]}"',
            ranged=True,
        )

    async def _take_faults(self, fault_request: FaultRequest) -> Effects | web.Response:
        """The faults for this response; an error response if one replaces it."""
        effects = self.faults.take(fault_request)
        if effects.latency > 0:
            await asyncio.sleep(effects.latency)
        if effects.status is None:
            return effects
        headers = {}
        if effects.status.retry_after is not None:
            headers["Retry-After"] = effects.status.retry_after
        return _error(effects.status.code, "injected fault", headers=headers)

    async def _send_json(
        self,
        request: web.BaseRequest,
        exchange: _Exchange,
        data: object,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        has_body = request.method == "GET"
        fault_request = FaultRequest("hub", "", has_body=has_body, has_range=False)
        effects = await self._take_faults(fault_request)
        if isinstance(effects, web.Response):
            return effects
        body = _MemoryBlob(json.dumps(data).encode())
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        return await self._send_body(
            request, exchange, body, effects, headers=all_headers, etag=None, ranged=False
        )

    async def _send_body(
        self,
        request: web.BaseRequest,
        exchange: _Exchange,
        blob: _Blob,
        effects: Effects,
        *,
        headers: Mapping[str, str],
        etag: str | None,
        ranged: bool,
    ) -> web.StreamResponse:
        """Answer with `blob` (or the part a ``Range`` selects), applying body faults."""
        out = CIMultiDict(headers)
        span, status = _Span(0, blob.size), 200
        etag = effects.etag(etag) if etag is not None else None
        # what a conditional request is compared with: the ETag a full answer carries
        validator = effects.sent_etag(etag, status=200) if etag is not None else None
        if_match = request.headers.get("If-Match")
        if ranged and if_match is not None and not _if_match_matches(if_match, validator):
            return _error(412, "PreconditionFailed: the object changed")
        if ranged:
            out["Accept-Ranges"] = "bytes"
            range_header = request.headers.get("Range")
            if_range = request.headers.get("If-Range")
            if (
                range_header is not None
                and not effects.ignore_range
                and (effects.ignore_if_range or _if_range_matches(if_range, validator or ""))
            ):
                parsed = _parse_range(range_header, blob.size)
                if parsed == _UNSATISFIABLE:
                    out["Content-Range"] = f"bytes */{blob.size}"
                    return web.Response(status=416, headers=out)
                if isinstance(parsed, _Span):
                    span, status = _shifted(parsed, effects.range_shift, blob.size), 206
                    first = span.start + effects.content_range_shift
                    last = span.stop - 1 + effects.content_range_shift
                    out["Content-Range"] = f"bytes {first}-{last}/{blob.size}"
        sent_etag = effects.sent_etag(etag, status=status) if etag is not None else None
        if sent_etag is not None:
            out["ETag"] = sent_etag
        response = web.StreamResponse(status=status, headers=out)
        if effects.chunked is not None and request.method == "GET":
            response.enable_chunked_encoding()
        else:
            response.content_length = span.stop - span.start
        await response.prepare(request)
        exchange.status = status
        if request.method == "HEAD":
            return response
        if effects.stall is not None:
            await asyncio.sleep(effects.stall)
            _drop_connection(request)
            return response
        await _write_body(request, response, exchange, blob, span, effects)
        return response


@dataclass(frozen=True, slots=True)
class _Target:
    """An authorized request's repository, commit and path within it."""

    repo_id: str
    commit: _Commit
    path: str
    gated: bool
    private: bool

    def info(self, *, blobs: bool, cap: int | None = None) -> dict[str, Any]:
        """The ``/api/models/{repo_id}/revision/{rev}`` document huggingface_hub parses."""
        author = self.repo_id.split("/")[0]
        return {
            "_id": hashlib.sha1(self.repo_id.encode(), usedforsecurity=False).hexdigest()[:24],
            "id": self.repo_id,
            "modelId": self.repo_id,
            "author": author,
            "sha": self.commit.sha,
            "lastModified": _TIMESTAMP,
            "createdAt": _TIMESTAMP,
            "private": self.private,
            "gated": "manual" if self.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [
                _sibling(file, blobs=blobs) for file in list(self.commit.files.values())[:cap]
            ],
            "usedStorage": sum(file.size for file in self.commit.files.values()),
        }


def _repo_not_found(repo_id: str, token: str | None) -> web.Response:
    # Like the Hub: 401 without credentials (it might exist and be private), 404 with them.
    status = 401 if token is None else 404
    return _error(status, f"Repository {repo_id} not found", code="RepoNotFound")


def _encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"offset:{offset}".encode()).decode()


def _decode_cursor(cursor: str | None) -> int | None:
    """The offset a cursor stands for (0 without one), or None if it is not ours."""
    if cursor is None:
        return 0
    try:
        text = base64.urlsafe_b64decode(cursor.encode()).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    prefix, _, offset = text.partition(":")
    return int(offset) if prefix == "offset" and _NUMBER_RE.fullmatch(offset) else None


def _drop_connection(request: web.BaseRequest) -> None:
    """Close the connection once what was written is flushed: the client sees a short body."""
    if request.transport is not None:
        request.transport.close()


async def _write_body(
    request: web.BaseRequest,
    response: web.StreamResponse,
    exchange: _Exchange,
    blob: _Blob,
    span: _Span,
    effects: Effects,
) -> None:
    length = span.stop - span.start
    cut = effects.cut_after(length)
    flip = effects.flip_at(length)
    pacer = effects.pacer()
    end = length if cut is None else cut
    chunk = pacer.chunk if pacer is not None else _CHUNK_SIZE
    if effects.chunked is not None:
        chunk = min(chunk, effects.chunked)
    sent = 0
    try:
        while sent < end:
            n = min(chunk, end - sent)
            data = blob.read(span.start + sent, n)
            if flip is not None and sent <= flip < sent + n:
                data = _flipped(data, flip - sent)
            if pacer is not None and (delay := pacer.delay(n)) > 0:
                await asyncio.sleep(delay)
            await response.write(data)
            sent += n
            exchange.bytes_sent = sent
    except ConnectionError:
        return  # the client hung up; what it got is recorded
    if cut is not None:
        _drop_connection(request)


class Serving(Protocol):
    """A loopback server of the testing package (`FakeHub`, `Relay`)."""

    async def start(self) -> None:
        """Begin serving on loopback."""

    async def close(self) -> None:
        """Stop serving and let go of every connection."""


_S = TypeVar("_S", bound=Serving)


@contextmanager
def serve_in_thread(hub: _S) -> Iterator[_S]:
    """Run `hub` (a `FakeHub`, or any `Serving`, such as a `Relay`) on its own event loop in a
    daemon thread, for synchronous callers.

    Meant for sync tests (huggingface_hub's blocking API), subprocess tests and benchmarks.
    A hub's `add_repo`, `faults` and `log` stay usable from the calling thread.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="serving", daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(hub.start(), loop).result()
        try:
            yield hub
        finally:
            asyncio.run_coroutine_threadsafe(hub.close(), loop).result()
    finally:
        # on its own thread: the caller may be running an event loop of its own
        asyncio.run_coroutine_threadsafe(loop.shutdown_asyncgens(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
