"""The daemon API's wire format: error codes, job requests and results as JSON.

Pure and shared by the daemon, the client and the in-process scheduler, so all three
speak exactly the same shapes (documented in docs/daemon.md, "The API").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardsync import errors
from shardsync.errors import ConfigError, DaemonError, ShardsyncError
from shardsync.events import ErrorInfo
from shardsync.names import validate_revision
from shardsync.records import FileOutcome, PrefetchResult, RepoRef
from shardsync.training import Format, Skipped

API_VERSION = 1  # the /v1/ paths: fields are only added within a version

__all__ = [
    "API_VERSION",
    "CheckpointResult",
    "JobRequest",
    "checkpoint_result_from_json",
    "error_class",
    "error_code",
    "error_info",
    "error_json",
    "result_from_json",
    "result_to_json",
]

_MAX_PRIORITY = 1000
_MAX_GLOBS = 256
_MAX_TEXT = 4096


# ------------------------------------------------------------------------------ wire format


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.removesuffix("Error")).lower()


_CODE_OF: dict[type[ShardsyncError], str] = {
    cls: _snake(cls.__name__)
    for cls in (getattr(errors, name) for name in errors.__all__)
    if isinstance(cls, type) and issubclass(cls, ShardsyncError)
}
_CLASS_OF = {code: cls for cls, code in _CODE_OF.items()}


def error_code(exc: BaseException) -> str:
    """The API's name for an error: ``RepoNotFoundError`` -> ``repo_not_found``."""
    for cls in type(exc).__mro__:
        if cls in _CODE_OF:
            return _CODE_OF[cls]
    return "internal"


def error_class(code: str) -> type[ShardsyncError] | None:
    """The exception a client raises for ``code``; None for codes that are not ours."""
    return _CLASS_OF.get(code)


def error_info(exc: BaseException) -> ErrorInfo:
    """What the API says of an error; unexpected errors never leak their internals."""
    if isinstance(exc, ShardsyncError):
        return ErrorInfo(error_code(exc), str(exc))
    return ErrorInfo("internal", f"internal error ({type(exc).__name__}); see the log")


def error_json(exc: BaseException) -> dict[str, str]:
    """``{"code": ..., "message": ...}``, the body of an API error answer."""
    return error_info(exc).to_json()


def result_to_json(result: PrefetchResult) -> dict[str, Any]:
    """The documented ``prefetch --json`` shape, also the ``job_done`` event's ``result``."""
    return {
        "repo": result.repo.name,
        "origin": result.repo.kind,
        "revision": result.revision,
        "commit": result.commit,
        "snapshot_path": str(result.snapshot_path),
        "bytes_downloaded": result.bytes_downloaded,
        "bytes_from_tier": result.bytes_from_tier,
        "total_size": result.total_size,
        "elapsed_s": round(result.elapsed, 3),
        "files": [
            {
                "path": f.path,
                "size": f.size,
                "sha256": f.sha256,
                "verified": f.verified,
                "source": f.source,
                "downloaded": f.downloaded,
                "resumed": f.resumed,
            }
            for f in result.files
        ],
        **({"tier": asdict(result.tier)} if result.tier is not None else {}),
    }


def result_from_json(obj: Mapping[str, Any]) -> PrefetchResult:
    """Inverse of ``result_to_json`` (``fetch`` statistics stay with the daemon)."""
    try:
        files = tuple(
            FileOutcome(
                path=str(f["path"]),
                size=int(f["size"]),
                sha256=str(f["sha256"]),
                verified=f["verified"],
                source=f["source"],
                downloaded=int(f["downloaded"]),
                resumed=int(f["resumed"]),
            )
            for f in obj["files"]
        )
        return PrefetchResult(
            repo=RepoRef(kind=obj["origin"], name=str(obj["repo"])),
            revision=str(obj["revision"]),
            commit=str(obj["commit"]),
            snapshot_path=Path(obj["snapshot_path"]),
            files=files,
            bytes_downloaded=int(obj["bytes_downloaded"]),
            elapsed=float(obj["elapsed_s"]),
            fetch=None,
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # int(1e400): inf
        raise errors.DaemonError(f"malformed job result from the daemon: {exc!r}") from exc


# ------------------------------------------------------------------------------ requests


@dataclass(frozen=True, slots=True)
class CheckpointResult:
    """A training checkpoint (or one rank's part of it) complete in the cache.

    ``path`` is the local folder a framework is pointed at, laid out like the remote one
    (the checkpoint folder; for DeepSpeed and Megatron the run folder with the pointer file).
    """

    prefetch: PrefetchResult
    checkpoint: str
    format: Format
    step: int | None
    path: Path
    skipped: tuple[Skipped, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """``prefetch --json`` plus ``checkpoint``, ``format``, the checkpoint's folder as
        ``snapshot_path`` (the whole snapshot as ``snapshot_root``), and what was skipped."""
        return {
            **result_to_json(self.prefetch),
            "checkpoint": self.checkpoint,
            "format": self.format,
            "step": self.step,
            "snapshot_path": str(self.path),
            "snapshot_root": str(self.prefetch.snapshot_path),
            "skipped": [{"name": s.name, "reason": s.reason} for s in self.skipped],
            "notes": list(self.notes),
        }


def checkpoint_result_from_json(obj: Mapping[str, Any]) -> CheckpointResult:
    """Inverse of ``CheckpointResult.to_json`` (a daemon job's ``job_done`` result)."""
    try:
        prefetch = result_from_json({**obj, "snapshot_path": obj["snapshot_root"]})
        return CheckpointResult(
            prefetch=prefetch,
            checkpoint=str(obj["checkpoint"]),
            format=obj["format"],
            step=None if obj["step"] is None else int(obj["step"]),
            path=Path(obj["snapshot_path"]),
            skipped=tuple(Skipped(str(s["name"]), str(s["reason"])) for s in obj["skipped"]),
            notes=tuple(str(n) for n in obj["notes"]),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise DaemonError(f"malformed checkpoint result from the daemon: {exc!r}") from exc


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What a client asks for; validated here so the daemon and the fallback agree."""

    source: str
    revision: str | None = None
    include: tuple[str, ...] | None = None  # None: the engine's default small files
    exclude: tuple[str, ...] = ()
    priority: int = 0
    allow_pickle: bool = False
    checkpoint: str | None = None  # a training checkpoint: "latest" or its folder's name
    rank: int | None = None  # with checkpoint: only this rank's files ...
    world_size: int | None = None  # ... of this many
    in_order: bool = False  # a stream reads the shards in order: fetch them in their turn

    def __post_init__(self) -> None:
        _check_text("source", self.source)
        _check_checkpoint(self.checkpoint, self.rank, self.world_size)
        if self.revision is not None:
            _check_text("revision", self.revision)
            validate_revision(self.revision)
        for name, globs in (("include", self.include), ("exclude", self.exclude)):
            if globs is None:
                continue
            if not isinstance(globs, tuple) or len(globs) > _MAX_GLOBS:
                raise ConfigError(f"{name}: at most {_MAX_GLOBS} glob strings")
            for glob in globs:
                _check_text(name, glob)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError(f"priority must be an integer (got {self.priority!r})")
        if not -_MAX_PRIORITY <= self.priority <= _MAX_PRIORITY:
            raise ConfigError(f"priority must be within +-{_MAX_PRIORITY} (got {self.priority})")
        for flag in ("allow_pickle", "in_order"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be true or false (got {getattr(self, flag)!r})")

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "revision": self.revision,
            "include": None if self.include is None else list(self.include),
            "exclude": list(self.exclude),
            "priority": self.priority,
            "allow_pickle": self.allow_pickle,
            "in_order": self.in_order,
            **(
                {"checkpoint": self.checkpoint, "rank": self.rank, "world_size": self.world_size}
                if self.checkpoint is not None
                else {}
            ),
        }

    @classmethod
    def from_json(cls, obj: object) -> JobRequest:
        """Parse a request body; every problem is a ``ConfigError`` naming the field."""
        if not isinstance(obj, dict):
            raise ConfigError("the request body must be a JSON object")
        unknown = sorted(set(obj) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ConfigError(f"unknown field {unknown[0]!r}")
        if "source" not in obj:
            raise ConfigError("missing field 'source' (ORG/NAME or an http(s) URL)")
        revision = obj.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise ConfigError("revision must be a string or null")
        return cls(
            source=_text_field(obj, "source"),
            revision=revision,
            include=_globs(obj.get("include"), "include"),
            exclude=_globs(obj.get("exclude", []), "exclude") or (),
            priority=obj.get("priority", 0),
            allow_pickle=obj.get("allow_pickle", False),
            checkpoint=obj.get("checkpoint"),
            rank=obj.get("rank"),
            world_size=obj.get("world_size"),
            in_order=obj.get("in_order", False),
        )


def _check_checkpoint(checkpoint: object, rank: object, world_size: object) -> None:
    """A training checkpoint request: ``latest`` or a folder name, and a rank of a world."""
    if checkpoint is not None:
        _check_text("checkpoint", checkpoint)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{name} must be an integer or null (got {value!r})")
    if (rank is None) != (world_size is None):
        raise ConfigError("rank and world_size go together")
    if rank is not None and checkpoint is None:
        raise ConfigError("rank and world_size go with checkpoint")
    if isinstance(rank, int) and isinstance(world_size, int) and not 0 <= rank < world_size:
        raise ConfigError(f"rank must be from 0 to world_size - 1 (got {rank} of {world_size})")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT or "\0" in value:
        raise ConfigError(f"{name} must be a non-empty string of at most {_MAX_TEXT} characters")


def _text_field(obj: Mapping[str, Any], name: str) -> str:
    value = obj.get(name)
    _check_text(name, value)
    return str(value)


def _globs(value: object, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
        raise ConfigError(f"{name} must be a list of glob strings")
    return tuple(value)
