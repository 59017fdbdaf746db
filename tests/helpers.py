"""Shared assertions for engine tests: byte-identical snapshots, nothing unverified published."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from shardsync.config import Config, DaemonConfig
from shardsync.fetch.fetcher import Fetcher
from shardsync.manifest import Listing, ManifestEntry
from shardsync.origins import LocalOrigin
from shardsync.origins.base import Entry, Forget, Progress
from shardsync.records import FetchConfig, FileOutcome, RepoRef, VerifiedFile
from shardsync.retry import RetryPolicy
from shardsync.slot import Slot
from shardsync.testing import Checkpoint, FakeHub, serve_in_thread
from shardsync.testing.seaweedfs import S3Server

if TYPE_CHECKING:
    from aiohttp import web


def safetensors_bytes(fill: bytes, size: int) -> bytes:
    """A file of ``size`` bytes shaped as one empty-header safetensors shard, ``fill`` after."""
    head = b"{}"
    return len(head).to_bytes(8, "little") + head + fill * (size - 8 - len(head))


def random_shard(size: int) -> bytes:
    """``size`` random bytes after an empty safetensors header: a shard an origin that keeps
    no checksum may serve (one that does not start as a shard is refused unpublished)."""
    head = b"{}"
    return len(head).to_bytes(8, "little") + head + os.urandom(size - 8 - len(head))


def fast_config(cache_dir: Path, endpoint: str | None = None, **fetch: object) -> Config:
    """Small chunks (several Range requests per shard) and near-instant retries.

    The daemon socket points nowhere, so a daemon running on the developer's machine is
    never used by accident (tests that want one configure it).
    """
    base = FetchConfig(
        connections_per_file=4,
        chunk_size=256 * 1024,
        read_size=64 * 1024,
        write_size=128 * 1024,
        read_timeout=5.0,
        retry=RetryPolicy(max_attempts=6, base_delay=0.001, max_delay=0.01),
    )
    return Config(
        cache_dir=cache_dir,
        endpoint=endpoint,
        max_files=4,
        fetch=replace(base, **fetch),
        daemon=DaemonConfig(socket=cache_dir / "no-daemon" / "d.sock"),
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def open_under(root: Path) -> list[str]:
    """What this process holds open under ``root`` (by the descriptors' own paths)."""
    fds = Path("/proc/self/fd")
    targets = []
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone by now
            targets.append(os.readlink(fds / fd))
    return [t for t in targets if t.startswith(str(root))]


def assert_snapshot_matches(snapshot: Path, checkpoint: Checkpoint) -> None:
    """Every file of the checkpoint is in the snapshot with identical bytes."""
    for rel in checkpoint.files:
        got = snapshot / rel
        assert got.is_file(), f"{rel} missing from {snapshot}"
        assert got.read_bytes() == checkpoint.path(rel).read_bytes(), f"{rel} differs"


OriginBytes = Checkpoint | Path | bytes | Mapping[str, bytes | Path]
"""What an origin served: a checkpoint, one file or directory, some bytes, or ``{path: bytes}``."""


def origin_digests(*origins: OriginBytes) -> frozenset[str]:
    """The sha256 of every file the origins hold, computed from the origin's side."""
    digests: set[str] = set()

    def add(item: bytes | Path) -> None:
        if isinstance(item, bytes):
            digests.add(hashlib.sha256(item).hexdigest())
        elif item.is_dir():
            for path in item.rglob("*"):
                if path.is_file() and not path.is_symlink():
                    digests.add(sha256_file(path))
        else:
            digests.add(sha256_file(item))

    for origin in origins:
        if isinstance(origin, Checkpoint):
            for rel in origin.files:
                add(origin.path(rel))
        elif isinstance(origin, Mapping):
            for item in origin.values():
                add(item)
        else:
            add(origin)
    return frozenset(digests)


def assert_store_verified(cache_dir: Path, *origins: OriginBytes) -> None:
    """Promise 1, checked against the origin: every blob under its final name is byte for byte
    one of the files the origin served (given as `origins`), and hashes to its name.

    Hashing each blob against its own name alone proves nothing: blobs are named by the digest
    of the bytes received, so a download that skipped its verification still "matches".
    """
    if not origins:
        raise TypeError("assert_store_verified needs the origin's files to compare with")
    expected = origin_digests(*origins)
    store = cache_dir / "store" / "sha256"
    for blob in store.glob("*/*"):
        digest = sha256_file(blob)
        assert digest == blob.name, f"published blob {blob} has the wrong content"
        assert digest in expected, f"published blob {blob} is none of the origin's files"


class SleepRecorder:
    """An injected ``sleep`` that records delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


Sleep = Callable[[float], Awaitable[None]]


@contextlib.contextmanager
def serving(checkpoints: dict[str, Checkpoint]) -> Iterator[FakeHub]:
    """A fake Hub holding each checkpoint under its repo id, served from a background thread
    (for tests whose clients are real processes or blocking calls)."""
    fake = FakeHub()
    for repo, checkpoint in checkpoints.items():
        fake.add_checkpoint(repo, checkpoint)
    with serve_in_thread(fake) as running:
        yield running


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real small filesystem at ``path`` (e.g. ``"size=1m"``), so the disk fills for real.

    Skips the test where mounting is impossible (not root, no ``mount``, no privileges).
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("no mount binary")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class Bars:
    """A progress sink that remembers each file's running total and its highest point."""

    def __init__(self) -> None:
        self.sizes: dict[str, int | None] = {}
        self.now: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)

    def add_file(self, path: str, size: int | None) -> None:
        self.sizes[path] = size

    def advance(self, path: str, nbytes: int) -> None:
        self.now[path] += nbytes
        self.peak[path] = max(self.peak[path], self.now[path])

    def file_done(self, outcome: FileOutcome) -> None:
        return None


class OnFileDone(Bars):
    """A progress sink that calls ``act()`` once, in the job's own thread, when ``path`` is
    done: the job is then between that file and the next (or its end)."""

    def __init__(self, path: str, act: Callable[[], object]) -> None:
        super().__init__()
        self.path, self.act, self.results = path, act, list[object]()

    def file_done(self, outcome: FileOutcome) -> None:
        if outcome.path == self.path and not self.results:
            self.results.append(self.act())


SendBody = Callable[["web.StreamResponse", int, int], Awaitable[None]]
"""Writes bytes ``first..last`` (inclusive) of a 206 that is already prepared."""


@contextlib.asynccontextmanager
async def range_server(
    data: bytes, send_body: SendBody, *, chunked: bool = False, most: int | None = None
) -> AsyncIterator[str]:
    """A real aiohttp server of one file, ``model.safetensors``: HEAD, and GET with a Range
    answered by a 206 (with Content-Length, or chunked) whose body ``send_body`` writes;
    ``most``: of at most that many bytes (an honest short answer). Yields the base URL to
    prefetch (a plain-URL origin)."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.match_info["name"] != "model.safetensors":
            raise web.HTTPNotFound()
        headers = {"ETag": '"v1"', "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return web.Response(headers={**headers, "Content-Length": str(len(data))})
        first, last = (int(x) for x in request.headers["Range"][6:].split("-"))
        last = last if most is None else min(last, first + most - 1)
        headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        if not chunked:
            headers["Content-Length"] = str(last + 1 - first)
        response = web.StreamResponse(status=206, headers=headers)
        if chunked:
            response.enable_chunked_encoding()
        await response.prepare(request)
        await send_body(response, first, last)
        await response.write_eof()
        return response

    async with handler_at(handle) as base:
        yield base


def asked_span(request: web.Request, size: int) -> tuple[int, int] | None:
    """The inclusive span a ``Range: bytes=A-B`` header asks of ``size`` bytes, or None."""
    ranged = request.headers.get("Range")
    if not ranged:
        return None
    first, _, last = ranged.removeprefix("bytes=").partition("-")
    return int(first), min(int(last), size - 1)


def serve_bytes(request: web.Request, data: bytes, etag: str) -> web.Response:
    """``data`` as an honest origin answers: HEAD, a whole GET, or a 206 for ``bytes=A-B``."""
    from aiohttp import web

    headers = {"ETag": etag, "Accept-Ranges": "bytes"}
    if request.method == "HEAD":
        return web.Response(headers={**headers, "Content-Length": str(len(data))})
    span = asked_span(request, len(data))
    if span is None:
        return web.Response(body=data, headers=headers)
    start, end = span
    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
    return web.Response(status=206, body=data[start : end + 1], headers=headers)


@contextlib.asynccontextmanager
async def handler_at(
    handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A real aiohttp server on loopback answering ``/ckpt/{name}`` with ``handle``; yields
    the base URL to prefetch (a plain-URL origin)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_route("*", "/ckpt/{name}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/ckpt/"
    finally:
        await runner.cleanup()


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for a state change that has no event to await (pytest's timeout bounds it)."""
    while not predicate():  # noqa: ASYNC110 - polling internal state in a test
        await asyncio.sleep(0.01)


def kill_when(
    proc: subprocess.Popen[str] | subprocess.Popen[bytes], ready: Callable[[], bool]
) -> None:
    """``kill -9`` ``proc`` once ``ready()`` holds (it must still run then; a minute at most),
    and reap it whatever happens: a child left running fails a later test."""
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert proc.poll() is None, "the process finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@dataclass
class WrappedOrigin:
    """A local directory as an origin for range reads (``DCPReader(origin=...)``), to
    subclass: ``read_range`` is the hook a test overrides to count, hold back or replace
    what is read; everything else asks ``inner``."""

    inner: LocalOrigin

    @property
    def repo(self) -> RepoRef:
        return self.inner.repo

    @property
    def default_revision(self) -> str:
        return self.inner.default_revision

    @property
    def caller_only(self) -> bool:
        return True

    async def list_files(self, fetcher: Fetcher, revision: str, *, hidden: bool = False) -> Listing:
        return await self.inner.list_files(fetcher, revision, hidden=hidden)

    async def version(self, fetcher: Fetcher, entry: Entry) -> str | None:
        return await self.inner.version(fetcher, entry)

    def locate_ahead(self, fetcher: Fetcher, commit: str | None, entry: Entry) -> Forget:
        return self.inner.locate_ahead(fetcher, commit, entry)

    async def read_range(
        self, fetcher: Fetcher, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        return await self.inner.read_range(fetcher, commit, entry, start, end)

    async def download(
        self, fetcher: Fetcher, commit: str | None, entry: ManifestEntry, slot: Slot,
        progress: Progress,
    ) -> VerifiedFile:  # fmt: skip
        raise AssertionError("the reader never downloads whole files")

    async def aclose(self) -> None:
        return None


_S3_CLIENTS: dict[str, Any] = {}


def s3(server: S3Server) -> Any:
    """A blocking botocore client with full rights on the test store, for setting up and
    inspecting what the code under test wrote (one per store, kept for the session)."""
    import botocore.session

    if server.endpoint not in _S3_CLIENTS:
        session = botocore.session.get_session()
        _S3_CLIENTS[server.endpoint] = session.create_client("s3", **server.client_kwargs())
    return _S3_CLIENTS[server.endpoint]


_S3_PART = 5 << 20  # S3's (and SeaweedFS's) smallest part but the last


def put_as_uploaders_do(
    server: S3Server, bucket: str, key: str, data: bytes, algorithm: str, *, multipart: bool
) -> None:
    """What an uploader with default checksums writes: one PutObject carrying the checksum
    (a whole-object one), or a multipart upload whose parts each carry theirs (the store
    then keeps a composite of them, or for CRC64NVME a whole-object one)."""
    if not multipart or len(data) <= _S3_PART:
        s3(server).put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm=algorithm)
        return
    sizes = [min(_S3_PART, len(data) - at) for at in range(0, len(data), _S3_PART)]
    put_in_parts(server, bucket, key, data, sizes, algorithm)


def put_in_parts(
    server: S3Server, bucket: str, key: str, data: bytes, sizes: Sequence[int], algorithm: str
) -> None:
    """A multipart upload of ``data`` in parts of ``sizes``, each carrying its checksum: the
    store keeps a composite of them (or, for CRC64NVME, a whole-object one)."""
    assert sum(sizes) == len(data)
    client = s3(server)
    upload = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm=algorithm)
    done, at = [], 0
    for number, size in enumerate(sizes, start=1):
        answer = client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=data[at : at + size],
            ChecksumAlgorithm=algorithm,
        )
        field = f"Checksum{algorithm}"
        done.append({"PartNumber": number, "ETag": answer["ETag"], field: answer[field]})
        at += size
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": done}
    )


def upload_as_uploaders_do(
    server: S3Server,
    bucket: str,
    checkpoint: Checkpoint,
    prefix: str,
    algorithm: str,
    *,
    multipart: bool,
) -> None:
    """Every file of ``checkpoint`` under ``prefix``, as ``put_as_uploaders_do`` puts one."""
    for rel in checkpoint.files:
        data = checkpoint.path(rel).read_bytes()
        put_as_uploaders_do(server, bucket, f"{prefix}/{rel}", data, algorithm, multipart=multipart)


def s3_keys(server: S3Server, bucket: str, prefix: str) -> set[str]:
    """Every key under ``prefix`` in ``bucket``, as the store lists them."""
    pages = s3(server).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {obj["Key"] for page in pages for obj in page.get("Contents", ())}
