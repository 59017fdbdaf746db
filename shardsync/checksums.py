"""The checksum an object store keeps for an object, read from its answer (pure).

S3 and its clones keep one checksum per object when the uploader asked for one, and S3
computes CRC64NVME itself when it did not: ``sha256``, ``sha1``, ``crc64nvme``, ``crc32c``
or ``crc32``. It is either of the whole object (``FULL_OBJECT``) or, for most multipart
uploads, ``COMPOSITE``: the checksum of the parts' checksums concatenated, answered as
``BASE64-N`` for N parts. A composite one is checked part by part, so it needs the parts'
sizes (``S3Client.part_sizes``).

What each protects against: a CRC catches corruption on the way or at rest, not a store
that lies (anyone can make bytes with a chosen CRC); SHA-1 and SHA-256 catch that too, as far
as the store that named them is trusted. Bytes are hashed as they land in ``digest.py``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "STRONGEST_FIRST",
    "ChecksumAlgorithm",
    "StoreChecksum",
    "from_s3_answer",
    "parts_fit",
]

ChecksumAlgorithm = Literal["sha256", "sha1", "crc64nvme", "crc32c", "crc32"]
STRONGEST_FIRST: tuple[ChecksumAlgorithm, ...] = get_args(ChecksumAlgorithm)
DIGEST_SIZE: Mapping[ChecksumAlgorithm, int] = {
    "sha256": 32,
    "sha1": 20,
    "crc64nvme": 8,
    "crc32c": 4,
    "crc32": 4,
}
_ANSWER_KEY: Mapping[ChecksumAlgorithm, str] = {
    "sha256": "ChecksumSHA256",
    "sha1": "ChecksumSHA1",
    "crc64nvme": "ChecksumCRC64NVME",
    "crc32c": "ChecksumCRC32C",
    "crc32": "ChecksumCRC32",
}
_MAX_PARTS = 10_000  # S3's limit for one multipart upload


@dataclass(frozen=True, slots=True)
class StoreChecksum:
    """One object's checksum as its store keeps it. ``parts`` is 0 for a whole-object one;
    a composite one names its part count, and ``part_sizes`` once they are known."""

    algorithm: ChecksumAlgorithm
    digest: bytes
    parts: int = 0
    part_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_SIZE[self.algorithm]:
            raise ValueError(f"a {self.algorithm} digest has {DIGEST_SIZE[self.algorithm]} bytes")
        if not 0 <= self.parts <= _MAX_PARTS:
            raise ValueError(f"{self.parts} parts")
        if self.part_sizes and len(self.part_sizes) != self.parts:
            raise ValueError(f"{len(self.part_sizes)} part sizes for {self.parts} parts")

    @property
    def composite(self) -> bool:
        return self.parts > 0

    @property
    def checkable(self) -> bool:
        """Whether bytes can be checked against it (a composite one needs its parts)."""
        return not self.composite or bool(self.part_sizes)

    def with_part_sizes(self, sizes: Sequence[int], total: int) -> StoreChecksum:
        """This checksum with its parts' sizes. Sizes that do not add up to ``total`` (or are
        not as many as the checksum says) are a ValueError: they could check nothing, and the
        S3 client refuses them before they get here."""
        sizes = tuple(sizes)
        if not parts_fit(sizes, self.parts, total):
            raise ValueError(f"{len(sizes)} parts of {sum(sizes)} bytes for {total}")
        return StoreChecksum(self.algorithm, self.digest, self.parts, sizes)

    def describe(self) -> str:
        return f"{self.algorithm} of {self.parts} parts" if self.composite else self.algorithm


def parts_fit(sizes: Sequence[int], parts: int, total: int) -> bool:
    """Whether ``sizes`` can be the ``parts`` parts of an object of ``total`` bytes."""
    return len(sizes) == parts and sum(sizes) == total and all(s > 0 for s in sizes)


def from_s3_answer(answer: Mapping[str, object]) -> StoreChecksum | None:
    """The strongest checksum a HeadObject or GetObject answer carries (botocore's keys), or
    None when it carries none. A value that is not what its algorithm makes (bad base64, a
    wrong length, a part count that is no number, a type that contradicts it) checks
    nothing: the next is taken, and where none is left the answer is a ``ValueError`` (the
    store's error), not an object the store keeps no checksum of (``tofu``)."""
    kind = answer.get("ChecksumType")
    unreadable: list[str] = []
    for algorithm in STRONGEST_FIRST:
        value = answer.get(_ANSWER_KEY[algorithm])
        if value is None:
            continue
        found = _read(algorithm, value, kind)
        if found is not None:
            return found
        unreadable.append(_ANSWER_KEY[algorithm])
    if unreadable:
        raise ValueError(f"the store answers {', '.join(unreadable)} that no data can match")
    return None


def _read(algorithm: ChecksumAlgorithm, value: object, kind: object) -> StoreChecksum | None:
    if not isinstance(value, str):
        return None
    encoded, dash, count = value.partition("-")
    if dash and not (count.isdigit() and count.isascii() and 0 < int(count) <= _MAX_PARTS):
        return None
    parts = int(count) if dash else 0
    if (kind == "COMPOSITE") != bool(parts) and kind is not None:
        return None  # a type that contradicts the value's own form
    try:
        digest = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(digest) != DIGEST_SIZE[algorithm]:
        return None
    return StoreChecksum(algorithm, digest, parts)
