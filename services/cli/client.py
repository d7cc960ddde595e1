"""The CLI's HTTP client: one class over httpx whose every failure is a `CliError` of one line.

Responses are parsed with the API's own models (`services.api.schemas`, `shared.*`), imported once an answer
is in: an unreachable API or a refused token is reported before those imports (a second or so) cost anything.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from services.api.schemas import JobCreate, JobOut, JobPage, JobsSubmitted, ResultPage, WorkerOut
    from shared.jobs.sweeps import SweepOut
    from shared.results.cells import CellDiff

TOKEN_HINT = "pass --token or set SUPPORTMATRIX_API_TOKEN (an operator makes one: supportmatrix tokens create NAME)"


class CliError(Exception):
    """A failure the user can act on: printed as one line, then the command exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(one_line(message))
        self.exit_code = exit_code


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


class ApiClient:
    def __init__(self, base_url: str, token: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token or None
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    # --- the routes ------------------------------------------------------------------------------------------

    def submit(self, body: JobCreate) -> JobsSubmitted:
        response = self.request("POST", "/jobs", json=body.model_dump(mode="json", exclude_defaults=True), write=True)
        from services.api.schemas import JobsSubmitted

        return JobsSubmitted.model_validate(response.json())

    def job(self, job_id: int) -> JobOut:
        response = self.request("GET", f"/jobs/{job_id}")
        from services.api.schemas import JobOut

        return JobOut.model_validate(response.json())

    def jobs(self, **params: Any) -> JobPage:
        response = self.request("GET", "/jobs", params=params)
        from services.api.schemas import JobPage

        return JobPage.model_validate(response.json())

    def cancel(self, job_id: int) -> JobOut:
        response = self.request("DELETE", f"/jobs/{job_id}", write=True)
        from services.api.schemas import JobOut

        return JobOut.model_validate(response.json())

    def results(self, **params: Any) -> ResultPage:
        response = self.request("GET", "/results", params=params)
        from services.api.schemas import ResultPage

        return ResultPage.model_validate(response.json())

    def results_as(self, format: str, **params: Any) -> httpx.Response:
        """The results page as the API writes it (json, csv or parquet), for writing out unchanged."""
        return self.request("GET", "/results", params={**params, "format": format})

    def diff(self, old: str, new: str, axis: str) -> CellDiff:
        """The whole diff: every page, one after another, as one."""
        from shared.results.cells import CellDiff

        params = {"from": old, "to": new, "axis": axis}
        pages = [CellDiff.model_validate(_by_field_name(self.request("GET", "/results/diff", params=params).json()))]
        while pages[-1].next_cursor:
            params["cursor"] = pages[-1].next_cursor
            pages.append(
                CellDiff.model_validate(_by_field_name(self.request("GET", "/results/diff", params=params).json()))
            )
        whole = pages[0].model_copy(
            update={"next_cursor": None, "cells_compared": sum(p.cells_compared for p in pages)}
        )
        for field in ("regressed", "fixed", "flaky", "changed", "slower"):
            setattr(whole, field, [item for page in pages for item in getattr(page, field)])
        return whole

    def workers(self) -> list[WorkerOut]:
        response = self.request("GET", "/workers")
        from services.api.schemas import WorkerOut

        return [WorkerOut.model_validate(w) for w in response.json()]

    def start_sweep(self) -> SweepOut:
        response = self.request("POST", "/sweeps", write=True)
        from shared.jobs.sweeps import SweepOut

        return SweepOut.model_validate(response.json())

    def sweep(self, sweep_id: int) -> SweepOut:
        response = self.request("GET", f"/sweeps/{sweep_id}")
        from shared.jobs.sweeps import SweepOut

        return SweepOut.model_validate(response.json())

    # --- one request, and its failures as one line -----------------------------------------------------------

    def request(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None, write: bool = False
    ) -> httpx.Response:
        """Send one request; ``write`` routes need the token. Raises CliError for anything but a 2xx answer."""
        if write and self.token is None:
            raise CliError(f"{method} {path} needs an API token: {TOKEN_HINT}")
        headers = {"Authorization": f"Bearer {self.token}"} if write and self.token else {}
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self._http.request(method, path, params=params, json=json, headers=headers)
        except httpx.ConnectError as exc:
            raise CliError(
                f"cannot reach the API at {self.base_url} ({_reason(exc)}); is it running? "
                "Point --api-url or SUPPORTMATRIX_API_URL at it"
            ) from exc
        except httpx.TimeoutException as exc:
            raise CliError(
                f"the API at {self.base_url} did not answer {method} {path} within {self.timeout_s:g} s"
            ) from exc
        except httpx.HTTPError as exc:
            raise CliError(f"{method} {self.base_url}{path} failed: {_reason(exc)}") from exc
        if response.is_error:
            raise CliError(self._refusal(method, path, response))
        return response

    def _refusal(self, method: str, path: str, response: httpx.Response) -> str:
        status, detail = response.status_code, _detail(response)
        if status == 401:
            return f"the API refused the token (401): {detail}; {TOKEN_HINT}"
        if status == 403:
            return f"this token may not do that (403): {detail}"
        if status in (429, 503):
            retry = response.headers.get("Retry-After")
            return f"{detail} ({status}{f'; retry after {retry} s' if retry else ''})"
        return f"{detail} ({status} from {method} {path})"


def _detail(response: httpx.Response) -> str:
    """The API's reason: FastAPI's ``detail`` (a string, or a list of invalid fields), else the body's start."""
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        return one_line(response.text[:200]) or response.reason_phrase
    if isinstance(detail, list):  # 422: [{"loc": [...], "msg": ...}, ...]
        return "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', [])[1:]) or 'request'}: {e.get('msg', e)}"
            if isinstance(e, dict)
            else str(e)
            for e in detail
        )
    return one_line(str(detail))


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text:
        return "connection refused"
    return one_line(text)


def _by_field_name(body: Any) -> Any:
    """A diff names its from/to fields `from` and `to` on the wire (serialization aliases only): back to the
    models' field names (`from_version`, `from_status`, ...) so CellDiff and CellChange parse it."""
    if isinstance(body, list):
        return [_by_field_name(item) for item in body]
    if not isinstance(body, dict):
        return body
    if "ratio" in body:  # a speed change names its fields in full
        return body
    version = "axis" in body  # the diff itself; its changes carry statuses
    suffix = "_version" if version else "_status"
    renamed = {("from" + suffix if k == "from" else "to" + suffix if k == "to" else k): v for k, v in body.items()}
    return {k: _by_field_name(v) if isinstance(v, list) else v for k, v in renamed.items()}
