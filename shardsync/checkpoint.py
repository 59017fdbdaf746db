"""Training checkpoints from any origin: choose one, fetch one rank's files of it.

``prefetch_checkpoint`` is what ``shardsync prefetch SOURCE --checkpoint latest`` runs: the
engine's usual job (locks, verification, atomic publish, resume, leases), with its files
decided by ``shardsync.training`` instead of a weights index. ``latest`` says what would be
chosen without downloading anything but the small files the choice reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardsync.api import result_from_json, result_to_json
from shardsync.cache import CacheStore
from shardsync.checkpoint_cache import KeptFile, RangeCache, pread_exact
from shardsync.config import Config, load_config
from shardsync.errors import DaemonError, EntryNotFoundError, raise_first
from shardsync.fetch import Fetcher, Sleep
from shardsync.manifest import Listing, Manifest, ManifestEntry, RemoteFile
from shardsync.origins import Origin
from shardsync.prefetch import Engine, Select
from shardsync.records import PrefetchResult, ProgressSink
from shardsync.training import (
    Choice,
    Format,
    Need,
    RankSelection,
    Skipped,
    choose,
    select_rank,
)

__all__ = [
    "CheckpointPlan",
    "CheckpointResult",
    "DCPReader",  # noqa: F822 - built on first use by the module __getattr__
    "ReaderStatistics",
    "alatest",
    "checkpoint_result",
    "checkpoint_result_from_json",
    "latest",
    "prefetch_checkpoint",
    "resolve",
    "selector",
]


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    """A training checkpoint (or one rank's part of it) complete in the cache.

    ``path`` is the local folder a framework is pointed at, laid out like the remote one
    (the checkpoint folder; for DeepSpeed and Megatron the run folder with the pointer file).
    """

    prefetch: PrefetchResult
    checkpoint: str
    format: Format
    step: int | None
    path: Path
    skipped: tuple[Skipped, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """``prefetch --json`` plus ``checkpoint``, ``format``, the checkpoint's folder as
        ``snapshot_path`` (the whole snapshot as ``snapshot_root``), and what was skipped."""
        return {
            **result_to_json(self.prefetch),
            "checkpoint": self.checkpoint,
            "format": self.format,
            "step": self.step,
            "snapshot_path": str(self.path),
            "snapshot_root": str(self.prefetch.snapshot_path),
            "skipped": [{"name": s.name, "reason": s.reason} for s in self.skipped],
            "notes": list(self.notes),
        }


def checkpoint_result_from_json(obj: Mapping[str, Any]) -> CheckpointResult:
    """Inverse of ``CheckpointResult.to_json`` (a daemon job's ``job_done`` result)."""
    try:
        prefetch = result_from_json({**obj, "snapshot_path": obj["snapshot_root"]})
        return CheckpointResult(
            prefetch=prefetch,
            checkpoint=str(obj["checkpoint"]),
            format=obj["format"],
            step=None if obj["step"] is None else int(obj["step"]),
            path=Path(obj["snapshot_path"]),
            skipped=tuple(Skipped(str(s["name"]), str(s["reason"])) for s in obj["skipped"]),
            notes=tuple(str(n) for n in obj["notes"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DaemonError(f"malformed checkpoint result from the daemon: {exc!r}") from exc


ReadSmall = Callable[[Need], Awaitable[bytes | None]]
"""Reads the first ``need.limit + 1`` bytes of ``need.path`` at most (None: no such file)."""


async def resolve(
    origin: Origin,
    fetcher: Fetcher,
    listing: Listing,
    checkpoint: str = "latest",
    *,
    read: ReadSmall | None = None,
) -> Choice:
    """``training.choose`` over an origin: the small files it asks for are read by range
    (pass a listing made with ``hidden=True``: a DCP ``.metadata`` is a hidden file), by
    ``read`` when given (``DCPReader`` reads them through the cache)."""
    pairs = [(f.path, f.size) for f in listing.files]
    contents: dict[str, bytes | None] = {}
    while isinstance(step := choose(pairs, checkpoint, contents), Need):
        if read is None:
            contents[step.path] = await _read_small(origin, fetcher, listing.commit, step)
        else:
            contents[step.path] = await read(step)
    return step


async def _read_small(
    origin: Origin, fetcher: Fetcher, commit: str | None, need: Need
) -> bytes | None:
    try:
        return await origin.read_range(
            fetcher, commit, RemoteFile(need.path, None, None), 0, need.limit + 1
        )
    except EntryNotFoundError:
        return None


@dataclass(slots=True)
class CheckpointPlan:
    """What the ``selector`` hook decided, once the job is prepared."""

    choice: Choice | None = None
    selection: RankSelection | None = None


def selector(
    origin: Origin,
    fetcher: Fetcher,
    checkpoint: str,
    rank: int | None,
    world_size: int | None,
    plan: CheckpointPlan,
) -> Select:
    """The ``Job.prepare(select=...)`` hook: the chosen checkpoint's files for one rank."""

    async def select(listing: Listing) -> Manifest:
        choice = await resolve(origin, fetcher, listing, checkpoint)
        selection = select_rank(choice, rank, world_size)
        listed = {f.path: f for f in listing.files}
        entries = tuple(
            ManifestEntry.from_remote(listed[path], "shard")
            if path in listed
            else ManifestEntry(path, size, None, None, "shard")
            for path, size in selection.files
        )
        plan.choice, plan.selection = choice, selection
        return Manifest(commit=listing.commit, entries=entries, weight_map={})

    return select


async def prefetch_checkpoint(
    source: str,
    config: Config,
    *,
    checkpoint: str = "latest",
    rank: int | None = None,
    world_size: int | None = None,
    token: str | None = None,
    progress: ProgressSink | None = None,
    environ: Mapping[str, str] | None = None,
    sleep: Sleep = asyncio.sleep,
) -> CheckpointResult:
    """Make ``checkpoint`` of the training run at ``source`` (or rank ``rank``'s part of it)
    complete in the cache and return where it is."""
    started = time.monotonic()
    engine = Engine(config, sleep=sleep, environ=environ)
    origin = engine.origin(source, token=token)
    plan = CheckpointPlan()
    async with engine:
        job = engine.job(origin, sink=progress)
        await job.prepare(
            select=selector(origin, engine.fetcher, checkpoint, rank, world_size, plan)
        )
        result = job.result(await job.download(), time.monotonic() - started)
    result = job.after_uploads(result)
    assert plan.choice is not None and plan.selection is not None
    return checkpoint_result(result, plan.choice, plan.selection)


def checkpoint_result(
    result: PrefetchResult, choice: Choice, selection: RankSelection
) -> CheckpointResult:
    return CheckpointResult(
        prefetch=result,
        checkpoint=choice.name,
        format=choice.format,
        step=choice.step,
        path=local_folder(result.snapshot_path, choice.root),
        skipped=choice.skipped,
        notes=selection.notes,
    )


def local_folder(snapshot: Path, root: str) -> Path:
    return snapshot.joinpath(*posixpath.normpath(root).split("/")) if root else snapshot


async def alatest(
    source: str,
    *,
    checkpoint: str = "latest",
    config: Config | None = None,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> Choice:
    """What ``--checkpoint latest`` (or ``checkpoint``) would choose at ``source``, with the
    checkpoints passed over and why; downloads nothing but the small files it reads."""
    config = config or load_config(None, cache_dir=cache_dir)
    engine = Engine(config)
    origin = engine.origin(source, token=token)
    async with engine:
        listing = await origin.list_files(engine.fetcher, origin.default_revision, hidden=True)
        return await resolve(origin, engine.fetcher, listing, checkpoint)


def latest(
    source: str,
    *,
    checkpoint: str = "latest",
    config: Config | None = None,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> Choice:
    """Blocking ``alatest`` (not from inside a running event loop)."""
    return asyncio.run(
        alatest(source, checkpoint=checkpoint, config=config, cache_dir=cache_dir, token=token)
    )


# ------------------------------------------------------------------------------ DCP reader


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
            f.version = await self.origin.version(self.fetcher, f.entry)
            if listed.sha256 is None:
                blob = await asyncio.to_thread(self.ranges.whole, path, f.size, None, f.version)
        if blob is not None:
            try:
                f.blob_fd = os.open(blob, _READ_FLAGS)  # held: a prune may unlink, not cut it
                return f
            except OSError:
                if f.version is None:
                    f.version = await self.origin.version(self.fetcher, f.entry)
        if f.version is not None:
            f.kept = await asyncio.to_thread(self.ranges.open, path, f.size, f.version)
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

        await asyncio.to_thread(write)

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


_Item = Any  # torch.distributed.checkpoint.planner.ReadItem (torch is imported lazily)


@dataclass(frozen=True, slots=True)
class _ReadSpan:
    """One span read from a file (kept, cached or from the origin): bytes ``[start, start +
    len(data))``, and the plan's items inside them that are to be copied out of it."""

    start: int
    data: bytes
    items: tuple[_Item, ...]


def _spans(
    ranges: Iterable[tuple[int, int, _Item]], gap: int, max_span: int
) -> list[tuple[int, int, list[_Item]]]:
    """The items' ranges merged into requests: ranges closer than ``gap`` become one, as
    long as the request stays within ``max_span`` (a larger single range goes alone)."""
    out: list[tuple[int, int, list[_Item]]] = []
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
        reader: Any,
        per_file: Mapping[str, list[tuple[int, int, _Item]]],
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

    async def _file(self, source: _Source, path: str, ranges: list[tuple[int, int, _Item]]) -> None:
        f = await source.file(path)
        local: dict[tuple[int, int], list[_Item]] = {}
        remote: list[tuple[int, int, _Item]] = []
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
        self, source: _Source, f: _OpenFile, start: int, end: int, items: list[_Item]
    ) -> None:
        assert self._budget is not None
        await self._budget.take(end - start)
        data = await source.read(f, start, end)  # the origin if a kept piece went bad
        self.arrivals.put(_ReadSpan(start, data, tuple(items)))

    async def _remote(
        self, source: _Source, f: _OpenFile, start: int, end: int, items: list[_Item]
    ) -> None:
        assert self._budget is not None
        await self._budget.take(end - start)
        data = await source.fetch(f, start, end)
        self.arrivals.put(_ReadSpan(start, data, tuple(items)))  # copied while we keep it
        info = [self.reader.storage_data[i.storage_index] for i in items]
        pieces = sorted({(x.offset, x.offset + x.length) for x in info})
        await source.keep(f, pieces, data, start)


def __getattr__(name: str) -> Any:
    """``DCPReader`` is built on first use, so importing this module never imports torch."""
    if name == "DCPReader":
        return _dcp_reader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DCP_READER: Any = None


def _dcp_reader_class() -> Any:
    global _DCP_READER
    if _DCP_READER is not None:
        return _DCP_READER
    import io

    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
    from torch.distributed.checkpoint.storage import StorageReader
    from torch.futures import Future

    from shardsync.errors import LoadError

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
            return await resolve(
                source.origin, source.fetcher, listing, self.checkpoint, read=source.read_small
            )

    _DCP_READER = DCPReader
    return DCPReader
