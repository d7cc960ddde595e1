"""Cells of the support matrix and how they change between versions.

A cell is one model and task under one software stack (``Stack``: the compiler, torch, TorchNeuron, Neuron
runtime and library versions). Its status comes from all finished runs of the model's newest tested commit in
that cell: the runs' common verdict, or FLAKY when repeated runs disagree (a PASS and a FAIL of the same code is
not a PASS). Runs of two stacks are two cells, never one FLAKY one. Runs settled at submission (SKIPPED) count like
any other.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from shared.contracts.enums import Axis
from shared.contracts.run import IDENTITY_VERSIONS, Stack, stack_of
from shared.db.models import Job, Result
from shared.hub.client import MODEL_ID_PATTERN

# A job's stack, as columns.
STACK_COLUMNS = tuple(getattr(Job, version) for version in IDENTITY_VERSIONS)


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Orders versions by their numbers: ``2.9.1`` before ``2.21.0``, ``inductor-2.13.0`` by 2, 13, 0."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", version) if p)


class CellStatus(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"
    FLAKY = "FLAKY"


GOOD = {CellStatus.PASS}
BAD = {CellStatus.FAIL, CellStatus.ERROR}


def cell_status(verdicts: Iterable[str]) -> CellStatus:
    seen = set(verdicts)
    if not seen:
        raise ValueError("a cell needs at least one run")
    return CellStatus(seen.pop()) if len(seen) == 1 else CellStatus.FLAKY


def flips(verdicts: Sequence[str]) -> int:
    """How many times consecutive runs (oldest first) changed verdict: the sweep's rerun criterion."""
    return sum(1 for a, b in pairwise(verdicts) if a != b)


@dataclass(frozen=True)
class Cell:
    model_id: str
    task: str
    stack: Stack
    sha: str
    status: CellStatus
    runs: int
    flips: int
    tokens_per_s: float | None = None  # the median decode rate of its PASS runs (the performance tier)

    @property
    def compiler_version(self) -> str:
        return self.stack.compiler_version

    @property
    def library_version(self) -> str:
        return self.stack.library_version


# A cell of one version, as a diff pages through them: model, task, and the version of the other axis.
DiffKey = tuple[str, str, str]


def cells(
    session: Session,
    *,
    compiler: str | None = None,
    library_version: str | None = None,
    stack: Stack | None = None,
    after: DiffKey | None = None,
    through: DiffKey | None = None,
) -> list[Cell]:
    """The cells, of one compiler version, library version or stack when given. ``after`` and ``through`` bound
    the cells of one version's ``DiffKey`` (exclusive, inclusive): the range one page of a diff reads."""
    stmt = (
        sa.select(Job.model_id, Job.task, *STACK_COLUMNS, Job.sha, Result.verdict, Result.decode_tokens_per_s)
        .join(Result, Result.job_id == Job.id)
        .order_by(Job.id)
    )
    if compiler is not None:
        stmt = stmt.where(Job.compiler_version == compiler)
    if library_version is not None:
        stmt = stmt.where(Job.library_version == library_version)
    if stack is not None:
        stmt = stmt.where(Job.stack_digest == stack.digest)  # through ix_jobs_diff_stack
    if after is not None or through is not None:
        given = [axis for axis, version in _axes(compiler, library_version, stack) if version is not None]
        assert len(given) == 1, "a key range is over one version's cells"
        diff_key = _diff_key_columns(given[0])
        stmt = stmt.where(diff_key > after) if after is not None else stmt
        stmt = stmt.where(diff_key <= through) if through is not None else stmt
    runs: dict[tuple[str, str, Stack], tuple[str, list[str], list[float]]] = {}
    for row in session.execute(stmt):
        key = (row.model_id, row.task, stack_of(row))
        sha, verdict, rate = row.sha, row.verdict, row.decode_tokens_per_s
        current = runs.get(key)
        if current is None or current[0] != sha:  # a newer commit starts the cell afresh
            current = runs[key] = (sha, [], [])
        current[1].append(verdict.value)
        if rate is not None:
            current[2].append(rate)
    return [
        Cell(
            *key,
            sha=sha,
            status=cell_status(verdicts),
            runs=len(verdicts),
            flips=flips(verdicts),
            tokens_per_s=statistics.median(rates) if rates else None,
        )
        for key, (sha, verdicts, rates) in sorted(runs.items(), key=lambda item: _cell_order(item[0]))
    ]


def _cell_order(key: tuple[str, str, Stack]) -> tuple[str, ...]:
    model_id, task, stack = key
    return (model_id, task, *(getattr(stack, version) for version in IDENTITY_VERSIONS))


def _axes(compiler: str | None, library_version: str | None, stack: Stack | None) -> list[tuple[Axis, object]]:
    """Each axis with the version of it that ``cells`` was given."""
    return [(Axis.compiler, compiler), (Axis.library, library_version), (Axis.stack, stack)]


class StackName(BaseModel):
    """A stack as a diff names it: its digest (what ``axis=stack`` takes) and its versions as a person reads them."""

    digest: str
    label: str

    @classmethod
    def of(cls, stack: Stack) -> StackName:
        return cls(digest=stack.digest, label=stack.label())


class CellChange(BaseModel):
    """A cell whose status differs between the two versions of a diff, under the two stacks compared: a side with
    several stacks for one cell (another TorchNeuron under one compiler) is compared stack by stack."""

    model_id: str
    task: str
    from_stack: StackName
    to_stack: StackName
    from_status: CellStatus = Field(serialization_alias="from")
    to_status: CellStatus = Field(serialization_alias="to")
    from_sha: str
    to_sha: str


class SpeedChange(BaseModel):
    """A cell that decodes slower under the newer version, past the noise band."""

    model_id: str
    task: str
    from_stack: StackName
    to_stack: StackName
    from_tokens_per_s: float
    to_tokens_per_s: float
    ratio: float = Field(description="The newer rate over the older one.")


# A cell whose decode rate falls by more than this fraction between two versions regressed in speed. Repeated timed
# runs of one model on one machine spread by less (bench/tiers.py measures it); a trn2 fleet's rows may say more.
THROUGHPUT_NOISE_BAND = 0.15

# The stack's versions a diff of each axis lets change; cells are matched on the others. The compiler axis is the
# accelerator stack: a Neuron SDK release moves neuronx-cc, TorchNeuron, the runtime and torch together, and on cpu
# the compiler is inductor-<torch>, so torch moves with it; the library axis is transformers alone, the rest fixed; a
# stack's are all of them.
AXIS_VERSIONS: dict[Axis, tuple[str, ...]] = {
    Axis.compiler: ("compiler_version", "torch_version", "torch_neuronx_version", "neuron_runtime_version"),
    Axis.library: ("library_version",),
    Axis.stack: IDENTITY_VERSIONS,
}


class CellDiff(BaseModel):
    """One page of a diff: the changes among the newer version's cells in this page's key range (model, task,
    the other axis's version), in that order; ``next_cursor`` asks for the next range."""

    axis: Axis
    from_version: str = Field(serialization_alias="from", description="The older version.")
    to_version: str = Field(serialization_alias="to", description="The newer version.")
    regressed: list[CellChange] = Field(default_factory=list, description="PASS, then FAIL or ERROR")
    fixed: list[CellChange] = Field(default_factory=list, description="FAIL or ERROR, then PASS")
    flaky: list[CellChange] = Field(default_factory=list, description="FLAKY on either side")
    changed: list[CellChange] = Field(default_factory=list, description="any other change, e.g. SKIPPED to FAIL")
    slower: list[SpeedChange] = Field(
        default_factory=list,
        description=f"decodes more than {THROUGHPUT_NOISE_BAND:.0%} slower (PASS runs' median tokens per second)",
    )
    cells_compared: int = Field(0, description="the newer version's cells this page read")
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next page; null on the last.")


def _diff_key_columns(axis: Axis) -> sa.Tuple:
    """A diff's page key: model, task, and the version of the other axis. A stack has one cell per model and task,
    on both sides of its diff: its key's third part repeats the task (the same on both sides, as a version of the
    other axis is), so that cursors keep one shape."""
    other = {Axis.compiler: Job.library_version, Axis.library: Job.compiler_version, Axis.stack: Job.task}[axis]
    return sa.tuple_(Job.model_id, Job.task, other)


def stacks(session: Session) -> list[Stack]:
    """The stacks with results, newest compiler first (``version_key``), then by their other versions: what the
    stack axis's menu and GET /results/stacks list. It reads every job with results (a fleet has a handful of
    stacks, but the scan grows with the results table); a diff finds its stacks by digest instead
    (``stack_by_digest``)."""
    found = session.execute(sa.select(*STACK_COLUMNS).join(Result, Result.job_id == Job.id).distinct()).all()
    listed = [stack_of(row) for row in found]
    return sorted(listed, key=lambda st: [version_key(getattr(st, n)) for n in IDENTITY_VERSIONS], reverse=True)


def stack_by_digest(session: Session, digest: str) -> Stack | None:
    """The stack with results whose digest (``Stack.digest``) is ``digest``, if any: one row, found through the
    stored digest's index (ix_jobs_diff_stack)."""
    found = session.execute(
        sa.select(*STACK_COLUMNS).join(Result, Result.job_id == Job.id).where(Job.stack_digest == digest).limit(1)
    ).first()
    return stack_of(found) if found is not None else None


# A diff page's cursor: the page's last key, readable — ``model,task,version`` (none of them holds a comma).
DIFF_CURSOR_PATTERN = rf"^{MODEL_ID_PATTERN.strip('^$')},[a-z-]{{1,64}},[A-Za-z0-9][A-Za-z0-9._+-]{{0,99}}$"


def encode_cursor(key: DiffKey) -> str:
    return ",".join(key)


def decode_cursor(cursor: str) -> DiffKey:
    """A diff's cursor back to its key; ValueError for anything ``encode_cursor`` cannot have written."""
    if not re.fullmatch(DIFF_CURSOR_PATTERN, cursor):
        raise ValueError(f"cursor {cursor[:60]!r} is not a diff cursor (model,task,version): pass next_cursor as given")
    model_id, task, version = cursor.split(",")
    return model_id, task, version


def diff(
    session: Session, axis: Axis, from_version: str, to_version: str, after: DiffKey | None = None, limit: int = 500
) -> CellDiff:
    """Models that regressed or were fixed between two versions of an axis, and flaky ones: one page, of at most
    ``limit`` cells of the newer version after the key ``after``.

    Cells are matched on the stack's versions the axis holds fixed (``AXIS_VERSIONS``), stack by stack. A page reads
    the page's keys, then the rows of both versions in that key range (indexes on each version and key:
    ix_jobs_diff_compiler, ix_jobs_diff_library, and on the stack axis the stored digest's ix_jobs_diff_stack), so
    its cost follows ``limit``, not the size of either version.
    """
    from_of: dict[str, Any]
    to_of: dict[str, Any]
    if axis == Axis.stack:  # versions are digests: a stack nobody has results of has no cells
        older, newest = stack_by_digest(session, from_version), stack_by_digest(session, to_version)
        from_of, to_of = {"stack": older}, {"stack": newest}
        of_newer = [Job.stack_digest == to_version]
    else:
        by = "compiler" if axis == Axis.compiler else "library_version"
        version = Job.compiler_version if axis == Axis.compiler else Job.library_version
        from_of, to_of = {by: from_version}, {by: to_version}
        of_newer = [version == to_version]
    columns = _diff_key_columns(axis)
    keys_query = (
        sa.select(*columns.clauses).join(Result, Result.job_id == Job.id).where(*of_newer)
        .distinct().order_by(*columns.clauses).limit(limit + 1)
    )  # fmt: skip
    if after is not None:
        keys_query = keys_query.where(columns > after)
    keys: list[DiffKey] = [(k[0], k[1], k[2]) for k in session.execute(keys_query)]
    through = keys[limit - 1] if len(keys) > limit else None  # the last page reads to the end
    page: dict[str, Any] = {"after": after, "through": through}
    unchanged = [name for name in IDENTITY_VERSIONS if name not in AXIS_VERSIONS[axis]]

    def key(c: Cell) -> tuple[str, ...]:
        return (c.model_id, c.task, *(getattr(c.stack, name) for name in unchanged))

    # Every older cell of each key: a side may hold several stacks that the axis does not tell apart (two
    # TorchNeuron builds of one compiler); each newer stack is compared with each of them, never with one picked.
    old: dict[tuple[str, ...], list[Cell]] = {}
    for cell in cells(session, **from_of, **page) if None not in from_of.values() else []:
        old.setdefault(key(cell), []).append(cell)
    newer = cells(session, **to_of, **page) if None not in to_of.values() else []
    out = CellDiff(
        axis=axis, from_version=from_version, to_version=to_version, cells_compared=len(newer),
        next_cursor=encode_cursor(through) if through is not None else None,
    )  # fmt: skip
    for cell in newer:
        for was in old.get(key(cell), []):
            _compare(out, was, cell)
    return out


def _compare(out: CellDiff, was: Cell, cell: Cell) -> None:
    """Adds to ``out`` how ``cell`` changed from ``was``, the same model and task under an older stack."""
    stacks_of = {"from_stack": StackName.of(was.stack), "to_stack": StackName.of(cell.stack)}
    change = CellChange(model_id=cell.model_id, task=cell.task, from_status=was.status, to_status=cell.status,
                        from_sha=was.sha, to_sha=cell.sha, **stacks_of)  # fmt: skip
    if CellStatus.FLAKY in (was.status, cell.status):
        out.flaky.append(change)
    elif was.status in GOOD and cell.status in BAD:
        out.regressed.append(change)
    elif was.status in BAD and cell.status in GOOD:
        out.fixed.append(change)
    elif was.status != cell.status:
        out.changed.append(change)
    if was.tokens_per_s and cell.tokens_per_s and cell.tokens_per_s < was.tokens_per_s * (1 - THROUGHPUT_NOISE_BAND):
        out.slower.append(SpeedChange(model_id=cell.model_id, task=cell.task, from_tokens_per_s=was.tokens_per_s,
                                      to_tokens_per_s=cell.tokens_per_s, ratio=cell.tokens_per_s / was.tokens_per_s,
                                      **stacks_of))  # fmt: skip
