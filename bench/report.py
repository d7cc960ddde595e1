"""What a benchmark reports, and how `python -m bench` turns reports into BENCHMARKS.md.

A benchmark returns a `Section`: its measures (each ours beside a baseline measured in the same run, and
the goal it is held to) and a markdown body with the detail. The runner keeps each section's last report
in ``bench/results/<name>.json`` (one home for it), so ``--only NAME`` rewrites one section and the summary
table still lists every benchmark's last measures.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"


class Goal(BaseModel):
    """A bound on the ratio (ours / baseline) or on ours itself."""

    on: Literal["ratio", "ours"]
    at_most: float | None = None
    at_least: float | None = None

    def met(self, value: float) -> bool:
        return (self.at_most is None or value <= self.at_most) and (self.at_least is None or value >= self.at_least)

    def __str__(self) -> str:
        what = "ratio" if self.on == "ratio" else "ours"
        if self.at_most is not None and self.at_least is not None:
            return f"{self.at_least:g} ≤ {what} ≤ {self.at_most:g}"
        return f"{what} ≤ {self.at_most:g}" if self.at_most is not None else f"{what} ≥ {self.at_least:g}"


class Measure(BaseModel):
    measure: str
    unit: str
    ours: float
    baseline: float | None = None
    baseline_name: str = ""
    goal: Goal | None = None
    note: str = ""  # by how much and why a goal is missed, or what the figure leaves out

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.ours / self.baseline

    @property
    def met(self) -> bool | None:
        if self.goal is None:
            return None
        value = self.ratio if self.goal.on == "ratio" else self.ours
        return None if value is None else self.goal.met(value)


class Section(BaseModel):
    name: str  # the --only name
    title: str  # the "## " heading, without the hashes
    measures: list[Measure]
    details: str = ""  # markdown below the heading
    seconds: float = 0.0
    date: str = ""
    command: str = ""
    machine: str = ""
    versions: str = ""


def number(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} {unit}".strip()


def summary_row(section: Section, m: Measure) -> str:
    ratio = "-" if m.ratio is None else f"{m.ratio:.2f}x"
    baseline = "-" if m.baseline is None else f"{number(m.baseline, m.unit)} ({m.baseline_name})"
    met = {True: "yes", False: "**no**", None: "-"}[m.met]
    cells = [section.name, m.measure, number(m.ours, m.unit), baseline, ratio, str(m.goal or "-"), met, m.note]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def summary(sections: list[Section]) -> str:
    lines = [
        "| bench | measure | ours | baseline (same run) | ratio | goal | met? | note |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    for section in sections:
        lines += [summary_row(section, m) for m in section.measures]
    return "\n".join(lines)


def section_markdown(section: Section) -> str:
    head = f"## {section.title}\n\n{section.date} · {section.machine} · {section.versions} · `{section.command}` · "
    head += f"{section.seconds / 60:.1f} min\n"
    return head + "\n" + section.details.strip() + "\n"


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace (or append) one ``## `` section of a markdown file, keeping the others."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        new = text.rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "\n".join(lines[:start] + body.rstrip("\n").splitlines() + [""] + lines[end:]).rstrip("\n") + "\n"
    path.write_text(new)


def save(section: Section) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{section.name}.json").write_text(section.model_dump_json(indent=1) + "\n")


def load_all(order: list[str]) -> list[Section]:
    """Every benchmark's last saved report, in the runner's order."""
    found = {p.stem: Section.model_validate_json(p.read_text()) for p in RESULTS_DIR.glob("*.json")}
    return [found[name] for name in order if name in found]


SUMMARY_HEADING = "## Summary"


def rewrite(path: Path, sections: list[Section], ran: list[Section], command: str, machine: str) -> None:
    """The summary of every section's last report, and the detail sections of those that ran now."""
    body = (
        f"{SUMMARY_HEADING}\n\nEvery benchmark's last report (`bench/results/*.json`), written by `{command}` on "
        f"{machine}. Ratios compare figures measured side by side in one run; each section below says when, "
        "with which versions and command.\n\n" + summary(sections)
    )
    if not path.exists() or SUMMARY_HEADING not in path.read_text():
        intro = "# Benchmarks\n\nRun them all with `.venv/bin/python -m bench` (`--only NAME` runs one).\n\n"
        rest = path.read_text().split("\n", 1)[1] if path.exists() else ""
        rest = re.sub(r"^\s*Measured by the scripts in `bench/`\.\s*", "", rest)
        path.write_text(intro + body + "\n\n" + rest.lstrip("\n"))
    else:
        write_section(path, SUMMARY_HEADING, body)
    for section in ran:
        write_section(path, f"## {section.title}", section_markdown(section))


def run_alone(run: Callable[[Path], Section], prefix: str) -> int:
    """A bench module run as a script: its section in a scratch directory, printed; 0 when every goal is met."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        section = run(Path(tmp))
    print(summary([section]))
    print(section.details)
    return 0 if all(m.met for m in section.measures) else 1
