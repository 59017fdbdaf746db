"""The in-process engine: origin -> manifest -> fetcher -> cache, for one snapshot.

What ``shardsync prefetch`` and the daemon's jobs run: list the origin, fetch the index,
plan the files, download them under per-blob cross-process locks, publish each verified
blob, and mark the snapshot complete last.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path

import aiohttp

from shardsync.cache import CacheStore
from shardsync.config import Config
from shardsync.engine_api import FileGate, Select
from shardsync.errors import CacheError, raise_first
from shardsync.events import Verified
from shardsync.fetch.fetcher import Fetcher, IntoSlot
from shardsync.fetch.request import Sleep, Throttle, Turn
from shardsync.manifest import (
    MAX_JSON_BYTES,
    Listing,
    Manifest,
    ManifestEntry,
    RemoteFile,
    build_manifest,
    likely_shards,
    parse_index,
    select_weights,
)
from shardsync.network import ssl_context
from shardsync.origins import Origin, parse_source
from shardsync.origins.base import Forget, Progress
from shardsync.prepared import Prepared
from shardsync.records import (
    FileOutcome,
    FileRecord,
    NoProgress,
    PrefetchResult,
    ProgressSink,
    SnapshotRecord,
    TierStatistics,
    VerifiedFile,
)
from shardsync.s3 import S3Client
from shardsync.shard_headers import read_headers
from shardsync.slot import Slot
from shardsync.snapshot_use import AccessLog, Lease, Leases, offline_result
from shardsync.store import AsyncStore
from shardsync.tier import Tier, TierCounters, Upload

__all__ = ["Engine", "Job", "prefetch"]


def _open_gate(entry: ManifestEntry, position: int) -> AbstractAsyncContextManager[None]:
    return contextlib.nullcontext()


_SMALL_AT_ONCE = 4  # small files fetched at once, besides ``max_files`` large ones
_TIER_RETRY_S = 0.1  # seconds before the tier client's one retry of a request
_ORIGINS = 64  # origins an engine keeps, for the sources asked again


class Engine:
    """The HTTP session, fetcher and cache of one process (a CLI run, a loader, the daemon).

    Jobs made by one engine share its connection pool and its limits.
    """

    def __init__(
        self,
        config: Config,
        *,
        sleep: Sleep = asyncio.sleep,
        environ: Mapping[str, str] | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        self.config = config
        self.cache = CacheStore(config.cache_dir)
        self.store = AsyncStore(self.cache)  # what coroutines use: no fsync on the loop
        self._sleep = sleep
        self._environ = environ
        self._throttle = throttle
        self._session: aiohttp.ClientSession | None = None
        self._fetcher: Fetcher | None = None
        self._origins: dict[tuple[str, str | None], Origin] = {}
        self.s3 = S3Client(config.s3, config.network, sleep=sleep)  # opened on first use
        self.tier: Tier | None = None
        self._tier_s3: S3Client | None = None

    async def __aenter__(self) -> Engine:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_files * self.config.fetch.connections_per_file + 4,
            limit_per_host=0,
            # without a CA bundle of ours, aiohttp's own verified context (the system store,
            # loaded as aiohttp was imported): loading the store again cost 23 ms before the
            # first request
            ssl=True if self.config.network.ca_bundle is None else ssl_context(self.config.network),
        )
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=Fetcher.default_timeout(self.config.fetch)
        )
        self._fetcher = Fetcher(
            self._session,
            self.config.fetch,
            sleep=self._sleep,
            throttle=self._throttle,
            network=self.config.network,
        )
        if self.config.tier.url is not None:
            # its own client, retrying a request once after 0.1 s (botocore waited up to 1 s):
            # a dead tier cost a 95 MB job 2.0 s; the job (and its exit) must not wait on it
            s3, network = self.config.s3, self.config.network
            self._tier_s3 = S3Client(
                s3, network, attempts=2, retry_wait=_TIER_RETRY_S, sleep=self._sleep
            )
            tier = Tier(self.config.tier, self._tier_s3)
            self.tier = await tier.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        origins, self._origins = self._origins, {}
        tier, self.tier = self.tier, None
        try:
            try:
                if tier is not None:
                    await tier.__aexit__(*exc_info)  # waits for the uploads the fleet is owed
            finally:
                for origin in origins.values():
                    await origin.aclose()
                await self.s3.aclose()
                if self._tier_s3 is not None:
                    await self._tier_s3.aclose()
        finally:
            if self._fetcher is not None:
                self._fetcher.forget_ahead()
            if self._session is not None:
                await self._session.close()
            self._session = self._fetcher = None

    @property
    def fetcher(self) -> Fetcher:
        if self._fetcher is None:
            raise RuntimeError("use the engine as 'async with Engine(config) as engine'")
        return self._fetcher

    def origin(self, source: str, *, token: str | None = None) -> Origin:
        """The origin ``source`` names: one per source and token, the ``_ORIGINS`` last used
        kept (a daemon asks for each job's), closed with the engine (one dropped shares the
        engine's S3 client and session: nothing of its own to close)."""
        key = (source, token)
        origin = self._origins.pop(key, None) or parse_source(
            source, endpoint=self.config.endpoint, token=token, environ=self._environ, s3=self.s3
        )
        self._origins[key] = origin  # last: the most recently used
        if len(self._origins) > _ORIGINS:
            del self._origins[next(iter(self._origins))]
        return origin

    async def prepare(
        self, origin: Origin, *, revision: str | None = None, allow_pickle: bool = False
    ) -> Prepared:
        """What a stream plans from before any shard lands (``POST /v1/prepare``): the fetch
        list and every safetensors shard's header. The index lands in the cache, no shard
        does, and nothing is located ahead for a download that may never come."""
        job = self.job(origin, revision=revision, allow_pickle=allow_pickle)
        manifest = await job.prepare(include=(), locate_ahead=False)
        return Prepared(manifest, await job.read_headers())

    def job(
        self,
        origin: Origin,
        *,
        revision: str | None = None,
        allow_pickle: bool = False,
        sink: ProgressSink | None = None,
        gate: FileGate | None = None,
        in_order: bool = False,
    ) -> Job:
        return Job(
            origin,
            self.store,
            self.fetcher,
            max_files=self.config.max_files,
            revision=revision or origin.default_revision,
            sink=sink or NoProgress(),
            allow_pickle=allow_pickle,
            gate=gate,
            tier=self.tier,
            in_order=in_order,
        )


async def prefetch(
    source: str,
    config: Config,
    *,
    revision: str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    offline: bool = False,
    allow_pickle: bool = False,
    token: str | None = None,
    progress: ProgressSink | None = None,
    environ: Mapping[str, str] | None = None,
    sleep: Sleep = asyncio.sleep,
    on_complete: Callable[[PrefetchResult], None] | None = None,
) -> PrefetchResult:
    """Make one snapshot of ``source`` complete in the cache and return where it is.

    ``sleep`` is what retries wait with; tests pass a recorder to run them instantly.
    ``on_complete`` is called as soon as the snapshot is complete, before this returns:
    with a shared tier, the blobs this process fetched for the fleet are still uploading
    then, and this returns (with the tier's final counters) once they are up.
    """
    started = time.monotonic()
    engine = Engine(config, sleep=sleep, environ=environ)
    origin = engine.origin(source, token=token)
    if offline:
        return offline_result(
            engine.cache, origin.repo, revision or origin.default_revision, started
        )
    async with engine:
        job = engine.job(origin, revision=revision, allow_pickle=allow_pickle, sink=progress)
        await job.prepare(include, exclude)
        files = await job.download()
        result = job.result(files, time.monotonic() - started)  # complete; uploads may go on
        if on_complete is not None:
            on_complete(result)
    return job.after_uploads(result)


class Job:
    """One (origin, revision) snapshot being made complete: ``prepare`` then ``download``.

    ``in_order``: for a consumer that reads the shards in index order as each is verified
    (a stream, a serving engine). The large files then come one after another, each with
    the connections of ``max_files`` files, the next starting at the tail of the one before:
    side by side at equal rates, four shards would all be verified at the end. It may be
    set while the job runs (a stream joining a prefetch); the next file started obeys it.
    """

    def __init__(
        self,
        origin: Origin,
        store: AsyncStore,
        fetcher: Fetcher,
        *,
        max_files: int,
        revision: str,
        sink: ProgressSink,
        allow_pickle: bool,
        gate: FileGate | None = None,
        tier: Tier | None = None,
        in_order: bool = False,
    ) -> None:
        self.origin = origin
        self.in_order = in_order
        self.tier = tier
        self.store = store
        self.cache = store.sync  # for paths; every disk call goes through ``store``
        self.fetcher = fetcher
        self.max_files = max_files
        self.revision = revision
        self.sink = sink
        self.allow_pickle = allow_pickle
        self.gate: FileGate = gate or _open_gate
        self.commit, self.resolved_at = "", 0.0  # the revision's commit, and when it was read
        self._manifest: Manifest | None = None
        self._hints: dict[str, FileRecord] = {}
        self._records: dict[str, FileRecord] = {}
        self._outcomes: dict[str, FileOutcome] = {}
        self._ahead: list[Forget] = []  # shards located while the index downloads
        self._tier_counters = TierCounters()
        self._uploads: set[asyncio.Task[None]] = set()  # this job's, to the tier, running
        self._lease_held: Lease | None = None

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            raise RuntimeError("call prepare() first")
        return self._manifest

    @property
    def snapshot_path(self) -> Path:
        """Where the snapshot is (complete once ``download`` returned)."""
        if not self.commit:
            raise RuntimeError("the snapshot id is known after download()")
        return self.cache.snapshot_dir(self.origin.repo, self.commit)

    async def prepare(
        self,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        *,
        select: Select | None = None,
        locate_ahead: bool = True,
    ) -> Manifest:
        """List the origin, get the index, and decide every file to fetch, in order;
        ``select`` decides the files from the listing instead (``include``/``exclude`` unused).
        ``locate_ahead``: have the origin find the first shards while the index downloads."""
        async with await self._lease():
            try:
                return await self._prepare(include, exclude, select, locate_ahead)
            except BaseException:
                self._forget_ahead()
                raise

    async def read_headers(self) -> dict[str, bytes]:
        """Every safetensors shard's header, after ``prepare`` (``shard_headers``)."""

        async def cached(entry: ManifestEntry) -> Path | None:
            if entry.sha256 is None or not await self.store.has_blob(entry.sha256, entry.size):
                return None
            return self.cache.blob_path(entry.sha256)

        def read(entry: ManifestEntry, start: int, end: int) -> Awaitable[bytes]:
            return self.origin.read_range(self.fetcher, self.commit or None, entry, start, end)

        return await read_headers(self.manifest.shards, cached=cached, read=read)

    async def download(self) -> tuple[FileOutcome, ...]:
        """Fetch (or reuse) every file; the snapshot is complete when this returns."""
        async with await self._lease():
            try:
                files = await self._download_all()
            finally:
                self._forget_ahead()
            await self.adopt()
        return files

    async def adopt(self) -> None:
        """Name the complete snapshot by this job's revision, as read when the job resolved it
        (after ``download``, or after another job completed the same commit: ``Scheduler``),
        and log its use."""
        await self.store.write_ref(self.origin.repo, self.revision, self.commit, self.resolved_at)
        await asyncio.to_thread(AccessLog(self.cache).record, self.origin.repo, self.commit)

    def result(
        self, files: tuple[FileOutcome, ...], elapsed: float, *, counters: bool = True
    ) -> PrefetchResult:
        """What ``download`` returned, as the result a caller gets. ``counters``: with the
        fetcher's statistics, which tell this job's work only when it had the engine to itself
        (not in the daemon, whose engine serves every job at once), and the job's tier counters
        (not final while ``uploading``)."""
        return PrefetchResult(
            repo=self.origin.repo,
            revision=self.revision,
            commit=self.commit,
            snapshot_path=self.snapshot_path,
            files=files,
            bytes_downloaded=sum(f.downloaded for f in files),
            elapsed=elapsed,
            fetch=self.fetcher.statistics() if counters else None,
            tier=self.tier_statistics() if counters else None,
        )

    def after_uploads(self, result: PrefetchResult) -> PrefetchResult:
        """``result`` with the job's final tier counters, once the engine has closed: its
        uploads for the fleet are done then."""
        if result.tier is None:
            return result
        return replace(result, tier=self.tier_statistics())

    def tier_statistics(self) -> TierStatistics | None:
        """What the tier did for this job alone (None without a tier), however many jobs share
        the engine: the uploads it owes the fleet count too, so it is final once ``download``
        returned and ``uploading`` is false."""
        return None if self.tier is None else self.tier.statistics(self._tier_counters)

    def verified(self, outcome: FileOutcome, shard_index: int | None) -> Verified:
        """The ``Verified`` event of a file this job reports done; the one place that says
        where a verified file is read (clients over the daemon and the loader in-process
        alike). That is its snapshot entry (the job links it before reporting the file), or
        the blob while the snapshot has no id: origins without commits are named by content
        at the end."""
        blob = self.cache.blob_path(outcome.sha256)
        readable = (
            self.cache.snapshot_dir(self.origin.repo, self.commit) / outcome.path
            if self.commit
            else blob
        )
        return Verified(outcome=outcome, shard_index=shard_index, file=readable, blob=blob)

    @property
    def uploading(self) -> bool:
        """Whether uploads this job owes the tier are still running (in the background, after
        its files are published)."""
        return bool(self._uploads)

    async def _lease(self) -> Lease:
        """While a job works, every snapshot of its repo is leased: a prune leaves them be
        (the commit may not be known yet, and the previous snapshot's blobs are reused), and
        so are the blobs it ``_keep``s."""
        kept = () if self._lease_held is None else self._lease_held.info.blobs
        self._lease_held = await Leases(self.cache).ahold(
            self.origin.repo, owner=f"prefetch {self.origin.repo.name}@{self.revision}", blobs=kept
        )
        return self._lease_held

    async def _keep(self, sha256: str) -> None:
        """A content-named snapshot links its files only at its end: until then the job's
        lease names each blob it counts on, or a prune evicting another repo's snapshot that
        holds one would delete it. Check the blob after this, not before."""
        if not self.commit and self._lease_held is not None:
            await self._lease_held.akeep(sha256)

    async def _prepare(
        self,
        include: Sequence[str] | None,
        exclude: Sequence[str],
        select: Select | None,
        locate_ahead: bool,
    ) -> Manifest:
        # A crashed run's temp names go first: one is a second name of its partial, which
        # would otherwise look like a live download and not be resumed.
        await self.store.sweep_orphans()
        # a selection may want hidden files (a DCP checkpoint's ``.metadata``)
        listing = await self._list(hidden=select is not None)
        self.commit, self.resolved_at = listing.commit or "", time.time()
        await self._load_hints()
        if select is not None:
            self._manifest = await select(listing)
            return self._manifest
        weights = select_weights(listing, allow_pickle=self.allow_pickle)
        index = None
        if weights.path.endswith(".index.json"):
            if locate_ahead:
                await self._locate_ahead(likely_shards(listing, weights))
            entry = ManifestEntry.from_remote(weights, "index")
            self.sink.add_file(entry.path, entry.size)
            record, self._outcomes[entry.path] = await self._obtain(entry)
            self._records[entry.path] = record
            data = await self.store.read_blob(record.sha256, MAX_JSON_BYTES + 1)
            index = parse_index(data, path=entry.path)
        self._manifest = build_manifest(listing, index, weights, include=include, exclude=exclude)
        return self._manifest

    async def _locate_ahead(self, shards: Sequence[RemoteFile]) -> None:
        """Have the origin find the first ``max_files`` shards not in the cache (on the Hub a
        resolve, its redirect and the CDN's ``HEAD`` each) while the index downloads: their
        bodies then start that much sooner. Not with a shared tier, whose point is that a
        fleet's hosts ask the Hub as little as they can."""
        if self.tier is not None:
            return
        for remote in shards:
            if len(self._ahead) >= self.max_files:
                break
            if remote.sha256 is not None and await self.store.has_blob(remote.sha256, remote.size):
                continue
            self._ahead.append(self.origin.locate_ahead(self.fetcher, self.commit or None, remote))

    def _forget_ahead(self) -> None:
        ahead, self._ahead = self._ahead, []
        for forget in ahead:
            forget()

    async def _download_all(self) -> tuple[FileOutcome, ...]:
        manifest = self.manifest
        await self._recheck_prepared()
        pending = [e for e in manifest.entries if e.path not in self._records]
        for entry in pending:
            self.sink.add_file(entry.path, entry.size)
        await self._obtain_all(pending)
        await self._complete(manifest, self._records)
        return tuple(self._outcomes[e.path] for e in manifest.entries)

    async def _recheck_prepared(self) -> None:
        """``prepare``'s files (the index) had a lease of their own: a prune since (while the
        daemon waited for room, or for a job it follows) may have evicted them. Under
        ``download``'s lease each is linked again, or fetched again if its blob went too."""
        for path, record in list(self._records.items()):
            if await self.store.has_blob(record.sha256, record.size):
                await self._link(record)
            else:
                del self._records[path], self._outcomes[path]

    async def _list(self, *, hidden: bool = False) -> Listing:
        return await self.origin.list_files(self.fetcher, self.revision, hidden=hidden)

    async def _load_hints(self) -> None:
        """Records of this commit and of the revision's last snapshot: known xxh3 and etags."""
        for commit in (self.commit, await self.store.read_ref(self.origin.repo, self.revision)):
            if not commit:
                continue
            record = await self.store.read_snapshot_record(self.origin.repo, commit)
            if record is not None:
                for f in record.files:
                    self._hints.setdefault(f.path, f)

    async def _obtain_all(self, entries: Sequence[ManifestEntry]) -> None:
        """``max_files`` workers for the large files, in manifest order (each file in its
        turn while ``in_order``), and ``_SMALL_AT_ONCE`` more for the small ones
        (``ManifestEntry.small``), which never wait behind the shards."""
        small: asyncio.Queue[ManifestEntry] = asyncio.Queue()
        large: asyncio.Queue[ManifestEntry] = asyncio.Queue()
        for entry in entries:
            (small if entry.small else large).put_nowait(entry)
        positions = {e.path: i for i, e in enumerate(self.manifest.entries)}
        at_tail = asyncio.Event()  # the large file before is at its tail (or ended)
        at_tail.set()

        async def worker(queue: asyncio.Queue[ManifestEntry]) -> None:
            nonlocal at_tail
            while not queue.empty():
                entry, turn = queue.get_nowait(), None
                before, mine = at_tail, asyncio.Event()
                if queue is large:
                    at_tail = mine
                try:
                    if queue is large and self.in_order:
                        await before.wait()
                        turn = Turn(self.max_files, mine.set)
                    # no await between a file's end and the next one's gate otherwise: the
                    # job's next file competes for the slot it frees (``PriorityGate``)
                    async with self.gate(entry, positions[entry.path]):
                        record, outcome = await self._obtain(entry, turn)
                finally:
                    mine.set()
                self._records[entry.path], self._outcomes[entry.path] = record, outcome

        try:
            async with asyncio.TaskGroup() as tg:
                for queue, most in ((large, self.max_files), (small, _SMALL_AT_ONCE)):
                    for _ in range(min(most, queue.qsize())):
                        tg.create_task(worker(queue))
        except BaseExceptionGroup as group:
            raise_first(group)

    async def _obtain(
        self, entry: ManifestEntry, turn: Turn | None = None
    ) -> tuple[FileRecord, FileOutcome]:
        """Reuse a cached blob or download one, holding the blob's download slot."""
        hit = await self._cached(entry)
        slot = await self.store.slot(self._blob_key(entry))
        if hit is not None:
            await self.store.drop_leftover(slot)
            return hit
        async with slot:
            hit = await self._cached(entry)  # another process may have finished it meanwhile
            if hit is not None:
                return hit
            record, outcome = await self._download(entry, slot, turn)
        await self._link(record)
        self.sink.file_done(outcome)
        return record, outcome

    async def _cached(self, entry: ManifestEntry) -> tuple[FileRecord, FileOutcome] | None:
        hint = self._hints.get(entry.path)
        sha = entry.sha256
        if sha is None:  # its last download's note first: newer than the snapshot's record
            hint = await self.store.remembered(self._blob_key(entry), entry.path) or hint
        if sha is None and hint is not None and await self._hint_matches(entry, hint):
            sha = hint.sha256
        if sha is None:
            return None
        await self._keep(sha)
        if not await self.store.has_blob(sha, entry.size):
            return None
        try:
            record = await self._reuse(entry, sha, hint)
        except (FileNotFoundError, CacheError):
            if await self.store.has_blob(sha, entry.size):
                raise
            return None  # a concurrent prune removed it between the check and the link
        outcome = FileOutcome(entry.path, record.size, sha, record.verified, "cache", 0, 0)
        self.sink.advance(entry.path, record.size)
        self.sink.file_done(outcome)
        return record, outcome

    async def _reuse(self, entry: ManifestEntry, sha: str, hint: FileRecord | None) -> FileRecord:
        """Link a blob already in the store into this snapshot (hashing it if no record says)."""
        if hint is not None and hint.sha256 == sha:
            record = hint
        else:
            digest = await self.store.hash_blob(sha)
            record = FileRecord(
                path=entry.path,
                size=digest.nbytes,
                sha256=sha,
                xxh3_128=digest.xxh3_128,
                etag=self._hf_etag(entry, sha),
                verified="sha256",
            )
        await self._link(record)
        return record

    async def _hint_matches(self, entry: ManifestEntry, hint: FileRecord) -> bool:
        """A file without a known sha256 is the same only if the origin's identity matches:
        as this job's listing saw it where the listing says (an S3 listing ``HEAD``s each
        object; the job's sizes and sha256s are as old), else as the origin says now."""
        if entry.size is not None and hint.size != entry.size:
            return False
        if entry.blob_id is not None:
            return hint.etag == entry.blob_id
        if hint.origin_etag is None:
            return False
        version = entry.version or await self.origin.version(self.fetcher, entry)
        return version == hint.origin_etag

    def _blob_key(self, entry: ManifestEntry) -> str:
        if entry.sha256 is not None:
            return entry.sha256
        ident = f"{self.origin.repo.kind}\0{self.origin.repo.name}\0{self.commit}\0{entry.path}"
        return "p-" + hashlib.sha256(ident.encode()).hexdigest()[:40]

    def _hf_etag(self, entry: ManifestEntry, sha256: str) -> str:
        return entry.blob_id if entry.sha256 is None and entry.blob_id else sha256

    async def _download(
        self, entry: ManifestEntry, slot: Slot, turn: Turn | None
    ) -> tuple[FileRecord, FileOutcome]:
        into = IntoSlot(self.fetcher, slot, turn)

        def progress(n: int) -> None:
            self.sink.advance(entry.path, n)

        async def from_origin(
            tell: Progress, pace: Throttle | None = None, once: bool = False
        ) -> VerifiedFile:  # ``once``: one mismatch is the seeded tier parts' (``Tier``)
            paced = IntoSlot(self.fetcher, slot, turn, pace, verify_once=once)
            return await self.origin.download(self.fetcher, self.commit or None, entry, paced, tell)

        upload: Upload | None = None
        if self.tier is not None and entry.sha256 is not None and entry.size is not None:
            fetched, upload = await self.tier.obtain(
                entry.path,
                entry.sha256,
                entry.size,
                into.fetch,
                from_origin,
                progress,
                slot=slot,
                counters=self._tier_counters,
            )
        else:
            fetched = await from_origin(progress)
        try:
            await self._keep(fetched.sha256)
            await self.store.commit(slot, fetched)
        except BaseException:
            if self.tier is not None and upload is not None:
                await self.tier.abandon(upload)
            raise
        if self.tier is not None and upload is not None:
            uploading = self.tier.upload_soon(upload, self.cache.blob_path(fetched.sha256))
            self._uploads.add(uploading)
            uploading.add_done_callback(self._uploads.discard)
        record = FileRecord(
            path=entry.path,
            size=fetched.size,
            sha256=fetched.sha256,
            xxh3_128=fetched.xxh3_128,
            etag=self._hf_etag(entry, fetched.sha256),
            verified=fetched.verified,
            origin_etag=fetched.etag,
        )
        outcome = FileOutcome(
            entry.path,
            fetched.size,
            fetched.sha256,
            fetched.verified,
            fetched.source,
            fetched.downloaded,
            fetched.resumed,
        )
        return record, outcome

    async def _link(self, record: FileRecord) -> None:
        """Hub snapshots gain each file as it lands; content-named ones wait for the end."""
        if self.commit:
            await self.store.link_file(
                self.origin.repo, self.commit, record.path, sha256=record.sha256, etag=record.etag
            )

    async def _complete(self, manifest: Manifest, records: Mapping[str, FileRecord]) -> None:
        files = tuple(records[e.path] for e in manifest.entries)
        if not self.commit:
            self.commit = self.origin.repo.content_id(files)
            for record in files:
                await self._link(record)
        await self.store.write_snapshot_record(
            SnapshotRecord(
                repo=self.origin.repo,
                revision=self.revision,
                commit=self.commit,
                files=files,
                completed_at=time.time(),
            )
        )
