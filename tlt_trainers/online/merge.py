"""The merge: after an update, every member (rank, replica) continues with one drafter. The rule is a parameter.

``MergeRule.MOST_TRAINED`` (TRL): every rank takes the drafter, optimizer state and step counter of the rank that
made the most micro-steps (ties: the lowest rank). TRL's ranks are one torch.distributed job whose drafters stay
bit-identical between updates, checkpoints are written by the main process only, and a resumed run must continue
as the uninterrupted one would: the optimizer's moments have to belong to the weights they step. A broadcast of one
rank's drafter and Adam state does that in one collective; an average of weights would leave every rank's moments
describing weights nobody has. The rank that trained most is the one that finished first and waited longest; what
is dropped is the fewer steps of the ranks that waited less.

``MergeRule.STEP_WEIGHTED_AVERAGE`` (veRL): the parameter-wise average of the drafters that trained, each weighted
by its micro-steps since the last merge (local SGD's merge). veRL's rollout replicas are separate Ray actors on
disjoint shards of the batch, often several idle at once while the slowest finishes, and each has learned from
rollouts the others never saw; averaging keeps what every replica learned, in proportion to its steps.
Their states travel through the driver anyway (no collective joins them), the optimizer state stays with each
replica (shipping it too would triple the payload), and veRL checkpoints one replica's drafter.

The two rules agree when a single member trained (one process, or one replica); they differ in what the other
members learned in the same update, so choosing one for both adapters would change the drafter either adapter
continues with, and in TRL the optimizer state that travels with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from .reports import SliceReport, finite_mean
from .transport import DrafterPayload, DrafterTransport


class MergeRule(str, Enum):
    """How the drafters of one update become one (see the module's docstring for which adapter uses which)."""

    MOST_TRAINED = "most_trained"
    STEP_WEIGHTED_AVERAGE = "step_weighted_average"


@dataclass(frozen=True)
class MergedDrafter:
    """The drafter every member holds after the merge. ``source``: the member it came from (None for an average);
    ``steps``, ``loss``, ``top1``: of the training it carries from this update; ``total_steps``: the step counter
    every member continues from."""

    rule: MergeRule
    source: int | None
    steps: int
    loss: float
    top1: float
    total_steps: int


def most_trained(steps: Sequence[int]) -> int:
    """The member with the most micro-steps, ties to the lowest index."""
    best = max(steps)
    return next(i for i, value in enumerate(steps) if value == best)


def step_weighted_average(payloads: Sequence[DrafterPayload | None]) -> DrafterPayload | None:
    """Parameter-wise average of the drafters that trained (``steps > 0``), weighted by their steps; floating
    tensors are averaged in float32 and cast back, others (the draft vocabulary's maps) taken from the first.
    None when no drafter trained."""
    trained = [p for p in payloads if p is not None and p["steps"] > 0]
    if not trained:
        return None
    if len(trained) == 1:
        return trained[0]
    total = sum(p["steps"] for p in trained)
    state = {}
    for name, first in trained[0]["state"].items():
        if not torch.is_floating_point(first):
            state[name] = first
            continue
        state[name] = sum(p["state"][name].float() * (p["steps"] / total) for p in trained).to(first.dtype)
    return {"state": state, "steps": total, "total_steps": max(p["total_steps"] for p in trained),
            "draft_vocab_ready": any(p.get("draft_vocab_ready", False) for p in trained)}


def merge_drafters(rule: MergeRule | str, reports: Sequence[SliceReport],
                   transport: DrafterTransport) -> MergedDrafter | None:
    """Give every member the same drafter by ``rule``, through ``transport``; None when nothing was merged (no
    member trained). ``reports``: each member's training in this update, in the transport's member order."""
    rule = MergeRule(rule)
    if rule is MergeRule.MOST_TRAINED:
        if not reports or max(r.steps for r in reports) <= 0:
            return None
        source = most_trained([r.steps for r in reports])
        chosen = reports[source]
        transport.share_from(source, chosen.total_steps)
        return MergedDrafter(rule, source, chosen.steps, chosen.loss, chosen.top1, chosen.total_steps)
    merged = step_weighted_average(transport.collect())
    if merged is None:
        return None
    transport.load_everywhere(merged)
    trained = [r for r in reports if r.steps > 0]
    return MergedDrafter(rule, None, sum(r.steps for r in reports), finite_mean([r.loss for r in trained]),
                         finite_mean([r.top1 for r in trained]), merged["total_steps"])
