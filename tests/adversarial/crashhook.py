"""Run ``shardsync`` with its publishing steps traced, cut short by SIGKILL, or failed with EIO.

Usage (tests only)::

    SHARDSYNC_CRASHHOOK_ROOT=<cache root> [SHARDSYNC_CRASHHOOK_TRACE=<file>] \\
    [SHARDSYNC_CRASHHOOK=<action>] python tests/adversarial/crashhook.py <shardsync CLI args...>

Before shardsync (and aiofiles, which binds ``os`` functions at import) is imported, the OS
calls that make up publishing are wrapped. A call on a path below the cache root is a *step*,
named ``<kind> <category>``:

- kinds: ``write`` (``os.write``/``pwrite``/``pwritev``), ``fsync_file`` and ``fsync_dir``
  (``os.fsync``, told apart by ``fstat``), ``link``, ``symlink``, ``rename``
  (``os.rename``/``os.replace``), ``unlink`` (``os.unlink``/``os.remove``);
- categories, from the path the step writes (the destination of a link or rename):
  ``partial`` (blob data being downloaded), ``sidecar`` (its resume record), ``store``
  (final blob names), ``blobs``/``snapshot``/``ref`` (the Hugging Face view), ``record``
  (snapshot records), ``lease``, ``access``, ``journal``, ``lock``, ``layout`` and ``view``
  (directories). A temp file in ``tmp/`` is named for what it becomes, as its purpose says
  (``shardsync.layout.TEMP_BECOMES``: ``blob.*`` -> ``blobs``, ``resume.*`` -> ``sidecar``).

Steps run one at a time (under a lock), so the trace is their real order and a kill never
lands while another step is half done. The fetcher's resume record is written through a
buffered file object, not ``os.write``: its step is the ``rename sidecar`` that publishes it.

``SHARDSYNC_CRASHHOOK_TRACE`` gets one line per step, then one line for the action taken
(``KILL before <step>``, ``KILL after <step>``, ``KILL at byte <N> in <step>``,
``EIO <step>``). ``SHARDSYNC_CRASHHOOK`` is one action, ``<sel>`` being ``<kind>`` or
``<kind>/<category>`` and ``<n>`` counting matching steps from 1:

- ``<sel>@<name>`` counts only the steps whose path (a link's or rename's destination) is
  named ``<name>``: ``kill:link/store@<sha256>:1`` dies right before one chosen blob is
  linked into the store, whichever order the files finish in;
- ``kill:<sel>:<n>``: SIGKILL the process right before the n-th matching step;
- ``killafter:<sel>:<n>``: right after it returned;
- ``eio:<sel>:<n>``: fail it with ``OSError(EIO)`` instead of doing it (a failing disk);
- ``killbytes:<N>``: SIGKILL once N bytes of blob data were written; the write that crosses
  N is cut there, so the partial file ends at an arbitrary byte.

SIGKILL, not an exception: no ``finally`` block, handler or buffered write runs, exactly as
when the kernel's OOM killer or ``kill -9`` strikes.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NoReturn, TypeVar

from shardsync.layout import TEMP_BECOMES, temp_purpose  # pure: binds no os function

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike, ReadableBuffer, StrOrBytesPath

__all__ = ["ENV_ACTION", "ENV_ROOT", "ENV_TRACE", "Action", "Hook", "install", "main"]

ENV_ACTION = "SHARDSYNC_CRASHHOOK"
ENV_ROOT = "SHARDSYNC_CRASHHOOK_ROOT"
ENV_TRACE = "SHARDSYNC_CRASHHOOK_TRACE"

Mode = Literal["kill", "killafter", "eio", "killbytes"]
_MODES: dict[str, Mode] = {"kill": "kill", "killafter": "killafter", "eio": "eio"}
_T = TypeVar("_T")

_LAYOUT_DIRS = frozenset(
    {"store", "hub", "other", "state", "partial", "locks", "tmp", "quarantine"}
)
_VIEW_PARTS = {"blobs": "blobs", "snapshots": "snapshot", "refs": "ref"}
_STATE_PARTS = {
    "snapshots": "record",
    "leases": "lease",
    "access.log": "access",
    "daemon": "journal",
}

_real_write = os.write
_real_pwrite = os.pwrite
_real_pwritev = os.pwritev
_real_fsync = os.fsync
_real_link = os.link
_real_symlink = os.symlink
_real_rename = os.rename
_real_replace = os.replace
_real_unlink = os.unlink


@dataclass(frozen=True, slots=True)
class Action:
    """What to do at one step: ``n`` is the ordinal (or the byte count for ``killbytes``)."""

    mode: Mode
    selector: str
    n: int
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> Action:
        head, _, rest = text.partition(":")
        if head == "killbytes":
            if not rest.isdigit() or int(rest) < 1:
                raise ValueError(f"killbytes needs a positive byte count: {text!r}")
            return cls("killbytes", "write/partial", int(rest))
        selector, _, nth = rest.rpartition(":")
        selector, at, name = selector.partition("@")
        mode = _MODES.get(head)
        if mode is None or not selector or (at and not name) or not nth.isdigit() or int(nth) < 1:
            raise ValueError(
                f"expected kill|killafter|eio:<kind>[/<category>][@<name>]:<n>, got {text!r}"
            )
        return cls(mode, selector, int(nth), name or None)

    def matches(self, kind: str, category: str, name: str | None) -> bool:
        if self.name is not None and name != self.name:
            return False
        return self.selector in (kind, f"{kind}/{category}")


class Hook:
    """Names steps, keeps the trace and counts matches (thread-safe: the fetcher writes from a
    thread pool)."""

    def __init__(self, root: str, trace: str | None, action: Action | None) -> None:
        self.root = os.path.realpath(root)
        self.action = action
        self._lock = threading.Lock()
        self._matched = 0
        self._data_bytes = 0
        self._trace = None
        if trace:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            self._trace = os.open(trace, flags, 0o644)

    # -- naming ------------------------------------------------------------------------------

    def category(self, path: str) -> str | None:
        """The category of a real absolute path, or None when it is outside the cache."""
        if path == self.root:
            return "view"
        if not path.startswith(self.root + os.sep):
            return None
        parts = path[len(self.root) + 1 :].split(os.sep)
        top, name = parts[0], parts[-1]
        if len(parts) == 1:
            return "view" if top in _LAYOUT_DIRS else "layout"
        if top == "store":  # store/sha256 itself only changes when a fan-out folder is made
            return "store" if len(parts) > 2 else "view"
        if top == "partial":
            return "partial" if name.endswith(".part") else "sidecar"
        if top == "tmp":
            return TEMP_BECOMES.get(temp_purpose(name), "tmp")
        if top in ("hub", "other"):
            return _VIEW_PARTS.get(parts[2], "view") if len(parts) > 2 else "view"
        if top == "state":
            if parts[1] == "snapshots" and len(parts) == 2:
                return "view"  # a repo's record folder being made
            return _STATE_PARTS.get(parts[1], "state")
        return {"locks": "lock", "quarantine": "quarantine"}.get(top, "view")

    def fd_category(self, fd: int) -> str | None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        except OSError:
            return None
        return self.category(path)

    def path_category(self, path: StrOrBytesPath, dir_fd: int | None) -> str | None:
        text = os.fsdecode(path)
        if not os.path.isabs(text):
            base = os.getcwd() if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
            text = os.path.join(base, text)
        head, tail = os.path.split(os.path.normpath(text))
        return self.category(os.path.join(os.path.realpath(head), tail))

    # -- acting ------------------------------------------------------------------------------

    def run(
        self, kind: str, category: str | None, call: Callable[[], _T], name: str | None = None
    ) -> _T:
        """Do one call: traced and counted when it is a step, killed or failed when chosen;
        ``name``: the last part of the path the step writes, when it has one.

        Steps run one at a time under the lock, so the trace lists them in the order they
        happened and a kill never lands while another step is half done.
        """
        if category is None:
            return call()
        step = f"{kind} {category}"
        with self._lock:
            self._note(step)
            action = self.action
            hit = False
            if (
                action is not None
                and action.mode != "killbytes"
                and action.matches(kind, category, name)
            ):
                self._matched += 1
                hit = self._matched == action.n
            if hit and action is not None and action.mode == "kill":
                self._die(f"KILL before {step}")
            if hit and action is not None and action.mode == "eio":
                self._note(f"EIO {step}")
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            result = call()
            if hit and action is not None and action.mode == "killafter":
                self._die(f"KILL after {step}")
            return result

    def write(
        self, fd: int, buffers: Sequence[ReadableBuffer], write: Callable[[list[memoryview]], int]
    ) -> int:
        """A data write; ``killbytes`` cuts the one that crosses its byte count and dies."""
        category = self.fd_category(fd)
        views = [memoryview(b).cast("B") for b in buffers]
        action = self.action
        if category != "partial" or action is None or action.mode != "killbytes":
            return self.run("write", category, lambda: write(views))
        with self._lock:
            room = action.n - self._data_bytes
            size = sum(len(v) for v in views)
            if size < room:
                self._data_bytes += size
                self._note("write partial")
                return write(views)
            cut: list[memoryview] = []
            for view in views:
                if room <= 0:
                    break
                cut.append(view[:room])
                room -= len(cut[-1])
            if cut:
                write(cut)
            self._die(f"KILL at byte {action.n} in write partial")

    def receive(self, view: memoryview, read: Callable[[memoryview], int]) -> int:
        """Body bytes received straight into a partial file's mapping (``shardsync.fetch.wire``):
        a ``write partial`` step like a ``pwrite``; ``killbytes`` cuts the one crossing N."""
        action = self.action
        if action is None or action.mode != "killbytes":
            return self.run("write", "partial", lambda: read(view))
        with self._lock:
            room = action.n - self._data_bytes
            n = read(view[:room] if room < len(view) else view)
            self._data_bytes += n
            self._note("write partial")
            if self._data_bytes >= action.n:
                self._die(f"KILL at byte {action.n} in write partial")
            return n

    def _note(self, line: str) -> None:
        if self._trace is not None:
            _real_write(self._trace, f"{line}\n".encode())

    def _die(self, line: str) -> NoReturn:
        self._note(line)
        os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(128 + signal.SIGKILL)  # not reached: SIGKILL ends the process first


def _name(path: StrOrBytesPath) -> str:
    return os.path.basename(os.path.normpath(os.fsdecode(path)))


def install(hook: Hook) -> None:
    """Replace the ``os`` functions shardsync publishes with by traced ones."""

    def write(fd: int, data: ReadableBuffer, /) -> int:
        return hook.write(fd, [data], lambda v: _real_write(fd, v[0]))

    def pwrite(fd: int, data: ReadableBuffer, offset: int, /) -> int:
        return hook.write(fd, [data], lambda v: _real_pwrite(fd, v[0], offset))

    def pwritev(fd: int, buffers: Sequence[ReadableBuffer], offset: int, flags: int = 0, /) -> int:
        return hook.write(fd, buffers, lambda v: _real_pwritev(fd, v, offset, flags))

    def fsync(fd: FileDescriptorLike) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        kind = "fsync_dir" if stat.S_ISDIR(os.fstat(number).st_mode) else "fsync_file"
        hook.run(kind, hook.fd_category(number), lambda: _real_fsync(number))

    def link(
        src: StrOrBytesPath,
        dst: StrOrBytesPath,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        hook.run(
            "link",
            hook.path_category(dst, dst_dir_fd),
            lambda: _real_link(
                src,
                dst,
                src_dir_fd=src_dir_fd,
                dst_dir_fd=dst_dir_fd,
                follow_symlinks=follow_symlinks,
            ),
            _name(dst),
        )

    def symlink(
        src: StrOrBytesPath,
        dst: StrOrBytesPath,
        target_is_directory: bool = False,
        *,
        dir_fd: int | None = None,
    ) -> None:
        hook.run(
            "symlink",
            hook.path_category(dst, dir_fd),
            lambda: _real_symlink(src, dst, target_is_directory, dir_fd=dir_fd),
            _name(dst),
        )

    def renamer(real: Callable[..., None]) -> Callable[..., None]:
        def rename(
            src: StrOrBytesPath,
            dst: StrOrBytesPath,
            *,
            src_dir_fd: int | None = None,
            dst_dir_fd: int | None = None,
        ) -> None:
            hook.run(
                "rename",
                hook.path_category(dst, dst_dir_fd),
                lambda: real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd),
                _name(dst),
            )

        return rename

    def unlink(path: StrOrBytesPath, *, dir_fd: int | None = None) -> None:
        hook.run(
            "unlink",
            hook.path_category(path, dir_fd),
            lambda: _real_unlink(path, dir_fd=dir_fd),
            _name(path),
        )

    replacements: dict[str, object] = {
        "write": write,
        "pwrite": pwrite,
        "pwritev": pwritev,
        "fsync": fsync,
        "link": link,
        "symlink": symlink,
        "rename": renamer(_real_rename),
        "replace": renamer(_real_replace),
        "unlink": unlink,
        "remove": unlink,
    }
    for name, function in replacements.items():
        setattr(os, name, function)

    from shardsync.fetch import wire  # after the swap: it binds none of them at import

    received = wire.Stream.readinto

    def readinto(self: wire.Stream, view: memoryview) -> int:
        return hook.receive(view, lambda v: received(self, v))

    wire.Stream.readinto = readinto  # type: ignore[method-assign]


def main(argv: Sequence[str]) -> int:
    root = os.environ.get(ENV_ROOT)
    if not root:
        print(f"crashhook: set {ENV_ROOT} to the cache root", file=sys.stderr)
        return 2
    spec = os.environ.get(ENV_ACTION)
    install(Hook(root, os.environ.get(ENV_TRACE), Action.parse(spec) if spec else None))
    from shardsync.cli import main as shardsync_main

    return shardsync_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
