"""Prune, prefetch and load on one cache at once, across processes; then Hugging Face reads it.

No timing is relied on: the prefetch is parked inside a retry wait that the test controls (a
503, then an injected ``sleep`` that waits for an event), and the load is an open stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import assert_snapshot_matches, assert_store_verified, fast_config
from huggingface_hub import hf_hub_download, scan_cache_dir
from safetensors.torch import load_file

import shardsync
from shardsync.cache import CacheStore
from shardsync.inventory import scan
from shardsync.prefetch import prefetch
from shardsync.prune import prune_cache
from shardsync.prune_plan import Limits
from shardsync.records import PrefetchResult
from shardsync.testing import Checkpoint, FakeHub, Status, build_checkpoint, serve_in_thread

NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return {
        name: build_checkpoint(
            tmp_path_factory.mktemp(name), total_bytes=192 * 1024, n_shards=2, seed=10 + i
        )
        for i, name in enumerate(NAMES)
    }


@pytest.fixture
def hub(models: dict[str, Checkpoint]) -> Iterator[FakeHub]:
    fake = FakeHub()
    for name, checkpoint in models.items():
        fake.add_checkpoint(f"acme/{name}", checkpoint)
    with serve_in_thread(fake) as running:
        yield running


def expected_tensors(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in checkpoint.shards:
        out.update(load_file(checkpoint.path(shard)))
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def prune_process(cache_dir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "shardsync.cli", "prune", "--cache-dir", str(cache_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_prune_prefetch_and_load_at_once(
    hub: FakeHub, models: dict[str, Checkpoint], tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    config = fast_config(cache_dir, hub.endpoint)
    for name in ("a", "b"):
        asyncio.run(prefetch(f"acme/{name}", config))

    # c downloads in another thread and gets parked in a retry wait after one 503
    hub.faults.add(Status(503, path="model-00001*"))
    parked, resume = threading.Event(), threading.Event()

    async def sleep(delay: float) -> None:
        parked.set()
        await asyncio.to_thread(resume.wait)

    results: list[PrefetchResult] = []
    downloader = threading.Thread(
        target=lambda: results.append(asyncio.run(prefetch("acme/c", config, sleep=sleep)))
    )
    downloader.start()
    try:
        assert parked.wait(timeout=60)
        # a is being loaded: the stream is open (its plan is made) while the prunes run
        with shardsync.stream("acme/a", device_map="cpu", config=config) as stream:
            procs = [prune_process(cache_dir, "--max-size", "0", "--json") for _ in range(2)]
            outs = [p.communicate(timeout=120) for p in procs]
            # nothing can bring the cache to 0 bytes while a and c are in use: exit 8
            assert [p.returncode for p in procs] == [8, 8], [o[1] for o in outs]
            reports = [json.loads(out) for out, _ in outs]
            assert sorted(e["repo"] for r in reports for e in r["evicted"]) == ["acme/b"]
            for report in reports:
                assert {(p["repo"], p["reason"]) for p in report["protected"]} == {
                    ("acme/a", "leased"),
                    ("acme/c", "leased"),
                }
            tensors = dict(stream)
    finally:
        resume.set()
        downloader.join(timeout=120)
    want_a = expected_tensors(models["a"])
    assert_same(tensors, want_a)
    (c,) = results
    assert_snapshot_matches(c.snapshot_path, models["c"])

    # every snapshot left is complete and byte-exact, and Hugging Face reads them offline
    cache = CacheStore(cache_dir)
    left = scan(cache)
    assert [r.repo for r in left.repos] == ["acme/a", "acme/c"]
    for repo in left.repos:
        (snap,) = repo.snapshots
        assert snap.complete
        assert_snapshot_matches(
            cache.root / "hub" / repo.dirname / "snapshots" / snap.commit, models[repo.repo[-1]]
        )
    assert_store_verified(cache_dir, *models.values())
    assert scan_cache_dir(cache_dir / "hub").warnings == []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache_dir / "hub")}
    offline = subprocess.run(
        [
            sys.executable,
            "-c",
            "from huggingface_hub import snapshot_download; print(snapshot_download('acme/c'))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert offline.returncode == 0, offline.stderr
    assert Path(offline.stdout.strip()) == c.snapshot_path
    shard = models["a"].shards[0]
    path = hf_hub_download("acme/a", shard, cache_dir=cache_dir / "hub", local_files_only=True)
    assert Path(path).read_bytes() == models["a"].path(shard).read_bytes()

    # c was used last (its download finished after the load): a cap that fits one keeps c
    report = prune_cache(cache, Limits(max_size=left.find_repo("acme/c").nbytes))
    assert [(e.repo, e.reason) for e in report.evicted] == [("acme/a", "max_size")]
    assert scan_cache_dir(cache_dir / "hub").warnings == []
    # the loaded tensors are views of mapped blobs that are unlinked now: still intact
    assert_same(tensors, want_a)
