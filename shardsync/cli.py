"""The ``shardsync`` command line.

Errors end as one clear line on stderr and an exit code that says which kind
(see the README's table), never as a traceback for a condition we expected.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from shardsync import errors
from shardsync.config import Config, load_config, parse_size
from shardsync.prefetch import PrefetchResult, prefetch
from shardsync.progress import format_bytes, make_progress

__all__ = ["EXIT_CODES", "main"]

EXIT_CODES: dict[type[errors.ShardsyncError], int] = {
    errors.ConfigError: 2,
    errors.RepoNotFoundError: 3,
    errors.RevisionNotFoundError: 3,
    errors.EntryNotFoundError: 3,
    errors.AuthError: 4,
    errors.ManifestError: 5,
    errors.ProtocolError: 6,
    errors.OriginError: 6,
    errors.TransferError: 6,
    errors.IntegrityError: 7,
    errors.DiskFullError: 8,
    errors.CacheError: 9,
    errors.OfflineError: 10,
}


def _exit_code(exc: errors.ShardsyncError) -> int:
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsync",
        description="Fast, verified, resumable downloads of sharded model checkpoints.",
    )
    parser.add_argument("--config", type=Path, help="TOML config file (see config.example.toml)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prefetch", help="download a checkpoint into the cache")
    p.add_argument("source", help="ORG/NAME on the Hub, an http(s) base URL, or a directory")
    p.add_argument("--revision", help="branch, tag, commit or refs/pr/N (default: main)")
    p.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    p.add_argument("--cache-dir", type=Path, help="cache root (default: $SHARDSYNC_CACHE_DIR)")
    p.add_argument("--include", action="append", metavar="GLOB", help="small files to fetch")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB")
    p.add_argument("--offline", action="store_true", help="answer from the cache, no requests")
    p.add_argument("--allow-pickle", action="store_true", help="accept .bin checkpoints")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress output")

    ld = sub.add_parser("load", help="stream a checkpoint onto devices and report timings")
    ld.add_argument("source", help="ORG/NAME on the Hub, an http(s) base URL, or a directory")
    ld.add_argument("--revision")
    ld.add_argument("--endpoint")
    ld.add_argument("--cache-dir", type=Path)
    ld.add_argument(
        "--device-map",
        default="auto",
        help="auto|balanced|balanced_low_0|sequential|cpu|cuda:N, or JSON {prefix: device}",
    )
    ld.add_argument(
        "--max-memory",
        action="append",
        default=[],
        metavar="DEVICE=SIZE",
        help="budget per device, e.g. cuda:0=20GiB (repeatable)",
    )
    ld.add_argument("--dtype", help="cast floating tensors on the device, e.g. bfloat16")
    ld.add_argument("--json", action="store_true", help="print the plan and timings as JSON")

    d = sub.add_parser("demo", help="prefetch a generated checkpoint from a local fake hub")
    d.add_argument("--size", default="256MiB", help="checkpoint size (default 256MiB)")
    d.add_argument("--shards", type=int, default=4)
    d.add_argument("--cache-dir", type=Path, help="cache root (default: a temporary directory)")
    d.add_argument("--bandwidth", help="per-connection cap, e.g. 25MB (default: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prefetch":
            return _prefetch(args)
        if args.command == "load":
            return _load(args)
        return _demo(args)
    except errors.ShardsyncError as exc:
        print(f"shardsync: error: {exc}", file=sys.stderr)
        return _exit_code(exc)
    except KeyboardInterrupt:
        print("shardsync: interrupted; partial files are kept for the next run", file=sys.stderr)
        return 130


def _config(args: argparse.Namespace) -> Config:
    config = load_config(args.config, os.environ, cache_dir=args.cache_dir)
    endpoint = getattr(args, "endpoint", None)
    return replace(config, endpoint=endpoint) if endpoint else config


def _prefetch(args: argparse.Namespace) -> int:
    config = _config(args)
    progress = None if args.quiet or args.offline else make_progress(sys.stderr, args.source)
    try:
        result = asyncio.run(
            prefetch(
                args.source,
                config,
                revision=args.revision,
                include=args.include,
                exclude=args.exclude,
                offline=args.offline,
                allow_pickle=args.allow_pickle,
                progress=progress,
            )
        )
    finally:
        if progress is not None:
            progress.close()
    _report(result, as_json=args.json, quiet=args.quiet)
    return 0


def _report(result: PrefetchResult, *, as_json: bool, quiet: bool) -> None:
    if as_json:
        print(json.dumps(result_to_json(result), indent=2))
        return
    if not quiet:
        tofu = sum(1 for f in result.files if f.verified == "tofu")
        note = f", {tofu} trusted on first use (origin publishes no sha256)" if tofu else ""
        rate = result.bytes_downloaded / max(result.elapsed, 1e-9)
        print(
            f"{len(result.files)} files, {format_bytes(result.total_size)} verified; "
            f"downloaded {format_bytes(result.bytes_downloaded)} in {result.elapsed:.1f}s "
            f"({format_bytes(rate)}/s){note}",
            file=sys.stderr,
        )
    print(result.snapshot_path)


def result_to_json(result: PrefetchResult) -> dict[str, object]:
    """The documented ``--json`` shape (stable: fields are only ever added)."""
    return {
        "repo": result.repo.name,
        "origin": result.repo.kind,
        "revision": result.revision,
        "commit": result.commit,
        "snapshot_path": str(result.snapshot_path),
        "bytes_downloaded": result.bytes_downloaded,
        "total_size": result.total_size,
        "elapsed_s": round(result.elapsed, 3),
        "files": [
            {
                "path": f.path,
                "size": f.size,
                "sha256": f.sha256,
                "verified": f.verified,
                "source": f.source,
                "downloaded": f.downloaded,
                "resumed": f.resumed,
            }
            for f in result.files
        ],
    }


def _load(args: argparse.Namespace) -> int:
    """Stream every tensor onto its device; print the plan, then what it took."""
    import torch

    from shardsync.loader import stream

    device_map: str | dict[str, str] = args.device_map
    if args.device_map.lstrip().startswith("{"):
        try:
            device_map = json.loads(args.device_map)
        except ValueError as exc:
            raise errors.ConfigError(f"--device-map: invalid JSON: {exc}") from None
    max_memory: dict[str | int, int | str] = {}
    for item in args.max_memory:
        device, sep, size = item.partition("=")
        if not sep:
            raise errors.ConfigError(f"--max-memory expects DEVICE=SIZE, got {item!r}")
        max_memory[device] = size
    dtype = None
    if args.dtype:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise errors.ConfigError(f"--dtype: unknown torch dtype {args.dtype!r}")
    with stream(
        args.source,
        revision=args.revision,
        device_map=device_map,
        max_memory=max_memory or None,
        dtype=dtype,
        config=_config(args),
    ) as tensors:
        plan = tensors.plan
        if plan is None:
            raise errors.ConfigError("shardsync load streams safetensors checkpoints only")
        if not args.json:
            print("device plan:", file=sys.stderr)
            for use in plan.usage:
                print(
                    f"  {use.device:>8}: {format_bytes(use.bytes):>10}  {use.tensors:6d} tensors"
                    f"  {use.layers:4d} layers",
                    file=sys.stderr,
                )
        placed = dict(tensors)
        stats = tensors.statistics()
    report = {
        "plan": [
            {"device": u.device, "bytes": u.bytes, "tensors": u.tensors, "layers": u.layers}
            for u in plan.usage
        ],
        "tensors": len(placed),
        "bytes": stats.bytes,
        "bytes_downloaded": stats.bytes_downloaded,
        "plan_ready_s": round(stats.plan_ready, 3),
        "first_tensor_s": round(stats.first_tensor or 0.0, 3),
        "total_s": round(stats.finished or 0.0, 3),
        "throughput_bytes_per_s": round(stats.throughput),
        "peak_rss_bytes": stats.peak_rss,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{len(placed)} tensors, {format_bytes(stats.bytes)} on their devices; "
            f"first tensor after {report['first_tensor_s']}s, all after {report['total_s']}s "
            f"({format_bytes(stats.throughput)}/s); peak host RSS "
            f"{format_bytes(stats.peak_rss)}",
            file=sys.stderr,
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Generate a checkpoint, serve it from a fake hub on loopback, prefetch it."""
    from shardsync.testing import FakeHub, build_checkpoint, serve_in_thread
    from shardsync.testing.faults import Bandwidth

    total = parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="shardsync-demo-") as tmp:
        work = Path(tmp)
        print(
            f"demo: building a {format_bytes(total)} checkpoint in {args.shards} shards...",
            file=sys.stderr,
        )
        checkpoint = build_checkpoint(work / "origin", total_bytes=total, n_shards=args.shards)
        hub = FakeHub()
        hub.add_checkpoint("demo/tiny-llama", checkpoint)
        if args.bandwidth:
            hub.faults.add(Bandwidth(parse_size(args.bandwidth)))
        cache_dir = args.cache_dir or work / "cache"
        config = replace(load_config(args.config, os.environ, cache_dir=cache_dir))
        with serve_in_thread(hub):
            config = replace(config, endpoint=hub.endpoint)
            print(f"demo: fake hub at {hub.endpoint} (CDN {hub.cdn_endpoint})", file=sys.stderr)
            progress = make_progress(sys.stderr, "demo/tiny-llama")
            try:
                result = asyncio.run(prefetch("demo/tiny-llama", config, progress=progress))
            finally:
                progress.close()
        _report(result, as_json=False, quiet=False)
        if args.cache_dir is None:
            print("demo: (temporary cache removed; pass --cache-dir to keep it)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
