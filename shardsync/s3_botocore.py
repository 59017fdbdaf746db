"""botocore's hooks, as the S3 client registers them: presigned URLs for the bucket's own
region, the reader paying where the config says so, and the HTTP session it connects with.
botocore's own modules are imported inside them, so a run that reads without botocore
(``s3_direct``) never imports it."""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import quote

from shardsync.network import NetworkConfig, Proxy

__all__ = ["presign_for_own_region", "requester_pays", "session_class"]


def presign_for_own_region(
    builtins: dict[str, Any], context: dict[str, Any], region: str | None, **_: Any
) -> None:
    """Point a presigned URL at its region's own host. botocore points it at the global
    one (``BUCKET.s3.amazonaws.com``), which refuses buckets in the regions opened since
    2019 (``me-south-1``, ``ap-east-1``, ...); every region's own host serves its buckets."""
    if context.get("is_presign_request") and region and builtins.get("AWS::Region") == "aws-global":
        builtins["AWS::Region"] = region


def requester_pays(params: dict[str, Any], model: Any, **_: Any) -> None:
    """Every operation that can say so says the reader pays (``[s3] requester_pays``); a
    presigned GET then signs the header, and its requests must send it (``presign_get``)."""
    shape = model.input_shape
    if shape is not None and "RequestPayer" in shape.members:
        params.setdefault("RequestPayer", "requester")


def session_class(network: NetworkConfig) -> type:
    """aiobotocore's HTTP session as the fetcher connects: each request's proxy chosen by our
    rules (``NO_PROXY`` with CIDRs) for the URL it goes to, and, with no CA bundle
    configured, the system's CAs trusted (``SSL_CERT_FILE``, ``SSL_CERT_DIR``) besides
    botocore's own bundle. botocore's choice was made once, for a guess at the endpoint (not
    the one an AWS profile names), and trusted its bundle only: a store signed by a CA
    installed system-wide failed for ``s3://`` and the tier and served plain URLs."""
    from aiobotocore.httpsession import AIOHTTPSession
    from botocore.httpsession import ProxyConfiguration

    class Proxies(ProxyConfiguration):  # type: ignore[misc]
        def proxy_url_for(self, url: str) -> str | None:
            proxy = network.proxy_for(url)
            if proxy is None:
                return None
            return proxy.url if proxy.username is None else _with_userinfo(proxy.url, proxy)

    class Session(AIOHTTPSession):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            settings = kwargs.get("proxies_config")
            self._proxy_config = Proxies(proxies_settings=settings)

        def _get_ssl_context(self) -> ssl.SSLContext:
            context: ssl.SSLContext = super()._get_ssl_context()
            if network.ca_bundle is None:
                context.load_default_certs()
            return context

    return Session


def _with_userinfo(url: str, proxy: Proxy) -> str:
    """botocore takes proxy credentials inside the URL (it never logs the URL)."""
    user = quote(proxy.username or "", safe="")
    password = quote(proxy.password or "", safe="")
    return url.replace("://", f"://{user}:{password}@", 1)
