"""How many connections a file's transfer should hold (pure: no I/O, no clock).

Connections help only while they bring more bytes per second: past what this host can take
in (CPU for hashing and copying, the disk), an extra connection only parks more bytes in
kernel socket buffers, sent by the server but not in the file yet, and lost to a ``kill
-9``. Against nginx on a 2-core box, 16 connections per file at 25 MB/s each made five kills
cost +72% of the model and 4 made them cost +5%; yet where each connection is capped and the
host has room, 16 finish sooner than 8 (2.5 s against 3.3 s for 2 GB). So a transfer starts
with a few and climbs: each step adds half again and is kept only if the rate grew by at least
half of what the step would bring on a per-connection-capped link; a step that does not pay,
looked at twice as long, is undone and tried again a little later (``bench/README.md`` has
the alternatives measured).
"""

from __future__ import annotations

__all__ = ["ConnectionRamp"]


class ConnectionRamp:
    """Hill-climbing on one file's connection count, fed the rate of each interval.

    After a change, one interval is skipped (new connections are still starting) and the
    next ``samples`` are averaged. A step that did not pay is looked at for up to ``samples``
    more intervals, then undone if the average of all still says so, and tried again after
    ``pause`` intervals. Rates are noisy (nginx's ``limit_rate`` sends each connection's
    bytes in bursts of up to 2 MB, so a file's rate jumps by +-40% per 0.1 s), and a file
    stepped back by a noisy look ends last and sets the whole download's time: looking twice
    as long before undoing took the capped benchmark from 3.13-3.49 s to 3.07-3.23 s.
    """

    def __init__(self, most: int, *, payoff: float = 0.5, samples: int = 2, pause: int = 4) -> None:
        self.most = most
        self.payoff = payoff
        self.samples = samples
        self.pause = pause
        self.count = min(most, max(4, most // 4))  # a quarter; all of them up to 4
        self._skip = 1  # intervals to let pass before measuring
        self._rates: list[float] = []
        self._before: tuple[int, float] | None = None  # (count, rate) before the step on trial

    def grant(self, extra: int) -> int:
        """Take ``extra`` connections that another transfer let go of as it ended: not on
        trial (the host was carrying them), measured afresh from here."""
        self.count = min(self.most, self.count + extra)
        self._before, self._rates, self._skip = None, [], 1
        return self.count

    def observe(self, rate: float) -> int:
        """The connection count to hold next, given the bytes/s of the interval just ended."""
        if self.count >= self.most and self._before is None:
            return self.count
        if self._skip:
            self._skip -= 1
            return self.count
        self._rates.append(rate)
        if len(self._rates) < self.samples:
            return self.count
        if self._before is not None:
            count, was = self._before
            paid = sum(self._rates) / len(self._rates) >= was * (
                1 + self.payoff * (self.count - count) / count
            )
            if not paid and len(self._rates) < 2 * self.samples:
                return self.count  # not clear yet: look as long again before undoing
            self._before = None
            if not paid:
                self._rates = []
                self.count, self._skip = count, self.pause  # did not pay: undo, try later
                return self.count
        rate, self._rates = sum(self._rates[-self.samples :]) / self.samples, []
        if self.count < self.most:
            self._before = (self.count, rate)
            self.count = min(self.most, self.count + max(1, self.count // 2))
            self._skip = 1
        return self.count
