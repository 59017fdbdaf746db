"""The user documents and config.example.toml as a contract: what they name exists and behaves.

The user documents are README.md and every docs/*.md. Each test reads the documents
themselves, so a sentence that drifts from the code (a flag, an environment variable, an exit
code, a config key, a link) fails here, wherever the sentence lives.
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
EXAMPLE = ROOT / "config.example.toml"
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in USER_DOCS}
ALL_DOCS = "\n\n".join(DOCS.values())
LINKED = [*USER_DOCS, ROOT / "bench" / "README.md"]  # whose relative links must resolve


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


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_shardsync_command_line_in_the_documents_parses(doc: str) -> None:
    """Every `shardsync VERB --flag` a document shows is a verb and flags that verb takes."""
    commands = _subcommands()
    text = re.sub(r"\n\s+(?=\[)", " ", DOCS[doc])  # usage lines continued on the next line
    usages = re.findall(r"^\s*shardsync (\w+)([^\n#]*)", text, flags=re.M)
    usages += re.findall(r"`shardsync (\w+)([^`]*)`", text)
    for verb, rest in usages:
        if verb in ("prefetch", "load") or verb in commands:
            assert verb in commands, f"{doc}: {verb}"
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
                assert flag in commands[verb] | {"--help"}, f"{doc}: shardsync {verb} {flag}"


def test_the_documents_show_command_lines() -> None:
    """The check above has something to check: the README and the CLI reference show usages."""
    for doc in ("README.md", "docs/cli.md", "docs/cache.md"):
        assert re.search(r"^\s*shardsync (\w+)", DOCS[doc], re.M), doc


def test_every_exit_code_in_the_table_is_the_code_of_an_error() -> None:
    """The exit-code table (the one document table headed `| exit | cause |`) and
    cli.EXIT_CODES agree, both ways."""
    tables = [
        text.split("| exit | cause |\n", 1)[1].split("\n\n", 1)[0]
        for text in DOCS.values()
        if "| exit | cause |\n" in text
    ]
    assert len(tables) == 1, "one exit-code table, in one document"
    table = {
        int(code): cause for code, cause in re.findall(r"^\| (\d+) \| (.+?) \|$", tables[0], re.M)
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
    """Each SHARDSYNC_* variable the documents or the example name changes the config."""
    names = set(re.findall(r"\bSHARDSYNC_[A-Z_]+\b", ALL_DOCS + EXAMPLE.read_text()))
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
    """The documents' `--json` examples name the fields (test_cli, test_prune, test_verify and
    test_ls check each command prints exactly these)."""
    examples = re.findall(r"```json\n(.*?)```", ALL_DOCS, re.S)
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


# ------------------------------------------------------------------------------ links


def _outside_code(text: str) -> list[str]:
    """The document's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation but `-` and
    `_` dropped, spaces as `-`, `-1`, `-2`, ... for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _outside_code(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6} (.+?)\s*#*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    """Every markdown link target (images included) outside code."""
    text = "\n".join(_outside_code(path.read_text(encoding="utf-8")))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return re.findall(r"\]\(([^()\s]+)\)", text)


@pytest.mark.parametrize("path", LINKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    """Every relative link in README.md, docs/*.md and bench/README.md names a file that
    exists, and an anchor, where it has one, that a heading of that file makes."""
    links = [link for link in _links(path) if not re.match(r"^[a-z][a-z+.-]*:", link)]
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        exists = file.exists()
        if not exists or (anchor and (file.suffix != ".md" or anchor not in _anchors(file))):
            broken.append(link)
    assert not broken, f"{path.relative_to(ROOT)}: {broken}"


def test_the_readme_links_every_document() -> None:
    """A document under docs/ that the README does not link is one nobody finds."""
    linked = {link.partition("#")[0] for link in _links(ROOT / "README.md")}
    for path in USER_DOCS[1:]:
        assert path.relative_to(ROOT).as_posix() in linked, path.name
    assert {"ARCHITECTURE.md", "bench/README.md"} <= linked
