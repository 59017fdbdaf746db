"""Who uses what in the cache: an access log (for LRU) and leases (for "do not prune").

File atime is no help (``noatime``/``relatime`` mounts keep nothing useful), so every use
goes into the cache's own log, ``state/access.log``: one JSON object per line, appended
with a single ``O_APPEND`` write, compacted (one line per snapshot) when it grows past
``MAX_LOG_BYTES`` and by every prune. Each record *starts* with a newline, so a line torn by
a crash mid-append never swallows the next record.

A lease is one small JSON file in ``state/leases/``. It says that a process is using a
snapshot (or, with ``commit`` None, every snapshot of a repo) and it dies with its holder,
so a crashed holder never pins the cache. It may also name store blobs its holder counts on
before any snapshot links them (``Lease.akeep``: a content-named job's files):

* a *process* lease names a pid and that process's start time (field 22 of
  ``/proc/<pid>/stat``), the boot id and the PID namespace: it protects while that exact
  process lives. A recycled pid has another start time, a zombie counts as dead, a reboot
  changes the boot id. ``kill -9`` ends the protection at once.
* a lease with a ``ttl`` protects only while its holder heartbeats (the file's mtime) more
  often than that, and while its process lives. The daemon holds these for clients it cannot
  watch, so its own death ends them at once too; for a local client it can instead name the
  client's pid (``hold(..., pid=...)``, from ``SO_PEERCRED``).

A lease made on another machine, boot or PID namespace cannot be checked by pid: it
protects for its ``ttl`` after the last heartbeat, or for ``FOREIGN_LEASE_AGE`` without one.

Taking a lease and pruning exclude each other through the *prune gate*, a ``flock`` on
``locks/prune.lock``: a lease is written under the gate shared, a prune decides and deletes
under it exclusive. So a prune sees every lease taken before it, and a lease taken while a
prune runs waits for it (unlinks only: moments) and then sees what it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Self, TypeVar

from shardsync import strict_json
from shardsync.cache import CacheStore
from shardsync.errors import CacheError, OfflineError
from shardsync.layout import process_alive, process_stat
from shardsync.locks import BlobLock
from shardsync.records import FileOutcome, PrefetchResult, RepoRef

__all__ = [
    "FOREIGN_LEASE_AGE",
    "MAX_LOG_BYTES",
    "AccessLog",
    "Lease",
    "LeaseInfo",
    "Leases",
    "offline_result",
    "prune_gate",
    "wait_lock",
]

MAX_LOG_BYTES = 1 << 20
"""The access log is compacted when an append takes it past this size."""

FOREIGN_LEASE_AGE = 24 * 3600.0
"""How long a lease that cannot be checked by pid (another host, boot or PID namespace) and
has no ttl protects after its last heartbeat."""

_LOG = "access.log"
_LEASES = "leases"
_GATE = "prune"
_LOG_LOCK = "access-log"
_LEASE_FORMAT = 1
_POLL = 0.02

Clock = Callable[[], float]
T = TypeVar("T")


def prune_gate(cache: CacheStore, *, shared: bool) -> BlobLock:
    """The lock that orders lease taking (shared) against pruning and quarantine (exclusive)."""
    return cache.lock(_GATE, shared=shared)


def wait_lock(lock: BlobLock, timeout: float | None) -> None:
    """Take ``lock``, polling from a thread that may block (CLI, worker threads); CacheError
    after ``timeout`` seconds (None: wait as long as it takes)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not lock.try_acquire():
        if deadline is not None and time.monotonic() >= deadline:
            raise CacheError(f"timed out after {timeout} s waiting for {lock.path}")
        time.sleep(_POLL)


# --------------------------------------------------------------------------- access log


@dataclass(frozen=True, slots=True)
class _Access:
    at: float
    dirname: str
    commit: str


class AccessLog:
    """``state/access.log``: when each snapshot was last used by shardsync."""

    def __init__(self, cache: CacheStore, *, clock: Clock = time.time) -> None:
        self.cache = cache
        self._clock = clock

    def record(self, repo: RepoRef, commit: str) -> None:
        """Note that ``commit`` of ``repo`` is being used now. Blocking but brief (one append);
        from an event loop call it through ``asyncio.to_thread``."""
        line = _encode(_Access(self._clock(), repo.dirname, commit))
        lock = self.cache.lock(_LOG_LOCK, shared=True)
        wait_lock(lock, None)
        try:
            size = self.cache.append_state_file(_LOG, data=line)
        finally:
            lock.release()
        if size > MAX_LOG_BYTES:
            self.compact(wait=False)

    def last_used(self) -> dict[tuple[str, str], float]:
        """``{(repo dirname, commit): last use}``; unreadable lines are skipped."""
        data = _read(self.cache.layout.state(_LOG))
        latest: dict[tuple[str, str], float] = {}
        for access in _decode(data):
            key = (access.dirname, access.commit)
            if access.at > latest.get(key, float("-inf")):
                latest[key] = access.at
        return latest

    def compact(self, keep: Iterable[tuple[str, str]] | None = None, *, wait: bool = True) -> bool:
        """Rewrite the log with one line per snapshot, only those in ``keep`` when given.

        Appends wait meanwhile (the log lock), so none is lost. With ``wait=False`` a busy
        lock means another process is compacting or appending: skip (returns False).
        """
        lock = self.cache.lock(_LOG_LOCK)
        if wait:
            wait_lock(lock, None)
        elif not lock.try_acquire():
            return False
        try:
            latest = self.last_used()
            wanted = None if keep is None else set(keep)
            lines = [
                _encode(_Access(at, dirname, commit))
                for (dirname, commit), at in sorted(latest.items(), key=lambda kv: kv[1])
                if wanted is None or (dirname, commit) in wanted
            ]
            self.cache.write_state_file(_LOG, data=b"".join(lines))
        finally:
            lock.release()
        return True


def _encode(access: _Access) -> bytes:
    obj = {"t": round(access.at, 6), "repo": access.dirname, "commit": access.commit}
    return b"\n" + json.dumps(obj, separators=(",", ":")).encode("ascii")


def _decode(data: bytes) -> Iterator[_Access]:
    for raw in data.splitlines():
        try:
            obj = strict_json.loads(raw)
        except ValueError:
            continue  # a torn line from a crash mid-append
        if not isinstance(obj, dict):
            continue
        at, dirname, commit = obj.get("t"), obj.get("repo"), obj.get("commit")
        if isinstance(at, int | float) and isinstance(dirname, str) and isinstance(commit, str):
            yield _Access(float(at), dirname, commit)


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return b""
    except OSError as exc:
        raise CacheError(f"cannot read {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        return f.read(64 * MAX_LOG_BYTES)


# --------------------------------------------------------------------------- processes


@dataclass(frozen=True, slots=True)
class _Identity:
    """What tells one process apart from any other that ever had its pid."""

    pid: int
    start_time: int | None
    boot_id: str | None
    pid_ns: str | None
    host: str


def _boot_id() -> str | None:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    return None


def _pid_ns() -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return None


def _identity(pid: int) -> _Identity:
    found = process_stat(pid)
    if found is None and pid != os.getpid():
        raise CacheError(f"no process {pid} to hold a lease for")
    return _Identity(
        pid=pid,
        start_time=None if found is None else found[1],
        boot_id=_boot_id(),
        pid_ns=_pid_ns(),
        host=socket.gethostname(),
    )


# --------------------------------------------------------------------------- leases


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """One lease file as read back."""

    id: str
    dirname: str
    repo: str  # the repo's name, for people
    commit: str | None  # None: every snapshot of the repo
    owner: str
    pid: int
    start_time: int | None
    boot_id: str | None
    pid_ns: str | None
    host: str
    ttl: float | None
    created_at: float
    heartbeat_at: float  # the file's mtime
    # store blobs (sha256) the holder counts on though no snapshot of its links them yet
    blobs: tuple[str, ...] = ()

    def covers(self, dirname: str, commit: str) -> bool:
        return self.dirname == dirname and self.commit in (None, commit)

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "repo": self.repo,
            "commit": self.commit,
            "owner": self.owner,
            "pid": self.pid,
            "ttl": self.ttl,
            "created_at": self.created_at,
            "heartbeat_at": self.heartbeat_at,
            "blobs": list(self.blobs),
        }


class Lease:
    """A held lease: a context manager (sync or async) that releases it on exit."""

    __slots__ = ("_cache", "_file", "_released", "_written", "id", "info")

    def __init__(self, cache: CacheStore, info: LeaseInfo) -> None:
        self._cache = cache
        self.id = info.id
        self.info = info
        self._released = False
        self._file = threading.Lock()  # a worker's rewrite, or the release
        self._written = frozenset(info.blobs)  # the blobs in the file

    def heartbeat(self) -> None:
        """Keep a ``ttl`` lease alive (cheap: one ``utime``). A no-op once released; a lease
        file already reaped as dead is written again, so a late heartbeat revives it."""
        if self._released:
            return
        if not self._cache.touch_state_file(_LEASES, f"{self.id}.json"):
            _write_lease(self._cache, self.info)

    async def akeep(self, sha256: str) -> None:
        """Protect the store blob ``sha256`` too, before the holder relies on it: a job whose
        snapshot is named by its content links its files only at its end, and a prune that
        evicts another snapshot holding one of them would delete it meanwhile. Under the prune
        gate, so a prune that has not seen it yet has finished: check the blob after this."""
        if sha256 in self._written:
            return
        self._cache.blob_path(sha256)  # validates the name
        if sha256 not in self.info.blobs:
            self.info = replace(self.info, blobs=(*self.info.blobs, sha256))
        # the gate is waited for in the worker: held across an await, a prune run on this
        # loop's thread (a test's, a caller's) would wait for it for ever
        await asyncio.to_thread(self._rewrite)

    def _rewrite(self) -> None:
        gate = prune_gate(self._cache, shared=True)
        wait_lock(gate, None)
        try:
            with self._file:  # the latest ``info``: a write finishing last loses no blob
                if not self._released:
                    info = self.info
                    _write_lease(self._cache, info)
                    self._written = frozenset(info.blobs)
        finally:
            gate.release()

    def release(self) -> None:
        """Stop protecting; idempotent."""
        with self._file:
            if not self._released:
                self._released = True
                self._cache.remove_state_file(_LEASES, f"{self.id}.json")

    @property
    def released(self) -> bool:
        return self._released

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Leases:
    """Take, list and reap the leases of one cache.

    >>> with Leases(cache).hold(repo, commit, owner="my job"):
    ...     use(cache.snapshot_dir(repo, commit))
    """

    def __init__(self, cache: CacheStore, *, clock: Clock = time.time) -> None:
        self.cache = cache
        self._clock = clock

    def hold(
        self,
        repo: RepoRef,
        commit: str | None = None,
        *,
        owner: str,
        ttl: float | None = None,
        pid: int | None = None,
        timeout: float | None = None,
    ) -> Lease:
        """Take a lease now (waiting while a prune deletes, at most ``timeout`` s).

        ``commit`` None covers every snapshot of ``repo`` (a job that does not know its commit
        yet). ``pid`` is whose life the lease follows (default: this process; the daemon may
        name a local client's pid from ``SO_PEERCRED``). ``ttl`` also requires a
        ``heartbeat()`` at least every ``ttl`` seconds.
        """
        info = self._new(repo, commit, owner=owner, ttl=ttl, pid=pid)
        gate = prune_gate(self.cache, shared=True)
        wait_lock(gate, timeout)
        try:
            _write_lease(self.cache, info)
        finally:
            gate.release()
        return Lease(self.cache, info)

    async def ahold(
        self,
        repo: RepoRef,
        commit: str | None = None,
        *,
        owner: str,
        ttl: float | None = None,
        pid: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the wait ends in CacheError
        blobs: Iterable[str] = (),
    ) -> Lease:
        """``hold`` for an event loop: waits on the gate without blocking the loop, and writes
        (fsyncs) the lease in a worker thread. Cancelled meanwhile, the write still finishes
        and the lease is taken back then, so none is left behind that nobody releases.
        ``blobs``: store blobs it protects from the start (``Lease.akeep``)."""
        info = self._new(repo, commit, owner=owner, ttl=ttl, pid=pid)
        info = replace(info, blobs=tuple(blobs))
        for sha256 in info.blobs:
            self.cache.blob_path(sha256)  # validates the name
        lease = Lease(self.cache, info)
        gate = prune_gate(self.cache, shared=True)
        await gate.acquire(poll=_POLL, timeout=timeout)
        try:
            write = asyncio.get_running_loop().run_in_executor(None, _write_lease, self.cache, info)
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:

                def take_back(done: asyncio.Future[None]) -> None:
                    if not done.cancelled() and done.exception() is None:
                        lease.release()

                write.add_done_callback(take_back)
                raise
        finally:
            gate.release()
        return lease

    def all(self) -> tuple[LeaseInfo, ...]:
        """Every readable lease file, alive or not."""
        found = []
        directory = self.cache.layout.state(_LEASES)
        try:
            names = sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return ()
        except OSError as exc:
            raise CacheError(f"cannot list {directory}: {exc.strerror}") from exc
        for name in names:
            lease_id, _, ext = name.partition(".")
            if ext != "json":
                continue
            path = directory / name
            try:
                mtime = os.lstat(path).st_mtime
            except FileNotFoundError:
                continue
            info = _parse_lease(lease_id, _read(path), mtime)
            if info is not None:
                found.append(info)
        return tuple(found)

    def is_alive(self, lease: LeaseInfo, *, now: float | None = None) -> bool:
        """Whether ``lease`` still protects (see the module docstring for the rules)."""
        now = self._clock() if now is None else now
        since = now - lease.heartbeat_at
        if lease.ttl is not None and since > lease.ttl:
            return False
        if lease.boot_id == _boot_id() and lease.pid_ns == _pid_ns():
            return process_alive(lease.pid, lease.start_time)
        if lease.host == socket.gethostname() and lease.boot_id != _boot_id():
            return False  # this machine rebooted since: every process of that boot is gone
        return since <= (lease.ttl if lease.ttl is not None else FOREIGN_LEASE_AGE)

    def live(self, *, now: float | None = None) -> tuple[LeaseInfo, ...]:
        """The leases that protect now."""
        return tuple(lease for lease in self.all() if self.is_alive(lease, now=now))

    def reap(self, *, now: float | None = None) -> int:
        """Delete dead lease files (prune does it); returns how many."""
        dead = [lease for lease in self.all() if not self.is_alive(lease, now=now)]
        for lease in dead:
            self.cache.remove_state_file(_LEASES, f"{lease.id}.json")
        return len(dead)

    def _new(
        self,
        repo: RepoRef,
        commit: str | None,
        *,
        owner: str,
        ttl: float | None,
        pid: int | None,
    ) -> LeaseInfo:
        if ttl is not None and not ttl > 0:
            raise CacheError(f"lease ttl must be positive, got {ttl!r}")
        if commit is not None:
            self.cache.snapshot_dir(repo, commit)  # validates the commit
        who = _identity(os.getpid() if pid is None else pid)
        now = self._clock()
        return LeaseInfo(
            id=secrets.token_hex(12),
            dirname=repo.dirname,
            repo=repo.name,
            commit=commit,
            owner=owner,
            pid=who.pid,
            start_time=who.start_time,
            boot_id=who.boot_id,
            pid_ns=who.pid_ns,
            host=who.host,
            ttl=ttl,
            created_at=now,
            heartbeat_at=now,
        )


def offline_result(
    cache: CacheStore, repo: RepoRef, revision: str, started: float
) -> PrefetchResult:
    """An offline prefetch: a complete snapshot from the cache alone, without a single
    request, its use logged like any other."""
    record = cache.find_complete(repo, revision)
    if record is None:
        raise OfflineError(
            f"{repo.name}@{revision} is not complete in {cache.root}; run prefetch online first"
        )
    AccessLog(cache).record(repo, record.commit)
    files = tuple(
        FileOutcome(f.path, f.size, f.sha256, f.verified, "cache", 0, 0) for f in record.files
    )
    return PrefetchResult(
        repo=repo,
        revision=revision,
        commit=record.commit,
        snapshot_path=cache.snapshot_dir(repo, record.commit),
        files=files,
        bytes_downloaded=0,
        elapsed=time.monotonic() - started,
        fetch=None,
    )


def _write_lease(cache: CacheStore, info: LeaseInfo) -> None:
    obj = {
        "format": _LEASE_FORMAT,
        "repo": info.dirname,
        "name": info.repo,
        "commit": info.commit,
        "owner": info.owner,
        "pid": info.pid,
        "start_time": info.start_time,
        "boot_id": info.boot_id,
        "pid_ns": info.pid_ns,
        "host": info.host,
        "ttl": info.ttl,
        "created_at": info.created_at,
        "blobs": list(info.blobs),
    }
    cache.write_state_file(_LEASES, f"{info.id}.json", data=json.dumps(obj).encode() + b"\n")


def _parse_lease(lease_id: str, data: bytes, mtime: float) -> LeaseInfo | None:
    """A lease file, or None when it is torn or not ours (it then protects nothing)."""
    try:
        obj = strict_json.loads(data)
    except ValueError:
        return None
    if not isinstance(obj, Mapping) or obj.get("format") != _LEASE_FORMAT:
        return None
    try:
        info = LeaseInfo(
            id=lease_id,
            dirname=_typed(obj, "repo", str),
            repo=_typed(obj, "name", str),
            commit=_optional(obj, "commit", str),
            owner=_typed(obj, "owner", str),
            pid=_typed(obj, "pid", int),
            start_time=_optional(obj, "start_time", int),
            boot_id=_optional(obj, "boot_id", str),
            pid_ns=_optional(obj, "pid_ns", str),
            host=_typed(obj, "host", str),
            ttl=_optional_number(obj, "ttl"),
            created_at=_number(obj, "created_at"),
            heartbeat_at=mtime,
            blobs=_strings(obj, "blobs"),
        )
    except (KeyError, TypeError):
        return None
    return info


def _typed(obj: Mapping[str, object], key: str, kind: type[T]) -> T:
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(key)
    return value


def _optional(obj: Mapping[str, object], key: str, kind: type[T]) -> T | None:
    return None if obj.get(key) is None else _typed(obj, key, kind)


def _strings(obj: Mapping[str, object], key: str) -> tuple[str, ...]:
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(key)
    return tuple(value)


def _number(obj: Mapping[str, object], key: str) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(key)
    return float(value)


def _optional_number(obj: Mapping[str, object], key: str) -> float | None:
    return None if obj.get(key) is None else _number(obj, key)
