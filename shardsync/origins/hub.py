"""The Hugging Face Hub as an origin (or any server speaking its protocol)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar
from urllib.parse import quote, urlsplit

from shardsync.errors import ConfigError, ManifestError
from shardsync.fetch.request import BlobRequest
from shardsync.manifest import (
    SMALL_FILE,
    Listing,
    RemoteFile,
    parse_hub_revision,
    parse_hub_tree,
)
from shardsync.names import validate_revision
from shardsync.origins.base import Entry, Http, RequestOrigin, bearer_headers
from shardsync.records import RepoRef

__all__ = ["DEFAULT_ENDPOINT", "HubOrigin"]

DEFAULT_ENDPOINT = "https://huggingface.co"
_MAX_API_ANSWER = 64 << 20
# Below this many siblings the revision answer is taken as complete; huggingface_hub itself
# lists large repos with the paginated tree API.
_SIBLINGS_COMPLETE_BELOW = 1000
_MAX_TREE_PAGES = 10_000
_MAX_TREE_FILES = 200_000  # twice the 100k files the Hub asks a repo to stay under


@dataclass(frozen=True, slots=True)
class HubOrigin(RequestOrigin):
    """A repo on the Hub; the token goes to the endpoint host and nowhere else."""

    repo_id: str
    endpoint: str
    token: str | None
    default_revision: str = "main"
    records_etag: ClassVar[bool] = False  # every version is named by its sha256 or blob id

    @classmethod
    def create(cls, repo_id: str, *, endpoint: str | None, token: str | None) -> HubOrigin:
        # huggingface_hub (its validation and token) only when a Hub source is named: its
        # import took 0.06-0.12 s of every s3://, URL and local prefetch's start
        import huggingface_hub
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(repo_id)
        except HFValidationError as exc:
            raise ConfigError(f"invalid repo id {repo_id!r}: {exc}") from None
        base = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        if urlsplit(base).scheme not in ("http", "https"):
            raise ConfigError(f"endpoint must be an http(s) URL, got {base!r}")
        if token is None:
            try:
                token = huggingface_hub.get_token()  # HF_TOKEN, then the token file
            except OSError as exc:
                raise ConfigError(f"cannot read the Hugging Face token file: {exc}") from exc
        return cls(repo_id=repo_id, endpoint=base, token=token or None)

    @property
    def repo(self) -> RepoRef:
        return RepoRef(kind="hub", name=self.repo_id)

    @property
    def auth_headers(self) -> Mapping[str, str]:
        return bearer_headers(self.token)

    async def list_files(self, fetcher: Http, revision: str, *, hidden: bool = False) -> Listing:
        """Commit hash plus every file with size and LFS sha256: one API call, or for a large
        repo (whose ``siblings`` the Hub may cut short) the paginated tree at that commit."""
        validate_revision(revision)
        label = f"{self.repo_id}@{revision}"
        url = (
            f"{self.endpoint}/api/models/{self.repo_id}/revision/"
            f"{quote(revision, safe='')}?blobs=true"
        )
        payload = await fetcher.get_bytes(
            url, self.auth_headers, max_size=_MAX_API_ANSWER, label=label
        )
        listing = parse_hub_revision(payload, cut_at=_SIBLINGS_COMPLETE_BELOW)
        if listing.exhaustive or listing.commit is None:
            return replace(listing, exhaustive=True)
        files: list[RemoteFile] = []
        page: str | None = (
            f"{self.endpoint}/api/models/{self.repo_id}/tree/{listing.commit}?recursive=true"
        )
        seen: set[str] = set()
        for _ in range(_MAX_TREE_PAGES):
            if page is None:
                return replace(listing, files=tuple(files), exhaustive=True)
            if page in seen or len(files) > _MAX_TREE_FILES:  # a loop, or a listing without end
                raise ManifestError(f"{label}: the tree listing goes round or has no end")
            seen.add(page)
            payload, page = await fetcher.get_page(
                page, self.auth_headers, max_size=_MAX_API_ANSWER, label=f"{label} tree"
            )
            files.extend(parse_hub_tree(payload))
        raise ManifestError(f"{label}: the tree listing has more than {_MAX_TREE_PAGES} pages")

    def request_for(self, commit: str | None, entry: Entry) -> BlobRequest:
        # what ``huggingface_hub.hf_hub_url`` builds (a test holds the two equal), without
        # importing its download module on the way to the first request (7 ms)
        revision = quote(commit or self.default_revision, safe="")
        url = f"{self.endpoint}/{self.repo_id}/resolve/{revision}/{quote(entry.path)}"
        known = entry.sha256 is not None or entry.blob_id is not None
        return BlobRequest(
            url=url,
            headers=self.auth_headers,
            label=entry.path,
            size=entry.size,
            sha256=entry.sha256,
            git_blob_id=None if entry.sha256 else entry.blob_id,
            # a config or an index: one GET, not a HEAD and a GET (the index's HEAD was a
            # round trip before every shard's first byte)
            direct=known and entry.size is not None and entry.size <= SMALL_FILE,
        )

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        return None  # the Hub names every version by its sha256 or git blob id
