from __future__ import annotations

import io

from shardsync.progress import BarProgress, LogProgress, format_bytes, make_progress
from shardsync.records import FileOutcome


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _outcome(path: str, size: int) -> FileOutcome:
    return FileOutcome(path, size, "0" * 64, "sha256", "network", size, 0)


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 30) == "3.0 GiB"


def test_log_lines_with_rate_and_eta() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = LogProgress(out, "acme/x", interval=1.0, clock=lambda: now[0])
    progress.add_file("a.safetensors", 1000)
    progress.add_file("b.safetensors", 1000)
    now[0] = 2.0
    progress.advance("a.safetensors", 1000)
    progress.file_done(_outcome("a.safetensors", 1000))
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "acme/x: 1000 B / 2.0 KiB (50%), 500 B/s, ETA 2s"
    assert lines[1] == "acme/x: a.safetensors 1000 B downloaded, verified=sha256 (1/2)"


def test_log_without_known_sizes_shows_no_percentage() -> None:
    out = io.StringIO()
    progress = LogProgress(out, "u", interval=0.0, clock=lambda: 1.0)
    progress.add_file("a", None)
    progress.advance("a", 10)
    assert "%" not in out.getvalue() and "ETA" not in out.getvalue()


def test_nothing_printed_when_nothing_started() -> None:
    out = io.StringIO()
    LogProgress(out, "x").close()
    assert out.getvalue() == ""


def test_bars_on_a_terminal() -> None:
    out = _Tty()
    progress = make_progress(out, "acme/x")
    assert isinstance(progress, BarProgress)
    progress.add_file("a.safetensors", 4096)
    progress.advance("a.safetensors", 4096)
    progress.file_done(_outcome("a.safetensors", 4096))
    progress.close()
    assert "acme/x" in out.getvalue() and "4.00k" in out.getvalue()
    assert isinstance(make_progress(io.StringIO(), "x"), LogProgress)
