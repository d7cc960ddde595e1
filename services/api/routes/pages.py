"""The pages people read: the results table at /, a model's page, the changes between two versions, a sweep's
cost. Server-rendered HTML over the query functions the JSON routes use; every filter is a GET parameter, so
the URL carries the state and a view can be linked. Not in the OpenAPI schema: they are pages, not an API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Query, Request, status
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from services.api.deps import DiffPageDep, ScanDep, SessionDep, SettingsDep
from services.api.schemas import CompilerVersion, ModelId, RowId
from shared.contracts.enums import Axis, Task, Verdict
from shared.db.models import Sweep
from shared.hub.sizing import GIB
from shared.jobs.sweeps import progress
from shared.results import views
from shared.results.cells import THROUGHPUT_NOISE_BAND, diff, stacks
from shared.results.records import query_results
from tasks import DECLARATIONS, TASKS_DIR

HERE = Path(__file__).resolve().parent.parent
STATIC = HERE / "static"
STATIC_FILES = {p.name for p in STATIC.iterdir() if p.is_file()}
PAGE_SIZE = 100
SEARCH_MAX = 200

router = APIRouter(include_in_schema=False)
# A task's own parts of the model page live in its folder (tasks/<name>/page.html, charts.html)
templates = Jinja2Templates(directory=[HERE / "templates", TASKS_DIR])
templates.env.globals["folders"] = {d.task.value: d.folder for d in DECLARATIONS.values()}


def _filters(env: Any) -> None:
    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:,.1f} s"

    def usd(value: float | None) -> str:
        if value is None:
            return "—"
        return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"

    def gib(value: float | None) -> str:
        return "—" if value is None else f"{value:,.2f}"

    def bytes_gib(value: int | None) -> str:
        return gib(None if value is None else value / GIB)

    env.filters.update(seconds=seconds, usd=usd, gib=gib, bytes_gib=bytes_gib)


_filters(templates.env)


def _link(state: dict[str, Any], defaults: dict[str, Any]) -> Any:
    """``link(**changes)``: this page's URL with some parameters changed; defaults and empties are left out."""

    def link(path: str = "/", **changes: Any) -> str:
        merged = {**state, **changes}
        query = {k: v for k, v in merged.items() if v not in (None, "") and defaults.get(k) != v}
        return path + ("?" + urlencode(query) if query else "")

    return link


@router.get("/", response_class=HTMLResponse)
def results_page(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    task: Task = Task.text_generation,
    view: views.View = "all",
    compiler: Annotated[CompilerVersion | None, Query()] = None,
    library: Annotated[CompilerVersion | None, Query()] = None,
    q: Annotated[str, Query(max_length=SEARCH_MAX)] = "",
    result: Annotated[Verdict | Literal[""] | None, Query(description="empty: any")] = None,
    sort: views.Sort = "rank",
    dir: views.Direction = "asc",
    page: Annotated[int, Query(ge=1, le=100_000)] = 1,
) -> Response:
    """The table: per task and view, one row per model at the chosen compiler and library versions."""
    compilers = views.compiler_versions(session)
    compiler = compiler or (compilers[0] if compilers else None)
    libraries = views.library_versions(session, compiler) if compiler else []
    library = library or (libraries[0] if libraries else None)
    table = None
    if compiler and library:
        table = views.table_page(
            session,
            task=task.value,
            compiler=compiler,
            library_version=library,
            price_per_core_hour=settings.price_per_core_hour_usd,
            view=view,
            search=q.strip(),
            verdict=result or None,
            sort=sort,
            direction=dir,
            offset=(page - 1) * PAGE_SIZE,
            limit=PAGE_SIZE,
        )
    state = {"task": task.value, "view": view, "compiler": compiler, "library": library, "q": q,
             "result": result or None, "sort": sort, "dir": dir}  # fmt: skip
    defaults = {"task": Task.text_generation.value, "view": "all", "sort": "rank", "dir": "asc", "page": 1}
    if compilers and compiler == compilers[0]:
        defaults["compiler"] = compiler
    if libraries and library == libraries[0]:
        defaults["library"] = library
    return templates.TemplateResponse(
        request,
        "results.html",
        {
            "state": state,
            "page": page,
            "table": table,
            "tasks": [t.value for t in Task],
            "views": views.VIEWS,
            "verdicts": [v.value for v in Verdict],
            "compilers": compilers if compiler in compilers else [*compilers, compiler],
            "libraries": libraries if library in libraries or library is None else [*libraries, library],
            "price": settings.price_per_core_hour_usd,
            "link": _link(state, defaults),
            "page_size": PAGE_SIZE,
        },
    )


@router.get("/model/{model_id:path}", response_class=HTMLResponse)
def model_page(request: Request, model_id: ModelId, session: SessionDep, settings: SettingsDep) -> Response:
    """A model's history across versions, its latest verdict with the evidence, and how to reproduce it."""
    records = query_results(session, model_id=model_id).records
    if not records:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no results for {model_id}")
    latest = records[0]
    tasks = list(dict.fromkeys(r.task for r in records))
    return templates.TemplateResponse(
        request,
        "model.html",
        {
            "model_id": model_id,
            "latest": latest,
            "evidence": views.evidence(session, latest.job_id),
            "charts": {task: views.version_history(records, task) for task in tasks},
            "records": records,
            "cost": lambda r: views.cost_usd(r.wall_s, r.neuron_cores, settings.price_per_core_hour_usd),
            "price": settings.price_per_core_hour_usd,
        },
    )


# Each axis of /changes as its menu says it (every Axis, in the enum's order).
AXIS_NAMES = {Axis.compiler: "compiler versions", Axis.library: "transformers versions", Axis.stack: "whole stacks"}


@router.get("/changes", response_class=HTMLResponse)
def changes_page(
    request: Request,
    session: SessionDep,
    _: ScanDep,
    page: DiffPageDep,
    from_: Annotated[CompilerVersion | None, Query(alias="from")] = None,
    to: Annotated[CompilerVersion | None, Query()] = None,
    axis: Axis = Axis.compiler,
) -> Response:
    """What regressed and what got fixed between two versions (GET /results/diff), newest two by default; a page
    of the newer version's cells at a time. A stack (axis ``stack``) is given by its digest and shown by its
    versions."""
    labels: dict[str, str] = {}
    if axis == Axis.stack:
        labels = {stack.digest: stack.label() for stack in stacks(session)}
        versions = list(labels)
    else:
        versions = views.compiler_versions(session) if axis == Axis.compiler else views.library_versions(session, None)
    # A version of the other axis (the axis was just switched) falls back to the default, as a missing one does.
    to = to if to in versions else (versions[0] if versions else None)
    from_ = from_ if from_ in versions else next((v for v in versions if v != to), None)
    changes = diff(session, axis, from_, to, after=page.after, limit=page.limit) if from_ and to else None
    return templates.TemplateResponse(
        request,
        "changes.html",
        {
            "versions": versions,
            "labels": labels,
            "from_version": from_,
            "to_version": to,
            "axis": axis,
            "changes": changes,
            "paged": page.after is not None or (changes is not None and changes.next_cursor is not None),
            "noise_band": THROUGHPUT_NOISE_BAND,
            "axes": AXIS_NAMES,
        },
    )


@router.get("/sweep", response_class=HTMLResponse)
def newest_sweep(session: SessionDep) -> Response:
    """The newest sweep's page."""
    sweep_id = session.query(Sweep.id).order_by(Sweep.id.desc()).limit(1).scalar()
    if sweep_id is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no sweep has run yet")
    return RedirectResponse(f"/sweep/{sweep_id}", status.HTTP_307_TEMPORARY_REDIRECT)


@router.get("/sweep/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: RowId, session: SessionDep, settings: SettingsDep) -> Response:
    """A sweep's entries with their runs, what it cost in all and per PASS."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"sweep {sweep_id} does not exist")
    rows, cost = views.sweep_rows(session, sweep_id, settings.price_per_core_hour_usd)
    return templates.TemplateResponse(
        request,
        "sweep.html",
        {"sweep": progress(session, sweep), "rows": rows, "cost": cost, "price": settings.price_per_core_hour_usd},
    )


@router.get("/static/{name}")
def static_file(name: str) -> FileResponse:
    """The page's stylesheet and script (a fixed list: no path reaches outside the folder)."""
    if name not in STATIC_FILES:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no static file {name}")
    return FileResponse(STATIC / name, headers={"Cache-Control": "public, max-age=300"})
