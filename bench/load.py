"""Benchmark: time until every tensor is on its device, download included.

Same fake hub and emulated link as ``bench/download.py`` (per-connection cap and first-byte
latency), in one run:

  (a) huggingface_hub.snapshot_download, then safetensors.torch.load_file of every shard
  (b) shardsync prefetch, then load_file of every shard
  (c) shardsync.load, pipelined (tensors placed while later shards download)

Each variant runs in fresh child processes that import torch, safetensors and the tool first;
its clock starts at the first call (a training script has imported torch long before it asks
for weights). It prints that time to all tensors on the device, the children's whole wall clock
("process": interpreter start and imports included), the peak RSS of each (the child's own
``ru_maxrss``), the download-only time of shardsync, each variant's CPU-s/GB (its children's
user + system time over the model's bytes) and, beside it, that less this machine's cost of the
hashes the variant computes (sha256 and xxh3-128 for shardsync, none for huggingface_hub, which
checks no digest; both measured at the start and the end of the run), and the issue's targets:
(c) <= 1.15 x download-only, (c) <= 0.6 x (a), and peak RSS of (c) <= model + largest shard.
On CPU every variant hands out memory-mapped tensors (safetensors does too), so "on the
device" means usable, not read; on CUDA the bytes are really copied.

    python bench/load.py [--size 2GB] [--shards 4] [--device cpu|cuda:0] [--repeat 3]
                         [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (  # bench/common.py, beside this script
    REPO_ID,
    RESULTS,
    Origin,
    Scenario,
    beyond_hashes,
    clean_env,
    cpu_model,
    ensure_origin,
    hash_costs,
    machine_info,
    mean_costs,
    serve_hub,
)

# Every child imports what it needs (torch included: any loader needs it) before its clock
# starts, so each variant is timed from the call to the last tensor, not from interpreter start.
_IMPORTS = """
import glob, json, os, sys, time
from pathlib import Path
import torch
from safetensors.torch import load_file


def elapsed(start):
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # every copy to the GPU has landed, not just been queued
    return time.monotonic() - start
"""
_LOAD_SHARDS = """
def load_shards(snapshot, device):
    tensors = {}
    for shard in sorted(glob.glob(os.path.join(snapshot, "*.safetensors"))):
        tensors.update(load_file(shard, device=device))
    return tensors
"""
_HF_THEN_LOAD = (
    _IMPORTS
    + _LOAD_SHARDS
    + """
from huggingface_hub import snapshot_download
start = time.monotonic()
path = snapshot_download(sys.argv[1], endpoint=sys.argv[2], cache_dir=sys.argv[3])
tensors = load_shards(path, sys.argv[4])
print(json.dumps({"tensors": len(tensors), "seconds": elapsed(start)}))
"""
)
_SHARDSYNC_PREFETCH = (
    _IMPORTS
    + """
import contextlib, io
from shardsync.cli import main
out = io.StringIO()
start = time.monotonic()
with contextlib.redirect_stdout(out):
    code = main(["prefetch", sys.argv[1], "--endpoint", sys.argv[2], "--cache-dir", sys.argv[3],
                 "--quiet"])
seconds = time.monotonic() - start
if code:
    sys.exit(code)
print(json.dumps({"snapshot": out.getvalue().strip().splitlines()[-1], "seconds": seconds}))
"""
)
_LOAD_SNAPSHOT = (
    _IMPORTS
    + _LOAD_SHARDS
    + """
start = time.monotonic()
tensors = load_shards(sys.argv[1], sys.argv[2])
print(json.dumps({"tensors": len(tensors), "seconds": elapsed(start)}))
"""
)
_SHARDSYNC_LOAD = (
    _IMPORTS
    + """
from shardsync import load
start = time.monotonic()
tensors = load(sys.argv[1], device_map=sys.argv[4], endpoint=sys.argv[2],
               cache_dir=Path(sys.argv[3]))
print(json.dumps({"tensors": len(tensors), "seconds": elapsed(start)}))
"""
)


HASHED = {"a": (), "b": ("sha256", "xxh3_128"), "c": ("sha256", "xxh3_128")}
"""The hashes each variant computes over every byte (by its letter): huggingface_hub checks
no digest of what it downloads; shardsync names each blob by its sha256 and keeps its xxh3-128
for ``verify``."""


@dataclass(frozen=True, slots=True)
class Result:
    variant: str
    seconds: float  # from the first call to the last tensor usable, imports excluded
    download_seconds: float | None
    process_seconds: float  # the children's wall clock, interpreter start and imports included
    peak_rss: int
    tensors: int
    cpu_seconds: float  # the children's user + system time, imports included


@dataclass(frozen=True, slots=True)
class Child:
    wall: float
    cpu: float
    peak_rss: int
    report: dict[str, Any]


def _child(script: str, args: list[str], env: dict[str, str]) -> Child:
    """Run one child script; its wall clock, its CPU time, its own peak RSS and the JSON it
    printed last."""
    argv = [sys.executable, "-c", script, *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
        returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if returncode != 0:
            raise RuntimeError(f"child {args[:1]} failed: {err.read().decode()[-2000:]}")
        report = json.loads(out.read().decode().splitlines()[-1])
        cpu = usage.ru_utime + usage.ru_stime
        return Child(wall, cpu, usage.ru_maxrss * 1024, report)


def run_variants(endpoint: str, scratch: Path, device: str) -> list[Result]:
    env = clean_env(scratch, endpoint)
    results = []

    work = scratch / "a"
    a = _child(_HF_THEN_LOAD, [REPO_ID, endpoint, str(work), device], env)
    results.append(
        Result(
            "a: snapshot_download + load_file",
            a.report["seconds"],
            None,
            a.wall,
            a.peak_rss,
            a.report["tensors"],
            a.cpu,
        )
    )
    shutil.rmtree(work, ignore_errors=True)

    work = scratch / "b"
    fetched = _child(_SHARDSYNC_PREFETCH, [REPO_ID, endpoint, str(work)], env)
    loaded = _child(_LOAD_SNAPSHOT, [fetched.report["snapshot"], device], env)
    results.append(
        Result(
            "b: shardsync prefetch + load_file",
            fetched.report["seconds"] + loaded.report["seconds"],
            fetched.report["seconds"],
            fetched.wall + loaded.wall,
            max(fetched.peak_rss, loaded.peak_rss),
            loaded.report["tensors"],
            fetched.cpu + loaded.cpu,
        )
    )
    shutil.rmtree(work, ignore_errors=True)

    work = scratch / "c"
    c = _child(_SHARDSYNC_LOAD, [REPO_ID, endpoint, str(work), device], env)
    results.append(
        Result(
            "c: shardsync.load (pipelined)",
            c.report["seconds"],
            None,
            c.wall,
            c.peak_rss,
            c.report["tensors"],
            c.cpu,
        )
    )
    shutil.rmtree(work, ignore_errors=True)
    return results


def medians(rounds: list[list[Result]]) -> list[Result]:
    """Per variant: the median of each time over the rounds (variants interleave, so a slow
    moment of the machine hits all alike), and the highest peak RSS."""
    merged = []
    for runs in zip(*rounds, strict=True):
        download = [r.download_seconds for r in runs if r.download_seconds is not None]
        merged.append(
            Result(
                runs[0].variant,
                statistics.median(r.seconds for r in runs),
                statistics.median(download) if download else None,
                statistics.median(r.process_seconds for r in runs),
                max(r.peak_rss for r in runs),
                runs[0].tensors,
                statistics.median(r.cpu_seconds for r in runs),
            )
        )
    return merged


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
    parser.add_argument(
        "--bandwidth", type=float, default=25_000_000, help="bytes/s per connection; 0: uncapped"
    )
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the medians count")
    parser.add_argument("--out", type=Path, default=RESULTS, help="default bench/results")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be positive")
    from shardsync.config import parse_size

    size = parse_size(args.size)
    data_dir = Path(f"/tmp/shardsync-bench-data/{args.size}-{args.shards}")
    origin = ensure_origin(data_dir, size, args.shards, args.size)
    scenario = Scenario("capped", args.bandwidth or None, args.latency)
    costs_before = hash_costs()
    with tempfile.TemporaryDirectory(prefix="shardsync-load-bench-") as tmp:
        scratch = Path(tmp)
        with serve_hub(origin, scenario, scratch) as endpoint:
            rounds = []
            for n in range(args.repeat):
                rounds.append(run_variants(endpoint, scratch, args.device))
                print(
                    f"round {n + 1}: "
                    + ", ".join(f"{r.variant[0]} {r.seconds:.2f} s" for r in rounds[-1]),
                    flush=True,
                )
    results = medians(rounds)
    costs = mean_costs(costs_before, hash_costs())
    gb = origin.total_size / 1e9
    print(
        f"\n{gb:.2f} GB, {args.shards} shards, "
        + (f"{args.bandwidth / 1e6:.0f} MB/s per connection" if args.bandwidth else "uncapped")
        + f", {args.latency * 1000:.0f} ms latency, "
        f"device {args.device}; machine: {cpu_model() or '?'}, {os.cpu_count()} cores, CPU-s/GB "
        f"of sha256 {costs['sha256']:.2f}, xxh3-128 {costs['xxh3_128']:.2f} (measured in this run)"
    )
    print(
        f"{'variant':36} {'seconds':>8} {'download':>9} {'process':>8} {'peak RSS':>10} "
        f"{'tensors':>8} {'CPU-s/GB':>9} {'beyond hash':>12}"
    )
    for r in results:
        dl = f"{r.download_seconds:.2f}" if r.download_seconds else "-"
        print(
            f"{r.variant:36} {r.seconds:8.2f} {dl:>9} {r.process_seconds:8.2f} "
            f"{r.peak_rss / 2**20:7.0f} MiB {r.tensors:8d} {r.cpu_seconds / gb:9.2f} "
            f"{beyond_hashes(r.cpu_seconds / gb, costs, HASHED[r.variant[0]]):12.2f}"
        )
    print(
        "(CPU-s/GB: every child's user + system time, imports included; beyond hash: that less\n"
        " this machine's cost of the hashes the variant computes: sha256 + xxh3-128 for\n"
        " shardsync, none for huggingface_hub, which checks no digest)"
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
                "repeat": args.repeat,
                "hash_cpu_s_per_gb": costs,  # this machine's, mean of the start and end
                "results": [asdict(r) for r in results],
                "rounds": [[asdict(r) for r in runs] for runs in rounds],
                "checks": [{"target": t, "pass": ok, "detail": d} for t, ok, d in verdicts],
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
