"""Cells, FLAKY and the diff between versions, on constructed histories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from shared.contracts.enums import Verdict
from shared.contracts.run import RuntimeInfo
from shared.db.engine import new_session
from shared.results.cells import CellStatus, cell_status, cells, diff, flips
from tests.conftest import fresh_database
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


def test_a_compiler_diff_lets_the_neuron_sdk_change_together_and_matches_cells_on_torch(session: Session) -> None:
    """neuronx-cc, TorchNeuron, the runtime and torch are released together: a compiler diff matches a cell across all
    of them changing (another torch on the new compiler is a cell of its own, compared on its own); a library diff
    matches cells whose every other version is the same."""
    old = runtime(OLD, "5.24.0").model_copy(
        update={"torch_neuronx_version": "2.13.1", "neuron_runtime_version": "2.29"}
    )
    new = runtime(NEW, "5.24.0").model_copy(
        update={"torch_neuronx_version": "2.13.2", "neuron_runtime_version": "2.30"}
    )
    other_torch = new.model_copy(update={"torch_version": "2.14.0"})
    newer_library = new.model_copy(update={"library_version": "5.25.0"})
    record(session, "sdk/m", old, Verdict.PASS)
    record(session, "sdk/m", new, Verdict.FAIL)
    record(session, "sdk/m", other_torch, Verdict.PASS)  # same compiler, another torch: another cell, PASS as before
    record(session, "sdk/m", newer_library, Verdict.PASS)
    assert sorted(c.status for c in cells(session, compiler=NEW)) == [CellStatus.FAIL, CellStatus.PASS, CellStatus.PASS]
    compiler = diff(session, "compiler", OLD, NEW)
    assert [(c.model_id, c.from_status, c.to_status) for c in compiler.regressed] == [
        ("sdk/m", CellStatus.PASS, CellStatus.FAIL)
    ]
    assert compiler.flaky == compiler.fixed == compiler.changed == []  # the other torch's PASS: PASS before too
    library = diff(session, "library", "5.24.0", "5.25.0")
    # 5.24.0's cells: old's, new's and other_torch's; only new's has every other version of newer_library's
    assert [(c.from_status, c.to_status) for c in library.fixed] == [(CellStatus.FAIL, CellStatus.PASS)]
    assert library.regressed == library.flaky == library.changed == []


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_cpu_compiler_diff_is_a_torch_release(kind: str, tmp_path: Path) -> None:
    """On cpu the compiler is inductor-<torch>: a compiler diff lets torch change with it, so a PASS on
    inductor-2.13.0+cpu then a FAIL on inductor-2.14.0+cpu is a regression (before, no cell matched: nothing)."""
    cpu = RuntimeInfo(backend="cpu", compiler_name="inductor", compiler_version="inductor-2.13.0+cpu",
                      library_version="5.24.0", torch_version="2.13.0+cpu")  # fmt: skip
    newer = cpu.model_copy(update={"compiler_version": "inductor-2.14.0+cpu", "torch_version": "2.14.0+cpu"})
    with fresh_database(kind, tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        record(session, "cpu/m", cpu, Verdict.PASS)
        record(session, "cpu/m", newer, Verdict.FAIL)
        changes = diff(session, "compiler", cpu.compiler_version, newer.compiler_version)
    assert [(c.model_id, c.from_status, c.to_status) for c in changes.regressed] == [
        ("cpu/m", CellStatus.PASS, CellStatus.FAIL)
    ]
    [regressed] = changes.regressed
    assert (regressed.from_stack.digest, regressed.to_stack.digest) == (cpu.stack().digest, newer.stack().digest)
    assert changes.cells_compared == 1 and changes.fixed == changes.flaky == changes.changed == []


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_side_with_several_stacks_of_one_version_is_compared_stack_by_stack(kind: str, tmp_path: Path) -> None:
    """The older compiler ran under two TorchNeuron builds, PASS on one and FAIL on the other; the newer compiler
    under one, PASS. Each older stack is compared with the newer one and named in the change: one fix (from the build
    that failed), and nothing else — never one of the two picked by sort order, hiding the other. Two newer stacks
    over one older one are reported each."""
    old = runtime(OLD, "5.24.0")
    builds = [old.model_copy(update={"torch_neuronx_version": v}) for v in ("2.13.1", "2.13.9")]
    new = runtime(NEW, "5.24.0").model_copy(update={"torch_neuronx_version": "2.14.0"})
    new_other = new.model_copy(update={"torch_neuronx_version": "2.14.1"})
    with fresh_database(kind, tmp_path) as engine, Session(engine, expire_on_commit=False) as session:
        for build, verdict in zip(builds, (Verdict.FAIL, Verdict.PASS), strict=True):
            record(session, "stacks/m", build, verdict)
        record(session, "stacks/m", new, Verdict.PASS)
        changes = diff(session, "compiler", OLD, NEW)
        assert [(c.from_stack.digest, c.to_stack.digest, c.from_status, c.to_status) for c in changes.fixed] == [
            (builds[0].stack().digest, new.stack().digest, CellStatus.FAIL, CellStatus.PASS)
        ]
        assert changes.fixed[0].from_stack.label == builds[0].stack().label()
        assert changes.regressed == changes.flaky == changes.changed == []
        # the other way round: two newer stacks, each compared with the one older stack that failed
        record(session, "stacks/two", builds[0], Verdict.FAIL)
        record(session, "stacks/two", new, Verdict.PASS)
        record(session, "stacks/two", new_other, Verdict.ERROR)
        both = diff(session, "compiler", OLD, NEW)
    two = [c for c in both.fixed + both.changed if c.model_id == "stacks/two"]
    assert sorted((c.to_stack.digest, c.to_status) for c in two) == sorted(
        [(new.stack().digest, CellStatus.PASS), (new_other.stack().digest, CellStatus.ERROR)]
    )
    assert {c.from_stack.digest for c in two} == {builds[0].stack().digest}
