"""The names that become paths and URL parts, with their rules in one place (pure).

A commit, a content hash or a revision reaches the cache from a server, a record or a user;
each is checked here before it names a file, so the cache, the origins and the records can
never disagree about what is safe.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeGuard

from shardsync.errors import CacheError, ConfigError

__all__ = [
    "OriginKind",
    "S3Location",
    "check_commit",
    "check_etag",
    "check_hub_repo",
    "check_sha256",
    "is_commit",
    "is_etag",
    "is_sha256",
    "is_xxh3_128",
    "parse_s3_url",
    "source_kind",
    "split_revision",
    "validate_revision",
]

OriginKind = Literal["hub", "url", "local", "s3"]
"""What kind of place a snapshot comes from; its cache folder name says it."""

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_XXH3_128 = re.compile(r"[0-9a-f]{32}")
_ETAG = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a Hub blob name: git blob id or sha256
_REVISION_SEGMENT = re.compile(r"[A-Za-z0-9._+-]{1,255}")
_HUB_SEGMENT = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")


def is_commit(value: object) -> bool:
    """A full commit hash, lowercase, as the cache stores it."""
    return isinstance(value, str) and _COMMIT.fullmatch(value) is not None


def is_sha256(value: object) -> TypeGuard[str]:
    """A lowercase sha256 hex digest: the name of a blob in the store."""
    return isinstance(value, str) and _SHA256.fullmatch(value) is not None


def is_xxh3_128(value: object) -> TypeGuard[str]:
    """A lowercase xxh3-128 hex digest (the fast re-check hash of a file)."""
    return isinstance(value, str) and _XXH3_128.fullmatch(value) is not None


def is_etag(value: object) -> bool:
    """A Hub blob name under ``blobs/``: a 40-hex git blob id or a 64-hex sha256."""
    return isinstance(value, str) and _ETAG.fullmatch(value) is not None


def check_commit(value: object) -> str:
    """``value`` when it is a commit hash; a name the cache would write, else ``CacheError``."""
    if not is_commit(value):
        raise CacheError(f"not a 40-hex commit hash: {value!r}")
    assert isinstance(value, str)
    return value


def check_sha256(value: object) -> str:
    """``value`` when it is a sha256 digest; else ``CacheError``."""
    if not is_sha256(value):
        raise CacheError(f"not a lowercase 64-hex sha256: {value!r}")
    assert isinstance(value, str)
    return value


def check_etag(value: object) -> str:
    """``value`` when it is a Hub blob name; else ``CacheError``."""
    if not is_etag(value):
        raise CacheError(f"not a 40- or 64-hex etag: {value!r}")
    assert isinstance(value, str)
    return value


def split_revision(revision: object) -> tuple[str, ...]:
    """A branch, tag, commit or ``refs/pr/N`` split into segments safe under ``refs/`` and
    in a URL path: nothing that walks up, hides a lock file or changes a URL's meaning."""
    if not isinstance(revision, str) or not 0 < len(revision) <= 255:
        raise ConfigError(f"invalid revision {revision!r}")
    parts = tuple(revision.split("/"))
    for part in parts:
        if part in (".", "..") or not _REVISION_SEGMENT.fullmatch(part) or part.endswith(".lock"):
            raise ConfigError(f"invalid revision {revision!r}")
    return parts


def validate_revision(revision: object) -> str:
    """``revision`` unchanged when ``split_revision`` accepts it."""
    split_revision(revision)
    assert isinstance(revision, str)
    return revision


def check_hub_repo(name: str) -> None:
    """Hugging Face repo-id rules, so that a cache folder name maps back to exactly one id."""
    segments = name.split("/")
    if (
        not 0 < len(name) <= 96
        or len(segments) > 2
        or "--" in name
        or ".." in name
        or name.endswith(".git")
        or not all(_HUB_SEGMENT.fullmatch(segment) for segment in segments)
    ):
        raise ConfigError(f"invalid Hugging Face repo id {name!r}")


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,61}[a-z0-9]", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class S3Location:
    """``s3://BUCKET/PREFIX/``: the prefix is empty or ends with ``/``."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def key_for(self, path: str) -> str:
        return self.prefix + path


def parse_s3_url(url: str) -> S3Location:
    """Validate an ``s3://`` URL; a prefix names a folder, so it gains a trailing ``/``."""
    if not url.startswith("s3://"):
        raise ConfigError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"invalid S3 bucket name {bucket!r} in {url!r}")
    if _CONTROL.search(prefix) or "?" in prefix or "#" in prefix or len(prefix) > 900:
        raise ConfigError(f"invalid S3 prefix in {url!r}")
    parts = prefix.removesuffix("/").split("/") if prefix else []
    if "" in parts:  # S3 keys keep an empty segment: runs//llama/ is not runs/llama/
        raise ConfigError(f"an S3 prefix must not hold an empty segment ('//'): {url!r}")
    if any(p in (".", "..") for p in parts):
        raise ConfigError(f"an S3 prefix must not contain '.' or '..' segments: {url!r}")
    return S3Location(bucket=bucket, prefix="".join(p + "/" for p in parts))


def source_kind(source: str, *, is_dir: Callable[[str], bool] = os.path.isdir) -> OriginKind:
    """The kind of origin a user's source names: an http(s) URL, an ``s3://`` prefix, a
    directory (a path, or a bare name that is one here: ``is_dir`` looks), else a Hub repo
    id. The one rule ``origins.parse_source`` follows, so a caller that only hands the source
    on (the CLI, to the daemon) decides without importing the origins."""
    if source.startswith(("http://", "https://")):
        return "url"
    if source.startswith("s3://"):
        return "s3"
    if source.startswith(("/", "./", "../", "~")) or is_dir(source):
        return "local"
    if "://" in source:
        raise ConfigError(
            f"unsupported source {source!r}: use ORG/NAME, an http(s) or s3:// URL, or a directory"
        )
    return "hub"
