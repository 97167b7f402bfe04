"""How long the drafter trains when no member had idle time to train in: the fallback budget.

Idle time is free: a member that finished its share of the rollout trains while it would otherwise wait
(``drafter_max_idle_seconds`` at most, until the slowest member is done). When no member trained that way (a
single rank or replica, all finished together, or idle training switched off), the drafter still follows the
policy: every member trains after the rollout for ``drafter_update_fraction`` of the rollout's time, at most
``drafter_update_seconds``, and at least one micro-step, since that time delays the policy update.
"""

from __future__ import annotations

from typing import Protocol


class UpdateSettings(Protocol):
    """The settings the fallback reads (:class:`~tlt_trainers.settings.DrafterSettings`' fields, which TRL's
    TLTSettings and veRL's TLTSection both carry)."""

    drafter_update_seconds: float
    drafter_update_fraction: float
    drafter_max_steps_per_update: int | None


def trains_after_rollout(settings: UpdateSettings) -> bool:
    """Whether the fallback is on: ``drafter_update_seconds``, ``drafter_update_fraction`` and
    ``drafter_max_steps_per_update`` all leave it on (0 switches each off)."""
    return (settings.drafter_update_seconds > 0 and settings.drafter_update_fraction > 0
            and settings.drafter_max_steps_per_update != 0)


def after_rollout_budget(settings: UpdateSettings, rollout_seconds: float) -> float | None:
    """Seconds of training after a rollout that lasted ``rollout_seconds`` (at least one micro-step is made
    whatever the figure); None when the settings switch the fallback off."""
    if not trains_after_rollout(settings):
        return None
    return min(settings.drafter_update_seconds, settings.drafter_update_fraction * max(rollout_seconds, 0.0))
