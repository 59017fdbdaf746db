"""The systemd units (checked by systemd-analyze when present) and the sd_notify client."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardsync.notify import Notifier

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
