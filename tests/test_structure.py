"""Structural promises a newcomer relies on: pure modules stay pure, origins stay opaque."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardsync"

PURE = [
    "shardsync.api",
    "shardsync.checksums",
    "shardsync.config",
    "shardsync.devicemap",
    "shardsync.errors",
    "shardsync.events",
    "shardsync.manifest",
    "shardsync.names",
    "shardsync.network",
    "shardsync.ramp",
    "shardsync.ranges",
    "shardsync.records",
    "shardsync.retry",
    "shardsync.safetensors_header",
    "shardsync.strict_json",
]
HEAVY = ["aiohttp", "aiofiles", "torch", "huggingface_hub", "safetensors", "numpy", "xxhash"]

_IMPORT_BLOCKED = """
import importlib, importlib.abc, sys
heavy = set(sys.argv[2].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in heavy:
            raise ImportError(f"{name} is blocked")
sys.meta_path.insert(0, Block())
importlib.import_module(sys.argv[1])
"""


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_without_io_libraries(module: str) -> None:
    """Reading a config, a manifest or a header must not need the network, the GPU stack
    or the Hub client: these are the modules a tool embeds and tests table-drive."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_BLOCKED, module, ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_blocker_does_block() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_BLOCKED, "shardsync.fetch", ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0


_ORIGIN_CLASSES = {"HubOrigin", "UrlOrigin", "S3Origin", "LocalOrigin"}


def _isinstance_on_origins(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
            continue
        if len(node.args) != 2:
            continue
        names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
        if names & _ORIGIN_CLASSES:
            lines.append(node.lineno)
    return lines


def test_no_code_outside_the_origins_asks_which_origin_it_has() -> None:
    """Every origin is used through the ``Origin`` protocol; a branch on the concrete class
    is where a new origin kind would silently get the wrong behaviour."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "origins" in path.relative_to(PACKAGE).parts:
            continue
        lines = _isinstance_on_origins(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert found == {}


def test_the_origin_check_sees_a_branch() -> None:
    planted = ast.parse("if isinstance(origin, (origins.S3Origin, int)):\n    pass\n")
    assert _isinstance_on_origins(planted) == [1]


TORCH_MODULES = {"loader.py", "dcp_reader.py"}  # ARCHITECTURE.md: the consumers of the cache


def test_only_the_consumers_import_torch_and_nothing_imports_the_dcp_reader() -> None:
    """Importing any module but the loader and the DCP reader imports no torch (the daemon,
    the CLI and the fetch path never pay for it; a function that needs torch imports it when
    it runs), and the DCP reader sits beside the loader: no module of the package imports
    it."""
    torch_users, dcp_users = set(), set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if node in tree.body and any(n.split(".")[0] == "torch" for n in names):
                torch_users.add(path.name)
            if any(n == "shardsync.dcp_reader" for n in names):
                dcp_users.add(path.name)
    assert torch_users <= TORCH_MODULES, sorted(torch_users - TORCH_MODULES)
    assert not dcp_users, sorted(dcp_users)
