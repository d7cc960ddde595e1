"""Request and response bodies of the HTTP API."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import Path, Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from shared.contracts.enums import Task
from shared.contracts.run import CoreCount, RuntimeInfo, Stack
from shared.hub.client import MODEL_ID_PATTERN, REVISION_PATTERN, is_model_id, is_revision
from shared.results.records import JobRecord, ResultRecord
from tasks import TASK_BY_PIPELINE

COMPILER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$"


def _model_id(value: str) -> str:
    if not is_model_id(value):
        raise ValueError(
            "not a Hub model id: expected org/name, each part 1-96 letters, digits, '-', '_' or '.', "
            "not starting or ending with '-' or '.', without '--' or '..'"
        )
    return value


def _revision(value: str) -> str:
    if not is_revision(value):
        raise ValueError("not a revision: expected a branch, tag or commit sha without spaces or '..'")
    return value


# The Hub's grammars use look-aheads, which pydantic's regex engine lacks: checked in Python,
# still published in the OpenAPI schema.
ModelId = Annotated[
    str,
    Field(
        max_length=193,
        description="A Hub model id, `org/name`.",
        examples=["Qwen/Qwen3-0.6B"],
        json_schema_extra={"pattern": MODEL_ID_PATTERN},
    ),
    AfterValidator(_model_id),
]
Revision = Annotated[
    str, Field(max_length=200, json_schema_extra={"pattern": REVISION_PATTERN}), AfterValidator(_revision)
]
CompilerVersion = Annotated[
    str, Field(pattern=COMPILER_PATTERN, description="A compiler version, e.g. `2.21.33363.0+6dfecc895`.")
]


# Ids and cursors are SQL's 64-bit integers: a larger number is invalid input (422), not a database error.
ROW_ID_MAX = 2**63 - 1
RowId = Annotated[int, Path(ge=1, le=ROW_ID_MAX)]
Cursor = Annotated[int | None, Query(ge=1, le=ROW_ID_MAX, description="next_cursor of the previous page")]


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: ModelId
    revision: Revision | None = Field(None, description="Branch, tag or commit sha; default the Hub's main.")
    compilers: Annotated[list[CompilerVersion], Field(min_length=1, max_length=32)] | None = Field(
        None, description="Compiler versions to test with; default: every version live workers serve."
    )
    force: bool = Field(False, description="Run again even if an identical job already finished.")
    task: Task | None = Field(
        None,
        description="Default: from the model's pipeline tag on the Hub ("
        + ", ".join(f"{tag} → {task.value}" for tag, task in TASK_BY_PIPELINE.items())
        + "); any other tag (image-text-to-text, ...) is refused with 422 unless a task is given.",
    )
    cores: CoreCount | None = Field(
        None, description="Shard over this many cores; default: the fewest whose memory holds the weights."
    )


class JobOut(JobRecord):  # its fields: the job's columns, as JobRecord derives them
    """A job: what runs it (the runtime identity), where it is, and how it ended."""

    model_config = ConfigDict(from_attributes=True)


class SubmittedJob(JobOut):
    created: bool = Field(description="False when an identical job already existed and is returned instead.")


class JobsSubmitted(BaseModel):
    jobs: list[SubmittedJob]


class JobPage(BaseModel):
    items: list[JobOut]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last.")


class ResultPage(BaseModel):
    items: list[ResultRecord]
    next_cursor: str | None


class StackOut(BaseModel):
    """A software stack with results (GET /results/stacks): how it is named, and its versions."""

    digest: str = Field(description="What axis=stack takes; the stack-<digest> of queue, file and config names.")
    label: str = Field(description="Its versions as the pages show them.")
    versions: Stack

    @classmethod
    def of(cls, stack: Stack) -> StackOut:
        return cls(digest=stack.digest, label=stack.label(), versions=stack)


class ErrorBody(BaseModel):
    detail: Any = Field(description="Why the request was refused.")


def _header(description: str) -> dict[str, Any]:
    return {"description": description, "required": True, "schema": {"type": "string"}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route returns, with the headers that come with them."""
    reasons = {
        400: "Malformed request",
        401: "No bearer token, or one that is unknown or revoked",
        403: "The token's scope does not allow this (force and sweeps need admin)",
        404: "Not found",
        409: "Conflicts with the job's state",
        413: "Request body too large",
        422: "Invalid input; the detail says which field and why",
        429: "This token's rate limit is spent",
        503: "A dependency (Hub, database, broker) is unavailable",
    }
    headers = {
        401: {"WWW-Authenticate": _header('`Bearer`, with `error="invalid_token"` when a token was presented')},
        429: {"Retry-After": _header("Seconds until this token may write again")},
        503: {"Retry-After": _header("Seconds to wait before retrying")},
    }
    return {
        s: {"model": ErrorBody, "description": reasons[s]} | ({"headers": headers[s]} if s in headers else {})
        for s in statuses
    }


class WorkerOut(RuntimeInfo):
    """A live worker: the runtime it serves, on which host and core group, from which queue."""

    model_config = ConfigDict(from_attributes=True)

    name: str
    host: str
    cores: str
    core_count: int
    queue: str
    started_at: dt.datetime
    heartbeat_at: dt.datetime
