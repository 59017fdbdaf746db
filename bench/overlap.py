"""Probe: when does each shard's first tensor reach a ``shardsync.stream`` consumer?

Loading overlaps downloading only if the first shards are verified well before the last
one. This streams a generated checkpoint from the fake Hub over a per-connection cap and
prints, per shard, the seconds from the call to its first tensor, against the whole stream's.

    python bench/overlap.py [--size 400MB] [--shards 4] [--bandwidth 5MB]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import shardsync
from shardsync.config import parse_size
from shardsync.testing import Bandwidth, FakeHub, build_checkpoint, serve_in_thread

REPO = "bench/overlap"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="400MB", help="checkpoint size (default 400MB)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--bandwidth", default="5MB", help="bytes/s per connection (default 5MB)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardsync-overlap-") as tmp:
        work = Path(tmp)
        model = build_checkpoint(
            work / "origin", total_bytes=parse_size(args.size), n_shards=args.shards
        )
        shard_of = json.loads(model.path(model.index).read_text())["weight_map"]
        hub = FakeHub()
        hub.add_checkpoint(REPO, model)
        hub.faults.add(Bandwidth(float(parse_size(args.bandwidth))))
        first: dict[str, float] = {}
        with serve_in_thread(hub):
            began = time.monotonic()
            with shardsync.stream(
                REPO, endpoint=hub.endpoint, cache_dir=work / "cache", device_map="cpu"
            ) as tensors:
                for name, _tensor in tensors:
                    first.setdefault(shard_of[name], time.monotonic() - began)
            total = time.monotonic() - began
    print(f"stream: {total:.2f} s for {args.size} in {args.shards} shards at {args.bandwidth}/s")
    for shard, at in sorted(first.items()):
        print(f"  {shard}: first tensor at {at:.2f} s ({at / total:.0%})")


if __name__ == "__main__":
    main()
