"""The ``tlt/*`` metrics the TRL and veRL adapters log, each name declared once.

Per rollout and drafter update; "rows" are sequences being generated.
"""

from __future__ import annotations

# the rollout
ROLLOUT_SECONDS = "tlt/rollout_seconds"  # the slowest rank's (replica's) generation time
ACCEPTANCE_LENGTH = "tlt/acceptance_length"  # tokens emitted per policy pass of a row (1: no draft accepted)
DRAFT_TOKENS = "tlt/draft_tokens"  # drafts proposed
ACCEPTED_TOKENS = "tlt/accepted_tokens"  # drafts accepted
SPECULATIVE_STEP_FRACTION = "tlt/speculative_step_fraction"  # share of decode steps that drafted
SPECULATING = "tlt/speculating"  # 1 where the rollout engine serves a drafter (veRL's vLLM rollout)
HISTORY_PROPOSED_TOKENS = "tlt/history_proposed_tokens"  # drafts proposed from earlier rollouts
HISTORY_BYTES = "tlt/history_bytes"  # memory of the rollout-history index
COST_BATCH_SIZES_TIMED = "tlt/cost_batch_sizes_timed"  # batch sizes whose step costs were timed in idle time

# the drafter update
IDLE_SECONDS = "tlt/idle_seconds"  # time ranks (workers) waited for the slowest one
DRAFTER_IDLE_SECONDS = "tlt/drafter_idle_seconds"  # of that, time spent training the drafter
DRAFTER_UPDATE_SECONDS = "tlt/drafter_update_seconds"  # drafter training after the rollout (not hidden by a wait)
DRAFTER_STEPS = "tlt/drafter_steps"  # drafter optimizer steps in this update
DRAFTER_TOTAL_STEPS = "tlt/drafter_total_steps"  # drafter optimizer steps so far
DRAFTER_LOSS = "tlt/drafter_loss"
# the drafter's first-token agreement on its training data: with the policy's most likely token where it learns the
# law (drafter_targets="law"), with the token the rollout sampled where it learns those ("sampled", block drafters):
# at temperature 1 the second reads lower and can rise while acceptance does not (docs/settings.md)
DRAFTER_TOP1 = "tlt/drafter_top1"
DRAFTER_BUFFER_SEQUENCES = "tlt/drafter_buffer_sequences"  # rollouts held for drafter training
DRAFTER_TRIGGER_IDLE = "tlt/drafter_trigger_idle"  # 1 when the update trained in idle time
DRAFTER_SYNC_SECONDS = "tlt/drafter_sync_seconds"  # bringing every rank (replica) the same drafter
DRAFTER_PUSHES = "tlt/drafter_pushes"  # drafter reloads into the running vLLM engines so far
DRAFTER_UPDATES_LOADED = "tlt/drafter_updates_loaded"  # drafter reloads into TRL's vLLM engine so far
DRAFTER_PUSH_SECONDS = "tlt/drafter_push_seconds"  # the last reload's seconds
SPECULATION_SAVED_SECONDS = "tlt/speculation_saved_seconds"  # what speculation saved in the rollout (vLLM adaptive)
DRAFTER_CREDIT_SECONDS = "tlt/drafter_credit_seconds"  # the payback budget's credit left after the update

# vLLM's adaptive schedule (TRL's colocated engine)
VLLM_EXPECTED_TOKENS_PER_STEP = "tlt/vllm_expected_tokens_per_step"  # the acceptance the schedule decides on
VLLM_SPECULATIVE_STEP_FRACTION = "tlt/vllm_speculative_step_fraction"  # share of the engine's steps that drafted


def vllm_draft_length(bucket: int) -> str:
    """Draft tokens per request while at most ``bucket`` requests run (0: plain decoding)."""
    return f"tlt/vllm_draft_length_b{bucket}"


# on-policy checks of vLLM's rollouts (TRL, docs/importance_ratio.md)
ROLLOUT_LOGP_DIFF_MEAN = "tlt/rollout_logp_diff_mean"  # |vLLM - policy| log-prob of the sampled tokens
ROLLOUT_LOGP_DIFF_MAX = "tlt/rollout_logp_diff_max"
ROLLOUT_SEQ_LOGP_DIFF_MAX = "tlt/rollout_seq_logp_diff_max"  # the largest sum over one completion
ROLLOUT_IS_OUTSIDE_CLIP_FRACTION = "tlt/rollout_is_outside_clip_fraction"  # completions TRL masked or clipped
ROLLOUT_DTYPE_MATCHES_POLICY = "tlt/rollout_dtype_matches_policy"  # 1 when vLLM computes in the policy's dtype
