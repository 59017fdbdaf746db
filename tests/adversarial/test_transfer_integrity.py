"""Transfer integrity (promises 1 and 3), judged by the origin's bytes, for every origin kind.

Each test makes the server change the bytes the way real servers do (a 206 of another range, a
full 200 to a Range request, an object replaced at the same URL mid-download or between two
runs, a flipped byte in a small Hub file, no ETag at all), then compares what got published
with what the origin holds: the checkpoint builder's files, or the replacement's bytes. Never
with the cache's own names: a blob is named by the digest of what was received, so a skipped
check still "matches" its name.

On the Hub, the listing's sha256 or git blob id catches a wrong byte; plain-URL and local
origins publish no hash (trust on first use), so there only the transfer's own checks (where a
206 starts, its total, the ETag with ``If-Range``, the resume record) stand between a lying or
changing server and a corrupt snapshot. ``tools/mutants.py`` plants a bug in each of those
checks and shows that a test here fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from bodypaths import BodyPath
from helpers import assert_snapshot_matches, assert_store_verified, fast_config, until

from shardsync.errors import OriginError, ShardsyncError
from shardsync.origins import LocalOrigin
from shardsync.origins.base import Entry, Http
from shardsync.prefetch import Engine, prefetch
from shardsync.records import PrefetchResult
from shardsync.retry import RetryPolicy
from shardsync.testing import (
    Checkpoint,
    CutBody,
    FakeHub,
    Fault,
    FlipByte,
    IgnoreIfRange,
    IgnoreRange,
    Latency,
    NoEtag,
    ReplaceObject,
    ShiftedRange,
    Stall,
    build_checkpoint,
)
from shardsync.testing.nginx import serve_directory

REPO = "acme/integrity"
HTTP_KINDS = ["hub", "url"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Two shards of ~1.5 MiB: six 256 KiB ranges each with `fast_config`."""
    return build_checkpoint(
        tmp_path_factory.mktemp("integrity"), total_bytes=3 << 20, n_shards=2, seed=14
    )


@pytest.fixture
async def hub(checkpoint: Checkpoint, body_path: BodyPath) -> AsyncIterator[FakeHub]:
    """The checkpoint on a fake Hub that answers the way the test's body path needs."""
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, checkpoint)
        body_path.arm(hub)
        yield hub


def source(hub: FakeHub, kind: str) -> str:
    """The Hub repo id, or the same files as a plain base URL (no hash published: tofu)."""
    return REPO if kind == "hub" else f"{hub.endpoint}/{REPO}/resolve/main/"


def other_object(data: bytes) -> bytes:
    """Another valid shard of the same size: same safetensors header, every data byte changed."""
    data_start = 8 + int.from_bytes(data[:8], "little")
    return data[:data_start] + bytes(b ^ 0x5A for b in data[data_start:])


def published(result: PrefetchResult, rel: str) -> bytes:
    return (result.snapshot_path / rel).read_bytes()


def assert_matches_origin(
    result: PrefetchResult, checkpoint: Checkpoint, replaced: dict[str, bytes] | None = None
) -> None:
    """Every file of the snapshot is the origin's (a plain URL origin finds fewer files than
    the Hub lists, but always every shard), byte for byte."""
    replaced = replaced or {}
    paths = {f.path for f in result.files}
    assert set(checkpoint.shards) <= paths
    for rel in sorted(paths):
        want = replaced[rel] if rel in replaced else checkpoint.path(rel).read_bytes()
        assert published(result, rel) == want, f"{rel} is not the origin's file"


def expected_verification(kind: str, rel: str) -> str:
    if kind != "hub":
        return "tofu"
    return "sha256" if rel.endswith(".safetensors") else "git-sha1"


async def run(
    hub: FakeHub, kind: str, cache: Path, path: BodyPath, **fetch: object
) -> PrefetchResult:
    config = fast_config(cache, hub.endpoint if kind == "hub" else None, **fetch)
    result = await prefetch(source(hub, kind), path.configure(config))
    path.check()
    return result


async def test_a_throttle_holds_every_read_until_it_says_go_on_every_body_path(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath
) -> None:
    """A throttle may hold a file as long as it must (the tier's lead holds a claim holder's
    download so): after each pause it is asked again, and reads go on only when it answers
    0. While it holds, each connection reads at most the one piece it was charged for;
    asked once per read instead, the rest of the checkpoint came in during the hold."""
    lock, charged, asked_again = threading.Lock(), [0], [0]
    holding = threading.Event()
    at_hold: list[int] = []

    def throttle(nbytes: int) -> float:
        with lock:
            charged[0] += nbytes
            asked_again[0] += nbytes == 0
            if not at_hold and charged[0] >= 256 << 10:
                at_hold.append(charged[0])
                holding.set()
        return 0.001 if holding.is_set() else 0.0

    async def release_later() -> int:
        await asyncio.to_thread(holding.wait, 30)
        await asyncio.sleep(0.5)
        with lock:
            seen = charged[0]
        holding.clear()
        return seen

    config = body_path.configure(fast_config(tmp_path, hub.endpoint))
    releasing = asyncio.ensure_future(release_later())
    async with Engine(config, throttle=throttle) as engine:
        job = engine.job(engine.origin(REPO))
        await job.prepare()
        await job.download()
        snapshot = job.snapshot_path
    at_release = await releasing
    body_path.check()
    assert_snapshot_matches(snapshot, checkpoint)
    assert asked_again[0] > 0
    # a piece (64 KiB reads) per connection at most: 2 shards x 4, and the small files
    assert at_release - at_hold[0] <= (2 * 4 + 4) * (64 << 10)


# --------------------------------------------------------------------------- one run, lying server


@pytest.mark.parametrize("kind", HTTP_KINDS)
@pytest.mark.parametrize("shift", [-4096, 4096, -(300 << 10)], ids=["early", "late", "far-early"])
async def test_a_206_of_another_range_is_never_written_at_the_asked_offset(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, kind: str, shift: int
) -> None:
    lie = ShiftedRange(shift, times=4, path="*.safetensors", asked_again=body_path.chunked)
    rule = hub.faults.add(lie)
    result = await run(hub, kind, tmp_path, body_path)
    assert rule.exhausted
    assert_matches_origin(result, checkpoint)
    assert_store_verified(tmp_path, checkpoint)
    assert all(f.verified == expected_verification(kind, f.path) for f in result.files)


@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_a_full_200_to_a_range_request_is_never_written_at_the_range_offset(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, kind: str
) -> None:
    """A server may ignore Range and send the whole file with 200: legal, and its first byte
    is byte 0 of the file, whatever range was asked for."""
    rule = hub.faults.add(IgnoreRange(times=3, path="*.safetensors", asked_again=body_path.chunked))
    result = await run(hub, kind, tmp_path, body_path)
    assert rule.exhausted
    assert_matches_origin(result, checkpoint)
    assert_store_verified(tmp_path, checkpoint)


@pytest.mark.parametrize(
    "silence",
    [
        Stall(30, times=2, path="*.safetensors"),
        Latency(30, bodies_only=True, times=2, path="*.safetensors"),
    ],
    ids=["after-the-head", "before-the-head"],
)
async def test_a_silent_server_is_given_up_on_by_the_read_timeout_on_every_body_path(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, silence: Fault
) -> None:
    """A server that says nothing for 30 s, after the head or before it: the read timeout
    (0.5 s here) gives up on it on every body path and a retry finishes the file, long
    before the server would speak. An aiohttp request given ``timeout=None`` has no timeout
    at all."""
    rule = hub.faults.add(replace(silence, asked_again=body_path.chunked))
    async with asyncio.timeout(20):
        result = await run(hub, "url", tmp_path, body_path, read_timeout=0.5)
    assert rule.exhausted
    assert_matches_origin(result, checkpoint)
    assert_store_verified(tmp_path, checkpoint)


@pytest.mark.parametrize("rel", ["config.json", "model.safetensors.index.json"])
async def test_a_flipped_byte_in_a_small_hub_file_is_refused_by_its_git_blob_id(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, rel: str
) -> None:
    """Small files come from the Hub itself (no CDN, no sha256 in the listing): their git blob
    id is the only proof, and it must be checked."""
    rule = hub.faults.add(FlipByte(server="hub", path=rel))
    result = await run(hub, "hub", tmp_path, body_path)
    assert rule.exhausted
    assert published(result, rel) == checkpoint.path(rel).read_bytes()
    assert_matches_origin(result, checkpoint)
    assert_store_verified(tmp_path, checkpoint)
    (outcome,) = [f for f in result.files if f.path == rel]
    assert outcome.verified == "git-sha1"


async def test_a_small_hub_file_flipped_every_time_is_never_published(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath
) -> None:
    hub.faults.add(FlipByte(server="hub", path="config.json", times=None))
    with pytest.raises(ShardsyncError, match=r"config\.json"):
        await run(hub, "hub", tmp_path, body_path)
    assert_store_verified(tmp_path, checkpoint)


# --------------------------------------------------------------------------- a replaced object


async def test_an_object_replaced_mid_download_is_never_published_mixed(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath
) -> None:
    """The first range is the old object's, the next ones the new object's (new ETag): only a
    whole object may be published, which takes ``If-Range`` or a check of each 206's ETag."""
    shard = checkpoint.shards[1]
    old = checkpoint.path(shard).read_bytes()
    new = other_object(old)
    hub.faults.add(ReplaceObject(new, path=shard, after=1))
    result = await run(hub, "url", tmp_path, body_path)
    got = published(result, shard)
    assert got in (old, new), "a file mixed from two objects was published"
    assert got == new  # the old object can no longer be finished: its other ranges are gone
    assert_store_verified(tmp_path, checkpoint, new)


def old_answers(path: BodyPath) -> int:
    """How many answers of the old object land one range of it, on one connection: a
    chunked answer to the pump's first request is asked for again on the aiohttp path."""
    return 2 if path.chunked else 1


def conditional_answers(hub: FakeHub, rel: str, status: int) -> list[str]:
    """The ``If-Range`` values of the Range requests for `rel` answered with `status`."""
    return [
        r.headers["If-Range"]
        for r in hub.log
        if r.file == rel and r.range is not None and "If-Range" in r.headers and r.status == status
    ]


async def test_a_store_ignoring_if_range_is_caught_by_each_206s_etag(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath
) -> None:
    """A cache or store that answers every Range with a 206 of what it holds now, whatever
    ``If-Range`` names (SeaweedFS does): only the ETag each 206 carries tells the new
    object's bytes from the old one's."""
    shard = checkpoint.shards[1]
    old = checkpoint.path(shard).read_bytes()
    new = other_object(old)
    hub.faults.add(IgnoreIfRange(path=shard))
    replaced = hub.faults.add(ReplaceObject(new, path=shard, after=old_answers(body_path)))
    result = await run(hub, "url", tmp_path, body_path, connections_per_file=1)
    assert published(result, shard) == new
    assert_store_verified(tmp_path, checkpoint, new)
    assert isinstance(replaced.fault, ReplaceObject)
    stale = [tag for tag in conditional_answers(hub, shard, 206) if tag != replaced.fault.etag]
    assert stale, "no 206 of the new object answered an If-Range naming the old one"


async def test_a_cdn_stripping_etags_from_206s_is_caught_by_if_range(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath
) -> None:
    """A CDN that drops the ETag from partial answers: a 206 of the new object looks like
    one of the old, and only ``If-Range`` (the store answers 200 with the new object) keeps
    the two apart."""
    shard = checkpoint.shards[1]
    old = checkpoint.path(shard).read_bytes()
    new = other_object(old)
    hub.faults.add(NoEtag(partial_only=True, path=shard))
    hub.faults.add(ReplaceObject(new, path=shard, after=old_answers(body_path)))
    result = await run(hub, "url", tmp_path, body_path, connections_per_file=1)
    assert published(result, shard) == new
    assert_store_verified(tmp_path, checkpoint, new)
    assert conditional_answers(hub, shard, 200), "no If-Range was answered with the new object"


async def test_a_hub_object_replaced_mid_download_is_refused_by_its_sha256(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath
) -> None:
    """On the Hub the listing names the sha256: new bytes at the same URL are never published."""
    shard = checkpoint.shards[1]
    new = other_object(checkpoint.path(shard).read_bytes())
    hub.faults.add(ReplaceObject(new, path=shard, after=1))
    with pytest.raises(ShardsyncError, match=re.escape(shard)):
        await run(hub, "hub", tmp_path, body_path)
    assert_store_verified(tmp_path, checkpoint)


@pytest.mark.parametrize("grow", [4096, -4096], ids=["larger", "smaller"])
async def test_an_object_without_etag_changing_size_mid_download_is_never_published_mixed(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, grow: int
) -> None:
    """Without a strong ETag there is no ``If-Range``: the ``Content-Range`` total is what
    tells that the object changed. Failing is fine; publishing a mix is not."""
    shard = checkpoint.shards[1]
    old = checkpoint.path(shard).read_bytes()
    new = other_object(old)
    new = new + new[-grow:] if grow > 0 else new[:grow]
    hub.faults.add(NoEtag(path=shard))
    hub.faults.add(ReplaceObject(new, path=shard, after=1))
    try:
        result = await run(hub, "url", tmp_path, body_path)
    except ShardsyncError:
        pass
    else:
        assert published(result, shard) in (old, new), "a mix of two objects was published"
    assert_store_verified(tmp_path, checkpoint, new)


def partial_of(cache: Path, rel: str) -> Path:
    """The partial file whose resume record names `rel`."""
    (record,) = [
        p
        for p in (cache / "partial").glob("*.json")
        if json.loads(p.read_bytes()).get("url", "").endswith("/" + rel)
    ]
    return record.with_suffix(".part")


async def leave_a_partial(hub: FakeHub, kind: str, cache: Path, path: BodyPath, shard: str) -> None:
    """A run that fails on `shard` after some of its bytes are on disk with a resume record:
    every answer for it is cut after 20 000 bytes (too little progress to earn new attempts)."""
    rule = hub.faults.add(CutBody(at=20_000, times=None, path=shard))
    retry = RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.01)

    async def fail() -> None:
        with pytest.raises(ShardsyncError, match=re.escape(shard)):
            await run(hub, kind, cache, path, retry=retry)
        # What the failed run leaves going (a shielded resume-record write) ends by itself.
        this = asyncio.current_task()
        while others := [t for t in asyncio.all_tasks() if t is not this]:
            await asyncio.wait(others)

    # A loop of its own: asyncio.run returns once the run's threads are done too (a publish
    # already started finishes after the error), so the cache stays still from here on.
    await asyncio.to_thread(asyncio.run, fail())
    hub.faults.remove(rule)
    assert partial_of(cache, shard).exists(), "no partial left: nothing here tests a resume"


@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_a_partial_of_an_object_replaced_between_runs_is_not_resumed(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, kind: str
) -> None:
    shard = checkpoint.shards[1]
    old = checkpoint.path(shard).read_bytes()
    new = other_object(old)
    await leave_a_partial(hub, kind, tmp_path, body_path, shard)
    if kind == "hub":  # a new commit on main (content at a commit never changes on the Hub)
        files: dict[str, bytes | Path] = {rel: checkpoint.path(rel) for rel in checkpoint.files}
        files[shard] = new
        hub.add_repo(REPO, files)
    else:  # the same URL serves another object, under another ETag
        hub.faults.add(ReplaceObject(new, path=shard))
    result = await run(hub, kind, tmp_path, body_path)
    assert_matches_origin(result, checkpoint, {shard: new})
    (outcome,) = [f for f in result.files if f.path == shard]
    assert outcome.resumed == 0
    assert_store_verified(tmp_path, checkpoint, new)


@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_a_partial_of_the_same_object_is_resumed_byte_exact(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, kind: str
) -> None:
    """The counterpart: with proof it is the same object, the partial is used, and the result
    is still the origin's file."""
    shard = checkpoint.shards[1]
    await leave_a_partial(hub, kind, tmp_path, body_path, shard)
    result = await run(hub, kind, tmp_path, body_path)
    (outcome,) = [f for f in result.files if f.path == shard]
    assert outcome.resumed > 0
    assert_matches_origin(result, checkpoint)
    assert_store_verified(tmp_path, checkpoint)


@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_a_partial_shorter_than_its_record_is_not_trusted(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, kind: str
) -> None:
    """The record says which ranges are on disk; a file cut shorter since (a filesystem that
    lost its tail, someone's ``truncate``) holds fewer: those bytes must not be believed."""
    shard = checkpoint.shards[1]
    await leave_a_partial(hub, kind, tmp_path, body_path, shard)
    part = partial_of(tmp_path, shard)
    assert part.stat().st_nlink == 1  # the partial alone, no published blob's second name
    os.truncate(part, 10)
    result = await run(hub, kind, tmp_path, body_path)
    assert_matches_origin(result, checkpoint)
    assert_store_verified(tmp_path, checkpoint)


@pytest.mark.parametrize("kind", HTTP_KINDS)
async def test_a_complete_snapshot_of_an_object_replaced_since_is_not_reused(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path, body_path: BodyPath, kind: str
) -> None:
    shard = checkpoint.shards[0]
    new = other_object(checkpoint.path(shard).read_bytes())
    first = await run(hub, kind, tmp_path, body_path)
    assert_matches_origin(first, checkpoint)
    if kind == "hub":
        files: dict[str, bytes | Path] = {rel: checkpoint.path(rel) for rel in checkpoint.files}
        files[shard] = new
        hub.add_repo(REPO, files)
    else:
        hub.faults.add(ReplaceObject(new, path=shard))
    second = await run(hub, kind, tmp_path, body_path)
    assert_matches_origin(second, checkpoint, {shard: new})
    assert second.snapshot_path != first.snapshot_path
    assert published(first, shard) == checkpoint.path(shard).read_bytes()  # never modified
    assert_store_verified(tmp_path, checkpoint, new)


# --------------------------------------------------------------------------- other origins


@dataclass(frozen=True, slots=True)
class Edited:
    path: str
    before: bytes
    after: bytes


def edit_in_place(root: Path, rel: str) -> Edited:
    """Rewrite a file with other bytes of the same size (a new mtime, as any writer leaves)."""
    target = root / rel
    before = target.read_bytes()
    after = other_object(before)
    st = target.stat()
    target.write_bytes(after)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    return Edited(rel, before, after)


@pytest.fixture
def local_copy(checkpoint: Checkpoint, tmp_path: Path) -> Checkpoint:
    """The checkpoint's files in a directory of the test's own, free to edit."""
    root = tmp_path / "origin"
    root.mkdir()
    for rel in checkpoint.files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(checkpoint.path(rel).read_bytes())
    return Checkpoint.scan(root)


async def test_a_local_file_edited_between_runs_is_copied_again(
    checkpoint: Checkpoint, local_copy: Checkpoint, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = await prefetch(str(local_copy.directory), fast_config(cache))
    assert_matches_origin(first, checkpoint)
    edited = edit_in_place(local_copy.directory, checkpoint.shards[0])
    second = await prefetch(str(local_copy.directory), fast_config(cache))
    assert published(second, edited.path) == edited.after
    assert published(first, edited.path) == edited.before  # the old snapshot is untouched
    assert_snapshot_matches(second.snapshot_path, local_copy)
    assert_store_verified(cache, checkpoint, edited.after)


@dataclass(frozen=True)
class EditedWhileCopied(LocalOrigin):
    """A directory whose file ``rel`` is rewritten right after the copy's first look at its
    version, once: what a writer still at work does to a file being copied."""

    rel: str = ""
    edits: list[Edited] = field(default_factory=list)

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        stamp = await LocalOrigin.version(self, fetcher, entry)
        if entry.path == self.rel and not self.edits:
            self.edits.append(edit_in_place(self.root, self.rel))
        return stamp


async def test_a_local_file_changed_while_it_is_copied_is_never_published(
    checkpoint: Checkpoint, local_copy: Checkpoint, tmp_path: Path
) -> None:
    """The copy may hold bytes of both versions: it is dropped (no blob, no file left in the
    cache's tmp/) and the job fails; a run after the write publishes the new bytes."""
    cache = tmp_path / "cache"
    origin = EditedWhileCopied(local_copy.directory, rel=checkpoint.shards[0])
    with pytest.raises(OriginError):
        async with Engine(fast_config(cache)) as engine:
            job = engine.job(origin)
            await job.prepare()
            await job.download()
    (edited,) = origin.edits
    assert_store_verified(cache, checkpoint)  # the old bytes' blobs at most: never the new
    # the other files' copies, cancelled with the job, go too once their threads end
    async with asyncio.timeout(10):
        await until(lambda: not [p for p in (cache / "tmp").iterdir() if p.is_file()])
    again = await prefetch(str(local_copy.directory), fast_config(cache))
    assert published(again, edited.path) == edited.after
    assert_snapshot_matches(again.snapshot_path, local_copy)


@dataclass(frozen=True)
class ChangedBesideACopy(LocalOrigin):
    """``rel`` is rewritten during its copy and fails the job, once ``held``'s copy is where
    the test has the job cancel it: whole, at its second look at its version; or, given
    ``pipe`` (a FIFO the test writes ``held``'s bytes into only later), in its thread, which
    waits to open its source and has made no file yet."""

    rel: str = ""
    held: str = ""
    pipe: Path | None = None
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    looks: dict[str, int] = field(default_factory=dict)

    def source(self, path: str) -> Path:
        if path == self.held and self.pipe is not None and self.looks.get(path):
            self.reached.set()
            return self.pipe  # the copy's source, after its first look at the version
        return LocalOrigin.source(self, path)

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        stamp = await LocalOrigin.version(self, fetcher, entry)
        look = self.looks[entry.path] = self.looks.get(entry.path, 0) + 1
        if entry.path == self.rel and look == 1:
            edit_in_place(self.root, self.rel)
        elif entry.path == self.rel:
            await self.reached.wait()
        elif entry.path == self.held and look == 2:
            self.reached.set()
            await asyncio.Event().wait()  # until the job is cancelled
        return stamp


async def _fail_beside(origin: ChangedBesideACopy, cache: Path) -> None:
    with pytest.raises(OriginError):
        async with asyncio.timeout(30), Engine(fast_config(cache)) as engine:
            job = engine.job(origin)
            await job.prepare()
            await job.download()
    assert origin.reached.is_set()


async def _until_tmp_is_empty(cache: Path) -> None:
    async with asyncio.timeout(10):
        await until(lambda: not [p for p in (cache / "tmp").iterdir() if p.is_file()])


async def test_a_copy_cancelled_before_its_check_leaves_nothing_in_tmp(
    checkpoint: Checkpoint, local_copy: Checkpoint, tmp_path: Path
) -> None:
    """A whole copy not yet checked is no blob: cancelled there, it goes."""
    cache = tmp_path / "cache"
    held = checkpoint.shards[1]
    await _fail_beside(
        ChangedBesideACopy(local_copy.directory, rel=checkpoint.shards[0], held=held), cache
    )
    assert_store_verified(cache, checkpoint)
    await _until_tmp_is_empty(cache)  # other files' copies may still be in their threads


async def test_a_copy_cancelled_in_its_thread_goes_when_the_thread_ends(
    checkpoint: Checkpoint, local_copy: Checkpoint, tmp_path: Path
) -> None:
    """A cancel cannot stop a copy's thread: the file it makes and finishes after its job
    failed is dropped then, not left in ``tmp/`` for the life of the process."""
    cache = tmp_path / "cache"
    held, pipe = checkpoint.shards[1], tmp_path / "held.fifo"
    os.mkfifo(pipe)
    origin = ChangedBesideACopy(
        local_copy.directory, rel=checkpoint.shards[0], held=held, pipe=pipe
    )
    try:
        await _fail_beside(origin, cache)
        # the copy's thread opens its source now, makes its file and copies to the end
        async with asyncio.timeout(10):
            await asyncio.to_thread(pipe.write_bytes, local_copy.path(held).read_bytes())
    finally:
        # opening both ends at once never blocks, and frees a thread still waiting to open
        # one of them (a test that failed early must not hang at its loop's shutdown)
        os.close(os.open(pipe, os.O_RDWR | os.O_NONBLOCK))
    await _until_tmp_is_empty(cache)
    assert_store_verified(cache, checkpoint)


@pytest.mark.nginx
def test_a_file_replaced_on_nginx_between_runs_is_downloaded_again(
    checkpoint: Checkpoint, local_copy: Checkpoint, tmp_path: Path
) -> None:
    """A real server's ETag (nginx: mtime and size) is what tells the file changed."""
    cache = tmp_path / "cache"
    with serve_directory(local_copy.directory, tmp_path / "nginx") as base:
        first = asyncio.run(prefetch(base, fast_config(cache)))
        assert_matches_origin(first, checkpoint)
        edited = edit_in_place(local_copy.directory, checkpoint.shards[1])
        second = asyncio.run(prefetch(base, fast_config(cache)))
    assert_matches_origin(second, checkpoint, {edited.path: edited.after})
    assert_store_verified(cache, checkpoint, edited.after)
