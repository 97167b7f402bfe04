"""The online drafter update, written once for every adapter (TRL, veRL).

After each rollout the drafter is trained on the policy's latest hidden states, in time that would otherwise be
wasted, and every member (rank, rollout replica) continues with the same drafter:

- :mod:`.slice`: one member's training slice (budget, interruption, at least one step for the fallback);
- :mod:`.budget`: the fallback's budget when no member had idle time;
- :mod:`.payback`: that budget paid from what speculation saved, where a rollout measures it;
- :mod:`.reports`: what a slice did, as every transport carries it;
- :mod:`.merge`: the merge rule (``most_trained`` for TRL, ``step_weighted_average`` for veRL, and why);
- :mod:`.transport`: the interface the adapters implement to move drafters (collectives, Ray calls);
- :mod:`.cycle`: the update itself (fallback decision, timing, merge);
- :mod:`.metrics`: its ``tlt/*`` figures.

This package sits below the adapters: it never imports ``trl``, ``verl`` or ``vllm``.
"""

from .budget import after_rollout_budget, trains_after_rollout
from .cycle import IDLE, POST_ROLLOUT, UpdateOutcome, finish_update
from .merge import MergedDrafter, MergeRule, merge_drafters, most_trained, step_weighted_average
from .metrics import update_metrics, waited_seconds
from .payback import PaybackBudget
from .reports import REPORT_FIELDS, SliceReport
from .slice import train_slice
from .transport import DrafterPayload, DrafterTransport

__all__ = ["IDLE", "POST_ROLLOUT", "REPORT_FIELDS", "DrafterPayload", "DrafterTransport", "MergeRule",
           "MergedDrafter", "PaybackBudget", "SliceReport", "UpdateOutcome", "after_rollout_budget", "finish_update",
           "merge_drafters", "most_trained", "step_weighted_average", "train_slice", "trains_after_rollout",
           "update_metrics", "waited_seconds"]
