"""The daemon's listening sockets: the Unix socket and the optional TCP listener.

The Unix socket lives in a directory only the daemon's user (and, with ``daemon.group``,
that group) can traverse; it gets the configured mode and group before anyone can connect.
A socket left by a dead daemon is cleared, a live daemon's is never stolen (a lock file beside
it is held for the daemon's life: one still starting, bound but not yet listening, is live
too), and at exit only the file this daemon bound is removed. Every failure is a
``ConfigError`` naming the key.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

from shardsync.config import Config
from shardsync.errors import ConfigError

__all__ = ["bind_tcp", "bind_unix", "host_port", "unlink_socket"]

log = logging.getLogger("shardsync.daemon")  # what it warns of is the daemon's to say


def _give_group(path: Path, group: int | None) -> None:
    """Give ``path`` to ``group`` unless it has it: under systemd's ``Group=`` it already
    does, and the unit's ``SystemCallFilter=`` refuses ``chown`` (``@privileged``)."""
    if group is not None and os.lstat(path).st_gid != group:
        os.chown(path, -1, group)


def bind_unix(path: Path, config: Config) -> tuple[socket.socket, int, int]:
    """A bound (not yet listening) socket with its mode and group set, in a private directory;
    the inode of its file (so that only this file is removed at exit); and the descriptor of
    the lock beside it, to hold until then."""
    daemon = config.daemon
    directory = path.parent
    try:
        if not directory.exists():
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(mode=0o700)
            mode = 0o710 if daemon.group is not None else 0o700
            _give_group(directory, daemon.group)
            os.chmod(directory, mode)
        st = os.lstat(directory)
    except OSError as exc:
        raise ConfigError(f"daemon.socket: cannot create {directory}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(
            f"daemon.socket: {directory} must be a directory owned by uid {os.geteuid()} "
            "(not a symlink)"
        )
    if st.st_mode & 0o027:
        raise ConfigError(
            f"daemon.socket: {directory} has mode {stat.S_IMODE(st.st_mode):04o}; other users "
            "could reach the socket. Use a directory of mode 0700 (0710 with daemon.group)"
        )
    if daemon.group is not None and not st.st_mode & 0o010:
        log.warning("%s is not searchable by its group; group members cannot connect", directory)
    lock = _hold_lock(path)
    try:
        _clear_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(path))
            os.chmod(path, daemon.socket_mode)
            _give_group(path, daemon.group)
            inode = os.lstat(path).st_ino
        except OSError as exc:
            sock.close()
            raise ConfigError(f"daemon.socket: cannot listen on {path}: {exc}") from None
    except BaseException:
        os.close(lock)
        raise
    return sock, inode, lock


def _hold_lock(path: Path) -> int:
    """The lock beside the socket, held (the kernel lets go of it when the daemon dies)."""
    lock_path = path.with_name(f"{path.name}.lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"daemon.socket: cannot open {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(f"another shardsync daemon is already listening on {path}") from None
        raise ConfigError(f"daemon.socket: cannot lock {lock_path}: {exc.strerror}") from None
    return fd


def _clear_stale(path: Path) -> None:
    """Remove a socket left by a dead daemon; refuse to steal a live one's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"daemon.socket: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ConfigError(f"daemon.socket: cannot check {path}: {exc.strerror}") from None
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise ConfigError(f"another shardsync daemon is already listening on {path}")


def unlink_socket(path: Path, inode: int) -> None:
    """Remove our socket file, not one a successor has bound meanwhile."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == inode:
            path.unlink()


def bind_tcp(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as exc:
        raise ConfigError(f"daemon.tcp: cannot listen on {host}:{port}: {exc.strerror}") from None


def host_port(address: tuple[str, int] | None) -> str:
    if address is None:
        return ""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
