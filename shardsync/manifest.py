"""Turn what an origin says into a frozen, validated, ordered fetch list.

Pure: no I/O. Everything here reads bytes or values handed in by the caller,
so hostile input (names that escape the cache, duplicate JSON keys, listings
that disagree with the index) is rejected before any path or URL is built.
"""

from __future__ import annotations

import fnmatch
import logging
import posixpath
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from shardsync import strict_json
from shardsync.errors import ManifestError, UnsafeNameError

__all__ = [
    "DEFAULT_INCLUDE",
    "MAX_FILE_SIZE",
    "MAX_JSON_BYTES",
    "UNSAFE_NAMES",
    "FileRole",
    "IndexInfo",
    "Listing",
    "Manifest",
    "ManifestEntry",
    "RemoteFile",
    "build_manifest",
    "is_safe_name",
    "leave_out",
    "likely_shards",
    "parse_hub_revision",
    "parse_hub_tree",
    "parse_index",
    "select_weights",
    "validate_name",
]

log = logging.getLogger("shardsync.manifest")

FileRole = Literal["index", "shard", "extra"]

MAX_JSON_BYTES = 64 * 1024 * 1024
"""Largest index or listing we parse; real ones are a few MiB at most."""

MAX_NAME_BYTES = 1024
MAX_COMPONENT_BYTES = 255

DEFAULT_INCLUDE: tuple[str, ...] = (
    "*.json",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "*.bpe",
    "*.vocab",
    "*.py",
    "*.md",
    "*.yaml",
    "*.yml",
    "tokenizer*",
    "LICENSE*",
    "NOTICE*",
)
"""Small files a loader needs next to the weights (configs, tokenizers, chat
templates, remote code, model card). Deliberately no weight formats: other
``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``, ... are never fetched by default."""

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"

_SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
_PICKLE_INDEX_SUFFIX = ".bin.index.json"

_HEX40 = re.compile(r"[0-9a-fA-F]{40}")
_HEX = re.compile(r"[0-9a-fA-F]+")
# A drive-like first segment: Windows joins ``base / "C:x"`` onto drive C:, so it is
# refused in every component, not only the first.
_DRIVE = re.compile(r"[A-Za-z]:")


def _unsafe(name: object, reason: str) -> UnsafeNameError:
    return UnsafeNameError(f"unsafe file name {name!r}: {reason}")


def validate_name(name: str) -> str:
    """Return ``name`` unchanged if it is a safe repo-relative posix path, else raise.

    A name that passes can be joined under a directory on POSIX and Windows and
    quoted into a URL path without escaping the directory or changing the URL's
    meaning. Percent signs are refused outright so no layer can decode ``%2e%2e``.
    """
    if not isinstance(name, str):
        raise _unsafe(name, "not a string")
    if not name:
        raise _unsafe(name, "empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _unsafe(name, "not valid UTF-8") from exc
    if len(encoded) > MAX_NAME_BYTES:
        raise _unsafe(name, f"longer than {MAX_NAME_BYTES} bytes")
    for char in name:
        if ord(char) < 0x20 or ord(char) == 0x7F:
            raise _unsafe(name, f"control character {char!r}")
    for char, what in (("\\", "backslash"), ("%", "percent sign"), ("?", "'?'"), ("#", "'#'")):
        if char in name:
            raise _unsafe(name, f"contains a {what}")
    if name.startswith("/"):
        raise _unsafe(name, "absolute path")
    if name.endswith("/"):
        raise _unsafe(name, "trailing slash")
    if unicodedata.normalize("NFC", name) != name:
        raise _unsafe(name, "not in Unicode NFC form")
    for component in name.split("/"):
        if not component:
            raise _unsafe(name, "empty path component")
        if component in (".", ".."):
            raise _unsafe(name, f"{component!r} component")
        if component.casefold() == ".git":
            raise _unsafe(name, "'.git' component")
        if _DRIVE.match(component):
            raise _unsafe(name, "drive letter")
        if len(component.encode("utf-8")) > MAX_COMPONENT_BYTES:
            raise _unsafe(name, f"component longer than {MAX_COMPONENT_BYTES} bytes")
    return name


def leave_out(names: Sequence[str], where: str, why: str) -> None:
    """Say which listed files were left out of a listing (never requested): one stray file
    (an NFD name, a ``#`` in a log's name) must not refuse a whole checkpoint, yet its name
    never becomes a path or URL. An index that names one still fails, where it is parsed.
    Names are escaped (``ascii``) and cut short: they come from the network or a disk."""
    if names:
        shown = ", ".join(ascii(n[:200]) for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        log.warning("%s: left out %d file(s) %s: %s%s", where, len(names), why, shown, more)


UNSAFE_NAMES = "whose names are unsafe as paths or URLs"


MAX_FILE_SIZE = 1 << 53  # 8 PiB: past any file (and past what a JSON number says exactly)


def is_safe_name(name: str) -> bool:
    """Whether ``validate_name`` accepts ``name``."""
    try:
        validate_name(name)
    except UnsafeNameError:
        return False
    return True


def _check_size(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"{where}: size must be a non-negative integer, got {value!r}")
    if value > MAX_FILE_SIZE:
        raise ManifestError(f"{where}: a size of {value} bytes is more than any file holds")
    return value


def _check_hex(value: object, where: str, what: str, digits: int) -> str | None:
    """An optional hash as the origin wrote it (either case), lowercased."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != digits or not _HEX.fullmatch(value):
        raise ManifestError(f"{where}: {what} must be {digits} hex digits, got {value!r}")
    return value.lower()


def _check_file(file: RemoteFile | ManifestEntry) -> str:
    """Validate a file's name and size and normalise its hashes (a listing entry and a fetch
    list entry alike); returns how messages name it."""
    validate_name(file.path)
    where = f"file {file.path!r}"
    _check_size(file.size, where)
    object.__setattr__(file, "sha256", _check_hex(file.sha256, where, "sha256", 64))
    object.__setattr__(file, "blob_id", _check_hex(file.blob_id, where, "git blob id", 40))
    if file.version is not None and not isinstance(file.version, str):
        raise ManifestError(f"{where}: version must be text, got {file.version!r}")
    return where


def _check_commit(value: object, where: str) -> str:
    if not isinstance(value, str) or not _HEX40.fullmatch(value):
        raise ManifestError(f"{where}: commit must be 40 hex digits, got {value!r}")
    return value.lower()


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One entry of an origin's listing; validated and normalised on construction.

    ``version``: what the origin called the file's version when it listed it (an S3
    object's ETag, from the listing's ``HEAD``), so the job that listed can check a cached
    copy recorded under it without asking again; None where the listing did not say. It
    is a note of when the file was seen, not part of what the file is: equality ignores it.
    """

    path: str
    size: int | None
    sha256: str | None
    blob_id: str | None = None
    version: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_file(self)


@dataclass(frozen=True, slots=True)
class Listing:
    """What an origin says it holds at one commit.

    ``exhaustive=False`` is for a plain HTTP origin that cannot list: shards named
    by the index are then accepted without a listing entry (size and sha256 unknown).
    """

    commit: str | None
    files: tuple[RemoteFile, ...]
    exhaustive: bool = True

    def __post_init__(self) -> None:
        if self.commit is not None:
            object.__setattr__(self, "commit", _check_commit(self.commit, "listing"))
        files = tuple(self.files)
        seen: set[str] = set()
        for remote in files:
            if remote.path in seen:
                raise ManifestError(f"listing names {remote.path!r} more than once")
            seen.add(remote.path)
        object.__setattr__(self, "files", files)


@dataclass(frozen=True, slots=True)
class IndexInfo:
    """A parsed ``*.safetensors.index.json`` / ``*.bin.index.json``.

    Shard paths are resolved against the index's directory, so ``weight_map``
    values and ``shards`` are repo-relative like every other path here.
    """

    path: str
    weight_map: Mapping[str, str] = field(hash=False)
    shards: tuple[str, ...]
    metadata: Mapping[str, object] = field(hash=False)
    format: Literal["safetensors", "pickle"]


SMALL_FILE = 1 << 20
"""Files up to this size are ``ManifestEntry.small``."""


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One file to fetch, with what we know about it up front (``version`` as in
    ``RemoteFile``)."""

    path: str
    size: int | None
    sha256: str | None
    blob_id: str | None
    role: FileRole
    version: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        where = _check_file(self)
        if self.role not in ("index", "shard", "extra"):
            raise ManifestError(f"{where}: unknown role {self.role!r}")

    @classmethod
    def from_remote(cls, remote: RemoteFile, role: FileRole) -> ManifestEntry:
        return cls(remote.path, remote.size, remote.sha256, remote.blob_id, role, remote.version)

    @property
    def small(self) -> bool:
        """A small file beside the weights (a config, a tokenizer): it costs round trips, not
        bandwidth, so it takes no ``max_files`` slot. Behind four 500 MB shards, a model's
        six small files ended a 3 s download by 0.5 s at 20 ms per request. A shard never
        is: shards go in index order, whatever their size."""
        return self.role == "extra" and self.size is not None and self.size <= SMALL_FILE


_ROLE_ORDER: dict[str, int] = {"index": 0, "shard": 1, "extra": 2}


@dataclass(frozen=True, slots=True)
class Manifest:
    """The ordered fetch list of one snapshot.

    Order is the fetch priority: the index (if any), the shards in index order
    (or the single weights file), then extras sorted by path.
    """

    commit: str | None
    entries: tuple[ManifestEntry, ...]
    weight_map: Mapping[str, str] = field(hash=False)

    def __post_init__(self) -> None:
        if self.commit is not None:
            object.__setattr__(self, "commit", _check_commit(self.commit, "manifest"))
        entries = tuple(self.entries)
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "weight_map", MappingProxyType(dict(self.weight_map)))
        ranks = [_ROLE_ORDER[e.role] for e in entries]
        if ranks != sorted(ranks) or ranks.count(0) > 1:
            raise ManifestError("manifest entries must be: at most one index, shards, extras")
        if not any(e.role == "shard" for e in entries):
            raise ManifestError("manifest has no weights")
        paths = [e.path for e in entries]
        if len(set(paths)) != len(paths):
            raise ManifestError("manifest names a file more than once")
        # A file and a directory of the same name cannot coexist in a snapshot.
        dirs = {posixpath.dirname(p) for p in paths}
        parents = {d for p in dirs for d in _ancestors(p)}
        clash = sorted(parents.intersection(paths))
        if clash:
            raise ManifestError(f"{clash[0]!r} is both a file and a directory in the listing")
        shard_paths = {e.path for e in entries if e.role == "shard"}
        for tensor, shard in self.weight_map.items():
            if shard not in shard_paths:
                raise ManifestError(f"weight_map maps {tensor!r} to {shard!r}, not a shard")

    @property
    def index(self) -> ManifestEntry | None:
        """The index entry, or None for a single-file checkpoint."""
        first = self.entries[0]
        return first if first.role == "index" else None

    @property
    def shards(self) -> tuple[ManifestEntry, ...]:
        """The weight files in load order (one for a single-file checkpoint)."""
        return tuple(e for e in self.entries if e.role == "shard")

    @property
    def extras(self) -> tuple[ManifestEntry, ...]:
        return tuple(e for e in self.entries if e.role == "extra")

    @property
    def total_size(self) -> int | None:
        """Bytes to fetch in all, or None while any size is unknown."""
        total = 0
        for entry in self.entries:
            if entry.size is None:
                return None
            total += entry.size
        return total

    def entry(self, path: str) -> ManifestEntry:
        """The entry for ``path``; KeyError if the manifest does not name it."""
        for candidate in self.entries:
            if candidate.path == path:
                return candidate
        raise KeyError(path)


def _ancestors(directory: str) -> list[str]:
    parts = directory.split("/") if directory else []
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _load_json(data: bytes, what: str) -> object:
    try:
        return strict_json.loads(data, limit=MAX_JSON_BYTES)
    except strict_json.StrictJSONError as exc:
        raise ManifestError(f"{what}: {exc}") from exc


def _object(value: object, what: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ManifestError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _array(value: object, what: str) -> list[object]:
    if not isinstance(value, list):
        raise ManifestError(f"{what} must be a JSON array, got {type(value).__name__}")
    return value


def parse_index(data: bytes, *, path: str) -> IndexInfo:
    """Parse a sharded checkpoint index fetched from ``path``."""
    validate_name(path)
    if path.endswith(_SAFETENSORS_INDEX_SUFFIX):
        fmt: Literal["safetensors", "pickle"] = "safetensors"
        shard_suffix = ".safetensors"
    elif path.endswith(_PICKLE_INDEX_SUFFIX):
        fmt = "pickle"
        shard_suffix = ".bin"
    else:
        raise ManifestError(f"{path!r} is not a *.safetensors.index.json or *.bin.index.json")
    top = _object(_load_json(data, path), path)
    raw_map = _object(top.get("weight_map"), f"{path}: 'weight_map'")
    if not raw_map:
        raise ManifestError(f"{path}: 'weight_map' is empty")
    raw_metadata = top.get("metadata", {})
    metadata = _object({} if raw_metadata is None else raw_metadata, f"{path}: 'metadata'")
    base = posixpath.dirname(path)
    weight_map: dict[str, str] = {}
    shards: dict[str, None] = {}
    for tensor, shard in raw_map.items():
        if not isinstance(shard, str):
            raise ManifestError(
                f"{path}: weight_map[{tensor!r}] must be a string, got {type(shard).__name__}"
            )
        validate_name(shard)
        resolved = validate_name(f"{base}/{shard}" if base else shard)
        if not resolved.endswith(shard_suffix):
            raise ManifestError(
                f"{path}: weight_map[{tensor!r}] = {shard!r} is not a {shard_suffix} file"
            )
        weight_map[tensor] = resolved
        shards[resolved] = None
    return IndexInfo(
        path=path,
        weight_map=MappingProxyType(weight_map),
        shards=tuple(shards),
        metadata=MappingProxyType(metadata),
        format=fmt,
    )


def _fits(weights: RemoteFile) -> RemoteFile:
    """An index the listing says is over ``MAX_JSON_BYTES`` is refused before a byte of it
    is fetched: a hostile repo's would be downloaded, stored and linked first."""
    if weights.path.endswith(".index.json") and (weights.size or 0) > MAX_JSON_BYTES:
        raise ManifestError(
            f"{weights.path}: {weights.size} bytes, over the {MAX_JSON_BYTES} byte limit"
        )
    return weights


def select_weights(listing: Listing, *, allow_pickle: bool = False) -> RemoteFile:
    """Pick the checkpoint to fetch: safetensors always wins over pickle.

    Order: ``model.safetensors.index.json``, ``model.safetensors``, then a lone
    top-level ``*.safetensors.index.json``, then a lone top-level ``*.safetensors``;
    pickle (``pytorch_model.bin.index.json``, ``pytorch_model.bin``) only with
    ``allow_pickle``.
    """
    by_path = {f.path: f for f in listing.files}
    for name in (SAFETENSORS_INDEX, SAFETENSORS_SINGLE):
        if name in by_path:
            return _fits(by_path[name])
    top_level = sorted(p for p in by_path if "/" not in p)
    for suffix in (_SAFETENSORS_INDEX_SUFFIX, ".safetensors"):
        candidates = [p for p in top_level if p.endswith(suffix)]
        if len(candidates) == 1:
            return _fits(by_path[candidates[0]])
        if len(candidates) > 1:
            raise ManifestError(
                f"ambiguous weights: several top-level *{suffix} files and no "
                f"{SAFETENSORS_INDEX}: {', '.join(candidates)}"
            )
    pickles = [by_path[name] for name in (PICKLE_INDEX, PICKLE_SINGLE) if name in by_path]
    if pickles:
        if allow_pickle:
            return _fits(pickles[0])
        raise ManifestError(
            f"the repository only has pickle weights ({pickles[0].path}); pickle can run "
            "code when loaded, so it is refused unless allowed: `shardsync prefetch "
            "--allow-pickle` on the command line, allow_pickle=True in Python "
            "(shardsync.prefetch, load, stream, Client.prefetch); it is then loaded with "
            "torch.load(weights_only=True). `shardsync load` streams safetensors only"
        )
    raise ManifestError(
        f"no weights found: expected {SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE} or a "
        "top-level *.safetensors file"
    )


def likely_shards(listing: Listing, weights: RemoteFile) -> tuple[RemoteFile, ...]:
    """The shards an index will most likely name, before it is read: for
    ``<stem>.<ext>.index.json``, the listing's files beside it called
    ``<stem>-<n>-of-<m>.<ext>``, in name order (the usual index order). A guess to start work
    early on (``Job.prepare`` locates the first ones while the index downloads), never a
    substitute for the index."""
    if not weights.path.endswith(".index.json"):
        return ()
    stem, dot, ext = weights.path.removesuffix(".index.json").rpartition(".")
    if not dot or "/" in ext:
        return ()
    shard = re.compile(re.escape(stem) + r"-\d+-of-\d+\." + re.escape(ext))
    return tuple(
        sorted((f for f in listing.files if shard.fullmatch(f.path)), key=lambda f: f.path)
    )


def _matches(path: str, patterns: Sequence[str]) -> bool:
    base = posixpath.basename(path)
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(base, p) for p in patterns)


def build_manifest(
    listing: Listing,
    index: IndexInfo | None,
    weights: RemoteFile,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> Manifest:
    """Combine listing, parsed index and chosen weights into the fetch list.

    The index and its shards are always fetched; ``include``/``exclude`` globs
    (matched against the full path and the basename) only pick the extras.
    """
    if isinstance(include, str) or isinstance(exclude, str):
        raise TypeError("include and exclude take a sequence of globs, not a string")
    patterns = DEFAULT_INCLUDE if include is None else tuple(include)
    listed = {f.path: f for f in listing.files}
    if listing.exhaustive and weights.path not in listed:
        raise ManifestError(f"{weights.path!r} is not in the origin's listing")
    entries: list[ManifestEntry] = []
    if index is None:
        if weights.path.endswith(".index.json"):
            raise ManifestError(f"{weights.path!r} is an index; parse it and pass it as index")
        entries.append(ManifestEntry.from_remote(weights, "shard"))
        weight_map: Mapping[str, str] = MappingProxyType({})
    else:
        if index.path != weights.path:
            raise ManifestError(f"index {index.path!r} is not the chosen weights {weights.path!r}")
        entries.append(ManifestEntry.from_remote(weights, "index"))
        for shard in index.shards:
            remote = listed.get(shard)
            if remote is None:
                if listing.exhaustive:
                    raise ManifestError(
                        f"{index.path} names shard {shard!r}, which is not in the listing"
                    )
                remote = RemoteFile(shard, None, None)
            entries.append(ManifestEntry.from_remote(remote, "shard"))
        weight_map = index.weight_map
    chosen = {e.path for e in entries}
    extras = sorted(
        (
            f
            for f in listing.files
            if f.path not in chosen and _matches(f.path, patterns) and not _matches(f.path, exclude)
        ),
        key=lambda f: f.path,
    )
    entries.extend(ManifestEntry.from_remote(f, "extra") for f in extras)
    return Manifest(commit=listing.commit, entries=tuple(entries), weight_map=weight_map)


def _hub_file(
    item: dict[str, object], *, name_key: str, lfs_hash_keys: tuple[str, ...], blob_key: str
) -> RemoteFile:
    name = item.get(name_key)
    if not isinstance(name, str):
        raise ManifestError(f"listing entry without a string {name_key!r}: {item!r}")
    where = f"listing entry {name!r}"
    size = _check_size(item.get("size"), where)
    sha256: object = None
    raw_lfs = item.get("lfs")
    if raw_lfs is not None:
        lfs = _object(raw_lfs, f"{where}: 'lfs'")
        sha256 = next((lfs[k] for k in lfs_hash_keys if lfs.get(k) is not None), None)
        if sha256 is None:
            raise ManifestError(f"{where}: 'lfs' has no {' or '.join(lfs_hash_keys)}")
        lfs_size = _check_size(lfs.get("size"), f"{where} (lfs)")
        if size is None:
            size = lfs_size
        elif lfs_size is not None and lfs_size != size:
            raise ManifestError(f"{where}: size {size} disagrees with lfs size {lfs_size}")
    blob_id = item.get(blob_key)
    if blob_id is not None and not isinstance(blob_id, str):
        raise ManifestError(f"{where}: {blob_key!r} must be a string, got {blob_id!r}")
    sha_checked = _check_hex(sha256, where, "sha256", 64)
    return RemoteFile(name, size, sha_checked, _check_hex(blob_id, where, "git blob id", 40))


def parse_hub_revision(payload: bytes, *, cut_at: int | None = None) -> Listing:
    """Parse ``GET /api/models/{repo}/revision/{rev}?blobs=true``; with ``cut_at`` (where the
    Hub may cut its ``siblings`` short) not ``exhaustive`` when it answered that many, unsafe
    names counted (they are left out of ``files``)."""
    what = "Hub revision info"
    top = _object(_load_json(payload, what), what)
    commit = _check_commit(top.get("sha"), f"{what} 'sha'")
    siblings = _array(top.get("siblings"), f"{what}: 'siblings'")
    files: list[RemoteFile] = []
    unsafe: list[str] = []
    for raw in siblings:
        item = _object(raw, f"{what}: sibling")
        if _unsafe_entry(item, "rfilename", unsafe):
            continue
        files.append(
            _hub_file(
                item, name_key="rfilename", lfs_hash_keys=("sha256", "oid"), blob_key="blobId"
            )
        )
    leave_out(unsafe, what, UNSAFE_NAMES)
    cut = cut_at is not None and len(siblings) >= cut_at
    return Listing(commit=commit, files=tuple(files), exhaustive=not cut)


def parse_hub_tree(payload: bytes) -> tuple[RemoteFile, ...]:
    """Parse one page of ``GET /api/models/{repo}/tree/{rev}?recursive=true``.

    Directory entries are skipped; any other non-file type is refused rather than
    guessed at.
    """
    what = "Hub tree listing"
    files: list[RemoteFile] = []
    unsafe: list[str] = []
    for raw in _array(_load_json(payload, what), what):
        item = _object(raw, f"{what}: entry")
        kind = item.get("type")
        if kind == "directory":
            continue
        if kind != "file":
            raise ManifestError(f"{what}: unknown entry type {kind!r} for {item.get('path')!r}")
        if not _unsafe_entry(item, "path", unsafe):
            files.append(_hub_file(item, name_key="path", lfs_hash_keys=("oid",), blob_key="oid"))
    leave_out(unsafe, what, UNSAFE_NAMES)
    return tuple(files)


def _unsafe_entry(item: dict[str, object], name_key: str, unsafe: list[str]) -> bool:
    """Whether the entry's name is a string ``validate_name`` refuses (noted in ``unsafe``);
    a missing or non-string name is ``_hub_file``'s error to raise."""
    name = item.get(name_key)
    if isinstance(name, str) and not is_safe_name(name):
        unsafe.append(name)
        return True
    return False
