"""``torch.distributed.checkpoint`` from any origin: ``DCPReader`` reads the byte ranges a
load plan names, through the cache (a verified copy, pieces an earlier load kept, else the
origin), copying each into its tensor as it arrives.

It sits beside the loader: like ``loader.py`` it imports torch, and nothing of shardsync
imports it. Which checkpoint of a run it reads is ``checkpoint_selection.resolve``'s choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shardsync.cache import CacheStore
from shardsync.checkpoint_cache import KeptFile, RangeCache, pread_exact
from shardsync.checkpoint_selection import resolve
from shardsync.config import Config, load_config
from shardsync.dcp_metadata import DCP_METADATA
from shardsync.errors import LoadError, raise_first
from shardsync.fetch.fetcher import Fetcher
from shardsync.manifest import Listing, RemoteFile
from shardsync.origins import Origin
from shardsync.prefetch import Engine
from shardsync.tasks import opened, to_the_end
from shardsync.training import Choice, Need

__all__ = ["DCPReader", "ReaderStatistics"]


@dataclass(frozen=True, slots=True)
class ReaderStatistics:
    """What a ``DCPReader`` moved.

    ``bytes_read`` came from the origin (``.metadata`` included) in ``ranges`` requests;
    ``bytes_cached`` came from the cache (a whole verified blob, or pieces kept by an
    earlier load); ``bytes_kept`` were newly kept for the next load; ``peak_buffered`` is
    the most bytes held at once between their read and their copy into tensors.
    """

    bytes_read: int
    ranges: int
    checkpoint: str | None
    bytes_cached: int = 0
    bytes_kept: int = 0
    peak_buffered: int = 0


@dataclass(slots=True)
class _Counters:
    bytes_read: int = 0
    ranges: int = 0
    bytes_cached: int = 0
    bytes_kept: int = 0
    peak_buffered: int = 0


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class _OpenFile:
    """One file of the checkpoint as this load reads it."""

    entry: RemoteFile
    size: int
    blob_fd: int | None = None  # a complete, verified copy in the cache
    version: str | None = None  # what the origin called it when this load began
    kept: KeptFile | None = None
    fetched: bool = False

    @property
    def path(self) -> str:
        return self.entry.path


def _as_planned(listed: RemoteFile, version: str | None) -> str | None:
    """``version``, if it is the one the file had when the load was planned from the
    ``.metadata`` (another save of the same step puts other tensors at those offsets)."""
    from shardsync.errors import LoadError

    if listed.version is not None and version != listed.version:
        raise LoadError(
            f"{listed.path} changed since the checkpoint's {DCP_METADATA} was read "
            f"({listed.version} -> {version}): saved again meanwhile? load again"
        )
    return version


class _Source:
    """The files of one source, for one event loop: each range from a verified blob in the
    cache, else a kept piece, else the origin (and then kept for the next load)."""

    def __init__(
        self,
        origin: Origin,
        fetcher: Fetcher,
        cache: CacheStore,
        listed: Mapping[str, RemoteFile],
        counters: _Counters,
        connections: int,
    ) -> None:
        self.origin = origin
        self.fetcher = fetcher
        self.listed = listed
        self.counters = counters
        self.ranges = RangeCache(cache, origin.repo)
        self._files: dict[str, _OpenFile] = {}
        self._opening: dict[str, asyncio.Lock] = {}  # per file: files open side by side
        self._connections = asyncio.Semaphore(connections)

    async def file(self, path: str) -> _OpenFile:
        async with self._opening.setdefault(path, asyncio.Lock()):
            if path not in self._files:
                self._files[path] = await self._open(path)
            return self._files[path]

    async def _open(self, path: str) -> _OpenFile:
        from shardsync.errors import LoadError

        listed = self.listed.get(path)
        if listed is None or listed.size is None:
            raise LoadError(f"{path}: not in the source's listing (or of unknown size)")
        f = _OpenFile(RemoteFile(path, listed.size, None), listed.size)
        blob = None
        if listed.sha256 is not None:  # content-named: no need to ask the origin's version
            blob = await asyncio.to_thread(self.ranges.whole, path, f.size, listed.sha256, None)
        if blob is None:
            f.version = _as_planned(listed, await self.origin.version(self.fetcher, f.entry))
            if listed.sha256 is None:
                blob = await asyncio.to_thread(self.ranges.whole, path, f.size, None, f.version)
        if blob is not None:
            try:
                f.blob_fd = os.open(blob, _READ_FLAGS)  # held: a prune may unlink, not cut it
                return f
            except OSError:
                if f.version is None:
                    version = await self.origin.version(self.fetcher, f.entry)
                    f.version = _as_planned(listed, version)
        if f.version is not None:  # closed if the load is cancelled while it opens
            opening = asyncio.to_thread(self.ranges.open, path, f.size, f.version)
            f.kept = await opened(opening, KeptFile.close)
        return f

    def is_local(self, f: _OpenFile, start: int, end: int) -> bool:
        return f.blob_fd is not None or (f.kept is not None and f.kept.has(start, end))

    async def local(self, f: _OpenFile, start: int, end: int) -> bytes | None:
        """The bytes from the cache, or None (not there, or a kept piece no longer hashes
        to what was recorded)."""
        if f.blob_fd is not None:
            data = await asyncio.to_thread(pread_exact, f.blob_fd, start, end)
        elif f.kept is not None and f.kept.has(start, end):
            data = await asyncio.to_thread(f.kept.read, start, end)
        else:
            return None
        if data is not None:
            self.counters.bytes_cached += len(data)
        return data

    async def fetch(self, f: _OpenFile, start: int, end: int) -> bytes:
        from shardsync.errors import LoadError

        async with self._connections:
            data = await self.origin.read_range(self.fetcher, None, f.entry, start, end)
        if len(data) != end - start:
            raise LoadError(f"{f.path}: {len(data)} bytes at {start}, wanted {end - start}")
        self.counters.bytes_read += len(data)
        self.counters.ranges += 1
        f.fetched = True
        return data

    async def keep(
        self, f: _OpenFile, pieces: Iterable[tuple[int, int]], data: bytes, base: int
    ) -> None:
        """Keep the pieces ``pieces`` (absolute ranges) of ``data`` read at ``base``."""
        kept = f.kept
        if kept is None:
            return
        view = memoryview(data)

        def write() -> None:
            for start, end in pieces:
                kept.add(start, view[start - base : end - base])

        # to its end even when the load is cancelled: the kept file is closed once no
        # write runs (a closed number is the next file's, and a late write would land there)
        await to_the_end(asyncio.to_thread(write))

    async def read(self, f: _OpenFile, start: int, end: int) -> bytes:
        data = await self.local(f, start, end)
        if data is None:
            data = await self.fetch(f, start, end)
            await self.keep(f, [(start, end)], data, start)
        return data

    async def settle(self, f: _OpenFile) -> None:
        """After the last read of ``f``: a file read from the origin must still be the
        version it was before (else what was read may mix two versions, and is neither
        loaded nor kept); then its new pieces are made durable."""
        from shardsync.errors import LoadError

        if f.fetched and f.version is not None:
            now = await self.origin.version(self.fetcher, f.entry)
            if now != f.version:
                if f.kept is not None:
                    f.kept.close()
                    f.kept = None
                raise LoadError(
                    f"{f.path} changed at the origin while it was read "
                    f"({f.version} -> {now}); load again"
                )
        if f.kept is not None:
            kept = await asyncio.to_thread(f.kept.commit)
            self.counters.bytes_kept += kept  # not `+= await`: that reads the count first

    async def read_small(self, need: Need) -> bytes | None:
        """``resolve``'s reads (a ``.metadata``, a pointer file) through the cache too."""
        if need.path not in self.listed:
            return None  # the listing is exhaustive: no such file
        f = await self.file(need.path)
        end = min(need.limit + 1, f.size)
        data = await self.read(f, 0, end) if end > 0 else b""
        await self.settle(f)
        return data

    def close(self) -> None:
        for f in self._files.values():
            if f.blob_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(f.blob_fd)
                f.blob_fd = None
            if f.kept is not None:
                f.kept.close()


class _Budget:
    """Bytes read but not yet copied into tensors, at most ``limit`` (a single range larger
    than that goes alone). ``take`` in the event loop; ``give`` there too, scheduled from
    the copying thread."""

    def __init__(self, limit: int, counters: _Counters) -> None:
        self.limit = max(limit, 1)
        self.free = self.limit
        self.held = 0
        self.counters = counters
        self._changed = asyncio.Event()

    async def take(self, n: int) -> None:
        want = min(n, self.limit)
        while self.free < want:
            self._changed.clear()
            await self._changed.wait()
        self.free -= want
        self.held += n
        self.counters.peak_buffered = max(self.counters.peak_buffered, self.held)

    def give(self, n: int) -> None:
        self.free += min(n, self.limit)
        self.held -= n
        self._changed.set()


@dataclass(frozen=True, slots=True)
class _ReadSpan:
    """One span read from a file (kept, cached or from the origin): bytes ``[start, start +
    len(data))``, and the plan's items inside them that are to be copied out of it."""

    start: int
    data: bytes
    items: tuple[ReadItem, ...]


def _spans(
    ranges: Iterable[tuple[int, int, ReadItem]], gap: int, max_span: int
) -> list[tuple[int, int, list[ReadItem]]]:
    """The items' ranges merged into requests: ranges closer than ``gap`` become one, as
    long as the request stays within ``max_span`` (a larger single range goes alone)."""
    out: list[tuple[int, int, list[ReadItem]]] = []
    for start, end, item in sorted(ranges, key=lambda r: (r[0], r[1])):
        if out:
            s, e, items = out[-1]
            if start <= e + gap and max(e, end) - s <= max_span:
                out[-1] = (s, max(e, end), [*items, item])
                continue
        out.append((start, end, [item]))
    return out


class _Pipeline:
    """Reads the plan's ranges in an event loop on its own thread, handing each range to
    the caller's thread as it arrives (``arrivals``), so copies into tensors overlap the
    reads still in flight; at most ``window`` bytes wait between the two."""

    def __init__(
        self,
        reader: DCPReader,
        per_file: Mapping[str, list[tuple[int, int, ReadItem]]],
        window: int,
        max_span: int,
    ) -> None:
        self.reader = reader
        self.per_file = per_file
        self.window = window
        self.max_span = max_span
        self.arrivals: queue.SimpleQueue[_ReadSpan | BaseException | None] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._stopped = False
        self._budget: _Budget | None = None

    # -- the caller's thread

    def run(self) -> None:
        """The thread's body: every arrival, then None; an exception before the None."""
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # handed to the caller, who raises it
            self.arrivals.put(exc)
        finally:
            self.arrivals.put(None)

    def done_with(self, span: _ReadSpan) -> None:
        """The caller copied ``span``: its bytes leave the window."""
        with self._guard:
            loop, budget = self._loop, self._budget
        if loop is not None and budget is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(budget.give, len(span.data))

    def cancel(self) -> None:
        with self._guard:
            self._stopped = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)

    # -- the loop's thread

    async def _main(self) -> None:
        with self._guard:
            if self._stopped:
                return
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._budget = _Budget(self.window, self.reader._counters)
        await self.reader._with_source(self._produce)

    async def _produce(self, source: _Source) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for path, ranges in self.per_file.items():
                    tg.create_task(self._file(source, path, ranges))
        except BaseExceptionGroup as group:  # the one clear error, not the task group's
            raise_first(group)

    async def _file(
        self, source: _Source, path: str, ranges: list[tuple[int, int, ReadItem]]
    ) -> None:
        f = await source.file(path)
        local: dict[tuple[int, int], list[ReadItem]] = {}
        remote: list[tuple[int, int, ReadItem]] = []
        for start, end, item in ranges:
            if source.is_local(f, start, end):
                local.setdefault((start, end), []).append(item)
            else:
                remote.append((start, end, item))
        async with asyncio.TaskGroup() as tg:
            for (start, end), items in local.items():
                tg.create_task(self._local(source, f, start, end, items))
            for start, end, items in _spans(remote, self.reader.merge_gap, self.max_span):
                tg.create_task(self._remote(source, f, start, end, items))
        await source.settle(f)

    async def _local(
        self, source: _Source, f: _OpenFile, start: int, end: int, items: list[ReadItem]
    ) -> None:
        assert self._budget is not None
        await self._budget.take(end - start)
        data = await source.read(f, start, end)  # the origin if a kept piece went bad
        self.arrivals.put(_ReadSpan(start, data, tuple(items)))

    async def _remote(
        self, source: _Source, f: _OpenFile, start: int, end: int, items: list[ReadItem]
    ) -> None:
        assert self._budget is not None
        await self._budget.take(end - start)
        data = await source.fetch(f, start, end)
        self.arrivals.put(_ReadSpan(start, data, tuple(items)))  # copied while we keep it
        info = [self.reader.storage_data[i.storage_index] for i in items]
        pieces = sorted({(x.offset, x.offset + x.length) for x in info})
        await source.keep(f, pieces, data, start)


class DCPReader(StorageReader):
    """A ``torch.distributed.checkpoint`` reader of a training run at ``source`` (an
    ``s3://`` prefix, a directory, any origin): ``dcp.load(state_dict,
    storage_reader=DCPReader("s3://bucket/run/"))`` reads only the byte ranges its load
    plan names, through the cache.

    Each range comes from a complete verified copy in the cache when there is one
    (after ``shardsync prefetch --checkpoint``), else from pieces an earlier load kept,
    else from the origin (close ranges merged, several requests at once), and is then
    kept, so loading again from the same cache moves no checkpoint bytes. Kept pieces
    are tied to the origin's version of their file (see ``shardsync.checkpoint_cache``).
    Ranges are copied into tensors as they arrive, with at most ``window`` bytes
    waiting between the reads and the copies.
    """

    def __init__(
        self,
        source: str,
        checkpoint: str = "latest",
        *,
        cache_dir: Path | None = None,
        config: Config | None = None,
        token: str | None = None,
        origin: Origin | None = None,
        merge_gap: int = 64 << 10,
        window: int = 256 << 20,
    ) -> None:
        super().__init__()
        self.source = source
        self.checkpoint = checkpoint
        self.config = config or load_config(None, cache_dir=cache_dir)
        self.token = token
        self._origin = origin  # injected (tests count what it serves)
        self.merge_gap = merge_gap
        self.window = window
        self.choice: Choice | None = None
        self.storage_data: dict[Any, Any] = {}
        self._listed: dict[str, RemoteFile] = {}
        self._counters = _Counters()

    # -- the StorageReader protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.source = str(checkpoint_id)
        self.storage_data = {}

    @property
    def checkpoint_id(self) -> str:
        return self.source

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        choice = asyncio.run(self._with_source(self._resolve, listing=True))
        if choice.dcp is None or choice.dcp_dir is None:
            folders = [
                p.rpartition("/")[0] for p, _ in choice.files if p.endswith("/" + DCP_METADATA)
            ]
            if len(folders) > 1:  # a Trainer's, say: name the one to read
                raise LoadError(
                    f"{self.source}: {choice.name} holds several DCP checkpoints "
                    f"({', '.join(folders)}); point the reader at one of them"
                )
            raise LoadError(f"{self.source}: {choice.name} is not a DCP checkpoint")
        self.choice = choice
        metadata = choice.dcp.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata  # type: ignore[no-any-return]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.choice is not None and self.choice.dcp_dir is not None
        folder = self.choice.dcp_dir
        per_file: dict[str, list[tuple[int, int, Any]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if info.transform_descriptors:
                raise LoadError(f"{info.relative_path}: transformed (compressed) entries")
            path = f"{folder}/{info.relative_path}" if folder else info.relative_path
            per_file.setdefault(path, []).append((info.offset, info.offset + info.length, item))
        pipeline = _Pipeline(self, per_file, self.window, max(self.window // 4, 1))
        thread = threading.Thread(target=pipeline.run, name="shardsync-dcp-read", daemon=True)
        thread.start()
        try:
            while (span := pipeline.arrivals.get()) is not None:
                if isinstance(span, BaseException):
                    raise span
                try:
                    self._copy_in(span, planner)
                finally:
                    pipeline.done_with(span)
        except BaseException:
            pipeline.cancel()
            raise
        finally:
            thread.join()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _copy_in(self, span: _ReadSpan, planner: LoadPlanner) -> None:
        for item in span.items:
            info = self.storage_data[item.storage_index]
            at = info.offset - span.start
            raw = span.data[at : at + info.length]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(raw))
                continue
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise LoadError(
                    f"{item.storage_index}: size {tuple(tensor.size())} in the "
                    f"checkpoint, {tuple(target.size())} in the state dict"
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)

    # -- ours

    def statistics(self) -> ReaderStatistics:
        c = self._counters
        return ReaderStatistics(
            bytes_read=c.bytes_read,
            ranges=c.ranges,
            checkpoint=self.choice.name if self.choice else None,
            bytes_cached=c.bytes_cached,
            bytes_kept=c.bytes_kept,
            peak_buffered=c.peak_buffered,
        )

    async def _with_source(self, work: Any, *, listing: bool = False) -> Any:
        engine = Engine(self.config)
        origin = self._origin or engine.origin(self.source, token=self.token)
        async with engine:
            if listing:
                found = await origin.list_files(
                    engine.fetcher, origin.default_revision, hidden=True
                )
                self._listed = {f.path: f for f in found.files}
            source = _Source(
                origin,
                engine.fetcher,
                engine.cache,
                self._listed,
                self._counters,
                self.config.max_files * 2,
            )
            try:
                if listing:
                    return await work(source, found)
                return await work(source)
            finally:
                source.close()

    async def _resolve(self, source: _Source, listing: Listing) -> Choice:
        choice = await resolve(
            source.origin, source.fetcher, listing, self.checkpoint, read=source.read_small
        )
        if choice.dcp is not None:  # each data file as it is now, after its .metadata
            folder = choice.dcp.folder
            for rel in choice.dcp.needed:
                listed = self._listed.get(f"{folder}/{rel}" if folder else rel)
                if listed is not None and listed.version is None:
                    version = await source.origin.version(source.fetcher, listed)
                    self._listed[listed.path] = replace(listed, version=version)
        return choice
