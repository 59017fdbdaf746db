"""Table-driven tests for the pure retry/range helpers; no event loop, no clock."""

from __future__ import annotations

import asyncio
import itertools
import random
import ssl
from datetime import UTC, datetime
from email.utils import format_datetime

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from shardsync.errors import ConfigError, ProtocolError
from shardsync.fetch.answers import is_retryable_exception
from shardsync.ranges import (
    ContentRange,
    RangeSet,
    format_range,
    is_strong_etag,
    parse_content_range,
    parse_unsatisfied_range,
    split_ranges,
    split_tail,
)
from shardsync.retry import Backoff, RetryPolicy, classify_status, parse_retry_after

NOW = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC).timestamp()

# --- Retry-After --------------------------------------------------------------------------

RETRY_AFTER = [
    ("absent", None, None),
    ("seconds", "120", 120.0),
    ("zero", "0", 0.0),
    ("padded", "  7 ", 7.0),
    ("fraction", "1.5", 1.5),
    ("negative", "-5", 0.0),
    ("huge", "9" * 400, float("inf")),
    ("imf-fixdate", "Wed, 01 May 2024 12:00:30 GMT", 30.0),
    ("rfc850", "Wednesday, 01-May-24 12:01:00 GMT", 60.0),
    ("asctime", "Wed May  1 12:00:10 2024", 10.0),
    ("numeric-zone", "Wed, 01 May 2024 14:00:05 +0200", 5.0),
    ("date-in-past", "Wed, 01 May 2024 11:00:00 GMT", 0.0),
    ("garbage", "soon", None),
    ("empty", "", None),
    ("plus-sign", "+5", None),
    ("unicode-digits", "\u0661\u0662", None),
    ("exponent", "1e3", None),
    ("bad-hour", "Wed, 01 May 2024 25:00:00 GMT", None),
    ("half-date", "Wed, 01 May", None),
]


@pytest.mark.parametrize(
    ("value", "expected"), [c[1:] for c in RETRY_AFTER], ids=[c[0] for c in RETRY_AFTER]
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, now=NOW) == expected


def test_parse_retry_after_roundtrips_formatted_date() -> None:
    when = datetime.fromtimestamp(NOW + 42, tz=UTC)
    assert parse_retry_after(format_datetime(when, usegmt=True), now=NOW) == 42.0


# --- RetryPolicy / Backoff ----------------------------------------------------------------

BAD_POLICIES = [
    ("zero-attempts", {"max_attempts": 0}),
    ("bool-attempts", {"max_attempts": True}),
    ("negative-base", {"base_delay": -1.0}),
    ("nan-base", {"base_delay": float("nan")}),
    ("inf-max", {"max_delay": float("inf")}),
    ("max-below-base", {"base_delay": 5.0, "max_delay": 1.0}),
    ("negative-retry-after-cap", {"max_retry_after": -1.0}),
    ("shrinking-multiplier", {"multiplier": 0.5}),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in BAD_POLICIES], ids=[c[0] for c in BAD_POLICIES])
def test_retry_policy_validates(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


class MaxRandom(random.Random):
    """Always draws the top of the interval, exposing the cap itself."""

    def uniform(self, a: float, b: float) -> float:
        return b


class MinRandom(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return a


def test_backoff_grows_exponentially_to_the_cap() -> None:
    policy = RetryPolicy(max_attempts=10, base_delay=0.5, max_delay=5.0, multiplier=2.0)
    backoff = Backoff(policy, rng=MaxRandom())
    delays = [backoff.next_delay() for _ in range(9)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    assert backoff.attempts == 9


def test_backoff_full_jitter_stays_within_bounds() -> None:
    policy = RetryPolicy(max_attempts=1000, base_delay=0.5, max_delay=30.0)
    backoff = Backoff(policy, rng=random.Random(1234))
    delays: list[float] = []
    for attempt in range(1, 200):
        delay = backoff.next_delay()
        assert delay is not None
        assert 0.0 <= delay <= min(30.0, 0.5 * 2.0 ** (attempt - 1))
        delays.append(delay)
    # Jittered, not constant: late delays spread over the capped interval.
    assert min(delays[20:]) < 10.0 < max(delays[20:])


def test_backoff_is_reproducible_with_a_seeded_rng() -> None:
    def run() -> list[float | None]:
        backoff = Backoff(RetryPolicy(), rng=random.Random(7))
        return [backoff.next_delay() for _ in range(8)]

    assert run() == run()


def test_backoff_exhausts_after_max_attempts() -> None:
    backoff = Backoff(RetryPolicy(max_attempts=3), rng=random.Random(0))
    assert backoff.next_delay() is not None
    assert backoff.next_delay() is not None
    assert backoff.next_delay() is None
    assert backoff.next_delay() is None
    assert backoff.attempts == 4


def test_backoff_single_attempt_never_retries() -> None:
    assert Backoff(RetryPolicy(max_attempts=1)).next_delay() is None


def test_backoff_reset_restores_the_budget() -> None:
    backoff = Backoff(RetryPolicy(max_attempts=3, base_delay=1.0), rng=MaxRandom())
    assert [backoff.next_delay(), backoff.next_delay()] == [1.0, 2.0]
    backoff.reset()
    assert backoff.attempts == 0
    assert [backoff.next_delay(), backoff.next_delay(), backoff.next_delay()] == [1.0, 2.0, None]


def test_backoff_survives_exponent_overflow() -> None:
    policy = RetryPolicy(max_attempts=5000, base_delay=1.0, max_delay=9.0, multiplier=10.0)
    backoff = Backoff(policy, rng=MaxRandom())
    delays = [backoff.next_delay() for _ in range(2000)]
    assert delays[-1] == 9.0


RETRY_AFTER_DELAYS = [
    ("longer-than-jitter", 10.0, 10.0),
    ("shorter-than-jitter", 0.1, 1.0),
    ("huge-clamped", 1e9, 120.0),
    ("infinite-clamped", float("inf"), 120.0),
    ("negative-floored", -3.0, 1.0),
    ("nan-ignored", float("nan"), 1.0),
    ("none", None, 1.0),
]


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [c[1:] for c in RETRY_AFTER_DELAYS],
    ids=[c[0] for c in RETRY_AFTER_DELAYS],
)
def test_backoff_honours_clamped_retry_after(retry_after: float | None, expected: float) -> None:
    backoff = Backoff(RetryPolicy(base_delay=1.0), rng=MaxRandom())
    assert backoff.next_delay(retry_after) == expected


def test_backoff_retry_after_floor_with_min_jitter() -> None:
    backoff = Backoff(RetryPolicy(max_retry_after=60.0), rng=MinRandom())
    assert backoff.next_delay(parse_retry_after("3600", now=NOW)) == 60.0


def test_backoff_retry_after_still_spends_the_budget() -> None:
    backoff = Backoff(RetryPolicy(max_attempts=2))
    assert backoff.next_delay(1.0) == 1.0
    assert backoff.next_delay(1.0) is None


# --- classify_status / is_retryable_exception ---------------------------------------------

STATUSES = [
    (408, "retry"),
    (425, "retry"),
    (429, "retry"),
    (500, "retry"),
    (502, "retry"),
    (503, "retry"),
    (504, "retry"),
    (507, "retry"),
    (599, "retry"),
    (401, "relocate"),
    (403, "relocate"),
    (412, "restart"),
    (416, "restart"),
    (400, "fatal"),
    (404, "fatal"),
    (410, "fatal"),
    (451, "fatal"),
    (304, "fatal"),
    (600, "fatal"),
]


@pytest.mark.parametrize(("status", "verdict"), STATUSES, ids=[str(s) for s, _ in STATUSES])
def test_classify_status(status: int, verdict: str) -> None:
    assert classify_status(status) == verdict


@pytest.mark.parametrize("status", [200, 206], ids=["200", "206"])
def test_classify_status_refuses_success(status: int) -> None:
    with pytest.raises(ValueError):
        classify_status(status)


KEY = ConnectionKey("cdn.invalid", 443, True, True, None, None, None, None)

EXCEPTIONS: list[tuple[str, BaseException, bool]] = [
    ("payload", aiohttp.ClientPayloadError("cut"), True),
    ("server-disconnected", aiohttp.ServerDisconnectedError(), True),
    ("connection", aiohttp.ClientConnectionError(), True),
    ("client-os", aiohttp.ClientOSError(104, "reset"), True),
    ("server-timeout", aiohttp.ServerTimeoutError(), True),
    ("timeout", TimeoutError(), True),
    ("connection-reset", ConnectionResetError(), True),
    ("broken-pipe", BrokenPipeError(), True),
    (
        "ssl-certificate",
        aiohttp.ClientConnectorCertificateError(KEY, ssl.SSLCertVerificationError("bad")),
        False,
    ),
    ("ssl-handshake", aiohttp.ClientConnectorSSLError(KEY, ssl.SSLError("bad")), False),
    ("invalid-url", aiohttp.InvalidURL("x"), False),
    ("too-many-redirects", aiohttp.TooManyRedirects(None, ()), False),  # type: ignore[arg-type]
    ("value-error", ValueError("x"), False),
    ("permission", PermissionError(), False),
    ("cancelled", asyncio.CancelledError(), False),
    ("keyboard", KeyboardInterrupt(), False),
]


@pytest.mark.parametrize(
    ("exc", "expected"), [c[1:] for c in EXCEPTIONS], ids=[c[0] for c in EXCEPTIONS]
)
def test_is_retryable_exception(exc: BaseException, expected: bool) -> None:
    assert is_retryable_exception(exc) is expected


# --- Content-Range ------------------------------------------------------------------------

CONTENT_RANGES = [
    ("full", "bytes 0-99/100", ContentRange(0, 99, 100)),
    ("middle", "bytes 10-19/100", ContentRange(10, 19, 100)),
    ("one-byte", "bytes 5-5/6", ContentRange(5, 5, 6)),
    ("unknown-total", "bytes 0-9/*", ContentRange(0, 9, None)),
    ("unit-case", "Bytes 0-9/10", ContentRange(0, 9, 10)),
    ("padded", " bytes 0-9/10 ", ContentRange(0, 9, 10)),
    ("big", "bytes 0-1099511627775/1099511627776", ContentRange(0, 2**40 - 1, 2**40)),
    ("unsatisfied", "bytes */100", None),
]


@pytest.mark.parametrize(
    ("value", "expected"), [c[1:] for c in CONTENT_RANGES], ids=[c[0] for c in CONTENT_RANGES]
)
def test_parse_content_range(value: str, expected: ContentRange | None) -> None:
    assert parse_content_range(value) == expected


BAD_CONTENT_RANGES = [
    ("empty", ""),
    ("garbage", "nonsense"),
    ("wrong-unit", "items 0-9/10"),
    ("no-unit", "0-9/10"),
    ("equals-sign", "bytes=0-9/10"),
    ("no-total", "bytes 0-9"),
    ("open-end", "bytes 0-/10"),
    ("suffix", "bytes -9/10"),
    ("negative", "bytes -1-9/10"),
    ("inverted", "bytes 9-0/10"),
    ("end-equals-total", "bytes 0-10/10"),
    ("beyond-total", "bytes 50-150/100"),
    ("zero-total", "bytes 0-0/0"),
    ("multiple", "bytes 0-1/10, 3-4/10"),
    ("unicode-digits", "bytes \u0660-\u0669/10"),
    ("too-many-digits", "bytes 0-1/" + "9" * 30),
    ("double-space", "bytes  0-9/10"),
]


@pytest.mark.parametrize(
    "value", [c[1] for c in BAD_CONTENT_RANGES], ids=[c[0] for c in BAD_CONTENT_RANGES]
)
def test_parse_content_range_rejects(value: str) -> None:
    with pytest.raises(ProtocolError):
        parse_content_range(value)


UNSATISFIED = [
    ("plain", "bytes */100", 100),
    ("zero", "bytes */0", 0),
    ("padded", " bytes */7 ", 7),
]


@pytest.mark.parametrize(
    ("value", "expected"), [c[1:] for c in UNSATISFIED], ids=[c[0] for c in UNSATISFIED]
)
def test_parse_unsatisfied_range(value: str, expected: int) -> None:
    assert parse_unsatisfied_range(value) == expected


BAD_UNSATISFIED = [
    ("satisfied-form", "bytes 0-9/10"),
    ("star-total", "bytes */*"),
    ("garbage", "bytes */abc"),
    ("negative", "bytes */-1"),
    ("empty", ""),
]


@pytest.mark.parametrize(
    "value", [c[1] for c in BAD_UNSATISFIED], ids=[c[0] for c in BAD_UNSATISFIED]
)
def test_parse_unsatisfied_range_rejects(value: str) -> None:
    with pytest.raises(ProtocolError):
        parse_unsatisfied_range(value)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [(0, 0, "bytes=0-0"), (0, 99, "bytes=0-99"), (100, 2**40, f"bytes=100-{2**40}")],
    ids=["one-byte", "first-hundred", "large"],
)
def test_format_range(start: int, end: int, expected: str) -> None:
    assert format_range(start, end) == expected


@pytest.mark.parametrize(("start", "end"), [(-1, 5), (5, 4)], ids=["negative", "inverted"])
def test_format_range_rejects(start: int, end: int) -> None:
    with pytest.raises(ValueError):
        format_range(start, end)


# --- split_ranges -------------------------------------------------------------------------

SPLITS = [
    ("empty", 0, 4, []),
    ("smaller-than-chunk", 3, 4, [(0, 3)]),
    ("exact-one", 4, 4, [(0, 4)]),
    ("exact-multiple", 12, 4, [(0, 4), (4, 8), (8, 12)]),
    ("remainder", 10, 4, [(0, 4), (4, 8), (8, 10)]),
    ("byte-chunks", 3, 1, [(0, 1), (1, 2), (2, 3)]),
]


@pytest.mark.parametrize(
    ("size", "chunk", "expected"), [c[1:] for c in SPLITS], ids=[c[0] for c in SPLITS]
)
def test_split_ranges(size: int, chunk: int, expected: list[tuple[int, int]]) -> None:
    assert split_ranges(size, chunk) == expected


@pytest.mark.parametrize(
    ("size", "chunk"), [(-1, 4), (10, 0), (10, -4)], ids=["negative-size", "zero", "negative"]
)
def test_split_ranges_rejects(size: int, chunk: int) -> None:
    with pytest.raises(ValueError):
        split_ranges(size, chunk)


# --- split_tail -------------------------------------------------------------------------


def test_the_last_round_of_ranges_is_cut_finer_and_still_covers_the_file() -> None:
    pieces = split_ranges(100, 16)  # 6 of 16 and one of 4
    cut = split_tail(pieces, 2, 4, 3)
    assert cut[:5] == pieces[:5]
    assert cut[5:] == [(80, 84), (84, 88), (88, 92), (92, 96), (96, 100)]  # 4: no cut
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cut)) and cut[-1][1] == 100


def test_no_tail_piece_is_cut_below_the_smallest() -> None:
    assert split_tail([(0, 5), (5, 10)], 2, 4, 3) == [(0, 5), (5, 10)]
    assert split_tail([(0, 12)], 5, 4, 3) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert split_tail([(0, 12)], 0, 4, 3) == [(0, 12)]  # no last round: untouched


# --- RangeSet -----------------------------------------------------------------------------

ADDS: list[tuple[str, list[tuple[int, int]], list[list[int]]]] = [
    ("nothing", [], []),
    ("one", [(0, 10)], [[0, 10]]),
    ("empty-interval-ignored", [(5, 5)], []),
    ("disjoint-sorted", [(20, 30), (0, 10)], [[0, 10], [20, 30]]),
    ("adjacent-merge", [(0, 10), (10, 20)], [[0, 20]]),
    ("adjacent-merge-left", [(10, 20), (0, 10)], [[0, 20]]),
    ("overlap-merge", [(0, 10), (5, 15)], [[0, 15]]),
    ("contained", [(0, 100), (10, 20)], [[0, 100]]),
    ("bridge-many", [(0, 5), (10, 15), (20, 25), (30, 35), (3, 32)], [[0, 35]]),
    ("bridge-touching", [(0, 5), (10, 15), (5, 10)], [[0, 15]]),
    (
        "swallow-middle",
        [(0, 1), (10, 15), (20, 25), (50, 51), (8, 30)],
        [[0, 1], [8, 30], [50, 51]],
    ),
    ("duplicate", [(3, 7), (3, 7)], [[3, 7]]),
    ("out-of-order-chunks", [(8, 12), (4, 8), (0, 4), (16, 20)], [[0, 12], [16, 20]]),
]


@pytest.mark.parametrize(("adds", "expected"), [c[1:] for c in ADDS], ids=[c[0] for c in ADDS])
def test_rangeset_add_merges(adds: list[tuple[int, int]], expected: list[list[int]]) -> None:
    ranges = RangeSet()
    for start, end in adds:
        ranges.add(start, end)
    assert ranges.to_list() == expected
    assert ranges.total() == sum(e - s for s, e in expected)


def test_rangeset_add_matches_a_brute_force_model() -> None:
    rng = random.Random(99)
    for _ in range(200):
        ranges = RangeSet()
        model: set[int] = set()
        for _ in range(rng.randrange(1, 12)):
            start = rng.randrange(0, 60)
            end = start + rng.randrange(0, 15)
            ranges.add(start, end)
            model.update(range(start, end))
        covered = {i for s, e in ranges.to_list() for i in range(s, e)}
        assert covered == model
        pairs = ranges.to_list()
        assert all(a[1] < b[0] for a, b in itertools.pairwise(pairs))
        assert ranges.missing(80) == _model_gaps(model, 80)


def _model_gaps(model: set[int], size: int) -> list[tuple[int, int]]:
    gaps: list[tuple[int, int]] = []
    for i in range(size):
        if i not in model:
            if gaps and gaps[-1][1] == i:
                gaps[-1] = (gaps[-1][0], i + 1)
            else:
                gaps.append((i, i + 1))
    return gaps


@pytest.mark.parametrize(("start", "end"), [(-1, 3), (5, 2)], ids=["negative", "inverted"])
def test_rangeset_add_rejects(start: int, end: int) -> None:
    with pytest.raises(ValueError):
        RangeSet().add(start, end)


CONTAINS = [
    ("inside", 2, 8, True),
    ("exact", 0, 10, True),
    ("empty-range", 50, 50, True),
    ("crosses-gap", 5, 25, False),
    ("in-gap", 12, 18, False),
    ("starts-before", 15, 22, False),
    ("second-interval", 20, 30, True),
    ("past-end", 25, 31, False),
    ("after-all", 40, 41, False),
]


@pytest.mark.parametrize(
    ("start", "end", "expected"), [c[1:] for c in CONTAINS], ids=[c[0] for c in CONTAINS]
)
def test_rangeset_contains(start: int, end: int, expected: bool) -> None:
    ranges = RangeSet.from_list([[0, 10], [20, 30]], 100)
    assert ranges.contains(start, end) is expected


MISSING = [
    ("empty-set", [], 10, [(0, 10)]),
    ("complete", [[0, 10]], 10, []),
    ("size-zero", [], 0, []),
    ("hole-front", [[5, 10]], 10, [(0, 5)]),
    ("hole-back", [[0, 5]], 10, [(5, 10)]),
    ("holes", [[2, 4], [6, 8]], 10, [(0, 2), (4, 6), (8, 10)]),
    ("smaller-size-query", [[2, 4], [6, 8]], 5, [(0, 2), (4, 5)]),
]


@pytest.mark.parametrize(
    ("data", "size", "expected"), [c[1:] for c in MISSING], ids=[c[0] for c in MISSING]
)
def test_rangeset_missing(
    data: list[list[int]], size: int, expected: list[tuple[int, int]]
) -> None:
    assert RangeSet.from_list(data, 10).missing(size) == expected


PREFIXES = [
    ("empty", [], 0),
    ("from-zero", [[0, 7]], 7),
    ("hole-at-zero", [[1, 7]], 0),
    ("first-only", [[0, 3], [4, 9]], 3),
]


@pytest.mark.parametrize(
    ("data", "expected"), [c[1:] for c in PREFIXES], ids=[c[0] for c in PREFIXES]
)
def test_rangeset_contiguous_prefix(data: list[list[int]], expected: int) -> None:
    assert RangeSet.from_list(data, 10).contiguous_prefix() == expected


def test_rangeset_roundtrip_and_equality() -> None:
    ranges = RangeSet()
    for start, end in [(30, 40), (0, 10), (10, 12)]:
        ranges.add(start, end)
    restored = RangeSet.from_list(ranges.to_list(), 40)
    assert restored == ranges
    assert restored != RangeSet()
    assert repr(restored) == "RangeSet([[0, 12], [30, 40]])"
    assert RangeSet.from_list([[5, 6], [0, 2]], 10).to_list() == [[0, 2], [5, 6]]
    assert RangeSet.from_list([[0, 2], [2, 4]], 10).to_list() == [[0, 4]]


BAD_LISTS: list[tuple[str, object]] = [
    ("not-a-list", {"a": 1}),
    ("string", "0-10"),
    ("pair-not-list", [5]),
    ("triple", [[0, 1, 2]]),
    ("float", [[0, 1.5]]),
    ("bool", [[False, True]]),
    ("string-ints", [["0", "1"]]),
    ("negative", [[-1, 5]]),
    ("empty-interval", [[3, 3]]),
    ("inverted", [[5, 3]]),
    ("beyond-size", [[0, 11]]),
    ("overlap", [[0, 5], [4, 8]]),
    ("overlap-unsorted", [[4, 8], [0, 5]]),
    ("contained", [[0, 10], [2, 3]]),
]


@pytest.mark.parametrize("data", [c[1] for c in BAD_LISTS], ids=[c[0] for c in BAD_LISTS])
def test_rangeset_from_list_rejects(data: object) -> None:
    with pytest.raises(ValueError):
        RangeSet.from_list(data, 10)


# --- ETags --------------------------------------------------------------------------------

ETAGS = [
    ("strong", '"abc123"', True),
    ("sha256-like", '"' + "a" * 64 + '"', True),
    ("weak", 'W/"abc"', False),
    ("unquoted", "abc", False),
    ("empty-quoted", '""', False),
    ("none", None, False),
    ("empty", "", False),
    ("half-quoted", '"abc', False),
    ("inner-quote", '"a"b"', False),
    ("space-inside", '"a b"', False),
    ("lowercase-weak", 'w/"abc"', False),
]


@pytest.mark.parametrize(("value", "expected"), [c[1:] for c in ETAGS], ids=[c[0] for c in ETAGS])
def test_is_strong_etag(value: str | None, expected: bool) -> None:
    assert is_strong_etag(value) is expected
