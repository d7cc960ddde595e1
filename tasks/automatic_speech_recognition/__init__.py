"""automatic-speech-recognition: a Whisper-style encoder-decoder transcribes a fixed synthetic clip with greedy
``generate``, token by token against the CPU reference's transcript of the same clip.

The clip is made from the numbers below (a two-tone chirp with a pause), never downloaded: the same waveform on
every host, sampled at the repo's own feature extractor's rate. Verdict (``tasks.automatic_speech_recognition.
runner``): FAIL on non-finite logits; FAIL where a decode step's logits, at the reference's top ``TOP_LOGITS`` on the
accelerator's prefix, differ by more than ``decode``; FAIL where the transcripts part at a step the reference does
not see as a near tie (its best token more than ``near_tie_gap`` nats above the accelerator's); else PASS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shared.contracts.enums import Task
from tasks.declaration import DTYPES, TaskDeclaration

NEW_TOKENS = 32  # greedy tokens after the decoder's forced start (a transcript may end sooner, at its EOS)
CLIP_SECONDS = 1.5
# (start Hz, end Hz, seconds) of each tone of the clip, then silence to CLIP_SECONDS: a signal with structure over
# time that every mel front end sees, not noise
CLIP_TONES = ((220.0, 660.0, 0.6), (880.0, 440.0, 0.5))
CLIP_AMPLITUDE = 0.5
TOP_LOGITS = 64  # each decode step is compared at the reference's largest logits, as text-generation's are
# Bumped by hand when the rule's logic changes; its tolerances are hashed in as they are.
RULE_VERSION = 1


@dataclass(frozen=True)
class SpeechTolerances:
    """What the transcript's verdict tolerates, per run dtype. Text-generation's decode and near-tie values (its
    calibration, BENCHMARKS.md): a decoder step is the same computation; not yet measured on Whisper models."""

    decode: float  # ||acc - ref|| / ||ref|| of a decode step's logits at the reference's top TOP_LOGITS
    near_tie_gap: float  # nats between the reference's best token and the accelerator's, where the texts part

    @classmethod
    def for_dtype(cls, dtype: str) -> SpeechTolerances:
        if dtype == "float32":
            return cls(decode=1e-3, near_tie_gap=1e-3)
        return cls(decode=4e-2, near_tie_gap=0.3)


def config() -> dict[str, object]:
    tolerances = {dtype: asdict(SpeechTolerances.for_dtype(dtype)) for dtype in DTYPES}
    clip = {"seconds": CLIP_SECONDS, "tones": CLIP_TONES, "amplitude": CLIP_AMPLITUDE}
    return {"clip": clip, "new_tokens": NEW_TOKENS, "top_logits": TOP_LOGITS, "rule": RULE_VERSION,
            "tolerances": tolerances}  # fmt: skip


DECLARATION = TaskDeclaration(
    Task.automatic_speech_recognition,
    summary="a Whisper-style transcript of a synthetic clip, greedy, token by token against the CPU reference's",
    pipeline_tags=("automatic-speech-recognition",),
    config=config,
)
