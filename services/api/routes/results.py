"""/results: finished tests as JSON, CSV or Parquet, for people and downstream tools."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response

from services.api.answers import Answer
from services.api.deps import AnswersDep, DiffPageDep, ScanDep, SessionDep, SettingsDep, read_in_one_hop
from services.api.schemas import CompilerVersion, Cursor, ModelId, ResultPage, StackOut, error_responses
from shared.contracts.enums import Axis, SweepView, Task, Verdict
from shared.results.cells import CellDiff, diff, stacks
from shared.results.records import (
    RecordFilters,
    query_results,
    query_view,
    records_version,
    to_csv,
    to_parquet_bytes,
)

router = APIRouter(prefix="/results", tags=["results"])

NEXT_CURSOR_HEADER = "X-Next-Cursor"
# list_results' parameters that are not the query's
DEPENDENCIES = {"session", "settings", "answers"}


@router.get("/diff", response_model=CellDiff, responses=error_responses(422, 429, 503))
def diff_results(
    session: SessionDep,
    _: ScanDep,
    page: DiffPageDep,
    from_: Annotated[CompilerVersion, Query(alias="from", description="the older version")],
    to: Annotated[CompilerVersion, Query(description="the newer version")],
    axis: Axis = Axis.compiler,
) -> CellDiff:
    """Models that regressed (PASS → FAIL/ERROR) or were fixed between two compiler or library versions, or two
    whole stacks (axis=stack: from and to are stack digests, the stack-<digest> of queue and file names); cells
    whose repeated runs disagree are listed as FLAKY. One page of the newer version's cells at a time
    (at most SUPPORTMATRIX_DIFF_PAGE_CELLS, and never more than page_limit_max); follow next_cursor."""
    return diff(session, axis, from_, to, after=page.after, limit=page.limit)


@router.get("/stacks", response_model=list[StackOut], responses=error_responses(429, 503))
def list_stacks(session: SessionDep, _: ScanDep) -> list[StackOut]:
    """The software stacks with results, newest compiler first: each one's digest (what axis=stack of /results/diff
    and /changes takes as from and to, the stack-<digest> of queue, file and dataset config names), its versions, and
    its label as the pages show it. A read that scans the results, rate limited as the diffs are."""
    return [StackOut.of(stack) for stack in stacks(session)]


@router.get(
    "",
    response_model=ResultPage,
    responses={
        200: {
            "description": "Results, newest first. CSV and Parquet carry the next cursor in X-Next-Cursor.",
            "content": {"text/csv": {}, "application/vnd.apache.parquet": {}},
        },
        **error_responses(422, 503),
    },
)
@read_in_one_hop
def list_results(
    session: SessionDep,
    settings: SettingsDep,
    answers: AnswersDep,
    model_id: Annotated[ModelId | None, Query()] = None,
    compiler: Annotated[CompilerVersion | None, Query()] = None,
    library_version: Annotated[CompilerVersion | None, Query()] = None,
    verdict: Verdict | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 100,
    cursor: Cursor = None,
    format: Literal["json", "csv", "parquet"] = "json",
    view: Annotated[
        SweepView | None,
        Query(description="the view of the newest finished sweep that lists it for the task, in its rank order"),
    ] = None,
    task: Task | None = None,
) -> Response:
    limit = min(limit, settings.page_limit_max)
    # What its answer is kept by: the database, and every query parameter of the route by name (one added to the
    # route is in it without being listed here).
    arguments = locals()
    query = (session.get_bind(), *((name, value) for name, value in arguments.items() if name not in DEPENDENCIES))
    kept = answers.get(query, lambda: records_version(session))
    if kept is not None:
        return kept
    filters = RecordFilters(model_id=model_id, compiler=compiler, library_version=library_version, verdict=verdict)
    if view is None:
        read = query_results(session, **filters, before_id=cursor, limit=limit)
        next_cursor = str(read.records[-1].job_id) if len(read.records) == limit else None
    else:
        # A view pages in its rank order: the cursor is the position (1-based) of the next page's first row among
        # the view's rows that pass the filters.
        start = (cursor or 1) - 1
        read = query_view(session, view, task.value if task else None, offset=start, limit=limit, **filters)
        next_cursor = str(start + limit + 1) if read.more else None
    headers = {NEXT_CURSOR_HEADER: next_cursor} if next_cursor else {}
    if format == "csv":
        body, media_type = to_csv(read.records).encode(), "text/csv"
    elif format == "parquet":
        body, media_type = to_parquet_bytes(read.records), "application/vnd.apache.parquet"
    else:  # the response model's JSON, encoded here so that it can be kept
        page = ResultPage(items=read.records, next_cursor=next_cursor)
        body, media_type = page.model_dump_json().encode(), "application/json"
    return answers.keep(query, Answer(read.version, body, media_type, headers))
