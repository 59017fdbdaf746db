"""The README and config.example.toml as a contract: what they name exists and behaves.

Each test reads the documents themselves, so a sentence that drifts from the code (a flag,
an environment variable, an exit code, a config key) fails here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from shardsync import errors
from shardsync.cli import EXIT_CODES, _parser
from shardsync.config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXAMPLE = ROOT / "config.example.toml"


def _subcommands() -> dict[str, set[str]]:
    """Every subcommand and the option strings it accepts."""
    parser = _parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    choices: dict[str, object] = sub.choices  # type: ignore[attr-defined]
    found: dict[str, set[str]] = {}
    for name, child in choices.items():
        found[name] = {
            opt
            for action in child._actions  # type: ignore[attr-defined]
            for opt in action.option_strings
        }
    return found


def test_every_shardsync_command_line_in_the_readme_parses() -> None:
    """Every `shardsync VERB --flag` the README shows is a verb and flags that verb takes."""
    commands = _subcommands()
    text = re.sub(r"\n\s+(?=\[)", " ", README)  # usage lines continued on the next line
    usages = re.findall(r"^\s*shardsync (\w+)([^\n#]*)", text, flags=re.M)
    usages += re.findall(r"`shardsync (\w+)([^`]*)`", text)
    assert usages
    for verb, rest in usages:
        if verb in ("prefetch", "load") or verb in commands:
            assert verb in commands, verb
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
                assert flag in commands[verb] | {"--help"}, f"shardsync {verb} {flag}"


def test_every_exit_code_in_the_table_is_the_code_of_an_error() -> None:
    """The exit-code table and cli.EXIT_CODES agree, both ways."""
    table = {
        int(code): cause for code, cause in re.findall(r"^\| (\d+) \| (.+?) \|$", README, re.M)
    }
    assert set(table) >= {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 130}
    assert set(EXIT_CODES.values()) <= set(table)
    for name in re.findall(r"`(\w+Error)`", " ".join(table.values())):
        cls = getattr(errors, name)
        code = next(c for k, c in EXIT_CODES.items() if issubclass(cls, k))
        assert name in table[code], f"{name} is exit {code}, the table says otherwise"


def test_every_key_of_config_example_loads_and_is_documented() -> None:
    """config.example.toml loads as is, and with every commented key uncommented too."""
    load_config(EXAMPLE, {})
    text = EXAMPLE.read_text(encoding="utf-8")
    data = tomllib.loads(text)
    for section, keys in data.items():
        for key in keys:
            assert re.search(rf"^#?\s*{key}\s*=", text, re.M), f"{section}.{key}"


def test_every_environment_variable_the_documents_name_is_read(tmp_path: Path) -> None:
    """Each SHARDSYNC_* variable the README or the example names changes the config."""
    names = set(re.findall(r"\bSHARDSYNC_[A-Z_]+\b", README + EXAMPLE.read_text()))
    values = {
        "SHARDSYNC_CACHE_DIR": (str(tmp_path / "c"), lambda c: c.cache_dir == tmp_path / "c"),
        "SHARDSYNC_MAX_FILES": ("3", lambda c: c.max_files == 3),
        "SHARDSYNC_CONNECTIONS_PER_FILE": ("5", lambda c: c.fetch.connections_per_file == 5),
        "SHARDSYNC_CHUNK_SIZE": ("2MiB", lambda c: c.fetch.chunk_size == 2 << 20),
        "SHARDSYNC_SOCKET": ("/tmp/x.sock", lambda c: str(c.daemon.socket) == "/tmp/x.sock"),
        "SHARDSYNC_FALLBACK": ("error", lambda c: c.daemon.fallback == "error"),
        "SHARDSYNC_MAX_BANDWIDTH": ("1GB", lambda c: c.daemon.max_bandwidth == 10**9),
    }
    for name in sorted(names & set(values)):
        value, holds = values[name]
        assert holds(load_config(None, {name: value})), name
    assert set(values) <= names  # and the documents still name them all


def test_the_hub_endpoint_variable_is_read() -> None:
    assert load_config(None, {"HF_ENDPOINT": "http://127.0.0.1:1"}).endpoint == (
        "http://127.0.0.1:1"
    )


@pytest.mark.parametrize(
    ("block", "fields"),
    [
        ("prefetch", ("repo", "origin", "revision", "commit", "snapshot_path", "files")),
        ("prune", ("dry_run", "skipped", "satisfied", "evicted", "protected", "junk")),
        ("verify", ("ok", "full", "snapshots", "blobs", "problems", "incomplete")),
        ("ls", ("root", "bytes_on_disk", "partial_bytes", "junk_bytes", "repos")),
    ],
)
def test_the_json_examples_show_the_fields_the_commands_print(
    block: str, fields: tuple[str, ...]
) -> None:
    """The README's `--json` examples name the fields (test_cli, test_prune, test_verify and
    test_ls check each command prints exactly these)."""
    examples = re.findall(r"```json\n(.*?)```", README, re.S)
    assert any(all(f'"{f}"' in ex for f in fields) for ex in examples), block


def test_the_testing_example_runs_as_written(tmp_path: Path) -> None:
    """The `shardsync.testing` example: a FakeHub, a checkpoint, a fault knob."""
    import asyncio

    import aiohttp

    from shardsync.testing import CutBody, FakeHub, build_checkpoint

    tmp = tmp_path

    async def example() -> None:
        async with FakeHub() as hub:
            hub.add_checkpoint("acme/tiny", build_checkpoint(tmp, total_bytes=1 << 20, n_shards=4))
            hub.faults.add(CutBody(times=3))
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{hub.endpoint}/api/models/acme/tiny/revision/main") as resp,
            ):
                assert resp.status == 200

    asyncio.run(example())
