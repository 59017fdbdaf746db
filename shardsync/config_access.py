"""The ``[daemon]`` section's access settings, checked: who may reach the daemon and where.

The socket's mode (read-write bits, 0600 at least), users and groups (a name, looked up in
the system's databases, or an id) and the TCP listener's address (loopback unless
``daemon.tcp_allow_remote`` says otherwise). Each raises one ``ConfigError`` naming the key.
"""

from __future__ import annotations

import grp
import ipaddress
import pwd
from collections.abc import Callable

from shardsync.errors import ConfigError

__all__ = ["group_id", "id_list", "socket_mode", "tcp_address", "user_id"]


def socket_mode(value: object) -> int:
    """``0o600`` in TOML, or an octal string like ``"0660"``; read-write bits only."""
    mode: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str):
        try:
            mode = int(value.removeprefix("0o"), 8)
        except ValueError:
            mode = None
    if mode is None or mode & ~0o666 or mode & 0o600 != 0o600:
        raise ConfigError(
            f"daemon.socket_mode must be an octal mode of read/write bits including 0600, "
            f'like 0o600 or "0660" (got {value!r})'
        )
    return mode


def user_id(key: str, value: object) -> int:
    if isinstance(value, str):
        try:
            return pwd.getpwnam(value).pw_uid
        except KeyError:
            raise ConfigError(f"{key}: no user named {value!r}") from None
    return _nonnegative(key, value)


def group_id(key: str, value: object) -> int:
    if isinstance(value, str):
        try:
            return grp.getgrnam(value).gr_gid
        except KeyError:
            raise ConfigError(f"{key}: no group named {value!r}") from None
    return _nonnegative(key, value)


def _nonnegative(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: expected a name or a non-negative id (got {value!r})")
    return value


def id_list(key: str, value: object, one: Callable[[str, object], int]) -> list[int]:
    if not isinstance(value, list):
        raise ConfigError(f"{key} must be a list of names or ids")
    return [one(key, item) for item in value]


def tcp_address(value: object, *, allow_remote: bool) -> tuple[str, int] | None:
    """``"127.0.0.1:9464"`` or ``"[::1]:9464"``; anything but loopback needs an explicit yes."""
    if not isinstance(value, str):
        raise ConfigError('daemon.tcp must be a "HOST:PORT" string')
    if not value:
        return None
    host, sep, port_text = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if (
        not sep
        or not host
        or not (port_text.isascii() and port_text.isdigit())
        or not 0 <= int(port_text) <= 65535
    ):
        raise ConfigError(f'daemon.tcp must look like "127.0.0.1:9464" (got {value!r})')
    if not allow_remote:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ConfigError(
                f"daemon.tcp: {host} is not a loopback address; set "
                "daemon.tcp_allow_remote = true to listen on it"
            )
    return host, int(port_text)
