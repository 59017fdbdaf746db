"""Streaming loader: tensors onto their devices as each shard arrives.

It imports torch lazily (so the CLI and daemon start fast), as ``placement.py`` does.
A background thread runs the engine's event loop: it lists the origin, reads
every shard's safetensors header with Range requests *before* any shard body
lands, plans the device map, then downloads shards in index order (when a
daemon serves the load, the daemon lists, reads the headers and downloads;
this process plans and places). The
caller's thread takes each shard the moment it is verified, in index order,
and places its tensors (``placement.py``):

- CPU (and ``"disk"``): tensors are views of the memory-mapped cache blob, no
  copy unless a dtype cast is asked, so host RAM stays bounded by what is used.
- CUDA: bytes go through a small ring of pinned staging buffers and are copied
  with ``non_blocking=True`` on a side stream; a tensor is handed out only
  after its copy finished. Never a whole-shard copy in pageable RAM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import resource
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from shardsync.cache import CacheStore
from shardsync.config import Config, check_endpoint, load_config
from shardsync.devicemap import MODES, DevicePlan, MaxMemory, parse_memory
from shardsync.errors import ConfigError, HeaderError, LoadError, raise_first
from shardsync.events import Verified
from shardsync.manifest import Manifest, ManifestEntry
from shardsync.origins import parse_source
from shardsync.placement import DeviceMap, ShardPlacer, fill_model, find_devices, plan_from_headers
from shardsync.prefetch import Engine, Job
from shardsync.records import FileOutcome
from shardsync.safetensors_header import Header, check_index, parse_header
from shardsync.snapshot_use import Lease, Leases
from shardsync.tasks import opened

if TYPE_CHECKING:
    import torch

    from shardsync.daemon_transport import DaemonLease
    from shardsync.jobs import JobClient

__all__ = ["LoadResult", "LoadStatistics", "TensorStream", "load", "stream"]


@dataclass(frozen=True, slots=True)
class LoadStatistics:
    """Timings of one load (seconds since it started) and its peak host RSS."""

    started_at: float  # time.monotonic() at the start
    plan_ready: float
    first_tensor: float | None
    shards_verified: tuple[float, ...]  # in index order
    finished: float | None
    tensors: int
    bytes: int
    bytes_downloaded: int
    peak_rss: int  # bytes, of this process

    @property
    def throughput(self) -> float:
        """Checkpoint bytes on their devices per second of wall time."""
        return self.bytes / self.finished if self.finished else 0.0


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What ``load(model=...)`` reports, like ``nn.Module.load_state_dict``."""

    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    plan: DevicePlan | None  # None for pickle checkpoints
    statistics: LoadStatistics


@dataclass(frozen=True, slots=True)
class _Request:
    """What to load and how; handed to the producer thread."""

    source: str
    config: Config
    revision: str | None
    device_map: DeviceMap
    max_memory: MaxMemory | None
    token: str | None
    no_split: Sequence[str] | None
    allow_pickle: bool
    priority: int  # the daemon's job priority
    gated: bool  # download only once iteration starts (load(model=...) checks keys first)
    named_cache: Path | None = None  # a cache the caller named: a daemon must serve that one
    named_endpoint: str | None = None  # likewise a Hub endpoint


@dataclass(slots=True)
class _Handoff:
    """What the two threads exchange: the consumer's devices, the producer's messages."""

    messages: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)
    devices: concurrent.futures.Future[tuple[tuple[str, ...], Mapping[str | int, int | str]]] = (
        field(default_factory=concurrent.futures.Future)
    )
    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task[None] | None = None
    go: asyncio.Event | None = None  # set by the consumer when iteration starts


class _Leases:
    """The stream's one lease, released once from whichever thread closes the stream first;
    one added after that is released at once."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: Lease | DaemonLease | None = None
        self._released = False

    def add(self, lease: Lease | DaemonLease) -> None:
        with self._guard:
            if not self._released:
                self._held = lease
                return
        lease.release()

    def release(self) -> None:
        with self._guard:
            self._released = True
            held, self._held = self._held, None
        if held is not None:
            held.release()


class _ShardSink:
    """Engine progress sink that hands each verified file to the consumer thread as the
    ``Verified`` event a daemon would send for it, so both ways read the same ``file``."""

    def __init__(self, handoff: _Handoff) -> None:
        self._handoff = handoff
        self.engine_job: Job | None = None
        self._shard_index: dict[str, int] = {}

    def resolved(self, manifest: Manifest) -> None:
        self._shard_index = {e.path: i for i, e in enumerate(manifest.shards)}

    def add_file(self, path: str, size: int | None) -> None:
        return None

    def advance(self, path: str, nbytes: int) -> None:
        return None

    def file_done(self, outcome: FileOutcome) -> None:
        assert self.engine_job is not None
        index = self._shard_index.get(outcome.path)
        self._handoff.messages.put(("verified", self.engine_job.verified(outcome, index)))


class TensorStream:
    """An iterator of ``(name, tensor)`` in shard order; each shard as soon as it is verified.

    Creating it reads the headers and plans the devices (``plan``, ``headers``) while
    the shard bodies start downloading. Use it as a context manager (or exhaust it) so
    the background download stops when you stop early.

    The repo's snapshots stay leased (``prune`` leaves them alone) for as long as the stream
    is open: until ``close()`` or the end of the ``with`` block, or, for a stream never
    closed, until it is garbage collected. Exhausting it does not end the lease. Tensors
    already mapped stay readable after that too: prune only unlinks.
    """

    def __init__(self, request: _Request, dtype: torch.dtype | None) -> None:
        self._started = time.monotonic()
        self._handoff = _Handoff()
        self._request = request
        self._thread = threading.Thread(
            target=self._produce_in_thread, name="shardsync-loader", daemon=True
        )
        self._verified: dict[str, Verified] = {}
        self._done = False
        self._plan: (
            tuple[Manifest, Mapping[str, Header], Mapping[str, bytes], DevicePlan | None] | None
        ) = None
        self._shard_times: list[float] = []
        self._first_tensor: float | None = None
        self._finished: float | None = None
        self._tensors: int = 0
        self._bytes: int = 0
        self._placer = ShardPlacer(dtype, request.device_map)
        self._iterator: Iterator[tuple[str, torch.Tensor]] = self._iterate()
        self._leases = _Leases()  # taken by the producer: this process's, or the daemon's
        self._release_lease = weakref.finalize(self, self._leases.release)
        self._thread.start()  # listing, index and headers go on while torch imports
        self._devices: tuple[str, ...] = ()
        try:
            self._devices = self._find_devices()
            while self._plan is None:
                self._pump()
        except BaseException:
            self.close()
            raise
        self.manifest: Manifest = self._plan[0]
        self.headers: Mapping[str, Header] = self._plan[1]
        self._raw_headers: Mapping[str, bytes] = self._plan[2]
        self.plan: DevicePlan | None = self._plan[3]
        """The device plan; ``None`` for pickle checkpoints (no headers to plan from)."""
        self._plan_ready: float = time.monotonic() - self._started

    # -------------------------------------------------------------- consumer side

    def _find_devices(self) -> tuple[str, ...]:
        """The accelerators and their budgets; the first use of torch, off the network path."""
        try:
            mode = self._request.device_map
            automatic = isinstance(mode, str) and mode in MODES
            devices, budgets = find_devices(self._request.max_memory, automatic=automatic)
        except BaseException as exc:
            self._handoff.devices.set_exception(exc)
            raise
        self._handoff.devices.set_result((devices, budgets))
        return devices

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._iterator)

    def __enter__(self) -> TensorStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background download (partial files stay for the next run) and end the
        lease on the repo's snapshots."""
        self._stop()
        self._release_lease()

    def _stop(self) -> None:
        """Stop the background download; the lease lives on until ``close()``."""
        handoff = self._handoff
        if handoff.loop is not None and handoff.task is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                handoff.loop.call_soon_threadsafe(handoff.task.cancel)
        self._thread.join(timeout=30)

    def statistics(self) -> LoadStatistics:
        return LoadStatistics(
            started_at=self._started,
            plan_ready=self._plan_ready,
            first_tensor=self._first_tensor,
            shards_verified=tuple(self._shard_times),
            finished=self._finished,
            tensors=self._tensors,
            bytes=self._bytes,
            bytes_downloaded=sum(v.outcome.downloaded for v in self._verified.values()),
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        )

    def _iterate(self) -> Iterator[tuple[str, torch.Tensor]]:
        handoff = self._handoff
        if self._request.gated and handoff.loop is not None and handoff.go is not None:
            with contextlib.suppress(RuntimeError):  # the producer already ended (an error)
                handoff.loop.call_soon_threadsafe(handoff.go.set)
        try:
            for entry in self.manifest.shards:
                yield from self._place_shard(entry, self._wait_verified(entry.path).file)
            self._wait_done()
            self._finished = time.monotonic() - self._started
        finally:
            self._stop()

    def _wait_verified(self, path: str) -> Verified:
        while path not in self._verified:
            if self._done:  # the job's files were not the planned ones (an S3 prefix resaved)
                raise LoadError(f"{path}: the download ended without it; load again")
            self._pump()
        return self._verified[path]

    def _wait_done(self) -> None:
        """Drain events until the snapshot is complete (extra files, the record)."""
        while not self._done:
            self._pump()

    def _pump(self) -> None:
        """Take one message from the producer thread (errors are raised here)."""
        kind, payload = self._handoff.messages.get()
        if kind == "error":
            raise payload
        if kind == "verified":
            self._verified[payload.outcome.path] = payload
        elif kind == "plan":
            self._plan = payload
        elif kind == "done":
            self._done = True

    def _place_shard(self, entry: ManifestEntry, file: Path) -> Iterator[tuple[str, torch.Tensor]]:
        self._shard_times.append(time.monotonic() - self._started)
        if self.plan is None:
            placed = self._placer.place_pickle(entry, file, self._devices)
        else:
            header = self.headers[entry.path]
            _check_planned(entry.path, file, header, self._raw_headers[entry.path])
            placed = self._placer.place_safetensors(file, header, self.plan)
        for name, tensor, event, nbytes in placed:
            yield self._hand_out(name, tensor, event, nbytes)

    def _hand_out(
        self, name: str, tensor: torch.Tensor, event: Any, nbytes: int
    ) -> tuple[str, torch.Tensor]:
        if event is not None:
            event.synchronize()
        if self._first_tensor is None:
            self._first_tensor = time.monotonic() - self._started
        self._tensors += 1
        self._bytes += nbytes
        return name, tensor

    # -------------------------------------------------------------- producer side

    def _produce_in_thread(self) -> None:
        loop = asyncio.new_event_loop()
        self._handoff.loop = loop
        try:
            task = loop.create_task(self._produce(self._request))
            self._handoff.task = task
            loop.run_until_complete(task)
        except asyncio.CancelledError:
            self._handoff.messages.put(("error", LoadError("loading was cancelled")))
        except BaseException as exc:  # handed to the consumer thread, which raises it
            self._handoff.messages.put(("error", exc))
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _produce(self, request: _Request) -> None:
        client = await _daemon(request)
        if client is None:
            await self._produce_here(request)
        else:
            try:
                await self._produce_via(client, request)
            finally:
                await client.close()
        self._handoff.messages.put(("done", None))

    async def _produce_here(self, request: _Request) -> None:
        """No daemon serves us: list, read the headers and download in this process."""
        await self._lease_here(request)
        async with Engine(request.config) as engine:
            origin = engine.origin(request.source, token=request.token)
            sink = _ShardSink(self._handoff)
            job = engine.job(
                origin,
                revision=request.revision,
                allow_pickle=request.allow_pickle,
                sink=sink,
                in_order=True,
            )
            sink.engine_job = job
            manifest = await job.prepare(include=())
            sink.resolved(manifest)
            raw = await job.read_headers()

            async def download() -> None:
                await job.download()

            await self._plan_then(request, manifest, raw, download)

    async def _produce_via(self, client: JobClient, request: _Request) -> None:
        """A daemon lists, reads the headers and downloads (each byte once per host); this
        process asks the origin nothing. The commit the headers came from is pinned, so the
        daemon fetches those exact shards. The daemon leases them in its cache for us (this
        process's own cache may be another one)."""
        lease = await client.hold(request.source)
        if lease is None:  # a daemon older than ``POST /v1/leases``
            await self._lease_here(request)
        else:
            self._leases.add(lease)
        prepared = await client.prepare(
            request.source, revision=request.revision, allow_pickle=request.allow_pickle
        )
        if prepared is None:  # a daemon older than ``POST /v1/prepare``: read them here
            async with Engine(request.config) as engine:
                origin = engine.origin(request.source, token=request.token)
                prepared = await engine.prepare(
                    origin, revision=request.revision, allow_pickle=request.allow_pickle
                )
        manifest, planned_headers = prepared.manifest, prepared.headers

        async def download() -> None:
            remote = await client.prefetch(
                request.source,
                revision=manifest.commit or request.revision,
                include=(),
                priority=request.priority,
                allow_pickle=request.allow_pickle,
                in_order=True,
            )
            async for event in remote.events():
                if isinstance(event, Verified):
                    self._handoff.messages.put(("verified", event))
            await remote.wait()

        await self._plan_then(request, manifest, planned_headers, download)

    async def _lease_here(self, request: _Request) -> None:
        taking = asyncio.to_thread(_lease, request.config, request.source, request.token)
        lease = await opened(taking, Lease.release)
        if lease is not None:
            self._leases.add(lease)

    async def _plan_then(
        self,
        request: _Request,
        manifest: Manifest,
        raw: Mapping[str, bytes],
        download: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        """Parse the headers, plan the devices once the consumer found them, and download:
        at once, or (``gated``) once the consumer has checked the keys."""
        sizes = {e.path: e.size for e in manifest.shards}
        headers = {p: parse_header(h, shard=p, file_size=sizes[p]) for p, h in raw.items()}
        if _is_pickle(manifest):
            if isinstance(request.device_map, str) and request.device_map in MODES:
                raise ConfigError(
                    f"device_map={request.device_map!r} plans from safetensors headers; "
                    "for a pickle checkpoint give a device or an explicit {prefix: device} map"
                )
        elif manifest.weight_map:
            check_index(manifest.weight_map, headers)
        try:
            async with asyncio.TaskGroup() as tg:
                if not request.gated:  # the download does not need the plan: start now
                    tg.create_task(download())
                devices, budgets = await asyncio.wrap_future(self._handoff.devices)
                plan = plan_from_headers(
                    manifest,
                    headers,
                    request.device_map,
                    devices=devices,
                    budgets=budgets,
                    no_split=request.no_split,
                    dtype=self._placer.dtype,
                )
                self._handoff.go = asyncio.Event()
                self._handoff.messages.put(("plan", (manifest, headers, raw, plan)))
                if request.gated:
                    await self._handoff.go.wait()  # the consumer checked the keys first
                    await download()
        except BaseExceptionGroup as group:
            raise_first(group)


async def _daemon(request: _Request) -> JobClient | None:
    """The daemon that serves this load, or None: work in this process (always for a local
    directory, which only its caller reads, and with a ``token=``: the daemon fetches with
    its own credentials)."""
    from shardsync.jobs import daemon_for

    origin = parse_source(request.source, endpoint=request.config.endpoint, token=request.token)
    if origin.caller_only or request.token is not None:
        return None
    return await daemon_for(
        request.config, cache_dir=request.named_cache, endpoint=request.named_endpoint
    )


def _check_planned(path: str, file: Path, header: Header, raw: bytes) -> None:
    """Refuse a verified shard that is not the one its plan was made from, before a byte of
    it is mapped: a local file, an S3 object or a plain URL has no commit to pin, so it may
    have been replaced between the header read and the download (its tensors would then be
    cut at the old offsets); and a shard whose size was not known when its header was read
    (a plain URL's) must end where its header says."""
    with file.open("rb") as f:
        same = f.read(8) == len(raw).to_bytes(8, "little") and f.read(len(raw)) == raw
        size = os.fstat(f.fileno()).st_size
    if not same:
        raise LoadError(
            f"{path} changed at the origin between the plan and its download; load again"
        )
    if size != header.file_size:
        raise HeaderError(
            f"{path}: its header's data section ends at byte {header.file_size}, "
            f"the file has {size} bytes"
        )


def _lease(config: Config, source: str, token: str | None) -> Lease:
    """An open stream leases every snapshot of its repo, so a prune leaves the blobs it is
    about to map (blobs already mapped stay readable anyway: prune only unlinks)."""
    repo = parse_source(source, endpoint=config.endpoint, token=token).repo
    return Leases(CacheStore(config.cache_dir)).hold(repo, owner=f"load {repo.name}")


def _is_pickle(manifest: Manifest) -> bool:
    return any(not e.path.endswith(".safetensors") for e in manifest.shards)


def stream(
    source: str,
    *,
    revision: str | None = None,
    device_map: DeviceMap = "auto",
    max_memory: MaxMemory | None = None,
    dtype: torch.dtype | None = None,
    endpoint: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    no_split: Sequence[str] | None = None,
    allow_pickle: bool = False,
    priority: int = 0,
    config: Config | None = None,
) -> TensorStream:
    """Stream ``(name, tensor)`` pairs in shard order, each shard as soon as it is verified.
    ``priority`` is the daemon's job's (its files go before lower jobs'), as for a prefetch.

    >>> with shardsync.stream("org/model", device_map="cuda:0") as tensors:
    ...     for name, tensor in tensors:
    ...         consume(name, tensor)
    """
    return _open(
        source,
        revision=revision,
        device_map=device_map,
        max_memory=max_memory,
        dtype=dtype,
        endpoint=endpoint,
        cache_dir=cache_dir,
        token=token,
        no_split=no_split,
        allow_pickle=allow_pickle,
        priority=priority,
        config=config,
        gated=False,
    )


def weights(
    source: str,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    allow_pickle: bool = False,
    priority: int = 0,
    config: Config | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``source``, in index order, each shard as soon as
    it is verified: what a serving engine's ``load_weights`` takes (vLLM's, SGLang's, your
    own). The tensors are CPU views of the cache's mapped files, so nothing is copied or read
    twice; the download goes through the daemon when one answers. The stream (and the lease
    on the snapshot) closes when the iterator is exhausted or closed.

    >>> model.load_weights(shardsync.weights("org/model"))
    """
    with stream(
        source,
        revision=revision,
        device_map="cpu",
        endpoint=endpoint,
        cache_dir=cache_dir,
        token=token,
        allow_pickle=allow_pickle,
        priority=priority,
        config=config,
    ) as tensors:
        yield from tensors


def _open(
    source: str,
    *,
    revision: str | None,
    device_map: DeviceMap,
    max_memory: MaxMemory | None,
    dtype: torch.dtype | None,
    endpoint: str | None,
    cache_dir: str | Path | None,
    token: str | None,
    no_split: Sequence[str] | None,
    allow_pickle: bool,
    priority: int,
    config: Config | None,
    gated: bool,
) -> TensorStream:
    named_cache = Path(cache_dir).expanduser() if cache_dir else None
    if config is None:
        cfg = load_config(cache_dir=named_cache)
        if named_cache is None and os.environ.get("SHARDSYNC_CACHE_DIR"):
            named_cache = cfg.cache_dir
    else:
        cfg = config if named_cache is None else replace(config, cache_dir=named_cache)
    if endpoint:
        cfg = replace(cfg, endpoint=check_endpoint("endpoint=", endpoint))
    if max_memory is not None:
        max_memory = {k: parse_memory(v) for k, v in max_memory.items()}
    request = _Request(
        source=source,
        config=cfg,
        revision=revision,
        device_map=device_map,
        max_memory=max_memory,
        token=token,
        no_split=no_split,
        allow_pickle=allow_pickle,
        priority=priority,
        gated=gated,
        named_cache=named_cache,
        named_endpoint=endpoint or None,
    )
    return TensorStream(request, dtype)


def load(
    source: str,
    *,
    revision: str | None = None,
    device_map: DeviceMap = "auto",
    max_memory: MaxMemory | None = None,
    dtype: torch.dtype | None = None,
    model: torch.nn.Module | None = None,
    strict: bool = True,
    endpoint: str | None = None,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    no_split: Sequence[str] | None = None,
    allow_pickle: bool = False,
    priority: int = 0,
    config: Config | None = None,
) -> dict[str, torch.Tensor] | LoadResult:
    """Load a checkpoint onto devices while it downloads.

    Without ``model``: a ``dict`` of tensors placed per ``device_map``. With ``model``
    (possibly built on the ``meta`` device): fills it in place (``assign=True``) and
    returns the missing/unexpected keys; ``strict`` raises ``LoadError`` on either,
    before a single shard is downloaded.
    """
    tensors = _open(
        source,
        revision=revision,
        device_map=device_map,
        max_memory=max_memory,
        dtype=dtype,
        endpoint=endpoint,
        cache_dir=cache_dir,
        token=token,
        no_split=no_split,
        allow_pickle=allow_pickle,
        priority=priority,
        config=config,
        gated=model is not None,  # the keys are checked against the model before downloading
    )
    with tensors:
        if model is None:
            return dict(tensors)
        return _fill_model(model, tensors, strict=strict)


def _fill_model(model: torch.nn.Module, tensors: TensorStream, *, strict: bool) -> LoadResult:
    known = None
    if tensors.plan is not None:  # safetensors: every name is known before the download
        known = {t.name for h in tensors.headers.values() for t in h.tensors}
    missing, unexpected = fill_model(
        model, tensors, tensors.manifest.weight_map, known=known, strict=strict
    )
    return LoadResult(missing, unexpected, tensors.plan, tensors.statistics())
