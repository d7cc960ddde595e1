"""/failures: ERROR and FAIL rows grouped by their failure signature (``shared/results/failures.py``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from services.api.deps import SessionDep, SettingsDep
from services.api.schemas import CompilerVersion, error_responses
from shared.contracts.enums import Task
from shared.results.failures import FailureGroup, failure_groups

router = APIRouter(prefix="/failures", tags=["results"])


class FailurePage(BaseModel):
    compiler: str | None
    task: Task | None
    items: list[FailureGroup] = Field(description="Most rows first; of as many, the latest seen first.")


@router.get("", response_model=FailurePage, responses=error_responses(422, 503))
def list_failures(
    session: SessionDep,
    settings: SettingsDep,
    compiler: Annotated[
        CompilerVersion | None, Query(description="Only causes seen under this version, counted there.")
    ] = None,
    task: Task | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 100,
) -> FailurePage:
    """ERROR and FAIL rows grouped by failure signature: count, first and last seen, compiler versions,
    example models, and the version each cause first appeared in."""
    items = failure_groups(session, compiler, task)[: min(limit, settings.page_limit_max)]
    return FailurePage(compiler=compiler, task=task, items=items)
