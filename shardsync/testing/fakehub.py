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
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import quote, unquote, urlencode

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from shardsync.testing.checkpoints import Checkpoint
from shardsync.testing.faults import Effects, FaultPlan, FaultRequest
from shardsync.testing.hub_http import (
    UNSATISFIABLE,
    Exchange,
    RequestRecord,
    Span,
    bearer,
    decode_cursor,
    drop_connection,
    encode_cursor,
    error_response,
    flag,
    if_match_matches,
    if_range_matches,
    parse_range,
    replaced,
    shifted,
    write_body,
)
from shardsync.testing.hub_repos import (
    Blob,
    Commit,
    MemoryBlob,
    Repo,
    RepoFile,
    content_commit,
    make_file,
    sibling,
)

__all__ = ["FakeHub", "serve_in_thread"]

_DEFAULT_TREE_PAGE_SIZE = 1000
_SHUTDOWN_TIMEOUT = 0.5
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_NUMBER_RE = re.compile(r"[0-9]+")
_TIMESTAMP = "2024-01-01T00:00:00.000Z"


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
        self._asked: set[tuple[str, str, str]] = set()  # (server, file, Range) seen so far
        self._repos: dict[str, Repo] = {}
        self._store: dict[str, Blob] = {}
        self._log: list[RequestRecord] = []
        self._answering: set[Exchange] = set()  # bodies being sent, counted while they flow
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
        built = {path: make_file(path, files[path]) for path in sorted(files)}
        sha = commit or content_commit(repo_id, built)
        with self._lock:
            repo = self._repos.setdefault(repo_id, Repo(repo_id, gated=gated, token=token))
            if (repo.gated, repo.token) != (gated, token):
                raise ValueError(f"{repo_id} was added with other access settings")
            repo.commits[sha] = Commit(sha, built)
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

    def in_flight(self) -> Counter[str]:
        """The file bodies being sent right now, per repository path: how many connections
        a client holds on each file."""
        with self._lock:
            return Counter(
                e.file for e in self._answering if e.file is not None and e.status in (200, 206)
            )

    # --- serving -----------------------------------------------------------------------------

    async def _listen(self, server: Literal["hub", "cdn"], host: str, port: int) -> str:
        route = self._route_hub if server == "hub" else self._route_cdn

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            exchange = Exchange()
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
        self, server: Literal["hub", "cdn"], request: web.BaseRequest, exchange: Exchange
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

    async def _route_hub(self, request: web.BaseRequest, exchange: Exchange) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return error_response(405, f"{request.method} is not supported by the fake hub")
        parts = request.rel_url.raw_path.split("/")[1:]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return await self._api(request, exchange, parts[2:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return await self._resolve(request, exchange, parts)
        return error_response(404, "Not Found")

    def _find(
        self, request: web.BaseRequest, repo_id: str, rest: str, *, need_path: bool
    ) -> _Target | web.Response:
        """Authorize the request for `repo_id` and resolve ``{revision}[/{path}]`` in it."""
        token = bearer(request)
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                return _repo_not_found(repo_id, token)
            if repo.token is not None and not (token and hmac.compare_digest(token, repo.token)):
                if not repo.gated:
                    return _repo_not_found(repo_id, token)
                message = f"Access to model {repo_id} is restricted and you are not in the list."
                return error_response(401 if token is None else 403, message, code="GatedRepo")
            revision, path = repo.split_revision(rest, need_path=need_path)
            commit = repo.commit(revision)
            gated, private = repo.gated, repo.token is not None and not repo.gated
        if commit is None:
            return error_response(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return _Target(repo_id, commit, path, gated=gated, private=private)

    async def _api(
        self, request: web.BaseRequest, exchange: Exchange, parts: list[str]
    ) -> web.StreamResponse:
        repo_id = f"{unquote(parts[0])}/{unquote(parts[1])}"
        if len(parts) == 2:
            kind, rest = "revision", "main"
        elif len(parts) > 3 and parts[2] in ("revision", "tree"):
            kind, rest = parts[2], "/".join(unquote(part) for part in parts[3:])
        else:
            return error_response(404, "Not Found")
        found = self._find(request, repo_id, rest, need_path=False)
        if isinstance(found, web.Response):
            return found
        if kind == "revision":
            if found.path:
                return error_response(404, f"Invalid rev id: {rest}", code="RevisionNotFound")
            info = found.info(blobs=flag(request, "blobs"), cap=self.siblings_cap)
            return await self._send_json(request, exchange, info)
        entries = found.commit.tree(found.path, recursive=flag(request, "recursive"))
        if found.path and not entries:
            message = f"{found.path} does not exist at {found.commit.sha}"
            return error_response(404, message, code="EntryNotFound")
        return await self._send_tree_page(request, exchange, entries)

    async def _send_tree_page(
        self, request: web.BaseRequest, exchange: Exchange, entries: list[dict[str, Any]]
    ) -> web.StreamResponse:
        limit = self.tree_page_size
        raw_limit = request.query.get("limit")
        if raw_limit is not None:
            if not _NUMBER_RE.fullmatch(raw_limit) or int(raw_limit) == 0:
                return error_response(400, f"invalid limit {raw_limit!r}")
            limit = min(limit, int(raw_limit))
        offset = decode_cursor(request.query.get("cursor"))
        if offset is None:
            return error_response(400, "invalid cursor")
        headers: dict[str, str] = {}
        if offset + limit < len(entries):
            query = {**request.query, "cursor": encode_cursor(offset + limit)}
            next_url = f"{self.endpoint}{request.rel_url.raw_path}?{urlencode(query)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        page = entries[offset : offset + limit]
        return await self._send_json(request, exchange, page, headers=headers)

    async def _resolve(
        self, request: web.BaseRequest, exchange: Exchange, parts: list[str]
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
            return error_response(404, message, code="EntryNotFound", headers=headers)
        has_body = request.method == "GET" and not file.lfs
        effects = await self._take_faults(self._fault_request("hub", file.path, has_body, request))
        if isinstance(effects, web.Response):
            return effects
        if not file.lfs:
            blob = replaced(effects, file.blob)
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

    def _cdn_url(self, commit: Commit, file: RepoFile) -> str:
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

    async def _route_cdn(self, request: web.BaseRequest, exchange: Exchange) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return error_response(405, f"{request.method} is not supported by the fake CDN")
        path = request.rel_url.raw_path
        parts = path.split("/")[1:]
        repo_path = request.query.get("repo_path", "")
        signature = request.query.get("Signature", "")
        expires = request.query.get("Expires", "")
        if len(parts) != 3 or parts[0] != "repos":
            return error_response(404, "NoSuchKey")
        if not hmac.compare_digest(signature, self._sign(path, repo_path, expires)):
            return error_response(403, "AccessDenied: the URL signature does not match")
        if expires and time.time() > float(expires):
            return error_response(403, "AccessDenied: Request has expired")
        exchange.file = repo_path
        with self._lock:
            blob = self._store.get(parts[2])
        if blob is None:
            return error_response(404, "NoSuchKey")
        has_body = request.method == "GET"
        effects = await self._take_faults(self._fault_request("cdn", repo_path, has_body, request))
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
            replaced(effects, blob),
            effects,
            headers=headers,
            etag=f'"{parts[2]}"',
            ranged=True,
        )

    def _fault_request(
        self, server: Literal["hub", "cdn"], path: str, has_body: bool, request: web.BaseRequest
    ) -> FaultRequest:
        """What the fault plan is told of a file's answer, and whether it was asked before."""
        asked = (server, path, request.headers.get("Range", ""))
        with self._lock:
            before = asked in self._asked
            self._asked.add(asked)
        has_range = "Range" in request.headers
        return FaultRequest(server, path, has_body, has_range, asked_before=before)

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
        return error_response(effects.status.code, "injected fault", headers=headers)

    async def _send_json(
        self,
        request: web.BaseRequest,
        exchange: Exchange,
        data: object,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        has_body = request.method == "GET"
        fault_request = FaultRequest("hub", "", has_body=has_body, has_range=False)
        effects = await self._take_faults(fault_request)
        if isinstance(effects, web.Response):
            return effects
        body = MemoryBlob(json.dumps(data).encode())
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        return await self._send_body(
            request, exchange, body, effects, headers=all_headers, etag=None, ranged=False
        )

    async def _send_body(
        self,
        request: web.BaseRequest,
        exchange: Exchange,
        blob: Blob,
        effects: Effects,
        *,
        headers: Mapping[str, str],
        etag: str | None,
        ranged: bool,
    ) -> web.StreamResponse:
        """Answer with `blob` (or the part a ``Range`` selects), applying body faults."""
        out = CIMultiDict(headers)
        span, status = Span(0, blob.size), 200
        etag = effects.etag(etag) if etag is not None else None
        # what a conditional request is compared with: the ETag a full answer carries
        validator = effects.sent_etag(etag, status=200) if etag is not None else None
        if_match = request.headers.get("If-Match")
        if ranged and if_match is not None and not if_match_matches(if_match, validator):
            return error_response(412, "PreconditionFailed: the object changed")
        if ranged:
            out["Accept-Ranges"] = "bytes"
            range_header = request.headers.get("Range")
            if_range = request.headers.get("If-Range")
            if (
                range_header is not None
                and not effects.ignore_range
                and (effects.ignore_if_range or if_range_matches(if_range, validator or ""))
            ):
                parsed = parse_range(range_header, blob.size)
                if parsed == UNSATISFIABLE:
                    out["Content-Range"] = f"bytes */{blob.size}"
                    return web.Response(status=416, headers=out)
                if isinstance(parsed, Span):
                    span, status = shifted(parsed, effects.range_shift, blob.size), 206
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
            drop_connection(request)
            return response
        await write_body(request, response, exchange, blob, span, effects)
        return response


@dataclass(frozen=True, slots=True)
class _Target:
    """An authorized request's repository, commit and path within it."""

    repo_id: str
    commit: Commit
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
                sibling(file, blobs=blobs) for file in list(self.commit.files.values())[:cap]
            ],
            "usedStorage": sum(file.size for file in self.commit.files.values()),
        }


def _repo_not_found(repo_id: str, token: str | None) -> web.Response:
    # Like the Hub: 401 without credentials (it might exist and be private), 404 with them.
    status = 401 if token is None else 404
    return error_response(status, f"Repository {repo_id} not found", code="RepoNotFound")


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
