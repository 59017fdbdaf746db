"""The fleet's shared tier: an S3 prefix that every host reads before the origin and fills
after it, so a model leaves the Hub about once for a whole cluster.

Key layout (a contract: other hosts, versions and tools read it)::

    PREFIX/sha256/<first two hex>/<sha256>   a blob, byte for byte the file with that sha256
    PREFIX/claims/<sha256>                   a single-flight claim (JSON, short-lived)
    PREFIX/parts/<sha256>/<start>-<end>      a claim holder's blocks, while it downloads

Only files whose sha256 the origin publishes (Hub LFS files, S3 objects with a checksum)
go through the tier: the name must be known before the bytes are. The tier is never
trusted: what it serves is verified while it streams like any download, a mismatch
deletes the object and the file comes from the origin. Metadata (what a revision means)
never comes from it. Any object may vanish at any time; a tier that is down, slow or
refusing writes costs a warning and a metric, and the job goes on from the origin.

Single flight: a host that misses creates the claim with a conditional PUT
(``If-None-Match: *``) and renews it (``If-Match``) while it downloads and uploads; the
others wait for the blob to appear, watching the claim. A claim whose ETag a waiter has not
seen change for ``claim_lease`` by its own clock (its holder died) is taken over, and so is
one whose holder's own stamp is ``tier_claims.SKEW_S`` past its expiry (clocks may differ
by that much); one that is renewed but makes no progress for ``claim_stall`` makes the
waiter download from the origin itself. The taker resumes from the blocks the dead holder published
(``tier_parts``), so a holder's death costs the fleet what it had in flight.

Spread: a host that already claims or downloads a blob waits ``claim_courtesy`` before it
claims another, so hosts that start together each win one (a host that dies then holds one
blob's progress, not the whole model's); a host alone pays it once: its second to last
files start ``claim_courtesy`` late.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shardsync.config import TierConfig
from shardsync.errors import (
    AuthError,
    CacheError,
    EntryNotFoundError,
    IntegrityError,
    ShardsyncError,
    TransferError,
)
from shardsync.fetch.request import BlobRequest, Located, Throttle
from shardsync.names import S3Location, parse_s3_url
from shardsync.ranges import RangeSet
from shardsync.records import TierStatistics, VerifiedFile
from shardsync.s3 import ObjectInfo, PreconditionFailed, S3Client
from shardsync.slot import Slot
from shardsync.tier_claims import MAX_CLAIM, Watch, blob_key, claim_body, claim_key, expired
from shardsync.tier_parts import Lead, delete_parts, publish_parts, seed_from_parts

__all__ = ["Tier", "TierCounters", "Upload"]

log = logging.getLogger("shardsync.tier")

Progress = Callable[[int], None]
FromOrigin = Callable[[Progress, Throttle | None, bool], Awaitable[VerifiedFile]]  # paced, once
_MAX_ROUNDS = 4  # miss -> wait -> (taken over | released) -> ... before going to the origin
_POLL_FIRST, _POLL_MAX = 0.2, 2.0  # and at most a quarter of the lease apart
_ANSWER_S = 5.0  # the longest a tier request but an upload may take (S3 answers in ms)
_EXIT_LOOK = 0.1  # seconds between looks at a tier that may have died, while leaving
_RENEWALS_PER_LEASE = 5
_COOLDOWN = 60.0  # seconds the tier is skipped after it could not be reached


@dataclass(slots=True)
class _Claim:
    sha256: str
    size: int
    etag: str
    token: str
    done: int = 0
    phase: Literal["download", "upload"] = "download"
    lost: bool = False


@dataclass(slots=True)
class TierCounters:
    """What the tier did: for the whole process (``Tier.statistics()``), or for one job, whose
    ``obtain`` calls were given these (the daemon runs many jobs on one tier at once)."""

    hits: int = 0
    misses: int = 0
    bytes_from_tier: int = 0
    uploads: int = 0
    bytes_uploaded: int = 0
    claims_won: int = 0
    claims_waited: int = 0
    claims_taken_over: int = 0
    stalled_fallbacks: int = 0
    corrupt_objects: int = 0
    errors: int = 0
    bytes_from_parts: int = 0


# The counters of the job the current task works for: tasks spawned meanwhile (a claim's
# renewals, an upload) copy it, so their counts are that job's too, however many run at once.
_JOB: contextvars.ContextVar[TierCounters | None] = contextvars.ContextVar(
    "shardsync_tier_job", default=None
)


@contextlib.contextmanager
def _for_job(counters: TierCounters | None) -> Iterator[None]:
    token = _JOB.set(counters)
    try:
        yield
    finally:
        _JOB.reset(token)


@dataclass(slots=True)
class Upload:
    """A verified blob owed to the tier; its claim (if this host won one) is released after."""

    sha256: str
    size: int
    claim: _Claim | None
    renewal: asyncio.Task[None] | None = None
    counters: TierCounters | None = None  # the job it is owed for


class Tier:
    """One process's use of the shared tier; use as ``async with Tier(...) as tier``.

    Uploads and claim renewals run in the tier's own task group; leaving the ``async with``
    waits for the uploads still running (so a CLI run leaves the fleet its blobs).
    """

    def __init__(
        self,
        config: TierConfig,
        client: S3Client,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.url is None:
            raise ValueError("a Tier needs config.url")
        self.config = config
        self.location: S3Location = parse_s3_url(config.url)
        self._client = client
        self._clock = clock
        self._n = TierCounters()
        self._warned: set[str] = set()
        self._disabled = False  # reads refused (bad credentials): the tier is off
        self._read_only = False  # writes refused: read what others upload, claim nothing
        self._down_until = 0.0  # after a transport error, the tier is skipped until then
        self._tasks: asyncio.TaskGroup | None = None
        self._spawned: set[asyncio.Task[None]] = set()
        self._host = f"{socket.gethostname()}:{os.getpid()}"
        self._claiming = asyncio.Lock()  # one claim attempt at a time, in this process
        self._held = 0  # claims this process won and still downloads for

    async def __aenter__(self) -> Tier:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        """Waits for the uploads the fleet is owed, unless the work around the tier failed
        or the tier is down (then within ``_EXIT_LOOK`` of its first failed request): they are
        given up (the origin still has every byte; the claims die by their lease), and the
        work's failure goes on as it was raised, not inside the uploads' exception group."""
        tasks, self._tasks = self._tasks, None
        if tasks is None:
            return
        failed = bool(exc_info and exc_info[0] is not None)
        while self._spawned and not failed:
            await asyncio.wait(set(self._spawned), timeout=_EXIT_LOOK)
            failed = not self._usable()  # the tier died meanwhile: the uploads are lost
        for task in self._spawned:
            task.cancel()
        await tasks.__aexit__(None, None, None)

    def statistics(self, counters: TierCounters | None = None) -> TierStatistics:
        """The whole process's counters, or one job's (the ``counters`` it obtained with)."""
        n = self._n if counters is None else counters
        return TierStatistics(
            url=self.location.url,
            disabled=self._disabled,
            read_only=self._read_only,
            **dataclasses.asdict(n),  # the same fields, named the same
        )

    def _counting(self) -> tuple[TierCounters, ...]:
        """The counters a count goes to: the process's, and the current job's."""
        job = _JOB.get()
        return (self._n,) if job is None else (self._n, job)

    # ------------------------------------------------------------------ obtaining a blob

    async def obtain(
        self,
        label: str,
        sha256: str,
        size: int,
        slot_fetch: Callable[[BlobRequest, Progress], Awaitable[VerifiedFile]],
        from_origin: FromOrigin,
        progress: Progress,
        *,
        slot: Slot | None = None,
        counters: TierCounters | None = None,
    ) -> tuple[VerifiedFile, Upload | None]:
        """The blob from the tier, or from the origin (with what the fleet is owed).

        ``slot_fetch`` downloads a request into the file's download slot and
        ``from_origin`` the file from its origin, each reporting progress to the callback
        it gets. ``slot`` is that download slot: while this host holds the claim its partial
        is published as parts, its download paced to them, and a dead holder's parts seed it
        (``tier_parts``). What this costs, and the upload owed, counts in ``counters`` too.
        """
        with _for_job(counters):
            fetched, upload = await self._obtain(
                label, sha256, size, slot_fetch, from_origin, progress, slot
            )
        if upload is not None:
            upload.counters = counters
        return fetched, upload

    async def _obtain(
        self,
        label: str,
        sha256: str,
        size: int,
        slot_fetch: Callable[[BlobRequest, Progress], Awaitable[VerifiedFile]],
        from_origin: FromOrigin,
        progress: Progress,
        slot: Slot | None,
    ) -> tuple[VerifiedFile, Upload | None]:
        stale: str | None = None  # the ETag of a claim we saw die
        for _ in range(_MAX_ROUNDS):
            if not self._usable():
                break
            head = await self._quietly("read", self._head(sha256))
            if head is _FAILED:
                break
            if isinstance(head, ObjectInfo):
                fetched = await self._read(label, sha256, size, head, slot_fetch, progress)
                if isinstance(fetched, VerifiedFile):
                    return fetched, None
                if fetched == "failed":
                    break
                # corrupt: deleted; whoever claims next brings the origin's bytes
            if self._read_only:
                break
            claim = await self._claim_politely(sha256, size, stale)
            if claim is _FAILED:
                break
            if isinstance(claim, _Claim):
                try:
                    # The previous holder may have uploaded and released between our HEAD
                    # and our claim: look again before fetching from the origin.
                    if isinstance(await self._quietly("read", self._head(sha256)), ObjectInfo):
                        await self._release(Upload(sha256, size, claim))
                        continue
                    return await self._fetch_for_fleet(claim, from_origin, progress, slot)
                finally:
                    self._held -= 1
            for n in self._counting():
                n.claims_waited += 1
            outcome, stale = await self._wait(sha256, size, progress)
            if outcome == "stalled":
                for n in self._counting():
                    n.stalled_fallbacks += 1
                break
            if outcome == "failed":
                break
            # "ready" (read it), "dead" or "released" (claim it): round again
        fetched = await from_origin(progress, None, False)
        owed = self._usable() and not self._read_only and fetched.sha256 == sha256
        return fetched, Upload(sha256, size, None) if owed else None

    def _usable(self) -> bool:
        return not self._disabled and self._clock() >= self._down_until

    def _allowed(self, size: int) -> float:
        """The longest moving ``size`` bytes to or from the tier may take: the slowest a
        waiting host tolerates (``upload_floor``), for many requests or one."""
        return _ANSWER_S + size / self.config.upload_floor

    async def _head(self, sha256: str) -> ObjectInfo | None:
        key = blob_key(self.location.prefix, sha256)
        try:
            return await self._client.head(self.location.bucket, key, checksum=False)
        except EntryNotFoundError:
            return None

    async def _read(
        self,
        label: str,
        sha256: str,
        size: int,
        head: ObjectInfo,
        slot_fetch: Callable[[BlobRequest, Progress], Awaitable[VerifiedFile]],
        progress: Progress,
    ) -> VerifiedFile | Literal["corrupt", "failed"]:
        key = blob_key(self.location.prefix, sha256)
        if head.size != size:
            await self._discard_corrupt(key, f"{head.size} bytes, expected {size}")
            return "corrupt"
        bucket, client = self.location.bucket, self._client
        known = [head]  # the HEAD just made serves the first locate

        async def locate() -> Located:
            info = known.pop() if known else await client.head(bucket, key, checksum=False)
            url, headers = await client.presign_get(bucket, key)
            return Located(url, headers, info.size, info.etag, linked_etag=None, commit=None)

        request = BlobRequest(
            url=f"s3://{bucket}/{key}",
            headers={},
            label=f"{label} (tier)",
            size=size,
            sha256=sha256,
            locator=locate,
            validator="If-Match",
            verify_attempts=1,  # one mismatch means a corrupt object, not a flaky link
            connections=client.config.connections_per_file,
            chunk_size=client.config.chunk_size,
        )
        within = self._allowed(size)
        try:  # a failed fetch takes its bytes back off the progress it reported
            async with asyncio.timeout(within):  # not the origin's retries of a stalled read
                fetched = await slot_fetch(request, progress)
        except TimeoutError:
            self._failed("read", TransferError(f"a tier read took over {within:.0f} s"))
            return "failed"
        except IntegrityError:
            await self._discard_corrupt(key, "its bytes do not hash to its name")
            return "corrupt"
        except ShardsyncError as exc:
            self._failed("read", exc)
            return "failed"
        for n in self._counting():
            n.hits += 1
            n.bytes_from_tier += fetched.downloaded
        return dataclasses.replace(fetched, etag=None, source="tier")

    async def _discard_corrupt(self, key: str, why: str) -> None:
        for n in self._counting():
            n.corrupt_objects += 1
        log.warning(
            "tier object s3://%s/%s is corrupt (%s): deleting it", self.location.bucket, key, why
        )
        await self._quietly("delete", self._client.delete(self.location.bucket, key))

    async def _fetch_for_fleet(
        self,
        claim: _Claim,
        from_origin: FromOrigin,
        progress: Progress,
        slot: Slot | None,
    ) -> tuple[VerifiedFile, Upload]:
        """We hold the claim: resume from what a dead holder left in parts, download the rest
        from the origin while renewing the claim with our progress and publishing our parts."""
        for n in self._counting():
            n.claims_won += 1
            n.misses += 1
        seeded, publisher, lead = 0, None, None  # lead: our download held within reach

        def counted(n: int) -> None:
            claim.done += n
            progress(n)

        upload = Upload(claim.sha256, claim.size, claim, self._spawn(self._renew(claim)))
        try:  # from here on any way out lets go of the claim, or it is renewed for ever
            if slot is not None and self.config.part_size:
                there = await self._seed(claim, slot)
                seeded = there.total()
                lead = Lead.of_parts(self.config.part_size)
                publisher = self._spawn(self._publish(claim, slot, there, lead))
            try:  # a mismatch after seeding is the parts' (see ``IntoSlot``): at once
                fetched = await from_origin(counted, lead, seeded > 0)
            except IntegrityError:
                if not seeded:
                    raise
                await self._discard_parts(claim.sha256)  # the download was abandoned: afresh
                seeded = 0
                if publisher is not None and slot is not None:  # those parts are gone now
                    publisher.cancel()
                    lead = Lead.of_parts(self.config.part_size)
                    publisher = self._spawn(self._publish(claim, slot, RangeSet(), lead))
                fetched = await from_origin(counted, lead, False)
        except BaseException:
            await self._release(upload)
            raise
        finally:
            if publisher is not None:
                publisher.cancel()
        for n in self._counting():
            n.bytes_from_parts += min(seeded, fetched.resumed)
        if fetched.sha256 != claim.sha256:  # an origin without a hash of its own: not ours
            await self._release(upload)
            return fetched, Upload(claim.sha256, claim.size, None, None)
        return fetched, upload

    async def _seed(self, claim: _Claim, slot: Slot) -> RangeSet:
        """What a dead holder left, in our partial: the tier's failure costs a warning and
        what was not seeded yet; the disk's is the job's own error."""
        allowed = self._allowed(claim.size)
        try:
            async with asyncio.timeout(allowed):
                seeded = await seed_from_parts(
                    self._client, self.location, claim.sha256, claim.size, slot
                )
        except CacheError:
            raise
        except TimeoutError:
            self._failed("read", TransferError(f"the tier's parts took over {allowed:.0f} s"))
            return RangeSet()
        except ShardsyncError as exc:
            self._failed("read", exc)
            return RangeSet()
        if seeded.total():
            log.info("%s: resumed from %d bytes of parts", claim.sha256[:12], seeded.total())
        return seeded

    async def _publish(self, claim: _Claim, slot: Slot, there: RangeSet, lead: Lead) -> None:
        """Our parts as they land, all but what the tier holds (``there``), paced by ``lead``."""

        def downloading() -> bool:
            return claim.phase == "download" and not claim.lost and self._usable()

        await publish_parts(
            self._client,
            self.location,
            claim.sha256,
            claim.size,
            self.config.part_size,
            slot,
            downloading,
            there=there,
            lead=lead,
        )

    async def _discard_parts(self, sha256: str) -> None:
        for n in self._counting():
            n.corrupt_objects += 1
        log.warning("the tier's parts of %s do not hash to its name: deleted", sha256[:12])
        await self._quietly("delete", delete_parts(self._client, self.location, sha256))

    # ------------------------------------------------------------------ claims

    def _claim_body(self, claim: _Claim) -> bytes:
        return claim_body(
            self._host, claim.token, claim.size, claim.done, claim.phase, self.config.claim_lease
        )

    async def _claim_politely(self, sha256: str, size: int, stale: str | None) -> Any:
        """A claim (or None, or ``_FAILED``), one attempt at a time: one that would make a
        second blob held waits ``claim_courtesy`` first, so that hosts holding none win it."""
        courtesy = self.config.claim_courtesy
        async with self._claiming:
            if stale is not None or not self._held or not courtesy:
                return await self._claim_counted(sha256, size, stale)
        await asyncio.sleep(courtesy)
        async with self._claiming:
            return await self._claim_counted(sha256, size, stale)

    async def _claim_counted(self, sha256: str, size: int, stale: str | None) -> Any:
        if not self._usable():  # it died while this attempt queued: do not wait on it again
            return _FAILED
        claim = await self._quietly("claim", self._claim(sha256, size, stale))
        if isinstance(claim, _Claim):
            self._held += 1
        return claim

    async def _claim(self, sha256: str, size: int, stale: str | None = None) -> _Claim | None:
        """Win the claim (``If-None-Match: *``), take over a dead one (expired by its own
        stamp, or the very version ``stale`` we watched go unrenewed), or None: someone
        else is fetching it."""
        bucket, key = self.location.bucket, claim_key(self.location.prefix, sha256)
        claim = _Claim(sha256=sha256, size=size, etag="", token=secrets.token_hex(8))
        try:
            claim.etag = await self._client.put_bytes(
                bucket, key, self._claim_body(claim), if_none_match=True
            )
            return claim
        except PreconditionFailed:
            pass
        existing = await self._read_claim(sha256)
        if existing is None:
            return None  # released just now: the blob is probably there; round again
        body, etag = existing
        if etag != stale and not expired(body, time.time()):
            return None
        return await self._take_over(claim, etag)

    async def _read_claim(self, sha256: str) -> tuple[bytes, str] | None:
        key = claim_key(self.location.prefix, sha256)
        try:
            return await self._client.get_small(self.location.bucket, key, max_size=MAX_CLAIM)
        except EntryNotFoundError:
            return None

    async def _take_over(self, claim: _Claim, stale_etag: str) -> _Claim | None:
        bucket, key = self.location.bucket, claim_key(self.location.prefix, claim.sha256)
        try:
            claim.etag = await self._client.put_bytes(
                bucket, key, self._claim_body(claim), if_match=stale_etag
            )
        except (PreconditionFailed, EntryNotFoundError):
            return None  # another waiter took it over first
        for n in self._counting():
            n.claims_taken_over += 1
        log.info("took over the stale tier claim on %s", claim.sha256[:12])
        return claim

    async def _renew(self, claim: _Claim) -> None:
        """Renew every fifth of the lease, with our progress, until cancelled or lost: four
        renewals may be late or fail before a waiter takes the claim for dead."""
        bucket, key = self.location.bucket, claim_key(self.location.prefix, claim.sha256)
        while not claim.lost:
            await asyncio.sleep(self.config.claim_lease / _RENEWALS_PER_LEASE)
            try:
                async with asyncio.timeout(_ANSWER_S):  # a hung tier: the claim dies by its lease
                    claim.etag = await self._client.put_bytes(
                        bucket, key, self._claim_body(claim), if_match=claim.etag
                    )
            except (PreconditionFailed, EntryNotFoundError):
                claim.lost = True  # taken over (we were too slow to renew): not ours anymore
            except TimeoutError:
                self._failed("claim", TransferError(f"a claim renewal took over {_ANSWER_S} s"))
            except ShardsyncError as exc:
                self._failed("claim", exc)

    async def _release(self, upload: Upload) -> None:
        if upload.renewal is not None:
            upload.renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await upload.renewal
        claim = upload.claim
        if claim is not None and not claim.lost:
            if not self._usable():
                return  # down: the claim dies by its lease, no request waits on it
            key = claim_key(self.location.prefix, claim.sha256)
            await self._quietly("claim", self._client.delete(self.location.bucket, key))

    async def _wait(
        self, sha256: str, size: int, progress: Progress
    ) -> tuple[Literal["ready", "dead", "released", "stalled", "failed"], str | None]:
        """Until the blob is in the tier, or the claim dies (then with its last ETag), goes
        away or stalls."""
        cfg = self.config
        watch = Watch(size, cfg.claim_lease, cfg.claim_stall, cfg.upload_floor, self._clock())
        shown = 0
        delay = _POLL_FIRST
        try:
            while True:
                head = await self._quietly("read", self._head(sha256))
                if head is _FAILED:
                    return "failed", None
                if isinstance(head, ObjectInfo):
                    return "ready", None
                answer = await self._quietly("claim", self._read_claim(sha256))
                if answer is _FAILED:
                    return "failed", None
                if answer is None:
                    return "released", None
                body, etag = answer
                seen = watch.look(body, etag, self._clock())
                if isinstance(seen, str):  # dead (taken over from its last ETag) or stalled
                    return seen, etag if seen == "dead" else None
                if seen > shown:
                    progress(seen - shown)
                    shown = seen
                await asyncio.sleep(delay)  # another host's pace: wall time
                delay = min(delay * 1.5, _POLL_MAX, cfg.claim_lease / 4)
        finally:
            progress(-shown)  # what we read next counts its own bytes

    # ------------------------------------------------------------------ uploads

    def upload_soon(self, upload: Upload, blob: Path) -> asyncio.Task[None]:
        """Upload a published blob in the background, then release its claim; it counts for
        the job it is owed for. The task ends once the upload did or was given up."""
        with _for_job(upload.counters):
            return self._spawn(self._upload(upload, blob))

    async def abandon(self, upload: Upload) -> None:
        """The blob will not be published after all: release its claim at once."""
        with _for_job(upload.counters):
            await self._release(upload)

    async def _upload(self, upload: Upload, blob: Path) -> None:
        if upload.claim is not None:
            upload.claim.phase = "upload"
        key = blob_key(self.location.prefix, upload.sha256)
        try:
            if not self._usable() and (upload.claim is None or upload.claim.lost):
                return  # down; but a claim its renewals keep is a promise to its waiters
            done = await self._quietly(
                "write",
                self._client.put_file(
                    self.location.bucket, key, blob, sha256=upload.sha256, size=upload.size
                ),
                within=self._allowed(upload.size),
            )
            if done is not _FAILED:
                for n in self._counting():
                    n.uploads += 1
                    n.bytes_uploaded += upload.size
                await self._tidy(delete_parts(self._client, self.location, upload.sha256))
        finally:
            await self._release(upload)

    # ------------------------------------------------------------------ plumbing

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        if self._tasks is None:
            raise RuntimeError("use the tier as 'async with Tier(...) as tier'")

        async def guarded() -> None:
            try:
                await coro
            except ShardsyncError as exc:  # a background task never fails the jobs
                self._failed("write", exc)
            except Exception:  # nor ends the tier's task group, and the engine's task with it
                log.exception("a tier task failed unexpectedly; the jobs go on without it")

        task = self._tasks.create_task(guarded())
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        return task

    async def _tidy(self, op: Awaitable[None]) -> None:
        """Best-effort housekeeping (the parts of a blob that is in the tier now): a slow or
        failed one is counted, never warned about nor taken for a dead tier (the lifecycle
        rule on ``parts/`` collects what is left)."""
        try:
            async with asyncio.timeout(_ANSWER_S):
                await op
        except (ShardsyncError, TimeoutError) as exc:
            for n in self._counting():
                n.errors += 1
            log.info("tier housekeeping failed (%s); the lifecycle rule collects it", exc)

    async def _quietly(self, doing: str, op: Awaitable[Any], within: float = _ANSWER_S) -> Any:
        """Run one tier request; a failure is counted and warned about, never raised. It
        must end ``within`` (an upload: at ``upload_floor``): a tier that accepts connections
        and then says nothing (a hung gateway) is taken for down, not waited on per file."""
        try:
            async with asyncio.timeout(within):
                return await op
        except TimeoutError:
            silent = TransferError(f"the tier did not answer a {doing} within {within:.0f} s")
            self._failed(doing, silent)
            return _FAILED
        except ShardsyncError as exc:
            self._failed(doing, exc)
            return _FAILED

    def _failed(self, doing: str, exc: ShardsyncError) -> None:
        for n in self._counting():
            n.errors += 1
        if isinstance(exc, TransferError):  # down or unreachable: do not wait on it per file
            self._down_until = self._clock() + _COOLDOWN
        if isinstance(exc, AuthError):
            writing = doing in ("claim", "write", "delete")  # a read-only identity reads on
            if writing and not self._read_only:
                self._read_only = True
                log.warning("tier %s refuses our writes; reading only: %s", self.location.url, exc)
            elif not writing and not self._disabled:
                self._disabled = True
                log.warning("tier %s refuses our credentials; off: %s", self.location.url, exc)
            return
        # one warning per way of failing; a tier that cannot be reached is one way, whatever
        # was asked of it (reads, claims, writes all fail as it dies)
        kind = "down" if isinstance(exc, TransferError) else f"{doing}:{type(exc).__name__}"
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("tier %s failed (%s); going on from the origin", doing, exc)


class _Failed:
    def __repr__(self) -> str:
        return "<tier request failed>"


_FAILED: Any = _Failed()
