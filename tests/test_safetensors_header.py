"""Table-driven tests for the pure safetensors header parser.

Headers are built with json + struct so each case names exactly one defect. Valid
cases are also handed to the real safetensors reader, so we never accept a file it
refuses; the reverse is deliberate only where the reference reader is lenient about
hostile input (duplicate keys, unknown entry keys, empty names, names with NUL).
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

from shardsync.errors import HeaderError, ManifestError
from shardsync.safetensors_header import (
    DTYPE_BITS,
    DTYPE_SIZES,
    MAX_HEADER_SIZE,
    Header,
    TensorInfo,
    check_index,
    check_start,
    header_length,
    parse_header,
)

SHARD = "sub/model-00001-of-00002.safetensors"


def ent(dtype: object, shape: list[object], begin: object, end: object) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def u8(begin: int, end: int) -> dict[str, object]:
    """A U8 vector exactly filling ``[begin, end)``."""
    return ent("U8", [end - begin], begin, end)


def encode(header: Mapping[str, object] | bytes) -> bytes:
    return header if isinstance(header, bytes) else json.dumps(header).encode()


def parse(header: Mapping[str, object] | bytes, data_len: int | None) -> Header:
    """Parse with ``file_size = 8 + N + data_len`` (no file size when ``data_len`` is None)."""
    raw = encode(header)
    size = None if data_len is None else 8 + len(raw) + data_len
    return parse_header(raw, shard=SHARD, file_size=size)


def file_bytes(header: Mapping[str, object] | bytes, data_len: int) -> bytes:
    raw = encode(header)
    return (
        struct.pack("<Q", len(raw))
        + raw
        + bytes(range(256)) * (data_len // 256)
        + bytes(range(data_len % 256))
    )


# --- valid headers --------------------------------------------------------------------------


def all_dtypes() -> tuple[dict[str, object], list[tuple[str, int, int]]]:
    """One 8-element tensor per dtype (8 elements of ``b`` bits are ``b`` bytes), and its layout."""
    header: dict[str, object] = {}
    layout = []
    offset = 0
    for dtype, bits in DTYPE_BITS.items():
        header[f"t_{dtype}"] = ent(dtype, [8], offset, offset + bits)
        layout.append((f"t_{dtype}", offset, offset + bits))
        offset += bits
    return header, layout


ALL_DTYPES_HEADER, ALL_DTYPES_LAYOUT = all_dtypes()
ALL_DTYPES_LEN = sum(DTYPE_BITS.values())

VALID: list[tuple[str, Mapping[str, object] | bytes, int | None, list[tuple[str, int, int]]]] = [
    ("empty", {}, 0, []),
    ("empty-no-file-size", {}, None, []),
    ("metadata-only", {"__metadata__": {"format": "pt"}}, 0, []),
    ("metadata-null", {"__metadata__": None}, 0, []),
    ("one", {"a": ent("F32", [2, 3], 0, 24)}, 24, [("a", 0, 24)]),
    ("scalar", {"s": ent("F64", [], 0, 8)}, 8, [("s", 0, 8)]),
    (
        "sorted-by-offset",
        {"c": u8(5, 9), "a": u8(0, 2), "b": u8(2, 5)},
        9,
        [("a", 0, 2), ("b", 2, 5), ("c", 5, 9)],
    ),
    (
        "zero-sized-everywhere",
        {
            "z2": ent("F16", [0, 4], 0, 0),
            "z1": ent("F32", [3, 0], 0, 0),
            "a": u8(0, 1),
            "mid": ent("I64", [0], 1, 1),
            "b": u8(1, 3),
            "end": ent("BOOL", [0], 3, 3),
        },
        3,
        [("z1", 0, 0), ("z2", 0, 0), ("a", 0, 1), ("mid", 1, 1), ("b", 1, 3), ("end", 3, 3)],
    ),
    ("zero-dim-and-huge-dim", {"z": ent("F32", [0, 2**62], 0, 0)}, 0, [("z", 0, 0)]),
    ("no-file-size", {"a": u8(0, 7)}, None, [("a", 0, 7)]),
    ("unicode-name", {"模型.权重": u8(0, 1)}, 1, [("模型.权重", 0, 1)]),
    ("f4-packed", {"q": ent("F4", [2, 3], 0, 3)}, 3, [("q", 0, 3)]),
    (
        "f6-packed",
        {"q": ent("F6_E2M3", [4], 0, 3), "r": ent("F6_E3M2", [4], 3, 6)},
        6,
        [("q", 0, 3), ("r", 3, 6)],
    ),
    ("e8m0", {"s": ent("F8_E8M0", [5], 0, 5)}, 5, [("s", 0, 5)]),
    (
        "space-padded",
        json.dumps({"a": u8(0, 1)}).encode() + b"      ",
        1,
        [("a", 0, 1)],
    ),
    (
        "json-whitespace-around",
        b" \n\t" + json.dumps({"a": u8(0, 1)}).encode() + b"\r\n \t",
        1,
        [("a", 0, 1)],
    ),
    ("all-dtypes", ALL_DTYPES_HEADER, ALL_DTYPES_LEN, ALL_DTYPES_LAYOUT),
]


@pytest.mark.parametrize(
    ("header", "data_len", "expected"), [c[1:] for c in VALID], ids=[c[0] for c in VALID]
)
def test_valid_header(
    header: Mapping[str, object] | bytes,
    data_len: int | None,
    expected: list[tuple[str, int, int]],
) -> None:
    raw = encode(header)
    parsed = parse(header, data_len)
    assert parsed.shard == SHARD
    assert parsed.header_size == len(raw)
    assert parsed.data_start == 8 + len(raw)
    if data_len is not None:
        assert parsed.data_size == data_len
        assert parsed.file_size == 8 + len(raw) + data_len
    got = [(t.name, t.start - parsed.data_start, t.end - parsed.data_start) for t in parsed.tensors]
    assert got == expected
    for info in parsed.tensors:
        assert info.shard == SHARD
        assert parsed.tensor(info.name) is info


@pytest.mark.parametrize(
    ("header", "data_len"),
    [c[1:3] for c in VALID if c[2] is not None],
    ids=[c[0] for c in VALID if c[2] is not None],
)
def test_valid_header_agrees_with_safetensors(
    tmp_path: Path, header: Mapping[str, object] | bytes, data_len: int
) -> None:
    """Whatever we accept, the reference reader accepts with the same names, dtypes, shapes."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(file_bytes(header, data_len))
    parsed = parse(header, data_len)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert sorted(f.keys()) == sorted(parsed.names)
        for info in parsed.tensors:
            view = f.get_slice(info.name)
            assert view.get_dtype() == info.dtype
            assert tuple(view.get_shape()) == info.shape
        assert dict(f.metadata() or {}) == dict(parsed.metadata)


def test_all_dtypes_sizes() -> None:
    parsed = parse(ALL_DTYPES_HEADER, ALL_DTYPES_LEN)
    for info in parsed.tensors:
        assert info.nbytes == DTYPE_BITS[info.dtype]  # 8 elements
        assert info.numel == 8
    expected = {
        "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
        "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
        "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1, "C64": 8,
    }  # fmt: skip
    assert dict(DTYPE_SIZES) == expected
    assert {k: v for k, v in DTYPE_BITS.items() if k not in DTYPE_SIZES} == {
        "F4": 4,
        "F6_E2M3": 6,
        "F6_E3M2": 6,
    }


def test_dtype_list_matches_installed_safetensors(tmp_path: Path) -> None:
    """A dtype the reference reader knows and we do not would refuse loadable checkpoints."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(file_bytes({"a": ent("NO_SUCH_DTYPE", [1], 0, 1)}, 1))
    with pytest.raises(safetensors.SafetensorError) as info:
        safetensors.safe_open(str(path), framework="np")
    listed = re.search(r"expected one of (.*?) at line", str(info.value))
    if listed is None:
        pytest.skip(f"this safetensors does not list its dtypes: {info.value}")
    assert set(re.findall(r"`([A-Z0-9_]+)`", listed.group(1))) == set(DTYPE_BITS)


# --- invalid headers ------------------------------------------------------------------------

GOOD_A = json.dumps({"a": u8(0, 1)}).encode()

INVALID: list[tuple[str, Mapping[str, object] | bytes, int | None, str]] = [
    # encoding and JSON syntax
    ("bad-utf8", b'{"\xff": {}}', None, "not valid UTF-8"),
    ("truncated-json", b'{"a": {"dtype": "U8"', None, "not valid JSON"),
    ("trailing-garbage", GOOD_A + b"  x", 1, "not valid JSON: Extra data"),
    ("nul-padding", GOOD_A + b"\x00\x00", 1, "not valid JSON: Extra data"),
    ("two-objects", GOOD_A + GOOD_A, 1, "not valid JSON: Extra data"),
    (
        "nan",
        b'{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}',
        1,
        "NaN is not valid JSON",
    ),
    ("infinity", b'{"__metadata__": {"k": Infinity}}', 0, "Infinity is not valid JSON"),
    (
        "negative-zero",  # safetensors reads -0 as a float and refuses the file
        b'{"a": {"dtype": "U8", "shape": [-0], "data_offsets": [-0, 0]}}',
        0,
        "-0",
    ),
    (
        "int-too-many-digits",
        b'{"a": {"dtype": "U8", "shape": [' + b"9" * 5000 + b"]}}",
        None,
        "not usable JSON",
    ),
    (
        "nested-too-deeply",
        b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        None,
        "nested too deeply",
    ),
    ("top-array", b"[]", 0, "must be a JSON object, got list"),
    ("top-string", b'"{}"', 0, "must be a JSON object, got str"),
    ("top-null", b"null", 0, "must be a JSON object, got NoneType"),
    # duplicate keys, at every level
    (
        "dup-tensor",
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
        b'"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}',
        4,
        "duplicate JSON key 'a'",
    ),
    (
        "dup-entry-key",
        b'{"a": {"dtype": "F32", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
        1,
        "duplicate JSON key 'dtype'",
    ),
    (
        "dup-metadata",
        b'{"__metadata__": {}, "__metadata__": {"k": "v"}}',
        0,
        "duplicate JSON key '__metadata__'",
    ),
    ("dup-in-metadata", b'{"__metadata__": {"k": "v", "k": "w"}}', 0, "duplicate JSON key 'k'"),
    # __metadata__
    ("metadata-list", {"__metadata__": ["k", "v"]}, 0, "__metadata__ must be an object, got list"),
    ("metadata-string", {"__metadata__": "pt"}, 0, "__metadata__ must be an object, got str"),
    (
        "metadata-int-value",
        {"__metadata__": {"k": 1}},
        0,
        "__metadata__['k'] must be a string, got int",
    ),
    (
        "metadata-null-value",
        {"__metadata__": {"k": None}},
        0,
        "__metadata__['k'] must be a string, got NoneType",
    ),
    (
        "metadata-nested",
        {"__metadata__": {"k": {"x": "y"}}},
        0,
        "__metadata__['k'] must be a string, got dict",
    ),
    ("metadata-lone-surrogate", b'{"__metadata__": {"k": "\\udc80"}}', 0, "not valid Unicode"),
    # names
    ("empty-name", {"": u8(0, 1)}, 1, "empty tensor name"),
    ("nul-in-name", {"a\x00b": u8(0, 1)}, 1, "tensor 'a\\x00b': name contains NUL"),
    (
        "lone-surrogate-name",
        b'{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
        1,
        "tensor name '\\ud800' is not valid Unicode",
    ),
    # entry structure
    ("entry-list", {"a": [0, 1]}, 1, "tensor 'a': entry must be an object, got list"),
    ("entry-null", {"a": None}, 1, "tensor 'a': entry must be an object, got NoneType"),
    ("missing-offsets", {"a": {"dtype": "U8", "shape": [1]}}, 1, "missing 'data_offsets'"),
    ("missing-all", {"a": {}}, 1, "missing 'data_offsets', missing 'dtype', missing 'shape'"),
    ("extra-key", {"a": {**u8(0, 1), "offsets": [0, 1]}}, 1, "tensor 'a': unknown key 'offsets'"),
    # dtype
    ("unknown-dtype", {"a": ent("I4", [2], 0, 1)}, 1, "tensor 'a': unknown dtype 'I4'"),
    ("lowercase-dtype", {"a": ent("f32", [1], 0, 4)}, 4, "unknown dtype 'f32'"),
    ("torch-dtype-name", {"a": ent("float32", [1], 0, 4)}, 4, "unknown dtype 'float32'"),
    ("dtype-int", {"a": {**u8(0, 1), "dtype": 4}}, 1, "dtype must be a string, got int"),
    # shape
    ("shape-int", {"a": {**u8(0, 1), "shape": 1}}, 1, "shape must be a list, got int"),
    ("shape-null", {"a": {**u8(0, 1), "shape": None}}, 1, "shape must be a list, got NoneType"),
    ("shape-negative", {"a": ent("U8", [-1], 0, 1)}, 1, "shape entry -1 is not a non-negative"),
    ("shape-negative-pair", {"a": ent("U8", [-1, -1], 0, 1)}, 1, "shape entry -1"),
    ("shape-float", {"a": ent("U8", [1.0], 0, 1)}, 1, "shape entry 1.0 is not"),
    ("shape-bool", {"a": ent("U8", [True], 0, 1)}, 1, "shape entry True is not"),
    ("shape-string", {"a": ent("U8", ["1"], 0, 1)}, 1, "shape entry '1' is not"),
    ("shape-nested", {"a": ent("U8", [[1]], 0, 1)}, 1, "shape entry list is not"),
    ("shape-product-overflow", {"a": ent("U8", [2**32, 2**32], 0, 1)}, 1, "shape overflow"),
    ("shape-product-exactly-2**63", {"a": ent("U8", [2] * 63, 0, 1)}, 1, "shape overflow"),
    ("shape-dim-2**63", {"a": ent("U8", [2**63], 0, 1)}, 1, "shape overflow"),
    ("shape-dim-2**64-with-zero", {"a": ent("U8", [0, 2**64], 0, 0)}, 0, "shape overflow"),
    ("shape-giant-int", {"a": ent("U8", [10**4000, 10**4000], 0, 1)}, 1, "shape overflow"),
    # data_offsets
    (
        "offsets-string",
        {"a": {**u8(0, 1), "data_offsets": "0,1"}},
        1,
        "data_offsets must be a list, got '0,1'",
    ),
    ("offsets-one", {"a": {**u8(0, 1), "data_offsets": [1]}}, 1, "must hold 2 ints, got 1"),
    ("offsets-three", {"a": {**u8(0, 1), "data_offsets": [0, 1, 2]}}, 1, "got 3 items"),
    ("offsets-negative", {"a": ent("U8", [1], -1, 0)}, 1, "data_offsets [-1, 0] are not ints"),
    ("offsets-bool", {"a": ent("U8", [1], False, True)}, 1, "[False, True] are not ints"),
    ("offsets-float", {"a": {**u8(0, 1), "data_offsets": [0.0, 1.0]}}, 1, "[0.0, 1.0] are not"),
    ("offsets-null", {"a": {**u8(0, 1), "data_offsets": [None, 1]}}, 1, "[None, 1] are not"),
    ("offsets-2**63", {"a": ent("U8", [0], 2**63, 2**63)}, None, "are not ints in [0, 2**63)"),
    ("offsets-2**64", {"a": ent("U8", [1], 2**64 - 1, 2**64)}, None, "are not ints in"),
    ("offsets-reversed", {"a": ent("U8", [0], 4, 0)}, 4, "data_offsets begin 4 is after end 0"),
    # shape * dtype against the byte range
    (
        "size-too-small",
        {"a": ent("F32", [2], 0, 4)},
        4,
        "tensor 'a': F32 (2,) needs 8 bytes but data_offsets [0, 4] hold 4",
    ),
    ("size-too-large", {"a": ent("U8", [2], 0, 3)}, 3, "needs 2 bytes but"),
    ("scalar-empty-range", {"a": ent("F32", [], 0, 0)}, 0, "needs 4 bytes but"),
    ("zero-size-with-bytes", {"a": ent("F32", [0], 0, 4)}, 4, "needs 0 bytes but"),
    ("f4-odd", {"a": ent("F4", [3], 0, 2)}, 2, "3 elements of F4 are 12 bits, not whole bytes"),
    ("f6-two", {"a": ent("F6_E3M2", [2], 0, 2)}, 2, "12 bits, not whole bytes"),
    (
        "long-shape-message",
        {"a": ent("U8", [1] * 1000, 0, 2)},
        2,
        "U8 of 1000 dimensions needs 1 bytes",
    ),
    # layout: overlaps, holes, the end of the file
    ("overlap", {"a": u8(0, 4), "b": u8(2, 6)}, 6, "tensor 'b' at data_offsets [2, 6] overlaps"),
    ("same-range", {"a": u8(0, 4), "b": u8(0, 4)}, 4, "tensor 'b' at data_offsets [0, 4] overlaps"),
    (
        "zero-size-inside",
        {"a": u8(0, 4), "z": ent("U8", [0], 2, 2)},
        4,
        "tensor 'z' at data_offsets [2, 2] overlaps",
    ),
    ("contained", {"a": u8(0, 8), "b": u8(2, 4), "c": u8(8, 9)}, 9, "'b' at data_offsets [2, 4]"),
    ("hole-at-start", {"a": u8(1, 2)}, 2, "tensor 'a' at data_offsets [1, 2] leaves a hole"),
    (
        "hole-in-middle",
        {"a": u8(0, 1), "b": u8(2, 3)},
        3,
        "'b' at data_offsets [2, 3] leaves a hole",
    ),
    (
        "zero-size-past-end",
        {"a": u8(0, 1), "z": ent("U8", [0], 5, 5)},
        1,
        "'z' at data_offsets [5, 5]",
    ),
    ("data-past-file", {"a": u8(0, 4)}, 2, "data section ends at byte"),
    ("trailing-bytes", {"a": u8(0, 4)}, 6, "2 trailing bytes after the last tensor"),
    ("empty-with-trailing", {}, 1, "1 trailing bytes"),
    ("header-past-file", {"a": u8(0, 1)}, -3, "header ends at byte"),
]


@pytest.mark.parametrize(
    ("header", "data_len", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_header(
    header: Mapping[str, object] | bytes, data_len: int | None, message: str
) -> None:
    with pytest.raises(HeaderError) as info:
        parse(header, data_len)
    text = str(info.value)
    assert text.startswith(f"{SHARD}: ")
    assert message in text
    assert len(text) < 600, "messages stay short whatever the input"


def test_header_error_is_a_manifest_error() -> None:
    assert issubclass(HeaderError, ManifestError)


def test_hostile_long_name_is_clipped_in_messages() -> None:
    name = "x" * 1_000_000
    with pytest.raises(HeaderError, match=r"\.\.\. \(1000002 characters\): unknown dtype") as info:
        parse({name: ent("ZZ", [1], 0, 1)}, 1)
    assert len(str(info.value)) < 400


def test_errors_are_chained_from_the_decoder() -> None:
    with pytest.raises(HeaderError) as info:
        parse(b"{", None)
    causes = []
    cause = info.value.__cause__
    while cause is not None:
        causes.append(cause)
        cause = cause.__cause__
    assert any(isinstance(c, json.JSONDecodeError) for c in causes)


# --- header_length --------------------------------------------------------------------------


def prefix(n: int) -> bytes:
    return struct.pack("<Q", n)


@pytest.mark.parametrize(
    ("data", "file_size", "max_header", "expected"),
    [
        (prefix(2), None, MAX_HEADER_SIZE, 2),
        (prefix(2), 10, MAX_HEADER_SIZE, 2),
        (prefix(1000) + b"{...rest of the file", None, MAX_HEADER_SIZE, 1000),
        (prefix(MAX_HEADER_SIZE), None, MAX_HEADER_SIZE, MAX_HEADER_SIZE),
        (prefix(10), 18, 10, 10),
    ],
    ids=["min", "min-fills-file", "longer-prefix", "at-cap", "custom-cap-exact-file"],
)
def test_header_length_ok(
    data: bytes, file_size: int | None, max_header: int, expected: int
) -> None:
    got = header_length(data, shard=SHARD, file_size=file_size, max_header=max_header)
    assert got == expected


@pytest.mark.parametrize(
    ("data", "file_size", "max_header", "message"),
    [
        (b"", None, MAX_HEADER_SIZE, "need the first 8 bytes for the header length, got 0"),
        (prefix(16)[:7], None, MAX_HEADER_SIZE, "got 7"),
        (prefix(0), None, MAX_HEADER_SIZE, "header length 0 is too small"),
        (prefix(1), None, MAX_HEADER_SIZE, "header length 1 is too small"),
        (prefix(MAX_HEADER_SIZE + 1), None, MAX_HEADER_SIZE, "over the 100000000 byte limit"),
        (prefix(2**63), None, MAX_HEADER_SIZE, f"header length {2**63} is over"),
        (prefix(2**64 - 1), 2**70, MAX_HEADER_SIZE, f"header length {2**64 - 1} is over"),
        (prefix(11), None, 10, "header length 11 is over the 10 byte limit"),
        (prefix(100), 107, MAX_HEADER_SIZE, "header length 100 is larger than the file (107"),
        (prefix(2), 5, MAX_HEADER_SIZE, "larger than the file (5 bytes)"),
        (prefix(2), 0, MAX_HEADER_SIZE, "larger than the file (0 bytes)"),
    ],
    ids=[
        "empty-prefix",
        "short-prefix",
        "zero",
        "one",
        "over-cap",
        "2**63",
        "2**64-1",
        "custom-cap",
        "larger-than-file",
        "file-shorter-than-prefix",
        "empty-file",
    ],
)
def test_header_length_rejects(
    data: bytes, file_size: int | None, max_header: int, message: str
) -> None:
    with pytest.raises(HeaderError) as info:
        header_length(data, shard=SHARD, file_size=file_size, max_header=max_header)
    assert str(info.value).startswith(f"{SHARD}: ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("start", "file_size"),
    [
        (b"<!DOCTYPE html><html>", 4096),  # a login page
        (b'{"error": "AccessDenied"}', 25),  # a JSON error body
        (b"version https://git-lfs", 131),  # an LFS pointer left by a failed pull
        (prefix(2) + b"[]", 10),  # a header that is JSON, not an object
        (prefix(2) + b" {", 10),
        (prefix(20) + b"{", 27),  # a header longer than the file
        (prefix(2)[:7], 7),  # shorter than a length
        (prefix(2), 8),  # nothing after the length
    ],
    ids=["html", "json-error", "lfs-pointer", "array", "space", "past-end", "7-bytes", "8-bytes"],
)
def test_check_start_refuses_what_cannot_be_a_shard(start: bytes, file_size: int) -> None:
    with pytest.raises(HeaderError):
        check_start(start[:9], shard=SHARD, file_size=file_size)


@pytest.mark.parametrize(
    ("start", "file_size"), [(prefix(2) + b"{", 10), (prefix(96) + b"{", 1 << 20)]
)
def test_check_start_takes_what_starts_as_a_shard(start: bytes, file_size: int) -> None:
    check_start(start, shard=SHARD, file_size=file_size)


# --- real files -----------------------------------------------------------------------------


def read_header(path: Path, shard: str) -> Header:
    """What the fetcher does with two Range requests, done on a local file."""
    data = path.read_bytes()
    n = header_length(data[:8], shard=shard, file_size=len(data))
    return parse_header(data[8 : 8 + n], shard=shard, file_size=len(data))


def test_real_torch_file_agrees_with_safe_open(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed.weight": torch.randn(7, 5, generator=gen),
        "model.norm.weight": torch.randn(5, generator=gen).to(torch.float16),
        "model.layers.0.bf16": torch.randn(3, 3, generator=gen).to(torch.bfloat16),
        "model.layers.0.f64": torch.randn(2, generator=gen).to(torch.float64),
        "ids": torch.arange(11, dtype=torch.int64),
        "i32": torch.arange(-3, 3, dtype=torch.int32),
        "i16": torch.arange(5, dtype=torch.int16),
        "i8": torch.arange(-4, 3, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.randn(6, generator=gen).to(torch.float8_e4m3fn),
        "fp8b": torch.randn(4, generator=gen).to(torch.float8_e5m2),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt", "note": "ünï"})
    header = read_header(path, "model.safetensors")
    data = path.read_bytes()

    assert header.file_size == len(data)
    assert dict(header.metadata) == {"format": "pt", "note": "ünï"}
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(header.names) == sorted(tensors)
        for info in header.tensors:
            view = f.get_slice(info.name)
            assert view.get_dtype() == info.dtype
            assert tuple(view.get_shape()) == info.shape
            loaded = f.get_tensor(info.name)
            assert info.numel == loaded.numel()
            raw = loaded.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert info.nbytes == len(raw)
            assert data[info.start : info.end] == raw, info.name
    # The data section is tiled exactly, in offset order.
    ends = [header.data_start] + [t.end for t in header.tensors]
    assert [t.start for t in header.tensors] == ends[:-1]


def test_real_numpy_file_agrees_with_safe_open(tmp_path: Path) -> None:
    arrays = {
        "c64": np.arange(4, dtype=np.complex64),
        "u16": np.arange(5, dtype=np.uint16),
        "u32": np.arange(3, dtype=np.uint32),
        "u64": np.arange(2, dtype=np.uint64),
        "f32": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4),
    }
    path = tmp_path / "model-00002-of-00002.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    header = read_header(path, "model-00002-of-00002.safetensors")
    data = path.read_bytes()
    with safetensors.safe_open(str(path), framework="np") as f:
        for info in header.tensors:
            loaded = f.get_tensor(info.name)
            assert info.shape == loaded.shape
            assert data[info.start : info.end] == np.ascontiguousarray(loaded).tobytes()


def test_header_value_api() -> None:
    header = parse({"__metadata__": {"k": "v"}, "b": ent("F16", [2, 2], 4, 12), "a": u8(0, 4)}, 12)
    assert header.names == ("a", "b")
    b = header.tensor("b")
    assert b == TensorInfo("b", "F16", (2, 2), header.data_start + 4, header.data_start + 12, SHARD)
    assert (b.nbytes, b.numel) == (8, 4)
    with pytest.raises(KeyError):
        header.tensor("missing")
    with pytest.raises(TypeError):
        header.metadata["k"] = "w"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        header.data_size = 0  # type: ignore[misc]
    again = parse({"__metadata__": {"k": "v"}, "a": u8(0, 4), "b": ent("F16", [2, 2], 4, 12)}, 12)
    assert again == header
    assert hash(again) == hash(header)
    assert "_by_name" not in repr(header)


def test_many_tiny_entries() -> None:
    n = 200_000
    header = {f"model.layers.{i}.w": ent("BF16", [2], 4 * i, 4 * i + 4) for i in range(n)}
    parsed = parse(header, 4 * n)
    assert len(parsed.tensors) == n
    assert parsed.data_size == 4 * n
    assert parsed.tensor("model.layers.123456.w").start == parsed.data_start + 4 * 123456


# --- check_index ----------------------------------------------------------------------------


def shard_header(shard: str, *names: str) -> Header:
    header = {name: u8(i, i + 1) for i, name in enumerate(names)}
    raw = encode(header)
    return parse_header(raw, shard=shard, file_size=8 + len(raw) + len(names))


S1 = "model-00001-of-00002.safetensors"
S2 = "model-00002-of-00002.safetensors"


def test_check_index_ok() -> None:
    headers = {
        S1: shard_header(S1, "a", "b"),
        S2: shard_header(S2, "c"),
        "x.safetensors": shard_header("x.safetensors"),
    }
    weight_map = {"a": S1, "b": S1, "c": S2}
    assert check_index(weight_map, headers) is None
    # the same headers refuse any map that puts one tensor elsewhere: the acceptance above
    # is a verdict on this map, not a check that accepts everything
    for name in weight_map:
        for shard in (S1, S2, "x.safetensors"):
            if shard != weight_map[name]:
                with pytest.raises(HeaderError, match=name):
                    check_index({**weight_map, name: shard}, headers)


@pytest.mark.parametrize(
    ("weight_map", "headers", "message"),
    [
        (
            {"a": S1},
            {S1: shard_header(S1, "a", "b")},
            f"{S1}: tensor 'b' is missing from the index weight_map",
        ),
        (
            {"a": S1, "b": S1},
            {S1: shard_header(S1, "a"), S2: shard_header(S2, "b")},
            f"{S2}: tensor 'b' is here but the index puts it in {S1}",
        ),
        (
            {"a": S1, "b": S2},
            {S1: shard_header(S1, "a"), S2: shard_header(S2, "b", "a")},
            f"{S2}: tensor 'a' is also in shard {S1}",
        ),
        (
            {"a": S1, "b": S1},
            {S1: shard_header(S1, "a")},
            f"{S1}: tensor 'b' listed in the index is not in this shard",
        ),
        (
            {"a": S1, "b": S2},
            {S1: shard_header(S1, "a")},
            f"{S2}: no header given for this shard (index names 'b')",
        ),
    ],
    ids=[
        "missing-from-index",
        "listed-in-another-shard",
        "in-two-shards",
        "listed-but-absent",
        "no-header-for-shard",
    ],
)
def test_check_index_rejects(
    weight_map: dict[str, str], headers: dict[str, Header], message: str
) -> None:
    with pytest.raises(HeaderError) as info:
        check_index(weight_map, headers)
    assert str(info.value) == message


def test_negative_zero_is_what_safetensors_refuses_too(tmp_path: Path) -> None:
    """``-0`` is refused because the reference reader refuses it (a float to serde), while
    Python's json reads the int 0: a file one reader loads and the other does not."""
    raw = b'{"a": {"dtype": "U8", "shape": [-0], "data_offsets": [-0, 0]}}'
    path = tmp_path / "zero.safetensors"
    path.write_bytes(file_bytes(raw, 0))
    with pytest.raises(Exception, match="-0"):
        safetensors.torch.load_file(path)
    with pytest.raises(HeaderError):
        parse(raw, 0)
