"""The one rule for blocking work: no store call runs on the event loop.

One job's snapshot publish fsyncs every folder of its snapshot and then its record; made slow
here (a real fsync after a 1 s sleep, as on a busy disk), it must not stall another job's
transfer sharing the loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import fast_config

from shardsync.cache import CacheStore
from shardsync.prefetch import Engine, prefetch
from shardsync.records import FileOutcome
from shardsync.testing import FakeHub, build_checkpoint, serve_in_thread
from shardsync.testing.faults import Bandwidth

SLOW = 1.0  # seconds one fsync of the small job's snapshot takes


class _Timeline:
    """When the big job's bytes arrived, as the engine reported them."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []
        self.flowing = asyncio.Event()  # a first MiB arrived

    def add_file(self, path: str, size: int | None) -> None:
        return None

    def advance(self, path: str, nbytes: int) -> None:
        self.arrivals.append((time.monotonic(), nbytes))
        if sum(n for _, n in self.arrivals) >= 1 << 20:
            self.flowing.set()

    def file_done(self, outcome: FileOutcome) -> None:
        return None

    def between(self, start: float, end: float) -> int:
        return sum(n for at, n in self.arrivals if start <= at <= end)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    hub = FakeHub()
    small = build_checkpoint(tmp_path / "s", total_bytes=64 << 10, n_shards=1)
    big = build_checkpoint(tmp_path / "b", total_bytes=24 << 20, n_shards=2, seed=3)
    hub.add_checkpoint("acme/small", small)
    hub.add_checkpoint("acme/big", big)
    hub.faults.add(Bandwidth(1 << 20))  # per connection: the big job takes several seconds
    with serve_in_thread(hub):
        yield hub


def test_a_slow_snapshot_fsync_never_stalls_another_jobs_transfer(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync
    window: list[float] = []
    first = threading.Lock()

    def fsync(fd: int) -> None:
        """The small job's first snapshot folder fsync (its publish) takes SLOW seconds."""
        where = os.readlink(f"/proc/self/fd/{fd}")
        if "models--acme--small" in where and "/snapshots/" in where and first.acquire(False):
            window.append(time.monotonic())
            time.sleep(SLOW)
            window.append(time.monotonic())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    timeline = _Timeline()

    async def main() -> None:
        async with Engine(fast_config(tmp_path / "cache", hub.endpoint)) as engine:
            big = engine.job(engine.origin("acme/big"), sink=timeline)
            small = engine.job(engine.origin("acme/small"))

            async def big_job() -> None:
                await big.prepare()
                await big.download()

            async def small_job() -> None:
                await timeline.flowing.wait()
                await small.prepare()
                await small.download()

            async with asyncio.TaskGroup() as tg:
                tg.create_task(big_job())
                tg.create_task(small_job())

    asyncio.run(main())
    assert len(window) == 2, "the small job's snapshot was never fsynced"
    moved = timeline.between(*window)
    print(f"\nbytes the big job moved during a {SLOW:.0f} s fsync of the small job: {moved}")
    assert timeline.between(window[1], float("inf")) > 0, "the big job ended before the fsync"
    assert moved >= 512 << 10, f"the transfer stalled: {moved} bytes in {SLOW} s"


def test_no_fsync_runs_on_the_event_loop(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule itself: a whole download (prepare, files, links, record, ref, lease, access
    log) fsyncs only from worker threads."""
    real_fsync = os.fsync
    on_loop: list[str] = []

    def fsync(fd: int) -> None:
        if asyncio._get_running_loop() is not None:  # this thread runs the event loop
            on_loop.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    config = fast_config(tmp_path / "cache", hub.endpoint)
    CacheStore(config.cache_dir)  # a daemon makes its cache once, before it serves
    monkeypatch.setattr(os, "fsync", fsync)
    asyncio.run(prefetch("acme/small", config))
    assert on_loop == []
