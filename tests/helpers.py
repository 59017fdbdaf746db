"""Shared assertions for engine tests: byte-identical snapshots, nothing unverified published."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from shardsync.config import Config, DaemonConfig
from shardsync.fetch import FetchConfig
from shardsync.retry import RetryPolicy
from shardsync.testing import Checkpoint, FakeHub, serve_in_thread


def fast_config(cache_dir: Path, endpoint: str | None = None, **fetch: object) -> Config:
    """Small chunks (several Range requests per shard) and near-instant retries.

    The daemon socket points nowhere, so a daemon running on the developer's machine is
    never used by accident (tests that want one configure it).
    """
    base = FetchConfig(
        connections_per_file=4,
        chunk_size=256 * 1024,
        read_size=64 * 1024,
        write_size=128 * 1024,
        read_timeout=5.0,
        retry=RetryPolicy(max_attempts=6, base_delay=0.001, max_delay=0.01),
    )
    return Config(
        cache_dir=cache_dir,
        endpoint=endpoint,
        max_files=4,
        fetch=replace(base, **fetch),
        daemon=DaemonConfig(socket=cache_dir / "no-daemon" / "d.sock"),
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def assert_snapshot_matches(snapshot: Path, checkpoint: Checkpoint) -> None:
    """Every file of the checkpoint is in the snapshot with identical bytes."""
    for rel in checkpoint.files:
        got = snapshot / rel
        assert got.is_file(), f"{rel} missing from {snapshot}"
        assert got.read_bytes() == checkpoint.path(rel).read_bytes(), f"{rel} differs"


def assert_store_verified(cache_dir: Path) -> None:
    """Promise 1: every blob under its final name hashes to that name."""
    store = cache_dir / "store" / "sha256"
    for blob in store.glob("*/*"):
        assert sha256_file(blob) == blob.name, f"published blob {blob} has the wrong content"


class SleepRecorder:
    """An injected ``sleep`` that records delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


Sleep = Callable[[float], Awaitable[None]]


@contextlib.contextmanager
def serving(checkpoints: dict[str, Checkpoint]) -> Iterator[FakeHub]:
    """A fake Hub holding each checkpoint under its repo id, served from a background thread
    (for tests whose clients are real processes or blocking calls)."""
    fake = FakeHub()
    for repo, checkpoint in checkpoints.items():
        fake.add_checkpoint(repo, checkpoint)
    with serve_in_thread(fake) as running:
        yield running


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real small filesystem at ``path`` (e.g. ``"size=1m"``), so the disk fills for real.

    Skips the test where mounting is impossible (not root, no ``mount``, no privileges).
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            check=False,
        )
    except FileNotFoundError:
        pytest.skip("no mount binary")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
