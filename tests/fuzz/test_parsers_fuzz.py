"""Property-based fuzzing of the parsers that read bytes from the network.

Whatever the input, each parser returns a value or raises its own error class, never
another exception. CI runs a short profile; for a long run:

    HYPOTHESIS_PROFILE=long pytest tests/fuzz -q
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import PurePosixPath

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardsync.errors import HeaderError, ManifestError, UnsafeNameError
from shardsync.manifest import parse_hub_revision, parse_index, validate_name
from shardsync.safetensors_header import DTYPE_SIZES, header_length, parse_header

settings.register_profile(
    "ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=20_000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@given(st.binary(max_size=512))
def test_header_bytes_never_crash(data: bytes) -> None:
    with contextlib.suppress(HeaderError):
        parse_header(data, shard="s.safetensors", file_size=None)


@given(st.binary(min_size=8, max_size=16), st.one_of(st.none(), st.integers(0, 2**64)))
def test_header_length_never_crashes(prefix: bytes, file_size: int | None) -> None:
    try:
        n = header_length(prefix, shard="s.safetensors", file_size=file_size)
    except HeaderError:
        return
    assert 0 < n <= 100_000_000


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=6), st.integers(0, 4096))
def test_json_shaped_headers_never_crash(header: dict[str, object], file_size: int) -> None:
    raw = json.dumps(header).encode()
    with contextlib.suppress(HeaderError):
        parse_header(raw, shard="s.safetensors", file_size=8 + len(raw) + file_size)


tensors = st.lists(
    st.tuples(
        st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=12),
        st.sampled_from(sorted(DTYPE_SIZES)),
        st.lists(st.integers(0, 5), max_size=3),
    ),
    max_size=8,
    unique_by=lambda t: t[0],
)


@given(tensors)
def test_valid_headers_round_trip(entries: list[tuple[str, str, list[int]]]) -> None:
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in entries:
        if name == "__metadata__":
            continue
        nbytes = DTYPE_SIZES[dtype]
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    parsed = parse_header(raw, shard="s.safetensors", file_size=8 + len(raw) + offset)
    assert {t.name for t in parsed.tensors} == set(header)
    assert parsed.data_size == offset
    for info in parsed.tensors:
        entry = header[info.name]
        assert isinstance(entry, dict)
        assert list(info.shape) == entry["shape"] and info.dtype == entry["dtype"]
        assert info.start == 8 + len(raw) + entry["data_offsets"][0]


@given(st.binary(max_size=512))
def test_index_bytes_never_crash(data: bytes) -> None:
    with contextlib.suppress(ManifestError):
        parse_index(data, path="model.safetensors.index.json")


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_json_shaped_indexes_never_crash(index: dict[str, object]) -> None:
    with contextlib.suppress(ManifestError):
        parse_index(json.dumps(index).encode(), path="model.safetensors.index.json")


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_hub_answers_never_crash(answer: dict[str, object]) -> None:
    with contextlib.suppress(ManifestError):
        parse_hub_revision(json.dumps(answer).encode())


@given(st.text(max_size=64))
def test_accepted_names_never_leave_the_directory(name: str) -> None:
    try:
        accepted = validate_name(name)
    except UnsafeNameError:
        return
    parts = PurePosixPath(accepted).parts
    assert parts and ".." not in parts and not PurePosixPath(accepted).is_absolute()
    assert "\\" not in accepted and "%" not in accepted and "\x00" not in accepted


@given(st.binary(max_size=64))
def test_length_prefixed_garbage(body: bytes) -> None:
    data = struct.pack("<Q", len(body)) + body
    try:
        n = header_length(data, shard="s.safetensors", file_size=len(data))
        parse_header(data[8 : 8 + n], shard="s.safetensors", file_size=len(data))
    except HeaderError:
        pass
