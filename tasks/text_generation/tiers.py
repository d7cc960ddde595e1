"""The tiers past the 32-token verdict, run by the text-generation task on the compiled model: a long greedy
generation (``LONG_NEW_TOKENS``), and timed generations for speed (``PERF_NEW_TOKENS``, ``perf_iterations``
times, for the decode rate and the time per output token) with ``TTFT_SAMPLES`` first tokens timed on their own
(for the time to first token). All reuse the 32-token run's graphs — every static cache is sized for the long
generation, and a first token is the prefill of the same prompt — so none compiles again."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from services.runner.failures import RunFailure
from shared.contracts.enums import ErrorClass
from shared.contracts.report import Performance
from tasks.text_generation import TTFT_SAMPLES


class StepClock:
    """A logits processor that notes when each step's logits are ready (after the backend has finished them):
    generate calls it once per new token. With ``stop_after`` it ends the generation there by raising
    ``EnoughSteps``: generate has no other way for a logits processor to end it, and the rest of its steps are
    what a first-token sample must not pay for (each generate builds its static cache afresh, so nothing of an
    ended one is left for the next)."""

    def __init__(self, synchronize: Callable[[], None], stop_after: int | None = None) -> None:
        self.synchronize = synchronize
        self.stop_after = stop_after
        self.at: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.synchronize()
        self.at.append(time.perf_counter())
        if self.stop_after is not None and len(self.at) >= self.stop_after:
            raise EnoughSteps
        return scores


class EnoughSteps(Exception):
    """A ``StepClock`` has the steps it was asked for: the generation it timed ends here."""


def first_token_seconds(generate: Callable[[list[Any]], Any], synchronize: Callable[[], None]) -> float:
    """One time to first token: from the call of ``generate`` to its first step's logits (the prefill, on the
    compiled graph), the generation then ended."""
    clock = StepClock(synchronize, stop_after=1)
    started = time.perf_counter()
    with contextlib.suppress(EnoughSteps):
        generate([clock])
    if not clock.at:  # a generate that returned without calling its logits processors: nothing was timed
        raise RunFailure(ErrorClass.runtime, "a first-token sample's generate ran no step: no first token to time")
    return clock.at[0] - started


def timed_generations(
    generate: Callable[[list[Any]], Any], synchronize: Callable[[], None], iterations: int, prompt_tokens: int,
    new_tokens: int, ttft_samples: int = TTFT_SAMPLES,
) -> Performance:  # fmt: skip
    """``iterations`` whole generations of ``new_tokens`` (``generate`` takes the extra logits processors),
    timed per step: the time per output token after the first and the decode rate; then ``ttft_samples``
    generations ended at their first token: the time to first token (the prefill and its pick), its p50 and p99
    over those samples."""
    tpot: list[float] = []
    rates: list[float] = []
    for _ in range(iterations):
        clock = StepClock(synchronize)
        generate([clock])
        steps = np.diff(clock.at)
        tpot.extend(steps.tolist())
        rates.append(len(steps) / float(steps.sum()))
    ttft = [first_token_seconds(generate, synchronize) for _ in range(ttft_samples)]
    return Performance(
        perf_prompt_tokens=prompt_tokens,
        perf_new_tokens=new_tokens,
        perf_iterations=iterations,
        decode_tokens_per_s=statistics.median(rates),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        tpot_p50_s=float(np.percentile(tpot, 50)),
        tpot_p99_s=float(np.percentile(tpot, 99)),
    )


def token_logprobs(model: Any, prompt_ids: Any, tokens: list[int]) -> list[float]:
    """The log-prob ``model`` gives each of ``tokens`` after the prompt and the tokens before it (teacher forcing,
    raw logits): one forward over the whole sequence."""
    import torch

    sequence = torch.cat([prompt_ids, torch.tensor([tokens], dtype=prompt_ids.dtype)], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=sequence).logits[0, prompt_ids.shape[1] - 1 : -1].float()
    chosen = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1))
    return chosen.squeeze(-1).tolist()
