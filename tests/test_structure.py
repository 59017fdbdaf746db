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
    "shardsync.config_access",
    "shardsync.dcp_metadata",
    "shardsync.devicemap",
    "shardsync.errors",
    "shardsync.events",
    "shardsync.manifest",
    "shardsync.names",
    "shardsync.prepared",
    "shardsync.network",
    "shardsync.ramp",
    "shardsync.ranges",
    "shardsync.records",
    "shardsync.retry",
    "shardsync.s3_sigv4",
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
        [sys.executable, "-c", _IMPORT_BLOCKED, "shardsync.fetch.fetcher", ",".join(HEAVY)],
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


# ------------------------------------------------------------------------ the import graph
# Layers from the bottom up. A module imports its own layer or a lower one, never a higher
# one; a new module gets a line here (the test below names one that has none).
LAYERS: dict[str, set[str]] = {
    "core": {  # values and decisions, no I/O (see PURE for those that import without it)
        "errors", "strict_json", "names", "manifest", "records", "retry", "ranges", "ramp",
        "checksums", "devicemap", "safetensors_header", "prepared", "training", "prune_plan",
        "dcp_metadata",
        "events", "layout", "version", "limits", "api", "network", "config", "config_access",
        "tasks", "s3_sigv4",
    },
    "cache": {
        "digest", "cache", "removal", "slot", "store", "snapshot_use", "inventory", "verify",
        "prune", "checkpoint_cache", "locks",
    },
    "transfer": {
        "fetch", "fetch.request", "fetch.answers", "fetch.body", "fetch.body_aiohttp",
        "fetch.body_wire", "fetch.disk", "fetch.pump", "fetch.wire", "fetch.transfer",
        "fetch.fetcher", "fetch.session", "s3", "tier", "tier_claims", "tier_parts", "origins",
        "origins.base", "origins.http", "origins.hub", "origins.local", "origins.s3",
        "s3_botocore", "s3_direct",
    },
    "engine": {"engine_api", "prefetch", "shard_headers", "checkpoint", "checkpoint_selection"},
    "service": {
        "scheduler", "job_log", "journal", "daemon", "daemon_transport", "listeners", "notify",
        "jobs", "client", "metrics",
    },
    "consume": {"loader", "placement", "dcp_reader", "vllm_plugin"},
    "interface": {
        "cli", "cli_output", "progress", "shardsync", "testing", "testing.__main__",
        "testing.checkpoints", "testing.fakehub", "testing.faults", "testing.relay",
        "testing.hub_http", "testing.hub_repos", "testing.seaweedfs", "testing.nginx",
        "testing.daemons", "testing.ports",
    },
}  # fmt: skip
MAX_CHAIN = 9  # modules in the longest chain of imports (17 before issue 26)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` (``fetch.request``; the package itself is its name) and
    the package's modules it imports: at the top, in functions, under ``TYPE_CHECKING``."""
    top = package.name
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__") or top
        names[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{name}: relative import (the graph would miss it)")
            if isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                wanted = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, member in wanted:
                if module != top and not module.startswith(f"{top}."):
                    continue
                local = module.removeprefix(top).removeprefix(".") or top
                sub = member and (f"{local}.{member}" if local != top else member)
                out.add(sub if sub in names else local)  # ``from pkg import mod`` names mod
        graph[name] = {m for m in out if m in names and m != name}
    return graph


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports (assumes no circle)."""
    memo: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:
        if name not in memo:
            memo[name] = [name, *max((chain(d) for d in graph[name]), key=len, default=[])]
        return memo[name]

    return max((chain(n) for n in graph), key=len, default=[])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        for d in graph[n]:
            if d not in index:
                visit(d)
                low[n] = min(low[n], low[d])
            elif d in stack:
                low[n] = min(low[n], index[d])
        if low[n] == index[n]:
            group = []
            while (m := stack.pop()) != n:
                group.append(m)
            if group or n in graph[n]:
                found.append([n, *group])

    for n in graph:
        if n not in index:
            visit(n)
    return found


def _layer_of() -> dict[str, int]:
    return {m: i for i, members in enumerate(LAYERS.values()) for m in members}


def test_every_module_has_one_layer() -> None:
    placed = [m for members in LAYERS.values() for m in members]
    assert len(placed) == len(set(placed)), sorted({m for m in placed if placed.count(m) > 1})
    graph = import_graph(PACKAGE)
    assert set(graph) <= set(placed), sorted(set(graph) - set(placed))


def test_no_module_imports_from_a_higher_layer() -> None:
    layer, names = _layer_of(), list(LAYERS)
    upward = [
        f"{m} ({names[layer[m]]}) imports {d} ({names[layer[d]]})"
        for m, deps in import_graph(PACKAGE).items()
        for d in deps
        if layer[d] > layer[m]
    ]
    assert not upward, upward


def test_the_import_graph_has_no_circle() -> None:
    assert not circles(import_graph(PACKAGE))


def test_the_longest_chain_of_imports_is_short() -> None:
    chain = longest_chain(import_graph(PACKAGE))
    assert len(chain) <= MAX_CHAIN, " > ".join(chain)


def test_the_docs_state_the_chain_the_graph_has() -> None:
    """README and ARCHITECTURE.md give the bound and ARCHITECTURE.md the chain itself."""
    chain = longest_chain(import_graph(PACKAGE))
    root = PACKAGE.parent
    readme = " ".join((root / "README.md").read_text().split())
    architecture = " ".join((root / "ARCHITECTURE.md").read_text().split())
    assert f"no chain of imports longer than {MAX_CHAIN} modules" in readme
    assert f"The longest chain of imports is {len(chain)} modules" in architecture


MAX_LINES = 700  # a module a newcomer reads in one sitting (issue 26)


def test_no_module_is_longer_than_a_sitting() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """A lazy import, one under TYPE_CHECKING and ``from pkg import module`` are edges, and a
    circle and a chain are found (the checks above would pass on a graph that saw nothing)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import x\n",
        "a.py": "def f():\n    from pkg import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.sub.c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from pkg.sub import d\nimport os\n",
        "sub/d.py": "x = 1\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph == {
        "pkg": {"a"},
        "a": {"b"},
        "b": {"sub.c"},
        "sub": set(),
        "sub.c": {"sub.d"},
        "sub.d": set(),
    }
    assert longest_chain(graph) == ["pkg", "a", "b", "sub.c", "sub.d"]
    assert not circles(graph)
    (pkg / "sub" / "d.py").write_text("from pkg.a import f\n")
    assert [sorted(c) for c in circles(import_graph(pkg))] == [["a", "b", "sub.c", "sub.d"]]
