"""The daemon: its API (in the test's loop) and real daemon processes (signals, kill -9, uids)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemons import api, cli, daemon_in_loop, short_tmp
from helpers import assert_snapshot_matches, assert_store_verified, fast_config, serving, until

from shardsync import daemon as daemon_module
from shardsync import errors
from shardsync.client import Client
from shardsync.config import DaemonConfig
from shardsync.daemon import Daemon
from shardsync.events import FileStarted, JobDone, JobEvent, Progress, Verified
from shardsync.testing import Bandwidth, Checkpoint, FakeHub, Latency, build_checkpoint
from shardsync.testing.daemons import DaemonProcess, write_config

REPO = "acme/daemon"


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_tmp() as path:
        yield path


@pytest.fixture
async def daemon(fake_hub: FakeHub, checkpoint: Checkpoint, workdir: Path) -> AsyncIterator[Daemon]:
    fake_hub.add_checkpoint(REPO, checkpoint)
    config = fast_config(workdir / "cache", fake_hub.endpoint)
    async with daemon_in_loop(config, workdir / "shardsync" / "d.sock", tcp=("127.0.0.1", 0)) as d:
        yield d


async def _done(socket_path: Path, job_id: str) -> list[JobEvent]:
    """Every event of a job, read from the API until its end."""
    async with Client(socket=socket_path, fallback="error") as client:
        job = await client.job(job_id)
        return [event async for event in job.events()]


def _shard_bytes(checkpoint: Checkpoint) -> int:
    return sum(checkpoint.path(s).stat().st_size for s in checkpoint.shards)


def _plant_dead_socket(path: Path) -> None:
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()


def _chmod(path: Path, mode: int) -> None:
    path.chmod(mode)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# ---------------------------------------------------------------------------- the API


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "needle"),
    [
        ("POST", "/v1/jobs", b"{not json", 400, "bad_request", "not valid JSON"),
        ("POST", "/v1/jobs", b"", 400, "bad_request", "not valid JSON"),
        ("POST", "/v1/jobs", b"[1, 2]", 400, "config", "JSON object"),
        ("POST", "/v1/jobs", b'{"source": "acme/x", "source": "y"}', 400, "bad_request", "dupl"),
        ("POST", "/v1/jobs", b"[" * 50_000, 400, "bad_request", "not valid JSON"),
        ("POST", "/v1/jobs", b'{"source": "' + b"a" * 70_000 + b'"}', 413, "payload_too_large", ""),
        ("POST", "/v1/jobs", b'{"repo": "acme/x"}', 400, "config", "unknown field 'repo'"),
        ("POST", "/v1/jobs", b'{"source": 7}', 400, "config", "source must be"),
        ("POST", "/v1/jobs", b'{"source": "not a repo!"}', 400, "config", "invalid repo id"),
        ("POST", "/v1/jobs", b'{"source": "acme/x", "priority": 1e9}', 400, "config", "priority"),
        ("POST", "/v1/jobs", b'{"source": "acme/x", "revision": "a/../b"}', 400, "config", "rev"),
        ("POST", "/v1/jobs", b'{"source": "/etc"}', 400, "config", "local directories"),
        ("POST", "/v1/jobs", b'{"source": "ftp://x/y"}', 400, "config", "unsupported source"),
        ("POST", "/v1/jobs", b'{"source": "http://[::1"}', 400, "config", "not a usable URL"),
        ("POST", "/v1/prepare", b'{"source": "http://[::1"}', 400, "config", "not a usable"),
        ("POST", "/v1/leases", b'{"source": "http://h:port/"}', 400, "config", "not a usable"),
        ("POST", "/v1/jobs", b'{"source": "http://u:pw@h/m/"}', 400, "config", "credentials"),
        ("POST", "/v1/prepare", b"{not json", 400, "bad_request", "not valid JSON"),
        ("POST", "/v1/leases", b"{not json", 400, "bad_request", "not valid JSON"),
        ("POST", "/v1/leases", b'{"source": "not a repo!"}', 400, "config", "invalid repo id"),
        ("POST", "/v1/prepare", b'{"source": "/etc"}', 400, "config", "local director"),
        ("POST", "/v1/prepare", b'{"source": "acme/x", "checkpoint": "latest"}', 400, "config", ""),
        ("POST", "/v1/prepare", b'{"source": "acme/x", "revision": "a/../b"}', 400, "config", ""),
        ("GET", "/v1/jobs/nope", None, 404, "not_found", "no job 'nope'"),
        ("DELETE", "/v1/jobs/nope", None, 404, "not_found", "no job"),
        ("GET", "/v1/jobs/nope/events", None, 404, "not_found", "no job"),
        ("PUT", "/v1/jobs", b"{}", 405, "method_not_allowed", ""),
        ("GET", "/v2/jobs", None, 404, "not_found", ""),
        ("GET", "/", None, 404, "not_found", ""),
    ],
)
async def test_malformed_requests_get_4xx_with_a_message(
    daemon: Daemon, method: str, path: str, body: bytes | None, status: int, code: str, needle: str
) -> None:
    got, answer = await api(daemon.socket_path, method, path, body=body)
    assert got == status, answer
    assert answer["error"]["code"] == code
    assert needle in answer["error"]["message"] and answer["error"]["message"]
    assert (await api(daemon.socket_path, "GET", "/v1/status"))[0] == 200  # still serving


async def test_a_late_subscriber_gets_the_earlier_events(
    daemon: Daemon, checkpoint: Checkpoint
) -> None:
    status, job = await api(daemon.socket_path, "POST", "/v1/jobs", json_body={"source": REPO})
    # the job runs in the daemon's loop meanwhile, so it may be in any state already
    assert status == 201 and job["state"] not in ("failed", "cancelled")
    first = await _done(daemon.socket_path, job["id"])
    late = await _done(daemon.socket_path, job["id"])  # after the end: a full replay
    assert late == first
    shards = [
        e.outcome.path for e in first if isinstance(e, Verified) and e.shard_index is not None
    ]
    assert sorted(shards) == sorted(checkpoint.shards)
    since = first[5].seq
    status, text = await api(
        daemon.socket_path, "GET", f"/v1/jobs/{job['id']}/events?since={since}"
    )
    assert status == 200
    # the wire is each event's to_json, one per line, from ``since``
    assert [json.loads(line) for line in text.splitlines()] == [
        e.to_json() for e in first if e.seq >= since
    ]
    bad = await api(daemon.socket_path, "GET", f"/v1/jobs/{job['id']}/events?since=-1")
    assert bad[0] == 400 and bad[1]["error"]["code"] == "bad_request"
    status, info = await api(daemon.socket_path, "GET", f"/v1/jobs/{job['id']}")
    done = first[-1]
    assert isinstance(done, JobDone)
    assert info["state"] == "done" and info["snapshot_path"] == done.result["snapshot_path"]
    listed = (await api(daemon.socket_path, "GET", "/v1/jobs"))[1]["jobs"]
    assert [j["id"] for j in listed] == [job["id"]]
    again = await api(daemon.socket_path, "DELETE", f"/v1/jobs/{job['id']}")
    assert again == (200, {**info, "events": again[1]["events"]})  # done stays done


async def test_prepare_answers_the_origins_headers_and_downloads_no_shard(
    daemon: Daemon, checkpoint: Checkpoint
) -> None:
    """``POST /v1/prepare``: the fetch list in index order and each shard's header as the
    origin holds it, compared with the files served; the index lands, no shard does."""
    status, answer = await api(
        daemon.socket_path, "POST", "/v1/prepare", json_body={"source": REPO}
    )
    assert status == 200, answer
    index = json.loads(checkpoint.path(checkpoint.index).read_bytes())
    shards = list(dict.fromkeys(index["weight_map"].values()))
    assert [(e["path"], e["role"]) for e in answer["entries"]] == [
        (checkpoint.index, "index"),
        *((shard, "shard") for shard in shards),
    ]
    for entry in answer["entries"]:
        data = checkpoint.path(entry["path"]).read_bytes()
        assert entry["size"] == len(data)
        if entry["role"] == "shard" or entry["sha256"] is not None:  # the index is no LFS file
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert answer["weight_map"] == index["weight_map"]
    for shard in shards:
        data = checkpoint.path(shard).read_bytes()
        n = int.from_bytes(data[:8], "little")
        assert answer["headers"][shard].encode() == data[8 : 8 + n]
    store = Path(daemon.config.cache_dir) / "store"
    index_sha = hashlib.sha256(checkpoint.path(checkpoint.index).read_bytes()).hexdigest()
    assert [p.name for p in store.glob("sha256/*/*")] == [index_sha]
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        prepared = await client.prepare(REPO)
    assert prepared.to_json() == answer


async def test_status_cache_and_metrics(daemon: Daemon, checkpoint: Checkpoint) -> None:
    _, job = await api(daemon.socket_path, "POST", "/v1/jobs", json_body={"source": REPO})
    await _done(daemon.socket_path, job["id"])
    _, status = await api(daemon.socket_path, "GET", "/v1/status")
    assert status["jobs"]["done"] == 1 and status["jobs_submitted"] == 1
    assert status["bytes_downloaded"] >= _shard_bytes(checkpoint)
    assert status["socket"] == str(daemon.socket_path) and status["api"] == 1
    _, cache = await api(daemon.socket_path, "GET", "/v1/cache")
    assert cache["bytes"] >= _shard_bytes(checkpoint) and cache["partial_files"] == 0
    assert [r["repo"] for r in cache["repos"]] == [REPO]
    status_code, text = await api(daemon.socket_path, "GET", "/metrics")
    assert status_code == 200
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) shardsync_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        assert re.fullmatch(r'shardsync_\w+(\{\w+="[^"]*"(,\w+="[^"]*")*\})?', name), line
        samples[name] = float(value)
    assert samples["shardsync_bytes_downloaded_total"] == status["bytes_downloaded"]
    assert samples["shardsync_cache_size_bytes"] == cache["bytes"]
    assert samples['shardsync_jobs{state="done"}'] == 1
    assert samples['shardsync_job_duration_seconds_bucket{le="+Inf"}'] == 1
    assert samples["shardsync_job_duration_seconds_count"] == 1
    assert "shardsync_active_connections" in samples
    assert "shardsync_verify_failures_total" in samples


async def test_the_tcp_listener_serves_monitoring_only(daemon: Daemon) -> None:
    assert daemon.tcp_address is not None
    host, port = daemon.tcp_address
    async with aiohttp.ClientSession() as session:
        for path in ("/metrics", "/v1/status"):
            async with session.get(f"http://{host}:{port}{path}") as resp:
                assert resp.status == 200
        async with session.post(f"http://{host}:{port}/v1/jobs", json={"source": REPO}) as resp:
            assert resp.status == 403
            assert "Unix socket" in (await resp.json())["error"]["message"]
        async with session.get(f"http://{host}:{port}/v1/jobs") as resp:
            assert resp.status == 403


async def test_connections_that_send_nothing_are_closed(
    fake_hub: FakeHub, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TCP listener checks no credentials: any local user may connect. Silent
    connections used to stay for an hour each, and a few hundred held every descriptor the
    daemon had (its clients' requests went unanswered); they are closed when idle."""
    # raising=False: a daemon without the bound fails the promise below, not this line
    monkeypatch.setattr(daemon_module, "_IDLE_S", 0.5, raising=False)
    config = fast_config(workdir / "cache", fake_hub.endpoint)
    async with daemon_in_loop(config, workdir / "shardsync" / "d.sock", tcp=("127.0.0.1", 0)) as d:
        assert d.tcp_address is not None
        silent = [await asyncio.open_connection(*d.tcp_address) for _ in range(20)]
        async with asyncio.timeout(10):
            for reader, writer in silent:
                assert await reader.read() == b""  # closed by the daemon
                writer.close()
        assert (await api(d.socket_path, "GET", "/v1/status"))[0] == 200


async def test_scrapes_at_once_share_one_scan_of_the_cache(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each scan walks the whole store in a worker thread the jobs' own steps also wait
    for: a burst of scrapes started one scan each."""
    scans = 0
    summary = daemon_module.cache_summary

    def counted(root: Path) -> dict[str, Any]:
        nonlocal scans
        scans += 1
        time.sleep(0.2)  # a big store: the other scrapes come while it is walked
        return summary(root)

    monkeypatch.setattr(daemon_module, "cache_summary", counted)
    assert daemon.tcp_address is not None
    host, port = daemon.tcp_address
    async with aiohttp.ClientSession() as session:

        async def scrape() -> int:
            async with session.get(f"http://{host}:{port}/metrics") as resp:
                await resp.read()
                return resp.status

        assert await asyncio.gather(*(scrape() for _ in range(20))) == [200] * 20
    assert scans == 1


async def test_the_socket_is_private(daemon: Daemon) -> None:
    assert _mode(daemon.socket_path) == 0o600
    assert _mode(daemon.socket_path.parent) == 0o700


async def test_cancel_over_the_api(daemon: Daemon, fake_hub: FakeHub) -> None:
    fake_hub.faults.add(Bandwidth(100_000, times=None))
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        job = await client.prefetch(REPO)
        async for event in job.events():
            if isinstance(event, FileStarted) and event.shard_index is not None:
                break
        status, info = await api(daemon.socket_path, "DELETE", f"/v1/jobs/{job.id}")
        assert status == 200 and info["state"] == "cancelled"
        with pytest.raises(errors.JobCancelledError, match="was cancelled"):
            await job.wait()


async def test_a_lease_the_daemon_holds_ends_when_the_daemon_stops(
    fake_hub: FakeHub, workdir: Path
) -> None:
    """``POST /v1/leases`` lasts while its request is open: a daemon that stops closes it,
    so the lease goes too, not only when the caller's process ends (a serving engine that
    outlives a daemon restart would otherwise pin the repo against every prune)."""
    from shardsync.snapshot_use import Leases

    config = fast_config(workdir / "cache", fake_hub.endpoint)
    socket_path = workdir / "d" / "d.sock"
    async with contextlib.AsyncExitStack() as stack:
        stop = contextlib.AsyncExitStack()
        running = await stop.enter_async_context(daemon_in_loop(config, socket_path))
        client = await stack.enter_async_context(Client(socket=socket_path, fallback="error"))
        assert running._engine is not None
        leases = Leases(running._engine.cache)
        lease = await client.hold(REPO)
        assert lease is not None
        await until(lambda: len(leases.all()) == 1)
        await stop.aclose()  # the daemon stops; the caller lives on, lease in hand
        assert not leases.all()
        lease.release()


async def test_a_since_that_is_no_event_number_is_a_400(daemon: Daemon) -> None:
    """``"\u00b2".isdigit()`` is true and ``int`` refuses it: the answer was a 200 whose body
    then held a second, 500 answer."""
    status, job = await api(daemon.socket_path, "POST", "/v1/jobs", json_body={"source": REPO})
    assert status in (200, 201)
    status, body = await api(daemon.socket_path, "GET", f"/v1/jobs/{job['id']}/events?since=%C2%B2")
    assert status == 400 and body["error"]["code"] == "bad_request"


async def test_an_event_stream_its_client_left_ends_without_an_event(
    daemon: Daemon, fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream of a job that says nothing for a while (queued, listing a slow origin) found
    out that its client had gone only at the job's next event: each one left held a handler
    and a connection until then. The heartbeat finds out within one beat."""
    # raising=False: a daemon without a heartbeat fails the promise below, not this line
    monkeypatch.setattr(daemon_module, "_HEARTBEAT_S", 0.2, raising=False)
    fake_hub.faults.add(Latency(30, server="hub"))  # the job's listing: no event meanwhile
    status, job = await api(daemon.socket_path, "POST", "/v1/jobs", json_body={"source": REPO})
    assert status == 201
    for _ in range(5):
        reader, writer = await asyncio.open_unix_connection(str(daemon.socket_path))
        request = f"GET /v1/jobs/{job['id']}/events?since=0 HTTP/1.1\r\nHost: d\r\n\r\n"
        writer.write(request.encode())
        await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await writer.wait_closed()
    async with asyncio.timeout(10):
        await until(lambda: daemon.statistics().api_requests == 0)


async def test_client_errors_carry_the_daemons_message(daemon: Daemon) -> None:
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        assert client.mode == "daemon"
        job = await client.prefetch("acme/missing")
        with pytest.raises(errors.RepoNotFoundError, match="RepoNotFound"):
            await job.wait()
        with pytest.raises(errors.ConfigError, match="invalid repo id"):
            await client.prefetch("not a repo!")


async def test_a_second_daemon_does_not_steal_the_socket(daemon: Daemon, workdir: Path) -> None:
    other = Daemon(daemon.config, environ={})
    with pytest.raises(errors.ConfigError, match="already listening"):
        await other.serve()
    assert (await api(daemon.socket_path, "GET", "/v1/status"))[0] == 200


async def test_a_daemon_still_starting_keeps_its_socket(workdir: Path, fake_hub: FakeHub) -> None:
    """Between binding its socket and listening on it a daemon starts its engine and resumes
    its journal; a second daemon started then used to take the socket as a dead one's, and
    both ran the same journal. It is refused, and the first one serves on its own socket."""
    config = replace(
        fast_config(workdir / "cache", fake_hub.endpoint),
        daemon=DaemonConfig(socket=workdir / "shardsync" / "d.sock"),
    )
    first = Daemon(config, environ={})
    serving = asyncio.create_task(first.serve())
    try:
        await asyncio.sleep(0)  # it bound its socket and went on to start its engine
        assert first.socket_path.is_socket() and not first._ready.is_set()
        bound = first.socket_path.stat().st_ino
        second = Daemon(config, environ={})
        trying = asyncio.create_task(second.serve())
        ready = asyncio.create_task(second.wait_ready())
        await asyncio.wait({trying, ready}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if not trying.done():  # it took the socket and serves: end it, and the test
            second.request_stop()
            await trying
            pytest.fail("a second daemon took the socket of one still starting")
        with pytest.raises(errors.ConfigError, match="already listening"):
            trying.result()
        await first.wait_ready()
        assert first.socket_path.stat().st_ino == bound
        assert (await api(first.socket_path, "GET", "/v1/status"))[0] == 200
    finally:
        first.request_stop()
        await serving


async def test_a_stale_socket_is_replaced_and_an_open_directory_refused(
    workdir: Path, fake_hub: FakeHub
) -> None:
    config = fast_config(workdir / "cache", fake_hub.endpoint)
    stale = workdir / "shardsync" / "d.sock"
    async with daemon_in_loop(config, stale):
        pass  # leaves no socket; now plant a dead one
    _plant_dead_socket(stale)
    async with daemon_in_loop(config, stale) as running:
        assert (await api(running.socket_path, "GET", "/v1/status"))[0] == 200
    assert not stale.exists()
    open_dir = workdir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    with pytest.raises(errors.ConfigError, match="other users could reach the socket"):
        async with daemon_in_loop(config, open_dir / "d.sock"):
            pass


# ---------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(
        tmp_path_factory.mktemp("big"), total_bytes=40 << 20, n_shards=4, seed=4
    )


@pytest.fixture
def hub(big_checkpoint: Checkpoint) -> Iterator[FakeHub]:
    with serving({REPO: big_checkpoint}) as running:
        yield running


@pytest.fixture
def process(hub: FakeHub, workdir: Path) -> Iterator[DaemonProcess]:
    config = write_config(
        workdir / "d.toml",
        cache=workdir / "cache",
        endpoint=hub.endpoint,
        socket_path=workdir / "shardsync" / "d.sock",
    )
    daemon = DaemonProcess(config, workdir)
    try:
        yield daemon
    finally:
        daemon.close()


async def test_twenty_clients_share_one_download(
    hub: FakeHub, big_checkpoint: Checkpoint, process: DaemonProcess, workdir: Path
) -> None:
    hub.faults.add(Bandwidth(1_600_000, times=None))  # ~3 s: every client joins the job
    ready = await asyncio.to_thread(process.start)
    assert ready["READY"] == "1" and "serving on" in ready["STATUS"]
    socket_path = workdir / "shardsync" / "d.sock"

    async def one_client() -> tuple[str, list[tuple[int, str]], str]:
        async with Client(socket=socket_path, fallback="error") as client:
            job = await client.prefetch(REPO)
            shards = [(shard.index, shard.path) async for shard in job.shards()]
            result = await job.wait()
            return job.id, shards, str(result.snapshot_path)

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one_client()) for _ in range(20)]
    outcomes = [t.result() for t in tasks]
    expected = list(enumerate(big_checkpoint.shards))
    assert all(shards == expected for _, shards, _ in outcomes)
    assert len({job_id for job_id, _, _ in outcomes}) == 1
    assert len({snapshot for _, _, snapshot in outcomes}) == 1
    served = hub.bytes_served("*.safetensors")
    assert served < 1.1 * _shard_bytes(big_checkpoint), served
    assert_snapshot_matches(Path(outcomes[0][2]), big_checkpoint)
    _, status = await api(socket_path, "GET", "/v1/status")
    assert status["jobs_submitted"] == 20 and status["jobs_deduplicated"] == 19


STALLED_DISK = r"""
import sys, time
from pathlib import Path
from shardsync import slot
def stalled(self, *args, **kwargs):  # a publish whose fsync a stalled disk holds
    Path(sys.argv[2]).touch()
    time.sleep(120)
slot.Slot.commit = stalled
from shardsync.daemon import run_daemon
sys.exit(run_daemon(Path(sys.argv[1])))
"""


async def test_a_stop_ends_the_process_even_with_a_publish_that_never_returns(
    hub: FakeHub, big_checkpoint: Checkpoint, process: DaemonProcess, workdir: Path
) -> None:
    """A publish runs to its end whoever cancels it; on a stalled disk it did not end, and
    the daemon's stop waited for it past the 10 s it promises (until systemd's SIGKILL).
    It now leaves, as a ``kill -9`` would, and the next daemon finishes the job."""
    stalled, output = workdir / "stalled", workdir / "stalled.log"
    with output.open("w") as log:
        daemon = await asyncio.create_subprocess_exec(
            sys.executable, "-c", STALLED_DISK, str(process.config), str(stalled),
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    socket_path = workdir / "shardsync" / "d.sock"
    try:
        async with asyncio.timeout(60):
            await until(lambda: _answers(socket_path) or daemon.returncode is not None)
            assert daemon.returncode is None, output.read_text()
            status, job = await api(socket_path, "POST", "/v1/jobs", json_body={"source": REPO})
            assert status == 201
            await until(stalled.exists)
        daemon.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):  # the stall lasts 120 s
            assert await daemon.wait() == 0, output.read_text()
    finally:
        if daemon.returncode is None:
            daemon.kill()
            await daemon.wait()
    await asyncio.to_thread(process.start)
    events = await _done(socket_path, job["id"])
    done = events[-1]
    assert isinstance(done, JobDone), events[-1]
    assert_snapshot_matches(Path(done.result["snapshot_path"]), big_checkpoint)


def _answers(socket_path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        return probe.connect_ex(str(socket_path)) == 0


async def test_kill_9_mid_job_then_restart_resumes(
    hub: FakeHub, big_checkpoint: Checkpoint, process: DaemonProcess, workdir: Path
) -> None:
    total = _shard_bytes(big_checkpoint)
    rule = hub.faults.add(Bandwidth(1_500_000, times=None))
    await asyncio.to_thread(process.start)
    socket_path = workdir / "shardsync" / "d.sock"
    async with Client(socket=socket_path, fallback="error") as client:
        job = await client.prefetch(REPO)
        with pytest.raises(errors.DaemonError):
            async for _ in job.events():
                if hub.bytes_served("*.safetensors") > total * 0.5:
                    process.signal(signal.SIGKILL)
    assert await asyncio.to_thread(process.wait) == -signal.SIGKILL
    assert_store_verified(workdir / "cache", big_checkpoint)
    hub.faults.remove(rule)
    restarted = await asyncio.to_thread(process.start)
    assert restarted["READY"] == "1"
    async with Client(socket=socket_path, fallback="error") as client:
        resumed = await client.job(job.id)  # the journal kept the job under its id
        result = await resumed.wait()
    refetched = hub.bytes_served("*.safetensors") - total
    assert refetched < 0.10 * total, f"re-fetched {refetched} of {total} bytes"
    assert sum(f.resumed for f in result.files) > 0
    assert_snapshot_matches(result.snapshot_path, big_checkpoint)
    process.signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.wait) == 0


async def test_a_service_manager_that_reads_nothing_holds_no_job_and_no_stop(
    process: DaemonProcess, workdir: Path
) -> None:
    """Every job's start and end sends a status line to ``$NOTIFY_SOCKET``; a manager busy
    elsewhere (its queue holds 10) made the send block on the event loop: the sixth job got
    no answer, nor did status, and SIGTERM (a handler on that loop) was never run."""
    await asyncio.to_thread(process.start)  # READY read; nothing is read from here on
    async with Client(socket=workdir / "shardsync" / "d.sock", fallback="error") as client:
        for n in range(12):
            async with asyncio.timeout(20):
                job = await client.prefetch(REPO, include=["config.json"], exclude=[f"x{n}"])
                await job.wait()
        async with asyncio.timeout(10):
            await client.status()
    process.signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.wait, 15) == 0


async def test_sigterm_answers_waiters_and_exits(
    hub: FakeHub, big_checkpoint: Checkpoint, process: DaemonProcess, workdir: Path
) -> None:
    rule = hub.faults.add(Bandwidth(200_000, times=None))
    await asyncio.to_thread(process.start)
    socket_path = workdir / "shardsync" / "d.sock"
    async with Client(socket=socket_path, fallback="error") as client:
        job = await client.prefetch(REPO)
        status = await asyncio.to_thread(process.wait_for, "STATUS")  # systemctl status shows
        assert status["STATUS"].endswith("; 1 active job(s)"), status
        async for event in job.events():
            if isinstance(event, Progress) and event.done >= 128 * 1024:
                break  # some bytes of a shard are on disk (two 64 KiB write buffers' worth)
        process.signal(signal.SIGTERM)
        with pytest.raises(errors.DaemonStoppingError, match="daemon stopping"):
            await job.wait()
    stopping = await asyncio.to_thread(process.wait_for, "STOPPING")
    assert stopping["STOPPING"] == "1"
    assert await asyncio.to_thread(process.wait, 10) == 0
    assert not socket_path.exists()
    journal = json.loads((workdir / "cache" / "state" / "daemon" / "jobs.json").read_text())
    assert [j["id"] for j in journal["jobs"]] == [job.id]
    partials = list((workdir / "cache" / "partial").glob("*.json"))
    assert partials, "SIGTERM must leave resume records for the partial files"
    hub.faults.remove(rule)
    await asyncio.to_thread(process.start)
    async with Client(socket=socket_path, fallback="error") as client:
        result = await (await client.job(job.id)).wait()
    assert sum(f.resumed for f in result.files) > 0
    process.signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.wait) == 0


_PEER = textwrap.dedent(
    """
    import os, socket, sys
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    s.sendall(b"GET /v1/status HTTP/1.1\\r\\nHost: d\\r\\nConnection: close\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    sys.stdout.write(data.decode())
    """
)


def _as_nobody(socket_path: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _PEER, str(socket_path)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


STRANGER = 4242


@pytest.fixture
def stranger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Unix-socket peer reads as uid and gid 4242 (not us, not root), through the very
    ``SO_PEERCRED`` call the daemon makes: the check behind it runs unchanged, without root."""
    real = daemon_module._peer_credentials

    def faked(sock: Any) -> tuple[int, int, int]:
        pid, _uid, _gid = real(sock)
        return pid, STRANGER, STRANGER

    monkeypatch.setattr(daemon_module, "_peer_credentials", faked)


@pytest.mark.parametrize(
    ("allowed", "status"),
    [
        ({}, 403),
        ({"allowed_uids": frozenset({STRANGER + 1})}, 403),
        ({"allowed_gids": frozenset({STRANGER + 1})}, 403),
        ({"allowed_uids": frozenset({STRANGER})}, 200),
        ({"allowed_gids": frozenset({STRANGER})}, 200),
    ],
    ids=["nobody-allowed", "other-uid", "other-gid", "uid-allowed", "gid-allowed"],
)
async def test_peer_credentials_decide_who_may_connect_without_root(
    stranger: None, fake_hub: FakeHub, workdir: Path, allowed: dict[str, Any], status: int
) -> None:
    """Promise 8 as any user may test it (the root-only test below uses real uids)."""
    config = fast_config(workdir / "cache", fake_hub.endpoint)
    socket_path = workdir / "shardsync" / "d.sock"
    async with daemon_in_loop(config, socket_path, **allowed):
        got, body = await api(socket_path, "GET", "/v1/status")
        assert got == status, body
        if status == 403:
            assert f"uid {STRANGER} is not allowed" in str(body)
            got, _ = await api(socket_path, "POST", "/v1/jobs", json_body={"source": "acme/x"})
            assert got == 403  # every route, not only the status
        else:
            assert body["jobs_submitted"] == 0


async def test_a_supplementary_group_of_the_peer_may_be_allowed(
    stranger: None, fake_hub: FakeHub, workdir: Path
) -> None:
    """``SO_PEERCRED`` names the primary gid only; the others come from ``/proc/<pid>``."""
    groups = set(os.getgroups()) - {STRANGER}
    if not groups:
        pytest.skip("this process has no supplementary group to allow")
    config = fast_config(workdir / "cache", fake_hub.endpoint)
    socket_path = workdir / "shardsync" / "d.sock"
    async with daemon_in_loop(config, socket_path, allowed_gids=frozenset({min(groups)})):
        assert (await api(socket_path, "GET", "/v1/status"))[0] == 200


@pytest.mark.skipif(
    os.geteuid() != 0,
    reason="root only: switches a client to uid 65534 for real (CI runs as root; "
    "test_peer_credentials_decide_who_may_connect_without_root covers the check for anyone)",
)
async def test_peer_credentials_decide_who_may_connect(hub: FakeHub, workdir: Path) -> None:
    _chmod(workdir, 0o711)  # nobody may traverse to the socket's directory ...
    socket_path = workdir / "shardsync" / "d.sock"
    common = {"cache": workdir / "cache", "endpoint": hub.endpoint, "socket_path": socket_path}
    # ... which the group 65534 may search, and the socket it may write: only the peer
    # credential check stands in the way.
    config = write_config(workdir / "d.toml", **common, daemon="group = 65534\nallowed_gids = []\n")
    daemon = DaemonProcess(config, workdir)
    try:
        await asyncio.to_thread(daemon.start)
        assert _mode(socket_path.parent) == 0o710 and _mode(socket_path) == 0o660
        assert socket_path.stat().st_gid == 65534
        refused = await asyncio.to_thread(_as_nobody, socket_path)
        assert refused.startswith("HTTP/1.1 403"), refused
        assert "uid 65534 is not allowed" in refused
        assert (await api(socket_path, "GET", "/v1/status"))[0] == 200  # root always may
        write_config(
            workdir / "d.toml",
            **common,
            daemon="group = 65534\nallowed_gids = []\nallowed_uids = [65534]\n"
            'max_bandwidth = "100MB"\n',
        )
        daemon.signal(signal.SIGHUP)
        assert (await asyncio.to_thread(daemon.wait_for, "RELOADING"))["RELOADING"] == "1"
        await asyncio.to_thread(daemon.wait_for, "READY")
        allowed = await asyncio.to_thread(_as_nobody, socket_path)
        assert allowed.startswith("HTTP/1.1 200"), allowed
        _, status = await api(socket_path, "GET", "/v1/status")
        assert status["max_bandwidth"] == 100_000_000  # reloaded live too
        daemon.signal(signal.SIGTERM)
        assert await asyncio.to_thread(daemon.wait) == 0
    finally:
        daemon.close()


@pytest.mark.parametrize(
    ("daemon_keys", "needle"),
    [
        ('socket_mode = "0777"\n', "daemon.socket_mode"),
        ('tcp = "10.1.2.3:9464"\n', "daemon.tcp"),
        ('fallback = "maybe"\n', "daemon.fallback"),
        ('group = "no-such-group-here"\n', "daemon.group"),
        ("bogus = 1\n", "daemon.bogus"),
    ],
)
def test_config_errors_stop_the_daemon_with_one_line(
    workdir: Path, daemon_keys: str, needle: str
) -> None:
    config = write_config(
        workdir / "d.toml",
        cache=workdir / "cache",
        endpoint="http://127.0.0.1:9",
        socket_path=workdir / "shardsync" / "d.sock",
        daemon=daemon_keys,
    )
    out = cli("daemon", "--config", str(config))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardsync: error:"), out.stderr
    assert needle in lines[0]


_LOADED_HEAVY = """\
import json, sys
from shardsync.cli import main
code = main(sys.argv[1:])
heavy = ("aiohttp", "aiobotocore", "botocore", "huggingface_hub", "tqdm", "shardsync.prefetch")
print(json.dumps(sorted({m for m in sys.modules if m.startswith(heavy)})), file=sys.stderr)
sys.exit(code)
"""


async def test_a_prefetch_the_daemon_runs_loads_no_engine_in_the_command(
    hub: FakeHub, big_checkpoint: Checkpoint, process: DaemonProcess, workdir: Path
) -> None:
    """The command that hands its job to the daemon is a thin client: no engine, aiohttp,
    botocore or Hub client to import (0.15-0.25 s of a small model's prefetch), and the
    same snapshot and result as in-process."""
    await asyncio.to_thread(process.start)
    argv = ["--config", str(process.config), "prefetch", REPO, "--quiet", "--json"]
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _LOADED_HEAVY, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stderr.strip().splitlines()[-1]) == []
    result = json.loads(out.stdout)
    assert result["bytes_downloaded"] == big_checkpoint.total_size
    assert_snapshot_matches(Path(result["snapshot_path"]), big_checkpoint)
    _, status = await api(workdir / "shardsync" / "d.sock", "GET", "/v1/status")
    assert status["jobs_submitted"] == 1  # the daemon did it


async def test_cli_prefetch_and_status_go_through_the_daemon(
    hub: FakeHub, big_checkpoint: Checkpoint, process: DaemonProcess, workdir: Path
) -> None:
    await asyncio.to_thread(process.start)
    config = str(process.config)
    out = await asyncio.to_thread(cli, "--config", config, "prefetch", REPO)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("verified=sha256") == len(big_checkpoint.shards)  # same progress
    snapshot = Path(out.stdout.strip())
    assert snapshot.is_relative_to(workdir / "cache")
    status = await asyncio.to_thread(cli, "status", "--config", config, "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["daemon"]["jobs_submitted"] == 1 and report["daemon"]["mode"] == "daemon"
    assert report["jobs"][0]["state"] == "done" and report["cache"]["blobs"] > 0
    human = await asyncio.to_thread(cli, "status", "--config", config)
    assert "shardsync daemon" in human.stdout and REPO in human.stdout
    # --no-daemon (or another cache) runs in-process: the daemon sees no new job
    own = workdir / "own-cache"
    alone = await asyncio.to_thread(
        cli, "--config", config, "prefetch", REPO, "--no-daemon", "--cache-dir", str(own), "--json"
    )
    assert alone.returncode == 0, alone.stderr
    assert json.loads(alone.stdout)["snapshot_path"].startswith(str(own))
    again = json.loads(
        (await asyncio.to_thread(cli, "status", "--config", config, "--json")).stdout
    )
    assert again["daemon"]["jobs_submitted"] == 1
    process.signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.wait) == 0
    gone = await asyncio.to_thread(cli, "status", "--config", config)
    assert gone.returncode == 11 and "no shardsync daemon answers" in gone.stderr
    strict = await asyncio.to_thread(
        cli, "--config", config, "prefetch", REPO, env={"SHARDSYNC_FALLBACK": "error"}
    )
    assert strict.returncode == 11, strict.stderr
