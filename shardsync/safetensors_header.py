"""Parse and validate safetensors headers without torch and without I/O.

A safetensors file is an 8-byte little-endian length ``N``, ``N`` bytes of UTF-8
JSON, then the data section. The caller fetches the first 8 bytes and then the
header with Range requests; this module turns those bytes into absolute byte
ranges per tensor, so the loader can plan devices and the fetcher can verify
layout before a shard lands.

Headers come from the network and are treated as hostile. We are deliberately
stricter than the reference reader where leniency lets two parsers disagree
about one file (duplicate keys, unknown keys, names with NUL) and exactly as
strict where it protects memory: the tensors must tile the data section with
no overlap and no hole, and the data section must end at the end of the file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeGuard

from shardsync import strict_json
from shardsync.errors import HeaderError

__all__ = [
    "DTYPE_BITS",
    "DTYPE_SIZES",
    "MAX_HEADER_SIZE",
    "Header",
    "TensorInfo",
    "check_index",
    "check_start",
    "header_length",
    "parse_header",
]

MAX_HEADER_SIZE = 100_000_000
"""Largest header we accept, the same cap as the safetensors crate."""

DTYPE_BITS: Mapping[str, int] = MappingProxyType(
    {
        "BOOL": 8,
        "F4": 4,
        "F6_E2M3": 6,
        "F6_E3M2": 6,
        "U8": 8,
        "I8": 8,
        "F8_E5M2": 8,
        "F8_E4M3": 8,
        "F8_E8M0": 8,
        "F8_E4M3FNUZ": 8,
        "F8_E5M2FNUZ": 8,
        "I16": 16,
        "U16": 16,
        "F16": 16,
        "BF16": 16,
        "I32": 32,
        "U32": 32,
        "F32": 32,
        "C64": 64,
        "F64": 64,
        "I64": 64,
        "U64": 64,
    }
)
"""Bits per element of every dtype safetensors 0.8 reads. Sub-byte types (F4, F6_*)
are packed: a tensor of them must fill a whole number of bytes."""

DTYPE_SIZES: Mapping[str, int] = MappingProxyType(
    {name: bits // 8 for name, bits in DTYPE_BITS.items() if bits % 8 == 0}
)
"""Bytes per element of the whole-byte dtypes; sub-byte dtypes are only in DTYPE_BITS."""

_LIMIT = 1 << 63
"""Bound on offsets, sizes and element counts: larger numbers are never a real file."""

_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_METADATA_KEY = "__metadata__"
_QUOTE_MAX = 120


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives: ``[start, end)`` are absolute offsets in the shard file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    shard: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Header:
    """A validated header: tensors sorted by offset, tiling ``[data_start, file_size)``."""

    shard: str
    header_size: int
    data_start: int
    data_size: int
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str] = field(hash=False)
    _by_name: Mapping[str, TensorInfo] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        by_name = MappingProxyType({t.name: t for t in self.tensors})
        object.__setattr__(self, "_by_name", by_name)

    def tensor(self, name: str) -> TensorInfo:
        """The tensor called ``name``; ``KeyError`` if this shard has none."""
        return self._by_name[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def _q(value: object) -> str:
    """Show a value from the network in a message, bounded so a hostile one stays short.

    Containers are named by type only: their repr could be huge or nested past the
    recursion limit.
    """
    if not (value is None or isinstance(value, str | int | float)):
        return type(value).__name__
    shown = repr(value)
    if len(shown) <= _QUOTE_MAX:
        return shown
    return f"{shown[:_QUOTE_MAX]}... ({len(shown)} characters)"


def _fail(shard: str, message: str) -> HeaderError:
    return HeaderError(f"{shard}: {message}")


def _bad(shard: str, name: str, message: str) -> HeaderError:
    return _fail(shard, f"tensor {_q(name)}: {message}")


def header_length(
    prefix: bytes,
    *,
    shard: str,
    file_size: int | None = None,
    max_header: int = MAX_HEADER_SIZE,
) -> int:
    """Read ``N`` from the first 8 bytes of a shard and check it before fetching ``N`` bytes."""
    if len(prefix) < 8:
        raise _fail(shard, f"need the first 8 bytes for the header length, got {len(prefix)}")
    size = int.from_bytes(prefix[:8], "little")
    if size < 2:
        raise _fail(shard, f"header length {size} is too small for a JSON object")
    if size > max_header:
        raise _fail(shard, f"header length {size} is over the {max_header} byte limit")
    if file_size is not None and 8 + size > file_size:
        raise _fail(shard, f"header length {size} is larger than the file ({file_size} bytes)")
    return size


def check_start(prefix: bytes, *, shard: str, file_size: int) -> None:
    """Refuse a file that cannot be a safetensors shard from its first 9 bytes: a header
    length that fits the file and a header that opens a JSON object. What an unchecked
    origin answers instead (a login page, an error body) fails here."""
    try:
        header_length(prefix, shard=shard, file_size=file_size)
        if prefix[8:9] != b"{":
            raise _fail(shard, "the header does not open a JSON object")
    except HeaderError as exc:
        raise HeaderError(f"not a safetensors file (no checksum vouches for it): {exc}") from None


def _load(header: bytes, shard: str) -> object:
    try:
        return strict_json.loads(header)
    except strict_json.StrictJSONError as exc:
        raise _fail(shard, f"header: {exc}") from exc


def _check_text(value: str, shard: str, what: str) -> None:
    """Reject strings that cannot be written back as UTF-8 (lone surrogates from escapes)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _fail(shard, f"{what} {_q(value)} is not valid Unicode") from exc


def _metadata(value: object, shard: str) -> dict[str, str]:
    if value is None:
        # The reference reader treats ``null`` as absent; refusing it would reject loadable files.
        return {}
    if not isinstance(value, dict):
        raise _fail(shard, f"{_METADATA_KEY} must be an object, got {type(value).__name__}")
    for key, item in value.items():
        _check_text(key, shard, f"{_METADATA_KEY} key")
        if not isinstance(item, str):
            raise _fail(
                shard,
                f"{_METADATA_KEY}[{_q(key)}] must be a string, got {type(item).__name__}",
            )
        _check_text(item, shard, f"{_METADATA_KEY}[{_q(key)}] value")
    return value


def _shape_text(shape: list[int]) -> str:
    return str(tuple(shape)) if len(shape) <= 16 else f"of {len(shape)} dimensions"


def _uint(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value < _LIMIT


def _entry(name: str, value: object, shard: str, data_start: int) -> TensorInfo:
    """Validate one tensor entry and place it at absolute offsets."""
    if not name:
        raise _fail(shard, "empty tensor name")
    if "\x00" in name:
        raise _bad(shard, name, "name contains NUL")
    if not name.isascii():
        _check_text(name, shard, "tensor name")
    if not isinstance(value, dict):
        raise _bad(shard, name, f"entry must be an object, got {type(value).__name__}")
    if value.keys() != _ENTRY_KEYS:
        missing = sorted(_ENTRY_KEYS - value.keys())
        extra = sorted(value.keys() - _ENTRY_KEYS)
        problems = [f"missing {k!r}" for k in missing] + [f"unknown key {_q(k)}" for k in extra]
        raise _bad(shard, name, ", ".join(problems))

    dtype = value["dtype"]
    if not isinstance(dtype, str):
        raise _bad(shard, name, f"dtype must be a string, got {type(dtype).__name__}")
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise _bad(shard, name, f"unknown dtype {_q(dtype)}")

    shape = value["shape"]
    if not isinstance(shape, list):
        raise _bad(shard, name, f"shape must be a list, got {type(shape).__name__}")
    numel = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise _bad(shard, name, f"shape entry {_q(dim)} is not a non-negative int")
        if dim >= _LIMIT:
            raise _bad(shard, name, f"shape overflow (dimension {_q(dim)})")
        # Both factors are below 2**63, so the product never grows past 2**126.
        numel *= dim
        if numel >= _LIMIT:
            raise _bad(shard, name, "shape overflow (over 2**63 elements)")

    offsets = value["data_offsets"]
    if not isinstance(offsets, list):
        raise _bad(shard, name, f"data_offsets must be a list, got {_q(offsets)}")
    if len(offsets) != 2:
        raise _bad(shard, name, f"data_offsets must hold 2 ints, got {len(offsets)} items")
    begin, end = offsets[0], offsets[1]
    if not (_uint(begin) and _uint(end)):
        raise _bad(shard, name, f"data_offsets [{_q(begin)}, {_q(end)}] are not ints in [0, 2**63)")
    if begin > end:
        raise _bad(shard, name, f"data_offsets begin {begin} is after end {end}")

    total_bits = numel * bits
    if total_bits % 8:
        raise _bad(
            shard, name, f"{numel} elements of {dtype} are {total_bits} bits, not whole bytes"
        )
    if total_bits // 8 != end - begin:
        raise _bad(
            shard,
            name,
            f"{dtype} {_shape_text(shape)} needs {total_bits // 8} bytes "
            f"but data_offsets [{begin}, {end}] hold {end - begin}",
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end, shard)


def parse_header(header: bytes, *, shard: str, file_size: int | None = None) -> Header:
    """Validate the ``N`` header bytes of ``shard`` (the bytes after the length prefix).

    With ``file_size`` the data section must end exactly at the end of the file.
    """
    data_start = 8 + len(header)
    if file_size is not None and data_start > file_size:
        raise _fail(shard, f"header ends at byte {data_start}, past the file ({file_size} bytes)")
    top = _load(header, shard)
    if not isinstance(top, dict):
        raise _fail(shard, f"header must be a JSON object, got {type(top).__name__}")

    metadata: dict[str, str] = {}
    tensors: list[TensorInfo] = []
    for name, value in top.items():
        if name == _METADATA_KEY:
            metadata = _metadata(value, shard)
        else:
            tensors.append(_entry(name, value, shard, data_start))
    # Ties are zero-sized tensors sharing an offset; the name keeps the order deterministic.
    tensors.sort(key=lambda t: (t.start, t.end, t.name))

    cursor = data_start
    for info in tensors:
        if info.start != cursor:
            kind = "overlaps the previous tensor" if info.start < cursor else "leaves a hole"
            raise _fail(
                shard,
                f"tensor {_q(info.name)} at data_offsets [{info.start - data_start}, "
                f"{info.end - data_start}] {kind} (expected begin {cursor - data_start})",
            )
        cursor = info.end
    data_size = cursor - data_start

    if file_size is not None and cursor != file_size:
        if cursor > file_size:
            raise _fail(
                shard, f"data section ends at byte {cursor}, past the file ({file_size} bytes)"
            )
        raise _fail(
            shard,
            f"{file_size - cursor} trailing bytes after the last tensor "
            f"(data ends at byte {cursor}, file is {file_size} bytes)",
        )
    return Header(
        shard=shard,
        header_size=len(header),
        data_start=data_start,
        data_size=data_size,
        tensors=tuple(tensors),
        metadata=MappingProxyType(metadata),
    )


def check_index(weight_map: Mapping[str, str], headers: Mapping[str, Header]) -> None:
    """Check that an index's ``weight_map`` and the shard headers describe the same tensors.

    ``headers`` maps every shard path the ``weight_map`` names to its parsed header. A
    tensor must sit in exactly one shard, and that shard must be the one the index names:
    a loader trusting either side alone would otherwise load the wrong bytes or miss some.
    """
    owner: dict[str, str] = {}
    for shard, header in headers.items():
        for info in header.tensors:
            name = info.name
            first = owner.get(name)
            if first is not None:
                raise _fail(shard, f"tensor {_q(name)} is also in shard {first}")
            owner[name] = shard
            listed = weight_map.get(name)
            if listed is None:
                raise _fail(shard, f"tensor {_q(name)} is missing from the index weight_map")
            if listed != shard:
                raise _fail(shard, f"tensor {_q(name)} is here but the index puts it in {listed}")
    for name, shard in weight_map.items():
        if shard not in headers:
            raise HeaderError(f"{shard}: no header given for this shard (index names {_q(name)})")
        if name not in owner:
            raise _fail(shard, f"tensor {_q(name)} listed in the index is not in this shard")
