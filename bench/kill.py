"""What a ``kill -9`` costs: bytes fetched again after a kill, as a fraction of the model.

    python bench/kill.py [--size 1GB] [--shards 4] [--bandwidth 25MB] [--latency 0.02]
                         [--scenarios one,five,daemon] [--seed 0] [--json bench/kill.json]

Scenarios (each on a fresh cache):

- ``one``: ``shardsync prefetch`` killed once 40% of the model has been served, then rerun.
- ``five``: killed five times, each at a random point (seeded) of what is left, then rerun.
- ``daemon``: the daemon killed once 40% has been served, restarted, the client rerun.

The fake Hub runs in this process (so it can count every byte it sends, per request) with a
per-connection cap and first-byte latency, like a CDN link; the clients are real processes.
"Extra" is (bytes served in all) / (model bytes) - 1: what the kills cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemons import DaemonProcess, write_config

from shardsync.config import parse_size
from shardsync.testing import Bandwidth, FakeHub, Latency, build_checkpoint, serve_in_thread

REPO = "bench/kill"


def _prefetch(
    endpoint: str, cache: Path, *, daemon: bool, config: Path | None = None
) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "shardsync.cli"]
    if config is not None:
        args += ["--config", str(config)]
    args += ["prefetch", REPO, "--endpoint", endpoint, "--cache-dir", str(cache), "--quiet"]
    if not daemon:
        args.append("--no-daemon")
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _served(hub: FakeHub) -> int:
    """Shard bytes the hub has sent, bodies still flowing included. Partial files are
    preallocated, so their size on disk says nothing about progress; this does."""
    return hub.bytes_served("*.safetensors")


def _wait_served(hub: FakeHub, target: int, proc: subprocess.Popen[bytes] | None) -> bool:
    """Until the hub has sent ``target`` shard bytes (False if the client finished first)."""
    while _served(hub) < target:
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.005)
    return True


def _finish(proc: subprocess.Popen[bytes]) -> None:
    _out, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"prefetch failed ({proc.returncode}): {err.decode()[-2000:]}")


def one(hub: FakeHub, model: int, work: Path, rng: random.Random) -> dict[str, float]:
    cache = work / "cache"
    proc = _prefetch(hub.endpoint, cache, daemon=False)
    killed = _wait_served(hub, int(0.4 * model), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at = _served(hub)
    _finish(_prefetch(hub.endpoint, cache, daemon=False))
    return {"killed_at": round(at / model, 3), "kills": int(killed)}


def five(hub: FakeHub, model: int, work: Path, rng: random.Random) -> dict[str, float]:
    cache = work / "cache"
    kills = 0
    points = []
    for _ in range(5):
        proc = _prefetch(hub.endpoint, cache, daemon=False)
        # a random early point: 2-12% of the model more than has been served so far
        target = _served(hub) + int(rng.uniform(0.02, 0.12) * model)
        if _wait_served(hub, target, proc):
            kills += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        points.append(round(_served(hub) / model, 3))
    _finish(_prefetch(hub.endpoint, cache, daemon=False))
    return {"kills": kills, "points": points}  # type: ignore[dict-item]


def daemon(hub: FakeHub, model: int, work: Path, rng: random.Random) -> dict[str, float]:
    sock = Path(tempfile.mkdtemp(prefix="kb-", dir="/tmp")) / "d.sock"
    config = write_config(
        work / "d.toml", cache=work / "cache", endpoint=hub.endpoint, socket_path=sock
    )
    config.write_text(
        config.read_text()
        .replace('connections_per_file = 2\nchunk_size = "1MiB"\nwrite_size = "64KiB"\n', "")
        .replace('read_size = "64KiB"\nsidecar_interval = 0.05\n', "")
    )
    first = DaemonProcess(config, work)
    first.start()
    client = _prefetch(hub.endpoint, work / "cache", daemon=True, config=config)
    killed = _wait_served(hub, int(0.4 * model), client)
    assert first.proc is not None
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    at = _served(hub)
    client.kill()
    client.wait()
    first.close()
    second = DaemonProcess(config, work)
    second.start()
    try:
        _finish(_prefetch(hub.endpoint, work / "cache", daemon=True, config=config))
    finally:
        second.close()
        shutil.rmtree(sock.parent, ignore_errors=True)
    return {"killed_at": round(at / model, 3), "kills": int(killed)}


SCENARIOS: dict[str, Callable[[FakeHub, int, Path, random.Random], dict[str, float]]] = {
    "one": one,
    "five": five,
    "daemon": daemon,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--bandwidth", default="25MB", help="per connection")
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--scenarios", default="one,five,daemon")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = {}
    with tempfile.TemporaryDirectory(prefix="shardsync-kill-") as tmp:
        root = Path(tmp)
        ckpt = build_checkpoint(
            root / "ckpt", total_bytes=parse_size(args.size), n_shards=args.shards
        )
        model = sum(ckpt.path(s).stat().st_size for s in ckpt.shards)
        for name in args.scenarios.split(","):
            hub = FakeHub()
            hub.add_checkpoint(REPO, ckpt)
            hub.faults.add(Bandwidth(parse_size(args.bandwidth)))
            hub.faults.add(Latency(args.latency))
            work = root / name
            work.mkdir()
            with serve_in_thread(hub) as running:
                started = time.monotonic()
                detail = SCENARIOS[name](running, model, work, rng)
                served = running.bytes_served("*.safetensors")
            extra = served / model - 1
            results[name] = {
                "extra": round(extra, 4),
                "seconds": round(time.monotonic() - started, 1),
                **detail,
            }
            print(
                f"{name:>7}: {extra * 100:+.1f}% of the model fetched again ({detail})", flush=True
            )
            shutil.rmtree(work, ignore_errors=True)
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    report = {
        "size": args.size,
        "shards": args.shards,
        "bandwidth": args.bandwidth,
        "latency": args.latency,
        "seed": args.seed,
        "machine": machine,
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
