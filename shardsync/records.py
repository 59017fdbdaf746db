"""The records and results every layer passes around, with no I/O (pure).

What a snapshot is (``RepoRef``, ``FileRecord``, ``SnapshotRecord`` and its JSON form), what a
prefetch returns (``FileOutcome``, ``PrefetchResult``), the tuning the fetcher takes
(``FetchConfig``) and the counters it reports. They live here, not next to the code that
makes them, so reading a config or a record never imports the network or the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, get_args

from shardsync import strict_json
from shardsync.errors import CacheError, ConfigError, UnsafeNameError
from shardsync.manifest import validate_name
from shardsync.names import (
    OriginKind,
    check_commit,
    check_etag,
    check_hub_repo,
    check_sha256,
    is_xxh3_128,
    split_revision,
)
from shardsync.retry import RetryPolicy

__all__ = [
    "FetchConfig",
    "FetchStatistics",
    "FileOutcome",
    "FileRecord",
    "NoProgress",
    "PrefetchResult",
    "ProgressSink",
    "RepoRef",
    "SnapshotRecord",
    "Source",
    "TierStatistics",
    "Verification",
    "VerifiedFile",
]

MiB = 1 << 20
_RECORD_FORMAT = 1
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


# --------------------------------------------------------------------------- snapshots


@dataclass(frozen=True, slots=True)
class RepoRef:
    """Where a snapshot comes from; its ``dirname`` names it inside the cache."""

    kind: OriginKind
    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or _CONTROL.search(self.name):
            raise ConfigError(f"invalid {self.kind} origin name {self.name!r}")
        if self.kind == "hub":
            check_hub_repo(self.name)
        elif self.kind == "local":
            if not os.path.isabs(self.name):
                raise ConfigError(f"a local origin needs an absolute path, got {self.name!r}")
        elif self.kind == "s3":
            if not self.name.startswith("s3://"):
                raise ConfigError(f"an S3 origin name starts with s3://, got {self.name!r}")
        elif self.kind != "url":
            raise ConfigError(f"unknown origin kind {self.kind!r}")

    @property
    def dirname(self) -> str:
        """``models--org--name`` for the Hub; ``{kind}--{slug}-{12 hex}`` otherwise.

        The hash suffix keeps two URLs that slug alike apart; the slug keeps it readable.
        """
        if self.kind == "hub":
            return "models--" + self.name.replace("/", "--")
        digest = hashlib.sha256(self.name.encode("utf-8", "surrogateescape")).hexdigest()[:12]
        slug = _SLUG_UNSAFE.sub("-", self.name).strip("-._")[:64].rstrip("-._")
        return f"{self.kind}--{slug}-{digest}" if slug else f"{self.kind}--{digest}"

    def content_id(self, files: Sequence[FileRecord]) -> str:
        """The snapshot id of an origin without commits: derived from what it holds."""
        h = hashlib.sha1(usedforsecurity=False)
        h.update(f"{self.kind}\0{self.name}\0".encode())
        for f in sorted(files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.sha256}\0".encode())
        return h.hexdigest()


Verification = Literal["sha256", "git-sha1", "sha1", "crc64nvme", "crc32c", "crc32", "tofu"]
"""What a file's bytes were checked against: the origin's SHA-256 (the Hub's LFS one, an S3
object's), a small Hub file's git blob id, an object store's other checksum (``checksums``),
or nothing (``tofu``)."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One verified file of a snapshot.

    ``verified`` says what the bytes were checked against: the Hub's LFS sha256, the git
    blob id of a small Hub file, an object store's checksum, or nothing (``"tofu"``: the
    origin gave no hash, so the one we computed is trusted on first use and every later read
    is checked against it).
    """

    path: str
    size: int
    sha256: str
    xxh3_128: str
    etag: str
    verified: Verification
    origin_etag: str | None = None  # what the origin called this version (URL/local origins)


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    """Proof that every file of ``repo`` at ``commit`` is in the cache; written last."""

    repo: RepoRef
    revision: str
    commit: str
    files: tuple[FileRecord, ...]
    completed_at: float

    def to_json(self) -> bytes:
        """Serialize, refusing a record that ``from_json`` would not read back."""
        _check_record(self)
        obj = {
            "format": _RECORD_FORMAT,
            "repo": {"kind": self.repo.kind, "name": self.repo.name},
            "revision": self.revision,
            "commit": self.commit,
            "completed_at": self.completed_at,
            "files": [
                {
                    "path": f.path,
                    "size": f.size,
                    "sha256": f.sha256,
                    "xxh3_128": f.xxh3_128,
                    "etag": f.etag,
                    "verified": f.verified,
                    "origin_etag": f.origin_etag,
                }
                for f in self.files
            ],
        }
        return json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=True).encode("ascii") + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> SnapshotRecord:
        """Parse and validate a record; anything unexpected raises ``CacheError``."""
        try:
            obj = strict_json.loads(data)
        except strict_json.StrictJSONError as exc:
            raise CacheError(f"snapshot record: {exc}") from exc
        record = _record_from_obj(obj)
        _check_record(record)
        return record


def _obj(value: object, keys: frozenset[str], what: str) -> dict[str, object]:
    if not isinstance(value, dict) or set(value) != keys:
        raise CacheError(f"snapshot record: {what} must be an object with keys {sorted(keys)}")
    return value


def _str(obj: dict[str, object], key: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise CacheError(f"snapshot record: {key!r} must be a string")
    return value


def _optional_str(obj: dict[str, object], key: str) -> str | None:
    value = obj[key]
    if value is not None and not isinstance(value, str):
        raise CacheError(f"snapshot record: {key!r} must be a string or null")
    return value


_RECORD_KEYS = frozenset({"format", "repo", "revision", "commit", "completed_at", "files"})
_REPO_KEYS = frozenset({"kind", "name"})
_FILE_KEYS = frozenset({"path", "size", "sha256", "xxh3_128", "etag", "verified", "origin_etag"})
_KINDS: dict[str, OriginKind] = {"hub": "hub", "url": "url", "local": "local", "s3": "s3"}
_VERIFICATIONS: dict[str, Verification] = {v: v for v in get_args(Verification)}


def _record_from_obj(value: object) -> SnapshotRecord:
    top = _obj(value, _RECORD_KEYS, "the record")
    if top["format"] != _RECORD_FORMAT or isinstance(top["format"], bool):
        raise CacheError(f"snapshot record: unsupported format {top['format']!r}")
    repo_obj = _obj(top["repo"], _REPO_KEYS, "'repo'")
    kind = _KINDS.get(_str(repo_obj, "kind"))
    if kind is None:
        raise CacheError(f"snapshot record: unknown repo kind {repo_obj['kind']!r}")
    try:
        repo = RepoRef(kind, _str(repo_obj, "name"))
    except ConfigError as exc:
        raise CacheError(f"snapshot record: {exc}") from exc
    completed_at = top["completed_at"]
    if isinstance(completed_at, bool) or not isinstance(completed_at, int | float):
        raise CacheError("snapshot record: 'completed_at' must be a number")
    files_value = top["files"]
    if not isinstance(files_value, list):
        raise CacheError("snapshot record: 'files' must be a list")
    files = []
    for item in files_value:
        entry = _obj(item, _FILE_KEYS, "a file entry")
        size = entry["size"]
        if isinstance(size, bool) or not isinstance(size, int):
            raise CacheError("snapshot record: 'size' must be an integer")
        verified = _VERIFICATIONS.get(_str(entry, "verified"))
        if verified is None:
            raise CacheError(f"snapshot record: unknown verification {entry['verified']!r}")
        files.append(
            FileRecord(
                path=_str(entry, "path"),
                size=size,
                sha256=_str(entry, "sha256"),
                xxh3_128=_str(entry, "xxh3_128"),
                etag=_str(entry, "etag"),
                verified=verified,
                origin_etag=_optional_str(entry, "origin_etag"),
            )
        )
    return SnapshotRecord(
        repo=repo,
        revision=_str(top, "revision"),
        commit=_str(top, "commit"),
        files=tuple(files),
        completed_at=float(completed_at),
    )


def _check_record(record: SnapshotRecord) -> None:
    try:
        split_revision(record.revision)
        for f in record.files:
            validate_name(f.path)
    except (ConfigError, UnsafeNameError) as exc:
        raise CacheError(f"snapshot record: {exc}") from exc
    check_commit(record.commit)
    if not math.isfinite(record.completed_at) or record.completed_at < 0:
        raise CacheError(f"snapshot record: bad completed_at {record.completed_at!r}")
    seen: set[str] = set()
    for f in record.files:
        if f.path in seen:
            raise CacheError(f"snapshot record: duplicate file {f.path!r}")
        seen.add(f.path)
        if isinstance(f.size, bool) or not isinstance(f.size, int) or f.size < 0:
            raise CacheError(f"snapshot record: bad size {f.size!r} for {f.path!r}")
        check_sha256(f.sha256)
        check_etag(f.etag)
        if not is_xxh3_128(f.xxh3_128):
            raise CacheError(f"snapshot record: bad xxh3_128 {f.xxh3_128!r} for {f.path!r}")
        if f.verified not in _VERIFICATIONS:
            raise CacheError(f"snapshot record: unknown verification {f.verified!r}")


# --------------------------------------------------------------------------- results


Source = Literal["network", "cache", "local", "tier"]


@dataclass(frozen=True, slots=True)
class VerifiedFile:
    """A downloaded (or copied) file in a slot's private temp name, hashed and checked (or
    trusted on first use): what an origin or the tier hands the engine and ``Slot.commit``
    publishes."""

    path: Path
    size: int
    sha256: str
    xxh3_128: str
    etag: str | None
    verified: Verification
    downloaded: int  # bytes received over the network by this call
    resumed: int  # bytes reused from an earlier partial
    source: Literal["network", "local", "tier"] = "network"


@dataclass(frozen=True, slots=True)
class FileOutcome:
    """How one file got into the snapshot."""

    path: str
    size: int
    sha256: str
    verified: Verification
    source: Source
    downloaded: int  # bytes received over the network for it in this run
    resumed: int  # bytes reused from an earlier partial


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """A complete snapshot: every file verified (or recorded, for tofu origins)."""

    repo: RepoRef
    revision: str
    commit: str
    snapshot_path: Path
    files: tuple[FileOutcome, ...]
    bytes_downloaded: int
    elapsed: float
    fetch: FetchStatistics | None
    tier: TierStatistics | None = None  # this job's tier use (None: no tier, or not final)

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_from_tier(self) -> int:
        return sum(f.downloaded for f in self.files if f.source == "tier")


class ProgressSink(Protocol):
    """Receives progress; the CLI draws bars from it, the daemon turns it into events."""

    def add_file(self, path: str, size: int | None) -> None: ...

    def advance(self, path: str, nbytes: int) -> None: ...

    def file_done(self, outcome: FileOutcome) -> None: ...


class NoProgress:
    """A ``ProgressSink`` that hears nothing: for a job nobody watches."""

    def add_file(self, path: str, size: int | None) -> None:
        return None

    def advance(self, path: str, nbytes: int) -> None:
        return None

    def file_done(self, outcome: FileOutcome) -> None:
        return None


# --------------------------------------------------------------------------- fetcher and tier


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """Transfer tuning. Defaults come from ``bench/download.py`` (bench/README.md)."""

    connections_per_file: int = 16
    chunk_size: int = 16 * MiB
    read_size: int = 4 * MiB
    write_size: int = 128 * 1024
    connect_timeout: float = 10.0
    read_timeout: float = 30.0
    min_throughput: int = 32 * 1024  # bytes/s a connection must sustain ...
    throughput_window: float = 30.0  # ... averaged over this many seconds
    sidecar_interval: float = 0.1  # the resume record is saved this often while data lands ...
    sidecar_bytes: int = 1 * MiB  # ... or once this much more of a file is on disk
    max_verify_attempts: int = 3  # full re-downloads after a hash mismatch
    retry: RetryPolicy = field(default_factory=RetryPolicy)


@dataclass(frozen=True, slots=True)
class FetchStatistics:
    """A snapshot of the fetcher's counters (what ``shardsync status`` prints)."""

    bytes_downloaded: int
    files_fetched: int
    active_connections: int
    retries: Mapping[str, int]
    verify_failures: int


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """What the tier did for this process (``shardsync status``, ``/metrics``) or one job
    (``--json``, a daemon's job)."""

    url: str
    hits: int  # blobs read from the tier
    misses: int  # blobs this host fetched from the origin for the fleet (it held the claim)
    bytes_from_tier: int
    uploads: int
    bytes_uploaded: int
    claims_won: int
    claims_waited: int  # blobs another host was fetching when we wanted them
    claims_taken_over: int  # claims of dead holders taken over
    stalled_fallbacks: int  # waits given up on a claim making no progress
    corrupt_objects: int  # tier objects that failed verification (deleted)
    errors: int  # tier requests that failed (the job went on from the origin)
    disabled: bool  # the tier refused our credentials: off for this process
    read_only: bool  # the tier refused our writes: we read from it, never upload or claim
    bytes_from_parts: int = 0  # bytes a taken-over download resumed from the dead holder's parts

    @classmethod
    def from_json(cls, obj: object) -> TierStatistics:
        """Read back ``dataclasses.asdict`` of one (a daemon's job); fields a newer daemon
        added are ignored. Anything else raises ``ValueError``."""
        if not isinstance(obj, dict):
            raise ValueError("a tier object must be a JSON object")

        def count(name: str, default: int | None = None) -> int:
            value = obj.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"tier object: {name!r} must be a count, not {value!r}")
            return value

        def flag(name: str) -> bool:
            value = obj.get(name)
            if not isinstance(value, bool):
                raise ValueError(f"tier object: {name!r} must be true or false, not {value!r}")
            return value

        url = obj.get("url")
        if not isinstance(url, str):
            raise ValueError(f"tier object: 'url' must be a string, not {url!r}")
        return cls(
            url=url,
            hits=count("hits"),
            misses=count("misses"),
            bytes_from_tier=count("bytes_from_tier"),
            uploads=count("uploads"),
            bytes_uploaded=count("bytes_uploaded"),
            claims_won=count("claims_won"),
            claims_waited=count("claims_waited"),
            claims_taken_over=count("claims_taken_over"),
            stalled_fallbacks=count("stalled_fallbacks"),
            corrupt_objects=count("corrupt_objects"),
            errors=count("errors"),
            disabled=flag("disabled"),
            read_only=flag("read_only"),
            bytes_from_parts=count("bytes_from_parts", 0),  # added in a later version
        )
