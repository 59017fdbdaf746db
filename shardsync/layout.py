"""Every name under a cache root, spelled once (pure: no I/O but a temp name's owner check).

Layout of a cache root ``R``::

    R/VERSION, R/CACHEDIR.TAG
    R/store/sha256/<aa>/<sha256>              immutable blobs (0o444), named by their content
    R/hub/models--{org}--{name}/              Hugging Face hub layout (HF_HUB_CACHE=R/hub works)
        blobs/<etag>                          hard link to the store blob: bytes are stored once
        snapshots/<commit>/<path>             relative symlink to ../../blobs/<etag>
        refs/<revision>                       the bare commit hash
    R/other/{kind}--{slug}/                   same layout for URL, S3 and local origins
    R/state/snapshots/<repo>/<commit>.json    snapshot record, written last: it means "complete"
    R/state/access.log, R/state/leases/       last use of each snapshot; who uses one now
    R/state/daemon/                           the daemon's job journal
    R/quarantine/                             corrupt blobs moved out of the store by verify
    R/partial/<key>.part, <key>.json          in-progress downloads (``slot.py`` owns them)
    R/locks/<key>.lock                        flock(2) locks
    R/tmp/<purpose>.<host>.<pid>.<random>     temp names for atomic replace

Names are relative ``Parts`` (folder components) so the store can walk them one directory
descriptor at a time; ``CacheLayout`` joins them to a root for everyone who only reads.
Like uv's ``CacheBucket``: a new folder is one line here, and nothing else spells a path.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shardsync.errors import CacheError
from shardsync.manifest import validate_name
from shardsync.names import OriginKind, check_commit, check_sha256, split_revision

__all__ = [
    "AREAS",
    "CACHEDIR_TAG",
    "JOURNAL",
    "LAYOUT_VERSION",
    "LOCKS",
    "PARTIAL",
    "QUARANTINE",
    "RECORDS",
    "STATE",
    "STORE",
    "TEMP_BECOMES",
    "TMP",
    "CacheLayout",
    "Parts",
    "TempPurpose",
    "blob_dir",
    "blob_target",
    "check_dirname",
    "check_key",
    "check_state_parts",
    "file_parts",
    "is_download_lock",
    "is_junk_name",
    "is_live_temp",
    "is_repo_dirname",
    "kind_of_dirname",
    "name_of_dirname",
    "pending_name",
    "quarantine_name",
    "record_name",
    "repo_dir",
    "temp_name",
    "temp_owner",
    "temp_purpose",
]

Parts = tuple[str, ...]

LAYOUT_VERSION = 1
"""The on-disk layout version written to ``R/VERSION``; another number is refused."""

CACHEDIR_TAG = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This file is a cache directory tag created by shardsync.\n"
    b"# For information about cache directory tags see https://bford.info/cachedir/\n"
)

STORE: Parts = ("store", "sha256")
HUB: Parts = ("hub",)
OTHER: Parts = ("other",)
STATE: Parts = ("state",)
RECORDS: Parts = ("state", "snapshots")
JOURNAL: Parts = ("daemon", "jobs.json")  # a state file: state/daemon/jobs.json
PARTIAL: Parts = ("partial",)
LOCKS: Parts = ("locks",)
TMP: Parts = ("tmp",)
QUARANTINE: Parts = ("quarantine",)
AREAS: tuple[Parts, ...] = (STORE, HUB, OTHER, RECORDS, PARTIAL, LOCKS, TMP)
"""Folders a cache is initialized with (``quarantine/`` appears on first use)."""

_KINDS: tuple[OriginKind, ...] = ("hub", "url", "local", "s3")
_PREFIX = {"hub": "models"}  # RepoRef.dirname: models--org--name, {kind}--slug-hash otherwise
_KEY_RE = re.compile(r"[a-z0-9_-]{1,128}")
_DOWNLOAD_LOCK_RE = re.compile(r"(?:[0-9a-f]{64}|[pr]-[0-9a-f]{40})\.lock")
_DIRNAME_RE = re.compile(
    "(?:" + "|".join(_PREFIX.get(k, k) for k in _KINDS) + r")--[A-Za-z0-9._-]{1,240}"
)
_STATE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_QUARANTINED_RE = re.compile(r"[0-9a-f]{64}\.[0-9]{1,20}")  # <sha256>.<ns>


# --------------------------------------------------------------------------- validation


def check_key(key: str) -> str:
    """A download or lock key (``[a-z0-9_-]{1,128}``), else CacheError."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise CacheError(f"invalid cache key {key!r}: expected [a-z0-9_-]{{1,128}}")
    return key


def is_repo_dirname(name: str) -> bool:
    """Whether ``name`` is a repo folder name as ``RepoRef.dirname`` makes them."""
    return isinstance(name, str) and _DIRNAME_RE.fullmatch(name) is not None


def check_dirname(dirname: str) -> str:
    """A repo folder name; returns its area (``hub`` or ``other``)."""
    if not is_repo_dirname(dirname):
        raise CacheError(f"not a repo folder name: {dirname!r}")
    return "hub" if dirname.startswith("models--") else "other"


def kind_of_dirname(dirname: str) -> OriginKind:
    """The origin kind a repo folder name says (``models--`` is the Hub)."""
    check_dirname(dirname)
    prefix = dirname.split("--", 1)[0]
    return next(k for k in _KINDS if _PREFIX.get(k, k) == prefix)


def name_of_dirname(dirname: str) -> str:
    """``models--org--name`` -> ``org/name``; other folders name a hash, shown as they are."""
    if dirname.startswith("models--"):
        return dirname.removeprefix("models--").replace("--", "/")
    return dirname


def check_state_parts(parts: Sequence[str]) -> Parts:
    """A name under ``state/`` (one or two safe components), never a snapshot record."""
    if not 0 < len(parts) <= 2 or not all(
        isinstance(p, str) and _STATE_NAME_RE.fullmatch(p) for p in parts
    ):
        raise CacheError(f"invalid state file name {'/'.join(map(str, parts))!r}")
    if parts[0] == RECORDS[1]:
        raise CacheError("snapshot records are written by write_snapshot_record only")
    return tuple(parts)


def file_parts(relpath: str) -> Parts:
    """A repository file name as path segments, after the manifest's own checks: the name
    came from the network, and this is where it becomes a path."""
    return tuple(validate_name(relpath).split("/"))


def is_junk_name(area: str, name: str) -> bool:
    """A name shardsync gives in ``tmp/`` (``temp_name``) or ``quarantine/``
    (``quarantine_name``): what it may remove there. Another (a core dump, a user's file)
    is not its own; none of these names can turn into another path."""
    if not isinstance(name, str):
        return False
    if area == "tmp":
        return temp_purpose(name) in TEMP_BECOMES
    return area == "quarantine" and _QUARANTINED_RE.fullmatch(name) is not None


def quarantine_name(sha256: str) -> str:
    """The name a corrupt blob is kept under in ``quarantine/``."""
    return f"{sha256}.{time.time_ns()}"


def is_download_lock(name: str) -> bool:
    """A ``locks/`` entry of a blob download or of a training reader's kept ranges (``r-``),
    not the prune gate or the access log's."""
    return _DOWNLOAD_LOCK_RE.fullmatch(name) is not None


# --------------------------------------------------------------------------- names


def blob_dir(sha256: str) -> Parts:
    return (*STORE, check_sha256(sha256)[:2])


def repo_dir(dirname: str) -> Parts:
    return (check_dirname(dirname), dirname)


def record_name(commit: str) -> str:
    """A snapshot record's file name in ``state/snapshots/<dirname>/``."""
    return f"{check_commit(commit)}.json"


def pending_name(commit: str) -> str:
    """Beside the records: a snapshot shardsync makes and has not recorded yet (its mark)."""
    return f"{check_commit(commit)}.pending"


def blob_target(parts: Sequence[str], etag: str) -> str:
    """The relative symlink text from ``snapshots/<commit>/<parts>`` to ``blobs/<etag>``."""
    return "../" * (len(parts) + 1) + "blobs/" + etag


# --------------------------------------------------------------------------- temp names

TempPurpose = Literal[
    "part",
    "link",
    "copy",
    "resume",
    "blob",
    "symlink",
    "record",
    "ref",
    "state",
    "layout",
    "evict",
    "ranges",
]
TEMP_BECOMES: dict[str, str] = {
    "part": "partial",  # a download's private name for its data file
    "link": "partial",  # the shared name of a new partial, before its rename into partial/
    "copy": "partial",  # a local origin's copy
    "resume": "sidecar",  # a new resume record, before its rename into partial/
    "blob": "blobs",  # a repo's blobs/<etag> link
    "symlink": "snapshot",  # a snapshot entry
    "record": "record",  # a snapshot record
    "ref": "ref",  # refs/<revision>
    "state": "state",  # a lease or the compacted access log
    "layout": "layout",  # VERSION, CACHEDIR.TAG
    "evict": "evict",  # a snapshot or repo folder being deleted
    "ranges": "ranges",  # a training reader's kept ranges
}
"""What each ``tmp/`` name becomes: the crash hook names its steps by this, not by reading
method names off the stack."""

_HOST_TAG = hashlib.sha256(os.uname().nodename.encode()).hexdigest()[:8]
_TEMP_RE = re.compile(
    r"(?P<purpose>[a-z]+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]{1,10})(?:-(?P<start>[0-9]{1,20}))?"
    r"\.[0-9a-f]{16}"
)


def process_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, from ``/proc/<pid>/stat``;
    None when there is none or it cannot be read."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        # the command name (field 2) is in parentheses and may hold spaces and ')'
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether process ``pid`` runs and, with ``start_time``, is the very one that started
    then (a recycled pid, as a container's pid 1 after a restart, has another)."""
    found = process_stat(pid)
    if found is None:
        # none, or hidden from us (``/proc`` mounted ``hidepid``: another user's process, as
        # on shared GPU hosts), or no procfs: signal 0 at least says whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except (PermissionError, OverflowError):
            return True
        return True
    state, started = found
    if state in ("Z", "X", "x"):
        return False  # killed, not yet reaped: it holds nothing any more
    return start_time is None or started == start_time


def temp_name(purpose: TempPurpose) -> str:
    """A name under ``tmp/`` that says what it is for and who made it (host, pid and the
    process's start time), so the next run on this host can tell a crashed writer's leftovers
    from a live writer's files, even when it runs under the same pid (a container's pid 1)."""
    pid = os.getpid()
    found = process_stat(pid)
    who = str(pid) if found is None else f"{pid}-{found[1]}"
    return f"{purpose}.{_HOST_TAG}.{who}.{secrets.token_hex(8)}"


def temp_purpose(name: str) -> str:
    """The purpose a ``tmp/`` name was made for (``""`` when it is not one of ours)."""
    found = _TEMP_RE.fullmatch(name)
    return "" if found is None else found["purpose"]


def temp_owner(name: str) -> Literal["live", "gone", "unknown"]:
    """Whether the process that made a temp name still runs (known only on its own host)."""
    found = _TEMP_RE.fullmatch(name)
    if found is None or found["host"] != _HOST_TAG:
        return "unknown"  # another host's (a shared cache): left to prune's stale age
    pid = int(found["pid"])
    if pid <= 0:
        return "unknown"
    start = None if found["start"] is None else int(found["start"])
    return "live" if process_alive(pid, start) else "gone"


def is_live_temp(name: str) -> bool:
    """A ``tmp/`` entry of a running process of this host (a download's private name lives
    as long as the download): prune leaves it whatever its age."""
    return temp_owner(name) == "live"


# --------------------------------------------------------------------------- absolute paths


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The names above joined to one root: for readers (scanners, the loader, messages)."""

    root: Path

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @property
    def hub(self) -> Path:
        """The folder to hand Hugging Face tools as ``HF_HUB_CACHE``."""
        return self.path(*HUB)

    @property
    def store(self) -> Path:
        return self.path(*STORE)

    def blob(self, sha256: str) -> Path:
        return self.path(*blob_dir(sha256), sha256)

    def repo(self, dirname: str) -> Path:
        return self.path(*repo_dir(dirname))

    def snapshot(self, dirname: str, commit: str) -> Path:
        return self.repo(dirname) / "snapshots" / check_commit(commit)

    def ref(self, dirname: str, revision: str) -> Path:
        return self.repo(dirname).joinpath("refs", *split_revision(revision))

    def records(self, dirname: str) -> Path:
        return self.path(*RECORDS, dirname)

    def record(self, dirname: str, commit: str) -> Path:
        return self.records(dirname) / record_name(commit)

    def pending(self, dirname: str, commit: str) -> Path:
        return self.records(dirname) / pending_name(commit)

    def partial(self, key: str) -> tuple[Path, Path]:
        """(data file, resume record) of an in-progress download."""
        return self.path(*PARTIAL, f"{check_key(key)}.part"), self.path(*PARTIAL, f"{key}.json")

    def lock(self, key: str) -> Path:
        return self.path(*LOCKS, f"{check_key(key)}.lock")

    def state(self, *parts: str) -> Path:
        return self.path(*STATE, *check_state_parts(parts))

    def journal(self) -> Path:
        return self.state(*JOURNAL)
