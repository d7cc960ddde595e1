"""automatic-speech-recognition's torch half: load a Whisper-style checkpoint with its feature extractor, compile
its forward with the backend, transcribe the test's clip with greedy ``generate`` (a static cache: the prefill and one
decode graph), and compare with the CPU reference's transcript of the same features.

The accelerator leaves each generated step's raw logits in the job's artifacts (``Artifacts.step_logits``). The
reference transcribes the clip itself; where the transcripts differ it also runs its decoder teacher-forced on the
accelerator's tokens, so that every step's logits are compared on the accelerator's own prefix.
"""

from __future__ import annotations

from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from services.runner import faults
from services.runner.backends.base import Backend
from services.runner.failures import phase
from services.runner.measure import accelerator_timings, compile_record
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import Conclusion
from services.runner.tasks.logits import gap_and_rank, step_errors, top_logits
from services.runner.tasks.whole import compiled_twice
from shared.contracts.enums import ErrorClass, Parallelism, Task, Verdict
from shared.contracts.evidence import StepEvidence
from shared.contracts.handoffs import AcceleratorData, Artifacts
from shared.contracts.report import Comparison, Output, Resources
from tasks.automatic_speech_recognition import (
    CLIP_AMPLITUDE,
    CLIP_SECONDS,
    CLIP_TONES,
    NEW_TOKENS,
    TOP_LOGITS,
    SpeechTolerances,
)


def clip(sampling_rate: int) -> np.ndarray:
    """The test's waveform at ``sampling_rate``: each tone a linear chirp, then silence to ``CLIP_SECONDS``."""
    parts = []
    for start_hz, end_hz, seconds in CLIP_TONES:
        t = np.arange(int(seconds * sampling_rate)) / sampling_rate
        phase_turns = start_hz * t + (end_hz - start_hz) * t**2 / (2 * seconds)
        parts.append(CLIP_AMPLITUDE * np.sin(2 * np.pi * phase_turns))
    waveform = np.concatenate(parts)
    silence = np.zeros(max(int(CLIP_SECONDS * sampling_rate) - len(waveform), 0))
    return np.concatenate([waveform, silence]).astype(np.float32)


class Transcriber:
    """A loaded speech encoder-decoder and the clip's input features; ``transcribe()`` runs the test's generate."""

    def __init__(self, model_dir: Path, backend: Backend, device: str, trust_remote_code: bool) -> None:
        import torch
        from transformers import AutoFeatureExtractor, AutoModelForSpeechSeq2Seq, AutoTokenizer

        dtype = getattr(torch, backend.dtype)
        code: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        features = AutoFeatureExtractor.from_pretrained(model_dir, **code)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, **code)
        self.network = AutoModelForSpeechSeq2Seq.from_pretrained(model_dir, dtype=dtype, **code).to(device).eval()
        rate = features.sampling_rate
        self.inputs = features(clip(rate), sampling_rate=rate, return_tensors="pt").input_features.to(device, dtype)

    def transcribe(self) -> tuple[list[int], np.ndarray]:
        """The decoder's whole sequence (its forced start, then the generated tokens) and each generated step's raw
        logits (steps x vocabulary)."""
        import torch

        with torch.inference_mode():
            out = self.network.generate(
                self.inputs,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                num_beams=1,
                cache_implementation="static",  # static shapes: one prefill and one decode graph
                return_dict_in_generate=True,
                output_logits=True,
            )
        logits = torch.stack([step[0] for step in out.logits]).float().cpu().numpy()
        return out.sequences[0].tolist(), logits

    def forced(self, sequence: list[int], steps: int) -> np.ndarray:
        """The raw logits of the last ``steps`` tokens of ``sequence`` with the decoder fed ``sequence`` itself."""
        import torch

        with torch.inference_mode():
            out = self.network(input_features=self.inputs, decoder_input_ids=torch.tensor([sequence[:-1]]))
        return out.logits[0, -steps:].float().numpy()

    def plant(self, fault: str) -> None:
        faults.inject_module(self.network, fault)

    def text(self, sequence: list[int]) -> str:
        return str(self.tokenizer.decode(sequence, skip_special_tokens=True))


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two sequences differ (a shorter one differs where it ends), or None."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return position
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


class SpeechRecognition:
    name = Task.automatic_speech_recognition

    def accelerator(self, spec: AcceleratorSpec, backend: Backend) -> AcceleratorData:
        transcriber, (sequence, logits), clock = compiled_twice(
            spec, backend, "a speech model",
            lambda: Transcriber(spec.model_dir, backend, backend.device, spec.trust_remote_code),
            Transcriber.transcribe,
        )  # fmt: skip
        if spec.rank == 0:
            np.save(Artifacts(spec.artifacts).step_logits, logits)
        return AcceleratorData(
            token_ids=sequence,
            text=transcriber.text(sequence),
            finite=bool(np.isfinite(logits).all()),
            output=Output(pipeline_library="transformers", pipeline_library_version=version("transformers")),
            placement=backend.placement().model_copy(update={"parallelism": Parallelism.none}),
            timings=accelerator_timings(clock),
            resources=Resources(
                peak_memory_bytes=backend.peak_memory_bytes(), **compile_record(transcriber.network, backend)
            ),
        )

    def reference(self, spec: ReferenceSpec, backend: Backend) -> ReferenceResult:
        artifacts = Artifacts(spec.artifacts)
        with phase(ErrorClass.load):
            transcriber = Transcriber(spec.model_dir, backend, "cpu", spec.trust_remote_code)
        with phase(ErrorClass.runtime):
            sequence, logits = transcriber.transcribe()
            ours = spec.accelerator.token_ids or []
            accelerator_steps = np.load(artifacts.step_logits)
            steps = len(accelerator_steps)
            # the reference's logits on the accelerator's prefix: its own run's where the sequences agree
            forced = None if ours == sequence else transcriber.forced(ours, steps)
        tops = [top_logits(step, TOP_LOGITS) for step in logits]
        stored = {
            "sequence": sequence,
            "text": transcriber.text(sequence),
            "step_top_ids": [ids for ids, _ in tops],
            "step_top_logits": [values for _, values in tops],
        }
        on_prefix = tops if forced is None else [top_logits(step, TOP_LOGITS) for step in forced]
        errors = step_errors(accelerator_steps, on_prefix)
        divergent = []
        position = first_divergence(ours, sequence)
        start = len(sequence) - len(logits)  # the forced start's length: position start + i is generated step i
        if position is not None and start <= position < len(ours) and position < len(sequence):
            import torch

            step = position - start
            gap, rank = gap_and_rank(torch.from_numpy(logits[step]), ours[position])
            divergent.append(StepEvidence(step, ours[position], sequence[position], gap, rank))
        return ReferenceResult(data=stored, divergent_steps=divergent, step_rel_errors=errors)

    def reuse(
        self, acc: AcceleratorData, stored: dict[str, Any], artifacts: Artifacts, dtype: str
    ) -> ReferenceResult | None:
        """A stored transcript serves only one the accelerator matched token for token: its steps' top logits are then
        the reference's on the accelerator's prefix; where they part, the reference runs again, teacher-forced."""
        if acc.token_ids != stored["sequence"]:
            return None
        tops = list(zip(stored["step_top_ids"], stored["step_top_logits"], strict=True))
        errors = step_errors(np.load(artifacts.step_logits), tops)
        return ReferenceResult(data=stored, step_rel_errors=errors, reused=True)

    def conclude(self, acc: AcceleratorData, found: ReferenceResult, artifacts: Artifacts, dtype: str) -> Conclusion:
        tolerances = SpeechTolerances.for_dtype(dtype)
        ours, theirs = acc.token_ids or [], list(found.data["sequence"])
        steps = len(found.data["step_top_ids"])
        start = len(theirs) - steps
        errors = found.step_rel_errors or []
        position = first_divergence(ours, theirs)
        comparison = Comparison(
            tokens_match=position is None,
            first_divergence=None if position is None else max(position - start, 0),
            generated_text=acc.text,
            reference_text=found.data["text"],
            generated_token_ids=ours[start:],
            reference_token_ids=theirs[start:],
            reference_reused=found.reused,
            evidence={
                "step_rel_errors": errors,
                "divergent_steps": [asdict(step) for step in found.divergent_steps],
                "tolerances": {"decode": tolerances.decode, "near_tie_gap": tolerances.near_tie_gap},
            },
        )
        if not acc.finite or any(error is None for error in errors):
            return Conclusion(Verdict.FAIL, "the accelerator's decoder produced non-finite logits", comparison)
        worst = max(range(len(errors)), key=lambda i: errors[i] or 0.0, default=None)
        if worst is not None and (errors[worst] or 0.0) > tolerances.decode:
            reason = (
                f"decode step {worst}'s logits differ from the reference's on the same prefix by "
                f"{errors[worst]:.4g} > {tolerances.decode:g} (at its top {TOP_LOGITS})"
            )
            return Conclusion(Verdict.FAIL, reason, comparison)
        if position is None:
            reason = f"the transcript matches the reference's, {steps} tokens; every step's logits within tolerance"
            return Conclusion(Verdict.PASS, reason, comparison)
        step = found.divergent_steps[0] if found.divergent_steps else None
        if step is not None and step.gap <= tolerances.near_tie_gap:
            reason = (
                f"the transcript parts from the reference's at step {step.step}, a near tie ({step.gap:.3g} nats "
                f"<= {tolerances.near_tie_gap:g}); every step's logits within tolerance"
            )
            return Conclusion(Verdict.PASS, reason, comparison)
        gap = "its length" if step is None else f"{step.gap:.3g} nats > {tolerances.near_tie_gap:g}"
        reason = f"the transcript parts from the reference's at step {comparison.first_divergence}: {gap}"
        return Conclusion(Verdict.FAIL, reason, comparison)


RUNNER = SpeechRecognition()
