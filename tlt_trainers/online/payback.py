"""Drafter training paid for by what speculation saved: the after-rollout budget where no rank waits for another.

Idle-time training is free, but where no member had idle time (one process, or all finished together) every second
of drafter training is added to the RL step. There the drafter should train only as far as it pays: the rollouts
it drafts for must save more time than its training costs. :class:`PaybackBudget` keeps a credit in seconds:

* each rollout adds ``payback_share`` of the seconds speculation saved in it (what the rollout's decode steps would
  have cost without speculation minus what they cost; negative where speculation lost time), and ``explore_share``
  of the rollout's seconds, so a drafter that does not pay yet is still trained a little and can start to pay;
* the credit never falls below 0 and never exceeds the user's cap (``drafter_update_seconds``);
* an update trains for the credit, at most the fixed budget's cap (``drafter_update_fraction`` of the rollout, at
  most ``drafter_update_seconds``), and only once the credit buys a whole micro-step (its measured cost), for as many
  whole micro-steps as it buys; the seconds it trained are taken out of the credit. Until a micro-step has been
  timed, the first update makes one.

So training costs at most ``payback_share`` of what speculation saved plus ``explore_share`` of the rollouts: where
speculation never pays, a step costs ``explore_share`` more than without a drafter (and drafter pushes happen only
after an update); where it pays, training keeps going, at up to ``payback_share`` of the savings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PaybackBudget:
    """The credit of drafter training (module doc). ``payback_share``: seconds of training bought by a second saved;
    ``explore_share``: seconds of training bought by a second of rollout, whatever it saved."""

    payback_share: float = 0.5
    explore_share: float = 0.02
    credit: float = 0.0
    saved_seconds: float = 0.0  # over the run, what speculation saved (net of what it lost)
    trained_seconds: float = 0.0  # over the run, what the budget spent on training
    step_seconds: float = math.nan  # one micro-step's measured cost (the most recent update's mean)
    skipped: int = 0  # updates left out because the credit did not buy a micro-step

    def __post_init__(self):
        if not (0.0 <= self.payback_share and 0.0 <= self.explore_share):
            raise ValueError(f"payback_share={self.payback_share} and explore_share={self.explore_share} must be >= 0.")

    def budget(self, rollout_seconds: float, saved_seconds: float, cap: float) -> float | None:
        """Seconds to train after a rollout of ``rollout_seconds`` that saved ``saved_seconds``; ``cap``: the fixed
        budget's figure for this rollout. None: no update this time (the credit does not buy a micro-step)."""
        saved = float(saved_seconds) if math.isfinite(saved_seconds) else 0.0
        self.saved_seconds += saved
        earned = self.payback_share * saved + self.explore_share * max(float(rollout_seconds), 0.0)
        room = max(cap, 0.0 if math.isnan(self.step_seconds) else self.step_seconds)  # at least one micro-step
        self.credit = min(max(self.credit + earned, 0.0), room)
        if math.isnan(self.step_seconds):
            return min(self.credit, cap)  # nothing timed yet: one micro-step (the caller makes at least one)
        if self.credit < self.step_seconds:
            self.skipped += 1
            return None
        return min(self.credit, cap)

    def affordable_steps(self, seconds: float) -> int | None:
        """Whole micro-steps that ``seconds`` buy at the measured cost (at least one); None before one is timed. A
        slice given only seconds would start a step its budget cannot finish."""
        if math.isnan(self.step_seconds) or self.step_seconds <= 0:
            return None
        return max(1, int(seconds // self.step_seconds))

    def spent(self, seconds: float, steps: int) -> None:
        """An update trained ``steps`` micro-steps in ``seconds``."""
        seconds = max(float(seconds), 0.0)
        self.credit = max(self.credit - seconds, 0.0)
        self.trained_seconds += seconds
        if steps > 0:
            self.step_seconds = seconds / steps

    def state(self) -> dict[str, float]:
        """What the decisions rest on, for logs and checkpoints."""
        return {"credit": self.credit, "saved_seconds": self.saved_seconds, "trained_seconds": self.trained_seconds,
                "step_seconds": self.step_seconds, "skipped": float(self.skipped)}

    def load_state(self, state: dict) -> None:
        """Continue from :meth:`state` (a resumed run keeps its credit and what a micro-step costs)."""
        self.credit = max(float(state.get("credit", 0.0)), 0.0)
        self.saved_seconds = float(state.get("saved_seconds", 0.0))
        self.trained_seconds = float(state.get("trained_seconds", 0.0))
        self.step_seconds = float(state.get("step_seconds", math.nan))
        self.skipped = int(state.get("skipped", 0))
