"""``shardsync verify``: a flipped byte is found, quarantined and repaired by one re-download."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from helpers import assert_snapshot_matches, assert_store_verified, fast_config, serving
from huggingface_hub import hf_hub_download, scan_cache_dir
from huggingface_hub.errors import LocalEntryNotFoundError

from shardsync.cache import CacheStore
from shardsync.prefetch import prefetch
from shardsync.records import RepoRef
from shardsync.testing import Checkpoint, FakeHub, build_checkpoint
from shardsync.verify import EXIT_PROBLEMS, verify_cache

REPO = "acme/v"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(tmp_path_factory.mktemp("v"), total_bytes=192 * 1024, n_shards=3)


@pytest.fixture
def hub(checkpoint: Checkpoint) -> Iterator[FakeHub]:
    # the twin: the same bytes under another name
    with serving({REPO: checkpoint, "acme/twin": checkpoint}) as running:
        yield running


def get(cache_dir: Path, hub: FakeHub, repo: str = REPO) -> Path:
    return asyncio.run(prefetch(repo, fast_config(cache_dir, hub.endpoint))).snapshot_path


def flip_byte(path: Path, offset: int = 1000) -> None:
    """Bit rot in place: the same inode, so every hard link of the blob sees it."""
    os.chmod(path, 0o644)
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.chmod(path, 0o444)


def blob_of(snapshot: Path, rel: str) -> Path:
    """The store blob behind a snapshot file."""
    return snapshot.parents[3] / "store" / "sha256" / _sha(snapshot, rel)[:2] / _sha(snapshot, rel)


def _sha(snapshot: Path, rel: str) -> str:
    return hashlib.sha256((snapshot / rel).read_bytes()).hexdigest()


def run_cli(cache_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "verify", "--cache-dir", str(cache_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


VERIFY_KEYS = {"ok", "full", "snapshots", "blobs", "bytes_hashed", "problems", "incomplete"}
PROBLEM_KEYS = {"repo", "dir", "commit", "path", "sha256", "problem", "detail", "quarantined"}


def test_flipped_byte_is_quarantined_and_repaired_by_one_download(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    snapshot = get(cache_dir, hub)
    shard = checkpoint.shards[1]
    blob = blob_of(snapshot, shard)
    sha = blob.name
    flip_byte(blob)

    clean = run_cli(cache_dir, "--json", "acme/twin*")  # another repo: not checked
    assert clean.returncode == 2 and "no complete snapshot" in clean.stderr

    out = run_cli(cache_dir, "--json")
    assert out.returncode == EXIT_PROBLEMS, out.stderr
    report = json.loads(out.stdout)
    assert set(report) == VERIFY_KEYS and report["ok"] is False and report["full"] is False
    (problem,) = report["problems"]
    assert set(problem) == PROBLEM_KEYS
    assert (problem["repo"], problem["path"], problem["sha256"], problem["problem"]) == (
        REPO,
        shard,
        sha,
        "corrupt",
    )
    assert report["incomplete"] == [{"repo": REPO, "commit": snapshot.name}]

    # out of every view: store, repo blob link, snapshot link; the bytes kept for a post-mortem
    quarantined = Path(problem["quarantined"])
    assert quarantined.parent == cache_dir / "quarantine" and quarantined.exists()
    assert not blob.exists() and not os.path.lexists(snapshot / shard)
    assert not (snapshot.parents[1] / "blobs" / sha).exists()
    assert CacheStore(cache_dir).find_complete(RepoRef("hub", REPO), "main") is None
    assert scan_cache_dir(cache_dir / "hub").warnings == []
    with pytest.raises(LocalEntryNotFoundError):  # Hugging Face readers never get bad bytes
        hf_hub_download(REPO, shard, cache_dir=cache_dir / "hub", local_files_only=True)
    good = hf_hub_download(REPO, "config.json", cache_dir=cache_dir / "hub", local_files_only=True)
    assert Path(good).read_bytes() == checkpoint.path("config.json").read_bytes()

    # the record stays: its other files are right, and they guide the repair
    record = cache_dir / "state" / "snapshots" / "models--acme--v" / f"{snapshot.name}.json"
    assert record.exists()
    assert run_cli(cache_dir).returncode == EXIT_PROBLEMS  # still broken until repaired

    hub.reset_log()
    assert get(cache_dir, hub) == snapshot
    fetched = {r.file for r in hub.log if r.file and r.bytes_sent}
    assert fetched == {shard}  # exactly the quarantined blob, nothing else
    assert hub.bytes_served() == checkpoint.path(shard).stat().st_size
    assert_snapshot_matches(snapshot, checkpoint)
    assert_store_verified(cache_dir, checkpoint)
    again = run_cli(cache_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "all intact" in again.stdout


def test_a_cache_copied_without_its_hard_links_is_checked_where_readers_read(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """``cp -r`` (or ``rsync -a`` without ``-H``) makes every repo blob a copy of its own,
    apart from the store's: a flipped byte in one is what Hugging Face readers and loads get.
    ``verify`` says so, the snapshot is incomplete, and a prefetch links the verified blob
    back, downloading nothing."""
    original = tmp_path / "cache"
    snapshot = get(original, hub)
    copied = tmp_path / "copied"
    shutil.copytree(original, copied, symlinks=True)
    shard = checkpoint.shards[1]
    snapshot = copied / snapshot.relative_to(original)
    rotten = snapshot.parents[1] / "blobs" / _sha(snapshot, shard)
    flip_byte(rotten)

    out = run_cli(copied, "--json", "--full")
    assert out.returncode == EXIT_PROBLEMS, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert {p["path"] for p in report["problems"]} == set(checkpoint.files)  # copies, all
    assert CacheStore(copied).find_complete(RepoRef("hub", REPO), "main") is None
    hub.reset_log()
    assert get(copied, hub) == snapshot
    assert hub.bytes_served("*.safetensors") == 0  # the store's blob was right all along
    assert_snapshot_matches(snapshot, checkpoint)


def test_a_shared_blob_makes_every_snapshot_holding_it_incomplete(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    snapshot = get(cache_dir, hub)
    twin = get(cache_dir, hub, "acme/twin")
    flip_byte(blob_of(snapshot, "config.json"), offset=3)
    report = verify_cache(CacheStore(cache_dir))
    assert report.blobs == len(checkpoint.files)  # hashed once for both repos
    assert sorted((p.repo, p.path) for p in report.problems) == [
        ("acme/twin", "config.json"),
        (REPO, "config.json"),
    ]
    assert sorted(r for r, _ in report.incomplete) == ["acme/twin", REPO]
    assert not os.path.lexists(twin / "config.json")
    assert scan_cache_dir(cache_dir / "hub").warnings == []
    get(cache_dir, hub)
    get(cache_dir, hub, "acme/twin")
    assert verify_cache(CacheStore(cache_dir)).ok


def test_full_recomputes_sha256(hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path) -> None:
    """A record made from bad bytes (trust on first use) fools the fast check, not --full."""
    cache_dir = tmp_path / "cache"
    snapshot = get(cache_dir, hub)
    shard = checkpoint.shards[0]
    blob = blob_of(snapshot, shard)
    flip_byte(blob)
    record_path = cache_dir / "state" / "snapshots" / "models--acme--v" / f"{snapshot.name}.json"
    record = json.loads(record_path.read_text())
    for f in record["files"]:
        if f["path"] == shard:
            f["xxh3_128"] = xxhash.xxh3_128_hexdigest(blob.read_bytes())
    record_path.write_text(json.dumps(record))
    assert verify_cache(CacheStore(cache_dir)).ok
    out = run_cli(cache_dir, "--full", "--json")
    assert out.returncode == EXIT_PROBLEMS
    (problem,) = json.loads(out.stdout)["problems"]
    assert (problem["path"], problem["problem"]) == (shard, "corrupt")
    assert "sha256" in problem["detail"]


def test_a_snapshot_it_may_not_read_is_an_error_not_missing_files(
    hub: FakeHub, tmp_path: Path
) -> None:
    """A user who may not read a snapshot folder (its mode 000) was told each of its files
    is missing, and that the snapshot is incomplete now (exit 13); ``ls`` and ``prune`` say
    what it is: the cache cannot be read (exit 9)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the check runs as another user")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    root = Path(tempfile.mkdtemp(prefix="verify-"))
    try:
        root.chmod(0o755)
        cache_dir = root / "cache"
        snapshot = get(cache_dir, hub)
        subprocess.run(["chmod", "-R", "a+rwX", str(cache_dir)], check=True)
        snapshot.chmod(0)
        done = subprocess.run(
            [*as_nobody, sys.executable, "-m", "shardsync.cli", "verify", "--cache-dir",
             str(cache_dir)],
            capture_output=True, text=True, timeout=120, cwd=root,
            env={**os.environ, "HOME": str(root)},
        )  # fmt: skip
        if "No module named" in done.stderr:
            pytest.skip("another user cannot run this checkout's Python here")
        assert done.returncode == 9, (done.returncode, done.stdout, done.stderr)
        assert "Permission denied" in done.stderr and "missing" not in done.stdout
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)


def test_missing_link_and_missing_blob(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    snapshot = get(cache_dir, hub)
    (snapshot / "config.json").unlink()
    for _ in range(2):  # reported on every run until a prefetch repairs it
        report = verify_cache(CacheStore(cache_dir))
        assert [(p.path, p.kind) for p in report.problems] == [("config.json", "missing")]
        assert report.incomplete == ((REPO, snapshot.name),)
    get(cache_dir, hub)
    assert verify_cache(CacheStore(cache_dir)).ok
    shard = checkpoint.shards[2]
    blob = blob_of(snapshot, shard)
    os.unlink(blob)
    report = verify_cache(CacheStore(cache_dir), REPO)
    assert [(p.path, p.kind, p.quarantined) for p in report.problems] == [(shard, "missing", None)]
    hub.reset_log()
    get(cache_dir, hub)
    assert hub.bytes_served("*.safetensors") == checkpoint.path(shard).stat().st_size
    assert verify_cache(CacheStore(cache_dir), full=True).ok


def test_a_blob_gone_from_the_store_and_the_repo_view_is_one_problem(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """Both names of the blob gone: the snapshot's link dangles and the store has no copy;
    that is one missing file, reported once (on every run until a prefetch repairs it)."""
    cache_dir = tmp_path / "cache"
    snapshot = get(cache_dir, hub)
    shard = checkpoint.shards[1]
    view_blob = (snapshot / shard).resolve()
    os.unlink(blob_of(snapshot, shard))
    os.unlink(view_blob)
    for _ in range(2):
        report = verify_cache(CacheStore(cache_dir))
        assert [(p.path, p.kind) for p in report.problems] == [(shard, "missing")]
        assert report.incomplete == ((REPO, snapshot.name),)
    hub.reset_log()
    get(cache_dir, hub)
    assert hub.bytes_served("*.safetensors") == checkpoint.path(shard).stat().st_size
    assert_snapshot_matches(snapshot, checkpoint)
    assert verify_cache(CacheStore(cache_dir), full=True).ok
