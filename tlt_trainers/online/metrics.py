"""The ``tlt/*`` figures of a drafter update (names from :mod:`tlt_trainers.metric_names`), the same in every
adapter."""

from __future__ import annotations

from collections.abc import Sequence

from .. import metric_names as metric
from .cycle import IDLE, UpdateOutcome

_NAN = float("nan")


def waited_seconds(finish_seconds: Sequence[float]) -> float:
    """Member-seconds spent waiting for the slowest member, from each member's finish time (``tlt/idle_seconds``:
    the time idle training can use)."""
    if not finish_seconds:
        return 0.0
    last = max(finish_seconds)
    return float(sum(last - t for t in finish_seconds))


def update_metrics(outcome: UpdateOutcome) -> dict[str, float]:
    """The update's figures. Steps, loss and top-1 are those of the drafter every member continues with (the
    source's under ``most_trained``, all trained members' under ``step_weighted_average``); nan and 0 when nothing
    was merged."""
    merged = outcome.merged
    return {
        metric.DRAFTER_IDLE_SECONDS: float(sum(r.seconds for r in outcome.idle)),
        metric.DRAFTER_UPDATE_SECONDS: float(outcome.fallback_seconds),
        metric.DRAFTER_STEPS: float(merged.steps) if merged is not None else 0.0,
        metric.DRAFTER_LOSS: float(merged.loss) if merged is not None else _NAN,
        metric.DRAFTER_TOP1: float(merged.top1) if merged is not None else _NAN,
        metric.DRAFTER_SYNC_SECONDS: float(outcome.sync_seconds),
        metric.DRAFTER_TRIGGER_IDLE: 1.0 if outcome.trigger == IDLE and merged is not None else 0.0,
        metric.DRAFTER_TOTAL_STEPS: float(outcome.total_steps),
        # batch sizes whose passes members timed for the adaptive engine in idle time (once each; then cached)
        metric.COST_BATCH_SIZES_TIMED: float(sum(r.costs_timed for r in outcome.idle)),
    }
