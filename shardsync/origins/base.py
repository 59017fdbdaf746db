"""The one protocol every origin implements, and the HTTP behaviour most of them share.

The engine, loader, scheduler and CLI talk to an ``Origin`` and never ask which kind it
is: an origin lists the files at a revision, says how one entry's bytes are read (a
Range, or the whole file into a download slot), and names the version a cached copy or a
partial file is checked against. A new origin is a new class here, not an engine edit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import ClassVar, Protocol

from shardsync.fetch.request import BlobRequest, Located
from shardsync.manifest import Listing, ManifestEntry, RemoteFile
from shardsync.ranges import is_strong_etag
from shardsync.records import RepoRef, VerifiedFile

__all__ = ["Http", "Into", "Origin", "Progress", "RequestOrigin", "bearer_headers"]

Progress = Callable[[int], None]
Entry = ManifestEntry | RemoteFile
Forget = Callable[[], None]
"""Drops what ``Origin.locate_ahead`` started, if no download took it."""


class Http(Protocol):
    """What an origin asks of the fetcher (``fetch.fetcher.Fetcher``). Origins name this,
    not the class, so they sit beside the transfer machinery instead of on top of it."""

    async def get_bytes(
        self, url: str, headers: Mapping[str, str], *, max_size: int, label: str
    ) -> bytes:
        """A small metadata answer's body (an API listing), at most ``max_size`` bytes."""

    async def get_page(
        self, url: str, headers: Mapping[str, str], *, max_size: int, label: str
    ) -> tuple[bytes, str | None]:
        """One page of a paginated answer, and the next page's URL if any."""

    async def read_range(self, request: BlobRequest, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file, short at its end."""

    async def locate(self, request: BlobRequest) -> Located:
        """Where the file's bytes are served (redirects followed), its size and validators."""

    def locate_ahead(self, request: BlobRequest) -> None:
        """Start ``locate`` now, for the file's download to take the answer."""

    def forget_ahead(self, request: BlobRequest | None = None) -> None:
        """Drop what ``locate_ahead`` started (all of it without ``request``)."""


class Into(Protocol):
    """The download slot an origin fills, as the engine hands it over (a ``slot.Slot``
    behind it): through the fetcher from a request, or copied from a file the origin opens
    itself. Origins name this, not the slot, so they sit beside the cache, not above it."""

    async def fetch(self, request: BlobRequest, progress: Progress) -> VerifiedFile:
        """The whole file ``request`` names, resumed where the partial allows, verified."""

    async def copy(self, source: Path, version: str | None, name: str) -> VerifiedFile:
        """``source`` copied in, hashed on the way; ``version`` is the origin's for it and
        ``name`` its path in the repo (what it must be: a symlink's target may be a hash)."""


class Origin(Protocol):
    """Where a checkpoint comes from (the Hub, a base URL, an S3 prefix, a directory)."""

    @property
    def repo(self) -> RepoRef:
        """Names the origin in the cache (its snapshots live under ``repo.dirname``)."""

    @property
    def default_revision(self) -> str:
        """The revision asked for when none is given (``main``)."""

    @property
    def caller_only(self) -> bool:
        """True when only the calling process may read it (a local path): the daemon
        refuses such a source on a client's behalf, and the loader never hands it over."""

    async def list_files(self, fetcher: Http, revision: str, *, hidden: bool = False) -> Listing:
        """Every file at ``revision``: the commit (None when the origin has none), sizes,
        and sha256 where the origin publishes one. Folder-like origins leave out names
        starting with ``.`` unless ``hidden`` (a DCP checkpoint's ``.metadata``)."""

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        """What the origin calls the current version of ``entry`` (a strong ETag, a stat
        stamp), or None when it has none worth trusting. A cached copy recorded under this
        version is reused only while the origin still says the same."""

    async def read_range(
        self, fetcher: Http, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        """Bytes ``[start, end)`` of one file (a safetensors header), short at its end."""

    async def download(
        self,
        fetcher: Http,
        commit: str | None,
        entry: ManifestEntry,
        into: Into,
        progress: Progress,
    ) -> VerifiedFile:
        """The whole file ``into`` the engine's slot (the caller commits it), verified against
        the origin's hash when it has one; ``VerifiedFile.etag`` is ``version`` at download
        time (recorded, so later runs can reuse the copy)."""

    def locate_ahead(self, fetcher: Http, commit: str | None, entry: Entry) -> Forget:
        """Start finding where ``entry`` lives (its redirects and ``HEAD``) now, for its
        download to take the answer instead of asking then; returns what drops an answer no
        download took. Nothing to do where there is nothing to find (a local directory)."""

    async def aclose(self) -> None:
        """Release what the origin opened (clients, sessions); called once by its engine."""


def bearer_headers(token: str | None) -> Mapping[str, str]:
    """The ``Authorization`` header that carries ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class RequestOrigin(ABC):
    """What origins share whose files the fetcher reads from a request (the Hub, a base URL,
    S3): a subclass says how to ask for one entry (``request_for``) and whether the ETag it
    answers with is the version to record (``records_etag``: when no hash names the file)."""

    __slots__ = ()
    records_etag: ClassVar[bool] = True

    @property
    def caller_only(self) -> bool:
        """False: what a request reads, the daemon can read on a client's behalf."""
        return False

    @abstractmethod
    def request_for(self, commit: str | None, entry: Entry) -> BlobRequest:
        """The request that reads ``entry`` at ``commit`` (None: the origin has no commits)."""

    async def read_range(
        self, fetcher: Http, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        return await fetcher.read_range(self.request_for(commit, entry), start, end)

    def locate_ahead(self, fetcher: Http, commit: str | None, entry: Entry) -> Forget:
        request = self.request_for(commit, entry)
        fetcher.locate_ahead(request)
        return partial(fetcher.forget_ahead, request)

    async def download(
        self,
        fetcher: Http,
        commit: str | None,
        entry: ManifestEntry,
        into: Into,
        progress: Progress,
    ) -> VerifiedFile:
        fetched = await into.fetch(self.request_for(commit, entry), progress)
        keep = self.records_etag and is_strong_etag(fetched.etag)
        return fetched if keep else replace(fetched, etag=None)

    async def aclose(self) -> None:
        return None
