"""shardsync: fast, verified, resumable downloads of sharded model checkpoints."""

from __future__ import annotations

from shardsync.errors import ShardsyncError

__all__ = ["ShardsyncError", "__version__"]
__version__ = "0.1.0"
