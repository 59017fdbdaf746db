"""One job's events as the scheduler keeps them: the log late subscribers replay, and the
counters ``info`` folds from it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from shardsync.events import (
    TERMINAL_EVENTS,
    FileFailed,
    FileStarted,
    JobEvent,
    Progress,
    Resolved,
    Verified,
)

__all__ = ["EventLog", "JobCounters"]

_Event = TypeVar("_Event", bound=JobEvent)


class EventLog:
    """Every event of one job, replayed to late subscribers, then live.

    The log stamps what it takes with the job's id, the event's number and the time, so an
    event mirrored from another job (``Scheduler._follow``) becomes this job's own.
    Progress events are compacted: a new one for a file replaces the previous one, so a
    subscriber joining a long download replays the files' current progress, not every step
    of it, and the log holds what is live, however many steps a day-long download took.
    """

    def __init__(self, job_id: str, *, clock: Callable[[], float] = time.time) -> None:
        self.job_id = job_id
        self._clock = clock
        self._events: dict[int, JobEvent] = {}  # by seq, in seq order; replaced ones gone
        self._next = 0
        self._progress_at: dict[str, int] = {}
        self._changed = asyncio.Event()
        self.closed = False

    def __len__(self) -> int:
        """How many events were logged (the next one's ``seq``), replaced ones included."""
        return self._next

    def append(self, event: _Event) -> _Event:
        """Stamp ``event`` and log it; returns it as logged."""
        if self.closed:
            raise RuntimeError("the job's event log is closed")
        event = replace(event, job=self.job_id, seq=self._next, time=self._clock())
        self._next += 1
        if isinstance(event, Progress):
            old = self._progress_at.get(event.path)
            if old is not None:
                del self._events[old]
            self._progress_at[event.path] = event.seq
        self._events[event.seq] = event
        if isinstance(event, TERMINAL_EVENTS):
            self.closed = True
        self._changed.set()
        self._changed = asyncio.Event()
        return event

    def past(self) -> list[JobEvent]:
        return list(self._events.values())

    async def follow(self, since: int = 0) -> AsyncIterator[JobEvent]:
        """Events with ``seq >= since``, then new ones until the job's terminal event."""
        pos = max(since, 0)
        while True:
            while pos < self._next:
                if self._next - pos > len(self._events):  # far behind: what is live is less
                    batch = [e for seq, e in self._events.items() if seq >= pos]
                else:
                    found = (self._events.get(seq) for seq in range(pos, self._next))
                    batch = [e for e in found if e is not None]
                pos = self._next
                for event in batch:
                    yield event
            if self.closed:
                return
            await self._changed.wait()


@dataclass(slots=True)
class JobCounters:
    """A job's files and bytes as ``info`` reports them: a fold over the events it logs."""

    files_total: int | None = None
    bytes_total: int | None = None
    files_verified: int = 0
    bytes_downloaded: int = 0
    done_by_path: dict[str, int] = field(default_factory=dict)
    verified_paths: set[str] = field(default_factory=set)

    def repeats(self, event: JobEvent) -> bool:
        """Whether ``event`` is about a file this job verified already (not to be logged): a
        follower mirrors what it verified itself, and verifies again, on its own, what it
        mirrored when the job it followed is cancelled. A file is verified once per job."""
        match event:
            case Verified(outcome=outcome):
                return outcome.path in self.verified_paths
            case FileStarted() | Progress() | FileFailed():
                return event.path in self.verified_paths
        return False

    @property
    def bytes_done(self) -> int:
        return sum(self.done_by_path.values())

    def observe(self, event: JobEvent) -> None:
        match event:
            case Resolved():
                self.files_total = len(event.files)
                self.bytes_total = event.total_size
            case Progress():
                self.done_by_path[event.path] = event.done
            case Verified(outcome=outcome):
                self.verified_paths.add(outcome.path)
                self.done_by_path[outcome.path] = outcome.size
                self.files_verified += 1
                self.bytes_downloaded += outcome.downloaded
