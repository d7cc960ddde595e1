"""Codes defined once and used everywhere: SQL, API, Parquet, metrics."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class JobState(StrEnum):
    queued = "queued"
    running = "running"  # the accelerator stage holds its core group
    judging = "judging"  # the cores are free; the verdict stage runs on the host's CPUs
    done = "done"  # finished with a verdict about the model: PASS, FAIL or SKIPPED
    failed = "failed"  # finished with ERROR: the model could not be tested to the end
    cancelled = "cancelled"


ACTIVE_STATES = (JobState.queued, JobState.running, JobState.judging)
FINISHED_STATES = (JobState.done, JobState.failed, JobState.cancelled)


class SweepState(StrEnum):
    queued = "queued"
    running = "running"
    done = "done"
    failed = "failed"


class Stage(StrEnum):
    """What one runner invocation does: the whole test, or one of a job's two stages."""

    full = "full"  # accelerator run then verdict, in one go (a person's reproduce command)
    accelerator = "accelerator"  # on the pinned core group: download, load, compile, generate, save artifacts
    verdict = "verdict"  # on the host's CPUs: the reference (stored or computed), scoring, the evidence
    judge = "judge"  # the fluency judge of a sharded run, in a process that never loads the tested checkpoint


class Verdict(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    ERROR = "ERROR"
    SKIPPED = "SKIPPED"


class ErrorClass(StrEnum):
    download = "download"  # the Hub refused or failed to serve the files
    gated = "gated"  # the repo needs accepted terms or a token we do not have
    not_found = "not_found"  # repo, revision or a required file does not exist
    load = "load"  # from_pretrained failed
    compile = "compile"  # torch.compile / the backend compiler failed
    runtime = "runtime"  # the compiled model failed while running
    oom = "oom"  # out of host or device memory
    timeout = "timeout"  # the runner ran past its hard limit
    crash = "crash"  # a runner process died without a report (signal, abort)
    worker_lost = "worker_lost"  # delivered max_attempts times without finishing
    no_worker = "no_worker"  # its queue had no live worker for longer than the configured wait
    unsupported_parallelism = "unsupported_parallelism"  # must be sharded, but has no plan that fits
    placement = "placement"  # two ranks of a sharded run held the same core
    too_large = "too_large"  # needs more than 16 cores: SKIPPED at submission
    unsizable = "unsizable"  # neither safetensors metadata nor file sizes tell its size
    remote_code = "remote_code"  # needs trust_remote_code and its org is not allowlisted: SKIPPED
    hub_unavailable = "hub_unavailable"  # the Hub did not answer, after retries
    unsupported_architecture = "unsupported_architecture"  # transformers does not know its model_type
    adapter = "adapter"  # a PEFT adapter without its own base weights: SKIPPED
    weights_format = "format"  # only GGUF, ONNX or MLX weights, which from_pretrained does not load: SKIPPED
    quantized = "quantized"  # a quantization method the backend cannot load: SKIPPED, the method named
    internal = "internal"  # a bug of ours; the message says where


class Task(StrEnum):
    """The tasks: each member is one line of the registry, and names its folder under tasks/ (``tasks.<name>``)."""

    text_generation = "text-generation"
    feature_extraction = "feature-extraction"  # transformers encoders, and sentence-transformers' own pipelines
    text_to_image = "text-to-image"  # diffusers pipelines
    automatic_speech_recognition = "automatic-speech-recognition"  # Whisper-style encoder-decoders


class CacheOutcome(StrEnum):
    """What an accelerator run's compiles found in the compile cache."""

    hit = "hit"  # every graph it looked up was there
    miss = "miss"  # at least one was compiled anew
    none = "none"  # a compiler without a persistent cache
    unknown = "unknown"  # the compiler keeps one, but did not say how this run's lookups went


class CompilePath(StrEnum):
    """Which compile an accelerator run's generate went through (transformers may add its own: see the runner)."""

    forward = "forward"  # the forward compiled with the backend, generate's own auto-compile switched off
    forward_and_generate = "forward+generate"  # generate also wrapped its decode step in a compile of its own


class LongOutcome(StrEnum):
    """The long-generation check's outcome: its own field, never folded into the 32-token verdict."""

    ok = "ok"  # the text agrees, or diverges late and stays as plausible under the reference as its own
    diverged = "diverged"  # a window of the text became implausible under the reference (loss of agreement)
    collapsed = "collapsed"  # it fell into repetition that the reference's text does not show
    non_finite = "non-finite"  # a step's logits were NaN or infinite
    not_run = "not run"  # off by settings, another task, or the run ended before it


class Parallelism(StrEnum):
    none = "none"  # one core
    tp = "tp"  # tensor parallel (dense models)
    ep = "ep"  # experts split by expert, everything else replicated (MoE, as the public Space runs them)
    ep_tp = "ep_tp"  # experts split by expert, attention tensor parallel (MoE)


class JudgeKind(StrEnum):
    likelihood = "likelihood"  # the reference model's log-likelihood of the text: no extra model
    local = "local"  # a transformers causal LM on the CPU
    openai = "openai"  # any OpenAI-compatible chat endpoint


class SweepView(StrEnum):
    """One of a sweep's lists of a task's models, in the order a sweep makes them (``shared.jobs.sweeps``)."""

    selected = "selected"  # the configured selection, in its order
    trending = "trending"  # the Hub's top by trending score
    downloads = "downloads"  # the Hub's top by downloads


class Fault(StrEnum):
    """A fault planted in the cpu backend's accelerator run, for tests and benches (``services/runner/faults.py``
    says what each does)."""

    perturb_shard = "perturb_shard"
    skip_allreduce = "skip_allreduce"
    drop_layer = "drop_layer"
    scale_shard_1pct = "scale_shard_1pct"
    scale_shard_10pct = "scale_shard_10pct"
    zero_head = "zero_head"
    rotary_base = "rotary_base"
    cache_position = "cache_position"
    permute_experts = "permute_experts"
    late_corruption = "late_corruption"
    late_nan = "late_nan"
    swap_token = "swap_token"
    swap_near_tie = "swap_near_tie"
    slow_decode = "slow_decode"
    wrong_pooling = "wrong_pooling"


class CompilerName(StrEnum):
    inductor = "inductor"
    neuronx_cc = "neuronx-cc"


class Axis(StrEnum):
    """What a diff compares (``shared.results.cells.diff``): the API's, the page's and the CLI's one spelling."""

    compiler = "compiler"  # the accelerator stack moves (compiler, torch, TorchNeuron, runtime); transformers stays
    library = "library"  # transformers moves; the rest of the stack stays
    stack = "stack"  # whole stacks, by their digests (the stack-<digest> of queue and file names)


class Scope(StrEnum):
    """What an API token may do."""

    submit = "submit"  # submit models, cancel jobs
    admin = "admin"  # also: rerun finished jobs (force) and start sweeps

    def covers(self, needed: Scope) -> bool:
        return self is Scope.admin or needed is self


# The backends a runner knows (services/runner/backends/): a job's and a setting's spelling.
BackendName = Literal["cpu", "cuda", "neuron"]
