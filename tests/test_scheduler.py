"""The scheduler on a real engine and fake hub: dedup, priority, events, cancel, journal."""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_snapshot_matches, fast_config, tmpfs, until

from shardsync import errors
from shardsync.api import (
    JobRequest,
    error_class,
    error_code,
    error_json,
    result_from_json,
    result_to_json,
)
from shardsync.cache import CacheStore
from shardsync.checkpoint_selection import selection_for
from shardsync.config import Config
from shardsync.events import (
    ErrorInfo,
    FileFailed,
    FileStarted,
    JobDone,
    JobEvent,
    JobFailed,
    Progress,
    Pruning,
    Resolved,
    Verified,
)
from shardsync.job_log import EventLog
from shardsync.journal import Journal
from shardsync.limits import Histogram, PriorityGate, TokenBucket
from shardsync.manifest import SMALL_FILE
from shardsync.prefetch import Engine, prefetch
from shardsync.prune import CacheRoom
from shardsync.records import RepoRef
from shardsync.scheduler import Scheduler, SharedJob
from shardsync.store import AsyncStore
from shardsync.testing import Bandwidth, Checkpoint, FakeHub, Status, build_checkpoint

REPO = "acme/tiny"
INDEX = "model.safetensors.index.json"


def scheduled(engine: Engine, **options: Any) -> Scheduler:
    """A scheduler as the daemon and the client build one."""
    room = CacheRoom(engine.store, engine.config.prune)
    return Scheduler(engine, selections=selection_for, room=room, **options)


def _same_bytes(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def _listing(directory: Path) -> list[Path]:
    return list(directory.iterdir())


def _shard_bytes(checkpoint: Checkpoint) -> int:
    return sum(checkpoint.path(s).stat().st_size for s in checkpoint.shards)


async def _outcome(job: SharedJob) -> JobDone | JobFailed:
    """The job's terminal event (replayed if it already happened)."""
    async for event in job.events.follow():
        if isinstance(event, JobDone | JobFailed):
            return event
    raise AssertionError("the event log closed without a terminal event")


async def _done(job: SharedJob) -> JobDone:
    outcome = await _outcome(job)
    assert isinstance(outcome, JobDone), outcome
    return outcome


async def _failed(job: SharedJob) -> JobFailed:
    outcome = await _outcome(job)
    assert isinstance(outcome, JobFailed), outcome
    return outcome


@pytest.fixture
async def scheduler(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> AsyncIterator[Scheduler]:
    fake_hub.add_checkpoint(REPO, checkpoint)
    async with (
        Engine(fast_config(tmp_path / "cache", fake_hub.endpoint)) as engine,
        scheduled(engine) as running,
    ):
        yield running


# ---------------------------------------------------------------------------- pure parts


def test_event_log_stamps_replays_then_follows_and_compacts_progress() -> None:
    async def scenario() -> None:
        log = EventLog("j1", clock=lambda: 7.5)
        log.append(FileStarted(path="a", size=30, shard_index=0))
        for done in (10, 20, 30):
            log.append(Progress(path="a", done=done, size=30))
        # a late subscriber replays the file's current progress, not every step of it
        assert [getattr(e, "done", None) for e in log.past()] == [None, 30]
        assert {(e.job, e.time) for e in log.past()} == {("j1", 7.5)}
        seen: list[str] = []

        async def follow() -> None:
            async for event in log.follow():
                seen.append(event.kind)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(follow())
            await asyncio.sleep(0)
            log.append(FileFailed(path="a", shard_index=0, error=ErrorInfo("transfer", "x")))
            log.append(JobFailed(job="other", seq=99, error=ErrorInfo("transfer", "x")))
        assert seen == ["file_started", "progress", "failed", "job_failed"]
        assert [e.seq for e in log.past()] == [0, 3, 4, 5]
        assert [e.seq async for e in log.follow(since=4)] == [4, 5]
        assert log.past()[-1].job == "j1"  # an event mirrored from another job becomes ours
        with pytest.raises(RuntimeError):
            log.append(Progress(path="a", done=1, size=30))

    asyncio.run(scenario())


def test_the_event_log_of_a_long_download_holds_what_is_live() -> None:
    """A day-long download logs a progress event per step of each file: the log keeps the
    last one per file, not a slot per step, and a late subscriber gets what is live."""
    log = EventLog("j1")
    log.append(FileStarted(path="a", size=1 << 40, shard_index=0))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for done in range(300_000):
            log.append(Progress(path="a", done=done, size=1 << 40))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10, f"{grown} bytes for one file's progress"
    assert len(log) == 300_001
    late = asyncio.run(_first(log.follow(), 2))
    assert [(e.kind, getattr(e, "done", None)) for e in late] == [
        ("file_started", None),
        ("progress", 299_999),
    ]


async def _first(events: AsyncIterator[JobEvent], n: int) -> list[JobEvent]:
    got: list[JobEvent] = []
    async for event in events:
        got.append(event)
        if len(got) == n:
            break
    return got


async def _taken_gate() -> tuple[PriorityGate, AbstractAsyncContextManager[None]]:
    """A gate of one slot, held: waiters queue until the returned hold exits."""
    gate = PriorityGate(1)
    hold = gate.admit(lambda: 0)
    await hold.__aenter__()
    return gate, hold


async def _pass(gate: PriorityGate) -> None:
    async with gate.admit(lambda: 0):
        pass


async def test_priority_gate_hands_slots_to_the_best_waiter() -> None:
    gate, hold = await _taken_gate()
    order: list[str] = []
    priority = {"low": 1, "mid": 2, "high": 3}

    async def worker(name: str) -> None:
        async with gate.admit(lambda: -priority[name]):
            order.append(name)
            await asyncio.sleep(0)

    async with asyncio.TaskGroup() as tg:
        for name in ("low", "mid", "high"):
            tg.create_task(worker(name))
        await asyncio.sleep(0)  # each worker runs up to its wait
        assert gate.waiting == 3
        priority["low"] = 9  # raised while waiting: read when the slot is handed out
        await hold.__aexit__(None, None, None)
    assert order == ["low", "high", "mid"]


async def test_priority_gate_survives_cancelled_waiters() -> None:
    gate, hold = await _taken_gate()
    async with asyncio.TaskGroup() as tg:
        doomed = tg.create_task(_pass(gate))
        await asyncio.sleep(0)
        doomed.cancel()
    await hold.__aexit__(None, None, None)
    async with gate.admit(lambda: 0):  # the slot came back
        assert gate.waiting == 0


async def test_a_waiter_cancelled_as_a_slot_frees_stays_a_cancel() -> None:
    """A slot freed and its waiter's job cancelled in one loop turn (a DELETE, a SIGTERM):
    the wake drops the cancelled waiter, and the cancel is still a cancel, not the
    ``ValueError`` that made the job ``failed`` (``internal``) and left the journal."""
    gate, hold = await _taken_gate()
    doomed = asyncio.create_task(_pass(gate))
    await asyncio.sleep(0)
    assert gate.waiting == 1
    await hold.__aexit__(None, None, None)  # the slot frees: a wake is scheduled
    doomed.cancel()  # in the same turn
    with pytest.raises(asyncio.CancelledError):
        await doomed
    async with gate.admit(lambda: 0):  # the slot came back
        assert gate.waiting == 0


def test_token_bucket_charges_the_rate() -> None:
    now = [0.0]
    paused = 0.0
    bucket = TokenBucket(1_000_000, clock=lambda: now[0])
    for _ in range(40):
        pause = bucket(100_000)
        paused += pause
        now[0] += pause  # the reader waits that long
    # 4 MB at 1 MB/s: 4 s, less the initial burst of 256 KiB
    assert paused == pytest.approx((4_000_000 - 256 * 1024) / 1_000_000)
    bucket.set_rate(0)
    assert bucket(10**9) == 0


def test_histogram_is_cumulative() -> None:
    hist = Histogram([1, 10])
    for value in (0.5, 3, 30):
        hist.observe(value)
    assert hist.cumulative() == [(1, 1), (10, 2)]
    assert (hist.count, hist.sum) == (3, 33.5)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ([], "JSON object"),
        ({}, "missing field 'source'"),
        ({"source": REPO, "bogus": 1}, "unknown field 'bogus'"),
        ({"source": ""}, "source must be a non-empty string"),
        ({"source": 5}, "source must be"),
        ({"source": REPO, "revision": 5}, "revision must be a string"),
        ({"source": REPO, "revision": "../x"}, "invalid revision"),
        ({"source": REPO, "include": "*.json"}, "include must be a list"),
        ({"source": REPO, "exclude": [1]}, "exclude must be a list"),
        ({"source": REPO, "priority": "high"}, "priority must be an integer"),
        ({"source": REPO, "priority": True}, "priority must be an integer"),
        ({"source": REPO, "priority": 10**6}, "priority must be within"),
        ({"source": REPO, "allow_pickle": "yes"}, "allow_pickle must be true or false"),
        ({"source": REPO, "in_order": 1}, "in_order must be true or false"),
        ({"source": "a\0b"}, "source must be"),
    ],
)
def test_job_request_validation_names_the_field(body: object, needle: str) -> None:
    with pytest.raises(errors.ConfigError, match=needle):
        JobRequest.from_json(body)


def test_job_request_round_trips() -> None:
    request = JobRequest(REPO, revision="v1", include=("*.json",), exclude=("a*",), priority=3)
    assert JobRequest.from_json(json.loads(json.dumps(request.to_json()))) == request


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.RepoNotFoundError("x"), "repo_not_found"),
        (errors.ConfigError("x"), "config"),
        (errors.DiskFullError("x"), "disk_full"),
        (errors.DaemonStoppingError("x"), "daemon_stopping"),
        (errors.JobCancelledError("x"), "job_cancelled"),
    ],
)
def test_error_codes_map_back_to_our_exceptions(exc: errors.ShardsyncError, code: str) -> None:
    assert error_code(exc) == code
    assert error_class(code) is type(exc)


def test_unexpected_errors_do_not_leak_details() -> None:
    assert error_json(KeyError("secret")) == {
        "code": "internal",
        "message": "internal error (KeyError); see the log",
    }


# ---------------------------------------------------------------------------- with a hub


async def test_same_request_joins_the_running_job(
    scheduler: Scheduler, fake_hub: FakeHub, checkpoint: Checkpoint
) -> None:
    first, created = await scheduler.submit(JobRequest(REPO))
    second, again = await scheduler.submit(JobRequest(REPO, priority=7))
    assert (created, again) == (True, False)
    assert second is first and first.clients == 2 and first.priority == 7
    done = await _done(first)
    result = result_from_json(done.result)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert result_to_json(result) == done.result
    assert fake_hub.bytes_served("*.safetensors") == _shard_bytes(checkpoint)
    # after it finished, a new request starts a new job that finds everything cached
    third, created = await scheduler.submit(JobRequest(REPO))
    assert created and third is not first
    assert (await _done(third)).result["bytes_downloaded"] == 0


async def test_events_describe_the_download(scheduler: Scheduler, checkpoint: Checkpoint) -> None:
    job, _ = await scheduler.submit(JobRequest(REPO))
    await _outcome(job)
    events = job.events.past()
    kinds = [e.kind for e in events]
    assert isinstance(events[0], FileStarted)
    assert events[0].path == INDEX
    assert kinds.count("resolved") == 1 and kinds[-1] == "job_done"
    (resolved,) = [e for e in events if isinstance(e, Resolved)]
    shards = [f for f in resolved.files if f.shard_index is not None]
    assert [f.path for f in shards] == list(checkpoint.shards)
    assert resolved.shard_count == len(checkpoint.shards)
    verified = {e.outcome.path: e for e in events if isinstance(e, Verified)}
    assert set(verified) == {f.path for f in resolved.files}
    assert job.result is not None
    for index, name in enumerate(checkpoint.shards):
        event = verified[name]
        assert event.shard_index == index
        assert event.file == job.result.snapshot_path / name
        assert _same_bytes(event.file, checkpoint.path(name))
        assert event.blob.name == event.outcome.sha256
        started = next(e for e in events if isinstance(e, FileStarted) and e.path == name)
        assert started.seq < event.seq
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    assert {e.job for e in events} == {job.id}
    info = job.info()
    assert info["state"] == "done" and info["files"]["verified"] == info["files"]["total"]
    assert info["bytes"]["done"] == info["bytes"]["total"] == resolved.total_size


def _small(started: FileStarted) -> bool:
    """A small file beside the weights takes no slot: it starts whatever the priorities."""
    return started.shard_index is None and started.size is not None and started.size <= SMALL_FILE


async def test_small_files_take_no_slot(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    fake_hub.add_checkpoint("acme/held", checkpoint)
    config = replace(fast_config(tmp_path / "cache", fake_hub.endpoint), max_files=1)
    async with (
        Engine(config) as engine,
        scheduled(engine) as scheduler,
    ):
        hold = scheduler.gate.admit(lambda: (-(10**9),))
        await hold.__aenter__()  # the one slot is taken: no shard can start
        job, _ = await scheduler.submit(JobRequest("acme/held"))
        small = {path for path in checkpoint.files if path not in checkpoint.shards}

        def verified() -> set[str]:
            return {e.outcome.path for e in job.events.past() if isinstance(e, Verified)}

        async with asyncio.timeout(30):  # all of them while the slot is held
            await until(lambda: verified() >= small)
        started = {e.path for e in job.events.past() if isinstance(e, FileStarted)}
        assert not started & set(checkpoint.shards)
        await hold.__aexit__(None, None, None)
        await _outcome(job)


async def test_a_stream_joining_a_job_makes_its_next_files_come_in_order(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A stream joins the prefetch already running for its snapshot (one download), and the
    files not started yet come in their turn: it reads them in index order."""
    fake_hub.add_checkpoint("acme/joined", checkpoint)
    config = replace(fast_config(tmp_path / "cache", fake_hub.endpoint), max_files=1)
    async with (
        Engine(config) as engine,
        scheduled(engine) as scheduler,
    ):
        hold = scheduler.gate.admit(lambda: (-(10**9),))
        await hold.__aenter__()  # the job starts, its shards wait for the slot
        job, _ = await scheduler.submit(JobRequest("acme/joined"))
        await until(lambda: job.engine_job is not None)
        assert job.engine_job is not None and not job.engine_job.in_order
        assert job.info()["in_order"] is False
        joined, created = await scheduler.submit(JobRequest("acme/joined", in_order=True))
        assert joined is job and not created
        assert job.engine_job.in_order and job.info()["in_order"] is True
        await hold.__aexit__(None, None, None)
        await _outcome(job)
    assert JobRequest.from_json(JobRequest("acme/joined", in_order=True).to_json()).in_order


async def test_files_of_the_highest_priority_job_go_first(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    other = build_checkpoint(tmp_path / "other", total_bytes=256 * 1024, n_shards=2, seed=5)
    fake_hub.add_checkpoint("acme/low", checkpoint)
    fake_hub.add_checkpoint("acme/high", other)
    config = replace(fast_config(tmp_path / "cache", fake_hub.endpoint), max_files=1)
    async with (
        Engine(config) as engine,
        scheduled(engine) as scheduler,
    ):
        hold = scheduler.gate.admit(lambda: (-(10**9),))
        await hold.__aenter__()  # every file waits until both jobs are queued
        low, _ = await scheduler.submit(JobRequest("acme/low", priority=0))
        high, _ = await scheduler.submit(JobRequest("acme/high", priority=5))
        await until(lambda: scheduler.gate.waiting == 2)
        await hold.__aexit__(None, None, None)
        await _outcome(low)
        await _outcome(high)
    started = []
    for job in (low, high):
        events = job.events.past()
        resolved = next(e.seq for e in events if isinstance(e, Resolved))
        started += [
            (e.time, job.request.source, e.path)
            for e in events
            if isinstance(e, FileStarted) and e.seq > resolved and not _small(e)
        ]
    started.sort()
    sources = [source for _, source, _ in started]
    n_high = sources.count("acme/high")
    assert sources == ["acme/high"] * n_high + ["acme/low"] * (len(sources) - n_high)
    shard_order = [path for _, source, path in started if path in other.shards]
    assert shard_order == list(other.shards)  # index order within the job


async def test_a_revision_naming_a_running_commit_follows_that_job(
    scheduler: Scheduler, fake_hub: FakeHub, checkpoint: Checkpoint
) -> None:
    fake_hub.faults.add(Bandwidth(300_000, times=None))
    commit = fake_hub.add_checkpoint(REPO, checkpoint)  # again: same content, same commit
    by_branch, _ = await scheduler.submit(JobRequest(REPO))
    by_commit, created = await scheduler.submit(JobRequest(REPO, revision=commit))
    assert created
    done = [await _done(by_branch), await _done(by_commit)]
    assert done[0].result["snapshot_path"] == done[1].result["snapshot_path"]
    # each as its own prefetch would say, whichever job followed the other
    assert [d.result["revision"] for d in done] == ["main", commit]
    assert {by_branch.merged_into, by_commit.merged_into} - {None} <= {by_branch.id, by_commit.id}
    assert (by_branch.merged_into is None) != (by_commit.merged_into is None)
    follower = by_commit if by_commit.merged_into else by_branch
    verified = [e for e in follower.events.past() if isinstance(e, Verified)]
    assert set(checkpoint.shards) <= {e.outcome.path for e in verified}
    assert {e.job for e in verified} == {follower.id}  # mirrored events are the follower's
    assert follower.info()["files"]["verified"] == len(verified)
    assert fake_hub.bytes_served("*.safetensors") < 1.1 * _shard_bytes(checkpoint)


async def test_a_follower_at_another_revision_names_the_snapshot_by_it_too(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """``main`` and a tag on one commit, asked while the first still downloads: the second
    follows it, and its revision must name the snapshot as its own download would have, or
    huggingface_hub offline (and ``--offline``) finds no snapshot for the tag."""
    import huggingface_hub

    commit = fake_hub.add_checkpoint(REPO, checkpoint)
    fake_hub.add_checkpoint(REPO, checkpoint, revision="v1.0", commit=commit)
    fake_hub.faults.add(Bandwidth(300_000, times=None))
    cache = tmp_path / "cache"
    async with (
        Engine(fast_config(cache, fake_hub.endpoint)) as engine,
        scheduled(engine) as scheduler,
    ):
        by_branch, _ = await scheduler.submit(JobRequest(REPO))
        by_tag, _ = await scheduler.submit(JobRequest(REPO, revision="v1.0"))
        done = [await _done(by_branch), await _done(by_tag)]
    assert (by_branch.merged_into is None) != (by_tag.merged_into is None)  # one followed
    store = CacheStore(cache)
    repo = RepoRef("hub", REPO)
    assert [store.read_ref(repo, r) for r in ("main", "v1.0")] == [commit, commit]
    found = await asyncio.to_thread(
        huggingface_hub.snapshot_download,
        REPO,
        revision="v1.0",
        cache_dir=cache / "hub",
        local_files_only=True,
    )
    assert Path(found) == Path(done[1].result["snapshot_path"])


async def test_a_follower_goes_on_alone_when_the_job_it_follows_is_cancelled(
    scheduler: Scheduler, fake_hub: FakeHub, checkpoint: Checkpoint
) -> None:
    """A job that follows another's download (the same commit asked by its hash) belongs to
    its own clients: the other job's clients cancelling theirs does not cancel it."""
    fake_hub.faults.add(Bandwidth(300_000, times=None))
    commit = fake_hub.add_checkpoint(REPO, checkpoint)
    by_branch, _ = await scheduler.submit(JobRequest(REPO))
    by_commit, _ = await scheduler.submit(JobRequest(REPO, revision=commit))
    await until(lambda: by_branch.merged_into is not None or by_commit.merged_into is not None)
    follower = by_commit if by_commit.merged_into else by_branch
    followed = by_branch if follower is by_commit else by_commit
    await scheduler.cancel(followed.id)
    assert followed.state == "cancelled"
    done = await _done(follower)
    assert follower.state == "done" and follower.merged_into is None
    assert_snapshot_matches(Path(done.result["snapshot_path"]), checkpoint)


@pytest.mark.parametrize("followed_cancelled", [False, True])
async def test_a_follower_logs_each_file_once_and_gives_its_clients_back(
    scheduler: Scheduler, fake_hub: FakeHub, checkpoint: Checkpoint, followed_cancelled: bool
) -> None:
    """What the follower verified itself, mirrored, or verified again on its own after the
    job it followed was cancelled, is one ``Verified`` per file: its counters and a
    client's ``shards()`` count each file once."""
    fake_hub.faults.add(Bandwidth(300_000, times=None))
    commit = fake_hub.add_checkpoint(REPO, checkpoint)
    followed, _ = await scheduler.submit(JobRequest(REPO))
    await until(lambda: followed.commit is not None)
    follower, _ = await scheduler.submit(JobRequest(REPO, revision=commit))
    await until(lambda: follower.merged_into == followed.id)
    if followed_cancelled:
        shard = checkpoint.shards[0]
        await until(lambda: shard in _verified_paths(follower))  # mirrored
        await scheduler.cancel(followed.id)
    await _done(follower)
    paths = _verified_paths(follower)
    assert len(paths) == len(set(paths)) == follower.info()["files"]["total"]
    assert follower.info()["files"]["verified"] == len(paths)
    assert followed.info()["clients"] == 1


def _verified_paths(job: SharedJob) -> list[str]:
    return [e.outcome.path for e in job.events.past() if isinstance(e, Verified)]


async def test_a_request_while_a_job_is_being_cancelled_starts_a_new_job(
    scheduler: Scheduler, fake_hub: FakeHub, checkpoint: Checkpoint
) -> None:
    """A cancelled job winds down (its files' cleanup) before it ends; a request made
    meanwhile is not the cancelled one's and must not end with its cancellation."""
    fake_hub.faults.add(Bandwidth(300_000, times=None))
    job, _ = await scheduler.submit(JobRequest(REPO))
    async for event in job.events.follow():
        if isinstance(event, Progress) and event.path.endswith(".safetensors"):
            break
    cancelling = asyncio.create_task(scheduler.cancel(job.id))
    await asyncio.sleep(0)  # cancelled; its task still winds down
    assert job.stop_error is not None and not job.finished
    again, created = await scheduler.submit(JobRequest(REPO))
    await cancelling
    assert created and again is not job and job.state == "cancelled"
    done = await _done(again)
    assert_snapshot_matches(Path(done.result["snapshot_path"]), checkpoint)


async def test_cancel_stops_the_job_and_keeps_partials(
    scheduler: Scheduler, fake_hub: FakeHub
) -> None:
    fake_hub.faults.add(Bandwidth(200_000, times=None))
    job, _ = await scheduler.submit(JobRequest(REPO))
    async for event in job.events.follow():
        if isinstance(event, Progress) and event.path.endswith(".safetensors"):
            break
    await scheduler.cancel(job.id)
    outcome = await _failed(job)
    assert outcome.error.code == "job_cancelled"
    assert job.state == "cancelled" and job.finished
    partial = scheduler.engine.cache.root / "partial"
    assert any(p.suffix == ".part" for p in partial.iterdir())
    assert (await scheduler.cancel(job.id)) is job  # cancelling again changes nothing


async def test_a_failing_file_is_reported_with_its_path(
    scheduler: Scheduler, fake_hub: FakeHub, checkpoint: Checkpoint
) -> None:
    broken = checkpoint.shards[1]
    fake_hub.faults.add(Status(503, times=None, path=broken))
    job, _ = await scheduler.submit(JobRequest(REPO))
    outcome = await _failed(job)
    assert outcome.error.code == "transfer"
    failed = [e for e in job.events.past() if isinstance(e, FileFailed)]
    assert [e.path for e in failed] == [broken]
    assert failed[0].shard_index == 1 and "503" in failed[0].error.message
    assert job.state == "failed" and job.error == outcome.error
    assert job.info()["error"] == outcome.error.to_json()


async def test_origin_errors_fail_the_job_not_the_submission(scheduler: Scheduler) -> None:
    job, _ = await scheduler.submit(JobRequest("acme/missing"))
    outcome = await _failed(job)
    assert outcome.error.code == "repo_not_found"
    with pytest.raises(errors.ConfigError, match="invalid repo id"):
        await scheduler.submit(JobRequest("not a repo!"))


async def test_local_sources_can_be_refused(checkpoint: Checkpoint, tmp_path: Path) -> None:
    async with (
        Engine(fast_config(tmp_path / "cache")) as engine,
        scheduled(engine, allow_local=False) as scheduler,
    ):
        with pytest.raises(errors.ConfigError, match="local directories"):
            await scheduler.submit(JobRequest(str(checkpoint.directory)))


async def test_stopping_refuses_jobs_and_interrupts_running_ones(
    scheduler: Scheduler, fake_hub: FakeHub
) -> None:
    fake_hub.faults.add(Bandwidth(200_000, times=None))
    job, _ = await scheduler.submit(JobRequest(REPO))
    scheduler.stop(errors.DaemonStoppingError("daemon stopping"))
    outcome = await _failed(job)
    assert outcome.error == ErrorInfo("daemon_stopping", "daemon stopping")
    assert job.state == "interrupted" and not job.finished
    with pytest.raises(errors.DaemonStoppingError):
        await scheduler.submit(JobRequest(REPO))


@pytest.mark.parametrize("interrupted_first", [False, True])
async def test_a_cancel_while_the_daemon_stops_is_not_undone_by_the_restart(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, interrupted_first: bool
) -> None:
    """A DELETE cancels the job for every client, also one that comes while the daemon
    stops: the job it was stopping (or has stopped) does not come back with the journal."""
    fake_hub.add_checkpoint(REPO, checkpoint)
    fake_hub.faults.add(Bandwidth(200_000, times=None))
    config = fast_config(tmp_path / "cache", fake_hub.endpoint)
    journal = Journal(AsyncStore(CacheStore(config.cache_dir)))
    async with Engine(config) as engine, scheduled(engine, journal=journal) as scheduler:
        job, _ = await scheduler.submit(JobRequest(REPO))
        await until(lambda: job.state == "downloading")
        scheduler.stop(errors.DaemonStoppingError("daemon stopping"))
        if interrupted_first:
            await _failed(job)
            assert job.state == "interrupted"
        await scheduler.cancel(job.id)
        assert job.state == "cancelled" and job.finished
        assert job.info()["error"]["code"] == "job_cancelled"
    assert await journal.load() == []
    async with Engine(config) as engine, scheduled(engine, journal=journal) as scheduler:
        assert await scheduler.restore() == 0 and scheduler.get(job.id) is None


async def test_journaled_jobs_resume_from_their_partial_files(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    # shards above SMALL_FILE: smaller ones are one GET each, never resumed
    checkpoint = build_checkpoint(tmp_path / "ckpt", total_bytes=3600 << 10, n_shards=3)
    fake_hub.add_checkpoint(REPO, checkpoint)
    rule = fake_hub.faults.add(Bandwidth(300_000, times=None))
    config: Config = fast_config(
        tmp_path / "cache", fake_hub.endpoint, sidecar_interval=0.05, write_size=16 * 1024
    )
    journal = Journal(AsyncStore(CacheStore(config.cache_dir)))
    async with (
        Engine(config) as engine,
        scheduled(engine, journal=journal) as scheduler,
    ):
        job, _ = await scheduler.submit(JobRequest(REPO, priority=4))
        assert [r["id"] for r in await journal.load()] == [job.id]
        async for event in job.events.follow():
            if isinstance(event, Progress) and event.done > 60_000 and event.path != INDEX:
                break
    records = await journal.load()
    assert [(r["id"], r["priority"]) for r in records] == [(job.id, 4)]
    fake_hub.faults.remove(rule)
    async with (
        Engine(config) as engine,
        scheduled(engine, journal=journal) as scheduler,
    ):
        assert await scheduler.restore() == 1
        resumed = scheduler.get(job.id)
        assert resumed is not None and resumed.priority == 4
        outcome = await _done(resumed)
    result = result_from_json(outcome.result)
    assert sum(f.resumed for f in result.files) > 0
    assert await journal.load() == []
    assert_snapshot_matches(result.snapshot_path, checkpoint)


async def test_a_corrupt_journal_is_set_aside(tmp_path: Path) -> None:
    journal = Journal(AsyncStore(CacheStore(tmp_path)))
    journal.path.parent.mkdir(parents=True)
    journal.path.write_bytes(b"{not json")
    assert await journal.load() == []
    listing = _listing(journal.path.parent)
    assert sorted(p.name.split("-")[0] for p in listing) == ["jobs.json.corrupt"]


async def test_a_journal_too_large_to_load_is_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs whose records pass what ``load`` reads (16 MiB; 64 KiB here, with requests of
    non-ASCII globs, which ``\\uXXXX`` tripled): the journal keeps the first that fit,
    where it was written whole, set aside as corrupt at the restart, and resumed none."""
    from shardsync import journal as journal_module

    monkeypatch.setattr(journal_module, "_MAX_SIZE", 64 << 10)
    journal = Journal(AsyncStore(CacheStore(tmp_path)))
    records = [
        {"id": f"{i:016x}", "request": {"source": REPO, "include": ["größe-ß*"] * 200}}
        for i in range(40)
    ]
    await journal.save(records)
    loaded = await journal.load()
    assert 0 < len(loaded) < len(records)
    assert loaded == records[: len(loaded)]
    assert journal.path.stat().st_size <= 64 << 10


async def test_a_journal_nested_too_deep_to_read_is_set_aside(tmp_path: Path) -> None:
    journal = Journal(AsyncStore(CacheStore(tmp_path)))
    journal.path.parent.mkdir(parents=True)
    journal.path.write_bytes(b'{"format": 1, "jobs": ' + b"[" * 200_000)
    assert await journal.load() == []
    listing = _listing(journal.path.parent)
    assert sorted(p.name.split("-")[0] for p in listing) == ["jobs.json.corrupt"]


async def test_a_journaled_job_with_an_impossible_number_is_dropped_alone(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """A record the daemon cannot resume is skipped: the others resume, the daemon starts."""
    fake_hub.add_checkpoint(REPO, checkpoint)
    journal = Journal(AsyncStore(CacheStore(tmp_path / "cache")))
    good = {"id": "a" * 16, "seq": 1, "submitted_at": 1.0, "priority": 0}
    records = [
        {**good, "request": JobRequest(REPO).to_json()},
        {**good, "id": "b" * 16, "priority": 1e400, "request": {"source": "acme/other"}},
        {**good, "id": "c" * 16, "submitted_at": 10**400, "request": {"source": "acme/x"}},
    ]
    await journal.save(records)
    async with (
        Engine(fast_config(tmp_path / "cache", fake_hub.endpoint)) as engine,
        scheduled(engine, journal=journal) as scheduler,
    ):
        assert await scheduler.restore() == 1
        resumed = scheduler.get("a" * 16)
        assert resumed is not None
        await _done(resumed)


async def test_finished_jobs_beyond_the_history_are_forgotten(
    scheduler: Scheduler, checkpoint: Checkpoint
) -> None:
    scheduler.history = 1
    jobs = []
    for _ in range(3):
        job, _ = await scheduler.submit(JobRequest(REPO))
        await _outcome(job)
        jobs.append(job)
    assert scheduler.get(jobs[0].id) is None
    assert [j.id for j in scheduler.jobs()] == [jobs[2].id, jobs[1].id]


async def test_scheduler_result_matches_plain_prefetch(
    scheduler: Scheduler, fake_hub: FakeHub, tmp_path: Path
) -> None:
    job, _ = await scheduler.submit(JobRequest(REPO))
    ours = result_from_json((await _done(job)).result)
    plain = await prefetch(REPO, fast_config(tmp_path / "plain", fake_hub.endpoint))
    assert (ours.repo, ours.commit, ours.revision) == (plain.repo, plain.commit, plain.revision)
    assert [(f.path, f.size, f.sha256, f.verified) for f in ours.files] == [
        (f.path, f.size, f.sha256, f.verified) for f in plain.files
    ]


async def test_the_bandwidth_hook_sees_every_body_byte(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    fake_hub.add_checkpoint(REPO, checkpoint)
    charged: list[int] = []

    def throttle(nbytes: int) -> float:
        charged.append(nbytes)  # from the pump threads too: list.append is atomic
        return 0.0

    config = fast_config(tmp_path / "cache", fake_hub.endpoint)
    async with (
        Engine(config, throttle=throttle) as engine,
        scheduled(engine) as scheduler,
    ):
        job, _ = await scheduler.submit(JobRequest(REPO))
        await _done(job)
        assert sum(charged) == engine.fetcher.statistics().bytes_downloaded > 0


async def test_the_bandwidth_cap_holds_for_bodies_read_by_the_pump_threads(
    fake_hub: FakeHub, tmp_path: Path
) -> None:
    """The pump threads charge the token bucket themselves and pause as long as it says: at
    8 MB/s, 8 MB cannot arrive in less than the time the bucket allows beyond its burst (a
    lower bound, which a slow machine cannot break)."""
    model = build_checkpoint(tmp_path / "model", total_bytes=8 << 20, n_shards=2, seed=5)
    fake_hub.add_checkpoint(REPO, model)
    rate = 8e6
    bucket = TokenBucket(rate)
    config = fast_config(tmp_path / "cache", fake_hub.endpoint, chunk_size=1 << 20)
    began = time.monotonic()
    async with (
        Engine(config, throttle=bucket) as engine,
        scheduled(engine) as scheduler,
    ):
        job, _ = await scheduler.submit(JobRequest(REPO))
        await _done(job)
        body_bytes = engine.fetcher.statistics().bytes_downloaded
    elapsed = time.monotonic() - began
    burst = max(rate / 10, 256 * 1024)
    assert body_bytes > 7_000_000  # the whole model came through the pumps
    assert elapsed >= (body_bytes - burst) / rate


# ---------------------------------------------------------------------------- auto-prune


def _prune_config(base: Config, **limits: Any) -> Config:
    return replace(base, prune=replace(base.prune, **limits))


async def test_the_daemon_prunes_past_the_high_water_mark(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    old = build_checkpoint(tmp_path / "old", total_bytes=384 << 10, n_shards=3, seed=9)
    fake_hub.add_checkpoint("acme/old", old)
    fake_hub.add_checkpoint(REPO, checkpoint)
    config = fast_config(tmp_path / "cache", fake_hub.endpoint)
    await prefetch("acme/old", config)
    limit = int(1.5 * _shard_bytes(checkpoint))
    async with (
        Engine(_prune_config(config, max_size=limit)) as engine,
        scheduled(engine) as scheduler,
    ):
        job, _ = await scheduler.submit(JobRequest(REPO))
        await _done(job)
        cache = engine.cache
        assert cache.find_complete(job.repo, "main") is not None
        assert cache.find_complete(RepoRef("hub", "acme/old"), "main") is None


@pytest.mark.parametrize("pinned", [False, True], ids=["prunes-to-fit", "pinned-disk-full"])
async def test_a_download_that_would_not_fit_prunes_first(
    fake_hub: FakeHub, tmp_path: Path, pinned: bool
) -> None:
    old = build_checkpoint(tmp_path / "old", total_bytes=700 << 10, n_shards=2, seed=9)
    new = build_checkpoint(tmp_path / "new", total_bytes=700 << 10, n_shards=2, seed=10)
    fake_hub.add_checkpoint("acme/old", old)
    fake_hub.add_checkpoint(REPO, new)
    with tmpfs(tmp_path / "small", "size=1200k") as cache_dir:
        config = fast_config(cache_dir, fake_hub.endpoint)
        await prefetch("acme/old", config)
        if pinned:
            config = _prune_config(config, pin=("acme/old",))
        async with (
            Engine(config) as engine,
            scheduled(engine) as scheduler,
        ):
            job, _ = await scheduler.submit(JobRequest(REPO))
            outcome = await _outcome(job)
            assert any(isinstance(e, Pruning) for e in job.events.past())
            if pinned:
                assert isinstance(outcome, JobFailed)
                assert outcome.error.code == "disk_full"
                assert "not enough disk space" in outcome.error.message
                assert engine.cache.find_complete(RepoRef("hub", "acme/old"), "main")
            else:
                assert isinstance(outcome, JobDone), outcome
                result = result_from_json(outcome.result)
                assert_snapshot_matches(result.snapshot_path, new)
                assert engine.cache.find_complete(RepoRef("hub", "acme/old"), "main") is None
