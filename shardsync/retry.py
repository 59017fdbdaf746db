"""Pure retry decisions for the fetcher: backoff, Retry-After, status verdicts.

No I/O and no clock: callers pass ``now`` and an ``rng``, so every decision the
fetcher makes about retrying and resuming can be tested exhaustively from tables.
"""

from __future__ import annotations

import email.utils
import math
import random
import re
from dataclasses import dataclass
from datetime import UTC
from typing import Literal

from shardsync.errors import ConfigError

__all__ = [
    "Backoff",
    "RetryPolicy",
    "Verdict",
    "classify_status",
    "parse_retry_after",
]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard to retry one file. Every bound is finite (promise 4)."""

    max_attempts: int = 8
    """Consecutive failed attempts per file without progress before giving up."""
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_retry_after: float = 120.0
    """A server's ``Retry-After`` is clamped to ``[0, max_retry_after]``."""
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ConfigError(f"max_attempts must be an int, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("base_delay", "max_delay", "max_retry_after"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.max_delay < self.base_delay:
            raise ConfigError(
                f"max_delay ({self.max_delay}) must be >= base_delay ({self.base_delay})"
            )
        if not math.isfinite(self.multiplier) or self.multiplier < 1:
            raise ConfigError(f"multiplier must be a finite number >= 1, got {self.multiplier!r}")


class Backoff:
    """Per-file attempt counter: exponential backoff with full jitter; budget resets on progress.

    Full jitter (a uniform draw in ``[0, cap]``) spreads the retries of many
    parallel range requests that failed together, instead of re-synchronising them.
    """

    __slots__ = ("_attempts", "_policy", "_rng")

    def __init__(self, policy: RetryPolicy, *, rng: random.Random | None = None) -> None:
        self._policy = policy
        self._rng = rng if rng is not None else random.Random()
        self._attempts = 0

    @property
    def attempts(self) -> int:
        """Failed attempts recorded since the last progress."""
        return self._attempts

    def next_delay(self, retry_after: float | None = None) -> float | None:
        """Record a failed attempt; return how long to sleep, or None when the budget is spent.

        With ``retry_after`` (seconds, from the server) the delay is at least the
        clamped ``retry_after``, so we never come back sooner than asked.
        """
        policy = self._policy
        self._attempts += 1
        if self._attempts >= policy.max_attempts:
            return None
        try:
            growth = policy.multiplier ** (self._attempts - 1)
            cap = min(policy.max_delay, policy.base_delay * growth)
        except OverflowError:
            cap = policy.max_delay
        delay = self._rng.uniform(0.0, cap)
        if retry_after is not None and not math.isnan(retry_after):
            delay = max(delay, min(max(retry_after, 0.0), policy.max_retry_after))
        return delay

    def reset(self) -> None:
        """Give the file its full budget again: the last attempt wrote bytes."""
        self._attempts = 0

    def __repr__(self) -> str:
        return f"Backoff(attempts={self._attempts}, policy={self._policy!r})"


_SECONDS = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Seconds to wait according to a ``Retry-After`` header, or None if absent or garbage.

    Accepts delay-seconds and every HTTP-date form of RFC 9110 (IMF-fixdate,
    RFC 850, asctime; dates without a zone are GMT). A date in the past or a
    negative number gives 0. Not clamped: :class:`Backoff` applies the policy's cap.
    """
    if value is None:
        return None
    text = value.strip()
    if _SECONDS.fullmatch(text):
        return max(float(text), 0.0)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(when.timestamp() - now, 0.0)


Verdict = Literal["retry", "fatal", "restart", "relocate"]

_RETRY_STATUSES = frozenset({408, 425, 429})


def classify_status(status: int) -> Verdict:
    """What to do after an error status.

    ``retry``: transient, back off and try again. ``relocate``: 401/403, a signed
    CDN URL may have expired; ask the origin for a fresh URL (the caller decides
    whether that is an auth error). ``restart``: the object changed under us
    (412 from a failed precondition, 416 when the caller did not resolve it from
    ``Content-Range``); drop the partial and start over. ``fatal``: anything else.
    """
    if 200 <= status < 300:
        raise ValueError(f"status {status} is not an error")
    if status in _RETRY_STATUSES or 500 <= status < 600:
        return "retry"
    if status in (401, 403):
        return "relocate"
    if status in (412, 416):
        return "restart"
    return "fatal"
