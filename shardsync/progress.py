"""Progress display for the CLI: tqdm bars on a terminal, plain log lines otherwise.

Both implement the engine's ``ProgressSink``; neither is imported by the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Never, TextIO

from shardsync.records import FileOutcome

if TYPE_CHECKING:  # imported by the bars alone: a quiet or logged command never pays for it
    from tqdm import tqdm

__all__ = ["BarProgress", "LogProgress", "format_bytes", "make_progress"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class BarProgress:
    """A total bar plus one bar per file in flight (bytes, rate, ETA)."""

    def __init__(self, stream: TextIO, label: str) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._stream = stream
        self._total = tqdm(
            total=0,
            desc=label,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=stream,
            position=0,
            dynamic_ncols=True,
        )
        self._bars: dict[str, tqdm[Never]] = {}
        self._sizes: dict[str, int | None] = {}

    def add_file(self, path: str, size: int | None) -> None:
        self._sizes[path] = size
        if size:
            self._total.total = (self._total.total or 0) + size
            self._total.refresh()

    def advance(self, path: str, nbytes: int) -> None:
        bar = self._bars.get(path)
        if bar is None:
            bar = self._tqdm(
                total=self._sizes.get(path),
                desc=path[-40:],
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self._stream,
                leave=False,
                position=len(self._bars) + 1,
                dynamic_ncols=True,
            )
            self._bars[path] = bar
        bar.update(nbytes)
        self._total.update(nbytes)

    def file_done(self, outcome: FileOutcome) -> None:
        bar = self._bars.pop(outcome.path, None)
        if bar is not None:
            bar.close()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._total.close()


class LogProgress:
    """One line per finished file and a summary line every ``interval`` seconds."""

    def __init__(
        self,
        stream: TextIO,
        label: str,
        *,
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._label = label
        self._interval = interval
        self._clock = clock
        self._start = clock()
        self._last = self._start
        self._done = 0
        self._total = 0
        self._files = 0
        self._finished = 0
        self._sizes_known = True

    def add_file(self, path: str, size: int | None) -> None:
        self._files += 1
        self._total += size or 0
        self._sizes_known = self._sizes_known and size is not None

    def advance(self, path: str, nbytes: int) -> None:
        self._done += nbytes
        now = self._clock()
        if now - self._last >= self._interval:
            self._last = now
            self._line(now)

    def file_done(self, outcome: FileOutcome) -> None:
        self._finished += 1
        how = {
            "network": "downloaded",
            "cache": "in cache",
            "local": "copied",
            "tier": "from the tier",
        }[outcome.source]
        self._write(
            f"{self._label}: {outcome.path} {format_bytes(outcome.size)} {how}, "
            f"verified={outcome.verified} ({self._finished}/{self._files})"
        )

    def close(self) -> None:
        if self._files:
            self._line(self._clock())

    def _line(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = self._done / elapsed
        total = pct = eta = ""
        if self._sizes_known and self._total:
            total = f" / {format_bytes(self._total)}"
            pct = f" ({100 * self._done / self._total:.0f}%)"
            if rate > 0 and self._total > self._done:
                eta = f", ETA {(self._total - self._done) / rate:.0f}s"
        self._write(
            f"{self._label}: {format_bytes(self._done)}{total}{pct}, {format_bytes(rate)}/s{eta}"
        )

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()


def make_progress(stream: TextIO, label: str) -> BarProgress | LogProgress:
    """Bars when a person watches a terminal, log lines for journald and CI logs."""
    if stream.isatty():
        return BarProgress(stream, label)
    return LogProgress(stream, label)
