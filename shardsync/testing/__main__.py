"""``python -m shardsync.testing``: serve a checkpoint from a fake hub, or build one.

``serve`` prints one JSON line, ``{"endpoint", "cdn_endpoint", "commit"}``, once both servers
listen (and writes it to ``--ready-file``), then serves until SIGTERM or SIGINT. Benchmarks and
subprocess tests use it to put a real process boundary between client and server.
``--cdn-base URL`` redirects LFS files to ``URL/<sha256>`` (e.g. nginx serving a directory of
files named by their sha256) instead of the built-in CDN; ``--bandwidth``/``--latency`` then
shape only what the hub itself answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from shardsync.testing.checkpoints import DTYPES, Checkpoint, build_checkpoint
from shardsync.testing.fakehub import FakeHub
from shardsync.testing.faults import Bandwidth, Latency


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shardsync.testing",
        description="Serve a checkpoint from a fake Hugging Face Hub, or build one.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a checkpoint directory as a Hub repository")
    serve.add_argument("--checkpoint", type=Path, required=True, metavar="DIR")
    serve.add_argument("--repo", required=True, metavar="ORG/NAME", help="repository id")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--cdn-host", default="127.0.0.2")
    serve.add_argument("--port", type=int, default=0, help="hub port (0: any free port)")
    serve.add_argument("--cdn-port", type=int, default=0, help="CDN port (0: any free port)")
    serve.add_argument(
        "--cdn-base",
        metavar="URL",
        help="redirect LFS files to URL/<sha256> (a server of your own), not the built-in CDN",
    )
    serve.add_argument("--token", help="make the repository private to this bearer token")
    serve.add_argument("--bandwidth", type=float, metavar="BPS", help="cap each response (B/s)")
    serve.add_argument("--latency", type=float, metavar="S", help="delay each response (s)")
    serve.add_argument("--ready-file", type=Path, metavar="PATH", help="write the ready line here")

    build = commands.add_parser("build", help="build a random sharded safetensors checkpoint")
    build.add_argument("--out", type=Path, required=True, metavar="DIR")
    build.add_argument("--total-bytes", type=int, required=True, metavar="N", help="about N bytes")
    build.add_argument("--shards", type=int, required=True, metavar="K", help="exactly K shards")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--dtype", default="float16", choices=DTYPES)
    build.add_argument("--no-extras", action="store_true", help="weights and index only")
    return parser


def _serve(args: argparse.Namespace) -> int:
    if not args.checkpoint.is_dir():
        return _fail(f"{args.checkpoint} is not a directory")
    hub = FakeHub(
        host=args.host,
        cdn_host=args.cdn_host,
        port=args.port,
        cdn_port=args.cdn_port,
        cdn_base=args.cdn_base,
    )
    try:
        commit = hub.add_checkpoint(args.repo, Checkpoint.scan(args.checkpoint), token=args.token)
        if args.bandwidth is not None:
            hub.faults.add(Bandwidth(args.bandwidth, server="any"))
        if args.latency is not None:
            hub.faults.add(Latency(args.latency, server="any"))
    except ValueError as exc:
        return _fail(str(exc))
    asyncio.run(_serve_until_signalled(hub, commit, args.ready_file))
    return 0


async def _serve_until_signalled(hub: FakeHub, commit: str, ready_file: Path | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with hub:
        ready = {"endpoint": hub.endpoint, "cdn_endpoint": hub.cdn_endpoint, "commit": commit}
        line = json.dumps(ready)
        if ready_file is not None:
            # Write then rename, so a reader polling for the file never sees half a line.
            partial = ready_file.with_name(ready_file.name + ".partial")
            partial.write_text(line + "\n")
            os.replace(partial, ready_file)
        print(line, flush=True)
        await stop.wait()


def _build(args: argparse.Namespace) -> int:
    try:
        checkpoint = build_checkpoint(
            args.out,
            total_bytes=args.total_bytes,
            n_shards=args.shards,
            seed=args.seed,
            dtype=args.dtype,
            extras=not args.no_extras,
        )
    except ValueError as exc:
        return _fail(str(exc))
    print(json.dumps({"directory": str(checkpoint.directory), "files": list(checkpoint.files)}))
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    return _serve(args) if args.command == "serve" else _build(args)


if __name__ == "__main__":
    sys.exit(main())
