"""The README stays a front page, and what the docs say about the tests stays true: the README is short and opens
with the two commands, its layout table matches the tree, and every test the README or docs/ names exists.

The docs themselves (links, anchors, a nav that lists every page) are built with `mkdocs build --strict` in
scripts/test.sh, not here: this file reads text and parses test files only, in well under a second."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
MAX_README_LINES = 150
TWO_COMMANDS = [
    "```bash",
    "bash scripts/demo.sh     # (a) set up, then run the main job on embedded defaults: SQLite + a local Redis",
    "bash scripts/test.sh     # (b) set up, then run the tests "
    "(real Redis and PostgreSQL, started if they do not answer)",
    "```",
]
# `tests/test_x.py` or `tests/test_x.py::test_name` (a class between them is allowed: `::TestX::test_name`)
NAMED_TEST = re.compile(r"\btests/[\w/]+\.py(?:::\w+)*")
# a test function named alone in backticks, without its file: the reader cannot find it
BARE_TEST = re.compile(r"`(test_\w+)`")


def documents() -> list[Path]:
    return [README, *PAGES]


@cache
def defined_names(path: Path) -> frozenset[str]:
    """The functions and classes a test file defines, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return frozenset(node.name for node in ast.walk(tree) if isinstance(node, kinds))


def missing(reference: str) -> str | None:
    """Why ``reference`` (``tests/test_x.py[::name...]``) names nothing, or None when it names what exists."""
    file, *names = reference.split("::")
    path = ROOT / file
    if not path.is_file():
        return f"{file} does not exist"
    absent = [name for name in names if name not in defined_names(path)]
    return f"{file} defines no {', '.join(absent)}" if absent else None


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    first = [line for line in lines if line.strip()][1:5]  # after the title
    assert lines[0].startswith("# ") and first == TWO_COMMANDS


def test_every_test_the_readme_and_the_docs_name_exists() -> None:
    named = {
        (document.relative_to(ROOT).as_posix(), reference)
        for document in documents()
        for reference in NAMED_TEST.findall(document.read_text())
    }
    assert named, "the docs name no test"
    broken = sorted(f"{where}: {reference}: {why}" for where, reference in named if (why := missing(reference)))
    assert broken == []


def test_a_test_is_named_with_its_file() -> None:
    bare = sorted(
        f"{document.relative_to(ROOT).as_posix()}: {name}"
        for document in documents()
        for name in BARE_TEST.findall(document.read_text())
    )
    assert bare == [], "name a test as `tests/test_file.py::test_name`"


def test_the_readmes_layout_table_matches_the_tree() -> None:
    """Every path the layout table names exists, and every package of services/ and shared/ is named."""
    text = README.read_text()
    after = text[text.index("### Layout") :].splitlines()[1:]
    section = after[: next((i for i, line in enumerate(after) if line.startswith("#")), len(after))]
    first_cells = [line.split("|")[1] for line in section if line.startswith("| `")]
    named = [path for cell in first_cells for path in re.findall(r"`([^`]+)`", cell)]
    assert named, "no layout table under '### Layout'"
    assert [path for path in named if not (ROOT / path).exists()] == []
    packages = [
        f"{path.parent.relative_to(ROOT).as_posix()}/"
        for top in ("services", "shared")
        for path in (ROOT / top).glob("*/__init__.py")
    ]
    assert sorted(p for p in packages if p not in named) == []


def test_the_row_page_names_every_column_of_the_record() -> None:
    """docs/row.md says what each published column means: a new column without its line there fails."""
    from shared.results.records import ResultRecord

    page = (ROOT / "docs" / "row.md").read_text()
    assert [name for name in ResultRecord.model_fields if f"`{name}`" not in page] == []
