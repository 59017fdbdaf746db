"""What a job knows before its shards land, as a value that crosses the daemon's socket.

A stream plans its devices from every shard's safetensors header before any shard body
arrives. When a daemon serves the stream, the daemon lists the origin, gets the index and
reads those headers (``POST /v1/prepare``), so the stream's own process asks the origin
nothing: no S3 client, no credentials, no second listing. Pure: the JSON a daemon sends is
checked here like any other bytes from outside, and the headers themselves are parsed by
``safetensors_header`` on the caller's side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from shardsync.errors import DaemonError, HeaderError, ManifestError
from shardsync.manifest import Manifest, ManifestEntry
from shardsync.safetensors_header import MAX_HEADER_SIZE

__all__ = ["Prepared"]

_FIELDS = frozenset({"commit", "entries", "weight_map", "headers"})
_ENTRY_FIELDS = ("path", "size", "sha256", "blob_id", "role")


@dataclass(frozen=True, slots=True)
class Prepared:
    """A snapshot's fetch list and each safetensors shard's raw header (the ``N`` bytes
    after its length prefix), keyed by the shard's path; none for pickle shards."""

    manifest: Manifest
    headers: Mapping[str, bytes] = field(hash=False)

    def __post_init__(self) -> None:
        headers = dict(self.headers)
        wanted = {e.path for e in self.manifest.shards if e.path.endswith(".safetensors")}
        if set(headers) != wanted:
            raise ManifestError("the headers name other files than the manifest's shards")
        for path, raw in headers.items():
            if not isinstance(raw, bytes) or len(raw) > MAX_HEADER_SIZE:
                raise HeaderError(f"{path}: a header of at most {MAX_HEADER_SIZE} bytes")
        object.__setattr__(self, "headers", MappingProxyType(headers))

    def to_json(self) -> dict[str, Any]:
        """The answer of ``POST /v1/prepare``."""
        m = self.manifest
        return {
            "commit": m.commit,
            "entries": [{k: getattr(e, k) for k in _ENTRY_FIELDS} for e in m.entries],
            "weight_map": dict(m.weight_map),
            "headers": {path: _header_text(path, raw) for path, raw in self.headers.items()},
        }

    @classmethod
    def from_json(cls, obj: object) -> Prepared:
        """Read a daemon's answer; anything malformed is a ``DaemonError`` (the names in it
        are validated as a listing's are, by ``Manifest``)."""
        try:
            if not isinstance(obj, dict) or set(obj) != _FIELDS:
                raise TypeError("not the fields of a prepared job")
            entries, weights, headers = obj["entries"], obj["weight_map"], obj["headers"]
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise TypeError("entries must be a list of file objects")
            if not _text_map(weights) or not _text_map(headers):
                raise TypeError("weight_map and headers must map strings to strings")
            manifest = Manifest(
                commit=obj["commit"],
                entries=tuple(ManifestEntry(**e) for e in entries),
                weight_map=weights,
            )
            return cls(manifest, {path: text.encode() for path, text in headers.items()})
        except (TypeError, ValueError, ManifestError, HeaderError) as exc:
            raise DaemonError(f"the daemon's prepared job is malformed: {exc}") from exc


def _header_text(path: str, raw: bytes) -> str:
    """A header as JSON text (safetensors headers are UTF-8 JSON; one that is not could
    never parse, so it fails here, naming its shard)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"{path}: the header is not UTF-8 text") from exc


def _text_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )
