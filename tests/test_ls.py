"""``shardsync ls``: repos, refs, sizes with shared bytes counted once, flags; read-only."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import fast_config

from shardsync.cache import CacheStore
from shardsync.cli import main
from shardsync.inventory import inventory_to_json, scan
from shardsync.prefetch import prefetch
from shardsync.records import RepoRef
from shardsync.snapshot_use import Leases
from shardsync.testing import Checkpoint, FakeHub, build_checkpoint, serve_in_thread

TOP_KEYS = {
    "root",
    "bytes_on_disk",
    "blob_bytes",
    "partial_bytes",
    "junk_bytes",
    "foreign_bytes",
    "disk_free",
    "disk_total",
    "repos",
}
REPO_KEYS = {"repo", "kind", "dir", "bytes_on_disk", "last_used", "pinned", "leased", "snapshots"}
SNAPSHOT_KEYS = {
    "commit",
    "refs",
    "complete",
    "files",
    "bytes_on_disk",
    "last_used",
    "leased",
    "foreign",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    return {
        name: build_checkpoint(
            tmp_path_factory.mktemp(name), total_bytes=128 * 1024, n_shards=2, seed=seed
        )
        for seed, name in enumerate(("a", "b"))
    }


@pytest.fixture
def cache_dir(models: dict[str, Checkpoint], tmp_path: Path) -> Iterator[Path]:
    """acme/a at main and v1 (one commit), acme/b; their small files are the same blobs."""
    hub = FakeHub()
    for name, checkpoint in models.items():
        hub.add_checkpoint(f"acme/{name}", checkpoint)
    hub.add_checkpoint("acme/a", models["a"], revision="v1")
    root = tmp_path / "cache"
    with serve_in_thread(hub):
        config = fast_config(root, hub.endpoint)
        for repo, revision in (("acme/a", "main"), ("acme/a", "v1"), ("acme/b", "main")):
            asyncio.run(prefetch(repo, config, revision=revision))
    yield root


@pytest.fixture
def ls(capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """``shardsync ls`` in this process (one real subprocess run is in test_empty_cache)."""

    def run(cache_dir: Path, *args: str, config: Path | None = None) -> str:
        capsys.readouterr()
        argv = ["--config", str(config)] if config else []
        assert main([*argv, "ls", "--cache-dir", str(cache_dir), *args]) == 0
        return capsys.readouterr().out

    return run


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        os.path.join(top, n): (
            os.lstat(os.path.join(top, n)).st_ino,
            os.lstat(os.path.join(top, n)).st_mtime_ns,
        )
        for top, dirs, files in os.walk(root)
        for n in dirs + files
    }


def test_json_shape_and_sizes(
    cache_dir: Path, models: dict[str, Checkpoint], ls: Callable[..., str]
) -> None:
    before = tree(cache_dir)
    listing = json.loads(ls(cache_dir, "--json"))
    assert tree(cache_dir) == before  # ls only reads
    assert set(listing) == TOP_KEYS
    assert [r["repo"] for r in listing["repos"]] == ["acme/a", "acme/b"]
    for repo in listing["repos"]:
        assert set(repo) == REPO_KEYS
        (snap,) = repo["snapshots"]
        assert set(snap) == SNAPSHOT_KEYS
        assert snap["complete"] is True and snap["leased"] is False
        assert snap["files"] == len(models[repo["repo"][-1]].files)
        assert snap["bytes_on_disk"] == repo["bytes_on_disk"] > 0
        assert isinstance(snap["last_used"], float) and repo["last_used"] == snap["last_used"]
        assert (repo["kind"], repo["pinned"], repo["leased"]) == ("hub", False, False)
    assert listing["repos"][0]["snapshots"][0]["refs"] == ["main", "v1"]
    # the small files are stored once: the repos' sizes add up to more than the cache holds
    total = listing["bytes_on_disk"]
    assert total == listing["blob_bytes"] < sum(r["bytes_on_disk"] for r in listing["repos"])
    store = cache_dir / "store" / "sha256"
    assert total == sum(p.stat().st_blocks * 512 for p in store.glob("*/*"))
    assert listing["partial_bytes"] == listing["junk_bytes"] == listing["foreign_bytes"] == 0
    assert listing["disk_free"] > 0 and listing["disk_total"] >= listing["disk_free"]


def test_flags_incomplete_and_text(cache_dir: Path, ls: Callable[..., str]) -> None:
    cache = CacheStore(cache_dir)
    commit = scan(cache).find_repo("acme/b").snapshots[0].commit
    (cache.snapshot_dir(RepoRef("hub", "acme/b"), commit) / "config.json").unlink()
    config = cache_dir.parent / "c.toml"
    config.write_text('[prune]\npin = ["acme/a"]\n')
    with Leases(cache).hold(RepoRef("hub", "acme/b"), commit, owner="test"):
        listing = json.loads(ls(cache_dir, "--json", config=config))
        a, b = listing["repos"]
        assert (a["pinned"], a["leased"], b["pinned"], b["leased"]) == (True, False, False, True)
        assert b["snapshots"][0]["complete"] is False and b["snapshots"][0]["leased"] is True
        text = ls(cache_dir, config=config).splitlines()
    assert text[0].split() == [
        "REPO",
        "REFS",
        "COMMIT",
        "SIZE",
        "COMPLETE",
        "LAST",
        "USED",
        "FLAGS",
    ]
    row_a, row_b = text[1].split(), text[2].split()
    assert row_a[:3] == ["acme/a", "main,v1", a["snapshots"][0]["commit"][:12]]
    assert row_a[-1] == "pinned" and row_a[-4] == "yes"
    assert row_b[0] == "acme/b" and row_b[-1] == "leased" and row_b[-4] == "no"
    assert text[-1].startswith("2 repos, ") and "shared blobs counted once" in text[-1]
    assert inventory_to_json(scan(cache))["repos"][1]["leased"] is False  # the lease ended


def test_empty_cache_from_the_command_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "ls", "--cache-dir", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert listing["repos"] == [] and listing["bytes_on_disk"] == 0


def test_an_s3_snapshot_is_listed_pruned_and_verified(tmp_path: Path) -> None:
    """An S3 origin's folder is ``other/s3--...``: ls, prune and verify see it like the rest."""
    import hashlib

    import xxhash

    from shardsync.prune import prune_cache
    from shardsync.prune_plan import Limits
    from shardsync.records import FileRecord, SnapshotRecord
    from shardsync.verify import verify_cache

    store = CacheStore(tmp_path / "cache")
    repo = RepoRef("s3", "s3://bucket/models/tiny")
    data = os.urandom(4096)
    sha = hashlib.sha256(data).hexdigest()
    part = store.root / "tmp" / "s3-blob"
    part.write_bytes(data)
    store.publish_blob(part, sha)
    commit = "c" * 40
    store.link_file(repo, commit, "model.safetensors", sha256=sha, etag=sha)
    xxh = xxhash.xxh3_128_hexdigest(data)
    rec = FileRecord("model.safetensors", len(data), sha, xxh, sha, "sha256")
    store.write_snapshot_record(SnapshotRecord(repo, "main", commit, (rec,), 1_700_000_000.0))

    (found,) = scan(store).repos
    assert (found.kind, found.dirname) == ("s3", repo.dirname)
    assert [s.complete for s in found.snapshots] == [True]
    assert verify_cache(store).snapshots == 1
    report = prune_cache(store, Limits(max_size=0))
    assert [e.dirname for e in report.evicted] == [repo.dirname]
    assert not store.has_blob(sha) and scan(store).repos == ()
