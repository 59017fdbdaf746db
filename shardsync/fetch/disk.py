"""Body bytes to the partial file: positioned writes, and the kernel told to write them back.

Called from worker threads and the pump's thread as well as the event loop's executor; each
function looks its ``os`` call up when it runs (a crash test swaps them after import).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

__all__ = ["start_writeback", "write_all"]

_IOV_MAX = 512  # pieces per pwritev call, well under the kernel's IOV_MAX (1024)


def write_all(fd: int, pieces: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``pieces`` back to back at ``offset`` (``pwritev``), retrying short writes: a
    write cut short by a full disk is followed by one that fails with ENOSPC."""
    views = [memoryview(p) for p in pieces if p]
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)  # Linux only
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    _sync_file_range.restype = ctypes.c_int


def start_writeback(fd: int, start: int, end: int) -> None:
    """Have the kernel start writing bytes ``[start, end)`` of ``fd`` to disk now, without
    waiting (``sync_file_range``). The fsync before publishing then finds little left to
    do; without this a download smaller than the dirty-page threshold (10% of RAM by
    default: many GB on a GPU host) reaches the disk only in that fsync. Best effort: where
    the call is missing or refused, the fsync does it all, as before."""
    if _sync_file_range is not None and end > start:
        _sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)
