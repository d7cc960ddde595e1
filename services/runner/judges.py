"""Judges of English fluency for sharded runs: pluggable, each answering for both texts.

- ``likelihood``: the reference model's own judgement, no extra model — the accelerator's text is fluent
  when its mean log-prob per token under the reference is within ``judge_loglik_slack`` of the
  reference's own text.
- ``local``: a transformers causal LM (``judge_model``, run on the CPU) asked the question below;
  its answer is P(" Yes") against P(" No") for the next token.
- ``openai``: any OpenAI-compatible chat endpoint (``judge_url``, ``judge_model``, ``judge_token``).
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from shared.contracts.enums import JudgeKind
from shared.contracts.evidence import JudgeOutcome
from shared.contracts.report import JudgeAudit
from shared.settings import RunnerSettings

QUESTION = (
    "Is the following text fluent, grammatical English (it may stop mid-sentence)? "
    "Answer Yes or No, then give one short reason.\n\nText: {text}\n\nAnswer:"
)
PROMPT_HASH = hashlib.sha256(QUESTION.encode()).hexdigest()[:16]


class Judge(Protocol):
    def judge(self, text: str, reference_text: str, loglik: float, reference_loglik: float) -> JudgeOutcome: ...


class LikelihoodJudge:
    def __init__(self, slack: float) -> None:
        self.slack = slack

    def judge(self, text: str, reference_text: str, loglik: float, reference_loglik: float) -> JudgeOutcome:
        fluent = loglik >= reference_loglik - self.slack
        audit = JudgeAudit(
            judge_kind=JudgeKind.likelihood.value,
            judge_prompt_hash=PROMPT_HASH,
            judge_answer=f"{'Yes' if fluent else 'No'} / Yes",
            judge_rationale=f"{loglik:.3f} vs the reference's {reference_loglik:.3f} nats per token "
            f"(slack {self.slack})",
        )
        return JudgeOutcome(audit, fluent=fluent, reference_fluent=True)  # the reference's text is the yardstick


class QuestionJudge:
    """A judge that asks a model QUESTION about each text; subclasses say how to ask."""

    kind: JudgeKind
    model_id: str

    def _ask(self, text: str) -> tuple[bool | None, str]:
        raise NotImplementedError

    def judge(self, text: str, reference_text: str, loglik: float, reference_loglik: float) -> JudgeOutcome:
        fluent, answer = self._ask(text)
        reference_fluent, reference_answer = self._ask(reference_text)
        audit = JudgeAudit(
            judge_kind=self.kind.value,
            judge_model=self.model_id,
            judge_prompt_hash=PROMPT_HASH,
            judge_answer=f"{answer} / {reference_answer}"[:4000],
            judge_rationale=f"accelerator: {answer}; reference: {reference_answer}"[:1000],
        )
        return JudgeOutcome(audit, fluent=fluent, reference_fluent=reference_fluent)


class LocalLMJudge(QuestionJudge):
    kind = JudgeKind.local

    def __init__(self, model_id: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_id = model_id
        self.tokenizer = AutoTokenizer.from_pretrained(model_id)
        self.model = AutoModelForCausalLM.from_pretrained(model_id).eval()

    def _ask(self, text: str) -> tuple[bool | None, str]:
        import torch

        ids = self.tokenizer(QUESTION.format(text=text), return_tensors="pt")
        with torch.inference_mode():
            logits = self.model(**ids).logits[0, -1].float()
        yes, no = (self.tokenizer.encode(word, add_special_tokens=False)[0] for word in (" Yes", " No"))
        p = torch.softmax(logits[[yes, no]], -1)
        return bool(p[0] > p[1]), f"{'Yes' if p[0] > p[1] else 'No'} (P(Yes)={p[0]:.2f})"


class OpenAIJudge(QuestionJudge):
    kind = JudgeKind.openai

    def __init__(self, url: str, model: str, token: str | None, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/") + "/chat/completions"
        self.model_id = model
        self.token = token
        self.timeout_s = timeout_s

    def _ask(self, text: str) -> tuple[bool | None, str]:
        import httpx

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        body: dict[str, Any] = {
            "model": self.model_id,
            "messages": [{"role": "user", "content": QUESTION.format(text=text)}],
            "temperature": 0,
            "max_tokens": 60,
        }
        response = httpx.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
        response.raise_for_status()
        answer = response.json()["choices"][0]["message"]["content"].strip()
        first = answer.split(maxsplit=1)[0].strip(".,:;!").lower() if answer else ""
        return {"yes": True, "no": False}.get(first), answer


def make_judge(settings: RunnerSettings) -> Judge:
    if settings.judge_kind == JudgeKind.local:
        return LocalLMJudge(settings.judge_model)
    if settings.judge_kind == JudgeKind.openai:
        if not settings.judge_url:
            raise ValueError("the openai judge needs SUPPORTMATRIX_JUDGE_URL")
        return OpenAIJudge(settings.judge_url, settings.judge_model, settings.judge_token)
    return LikelihoodJudge(settings.judge_loglik_slack)
