"""The tier's object names and what a claim says, in one place (pure).

A claim is a small JSON object at ``PREFIX/claims/<sha256>`` that the host fetching a blob
for the fleet writes with ``If-None-Match: *`` and renews with ``If-Match``; the blob goes to
``PREFIX/sha256/<first two>/<sha256>``. Hosts read each other's claims, so the format is
versioned and a claim that cannot be read counts as expired.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "MAX_CLAIM",
    "SKEW_S",
    "Watch",
    "blob_key",
    "claim_body",
    "claim_key",
    "expired",
    "parse_claim",
]

MAX_CLAIM = 64 * 1024  # bytes of a claim read at most
SKEW_S = 60.0  # how far the hosts' clocks may disagree (only the expiry stamps use them)


def blob_key(prefix: str, sha256: str) -> str:
    return f"{prefix}sha256/{sha256[:2]}/{sha256}"


def claim_key(prefix: str, sha256: str) -> str:
    return f"{prefix}claims/{sha256}"


def claim_body(
    holder: str,
    token: str,
    size: int,
    done: int,
    phase: Literal["download", "upload"],
    lease: float,
) -> bytes:
    """A claim as its holder writes it: who, how far (waiting hosts show ``done``), and
    until when by the holder's clock unless renewed."""
    now = time.time()
    return json.dumps(
        {
            "version": 1,
            "holder": holder,
            "token": token,
            "size": size,
            "done": done,
            "phase": phase,
            "renewed": now,
            "expires": now + lease,
        }
    ).encode()


def parse_claim(body: bytes) -> dict[str, Any]:
    """A claim's fields, or none for one that is not a JSON object."""
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def expired(body: bytes, now: float) -> bool:
    """By the holder's own clock stamp, with ``SKEW_S`` of allowance for clock skew (so a
    claim left by a holder that died long ago is taken over at once); a claim that cannot be
    read is treated as expired (whoever wrote it cannot renew it either)."""
    expires = parse_claim(body).get("expires")
    if not isinstance(expires, int | float):
        return True
    return bool(now > expires + SKEW_S)


@dataclass(slots=True)
class Watch:
    """A waiting host's judgement of another host's claim, on the waiter's own monotonic
    clock (so it needs no agreement between clocks): dead once its ETag has not changed for
    ``lease`` (or by its holder's own stamp), stalled once it shows no progress for ``stall``
    (an upload: slower than ``upload_floor``)."""

    size: int
    lease: float
    stall: float
    upload_floor: int
    started: float
    etag: str | None = None
    changed_at: float = 0.0
    done: int = -1
    progressed_at: float = 0.0
    upload_since: float | None = None

    def __post_init__(self) -> None:
        self.changed_at = self.progressed_at = self.started

    def look(self, body: bytes, etag: str, now: float) -> Literal["dead", "stalled"] | int:
        """What one read of the claim says: ``dead``, ``stalled``, or the holder's bytes so
        far (its own word, clamped to the blob's size)."""
        state = parse_claim(body)
        if etag != self.etag:
            self.etag, self.changed_at = etag, now
        if now - self.changed_at > self.lease or expired(body, time.time()):
            return "dead"
        reported = state.get("done")  # another host's word: a number, or nothing
        done = reported if isinstance(reported, int) and not isinstance(reported, bool) else 0
        done = min(max(done, 0), self.size)
        if done > self.done:
            self.done, self.progressed_at = done, now
        if state.get("phase") == "upload":
            if self.upload_since is None:
                self.upload_since = now
            if now - self.upload_since > self.stall + self.size / self.upload_floor:
                return "stalled"
        elif now - self.progressed_at > self.stall:
            return "stalled"
        return self.done
