"""Comparing two runs' token steps: a step's top logits, its error against another run's at them, and how far a
token sits below a step's best. What every task that generates tokens checks its decode steps by."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def top_logits(step: np.ndarray, count: int) -> tuple[list[int], list[float]]:
    """A step's ``count`` largest logits, largest first, and their token ids: what a decode check compares at, and
    what a stored reference keeps of each of its steps."""
    ids = np.argsort(-step, kind="stable")[:count]
    return ids.tolist(), step[ids].astype(np.float64).tolist()


def top_logit_error(ours: np.ndarray, ids: list[int], logits: list[float]) -> float | None:
    """A step's logits against another run's on the same prefix, at that run's top logits (``top_logits``):
    ``||ours - theirs|| / ||theirs||`` over those ids, as the prefill check measures the whole vector. None where
    either is not finite: nothing to compare (rule 1 fails the run on non-finite logits; JSON has no NaN)."""
    theirs = np.asarray(logits, dtype=np.float64)
    error = float(np.linalg.norm(ours[np.asarray(ids)].astype(np.float64) - theirs) / np.linalg.norm(theirs))
    return error if math.isfinite(error) else None


def step_errors(ours: np.ndarray, tops: list[tuple[list[int], list[float]]]) -> list[float | None]:
    """Each of the accelerator's steps (``ours``: steps x vocabulary) against the other run's top logits."""
    return [top_logit_error(step, *top) for step, top in zip(ours, tops, strict=False)]


def gap_and_rank(scores: Any, token: int) -> tuple[float, int]:
    """How far ``token`` sits below the best of a step's processed scores (log-probs, nats), and its 0-based rank."""
    import torch

    processed = torch.log_softmax(scores, -1)
    return processed.max().item() - processed[token].item(), int((processed > processed[token]).sum())
