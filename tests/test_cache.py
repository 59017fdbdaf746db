"""Tests of the cache store on real files: layout, atomic publish, HF interop, locks, safety."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash
from helpers import tmpfs

from shardsync.cache import CacheStore
from shardsync.checkpoint_cache import RangeCache
from shardsync.errors import CacheError, ConfigError, DiskFullError, UnsafeNameError
from shardsync.layout import is_live_temp, temp_name
from shardsync.locks import BlobLock
from shardsync.records import FileRecord, RepoRef, SnapshotRecord
from shardsync.removal import remove_idle_locks, sweep_orphans
from shardsync.snapshot_use import Leases

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
REPO = RepoRef("hub", "acme/tiny-model")


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_sha1_of(data: bytes) -> str:
    """The git blob id the Hub uses as the ETag of a small (non-LFS) file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def publish(store: CacheStore, data: bytes, key: str = "k") -> str:
    """Write ``data`` where the fetcher would and publish it; returns its sha256."""
    part, _ = store.layout.partial(key)
    part.write_bytes(data)
    sha = sha256_of(data)
    store.publish_blob(part, sha)
    return sha


def file_record(path: str, data: bytes, *, lfs: bool) -> FileRecord:
    sha = sha256_of(data)
    return FileRecord(
        path=path,
        size=len(data),
        sha256=sha,
        xxh3_128=xxhash.xxh3_128_hexdigest(data),
        etag=sha if lfs else git_sha1_of(data),
        verified="sha256" if lfs else "tofu",
    )


def build_snapshot(
    store: CacheStore,
    repo: RepoRef,
    commit: str,
    files: dict[str, tuple[bytes, bool]],
    *,
    revision: str = "main",
) -> SnapshotRecord:
    """What a download does, in its order: publish, link, record (last but the ref)."""
    records = []
    for path, (data, lfs) in files.items():
        rec = file_record(path, data, lfs=lfs)
        publish(store, data)
        store.link_file(repo, commit, path, sha256=rec.sha256, etag=rec.etag)
        records.append(rec)
    record = SnapshotRecord(repo, revision, commit, tuple(records), 1_700_000_000.5)
    store.write_snapshot_record(record)
    store.write_ref(repo, revision, commit)
    return record


TINY_FILES = {
    "config.json": (b'{"model_type": "tiny"}\n', False),
    "tokenizer/vocab.txt": (b"a\nb\nc\n", False),
    "model.safetensors": (os.urandom(4096), True),
}


@pytest.fixture
def store(tmp_path: Path) -> CacheStore:
    return CacheStore(tmp_path / "cache")


# --------------------------------------------------------------------------- layout


def test_layout_is_created_and_versioned(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    store = CacheStore(root)
    assert (root / "VERSION").read_bytes() == b"1\n"
    assert (
        (root / "CACHEDIR.TAG")
        .read_bytes()
        .startswith(b"Signature: 8a477f597d28d172789f06886806bc55")
    )
    for sub in ("store/sha256", "hub", "other", "state/snapshots", "partial", "locks", "tmp"):
        assert stat.S_IMODE((root / sub).stat().st_mode) == 0o755
    assert store.layout.hub == root / "hub"
    CacheStore(root)  # reopening an existing cache is fine
    assert os.listdir(root / "tmp") == []


@pytest.mark.parametrize("content", [b"2\n", b"0", b"banana\n"])
def test_other_layout_version_is_refused(tmp_path: Path, content: bytes) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    (root / "VERSION").write_bytes(content)
    with pytest.raises(CacheError):
        CacheStore(root)
    assert not (root / "hub").exists()  # nothing written into a cache we do not understand


def test_paths_validate_their_inputs(store: CacheStore) -> None:
    sha = "0" * 64
    assert store.blob_path(sha) == store.root / "store" / "sha256" / "00" / sha
    assert store.layout.partial("job_1-x") == (
        store.root / "partial" / "job_1-x.part",
        store.root / "partial" / "job_1-x.json",
    )
    for bad in ("0" * 63, "G" * 64, "A" * 64, "../" + "0" * 61):
        with pytest.raises(CacheError):
            store.blob_path(bad)
    for key in ("", "Up", "a/b", "..", "x" * 129):
        with pytest.raises(CacheError):
            store.layout.partial(key)
    with pytest.raises(CacheError):
        store.snapshot_dir(REPO, "main")


# --------------------------------------------------------------------------- repo refs


def test_hub_dirname_matches_hugging_face() -> None:
    assert RepoRef("hub", "acme/tiny-model").dirname == "models--acme--tiny-model"
    assert RepoRef("hub", "gpt2").dirname == "models--gpt2"


@pytest.mark.parametrize(
    "name",
    ["", "a/b/c", "a--b/c", "a/b..c", "-a/b", "a/b-", ".a", "a/b.git", "a b", "a/b\n", "x" * 97],
)
def test_invalid_hub_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError):
        RepoRef("hub", name)


def test_other_origins_get_unique_safe_dirnames(store: CacheStore) -> None:
    one = RepoRef("url", "https://example.test/models/tiny")
    two = RepoRef("url", "https://example.test/models?tiny")
    local = RepoRef("local", "/srv/models/tiny")
    assert one.dirname.startswith("url--https-example.test-models-tiny-")
    assert one.dirname != two.dirname
    assert local.dirname.startswith("local--srv-models-tiny-")
    for repo in (one, two, local):
        assert "/" not in repo.dirname
        assert store.layout.repo(repo.dirname).parent == store.root / "other"
    with pytest.raises(ConfigError):
        RepoRef("local", "relative/path")


# --------------------------------------------------------------------------- publish


def test_publish_is_atomic_idempotent_and_never_overwrites(store: CacheStore) -> None:
    data = b"original bytes"
    part, _ = store.layout.partial("p")
    part.write_bytes(data)
    sha = sha256_of(data)

    blob = store.publish_blob(part, sha)
    assert blob == store.blob_path(sha)
    assert blob.read_bytes() == data
    assert stat.S_IMODE(blob.stat().st_mode) == 0o444
    assert not part.exists()
    assert store.has_blob(sha)
    assert store.has_blob(sha, len(data))
    assert not store.has_blob(sha, len(data) + 1)
    inode = blob.stat().st_ino

    part.write_bytes(data)  # a second download of the same bytes
    assert store.publish_blob(part, sha) == blob
    assert not part.exists()

    part.write_bytes(b"impostor bytes")  # never happens after verification, but must not win
    assert store.publish_blob(part, sha) == blob
    assert blob.read_bytes() == data
    assert blob.stat().st_ino == inode
    assert blob.stat().st_nlink == 1
    assert not part.exists()


def test_publish_refuses_a_symlink_as_temp_file(store: CacheStore, tmp_path: Path) -> None:
    target = tmp_path / "outside"
    target.write_bytes(b"x")
    part, _ = store.layout.partial("p")
    part.symlink_to(target)
    with pytest.raises(CacheError):
        store.publish_blob(part, sha256_of(b"x"))
    assert not store.has_blob(sha256_of(b"x"))


# --------------------------------------------------------------------------- linking


def test_link_file_dedups_across_repos_and_revisions(store: CacheStore) -> None:
    data = os.urandom(1024)
    sha = publish(store, data)
    other = RepoRef("hub", "other-org/other-model")
    paths = [
        store.link_file(REPO, COMMIT_A, "model.safetensors", sha256=sha, etag=sha),
        store.link_file(REPO, COMMIT_B, "model.safetensors", sha256=sha, etag=sha),
        store.link_file(other, COMMIT_A, "sub/dir/file.json", sha256=sha, etag=sha),
    ]
    blob = store.blob_path(sha)
    repo_blobs = [
        store.layout.repo(REPO.dirname) / "blobs" / sha,
        store.layout.repo(other.dirname) / "blobs" / sha,
    ]
    # one inode: the store, and one hard link per repo (revisions share the repo's link)
    assert blob.stat().st_nlink == 3
    for path in [*paths, *repo_blobs]:
        assert path.stat().st_ino == blob.stat().st_ino
    for path, repo_blob in zip(paths, [repo_blobs[0], repo_blobs[0], repo_blobs[1]], strict=True):
        assert path.is_symlink()
        assert path.resolve() == repo_blob.resolve()
        assert path.read_bytes() == data
    assert paths[0] == store.snapshot_dir(REPO, COMMIT_A) / "model.safetensors"
    assert os.readlink(paths[0]) == f"../../blobs/{sha}"
    assert paths[2] == store.snapshot_dir(other, COMMIT_A) / "sub" / "dir" / "file.json"
    assert os.readlink(paths[2]) == f"../../../../blobs/{sha}"

    again = store.link_file(REPO, COMMIT_A, "model.safetensors", sha256=sha, etag=sha)
    assert again == paths[0]
    assert blob.stat().st_nlink == 3
    assert os.listdir(store.root / "tmp") == []


def test_link_file_replaces_a_foreign_copy_and_a_planted_link(
    store: CacheStore, tmp_path: Path
) -> None:
    data = b"payload"
    sha = publish(store, data)
    blobs = store.layout.repo(REPO.dirname) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / sha).write_bytes(data)  # e.g. left by huggingface_hub itself
    store.link_file(REPO, COMMIT_A, "a.bin", sha256=sha, etag=sha)
    assert (blobs / sha).stat().st_ino == store.blob_path(sha).stat().st_ino

    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"do not touch")
    (blobs / sha).unlink()
    (blobs / sha).symlink_to(outside)
    store.link_file(REPO, COMMIT_A, "a.bin", sha256=sha, etag=sha)
    assert not (blobs / sha).is_symlink()
    assert outside.read_bytes() == b"do not touch"


def test_link_file_needs_a_published_blob(store: CacheStore) -> None:
    sha = sha256_of(b"never published")
    with pytest.raises(CacheError, match="not in the store"):
        store.link_file(REPO, COMMIT_A, "x.bin", sha256=sha, etag=sha)


@pytest.mark.parametrize(
    "relpath",
    [
        "",
        "/etc/passwd",
        "../x",
        "a/../../x",
        "a//b",
        "a/",
        "./a",
        "a\\b",
        "C:x",
        "a\x00b",
        "a?b",
        "a#b",
        "%2e%2e/x",
        "a%2Fb",
        "x" * 256,
    ],
)
def test_link_file_refuses_unsafe_names(store: CacheStore, relpath: str) -> None:
    sha = publish(store, b"z")
    with pytest.raises(UnsafeNameError):
        store.link_file(REPO, COMMIT_A, relpath, sha256=sha, etag=sha)
    assert not store.layout.repo(REPO.dirname).exists()


@pytest.mark.parametrize("etag", ["", "abc", "A" * 40, "0" * 41, '"' + "0" * 40 + '"'])
def test_link_file_refuses_bad_etags(store: CacheStore, etag: str) -> None:
    sha = publish(store, b"z")
    with pytest.raises(CacheError):
        store.link_file(REPO, COMMIT_A, "z.bin", sha256=sha, etag=etag)


# --------------------------------------------------------------------------- HF interop


def test_hugging_face_reads_the_hub_view(
    store: CacheStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    build_snapshot(store, REPO, COMMIT_A, TINY_FILES)
    build_snapshot(store, RepoRef("url", "http://127.0.0.1:9/models/x"), COMMIT_A, TINY_FILES)
    hub = store.layout.hub
    snapshot = store.snapshot_dir(REPO, COMMIT_A)

    info = huggingface_hub.scan_cache_dir(hub)
    assert info.warnings == []
    (repo_info,) = info.repos
    assert repo_info.repo_id == "acme/tiny-model"
    assert repo_info.repo_type == "model"
    assert repo_info.nb_files == 3
    (revision,) = repo_info.revisions
    assert revision.commit_hash == COMMIT_A
    assert revision.refs == frozenset({"main"})
    sizes = {f.file_path.relative_to(snapshot).as_posix(): f.size_on_disk for f in revision.files}
    assert sizes == {path: len(data) for path, (data, _) in TINY_FILES.items()}
    assert repo_info.size_on_disk == sum(len(data) for data, _ in TINY_FILES.values())

    folder = huggingface_hub.snapshot_download(
        REPO.name, cache_dir=hub, local_files_only=True, revision="main"
    )
    assert Path(folder) == snapshot
    for path in TINY_FILES:
        got = huggingface_hub.hf_hub_download(
            REPO.name, path, cache_dir=hub, local_files_only=True, revision="main"
        )
        assert Path(got) == snapshot / path
        cached = huggingface_hub.try_to_load_from_cache(
            REPO.name, path, cache_dir=hub, revision="main"
        )
        assert isinstance(cached, str)
        assert Path(cached) == snapshot / path
        assert Path(cached).read_bytes() == TINY_FILES[path][0]
    assert huggingface_hub.scan_cache_dir(hub).warnings == []


# --------------------------------------------------------------------------- refs


def test_refs_including_pull_request_refs(store: CacheStore) -> None:
    sha = publish(store, b"w")
    with pytest.raises(CacheError, match="does not exist yet"):
        store.write_ref(REPO, "refs/pr/1", COMMIT_A)  # links first, then the ref
    store.link_file(REPO, COMMIT_A, "w.bin", sha256=sha, etag=sha)
    store.write_ref(REPO, "refs/pr/1", COMMIT_A)
    ref_file = store.layout.repo(REPO.dirname) / "refs" / "refs" / "pr" / "1"
    assert ref_file.read_bytes() == COMMIT_A.encode()  # bare hash, as huggingface_hub reads it
    assert store.read_ref(REPO, "refs/pr/1") == COMMIT_A
    assert store.read_ref(REPO, "main") is None

    store.write_ref(REPO, COMMIT_A, COMMIT_A)  # a commit needs no ref
    assert not (store.layout.repo(REPO.dirname) / "refs" / COMMIT_A).exists()
    for bad in ("", "../main", "refs//x", "a/./b", "main\n", "x.lock", "a b"):
        with pytest.raises(ConfigError):
            store.write_ref(REPO, bad, COMMIT_A)
    with pytest.raises(ConfigError):
        store.write_ref(REPO, COMMIT_B, COMMIT_A)

    ref_file.write_bytes(b"not a commit")
    with pytest.raises(CacheError):
        store.read_ref(REPO, "refs/pr/1")


# --------------------------------------------------------------------------- find_complete


def test_find_complete_by_ref_and_by_commit(store: CacheStore) -> None:
    assert store.find_complete(REPO, "main") is None
    record = build_snapshot(store, REPO, COMMIT_A, TINY_FILES)
    assert store.find_complete(REPO, "main") == record
    assert store.find_complete(REPO, COMMIT_A) == record
    assert store.read_snapshot_record(REPO, COMMIT_A) == record
    assert store.find_complete(REPO, COMMIT_B) is None
    assert store.find_complete(RepoRef("hub", "acme/other"), "main") is None


def test_find_complete_is_none_without_a_record(store: CacheStore) -> None:
    build_snapshot(store, REPO, COMMIT_A, TINY_FILES)
    (store.root / "state" / "snapshots" / REPO.dirname / f"{COMMIT_A}.json").unlink()
    assert store.read_snapshot_record(REPO, COMMIT_A) is None
    assert store.find_complete(REPO, "main") is None


def test_find_complete_is_none_when_a_blob_is_missing(store: CacheStore) -> None:
    record = build_snapshot(store, REPO, COMMIT_A, TINY_FILES)
    lfs = next(f for f in record.files if f.path == "model.safetensors")
    (store.layout.repo(REPO.dirname) / "blobs" / lfs.etag).unlink()
    assert store.find_complete(REPO, "main") is None


def test_find_complete_is_none_when_a_link_is_missing(store: CacheStore) -> None:
    build_snapshot(store, REPO, COMMIT_A, TINY_FILES)
    (store.snapshot_dir(REPO, COMMIT_A) / "tokenizer" / "vocab.txt").unlink()
    assert store.find_complete(REPO, "main") is None


def test_find_complete_is_none_when_a_blob_is_truncated(store: CacheStore) -> None:
    record = build_snapshot(store, REPO, COMMIT_A, TINY_FILES)
    lfs = next(f for f in record.files if f.path == "model.safetensors")
    blob = store.blob_path(lfs.sha256)
    blob.chmod(0o644)
    os.truncate(blob, lfs.size - 1)
    assert store.find_complete(REPO, "main") is None


def test_find_complete_treats_a_corrupt_record_as_absent(store: CacheStore) -> None:
    build_snapshot(store, REPO, COMMIT_A, TINY_FILES)
    (store.root / "state" / "snapshots" / REPO.dirname / f"{COMMIT_A}.json").write_bytes(b"{")
    assert store.find_complete(REPO, "main") is None
    with pytest.raises(CacheError):
        store.read_snapshot_record(REPO, COMMIT_A)


# --------------------------------------------------------------------------- records


def test_snapshot_record_round_trips(store: CacheStore) -> None:
    record = SnapshotRecord(
        RepoRef("url", "https://example.test/m"),
        "refs/pr/1",
        COMMIT_A,
        tuple(file_record(p, d, lfs=lfs) for p, (d, lfs) in TINY_FILES.items()),
        1_700_000_000.25,
    )
    assert SnapshotRecord.from_json(record.to_json()) == record
    store.write_snapshot_record(record)
    assert store.read_snapshot_record(record.repo, COMMIT_A) == record
    assert os.listdir(store.root / "tmp") == []


def _valid_record_obj() -> dict[str, object]:
    record = SnapshotRecord(REPO, "main", COMMIT_A, (file_record("a.json", b"{}", lfs=False),), 1.0)
    obj: dict[str, object] = json.loads(record.to_json())
    return obj


def _file_entry(obj: dict[str, object]) -> dict[str, object]:
    files = obj["files"]
    assert isinstance(files, list)
    entry: dict[str, object] = files[0]
    return entry


def _set_file(key: str, value: object) -> bytes:
    obj = _valid_record_obj()
    _file_entry(obj)[key] = value
    return json.dumps(obj).encode()


def _set_top(key: str, value: object) -> bytes:
    obj = _valid_record_obj()
    obj[key] = value
    return json.dumps(obj).encode()


def _duplicate_files() -> bytes:
    obj = _valid_record_obj()
    obj["files"] = [_file_entry(obj), _file_entry(obj)]
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"not json",
        b"[]",
        b"[" * 100_000,
        b'{"format": 1, "format": 1}',
        _set_top("format", 2),
        _set_top("format", True),
        _set_top("extra", 1),
        _set_top("commit", "main"),
        _set_top("revision", "../x"),
        _set_top("completed_at", "yesterday"),
        _set_top("files", {}),
        _set_top("repo", {"kind": "ftp", "name": "x"}),
        _set_top("repo", {"kind": "hub", "name": "a--b"}),
        _set_file("path", "../escape"),
        _set_file("size", -1),
        _set_file("size", True),
        _set_file("size", 1.5),
        _set_file("sha256", "0" * 63),
        _set_file("etag", "W/abc"),
        _set_file("xxh3_128", "x"),
        _set_file("verified", "trust-me"),
        _duplicate_files(),
    ],
)
def test_garbage_records_raise_cache_error(data: bytes) -> None:
    with pytest.raises(CacheError):
        SnapshotRecord.from_json(data)


def test_unserializable_record_is_refused(store: CacheStore) -> None:
    bad = SnapshotRecord(REPO, "main", "not-a-commit", (), 1.0)
    with pytest.raises(CacheError):
        store.write_snapshot_record(bad)
    with pytest.raises(CacheError):
        bad.to_json()


# --------------------------------------------------------------------------- locks

_HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from shardsync.cache import CacheStore

    lock = CacheStore(Path(sys.argv[1])).lock(sys.argv[2])
    if not lock.try_acquire():
        sys.exit(3)
    print("held", flush=True)
    sys.stdin.read()
    """
)


def test_lock_excludes_a_second_lock_in_the_same_process(store: CacheStore) -> None:
    first, second = store.lock("job"), store.lock("job")
    assert first.try_acquire()
    assert first.held
    assert first.try_acquire()  # already ours
    assert not second.try_acquire()
    assert not second.held
    assert store.lock("other-job").try_acquire()
    first.release()
    assert not first.held
    assert second.try_acquire()
    second.release()
    second.release()  # releasing twice is harmless


def test_lock_of_a_killed_holder_is_taken_over(store: CacheStore) -> None:
    lock = store.lock("job")
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(store.root), "job"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as holder:
        assert holder.stdout is not None
        assert holder.stdout.readline() == b"held\n"
        assert not lock.try_acquire()
        holder.send_signal(signal.SIGKILL)
        assert holder.wait() == -signal.SIGKILL
    asyncio.run(lock.acquire(timeout=1.0))
    assert lock.held
    lock.release()


def test_subprocess_cannot_take_a_held_lock(store: CacheStore) -> None:
    lock = store.lock("job")
    assert lock.try_acquire()
    done = subprocess.run(
        [sys.executable, "-c", _HOLDER, str(store.root), "job"],
        input=b"",
        capture_output=True,
        check=False,
    )
    assert done.returncode == 3
    lock.release()


async def test_acquire_times_out_with_cache_error(store: CacheStore) -> None:
    holder = store.lock("job")
    assert holder.try_acquire()
    with pytest.raises(CacheError, match="timed out"):
        await store.lock("job").acquire(poll=0.01, timeout=0.05)
    holder.release()


async def test_acquire_waits_for_release(store: CacheStore) -> None:
    holder, waiter = store.lock("job"), store.lock("job")
    assert holder.try_acquire()
    got_it = asyncio.Event()

    async def wait_for_lock() -> None:
        async with waiter:
            got_it.set()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(wait_for_lock())
        await asyncio.sleep(0.03)
        assert not got_it.is_set()
        holder.release()
    assert got_it.is_set()
    assert not waiter.held


def test_lock_refuses_a_planted_symlink(store: CacheStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside.lock"
    (store.root / "locks" / "job.lock").symlink_to(outside)
    with pytest.raises(CacheError):
        store.lock("job").try_acquire()
    assert not outside.exists()


def test_blob_lock_is_usable_directly(tmp_path: Path) -> None:
    lock = BlobLock(tmp_path / "x.lock")
    assert lock.path == tmp_path / "x.lock"
    assert lock.try_acquire()
    lock.release()


# --------------------------------------------------------------------------- path safety


@pytest.mark.parametrize(
    "planted",
    [
        "hub/models--acme--tiny-model",
        "hub/models--acme--tiny-model/blobs",
        "hub/models--acme--tiny-model/snapshots",
        f"hub/models--acme--tiny-model/snapshots/{COMMIT_A}/sub",
        "store/sha256/{aa}",
        "tmp",
    ],
)
def test_link_file_never_writes_through_a_planted_symlink(
    store: CacheStore, tmp_path: Path, planted: str
) -> None:
    data = b"blob"
    sha = publish(store, data)
    evil = tmp_path / "evil"
    evil.mkdir()
    victim = store.root / planted.format(aa=sha[:2])
    if victim.exists():
        os.rename(victim, tmp_path / "moved-away")
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.symlink_to(evil, target_is_directory=True)
    with pytest.raises(CacheError, match="symlink"):
        store.link_file(REPO, COMMIT_A, "sub/blob.bin", sha256=sha, etag=sha)
    assert os.listdir(evil) == []


def test_a_snapshot_is_marked_as_being_made_from_its_first_link_to_its_record(
    store: CacheStore,
) -> None:
    """The mark is what tells an abandoned download of shardsync's (prunable once stale)
    from a snapshot another tool built from our blobs: there from the first link, gone
    with the record, and with an eviction."""
    mark = store.root / "state" / "snapshots" / REPO.dirname / f"{COMMIT_A}.pending"
    sha = publish(store, b"r")
    store.link_file(REPO, COMMIT_A, "r.bin", sha256=sha, etag=sha)
    assert mark.exists()
    store.write_snapshot_record(SnapshotRecord(REPO, "main", COMMIT_A, (), 1.0))
    assert not mark.exists()
    store.link_file(REPO, COMMIT_A, "s.bin", sha256=sha, etag=sha)  # recorded: no new mark
    assert not mark.exists()


def test_records_and_refs_never_write_through_a_planted_symlink(
    store: CacheStore, tmp_path: Path
) -> None:
    evil = tmp_path / "evil"
    evil.mkdir()
    sha = publish(store, b"r")
    store.link_file(REPO, COMMIT_A, "r.bin", sha256=sha, etag=sha)
    records = store.root / "state" / "snapshots" / REPO.dirname
    (records / f"{COMMIT_A}.pending").unlink()  # the mark the link left, and its folder
    records.rmdir()
    records.symlink_to(evil)
    (store.layout.repo(REPO.dirname) / "refs").symlink_to(evil)
    record = SnapshotRecord(REPO, "main", COMMIT_A, (), 1.0)
    with pytest.raises(CacheError, match="symlink"):
        store.write_snapshot_record(record)
    with pytest.raises(CacheError, match="symlink"):
        store.write_ref(REPO, "main", COMMIT_A)
    assert os.listdir(evil) == []


# --------------------------------------------------------------------------- disk full


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs with few inodes, so both bytes and inodes can run out for real."""
    with tmpfs(tmp_path / "tiny", "size=1m,nr_inodes=64") as mnt:
        yield mnt


def _exhaust(where: Path, *, inodes: bool) -> None:
    """Fill the file system under ``where`` until it answers ENOSPC."""
    with pytest.raises(OSError) as info:
        if inodes:
            for i in range(10_000):
                (where / f"inode-{i}").touch()
        else:
            with open(where / "filler", "wb") as f:
                for _ in range(10_000):
                    f.write(b"\0" * 65536)
                    f.flush()
    assert info.value.errno == errno.ENOSPC


def test_full_disk_maps_to_disk_full_error(tiny_fs: Path) -> None:
    store = CacheStore(tiny_fs / "cache")
    sha = publish(store, b"small")
    store.link_file(REPO, COMMIT_A, "small.bin", sha256=sha, etag=sha)
    record = SnapshotRecord(REPO, "main", COMMIT_A, (), 1.0)
    _exhaust(tiny_fs, inodes=False)

    with pytest.raises(DiskFullError) as info:
        store.write_snapshot_record(record)
    assert f"{COMMIT_A}.json" in str(info.value)
    assert "kept" in str(info.value)
    with pytest.raises(DiskFullError, match="refs/main"):
        store.write_ref(REPO, "main", COMMIT_A)
    assert os.listdir(store.root / "tmp") == []
    assert store.find_complete(REPO, "main") is None


def test_a_lease_on_a_full_disk_does_not_speak_of_a_partial(tiny_fs: Path) -> None:
    """Loading a model complete in the cache takes a lease first: on a full disk that write
    fails, and its error said "the partial download is kept", of a download there was not."""
    store = CacheStore(tiny_fs / "cache")
    _exhaust(tiny_fs, inodes=False)
    with pytest.raises(DiskFullError) as info:
        Leases(store).hold(REPO, owner="a load")
    assert "partial" not in str(info.value) and "prune" in str(info.value)


def test_full_disk_on_publish_keeps_a_writable_partial(tiny_fs: Path) -> None:
    store = CacheStore(tiny_fs / "cache")
    part, _ = store.layout.partial("job")
    part.write_bytes(b"verified payload")
    _exhaust(tiny_fs, inodes=True)  # the store's new <aa> folder needs an inode

    with pytest.raises(DiskFullError, match="kept"):
        store.publish_blob(part, sha256_of(b"verified payload"))
    assert part.read_bytes() == b"verified payload"
    assert stat.S_IMODE(part.stat().st_mode) & 0o200
    assert not store.has_blob(sha256_of(b"verified payload"))


def test_publish_across_file_systems_is_refused_and_keeps_the_partial(
    tiny_fs: Path, tmp_path: Path
) -> None:
    store = CacheStore(tiny_fs / "cache")
    part = tmp_path / "elsewhere.part"  # not on the cache's file system: link(2) says EXDEV
    part.write_bytes(b"payload")
    with pytest.raises(CacheError, match="publish blob"):
        store.publish_blob(part, sha256_of(b"payload"))
    assert part.read_bytes() == b"payload"
    assert stat.S_IMODE(part.stat().st_mode) & 0o200


def test_sweep_orphans_removes_only_dead_writers_of_this_host(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cache")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    mine = temp_name("part")
    host = mine.split(".")[1]
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    names = {
        "gone": f"part.{host}.{dead.stdout.strip()}.{'a' * 16}",
        # our very pid, but another process's start: a container's pid 1 before a restart
        "recycled": f"part.{host}.{os.getpid()}-1.{'d' * 16}",
        "live": mine,
        "elsewhere": f"part.{other_host}.{dead.stdout.strip()}.{'b' * 16}",
        "foreign": "something-else",
    }
    for name in names.values():
        (store.root / "tmp" / name).write_bytes(b"x")
    (store.root / "tmp" / f"evict.{host}.{dead.stdout.strip()}.{'c' * 16}").mkdir()
    assert sweep_orphans(store) == 3
    left = set(os.listdir(store.root / "tmp"))
    assert left == {names["live"], names["elsewhere"], names["foreign"]}
    assert is_live_temp(names["live"]) and not is_live_temp(names["elsewhere"])


def test_idle_download_locks_are_removed_and_a_waiter_locks_the_new_file(
    store: CacheStore,
) -> None:
    busy, idle = "a" * 64, "p-" + "b" * 40
    held = store.lock(busy)
    assert held.try_acquire()
    first = store.lock(idle)
    assert first.try_acquire()
    first.release()  # the file stays behind, idle
    waiter = store.lock(idle)
    gate = store.lock("prune-gate")
    assert gate.try_acquire()
    gate.release()
    assert remove_idle_locks(store) == 1  # not the held one, not the gate
    assert sorted(os.listdir(store.root / "locks")) == [f"{busy}.lock", "prune-gate.lock"]
    # an acquirer after the file went locks a fresh one
    assert waiter.try_acquire()
    assert (store.root / "locks" / f"{idle}.lock").exists()
    assert not store.lock(idle).try_acquire()
    held.release()
    waiter.release()


def test_idle_kept_range_locks_are_removed_and_a_held_one_stays(store: CacheStore) -> None:
    ranges = RangeCache(store, RepoRef(kind="url", name="https://example.test/run/"))
    idle, held = ranges.key("a.distcp"), ranges.key("b.distcp")
    first = store.lock(idle)
    assert first.try_acquire()
    first.release()  # a reader's commit is over: its lock file stays behind, idle
    busy = store.lock(held)
    assert busy.try_acquire()
    assert remove_idle_locks(store) == 1
    assert os.listdir(store.root / "locks") == [f"{held}.lock"]
    busy.release()


def test_a_lock_file_removed_between_open_and_flock_is_not_held(
    store: CacheStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardsync.locks as locks_module

    key = "c" * 64
    path = store.root / "locks" / f"{key}.lock"
    path.touch()
    real, raced = fcntl.flock, []

    def collector_first(fd: int, op: int) -> None:
        if not raced:  # the collector unlinks the file this acquirer just opened
            raced.append(path)
            path.unlink()
        real(fd, op)

    monkeypatch.setattr(locks_module.fcntl, "flock", collector_first)
    lock = store.lock(key)
    assert lock.try_acquire() and raced
    monkeypatch.undo()
    assert path.exists()
    assert not store.lock(key).try_acquire()  # it holds the file now at the path
    lock.release()
