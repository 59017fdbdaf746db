"""The planted-bug list of ``tools/mutants.py`` stays well formed (the mutants themselves run
outside the suite: ``python tools/mutants.py``, a few minutes)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tools_mutants", ROOT / "tools" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


mutants = _load()


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=[m.name for m in mutants.MUTANTS])
def test_each_mutant_is_well_formed(mutant: Any) -> None:
    """The tests a mutant names exist, and where its patch applies the planted code still
    parses (a run then means a failing test, not a SyntaxError). Where the code moved and
    the patch no longer applies this fails, naming the mutant: a stale mutant guards
    nothing, so the change that moved the code brings its ``old`` text up to date."""
    for arg in mutant.tests:
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), f"{mutant.name}: no {arg}"
    source = (ROOT / mutant.file).read_text()
    try:
        planted = mutant.apply(source)
    except ValueError as exc:
        pytest.fail(f"stale mutant, update tools/mutants.py: {exc}")
    assert planted != source
    ast.parse(planted)


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))


def test_a_patch_that_no_longer_applies_is_reported() -> None:
    (first, *_) = mutants.MUTANTS
    with pytest.raises(ValueError, match="found 0"):
        first.apply("nothing of the kind")


def test_the_testing_doc_lists_every_mutant_and_its_count() -> None:
    """docs/testing.md's table is what a reader trusts: one row per planted bug, and the
    count the README and the doc state is the list's."""
    doc = (ROOT / "docs" / "testing.md").read_text()
    rows = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    assert rows == {m.name for m in mutants.MUTANTS}
    n = len(mutants.MUTANTS)
    assert f"({n} of {n})" in doc
    assert f"({n} of {n} caught)" in (ROOT / "README.md").read_text()
