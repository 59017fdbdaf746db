"""The pooled aiohttp session as the fetcher's requests use it.

Redirects are followed by hand (credentials never leave the origin, https never becomes
http), each hop through the proxy ``NO_PROXY`` leaves it, with its credentials where that
proxy needs them; our headers, then the configured ones, then the request's own; explicit
timeouts (none total: aiohttp's 300 s default would cut big files); and what a refused
answer means, with its body read for the server's words.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from typing import Any, NoReturn

import aiohttp

from shardsync.errors import AuthError, ProtocolError
from shardsync.fetch.answers import (
    ERROR_BODY,
    MAX_REDIRECTS,
    REDIRECTS,
    follow,
    proxy_refused,
    status_error,
)
from shardsync.fetch.body import Traffic
from shardsync.fetch.request import redact_url
from shardsync.network import NetworkConfig
from shardsync.records import FetchConfig

__all__ = ["Session", "default_timeout"]


def default_timeout(config: FetchConfig) -> aiohttp.ClientTimeout:
    """Explicit timeouts; no total cap (aiohttp's 300 s default would cut big files)."""
    return aiohttp.ClientTimeout(
        total=None,
        connect=config.connect_timeout,
        sock_connect=config.connect_timeout,
        sock_read=config.read_timeout,
    )


class Session:
    """Requests on one pooled ``aiohttp`` session, as the fetcher sends them; counts those
    in flight in ``traffic``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        config: FetchConfig,
        network: NetworkConfig,
        traffic: Traffic,
    ) -> None:
        self._session = session
        self._config = config
        self._network = network
        self._traffic = traffic
        self._timeout = default_timeout(config)

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, headers: Mapping[str, str], *, metadata: bool = False
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A request with redirects followed by hand (credentials never leave the origin),
        each hop through the proxy ``NO_PROXY`` leaves it. ``metadata``: an API answer or
        listing, which a mirror may fetch upstream first (its own, longer, read timeout)."""
        hdrs = dict(headers)
        for _ in range(MAX_REDIRECTS + 1):
            self._traffic.active += 1
            try:
                async with self._session.request(
                    method,
                    url,
                    headers=self.headers(url, hdrs),
                    allow_redirects=False,
                    # always explicit: None would mean no timeout at all, not the session's
                    timeout=self._metadata_timeout() if metadata else self._timeout,
                    **self._proxy(url),
                ) as resp:
                    if resp.status not in REDIRECTS:
                        yield resp
                        return
                    location = resp.headers.get("Location")
            finally:
                self._traffic.active -= 1
            url, hdrs = follow(url, hdrs, location)
        raise ProtocolError(f"more than {MAX_REDIRECTS} redirects for {redact_url(url)}")

    def head(
        self, url: str, headers: Mapping[str, str]
    ) -> AsyncContextManager[aiohttp.ClientResponse]:
        """A ``HEAD`` of ``url`` alone, no redirect followed: ``Fetcher.locate`` follows them,
        reading each hop's headers. Metadata's timeouts."""
        return self._session.head(
            url,
            headers=self.headers(url, headers),
            allow_redirects=False,
            timeout=self._metadata_timeout(),
            **self._proxy(url),
        )

    def headers(self, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        """Ours, then the configured ones for this host, then the request's own."""
        merged = _with_defaults({})
        merged.update(self._network.extra_headers(url))
        merged.update(headers)
        # a plain-http request goes to the proxy itself, so its credentials go in it
        merged.update(self._network.route(url).request_headers)
        return merged

    def _proxy(self, url: str) -> dict[str, Any]:
        """Where the request goes through, and for a ``CONNECT`` (https) its credentials."""
        route = self._network.route(url)
        if route.proxy is None:
            return {}
        return {"proxy": route.proxy, "proxy_headers": route.connect_headers or None}

    def proxy_auth(self, url: str) -> str | None:
        """The Basic credentials of the proxy ``url`` goes through, if its URL names any."""
        return self._network.route(url).authorization

    def _metadata_timeout(self) -> aiohttp.ClientTimeout:
        cfg = self._config
        return aiohttp.ClientTimeout(
            total=None,
            connect=cfg.connect_timeout,
            sock_connect=cfg.connect_timeout,
            sock_read=max(cfg.read_timeout, self._network.metadata_timeout),
        )

    async def raise_for_status(
        self, resp: aiohttp.ClientResponse, label: str, *, relocatable: bool = False
    ) -> NoReturn:
        """Turn a non-success answer into an exception (retryable ones as ``RetryLater``)."""
        body = b""
        with contextlib.suppress(Exception):
            body = await resp.content.read(ERROR_BODY)
        if resp.status == 407:
            sent = self.proxy_auth(str(resp.url)) is not None
            raise AuthError(f"{label}: {proxy_refused(sent)}")
        raise status_error(resp.status, resp.headers.get, body, label, relocatable=relocatable)


def _with_defaults(headers: Mapping[str, str]) -> dict[str, str]:
    merged = {"Accept-Encoding": "identity", "User-Agent": "shardsync/0.1"}
    merged.update(headers)
    return merged
