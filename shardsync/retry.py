"""Pure helpers for the fetcher: backoff, Retry-After, verdicts, byte-range arithmetic.

No I/O and no clock: callers pass ``now`` and an ``rng``, so every decision the
fetcher makes about retrying and resuming can be tested exhaustively from tables.
"""

from __future__ import annotations

import asyncio
import bisect
import email.utils
import math
import random
import re
from dataclasses import dataclass
from datetime import UTC
from typing import Literal

import aiohttp

from shardsync.errors import ConfigError, ProtocolError

__all__ = [
    "Backoff",
    "ContentRange",
    "RangeSet",
    "RetryPolicy",
    "Verdict",
    "classify_status",
    "format_range",
    "is_retryable_exception",
    "is_strong_etag",
    "parse_content_range",
    "parse_retry_after",
    "parse_unsatisfied_range",
    "split_ranges",
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


def is_retryable_exception(exc: BaseException) -> bool:
    """Whether a failed request is worth another attempt.

    Connection drops, truncated bodies and timeouts are; TLS certificate or
    handshake failures, bad URLs and everything else are not.
    """
    if isinstance(exc, aiohttp.ClientSSLError):
        return False
    return isinstance(
        exc,
        aiohttp.ClientPayloadError
        | aiohttp.ClientConnectionError
        | asyncio.TimeoutError
        | ConnectionError,
    )


@dataclass(frozen=True, slots=True)
class ContentRange:
    """A satisfied ``Content-Range``: bytes ``start..end`` inclusive, as in HTTP."""

    start: int
    end: int
    total: int | None
    """Complete length, None for ``*``."""


# Digit runs are capped so a hostile header cannot make int() do quadratic work.
_POS = r"([0-9]{1,19})"
_CONTENT_RANGE = re.compile(rf"bytes {_POS}-{_POS}/(?:{_POS}|\*)", re.IGNORECASE)
_UNSATISFIED = re.compile(rf"bytes \*/{_POS}", re.IGNORECASE)


def parse_content_range(value: str) -> ContentRange | None:
    """Parse a 206 ``Content-Range`` (``bytes a-b/N`` or ``bytes a-b/*``).

    Returns None for the unsatisfied form ``bytes */N`` (see
    :func:`parse_unsatisfied_range`); raises ProtocolError for anything malformed
    or impossible (``b < a``, ``b >= N``).
    """
    text = value.strip()
    if _UNSATISFIED.fullmatch(text):
        return None
    match = _CONTENT_RANGE.fullmatch(text)
    if match is None:
        raise ProtocolError(f"malformed Content-Range {value!r}")
    start, end = int(match[1]), int(match[2])
    total = None if match[3] is None else int(match[3])
    if end < start:
        raise ProtocolError(f"Content-Range {value!r} ends before it starts")
    if total is not None and end >= total:
        raise ProtocolError(f"Content-Range {value!r} ends beyond the complete length")
    return ContentRange(start=start, end=end, total=total)


def parse_unsatisfied_range(value: str) -> int:
    """The complete length from a 416's ``Content-Range: bytes */N``."""
    match = _UNSATISFIED.fullmatch(value.strip())
    if match is None:
        raise ProtocolError(f"malformed unsatisfied Content-Range {value!r}")
    return int(match[1])


def format_range(start: int, end: int) -> str:
    """A ``Range`` header value for bytes ``start..end`` inclusive."""
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range {start}-{end}")
    return f"bytes={start}-{end}"


def split_ranges(size: int, chunk_size: int) -> list[tuple[int, int]]:
    """Half-open ``[start, end)`` chunks covering ``[0, size)``; the last may be short."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    return [(start, min(start + chunk_size, size)) for start in range(0, size, chunk_size)]


class RangeSet:
    """Disjoint, merged, half-open byte intervals: which parts of a file are on disk.

    Mutable on purpose (one per partial file, updated as chunks land); persisted
    in the resume sidecar via :meth:`to_list` / :meth:`from_list`.
    """

    __slots__ = ("_ends", "_starts")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        """Mark ``[start, end)`` done, merging with overlapping or touching intervals."""
        _check_interval(start, end)
        if start == end:
            return
        lo = bisect.bisect_left(self._ends, start)
        hi = bisect.bisect_right(self._starts, end)
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def contains(self, start: int, end: int) -> bool:
        """Whether all of ``[start, end)`` is done (an empty range always is)."""
        _check_interval(start, end)
        if start == end:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def missing(self, size: int) -> list[tuple[int, int]]:
        """The gaps in ``[0, size)``, in order: what is still to fetch."""
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        gaps: list[tuple[int, int]] = []
        cursor = 0
        for start, end in zip(self._starts, self._ends, strict=True):
            if start >= size:
                break
            if start > cursor:
                gaps.append((cursor, start))
            cursor = end
        if cursor < size:
            gaps.append((cursor, size))
        return gaps

    def contiguous_prefix(self) -> int:
        """Bytes done from offset 0 without a hole: where a streaming hash can reach."""
        if self._starts and self._starts[0] == 0:
            return self._ends[0]
        return 0

    def total(self) -> int:
        """Bytes done in all."""
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def to_list(self) -> list[list[int]]:
        """JSON-ready ``[[start, end], ...]``, sorted and merged."""
        return [[s, e] for s, e in zip(self._starts, self._ends, strict=True)]

    @classmethod
    def from_list(cls, data: object, size: int) -> RangeSet:
        """Rebuild from :meth:`to_list` output read back from disk, trusting nothing.

        ValueError for anything but non-empty, non-overlapping ``[start, end]``
        pairs of ints within ``[0, size]``.
        """
        if not isinstance(data, list | tuple):
            raise ValueError(f"ranges must be a list, got {type(data).__name__}")
        pairs: list[tuple[int, int]] = []
        for item in data:
            if not isinstance(item, list | tuple) or len(item) != 2:
                raise ValueError(f"range {item!r} is not a [start, end] pair")
            start, end = item
            if not (_is_int(start) and _is_int(end)):
                raise ValueError(f"range {item!r} must hold integers")
            if start < 0 or end <= start:
                raise ValueError(f"range {item!r} is negative or empty")
            if end > size:
                raise ValueError(f"range {item!r} extends beyond the file size {size}")
            pairs.append((start, end))
        pairs.sort()
        result = cls()
        previous_end = 0
        for start, end in pairs:
            if start < previous_end:
                raise ValueError(f"range [{start}, {end}] overlaps another")
            result.add(start, end)
            previous_end = end
        return result

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RangeSet):
            return NotImplemented
        return self._starts == other._starts and self._ends == other._ends

    def __repr__(self) -> str:
        return f"RangeSet({self.to_list()!r})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_interval(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"invalid interval [{start}, {end})")


_ETAG = re.compile(r'"[\x21\x23-\x7e\x80-\xff]+"')


def is_strong_etag(value: str | None) -> bool:
    """Whether ``value`` is a strong entity tag, usable in ``If-Range``.

    Weak tags (``W/"..."``) and unquoted values never prove byte identity, and
    neither does the empty tag ``""``, so resume (promise 3) refuses them.
    """
    return value is not None and _ETAG.fullmatch(value) is not None
