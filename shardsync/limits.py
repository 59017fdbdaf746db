"""What jobs share on one host: file slots handed out by priority, the bandwidth cap, and
the latency histogram the daemon's metrics show (no I/O, no shardsync imports).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Histogram", "PriorityGate", "TokenBucket"]


class TokenBucket:
    """The daemon's global bandwidth cap: each body read is charged its bytes and answered
    how long its reader pauses (a ``fetch.Throttle``).

    Thread-safe, so the pump threads charge it directly. Awaited on the event loop instead,
    the round trip each read took (with no cap set, too) held every file's reads behind the
    loop's other work: in the daemon, 40% more bytes waited in socket buffers, lost to a
    ``kill -9``. Reads reserve their tokens in arrival order and a read that finds the
    bucket in debt pauses until the debt before it is paid, so connections share the rate
    fairly; a short burst is allowed so small reads do not each pay a pause.
    """

    def __init__(self, rate: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._rate = 0.0
        self._burst = 0.0
        self._tokens = 0.0
        self._stamp = clock()
        self.set_rate(rate)
        self._tokens = self._burst

    @property
    def rate(self) -> float:
        return self._rate

    def set_rate(self, rate: float) -> None:
        """Change the cap (a config reload); 0 removes it."""
        with self._lock:
            self._rate = max(float(rate), 0.0)
            self._burst = max(self._rate / 10, 256 * 1024.0)
            self._tokens = min(self._tokens, self._burst)

    def __call__(self, nbytes: int) -> float:
        """Charge ``nbytes``; the seconds the reader pauses before reading on."""
        if self._rate <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            self._tokens -= nbytes
            return max(0.0, -self._tokens / self._rate)


@dataclass(slots=True)
class _Waiter:
    key: Callable[[], Any]  # the waiter's current sort key
    future: asyncio.Future[None]


class PriorityGate:
    """``slots`` files at a time across all jobs, each freed slot going to the best waiter.

    Keys are read when a slot is handed out, so a job whose priority was raised (another
    client asked for it with a higher one) moves ahead of files that were waiting before.
    A freed slot is handed out on the next loop turn, not at once: the worker that freed it
    asks again for its job's next file synchronously, so that file competes too, and a
    high-priority job keeps its slots instead of losing each one to whoever waited longest.
    """

    def __init__(self, slots: int) -> None:
        self._free = slots
        self._waiters: list[_Waiter] = []
        self._wake_scheduled = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def admit(self, key: Callable[[], Any]) -> AsyncIterator[None]:
        """Hold a slot for the body; ``key()`` orders waiters (smallest first)."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
        else:
            waiter = _Waiter(key, asyncio.get_running_loop().create_future())
            self._waiters.append(waiter)
            self._schedule_wake()
            try:
                await waiter.future
            except asyncio.CancelledError:
                if waiter.future.done() and not waiter.future.cancelled():
                    self._release()  # the slot was handed over just as we were cancelled
                elif waiter in self._waiters:  # else a wake dropped it, cancelled, already
                    self._waiters.remove(waiter)
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self._free += 1
        self._schedule_wake()

    def _schedule_wake(self) -> None:
        if self._free > 0 and self._waiters and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._wake)

    def _wake(self) -> None:
        self._wake_scheduled = False
        while self._free > 0 and self._waiters:
            best = min(self._waiters, key=lambda w: w.key())
            self._waiters.remove(best)
            if not best.future.done():
                best.future.set_result(None)
                self._free -= 1


class Histogram:
    """Cumulative buckets for Prometheus (job latency); a value lands in every bucket >= it."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * len(self.bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self._counts):
            self._counts[i] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        total, out = 0, []
        for bound, n in zip(self.bounds, self._counts, strict=True):
            total += n
            out.append((bound, total))
        return out
