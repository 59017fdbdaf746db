"""The Hub's CDN URLs expire (signed, about an hour): a download that outlives one resolves
again and goes on, and every byte is counted once, where it arrives, in the bar and in
``--json``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from helpers import Bars, assert_snapshot_matches, assert_store_verified, fast_config

from shardsync.config import Config
from shardsync.prefetch import prefetch
from shardsync.testing import Bandwidth, Checkpoint, FakeHub, build_checkpoint

REPO = "acme/expiring"


@contextlib.asynccontextmanager
async def expiring(
    tmp_path: Path, *, n_shards: int
) -> AsyncIterator[tuple[FakeHub, Checkpoint, Config]]:
    """About 3.5 MiB in ``n_shards`` on a Hub whose URLs expire after 0.15 s, sent at 1.6 MB/s
    (each shard outlives its URL), fetched in 256 KiB ranges on one connection per file."""
    checkpoint = build_checkpoint(tmp_path / "ckpt", total_bytes=3600 << 10, n_shards=n_shards)
    async with FakeHub(url_lifetime=0.15) as hub:
        hub.add_checkpoint(REPO, checkpoint)
        hub.faults.add(Bandwidth(1_600_000, server="cdn"))
        config = fast_config(
            tmp_path / "c", hub.endpoint, chunk_size=256 * 1024, connections_per_file=1
        )
        yield hub, checkpoint, config


async def test_urls_that_expire_mid_download_are_resolved_again_and_counted_once(
    tmp_path: Path,
) -> None:
    # Shards of about 1.2 MiB (above SMALL_FILE, which is one GET): five 256 KiB ranges, asked
    # one after the other on one connection per file, so each range after the first finds the
    # URL it was given expired (whatever the exact shard sizes; with several connections per
    # file, how many expire is up to timing).
    async with expiring(tmp_path, n_shards=3) as (hub, checkpoint, config):
        bars = Bars()
        result = await prefetch(REPO, config, progress=bars)
        served = hub.bytes_served()
        expired = [r for r in hub.log if r.server == "cdn" and r.status == 403]
    assert expired, "no URL expired: the test proves nothing"
    assert result.fetch is not None and result.fetch.retries.get("relocate", 0) > 0
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(config.cache_dir, checkpoint)
    assert result.bytes_downloaded == served  # every byte the Hub sent, once
    for path, size in bars.sizes.items():
        assert bars.now[path] == size and bars.peak[path] <= (size or 0), path


async def test_relocations_that_each_make_progress_never_run_out_of_attempts(
    tmp_path: Path,
) -> None:
    # one shard of about 3.5 MiB: fourteen 256 KiB ranges on one connection, each outliving
    # its URL; more relocations than ``max_attempts`` (6), each after a range landed
    async with expiring(tmp_path, n_shards=1) as (_hub, checkpoint, config):
        result = await prefetch(REPO, config)
    assert result.fetch is not None
    assert result.fetch.retries["relocate"] >= config.fetch.retry.max_attempts
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(config.cache_dir, checkpoint)
