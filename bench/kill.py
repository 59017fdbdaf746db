"""What a ``kill -9`` costs: bytes fetched again after a kill, as a fraction of the model.

    python bench/kill.py [--size 1GB] [--shards 4] [--bandwidth 25MB] [--latency 0.02]
                         [--scenarios one,five,daemon] [--seed 0]
                         [--json bench/results/kill.json]

    python bench/kill.py [--server nginx|fakehub] [--size 1GB] [--shards 4] ...

Scenarios (each on a fresh cache):

- ``one``: ``shardsync prefetch`` killed once 40% of the model has been served, then rerun.
- ``five``: killed five times, each at a random point (seeded) of what is left, then rerun.
- ``daemon``: the daemon killed once 40% has been served, restarted, the client rerun.

``--server nginx`` (the default): nginx serves the shards with ``limit_rate`` per connection,
the fake Hub (its own process) answers the API and redirects, as in ``bench/download.py``.
Kills are timed by the bytes nginx's open connections have sent (``ss``'s ``bytes_sent``);
what each request really sent is read from nginx's access log afterwards.
``--server fakehub``: the Python fake Hub serves every byte from this process and counts
them as they flow. It is a CPU-hungry server sharing the client's cores, so clients fall
behind and more bytes sit in socket buffers at a kill; kept to compare.

"Extra" is (shard bytes served in all) / (model bytes) - 1: what the kills cost. Two counts:
nginx's access log (bytes its writes handed to the kernel), and "on the wire": that less what
was still in nginx's socket buffers, unsent, when the client was killed (``ss``'s
``notsent``, read just before the ``kill -9``). Those bytes never left the server: the
client's reset discards them, and no link carries or bills them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import common  # bench/common.py, beside this script: the checkpoint, nginx and the fake Hub

from shardsync.config import parse_size
from shardsync.testing import Bandwidth, FakeHub, Latency, build_checkpoint, serve_in_thread
from shardsync.testing.daemons import DaemonProcess, write_config


class Server(Protocol):
    """Where the clients download from, and how many shard bytes it has sent."""

    endpoint: str
    repo: str

    def served(self) -> int:
        """Shard bytes sent so far, bodies still flowing included (partial files are
        preallocated, so their size on disk says nothing about progress)."""
        ...

    def settle(self) -> int:
        """Once the clients so far are gone (killed or done): the exact shard bytes sent in
        all; a later ``served`` counts on from there."""
        ...

    def unsent(self) -> int:
        """Of what ``settle`` will count, the bytes still in the server's socket buffers
        now, never sent on the wire: a killed client's reset throws them away there."""
        ...


class FakeHubServer:
    def __init__(self, hub: FakeHub, repo: str) -> None:
        self.endpoint, self.repo, self._hub = hub.endpoint, repo, hub

    def served(self) -> int:
        return self._hub.bytes_served("*.safetensors")

    def settle(self) -> int:
        return self.served()

    def unsent(self) -> int:
        return 0  # it counts a byte once its socket write returned; not known per socket


class NginxServer:
    """nginx's access log holds what each finished request sent; its open connections'
    ``bytes_sent`` (from ``ss``) what the running ones have. A client keeps its connections
    for the whole run, so the live count of a run is the log up to its start plus those."""

    def __init__(self, servers: common.Servers, port: int) -> None:
        self.endpoint, self.repo = servers.endpoint, common.REPO_ID
        self._servers, self._port = servers, port
        self._logged = 0

    def served(self) -> int:
        return self._logged + sum(int(n) for n in re.findall(r"bytes_sent:(\d+)", self._ss()))

    def unsent(self) -> int:
        return sum(int(n) for n in re.findall(r"notsent:(\d+)", self._ss()))

    def _ss(self) -> str:
        argv = ["ss", "-tinH", "state", "established", f"( sport = :{self._port} )"]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

    def settle(self) -> int:
        time.sleep(0.3)  # nginx logs a request once it notices its end
        self._logged += self._servers.cdn_since_last()[1]
        return self._logged


def _prefetch(
    server: Server, cache: Path, *, daemon: bool, config: Path | None = None
) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "shardsync.cli"]
    if config is not None:
        args += ["--config", str(config)]
    args += ["prefetch", server.repo, "--endpoint", server.endpoint]
    args += ["--cache-dir", str(cache), "--quiet"]
    if not daemon:
        args.append("--no-daemon")
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_served(server: Server, target: int, proc: subprocess.Popen[bytes] | None) -> bool:
    """Until ``target`` shard bytes are sent (False if the client finished first).

    Each ``served`` of nginx runs ``ss``: about 4 ms of CPU. Polled every 5 ms, the probe
    took about half of one of this box's two cores from the client it was timing, and more
    bytes waited in socket buffers at the kill than without it. So it sleeps for half the
    time the last rate says is left (5-200 ms): few polls early, dense ones near the target.
    """
    then, seen = time.monotonic(), server.served()
    while seen < target:
        if proc is not None and proc.poll() is not None:
            return False
        now, served = time.monotonic(), server.served()
        rate = (served - seen) / max(now - then, 1e-3)
        then, seen = now, served
        time.sleep(min(0.2, max(0.005, 0.5 * (target - seen) / rate if rate > 0 else 0.05)))
    return True


def _kill(server: Server, *procs: subprocess.Popen[bytes] | subprocess.Popen[str]) -> int:
    """``kill -9`` the processes; returns the bytes the server had not sent on the wire just
    before (read in the few ms before the kill: what nginx queues in them is not counted
    as unsent, what it sends is, a few MB either way at most).

    Not ``SIGSTOP``, read, then kill: a stopped client's kernel still takes in as much as
    its receive windows allow, tens of MB in a few ms on loopback, that a real kill would
    have refused."""
    unsent = server.unsent()
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
    return unsent


def _finish(proc: subprocess.Popen[bytes]) -> None:
    _out, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"prefetch failed ({proc.returncode}): {err.decode()[-2000:]}")


def one(server: Server, model: int, work: Path, rng: random.Random) -> dict[str, float]:
    cache = work / "cache"
    proc = _prefetch(server, cache, daemon=False)
    killed = _wait_served(server, int(0.4 * model), proc)
    unsent = _kill(server, proc)
    at = server.settle()
    _finish(_prefetch(server, cache, daemon=False))
    return {"killed_at": round(at / model, 3), "kills": int(killed), "unsent": unsent}


def five(server: Server, model: int, work: Path, rng: random.Random) -> dict[str, float]:
    cache = work / "cache"
    kills = unsent = 0
    points = []
    for _ in range(5):
        proc = _prefetch(server, cache, daemon=False)
        # a random early point: 2-12% of the model more than has been served so far
        target = server.served() + int(rng.uniform(0.02, 0.12) * model)
        if _wait_served(server, target, proc):
            kills += 1
        unsent += _kill(server, proc)
        points.append(round(server.settle() / model, 3))
    _finish(_prefetch(server, cache, daemon=False))
    return {"kills": kills, "points": points, "unsent": unsent}  # type: ignore[dict-item]


def daemon(server: Server, model: int, work: Path, rng: random.Random) -> dict[str, float]:
    sock = Path(tempfile.mkdtemp(prefix="kb-", dir="/tmp")) / "d.sock"
    config = write_config(
        work / "d.toml", cache=work / "cache", endpoint=server.endpoint, socket_path=sock
    )
    config.write_text(
        config.read_text()
        .replace('connections_per_file = 2\nchunk_size = "1MiB"\nwrite_size = "64KiB"\n', "")
        .replace('read_size = "64KiB"\nsidecar_interval = 0.05\n', "")
    )
    first = DaemonProcess(config, work)
    first.start()
    client = _prefetch(server, work / "cache", daemon=True, config=config)
    killed = _wait_served(server, int(0.4 * model), client)
    assert first.proc is not None
    unsent = _kill(server, first.proc, client)
    at = server.settle()
    first.close()
    second = DaemonProcess(config, work)
    second.start()
    try:
        _finish(_prefetch(server, work / "cache", daemon=True, config=config))
    finally:
        second.close()
        shutil.rmtree(sock.parent, ignore_errors=True)
    return {"killed_at": round(at / model, 3), "kills": int(killed), "unsent": unsent}


SCENARIOS: dict[str, Callable[[Server, int, Path, random.Random], dict[str, float]]] = {
    "one": one,
    "five": five,
    "daemon": daemon,
}


@contextlib.contextmanager
def fakehub_server(args: argparse.Namespace, root: Path) -> Iterator[tuple[Server, int]]:
    ckpt = build_checkpoint(root / "ckpt", total_bytes=parse_size(args.size), n_shards=args.shards)
    hub = FakeHub()
    hub.add_checkpoint("bench/kill", ckpt)
    hub.faults.add(Bandwidth(parse_size(args.bandwidth)))
    hub.faults.add(Latency(args.latency))
    with serve_in_thread(hub) as running:
        yield (
            FakeHubServer(running, "bench/kill"),
            sum(ckpt.path(s).stat().st_size for s in ckpt.shards),
        )


@contextlib.contextmanager
def nginx_server(args: argparse.Namespace, root: Path) -> Iterator[tuple[Server, int]]:
    data_dir = common.data_dir_for(args.size, args.shards)
    origin = common.ensure_origin(data_dir, parse_size(args.size), args.shards, args.size)
    scenario = common.Scenario("kill", float(parse_size(args.bandwidth)), args.latency or None)
    with common.serve_scenario(origin, scenario, data_dir) as servers:
        port = int(servers.nginx.url.rsplit(":", 1)[1])
        yield NginxServer(servers, port), sum(size for size, _ in origin.lfs.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=("nginx", "fakehub"), default="nginx")
    parser.add_argument("--size", default="1GB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--bandwidth", default="25MB", help="per connection")
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--scenarios", default="one,five,daemon")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", type=Path, default=common.RESULTS / "kill.json", help="default results/kill.json"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    serve = nginx_server if args.server == "nginx" else fakehub_server
    results = {}
    with tempfile.TemporaryDirectory(prefix="shardsync-kill-") as tmp:
        root = Path(tmp)
        for name in args.scenarios.split(","):
            work = root / name
            work.mkdir()
            with serve(args, root) as (server, model):
                started = time.monotonic()
                detail = SCENARIOS[name](server, model, work, rng)
                served = server.settle()
            extra = served / model - 1
            wire = (served - detail["unsent"]) / model - 1
            results[name] = {
                "extra": round(extra, 4),
                "extra_on_wire": round(wire, 4),
                "seconds": round(time.monotonic() - started, 1),
                **detail,
            }
            print(
                f"{name:>7}: {wire * 100:+.1f}% of the model sent again on the wire, "
                f"{extra * 100:+.1f}% by nginx's log ({detail})",
                flush=True,
            )
            shutil.rmtree(work, ignore_errors=True)
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    report = {
        "server": args.server,
        "size": args.size,
        "shards": args.shards,
        "bandwidth": args.bandwidth,
        "latency": args.latency,
        "seed": args.seed,
        "machine": machine,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
