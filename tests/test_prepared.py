"""``Prepared``: what a daemon answers to ``POST /v1/prepare``, read like any bytes from outside."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from shardsync.errors import DaemonError, HeaderError
from shardsync.manifest import Manifest, ManifestEntry
from shardsync.prepared import Prepared

SHA = "ab" * 32
INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _prepared() -> Prepared:
    manifest = Manifest(
        commit="c" * 40,
        entries=(
            ManifestEntry(INDEX, 300, None, "d" * 40, "index"),
            *(ManifestEntry(s, 1000 + i, SHA, None, "shard") for i, s in enumerate(SHARDS)),
            ManifestEntry("config.json", 10, None, "e" * 40, "extra"),
        ),
        weight_map={"a.weight": SHARDS[0], "b.weight": SHARDS[1]},
    )
    return Prepared(manifest, {s: b'{"a":1}' for s in SHARDS})


def test_round_trip() -> None:
    prepared = _prepared()
    again = Prepared.from_json(prepared.to_json())
    assert again == prepared
    assert dict(again.headers) == dict(prepared.headers)
    assert dict(again.manifest.weight_map) == dict(prepared.manifest.weight_map)


def _broken(change: str) -> Any:
    answer = copy.deepcopy(_prepared().to_json())
    if change == "not an object":
        return [answer]
    if change == "a field more":
        answer["extra"] = 1
    elif change == "a field less":
        del answer["weight_map"]
    elif change == "a path out of the snapshot":
        answer["entries"][1]["path"] = "../../etc/passwd"
    elif change == "a size that is text":
        answer["entries"][1]["size"] = "1000"
    elif change == "an unknown role":
        answer["entries"][1]["role"] = "weights"
    elif change == "an entry field more":
        answer["entries"][1]["url"] = "http://elsewhere/"
    elif change == "a header of another file":
        answer["headers"]["config.json"] = "{}"
    elif change == "a header missing":
        del answer["headers"][SHARDS[1]]
    elif change == "a header that is not text":
        answer["headers"][SHARDS[0]] = [1, 2]
    elif change == "a lone surrogate":
        answer["headers"][SHARDS[0]] = "\ud800"
    elif change == "a weight in no shard":
        answer["weight_map"]["c.weight"] = "config.json"
    elif change == "a bad commit":
        answer["commit"] = "main"
    return answer


@pytest.mark.parametrize(
    "change",
    [
        "not an object",
        "a field more",
        "a field less",
        "a path out of the snapshot",
        "a size that is text",
        "an unknown role",
        "an entry field more",
        "a header of another file",
        "a header missing",
        "a header that is not text",
        "a lone surrogate",
        "a weight in no shard",
        "a bad commit",
    ],
)
def test_a_malformed_answer_is_a_daemon_error(change: str) -> None:
    with pytest.raises(DaemonError):
        Prepared.from_json(_broken(change))


def test_a_header_that_is_not_utf8_fails_naming_its_shard() -> None:
    prepared = Prepared(_prepared().manifest, {SHARDS[0]: b"{}", SHARDS[1]: b'{"\xff":1}'})
    with pytest.raises(HeaderError) as caught:
        prepared.to_json()
    assert SHARDS[1] in str(caught.value)
