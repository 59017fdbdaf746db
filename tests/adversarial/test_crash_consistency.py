"""Crash consistency (promises 1 and 2): ``kill -9`` at every publishing step, fsync failures.

``crashhook.py`` runs the real CLI with the OS calls of publishing wrapped (its docstring names
the steps). A traced clean run lists them; each case then SIGKILLs ``shardsync prefetch`` right
before or right after one step (or at a seeded-random byte of blob data) and checks what a
reader finds on disk:

- every store blob hashes to its name, every ``blobs/<etag>`` to its etag, and every snapshot
  entry that exists is the checkpoint's file, byte for byte;
- the snapshot record and the ref exist exactly when the trace says their rename ran, and
  then for a complete snapshot; ``huggingface_hub.scan_cache_dir`` finds nothing wrong;

then reruns prefetch (a byte-exact snapshot) and checks that nothing is left in ``tmp/`` or
``partial/``: the crash's temp names carry its dead pid and are swept, the partial of a blob
published just before the kill is dropped, and a later prune keeps the snapshot.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from crashhook import ENV_ACTION, ENV_ROOT, ENV_TRACE
from daemons import cli, short_tmp
from helpers import assert_snapshot_matches, assert_store_verified, fast_config
from huggingface_hub import scan_cache_dir

from shardsync.cache import CacheStore
from shardsync.prefetch import prefetch
from shardsync.prune import prune_cache
from shardsync.prune_plan import Limits
from shardsync.records import PrefetchResult, RepoRef
from shardsync.testing import Checkpoint, FakeHub, build_checkpoint, serve_in_thread
from shardsync.testing.daemons import DaemonProcess, write_config

REPO = "acme/crash"
DIRNAME = "models--acme--crash"
HOOK = Path(__file__).with_name("crashhook.py")


@dataclass(frozen=True, slots=True)
class Served:
    """The checkpoint on a fake Hub, and the CLI config of the hooked runs."""

    endpoint: str
    commit: str
    checkpoint: Checkpoint
    config: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("crash")
    checkpoint = build_checkpoint(work / "ckpt", total_bytes=4 << 20, n_shards=3, seed=6)
    config = work / "shardsync.toml"
    config.write_text(  # several data writes per shard, resume records every 20 ms
        '[download]\nconnections_per_file = 2\nchunk_size = "512KiB"\nwrite_size = "128KiB"\n'
        'read_size = "64KiB"\nsidecar_interval = 0.02\n'
        "[retry]\nbase_delay = 0.01\nmax_delay = 0.1\n"
    )
    hub = FakeHub()
    commit = hub.add_checkpoint(REPO, checkpoint)
    with serve_in_thread(hub):
        yield Served(hub.endpoint, commit, checkpoint, config)


@dataclass(frozen=True, slots=True)
class Run:
    """A hooked ``shardsync prefetch`` that ended (or was killed)."""

    returncode: int
    pid: int
    stderr: str
    lines: list[str]  # the trace: steps in lower case, the hook's action in upper case

    @property
    def steps(self) -> list[str]:
        return [line for line in self.lines if line[:1].islower()]

    @property
    def done(self) -> list[str]:
        """The steps that ran: a step killed before it or failed with EIO did not."""
        done: list[str] = []
        for line in self.lines:
            if line[:1].islower():
                done.append(line)
            elif line.startswith(("KILL before", "EIO")):
                done.pop()
        return done

    @property
    def marker(self) -> str:
        return self.lines[-1] if self.lines else ""

    def __str__(self) -> str:
        """For failure messages: how it ended, its stderr and the end of its trace."""
        return f"exit {self.returncode}: {self.stderr.strip()}; trace ends {self.lines[-8:]}"


def run_hooked(cache: Path, action: str | None, *args: str) -> Run:
    trace = cache.with_name(cache.name + ".trace")
    env = {**os.environ, ENV_ROOT: str(cache), ENV_TRACE: str(trace)}
    if action is not None:
        env[ENV_ACTION] = action
    proc = subprocess.Popen(
        [sys.executable, str(HOOK), *args, "--cache-dir", str(cache), "--no-daemon", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _, stderr = proc.communicate(timeout=60)
    lines = trace.read_text().splitlines() if trace.exists() else []
    return Run(proc.returncode, proc.pid, stderr, lines)


def prefetch_hooked(served: Served, cache: Path, action: str | None) -> Run:
    args = ("--config", str(served.config), "prefetch", REPO, "--endpoint", served.endpoint)
    return run_hooked(cache, action, *args)


def rerun(served: Served, cache: Path) -> PrefetchResult:
    """A plain prefetch after the crash, in this process."""
    result = asyncio.run(prefetch(REPO, fast_config(cache, served.endpoint)))
    assert result.commit == served.commit
    assert_snapshot_matches(result.snapshot_path, served.checkpoint)
    return result


def nth(steps: list[str], selector: str, which: str) -> int:
    """Which matching step of the clean run ``which`` (first, mid, last) names."""
    count = steps.count(selector.replace("/", " "))
    assert count, f"the clean run has no {selector} step"
    return {"first": 1, "mid": (count + 1) // 2, "last": count}[which]


@pytest.fixture(scope="module")
def clean(served: Served, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The steps of an undisturbed run, in order."""
    run = prefetch_hooked(served, tmp_path_factory.mktemp("clean") / "cache", None)
    assert run.returncode == 0, str(run)
    return run.steps


# --------------------------------------------------------------------------- invariants


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def assert_consistent(served: Served, cache: Path, done: list[str] | None) -> None:
    """What any reader may find after a crash; ``done`` (the steps that ran) says exactly
    which of record, ref and store blobs must exist; None: the snapshot must be complete."""
    assert_store_verified(cache, served.checkpoint)
    repo_dir = cache / "hub" / DIRNAME
    for blob in repo_dir.glob("blobs/*"):
        data = blob.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if len(blob.name) == 64 else _git_blob_id(data)
        assert etag == blob.name, f"{blob} does not hold what its name says"
    snapshot = repo_dir / "snapshots" / served.commit
    for entry in snapshot.rglob("*"):
        if entry.is_dir() and not entry.is_symlink():
            continue
        rel = entry.relative_to(snapshot).as_posix()
        assert entry.is_symlink() and entry.is_file(), f"snapshot entry {rel} is not a blob link"
        assert entry.read_bytes() == served.checkpoint.path(rel).read_bytes(), rel
    record = cache / "state" / "snapshots" / DIRNAME / f"{served.commit}.json"
    ref = repo_dir / "refs" / "main"
    if done is None:
        assert record.is_file() and ref.is_file()
    else:
        assert record.exists() == ("rename record" in done)
        assert ref.exists() == ("rename ref" in done)
        assert len(list(cache.glob("store/sha256/*/*"))) == done.count("link store")
    store, repo = CacheStore(cache), RepoRef("hub", REPO)
    if record.exists():
        assert store.find_complete(repo, served.commit) is not None
        assert_snapshot_matches(snapshot, served.checkpoint)
    if ref.exists():
        assert ref.read_text() == served.commit
        assert store.find_complete(repo, "main") is not None
    assert not scan_cache_dir(cache / "hub").warnings


def leftovers(cache: Path) -> set[str]:
    """Entries of ``tmp/`` and ``partial/`` (``area/name``)."""
    return {
        f"{p.parent.name}/{p.name}" for area in ("tmp", "partial") for p in cache.glob(f"{area}/*")
    }


def assert_rerun_cleans_up(served: Served, cache: Path, crashed: Run) -> None:
    """Rerun, then: nothing left in ``tmp/`` or ``partial/`` (the crash's temp names carry
    its dead pid; a partial already published is dropped), and a prune finds nothing else."""
    after_crash = leftovers(cache)
    rerun(served, cache)
    assert_consistent(served, cache, None)
    assert leftovers(cache) == set(), f"after the rerun (the crash left {sorted(after_crash)})"
    for name in after_crash:  # each was the killed one's: <purpose>.<host>.<pid>-<start>.<hex>
        area, _, base = name.partition("/")
        if area == "tmp":
            assert base.split(".")[2].partition("-")[0] == str(crashed.pid), name
    prune_cache(CacheStore(cache), Limits(stale_age=0.0))
    assert not list(cache.glob("state/leases/*")), "the killed process's lease outlived a prune"
    assert_consistent(served, cache, None)


# --------------------------------------------------------------------------- the steps


def test_a_clean_run_publishes_in_promise_order(served: Served, clean: list[str]) -> None:
    files = len(served.checkpoint.files)
    for step in ("fsync_file partial", "link store", "fsync_dir store", "rename snapshot"):
        assert clean.count(step) == files, step
    assert clean.count("write partial") > 2 * len(served.checkpoint.shards)

    def first(step: str) -> int:
        return clean.index(step)

    def last(step: str) -> int:
        return len(clean) - 1 - clean[::-1].index(step)

    # each blob: data, file fsync, link to its final name, directory fsync
    assert first("write partial") < first("fsync_file partial") < first("link store")
    assert first("link store") < first("fsync_dir store")
    assert first("link store") < first("link blobs") < first("rename blobs")
    assert first("rename blobs") < first("symlink snapshot") < first("rename snapshot")
    # the view's folders are durable before the record says the snapshot is complete
    assert last("rename snapshot") < last("fsync_dir blobs") < first("write record")
    assert last("rename snapshot") < last("fsync_dir snapshot") < first("write record")
    # the snapshot is marked complete last: its record, then the ref
    tail = [
        "write record",
        "fsync_file record",
        "rename record",
        "fsync_dir record",
        "write ref",
        "fsync_file ref",
        "rename ref",
        "fsync_dir ref",
    ]
    positions = [first(step) for step in tail]
    assert positions == sorted(positions)
    for step in ("write partial", "fsync_dir store", "rename snapshot", "rename sidecar"):
        assert last(step) < first("write record"), step


# --------------------------------------------------------------------------- kill -9


@dataclass(frozen=True, slots=True)
class Point:
    mode: str  # kill (right before the step) | killafter (right after it)
    selector: str
    which: str  # first | mid | last matching step of the clean run

    def __str__(self) -> str:
        return f"{self.mode}-{self.selector.replace('/', '-')}-{self.which}"


POINTS = [
    Point("kill", "write/partial", "first"),
    Point("killafter", "write/partial", "mid"),
    Point("kill", "rename/sidecar", "first"),
    Point("kill", "fsync_file/partial", "first"),
    Point("killafter", "fsync_file/partial", "last"),
    Point("kill", "link/store", "mid"),
    Point("killafter", "link/store", "last"),
    Point("kill", "fsync_dir/store", "last"),
    Point("killafter", "fsync_dir/store", "mid"),
    Point("killafter", "unlink/partial", "first"),
    Point("killafter", "link/blobs", "first"),
    Point("kill", "rename/blobs", "mid"),
    Point("killafter", "rename/blobs", "last"),
    Point("killafter", "symlink/snapshot", "mid"),
    Point("kill", "rename/snapshot", "last"),
    Point("killafter", "rename/snapshot", "first"),
    Point("kill", "write/record", "first"),
    Point("killafter", "write/record", "first"),
    Point("killafter", "fsync_file/record", "first"),
    Point("killafter", "rename/record", "first"),
    Point("killafter", "fsync_dir/record", "first"),
    Point("kill", "write/ref", "first"),
    Point("killafter", "fsync_file/ref", "first"),
    Point("killafter", "rename/ref", "first"),
    Point("killafter", "fsync_dir/ref", "first"),
]


@pytest.mark.parametrize("point", POINTS, ids=str)
def test_kill_9_at_a_publish_step(
    served: Served, clean: list[str], point: Point, tmp_path: Path
) -> None:
    n = nth(clean, point.selector, point.which)
    cache = tmp_path / "cache"
    run = prefetch_hooked(served, cache, f"{point.mode}:{point.selector}:{n}")
    step = point.selector.replace("/", " ")
    assert run.returncode == -signal.SIGKILL, str(run)
    assert run.marker == f"KILL {'before' if point.mode == 'kill' else 'after'} {step}"
    assert run.steps.count(step) == n
    assert_consistent(served, cache, run.done)
    assert_rerun_cleans_up(served, cache, run)


_RNG = random.Random(6)
BYTE_FRACTIONS = [_RNG.uniform(0.01 + third / 3, (third + 1) / 3 - 0.01) for third in range(3)]
"""Where the kill lands, as a fraction of all blob bytes: one in each third, seeded."""


@pytest.mark.parametrize("fraction", BYTE_FRACTIONS, ids=lambda f: f"{f:.3f}")
def test_kill_9_at_a_random_byte_of_blob_data(
    served: Served, fraction: float, tmp_path: Path
) -> None:
    total = sum(served.checkpoint.path(rel).stat().st_size for rel in served.checkpoint.files)
    offset = int(fraction * total)
    cache = tmp_path / "cache"
    run = prefetch_hooked(served, cache, f"killbytes:{offset}")
    assert run.returncode == -signal.SIGKILL, str(run)
    assert run.marker == f"KILL at byte {offset} in write partial"
    assert_consistent(served, cache, run.done)
    assert_rerun_cleans_up(served, cache, run)


# --------------------------------------------------------------------------- fsync failures


@pytest.mark.parametrize(
    ("selector", "which"),
    [
        ("fsync_file/partial", "last"),
        ("fsync_dir/store", "first"),
        ("write/record", "first"),
        ("fsync_file/record", "first"),
    ],
)
def test_an_io_error_while_publishing_is_one_clear_error(
    served: Served, clean: list[str], selector: str, which: str, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    run = prefetch_hooked(served, cache, f"eio:{selector}:{nth(clean, selector, which)}")
    assert f"EIO {selector.replace('/', ' ')}" in run.lines
    assert run.returncode == 9, str(run)  # CacheError: the cache cannot be used
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardsync: error:"), run.stderr
    assert "Input/output error" in lines[0]
    assert_consistent(served, cache, run.done)  # no record, no ref: nothing claims completion
    after = leftovers(cache)
    result = rerun(served, cache)
    assert_consistent(served, cache, None)
    if selector == "fsync_file/partial":
        # After a failed fsync the kernel may have dropped the dirty pages: what a read
        # returns is not what is on the disk, so the file is downloaded again, not resumed.
        resumed = [f.path for f in result.files if f.resumed]
        assert not resumed, f"{resumed} resumed from a file whose fsync failed"
    assert leftovers(cache) == set(), f"after the rerun (the failure left {sorted(after)})"


SETPRIV = shutil.which("setpriv")


def _rerun_unprivileged(
    served: Served, work: Path, cache: Path
) -> subprocess.CompletedProcess[str]:
    """``shardsync prefetch`` as a user who owns the cache but is not root (root ignores file
    modes). As root: the run keeps uid 0, which owns the cache, but loses every capability
    (``setpriv``), so file modes bind it as they bind any owner. Switching to another uid
    instead would make the run depend on where the checkout and the interpreter live (a
    ``mktemp -d`` clone, or a Python under ``/root``, is unreadable to uid 65534)."""
    args = [REPO, "--endpoint", served.endpoint, "--cache-dir", str(cache), "--no-daemon"]
    env = {**os.environ, "HOME": str(work), "HF_HOME": str(work / "hf")}
    if os.geteuid() != 0:
        return cli("prefetch", *args, "--quiet", env=env)
    if SETPRIV is None:
        pytest.skip("as root this needs setpriv (util-linux) to drop the capabilities")
    drop = [SETPRIV, "--bounding-set=-all", "--inh-caps=-all"]
    probe = subprocess.run([*drop, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot drop capabilities here: {probe.stderr.strip()}")
    script = "import sys, shardsync.cli\nsys.exit(shardsync.cli.main(sys.argv[1:]))\n"
    return subprocess.run(
        [*drop, sys.executable, "-c", script, "prefetch", *args, "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=work,
    )


@pytest.mark.parametrize("mode", ["kill", "killafter"])
def test_a_crash_inside_publish_never_wedges_a_rerun(served: Served, mode: str) -> None:
    """Killed between publishing's ``chmod 0444`` and the temp file's unlink, the partial is
    read-only (and, after the link, a second name of the published blob): the next run must
    neither fail on it nor write through it. The kill lands at a shard's link, chosen by
    name: its record says every byte is on disk, so the rerun reopens that partial. (Chosen
    by count, the last link was a small file's once in a few runs on busy cores: a small file
    has nothing to resume and is made afresh, and the reopening went untested.)"""
    shard = max(
        served.checkpoint.shards, key=lambda rel: served.checkpoint.path(rel).stat().st_size
    )
    sha256 = hashlib.sha256(served.checkpoint.path(shard).read_bytes()).hexdigest()
    with short_tmp() as work:
        cache = work / "cache"
        run = prefetch_hooked(served, cache, f"{mode}:link/store@{sha256}:1")
        assert run.returncode == -signal.SIGKILL, str(run)
        part = cache / "partial" / f"{sha256}.part"
        assert stat.S_IMODE(part.stat().st_mode) == 0o444
        out = _rerun_unprivileged(served, work, cache)
        assert out.returncode == 0, out.stderr
        assert_snapshot_matches(Path(out.stdout.strip()), served.checkpoint)
        assert_store_verified(cache, served.checkpoint)


def test_a_local_copy_never_writes_through_a_published_blob(served: Served, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(served.checkpoint.directory, source)
    cache = tmp_path / "cache"
    run = run_hooked(cache, "killafter:link/store:1", "prefetch", str(source))
    assert run.returncode == -signal.SIGKILL, str(run)
    (linked,) = [p for p in cache.glob("tmp/copy.*") if p.stat().st_nlink > 1]
    (edited,) = [p for p in source.iterdir() if p.read_bytes() == linked.read_bytes()]
    edited.write_bytes(edited.read_bytes() + b"\n")  # the index, still valid JSON
    asyncio.run(prefetch(str(source), fast_config(cache)))
    assert_store_verified(cache, served.checkpoint, source)


# --------------------------------------------------------------------------- the daemon


class HookedDaemon(DaemonProcess):
    """``shardsync daemon`` started through ``crashhook.py``."""

    def start(self) -> dict[str, str]:
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(self.notify_path)}
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HOOK), "daemon", "--config", str(self.config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        return self.wait_for("READY")


def test_daemon_killed_at_a_publish_step_then_restarted(served: Served) -> None:
    with short_tmp() as work:
        cache = work / "cache"
        trace = work / "trace"
        config = write_config(
            work / "d.toml",
            cache=cache,
            endpoint=served.endpoint,
            socket_path=work / "shardsync" / "d.sock",
        )
        env = {ENV_ROOT: str(cache), ENV_TRACE: str(trace), ENV_ACTION: "killafter:link/store:3"}
        hooked = HookedDaemon(config, work, env)
        try:
            hooked.start()
            client = cli("--config", str(config), "prefetch", REPO, "--quiet")
            assert hooked.wait() == -signal.SIGKILL, hooked.output()
        finally:
            hooked.close()
        lines = client.stderr.strip().splitlines()
        assert client.returncode == 11, client.stderr  # DaemonError
        assert len(lines) == 1 and lines[0].startswith("shardsync: error:"), client.stderr
        assert "daemon" in lines[0] and "Traceback" not in client.stderr
        crashed = Run(-signal.SIGKILL, 0, "", trace.read_text().splitlines())
        assert crashed.marker == "KILL after link store"
        assert_consistent(served, cache, crashed.done)
        restarted = DaemonProcess(config, work)
        try:
            restarted.start()
            again = cli("--config", str(config), "prefetch", REPO, "--quiet", "--json")
            assert again.returncode == 0, again.stderr
            snapshot = Path(json.loads(again.stdout)["snapshot_path"])
            assert_snapshot_matches(snapshot, served.checkpoint)
            assert_consistent(served, cache, None)
            restarted.signal(signal.SIGTERM)
            assert restarted.wait() == 0
        finally:
            restarted.close()
