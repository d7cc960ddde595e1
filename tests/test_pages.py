"""The results pages in a real browser: Debian's chromium, headless, driven by Playwright's Python client
(``executable_path``: Playwright never downloads a browser here). The API is served by a real uvicorn on a
free port, over the suite's PostgreSQL schema seeded below; the 100 k-row table lives in a schema of its own.

Each test saves a full-page screenshot in its own artifact folder, pytest's ``tmp_path`` (kept after the run
under pytest's base temp, e.g. /tmp/pytest-of-root/pytest-N/<test name>0/; ``--basetemp DIR`` chooses it).
"""

from __future__ import annotations

import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import uvicorn
from sqlalchemy.orm import Session

from shared.contracts.enums import ErrorClass, Stage, SweepState, Task, Verdict
from shared.contracts.run import RuntimeInfo
from shared.db.models import Sweep, SweepEntry
from shared.hub.client import ResolvedModel
from shared.jobs.lease import acquire_lease
from shared.jobs.outcomes import finish
from shared.jobs.submission import submit
from shared.processes import free_port
from shared.settings import get_settings
from tests.conftest import fresh_database
from tests.history import report_of

OLD, NEW = "pages-1.0", "pages-2.0"
LIB, NEWER_LIB = "5.0", "5.1"
REPRODUCE = "python -m services.runner {model} --task text-generation --compiler-version pages-2.0 --cores 2"
BIG_ROWS = 100_000
COMPILE_ERROR = "neuronx-cc: unsupported op aten::foo"


def runtime(compiler: str, library: str) -> RuntimeInfo:
    return RuntimeInfo(backend="neuron", compiler_name="neuronx-cc", compiler_version=compiler,
                       library_version=library, torch_version="2.13.0")  # fmt: skip


def finished(session: Session, model: str, rt: RuntimeInfo, verdict: Verdict, **report: Any) -> int:
    """One finished run of ``model``, written as a worker writes it; returns the job id."""
    task = report.pop("task", Task.text_generation.value)
    resolved = ResolvedModel(model_id=model, sha=f"{abs(hash(model)) % 10**40:040d}", gated=False, pipeline_tag=None)
    [sub] = submit(session, resolved, None, [rt], task=task)
    session.flush()
    acquire_lease(session, sub.job.id, "pages", get_settings(), Stage.accelerator)
    fields = {"cores": 2, "wall_s": 30.0, "compile_s": 20.0, "peak_memory_bytes": 3 << 30, "compile_cache": "miss"}
    finish(
        session,
        sub.job.id,
        "pages",
        report_of(model_id=model, task=task, backend="neuron", verdict=verdict, **{**fields, **report}),
    )
    return sub.job.id


@dataclass(frozen=True)
class Seeded:
    org: str
    sweep_id: int

    def m(self, i: int) -> str:
        return f"{self.org}/m{i}"


@contextmanager
def serving(engine: sa.Engine) -> Iterator[None]:
    """The app reads ``engine``'s database while inside: the pages see only the rows planted there."""
    from services.api.deps import get_session
    from services.api.main import app

    def session_of_engine() -> Iterator[Session]:
        with Session(engine) as session:
            yield session

    previous = app.dependency_overrides.get(get_session)
    app.dependency_overrides[get_session] = session_of_engine
    try:
        yield
    finally:
        if previous is None:
            app.dependency_overrides.pop(get_session)
        else:
            app.dependency_overrides[get_session] = previous


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    with fresh_database("postgresql", tmp_path_factory.mktemp("pages")) as engine, serving(engine):
        yield plant(engine)


def plant(engine: sa.Engine) -> Seeded:
    """A fresh org: six text-generation models under two compiler versions (m1 regresses PASS → FAIL, m2
    PASS → ERROR, m5 is fixed), two of them (m1, m3) under a newer transformers too, two feature-extraction models,
    and a finished sweep whose trending view ranks m3, m0, m5, m1 and a model it never ran."""
    org = f"pages{uuid.uuid4().hex[:8]}"
    with Session(engine) as session:
        for i in range(6):
            speed = {"decode_tokens_per_s": 100.0} if i == 0 else {}
            finished(session, f"{org}/m{i}", runtime(OLD, LIB), Verdict.FAIL if i == 5 else Verdict.PASS,
                     wall_s=40.0 + i, compile_s=30.0, **speed)  # fmt: skip
        new: dict[int, int] = {}
        new[0] = finished(
            session, f"{org}/m0", runtime(NEW, LIB), Verdict.PASS,
            wall_s=12.5, compile_s=9.0, compile_cache="hit", first_divergence=7, tokens_match=False,
            prefill_rel_error=1.25e-4, accelerator_loglik=-1.234, reference_loglik=-1.2,
            judge_kind="local", judge_model="Qwen/Qwen3-0.6B", judge_answer="YES, fluent",
            judge_rationale="The continuation is grammatical and on topic.",
            verdict_reason="tokens diverge from step 7, every divergence a near tie",
            reproduce=REPRODUCE.format(model=f"{org}/m0"),
            decode_tokens_per_s=50.0, ttft_p50_s=0.2, ttft_p99_s=0.25, tpot_p50_s=0.02, tpot_p99_s=0.03,
            perf_new_tokens=64, perf_prompt_tokens=10, perf_iterations=3,
            long_generation="ok", long_new_tokens=246, long_first_divergence=180,
            long_agreement=[1.0, 1.0, 1.0, 1.0, 1.0, 0.4, 0.1, 0.0],
            long_reason="diverges from the reference at step 180, as plausible as its own text",
            evidence={"divergent_steps": [{"step": 7, "accelerator_token": 1234, "reference_token": 4321,
                                           "gap": 0.0004, "rank": 1}]},
        )  # fmt: skip
        new[1] = finished(session, f"{org}/m1", runtime(NEW, LIB), Verdict.FAIL, wall_s=50.0, cores=4)
        new[2] = finished(session, f"{org}/m2", runtime(NEW, LIB), Verdict.ERROR, wall_s=5.0, compile_s=None,
                          error_class=ErrorClass.compile, error_message=COMPILE_ERROR)  # fmt: skip
        for i in (3, 4, 5):
            new[i] = finished(session, f"{org}/m{i}", runtime(NEW, LIB), Verdict.PASS, wall_s=20.0 + i)
        for i in (1, 3):
            finished(session, f"{org}/m{i}", runtime(NEW, NEWER_LIB), Verdict.PASS, wall_s=11.0)
        for i in range(2):
            finished(session, f"{org}/e{i}", runtime(NEW, LIB), Verdict.PASS,
                     task=Task.feature_extraction.value, similarity=0.9999)  # fmt: skip
        sweep = Sweep(trigger="api", state=SweepState.done, config={})
        session.add(sweep)
        session.flush()
        trending = [(3, 1), (0, 2), (5, 3), (1, 4)]
        for i, rank in trending:
            session.add(SweepEntry(sweep_id=sweep.id, model_id=f"{org}/m{i}", task="text-generation",
                                   view="trending", rank=rank, job_id=new[i]))  # fmt: skip
        session.add(SweepEntry(sweep_id=sweep.id, model_id=f"{org}/never-run", task="text-generation",
                               view="trending", rank=5, job_id=None, note="gated"))  # fmt: skip
        # m0 is listed by downloads too: the sweep's cost counts its job once.
        session.add(SweepEntry(sweep_id=sweep.id, model_id=f"{org}/m0", task="text-generation",
                               view="downloads", rank=1, job_id=new[0]))  # fmt: skip
        session.commit()
        return Seeded(org, sweep.id)


# --- a real server and a real browser --------------------------------------------------------------------


class Served:
    """The API app under uvicorn, in a thread of this process (so that a test may override a dependency)."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    from services.api.main import app

    served = Served(app)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: apt-get install -y --no-install-recommends chromium (scripts/setup.sh)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh page; its screenshot is saved in the test's folder when the test ends, pass or fail."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    shot = tmp_path / f"{request.node.name}.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    context.close()


def models_in_table(page: Any) -> list[str]:
    return page.locator("#results tbody th[scope=row]").all_inner_texts()


# --- the tests ---------------------------------------------------------------------------------------------


def test_the_table_renders_the_rows_of_a_seeded_database(page: Any, server: Served, seeded: Seeded) -> None:
    page.goto(server.url(f"/?compiler={NEW}&library={LIB}&q={seeded.org}/m"))
    assert models_in_table(page) == [seeded.m(i) for i in range(6)]
    error_row = page.locator("#results tbody tr", has_text=seeded.m(2))
    assert "ERROR (compile)" in error_row.inner_text()  # the colour comes with its text
    assert error_row.locator(".verdict-ERROR").count() == 1
    first = page.locator("#results tbody tr").first.locator("td").all_inner_texts()
    # result, cores, wall, compile, peak GiB, cache, decode rate, cost — m0 ran 12.5 s on 2 cores
    price = get_settings().price_per_core_hour_usd
    assert first == ["✓ PASS", "2", "12.5 s", "9.0 s", "3.00", "hit", "50.0", f"${12.5 * 2 / 3600 * price:,.4f}"]
    assert page.locator("#row-count").inner_text() == "6"
    assert page.locator("th[aria-sort]").count() == 9 and page.get_by_label("Model id contains").count() == 1


def test_search_and_the_version_selectors_narrow_the_table(page: Any, server: Served, seeded: Seeded) -> None:
    page.goto(server.url(f"/?q={seeded.org}/m"))
    # Defaults: the newest compiler version, and its newest transformers version (only m1 and m3 ran there).
    assert page.get_by_label("Compiler version").input_value() == NEW
    assert page.get_by_label("transformers version").input_value() == NEWER_LIB
    assert models_in_table(page) == [seeded.m(1), seeded.m(3)]

    page.get_by_label("transformers version").select_option(LIB)
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url(re.compile(f"library={LIB}"))
    assert len(models_in_table(page)) == 6

    search = page.get_by_label("Model id contains")  # by keyboard: type, then Enter submits the form
    search.fill(f"{seeded.org}/M2")
    search.press("Enter")
    page.wait_for_url(re.compile(r"q=.*M2"))
    assert models_in_table(page) == [seeded.m(2)]

    page.get_by_label("Compiler version").select_option(OLD)
    page.get_by_label("Model id contains").fill(seeded.org)
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url(re.compile(f"compiler={OLD}"))
    assert len(models_in_table(page)) == 6 and "FAIL" in page.locator("#results tbody tr").nth(5).inner_text()
    page.get_by_label("Result", exact=True).select_option("FAIL")
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url(re.compile("result=FAIL"))
    assert models_in_table(page) == [seeded.m(5)]


def test_a_view_follows_the_newest_sweeps_rank_order_and_columns_sort(
    page: Any, server: Served, seeded: Seeded
) -> None:
    page.goto(server.url(f"/?compiler={NEW}&library={LIB}&q={seeded.org}"))
    page.get_by_role("navigation", name="View").get_by_role("link", name="Trending").click()
    page.wait_for_url(re.compile("view=trending"))
    expected = [seeded.m(3), seeded.m(0), seeded.m(5), seeded.m(1), f"{seeded.org}/never-run"]
    assert models_in_table(page) == expected
    ranks = page.locator("#results tbody tr td:first-child").all_inner_texts()
    assert ranks == ["1", "2", "3", "4", "5"]
    assert "no run" in page.locator("#results tbody tr").nth(4).inner_text()

    page.get_by_role("link", name="Wall time (incl. compile)").click()  # numeric columns sort largest first
    page.wait_for_url(re.compile("sort=wall"))
    assert "dir=desc" in page.url
    assert models_in_table(page) == [seeded.m(1), seeded.m(5), seeded.m(3), seeded.m(0), f"{seeded.org}/never-run"]
    assert page.locator("th[aria-sort=descending]").inner_text().startswith("Wall time")

    linked = page.url  # the URL carries the state: opened again, it shows the same table
    page.goto(server.url("/"))
    page.goto(linked)
    assert models_in_table(page)[0] == seeded.m(1)

    page.get_by_role("link", name="Decode (tokens/s)").click()  # the one PASS with a measured rate first
    page.wait_for_url(re.compile("sort=throughput"))
    assert models_in_table(page)[0] == seeded.m(0) and "50.0" in page.locator("#results tbody tr").first.inner_text()


def test_the_model_page_shows_the_evidence_and_the_reproduce_command(page: Any, server: Served, seeded: Seeded) -> None:
    page.goto(server.url(f"/model/{seeded.m(2)}"))  # an ERROR row: its class and message
    error = page.locator("#error")
    assert "compile" in error.inner_text() and COMPILE_ERROR in error.inner_text()
    assert page.locator("#first-divergence").inner_text() == "—"

    page.goto(server.url(f"/?compiler={NEW}&library={LIB}&q={seeded.org}/m"))
    page.get_by_role("link", name=seeded.m(0), exact=True).click()
    page.wait_for_url(re.compile(f"/model/{seeded.m(0)}$"))
    assert page.locator("h1").inner_text() == seeded.m(0)
    assert page.locator("#first-divergence").inner_text() == "step 7"
    assert page.locator("#prefill-error").inner_text() == "0.000125"
    assert page.locator("#judge-answer").inner_text() == "YES, fluent"
    assert "grammatical" in page.locator("#judge-rationale").inner_text()
    assert "near tie" in page.locator("#verdict-reason").inner_text()
    assert page.locator("#near-ties tbody tr").all_inner_texts() == ["7\t1234\t4321\t0.0004\t1"]
    assert page.locator("#throughput").inner_text().startswith("50.0 tokens/s · first token")
    assert page.locator("#long-generation").inner_text().startswith("ok: diverges from the reference at step 180")
    # The history charts (wall time, peak memory, decode rate, the long generation's profile): a bar (or a row of
    # windows) per version, pages-1.0 · 5.0 then pages-2.0 · 5.0.
    assert page.locator("figure.chart").count() == 4
    assert page.locator("figure.chart").nth(2).locator("text.value").all_text_contents() == [
        "100.00 tokens/s",
        "50.00 tokens/s",
    ]
    assert page.locator("figure.chart").nth(3).locator("g.profile").last.locator("rect").count() == 8
    assert page.locator("figure.chart").first.locator("text.label").all_text_contents() == [
        f"{OLD} · {LIB} · PASS",
        f"{NEW} · {LIB} · PASS",
    ]

    command = REPRODUCE.format(model=seeded.m(0))
    assert page.locator("#reproduce").inner_text() == command
    page.get_by_role("button", name="Copy command").click()
    page.get_by_text("Copied.").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == command


def test_the_changes_view_lists_a_planted_regression(page: Any, server: Served, seeded: Seeded) -> None:
    page.goto(server.url("/changes"))
    page.get_by_label("From (older)").select_option(OLD)
    page.get_by_label("To (newer)").select_option(NEW)
    page.get_by_role("button", name="Compare").click()
    page.wait_for_url(re.compile(f"from={OLD}.*to={NEW}"))
    regressed = page.locator("#regressed tbody tr").all_inner_texts()
    assert [row.split("\t")[0] for row in regressed] == [seeded.m(1), seeded.m(2)]
    assert "✓ PASS" in regressed[0] and "✗ FAIL" in regressed[0] and "! ERROR" in regressed[1]
    assert [row.split("\t")[0] for row in page.locator("#fixed tbody tr").all_inner_texts()] == [seeded.m(5)]
    slower = page.locator("#slower tbody tr").all_inner_texts()  # 100 → 50 tokens/s: past the noise band
    assert [row.split("\t") for row in slower] == [[seeded.m(0), "text-generation", "100.0", "50.0", "0.50"]]


def test_the_sweep_page_shows_the_total_cost_and_the_cost_per_pass(page: Any, server: Served, seeded: Seeded) -> None:
    page.goto(server.url(f"/sweep/{seeded.sweep_id}"))
    price = get_settings().price_per_core_hour_usd
    # m3 (23 s), m0 (12.5 s), m5 (25 s) PASS on 2 cores; m1 FAIL, 50 s on 4 cores; m0 twice listed, paid once.
    total = (23 + 12.5 + 25) * 2 / 3600 * price + 50 * 4 / 3600 * price
    assert page.locator("#sweep-total").inner_text() == f"${total:,.4f}"
    assert page.locator("#sweep-per-pass").inner_text() == f"${total / 3:,.4f}"
    assert page.locator("#entries tbody tr").count() == 6


# --- 100 k rows ----------------------------------------------------------------------------------------------

BIG_JOBS = """
INSERT INTO jobs (model_id, sha, task, config_hash, gated, trust_remote_code, cores, queue, state, attempts,
                  verdict_attempts, resends, attempt_log, created_at, finished_at, library, library_version,
                  torch_version, backend, compiler_name, compiler_version)
SELECT 'big/model-' || lpad(i::text, 6, '0'), repeat('a', 40), 'text-generation', '', false, false,
       (ARRAY[1, 1, 2, 4])[1 + mod(i, 4)], 'q', CASE WHEN mod(i, 10) = 0 THEN 'failed' ELSE 'done' END, 1, 1, 0, '[]',
       now(), now(), 'transformers', '5.0', '2.13.0', 'neuron', 'neuronx-cc', 'big-1.0'
FROM generate_series(1, {rows}) AS i
"""
BIG_RESULTS = """
INSERT INTO results (job_id, verdict, error_class, cores, wall_s, compile_s, peak_memory_bytes, compile_cache,
                     created_at)
SELECT id, CASE WHEN state = 'failed' THEN 'ERROR' WHEN mod(id, 7) = 0 THEN 'FAIL' ELSE 'PASS' END,
       CASE WHEN state = 'failed' THEN 'compile' END, cores, 10 + (mod(id, 977)) * 0.37, 5 + (mod(id, 311)) * 0.21,
       (1 + mod(id, 23))::bigint << 28, CASE WHEN mod(id, 3) = 0 THEN 'hit' ELSE 'miss' END, now()
FROM jobs
"""


@pytest.fixture(scope="module")
def big_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    """A database of its own with 100 k finished runs of one compiler version, bulk-inserted in SQL."""
    started = time.perf_counter()
    with fresh_database("postgresql", tmp_path_factory.mktemp("pages-big")) as engine:
        with engine.begin() as conn:
            conn.exec_driver_sql(BIG_JOBS.format(rows=BIG_ROWS))
            conn.exec_driver_sql(BIG_RESULTS)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE jobs; ANALYZE results")
        print(f"\n100 k rows: schema migrated and filled in {time.perf_counter() - started:.1f} s")
        with Session(engine) as session:
            yield session


def test_the_first_page_of_100k_rows_renders_fast(page: Any, server: Served, big_schema: Session) -> None:
    """Server-side paging, filtering and sorting: the time is printed, not asserted (shared CPUs vary)."""
    assert big_schema.scalar(sa.text("SELECT count(*) FROM results")) == BIG_ROWS
    with serving(big_schema.get_bind()):
        timings = {}
        for name, path in [
            ("first page", "/"),
            ("first page again", "/"),
            ("sorted by wall time", "/?sort=wall&dir=desc"),
            ("searched", "/?q=model-0999"),
            ("page 500", "/?page=500"),
        ]:
            started = time.perf_counter()
            page.goto(server.url(path), wait_until="load")
            timings[name] = time.perf_counter() - started
            if name.startswith("first page"):
                assert page.locator("#row-count").inner_text() == "100,000"
                assert page.locator("#results tbody tr").count() == 100
                served = page.evaluate(
                    "(() => { const n = performance.getEntriesByType('navigation')[0];"
                    " return [n.responseEnd - n.requestStart, n.loadEventEnd - n.startTime]; })()"
                )
                print(f"\n100 k rows, {name}: server answered in {served[0]:.0f} ms, loaded in {served[1]:.0f} ms")
        assert page.locator("#results tbody tr").count() == 100 and "Page 500 of 1,000" in page.content()
        print("100 k rows, browser time to load: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
        page.goto(server.url("/"))  # the screenshot shows the first page
