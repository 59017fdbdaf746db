"""A plain HTTP(S) base URL holding a checkpoint (nginx, S3 website, an artifact server)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from shardsync.errors import (
    AuthError,
    ConfigError,
    EntryNotFoundError,
    ManifestError,
    first_error,
    redact,
)
from shardsync.fetch.request import BlobRequest
from shardsync.manifest import Listing, RemoteFile, validate_name
from shardsync.origins.base import Entry, Http, RequestOrigin, bearer_headers
from shardsync.ranges import is_strong_etag
from shardsync.records import RepoRef

__all__ = ["PROBED_FILES", "WEIGHT_FILES", "UrlOrigin"]

# Such a server cannot list a directory, so we ask for the files a checkpoint usually has.
WEIGHT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",  # pickle: listed, refused unless allow_pickle
    "pytorch_model.bin",
)
PROBED_FILES = (
    *WEIGHT_FILES,
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


@dataclass(frozen=True, slots=True)
class UrlOrigin(RequestOrigin):
    """Files under ``base``; no commit, so snapshots are named by their content. The
    server's strong ETag is the version recorded: no hash comes with a file."""

    base: str
    token: str | None
    default_revision: str = "main"

    @classmethod
    def from_url(cls, url: str, *, token: str | None = None) -> UrlOrigin:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018  (a port that is no number raises here)
        except ValueError as exc:  # "http://[::1", "http://h:port"
            raise ConfigError(f"not a usable URL: {redact(url)!r} ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"not an http(s) URL: {redact(url)!r}")
        if parts.query or parts.fragment:
            raise ConfigError(f"base URL must not have a query or fragment: {redact(url)!r}")
        if parts.username is not None or parts.password is not None:
            # a source is kept in job lists, the journal, logs and the cache's folder names
            raise ConfigError(
                f"a base URL must not carry credentials (user:password@): {redact(url)!r}; "
                "the origin takes a bearer token (token=) instead"
            )
        base = url if url.endswith("/") else url + "/"
        return cls(base=base, token=token)

    @property
    def repo(self) -> RepoRef:
        return RepoRef(kind="url", name=self.base)

    @property
    def auth_headers(self) -> Mapping[str, str]:
        return bearer_headers(self.token)

    def url_for(self, path: str) -> str:
        return self.base + quote(validate_name(path))

    async def list_files(self, fetcher: Http, revision: str, *, hidden: bool = False) -> Listing:
        """HEAD the usual file names; the index (fetched later) names the shards."""
        if revision != self.default_revision:
            raise ConfigError("a plain URL origin has no revisions")

        async def probe(path: str) -> RemoteFile | AuthError | None:
            request = BlobRequest(url=self.url_for(path), headers=self.auth_headers, label=path)
            try:
                located = await fetcher.locate(request)
            except EntryNotFoundError:
                return None
            except AuthError as exc:
                return exc  # absent, or truly refused: the weights' answers tell (below)
            return RemoteFile(path=path, size=located.size, sha256=None)

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(probe(p)) for p in PROBED_FILES]
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        answers = [t.result() for t in tasks]
        files = tuple(a for a in answers if isinstance(a, RemoteFile))
        # An S3 website, or a bucket readable without ListBucket, answers 403 (some servers
        # 401) for a name it does not hold: once the same requests read a weights file, a
        # refused name is one the checkpoint lacks; with no weights read, it is refused.
        refused = [a for a in answers if isinstance(a, AuthError)]
        if refused and not any(f.path in WEIGHT_FILES for f in files):
            raise refused[0]
        if not any(f.path.endswith(".safetensors") or f.path.endswith(".json") for f in files):
            raise ManifestError(f"no model.safetensors[.index.json] under {self.base}")
        return Listing(commit=None, files=files, exhaustive=False)

    def request_for(self, commit: str | None, entry: Entry) -> BlobRequest:
        return BlobRequest(
            url=self.url_for(entry.path),
            headers=self.auth_headers,
            label=entry.path,
            size=entry.size,
            sha256=entry.sha256,
        )

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        located = await fetcher.locate(self.request_for(None, entry))
        return located.etag if is_strong_etag(located.etag) else None
