"""An object store's checksums: read from its answers, and checked against bytes fed in any
pieces. Expected digests come from botocore's own checksum classes (what uploaders use)."""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest
from botocore import httpchecksum

from shardsync.checksums import StoreChecksum, from_s3_answer
from shardsync.digest import Digest

BOTOCORE = {
    "sha256": httpchecksum.Sha256Checksum,
    "sha1": httpchecksum.Sha1Checksum,
    "crc64nvme": httpchecksum.CrtCrc64NvmeChecksum,
    "crc32c": httpchecksum.CrtCrc32cChecksum,
    "crc32": httpchecksum.Crc32Checksum,
}
KEYS = {
    "sha256": "ChecksumSHA256",
    "sha1": "ChecksumSHA1",
    "crc64nvme": "ChecksumCRC64NVME",
    "crc32c": "ChecksumCRC32C",
    "crc32": "ChecksumCRC32",
}
DATA = os.urandom(3 * 65536 + 123)
PARTS = (65536, 65536, 65536, 123)


def botocore_digest(algorithm: str, data: bytes) -> bytes:
    checksum = BOTOCORE[algorithm]()
    checksum.update(data)
    return bytes(checksum.digest())


def composite(algorithm: str, data: bytes, parts: tuple[int, ...]) -> bytes:
    """S3's composite checksum: the checksum of the parts' checksums, concatenated."""
    digests, at = b"", 0
    for size in parts:
        digests += botocore_digest(algorithm, data[at : at + size])
        at += size
    return botocore_digest(algorithm, digests)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def fed(checksum: StoreChecksum, data: bytes, step: int) -> bool:
    digest = Digest(store=checksum)
    for at in range(0, len(data), step):
        digest.update(memoryview(data)[at : at + step])
    assert digest.store is not None
    return digest.store.matches()


@pytest.mark.parametrize("algorithm", list(BOTOCORE))
@pytest.mark.parametrize("step", [1000, 65536, 70000, len(DATA)])
def test_whole_object_checksums_match_what_botocore_computes(algorithm: str, step: int) -> None:
    answer = {KEYS[algorithm]: b64(botocore_digest(algorithm, DATA)), "ChecksumType": "FULL_OBJECT"}
    checksum = from_s3_answer(answer)
    assert checksum == StoreChecksum(algorithm, botocore_digest(algorithm, DATA))  # type: ignore[arg-type]
    assert fed(checksum, DATA, step)
    flipped = bytearray(DATA)
    flipped[len(DATA) // 3] ^= 0x10
    assert not fed(checksum, bytes(flipped), step)
    assert not fed(checksum, DATA[:-1], step)


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c", "sha1", "sha256"])
@pytest.mark.parametrize("step", [999, 65536, 65537, len(DATA)])
def test_composite_checksums_are_checked_part_by_part(algorithm: str, step: int) -> None:
    value = f"{b64(composite(algorithm, DATA, PARTS))}-{len(PARTS)}"
    checksum = from_s3_answer({KEYS[algorithm]: value, "ChecksumType": "COMPOSITE"})
    assert checksum is not None and checksum.composite and not checksum.checkable
    with_parts = checksum.with_part_sizes(PARTS, len(DATA))
    assert fed(with_parts, DATA, step)
    # the same bytes cut into other parts give another composite: the boundaries count
    other = checksum.with_part_sizes((65536, 65536, 65536 + 100, 23), len(DATA))
    assert not fed(other, DATA, step)
    flipped = bytearray(DATA)
    flipped[-1] ^= 0x01
    assert not fed(with_parts, bytes(flipped), step)
    assert not fed(with_parts, DATA + b"\0", step)
    assert not fed(with_parts, DATA[:-1], step)


def test_part_sizes_must_add_up_to_the_object() -> None:
    checksum = StoreChecksum("crc32", b"\0" * 4, parts=2)
    assert checksum.with_part_sizes((5, 5), 10).checkable
    for sizes in ((5, 4), (10,), (10, 0)):
        with pytest.raises(ValueError):
            checksum.with_part_sizes(sizes, 10)
    with pytest.raises(ValueError):
        Digest(store=checksum)  # a composite without its parts checks nothing


CRC32 = b64(b"\1\2\3\4")
SHA256 = b64(bytes(32))


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({}, None),
        ({"ChecksumCRC32": CRC32}, StoreChecksum("crc32", b"\1\2\3\4")),
        # the strongest of several wins
        (
            {"ChecksumCRC32": CRC32, "ChecksumSHA256": SHA256},
            StoreChecksum("sha256", bytes(32)),
        ),
        ({"ChecksumCRC32": CRC32 + "-3", "ChecksumType": "COMPOSITE"}, "composite"),
        ({"ChecksumCRC32": CRC32 + "-3"}, "composite"),  # stores that omit the type
        # what checks nothing is the store's error, not a checksum it does not keep: bad
        # base64, a wrong length, a bad part count, a type that contradicts the value
        ({"ChecksumCRC32": "not base64!"}, ValueError),
        ({"ChecksumCRC32": b64(b"\1\2\3")}, ValueError),
        ({"ChecksumSHA256": CRC32}, ValueError),
        ({"ChecksumCRC32": CRC32 + "-0"}, ValueError),
        ({"ChecksumCRC32": CRC32 + "-x"}, ValueError),
        ({"ChecksumCRC32": CRC32 + "-10001"}, ValueError),
        ({"ChecksumCRC32": CRC32 + "-٣"}, ValueError),
        ({"ChecksumCRC32": CRC32, "ChecksumType": "COMPOSITE"}, ValueError),
        ({"ChecksumCRC32": CRC32 + "-3", "ChecksumType": "FULL_OBJECT"}, ValueError),
        ({"ChecksumCRC32": 12345}, ValueError),
        # a bad strongest one leaves the next
        (
            {"ChecksumSHA256": "!!", "ChecksumCRC64NVME": b64(bytes(8))},
            StoreChecksum("crc64nvme", bytes(8)),
        ),
    ],
)
def test_answers_are_read_strictly(answer: dict[str, Any], expected: object) -> None:
    if expected is ValueError:  # the store's error (``S3Client.head``: a ProtocolError)
        with pytest.raises(ValueError):
            from_s3_answer(answer)
        return
    found = from_s3_answer(answer)
    if expected == "composite":
        assert found == StoreChecksum("crc32", b"\1\2\3\4", parts=3)
    else:
        assert found == expected
