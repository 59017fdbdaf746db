"""Benchmark: time until every tensor is on its device, download included.

Same fake hub and emulated link as ``bench/download.py`` (per-connection cap and first-byte
latency), in one run:

  (a) huggingface_hub.snapshot_download, then safetensors.torch.load_file of every shard
  (b) shardsync prefetch, then load_file of every shard
  (c) shardsync.load, pipelined (tensors placed while later shards download)

It prints the time to all tensors on the device and the peak RSS of each (the child's own
``ru_maxrss``), the download-only time of shardsync, and the issue's targets:
(c) <= 1.15 x download-only, (c) <= 0.6 x (a), and peak RSS of (c) <= model + largest shard.
On CPU every variant hands out memory-mapped tensors (safetensors does too), so "on the
device" means usable, not read; on CUDA the bytes are really copied.

    python bench/load.py [--size 2GB] [--shards 4] [--device cpu|cuda:0] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from download import (  # a sibling script, not a package
    REPO_ID,
    Origin,
    Scenario,
    Settings,
    clean_env,
    ensure_origin,
    machine_info,
    serve_hub,
)

_LOAD_SHARDS = """
import glob, json, os, sys, time, resource
from safetensors.torch import load_file
start = time.monotonic()
tensors = {}
for shard in sorted(glob.glob(os.path.join(sys.argv[1], "*.safetensors"))):
    tensors.update(load_file(shard, device=sys.argv[2]))
print(json.dumps({"tensors": len(tensors), "seconds": time.monotonic() - start}))
"""
_HF_THEN_LOAD = (
    """
import sys
from huggingface_hub import snapshot_download
path = snapshot_download(sys.argv[1], endpoint=sys.argv[2], cache_dir=sys.argv[3])
sys.argv = [sys.argv[0], path, sys.argv[4]]
"""
    + _LOAD_SHARDS
)
_SHARDSYNC_LOAD = """
import json, sys, time
from pathlib import Path
import shardsync
start = time.monotonic()
tensors = shardsync.load(sys.argv[1], device_map=sys.argv[4], endpoint=sys.argv[2],
                         cache_dir=Path(sys.argv[3]))
print(json.dumps({"tensors": len(tensors), "seconds": time.monotonic() - start}))
"""


@dataclass(frozen=True, slots=True)
class Result:
    variant: str
    seconds: float
    download_seconds: float | None
    peak_rss: int
    tensors: int


def _child(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Run one child; wall seconds, its own peak RSS in bytes, and its stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[:3]} failed: {err.read().decode()[-2000:]}")
        return seconds, usage.ru_maxrss * 1024, out.read().decode()


def run_variants(endpoint: str, scratch: Path, device: str) -> list[Result]:
    env = clean_env(scratch, endpoint)
    py = sys.executable
    results = []

    work = scratch / "a"
    seconds, rss, out = _child([py, "-c", _HF_THEN_LOAD, REPO_ID, endpoint, str(work), device], env)
    results.append(
        Result(
            "a: snapshot_download + load_file",
            seconds,
            None,
            rss,
            json.loads(out.splitlines()[-1])["tensors"],
        )
    )
    shutil.rmtree(work, ignore_errors=True)

    work = scratch / "b"
    shardsync = [
        py,
        "-m",
        "shardsync.cli",
        "prefetch",
        REPO_ID,
        "--endpoint",
        endpoint,
        "--cache-dir",
        str(work),
        "--quiet",
    ]
    download, rss_b1, out = _child(shardsync, env)
    snapshot = out.strip().splitlines()[-1]
    load_s, rss_b2, out = _child([py, "-c", _LOAD_SHARDS, snapshot, device], env)
    results.append(
        Result(
            "b: shardsync prefetch + load_file",
            download + load_s,
            download,
            max(rss_b1, rss_b2),
            json.loads(out.splitlines()[-1])["tensors"],
        )
    )
    shutil.rmtree(work, ignore_errors=True)

    work = scratch / "c"
    seconds, rss, out = _child(
        [py, "-c", _SHARDSYNC_LOAD, REPO_ID, endpoint, str(work), device], env
    )
    results.append(
        Result(
            "c: shardsync.load (pipelined)",
            seconds,
            None,
            rss,
            json.loads(out.splitlines()[-1])["tensors"],
        )
    )
    shutil.rmtree(work, ignore_errors=True)
    return results


def checks(results: list[Result], origin: Origin) -> list[tuple[str, bool, str]]:
    a, b, c = results
    download = b.download_seconds or float("nan")
    largest = max(size for path, (size, _) in origin.files.items() if path.endswith(".safetensors"))
    budget = origin.total_size + largest
    return [
        (
            "(c) <= 1.15 x download-only",
            c.seconds <= 1.15 * download,
            f"{c.seconds:.2f} s vs {download:.2f} s ({c.seconds / download:.2f}x)",
        ),
        (
            "(c) <= 0.6 x (a)",
            c.seconds <= 0.6 * a.seconds,
            f"{c.seconds:.2f} s vs {a.seconds:.2f} s ({c.seconds / a.seconds:.2f}x)",
        ),
        (
            "peak RSS (c) <= model + largest shard",
            c.peak_rss <= budget,
            f"{c.peak_rss / 2**20:.0f} MiB vs {budget / 2**20:.0f} MiB",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="2GB")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--bandwidth", type=float, default=25_000_000)
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    from shardsync.config import parse_size

    size = parse_size(args.size)
    data_dir = Path(f"/tmp/shardsync-bench-data/{args.size}-{args.shards}")
    settings = Settings(
        size=size,
        size_label=args.size,
        shards=args.shards,
        bandwidth=args.bandwidth,
        latency=args.latency,
        repeat=1,
        out=args.out,
        tools=(),
        scenarios=("capped",),
        data_dir=data_dir,
        shardsync_config=None,
    )
    origin = ensure_origin(settings)
    scenario = Scenario("capped", args.bandwidth, args.latency)
    with tempfile.TemporaryDirectory(prefix="shardsync-load-bench-") as tmp:
        scratch = Path(tmp)
        with serve_hub(origin, scenario, scratch) as endpoint:
            results = run_variants(endpoint, scratch, args.device)
    print(
        f"\n{origin.total_size / 1e9:.2f} GB, {args.shards} shards, "
        f"{args.bandwidth / 1e6:.0f} MB/s per connection, {args.latency * 1000:.0f} ms latency, "
        f"device {args.device}"
    )
    print(f"{'variant':40} {'seconds':>8} {'download':>9} {'peak RSS':>10} {'tensors':>8}")
    for r in results:
        dl = f"{r.download_seconds:.2f}" if r.download_seconds else "-"
        print(
            f"{r.variant:40} {r.seconds:8.2f} {dl:>9} {r.peak_rss / 2**20:7.0f} MiB {r.tensors:8d}"
        )
    verdicts = checks(results, origin)
    for target, ok, detail in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {target}: {detail}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "settings": {
                    "size": origin.total_size,
                    "shards": args.shards,
                    "bandwidth": args.bandwidth,
                    "latency": args.latency,
                    "device": args.device,
                },
                "results": [asdict(r) for r in results],
                "checks": [{"target": t, "pass": ok, "detail": d} for t, ok, d in verdicts],
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
