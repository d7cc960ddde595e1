"""text-generation: greedy, exactly 32 new tokens from a fixed prompt, static shapes (static KV cache).

The accelerator run goes first (possibly as N ranks): its tokens, prefill logits and per-step scores land
in the job's artifacts. Then the CPU reference (eager, one process) generates its own 32 tokens and scores
the accelerator's tokens teacher-forced on the accelerator's prefix: the evidence ``verdict.decide`` rules on.

Greedy picks from *processed* scores: the logits processors that the model's generation config and our
arguments imply (``min_new_tokens`` masks EOS, a repetition penalty rescales seen tokens) run between the
logits and the choice. So the reference scores the accelerator's tokens through ``generate`` itself, forced
token by token (``_ForceTokens``, after every processor; its own run already is that when the tokens match):
each step's processed scores decide whether a divergent token was a near tie, and its raw logits give the
text's likelihood, as the prefill check uses raw logits too.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from services.runner.backends.base import Backend
from services.runner.failures import phase
from services.runner.measure import Stopwatch, accelerator_timings, compile_record, peak_rss_bytes
from services.runner.routing import RoutingForcer, RoutingRecorder, experts_per_token
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import NOT_RUN, Conclusion
from services.runner.tasks.logits import gap_and_rank, step_errors, top_logits
from shared.contracts.enums import ErrorClass, Parallelism, Task
from shared.contracts.evidence import Evidence, StepEvidence
from shared.contracts.handoffs import AcceleratorData, Artifacts, Routing
from shared.contracts.report import Comparison, Performance, Resources
from tasks.text_generation import (
    DECODE_TOP,
    LONG_NEW_TOKENS,
    NEW_TOKENS,
    PERF_NEW_TOKENS,
    PROMPT,
    LongTolerances,
    Tolerances,
)
from tasks.text_generation.tiers import timed_generations, token_logprobs
from tasks.text_generation.verdict import (
    decide,
    implausible_text,
    is_near_tie,
    long_outcome,
    routing_flips,
    routing_roots,
)


def long_new_tokens(config: Any, prompt_length: int) -> int:
    """The long generation's length: ``LONG_NEW_TOKENS``, or what the model's context leaves after the prompt."""
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return min(LONG_NEW_TOKENS, context - prompt_length) if context else LONG_NEW_TOKENS


def _generation_kwargs(
    tokenizer: Any, prompt_length: int, long_tokens: int, new_tokens: int = NEW_TOKENS
) -> dict[str, Any]:
    """The test's arguments to ``generate``, for both runs. On an accelerator device with a static cache,
    transformers' generate compiles its decode step itself, around the forward we compiled (its
    ``CompileConfig``: inductor, reduce-overhead). A user's TorchNeuron run compiles the model with the neuron
    backend, once: that is what a row measures, so generate's own compile is switched off by saying so
    (``disable_compile``), never left to how dynamo happens to nest two compiles. Each row says which compile
    ran (``compile_path``) and how many graphs it received.

    Every static cache holds the long generation (``max_cache_len``): the 32-token run, the long one and the timed
    ones then share one shape, and one compile serves them all."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {
        "disable_compile": True,
        "do_sample": False,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "cache_implementation": "static",
        "max_cache_len": prompt_length + long_tokens,
        "pad_token_id": pad_id,
        "output_logits": True,
        "output_scores": True,
        "return_dict_in_generate": True,
    }


def _smallest(margins: list[float | None]) -> float | None:
    return min((m for m in margins if m is not None), default=None)


def routing_evidence(found: ReferenceResult) -> dict[str, Any]:
    """What a row keeps of the routing comparison: the count of flips and the roots (each flip would be hundreds; a
    root's margin null where it is no near tie at all), and the counterfactual's prefill error and the accelerator
    text's likelihood under it, where it ran."""
    flips = found.routing_flips
    if flips is None:
        return {}
    forced = {} if found.forced_prefill_rel_error is None else {
        "forced_prefill_rel_error": found.forced_prefill_rel_error,
        "forced_step_rel_errors": found.forced_step_rel_errors,
        "forced_accelerator_loglik": found.forced_accelerator_loglik,
        "forced_reference_loglik": found.forced_reference_loglik,
    }  # fmt: skip
    return {"routing_flips": len(flips), "routing_roots": [asdict(f) for f in routing_roots(flips)], **forced}


def _digest(routing: Routing | None) -> bytes:
    return hashlib.sha256(b"none" if routing is None else json.dumps(routing.experts).encode()).digest()


@dataclass(frozen=True)
class _Counterfactual:
    """The reference re-run on the accelerator's prefix with the accelerator's experts forced: its prefill logits, and
    each step's processed scores (what greedy would pick from)."""

    prefill_logits: np.ndarray
    scores: list[Any]
    step_tops: list[tuple[list[int], list[float]]]  # each step's top raw logits (``top_logits``)
    accelerator_loglik: float  # the accelerator's tokens' mean log-prob per token (raw logits)
    best_loglik: float  # and its own best pick's at each step on that prefix: what the text is weighed against

    def scored(self, step: StepEvidence) -> StepEvidence:
        """A divergent step with the accelerator's token's gap and rank under the counterfactual."""
        gap, rank = gap_and_rank(self.scores[step.step], step.accelerator_token)
        return replace(step, forced_gap=gap, forced_rank=rank)


def _relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def _forced_routing(
    model: Any, inputs: Any, kwargs: dict[str, Any], tokens: list[int], routing: Routing
) -> _Counterfactual | None:
    """The counterfactual of a MoE whose routing flipped: the reference teacher-forced on the accelerator's tokens
    again, its routers made to choose the accelerator's experts (``RoutingForcer``). None where the routers could not
    be forced, or the forwards did not route exactly the recorded positions: then no flip is excused."""
    import torch
    from transformers import LogitsProcessorList

    forcer = RoutingForcer(model, routing)
    forced = _ForceTokens(tokens, inputs["input_ids"].shape[1])
    try:
        out = model.generate(**inputs, **kwargs, logits_processor=LogitsProcessorList([forced]))
    finally:
        forcer.remove()
    if not forcer.covered:
        return None
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    loglik = sum(step[t].item() for step, t in zip(logprobs, tokens, strict=True)) / NEW_TOKENS
    best = sum(step.max().item() for step in logprobs) / NEW_TOKENS
    tops = [top_logits(step[0].float().numpy(), DECODE_TOP) for step in out.logits]
    return _Counterfactual(out.logits[0][0].float().numpy(), forced.processed, tops, loglik, best)


class _ForceTokens:
    """A logits processor, after all of generate's own, that keeps the scores it is given (what greedy would
    pick from) and then forces the accelerator's token: teacher forcing through ``generate`` itself."""

    def __init__(self, tokens: list[int], prompt_length: int) -> None:
        self.tokens, self.prompt_length = tokens, prompt_length
        self.processed: list[Any] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        self.processed.append(scores[0].float().clone())
        forced = torch.full_like(scores, -torch.inf)
        forced[0, self.tokens[input_ids.shape[1] - self.prompt_length]] = 0.0
        return forced


class TextGeneration:
    name = Task.text_generation

    def accelerator(self, spec: AcceleratorSpec, backend: Backend) -> AcceleratorData:
        """One rank of the accelerator run: load (sharded when world_size > 1), compile, generate twice."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

        from services.runner import faults, parallel

        model_dir, world_size, rank = spec.model_dir, spec.world_size, spec.rank
        dtype = getattr(torch, backend.dtype)
        code = {"trust_remote_code": spec.trust_remote_code}
        clock = Stopwatch(announce=spec.phase_file)
        torch.manual_seed(0)
        with phase(ErrorClass.load), clock.time("load"):
            config = AutoConfig.from_pretrained(model_dir, **code)
            kind = parallel.choose_parallelism(config, world_size, backend.settings.moe_parallelism)
            tokenizer = AutoTokenizer.from_pretrained(model_dir, **code)
            if kind == Parallelism.none:
                # PreTrainedModel.to is typed as functools.wraps leaves Module.to: unbound, its first argument a model
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **code).to(
                    backend.device  # type: ignore[arg-type]
                )
            else:
                model = parallel.load_sharded(AutoModelForCausalLM, config, str(model_dir), dtype, world_size, kind,
                                              spec.trust_remote_code)  # fmt: skip
            model.eval()
            inputs = tokenizer(PROMPT, return_tensors="pt").to(model.device)
            prompt_length = inputs["input_ids"].shape[1]
            if backend.fault:
                faults.inject(model, backend.fault, rank, world_size, prompt_length)
        long_tokens = long_new_tokens(model.config, prompt_length)
        kwargs = _generation_kwargs(tokenizer, prompt_length, long_tokens) | backend.generation_config()
        planted = faults.logits_processors(backend.fault, prompt_length)

        def generate(new_tokens: int = NEW_TOKENS, processors: list[Any] | None = None, **options: Any) -> Any:
            run = kwargs | _generation_kwargs(tokenizer, prompt_length, long_tokens, new_tokens) | options
            run["logits_processor"] = LogitsProcessorList([*planted, *(processors or [])])
            with torch.inference_mode():
                out = model.generate(**inputs, **run)
            backend.synchronize()
            return out

        recorder = RoutingRecorder(model)  # its hooks go in before the compile, so that the graphs hold them
        model.forward = recorder.wrap(backend.compile(model.forward))
        # The first call compiles and generates; the second only generates. Their difference is the compile
        # time; the first call's output is what an unmodified user run produces (and its routing, a MoE's).
        recorder.recording = True
        with phase(ErrorClass.compile), clock.time("first"):
            out = generate()
        recorder.recording = False
        with phase(ErrorClass.runtime), clock.time("generate"):
            generate()
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logits = [step[0].float().cpu() for step in out.logits]
        if rank == 0:
            artifacts = Artifacts(spec.artifacts)
            np.save(artifacts.prefill, logits[0].numpy())
            np.save(artifacts.step_logits, torch.stack(logits).numpy())  # every step's raw logits (the decode check)
            # What greedy picked from at each step (after the logits processors), for the verdict stage.
            np.save(artifacts.step_scores, torch.stack([s[0].float().cpu() for s in out.scores]).numpy())
        long_ids, long_finite = None, None
        if backend.settings.long_generation:
            with phase(ErrorClass.runtime), clock.time("long"):
                long = generate(long_tokens, output_scores=False)
            long_ids = long.sequences[0, prompt_length:].tolist()
            long_finite = all(bool(torch.isfinite(step).all()) for step in long.logits)
        routing = recorder.routing(prompt_length)
        if world_size > 1 and not parallel.same_on_every_rank(_digest(routing), model.device):
            # a rank-local fault (a skipped all-reduce, a wrong shard) can route one rank otherwise: then no rank's
            # routing is the model's, and a run with no routing record has nothing excused as a flipped expert
            routing = None
        performance = Performance()
        if backend.settings.perf_iterations:
            with phase(ErrorClass.runtime), clock.time("perf"):
                performance = timed_generations(
                    lambda clocks: generate(PERF_NEW_TOKENS, clocks, output_logits=False, output_scores=False),
                    backend.synchronize, backend.settings.perf_iterations, prompt_length, PERF_NEW_TOKENS,
                )  # fmt: skip
        return AcceleratorData(
            token_ids=tokens,
            text=tokenizer.decode(tokens, skip_special_tokens=True),
            finite=all(bool(torch.isfinite(step).all()) for step in logits),
            placement=backend.placement().model_copy(update={"parallelism": kind}),
            timings=accelerator_timings(clock),
            resources=Resources(peak_memory_bytes=backend.peak_memory_bytes(), **compile_record(model, backend)),
            long_token_ids=long_ids,
            long_finite=long_finite,
            routing=routing,
            performance=performance,
        )

    def reference(self, spec: ReferenceSpec, backend: Backend) -> ReferenceResult:
        """The CPU reference: its own greedy tokens, and the accelerator's tokens scored teacher-forced."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

        acc_tokens = spec.accelerator.token_ids or []
        dtype = getattr(torch, backend.dtype)
        code = {"trust_remote_code": spec.trust_remote_code}
        clock = Stopwatch(announce=spec.phase_file)
        with phase(ErrorClass.load), clock.time("load"):
            tokenizer = AutoTokenizer.from_pretrained(spec.model_dir, **code)
            model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=dtype, **code).eval()
            inputs = tokenizer(PROMPT, return_tensors="pt")
        prompt_length = inputs["input_ids"].shape[1]
        acc_long = spec.accelerator.long_token_ids
        long_tokens = long_new_tokens(model.config, prompt_length)
        kwargs = _generation_kwargs(tokenizer, prompt_length, long_tokens)
        # One greedy run of the reference serves both checks: its first 32 tokens are the 32-token run's (greedy,
        # with EOS masked over those 32 steps either way)
        own = kwargs | _generation_kwargs(
            tokenizer, prompt_length, long_tokens, len(acc_long) if acc_long else NEW_TOKENS
        )
        # MoE: the routing of each generate below at the positions whose forward chose one of the 32 tokens, as the
        # accelerator recorded its own (the same cache, the same shapes: only the run's rounding differs)
        recorder = RoutingRecorder(model, top=True)
        model.forward = recorder.wrap(model.forward)
        positions = prompt_length + NEW_TOKENS - 1
        with phase(ErrorClass.runtime), clock.time("generate"), torch.inference_mode():
            recorder.recording = True
            out = model.generate(**inputs, **own)
            own_routing = recorder.routing(prompt_length, positions)  # stored, for a run that reuses it
            own_tokens = out.sequences[0, prompt_length:].tolist()
            own_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in
                            zip(out.logits, own_tokens, strict=True)]  # fmt: skip
            ref_tokens = own_tokens[:NEW_TOKENS]
            reference_loglik = sum(own_logprobs[:NEW_TOKENS]) / NEW_TOKENS
            if acc_tokens == ref_tokens:  # the reference's own run already went through the accelerator's prefix
                raw_steps, processed_steps = out.logits, [step[0].float() for step in out.scores]
                routing = own_routing
            else:
                recorder.calls.clear()
                forced = _ForceTokens(acc_tokens, prompt_length)
                scored = model.generate(**inputs, **kwargs, logits_processor=LogitsProcessorList([forced]))
                raw_steps, processed_steps = scored.logits, forced.processed
                routing = recorder.routing(prompt_length, positions)
            recorder.recording = False
        steps, acc_loglik, reordered = [], 0.0, []
        # where the accelerator's own routing parted from the reference's on the same prefix
        flips = None
        if routing is not None and spec.accelerator.routing is not None:
            flips = routing_flips(spec.accelerator.routing, routing)
        artifacts = Artifacts(spec.artifacts)
        # the smallest k-th-minus-(k+1)-th router gap over the layers at each position, which the row and each step
        # describe (the prompt's, each step's own); the rule reads the flips' own margins instead
        k = experts_per_token(model) or 0
        raw_margins = None if routing is None else routing.smallest_margins(k)
        smallest = None if raw_margins is None else [m if math.isfinite(m) else None for m in raw_margins]
        margins = None if smallest is None else smallest[prompt_length - 1 :]
        for i, token in enumerate(acc_tokens):
            raw = torch.log_softmax(raw_steps[i][0].float(), -1)
            acc_loglik += raw[token].item() / NEW_TOKENS
            processed = torch.log_softmax(processed_steps[i], -1)
            best = int(processed.argmax())
            if int(raw.argmax()) != best:
                reordered.append(i)
            if best != token:
                gap, rank = gap_and_rank(processed_steps[i], token)
                steps.append(StepEvidence(i, token, best, gap, rank, margins[i] if margins else None))
        ref_prefill = out.logits[0][0].float().numpy()
        np.save(artifacts.reference_prefill, ref_prefill)
        # each step of the accelerator's against this run's on the same prefix, at its top logits; and those of its
        # own run, which a later run with the same tokens is held to (the same prefix: ``reuse``)
        accelerator_steps = np.load(artifacts.step_logits)
        scored_tops = [top_logits(step[0].float().numpy(), DECODE_TOP) for step in raw_steps[:NEW_TOKENS]]
        errors = step_errors(accelerator_steps, scored_tops)
        own_tops = [top_logits(step[0].float().numpy(), DECODE_TOP) for step in out.logits[:NEW_TOKENS]]
        # The counterfactual, where the routing flipped and something would need its excuse: the prefill past its
        # tolerance, a divergent step that is no near tie, or implausible text. Its own 32-token generate, announced
        # as its own phase.
        tol, acc_prefill = Tolerances.for_dtype(backend.dtype), np.load(artifacts.prefill)
        counterfactual = None
        needed = (
            _relative_error(acc_prefill, ref_prefill) > tol.prefill
            or any(not is_near_tie(step, tol) for step in steps)
            or implausible_text(acc_loglik, reference_loglik, steps, tol)
            or any(error is not None and error > tol.decode for error in errors[1:])
        )
        if flips and needed and spec.accelerator.routing is not None:
            with phase(ErrorClass.runtime), clock.time("counterfactual"), torch.inference_mode():
                counterfactual = _forced_routing(model, inputs, kwargs, acc_tokens, spec.accelerator.routing)
        if counterfactual is not None:
            steps = [counterfactual.scored(step) for step in steps]
        data = {
            "token_ids": ref_tokens,
            "text": tokenizer.decode(ref_tokens, skip_special_tokens=True),
            "reference_loglik": reference_loglik,
            "generate_s": clock.seconds["generate"],
            "peak_rss_bytes": peak_rss_bytes(),
            "routing_margin": _smallest(smallest[:prompt_length]) if smallest else None,  # the prompt's: the same
            "step_top_ids": [ids for ids, _ in own_tops],
            "step_top_logits": [logits for _, logits in own_tops],
        }
        if own_routing is not None:
            data["routing"] = own_routing.model_dump()
        long_logprobs = None
        if acc_long:  # the reference's long text, and the accelerator's scored under it on its own prefix
            data |= {"long_token_ids": own_tokens, "long_logprobs": own_logprobs}
            same = acc_long == own_tokens
            long_logprobs = own_logprobs if same else token_logprobs(model, inputs["input_ids"], acc_long)
        return ReferenceResult(
            data=data,
            divergent_steps=steps,
            accelerator_loglik=acc_loglik,
            processor_reordered_steps=reordered,
            step_rel_errors=errors,
            long_logprobs=long_logprobs,
            routing_flips=flips,
            forced_prefill_rel_error=None
            if counterfactual is None
            else _relative_error(acc_prefill, counterfactual.prefill_logits),
            forced_step_rel_errors=None
            if counterfactual is None
            else step_errors(accelerator_steps, counterfactual.step_tops),
            forced_accelerator_loglik=None if counterfactual is None else counterfactual.accelerator_loglik,
            forced_reference_loglik=None if counterfactual is None else counterfactual.best_loglik,
        )

    def reuse(
        self, acc: AcceleratorData, stored: dict[str, Any], artifacts: Artifacts, dtype: str
    ) -> ReferenceResult | None:
        """The reference's findings from a stored run, without running the model; None when that is not enough.

        When the accelerator produced exactly the reference's tokens, scoring them teacher-forced under the
        reference gives the reference's own log-probs: the stored ones. So for the long generation: the same long
        tokens get the stored long log-probs, and the check decides as a fresh reference would; and each decode step is
        held to the stored run's top logits (the same prefix), as a fresh reference holds it to its own. A divergence
        (of either), a stored run without what this one needs (its long generation, its steps' top logits, a MoE's
        routing: a reference stored with the tiers off, or by an older runner), or a MoE whose routing flipped in the
        prompt or whose step is past the decode tolerance (only the counterfactual can excuse what that moved), needs
        the model.
        """
        if acc.token_ids != stored["token_ids"] or "step_top_ids" not in stored:
            return None
        tops = list(zip(stored["step_top_ids"], stored["step_top_logits"], strict=True))
        errors = step_errors(np.load(artifacts.step_logits), tops)
        long_logprobs = None
        if acc.long_token_ids is not None:
            if acc.long_token_ids != stored.get("long_token_ids"):
                return None
            long_logprobs = stored["long_logprobs"]
        flips = None
        if acc.routing is not None:
            stored_routing = Routing.model_validate(stored["routing"]) if stored.get("routing") else None
            if stored_routing is None or stored_routing.top_logits is None:  # an older runner's: no router logits
                return None
            flips = routing_flips(acc.routing, stored_routing)
            if flips and any(flip.step <= 0 for flip in flips):  # the prefill may need the counterfactual's excuse
                return None
            decode = Tolerances.for_dtype(dtype).decode
            if flips and any(error is not None and error > decode for error in errors[1:]):  # and so may a step
                return None
        return ReferenceResult(
            data=stored,
            accelerator_loglik=stored["reference_loglik"],
            reused=True,
            step_rel_errors=errors,
            long_logprobs=long_logprobs,
            routing_flips=flips,
        )

    def conclude(self, acc: AcceleratorData, found: ReferenceResult, artifacts: Artifacts, dtype: str) -> Conclusion:
        """Evidence → verdict (without the judge, which a sharded run asks next), and the comparison."""
        ref = found.data
        acc_prefill, ref_prefill = np.load(artifacts.prefill), np.load(artifacts.reference_prefill)
        prefill_error = _relative_error(acc_prefill, ref_prefill)
        acc_tokens, ref_tokens = acc.token_ids or [], ref["token_ids"]
        assert found.accelerator_loglik is not None
        comparison = Comparison(
            tokens_match=acc_tokens == ref_tokens,
            generated_token_ids=acc_tokens,
            reference_token_ids=ref_tokens,
            generated_text=acc.text,
            reference_text=ref["text"],
            prefill_rel_error=prefill_error,
            accelerator_loglik=found.accelerator_loglik,
            reference_loglik=ref["reference_loglik"],
            routing_margin=ref.get("routing_margin"),
            reference_reused=found.reused,
            evidence={
                "divergent_steps": [vars(s) for s in found.divergent_steps],
                # steps where the logits processors changed greedy's pick: raw argmax is not what it chose
                "processor_reordered_steps": found.processor_reordered_steps,
                "prompt_sha256": hashlib.sha256(PROMPT.encode()).hexdigest(),
                "reference_generate_s": ref["generate_s"],
                "reference_peak_rss_bytes": ref["peak_rss_bytes"],
                # each step's raw logits against the reference's on the same prefix, at its top logits (a stored
                # reference's own: the same prefix)
                "step_rel_errors": found.step_rel_errors,
                # MoE: how many (position, layer) choices the routing flipped, and where it first parted from the
                # reference's (the flips no earlier one explains; what an excused divergence rests on); the
                # accelerator's prefill against the reference made to choose the accelerator's experts
                **routing_evidence(found),
            },
        )
        sharded = acc.placement.parallelism != Parallelism.none
        evidence = Evidence(
            comparison,
            found.divergent_steps,
            finite=acc.finite,
            sharded=sharded,
            routing_flips=found.routing_flips,
            step_rel_errors=found.step_rel_errors,
            forced_prefill_rel_error=found.forced_prefill_rel_error,
            forced_step_rel_errors=found.forced_step_rel_errors,
            forced_accelerator_loglik=found.forced_accelerator_loglik,
            forced_reference_loglik=found.forced_reference_loglik,
        )
        long = NOT_RUN
        if acc.long_token_ids is not None and found.long_logprobs is not None:
            long = long_outcome(acc.long_token_ids, ref["long_token_ids"], found.long_logprobs, ref["long_logprobs"],
                                bool(acc.long_finite), LongTolerances())  # fmt: skip
        decision = decide(evidence, Tolerances.for_dtype(dtype))
        return Conclusion.of(decision, comparison, evidence, long, acc.performance)


RUNNER = TextGeneration()
