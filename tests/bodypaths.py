"""The paths a body can take from a server into a partial file, as one fixture.

Every integrity and hostile-server test takes ``body_path`` and so runs on each of them; a
new path is one more entry in ``BODY_PATHS``:

- ``direct``: the body is framed by ``Content-Length`` and shardsync's pump reads it
  (``shardsync.fetch.wire``);
- ``chunked``: the server sends ``Transfer-Encoding: chunked``, which only the aiohttp path
  reads (the pump hands such an answer over);
- ``proxy``: every request goes through a forward proxy (``shardsync.testing.relay.Relay``,
  which relays the server's bytes as sent), which shardsync speaks to with aiohttp.

``check()`` afterwards proves the path was really taken, so a test cannot pass on another.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest

from shardsync.config import Config
from shardsync.network import network_from_env
from shardsync.testing import ChunkedBody, FakeHub, Rule
from shardsync.testing.relay import Relay

BODY_PATHS = ("direct", "chunked", "proxy")
CHUNK = 8 * 1024  # small chunks: a body cut early still ends some of them


@dataclass
class BodyPath:
    name: str
    relay: Relay | None = None
    rule: Rule | None = None

    @property
    def chunked(self) -> bool:
        return self.name == "chunked"

    def configure(self, config: Config) -> Config:
        """`config` with this path's proxy, if it has one."""
        if self.relay is None:
            return config
        return replace(config, network=network_from_env({"http_proxy": self.relay.url}))

    def arm(self, hub: FakeHub) -> None:
        """Make `hub` answer the way this path needs (chunked bodies, for ``chunked``)."""
        if self.chunked and self.rule is None:
            self.rule = hub.faults.add(ChunkedBody(piece=CHUNK))

    def check(self) -> None:
        """The bodies really took this path."""
        if self.relay is not None:
            assert self.relay.statuses("GET"), "nothing went through the proxy"
        if self.chunked:
            assert self.rule is not None and self.rule.fired, "no body was sent chunked"


@pytest.fixture(params=BODY_PATHS)
async def body_path(request: pytest.FixtureRequest) -> AsyncIterator[BodyPath]:
    if request.param != "proxy":
        yield BodyPath(request.param)
        return
    async with Relay() as relay:
        yield BodyPath("proxy", relay)
