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
from typing import Any

import numpy as np

from services.runner.backends.base import Backend
from services.runner.failures import phase
from services.runner.measure import Stopwatch, accelerator_timings, compile_record, peak_rss_bytes
from services.runner.specs import AcceleratorSpec, ReferenceResult, ReferenceSpec
from services.runner.tasks.conclusion import NOT_RUN, Conclusion
from services.runner.tasks.tiers import timed_generations, token_logprobs
from shared.contracts.enums import ErrorClass, Parallelism, Task
from shared.contracts.evidence import Evidence, StepEvidence
from shared.contracts.handoffs import AcceleratorData, Artifacts
from shared.contracts.report import Comparison, Performance, Resources
from shared.results.verdict import decide, long_outcome
from shared.testconfig import LONG_NEW_TOKENS, NEW_TOKENS, PERF_NEW_TOKENS, PROMPT, LongTolerances, Tolerances


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


def router_margins(model: Any, input_ids: Any) -> list[float] | None:
    """A MoE model's router margin at each position of ``input_ids`` (a batch of one), the smallest over its layers:
    its k-th best expert's logit minus the next one's, k its experts per token. bf16 noise flips a choice that
    close. None for a dense model (or one whose forward returns no router logits)."""
    import torch

    k = getattr(model.config, "num_experts_per_tok", None)
    if not k:
        return None
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), output_router_logits=True)
    router = getattr(out, "router_logits", None)
    if not router:
        return None
    ranked = [layer.float().reshape(-1, layer.shape[-1]).sort(dim=-1, descending=True).values for layer in router]
    return torch.stack([r[:, k - 1] - r[:, k] for r in ranked if r.shape[-1] > k]).min(dim=0).values.tolist()


def routing_margin(model: Any, inputs: Any) -> float | None:
    """The smallest router margin over the prompt: a near tie there that bf16 flips moves the prefill."""
    margins = router_margins(model, inputs["input_ids"])
    return min(margins) if margins else None


def step_routing_margins(model: Any, inputs: Any, tokens: list[int]) -> list[float] | None:
    """The router margin at each position that chose one of ``tokens`` (the prompt's last, then each token's but
    the last), from one forward over the prompt and ``tokens``: where bf16 can flip the routing at that very step."""
    import torch

    ids = torch.cat([inputs["input_ids"], torch.tensor([tokens], dtype=inputs["input_ids"].dtype)], dim=1)
    margins = router_margins(model, ids)
    start = inputs["input_ids"].shape[1] - 1
    return None if margins is None else margins[start : start + len(tokens)]


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
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **code).to(backend.device)
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

        model.forward = backend.compile(model.forward)
        # The first call compiles and generates; the second only generates. Their difference is the compile
        # time; the first call's output is what an unmodified user run produces.
        with phase(ErrorClass.compile), clock.time("first"):
            out = generate()
        with phase(ErrorClass.runtime), clock.time("generate"):
            generate()
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logits = [step[0].float().cpu() for step in out.logits]
        if rank == 0:
            artifacts = Artifacts(spec.artifacts)
            np.save(artifacts.prefill, logits[0].numpy())
            np.save(artifacts.step_logits, torch.stack(logits).numpy())  # every step's raw logits (calibration)
            # What greedy picked from at each step (after the logits processors), for the verdict stage.
            np.save(artifacts.step_scores, torch.stack([s[0].float().cpu() for s in out.scores]).numpy())
        long_ids, long_finite = None, None
        if backend.settings.long_generation:
            with phase(ErrorClass.runtime), clock.time("long"):
                long = generate(long_tokens, output_scores=False)
            long_ids = long.sequences[0, prompt_length:].tolist()
            long_finite = all(bool(torch.isfinite(step).all()) for step in long.logits)
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
        with phase(ErrorClass.runtime), clock.time("generate"), torch.inference_mode():
            out = model.generate(**inputs, **own)
            own_tokens = out.sequences[0, prompt_length:].tolist()
            own_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in
                            zip(out.logits, own_tokens, strict=True)]  # fmt: skip
            ref_tokens = own_tokens[:NEW_TOKENS]
            reference_loglik = sum(own_logprobs[:NEW_TOKENS]) / NEW_TOKENS
            if acc_tokens == ref_tokens:  # the reference's own run already went through the accelerator's prefix
                raw_steps, processed_steps = out.logits, [step[0].float() for step in out.scores]
            else:
                forced = _ForceTokens(acc_tokens, prompt_length)
                scored = model.generate(**inputs, **kwargs, logits_processor=LogitsProcessorList([forced]))
                raw_steps, processed_steps = scored.logits, forced.processed
        steps, acc_loglik, reordered = [], 0.0, []
        # MoE: the routing at each step a divergence may come from (one more forward, only when the tokens differ)
        margins = step_routing_margins(model, inputs, acc_tokens) if acc_tokens != ref_tokens else None
        for i, token in enumerate(acc_tokens):
            raw = torch.log_softmax(raw_steps[i][0].float(), -1)
            acc_loglik += raw[token].item() / NEW_TOKENS
            processed = torch.log_softmax(processed_steps[i], -1)
            best = int(processed.argmax())
            if int(raw.argmax()) != best:
                reordered.append(i)
            if best != token:
                gap = processed[best].item() - processed[token].item()
                rank = int((processed > processed[token]).sum())
                steps.append(StepEvidence(i, token, best, gap, rank, margins[i] if margins else None))
        artifacts = Artifacts(spec.artifacts)
        np.save(artifacts.reference_prefill, out.logits[0][0].float().numpy())
        accelerator_steps = np.load(artifacts.step_logits) if artifacts.step_logits.exists() else None
        step_errors = None if accelerator_steps is None else [
            float(np.linalg.norm(accelerator_steps[i] - ref) / np.linalg.norm(ref))
            for i, ref in enumerate(step[0].float().numpy() for step in raw_steps[: len(accelerator_steps)])
        ]  # fmt: skip
        data = {
            "token_ids": ref_tokens,
            "text": tokenizer.decode(ref_tokens, skip_special_tokens=True),
            "reference_loglik": reference_loglik,
            "generate_s": clock.seconds["generate"],
            "peak_rss_bytes": peak_rss_bytes(),
            "routing_margin": routing_margin(model, inputs),
        }
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
            step_rel_errors=step_errors,
            long_logprobs=long_logprobs,
        )

    def reuse(self, acc: AcceleratorData, stored: dict[str, Any]) -> ReferenceResult | None:
        """The reference's findings from a stored run, without running the model; None when that is not enough.

        When the accelerator produced exactly the reference's tokens, scoring them teacher-forced under the
        reference gives the reference's own log-probs: the stored ones. A divergence needs the model, to
        score the accelerator's prefix.
        """
        if acc.token_ids != stored["token_ids"]:
            return None
        return ReferenceResult(data=stored, accelerator_loglik=stored["reference_loglik"], reused=True)

    def conclude(self, acc: AcceleratorData, found: ReferenceResult, artifacts: Artifacts, dtype: str) -> Conclusion:
        """Evidence → verdict (without the judge, which a sharded run asks next), and the comparison."""
        ref = found.data
        acc_prefill, ref_prefill = np.load(artifacts.prefill), np.load(artifacts.reference_prefill)
        prefill_error = float(np.linalg.norm(acc_prefill - ref_prefill) / np.linalg.norm(ref_prefill))
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
                # each step's raw logits against the reference's on the same prefix (none from a stored reference)
                "step_rel_errors": found.step_rel_errors,
            },
        )
        sharded = acc.placement.parallelism != Parallelism.none
        evidence = Evidence(comparison, found.divergent_steps, finite=acc.finite, sharded=sharded)
        long = NOT_RUN
        if acc.long_token_ids is not None and found.long_logprobs is not None:
            long = long_outcome(acc.long_token_ids, ref["long_token_ids"], found.long_logprobs, ref["long_logprobs"],
                                bool(acc.long_finite), LongTolerances())  # fmt: skip
        decision = decide(evidence, Tolerances.for_dtype(dtype))
        return Conclusion.of(decision, comparison, evidence, long, acc.performance)
