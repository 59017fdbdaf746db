"""The access log and leases: real files, real processes (kill -9, zombies, recycled pids)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import fast_config

from shardsync import snapshot_use
from shardsync.cache import CacheStore
from shardsync.errors import CacheError
from shardsync.prefetch import prefetch
from shardsync.prune import prune_cache
from shardsync.prune_plan import Limits
from shardsync.records import RepoRef
from shardsync.snapshot_use import FOREIGN_LEASE_AGE, MAX_LOG_BYTES, AccessLog, Leases, prune_gate
from shardsync.testing import Checkpoint, FakeHub, Status

REPO = RepoRef("hub", "acme/tiny")
COMMIT = "c" * 40


@pytest.fixture
def cache(tmp_path: Path) -> CacheStore:
    return CacheStore(tmp_path / "cache")


# --------------------------------------------------------------------------- access log


def test_access_log_keeps_the_last_use(cache: CacheStore) -> None:
    times = iter([10.0, 30.0, 20.0])
    log = AccessLog(cache, clock=lambda: next(times))
    log.record(REPO, COMMIT)
    log.record(REPO, COMMIT)
    log.record(RepoRef("hub", "acme/other"), COMMIT)
    assert log.last_used() == {
        ("models--acme--tiny", COMMIT): 30.0,
        ("models--acme--other", COMMIT): 20.0,
    }
    assert _lines(cache) == 3


def _lines(cache: CacheStore) -> int:
    return len(cache.layout.state("access.log").read_bytes().split())


def test_access_log_skips_torn_lines(cache: CacheStore) -> None:
    AccessLog(cache, clock=lambda: 5.0).record(REPO, COMMIT)
    with cache.layout.state("access.log").open("ab") as f:
        f.write(b'{"t": 9, "repo": "models--acme--tiny", "comm')  # a crash mid-append
    AccessLog(cache, clock=lambda: 7.0).record(REPO, COMMIT)
    assert AccessLog(cache).last_used() == {("models--acme--tiny", COMMIT): 7.0}


def test_access_log_is_compacted(cache: CacheStore) -> None:
    log = AccessLog(cache, clock=lambda: 1.0)
    for commit in ("a" * 40, "b" * 40):
        log.record(REPO, commit)
        log.record(REPO, commit)
    assert log.compact(keep=[("models--acme--tiny", "a" * 40)])
    assert log.last_used() == {("models--acme--tiny", "a" * 40): 1.0}
    assert _lines(cache) == 1


def test_access_log_stays_bounded(cache: CacheStore) -> None:
    path = cache.layout.state("access.log")
    line = json.dumps({"t": 1.0, "repo": "models--acme--tiny", "commit": COMMIT}) + "\n"
    path.write_text(line * (MAX_LOG_BYTES // len(line) + 1))
    AccessLog(cache, clock=lambda: 2.0).record(REPO, COMMIT)
    assert path.stat().st_size < 1000
    assert AccessLog(cache).last_used() == {("models--acme--tiny", COMMIT): 2.0}


# --------------------------------------------------------------------------- leases


def test_hold_and_release(cache: CacheStore) -> None:
    leases = Leases(cache)
    with leases.hold(REPO, COMMIT, owner="test") as lease:
        (live,) = leases.live()
        assert (live.id, live.repo, live.commit, live.pid) == (
            lease.id,
            "acme/tiny",
            COMMIT,
            os.getpid(),
        )
        assert live.covers("models--acme--tiny", COMMIT)
        assert not live.covers("models--acme--tiny", "d" * 40)
    assert lease.released and leases.all() == ()
    lease.release()  # idempotent
    with leases.hold(REPO, owner="whole repo") as whole:
        assert whole.info.covers("models--acme--tiny", "d" * 40)


async def test_ahold_in_an_event_loop(cache: CacheStore) -> None:
    async with await Leases(cache).ahold(REPO, COMMIT, owner="async") as lease:
        assert [x.id for x in Leases(cache).live()] == [lease.id]
    assert Leases(cache).all() == ()


async def test_ahold_cancelled_while_writing_leaves_no_lease(
    cache: CacheStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is written in a worker thread; a cancellation mid-write takes it back."""
    written = threading.Event()
    real = snapshot_use._write_lease

    def slow_write(*args: object) -> None:
        time.sleep(0.2)
        real(*args)  # type: ignore[arg-type]
        written.set()

    monkeypatch.setattr(snapshot_use, "_write_lease", slow_write)
    taking = asyncio.create_task(Leases(cache).ahold(REPO, COMMIT, owner="cancelled"))
    await asyncio.sleep(0.05)
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    await asyncio.to_thread(written.wait, 5)
    await asyncio.sleep(0.05)  # the callback that takes it back
    assert Leases(cache).all() == ()


async def test_a_lease_names_the_blobs_it_keeps_and_a_released_one_writes_nothing(
    cache: CacheStore,
) -> None:
    kept = ("a" * 64, "b" * 64)
    async with await Leases(cache).ahold(REPO, owner="job", blobs=kept[:1]) as lease:
        await lease.akeep(kept[1])
        await lease.akeep(kept[1])  # once is enough
        (live,) = Leases(cache).live()
        assert live.blobs == kept
        with pytest.raises(CacheError):
            await lease.akeep("../../etc")
    await lease.akeep("c" * 64)
    assert Leases(cache).all() == ()


def test_invalid_arguments(cache: CacheStore) -> None:
    with pytest.raises(CacheError):
        Leases(cache).hold(REPO, "main", owner="x")
    with pytest.raises(CacheError):
        Leases(cache).hold(REPO, COMMIT, owner="x", ttl=0)


HOLDER = r"""
import sys, time
from pathlib import Path
from shardsync.cache import CacheStore
from shardsync.records import RepoRef
from shardsync.snapshot_use import Leases
lease = Leases(CacheStore(Path(sys.argv[1]))).hold(RepoRef("hub", "acme/tiny"), owner="holder")
print(lease.id, flush=True)
time.sleep(600)
"""


def test_kill_9_ends_a_process_lease_at_once(cache: CacheStore) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(cache.root)], stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout is not None
        lease_id = holder.stdout.readline().strip()
        leases = Leases(cache)
        assert [x.id for x in leases.live()] == [lease_id]
        assert leases.reap() == 0
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert leases.live() == ()
    assert leases.reap() == 1 and leases.all() == ()


JUDGE = r"""
import sys
from pathlib import Path
from shardsync.cache import CacheStore
from shardsync.snapshot_use import Leases
leases = Leases(CacheStore(Path(sys.argv[1])))
print(len(leases.all()), len(leases.live()))
"""


def test_another_users_lease_is_live_where_proc_hides_their_processes() -> None:
    """Shared GPU hosts often mount ``/proc`` with ``hidepid=2``: a user sees only their own
    processes there. A prune run by another user must still take a running holder's lease
    for live (it did not, and evicted what the holder was loading)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: two other users and a mount namespace")
    as_user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    if subprocess.run([*as_user, sys.executable, "-c", "import shardsync"], check=False).returncode:
        pytest.skip("another user cannot run this checkout's Python here")
    root = Path(tempfile.mkdtemp(prefix="hidepid-"))
    try:
        root.chmod(0o777)
        holder_user = ["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups", "--"]
        with subprocess.Popen(
            [*holder_user, sys.executable, "-c", HOLDER, str(root)],
            stdout=subprocess.PIPE,
            text=True,
        ) as holder:
            try:
                assert holder.stdout is not None and holder.stdout.readline().strip()
                hidden = (
                    "mount -t proc -o hidepid=2 proc /proc && exec "
                    + " ".join(as_user)
                    + f' {sys.executable} -c "$0" "$1"'
                )
                judged = subprocess.run(
                    ["unshare", "--mount", "--propagation", "private", "sh", "-c", hidden,
                     JUDGE, str(root)],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                if judged.returncode != 0 and "mount" in judged.stderr:
                    pytest.skip(f"cannot mount a hidepid /proc here: {judged.stderr.strip()}")
                assert judged.returncode == 0, judged.stderr
                assert judged.stdout.split() == ["1", "1"]  # one lease, and it is live
            finally:
                holder.kill()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_zombie_protects_nothing(cache: CacheStore) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) as child:
        lease = Leases(cache).hold(REPO, owner="daemon client", pid=child.pid)
        assert Leases(cache).is_alive(lease.info)
        os.kill(child.pid, signal.SIGKILL)
        # not reaped yet: /proc still lists it, as state Z
        while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":
            time.sleep(0.01)
        assert not Leases(cache).is_alive(lease.info)
        child.wait()


def test_a_recycled_pid_is_not_the_holder(cache: CacheStore) -> None:
    lease = Leases(cache).hold(REPO, owner="me")
    path = cache.layout.state("leases", f"{lease.id}.json")
    data = json.loads(path.read_text())
    data["start_time"] -= 1  # same pid, another process (started at another moment)
    path.write_text(json.dumps(data))
    assert Leases(cache).live() == ()


def test_a_lease_for_a_missing_process_is_refused(cache: CacheStore) -> None:
    with subprocess.Popen([sys.executable, "-c", "pass"]) as child:
        child.wait()
    with pytest.raises(CacheError, match="no process"):
        Leases(cache).hold(REPO, owner="gone", pid=child.pid)


def test_ttl_lease_needs_heartbeats(cache: CacheStore) -> None:
    leases = Leases(cache)
    lease = leases.hold(REPO, COMMIT, owner="remote client", ttl=30)
    (info,) = leases.all()
    assert leases.is_alive(info, now=info.heartbeat_at + 29)
    assert not leases.is_alive(info, now=info.heartbeat_at + 31)
    os.utime(cache.layout.state("leases", f"{lease.id}.json"), (0, 0))  # last heartbeat long ago
    assert leases.live() == ()
    lease.heartbeat()
    assert [x.id for x in leases.live()] == [lease.id]
    assert leases.reap(now=time.time() + 60) == 1
    lease.heartbeat()  # a late heartbeat writes the reaped lease again
    assert [x.id for x in leases.live()] == [lease.id]
    lease.release()
    lease.heartbeat()
    assert leases.all() == ()


def test_leases_from_elsewhere(cache: CacheStore) -> None:
    leases = Leases(cache)
    lease = leases.hold(REPO, owner="x")
    path = cache.layout.state("leases", f"{lease.id}.json")
    data = json.loads(path.read_text())
    (info,) = leases.all()
    data.update(boot_id="another-boot", host="another-host")
    path.write_text(json.dumps(data))
    (other,) = leases.all()
    assert leases.is_alive(other, now=info.heartbeat_at + FOREIGN_LEASE_AGE - 1)
    assert not leases.is_alive(other, now=info.heartbeat_at + FOREIGN_LEASE_AGE + 1)
    data["host"] = info.host  # this machine, an earlier boot: every holder is gone
    path.write_text(json.dumps(data))
    assert leases.live() == ()


def test_garbage_lease_files_protect_nothing(cache: CacheStore) -> None:
    directory = cache.layout.state("leases")
    directory.mkdir()
    (directory / "torn.json").write_text('{"format": 1, "repo": ')
    (directory / "alien.json").write_text('{"format": 99}')
    (directory / "wrong.json").write_text('{"format": 1, "repo": 5}')
    with Leases(cache).hold(REPO, owner="x"):
        good = json.loads(next(directory.glob("*.json")).read_text())
    (directory / "blobs.json").write_text(json.dumps({**good, "blobs": "a" * 64}))
    assert Leases(cache).all() == ()


def test_taking_a_lease_waits_for_a_running_prune(cache: CacheStore) -> None:
    gate = prune_gate(cache, shared=False)
    assert gate.try_acquire()
    try:
        with pytest.raises(CacheError, match="timed out"):
            Leases(cache).hold(REPO, owner="x", timeout=0.05)
        took: list[str] = []
        waiter = threading.Thread(
            target=lambda: took.append(Leases(cache).hold(REPO, owner="x").id)
        )
        waiter.start()
        waiter.join(timeout=0.2)
        assert took == [] and Leases(cache).all() == ()
    finally:
        gate.release()
    waiter.join(timeout=30)
    assert [x.id for x in Leases(cache).live()] == took


# --------------------------------------------------------------------------- the hooks


async def test_a_running_prefetch_job_leases_its_repo(
    fake_hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The job is parked in a retry wait (a 503, then a sleep we control): a prune while it
    waits must leave its repo alone; afterwards the lease is gone and the use is logged.
    Every file but the index answers 503 until the prune is done, so the job has published
    nothing then: a blob it published but had not linked yet would look two days old to the
    prune's clock (an orphan), which is not what this test is about."""
    fake_hub.add_checkpoint("acme/tiny", checkpoint)
    fake_hub.faults.add(Status(503, path="[!m]*", server="hub"))  # all small files but the index
    fake_hub.faults.add(Status(503, path="*.safetensors", server="cdn"))
    cache = CacheStore(tmp_path / "cache")
    parked, resume = asyncio.Event(), asyncio.Event()

    async def sleep(delay: float) -> None:
        parked.set()
        await resume.wait()

    config = fast_config(cache.root, fake_hub.endpoint)
    job = asyncio.create_task(prefetch("acme/tiny", config, sleep=sleep))
    await parked.wait()
    (lease,) = Leases(cache).live()
    assert (lease.repo, lease.commit, lease.pid) == ("acme/tiny", None, os.getpid())
    report = await asyncio.to_thread(prune_cache, cache, Limits(max_size=0), clock=_later)
    assert report.evicted == ()
    assert {p.reason for p in report.protected} == {"leased"}
    fake_hub.faults.clear()
    resume.set()
    result = await job
    assert Leases(cache).all() == ()
    assert list(AccessLog(cache).last_used()) == [("models--acme--tiny", result.commit)]
    assert cache.find_complete(RepoRef("hub", "acme/tiny"), "main") is not None


def _later() -> float:
    """A clock two days ahead: the job's incomplete snapshot would count as stale."""
    return time.time() + 2 * 86400
