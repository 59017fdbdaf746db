"""The systemd units (checked by systemd-analyze when present) and the sd_notify client."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemons import cli, short_tmp

from shardsync.notify import Notifier
from shardsync.testing.daemons import DaemonProcess, write_config

UNITS = Path(__file__).resolve().parent.parent / "systemd"
NAMES = ("shardsync.service", "shardsync-prune.service", "shardsync-prune.timer")
INSTALLED = "/usr/local/bin/shardsync"


def _unit(name: str) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as (key, value) lists: systemd allows repeated keys."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _get(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def test_the_service_is_a_hardened_notify_daemon() -> None:
    unit = _unit("shardsync.service")
    one = {k: v for k, v in unit["Service"]}
    assert one["Type"] == "notify" and one["Restart"] == "on-failure"
    assert one["ExecStart"].startswith(f"{INSTALLED} daemon ")
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert one["RuntimeDirectory"] == one["CacheDirectory"] == "shardsync"
    assert one["RuntimeDirectoryMode"] == "0710"  # the socket's directory: group may search
    assert one["User"] == one["Group"] == "shardsync"
    for key, value in {
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "PrivateDevices": "yes",
    }.items():
        assert one[key] == value, key
    assert _get(unit, "Install", "WantedBy") == ["multi-user.target"]


def test_prune_runs_daily_and_catches_up() -> None:
    timer = _unit("shardsync-prune.timer")
    assert _get(timer, "Timer", "OnCalendar") == ["daily"]
    assert _get(timer, "Timer", "Persistent") == ["true"]
    assert _get(timer, "Install", "WantedBy") == ["timers.target"]
    service = _unit("shardsync-prune.service")
    assert _get(service, "Service", "Type") == ["oneshot"]
    exec_start = _get(service, "Service", "ExecStart")[0]
    assert exec_start.startswith(f"{INSTALLED} ") and exec_start.endswith(" prune")


@pytest.fixture
def installed_units(tmp_path: Path) -> Path:
    """The units with ExecStart pointing at this environment's shardsync (verify checks it)."""
    here = Path(sys.executable).parent / "shardsync"
    exe = str(here) if here.exists() else shutil.which("shardsync")
    if exe is None:
        pytest.skip("the shardsync entry point is not installed")
    for name in NAMES:
        (tmp_path / name).write_text((UNITS / name).read_text().replace(INSTALLED, exe))
    return tmp_path


@pytest.mark.parametrize("name", ["shardsync.service", "shardsync-prune.service"])
def test_a_cache_dir_in_the_config_is_the_units_cache(name: str, tmp_path: Path) -> None:
    """docs/systemd.md: a ``cache.dir`` elsewhere needs only ``ReadWritePaths=``. The units'
    environment (``Environment=``, and ``CACHE_DIRECTORY`` that ``CacheDirectory=`` sets) must
    not override it, and without one the unit's cache directory is the cache."""
    from shardsync.config import load_config

    unit = _unit(name)
    env = dict(line.split("=", 1) for line in _get(unit, "Service", "Environment"))
    env.update(
        CACHE_DIRECTORY=f"/var/cache/{_get(unit, 'Service', 'CacheDirectory')[0]}",
        HOME="/var/cache/shardsync",
    )
    conf = tmp_path / "shardsync.toml"
    conf.write_text('[cache]\ndir = "/data/models"\n')
    assert load_config(conf, env).cache_dir == Path("/data/models")
    conf.write_text("")
    assert load_config(conf, env).cache_dir == Path("/var/cache/shardsync")


def test_systemd_analyze_verify(installed_units: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    paths = [str(installed_units / name) for name in NAMES]
    out = subprocess.run(
        [analyze, "verify", "--man=no", *paths], capture_output=True, text=True, timeout=60
    )
    complaints = [
        line
        for line in (out.stdout + out.stderr).splitlines()
        if any(name in line for name in NAMES) or str(installed_units) in line
    ]
    assert out.returncode == 0, out.stderr
    assert complaints == []


def _syscalls(analyze: str, names: list[str]) -> set[str]:
    """The system calls a ``SystemCallFilter=`` list names, its ``@groups`` expanded as
    systemd expands them."""
    found: set[str] = set()
    for name in names:
        if not name.startswith("@"):
            found.add(name)
            continue
        out = subprocess.run(
            [analyze, "syscall-filter", name], capture_output=True, text=True, check=True
        ).stdout
        for line in out.splitlines()[1:]:
            entry = line.strip()
            if entry and not entry.startswith("#"):
                found |= _syscalls(analyze, [entry])
    return found


def _unit_filter(analyze: str) -> Callable[[], None]:
    """What ``shardsync.service`` asks systemd for (``SystemCallFilter=`` lines in order,
    ``SystemCallErrorNumber=``, ``NoNewPrivileges=``), installed in a child with libseccomp
    as systemd does."""
    import ctypes
    import errno

    service = _unit("shardsync.service")
    allowed: set[str] = set()
    for line in _get(service, "Service", "SystemCallFilter"):
        if line.startswith("~"):
            allowed -= _syscalls(analyze, line[1:].split())
        else:
            allowed |= _syscalls(analyze, line.split())
    refused = _get(service, "Service", "SystemCallErrorNumber")
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        pytest.skip("no libseccomp.so.2 to build the unit's filter with")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    numbers = [lib.seccomp_syscall_resolve_name(name.encode()) for name in sorted(allowed)]
    # SCMP_ACT_KILL_PROCESS, or SCMP_ACT_ERRNO(n) with SystemCallErrorNumber=
    default = 0x00050000 | getattr(errno, refused[-1]) if refused else 0x80000000
    no_new_privileges = _get(service, "Service", "NoNewPrivileges") == ["yes"]

    def install() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if no_new_privileges:
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, which seccomp needs anyway
        context = lib.seccomp_init(default)
        for number in numbers:
            if number >= 0:
                lib.seccomp_rule_add(context, 0x7FFF0000, number, 0)  # SCMP_ACT_ALLOW
        if lib.seccomp_load(context) != 0:
            raise OSError("seccomp_load failed")

    return install


def test_the_daemon_serves_under_the_units_system_call_filter(tmp_path: Path) -> None:
    """A call outside the unit's ``SystemCallFilter=`` kills the daemon (SIGSYS), or fails
    with ``SystemCallErrorNumber=``, and ``Restart=`` starts it into the same end. The
    daemon runs here under that filter with the group docs/systemd.md configures, which the
    unit's ``Group=`` already gave the socket: it must serve, not change ownership."""
    import grp

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    install = _unit_filter(analyze)
    with short_tmp() as work:
        socket_path = work / "run" / "shardsync.sock"
        group = grp.getgrgid(os.getegid()).gr_name
        conf = write_config(
            work / "d.toml",
            cache=work / "cache",
            endpoint="http://127.0.0.1:9",
            socket_path=socket_path,
            daemon=f'group = "{group}"\n',
        )
        daemon = DaemonProcess(conf, work, preexec=install)
        try:
            daemon.start()
            status = cli("status", "--json", env={"SHARDSYNC_SOCKET": str(socket_path)})
            assert status.returncode == 0, status.stderr
            daemon.signal(signal.SIGTERM)
            assert daemon.wait() == 0, daemon.output()
        finally:
            daemon.close()


# ---------------------------------------------------------------------------- sd_notify


@pytest.fixture(params=["path", "abstract"])
def notify_socket(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket like systemd's, and how $NOTIFY_SOCKET names it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(10)
    if request.param == "path":
        address = str(tmp_path / "notify")
        sock.bind(address)
        name = address
    else:
        abstract = f"shardsync-test-{secrets.token_hex(6)}"
        sock.bind("\0" + abstract)
        name = "@" + abstract
    try:
        yield name, sock
    finally:
        sock.close()


def test_notify_reaches_path_and_abstract_sockets(
    notify_socket: tuple[str, socket.socket],
) -> None:
    name, sock = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": name})
    assert notifier.enabled
    assert notifier.ready("serving")
    fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
    assert fields["READY"] == "1" and fields["STATUS"] == "serving" and fields["MAINPID"]
    assert notifier.reloading()
    fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
    assert fields["RELOADING"] == "1" and int(fields["MONOTONIC_USEC"]) > 0
    assert notifier.stopping("bye")
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=bye"


def test_notify_without_a_manager_is_a_no_op(tmp_path: Path) -> None:
    assert not Notifier({}).enabled
    assert Notifier({}).ready("x") is False
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing")})
    assert gone.status("x") is False  # logged, never raised
