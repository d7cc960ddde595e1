"""The pluggable fluency judges: a local transformers LM, an OpenAI-compatible endpoint, the likelihood one."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.runner.judges import PROMPT_HASH, QUESTION, LikelihoodJudge, LocalLMJudge, OpenAIJudge, make_judge
from shared.contracts.handoffs import VerdictOutput
from shared.processes import free_port
from shared.settings import Settings
from tests.conftest import ROOT, RUN_DIR
from tests.test_runner import run_local


class ChatEndpoint:
    """A local OpenAI-compatible /chat/completions that answers Yes for text with common English words."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                text = body["messages"][-1]["content"].split("Text: ", 1)[1]
                english = sum(w in {"the", "of", "and", "in", "a", "is"} for w in text.lower().split())
                answer = "Yes. It reads as English." if english >= 2 else "No. It is not English."
                payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def endpoint() -> Iterator[ChatEndpoint]:
    chat = ChatEndpoint()
    yield chat
    chat.server.shutdown()


ENGLISH = "The history of the printing press is a story of the craft and of the trade in a city."
GIBBERISH = "bersbersbers devgggg istorymbers antsure"


def test_openai_judge_asks_the_endpoint_about_both_texts(endpoint: ChatEndpoint) -> None:
    outcome = OpenAIJudge(endpoint.url, "judge-model", "sekret").judge(GIBBERISH, ENGLISH, -3.0, -2.0)
    audit = outcome.audit
    assert (
        audit.judge_kind == "openai" and audit.judge_model == "judge-model" and audit.judge_prompt_hash == PROMPT_HASH
    )
    assert outcome.fluent is False and outcome.reference_fluent is True
    assert outcome.audit.judge_answer.startswith("No. It is not English. / Yes.")
    assert [r["path"] for r in endpoint.requests] == ["/v1/chat/completions"] * 2
    assert endpoint.requests[0]["auth"] == "Bearer sekret" and endpoint.requests[0]["temperature"] == 0


def test_local_judge_runs_a_transformers_model_on_the_cpu(tiny_models: Path) -> None:
    judge = LocalLMJudge(str(tiny_models / "tiny-llama"))
    outcome = judge.judge(GIBBERISH, ENGLISH, -3.0, -2.0)
    assert outcome.kind == "local" and outcome.audit.judge_model.endswith("tiny-llama")
    assert isinstance(outcome.fluent, bool) and isinstance(outcome.reference_fluent, bool)
    assert "P(Yes)=" in outcome.audit.judge_answer  # a random tiny model's opinion, but a real forward pass


def test_likelihood_judge_needs_no_model() -> None:
    judge = make_judge(Settings(judge_kind="likelihood", judge_loglik_slack=1.0))
    assert isinstance(judge, LikelihoodJudge)
    assert judge.judge("a", "b", -2.5, -2.0).fluent is True
    assert judge.judge("a", "b", -3.5, -2.0).fluent is False


@pytest.fixture(scope="module")
def fluent_judge() -> Iterator[tuple[str, Path]]:
    """A real judge process: the OpenAI-compatible test server running a causal LM from a local directory,
    trained to find text fluent. Yields its base URL and its request log."""
    from testing.judge_server import train_answering_model

    model = train_answering_model(RUN_DIR / "judge-yes", "Yes, it reads as English.")
    port, log = free_port(), RUN_DIR / "judge-yes.jsonl"
    server = subprocess.Popen([sys.executable, "-m", "testing.judge_server", str(model), "--port", str(port),
                               "--log", str(log)], cwd=ROOT)  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/models").raise_for_status()
            break
        except httpx.TransportError:
            assert server.poll() is None and time.monotonic() < deadline, "the judge server did not start"
            time.sleep(0.2)
    yield url, log
    server.terminate()
    server.wait(10)


def test_a_judge_decides_a_sharded_bf16_run_whose_numbers_are_inconclusive(
    tiny_models: Path, fluent_judge: tuple[str, Path], tmp_path: Path
) -> None:
    """A sharded bf16 run whose greedy pick at step 4 is the reference's 10th choice: no near tie, but the text
    stays as likely as the reference's. The numbers alone fail it; the judge — asked through the real client,
    server, prompt and parser — finds the text fluent, and the run passes, with the judge's answer on record."""
    url, log = fluent_judge
    artifacts = tmp_path / "artifacts"
    judge = {"SUPPORTMATRIX_JUDGE_KIND": "openai", "SUPPORTMATRIX_JUDGE_URL": url,
             "SUPPORTMATRIX_JUDGE_MODEL": "tiny-judge", "SUPPORTMATRIX_JUDGE_TOKEN": "judge-secret"}  # fmt: skip
    run = {"SUPPORTMATRIX_CPU_DTYPE": "bfloat16", "SUPPORTMATRIX_CPU_FAULT": "swap_token"}
    code, report = run_local(tiny_models / "tiny-llama", "--cores", "2", "--artifacts", str(artifacts), **run, **judge)
    assert code == 0, report
    # without the judge: the numbers' verdict, kept in the verdict stage's hand-off
    numbers = VerdictOutput.model_validate_json((artifacts / "verdict.json").read_text()).report
    assert (
        numbers.verdict == "FAIL"
        and numbers.verdict_reason.startswith("step 4: ")
        and "not a near tie" in numbers.verdict_reason
    )
    assert numbers.comparison.first_divergence == 4
    # with it: PASS, and the audit fields say who decided and why
    assert (
        report.verdict == "PASS" and report.provenance.cores == 2 and report.runtime.compiler_version.endswith("-bf16")
    )
    assert "finds it fluent" in report.verdict_reason and report.comparison.first_divergence == 4
    assert report.judge.judge_kind == "openai" and report.judge.judge_model == "tiny-judge"
    assert report.judge.judge_prompt_hash == PROMPT_HASH
    assert report.judge.judge_answer == "Yes, it reads as English. / Yes, it reads as English."
    asked = [json.loads(line) for line in log.read_text().splitlines()]
    assert [a["prompt"] for a in asked] == [
        QUESTION.format(text=report.comparison.generated_text), QUESTION.format(text=report.comparison.reference_text)
    ]  # fmt: skip
    assert {(a["path"], a["auth"], a["model"], a["temperature"]) for a in asked} == {
        ("/v1/chat/completions", "Bearer judge-secret", "tiny-judge", 0)
    }
    # the default judge weighs only the likelihoods: the same hand-off, judged by it, keeps the numbers' FAIL
    code, likelihood = run_local(tiny_models / "tiny-llama", "--stage", "judge", "--artifacts", str(artifacts))
    assert likelihood.verdict == "FAIL" and likelihood.judge.judge_kind == "likelihood"
