"""A MoE's routing as a run chose it: a tracker of the experts each router picks at each forward.

The accelerator records its chosen experts per position and layer; the reference the same, plus each router's top
k+8 logits and their experts, so that a flip's margin is read between the experts that really swapped
(``tasks.text_generation.verdict.routing_flips``). Routers that do not choose by raw-logit order get no record at all:
nothing is excused for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.contracts.handoffs import Routing

# The reference keeps this many router logits past its k choices: a flip that brings in an expert outside them is no
# near tie (the margin to it is at least the gap from the k-th to the (k+8)-th). At 2, three benign bf16 runs of the
# 24-layer, 64-expert fixtures FAILed on flips to experts just past them; kept to 8 (those seeds re-run), the flips
# sat within 0.051 of the expert dropped: a router over many experts is flat well past its k-th. The calibration at
# k+8: 0 false FAIL in 250 (BENCHMARKS.md, *MoE at a real router shape*). A few more floats per position and layer,
# on the reference only.
EXTRA_LOGITS = 8


def experts_per_token(model: Any) -> int | None:
    return getattr(model.config, "num_experts_per_tok", None) or None


def unordered_routing(model: Any, routers: list[Any]) -> str | None:
    """Why these routers do not choose their experts by the order of the logits they output, or None when they do.
    A correction bias added before the choice (DeepSeek-V3's ``e_score_correction_bias``), expert groups chosen
    first (``n_group``/``topk_group``) or a score other than softmax (sigmoid) make a gap in the raw logits no
    measure of how close the choice was: such a router gets no routing record, and so no excuse."""
    config = model.config
    if any(getattr(router, "e_score_correction_bias", None) is not None for router in routers):
        return "a correction bias is added to the router's scores before the choice"
    groups = [getattr(config, "n_group", None), *(getattr(router, "num_group", None) for router in routers)]
    if any((g or 1) > 1 for g in groups) or getattr(config, "topk_group", None):
        return "the router chooses expert groups first"
    scoring = getattr(config, "scoring_func", None)
    if scoring not in (None, "softmax"):
        return f"the router scores experts by {scoring}, not by softmax over its logits"
    method = getattr(config, "topk_method", None)
    if method not in (None, "greedy"):
        return f"the router chooses its experts by {method}"
    return None


@dataclass(frozen=True)
class Routers:
    """A model's routers, found once: the modules transformers records router logits from (``_can_record_outputs``),
    in depth order; ``k`` experts per token; ``index`` of the logits among a router's outputs. None for a dense model
    or one whose routers do not choose by raw-logit order (``unordered``, the reason)."""

    modules: list[Any]
    k: int | None
    index: int
    unordered: str | None

    @classmethod
    def of(cls, model: Any) -> Routers:
        target = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        k = experts_per_token(model)
        router_class = target if isinstance(target, type) else getattr(target, "target_class", None)
        routers: list[Any] = []
        if router_class and k:
            routers = [m for m in model.modules() if isinstance(m, router_class)]
        unordered = unordered_routing(model, routers) if routers else None
        return cls([] if unordered else routers, k, getattr(target, "index", 0) or 0, unordered)


class RoutingRecorder:
    """The experts a MoE's routers choose at each forward, recorded without a graph break: a forward hook on each
    router keeps its choice (the router's own top-k indices, so that ties break as the model breaks them) as an
    attribute of the router — dynamo replays an attribute's assignment after the graph, as a side effect — and the
    forward's wrapper collects them after each call while ``recording``. Its routers are the modules transformers
    records router logits from (``_can_record_outputs``); a dense model has none, nor has a router that does not
    choose by raw-logit order (``unordered``, the reason). With ``top`` (the reference), each router's top k+8 logits
    and their experts too. Under expert parallelism the router is replicated: each rank records its own, and the run
    keeps rank 0's only where every rank's is the same (``services.runner.parallel.same_on_every_rank``)."""

    def __init__(self, model: Any, top: bool = False) -> None:
        found = Routers.of(model)
        self.k, self.index, self.unordered, self.routers = found.k, found.index, found.unordered, found.modules
        self.top, self.recording = top, False
        # each call: per router, (chosen experts, (top logits, their experts) or None), cloned on the CPU
        self.calls: list[list[tuple[Any, Any]]] = []
        # each router's choice (its attribute) as last collected: one an earlier recorder left is no fresh choice
        self.last: list[Any] = [getattr(router, "chosen_experts", None) for router in self.routers]
        self.hooks = [router.register_forward_hook(self._keep_choice) for router in self.routers]

    def _keep_choice(self, module: Any, args: Any, output: Any) -> None:
        import torch

        outputs = output if isinstance(output, tuple) else (output,)
        logits = outputs[self.index]
        logits = (logits.to_local() if hasattr(logits, "to_local") else logits).reshape(-1, logits.shape[-1])
        k = self.k or 0
        own = [o for o in outputs if isinstance(o, torch.Tensor) and not o.is_floating_point() and o.shape[-1] == k]
        module.chosen_experts = own[0].reshape(-1, k) if own else logits.topk(k, dim=-1).indices
        if self.top:
            best = logits.float().topk(min(k + EXTRA_LOGITS, logits.shape[-1]), dim=-1)
            module.router_top = (best.values, best.indices)

    def collect(self) -> None:
        """Keep what the routers chose in the forward that just ran, copied to the CPU now: a backend that reuses its
        output buffers (CUDA graphs, Neuron) overwrites them at the next forward. A router that did not run (its
        layer skipped) still holds the choice it made before: it is kept as no expert (-1), which excuses nothing."""
        if not self.recording:
            return
        import torch

        fresh = [getattr(r, "chosen_experts", None) for r in self.routers]
        ran = [c for c, last in zip(fresh, self.last, strict=True) if c is not None and c is not last]
        if not ran:
            return
        none = torch.full(tuple(ran[0].shape), -1, dtype=torch.long)
        call = []
        for router, chosen, last in zip(self.routers, fresh, self.last, strict=True):
            top = None
            if chosen is None or chosen is last:
                if self.top:  # never read: the flip's margin against no expert is no near tie
                    width = self._width(fresh)
                    top = (torch.zeros(none.shape[0], width), torch.full((none.shape[0], width), -1))
                call.append((none, top))
            else:
                if self.top:
                    values, indices = router.router_top
                    top = (values.detach().to("cpu", copy=True), indices.detach().to("cpu", torch.long, copy=True))
                call.append((chosen.detach().to("cpu", torch.long, copy=True), top))
        self.calls.append(call)
        self.last = fresh

    def _width(self, fresh: list[Any]) -> int:
        """How many top logits a router that ran this call kept (k+8, or every expert when there are fewer)."""
        return next(r.router_top[0].shape[-1] for r, c, last in zip(self.routers, fresh, self.last, strict=True)
                    if c is not None and c is not last)  # fmt: skip

    def wrap(self, forward: Any) -> Any:
        if not self.routers:
            return forward

        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            self.collect()
            return out

        return recorded

    def routing(self, prompt_positions: int, positions: int | None = None) -> Routing | None:
        """What the recorded calls chose, position by position (each call's positions in order), the first
        ``positions`` of them when given."""
        import torch

        if not self.calls:
            return None

        def stacked(part: Any) -> Any:  # each call's positions x layers x n, then the calls' positions in order
            return torch.cat([torch.stack([part(choice) for choice in call], dim=1) for call in self.calls])[:positions]

        experts = stacked(lambda choice: choice[0])
        top_logits = top_experts = None
        if self.top:
            top_logits = stacked(lambda choice: choice[1][0]).tolist()
            top_experts = stacked(lambda choice: choice[1][1]).tolist()
        return Routing(experts=experts.sort(dim=-1).values.tolist(), top_logits=top_logits, top_experts=top_experts,
                       prompt_positions=prompt_positions)  # fmt: skip

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


class RoutingForcer:
    """The counterfactual: the model made to choose another run's experts. A forward hook on each router replaces its
    choice at every position it routes by the experts ``routing`` recorded there (positions in the order the forwards
    run them: a ``generate`` over the same prefix), weighted as the router weights its own: the softmax of its logits
    at those experts, normalized to one where the router's own weights are. The reference re-run so shows what the
    accelerator's routing alone does to the logits: where it reproduces the accelerator's, the flips explain the
    difference; where it does not, something else made it (``tasks.text_generation.verdict.decide``).

    Forcing is checked, never assumed: at every call the hook first recomputes the router's own weights from its own
    logits and choice by that formula, and a router whose weights come otherwise (sparsemixer, per-expert scales,
    outputs that are already probabilities) makes the forcer not ``forceable``: no counterfactual, so nothing is
    excused. ``covered`` says whether the forwards routed exactly the recorded positions, every router at each."""

    def __init__(self, model: Any, routing: Routing) -> None:
        self.routers = Routers.of(model)
        self.routing, self.forceable = routing, bool(self.routers.modules)
        self.layer_of = {id(router): layer for layer, router in enumerate(self.routers.modules)}
        self.offset = self.next = 0  # the positions the current forward routes start at; the next forward's
        self.rows = [0] * len(self.routers.modules)  # the positions each router routed, over every forward
        self.hooks = [router.register_forward_hook(self._force) for router in self.routers.modules]

    @property
    def covered(self) -> bool:
        return self.forceable and set(self.rows) == {len(self.routing.experts)} == {self.next}

    @staticmethod
    def _weights(probabilities: Any, experts: Any, normalized: bool) -> Any:
        share = probabilities.gather(-1, experts)
        return share / share.sum(-1, keepdim=True) if normalized else share

    def _force(self, module: Any, args: Any, output: Any) -> Any:
        import torch

        layer, k, index = self.layer_of[id(module)], self.routers.k or 0, self.routers.index
        outputs = list(output) if isinstance(output, tuple) else [output]
        logits = outputs[index].reshape(-1, outputs[index].shape[-1])
        chosen = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and not o.is_floating_point()
                  and o.shape[-1] == k]  # fmt: skip
        weighted = [i for i, o in enumerate(outputs) if i != index and isinstance(o, torch.Tensor)
                    and o.is_floating_point() and o.shape[-1] == k]  # fmt: skip
        if not (self.forceable and chosen and weighted):
            self.forceable = False
            return output
        own, weights = outputs[chosen[0]], outputs[weighted[0]]
        indices, scores = own.reshape(-1, k).clone(), weights.reshape(-1, k).clone()
        probabilities = torch.softmax(logits.float(), dim=-1)
        # the router's own weights, recomputed: which formula it uses, or none of ours (then nothing is forced)
        normalized = next((n for n in (True, False) if torch.allclose(
            self._weights(probabilities, indices, n), scores.float(), rtol=2e-2, atol=2e-3)), None)  # fmt: skip
        if normalized is None or logits.shape[0] != indices.shape[0]:
            self.forceable = False
            return output
        if layer == 0:  # the first router of a forward: its positions follow the last forward's
            self.offset, self.next = self.next, self.next + logits.shape[0]
        self.rows[layer] += logits.shape[0]
        for row in range(logits.shape[0]):
            position = self.offset + row
            if position >= len(self.routing.experts) or min(self.routing.experts[position][layer]) < 0:
                continue
            experts = torch.tensor(self.routing.experts[position][layer], dtype=indices.dtype)
            # best first, as the router's own top-k lists them
            experts = experts[probabilities[row, experts].argsort(descending=True)]
            indices[row] = experts
            scores[row] = self._weights(probabilities[row], experts, normalized).to(scores.dtype)
        outputs[chosen[0]], outputs[weighted[0]] = indices.reshape(own.shape), scores.reshape(weights.shape)
        return tuple(outputs) if isinstance(output, tuple) else outputs[0]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
