"""The Hugging Face Hub as an origin (or any server speaking its protocol)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import huggingface_hub
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from shardsync.cache import RepoRef
from shardsync.errors import ConfigError
from shardsync.fetch import BlobRequest, Fetcher
from shardsync.manifest import Listing, ManifestEntry, RemoteFile, parse_hub_revision

__all__ = ["DEFAULT_ENDPOINT", "HubOrigin", "validate_revision"]

DEFAULT_ENDPOINT = "https://huggingface.co"
_MAX_API_ANSWER = 64 << 20
_REVISION = re.compile(r"[A-Za-z0-9._\-/]{1,255}")


def validate_revision(revision: str) -> str:
    """Branch, tag, commit or ``refs/pr/N``; nothing that could walk a path or split a URL."""
    parts = revision.split("/")
    if (
        not _REVISION.fullmatch(revision)
        or any(p in ("", ".", "..") for p in parts)
        or revision.endswith(".lock")
    ):
        raise ConfigError(f"invalid revision {revision!r}")
    return revision


@dataclass(frozen=True, slots=True)
class HubOrigin:
    """A repo on the Hub; the token goes to the endpoint host and nowhere else."""

    repo_id: str
    endpoint: str
    token: str | None
    default_revision: str = "main"

    @classmethod
    def create(cls, repo_id: str, *, endpoint: str | None, token: str | None) -> HubOrigin:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as exc:
            raise ConfigError(f"invalid repo id {repo_id!r}: {exc}") from None
        base = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        if urlsplit(base).scheme not in ("http", "https"):
            raise ConfigError(f"endpoint must be an http(s) URL, got {base!r}")
        if token is None:
            token = huggingface_hub.get_token()  # HF_TOKEN, then the token file
        return cls(repo_id=repo_id, endpoint=base, token=token or None)

    @property
    def repo(self) -> RepoRef:
        return RepoRef(kind="hub", name=self.repo_id)

    @property
    def auth_headers(self) -> Mapping[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def list_files(self, fetcher: Fetcher, revision: str) -> Listing:
        """One API call: commit hash plus every file with size and LFS sha256."""
        validate_revision(revision)
        url = (
            f"{self.endpoint}/api/models/{self.repo_id}/revision/"
            f"{quote(revision, safe='')}?blobs=true"
        )
        payload = await fetcher.get_bytes(
            url, self.auth_headers, max_size=_MAX_API_ANSWER, label=f"{self.repo_id}@{revision}"
        )
        return parse_hub_revision(payload)

    def request_for(self, commit: str | None, entry: ManifestEntry | RemoteFile) -> BlobRequest:
        url = huggingface_hub.hf_hub_url(
            self.repo_id, entry.path, revision=commit, endpoint=self.endpoint
        )
        return BlobRequest(
            url=url,
            headers=self.auth_headers,
            label=entry.path,
            size=entry.size,
            sha256=entry.sha256,
            git_blob_id=None if entry.sha256 else entry.blob_id,
        )
