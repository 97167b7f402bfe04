"""How the members of an update (TRL's ranks, veRL's rollout replicas) exchange drafters.

The update cycle decides which drafter every member keeps; a transport carries it: torch.distributed
collectives between TRL's ranks (:class:`tlt_trainers.trl.sync.RankDrafterTransport`), Ray actor calls from
veRL's driver to its rollout servers (:class:`tlt_trainers.verl.drafter_transport.RayDrafterTransport`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypedDict

import torch


class DrafterPayload(TypedDict):
    """One member's drafter as it travels: weights (draft vocabulary included) on the CPU, micro-steps trained
    since the last merge, its trainer's step counter, and whether its draft vocabulary has been chosen."""

    state: dict[str, torch.Tensor]
    steps: int
    total_steps: int
    draft_vocab_ready: bool


class DrafterTransport(ABC):
    """Moves drafters between the members of one update, indexed 0..members-1 in the same order as the reports
    the cycle is given. Every method is called on every member in step (collectives) or once by a driver."""

    @abstractmethod
    def collect(self) -> list[DrafterPayload | None]:
        """Every member's drafter (None for a member without one)."""

    @abstractmethod
    def load_everywhere(self, payload: DrafterPayload) -> None:
        """Load ``payload`` into every member's drafter; each trainer's step counter becomes at least
        ``payload["total_steps"]`` and its steps since the last merge start again from 0."""

    def share_from(self, source: int, total_steps: int) -> None:
        """Every member takes member ``source``'s drafter and continues from step ``total_steps``. This default
        ships the weights through :meth:`collect`; a transport that can also carry the optimizer state, or send
        from one member without gathering all, overrides it."""
        payload = self.collect()[source]
        if payload is not None:
            self.load_everywhere({**payload, "total_steps": total_steps})
