"""Typed job events and the job state table: pure, table-driven, no event loop."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from pathlib import Path
from typing import Any, get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardsync.api import checkpoint_result_from_json, result_from_json
from shardsync.errors import DaemonError
from shardsync.events import (
    EVENT_TYPES,
    FINISHED,
    JOB_STATES,
    TERMINAL_EVENTS,
    TRANSITIONS,
    ErrorInfo,
    FileFailed,
    FileStarted,
    JobDone,
    JobEvent,
    JobFailed,
    JobState,
    Progress,
    Pruning,
    Resolved,
    ResolvedFile,
    Verified,
    parse_event,
    transition,
)
from shardsync.manifest import FileRole
from shardsync.records import FileOutcome, Source, Verification

# ---------------------------------------------------------------------------- strategies

_text = st.text(max_size=40)
_count = st.integers(min_value=0, max_value=2**53)
_maybe_count = st.none() | _count
_paths = st.builds(Path, st.text(alphabet="abc/._-", max_size=20))
_errors = st.builds(ErrorInfo, code=_text, message=_text)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=10,
)
_stamp: dict[str, Any] = {
    "job": _text,
    "seq": _count,
    "time": st.floats(allow_nan=False, allow_infinity=False),
}

KINDS: dict[type[JobEvent], st.SearchStrategy[JobEvent]] = {
    FileStarted: st.builds(
        FileStarted, path=_text, size=_maybe_count, shard_index=_maybe_count, **_stamp
    ),
    Progress: st.builds(Progress, path=_text, done=_count, size=_maybe_count, **_stamp),
    Verified: st.builds(
        Verified,
        outcome=st.builds(
            FileOutcome,
            path=_text,
            size=_count,
            sha256=_text,
            verified=st.sampled_from(get_args(Verification)),
            source=st.sampled_from(get_args(Source)),
            downloaded=_count,
            resumed=_count,
        ),
        shard_index=_maybe_count,
        file=_paths,
        blob=_paths,
        **_stamp,
    ),
    FileFailed: st.builds(
        FileFailed, path=_text, shard_index=_maybe_count, error=_errors, **_stamp
    ),
    Pruning: st.builds(Pruning, needed=_count, free=_count, **_stamp),
    Resolved: st.builds(
        Resolved,
        commit=st.none() | _text,
        revision=_text,
        total_size=_maybe_count,
        files=st.lists(
            st.builds(
                ResolvedFile,
                path=_text,
                size=_maybe_count,
                role=st.sampled_from(get_args(FileRole)),
                shard_index=_maybe_count,
            ),
            max_size=4,
        ).map(tuple),
        **_stamp,
    ),
    JobDone: st.builds(JobDone, result=st.dictionaries(_text, _json, max_size=4), **_stamp),
    JobFailed: st.builds(JobFailed, error=_errors, **_stamp),
}
any_event = st.one_of(*KINDS.values())


def _over_the_wire(event: JobEvent) -> object:
    """What a client reads: the daemon writes ``to_json`` as one NDJSON line."""
    return json.loads(json.dumps(event.to_json(), separators=(",", ":")))


# ---------------------------------------------------------------------------- round trips


def test_every_kind_has_a_strategy() -> None:
    assert set(KINDS) == set(EVENT_TYPES.values())
    assert {cls.kind for cls in KINDS} == set(EVENT_TYPES)


@given(any_event)
def test_events_round_trip_through_the_wire(event: JobEvent) -> None:
    assert parse_event(_over_the_wire(event)) == event
    assert type(event).from_json(event.to_json()) == event


@given(any_event)
def test_the_wire_keeps_its_envelope(event: JobEvent) -> None:
    line = event.to_json()
    keys = list(line)
    assert keys[:3] == ["event", "job", "time"] and keys[-1] == "seq"
    assert line["event"] == event.kind


def test_a_verified_event_is_the_documented_line() -> None:
    outcome = FileOutcome("model-1.safetensors", 5, "ab" * 32, "sha256", "network", 5, 0)
    event = Verified(
        job="j",
        seq=4,
        time=1.5,
        outcome=outcome,
        shard_index=0,
        file=Path("/c/snapshots/x/model-1.safetensors"),
        blob=Path("/c/blob"),
    )
    assert event.to_json() == {
        "event": "verified",
        "job": "j",
        "time": 1.5,
        "path": "model-1.safetensors",
        "size": 5,
        "sha256": "ab" * 32,
        "verified": "sha256",
        "source": "network",
        "downloaded": 5,
        "resumed": 0,
        "shard_index": 0,
        "file": "/c/snapshots/x/model-1.safetensors",
        "blob": "/c/blob",
        "seq": 4,
    }


# ---------------------------------------------------------------------------- what a client meets


def test_an_unknown_kind_is_skipped_and_unknown_fields_ignored() -> None:
    assert parse_event({"event": "from_a_newer_daemon", "job": "j", "seq": 1}) is None
    line = Pruning(job="j", seq=1, time=2.0, needed=3, free=4).to_json()
    assert parse_event({**line, "added_later": [1]}) == parse_event(line)


@pytest.mark.parametrize("obj", [None, [], "verified", {}, {"event": 7}])
def test_an_event_without_a_kind_is_a_daemon_error(obj: object) -> None:
    with pytest.raises(DaemonError, match="without a type"):
        parse_event(obj)


@given(st.data())
def test_every_missing_or_mistyped_field_is_a_daemon_error(data: st.DataObject) -> None:
    line = data.draw(any_event).to_json()
    key = data.draw(st.sampled_from(sorted(set(line) - {"event"})))
    for broken in ({k: v for k, v in line.items() if k != key}, {**line, key: True}):
        with pytest.raises(DaemonError, match=repr(key)):
            parse_event(broken)


@given(st.data())
def test_any_value_in_any_field_parses_or_is_a_daemon_error(data: st.DataObject) -> None:
    line = data.draw(any_event).to_json()
    key = data.draw(st.sampled_from(sorted(set(line) - {"event"})))
    with contextlib.suppress(DaemonError):
        parse_event({**line, key: data.draw(_json)})


@pytest.mark.parametrize(
    "broken",
    [
        {"files": [7]},
        {"files": [{"path": "a", "size": 1, "role": "weights", "shard_index": None}]},
        {"files": [{"path": "a", "size": 1, "role": "shard"}]},
    ],
)
def test_a_malformed_resolved_file_is_a_daemon_error(broken: dict[str, Any]) -> None:
    line = Resolved(commit=None, revision="main", total_size=1, files=()).to_json()
    with pytest.raises(DaemonError, match="resolved event's file"):
        parse_event({**line, **broken})


@pytest.mark.parametrize("time", [10**400, -(10**400)], ids=["huge", "hugely negative"])
def test_a_time_too_large_for_a_float_is_a_daemon_error(time: int) -> None:
    line = Pruning(job="j", seq=1, time=2.0, needed=3, free=4).to_json()
    with pytest.raises(DaemonError):
        parse_event({**line, "time": time})


@pytest.mark.parametrize("field", ["size", "downloaded"])
def test_a_result_number_too_large_for_an_int_is_a_daemon_error(field: str) -> None:
    """JSON's ``1e400`` is a float infinity, which ``int()`` refuses with OverflowError."""
    good = {"path": "a", "size": 1, "sha256": "0" * 64, "verified": "sha256"}
    files = [{**good, "source": "origin", "downloaded": 1, "resumed": 0}]
    result = {"origin": "hub", "repo": "o/r", "revision": "main", "commit": "c" * 40}
    result |= {"snapshot_path": "/s", "files": files, "bytes_downloaded": 1, "elapsed_s": 0.1}
    checkpoint = {**result, "snapshot_root": "/s", "checkpoint": "step-1", "format": "dcp"}
    checkpoint |= {"step": 1, "skipped": [], "notes": []}
    checkpoint["files"] = [{**files[0], field: float("inf")}]
    checkpoint_result_from_json(checkpoint | {"step": 1, "files": files})  # the good one
    with pytest.raises(DaemonError):
        checkpoint_result_from_json(checkpoint)
    with pytest.raises(DaemonError):
        result_from_json(checkpoint)  # a plain job's result: the files alone (no step)


def test_a_malformed_error_object_is_a_daemon_error() -> None:
    line = JobFailed(error=ErrorInfo("transfer", "x")).to_json()
    with pytest.raises(DaemonError, match="'message'"):
        parse_event({**line, "error": {"code": "transfer"}})


def test_the_daemon_doc_documents_every_kind() -> None:
    """docs/daemon.md's event table names every kind of event, and only those."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "daemon.md").read_text()
    table = doc.split("| event | fields |", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) == set(EVENT_TYPES)


def test_only_job_done_and_job_failed_end_a_stream() -> None:
    assert {cls.kind for cls in TERMINAL_EVENTS} == {"job_done", "job_failed"}


# ---------------------------------------------------------------------------- job states


def test_the_table_names_every_state() -> None:
    assert tuple(TRANSITIONS) == JOB_STATES == get_args(JobState)
    assert all(targets <= set(JOB_STATES) for targets in TRANSITIONS.values())


@pytest.mark.parametrize(("current", "target"), list(itertools.product(JOB_STATES, repeat=2)))
def test_a_transition_happens_only_if_the_table_allows_it(
    current: JobState, target: JobState
) -> None:
    if target in TRANSITIONS[current]:
        assert transition(current, target) == target
    else:
        with pytest.raises(RuntimeError, match=f"from '{current}' to '{target}'"):
            transition(current, target)


def test_every_state_is_reachable_and_finished_ones_are_final() -> None:
    reached: set[JobState] = {"pending"}
    frontier: list[JobState] = ["pending"]
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    assert reached == set(JOB_STATES)
    assert all(not TRANSITIONS[state] for state in FINISHED)
