"""A DCP checkpoint file replaced at its origin between two range reads of one ``dcp.load``.

``DCPReader`` reads a ``.distcp`` file by several Range requests and copies each range into
tensors as it arrives. A trainer (or ``aws s3 cp``) that replaces the file in the meantime
hands the later ranges another version's bytes. Nothing in the bytes themselves tells: both
versions were saved with the same layout, so every range parses. The reader names the
origin's version of the file when the load begins and asks again after its last read; only
that check stands between the load and a state dict of two versions.

The promise, judged by values against what torch saved: the load fails with a
``ShardsyncError`` (inside torch's ``CheckpointException``), or it returns exactly one
version's tensors, all old or all new, never a mix. Then the cache: with the old version
put back at the origin (the very same inode for a directory, the same bytes and so the
same ETag for S3, so whatever was kept for it may be used) a load returns exactly the old
tensors, and with the new one back exactly the new ones.

The replacement is timed by the test's own parts, never by patching shardsync: for a local
directory a wrapper origin passed through ``DCPReader(origin=...)`` renames the new file into
place right after the first range of it was read; for S3 a small reverse proxy in front of
SeaweedFS (the reader's S3 endpoint) does a real PutObject right after it served the first
ranged GET of the object. Both hold the next read of that file until the replacement is
done; a window smaller than one tensor makes every tensor its own range.

One test here is of a load that fails mid-read (its second range read refused) while the
first range is written into the kept pieces: the kept file must be closed after that write,
not under it. Only there does the test wrap shardsync (``KeptFile.add`` and ``close``), to
hold the write in its thread and see the order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import ClientSession, web
from helpers import WrappedOrigin, fast_config
from multidict import CIMultiDict
from yarl import URL

from shardsync.checkpoint_cache import KeptFile
from shardsync.config import Config, S3Config
from shardsync.dcp_metadata import parse_dcp_metadata
from shardsync.dcp_reader import DCPReader
from shardsync.errors import OriginError, ShardsyncError
from shardsync.fetch.fetcher import Fetcher
from shardsync.origins import LocalOrigin
from shardsync.origins.base import Entry
from shardsync.testing.seaweedfs import S3Server

STEP = "step-1"
DATA = f"{STEP}/__0_0.distcp"  # one process saved it: every tensor in this one file
NAMES = ("t0", "t1", "t2", "t3")
WINDOW = 16 << 10  # below one tensor (~18 KB): one range per tensor, one range at a time


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(64, 64, generator=g) for name in NAMES}


@dataclass(frozen=True)
class Versions:
    """Two saves of the same state dict layout (same file, offsets and lengths), with other
    values: ``old`` is what the origin holds when a load begins."""

    old_run: Path  # a run folder: step-1/.metadata and step-1/__0_0.distcp
    new_data: Path  # the new version's __0_0.distcp
    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Versions:
    from torch.distributed.checkpoint.state_dict_saver import save

    base = tmp_path_factory.mktemp("mid-load")
    old, new = _state(1), _state(2)
    for name, state in (("old", old), ("new", new)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save(state, checkpoint_id=base / name / STEP, no_dist=True)
    layouts = [
        {
            k.fqn: (v.relative_path, v.offset, v.length)
            for k, v in parse_dcp_metadata(
                (base / n / STEP / ".metadata").read_bytes()
            ).metadata.storage_data.items()
        }
        for n in ("old", "new")
    ]
    # The premise: the new file fits the old .metadata, so a mix parses and goes unseen.
    assert layouts[0] == layouts[1] and {p for p, _, _ in layouts[0].values()} == {"__0_0.distcp"}
    assert (base / "old" / DATA).read_bytes() != (base / "new" / DATA).read_bytes()
    for name in NAMES:
        assert not torch.equal(old[name], new[name])
    return Versions(base / "old", base / "new" / DATA, old, new)


# ------------------------------------------------------------------------------ judging


def _load(reader: Any) -> dict[str, torch.Tensor] | BaseException:
    """What one ``dcp.load`` gave: the state dict, or the error the reader raised (torch
    wraps it in a ``CheckpointException`` naming each rank's failure)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    state = {name: torch.zeros(64, 64) for name in NAMES}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(state, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:
        (cause, _where), *others = exc.failures.values()  # one rank: this process
        assert not others, exc.failures
        return cause
    except Exception as exc:  # judged by the caller, by type
        return exc
    return state


def _versions_of(loaded: dict[str, torch.Tensor], v: Versions) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in NAMES:
        got = loaded[name].view(torch.uint8)
        if torch.equal(got, v.old[name].view(torch.uint8)):
            out[name] = "old"
        elif torch.equal(got, v.new[name].view(torch.uint8)):
            out[name] = "new"
        else:
            out[name] = "neither"
    return out


def assert_one_version_or_refused(
    outcome: dict[str, torch.Tensor] | BaseException, v: Versions
) -> None:
    """The promise: a shardsync error, or exactly one version's tensors."""
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, ShardsyncError), f"not a shardsync error: {outcome!r}"
        return
    which = _versions_of(outcome, v)
    assert set(which.values()) in ({"old"}, {"new"}), f"one load returned a mix: {which}"


def assert_exactly(
    outcome: dict[str, torch.Tensor] | BaseException, v: Versions, want: str
) -> None:
    assert not isinstance(outcome, BaseException), f"the load failed: {outcome!r}"
    which = _versions_of(outcome, v)
    assert set(which.values()) == {want}, f"the origin holds the {want} version, loaded {which}"


# ------------------------------------------------------------------------------ local directory


@dataclass
class ReplacingOrigin(WrappedOrigin):
    """A local directory whose file ``path`` is replaced (``replace``: a rename, as a trainer
    publishing a new save does) right after its first range was read and before the next:
    its reads go one at a time, the first one's answer waits for the replacement."""

    path: str
    replace: Callable[[], None]
    reads: list[tuple[int, int]] = field(default_factory=list)
    _one_at_a_time: asyncio.Lock | None = field(default=None, init=False, repr=False)

    async def read_range(
        self, fetcher: Fetcher, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        if entry.path != self.path:
            return await self.inner.read_range(fetcher, commit, entry, start, end)
        if self._one_at_a_time is None:
            self._one_at_a_time = asyncio.Lock()  # the read loop's own (one per load)
        async with self._one_at_a_time:
            data = await self.inner.read_range(fetcher, commit, entry, start, end)
            self.reads.append((start, end))
            if len(self.reads) == 1:
                await asyncio.to_thread(self.replace)
            return data


@dataclass
class FailingSecondRead(WrappedOrigin):
    """A local directory whose file ``path`` fails its second range read, once the first
    range's write into the kept pieces has begun (``begun``): the load is cancelled with that
    write still in its thread."""

    path: str
    begun: threading.Event
    reads: int = 0

    async def read_range(
        self, fetcher: Fetcher, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        if entry.path == self.path:
            self.reads += 1
            if self.reads > 1:
                await asyncio.to_thread(self.begun.wait, 10)
                raise OriginError(f"{entry.path}: the test's failing read")
        return await self.inner.read_range(fetcher, commit, entry, start, end)


def test_a_load_failing_while_a_range_is_kept_closes_the_kept_file_after_the_write(
    versions: Versions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel cannot stop a kept range's write in its thread: the kept file's descriptor
    is closed once that write ended, never under it (a closed number is the next file
    opened's, and the late write would land in that file)."""
    root = tmp_path / "run"
    shutil.copytree(versions.old_run, root)
    begun, events = threading.Event(), []
    add, close = KeptFile.add, KeptFile.close

    def held_add(self: KeptFile, start: int, data: bytes | memoryview) -> None:
        if self.path == DATA:
            begun.set()
            time.sleep(0.5)  # the second read fails the load meanwhile
        add(self, start, data)
        events.append(f"kept {self.path}")

    def noted_close(self: KeptFile) -> None:
        events.append(f"closed {self.path}")
        close(self)

    monkeypatch.setattr(KeptFile, "add", held_add)
    monkeypatch.setattr(KeptFile, "close", noted_close)
    origin = FailingSecondRead(LocalOrigin.from_path(str(root)), DATA, begun)
    config = fast_config(tmp_path / "cache")
    outcome = _load(DCPReader(str(root), config=config, origin=origin, window=WINDOW))
    assert isinstance(outcome, OriginError), outcome
    of_data = [event.split()[0] for event in events if event.endswith(DATA)]
    assert of_data[:1] == ["kept"] and of_data[-1:] == ["closed"], events
    assert "kept" not in of_data[of_data.index("closed") :], events  # no write after a close


def test_a_local_file_replaced_between_two_range_reads_is_never_loaded_as_a_mix(
    versions: Versions, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    shutil.copytree(versions.old_run, root)
    data = root / DATA
    old_inode = tmp_path / "old.distcp"  # the old file itself, outside the run folder
    os.link(data, old_inode)
    staged = tmp_path / "new.distcp"
    shutil.copyfile(versions.new_data, staged)
    config = fast_config(tmp_path / "cache")

    def publish_new() -> None:
        os.replace(staged, data)

    origin = ReplacingOrigin(LocalOrigin.from_path(str(root)), DATA, publish_new)
    reader = DCPReader(str(root), config=config, origin=origin, window=WINDOW)
    outcome = _load(reader)
    assert len(origin.reads) >= 2 and not staged.exists()  # it was replaced mid-load
    assert data.read_bytes() == versions.new_data.read_bytes()
    assert_one_version_or_refused(outcome, versions)

    # The cache: the old file back (same inode, size and mtime: the version the load began
    # with, so what was kept for it counts), then the new one; from the same cache each time.
    shutil.copyfile(data, staged)
    os.replace(old_inode, data)
    assert_exactly(_load(DCPReader(str(root), config=config, window=WINDOW)), versions, "old")
    os.replace(staged, data)
    assert_exactly(_load(DCPReader(str(root), config=config, window=WINDOW)), versions, "new")


# ------------------------------------------------------------------------------ S3 (SeaweedFS)

_HOP = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Transfer-Encoding", "TE", "Upgrade", "Trailer",
              "Proxy-Authorization", "Proxy-Connection")
)  # fmt: skip


class ReplacingProxy:
    """A reverse proxy in front of the store, on its own thread and event loop: every
    request passes through unchanged (the ``Host`` header too: SigV4 signs it), and right
    after the first ranged GET of ``watched`` (a path) was answered by the store,
    ``replace`` runs before that answer is sent on. GETs of ``watched`` go one at a time."""

    def __init__(self, upstream: str, watched: str, replace: Callable[[], None]) -> None:
        self.upstream = upstream.rstrip("/")
        self.watched = watched
        self.replace = replace
        self.reads: list[str] = []
        self.endpoint = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="replacing-proxy", daemon=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"
        if self._failure is not None:
            raise self._failure
        try:
            yield self.endpoint
        finally:
            assert self._loop is not None and self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)
            if self._failure is not None:
                raise self._failure

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the test's thread
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        one_at_a_time = asyncio.Lock()
        # Bytes as the store sent them: no decoding, no headers of the proxy's own.
        skip = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
        async with ClientSession(auto_decompress=False, skip_auto_headers=skip) as session:

            async def forward(request: web.Request) -> web.StreamResponse:
                watched = (
                    request.method == "GET"
                    and request.path == self.watched
                    and "Range" in request.headers
                )
                async with one_at_a_time if watched else contextlib.nullcontext():
                    headers = CIMultiDict(
                        (k, v) for k, v in request.headers.items() if k.lower() not in _HOP
                    )
                    body = await request.read()
                    async with session.request(
                        request.method,
                        URL(self.upstream + request.raw_path, encoded=True),
                        headers=headers,
                        data=body or None,
                        allow_redirects=False,
                    ) as resp:
                        payload = await resp.read()
                        status, answer = resp.status, CIMultiDict(resp.headers)
                    if watched and status == 206:
                        self.reads.append(request.headers["Range"])
                        if len(self.reads) == 1:
                            await asyncio.to_thread(self.replace)
                out = CIMultiDict(
                    (k, v)
                    for k, v in answer.items()
                    if k.lower() not in _HOP | {"content-length", "date", "server"}
                )
                if request.method != "HEAD":
                    return web.Response(status=status, headers=out, body=payload)
                head = web.StreamResponse(status=status, headers=out)
                if "Content-Length" in answer:
                    head.content_length = int(answer["Content-Length"])  # the object's size
                await head.prepare(request)
                await head.write_eof()
                return head

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            listening = socket.create_server(("127.0.0.1", 0))
            try:
                await web.SockSite(runner, listening).start()
                self.endpoint = f"http://127.0.0.1:{listening.getsockname()[1]}"
                self._ready.set()
                await self._stop.wait()
            finally:
                await runner.cleanup()
                listening.close()


def _s3_config(cache_dir: Path, server: S3Server, endpoint: str) -> Config:
    s3 = S3Config(endpoint=endpoint, region=server.region, addressing="path")
    return replace(fast_config(cache_dir), s3=s3)


def test_an_s3_object_replaced_between_two_range_reads_is_never_loaded_as_a_mix(
    s3server: S3Server,
    s3bucket: str,
    aws_env: None,
    versions: Versions,
    tmp_path: Path,
) -> None:
    from test_s3_origin import put

    old_data = (versions.old_run / DATA).read_bytes()
    new_data = versions.new_data.read_bytes()  # the same size: only the ETag tells them apart
    assert len(old_data) == len(new_data)
    for rel in (f"{STEP}/.metadata", DATA):
        put(s3server, s3bucket, f"run/{rel}", (versions.old_run / rel).read_bytes(), True)
    url = f"s3://{s3bucket}/run/"

    def publish_new() -> None:
        put(s3server, s3bucket, f"run/{DATA}", new_data, True)

    proxy = ReplacingProxy(s3server.endpoint, f"/{s3bucket}/run/{DATA}", publish_new)
    with proxy.running() as endpoint:
        config = _s3_config(tmp_path / "cache", s3server, endpoint)
        outcome = _load(DCPReader(url, config=config, window=WINDOW))
    assert len(proxy.reads) >= 2  # it was replaced mid-load, between two of these
    assert_one_version_or_refused(outcome, versions)

    # The cache: the old bytes back (the same ETag: what was kept for it counts), then the
    # new ones; from the same cache, straight to the store.
    config = _s3_config(tmp_path / "cache", s3server, s3server.endpoint)
    put(s3server, s3bucket, f"run/{DATA}", old_data, True)
    assert_exactly(_load(DCPReader(url, config=config, window=WINDOW)), versions, "old")
    put(s3server, s3bucket, f"run/{DATA}", new_data, True)
    assert_exactly(_load(DCPReader(url, config=config, window=WINDOW)), versions, "new")
