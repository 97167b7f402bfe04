"""The one decider of when and how much to speculate (tlt_trainers/adaptive/decider.py): its rules alone, then both of
its adapters (TLT's engine's StrategySelector, vLLM's AdaptiveSpeculation) driven by the same injected step costs and
acceptance, which must decide the same at every step.

``PYTHONPATH=$PWD python tests/test_decider.py`` prints the scripted scenario's decision table (markdown).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tlt_trainers.adaptive.decider import DecisionRules, Estimate, SpeculationDecider
from tlt_trainers.proposers.strategy import NONE, parse_strategy
from tlt_trainers.rollout.costs import CostProfile, selector_bucket
from tlt_trainers.rollout.selector import StrategySelector
from tlt_trainers.vllm.schedule import AdaptiveSpeculation, SpeculationSettings

# ------------------------------------------------------------------------------------------------ the rules alone


def priced(table: dict[str, Estimate]):
    """An engine whose arms are names, priced from ``table``; remembers which arms were priced."""
    asked: list[str] = []

    def estimate(arm: str) -> Estimate:
        asked.append(arm)
        return table[arm]

    return estimate, asked


def test_plain_where_nothing_is_priced():
    decider = SpeculationDecider(DecisionRules(), "plain")
    estimate, _ = priced({"a": Estimate("a", tokens=3.0, cost=math.inf)})
    decision = decider.choose(1, ["a"], estimate)
    assert decision.arm == "plain" and not decision.speculative and decision.reason == "measuring plain"
    assert decision.expected_speedup == 1.0 and decision.changed  # a bucket's first decision is a change


def test_an_arm_must_clear_the_margin():
    rules = DecisionRules(min_speedup=1.25)
    estimate, _ = priced({"below": Estimate("below", tokens=1.24, cost=1.0),
                          "at": Estimate("at", tokens=2.5, cost=2.0),
                          "above": Estimate("above", tokens=2.6, cost=2.0)})
    assert SpeculationDecider(rules, "plain").choose(1, ["below", "at"], estimate).arm == "plain"
    decision = SpeculationDecider(rules, "plain").choose(1, ["below", "at", "above"], estimate)
    assert decision.arm == "above" and decision.expected_speedup == pytest.approx(1.3)
    assert decision.reason.startswith("trial")  # not measured yet


def test_optimism_about_acceptance_only_where_a_wrong_guess_is_cheap():
    rules = DecisionRules(explore_below=1.3)
    cheap = Estimate("cheap", tokens=1.0, cost=1.2, optimistic_tokens=2.0)
    dear = Estimate("dear", tokens=1.0, cost=1.5, optimistic_tokens=4.0)
    assert rules.value(cheap) == pytest.approx(2.0 / 1.2) and rules.value(cheap, optimism=False) == pytest.approx(
        1.0 / 1.2)
    assert rules.value(dear) == pytest.approx(1.0 / 1.5)  # its optimistic acceptance would have said 2.7x
    doubted = Estimate("doubted", tokens=2.0, cost=2.0, optimistic_cost=1.0)  # a timed cost not doubted yet
    assert rules.value(doubted) == pytest.approx(2.0) and rules.value(doubted, optimism=False) == pytest.approx(1.0)
    estimate, _ = priced({"cheap": cheap, "dear": dear})
    assert SpeculationDecider(rules, "plain").choose(1, ["dear", "cheap"], estimate).arm == "cheap"


def test_the_floor_keeps_a_measured_loser_out_whatever_optimism_says():
    rules = DecisionRules(min_speedup=1.25, floor=0.97)
    loser = Estimate("x", tokens=0.9, cost=1.0, optimistic_tokens=2.0, measured=True)  # 0.9x measured
    estimate, _ = priced({"x": loser})
    assert SpeculationDecider(rules, "plain").choose(1, ["x"], estimate).arm == "plain"
    unmeasured = Estimate("x", tokens=0.9, cost=1.0, optimistic_tokens=2.0, measured=False)
    estimate, _ = priced({"x": unmeasured})
    assert SpeculationDecider(rules, "plain").choose(1, ["x"], estimate).arm == "x"  # exploration may try it
    near = Estimate("x", tokens=0.98, cost=1.0, optimistic_tokens=2.0, measured=True)  # above the floor
    estimate, _ = priced({"x": near})
    assert SpeculationDecider(rules, "plain").choose(1, ["x"], estimate).arm == "x"
    # a margin set below the floor lowers the floor with it: such a setting asks for losing arms
    assert DecisionRules(min_speedup=0.5).effective_floor == 0.5
    estimate, _ = priced({"x": loser})
    assert SpeculationDecider(DecisionRules(min_speedup=0.5), "plain").choose(1, ["x"], estimate).arm == "x"


def test_a_stale_plain_reference_is_measured_again_before_speculating():
    decider = SpeculationDecider(DecisionRules(refresh_steps=4), "plain")
    estimate, _ = priced({"x": Estimate("x", tokens=3.0, cost=1.5, measured=True)})
    assert decider.choose(1, ["x"], estimate).arm == "x"  # never measured plain: the engine's prediction stands
    decider.plain_measured(1)
    for _ in range(3):
        decider.step_taken()
        assert decider.choose(1, ["x"], estimate).arm == "x"
    decider.step_taken()  # four steps since the plain one
    decision = decider.choose(1, ["x"], estimate)
    assert decision.arm == "plain" and decision.reason == "plain refresh" and decision.changed
    assert decider.choose(2, ["x"], estimate).arm == "x"  # another bucket's reference is its own
    decider.plain_measured(1)
    assert decider.choose(1, ["x"], estimate).arm == "x"
    assert decider.chosen[1] == {"x": 5, "plain": 1}


def test_the_batch_cap_and_the_reasons_of_a_switch():
    decider = SpeculationDecider(DecisionRules(max_batch=4), "plain")
    estimate, asked = priced({"x": Estimate("x", tokens=3.0, cost=1.5, measured=True)})
    decision = decider.choose(8, ["x"], estimate)
    assert decision.arm == "plain" and decision.reason.startswith("above max batch") and asked == []
    assert decider.choose(4, ["x"], estimate).reason == "pays (2.00x)"
    estimate, _ = priced({"x": Estimate("x", tokens=1.5, cost=1.5, measured=True)})
    decision = decider.choose(4, ["x"], estimate)
    assert decision.arm == "plain" and decision.reason == "loses (1.00x)" and decision.changed
    assert decider.choose(4, ["x"], estimate).reason == "off"


def test_an_arm_bounded_below_the_best_is_not_priced():
    estimate, asked = priced({"a": Estimate("a", tokens=3.0, cost=1.0), "b": Estimate("b", tokens=9.0, cost=1.0)})
    bounds = {"a": math.inf, "b": 2.0}  # b could be worth 2x at most: not worth pricing once a is at 3x
    decision = SpeculationDecider(DecisionRules(), "plain").choose(1, ["a", "b"], estimate, bounds.__getitem__)
    assert decision.arm == "a" and asked == ["a"]


def test_both_adapters_map_their_settings_onto_the_rules():
    """The engine's selector arguments (TLTConfig.min_speedup reaches it) and vLLM's SpeculationSettings become the
    decider's rules: min_gain is the margin over 1."""
    selector = StrategySelector([parse_strategy("chain:3")], CostProfile(), min_speedup=1.4, refresh_steps=7,
                                explore_below=1.1)
    rules = selector.decider.rules
    assert (rules.min_speedup, rules.refresh_steps, rules.explore_below) == (1.4, 7, 1.1)
    schedule = AdaptiveSpeculation(SpeculationSettings(min_gain=0.1, refresh_steps=9, max_speculative_batch_size=8,
                                                       floor=0.9, explore_below=1.2))
    rules = schedule.decider.rules
    assert (rules.min_speedup, rules.refresh_steps, rules.max_batch, rules.floor, rules.explore_below) == (
        pytest.approx(1.1), 9, 8, 0.9, 1.2)
    # ...and the mapped rules decide by them: an arm worth 1.15x clears vLLM's 1.1 margin and not the engine's 1.4;
    # one worth 1.45x clears both; batch 16 is above vLLM's max_speculative_batch_size
    for worth, engine_takes, vllm_takes in ((1.15, False, True), (1.45, True, True)):
        estimate, _ = priced({"a": Estimate("a", tokens=2.0 * worth, cost=2.0)})
        taken = [SpeculationDecider(adapter.decider.rules, "plain").choose(1, ["a"], estimate).arm == "a"
                 for adapter in (selector, schedule)]
        assert taken == [engine_takes, vllm_takes], (worth, taken)
    estimate, _ = priced({"a": Estimate("a", tokens=2.9, cost=2.0)})
    assert SpeculationDecider(schedule.decider.rules, "plain").choose(16, ["a"], estimate).arm == "plain"


# ------------------------------------------------------------------------------------------------ both adapters

K = 3
CHAIN = parse_strategy(f"chain:{K}")
# Spec step seconds per plain step, by batch size: a CPU-like device (a verify of k + 1 tokens dearer the more rows).
COST_RATIO = {1: 1.4, 2: 1.5, 4: 1.7, 8: 2.0, 16: 3.4, 32: 4.0, 64: 5.0, 256: 9.0}


def plain_seconds(batch: int) -> float:
    """A plain step: a fixed share plus a share per row (the cost model's own shape, so that its predictions are
    exact and the engine's plain pace is 1: the two adapters then see the same costs)."""
    return 0.05 * (1 + 0.11 * batch)


@dataclass(frozen=True)
class Step:
    batch: int
    accepted_per_position: tuple[int, ...]  # per request with a draft: 1 if draft token i was accepted


def rollout(batches: list[tuple[int, int]], accepted: tuple[int, ...]) -> list[Step]:
    return [Step(batch, accepted) for batch, steps in batches for _ in range(steps)]


TRAINED = (1, 1, 1)  # every draft token accepted: 4 tokens per verify step
UNTRAINED = (0, 0, 0)
SHRINKING = [(64, 3), (32, 3), (16, 3), (8, 3), (4, 3), (2, 3), (1, 50)]
# First an engine's warm-up: a step at batch 1 and one at 256 seed the plain-cost curve (the engine extrapolates from
# one size with its device prior; vLLM does not predict beyond the sizes its plain steps cover). Then two rollouts
# whose batch shrinks as rows finish, with a trained drafter; then a rollout with an untrained one.
SCENARIOS = {
    "trained": rollout([(1, 1), (256, 1)] + SHRINKING + [(64, 4), (32, 4), (16, 8), (8, 8), (4, 8), (2, 8), (1, 20)],
                       TRAINED),
    "untrained": rollout([(1, 1), (256, 1)] + SHRINKING, UNTRAINED),
}


def make_engine_selector() -> StrategySelector:
    """TLT's engine's adapter: a chain of K as its only arm, costs learnt online (no timed table)."""
    return StrategySelector([CHAIN], CostProfile(drafter_share=0.05), exploration=0.0)


def make_vllm_schedule() -> AdaptiveSpeculation:
    """vLLM's adapter with the same rules and an acceptance prior equal to the engine's for a chain of K. The two
    forget acceptance on their own clocks (the engine's window of steps, vLLM's interval without drafts): set equal
    here, so that a drafter that lost is retried at the same step by both."""
    return AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K, cost_cache="off",
                                                   prior_accepted_per_position=(0.45, 0.25, 0.25),
                                                   explore_interval=make_engine_selector().window))


@dataclass
class Row:
    step: int
    batch: int
    cost_ratio: float
    tokens: float
    engine: str
    vllm: str
    engine_reason: str
    vllm_reason: str

    @property
    def same(self) -> bool:
        """The same decision (speculate or not, and the length) for the same kind of reason. A bucket without a
        plain step is "measuring plain" on vLLM (its costs are all measured) and "off" in the engine (whose cost
        curve prices it): plain either way."""
        length = "0" if self.engine == "none" else self.engine.removeprefix("chain:")
        return length == self.vllm and reason_kind(self.engine_reason) == reason_kind(self.vllm_reason)


def reason_kind(reason: str) -> str:
    kind = reason.split()[0]
    return "off" if kind == "measuring" else kind


def drive(scenario: list[Step]) -> list[Row]:
    """Both adapters through the scenario: each chooses, the step costs the injected seconds for what it chose, and
    its drafts are accepted as injected. Every step is measured (this harness knows its steps' seconds exactly)."""
    engine, schedule = make_engine_selector(), make_vllm_schedule()
    rows = []
    for number, step in enumerate(scenario, 1):
        strategy = engine.choose(step.batch)
        length = schedule.choose(step.batch)
        ratio = COST_RATIO[selector_bucket(step.batch)]
        tokens = 1 + sum(step.accepted_per_position[:K])
        rows.append(Row(number, step.batch, ratio, tokens, strategy.name, str(length),
                        engine.decider.last_decision.reason, schedule.decider.last_decision.reason))
        engine_seconds = plain_seconds(step.batch) * (ratio if strategy != NONE else 1.0)
        emitted = tokens * step.batch if strategy != NONE else step.batch
        engine.observe(strategy, step.batch, round(emitted), engine_seconds, expected_emitted=emitted)
        schedule.observe_step(step.batch, length, plain_seconds(step.batch) * (ratio if length else 1.0))
        if length:
            schedule.observe_drafts(step.batch, [a * step.batch for a in step.accepted_per_position[:length]])
    return rows



def decision_table(rows: list[Row]) -> str:
    """Markdown: one line per run of steps with the same batch, decisions and kind of reason."""
    lines = ["| steps | batch | injected cost ratio | injected tokens per verify | engine | vLLM | reason (vLLM's) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    runs: list[list[Row]] = []
    for row in rows:
        last = runs[-1][-1] if runs else None
        if last is not None and (last.batch, last.engine, last.vllm, last.vllm_reason.split()[0]) == (
                row.batch, row.engine, row.vllm, row.vllm_reason.split()[0]):
            runs[-1].append(row)
        else:
            runs.append([row])
    for run in runs:
        first, last = run[0], run[-1]
        steps = str(first.step) if first is last else f"{first.step}-{last.step}"
        reasons = sorted({r.vllm_reason for r in run}, key=[r.vllm_reason for r in run].index)
        lines.append(f"| {steps} | {first.batch} | {first.cost_ratio:.2f} | {first.tokens:g} | {first.engine} | "
                     f"{first.vllm} | {'; '.join(reasons[:2]) + ('; ...' if len(reasons) > 2 else '')} |")
    return "\n".join(lines)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_both_adapters_decide_the_same_step_by_step(name):
    rows = drive(SCENARIOS[name])
    differing = [row for row in rows if not row.same]
    assert not differing, f"the adapters disagree:\n{decision_table(differing)}"
    assert all(row.vllm == "0" for row in rows[:20])  # the warm-up and the head of the first rollout: plain
    assert rows[20].vllm == str(K) and rows[20].vllm_reason.startswith("trial")  # the tail: tried
    speculative = [row for row in rows if row.vllm != "0"]
    if name == "untrained":
        assert len(speculative) == 1  # one trial, measured to lose, and not retried within the window
        assert rows[21].vllm_reason.startswith("loses")
        return
    second = rows[70:]  # the second rollout, with the acceptance known
    assert all(row.vllm == "0" for row in second if row.batch >= 32)  # verifying 4 tokens a row costs 4-5x there
    at_16 = [row.vllm for row in second if row.batch == 16]
    assert at_16.count(str(K)) == 1 and any(r.vllm_reason.startswith("loses") for r in second if r.batch == 16)
    for batch in (8, 4, 2, 1):  # 4 tokens per verify at 1.4-2x a plain step: speculation pays
        assert [row.vllm for row in second if row.batch == batch][-3:] == [str(K)] * 3
    refreshes = [row.step for row in rows if row.vllm_reason == "plain refresh"]
    at_batch_1 = [(a, b) for a, b in zip(refreshes, refreshes[1:]) if rows[a - 1].batch == 1 == rows[b - 1].batch]
    assert at_batch_1, refreshes  # the check below is not vacuous
    assert all(b - a <= 33 for a, b in at_batch_1), at_batch_1  # the plain pace at batch 1 re-measured every 32


def test_neither_adapter_keeps_a_length_measured_under_the_floor():
    """A drafter worth 0.92x at batch 1 (1.1 tokens per verify at 1.2 plain steps): exploration may try it, but once
    its price is measured neither adapter chooses it while that measurement stands, though the engine's exploration
    bonus alone would have (the floor binds: the test is not vacuous)."""
    ratio, accepted = 1.2, (1, 0, 0)

    def tokens(step: int) -> float:  # one step in ten has its first draft token accepted
        return 1 + (step % 10 == 0)

    engine = StrategySelector([CHAIN], CostProfile(drafter_share=0.05), exploration=0.3)
    schedule = make_vllm_schedule()
    seen: list[Estimate] = []  # the prices each adapter gave its decider
    for adapter in (engine, schedule):
        price = adapter.estimate
        adapter.estimate = lambda *args, price=price: seen.append(price(*args)) or seen[-1]
    rules = engine.decider.rules
    bound_by_floor = speculated = 0
    for step in range(600):
        seen.clear()
        chosen = [engine.choose(1) != NONE, schedule.choose(1) != 0]
        assert len(seen) == 2
        for found, speculative in zip(seen, chosen):
            measured_loser = found.measured and rules.value(found, optimism=False) < rules.floor
            assert not (measured_loser and speculative), (step, found)
            bound_by_floor += measured_loser and rules.value(found) > rules.min_speedup
            speculated += speculative
        t = tokens(step)
        engine.observe(CHAIN if chosen[0] else NONE, 1, round(t) if chosen[0] else 1,
                       plain_seconds(1) * (ratio if chosen[0] else 1.0), expected_emitted=t if chosen[0] else 1)
        schedule.observe_step(1, K if chosen[1] else 0, plain_seconds(1) * (ratio if chosen[1] else 1.0))
        if chosen[1]:
            schedule.observe_drafts(10, [10 * (t - 1), 0, 0])
    assert accepted and bound_by_floor > 0 and 0 < speculated < 60


if __name__ == "__main__":
    for name, scenario in SCENARIOS.items():
        print(f"**{name} drafter**\n\n{decision_table(drive(scenario))}\n")
