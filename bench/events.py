"""How soon after a file is published does a client hear ``verified``? (target: 50 ms)

    python bench/events.py [--size 256MiB] [--shards 16] [--bandwidth 20MB]
                           [--subscribers 1,20] [--out bench/results]

A real daemon process (``shardsync daemon``, ready when it says ``READY=1`` on a notify
socket, as under systemd) downloads a generated checkpoint from the bundled fake Hub, running
in this process's background thread. For each subscriber count, that many clients follow the
job's event stream over the Unix socket; each ``verified`` event is timed on arrival
(``time.time()``) against the moment its file was published: the modification time of the
file's snapshot symlink, the last thing the engine writes before it reports the file.

Filesystem timestamps come from the kernel's coarse clock (a tick of 1-4 ms, never later than
the real time), so each latency is an upper bound by up to one tick. The event's own ``time``
field (stamped by the daemon when it appends the event) splits the latency into the daemon's
part (publish -> event) and the transport's (event -> client).

Prints a table and writes ``<out>/events.json``; the exit status is 1 only if the run itself
failed, not if the target was missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS  # bench/common.py, beside this script

from shardsync.client import Client
from shardsync.config import parse_size
from shardsync.events import Verified
from shardsync.testing import Bandwidth, FakeHub, build_checkpoint, serve_in_thread

REPO_ID = "bench/events"
TARGET_S = 0.050


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _start_daemon(config: Path, work: Path) -> tuple[subprocess.Popen[bytes], socket.socket]:
    notify_path = work / "notify"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(60)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardsync.cli", "daemon", "--config", str(config)],
        env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
        stderr=subprocess.DEVNULL,
    )
    while b"READY=1" not in notify.recv(4096):
        pass
    return proc, notify


async def _follow(socket_path: Path, job_id: str) -> list[tuple[float, Verified]]:
    """Arrival times of the ``verified`` events this client saw live (replays are dropped:
    they arrive late by design)."""
    async with Client(socket=socket_path, fallback="error") as client:
        job = await client.job(job_id)
        subscribed = time.time()
        return [
            (time.time(), e)
            async for e in job.events()
            if isinstance(e, Verified) and e.time >= subscribed
        ]


async def _run(socket_path: Path, repo: str, subscribers: int) -> list[dict[str, float]]:
    """One job followed by ``subscribers`` clients; a latency record per (client, file)."""
    async with Client(socket=socket_path, fallback="error") as client:
        job = await client.prefetch(repo)
    async with asyncio.TaskGroup() as tg:
        followers = [tg.create_task(_follow(socket_path, job.id)) for _ in range(subscribers)]
    records = []
    for follower in followers:
        for received, event in follower.result():
            published = os.lstat(event.file).st_mtime_ns / 1e9
            records.append(
                {
                    "latency": received - published,
                    "daemon": event.time - published,
                    "transport": received - event.time,
                }
            )
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="256MiB", help="checkpoint size")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--bandwidth", default="20MB", help="per-connection cap (spreads files)")
    parser.add_argument("--subscribers", default="1,20", help="comma-separated client counts")
    parser.add_argument("--out", type=Path, default=RESULTS, help="default bench/results")
    args = parser.parse_args()
    counts = [int(n) for n in args.subscribers.split(",")]
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "config": vars(args) | {"out": str(args.out)},
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="shardsync-events-") as tmp:
        work = Path(tmp)
        hub = FakeHub()
        hub.faults.add(Bandwidth(parse_size(args.bandwidth), times=None))
        with serve_in_thread(hub):
            socket_path = work / "run" / "d.sock"
            config = work / "d.toml"
            config.write_text(
                f'[cache]\ndir = "{work / "cache"}"\n[hub]\nendpoint = "{hub.endpoint}"\n'
                f'[daemon]\nsocket = "{socket_path}"\n'
            )
            proc, notify = _start_daemon(config, work)
            try:
                for n, subscribers in enumerate(counts):
                    # other weights per run, so every file is downloaded and published anew
                    print(f"building a {args.size} checkpoint...", file=sys.stderr)
                    checkpoint = build_checkpoint(
                        work / f"origin-{n}",
                        total_bytes=parse_size(args.size),
                        n_shards=args.shards,
                        seed=n,
                    )
                    repo = f"{REPO_ID}-{n}"
                    hub.add_checkpoint(repo, checkpoint)
                    records = asyncio.run(_run(socket_path, repo, subscribers))
                    latencies = [r["latency"] for r in records]
                    run = {
                        "subscribers": subscribers,
                        "events": len(records),
                        "p50_ms": 1000 * statistics.median(latencies),
                        "p95_ms": 1000 * _percentile(latencies, 0.95),
                        "max_ms": 1000 * max(latencies),
                        "daemon_max_ms": 1000 * max(r["daemon"] for r in records),
                        "transport_max_ms": 1000 * max(r["transport"] for r in records),
                        "within_target": max(latencies) <= TARGET_S,
                    }
                    results["runs"].append(run)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
                notify.close()
    print(
        f"{'subscribers':>11} {'events':>6} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7} "
        f"{'daemon max':>10} {'transport max':>13}  <= {TARGET_S * 1000:.0f} ms"
    )
    for run in results["runs"]:
        print(
            f"{run['subscribers']:>11} {run['events']:>6} {run['p50_ms']:>7.2f} "
            f"{run['p95_ms']:>7.2f} {run['max_ms']:>7.2f} {run['daemon_max_ms']:>10.2f} "
            f"{run['transport_max_ms']:>13.2f}  {'PASS' if run['within_target'] else 'FAIL'}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "events.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
