"""text-generation: greedy, exactly 32 new tokens from a fixed prompt, static shapes (static KV cache).

The accelerator run goes first (possibly as N ranks): its tokens, per-step logits and prefill logits.
Then the CPU reference (eager, one process) generates its own 32 tokens and scores the accelerator's
tokens teacher-forced on the accelerator's prefix: the evidence ``verdict.decide`` rules on.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from services.runner.backends.base import Backend
from services.runner.failures import phase
from services.runner.measure import Stopwatch, accelerator_timings, peak_rss_bytes
from shared.enums import ErrorClass, JudgeKind, Parallelism
from shared.results.verdict import Evidence, StepEvidence, Tolerances, decide
from shared.settings import Settings
from shared.testconfig import NEW_TOKENS, PROMPT


def _generation_kwargs(tokenizer: Any) -> dict[str, Any]:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {
        "do_sample": False,
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "cache_implementation": "static",
        "pad_token_id": pad_id,
        "output_logits": True,
        "return_dict_in_generate": True,
    }


def accelerator(spec: dict[str, Any], backend: Backend) -> dict[str, Any]:
    """One rank of the accelerator run: load (sharded when world_size > 1), compile, generate twice."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from services.runner import faults, parallel

    model_dir, world_size, rank = spec["model_dir"], spec["world_size"], spec["rank"]
    dtype = getattr(torch, backend.dtype)
    clock = Stopwatch()
    torch.manual_seed(0)
    with phase(ErrorClass.load), clock.time("load"):
        config = AutoConfig.from_pretrained(model_dir)
        kind = parallel.choose_parallelism(config, world_size, spec["moe_parallelism"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if kind == Parallelism.none:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(backend.device)
        else:
            model = parallel.load_sharded(AutoModelForCausalLM, model_dir, dtype, world_size, kind)
        model.eval()
        if spec.get("fault"):
            faults.inject(model, spec["fault"], rank, world_size)
        inputs = tokenizer(PROMPT, return_tensors="pt").to(model.device)
    kwargs = _generation_kwargs(tokenizer)

    def generate() -> Any:
        with torch.inference_mode():
            out = model.generate(**inputs, **kwargs)
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
        np.save(spec["prefill_path"], logits[0].numpy())
    return {
        "token_ids": tokens,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "finite": all(bool(torch.isfinite(step).all()) for step in logits),
        "parallelism": kind.value,
        **accelerator_timings(clock),
        "peak_memory_bytes": backend.peak_memory_bytes(),
        "visible_cores": backend.visible_cores(),
    }


def reference(spec: dict[str, Any], backend: Backend) -> dict[str, Any]:
    """The CPU reference: its own greedy tokens, and the evidence about the accelerator's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    acc = spec["accelerator"]
    dtype = getattr(torch, backend.dtype)
    clock = Stopwatch()
    with phase(ErrorClass.load), clock.time("load"):
        tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype).eval()
        inputs = tokenizer(PROMPT, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    with phase(ErrorClass.runtime), clock.time("generate"), torch.inference_mode():
        out = model.generate(**inputs, **_generation_kwargs(tokenizer))
        ref_tokens = out.sequences[0, prompt_len:].tolist()
        ref_logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
        reference_loglik = sum(lp[t].item() for lp, t in zip(ref_logprobs, ref_tokens, strict=True)) / NEW_TOKENS
        # Teacher-forced: the reference's distribution at each step given the accelerator's own prefix.
        acc_tokens = acc["token_ids"]
        ids = torch.tensor([inputs["input_ids"][0].tolist() + acc_tokens[:-1]])
        forced = model(input_ids=ids).logits[0, prompt_len - 1 :].float()
        forced_lp = torch.log_softmax(forced, -1)
    steps, acc_loglik = [], 0.0
    for i, token in enumerate(acc_tokens):
        lp = forced_lp[i]
        acc_lp = lp[token].item()
        acc_loglik += acc_lp / NEW_TOKENS
        best = int(lp.argmax())
        if best != token:
            steps.append(StepEvidence(i, token, best, lp[best].item() - acc_lp, int((lp > lp[token]).sum())))
    ref_prefill = out.logits[0][0].float().numpy()
    np.save(spec["reference_prefill_path"], ref_prefill)
    cache = {
        "token_ids": ref_tokens,
        "text": tokenizer.decode(ref_tokens, skip_special_tokens=True),
        "reference_loglik": reference_loglik,
        "generate_s": clock.seconds["generate"],
        "peak_rss_bytes": peak_rss_bytes(),
    }
    return conclude(spec, backend.settings, backend.dtype, acc, cache, steps, acc_loglik) | {"cache": cache}


def conclude_from_cache(
    spec: dict[str, Any], settings: Settings, dtype: str, cached: dict[str, Any]
) -> dict[str, Any] | None:
    """The verdict from a stored reference, without running the model again; None when that is not enough.

    When the accelerator produced exactly the reference's tokens, scoring them teacher-forced under the
    reference gives the reference's own log-probs: the stored ones. A divergence needs the model (to score
    the accelerator's prefix), and so does a judge other than the likelihood one.
    """
    acc = spec["accelerator"]
    sharded = spec["accelerator_world_size"] > 1
    if acc["token_ids"] != cached["token_ids"] or (sharded and settings.judge_kind != JudgeKind.likelihood):
        return None
    return conclude(spec, settings, dtype, acc, cached, [], cached["reference_loglik"])


def conclude(
    spec: dict[str, Any],
    settings: Settings,
    dtype: str,
    acc: dict[str, Any],
    ref: dict[str, Any],
    steps: list[StepEvidence],
    acc_loglik: float,
) -> dict[str, Any]:
    """Evidence → verdict, and the report's fields."""
    from services.runner.judges import make_judge

    acc_prefill = np.load(spec["prefill_path"])
    ref_prefill = np.load(spec["reference_prefill_path"])
    prefill_error = float(np.linalg.norm(acc_prefill - ref_prefill) / np.linalg.norm(ref_prefill))
    acc_tokens, ref_tokens = acc["token_ids"], ref["token_ids"]
    sharded = spec["accelerator_world_size"] > 1
    judge = None
    if sharded:
        with phase(ErrorClass.runtime):
            judge = make_judge(settings).judge(acc["text"], ref["text"], acc_loglik, ref["reference_loglik"])
    evidence = Evidence(
        generated=acc_tokens,
        reference=ref_tokens,
        divergent_steps=steps,
        accelerator_loglik=acc_loglik,
        reference_loglik=ref["reference_loglik"],
        prefill_rel_error=prefill_error,
        finite=acc["finite"],
        sharded=sharded,
        judge=judge,
    )
    decision = decide(evidence, Tolerances.for_dtype(dtype))
    return {
        "verdict": decision.verdict,
        "verdict_reason": decision.reason,
        "first_divergence": decision.first_divergence,
        "tokens_match": acc_tokens == ref_tokens,
        "generated_token_ids": acc_tokens,
        "reference_token_ids": ref_tokens,
        "generated_text": acc["text"],
        "reference_text": ref["text"],
        "prefill_rel_error": prefill_error,
        "accelerator_loglik": acc_loglik,
        "reference_loglik": ref["reference_loglik"],
        "judge_kind": judge.kind if judge else None,
        "judge_model": judge.model if judge else None,
        "judge_prompt_hash": judge.prompt_hash if judge else None,
        "judge_answer": judge.answer if judge else None,
        "judge_rationale": judge.rationale if judge else None,
        "evidence": {
            "divergent_steps": [vars(s) for s in steps],
            "prompt_sha256": hashlib.sha256(PROMPT.encode()).hexdigest(),
            "reference_generate_s": ref["generate_s"],
            "reference_peak_rss_bytes": ref["peak_rss_bytes"],
        },
    }
