"""Property-based fuzzing of the parsers that read bytes from the network.

Two kinds of property, so that neither a parser that crashes nor one that rejects everything
passes: whatever the input, each parser returns a value *that satisfies its invariants* or
raises its own error class, never another exception; and valid input generated here (headers,
indexes, Hub answers, names) is accepted and parses back to what was generated (round trips).
CI runs a short profile; for a long run:

    HYPOTHESIS_PROFILE=long pytest tests/fuzz -q
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import PurePosixPath

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardsync.errors import HeaderError, ManifestError, UnsafeNameError
from shardsync.manifest import IndexInfo, parse_hub_revision, parse_index, validate_name
from shardsync.safetensors_header import DTYPE_SIZES, Header, header_length, parse_header

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


def assert_header_invariants(parsed: Header, raw_size: int, file_size: int | None) -> None:
    """What a loader relies on: tensors tile the data area in order, each inside the file."""
    assert parsed.data_start == 8 + raw_size
    position = parsed.data_start
    for info in parsed.tensors:
        assert info.start == position and info.end >= info.start
        assert info.nbytes == info.numel * DTYPE_SIZES[info.dtype]
        assert parsed.tensor(info.name) is info
        position = info.end
    assert position == parsed.data_start + parsed.data_size
    assert len(set(parsed.names)) == len(parsed.names)
    if file_size is not None:
        assert parsed.file_size == file_size


@given(st.binary(max_size=512))
def test_header_bytes_never_crash(data: bytes) -> None:
    try:
        parsed = parse_header(data, shard="s.safetensors", file_size=None)
    except HeaderError:
        return
    assert_header_invariants(parsed, len(data), None)


@given(st.binary(min_size=8, max_size=16), st.one_of(st.none(), st.integers(0, 2**64)))
def test_header_length_never_crashes(prefix: bytes, file_size: int | None) -> None:
    try:
        n = header_length(prefix, shard="s.safetensors", file_size=file_size)
    except HeaderError:
        return
    assert 0 < n <= 100_000_000
    assert n == struct.unpack("<Q", prefix[:8])[0]  # the length the prefix says, never another
    assert file_size is None or 8 + n <= file_size


@given(st.integers(2, 100_000_000), st.integers(0, 1 << 40), st.binary(max_size=8))
def test_a_valid_length_prefix_is_accepted(n: int, extra: int, tail: bytes) -> None:
    prefix = struct.pack("<Q", n) + tail
    assert header_length(prefix, shard="s.safetensors", file_size=8 + n + extra) == n


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=6), st.integers(0, 4096))
def test_json_shaped_headers_never_crash(header: dict[str, object], file_size: int) -> None:
    raw = json.dumps(header).encode()
    try:
        parsed = parse_header(raw, shard="s.safetensors", file_size=8 + len(raw) + file_size)
    except HeaderError:
        return
    assert_header_invariants(parsed, len(raw), 8 + len(raw) + file_size)
    assert set(parsed.names) <= set(header) - {"__metadata__"}


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
    assert_header_invariants(parsed, len(raw), 8 + len(raw) + offset)
    assert {t.name for t in parsed.tensors} == set(header)
    assert parsed.data_size == offset
    for info in parsed.tensors:
        entry = header[info.name]
        assert isinstance(entry, dict)
        assert list(info.shape) == entry["shape"] and info.dtype == entry["dtype"]
        assert info.start == 8 + len(raw) + entry["data_offsets"][0]


def assert_index_invariants(info: IndexInfo) -> None:
    assert info.weight_map and set(info.shards) == set(info.weight_map.values())
    assert len(set(info.shards)) == len(info.shards)
    for shard in info.shards:
        assert validate_name(shard) == shard and shard.endswith(".safetensors")


@given(st.binary(max_size=512))
def test_index_bytes_never_crash(data: bytes) -> None:
    try:
        info = parse_index(data, path="model.safetensors.index.json")
    except ManifestError:
        return
    assert_index_invariants(info)


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_json_shaped_indexes_never_crash(index: dict[str, object]) -> None:
    try:
        info = parse_index(json.dumps(index).encode(), path="model.safetensors.index.json")
    except ManifestError:
        return
    assert_index_invariants(info)


segments = st.text(
    st.characters(min_codepoint=48, max_codepoint=122, categories=["Ll", "Lu", "Nd"]),
    min_size=1,
    max_size=8,
)
safe_names = st.lists(segments, min_size=1, max_size=3).map("/".join)


@given(
    st.dictionaries(st.text(min_size=1, max_size=12), safe_names, min_size=1, max_size=8),
    st.sampled_from(["", "sub", "a/b"]),
    st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=6), max_size=3),
)
def test_a_valid_index_round_trips(
    tensors: dict[str, str], directory: str, metadata: dict[str, object]
) -> None:
    weight_map = {name: f"{shard}.safetensors" for name, shard in tensors.items()}
    prefix = f"{directory}/" if directory else ""
    path = prefix + "model.safetensors.index.json"
    data = json.dumps({"metadata": metadata, "weight_map": weight_map}).encode()
    info = parse_index(data, path=path)
    assert_index_invariants(info)
    assert dict(info.weight_map) == {n: prefix + s for n, s in weight_map.items()}
    assert dict(info.metadata) == metadata and info.format == "safetensors"
    assert list(info.shards) == list(dict.fromkeys(prefix + s for s in weight_map.values()))


@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_hub_answers_never_crash(answer: dict[str, object]) -> None:
    try:
        listing = parse_hub_revision(json.dumps(answer).encode())
    except ManifestError:
        return
    assert listing.commit == str(answer["sha"]).lower()
    assert len({f.path for f in listing.files}) == len(listing.files)


@given(
    st.text("0123456789abcdef", min_size=40, max_size=40),
    st.dictionaries(
        safe_names,
        st.tuples(
            st.integers(0, 1 << 40),
            st.text("0123456789abcdef", min_size=40, max_size=40),
            st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
        ),
        max_size=8,
    ),
)
def test_a_valid_hub_answer_round_trips(
    commit: str, files: dict[str, tuple[int, str, str | None]]
) -> None:
    siblings: list[dict[str, object]] = []
    for name, (size, blob_id, sha256) in files.items():
        sibling: dict[str, object] = {"rfilename": name, "size": size, "blobId": blob_id}
        if sha256 is not None:
            sibling["lfs"] = {"sha256": sha256, "size": size, "pointerSize": 134}
        siblings.append(sibling)
    listing = parse_hub_revision(json.dumps({"sha": commit, "siblings": siblings}).encode())
    assert listing.commit == commit
    got = {f.path: (f.size, f.blob_id, f.sha256) for f in listing.files}
    assert got == files


@given(safe_names)
def test_valid_names_are_accepted_unchanged(name: str) -> None:
    assert validate_name(name) == name


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
        parsed = parse_header(data[8 : 8 + n], shard="s.safetensors", file_size=len(data))
    except HeaderError:
        return
    assert n == len(body)
    assert_header_invariants(parsed, n, len(data))
