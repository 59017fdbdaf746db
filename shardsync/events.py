"""A job's events and states: the daemon's event stream as typed values (pure).

Every event the scheduler appends to a job's log is one of the frozen dataclasses below, and
its ``to_json()`` is exactly the NDJSON line ``GET /v1/jobs/{id}/events`` serves (docs/daemon.md,
"Events"): ``{"event": <kind>, "job", "time", <the kind's fields>, "seq"}``. ``parse_event``
reads a line back for a client. A malformed event raises ``DaemonError``, never ``KeyError``.

Compatibility: within API version 1 fields are only ever added, and a newer daemon may add
kinds. So a reader ignores fields it does not know, and ``parse_event`` returns None for a kind
it does not know, which clients skip; ``job_done`` and ``job_failed`` stay the only kinds that
end a stream.

A job's states and the moves between them are one table, ``TRANSITIONS`` (the model is h11's
``_state.py``), and ``transition`` is the one way to move: a scheduler bug that would finish a
job twice or revive a finished one fails loudly instead of sending a second terminal event.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Final, Literal, Self, TypeVar, get_args

from shardsync.errors import DaemonError
from shardsync.manifest import FileRole
from shardsync.records import FileOutcome, Source, Verification

__all__ = [
    "EVENT_TYPES",
    "FINISHED",
    "JOB_STATES",
    "TERMINAL_EVENTS",
    "TRANSITIONS",
    "ErrorInfo",
    "FileFailed",
    "FileStarted",
    "JobDone",
    "JobEvent",
    "JobFailed",
    "JobState",
    "Progress",
    "Pruning",
    "Resolved",
    "ResolvedFile",
    "Verified",
    "parse_event",
    "transition",
]

# ------------------------------------------------------------------------------ states

JobState = Literal[
    "pending", "resolving", "downloading", "interrupted", "done", "failed", "cancelled"
]
JOB_STATES: Final[tuple[JobState, ...]] = get_args(JobState)

TRANSITIONS: Final[Mapping[JobState, frozenset[JobState]]] = MappingProxyType(
    {
        # submitted, its task not yet run; stopped before it runs, it cannot fail
        "pending": frozenset({"resolving", "cancelled", "interrupted"}),
        # listing the origin and fetching the index (or choosing a job to follow)
        "resolving": frozenset({"downloading", "failed", "cancelled", "interrupted"}),
        # fetching files, or following the job already downloading the same commit
        "downloading": frozenset({"done", "failed", "cancelled", "interrupted"}),
        # the daemon stopped; its journal resumes the job as a new pending one, same id,
        # unless a client cancels it before the daemon is gone
        "interrupted": frozenset({"cancelled"}),
        "done": frozenset(),
        "failed": frozenset(),
        "cancelled": frozenset(),
    }
)

FINISHED: Final[frozenset[JobState]] = frozenset({"done", "failed", "cancelled"})
"""States a job never leaves, not even through the journal (``interrupted`` is resumed)."""


def transition(current: JobState, target: JobState) -> JobState:
    """``target``, if the table allows a job in ``current`` to move there.

    A move it forbids is the scheduler's own bug, hence ``RuntimeError``.
    """
    if target not in TRANSITIONS[current]:
        raise RuntimeError(f"a job cannot go from {current!r} to {target!r}")
    return target


# ------------------------------------------------------------------------------ values


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """Why a file or a job failed, as the API says it: ``{"code", "message"}``."""

    code: str  # names the exception: repo_not_found, transfer, job_cancelled, ...
    message: str

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True, slots=True)
class ResolvedFile:
    """One file a job will make complete, in index order."""

    path: str
    size: int | None
    role: FileRole
    shard_index: int | None  # its place among the shards; None for other files

    def to_json(self) -> dict[str, object]:
        return _fields_json(self)


# ------------------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent(ABC):
    """What every event carries besides its own fields.

    ``job``, ``seq`` (its number in the job's log, what ``since`` counts) and ``time`` (Unix
    seconds) are stamped by the log that takes the event; the defaults stand in until then.

    A kind's own fields go on the wire in the order they are declared, each read back as its
    declared type says (``_READERS``); a kind whose wire shape is not its fields overrides
    ``_fields`` and ``_read_fields``.
    """

    kind: ClassVar[str]
    job: str = ""
    seq: int = -1
    time: float = 0.0

    def to_json(self) -> dict[str, object]:
        """The NDJSON object the daemon serves (key order as the API has always sent it)."""
        return {
            "event": self.kind,
            "job": self.job,
            "time": self.time,
            **self._fields(),
            "seq": self.seq,
        }

    def _fields(self) -> dict[str, object]:
        """This kind's own fields as JSON, in their wire order."""
        return _fields_json(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, object]) -> Self:
        """The event from its JSON object; ``DaemonError`` if a field is missing or mistyped."""
        r = _Reader(obj, f"{cls.kind} event")
        return cls(job=r.job, seq=r.seq, time=r.time, **cls._read_fields(r))

    @classmethod
    def _read_fields(cls, r: _Reader) -> dict[str, Any]:
        return _read_fields(cls, r)


@dataclass(frozen=True, slots=True, kw_only=True)
class FileStarted(JobEvent):
    """A file got a download slot (the index: as the job resolves, before ``resolved``)."""

    kind: ClassVar[str] = "file_started"
    path: str
    size: int | None
    shard_index: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress(JobEvent):
    """Bytes of a file so far; a log keeps only each file's latest."""

    kind: ClassVar[str] = "progress"
    path: str
    done: int
    size: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Verified(JobEvent):
    """A file is complete and verified: how it got there, and where to read it.

    ``file`` is the one answer to "where do I read this file", for the daemon's clients and
    for the loader in-process alike: the snapshot entry, or the blob while the snapshot has
    no id yet (origins without commits name it by content once every file is in).
    On the wire the outcome's fields stand beside the event's own.
    """

    kind: ClassVar[str] = "verified"
    outcome: FileOutcome
    shard_index: int | None
    file: Path
    blob: Path

    def _fields(self) -> dict[str, object]:
        o = self.outcome
        return {
            "path": o.path,
            "size": o.size,
            "sha256": o.sha256,
            "verified": o.verified,
            "source": o.source,
            "downloaded": o.downloaded,
            "resumed": o.resumed,
            "shard_index": self.shard_index,
            "file": str(self.file),
            "blob": str(self.blob),
        }

    @classmethod
    def _read_fields(cls, r: _Reader) -> dict[str, Any]:
        outcome = FileOutcome(
            path=r.string("path"),
            size=r.integer("size"),
            sha256=r.string("sha256"),
            verified=r.choice("verified", _VERIFICATIONS),
            source=r.choice("source", _SOURCES),
            downloaded=r.integer("downloaded"),
            resumed=r.integer("resumed"),
        )
        return {
            "outcome": outcome,
            "shard_index": r.optional_integer("shard_index"),
            "file": Path(r.string("file")),
            "blob": Path(r.string("blob")),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class FileFailed(JobEvent):
    """A file's retries are spent; the job fails with this error next."""

    kind: ClassVar[str] = "failed"
    path: str
    shard_index: int | None
    error: ErrorInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Pruning(JobEvent):
    """The download would not fit: the cache is pruned before it starts."""

    kind: ClassVar[str] = "pruning"
    needed: int  # bytes still to download
    free: int  # bytes free on the cache's disk


@dataclass(frozen=True, slots=True, kw_only=True)
class Resolved(JobEvent):
    """The origin was listed: the commit and every file the job will make complete."""

    kind: ClassVar[str] = "resolved"
    commit: str | None  # None: an origin without commits (named by content at the end)
    revision: str
    total_size: int | None  # None while any file's size is unknown
    files: tuple[ResolvedFile, ...]

    @property
    def shard_count(self) -> int:
        return sum(1 for f in self.files if f.shard_index is not None)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDone(JobEvent):
    """The job's snapshot is complete; the last event of its stream.

    ``result`` stays the JSON object it is on the wire because its shape depends on the job:
    ``api.result_from_json`` reads a prefetch's (the ``prefetch --json`` object),
    ``checkpoint.checkpoint_result_from_json`` a training checkpoint's.
    """

    kind: ClassVar[str] = "job_done"
    result: Mapping[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFailed(JobEvent):
    """The job failed, was cancelled or was interrupted; the last event of its stream."""

    kind: ClassVar[str] = "job_failed"
    error: ErrorInfo


EVENT_TYPES: Final[Mapping[str, type[JobEvent]]] = MappingProxyType(
    {
        c.kind: c
        for c in (
            FileStarted,
            Progress,
            Verified,
            FileFailed,
            Pruning,
            Resolved,
            JobDone,
            JobFailed,
        )
    }
)
TERMINAL_EVENTS: Final = (JobDone, JobFailed)


def parse_event(obj: object) -> JobEvent | None:
    """The event a daemon sent; None for a kind this version does not know (skip it)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("event"), str):
        raise DaemonError("the daemon sent an event without a type")
    cls = EVENT_TYPES.get(obj["event"])
    return None if cls is None else cls.from_json(obj)


# ------------------------------------------------------------------------------ reading

_VERIFICATIONS: tuple[Verification, ...] = get_args(Verification)
_SOURCES: tuple[Source, ...] = get_args(Source)
_ROLES: tuple[FileRole, ...] = get_args(FileRole)


_Choice = TypeVar("_Choice", bound=str)


class _Reader:
    """Typed fields of one JSON object; anything missing or mistyped is a ``DaemonError``."""

    def __init__(self, obj: object, what: str) -> None:
        if not isinstance(obj, dict):
            raise DaemonError(f"the daemon sent a malformed {what}: not an object")
        self._obj: dict[str, object] = obj
        self._what = what

    def _get(self, key: str) -> object:
        if key not in self._obj:
            raise DaemonError(f"the daemon sent a malformed {self._what}: no {key!r}")
        return self._obj[key]

    def _wrong(self, key: str, wanted: str) -> DaemonError:
        return DaemonError(
            f"the daemon sent a malformed {self._what}: {key!r} is {self._obj[key]!r}, not {wanted}"
        )

    @property
    def job(self) -> str:
        return self.string("job")

    @property
    def seq(self) -> int:
        return self.integer("seq")

    @property
    def time(self) -> float:
        value = self._get("time")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._wrong("time", "a number")
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise self._wrong("time", "a time") from None

    def string(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def optional_string(self, key: str) -> str | None:
        return None if self._get(key) is None else self.string(key)

    def integer(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(key, "an integer")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self._get(key) is None else self.integer(key)

    def choice(self, key: str, choices: tuple[_Choice, ...]) -> _Choice:
        value = self._get(key)
        for choice in choices:
            if value == choice:
                return choice
        raise self._wrong(key, "one of " + ", ".join(choices))

    def array(self, key: str) -> list[object]:
        value = self._get(key)
        if not isinstance(value, list):
            raise self._wrong(key, "a list")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self._get(key)
        if not isinstance(value, dict):
            raise self._wrong(key, "an object")
        return value

    def error(self, key: str) -> ErrorInfo:
        e = _Reader(self.mapping(key), f"{self._what}'s {key}")
        return ErrorInfo(code=e.string("code"), message=e.string("message"))

    def resolved_files(self, key: str) -> tuple[ResolvedFile, ...]:
        return tuple(
            ResolvedFile(**_read_fields(ResolvedFile, _Reader(item, f"{self._what}'s file")))
            for item in self.array(key)
        )


_READERS: Final[Mapping[str, Callable[[_Reader, str], object]]] = MappingProxyType(
    {
        "str": _Reader.string,
        "str | None": _Reader.optional_string,
        "int": _Reader.integer,
        "int | None": _Reader.optional_integer,
        "FileRole": lambda r, key: r.choice(key, _ROLES),
        "ErrorInfo": _Reader.error,
        "Mapping[str, Any]": _Reader.mapping,
        "tuple[ResolvedFile, ...]": _Reader.resolved_files,
    }
)
"""How a field is read back, by its declared type."""

_ENVELOPE: Final = frozenset({"job", "seq", "time"})


def _wire_fields(cls: type) -> tuple[tuple[str, str], ...]:
    """``(name, declared type)`` of a value's own fields in wire order (the declared order;
    an event's envelope goes around them)."""
    return tuple((f.name, str(f.type)) for f in fields(cls) if f.name not in _ENVELOPE)


def _fields_json(value: Any) -> dict[str, object]:
    """A value's own fields as JSON; nested values (an error, resolved files) as theirs."""
    out: dict[str, object] = {}
    for name, _ in _wire_fields(type(value)):
        field = getattr(value, name)
        if isinstance(field, ErrorInfo):
            out[name] = field.to_json()
        elif isinstance(field, tuple):
            out[name] = [item.to_json() for item in field]
        else:
            out[name] = field
    return out


def _read_fields(cls: type, r: _Reader) -> dict[str, Any]:
    """The fields of a ``cls`` read from ``r``, each as its declared type says."""
    return {name: _READERS[kind](r, name) for name, kind in _wire_fields(cls)}
