"""The download slot: one owner for the lock, partial, resume record and private name."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import tmpfs

from shardsync import layout
from shardsync.cache import CacheStore
from shardsync.errors import CacheError, DiskFullError
from shardsync.layout import CacheLayout
from shardsync.ranges import RangeSet
from shardsync.records import VerifiedFile
from shardsync.slot import Resumable, ResumeRecord, Slot, in_progress
from shardsync.store import AsyncStore

DATA = os.urandom(3000)
SHA = hashlib.sha256(DATA).hexdigest()
WHAT = Resumable("https://h.test/a/resolve/main/m.safetensors", '"abc"', len(DATA), SHA)


@pytest.fixture
def store(tmp_path: Path) -> CacheStore:
    return CacheStore(tmp_path / "cache")


def _write(slot: Slot, upto: int) -> ResumeRecord:
    """What the fetcher does: open, write the first ``upto`` bytes, record them, close."""
    partial = slot.open(WHAT)
    os.pwrite(partial.fd, DATA[:upto], 0)
    os.close(partial.fd)
    assert partial.record is not None
    partial.record.write(partial.record.encode(WHAT, RangeSet.from_list([[0, upto]], len(DATA))))
    partial.record.close()
    return partial.record


def _verified(slot: Slot) -> VerifiedFile:
    return VerifiedFile(slot.verified(), len(DATA), SHA, "0" * 32, None, "sha256", 0, 0)


def test_the_resume_record_is_byte_for_byte_the_format_of_earlier_releases() -> None:
    """Partials left by a release before slots resume: the bytes are those it wrote."""
    record = ResumeRecord(-1, (66, 1234))
    what = Resumable(WHAT.url, WHAT.etag, 1000, "ab" * 32)
    assert record.encode(what, RangeSet.from_list([[0, 300], [500, 600]], 1000)) == (
        b'{"version":3,"url":"https://h.test/a/resolve/main/m.safetensors","etag":"\\"abc\\"",'
        b'"size":1000,"sha256":"abababababababababababababababababababababababababababababababab",'
        b'"inode":[66,1234],"done":[[0,300],[500,600]],"check":"e797248d44212908"}'
    )


def test_a_suspended_slot_resumes_and_a_commit_publishes_and_forgets(store: CacheStore) -> None:
    slot = Slot(store, "k")
    _write(slot, 1000)
    slot.suspend()  # the transfer failed: the partial stays, the private name goes
    assert list(in_progress(store.layout)) == ["k"]
    again = Slot(store, "k").open(WHAT)
    assert again.done.to_list() == [[0, 1000]]
    os.close(again.fd)
    assert again.record is not None
    again.record.close()
    assert Slot(store, "k").open(Resumable(WHAT.url, '"other"', WHAT.size, SHA)).done.total() == 0


def test_a_partial_resumes_after_a_reboot_renumbered_its_device(store: CacheStore) -> None:
    """``st_dev`` names the device's enumeration this boot (NVMe partitions, ``dm-N``, NFS
    mounts number in mount order): a spot VM back with its disks in another order keeps
    every partial. The record lives beside its partial; its inode is what names the file."""
    slot = Slot(store, "k")
    dev, ino = _write(slot, 1000).inode
    slot.suspend()
    before = ResumeRecord(os.open(store.root / "partial" / "k.json", os.O_WRONLY), (dev + 7, ino))
    before.write(before.encode(WHAT, RangeSet.from_list([[0, 1000]], len(DATA))))
    before.close()
    again = Slot(store, "k").open(WHAT)
    os.close(again.fd)
    assert again.done.to_list() == [[0, 1000]]
    assert again.record is not None
    again.record.close()


def test_commit_publishes_the_slots_own_file_only(store: CacheStore, tmp_path: Path) -> None:
    slot = Slot(store, "k")
    _write(slot, len(DATA))
    stranger = tmp_path / "stranger"
    stranger.write_bytes(DATA)
    with pytest.raises(CacheError):
        slot.commit(VerifiedFile(stranger, len(DATA), SHA, "0" * 32, None, "sha256", 0, 0))
    slot = Slot(store, "k")
    _write(slot, len(DATA))
    assert slot.commit(_verified(slot)).read_bytes() == DATA
    assert in_progress(store.layout) == {} and os.listdir(store.root / "tmp") == []


def test_abandon_discards_partial_record_and_private_name(store: CacheStore) -> None:
    slot = Slot(store, "k")
    _write(slot, 1000)
    slot.abandon()
    assert in_progress(CacheLayout(store.root)) == {}
    assert os.listdir(store.root / "tmp") == []


async def test_the_slot_is_held_by_one_download_at_a_time(store: CacheStore) -> None:
    async with Slot(store, "k") as held:
        assert held.lock.held
        assert not Slot(store, "k").lock.try_acquire()
        with pytest.raises(CacheError):
            await asyncio.wait_for(Slot(store, "k").lock.acquire(timeout=0.05), 1)
    assert Slot(store, "k").lock.try_acquire()


def test_a_copy_holds_the_sources_bytes_and_publishes_under_their_hash(
    store: CacheStore, tmp_path: Path
) -> None:
    source = tmp_path / "model.safetensors"
    source.write_bytes(DATA)
    slot = Slot(store, "copied")
    copied = slot.copy_from(source, "stamp")
    assert (copied.size, copied.sha256, copied.etag) == (len(DATA), SHA, "stamp")
    assert (copied.verified, copied.source, copied.downloaded) == ("tofu", "local", 0)
    assert slot.commit(copied).read_bytes() == source.read_bytes()
    assert store.blob_path(SHA).read_bytes() == DATA
    assert list(store.fs.list_area(layout.TMP)) == []


async def test_a_commit_cancelled_before_its_thread_starts_still_publishes(
    store: CacheStore, tmp_path: Path
) -> None:
    """A job cancelled while its verified file waits for a thread (the pool busy with other
    files' copies): the publish runs to its end before the cancellation is raised, so the
    file is a blob, not a private name left in ``tmp/`` for the life of the process."""
    source = tmp_path / "model.safetensors"
    source.write_bytes(DATA)
    slot = Slot(store, "copied")
    copied = slot.copy_from(source, None)
    free = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        asyncio.get_running_loop().set_default_executor(pool)
        pool.submit(free.wait)  # the one thread is busy
        committing = asyncio.create_task(AsyncStore(store).commit(slot, copied))
        for _ in range(5):
            await asyncio.sleep(0)  # the commit waits in the pool's queue
        committing.cancel()
        free.set()
        with pytest.raises(asyncio.CancelledError):
            await committing
    assert store.blob_path(SHA).read_bytes() == DATA
    assert list(store.fs.list_area(layout.TMP)) == []


def test_a_full_disk_while_publishing_keeps_the_verified_download_to_resume(
    tmp_path: Path,
) -> None:
    """The disk fills (here its inodes) between the last byte and the blob's folder in the
    store: ``DiskFullError`` says the partial is kept, and it is, whole and resumable, so
    the next run publishes it without a byte downloaded again. (Only a failed ``fsync``
    drops it: its pages may be gone.)"""
    with tmpfs(tmp_path / "small", "size=4m,nr_inodes=64") as small:
        cache = CacheStore(small / "cache")
        slot = Slot(cache, "k")
        _write(slot, len(DATA))
        fillers = []
        with contextlib.suppress(OSError):
            while True:
                fillers.append(small / f"fill-{len(fillers)}")
                fillers[-1].touch()
        with pytest.raises(DiskFullError):
            slot.commit(_verified(slot))
        for filler in fillers:
            filler.unlink(missing_ok=True)
        again = Slot(cache, "k")
        partial = again.open(WHAT)
        os.close(partial.fd)
        assert partial.done.to_list() == [[0, len(DATA)]]
        assert partial.record is not None
        partial.record.close()
        assert again.commit(_verified(again)).read_bytes() == DATA


def test_a_copy_that_fills_the_disk_fails_clearly_and_leaves_nothing(tmp_path: Path) -> None:
    """ENOSPC halfway through a copy: ``DiskFullError``, no private file left in ``tmp/``,
    no partial (a copy is never resumed), and the source untouched."""
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(3 << 20))
    with tmpfs(tmp_path / "small", "size=1m") as small:
        cache = CacheStore(small / "cache")
        slot = Slot(cache, "big")
        with pytest.raises(DiskFullError):
            slot.copy_from(source, None)
        assert list(cache.fs.list_area(layout.TMP)) == []
        assert in_progress(cache.layout) == {}
    assert source.stat().st_size == 3 << 20
