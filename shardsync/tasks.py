"""Steps that must run to their end once begun, whoever is cancelled meanwhile (no I/O, no
shardsync imports)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["to_the_end"]

_T = TypeVar("_T")


async def to_the_end(step: Awaitable[_T]) -> _T:
    """Run ``step`` to its end even when the caller is cancelled meanwhile, then raise the
    cancellation (once, however many arrived). For what a cancel would split: a file's
    cleanup (stopped halfway it leaves threads, sockets and descriptors open for the life of
    the process), a publish in a thread (``asyncio.to_thread`` cancelled before its thread
    starts never runs it, leaving a verified file's private name in ``tmp/``), or a write in
    a thread into a descriptor the caller's cleanup closes (the thread runs on; closed under
    it, the number may be another file's by then)."""
    task = asyncio.ensure_future(step)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return result
