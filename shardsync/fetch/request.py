"""What the other layers hand the fetcher and get back: values, no transfer machinery.

A ``BlobRequest`` names one file to fetch and what is known of it; a ``Located`` says where
its bytes are after the redirects; the callables type what a caller injects (a clock's
``Sleep``, a bandwidth ``Throttle``, a progress callback). Imports only pure modules, so an
origin, the tier or a checkpoint reader names these without importing aiohttp, the slot or
the hasher.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from shardsync.checksums import StoreChecksum

__all__ = [
    "BlobRequest",
    "Header",
    "Located",
    "Locator",
    "ProgressFn",
    "Sleep",
    "Throttle",
    "Turn",
    "Validator",
    "joined",
    "redact_url",
]

Sleep = Callable[[float], Awaitable[None]]
Validator = Literal["If-Range", "If-Match"]
Throttle = Callable[[int], float]
"""Told each body read's size, on the event loop or on a pump thread (so it must be
thread-safe), it answers how many seconds that reader pauses (0: none): a shared bandwidth
budget (the daemon's token bucket), or a claim holder held to its uploads. After the pause
the reader asks again with 0 and reads on only when told 0, so a throttle can hold a file
for as long as it must. Raising stops the transfer."""


def joined(first: Throttle | None, second: Throttle | None) -> Throttle | None:
    """Both throttles, each told every read: the reader pauses for the longer answer."""
    if first is None or second is None:
        return first or second
    return lambda n: max(first(n), second(n))


Header = Callable[[str], "str | None"]  # a response header by case-insensitive name
ProgressFn = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Located:
    """Where a file's bytes are, after following redirects from the origin URL."""

    url: str
    headers: Mapping[str, str]  # credentials only when ``url`` is on the origin host
    size: int | None
    etag: str | None  # the data URL's own ETag, as sent (quoted)
    linked_etag: str | None  # X-Linked-Etag / ETag of the origin answer, unquoted
    commit: str | None  # X-Repo-Commit
    checksum: StoreChecksum | None = None  # what the store keeps for exactly this ETag


Locator = Callable[[], Awaitable[Located]]
"""Finds where a file's bytes are now (e.g. signs a fresh URL); asked again after a 401/403."""


@dataclass(frozen=True, slots=True)
class BlobRequest:
    """One file to fetch: its origin URL and what we already know about it.

    ``url`` names the object (a resume record is bound to it). Without a ``locator`` the
    fetcher finds the bytes by a HEAD of ``url``, following redirects. ``validator`` is the
    header that ties each Range request to the ETag first seen: ``If-Range`` (a changed
    object answers 200) or ``If-Match`` (it answers 412; for stores without ``If-Range``).

    ``direct``: a small file whose hash is known (a config, an index). It is fetched whole
    with one GET of ``url``, redirects followed by hand, on the shared connections: no HEAD
    first, no Range, no resume. The hash, not an ETag, says the bytes are the ones asked for.
    A relocation or restart asks the usual way.

    ``pace`` holds this file's reads back as a ``Throttle`` does, beside the fetcher's own:
    a claim holder kept within reach of what the tier holds of its download.
    """

    url: str
    headers: Mapping[str, str]
    label: str  # repo path, for messages and progress
    size: int | None = None
    sha256: str | None = None
    git_blob_id: str | None = None
    locator: Locator | None = None
    validator: Validator = "If-Range"
    verify_attempts: int | None = None  # full downloads after a mismatch (None: the config's)
    seeded: bool = False  # the partial holds another source's bytes: a mismatch is theirs
    direct: bool = False
    connections: int | None = None  # most connections (an origin's own cap; None: the config's)
    chunk_size: int | None = None  # most bytes per Range, none cut at the tail (an origin's own)
    pace: Throttle | None = None  # this file's own, after the fetcher's (``tier_parts.Lead``)


@dataclass(frozen=True, slots=True)
class Turn:
    """A file fetched in its turn, for a consumer that reads the files in order (a stream).

    It may hold the connections of ``share`` files, so it lands sooner than it would beside
    the others. ``at_tail`` is called when one of its connections finds no range left to
    take (it may be called again): the caller then starts the next file, which takes the
    connections this one lets go of as its last ranges end.
    """

    share: int
    at_tail: Callable[[], None]


def redact_url(url: str) -> str:
    """A URL fit for messages: no query (signed URLs carry credentials there), no userinfo."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a port no URL can have, a bracket left open: a server's word
        return "a malformed URL"
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{host}:{port}" if port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
