"""Steps that must run to their end once begun, whoever is cancelled meanwhile (no I/O, no
shardsync imports)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["opened", "to_the_end"]

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


async def opened(step: Awaitable[_T | None], close: Callable[[_T], object]) -> _T | None:
    """Run ``step``, which opens something only its caller closes (a file opened in a
    thread), to its end; if the caller is cancelled meanwhile, ``close`` what it opened
    (unless None) before the cancellation is raised. A thread a cancel cannot stop would
    otherwise hand its descriptor to no one: open for the life of the process, one more
    for every cancelled job."""
    task = asyncio.ensure_future(step)
    try:
        return await to_the_end(task)
    except asyncio.CancelledError:
        if task.done() and not task.cancelled() and task.exception() is None:
            made = task.result()
            if made is not None:
                close(made)
        raise
