"""Failure signatures: what an ERROR or FAIL row failed of, normalised so that one cause reads as one line.

A signature is text a person can read — ``ERROR(compile): FailOnRecompileLimitHit: recompile limit hit … @
torch._dynamo.convert_frame:_compile`` or ``FAIL: prefill logits differ from the reference by <n> …`` — and
its id is a short digest of that text, which ``GET /failures`` groups rows by. The message loses what
differs between two rows failing for the same reason: the model's id, numbers, hex addresses, uuids and
digests, paths, URLs and temporary names; compiler error codes (``NCC_EVRF007``) stay, since a number
that follows letters is kept. The frame is the innermost one of the traceback inside torch, transformers
or the Neuron compiler stack, without its line number (which moves between releases).

Pure functions: the runner (``services/runner/stages.py``) and the job outcomes (``shared/jobs/outcomes.py``)
both call them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

ID_LENGTH = 16  # hex digits of sha256 kept: results.signature_id is String(16)
MESSAGE_LIMIT = 400  # characters of the normalised message a signature keeps

# The packages whose innermost frame names where a failure happened (torch-neuronx, neuronx-cc, torch-xla).
FRAME_PACKAGES = ("torch", "transformers", "torch_neuronx", "neuronxcc", "torch_xla", "libneuronxla")

_SUBSTITUTIONS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE), "<url>"),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.IGNORECASE), "<uuid>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.IGNORECASE), "<addr>"),
    # absolute paths: a slash that starts a word, up to a space, a quote or closing punctuation
    (re.compile(r"(?<![\w.>])(?:~|\.{1,2})?/[^\s'\"`,;:()\[\]{}<>]+"), "<path>"),
    (re.compile(r"\btmp[a-z0-9_]{4,}\b", re.IGNORECASE), "<tmp>"),
    # digests and ids: a run of 7 or more hex digits with at least one digit
    (re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{7,}\b", re.IGNORECASE), "<id>"),
    # numbers that do not follow a letter or an underscore (float32, NCC_EVRF007, rank1 keep theirs)
    (re.compile(r"(?<![A-Za-z_\d])\d+(?:\.\d+)*(?:e[+-]?\d+)?", re.IGNORECASE), "<n>"),
]
# The Neuron compiler's error codes (NCC_EVRF007): kept in a signature even when below the message's first line.
_COMPILER_CODE = re.compile(r"\bNCC_[A-Z0-9]+\b")
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line \d+, in (?P<function>[^\s]+)')
_PACKAGE_DIR = re.compile(r"[/\\](?P<package>" + "|".join(FRAME_PACKAGES) + r")[/\\]")
_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\]")
# The judge's rationale is free text: a FAIL signature keeps that the judge refused, not what it said.
_JUDGE_RATIONALE = re.compile(r"(judge finds the (?:sharded )?(?:text|output) not fluent):.*$", re.DOTALL)


@dataclass(frozen=True)
class Signature:
    text: str
    id: str

    @classmethod
    def of(cls, text: str) -> Signature:
        return cls(text, signature_id(text))


def signature_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:ID_LENGTH]


def normalise(message: str, model_id: str | None = None) -> str:
    """The first line of ``message`` without what differs between two rows that failed for the same reason."""
    line = next((s.strip() for s in message.splitlines() if s.strip()), "")
    if model_id:
        line = line.replace(model_id, "<model>")
    for pattern, replacement in _SUBSTITUTIONS:
        line = pattern.sub(replacement, line)
    line = re.sub(r"\s+", " ", line)
    return line if len(line) <= MESSAGE_LIMIT else line[: MESSAGE_LIMIT - 1] + "…"


def innermost_frame(trace: str) -> str | None:
    """``module:function`` of the innermost frame inside torch, transformers or the Neuron stack, or None.

    Read from the last traceback of ``trace`` (a chained exception prints its causes first), including the
    "from user code" frames dynamo appends to its message, which come after the traceback's own.
    """
    last = trace.rsplit("Traceback (most recent call last):", 1)[-1]
    found = None
    for match in _FRAME.finditer(last):
        module = module_of(match["path"])
        if module is not None:
            found = f"{module}:{match['function']}"
    return found


def module_of(path: str) -> str | None:
    """``transformers.cache_utils`` for ``…/site-packages/transformers/cache_utils.py``; None outside the packages."""
    installed = list(_INSTALLED.finditer(path))
    if installed:
        relative = path[installed[-1].end() :]
        if relative.split("/", 1)[0].split("\\", 1)[0] not in FRAME_PACKAGES:
            return None
    else:
        packages = list(_PACKAGE_DIR.finditer(path))
        if not packages:
            return None
        relative = path[packages[-1].start() + 1 :]
    if not relative.endswith(".py"):
        return None
    module = relative.removesuffix(".py").replace("\\", "/").replace("/", ".")
    return module.removesuffix(".__init__")


def error_signature(
    error_class: str | None, message: str | None, trace: str = "", model_id: str | None = None
) -> Signature:
    """An ERROR row's signature: its class, the normalised message (which starts with the exception's type
    when an exception caused it), the compiler's error codes found further down the message, and the
    innermost frame of ``trace`` when there is one."""
    line = normalise(message or "", model_id) or "no message"
    codes = [c for c in dict.fromkeys(_COMPILER_CODE.findall(message or "")) if c not in line]
    text = f"ERROR({error_class or 'unknown'}): {line}" + (f" [{', '.join(codes)}]" if codes else "")
    frame = innermost_frame(trace) if trace else None
    return Signature.of(f"{text} @ {frame}" if frame else text)


def fail_signature(reason: str | None, model_id: str | None = None) -> Signature:
    """A FAIL row's signature: the rule that failed it (the verdict's reason, normalised)."""
    reason = _JUDGE_RATIONALE.sub(r"\1", reason or "")
    return Signature.of(f"FAIL: {normalise(reason, model_id) or 'no reason'}")
