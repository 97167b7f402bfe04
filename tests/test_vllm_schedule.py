"""The adaptive speculative-length schedule for vLLM (tlt_trainers/vllm/schedule.py), driven by injected step costs and
acceptance: no vLLM needed. The scheduler that feeds it inside a real engine is tested in tests/test_vllm.py."""

from __future__ import annotations

import json
import math

import pytest

from tlt_trainers.vllm.config import ADAPTIVE_SCHEDULER, GUARD_SCHEDULER, speculation_schedule
from tlt_trainers.vllm.schedule import AdaptiveSpeculation, SpeculationSettings, acceptance_from_top1

K = 3


def cpu_like_cost(batch: int, length: int) -> float:
    """Seconds of a step: a CPU-like device, where verifying k + 1 tokens per row costs more the larger the batch
    (1.3x plain at batch 1, about 3x at 32) and each of the k drafter passes costs 3% of a plain step."""
    plain = 0.05 * (1 + 0.2 * batch)
    if length == 0:
        return plain
    return plain * (1 + length * (0.1 + 0.02 * batch)) + 0.03 * length * 0.05


def run(schedule: AdaptiveSpeculation, batch: int, steps: int, accepted_per_position: tuple[int, ...],
        cost=cpu_like_cost) -> list[int]:
    """``steps`` engine steps at ``batch`` running requests; every draft has ``accepted_per_position`` accepted
    (per batch row, as counts over the batch). Returns the lengths chosen."""
    chosen, previous = [], None
    for _ in range(steps):
        length = schedule.choose(batch)
        if previous == length:  # a switching step is not a clean measurement (the engine does not count it either)
            schedule.observe_step(batch, length, cost(batch, length))
            if length:
                schedule.observe_drafts(batch, [a * batch for a in accepted_per_position])
        chosen.append(length)
        previous = length
    return chosen


GOOD = (1, 1, 1)  # every draft fully accepted: 4 tokens per verify step
USELESS = (0, 0, 0)  # an untrained drafter


def test_an_untrained_drafter_is_tried_then_switched_off_everywhere():
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    for batch in (32, 8, 1):
        chosen = run(schedule, batch, 200, USELESS)
        assert chosen[-100:].count(K) <= 5, (batch, chosen)  # at most one trial (backing off) in the last 100
        assert chosen.count(K) <= 15  # a few trial steps, not more
    assert schedule.expected_tokens(K) == 1.0
    assert all(length == 0 for length in schedule.schedule().values())
    reasons = [d["reason"] for d in schedule.decisions]
    assert any(r.startswith("trial") for r in reasons) and any(r.startswith("loses") for r in reasons)


def test_a_good_drafter_speculates_where_it_pays_and_not_where_it_does_not():
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    at_1 = run(schedule, 1, 200, GOOD)
    assert at_1[-100:].count(K) >= 90  # plain refreshes now and then
    # at batch 64 a chain costs 1 + 3 * 1.38 = 5.1x plain: 4 tokens per step do not pay for it
    at_64 = run(schedule, 64, 200, GOOD)
    assert at_64[-100:] == [0] * 100
    assert schedule.schedule()[1] == K and schedule.schedule()[64] == 0
    # the decision follows the measured costs: value = tokens * plain / speculative
    assert schedule.value(1, K) == pytest.approx(4 * cpu_like_cost(1, 0) / cpu_like_cost(1, K), rel=1e-6)


def test_costs_decide_on_a_gpu_like_device_too():
    """Where a verify pass over k + 1 tokens costs about what one token costs (a GPU at small batch), a drafter
    accepting one token in two pays at every batch size measured."""
    def gpu(batch, length):
        return 0.02 * (1 + 0.01 * batch) * (1 + 0.05 * length)

    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    for batch in (64, 16, 1):
        chosen = run(schedule, batch, 150, (1, 0, 0), cost=gpu)
        assert chosen[-50:].count(K) >= 45, (batch, chosen[-50:])


def test_a_drafter_that_gets_better_gets_switched_on():
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    assert run(schedule, 2, 300, USELESS)[-100:].count(K) <= 5
    schedule.note_drafter_update()  # a trained drafter was pushed into the engine
    assert run(schedule, 2, 100, GOOD)[-50:].count(K) >= 45
    assert schedule.drafter_updates == 1


def test_an_update_is_tried_where_its_trained_acceptance_pays_at_the_measured_cost():
    """Where a verify step costs 1.7 plain steps, the fixed prior (2 tokens a step) cannot pay 1.25x: a pushed
    drafter is tried again only on the acceptance its training measured (as on a slow CPU in CI, where a real
    trained drafter was never retried)."""
    def slow(batch, length):
        return 0.05 * (1.7 if length else 1.0)

    def after_update(expected) -> list[int]:
        schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
        assert run(schedule, 1, 100, USELESS, cost=slow)[-50:].count(K) == 0
        schedule.note_drafter_update(expected)
        return run(schedule, 1, 100, GOOD, cost=slow)

    assert after_update(None).count(K) == 0  # the prior: 2.0 / 1.7 = 1.18x, not worth a trial
    assert after_update(acceptance_from_top1(0.3, K)).count(K) == 0  # 1.42 tokens: 0.84x
    assert after_update(acceptance_from_top1(0.8, K))[-50:].count(K) >= 45  # 2.95 tokens: 1.74x, then measured


def test_acceptance_from_training_agreement():
    assert acceptance_from_top1(0.5, 3) == pytest.approx((0.5, 0.25, 0.125))
    assert acceptance_from_top1([0.8, 0.5], 3) == pytest.approx((0.8, 0.4, 0.2))  # the last step's repeated
    assert acceptance_from_top1(float("nan"), 3) == () and acceptance_from_top1([], 3) == ()
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    with pytest.raises(ValueError, match="one chance in"):
        schedule.note_drafter_update([1.5])
    schedule.note_drafter_update(())  # no figure: the fixed prior
    assert schedule.expected_tokens(K) == pytest.approx(2.0)


def test_without_an_update_signal_exploration_finds_the_better_drafter():
    """A server whose drafter improved without telling the schedule (only vLLM's prefix-cache reset after a weight
    sync): trials resume within the exploration interval."""
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K, explore_interval=16))
    assert run(schedule, 1, 300, USELESS)[-100:].count(K) <= 5
    schedule.note_weights_may_have_changed()
    chosen = run(schedule, 1, 200, GOOD)
    assert chosen[-50:].count(K) >= 45, chosen


def test_exploration_of_a_losing_drafter_backs_off():
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K, explore_interval=8))
    chosen = run(schedule, 1, 3000, USELESS)
    trials = sum(1 for d in schedule.decisions if d["reason"].startswith("trial"))
    assert sum(1 for length in chosen if length) / len(chosen) < 0.02
    assert trials <= 10  # 8, 16, 32, ... steps between trials: logarithmic in the steps


def test_max_speculative_batch_size_caps_the_schedule():
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K, max_speculative_batch_size=4))
    assert set(run(schedule, 8, 100, GOOD)) == {0}
    assert K in run(schedule, 4, 100, GOOD)


def test_acceptance_is_a_window_of_recent_drafts():
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K, window_drafts=10))
    assert schedule.expected_tokens(K) == pytest.approx(1 + 0.5 + 0.3 + 0.2)  # the prior, before any draft
    schedule.observe_drafts(10, [10, 10, 10])
    assert schedule.expected_tokens(K) == 4.0 and schedule.expected_tokens(1) == 2.0
    schedule.observe_drafts(10, [0, 0, 0])  # the older drafts leave the window
    assert schedule.expected_tokens(K) == 1.0
    schedule.note_weights_may_have_changed()
    assert schedule.expected_tokens(K) == 1.0  # kept until new drafts arrive ...
    schedule.observe_drafts(4, [2, 0, 0])
    assert schedule.expected_tokens(K) == 1.5  # ... which replace them
    assert math.isnan(schedule.value(1, K))  # no cost measured yet


def test_settings_are_checked_and_the_engine_arguments_built(monkeypatch):
    from tlt_trainers.vllm import config

    spec, engine = speculation_schedule("adaptive", 3)
    assert engine["scheduler_cls"] == ADAPTIVE_SCHEDULER
    assert engine["additional_config"]["tlt_speculation"] == {"num_speculative_tokens": 3,
                                                              "max_speculative_batch_size": None}
    assert spec["num_speculative_tokens_per_batch_size"][0] == (1, 32, 3)  # vLLM's dynamic mode, on
    monkeypatch.setattr(config, "_vllm_on_cpu", lambda: False)
    spec, engine = speculation_schedule("always", 3, 8)
    assert engine == {} and spec["num_speculative_tokens_per_batch_size"] == [(1, 8, 3), (9, 1 << 16, 0)]
    assert speculation_schedule("always", 3) == ({}, {})
    # vLLM's CPU backend: the guard scheduler, which needs a per-step length (a one-bucket schedule)
    monkeypatch.setattr(config, "_vllm_on_cpu", lambda: True)
    spec, engine = speculation_schedule("always", 3)
    assert engine == {"scheduler_cls": GUARD_SCHEDULER}
    assert spec["num_speculative_tokens_per_batch_size"] == [(1, 1 << 16, 3)]
    with pytest.raises(ValueError, match="never"):
        speculation_schedule("never", 3)
    with pytest.raises(ValueError, match="one of"):
        speculation_schedule("sometimes", 3)
    with pytest.raises(ValueError, match="max_speculative_batch_size"):
        speculation_schedule("adaptive", 3, 0)
    with pytest.raises(TypeError):
        speculation_schedule("adaptive", 3, min_gian=0.1)  # a misspelt setting fails here, not in the engine


def test_a_bucket_not_measured_yet_is_costed_from_the_plain_steps_over_as_many_rows():
    """The cost model of TLT's own engine: a verify of k + 1 tokens for b requests costs about a plain step of
    b * (k + 1) requests. Where the plain steps cover that size, a bucket is not tried on the prior's acceptance
    alone (which would have started a trial at 16 requests on this CPU-like device); where they do not, it is."""
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    for batch in (64, 32, 16):  # the head of a rollout: plain steps only
        for _ in range(3):
            schedule.observe_step(batch, 0, cpu_like_cost(batch, 0))
    assert schedule._unmeasured_ratio(16, 16) == pytest.approx(
        (cpu_like_cost(64, 0) + K * 0.05 * cpu_like_cost(16, 0)) / cpu_like_cost(16, 0))
    assert [schedule.choose(16) for _ in range(5)] == [0] * 5
    fresh = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    fresh.observe_step(1, 0, cpu_like_cost(1, 0))
    assert fresh._unmeasured_ratio(1, 1) == 1.0  # 4 rows not measured: no prediction beyond the plain steps
    assert fresh.choose(1) == K  # a trial, as before


def test_measured_costs_carry_over_to_the_next_engine():
    """What one engine measured starts the next (the scheduler stores it in the persistent cost cache); entries that
    do not parse are skipped."""
    first = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    run(first, 1, 100, GOOD)
    run(first, 8, 100, USELESS)
    second = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    second.merge_dict(json.loads(json.dumps(first.to_dict())))
    for key in (1, 8):
        assert second.cost_ratio(key, K) == pytest.approx(first.cost_ratio(key, K))
    assert second.profile.plain == pytest.approx(first.profile.plain)
    damaged = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    damaged.merge_dict({"buckets": {"1": {"0": [0.1, 2], "3": ["x", 1], "4": [-1.0, 3]}, "y": {"0": [1, 1]}},
                        "profile": {"plain": {"1": 0.1}}})
    assert set(damaged.buckets) == {1} and set(damaged.buckets[1].costs) == {0}
    assert damaged.profile.plain == {1: 0.1}


def test_a_speculative_step_is_never_priced_below_a_plain_one():
    """Plain steps timed in a burst of slowness made a chain read cheaper than plain (0.6x) on a shared CPU, and a
    drafter whose drafts were all rejected was kept on; as in TLT's engine, the price is at least one plain step."""
    schedule = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    schedule.observe_step(1, 0, 0.10)
    schedule.observe_step(1, K, 0.06)
    assert schedule.cost_ratio(1, K) == pytest.approx(0.6)  # what was measured ...
    assert schedule.relative_cost(1, K) == 1.0  # ... is not what a decision is priced at
    for _ in range(8):  # rejected drafts: 1 token per step
        schedule.observe_drafts(1, [0, 0, 0])
    assert [schedule.choose(1) for _ in range(20)] == [0] * 20


def test_saved_seconds_count_what_speculation_saved_and_lost():
    """Each timed speculative step saves its tokens at the bucket's plain cost per token minus what it took: a good
    drafter at batch 1 (4 tokens for 1.3x a plain step) saves 2.7 plain steps a step, a useless one loses 0.3."""
    good = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    chosen = run(good, 1, 100, GOOD)
    plain, step = cpu_like_cost(1, 0), cpu_like_cost(1, K)
    timed = sum(1 for a, b in zip(chosen, chosen[1:]) if a == b == K)  # steps after a switch are not timed
    assert good.saved_seconds == pytest.approx(timed * (4 * plain - step), rel=1e-6) and timed >= 80
    useless = AdaptiveSpeculation(SpeculationSettings(num_speculative_tokens=K))
    run(useless, 1, 100, USELESS)
    assert -3 * (step - plain) <= useless.saved_seconds < 0  # a trial's few steps, then plain: nothing more lost
    assert useless.state()["saved_seconds"] == useless.saved_seconds
