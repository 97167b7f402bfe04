"""The drafter-update cycle after a rollout, once for every adapter: idle slices, the fallback, the merge.

An adapter runs the idle slices its own way (TRL: each rank while its arrival collective is pending; veRL: the
driver starts them on replicas that have served their share) and hands the cycle what each member did. The cycle
decides whether the fallback runs (no member trained in idle time), times it, merges the drafters by the adapter's
:class:`~.merge.MergeRule` through its :class:`~.transport.DrafterTransport`, and returns an
:class:`UpdateOutcome`, from which :func:`~.metrics.update_metrics` makes the ``tlt/*`` figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .merge import MergedDrafter, MergeRule, merge_drafters
from .reports import SliceReport
from .transport import DrafterTransport

IDLE = "idle"  # the merged drafter trained while members waited for the slowest one
POST_ROLLOUT = "post_rollout"  # no member trained in idle time: the fallback trained after the rollout


@dataclass(frozen=True)
class UpdateOutcome:
    """One update. ``idle``: each member's idle slice; ``trained``: the slices whose drafters were merged (``idle``,
    or the fallback's when it ran); ``fallback_seconds``: the fallback's training time, which delays the policy
    update (the slowest member's; 0 when it did not run); ``sync_seconds``: the merge."""

    trigger: str
    idle: tuple[SliceReport, ...]
    trained: tuple[SliceReport, ...]
    fallback_seconds: float
    merged: MergedDrafter | None
    sync_seconds: float

    @property
    def total_steps(self) -> int:
        """The drafter's step counter after the update (every member's, once merged)."""
        if self.merged is not None:
            return self.merged.total_steps
        return max((r.total_steps for r in self.idle + self.trained), default=0)


def finish_update(idle: Sequence[SliceReport], transport: DrafterTransport, rule: MergeRule | str,
                  fallback: Callable[[], Sequence[SliceReport]] | None) -> UpdateOutcome:
    """Complete an update whose idle slices are over: run ``fallback`` (every member trains after the rollout, at
    least one micro-step, and its reports come back in member order) when no member trained in idle time and the
    adapter has one (None: switched off, or the drafter is not used), then merge by ``rule``.

    Called on every member in step (TRL's ranks, collectives inside ``fallback`` and ``transport``) or once by a
    driver (veRL); ``idle`` must be the same list everywhere.
    """
    idle = tuple(idle)
    trigger, trained, fallback_seconds = IDLE, idle, 0.0
    if fallback is not None and not any(r.steps > 0 for r in idle):
        trigger = POST_ROLLOUT
        trained = tuple(fallback())
        fallback_seconds = max((r.seconds for r in trained), default=0.0)
    start = time.perf_counter()
    merged = merge_drafters(rule, trained, transport)
    return UpdateOutcome(trigger, idle, trained, fallback_seconds, merged, time.perf_counter() - start)
