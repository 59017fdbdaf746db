"""File locks that silently do nothing (as ``flock`` on some network filesystems).

The design says locks only prevent duplicate work and correctness never depends on them.
Here several ``shardsync prefetch`` processes and a real daemon fetch the same checkpoint
into one cache at once, with ``fcntl.flock``/``fcntl.lockf`` replaced by no-ops in every
one of them (a ``sitecustomize`` on ``PYTHONPATH``), and a bandwidth cap so the downloads
really overlap. Without locks each process downloads what it does not find published yet:
the work is duplicated, yet every process must succeed and the cache must end with exactly
one verified blob per file, no temp files, and a byte-exact snapshot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemons import api, short_tmp
from helpers import assert_snapshot_matches, assert_store_verified, serving

from shardsync.cache import CacheStore
from shardsync.records import RepoRef
from shardsync.testing import Bandwidth, Checkpoint, FakeHub, build_checkpoint
from shardsync.testing.daemons import DaemonProcess, write_config

REPO = "acme/lockless"
LATE_CLIENTS = 2
"""In-process ``prefetch`` runs that start while the first ones are under way."""

_NO_LOCKS = textwrap.dedent(
    """
    import fcntl, os

    def _no_lock(*args, **kwargs):
        return None

    fcntl.flock = _no_lock
    fcntl.lockf = _no_lock
    with open(os.path.join(os.environ["LOCKLESS_MARKS"], str(os.getpid())), "w"):
        pass
    """
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt"), total_bytes=12 << 20, n_shards=4, seed=6
    )


@pytest.fixture
def hub(checkpoint: Checkpoint) -> Iterator[FakeHub]:
    with serving({REPO: checkpoint}) as running:
        yield running


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_tmp() as path:
        yield path


def _lockless_env(workdir: Path) -> dict[str, str]:
    """Every Python process started with it runs without file locks and leaves a mark."""
    site = workdir / "nolocks"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_NO_LOCKS)
    marks = workdir / "marks"
    marks.mkdir()
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "LOCKLESS_MARKS": str(marks)}


def test_no_op_locks_duplicate_work_but_never_break_the_cache(
    hub: FakeHub, checkpoint: Checkpoint, workdir: Path
) -> None:
    cache = workdir / "cache"
    socket_path = workdir / "shardsync" / "d.sock"
    config = write_config(
        workdir / "d.toml", cache=cache, endpoint=hub.endpoint, socket_path=socket_path
    )
    env = {**os.environ, **_lockless_env(workdir)}
    shards = checkpoint.shards
    shard_bytes = sum(checkpoint.path(s).stat().st_size for s in shards)
    # 2 connections per file, 4 files at once: ~2.4 MB/s per process, ~5 s for one copy.
    hub.faults.add(Bandwidth(300_000, times=None))
    cmd = [sys.executable, "-m", "shardsync.cli", "--config", str(config), "prefetch", REPO]

    def client(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*cmd, *args, "--quiet", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    daemon = DaemonProcess(config, workdir, env=env)
    try:
        daemon.start()
        # The daemon and one process start together; two more join when the first two have
        # left resume records next to the partial files they are writing.
        procs = [client(), client("--no-daemon")]
        deadline = time.monotonic() + 60
        while hub.bytes_served("*.safetensors") < 0.3 * shard_bytes:
            if any(p.poll() is not None for p in procs):
                break  # one ended early: its exit status tells why, below
            assert time.monotonic() < deadline, hub.bytes_served("*.safetensors")
            time.sleep(0.02)
        procs += [client("--no-daemon") for _ in range(LATE_CLIENTS)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.output()
        _, status = asyncio.run(api(socket_path, "GET", "/v1/status"))
    finally:
        daemon.close()
    marked = {int(name) for name in os.listdir(env["LOCKLESS_MARKS"])}
    assert daemon.proc is not None
    assert {daemon.proc.pid, *(p.pid for p in procs)} <= marked  # no process had working locks

    # Every process succeeds: a blob someone else published first is as good as one's own.
    assert [p.returncode for p in procs] == [0] * len(procs), [err for _, err in outs]
    results = [json.loads(out) for out, _ in outs]
    # The first client's job ran in the daemon, which downloaded too.
    assert status["jobs_submitted"] == 1 and status["bytes_downloaded"] > 0, status
    # The locks were really gone: the two first processes each fetched every shard. The late
    # ones found partial files still being written (each has a second, private name while its
    # download lives) and did not trust them: they downloaded afresh, never through them.
    assert hub.bytes_served("*.safetensors") > 1.5 * shard_bytes
    late = [sum(f["resumed"] for f in r["files"]) for r in results[2:]]
    assert late == [0] * LATE_CLIENTS, late

    snapshot = Path(results[0]["snapshot_path"])
    assert {r["snapshot_path"] for r in results} == {str(snapshot)}
    assert_snapshot_matches(snapshot, checkpoint)
    assert_store_verified(cache, checkpoint)
    blobs = list((cache / "store" / "sha256").glob("*/*"))
    assert len(blobs) == len(checkpoint.files)  # one blob per file, no duplicates
    assert {stat.S_IMODE(p.stat().st_mode) for p in blobs} == {0o444}
    hub_blobs = list((snapshot.parent.parent / "blobs").iterdir())
    assert len(hub_blobs) == len(checkpoint.files)
    assert not list((cache / "partial").iterdir())
    assert not list((cache / "tmp").iterdir())


def test_concurrent_links_of_one_blob_leave_no_temp_names(tmp_path: Path) -> None:
    """``link_file`` takes no lock at all, so racing linkers must clean up after themselves.

    Each linker hard-links the store blob to a temp name and renames it onto
    ``blobs/<etag>``; when another linker got there first, both names are links to the same
    inode and rename(2) does nothing, leaving the temp name (a second link that would keep
    the blob's bytes alive after a prune removes it).
    """
    store = CacheStore(tmp_path / "cache")
    repo = RepoRef(kind="hub", name="acme/links")
    for round_ in range(100):
        data = f"blob {round_}".encode()
        sha = hashlib.sha256(data).hexdigest()
        temp = tmp_path / "download.part"
        temp.write_bytes(data)
        store.publish_blob(temp, sha)
        start = threading.Barrier(4)

        def link(n: int, sha: str = sha, start: threading.Barrier = start) -> None:
            start.wait()
            store.link_file(repo, "c" * 40, f"f{n}", sha256=sha, etag=sha)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(link, range(4)))
    assert not list((tmp_path / "cache" / "tmp").iterdir())
    blobs = store.layout.repo(repo.dirname) / "blobs"
    assert all(p.stat().st_nlink == 2 for p in blobs.iterdir())  # the store's name and this one
