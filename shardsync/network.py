"""How requests reach the network: proxies, trusted CAs, extra headers per host.

Pure except ``ssl_context`` (which reads the CA file). Settings are resolved once, in
``load_config(environ)``, from the variables curl and requests read, with ``[network]``
overriding them:

- ``https_proxy``/``HTTPS_PROXY`` for https URLs, ``http_proxy``/``HTTP_PROXY`` for http,
  ``all_proxy``/``ALL_PROXY`` for both when the scheme's own is unset (lower case first);
- ``no_proxy``/``NO_PROXY``: ``*``, host names, domains (``example.com`` and
  ``.example.com`` both match its subdomains), ``host:port``, IP addresses and CIDRs;
- ``SSL_CERT_FILE``, then ``REQUESTS_CA_BUNDLE``, else the system store.

Proxy credentials (``http://user:pass@proxy:3128``) are split off the URL here and go to
the proxy only, as ``Proxy-Authorization``; ``redacted`` is the form for messages.
``S3Config`` is how S3 endpoints are reached (endpoint, region, addressing): it lives
here, not in ``config``, so the S3 client names it without importing the TOML loader.
"""

from __future__ import annotations

import base64
import fnmatch
import functools
import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from shardsync.errors import ConfigError

__all__ = [
    "Addressing",
    "NetworkConfig",
    "NoProxy",
    "Proxy",
    "Route",
    "S3Config",
    "network_from_env",
    "ssl_context",
]


@dataclass(frozen=True, slots=True)
class Proxy:
    """A proxy URL without credentials, and the credentials apart."""

    url: str
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, text: str, *, source: str) -> Proxy:
        raw = text.strip()
        if "://" not in raw:
            raw = "http://" + raw  # curl's default scheme for a bare host:port
        parts = urlsplit(raw)
        if parts.scheme not in ("http", "https"):
            raise ConfigError(
                f"{source}: unsupported proxy scheme {parts.scheme!r} "
                "(use an http:// or https:// proxy URL)"
            )
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"{source}: invalid proxy port in {_redact(raw)!r}") from None
        if not parts.hostname:
            raise ConfigError(f"{source}: a proxy URL needs a host, got {_redact(raw)!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            # "http://u:pa/ss@proxy:3128" is host "u", port "pa"... or, with a numeric
            # password, a proxy that does not exist: a proxy URL has no path
            raise ConfigError(
                f"{source}: a proxy URL has no path, query or fragment, got {_redact(raw)!r} "
                "(percent-encode /, ?, # and @ in a user name or password)"
            )
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        netloc = f"{host}:{port}" if port else host
        return cls(
            url=urlunsplit((parts.scheme, netloc, "", "", "")),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
        )

    @property
    def redacted(self) -> str:
        return self.url if self.username is None else self.url.replace("://", "://***@", 1)

    @property
    def authorization(self) -> str | None:
        """Its credentials as a ``Proxy-Authorization`` value (Basic), if its URL names any."""
        if self.username is None:
            return None
        pair = f"{self.username}:{self.password or ''}".encode()
        return "Basic " + base64.b64encode(pair).decode()


@dataclass(frozen=True, slots=True)
class Route:
    """How a request to one URL goes: through ``proxy`` (None: directly), the proxy's
    credentials in the request itself where the URL is http (it goes to the proxy as it
    is), else in the ``CONNECT`` (inside the tunnel they would reach the origin)."""

    proxy: str | None = None
    authorization: str | None = field(default=None, repr=False)
    tunnel: bool = False

    @property
    def request_headers(self) -> dict[str, str]:
        """What the request itself carries for the proxy."""
        if self.authorization is None or self.tunnel:
            return {}
        return {"Proxy-Authorization": self.authorization}

    @property
    def connect_headers(self) -> dict[str, str]:
        """What the ``CONNECT`` carries (aiohttp sends ``proxy_headers`` on it only)."""
        if self.authorization is None or not self.tunnel:
            return {}
        return {"Proxy-Authorization": self.authorization}


def _redact(url: str) -> str:
    """``url`` without its userinfo, cut at the last ``@``: a password holding ``/``, ``?``
    or ``#`` unencoded is no userinfo to ``urlsplit``, and was shown whole."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


@dataclass(frozen=True, slots=True)
class NoProxy:
    """Parsed ``NO_PROXY``: which hosts are reached directly."""

    everything: bool = False
    names: tuple[tuple[str, int | None], ...] = ()  # (lower-case name or domain, port)
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, text: str) -> NoProxy:
        names: list[tuple[str, int | None]] = []
        networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            if item == "*":
                return cls(everything=True)
            try:
                networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            host, port = _split_port(item)
            names.append((host.lower().lstrip(".").rstrip("."), port))
        return cls(names=tuple(names), networks=tuple(networks))

    def bypass(self, host: str, port: int | None) -> bool:
        if self.everything:
            return True
        host = host.lower().rstrip(".")
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            address = None
        if address is not None and any(address in net for net in self.networks):
            return True
        for name, only_port in self.names:
            if only_port is not None and only_port != port:
                continue
            if host == name or host.endswith("." + name):
                return True
        return False


def _split_port(item: str) -> tuple[str, int | None]:
    if item.startswith("["):  # [::1]:8080
        host, _, rest = item[1:].partition("]")
        return host, _port(rest[1:]) if rest.startswith(":") else None
    host, sep, port = item.rpartition(":")
    number = _port(port) if sep and host.count(":") == 0 else None
    return (item, None) if number is None else (host, number)


def _port(text: str) -> int | None:
    """ASCII digits as a number: ``"\u00b2".isdigit()`` is true, yet ``int`` refuses it."""
    return int(text) if text.isascii() and text.isdigit() else None


@dataclass(frozen=True, slots=True)
class NetworkConfig:
    """Resolved network settings (the ``[network]`` section over the environment)."""

    http_proxy: Proxy | None = None
    https_proxy: Proxy | None = None
    no_proxy: NoProxy = field(default_factory=NoProxy)
    ca_bundle: Path | None = None
    headers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # host glob -> headers
    metadata_timeout: float = 120.0

    def proxy_for(self, url: str) -> Proxy | None:
        """The proxy a request to ``url`` goes through, or None for a direct connection."""
        parts = urlsplit(url)
        proxy = self.https_proxy if parts.scheme == "https" else self.http_proxy
        if proxy is None or not parts.hostname:
            return None
        try:
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        except ValueError:
            return None
        return None if self.no_proxy.bypass(parts.hostname, port) else proxy

    def route(self, url: str) -> Route:
        """The proxy ``url`` goes through (``proxy_for``) and where its credentials go."""
        proxy = self.proxy_for(url)
        if proxy is None:
            return Route()
        tunnel = urlsplit(url).scheme != "http"
        return Route(proxy.url, proxy.authorization, tunnel)

    def extra_headers(self, url: str) -> dict[str, str]:
        """Configured headers for the URL's host (e.g. Dragonfly's task-id filters)."""
        host = (urlsplit(url).hostname or "").lower()
        out: dict[str, str] = {}
        for pattern, headers in self.headers.items():
            if fnmatch.fnmatchcase(host, pattern.lower()):
                out.update(headers)
        return out


def network_from_env(
    env: Mapping[str, str],
    *,
    proxy: str | None = None,
    no_proxy: str | None = None,
    ca_bundle: str | None = None,
    headers: Mapping[str, Mapping[str, str]] | None = None,
    metadata_timeout: float = 120.0,
) -> NetworkConfig:
    """Resolve the proxies and CA bundle from ``env``; the keyword arguments (``[network]``)
    win over the variables."""

    def var(name: str) -> tuple[str, str] | None:
        for key in (name.lower(), name.upper()):
            if env.get(key):
                return env[key], key
        return None

    def parsed(found: tuple[str, str] | None) -> Proxy | None:
        return None if found is None else Proxy.parse(found[0], source=found[1])

    if proxy is not None:
        http = https = Proxy.parse(proxy, source="network.proxy") if proxy else None
    else:
        fallback = var("all_proxy")
        http = parsed(var("http_proxy") or fallback)
        https = parsed(var("https_proxy") or fallback)
    skip = no_proxy if no_proxy is not None else (var("no_proxy") or ("", ""))[0]
    bundle: Path | None = None
    for value, source in (
        (ca_bundle, "network.ca_bundle"),
        (env.get("SSL_CERT_FILE"), "SSL_CERT_FILE"),
        (env.get("REQUESTS_CA_BUNDLE"), "REQUESTS_CA_BUNDLE"),
    ):
        if value:
            bundle = Path(value).expanduser()
            if not bundle.is_file():
                raise ConfigError(f"{source}: no CA bundle file at {str(bundle)!r}")
            break
    return NetworkConfig(
        http_proxy=http,
        https_proxy=https,
        no_proxy=NoProxy.parse(skip),
        ca_bundle=bundle,
        headers=dict(headers or {}),
        metadata_timeout=metadata_timeout,
    )


def ssl_context(network: NetworkConfig) -> ssl.SSLContext:
    """Verification on, with the configured CA bundle or else the system store: the same
    trust for the Hub, its CDN, plain URLs, S3, the tier and the daemon's downloads. One
    context per bundle as it is on disk, or per system store as the environment names it:
    loading one cost 17 ms each time (the engine's session, the fetcher's bodies and the S3
    reads each asked). A new session (a later ``shardsync.load`` in the same process) gets
    a bundle replaced since; one open keeps the context it was made with."""
    if network.ca_bundle is None:
        system = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return _context(None, system)
    try:
        seen = network.ca_bundle.stat()
        return _context(str(network.ca_bundle), (seen.st_mtime_ns, seen.st_size, seen.st_ino))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load CA bundle {network.ca_bundle}: {exc}") from None


@functools.lru_cache(maxsize=8)
def _context(cafile: str | None, version: tuple[object, ...]) -> ssl.SSLContext:
    """``version``: the file's identity (a bundle replaced on disk is loaded again), or the
    variables that name the system store."""
    return ssl.create_default_context(cafile=cafile)


Addressing = Literal["auto", "path", "virtual"]


@dataclass(frozen=True, slots=True)
class S3Config:
    """The ``[s3]`` section: overrides of the standard AWS chain for every S3 request.

    None keeps what the chain says (``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, ``AWS_PROFILE``,
    ``~/.aws/config``); credentials always come from the chain, never from this file.
    ``addressing = "path"`` suits stores without per-bucket host names (MinIO, SeaweedFS,
    Ceph RGW on a bare IP).
    """

    endpoint: str | None = None
    region: str | None = None
    addressing: Addressing = "auto"
    profile: str | None = None
    # most Range connections per object and the most bytes per Range request (s3:// sources
    # and tier reads; the connections at most the download section's). s5cmd's own choice
    # is alike (5 x 50 MiB). Against SeaweedFS on 2 cores, 4 x 64 MiB took 1.66-1.77 client
    # CPU-s/GB and 2.32-2.40 of the store's CPU-s per 2 GB where 8 x 16 MiB took 2.13-2.18
    # and 2.62-2.85 (bench/README.md, s3.py); raise the connections for AWS S3 on a fast NIC
    connections_per_file: int = 4
    chunk_size: int = 64 << 20
    # every request says the reader pays (``x-amz-request-payer: requester``): S3 refuses
    # any other with 403 on a Requester Pays bucket; harmless on others
    requester_pays: bool = False
