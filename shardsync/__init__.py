"""shardsync: fast, verified, resumable downloads of sharded model checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.errors import ShardsyncError

if TYPE_CHECKING:
    from shardsync.loader import load, stream

__all__ = ["ShardsyncError", "__version__", "load", "stream"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``shardsync.load``/``shardsync.stream`` import torch only when first used."""
    if name in ("load", "stream"):
        from shardsync import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'shardsync' has no attribute {name!r}")
