"""Fault injection for the fake hub: what can go wrong between a client and the Hub or its CDN.

A test describes faults as small frozen values and adds them to the hub's `FaultPlan`::

    hub.faults.add(CutBody(times=2, path="model-00002*"))      # next 2 bodies of shard 2 end early
    hub.faults.add(Status(429, retry_after="3"))               # next CDN answer is a 429
    hub.faults.add(Bandwidth(4 << 20, server="any"))           # every body paced at 4 MiB/s

Some faults change what the origin *holds*, not just how a response travels, so that a client
that skips a check publishes bytes that differ from the origin's: `ShiftedRange` answers a Range
request with the bytes of another range (and says so), `ReplaceObject` swaps the object at a URL
for new content with a new ETag (mid-download with ``after``, or between runs), `NoEtag` takes
away the validator a client could resume with, and `FlipByte` on ``server="hub"`` corrupts a
small file the Hub serves directly (no CDN, no sha256 in the listing: only its git blob id).

Every fault selects requests by ``server`` (``"cdn"`` by default, ``"hub"`` or ``"any"``) and by
``path``, an `fnmatch` glob on the repository file path (API calls have the path ``""``, which
only ``"*"`` matches). ``times`` is how many matching responses it affects before it is used
up; ``None`` means forever. A fault is only used up by a response it can affect: body faults
need a response with content (a GET, not a HEAD or a redirect), range faults such a response
to a request carrying ``Range``.

When several faults match one response, the first matching fault of each kind applies. A
`Status` fault replaces the whole response and a `Stall` replaces the body, so while one of them
fires the body faults wait for a later response; the ambient faults (`Bandwidth`, `Latency`,
`ChangeEtag`) apply alongside anything.

Positions (`CutBody.at`, `FlipByte.offset`) count bytes of the response body, not of the file;
``None`` picks one at random from the plan's seeded generator, so a failing test replays.

The plan is thread-safe: a test thread adds faults while the hub's loop (possibly in another
thread, see `serve_in_thread`) consumes them.
"""

from __future__ import annotations

import enum
import hashlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import ClassVar, Literal

__all__ = [
    "Bandwidth",
    "ChangeEtag",
    "ChunkedBody",
    "CutBody",
    "Effects",
    "Fault",
    "FaultPlan",
    "FaultRequest",
    "FlipByte",
    "IgnoreIfRange",
    "IgnoreRange",
    "Latency",
    "NoEtag",
    "Pacer",
    "ReplaceObject",
    "Rule",
    "Server",
    "ShiftedRange",
    "SlowDrip",
    "Stall",
    "Status",
    "WrongContentRange",
]

Server = Literal["hub", "cdn", "any"]

_SERVERS: frozenset[str] = frozenset({"hub", "cdn", "any"})


class _Scope(enum.Enum):
    """Which responses a kind of fault can affect (and so be used up by)."""

    ANY = "any response"
    BODY = "a response carrying a body"
    RANGE = "a response carrying a body, to a Range request"


class _Role(enum.Enum):
    """How a fault combines with others firing on the same response."""

    AMBIENT = "applies alongside anything"
    REPLACES_RESPONSE = "the response becomes an error"
    REPLACES_BODY = "the body is never sent"
    BODY = "modifies the body or its headers"


@dataclass(frozen=True, slots=True)
class FaultRequest:
    """What the fault plan needs to know about a response about to be sent."""

    server: Literal["hub", "cdn"]
    path: str
    """The repository file path, "" for API calls."""
    has_body: bool
    """A GET answered with content (not a HEAD, not a redirect)."""
    has_range: bool
    """The request carries a ``Range`` header."""
    asked_before: bool = False
    """The same file and ``Range`` were asked for before: a client's second look."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Fault:
    times: int | None = 1
    path: str = "*"
    server: Server = "cdn"
    asked_again: bool = False
    """Only requests for what was asked before. A client that hands an answer it cannot read
    to another reader (shardsync's pump, a chunked body) asks the first ranges twice, and
    only the second answer is read: a fault spent on the first tests nothing."""

    scope: ClassVar[_Scope] = _Scope.BODY
    role: ClassVar[_Role] = _Role.BODY

    def __post_init__(self) -> None:
        if self.times is not None and self.times < 1:
            raise ValueError(f"times must be None or >= 1, not {self.times}")
        if self.server not in _SERVERS:
            raise ValueError(f"server must be one of {sorted(_SERVERS)}, not {self.server!r}")

    def matches(self, request: FaultRequest) -> bool:
        """Whether this fault selects `request` (ignoring how many uses it has left)."""
        if self.server != "any" and self.server != request.server:
            return False
        if not fnmatchcase(request.path, self.path):
            return False
        if self.asked_again and not request.asked_before:
            return False
        if self.scope is _Scope.ANY:
            return True
        if self.scope is _Scope.RANGE:
            return request.has_body and request.has_range
        return request.has_body


def _check_rate(value: float) -> None:
    if not value > 0:
        raise ValueError(f"a rate must be > 0 bytes/s, not {value}")


def _check_position(value: int | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"a body position must be >= 0, not {value}")


@dataclass(frozen=True, slots=True)
class Bandwidth(_Fault):
    """Cap each matching response at `bytes_per_s`, i.e. per connection (a token bucket)."""

    bytes_per_s: float
    times: int | None = field(default=None, kw_only=True)

    role: ClassVar[_Role] = _Role.AMBIENT

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        _check_rate(self.bytes_per_s)


@dataclass(frozen=True, slots=True)
class Latency(_Fault):
    """Wait `seconds` before the first byte (the status line) of each matching response;
    with `bodies_only`, only of responses carrying a body (not a HEAD or a redirect)."""

    seconds: float
    bodies_only: bool = False
    times: int | None = field(default=None, kw_only=True)

    scope: ClassVar[_Scope] = _Scope.ANY
    role: ClassVar[_Role] = _Role.AMBIENT

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        if self.seconds < 0:
            raise ValueError(f"latency must be >= 0 s, not {self.seconds}")

    def matches(self, request: FaultRequest) -> bool:
        return _Fault.matches(self, request) and (request.has_body or not self.bodies_only)


@dataclass(frozen=True, slots=True)
class ChangeEtag(_Fault):
    """Report a different strong ETag for the file from now on; the content stays identical.

    An ``If-Range`` carrying the old ETag then gets a 200 with the full body, as after a
    re-upload of the object mid-download.
    """

    times: int | None = field(default=None, kw_only=True)

    scope: ClassVar[_Scope] = _Scope.ANY
    role: ClassVar[_Role] = _Role.AMBIENT


@dataclass(frozen=True, slots=True)
class Status(_Fault):
    """Answer `code` instead of the file, e.g. a 503 storm or a 429 with ``Retry-After``.

    `retry_after` is sent verbatim, so both delay-seconds (``"3"``) and an HTTP-date work.
    """

    code: int
    retry_after: str | None = None

    scope: ClassVar[_Scope] = _Scope.ANY
    role: ClassVar[_Role] = _Role.REPLACES_RESPONSE

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        if not 400 <= self.code <= 599:
            raise ValueError(f"a Status fault needs a 4xx or 5xx code, not {self.code}")


@dataclass(frozen=True, slots=True)
class Stall(_Fault):
    """Send the headers, then nothing for `seconds`, then close the connection."""

    seconds: float

    role: ClassVar[_Role] = _Role.REPLACES_BODY

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        if self.seconds < 0:
            raise ValueError(f"a stall must last >= 0 s, not {self.seconds}")


@dataclass(frozen=True, slots=True)
class CutBody(_Fault):
    """Close the connection after `at` bytes of the body (random when None); always truncates."""

    at: int | None = None

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        _check_position(self.at)


@dataclass(frozen=True, slots=True)
class FlipByte(_Fault):
    """Invert one byte of the body at `offset` (random when None); headers stay truthful."""

    offset: int | None = None

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        _check_position(self.offset)


@dataclass(frozen=True, slots=True)
class SlowDrip(_Fault):
    """Trickle the body at `bytes_per_s` in tiny writes, so the connection never looks idle.

    Unlike `Bandwidth`, the gaps between writes stay short: a read timeout never fires, only a
    minimum-throughput watchdog can catch it.
    """

    bytes_per_s: float

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        _check_rate(self.bytes_per_s)


@dataclass(frozen=True, slots=True)
class IgnoreRange(_Fault):
    """Answer a Range request with 200 and the full body, as servers are allowed to."""

    scope: ClassVar[_Scope] = _Scope.RANGE


@dataclass(frozen=True, slots=True)
class IgnoreIfRange(_Fault):
    """Answer a Range request with 206 of the object the URL holds now, whatever its
    ``If-Range`` names (as some caches and object stores do): a client that resumes or
    splits a file must then check each 206's ETag itself."""

    times: int | None = field(default=None, kw_only=True)
    server: Server = field(default="any", kw_only=True)

    scope: ClassVar[_Scope] = _Scope.RANGE
    role: ClassVar[_Role] = _Role.AMBIENT


@dataclass(frozen=True, slots=True)
class ChunkedBody(_Fault):
    """Send the body with ``Transfer-Encoding: chunked`` and no ``Content-Length`` (in
    pieces of `piece` bytes), as servers of generated content and some proxies do: the
    client cannot know the body's length before its end and reads it on its general path.
    HEAD answers keep their ``Content-Length``."""

    piece: int = 64 * 1024
    times: int | None = field(default=None, kw_only=True)
    server: Server = field(default="any", kw_only=True)

    role: ClassVar[_Role] = _Role.AMBIENT

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        if self.piece < 1:
            raise ValueError(f"a chunk must hold >= 1 byte, not {self.piece}")


@dataclass(frozen=True, slots=True)
class WrongContentRange(_Fault):
    """Answer 206 with the right bytes but a ``Content-Range`` shifted by `shift` bytes."""

    shift: int = 1

    scope: ClassVar[_Scope] = _Scope.RANGE

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        if self.shift == 0:
            raise ValueError("a WrongContentRange shift of 0 would be right")


@dataclass(frozen=True, slots=True)
class ShiftedRange(_Fault):
    """Answer 206 with the bytes of the asked range moved by `shift` (clipped to the file),
    and a ``Content-Range`` that truthfully names the bytes sent.

    A negative shift is a 206 that starts early, a positive one a 206 that starts late: what a
    buggy cache or proxy in front of the origin sends. A client that writes the body at the
    offset it asked for, instead of checking where the answer starts, stores the wrong bytes.
    """

    shift: int = -4096

    scope: ClassVar[_Scope] = _Scope.RANGE

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        if self.shift == 0:
            raise ValueError("a ShiftedRange shift of 0 would be right")


@dataclass(frozen=True, slots=True)
class ReplaceObject(_Fault):
    """The object at the matching paths is replaced by `content`, at the same URL, with a new
    strong ETag (the sha256 of `content`): every later answer (HEAD, GET, ranges, the Hub's
    ``X-Linked-*`` headers) describes and serves the new object.

    The first `after` responses carrying a body still get the old object, so ``after=1``
    replaces the object *mid-download* (one range is old, the rest new); ``after=0`` replaces
    it at once (between two runs). The Hub's listing (its sha256 and git blob ids) is left
    alone: on the Hub, content at a commit never changes, so there the client's hash check must
    refuse the new bytes; on a plain URL origin, only the ETag and ``If-Range`` tell.
    """

    content: bytes = field(repr=False)
    after: int = field(default=0, kw_only=True)
    times: int | None = field(default=None, kw_only=True)
    server: Server = field(default="any", kw_only=True)

    scope: ClassVar[_Scope] = _Scope.ANY
    role: ClassVar[_Role] = _Role.AMBIENT

    def __post_init__(self) -> None:
        _Fault.__post_init__(self)
        if self.after < 0:
            raise ValueError(f"after must be >= 0, not {self.after}")

    @property
    def etag(self) -> str:
        """The replacement's strong ETag, quoted."""
        return f'"{hashlib.sha256(self.content).hexdigest()}"'


@dataclass(frozen=True, slots=True)
class NoEtag(_Fault):
    """Send no ``ETag`` at all (or, with `weak`, only a weak ``W/`` one), as many servers of
    generated or proxied content do: the client has no validator for ``If-Range`` or a resume,
    and only the ``Content-Range`` total can tell that the object changed size."""

    weak: bool = False
    partial_only: bool = False
    """Strip it from 206 answers only (a CDN that drops it from partial content): the
    client still resumes with ``If-Range``, but cannot check a 206's ETag."""
    times: int | None = field(default=None, kw_only=True)
    server: Server = field(default="any", kw_only=True)

    scope: ClassVar[_Scope] = _Scope.ANY
    role: ClassVar[_Role] = _Role.AMBIENT


Fault = (
    Bandwidth
    | Latency
    | ChangeEtag
    | Status
    | Stall
    | CutBody
    | FlipByte
    | SlowDrip
    | IgnoreRange
    | WrongContentRange
    | ShiftedRange
    | ReplaceObject
    | NoEtag
    | IgnoreIfRange
    | ChunkedBody
)


class Rule:
    """A fault added to a plan, with its use count; returned by `FaultPlan.add`."""

    __slots__ = ("_passed", "_remaining", "fault", "fired")

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.fired = 0
        self._passed = 0
        self._remaining = fault.times

    @property
    def exhausted(self) -> bool:
        """True once the fault has affected `times` responses."""
        return self._remaining == 0

    def _waits(self, request: FaultRequest) -> bool:
        """True while a `ReplaceObject` still lets responses pass (counting those with a body)."""
        after = self.fault.after if isinstance(self.fault, ReplaceObject) else 0
        if self._passed >= after:
            return False
        if request.has_body:
            self._passed += 1
        return True

    def _use(self) -> None:
        self.fired += 1
        if self._remaining is not None:
            self._remaining -= 1

    def __repr__(self) -> str:
        return f"Rule({self.fault!r}, fired={self.fired})"


@dataclass(frozen=True, slots=True)
class _Position:
    """A body position: fixed, or a fraction of whatever the body length turns out to be."""

    at: int | None
    fraction: float

    def resolve(self, length: int) -> int:
        at = self.at if self.at is not None else int(self.fraction * length)
        return min(max(at, 0), length - 1)


@dataclass(frozen=True, slots=True)
class Effects:
    """What the faults that fired on one response do to it; the server applies them."""

    latency: float = 0.0
    status: Status | None = None
    stall: float | None = None
    bandwidth: float | None = None
    drip: float | None = None
    cut: _Position | None = None
    flip: _Position | None = None
    ignore_range: bool = False
    change_etag: bool = False
    content_range_shift: int = 0
    range_shift: int = 0
    """Serve the bytes of the asked range moved by this much (`ShiftedRange`)."""
    replacement: ReplaceObject | None = None
    """The object now at this URL (`ReplaceObject`), or None for the original."""
    no_etag: NoEtag | None = None
    ignore_if_range: bool = False
    chunked: int | None = None
    """Send the body chunked, in pieces of this many bytes (`ChunkedBody`)."""

    def cut_after(self, length: int) -> int | None:
        """Bytes of a `length`-byte body to send before closing, or None to send it all."""
        return self.cut.resolve(length) if self.cut is not None and length > 0 else None

    def flip_at(self, length: int) -> int | None:
        """Body offset of the byte to invert, or None."""
        return self.flip.resolve(length) if self.flip is not None and length > 0 else None

    def etag(self, etag: str) -> str:
        """The ETag of an object whose true ETag is `etag` (quoted), as the faults make it:
        a replaced object has its own, whatever `etag` says."""
        if self.replacement is not None:
            etag = self.replacement.etag
        if self.change_etag:
            bare = etag.strip('"')
            etag = f'"{bare}-changed"'
        return etag

    def sent_etag(self, etag: str, *, status: int) -> str | None:
        """The ``ETag`` header a `status` answer carries for `etag` (`etag`'s result); None:
        none at all."""
        if self.no_etag is not None and (status == 206 or not self.no_etag.partial_only):
            return f"W/{etag}" if self.no_etag.weak else None
        return etag

    def pacer(self) -> Pacer | None:
        """A pacer for the body, or None when it may go at full speed."""
        rates = [r for r in (self.bandwidth, self.drip) if r is not None]
        if not rates:
            return None
        rate = min(rates)
        # A drip writes ~10 times a second; a bandwidth cap in chunks of 1/20 s of traffic.
        chunk = rate / 10 if self.drip is not None else rate / 20
        return Pacer(rate, chunk=int(min(max(chunk, 1), 256 * 1024)))


class Pacer:
    """Pace writes to `rate` bytes/s in chunks of `chunk` bytes (a token bucket, one chunk deep).

    The clock is injectable so the arithmetic is testable without sleeping.
    """

    def __init__(
        self, rate: float, *, chunk: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.chunk = chunk
        self._clock = clock
        self._ready_at: float | None = None

    def delay(self, n: int) -> float:
        """Seconds to wait before sending `n` more bytes; books them."""
        now = self._clock()
        ready_at = now if self._ready_at is None else max(self._ready_at, now)
        self._ready_at = ready_at + n / self.rate
        return ready_at - now


class FaultPlan:
    """The mutable, thread-safe set of faults a fake hub applies; see the module docstring."""

    def __init__(self, *, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._random = random.Random(seed)

    def add(self, fault: Fault) -> Rule:
        """Add `fault` after the existing ones; the returned rule counts its uses."""
        rule = Rule(fault)
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove(self, rule: Rule) -> None:
        """Stop applying `rule` (no error if it is already gone)."""
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every fault."""
        with self._lock:
            self._rules.clear()

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules in the order they were added, used-up ones included."""
        with self._lock:
            return tuple(self._rules)

    def take(self, request: FaultRequest) -> Effects:
        """Pick the faults that fire on `request`, use them up, and say what they do."""
        with self._lock:
            first: dict[type[_Fault], Rule] = {}
            for rule in self._rules:
                if rule.exhausted or not rule.fault.matches(request) or rule._waits(request):
                    continue
                first.setdefault(type(rule.fault), rule)
            fired = self._select(first)
            for rule in fired:
                rule._use()
            return self._effects([rule.fault for rule in fired])

    @staticmethod
    def _select(first: dict[type[_Fault], Rule]) -> list[Rule]:
        ambient = [r for r in first.values() if r.fault.role is _Role.AMBIENT]
        for role in (_Role.REPLACES_RESPONSE, _Role.REPLACES_BODY):
            replacing = [r for r in first.values() if r.fault.role is role]
            if replacing:
                return [*ambient, replacing[0]]
        return list(first.values())

    def _effects(self, faults: list[Fault]) -> Effects:
        latency = 0.0
        status: Status | None = None
        stall: float | None = None
        bandwidth: float | None = None
        drip: float | None = None
        cut: _Position | None = None
        flip: _Position | None = None
        ignore_range = change_etag = False
        shift = range_shift = 0
        replacement: ReplaceObject | None = None
        no_etag: NoEtag | None = None
        ignore_if_range = False
        chunked: int | None = None
        for fault in faults:
            match fault:
                case Latency(seconds=seconds):
                    latency = seconds
                case Status():
                    status = fault
                case Stall(seconds=seconds):
                    stall = seconds
                case Bandwidth(bytes_per_s=rate):
                    bandwidth = rate
                case SlowDrip(bytes_per_s=rate):
                    drip = rate
                case CutBody(at=at):
                    cut = _Position(at, self._random.random())
                case FlipByte(offset=offset):
                    flip = _Position(offset, self._random.random())
                case IgnoreRange():
                    ignore_range = True
                case ChangeEtag():
                    change_etag = True
                case WrongContentRange(shift=value):
                    shift = value
                case ShiftedRange(shift=value):
                    range_shift = value
                case ReplaceObject():
                    replacement = fault
                case NoEtag():
                    no_etag = fault
                case IgnoreIfRange():
                    ignore_if_range = True
                case ChunkedBody(piece=piece):
                    chunked = piece
        return Effects(
            latency=latency,
            status=status,
            stall=stall,
            bandwidth=bandwidth,
            drip=drip,
            cut=cut,
            flip=flip,
            ignore_range=ignore_range,
            change_etag=change_etag,
            content_range_shift=shift,
            range_shift=range_shift,
            replacement=replacement,
            no_etag=no_etag,
            ignore_if_range=ignore_if_range,
            chunked=chunked,
        )
