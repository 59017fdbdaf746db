"""shardsync: fast, verified, resumable downloads of sharded model checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.errors import ShardsyncError
from shardsync.version import __version__

if TYPE_CHECKING:
    from shardsync.client import Client, SyncClient
    from shardsync.loader import load, stream, weights

__all__ = ["Client", "ShardsyncError", "SyncClient", "__version__", "load", "stream", "weights"]


def __getattr__(name: str) -> Any:
    """``shardsync.load``/``stream``/``weights`` import torch only when first used."""
    if name in ("load", "stream", "weights"):
        from shardsync import loader

        return getattr(loader, name)
    if name in ("Client", "SyncClient"):  # aiohttp and the engine load on first use too
        from shardsync import client

        return getattr(client, name)
    raise AttributeError(f"module 'shardsync' has no attribute {name!r}")
