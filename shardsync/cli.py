"""The ``shardsync`` command line.

Errors end as one clear line on stderr and an exit code that says which kind
(see the README's table), never as a traceback for a condition we expected.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import json
import os
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from shardsync import errors
from shardsync.cli_output import ls_lines, print_result, prune_lines, status_lines, verify_lines
from shardsync.config import Config, check_endpoint, load_config, parse_duration, parse_size
from shardsync.names import source_kind
from shardsync.progress import format_bytes, make_progress
from shardsync.records import PrefetchResult, ProgressSink

if TYPE_CHECKING:
    # Each command imports what it runs when it runs: a prefetch the daemon does for us
    # loads no engine, no aiohttp and no botocore here.
    from shardsync.cache import CacheStore
    from shardsync.jobs import JobClient

_T = TypeVar("_T")

__all__ = ["EXIT_CODES", "main", "run"]

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
    errors.DaemonError: 11,
    errors.JobCancelledError: 12,
    errors.LoadError: 1,  # the checkpoint does not fit the model, or a load stopped
}


def _exit_code(exc: errors.ShardsyncError) -> int:
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1


_SOURCE_HELP = "ORG/NAME on the Hub, an http(s) base URL, s3://BUCKET/PREFIX/, or a directory"


def _user_path(text: str) -> Path:
    """A path as a user types it: ``--cache-dir=~/c`` is not expanded by the shell."""
    return Path(text).expanduser()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsync",
        description="Fast, verified, resumable downloads of sharded model checkpoints.",
    )
    parser.add_argument("--config", type=Path, help="TOML config file (see config.example.toml)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prefetch", help="download a checkpoint into the cache")
    p.add_argument("source", help=_SOURCE_HELP)
    p.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")
    p.add_argument("--revision", help="branch, tag, commit or refs/pr/N (default: main)")
    p.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or huggingface.co)")
    p.add_argument(
        "--cache-dir", type=_user_path, help="cache root (default: $SHARDSYNC_CACHE_DIR)"
    )
    p.add_argument("--include", action="append", metavar="GLOB", help="small files to fetch")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB")
    p.add_argument("--offline", action="store_true", help="answer from the cache, no requests")
    p.add_argument("--allow-pickle", action="store_true", help="accept .bin checkpoints")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--priority", type=int, default=0, help="daemon job priority (default 0)")
    p.add_argument(
        "--checkpoint",
        metavar="latest|NAME",
        help="a training checkpoint of the run at SOURCE (s3:// or a directory): the newest "
        "complete one, or the folder NAME (see README: Resuming training)",
    )
    p.add_argument("--rank", type=int, help="with --checkpoint: only the files this rank reads")
    p.add_argument("--world-size", type=int, help="with --checkpoint and --rank")
    p.add_argument(
        "--no-daemon", action="store_true", help="download in this process even if a daemon runs"
    )

    ld = sub.add_parser("load", help="stream a checkpoint onto devices and report timings")
    ld.add_argument("source", help=_SOURCE_HELP)
    ld.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")
    ld.add_argument("--revision")
    ld.add_argument("--endpoint")
    ld.add_argument("--cache-dir", type=_user_path)
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

    dm = sub.add_parser("daemon", help="serve prefetch jobs on a Unix socket (see README)")
    dm.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")

    st = sub.add_parser("status", help="the daemon's jobs, counters and cache usage")
    st.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")
    st.add_argument("--json", action="store_true", help="print the status as JSON")

    pr = sub.add_parser("prune", help="evict least recently used snapshots to fit limits")
    pr.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")
    pr.add_argument(
        "--cache-dir", type=_user_path, help="cache root (default: $SHARDSYNC_CACHE_DIR)"
    )
    pr.add_argument("--max-size", metavar="SIZE", help="prune the cache down to this, e.g. 500G")
    pr.add_argument("--min-free", metavar="SIZE", help="leave this much free on the disk")
    pr.add_argument("--max-age", metavar="AGE", help="evict what was unused this long, e.g. 30d")
    pr.add_argument(
        "--keep", nargs="+", action="extend", default=[], metavar="REPO", help="repos to spare"
    )
    pr.add_argument("--dry-run", action="store_true", help="say what would go, change nothing")
    pr.add_argument("--no-wait", action="store_true", help="skip if another prune is running")
    pr.add_argument("--json", action="store_true", help="print the report as JSON")

    vf = sub.add_parser("verify", help="re-hash cached blobs, quarantine corrupt ones")
    vf.add_argument("repo", nargs="?", help="only this repo (name or glob)")
    vf.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")
    vf.add_argument(
        "--cache-dir", type=_user_path, help="cache root (default: $SHARDSYNC_CACHE_DIR)"
    )
    vf.add_argument("--full", action="store_true", help="recompute sha256 too (slower)")
    vf.add_argument("--json", action="store_true", help="print the report as JSON")

    ls = sub.add_parser("ls", help="cached repos and snapshots: size, completeness, last use")
    ls.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")
    ls.add_argument(
        "--cache-dir", type=_user_path, help="cache root (default: $SHARDSYNC_CACHE_DIR)"
    )
    ls.add_argument("--json", action="store_true", help="print the listing as JSON")

    d = sub.add_parser("demo", help="prefetch a generated checkpoint from a local fake hub")
    d.add_argument("--size", default="256MiB", help="checkpoint size (default 256MiB)")
    d.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML config file")
    d.add_argument("--shards", type=int, default=4)
    d.add_argument(
        "--cache-dir", type=_user_path, help="cache root (default: a temporary directory)"
    )
    d.add_argument("--bandwidth", help="per-connection cap, e.g. 25MB (default: none)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "prefetch":
            return _prefetch(args)
        if args.command == "load":
            return _load(args)
        if args.command == "daemon":
            from shardsync.daemon import run_daemon

            return run_daemon(args.config, os.environ)
        if args.command == "status":
            return _status(args)
        if args.command == "prune":
            return _prune(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "ls":
            return _ls(args)
        return _demo(args)
    except errors.ShardsyncError as exc:
        print(f"shardsync: error: {exc}{_hint(exc)}", file=sys.stderr)
        return _exit_code(exc)
    except KeyboardInterrupt:
        print("shardsync: interrupted; partial files are kept for the next run", file=sys.stderr)
        return 130


def _hint(exc: errors.ShardsyncError) -> str:
    """What to do next, where the error alone does not say it."""
    if isinstance(exc, errors.RepoNotFoundError):
        # The Hub answers a private repo it will not show this token (or no token) with the
        # same 404 as a missing one: say so rather than let "not found" mislead.
        return (
            " (if the repo is private, the Hub hides it without a token that has access: "
            "set HF_TOKEN or run `hf auth login`)"
        )
    return ""


def _config(args: argparse.Namespace) -> Config:
    config = load_config(args.config, os.environ, cache_dir=args.cache_dir)
    endpoint = getattr(args, "endpoint", None)
    if endpoint is None:
        return config
    return replace(config, endpoint=check_endpoint("--endpoint", endpoint))


def _prefetch(args: argparse.Namespace) -> int:
    config = _config(args)
    config = replace(config, cache_dir=Path(os.path.abspath(config.cache_dir)))
    if args.checkpoint is not None or args.rank is not None or args.world_size is not None:
        return _prefetch_checkpoint(args, config)
    progress = None if args.quiet or args.offline else make_progress(sys.stderr, args.source)
    reported = False

    def report(result: PrefetchResult) -> None:
        """As soon as the snapshot is complete (uploads to a shared tier may go on); the JSON
        waits for them, so that its ``tier`` counters are final."""
        nonlocal reported, progress
        if progress is not None:
            progress.close()
            progress = None
        if args.json:
            return
        print_result(result, as_json=False, quiet=args.quiet)
        sys.stdout.flush()
        reported = True

    try:
        result = asyncio.run(_prefetch_somewhere(args, config, progress, report))
    finally:
        if progress is not None:
            progress.close()
    if not reported:
        print_result(result, as_json=args.json, quiet=args.quiet)
    return 0


def _prefetch_checkpoint(args: argparse.Namespace, config: Config) -> int:
    """``--checkpoint``: a training checkpoint (or one rank's files of it), in-process."""
    from shardsync.api import CheckpointResult
    from shardsync.checkpoint import prefetch_checkpoint

    if args.checkpoint is None:
        raise errors.ConfigError("--rank and --world-size go with --checkpoint latest|NAME")
    if (args.rank is None) != (args.world_size is None):
        raise errors.ConfigError("--rank and --world-size go together")
    if args.world_size is not None and not 0 <= args.rank < args.world_size:
        raise errors.ConfigError(
            f"--rank must be from 0 to --world-size - 1 (got {args.rank} of {args.world_size})"
        )
    if args.offline or args.revision or args.include or args.exclude or args.allow_pickle:
        raise errors.ConfigError(
            "--checkpoint takes none of --offline, --revision, --include, --exclude, --allow-pickle"
        )
    progress = None if args.quiet else make_progress(sys.stderr, args.source)

    async def somewhere() -> CheckpointResult:
        """Through the daemon when one serves this source and cache (one download per host
        however many ranks ask), else in-process."""

        async def by_daemon(client: JobClient) -> CheckpointResult:
            job = await client.prefetch(
                args.source,
                priority=args.priority,
                checkpoint=args.checkpoint,
                rank=args.rank,
                world_size=args.world_size,
            )
            return await job.wait_checkpoint(progress)

        result = await _via_daemon(args, config, by_daemon)
        if result is not None:
            return result
        return await prefetch_checkpoint(
            args.source,
            config,
            checkpoint=args.checkpoint,
            rank=args.rank,
            world_size=args.world_size,
            progress=progress,
        )

    try:
        result = asyncio.run(somewhere())
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    if not args.quiet:
        for skipped in result.skipped:
            print(f"skipped {skipped.name}: {skipped.reason}", file=sys.stderr)
        for note in result.notes:
            print(f"note: {note}", file=sys.stderr)
        print(f"{result.format} checkpoint {result.checkpoint}", file=sys.stderr)
    print_result(result.prefetch, as_json=False, quiet=args.quiet, path=False)
    print(result.path)
    return 0


async def _prefetch_somewhere(
    args: argparse.Namespace,
    config: Config,
    progress: ProgressSink | None,
    on_complete: Callable[[PrefetchResult], None] | None = None,
) -> PrefetchResult:
    """Through the daemon when one answers and serves what was asked; else in-process.
    ``on_complete`` gets the result as soon as the snapshot is complete; with ``--json`` the
    result returned has the job's final tier counters, after the uploads it owes the fleet
    (the daemon goes on with them; a job's record says when they ended)."""

    async def by_daemon(client: JobClient) -> PrefetchResult:
        job = await client.prefetch(
            args.source,
            revision=args.revision,
            include=args.include,
            exclude=args.exclude,
            priority=args.priority,
            allow_pickle=args.allow_pickle,
        )
        result = await job.wait(progress)
        if on_complete is not None:
            on_complete(result)
        return replace(result, tier=await job.wait_tier()) if args.json else result

    result = await _via_daemon(args, config, by_daemon)
    if result is not None:
        return result
    from shardsync.prefetch import prefetch

    return await prefetch(
        args.source,
        config,
        revision=args.revision,
        include=args.include,
        exclude=args.exclude,
        offline=args.offline,
        allow_pickle=args.allow_pickle,
        progress=progress,
        on_complete=on_complete,
    )


async def _via_daemon(
    args: argparse.Namespace, config: Config, run: Callable[[JobClient], Awaitable[_T]]
) -> _T | None:
    """``run`` with a client of the daemon; None to run in-process instead: ``--no-daemon``,
    ``--offline``, a source the daemon never reads (a client's directories), no daemon
    answering (when fallback allows), or one serving another cache or Hub than --cache-dir,
    $SHARDSYNC_CACHE_DIR or --endpoint ask for."""
    if args.no_daemon or args.offline:
        return None
    if source_kind(args.source) == "local":  # only this process may read the caller's folders
        return None
    from shardsync.jobs import daemon_for

    client = await daemon_for(config, cache_dir=_named_cache(args), endpoint=args.endpoint)
    if client is None:
        return None
    try:
        return await run(client)
    finally:
        await client.close()


def _named_cache(args: argparse.Namespace) -> Path | None:
    """The cache the user named (``--cache-dir``, else ``$SHARDSYNC_CACHE_DIR``), else None."""
    if args.cache_dir is not None:
        return Path(args.cache_dir)
    env = os.environ.get("SHARDSYNC_CACHE_DIR")
    return Path(env).expanduser() if env else None


def _status(args: argparse.Namespace) -> int:
    """The daemon's counters, jobs and cache usage; exit 11 when none answers."""
    from shardsync.jobs import JobClient

    config = load_config(args.config, os.environ)

    async def gather() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        async with JobClient(config, fallback="error") as client:
            jobs = [dict(j) for j in await client.jobs()]
            return await client.status(), jobs, await client.cache()

    status, jobs, cache = asyncio.run(gather())
    if args.json:
        print(json.dumps({"daemon": status, "jobs": jobs, "cache": cache}, indent=2))
        return 0
    for line in status_lines(status, jobs, cache):
        print(line)
    return 0


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
        cache_dir=_named_cache(args),
        endpoint=args.endpoint,
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
    from shardsync.prefetch import prefetch
    from shardsync.testing import FakeHub, build_checkpoint, serve_in_thread
    from shardsync.testing.faults import Bandwidth

    total = _flag_size("--size", args.size)
    if total < 1 << 20 or total > 64 << 30:
        raise errors.ConfigError(f"--size: between 1MiB and 64GiB, got {args.size!r}")
    if not 1 <= args.shards <= 1000:
        raise errors.ConfigError(f"--shards: a whole number from 1 to 1000, got {args.shards}")
    bandwidth = None if args.bandwidth is None else _flag_size("--bandwidth", args.bandwidth)
    if bandwidth is not None and bandwidth <= 0:
        raise errors.ConfigError(f"--bandwidth: bytes per second > 0, got {args.bandwidth!r}")
    with tempfile.TemporaryDirectory(prefix="shardsync-demo-") as tmp:
        work = Path(tmp)
        print(
            f"demo: building a {format_bytes(total)} checkpoint in {args.shards} shards...",
            file=sys.stderr,
        )
        checkpoint = build_checkpoint(work / "origin", total_bytes=total, n_shards=args.shards)
        hub = FakeHub()
        hub.add_checkpoint("demo/tiny-llama", checkpoint)
        if bandwidth is not None:
            hub.faults.add(Bandwidth(bandwidth))
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
        if args.cache_dir is not None:
            print_result(result, as_json=False, quiet=False)  # the snapshot path on stdout
        else:  # the cache goes with the temporary directory: print no path that will not exist
            print_result(result, as_json=False, quiet=False, path=False)
            print("demo: (temporary cache removed; pass --cache-dir to keep it)", file=sys.stderr)
    return 0


def _flag_size(flag: str, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError:
        raise errors.ConfigError(
            f"{flag}: a size in bytes or with a unit, like 256MiB, 25MB or 1G (got {value!r})"
        ) from None


# --------------------------------------------------------------------------- cache lifecycle


def _as_stored(pattern: str) -> str:
    """A ``--keep`` or ``prune.pin`` entry as the cache names its source: a directory (no
    glob in it) by its absolute path, as ``prefetch`` stored it from the same spelling."""
    if any(c in pattern for c in "*?[") or source_kind(pattern) != "local":
        return pattern
    return str(Path(pattern).expanduser().resolve())


def _existing_cache(args: argparse.Namespace, config: Config) -> CacheStore:
    """The cache that ``ls``, ``verify`` and ``prune`` work on, which must already be one: a
    mistyped path is a CacheError (exit 9) naming where it came from, and nothing is created.
    (An existing empty directory is an empty cache, e.g. systemd's ``CacheDirectory=``.)"""
    from shardsync.cache import CacheStore

    root = Path(os.path.abspath(config.cache_dir))
    if args.cache_dir is not None:
        source = "--cache-dir"
    elif os.environ.get("SHARDSYNC_CACHE_DIR"):
        source = "$SHARDSYNC_CACHE_DIR"
    elif args.config is not None:
        source = f"cache.dir in {args.config} (or the default)"
    else:
        source = "the default cache directory"
    try:
        empty = root.is_dir() and not any(root.iterdir())
        ours = (root / "VERSION").is_file()
    except OSError as exc:
        raise errors.CacheError(f"cannot read {root} ({source}): {exc.strerror}") from None
    if not (ours or empty):
        what = "does not exist" if not root.exists() else "is not a shardsync cache (no VERSION)"
        raise errors.CacheError(
            f"{root} ({source}) {what}; give the cache root, e.g. --cache-dir "
            "~/.cache/shardsync (nothing was created)"
        )
    return CacheStore(root)


def _prune(args: argparse.Namespace) -> int:
    """Evict least recently used snapshots until the limits hold; exit 8 when they cannot."""
    from shardsync.prune import limits_from_config, prune_cache

    config = _config(args)
    try:
        max_age = None if args.max_age is None else parse_duration(args.max_age)
    except ValueError:
        raise errors.ConfigError(
            f"--max-age: a duration like 90s, 12h or 30d (got {args.max_age!r})"
        ) from None
    try:
        limits = limits_from_config(
            config.prune,
            max_size=None if args.max_size is None else _flag_size("--max-size", args.max_size),
            min_free=None if args.min_free is None else _flag_size("--min-free", args.min_free),
            max_age=max_age,
        )
    except ValueError as exc:
        raise errors.ConfigError(f"prune: {exc}") from None
    report = prune_cache(
        _existing_cache(args, config),
        limits,
        pin=tuple(_as_stored(p) for p in config.prune.pin),
        keep=tuple(_as_stored(k) for k in args.keep),
        dry_run=args.dry_run,
        wait=not args.no_wait,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in prune_lines(report):
            print(line)
    return EXIT_CODES[errors.DiskFullError] if report.unmet else 0


def _verify(args: argparse.Namespace) -> int:
    """Re-hash blobs; exit 13 when anything was corrupt or missing (it is quarantined)."""
    from shardsync.verify import EXIT_PROBLEMS, verify_cache

    config = _config(args)
    report = verify_cache(_existing_cache(args, config), args.repo, full=args.full)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in verify_lines(report):
            print(line)
    return 0 if report.ok else EXIT_PROBLEMS


def _ls(args: argparse.Namespace) -> int:
    from shardsync.inventory import inventory_to_json, scan

    config = _config(args)
    inventory = scan(
        _existing_cache(args, config), pin=tuple(_as_stored(p) for p in config.prune.pin)
    )
    if args.json:
        print(json.dumps(inventory_to_json(inventory), indent=2))
    else:
        for line in ls_lines(inventory):
            print(line)
    return 0


def run() -> NoReturn:
    """The ``shardsync`` command: ``main`` as a process of its own.

    What the imports built lives until the process ends, so the collector is told to skip it
    (``gc.freeze``): each full collection would walk some 46,000 objects. And once ``main``
    has returned with no other thread left, the process ends as it is: the atexit handlers
    run, stdout and stderr are flushed, and ``os._exit`` skips the interpreter's teardown of
    every module, which took 0.1-0.18 s after a prefetch, and most of the 0.4-0.75 s that
    8 hosts on 2 cores ran after their snapshot was complete (`bench/README.md`). Not in
    ``main``, which tests and embedders call in their own process.
    """
    gc.freeze()
    code = main()
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # a thread still works: the interpreter waits for it, as always
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: the exit status the interpreter gives it
        code = code or 120
    os._exit(code)


if __name__ == "__main__":
    run()
