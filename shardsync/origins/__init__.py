"""Origins: where a checkpoint comes from, all behind the one ``Origin`` protocol.

Network origins never move shard bytes themselves (the fetcher does); they turn a repo
path into a request plus the credentials for that request's host only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from shardsync.names import source_kind
from shardsync.origins.base import Origin
from shardsync.origins.http import UrlOrigin
from shardsync.origins.hub import HubOrigin
from shardsync.origins.local import LocalOrigin
from shardsync.origins.s3 import S3Origin
from shardsync.s3 import S3Client

__all__ = [
    "HubOrigin",
    "LocalOrigin",
    "Origin",
    "S3Origin",
    "UrlOrigin",
    "parse_source",
]


def parse_source(
    source: str,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    environ: Mapping[str, str] | None = None,
    s3: S3Client | None = None,
) -> Origin:
    """Pick the origin a user means: an http(s) URL, an ``s3://`` prefix, an existing
    directory, or a Hub repo id. S3 origins share ``s3`` when given (else own a client)."""
    env = os.environ if environ is None else environ
    kind = source_kind(source)
    if kind == "url":
        return UrlOrigin.from_url(source, token=token)
    if kind == "s3":
        return S3Origin.from_url(source, client=s3)
    if kind == "local":
        return LocalOrigin.from_path(source)
    return HubOrigin.create(source, endpoint=endpoint or env.get("HF_ENDPOINT"), token=token)
