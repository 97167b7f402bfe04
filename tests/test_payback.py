"""The payback budget of drafter training (tlt_trainers/online/payback.py): training is paid from what speculation
saved, plus a small exploration share, and costs nothing more where speculation never pays."""

from __future__ import annotations

import math

import pytest

from tlt_trainers.online import PaybackBudget
from tlt_trainers.settings import DrafterSettings

STEP = 0.5  # seconds a drafter micro-step costs
ROLLOUT = 20.0  # seconds a rollout takes
CAP = 2.0  # the fixed budget: drafter_update_fraction 0.1 of the rollout


def run(budget: PaybackBudget, saved_per_rollout: float, rollouts: int) -> list[float]:
    """Seconds trained after each rollout, training whole micro-steps within the budget (at least one)."""
    trained = []
    for _ in range(rollouts):
        seconds = budget.budget(ROLLOUT, saved_per_rollout, cap=CAP)
        if seconds is None:
            trained.append(0.0)
            continue
        steps = max(1, int(seconds // STEP))
        budget.spent(steps * STEP, steps)
        trained.append(steps * STEP)
    return trained


def test_where_speculation_never_pays_training_costs_the_exploration_share():
    budget = PaybackBudget(payback_share=0.5, explore_share=0.02)
    trained = run(budget, saved_per_rollout=0.0, rollouts=50)
    # one micro-step to time it, then one whenever 2% of the rollouts bought one: 0.4 s a rollout, 0.5 s a step
    assert sum(trained) <= 0.02 * ROLLOUT * 50 + STEP
    assert sum(trained) / (ROLLOUT * 50) <= 0.021
    assert budget.skipped >= 5 and trained.count(0.0) == budget.skipped
    # lost time (speculation slower than plain) buys nothing either
    losing = PaybackBudget(payback_share=0.5, explore_share=0.02)
    assert sum(run(losing, saved_per_rollout=-3.0, rollouts=50)) == STEP  # the first, timing step only
    assert losing.credit == 0.0


def test_where_speculation_pays_training_keeps_going_within_the_cap():
    budget = PaybackBudget(payback_share=0.5, explore_share=0.02)
    trained = run(budget, saved_per_rollout=3.0, rollouts=20)
    # 0.5 * 3 s saved + 0.4 s explored = 1.9 s a rollout: three micro-steps (1.5 s) each time, the rest kept
    assert all(t >= 1.5 for t in trained[1:]) and budget.skipped == 0
    assert sum(trained) <= 0.5 * 3.0 * 20 + 0.02 * ROLLOUT * 20 + STEP
    rich = PaybackBudget(payback_share=0.5, explore_share=0.02)
    assert max(run(rich, saved_per_rollout=100.0, rollouts=5)) <= CAP  # never above the fixed budget's cap


def test_the_credit_survives_a_checkpoint():
    budget = PaybackBudget()
    run(budget, saved_per_rollout=1.0, rollouts=3)
    resumed = PaybackBudget()
    resumed.load_state(budget.state())
    assert resumed.state() == budget.state()
    fresh = PaybackBudget()
    fresh.load_state({})
    assert fresh.credit == 0.0 and math.isnan(fresh.step_seconds)


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="payback_share"):
        PaybackBudget(payback_share=-1.0)
    with pytest.raises(ValueError, match="choose 'payback'"):
        DrafterSettings(drafter_update_budget="always")
    with pytest.raises(ValueError, match="drafter_explore_share"):
        DrafterSettings(drafter_explore_share=-0.1)


def test_an_update_is_capped_at_the_micro_steps_its_credit_buys():
    budget = PaybackBudget()
    assert budget.affordable_steps(3.0) is None  # nothing timed yet
    budget.spent(1.0, steps=2)
    assert budget.affordable_steps(1.2) == 2 and budget.affordable_steps(0.1) == 1
