"""One training slice: a member trains its drafter until a budget runs out or it is told to stop."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..drafter.trainer import DrafterTrainer


def train_slice(trainer: DrafterTrainer, max_seconds: float, *, max_steps: int | None,
                at_least_one: bool = False, interrupted: Callable[[], bool] | None = None,
                rebuild_draft_vocab: bool = False) -> dict:
    """Train ``trainer``'s drafter on its buffer for up to ``max_seconds`` and ``max_steps`` micro-steps.

    ``interrupted`` (checked between micro-steps) ends the slice early: the slowest rank has arrived, or a new
    request came in. ``at_least_one``: the fallback after a rollout, which finishes one micro-step whatever the
    budget and the interruption (otherwise the drafter would never follow the policy where there is no idle time).
    ``rebuild_draft_vocab``: first choose the draft vocabulary from the buffer (the drafter's first update).

    Returns :meth:`DrafterTrainer.train`'s metrics, or ``{}`` when the slice did not start (empty buffer, training
    switched off by ``max_steps=0``, no budget, or already interrupted); a non-empty result means the draft
    vocabulary was rebuilt where asked.
    """
    if len(trainer.buffer) == 0 or max_steps == 0:
        return {}
    if not at_least_one and (max_seconds <= 0 or (interrupted is not None and interrupted())):
        return {}
    if rebuild_draft_vocab:
        trainer.rebuild_draft_vocab()
    first, deadline = trainer.step, time.perf_counter() + max(max_seconds, 0.0)

    def should_stop() -> bool:
        if at_least_one and trainer.step == first:
            return False
        return (interrupted is not None and interrupted()) or time.perf_counter() >= deadline

    with torch.enable_grad():
        return trainer.train(max_steps=max_steps, max_seconds=None, should_stop=should_stop)
