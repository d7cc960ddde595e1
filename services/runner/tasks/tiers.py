"""The tiers past the 32-token verdict, run by the text-generation task on the compiled model: a long greedy
generation (``LONG_NEW_TOKENS``), and timed generations for speed (``PERF_NEW_TOKENS``, ``perf_iterations``
times). Both reuse the 32-token run's graphs — every static cache is sized for the long generation — so neither
compiles again."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shared.contracts.report import Performance


class StepClock:
    """A logits processor that notes when each step's logits are ready (after the backend has finished them):
    generate calls it once per new token."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self.synchronize = synchronize
        self.at: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.synchronize()
        self.at.append(time.perf_counter())
        return scores


def timed_generations(
    generate: Callable[[list[Any]], Any], synchronize: Callable[[], None], iterations: int, prompt_tokens: int,
    new_tokens: int,
) -> Performance:  # fmt: skip
    """``iterations`` generations of ``new_tokens`` (``generate`` takes the extra logits processors), timed per
    step: time to first token (the prefill and its pick), time per output token after it, and the decode rate."""
    ttft: list[float] = []
    tpot: list[float] = []
    rates: list[float] = []
    for _ in range(iterations):
        clock = StepClock(synchronize)
        started = time.perf_counter()
        generate([clock])
        ttft.append(clock.at[0] - started)
        steps = np.diff(clock.at)
        tpot.extend(steps.tolist())
        rates.append(len(steps) / float(steps.sum()))
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
