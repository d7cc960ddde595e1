"""Cells, FLAKY and the diff between versions, on constructed histories."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.contracts.run import RuntimeInfo
from shared.db.engine import new_session
from shared.results.cells import CellStatus, cell_status, cells, diff, flips
from tests.history import record, runtime

OLD, NEW = "2.21.0+old", "2.22.0+new"


def history(session: Session, old: RuntimeInfo, new: RuntimeInfo, prefix: str) -> None:
    """The same six models tested under ``old`` and then ``new``."""
    for model, before, after in [
        ("regress", [Verdict.PASS], [Verdict.FAIL]),
        ("crash", [Verdict.PASS], [Verdict.ERROR]),
        ("fix", [Verdict.ERROR], [Verdict.PASS]),
        ("steady", [Verdict.PASS], [Verdict.PASS, Verdict.PASS]),
        ("flaky", [Verdict.PASS], [Verdict.PASS, Verdict.FAIL, Verdict.PASS]),
        ("skipped", [Verdict.SKIPPED], [Verdict.FAIL]),
    ]:
        for rt, verdicts in ((old, before), (new, after)):
            for i, verdict in enumerate(verdicts):
                record(session, f"{prefix}/{model}", rt, verdict, force=i > 0)


def test_a_cell_is_flaky_when_its_runs_disagree() -> None:
    assert cell_status(["PASS", "PASS"]) == CellStatus.PASS
    assert cell_status(["PASS", "FAIL", "PASS"]) == CellStatus.FLAKY
    assert flips(["PASS", "FAIL", "PASS"]) == 2 and flips(["FAIL", "FAIL"]) == 0


def test_diff_lists_regressions_fixes_and_flaky_cells(session: Session) -> None:
    history(session, runtime(OLD, "5.24.0"), runtime(NEW, "5.24.0"), "org")
    changes = diff(session, "compiler", OLD, NEW)
    lists = changes.model_dump(include={"regressed", "fixed", "flaky", "changed"})
    names = {k: sorted(e["model_id"].split("/")[1] for e in v) for k, v in lists.items()}
    assert names == {"regressed": ["crash", "regress"], "fixed": ["fix"], "flaky": ["flaky"], "changed": ["skipped"]}
    [flaky] = [c for c in cells(session, compiler=NEW) if c.model_id.endswith("/flaky")]
    assert flaky.status == CellStatus.FLAKY and flaky.runs == 3 and flaky.flips == 2


def test_a_diff_and_the_failure_groups_keep_each_task_apart(session: Session) -> None:
    """One model tested as two tasks (a sentence-transformers repo, a pipeline): each task is a cell of its own,
    so a regression of one task's cell is listed under that task alone, and the failures filter by task."""
    from shared.contracts.enums import Task
    from shared.results.failures import failure_groups

    old, new = runtime(OLD, "5.24.0"), runtime(NEW, "5.24.0")
    for task, after in ((Task.feature_extraction, Verdict.PASS), (Task.text_to_image, Verdict.FAIL)):
        record(session, "tasks/both", old, Verdict.PASS, task=task.value)
        record(
            session, "tasks/both", new, after, task=task.value, verdict_reason="PSNR 21.3 dB < 38 and SSIM 0.8 < 0.99"
        )
    changes = diff(session, "compiler", OLD, NEW)
    assert [(c.model_id, c.task) for c in changes.regressed] == [("tasks/both", "text-to-image")]
    assert {c.task for c in cells(session, compiler=NEW) if c.model_id == "tasks/both"} == {
        "feature-extraction",
        "text-to-image",
    }
    [group] = failure_groups(session, NEW, Task.text_to_image)
    assert group.verdict == Verdict.FAIL and "PSNR" in group.signature and group.count == 1
    assert failure_groups(session, NEW, Task.feature_extraction) == []


def test_the_diff_endpoint_over_compilers_and_library_versions(api: Any) -> None:
    with new_session() as session:  # record() commits each run
        history(session, runtime("9.0+a", "5.24.0"), runtime("9.1+b", "5.24.0"), "diffc")
        history(session, runtime("9.3+d", "5.24.0"), runtime("9.3+d", "5.30.0"), "diffl")
    body = api.get("/results/diff", params={"from": "9.0+a", "to": "9.1+b"}).json()
    assert (body["axis"], body["from"], body["to"]) == ("compiler", "9.0+a", "9.1+b")
    assert {e["model_id"] for e in body["regressed"]} == {"diffc/crash", "diffc/regress"}
    [flaky] = body["flaky"]
    assert (flaky["model_id"], flaky["from"], flaky["to"]) == ("diffc/flaky", "PASS", "FLAKY")
    by_library = api.get("/results/diff", params={"from": "5.24.0", "to": "5.30.0", "axis": "library"}).json()
    assert by_library["axis"] == "library" and [e["model_id"] for e in by_library["fixed"]] == ["diffl/fix"]
    assert {e["model_id"] for e in by_library["regressed"]} == {"diffl/crash", "diffl/regress"}
    assert api.get("/results/diff", params={"from": "9.0+a"}).status_code == 422  # "to" is required
    assert api.get("/results/diff", params={"from": "x y", "to": "z"}).status_code == 422


def test_a_diff_pages_through_the_newer_versions_cells_and_scanning_reads_are_rate_limited(api: Any) -> None:
    with new_session() as session:
        history(session, runtime("9.4+e", "5.24.0"), runtime("9.5+f", "5.24.0"), "diffp")
    versions = {"from": "9.4+e", "to": "9.5+f"}
    whole = api.get("/results/diff", params=versions).json()
    assert whole["cells_compared"] == 6 and whole["next_cursor"] is None
    pages, params = [], {**versions, "limit": 4}
    while True:
        pages.append(api.get("/results/diff", params=params).json())
        if not pages[-1]["next_cursor"]:
            break
        params["cursor"] = pages[-1]["next_cursor"]
    assert [p["cells_compared"] for p in pages] == [4, 2]  # at most limit cells a page, each once
    for field in ("regressed", "fixed", "flaky", "changed"):
        assert sorted(e["model_id"] for p in pages for e in p[field]) == sorted(e["model_id"] for e in whole[field])
    # the /changes page shows one page and links the next
    html = api.get("/changes", params={**versions}).text
    assert "among the" not in html and 'id="next-page"' not in html
    assert pages[0]["next_cursor"].startswith("diffp/") and pages[0]["next_cursor"].count(",") == 2
    for bad in ("not-a-cursor", "a/b,text-generation", "a/b,,1.0", "a/b,t,1,x"):
        refused = api.get("/results/diff", params={**versions, "cursor": bad})
        assert refused.status_code == 422 and "cursor" in str(refused.json()["detail"])


def test_reads_that_scan_are_rate_limited_per_client(api: Any) -> None:
    import redis

    from services.api.deps import get_scan_limiter
    from services.api.ratelimit import RateLimiter
    from shared.settings import get_settings

    redis.Redis.from_url(get_settings().redis_url).delete("supportmatrix:rate:scan:testclient")  # earlier tests' reads
    limiter = RateLimiter(get_settings().redis_url, limit=2, window_s=60)
    api.app.dependency_overrides[get_scan_limiter] = lambda: limiter
    try:
        statuses = [api.get(path, params={"from": "9.4+e", "to": "9.5+f"}) for path in ("/results/diff", "/changes")]
        refused = api.get("/results/diff", params={"from": "9.4+e", "to": "9.5+f"})
        assert [r.status_code for r in statuses] == [200, 200] and refused.status_code == 429
        assert refused.json()["detail"].startswith("testclient made its 2 reads that scan (diffs) of the last 60 s")
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert api.get("/results", params={"limit": 1}).status_code == 200  # a page of rows is not a scan
    finally:
        api.app.dependency_overrides.pop(get_scan_limiter, None)
