"""Jobs over one engine: dedup across clients, priority order, an event log per job.

The daemon runs one ``Scheduler`` on its one ``Engine``; the client's in-process fallback runs
another, so both produce the same jobs and the same events. What it adds to the engine:

* **one job per snapshot**: requests for the same (origin, repo, revision, selection) attach
  to the job already running; a job whose revision turns out to name a commit another job is
  already downloading follows that job instead of downloading it again;
* **priority**: every file of every job passes one ``PriorityGate`` of ``max_files`` slots,
  highest job priority first, then submission order, then the file's place in the index;
* **events**: each job appends what happens, as the typed events of ``shardsync.events``, to
  an ``EventLog`` that replays to late subscribers and then goes live; the job's counters
  and its state (moved only through ``events.transition``) follow from what it logs;
* **a journal**: unfinished jobs are written to disk on every change, so a daemon restarted
  after ``kill -9`` resumes them from their partial files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from shardsync.api import JobRequest, error_code, error_info, result_to_json
from shardsync.engine_api import EngineJob, FileGate, Room, Runner
from shardsync.errors import (
    ConfigError,
    DaemonStoppingError,
    JobCancelledError,
    ShardsyncError,
)
from shardsync.events import (
    FINISHED,
    JOB_STATES,
    ErrorInfo,
    FileFailed,
    FileStarted,
    JobDone,
    JobEvent,
    JobFailed,
    JobState,
    Progress,
    Pruning,
    Resolved,
    ResolvedFile,
    transition,
)
from shardsync.job_log import EventLog, JobCounters
from shardsync.journal import Journal
from shardsync.limits import Histogram, PriorityGate
from shardsync.manifest import Listing, Manifest, ManifestEntry
from shardsync.origins.base import Http, Origin
from shardsync.records import FileOutcome, PrefetchResult, RepoRef

__all__ = ["Scheduler", "SchedulerStatistics", "Selection", "Selections", "SharedJob"]

log = logging.getLogger("shardsync.scheduler")


class Selection(Protocol):
    """A job's own files in place of the weights index (one rank's part of a training
    checkpoint: ``checkpoint_selection.CheckpointSelection``), and what its result says."""

    async def select(self, listing: Listing) -> Manifest:
        """The files to download, from the origin's listing (``Job.prepare``'s hook)."""

    def result_json(self, result: PrefetchResult) -> dict[str, Any]:
        """The finished job's ``job_done`` result."""


Selections = Callable[[JobRequest, Origin, Http], Selection | None]
"""Gives a request its ``Selection`` (None: the weights its index names)."""

_PROGRESS_INTERVAL = 0.2  # seconds between progress events of one file


# ------------------------------------------------------------------------------ jobs


@dataclass(eq=False, slots=True)
class SharedJob:
    """One snapshot being made complete for any number of clients: the scheduler's job.

    (The engine's ``prefetch.Job`` does the work of one run; the client's ``JobHandle`` is a
    caller's view of this one, over the daemon's API or in-process.)
    """

    id: str
    seq: int
    request: JobRequest
    origin: Origin
    revision: str
    priority: int
    submitted_at: float
    events: EventLog = field(init=False)
    counters: JobCounters = field(default_factory=JobCounters)
    state: JobState = "pending"
    commit: str | None = None
    clients: int = 1
    started_at: float | None = None
    finished_at: float | None = None
    merged_into: str | None = None
    result: PrefetchResult | None = None
    error: ErrorInfo | None = None
    task: asyncio.Task[None] | None = None
    stop_error: ShardsyncError | None = None  # why we cancelled the task ourselves
    selection: Selection | None = None  # the job's own files, in place of the index
    engine_job: EngineJob | None = None  # the engine's run of it, once it started
    in_order: bool = False  # a client streams it: shards in their turn (``prefetch.Job``)

    def __post_init__(self) -> None:
        self.events = EventLog(self.id)

    def stream_in_order(self) -> None:
        """A client reads the shards in index order: the next file started obeys it."""
        self.in_order = True
        if self.engine_job is not None:
            self.engine_job.in_order = True

    @property
    def repo(self) -> RepoRef:
        return self.origin.repo

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def tier_final(self) -> bool:
        """Whether the job's tier counters can change no more: it finished, and the uploads
        it owes the fleet (running after its snapshot is complete) ended or were given up."""
        return self.finished and (self.engine_job is None or not self.engine_job.uploading)

    def move_to(self, state: JobState) -> None:
        """Change state through the one table of allowed moves (``events.TRANSITIONS``)."""
        self.state = transition(self.state, state)

    def emit(self, event: JobEvent) -> None:
        """Log an event; the counters follow from what is logged, nowhere else."""
        if not self.counters.repeats(event):
            self.counters.observe(self.events.append(event))

    def info(self) -> dict[str, Any]:
        """The job as ``GET /v1/jobs/{id}`` shows it: its own tier counters too, not the
        engine's (which serves every job at once)."""
        tier = None if self.engine_job is None else self.engine_job.tier_statistics()
        return {
            "id": self.id,
            "source": self.request.source,
            "origin": self.repo.kind,
            "repo": self.repo.name,
            "revision": self.revision,
            "commit": self.commit,
            "state": self.state,
            "priority": self.priority,
            "include": None if self.request.include is None else list(self.request.include),
            "exclude": list(self.request.exclude),
            "allow_pickle": self.request.allow_pickle,
            "in_order": self.in_order,
            **(
                {
                    "checkpoint": self.request.checkpoint,
                    "rank": self.request.rank,
                    "world_size": self.request.world_size,
                }
                if self.request.checkpoint is not None
                else {}
            ),
            "clients": self.clients,
            "submitted_at": self.submitted_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "merged_into": self.merged_into,
            "files": {"total": self.counters.files_total, "verified": self.counters.files_verified},
            "bytes": {
                "total": self.counters.bytes_total,
                "done": self.counters.bytes_done,
                "downloaded": self.counters.bytes_downloaded,
            },
            "snapshot_path": str(self.result.snapshot_path) if self.result else None,
            "error": None if self.error is None else self.error.to_json(),
            "events": len(self.events),
            "tier": None if tier is None else asdict(tier),
            "tier_final": self.tier_final,
        }

    def journal_record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "seq": self.seq,
            "priority": self.priority,
            "submitted_at": self.submitted_at,
            "request": self.request.to_json(),
        }


class _JobSink:
    """The engine's ``ProgressSink`` for one job: turns its calls into the job's events."""

    def __init__(self, job: SharedJob, engine_job: EngineJob | None = None) -> None:
        self._job = job
        self.engine_job = engine_job
        self._sizes: dict[str, int | None] = {}
        self._done: Counter[str] = Counter()
        self._last: dict[str, float] = {}
        self._shard_index: dict[str, int] = {}

    def resolved(self, manifest: Manifest) -> None:
        self._shard_index = {e.path: i for i, e in enumerate(manifest.shards)}

    def shard_index(self, path: str) -> int | None:
        return self._shard_index.get(path)

    def add_file(self, path: str, size: int | None) -> None:
        self._sizes[path] = size
        if self._job.state == "resolving":  # the index, fetched while the job resolves
            self._job.emit(FileStarted(path=path, size=size, shard_index=None))

    def advance(self, path: str, nbytes: int) -> None:
        if not nbytes:
            return  # the engine reports a fresh start as 0 bytes resumed: nothing moved
        self._done[path] += nbytes
        now = time.monotonic()
        if now - self._last.get(path, 0.0) >= _PROGRESS_INTERVAL:
            self._last[path] = now
            self._job.emit(Progress(path=path, done=self._done[path], size=self._sizes.get(path)))

    def file_done(self, outcome: FileOutcome) -> None:
        assert self.engine_job is not None
        self._job.emit(self.engine_job.verified(outcome, self.shard_index(outcome.path)))


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """Counts of jobs by state, for ``/v1/status`` and ``/metrics``."""

    jobs: Mapping[str, int]
    files_waiting: int
    jobs_submitted: int
    jobs_deduplicated: int


_LATENCY_BUCKETS = (1, 5, 15, 60, 300, 900, 1800, 3600, 3 * 3600, 12 * 3600)


class Scheduler:
    """Runs jobs on one engine; use as ``async with Scheduler(engine, selections=..., room=...)``.

    ``selections`` gives each request its own choice of files, if it has one
    (``checkpoint_selection.selection_for``); the scheduler never asks what kind of job it runs.
    ``room`` makes disk space before a download and prunes past the high-water mark after
    one (``prune.CacheRoom``).

    Every job task lives in the scheduler's task group. Leaving the block stops the jobs
    still running (their partial files are kept and, with a journal, they resume next time).
    """

    def __init__(
        self,
        engine: Runner,
        *,
        selections: Selections,
        room: Room,
        journal: Journal | None = None,
        history: int = 100,
        allow_local: bool = True,
        on_change: Callable[[], object] | None = None,
    ) -> None:
        self.engine = engine
        self._selections = selections
        self._room = room
        self._on_change = on_change
        self.gate = PriorityGate(engine.config.max_files)
        self.latency = Histogram(_LATENCY_BUCKETS)
        self.history = history
        self._journal = journal
        self._allow_local = allow_local
        self._jobs: dict[str, SharedJob] = {}
        self._by_request: dict[tuple[object, ...], SharedJob] = {}
        self._by_commit: dict[tuple[object, ...], SharedJob] = {}
        self._seq = 0
        self._submitted = 0
        self._deduplicated = 0
        self._stopping: ShardsyncError | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._journal_lock = asyncio.Lock()

    async def __aenter__(self) -> Scheduler:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._stopping is None:
            self.stop(DaemonStoppingError("the scheduler was closed"))
        tg, self._tg = self._tg, None
        if tg is not None:  # the jobs are stopped; an error of the block propagates as is
            await tg.__aexit__(None, None, None)

    # -- queries ------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping is not None

    def get(self, job_id: str) -> SharedJob | None:
        return self._jobs.get(job_id)

    def jobs(self) -> list[SharedJob]:
        """Unfinished jobs in scheduling order, then finished ones, newest first."""
        active = sorted((j for j in self._jobs.values() if not j.finished), key=_order)
        done = sorted(
            (j for j in self._jobs.values() if j.finished), key=lambda j: -(j.finished_at or 0)
        )
        return active + done

    def statistics(self) -> SchedulerStatistics:
        states = Counter(j.state for j in self._jobs.values())
        return SchedulerStatistics(
            jobs={s: states.get(s, 0) for s in JOB_STATES},
            files_waiting=self.gate.waiting,
            jobs_submitted=self._submitted,
            jobs_deduplicated=self._deduplicated,
        )

    # -- commands -----------------------------------------------------------------------

    async def submit(self, request: JobRequest) -> tuple[SharedJob, bool]:
        """The job for ``request``: an unfinished one that covers it, else a new one.

        Returns (job, created). Raises ``ConfigError`` for a source that cannot be used and
        ``DaemonStoppingError`` once the scheduler is stopping.
        """
        if self._stopping is not None:
            raise DaemonStoppingError(str(self._stopping))
        origin = self.engine.origin(request.source)
        if origin.caller_only and not self._allow_local:
            raise ConfigError(
                "the daemon does not read local directories on a client's behalf; "
                "prefetch them in-process (shardsync prefetch --no-daemon)"
            )
        revision = request.revision or origin.default_revision
        self._submitted += 1
        existing = self._by_request.get(_request_key(origin, revision, request))
        if existing is not None:
            self._deduplicated += 1
            existing.clients += 1
            if request.in_order:
                self._follow_chain(existing, SharedJob.stream_in_order)
            if self._raise_priority(existing, request.priority):
                await self._save_journal()
            return existing, False
        job = self._new_job(request, origin, revision)
        await self._save_journal()
        return job, True

    async def restore(self) -> int:
        """Resubmit the journal's unfinished jobs under their ids; returns how many."""
        if self._journal is None:
            return 0
        restored = 0
        for record in await self._journal.load():
            try:
                request = JobRequest.from_json(record["request"])
                origin = self.engine.origin(request.source)
                job = self._new_job(
                    request,
                    origin,
                    request.revision or origin.default_revision,
                    job_id=str(record["id"]),
                    priority=int(record["priority"]),
                    submitted_at=float(record["submitted_at"]),
                )
            except (ShardsyncError, KeyError, TypeError, ValueError, OverflowError) as exc:
                log.warning("dropping journaled job %r: %s", record.get("id"), exc)
                continue
            log.info("resuming job %s (%s@%s)", job.id, job.repo.name, job.revision)
            restored += 1
        await self._save_journal()
        return restored

    async def cancel(self, job_id: str) -> SharedJob | None:
        """Cancel a job for every client waiting on it; its partial files are kept."""
        job = self._jobs.get(job_id)
        if job is None or job.finished:
            return job
        error = JobCancelledError(f"job {job.id} was cancelled")
        if job.state == "interrupted":  # by a stop: cancelled, the journal must not resume it
            job.move_to("cancelled")
            job.error = error_info(error)
        self._interrupt(job, error)
        if job.task is not None:
            await asyncio.wait({job.task})
        await self._save_journal()
        return job

    def stop(self, error: ShardsyncError) -> None:
        """Refuse new jobs and stop the running ones with ``error`` (kept in the journal)."""
        if self._stopping is None:
            self._stopping = error
        for job in list(self._jobs.values()):
            if not job.finished:
                self._interrupt(job, error)

    # -- internals ----------------------------------------------------------------------

    def _new_job(
        self,
        request: JobRequest,
        origin: Origin,
        revision: str,
        *,
        job_id: str | None = None,
        priority: int | None = None,
        submitted_at: float | None = None,
    ) -> SharedJob:
        if self._tg is None:
            raise RuntimeError("use the scheduler as 'async with Scheduler(...)'")
        self._seq += 1
        job = SharedJob(
            id=job_id or secrets.token_hex(8),
            seq=self._seq,
            request=request,
            origin=origin,
            revision=revision,
            priority=request.priority if priority is None else priority,
            submitted_at=time.time() if submitted_at is None else submitted_at,
            in_order=request.in_order,
        )
        self._jobs[job.id] = job
        self._by_request[_request_key(origin, revision, request)] = job
        job.task = self._tg.create_task(self._run(job), name=f"shardsync-job-{job.id}")
        self._forget_old()
        self._changed()
        return job

    def _follow_chain(self, job: SharedJob, change: Callable[[SharedJob], None]) -> None:
        """``change`` the job and every job it follows (whose download it waits on)."""
        current: SharedJob | None = job
        while current is not None:
            change(current)
            current = self._jobs.get(current.merged_into) if current.merged_into else None

    def _raise_priority(self, job: SharedJob, priority: int) -> bool:
        """A client asking with a higher priority raises it for the job (and the job it
        follows); returns whether anything changed."""
        changed = False
        current: SharedJob | None = job
        while current is not None and priority > current.priority:
            current.priority = priority
            changed = True
            current = self._jobs.get(current.merged_into) if current.merged_into else None
        return changed

    def _interrupt(self, job: SharedJob, error: ShardsyncError) -> None:
        if job.stop_error is None or isinstance(error, JobCancelledError):
            job.stop_error = error  # a cancel overrules a stop: the job must not resume
        self._release(job)  # a request from now on starts a job, not one ending
        if job.state == "pending":  # its task has not run yet, so it cannot answer itself
            self._finish_failed(job, _stopped_state(error), error_info(error))
        if job.task is not None:
            job.task.cancel()

    async def _run(self, job: SharedJob) -> None:
        """The job's task: never raises (a failure belongs to the job, not the daemon)."""
        try:
            await self._execute(job)
        except asyncio.CancelledError:
            error = job.stop_error or DaemonStoppingError("the daemon is stopping")
            self._finish_failed(job, _stopped_state(error), error_info(error))
            if job.stop_error is None:
                raise
        except ShardsyncError as exc:
            self._finish_failed(job, "failed", error_info(exc))
        except Exception as exc:
            log.exception("job %s failed unexpectedly", job.id)
            self._finish_failed(job, "failed", error_info(exc))
        if job.finished or self._stopping is None:
            await self._save_journal()

    async def _execute(self, job: SharedJob) -> None:
        job.move_to("resolving")
        job.started_at = time.time()
        sink = _JobSink(job)
        engine_job = self.engine.job(
            job.origin,
            revision=job.revision,
            allow_pickle=job.request.allow_pickle,
            sink=sink,
            gate=self._gate_for(job, sink),
            in_order=job.in_order,
        )
        sink.engine_job = job.engine_job = engine_job
        job.selection = self._selections(job.request, job.origin, self.engine.fetcher)
        if job.selection is not None:
            manifest = await engine_job.prepare(select=job.selection.select)
        else:
            manifest = await engine_job.prepare(job.request.include, job.request.exclude)
        sink.resolved(manifest)
        job.commit = engine_job.commit or None
        job.emit(
            Resolved(
                commit=job.commit,
                revision=job.revision,
                total_size=manifest.total_size,
                files=tuple(
                    ResolvedFile(e.path, e.size, e.role, sink.shard_index(e.path))
                    for e in manifest.entries
                ),
            )
        )
        if engine_job.commit:
            key = _commit_key(job, engine_job.commit)
            other = self._by_commit.get(key)
            if other is not None and not other.finished:
                if job.in_order:
                    self._follow_chain(other, SharedJob.stream_in_order)
                if await self._follow(job, other):
                    return
            self._by_commit[key] = job  # its own download (the one it followed was cancelled)
        await self._make_room(job, manifest)
        if job.state != "downloading":
            job.move_to("downloading")
        files = await engine_job.download()
        now = time.time()
        job.result = engine_job.result(files, now - (job.started_at or now), counters=False)
        try:
            await self._room.tidy(job.repo.name)
        except ShardsyncError as exc:  # the job is done; a failed prune is the cache's problem
            log.warning("auto-prune after job %s failed: %s", job.id, exc)
        self._finish_done(job)

    async def _make_room(self, job: SharedJob, manifest: Manifest) -> None:
        """Before a download: room for it (the job's own repo kept), or the job fails with
        ``DiskFullError`` before it fills the disk halfway."""

        def short(needed: int, free: int) -> None:
            job.emit(Pruning(needed=needed, free=free))

        await self._room.make(manifest.entries, job.repo.name, short)

    async def _follow(self, job: SharedJob, other: SharedJob) -> bool:
        """Mirror the job already downloading this commit instead of downloading it again;
        whether that ended ``job`` (False: ``other`` was cancelled, by its own clients, and
        ``job``, which was not, downloads on its own)."""
        log.info("job %s follows job %s (same commit %s)", job.id, other.id, job.commit)
        job.merged_into = other.id
        job.move_to("downloading")
        lent = job.clients  # the follower's clients wait on the other's download meanwhile
        other.clients += lent
        self._raise_priority(other, job.priority)
        try:
            async for event in other.events.follow():
                match event:
                    case JobDone():
                        job.selection = other.selection
                        if job.engine_job is not None:
                            await job.engine_job.adopt()
                        if other.result is not None:  # the snapshot's, at this job's revision
                            job.result = replace(other.result, revision=job.revision)
                        self._finish_done(job)
                        return True
                    case JobFailed(error=error):
                        if error.code != error_code(JobCancelledError()):
                            self._finish_failed(job, "failed", error)
                            return True
                        break
                    case Resolved():
                        pass  # the follower logged its own
                    case _:
                        job.emit(event)  # stamped anew by the follower's log
        finally:
            other.clients -= lent
        log.info("job %s was cancelled; job %s goes on alone", other.id, job.id)
        job.merged_into = None
        return False

    def _gate_for(self, job: SharedJob, sink: _JobSink) -> FileGate:
        gate = self.gate

        @contextlib.asynccontextmanager
        async def admit(entry: ManifestEntry, position: int) -> AsyncIterator[None]:
            # a small file takes no slot: it costs round trips, not bandwidth
            slot = contextlib.nullcontext() if entry.small else None
            async with slot or gate.admit(lambda: (-job.priority, job.seq, position)):
                index = sink.shard_index(entry.path)
                job.emit(FileStarted(path=entry.path, size=entry.size, shard_index=index))
                try:
                    yield
                except Exception as exc:
                    job.emit(FileFailed(path=entry.path, shard_index=index, error=error_info(exc)))
                    raise

        def gate_fn(entry: ManifestEntry, position: int) -> AbstractAsyncContextManager[None]:
            return admit(entry, position)

        return gate_fn

    def _finish_done(self, job: SharedJob) -> None:
        assert job.result is not None
        job.move_to("done")
        job.commit = job.result.commit
        job.finished_at = time.time()
        self._release(job)
        self.latency.observe(job.finished_at - job.submitted_at)
        selection = job.selection
        result = selection.result_json(job.result) if selection else result_to_json(job.result)
        job.emit(JobDone(result=result))

    def _finish_failed(self, job: SharedJob, state: JobState, error: ErrorInfo) -> None:
        """End a job with an error (``interrupted``: it resumes from the journal)."""
        job.move_to(state)
        job.error = error
        job.finished_at = time.time()
        self._release(job)
        job.emit(JobFailed(error=error))

    def _changed(self) -> None:
        """A job started or ended (the daemon updates its systemd STATUS= line)."""
        if self._on_change is not None:
            self._on_change()

    def _release(self, job: SharedJob) -> None:
        self._changed()
        for index in (self._by_request, self._by_commit):
            for key, value in list(index.items()):
                if value is job:
                    del index[key]

    def _forget_old(self) -> None:
        """Past ``history`` finished jobs, the oldest go; not while their uploads run (a
        client may be waiting for their final tier counters)."""
        finished = [j for j in self._jobs.values() if j.tier_final]
        if len(finished) > self.history:
            finished.sort(key=lambda j: j.finished_at or 0)
            for job in finished[: len(finished) - self.history]:
                del self._jobs[job.id]

    async def _save_journal(self) -> None:
        if self._journal is None:
            return
        async with self._journal_lock:
            records = [j.journal_record() for j in self._jobs.values() if not j.finished]
            try:
                await self._journal.save(records)
            except ShardsyncError as exc:
                log.warning("cannot write the job journal: %s", exc)


def _stopped_state(error: ShardsyncError) -> JobState:
    """A job we stopped: cancelled for good, or interrupted (the daemon stops; it resumes)."""
    return "cancelled" if isinstance(error, JobCancelledError) else "interrupted"


def _order(job: SharedJob) -> tuple[int, int]:
    return (-job.priority, job.seq)


def _request_key(origin: Origin, revision: str, request: JobRequest) -> tuple[object, ...]:
    return (
        origin.repo.kind,
        origin.repo.name,
        revision,
        None if request.include is None else tuple(sorted(set(request.include))),
        tuple(sorted(set(request.exclude))),
        request.allow_pickle,
        *((request.checkpoint, request.rank, request.world_size) if request.checkpoint else ()),
    )


def _commit_key(job: SharedJob, commit: str) -> tuple[object, ...]:
    return (*_request_key(job.origin, commit, job.request), "commit")
