"""The pluggable fluency judges: a local transformers LM, an OpenAI-compatible endpoint, the likelihood one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from services.runner.judges import PROMPT_HASH, LikelihoodJudge, LocalLMJudge, OpenAIJudge, make_judge
from shared.settings import Settings


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
    assert outcome.kind == "openai" and outcome.model == "judge-model" and outcome.prompt_hash == PROMPT_HASH
    assert outcome.fluent is False and outcome.reference_fluent is True
    assert outcome.answer.startswith("No. It is not English. / Yes.")
    assert [r["path"] for r in endpoint.requests] == ["/v1/chat/completions"] * 2
    assert endpoint.requests[0]["auth"] == "Bearer sekret" and endpoint.requests[0]["temperature"] == 0


def test_local_judge_runs_a_transformers_model_on_the_cpu(tiny_models: Path) -> None:
    judge = LocalLMJudge(str(tiny_models / "tiny-llama"))
    outcome = judge.judge(GIBBERISH, ENGLISH, -3.0, -2.0)
    assert outcome.kind == "local" and outcome.model.endswith("tiny-llama")
    assert isinstance(outcome.fluent, bool) and isinstance(outcome.reference_fluent, bool)
    assert "P(Yes)=" in outcome.answer  # a random tiny model's opinion, but a real forward pass


def test_likelihood_judge_needs_no_model() -> None:
    judge = make_judge(Settings(judge_kind="likelihood", judge_loglik_slack=1.0))
    assert isinstance(judge, LikelihoodJudge)
    assert judge.judge("a", "b", -2.5, -2.0).fluent is True
    assert judge.judge("a", "b", -3.5, -2.0).fluent is False
