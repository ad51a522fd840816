"""The conformance suite's clause map: every promise of every device hook has a check (in every
direction and size it must hold in) and a mutant that breaks it; the README's table is the map."""

from __future__ import annotations

from pathlib import Path

import pytest

clauses = pytest.importorskip("kvhal_conformance.clauses")
clausemap = pytest.importorskip("kvhal_conformance.clausemap")
mutants = pytest.importorskip("kvhal_conformance.mutants")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "conformance" / "README.md"


def test_every_clause_has_a_check() -> None:
    """A hook whose docstring grows a promise fails here until the suite checks it."""
    assert clausemap.coverage_problems() == []


def test_the_map_spans_every_device_hook() -> None:
    from kvhal.hookspecs import DEVICE_HOOKS

    stated = {c.hook for c in clauses.hook_clauses()}
    assert set(DEVICE_HOOKS) <= stated, sorted(set(DEVICE_HOOKS) - stated)


def test_a_promise_without_a_check_is_reported() -> None:
    """Negative control: the map check fails for an unchecked clause, an unknown clause, a
    check naming none, and a direction or size without a check."""
    known = clauses.Clause("copy.ordering", "kvhal_copy_blocks", "must not start early")
    extra = clauses.Clause("copy.brand_new", "kvhal_copy_blocks", "a promise nobody checks yet")
    one_way = clausemap.Check(
        "test_x.py::test_order",
        ("copy.ordering",),
        {"direction": frozenset({"d2h"}), "size": frozenset(clauses.SIZES)},
    )
    problems = clausemap.coverage_problems(
        [known, extra],
        [
            one_way,
            clausemap.Check("test_x.py::test_typo", ("copy.orderin",)),
            clausemap.Check("test_x.py::test_none", ()),
        ],
    )
    text = "\n".join(problems)
    assert "clause copy.brand_new (kvhal_copy_blocks) has no check" in text
    assert "check test_x.py::test_typo names unknown clause copy.orderin" in text
    assert "check test_x.py::test_none names no clause" in text
    assert "clause copy.ordering has no check for direction h2d, size small" in text
    assert "direction d2h" not in text


def test_promises_are_parsed_from_docstrings() -> None:
    doc = """Do it.

    Promises:

    - ``a.one``: first promise,
      continued here.
    - ``a.two``: second.

    :return: nothing.
    """
    import inspect

    found = [(m["id"], " ".join(m["text"].split())) for m in clauses._PROMISE.finditer(inspect.cleandoc(doc))]
    assert found == [("a.one", "first promise, continued here."), ("a.two", "second.")]


def test_failures_name_their_clauses() -> None:
    assert clauses.broken_clauses("[copy.data, copy.dst_only] dst block 3 ...") == (
        "copy.data",
        "copy.dst_only",
    )
    assert clauses.broken_clauses("AssertionError: something") is None
    assert clauses.tag("query.state", "x") == "[query.state] x"


def test_every_mutant_names_known_clauses_and_every_clause_has_a_mutant() -> None:
    known = clauses.clause_ids()
    for m in mutants.MUTANTS.values():
        assert m.breaks and set(m.breaks) <= known, (m.name, m.breaks)
        assert set(m.also) <= known | {mutants.EVERY_CLAUSE}, (m.name, m.also)
        assert m.defect, f"mutant {m.name} has no docstring saying its defect"
    unreached = sorted(known - set(mutants.reached(mutants.MUTANTS)))
    assert unreached == [], f"clauses no mutant breaks: {unreached}"


def test_readme_table_is_the_map() -> None:
    """conformance/README.md carries the generated map; regenerate it with
    ``python -m kvhal_conformance.clausemap conformance/README.md``."""
    text = README.read_text()
    assert clausemap.readme_block() in text, (
        "conformance/README.md's clause map is stale: run "
        "python -m kvhal_conformance.clausemap conformance/README.md"
    )
