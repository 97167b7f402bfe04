"""The adaptive selector: speculate where the measured costs and acceptance say it pays, nowhere else."""

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.proposers.strategy import NONE, Strategy, parse_strategy, tlt_prior
from tlt_trainers.rollout.costs import CostProfile, monotone_envelope, selector_bucket
from tlt_trainers.rollout.selector import StrategySelector

ARMS = [parse_strategy(n) for n in ("chain:4", "tree:4x2:8", "tree:8x4:32")]


def synthetic_profile() -> CostProfile:
    """Batch 1: extra tokens nearly free (GPU-like long tail); batch 64: cost grows with every token."""
    profile = CostProfile()
    for batch, slope in ((1, 0.01), (64, 0.5)):
        for q in (1, 5, 9, 33):
            profile.verify[(batch, q)] = 0.01 * batch ** 0.5 * (1 + slope * (q - 1))
        for width in (1, 2, 4):
            profile.draft[(batch, width)] = 0.0005 * batch ** 0.5
    return profile


def feed(selector, strategy, batch, tokens_per_row, steps=20):
    for _ in range(steps):
        seconds = selector.profile.step_seconds(strategy, batch)
        selector.observe(strategy, batch, int(tokens_per_row * batch), seconds)


def test_plain_decoding_at_large_batch_speculation_in_the_tail():
    selector = StrategySelector(ARMS, synthetic_profile())
    assert selector.choose(64) == NONE
    assert selector.choose(1).kind != "none"


def test_tlt_table_is_the_first_choice_where_it_is_affordable():
    arms = ARMS + [tlt_prior(1)]
    selector = StrategySelector(arms, synthetic_profile(), exploration=0.0)
    profile = selector.profile
    for q in (49,):
        profile.verify[(1, q)] = 0.01 * (1 + 0.01 * (q - 1))
        profile.verify[(64, q)] = 0.08 * (1 + 0.5 * (q - 1))
    assert selector.choose(1) == tlt_prior(1)


def test_poor_acceptance_switches_speculation_off():
    selector = StrategySelector(ARMS, synthetic_profile(), exploration=0.0)
    for arm in ARMS:
        feed(selector, arm, 1, tokens_per_row=1.0)
    assert selector.choose(1) == NONE


def test_measured_acceptance_picks_the_best_arm():
    selector = StrategySelector(ARMS, synthetic_profile(), exploration=0.0)
    feed(selector, ARMS[0], 1, 1.5)
    feed(selector, ARMS[1], 1, 1.6)
    feed(selector, ARMS[2], 1, 4.0)
    assert selector.choose(1) == ARMS[2]
    shared = (20 * 4.0 + 2 * selector._prior(ARMS[2], 1)) / 22  # the prior counts as 2 observations
    own_bucket = (20 * 4.0 + selector.bucket_weight * shared) / (20 + selector.bucket_weight)
    assert selector.acceptance(ARMS[2], 1) == pytest.approx(own_bucket)


def test_slow_steps_raise_the_measured_cost_of_their_bucket_only():
    selector = StrategySelector(ARMS, synthetic_profile(), exploration=0.0)
    feed(selector, ARMS[2], 1, 4.0)
    before = selector.relative_cost(ARMS[2], 1)
    for _ in range(30):  # the device turns out 5x slower for this strategy at batch 1 than profiled
        selector.observe(ARMS[2], 1, 4, 5 * selector.profile.step_seconds(ARMS[2], 1))
    assert selector.relative_cost(ARMS[2], 1) > 4 * before
    assert selector.relative_cost(ARMS[2], 2) == pytest.approx(selector.profile.step_seconds(ARMS[2], 2)
                                                               / selector.profile.step_seconds(NONE, 2))
    assert selector.choose(1) != ARMS[2]


def test_a_step_that_captured_a_graph_prices_nothing():
    """The step during which a CUDA graph was captured paid for the capture (a one-off, often 100x a step): its
    tokens count, its seconds neither correct the strategy's cost nor the plain pace; without the flag they would."""
    def after_one_capture_step(costed: bool) -> StrategySelector:
        selector = StrategySelector(ARMS, synthetic_profile(), exploration=0.0)
        feed(selector, ARMS[0], 1, 3.0)
        selector.observe(ARMS[0], 1, 3, 100 * selector.profile.step_seconds(ARMS[0], 1), costed=costed)
        return selector

    clean, priced = after_one_capture_step(costed=False), after_one_capture_step(costed=True)
    reference = StrategySelector(ARMS, synthetic_profile(), exploration=0.0)
    feed(reference, ARMS[0], 1, 3.0)
    assert clean.relative_cost(ARMS[0], 1) == reference.relative_cost(ARMS[0], 1)
    assert priced.relative_cost(ARMS[0], 1) > 2 * reference.relative_cost(ARMS[0], 1)
    plain_capture = StrategySelector(ARMS, synthetic_profile(), exploration=0.0)
    plain_capture.observe(NONE, 1, 1, 100 * plain_capture.profile.step_seconds(NONE, 1), costed=False)
    assert plain_capture.pace == {} and plain_capture.plain_seen == {}
    assert len(clean.observed[ARMS[0].name]) == len(reference.observed[ARMS[0].name]) + 1  # its tokens count


def test_the_engine_prices_nothing_for_a_step_during_which_a_graph_was_captured(monkeypatch):
    """The engine's own wiring (``Rollout.step``: ``costed`` from the runners' capture attempts): a faked capture,
    with the 100x seconds a real one costs, in one step of a real rollout. That step's seconds reach neither the
    plain pace nor any cost correction, and every other step is priced."""
    from tlt_trainers import Eagle3Drafter

    torch.manual_seed(0)
    model = tiny_model("llama", logit_scale=4.0, num_hidden_layers=4)
    drafter = Eagle3Drafter.from_target(model, aux_layer_ids=[0, 1, 3])
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="adaptive", cuda_graphs="static"))
    ids, mask = padded_prompts([5, 3, 8, 2], seed=3)
    rollout = engine.start(ids, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=16)
    assert rollout.step_graphs is not None and rollout.selector is not None
    costed = []
    observe = rollout.selector.observe
    monkeypatch.setattr(rollout.selector, "observe", lambda *a, **k: costed.append(k["costed"]) or observe(*a, **k))
    step_with_capture = 3
    clock = [0.0]
    monkeypatch.setattr(rollout, "_now", lambda: clock[0])
    speculative_step = rollout.speculative_step

    def step(strategy):
        clock[0] += 1.0
        if len(costed) == step_with_capture:
            rollout.step_graphs.capture_attempts += 1  # a capture tried during this step...
            clock[0] += 100.0  # ...and its cost
        return speculative_step(strategy)

    monkeypatch.setattr(rollout, "speculative_step", step)
    rollout.begin()
    selector = rollout.selector
    seen = []
    while True:
        seen.append((dict(selector.pace), dict(selector.profile.corrections), dict(selector.plain_seen)))
        if not rollout.step():
            break
    rollout.finish()
    assert len(costed) > step_with_capture + 1
    assert costed[step_with_capture] is False
    assert all(costed[:step_with_capture]) and all(costed[step_with_capture + 1:]), costed
    assert seen[step_with_capture] == seen[step_with_capture + 1]  # the capture's 101 s priced nothing


def test_window_forgets_a_stale_drafter():
    selector = StrategySelector(ARMS[:1], synthetic_profile(), window=50, exploration=0.0)
    feed(selector, ARMS[0], 1, 1.0, steps=100)
    assert selector.choose(1) == NONE
    for _ in range(60):  # plain steps elsewhere age the old observations out
        selector.observe(NONE, 64, 64, selector.profile.step_seconds(NONE, 64))
    assert selector.acceptance(ARMS[0], 1) == pytest.approx(selector._prior(ARMS[0], 1))
    assert selector.choose(1) == ARMS[0]


def test_profile_interpolates_and_refuses_unmeasured():
    profile = synthetic_profile()
    assert profile.step_seconds(NONE, 1) == pytest.approx(0.01)
    middle = profile.step_seconds(NONE, 32)
    assert profile.step_seconds(NONE, 1) < middle < profile.step_seconds(NONE, 64)
    assert profile.step_seconds(parse_strategy("tree:8x4:48"), 1) == float("inf")
    assert [selector_bucket(b) for b in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 8, 32, 64]


def test_a_slow_burst_in_the_profile_is_capped_by_larger_work():
    """Profiling on a busy CPU: (4, 1) was timed during a burst, slower than (4, 3) and (8, 1). Left alone it made
    chain:2 at batch 4 look nearly free relative to plain decoding."""
    measured = {(4, 1): 0.024, (4, 3): 0.020, (8, 1): 0.026, (8, 3): 0.033, (2, 1): 0.019}
    envelope = monotone_envelope(measured)
    assert envelope[(4, 1)] == 0.020
    assert {k: v for k, v in envelope.items() if k != (4, 1)} == {k: v for k, v in measured.items() if k != (4, 1)}
    keys = sorted(envelope)
    assert all(envelope[a] <= envelope[b] for a in keys for b in keys if b[0] >= a[0] and b[1] >= a[1])


def test_adaptive_engine_learns_costs_from_its_steps_and_stays_exact():
    """No timing pass before the first rollout: plain steps fill the cost curve at the batch sizes the rows retire
    through, and the engine stays greedy-identical to ``model.generate`` while it learns."""
    model = tiny_model("llama", logit_scale=4.0)
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="adaptive"))
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=10)
    for _ in range(2):
        ours = engine.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                               pad_token_id=PAD)
        reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=EOS,
                                   pad_token_id=PAD)
        assert torch.equal(ours.sequences, reference)
    profile = engine.cost_profile
    assert profile.seconds_spent == 0 and not profile.verify  # nothing timed outside the steps
    assert profile.plain_steps[6] > 0
    assert 0 < profile.drafter_share < 1
    summary = engine.selector(False).summary()
    assert summary["chosen"] and set(summary["acceptance"]) == {s.name for s in engine.strategies}
    assert sum(ours.stats.strategies["5-16"].values()) == ours.stats.buckets["5-16"].steps


def test_a_gain_within_the_noise_is_not_taken():
    """Predicted speedup 1.03: below a margin of 5% plain decoding stays; without a margin it is taken."""
    profile = CostProfile()
    profile.verify.update({(1, 1): 0.010, (1, 5): 0.0145})
    profile.draft.update({(1, 1): 0.0})
    arm = parse_strategy("chain:4")
    for margin, expected in ((1.05, NONE), (1.0, arm)):
        selector = StrategySelector([arm], profile, exploration=0.0, min_speedup=margin)
        feed(selector, arm, 2, tokens_per_row=1.5, steps=200)  # 1.5 / 1.45 = 1.03 (2 rows: 3 tokens a step)
        assert selector.choose(2) == expected


def test_a_bucket_that_accepts_less_than_the_tail_stops_speculating():
    """Acceptance learnt in the tail (long, repetitive rows) must not carry a bucket whose own rows accept less."""
    profile = synthetic_profile()
    for q in (1, 5, 9, 33):  # batch 64 made cheap enough that the tail's acceptance would pay there
        profile.verify[(64, q)] = 0.08 * (1 + 0.1 * (q - 1))
    arm = ARMS[0]
    selector = StrategySelector([arm], profile, exploration=0.0)
    feed(selector, arm, 1, tokens_per_row=3.0, steps=40)
    assert selector.choose(64) == arm  # the shared estimate alone says it pays
    feed(selector, arm, 64, tokens_per_row=1.0, steps=12)
    assert selector.choose(64) == NONE
    assert selector.choose(1) == arm


def history_profile() -> CostProfile:
    """Batch 1: extra tokens nearly free; batch 64: each verified token costs a third of a plain step."""
    profile = CostProfile()
    for batch, slope in ((1, 0.01), (64, 1 / 3)):
        for q in (1, 2, 3, 5, 9):
            profile.verify[(batch, q)] = 0.01 * batch ** 0.5 * (1 + slope * (q - 1))
    return profile


def test_history_arm_is_valued_from_the_steps_own_proposals():
    """Proposals cost nothing to look at: few rows with a match at large batch means plain decoding, long matches
    everywhere a chain cut to the length that pays, and the tail takes the whole chain."""
    arm = parse_strategy("history:8")
    assert arm.history_widths == (1, 2, 4, 8)
    selector = StrategySelector([arm], history_profile(), exploration=0.0)
    few = [0.1 * min(w, 6) for w in range(1, 9)]  # a tenth of the rows match 6 tokens
    assert selector.choose(64, few) == NONE
    selector.history_outcomes.append((0, 64, 1000, 1000))  # calibrated: predictions come true
    everyone = [min(w, 6) * 0.9 for w in range(1, 9)]
    chosen = selector.choose(64, everyone)
    assert chosen.kind == "history" and chosen.history_tokens == 4  # 8 costs 3.3 plain steps for 6 tokens at most
    assert selector.choose(1, everyone) == Strategy("history", history_tokens=8)


def test_history_calibration_learns_from_what_was_accepted():
    arm = parse_strategy("history:8")
    selector = StrategySelector([arm], history_profile(), exploration=0.0, min_speedup=1.15)
    expected = [min(w, 4) * 0.9 for w in range(1, 9)]  # at the 0.5 prior calibration: history:4 at 1.19x
    chosen = selector.choose(64, expected)
    assert chosen.kind == "history"
    for _ in range(10):  # the proposals' matches turn out right for a tenth of what they predicted
        chosen = selector.choose(64, expected)
        seconds = selector.profile.step_seconds(chosen, 64)  # costs as profiled
        selector.observe(chosen, 64, 64, seconds, accepted=int(0.1 * expected[chosen.history_tokens - 1] * 64))
    assert selector.history_calibration() < 0.2
    assert selector.choose(64, expected) == NONE
    assert selector.summary()["history_calibration"] == pytest.approx(selector.history_calibration())


def test_history_calibration_is_learnt_per_bucket():
    """Matches that come true in the tail must not keep a large batch verifying chains that mostly fail."""
    arm = parse_strategy("history:8")
    selector = StrategySelector([arm], history_profile(), exploration=0.0)
    expected = [min(w, 4) * 0.9 for w in range(1, 9)]
    for batch, share in ((1, 1.0), (64, 0.1)):
        for _ in range(20):
            chosen = selector.choose(batch, expected)
            assert chosen.kind == "history"
            predicted = expected[chosen.history_tokens - 1] * batch
            selector.observe(chosen, batch, batch, selector.profile.step_seconds(chosen, batch),
                             accepted=round(share * predicted))
            if selector.choose(batch, expected) == NONE:
                break
    assert selector.history_calibration(64) < 0.3 < 0.8 < selector.history_calibration(1)
    assert selector.choose(64, expected) == NONE
    assert selector.choose(1, expected).kind == "history"
    assert set(selector.summary()["history_calibration_by_bucket"]) == {1, 64}


def test_speculation_never_looks_cheaper_than_profiled():
    """Noisy step times once corrected a chain's cost below a plain step's: plain steps measured in a burst of
    slowness inflate plain's correction alone. Corrections may raise a speculative step's relative cost, never
    lower it below the profile's ratio; the default margin matches TLTConfig's."""
    arm = parse_strategy("chain:2")
    profile = CostProfile()
    profile.verify.update({(4, 1): 0.010, (4, 3): 0.015})
    profile.draft.update({(4, 1): 0.001})
    selector = StrategySelector([arm], profile, exploration=0.0)
    assert selector.min_speedup == TLTConfig().min_speedup
    plain = selector.profile.step_seconds(NONE, 4)
    for _ in range(10):  # plain steps measured slow (drift), chain steps fast
        selector.observe(NONE, 4, 4, 2.0 * plain)
        selector.observe(arm, 4, 4, 0.5 * selector.profile.step_seconds(arm, 4))
    assert selector.relative_cost(arm, 4) == pytest.approx(0.017 / 0.010)  # the profile's ratio, not below
    assert selector.relative_cost(NONE, 4) == 1.0


def test_speculative_steps_are_costed_against_the_plain_pace_of_their_time():
    """Contexts grow and this CPU drifts: plain steps measured 1.5x slower than profiled, then chain steps 1.5x
    slower too, cost what the profile says relative to each other. A bucket whose plain pace is older than
    ``refresh_steps`` takes one plain step before speculating again."""
    arm = ARMS[0]
    selector = StrategySelector([arm], synthetic_profile(), exploration=0.0, refresh_steps=10)
    feed(selector, arm, 1, tokens_per_row=3.0, steps=5)
    for _ in range(5):
        selector.observe(NONE, 1, 1, 1.5 * selector.profile.step_seconds(NONE, 1))
    for _ in range(10):
        assert selector.choose(1) == arm
        selector.observe(arm, 1, 3, 1.5 * selector.profile.step_seconds(arm, 1))
    profiled = selector.profile.step_seconds(arm, 1) / selector.profile.step_seconds(NONE, 1)
    assert selector.relative_cost(arm, 1) == pytest.approx(profiled, rel=0.02)
    assert selector.choose(1) == NONE  # 10 steps without a plain one in the bucket: refresh its pace
    selector.observe(NONE, 1, 1, 1.5 * selector.profile.step_seconds(NONE, 1))
    assert selector.choose(1) == arm


def test_the_drafters_catch_up_after_plain_steps_is_not_charged_to_the_strategy():
    """Switching from plain decoding feeds the drafter everything it sat out, a one-off paid by whichever strategy
    comes first; counted as that strategy's cost it priced a good arm out of the bucket."""
    arm = ARMS[0]
    selector = StrategySelector([arm], synthetic_profile(), exploration=0.0)
    plain = selector.profile.step_seconds(NONE, 1)
    step = selector.profile.step_seconds(arm, 1)
    selector.observe(arm, 1, 3, step + 5 * plain, catch_up_seconds=5 * plain + selector.profile.catch_up_seconds(1))
    assert selector.relative_cost(arm, 1) == pytest.approx(step / plain)
    selector.observe(arm, 1, 3, step + 5 * plain)
    assert selector.relative_cost(arm, 1) > 1.3 * step / plain  # the same seconds without the catch-up count


def test_a_speculative_step_dearer_than_believed_is_learnt_fast():
    """One step that cost twice its estimate moves the estimate half way (the loss is now); one that cost half
    moves it a fifth of the way (a gain forgone can wait for more evidence)."""
    arm = ARMS[0]
    selector = StrategySelector([arm], synthetic_profile(), exploration=0.0, cost_pessimism=0.5, cost_smoothing=0.2)
    step = selector.profile.step_seconds(arm, 64)
    selector.observe(arm, 64, 64, step)
    base = selector.relative_cost(arm, 64)
    selector.observe(arm, 64, 64, 2 * step)
    assert selector.relative_cost(arm, 64) == pytest.approx(base * 2 ** 0.5)
    selector.observe(arm, 64, 64, 0.25 * step)
    assert selector.relative_cost(arm, 64) == pytest.approx(base * (2 ** 0.5) ** 0.8 * 0.25 ** 0.2)  # = base


def test_profile_repeats_are_spread_over_passes_so_one_burst_does_not_stick(monkeypatch):
    """A burst of slowness lasting a few timings hit both back-to-back repeats of batch 4's plain step; timed in
    separate passes over the table, the burst hits one of them and the fastest is kept."""
    from tlt_trainers.rollout import costs

    model = tiny_model("llama")
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    calls = []

    def fake_timed(fn, sync):
        fn()
        calls.append(len(calls))
        return 10.0 if len(calls) in (1, 2) else 1.0  # the first two timings fall into a burst

    monkeypatch.setattr(costs, "_timed", fake_timed)
    profile = costs.profile_costs(engine.target, None, [parse_strategy("chain:2")], [4], context=8, repeats=2)
    assert profile.verify == {(4, 1): 1.0, (4, 3): 1.0}


def test_history_proposals_are_not_computed_where_even_certain_matches_cannot_pay():
    """Proposals for every row cost milliseconds a step at large batch; where a chain of w fully accepted could
    not reach ``min_speedup`` the selector does not ask for them, and chooses what it would have chosen."""
    arm = parse_strategy("history:8")
    profile = CostProfile()  # batch 64 as on this CPU: each verified token costs 0.6 of a plain step
    for batch, slope in ((1, 0.01), (64, 0.6)):
        for q in (1, 2, 3, 5, 9):
            profile.verify[(batch, q)] = 0.01 * batch ** 0.5 * (1 + slope * (q - 1))
    asked = []

    def proposals(share):
        def compute():
            asked.append(share)
            return [share * w for w in range(1, 9)]
        return compute

    selector = StrategySelector([arm], profile, exploration=0.0)
    assert selector.history_bound(arm, 64) < selector.min_speedup  # calibration 0.5: nothing can pay at 64
    assert selector.choose(64, proposals(1.0)) == NONE and asked == []
    assert selector.choose(1, proposals(1.0)) == Strategy("history", history_tokens=8) and asked == [1.0]
    history8 = Strategy("history", history_tokens=8)
    selector.observe(history8, 1, 9, profile.step_seconds(history8, 1), accepted=8)
    selector.history_outcomes.extend([(1, 64, 1000, 1000)] * 20)  # calibrated at 64: matches come true
    assert selector.history_bound(arm, 64) > selector.min_speedup
    assert selector.choose(64, proposals(0.9)).kind == "history" and asked == [1.0, 0.9]


def test_profile_skips_token_counts_that_cannot_reach_min_speedup(monkeypatch):
    """A forward over q tokens per row costing 2q - 1 plain steps: chain:4 emits at most 5 tokens, so at
    min_speedup 1.25 its 5-token forward is not worth timing once 3 tokens cost 5 plain steps."""
    from tlt_trainers.rollout import costs

    model = tiny_model("llama")
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    arms = [parse_strategy("chain:2"), parse_strategy("chain:4")]

    def fake_timed(fn, sync):
        fn()
        return 2.0 * engine.target.model.model.layers[0].self_attn.q_proj.last_q - 1

    def remember_q(module, args):
        module.last_q = args[0].shape[1]

    engine.target.model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(remember_q)
    monkeypatch.setattr(costs, "_timed", fake_timed)
    loose = costs.profile_costs(engine.target, None, arms, [2], context=8, repeats=1)
    tight = costs.profile_costs(engine.target, None, arms, [2], context=8, repeats=1, min_speedup=1.25)
    assert loose.verify == {(2, 1): 1.0, (2, 3): 5.0, (2, 5): 9.0}
    assert tight.verify == {(2, 1): 1.0, (2, 3): 5.0}


def cpu_like_profile() -> CostProfile:
    """Batch 1 on a 2-core CPU (SmolLM2-135M's measured shape): a second token per row is free, a third is not."""
    profile = CostProfile()
    for q, seconds in ((1, 0.112), (2, 0.112), (3, 0.127), (5, 0.136)):
        profile.verify[(1, q)] = seconds
    for width in (1, 2, 4):
        profile.draft[(1, width)] = 0.006
    return profile


@pytest.mark.parametrize("accepted_later, expected", [(1.45, "chain:1"), (1.0, "none")])
def test_one_unlucky_rejection_does_not_rule_out_a_cheap_arm(accepted_later, expected):
    """chain:1 at batch 1 is one accept/reject draw per step: a first rejection must not end its trials, and
    what the trials then measure decides (45% acceptance pays 1.37x here; none does not pay)."""
    arm = parse_strategy("chain:1")
    selector = StrategySelector([arm], cpu_like_profile())
    for _ in range(500):  # a rollout's worth of plain steps first, as in the tail of a real one
        selector.observe(NONE, 1, 1, 0.112)
    selector.observe(arm, 1, 1, selector.profile.step_seconds(arm, 1))  # its first step: the draft rejected
    assert selector.choose(1) == arm, "a single rejection ended chain:1's trials"
    for step in range(40):
        choice = selector.choose(1)
        if choice == arm:
            tokens = 2 if step / 40 < accepted_later - 1 else 1  # a deterministic share of accepted drafts
            selector.observe(arm, 1, tokens, selector.profile.step_seconds(arm, 1))
        else:
            selector.observe(NONE, 1, 1, 0.112)
    assert selector.choose(1).name == expected


def test_one_slow_step_does_not_lock_a_cheap_arm_out():
    """A single chain:1 step that ran twice its profiled time (a burst of slowness on this CPU) must not raise
    its cost for good: with fewer than min_trials steps in the bucket the profile's cost stands."""
    arm = parse_strategy("chain:1")
    selector = StrategySelector([arm], cpu_like_profile())
    for _ in range(500):
        selector.observe(NONE, 1, 1, 0.112)
    selector.observe(arm, 1, 2, 2 * selector.profile.step_seconds(arm, 1))
    assert selector.relative_cost(arm, 1) > 2.0  # what the step read...
    assert selector.choose(1) == arm  # ...is not yet believed
    for _ in range(selector.min_trials):
        selector.observe(arm, 1, 2, 2 * selector.profile.step_seconds(arm, 1))
    assert selector.choose(1) == NONE  # steps that keep reading twice the profile are


def test_an_arm_measured_slow_is_not_retried_every_window():
    """The cost floor lasts min_trials steps of the arm in the bucket, ever: the correction they built is not
    forgotten when the window moves on, so an arm that keeps reading twice its profile is not re-tried."""
    arm = parse_strategy("chain:1")
    selector = StrategySelector([arm], cpu_like_profile(), window=64)
    tried = 0
    for _ in range(1000):
        choice = selector.choose(1)
        if choice == arm:
            tried += 1
            selector.observe(arm, 1, 2, 2 * selector.profile.step_seconds(arm, 1))
        else:
            selector.observe(NONE, 1, 1, 0.112)
    assert selector.min_trials <= tried <= selector.min_trials + 1, tried
