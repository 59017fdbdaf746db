"""Table-driven tests for the pure manifest layer: names, strict JSON, selection, ordering."""

from __future__ import annotations

import json
import logging
from types import MappingProxyType

import pytest

from shardsync.errors import ManifestError, UnsafeNameError
from shardsync.manifest import (
    DEFAULT_INCLUDE,
    MAX_JSON_BYTES,
    IndexInfo,
    Listing,
    Manifest,
    ManifestEntry,
    RemoteFile,
    build_manifest,
    likely_shards,
    parse_hub_revision,
    parse_hub_tree,
    parse_index,
    select_weights,
    validate_name,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHA_A = "a" * 64
SHA_B = "b" * 64
BLOB = "c" * 40


def rf(path: str, size: int | None = 10, sha256: str | None = None) -> RemoteFile:
    return RemoteFile(path, size, sha256)


def listing(*paths: str, exhaustive: bool = True) -> Listing:
    return Listing(COMMIT, tuple(rf(p) for p in paths), exhaustive)


def index_bytes(weight_map: dict[str, str], **extra: object) -> bytes:
    return json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map, **extra}).encode()


# --- validate_name ------------------------------------------------------------------------

HOSTILE_NAMES = [
    ("empty", ""),
    ("dotdot", ".."),
    ("dot", "."),
    ("dotdot-inside", "a/../b"),
    ("dotdot-end", "a/.."),
    ("absolute", "/etc/passwd"),
    ("drive-backslash", "C:\\x"),
    ("drive-relative", "C:x"),
    ("drive-later-component", "a/C:x"),
    ("drive-like-later-component", "a/b:c"),
    ("unc", "\\\\srv\\share"),
    ("double-slash-unc", "//srv/share"),
    ("backslash", "a\\b"),
    ("pct-dotdot", "%2e%2e/x"),
    ("pct-slash", "a%2fb"),
    ("pct-nul", "a%00"),
    ("pct-plain", "100%"),
    ("nul", "x\x00"),
    ("newline", "a\nb"),
    ("tab", "a\tb"),
    ("del", "a\x7fb"),
    ("question", "a?b"),
    ("hash", "a#b"),
    ("empty-component", "a//b"),
    ("dot-component", "./a"),
    ("dot-inner", "a/./b"),
    ("trailing-slash", "a/"),
    ("long-component", "x" * 300),
    ("long-component-multibyte", "é" * 128),
    ("long-total", "/".join(["x" * 200] * 6)),
    ("non-nfc", "cafe\u0301.json"),
    ("dot-git", ".git/config"),
    ("dot-git-nested", "a/.git/HEAD"),
    ("dot-git-case", ".GIT/config"),
    ("lone-surrogate", "a\udc80"),
]


@pytest.mark.parametrize("name", [n for _, n in HOSTILE_NAMES], ids=[i for i, _ in HOSTILE_NAMES])
def test_validate_name_refuses(name: str) -> None:
    with pytest.raises(UnsafeNameError) as info:
        validate_name(name)
    assert repr(name) in str(info.value)


SAFE_NAMES = [
    ("plain", "model.safetensors"),
    ("nested", "sub/dir/config.json"),
    ("dotfile", ".gitattributes"),
    ("dots-in-name", "a..b/c...d"),
    ("git-like", "x.git/y"),
    ("nfc-unicode", "caf\u00e9.json"),
    ("max-component", "x" * 255),
    ("spaces", "my file (1).json"),
]


@pytest.mark.parametrize("name", [n for _, n in SAFE_NAMES], ids=[i for i, _ in SAFE_NAMES])
def test_validate_name_accepts(name: str) -> None:
    assert validate_name(name) is name


def test_validate_name_refuses_non_string() -> None:
    with pytest.raises(UnsafeNameError):
        validate_name(b"model.safetensors")  # type: ignore[arg-type]


# --- value classes validate themselves ----------------------------------------------------

BAD_REMOTE_FILES = [
    ("negative-size", {"path": "a", "size": -1, "sha256": None}, ManifestError),
    ("bool-size", {"path": "a", "size": True, "sha256": None}, ManifestError),
    ("float-size", {"path": "a", "size": 1.0, "sha256": None}, ManifestError),
    ("short-sha", {"path": "a", "size": 1, "sha256": "ab"}, ManifestError),
    ("non-hex-sha", {"path": "a", "size": 1, "sha256": "g" * 64}, ManifestError),
    ("bad-blob", {"path": "a", "size": 1, "sha256": None, "blob_id": "x" * 40}, ManifestError),
    ("hostile-path", {"path": "../a", "size": 1, "sha256": None}, UnsafeNameError),
    ("bytes-version", {"path": "a", "size": 1, "sha256": None, "version": b'"e"'}, ManifestError),
]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [(k, e) for _, k, e in BAD_REMOTE_FILES],
    ids=[i for i, _, _ in BAD_REMOTE_FILES],
)
def test_remote_file_validates(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        RemoteFile(**kwargs)  # type: ignore[arg-type]


def test_a_listed_version_travels_to_the_fetch_list_and_is_no_part_of_equality() -> None:
    """The ETag a listing saw is a note for the job that listed (its cache check), not part
    of the file: a plan and a job that saw the object at different moments agree on it."""
    remote = RemoteFile("a", 1, None, version='"e1"')
    assert ManifestEntry.from_remote(remote, "extra").version == '"e1"'
    assert remote == RemoteFile("a", 1, None, version='"e2"') == RemoteFile("a", 1, None)
    assert ManifestEntry.from_remote(remote, "extra") == ManifestEntry("a", 1, None, None, "extra")


def test_remote_file_normalises_hex_case() -> None:
    remote = RemoteFile("a", 1, "A" * 64, "B" * 40)
    assert (remote.sha256, remote.blob_id) == ("a" * 64, "b" * 40)


@pytest.mark.parametrize("commit", ["abc", "g" * 40, "0" * 41], ids=["short", "non-hex", "long"])
def test_listing_rejects_bad_commit(commit: str) -> None:
    with pytest.raises(ManifestError, match="commit"):
        Listing(commit, ())


def test_listing_rejects_duplicate_paths() -> None:
    with pytest.raises(ManifestError, match="more than once"):
        Listing(COMMIT, (rf("a.json"), rf("a.json", 5)))


# --- parse_index --------------------------------------------------------------------------


def test_parse_index_orders_shards_by_first_appearance() -> None:
    data = (
        b'{"metadata": {"total_size": 3}, "weight_map": {'
        b'"z.weight": "model-00002-of-00003.safetensors",'
        b'"a.weight": "model-00003-of-00003.safetensors",'
        b'"m.weight": "model-00002-of-00003.safetensors",'
        b'"b.weight": "model-00001-of-00003.safetensors"}}'
    )
    info = parse_index(data, path="model.safetensors.index.json")
    assert info.shards == (
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model-00001-of-00003.safetensors",
    )
    assert list(info.weight_map) == ["z.weight", "a.weight", "m.weight", "b.weight"]
    assert info.format == "safetensors"
    assert info.metadata == {"total_size": 3}
    assert isinstance(info.weight_map, MappingProxyType)
    with pytest.raises(TypeError):
        info.weight_map["x"] = "y"  # type: ignore[index]


def test_parse_index_resolves_subfolder() -> None:
    data = index_bytes({"w": "diffusion_pytorch_model-00001-of-00001.safetensors"})
    info = parse_index(data, path="unet/diffusion_pytorch_model.safetensors.index.json")
    assert info.shards == ("unet/diffusion_pytorch_model-00001-of-00001.safetensors",)
    assert info.weight_map == {"w": "unet/diffusion_pytorch_model-00001-of-00001.safetensors"}


def test_parse_index_pickle_format() -> None:
    info = parse_index(
        index_bytes({"w": "pytorch_model-00001-of-00001.bin"}), path="pytorch_model.bin.index.json"
    )
    assert info.format == "pickle"
    assert info.shards == ("pytorch_model-00001-of-00001.bin",)


def test_parse_index_without_metadata() -> None:
    info = parse_index(b'{"weight_map": {"w": "a.safetensors"}}', path="m.safetensors.index.json")
    assert info.metadata == {}


BAD_INDEXES: list[tuple[str, bytes, str, type[Exception], str]] = [
    (
        "dup-top-level",
        b'{"weight_map": {"w": "a.safetensors"}, "weight_map": {"w": "b.safetensors"}}',
        "model.safetensors.index.json",
        ManifestError,
        "duplicate JSON key 'weight_map'",
    ),
    (
        "dup-in-weight-map",
        b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}',
        "model.safetensors.index.json",
        ManifestError,
        "duplicate JSON key 'w'",
    ),
    (
        "dup-in-metadata",
        b'{"metadata": {"k": 1, "k": 2}, "weight_map": {"w": "a.safetensors"}}',
        "model.safetensors.index.json",
        ManifestError,
        "duplicate JSON key 'k'",
    ),
    (
        "top-level-array",
        b'[{"weight_map": {}}]',
        "model.safetensors.index.json",
        ManifestError,
        "must be a JSON object",
    ),
    (
        "top-level-string",
        b'"x"',
        "model.safetensors.index.json",
        ManifestError,
        "must be a JSON object",
    ),
    (
        "no-weight-map",
        b'{"metadata": {}}',
        "model.safetensors.index.json",
        ManifestError,
        "weight_map",
    ),
    (
        "weight-map-array",
        b'{"weight_map": ["a.safetensors"]}',
        "model.safetensors.index.json",
        ManifestError,
        "weight_map",
    ),
    (
        "empty-weight-map",
        b'{"weight_map": {}}',
        "model.safetensors.index.json",
        ManifestError,
        "empty",
    ),
    (
        "non-string-value",
        b'{"weight_map": {"w": 3}}',
        "model.safetensors.index.json",
        ManifestError,
        "weight_map['w'] must be a string",
    ),
    (
        "metadata-not-object",
        b'{"metadata": [1], "weight_map": {"w": "a.safetensors"}}',
        "model.safetensors.index.json",
        ManifestError,
        "metadata",
    ),
    (
        "hostile-shard",
        b'{"weight_map": {"w": "../../etc/passwd.safetensors"}}',
        "model.safetensors.index.json",
        UnsafeNameError,
        "../../etc/passwd.safetensors",
    ),
    (
        "pct-shard",
        b'{"weight_map": {"w": "%2e%2e/a.safetensors"}}',
        "model.safetensors.index.json",
        UnsafeNameError,
        "%2e%2e",
    ),
    (
        "absolute-shard-wrong-ext",
        b'{"weight_map": {"w": "/etc/passwd"}}',
        "model.safetensors.index.json",
        UnsafeNameError,
        "/etc/passwd",
    ),
    (
        "resolved-too-long",
        json.dumps({"weight_map": {"w": "/".join(["x" * 200] * 4) + ".safetensors"}}).encode(),
        "/".join(["d" * 200] * 2) + "/model.safetensors.index.json",
        UnsafeNameError,
        "1024",
    ),
    (
        "pickle-shard-in-safetensors-index",
        b'{"weight_map": {"w": "pytorch_model.bin"}}',
        "model.safetensors.index.json",
        ManifestError,
        "not a .safetensors file",
    ),
    (
        "safetensors-shard-in-pickle-index",
        b'{"weight_map": {"w": "model.safetensors"}}',
        "pytorch_model.bin.index.json",
        ManifestError,
        "not a .bin file",
    ),
    (
        "unknown-index-name",
        b'{"weight_map": {"w": "a.safetensors"}}',
        "model.index.json",
        ManifestError,
        "not a",
    ),
    (
        "hostile-index-path",
        b'{"weight_map": {"w": "a.safetensors"}}',
        "../model.safetensors.index.json",
        UnsafeNameError,
        "..",
    ),
    (
        "invalid-utf8",
        b'{"weight_map": {"w\xff": "a.safetensors"}}',
        "model.safetensors.index.json",
        ManifestError,
        "UTF-8",
    ),
    (
        "bom",
        b'\xef\xbb\xbf{"weight_map": {"w": "a.safetensors"}}',
        "model.safetensors.index.json",
        ManifestError,
        "not valid JSON",
    ),
    (
        "truncated",
        b'{"weight_map": {"w": "a.safe',
        "model.safetensors.index.json",
        ManifestError,
        "not valid JSON",
    ),
    (
        "nan",
        b'{"metadata": {"total_size": NaN}, "weight_map": {"w": "a.safetensors"}}',
        "model.safetensors.index.json",
        ManifestError,
        "NaN",
    ),
    (
        "deep-nesting",
        b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b', "weight_map": {}}',
        "model.safetensors.index.json",
        ManifestError,
        "nested too deeply",
    ),
]


@pytest.mark.parametrize(
    ("data", "path", "error", "message"),
    [case[1:] for case in BAD_INDEXES],
    ids=[case[0] for case in BAD_INDEXES],
)
def test_parse_index_rejects(data: bytes, path: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        parse_index(data, path=path)
    assert message in str(info.value)
    if error is ManifestError:
        assert path in str(info.value)


def test_parse_index_rejects_oversized_payload_before_decoding() -> None:
    # Invalid UTF-8 would be reported if the size check came second.
    with pytest.raises(ManifestError, match="limit"):
        parse_index(b"\xff" * (MAX_JSON_BYTES + 1), path="model.safetensors.index.json")


def test_parse_index_checks_names_before_extension() -> None:
    # A hostile name is an UnsafeNameError even though its extension is also wrong.
    with pytest.raises(UnsafeNameError):
        parse_index(b'{"weight_map": {"w": "a\\\\b"}}', path="model.safetensors.index.json")


# --- select_weights -----------------------------------------------------------------------

SELECTIONS = [
    (
        "index-beats-single",
        ["model.safetensors", "model.safetensors.index.json", "config.json"],
        False,
        "model.safetensors.index.json",
    ),
    (
        "index-beats-consolidated",
        ["consolidated.safetensors", "model.safetensors.index.json"],
        False,
        "model.safetensors.index.json",
    ),
    ("single", ["config.json", "model.safetensors"], False, "model.safetensors"),
    (
        "single-beats-other-index",
        ["model.safetensors", "model.fp16.safetensors.index.json"],
        False,
        "model.safetensors",
    ),
    (
        "lone-consolidated",
        ["consolidated.safetensors", "params.json"],
        False,
        "consolidated.safetensors",
    ),
    (
        "lone-other-index",
        ["weights.safetensors.index.json", "weights-1.safetensors", "weights-2.safetensors"],
        False,
        "weights.safetensors.index.json",
    ),
    (
        "safetensors-beats-pickle",
        ["pytorch_model.bin", "model.safetensors"],
        True,
        "model.safetensors",
    ),
    (
        "pickle-index-allowed",
        ["pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model-1.bin"],
        True,
        "pytorch_model.bin.index.json",
    ),
    ("pickle-single-allowed", ["pytorch_model.bin"], True, "pytorch_model.bin"),
    (
        "subfolder-safetensors-ignored",
        ["sub/model.safetensors", "model.safetensors"],
        False,
        "model.safetensors",
    ),
]


@pytest.mark.parametrize(
    ("paths", "allow_pickle", "expected"),
    [case[1:] for case in SELECTIONS],
    ids=[case[0] for case in SELECTIONS],
)
def test_select_weights(paths: list[str], allow_pickle: bool, expected: str) -> None:
    assert select_weights(listing(*paths), allow_pickle=allow_pickle).path == expected


REFUSED_SELECTIONS = [
    ("pickle-only", ["pytorch_model.bin", "config.json"], "allow_pickle=True"),
    ("pickle-index-only", ["pytorch_model.bin.index.json"], "pickle"),
    ("nothing", ["config.json", "README.md"], "no weights"),
    ("empty", [], "no weights"),
    ("only-in-subfolder", ["sub/model.safetensors"], "no weights"),
    ("ambiguous", ["b.safetensors", "a.safetensors"], "a.safetensors, b.safetensors"),
    ("other-formats", ["model.gguf", "tf_model.h5", "flax_model.msgpack"], "no weights"),
]


@pytest.mark.parametrize(
    ("paths", "message"),
    [case[1:] for case in REFUSED_SELECTIONS],
    ids=[case[0] for case in REFUSED_SELECTIONS],
)
def test_select_weights_refuses(paths: list[str], message: str) -> None:
    with pytest.raises(ManifestError) as info:
        select_weights(listing(*paths))
    assert message in str(info.value)


# --- build_manifest -----------------------------------------------------------------------

REPO_FILES = (
    RemoteFile("model.safetensors.index.json", 100, None, BLOB),
    RemoteFile("model-00002-of-00002.safetensors", 2000, SHA_B),
    RemoteFile("model-00001-of-00002.safetensors", 1000, SHA_A),
    RemoteFile("config.json", 5, None),
    RemoteFile("tokenizer.json", 6, None),
    RemoteFile("tokenizer.model", 7, None),
    RemoteFile("special_tokens_map.json", 8, None),
    RemoteFile("chat_template.jinja", 9, None),
    RemoteFile("README.md", 10, None),
    RemoteFile("merges.txt", 11, None),
    RemoteFile("sub/config.json", 12, None),
    RemoteFile("consolidated.safetensors", 3000, SHA_A),
    RemoteFile("pytorch_model.bin", 3000, SHA_A),
    RemoteFile("original/consolidated.00.pth", 3000, SHA_A),
    RemoteFile("model.gguf", 3000, SHA_A),
    RemoteFile("onnx/model.onnx", 3000, SHA_A),
    RemoteFile("tf_model.h5", 3000, SHA_A),
    RemoteFile("flax_model.msgpack", 3000, SHA_A),
    RemoteFile("ckpt/model.ckpt", 3000, SHA_A),
    RemoteFile("training.pt", 3000, SHA_A),
)
REPO = Listing(COMMIT, REPO_FILES)
INDEX = parse_index(
    index_bytes(
        {
            "b": "model-00002-of-00002.safetensors",
            "a": "model-00001-of-00002.safetensors",
        }
    ),
    path="model.safetensors.index.json",
)
INDEX_FILE = REPO_FILES[0]


def test_build_manifest_order_and_metadata() -> None:
    manifest = build_manifest(REPO, INDEX, INDEX_FILE)
    assert [(e.path, e.role) for e in manifest.entries] == [
        ("model.safetensors.index.json", "index"),
        ("model-00002-of-00002.safetensors", "shard"),
        ("model-00001-of-00002.safetensors", "shard"),
        ("README.md", "extra"),
        ("chat_template.jinja", "extra"),
        ("config.json", "extra"),
        ("merges.txt", "extra"),
        ("special_tokens_map.json", "extra"),
        ("sub/config.json", "extra"),
        ("tokenizer.json", "extra"),
        ("tokenizer.model", "extra"),
    ]
    assert manifest.commit == COMMIT
    assert manifest.index == ManifestEntry("model.safetensors.index.json", 100, None, BLOB, "index")
    assert manifest.entry("model-00001-of-00002.safetensors").sha256 == SHA_A
    assert [e.path for e in manifest.shards] == list(INDEX.shards)
    assert len(manifest.extras) == 8
    assert manifest.total_size == 100 + 2000 + 1000 + sum(range(5, 13))
    assert dict(manifest.weight_map) == dict(INDEX.weight_map)
    with pytest.raises(KeyError):
        manifest.entry("nope.json")


def test_default_include_has_no_weight_formats() -> None:
    manifest = build_manifest(REPO, INDEX, INDEX_FILE)
    weight_suffixes = (".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".gguf", ".ckpt")
    for entry in manifest.extras:
        assert not entry.path.endswith((*weight_suffixes, ".safetensors")), entry.path
    assert "*.json" in DEFAULT_INCLUDE


FILTERS: list[tuple[str, list[str] | None, list[str], list[str]]] = [
    ("include-basename-glob", ["config.json"], [], ["config.json", "sub/config.json"]),
    ("include-full-path-glob", ["sub/*"], [], ["sub/config.json"]),
    ("include-nothing", [], [], []),
    (
        "exclude-basename",
        None,
        ["*.md", "tokenizer*"],
        [
            "chat_template.jinja",
            "config.json",
            "merges.txt",
            "special_tokens_map.json",
            "sub/config.json",
        ],
    ),
    (
        "exclude-full-path",
        None,
        ["sub/*"],
        [
            "README.md",
            "chat_template.jinja",
            "config.json",
            "merges.txt",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer.model",
        ],
    ),
    (
        "exclude-wins-over-include",
        ["*.json"],
        ["config.json"],
        [
            "special_tokens_map.json",
            "tokenizer.json",
        ],
    ),
    ("include-everything-but-weights-kept", ["*.gguf"], ["*"], []),
    (
        "explicit-other-weights",
        ["*.gguf", "original/*"],
        [],
        [
            "model.gguf",
            "original/consolidated.00.pth",
        ],
    ),
    ("case-sensitive", ["*.MD"], [], []),
]


@pytest.mark.parametrize(
    ("include", "exclude", "extras"),
    [case[1:] for case in FILTERS],
    ids=[case[0] for case in FILTERS],
)
def test_build_manifest_include_exclude(
    include: list[str] | None, exclude: list[str], extras: list[str]
) -> None:
    manifest = build_manifest(REPO, INDEX, INDEX_FILE, include=include, exclude=exclude)
    assert [e.path for e in manifest.extras] == extras
    # The weights are fetched whatever the filters say.
    assert [e.path for e in manifest.entries[:3]] == [INDEX.path, *INDEX.shards]


def test_build_manifest_refuses_string_globs() -> None:
    with pytest.raises(TypeError):
        build_manifest(REPO, INDEX, INDEX_FILE, include="*.json")
    with pytest.raises(TypeError):
        build_manifest(REPO, INDEX, INDEX_FILE, exclude="*.json")


def test_build_manifest_single_file() -> None:
    repo = Listing(
        COMMIT,
        (RemoteFile("model.safetensors", 42, SHA_A), rf("config.json", 3), rf("model.bin", 9)),
    )
    weights = select_weights(repo)
    manifest = build_manifest(repo, None, weights)
    assert [(e.path, e.role) for e in manifest.entries] == [
        ("model.safetensors", "shard"),
        ("config.json", "extra"),
    ]
    assert manifest.index is None
    assert manifest.weight_map == {}
    assert manifest.total_size == 45


def test_build_manifest_missing_shard() -> None:
    repo = Listing(COMMIT, tuple(f for f in REPO_FILES if not f.path.startswith("model-00001")))
    with pytest.raises(ManifestError, match=r"'model-00001-of-00002\.safetensors'"):
        build_manifest(repo, INDEX, INDEX_FILE)


def test_build_manifest_non_exhaustive_listing() -> None:
    index_file = RemoteFile("model.safetensors.index.json", None, None)
    repo = Listing(None, (index_file,), exhaustive=False)
    manifest = build_manifest(repo, INDEX, index_file)
    assert [(e.path, e.size, e.sha256) for e in manifest.entries] == [
        ("model.safetensors.index.json", None, None),
        ("model-00002-of-00002.safetensors", None, None),
        ("model-00001-of-00002.safetensors", None, None),
    ]
    assert manifest.commit is None
    assert manifest.total_size is None


def test_build_manifest_non_exhaustive_uses_known_entries() -> None:
    index_file = RemoteFile("model.safetensors.index.json", 100, None)
    repo = Listing(None, (index_file, rf("model-00002-of-00002.safetensors", 7)), exhaustive=False)
    manifest = build_manifest(repo, INDEX, index_file)
    assert [e.size for e in manifest.shards] == [7, None]


def test_build_manifest_subfolder_index() -> None:
    info = parse_index(
        index_bytes({"w": "m-1.safetensors", "v": "m-2.safetensors"}),
        path="unet/m.safetensors.index.json",
    )
    repo = listing(
        "unet/m.safetensors.index.json",
        "unet/m-1.safetensors",
        "unet/m-2.safetensors",
        "m-1.safetensors",
        "unet/config.json",
    )
    manifest = build_manifest(repo, info, repo.files[0])
    assert [e.path for e in manifest.entries] == [
        "unet/m.safetensors.index.json",
        "unet/m-1.safetensors",
        "unet/m-2.safetensors",
        "unet/config.json",
    ]


BAD_BUILDS = [
    (
        "weights-not-listed",
        lambda: build_manifest(listing("config.json"), None, rf("model.safetensors")),
        "not in the origin's listing",
    ),
    (
        "index-mismatch",
        lambda: build_manifest(REPO, INDEX, rf("consolidated.safetensors")),
        "not the chosen weights",
    ),
    ("index-without-info", lambda: build_manifest(REPO, None, INDEX_FILE), "is an index"),
]


@pytest.mark.parametrize(
    ("call", "message"), [c[1:] for c in BAD_BUILDS], ids=[c[0] for c in BAD_BUILDS]
)
def test_build_manifest_refuses(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(ManifestError, match=message):
        call()


def test_manifest_rejects_file_directory_clash() -> None:
    repo = listing("model.safetensors", "config.json", "config.json/x.json")
    with pytest.raises(ManifestError, match="both a file and a directory"):
        build_manifest(repo, None, repo.files[0])


MANIFEST_INVARIANTS = [
    ("no-weights", (ManifestEntry("a.json", 1, None, None, "extra"),), "no weights"),
    (
        "extra-before-shard",
        (
            ManifestEntry("a.json", 1, None, None, "extra"),
            ManifestEntry("m.safetensors", 1, None, None, "shard"),
        ),
        "at most one index",
    ),
    (
        "two-indexes",
        (
            ManifestEntry("a.safetensors.index.json", 1, None, None, "index"),
            ManifestEntry("b.safetensors.index.json", 1, None, None, "index"),
            ManifestEntry("m.safetensors", 1, None, None, "shard"),
        ),
        "at most one index",
    ),
    (
        "duplicate",
        (
            ManifestEntry("m.safetensors", 1, None, None, "shard"),
            ManifestEntry("m.safetensors", 1, None, None, "shard"),
        ),
        "more than once",
    ),
]


@pytest.mark.parametrize(
    ("entries", "message"),
    [c[1:] for c in MANIFEST_INVARIANTS],
    ids=[c[0] for c in MANIFEST_INVARIANTS],
)
def test_manifest_invariants(entries: tuple[ManifestEntry, ...], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest(COMMIT, entries, {})


def test_manifest_weight_map_must_point_at_shards() -> None:
    entries = (ManifestEntry("m.safetensors", 1, None, None, "shard"),)
    with pytest.raises(ManifestError, match="not a shard"):
        Manifest(COMMIT, entries, {"w": "other.safetensors"})


def test_manifest_entry_rejects_unknown_role() -> None:
    with pytest.raises(ManifestError, match="role"):
        ManifestEntry("a", 1, None, None, "bogus")  # type: ignore[arg-type]


def test_frozen_values_are_hashable_and_immutable() -> None:
    manifest = build_manifest(REPO, INDEX, INDEX_FILE)
    assert hash(manifest) == hash(build_manifest(REPO, INDEX, INDEX_FILE))
    assert isinstance(hash(INDEX), int)
    with pytest.raises(AttributeError):
        manifest.commit = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        manifest.weight_map["x"] = "y"  # type: ignore[index]


# --- Hub payloads -------------------------------------------------------------------------


def hub_revision(*siblings: dict[str, object], sha: object = COMMIT) -> bytes:
    return json.dumps({"id": "org/name", "sha": sha, "siblings": list(siblings)}).encode()


def test_parse_hub_revision() -> None:
    payload = hub_revision(
        {"rfilename": "config.json", "size": 5, "blobId": BLOB},
        {
            "rfilename": "model.safetensors",
            "size": 42,
            "blobId": "d" * 40,
            "lfs": {"sha256": SHA_A.upper(), "size": 42, "pointerSize": 134},
        },
        {"rfilename": "old.safetensors", "lfs": {"oid": SHA_B, "size": 9}},
        {"rfilename": "bare.txt"},
    )
    result = parse_hub_revision(payload)
    assert result == Listing(
        COMMIT,
        (
            RemoteFile("config.json", 5, None, BLOB),
            RemoteFile("model.safetensors", 42, SHA_A, "d" * 40),
            RemoteFile("old.safetensors", 9, SHA_B, None),
            RemoteFile("bare.txt", None, None, None),
        ),
        exhaustive=True,
    )


BAD_REVISIONS = [
    ("not-object", b"[]", ManifestError, "JSON object"),
    ("no-sha", json.dumps({"siblings": []}).encode(), ManifestError, "commit"),
    ("short-sha", hub_revision(sha="abc"), ManifestError, "commit"),
    ("int-sha", hub_revision(sha=1), ManifestError, "commit"),
    ("no-siblings", json.dumps({"sha": COMMIT}).encode(), ManifestError, "siblings"),
    (
        "sibling-not-object",
        json.dumps({"sha": COMMIT, "siblings": ["a"]}).encode(),
        ManifestError,
        "sibling",
    ),
    ("no-rfilename", hub_revision({"size": 1}), ManifestError, "rfilename"),
    ("negative-size", hub_revision({"rfilename": "a", "size": -1}), ManifestError, "size"),
    ("string-size", hub_revision({"rfilename": "a", "size": "1"}), ManifestError, "size"),
    ("huge-size", hub_revision({"rfilename": "a", "size": 2**63}), ManifestError, "size"),
    (
        "bad-lfs-sha",
        hub_revision({"rfilename": "a", "lfs": {"sha256": "zz"}}),
        ManifestError,
        "sha256",
    ),
    (
        "lfs-without-hash",
        hub_revision({"rfilename": "a", "lfs": {"size": 1}}),
        ManifestError,
        "'lfs' has no",
    ),
    ("lfs-not-object", hub_revision({"rfilename": "a", "lfs": "x"}), ManifestError, "lfs"),
    (
        "size-disagrees",
        hub_revision({"rfilename": "a", "size": 1, "lfs": {"sha256": SHA_A, "size": 2}}),
        ManifestError,
        "disagrees",
    ),
    ("bad-blob-id", hub_revision({"rfilename": "a", "blobId": 5}), ManifestError, "blobId"),
    (
        "duplicate-sibling",
        hub_revision({"rfilename": "a"}, {"rfilename": "a"}),
        ManifestError,
        "more than once",
    ),
    (
        "duplicate-key",
        b'{"sha": "' + COMMIT.encode() + b'", "sha": "' + COMMIT.encode() + b'", "siblings": []}',
        ManifestError,
        "duplicate JSON key 'sha'",
    ),
    ("oversized", b" " * (MAX_JSON_BYTES + 1), ManifestError, "limit"),
]


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [c[1:] for c in BAD_REVISIONS],
    ids=[c[0] for c in BAD_REVISIONS],
)
def test_parse_hub_revision_rejects(payload: bytes, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        parse_hub_revision(payload)
    assert message in str(info.value)


def test_parse_hub_tree() -> None:
    payload = json.dumps(
        [
            {"type": "directory", "oid": BLOB, "size": 0, "path": "sub"},
            {"type": "file", "oid": BLOB, "size": 5, "path": "sub/config.json"},
            {
                "type": "file",
                "oid": "e" * 40,
                "size": 42,
                "path": "model.safetensors",
                "lfs": {"oid": SHA_A, "size": 42, "pointerSize": 134},
                "xetHash": "f" * 64,
            },
        ]
    ).encode()
    assert parse_hub_tree(payload) == (
        RemoteFile("sub/config.json", 5, None, BLOB),
        RemoteFile("model.safetensors", 42, SHA_A, "e" * 40),
    )


UNSAFE_LISTED = ["../../.ssh/id_rsa", "%2e%2e/x", "a/../../b", "a\u0000b", "Re\u0301sume\u0301.png"]


@pytest.mark.parametrize("name", UNSAFE_LISTED, ids=ascii)
def test_hub_listing_entries_with_unsafe_names_are_left_out(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """One stray file must not refuse a repo; its name never becomes a path or URL, and a
    warning names it, escaped."""
    kept = {"rfilename": "config.json", "size": 5, "blobId": BLOB}
    revision = parse_hub_revision(hub_revision(kept, {"rfilename": name, "size": 1}))
    assert revision.files == (RemoteFile("config.json", 5, None, BLOB),)
    tree = [
        {"type": "file", "oid": BLOB, "size": 5, "path": "config.json"},
        {"type": "file", "size": 1, "path": name},
    ]
    assert parse_hub_tree(json.dumps(tree).encode()) == (RemoteFile("config.json", 5, None, BLOB),)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(ascii(name) in w for w in warnings)


BAD_TREES = [
    ("not-array", b"{}", ManifestError, "JSON array"),
    ("entry-not-object", b"[1]", ManifestError, "entry"),
    (
        "unknown-type",
        json.dumps([{"type": "submodule", "path": "x"}]).encode(),
        ManifestError,
        "submodule",
    ),
    (
        "bad-oid",
        json.dumps([{"type": "file", "path": "a", "oid": "x"}]).encode(),
        ManifestError,
        "blob id",
    ),
    (
        "bad-lfs-oid",
        json.dumps([{"type": "file", "path": "a", "lfs": {"oid": "x" * 64, "size": 1}}]).encode(),
        ManifestError,
        "sha256",
    ),
    ("invalid-utf8", b'[{"type": "file", "path": "\xc3"}]', ManifestError, "UTF-8"),
]


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [c[1:] for c in BAD_TREES],
    ids=[c[0] for c in BAD_TREES],
)
def test_parse_hub_tree_rejects(payload: bytes, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        parse_hub_tree(payload)
    assert message in str(info.value)


def test_hub_listing_to_manifest_end_to_end() -> None:
    repo = parse_hub_revision(
        hub_revision(
            {"rfilename": "config.json", "size": 5, "blobId": BLOB},
            {"rfilename": "model.safetensors.index.json", "size": 100, "blobId": BLOB},
            {
                "rfilename": "model-00001-of-00002.safetensors",
                "size": 10,
                "lfs": {"sha256": SHA_A, "size": 10},
            },
            {
                "rfilename": "model-00002-of-00002.safetensors",
                "size": 20,
                "lfs": {"sha256": SHA_B, "size": 20},
            },
        )
    )
    weights = select_weights(repo)
    assert isinstance(INDEX, IndexInfo)
    manifest = build_manifest(repo, INDEX, weights)
    assert [(e.path, e.sha256) for e in manifest.shards] == [
        ("model-00002-of-00002.safetensors", SHA_B),
        ("model-00001-of-00002.safetensors", SHA_A),
    ]
    assert manifest.total_size == 135


def test_huge_integer_literal_is_a_manifest_error() -> None:
    payload = (
        b'{"metadata": {"total_size": ' + b"9" * 5000 + b'}, "weight_map": {"a": "m.safetensors"}}'
    )
    with pytest.raises(ManifestError, match="usable JSON"):
        parse_index(payload, path="model.safetensors.index.json")


def test_likely_shards_are_the_index_s_siblings_named_like_its_shards() -> None:
    names = [
        "model.safetensors.index.json",
        "model-00002-of-00002.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors",  # another format's single file
        "model-00001-of-00002.bin",  # the pickle shards
        "other-00001-of-00002.safetensors",
        "sub/model-00001-of-00002.safetensors",  # another folder
        "model-00001-of-00002.safetensors.bak",
        "tokenizer.json",
    ]
    listing = Listing("a" * 40, tuple(RemoteFile(n, 1, None) for n in names))
    index = RemoteFile("model.safetensors.index.json", 1, None)
    assert [f.path for f in likely_shards(listing, index)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    nested = RemoteFile("sub/model.safetensors.index.json", 1, None)
    assert [f.path for f in likely_shards(listing, nested)] == [
        "sub/model-00001-of-00002.safetensors"
    ]
    single = RemoteFile("model.safetensors", 1, None)
    assert likely_shards(listing, single) == ()
