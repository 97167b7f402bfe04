"""Costs learnt from the steps the engine runs, kept between runs, timed only in idle time (no first-step tax)."""

import json
import logging
import math

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.proposers.strategy import NONE, parse_strategy
from tlt_trainers.rollout.cost_cache import cost_dir, load_costs, save_costs
from tlt_trainers.rollout.costs import FIXED_SHARE_RATE, CostProfile, _curve
from tlt_trainers.rollout.selector import StrategySelector

CHAIN1 = parse_strategy("chain:1")
# Plain steps as the 2-core CPU ran SmolLM2-135M (seconds by batch size): extra rows cost little up to a few,
# then about linearly.
CPU_PLAIN = {64: 0.25, 8: 0.075, 4: 0.055, 2: 0.05, 1: 0.046}


def test_the_curve_interpolates_and_extrapolates_never_flatter_than_the_prior():
    points = {1: 1.0, 2: 1.2, 8: 2.0}
    assert _curve({}, 4) == math.inf
    assert _curve(points, 1) == 1.0 and _curve(points, 0.5) == 1.0
    assert _curve(points, 5) == pytest.approx(1.6)
    assert _curve(points, 16) == pytest.approx(2.0 + 8 * (0.8 / 6))  # the slope from 2 to 8
    # Adjacent sizes differ by noise alone: a slower 15 than 16 does not make 64 rows cost what 16 do.
    assert _curve({8: 0.08, 15: 0.10, 16: 0.087}, 64) > 2.5 * 0.087
    # One size known: a fixed share 1 / (1 + rate * n) of it, the rest per row (a CPU's rate by default).
    fixed = 1 / (1 + FIXED_SHARE_RATE["cpu"] * 4)
    assert _curve({4: 2.0}, 8) == pytest.approx(2.0 * (fixed + 2 * (1 - fixed)))
    assert _curve({1: 1.0}, 2) == pytest.approx(1.1, abs=0.01)  # a second row at batch 1: ~10% more on a CPU
    assert _curve({64: 1.0}, 128, FIXED_SHARE_RATE["cuda"]) < 1.2  # a GPU's forward stays flat far longer


def test_a_pass_over_q_tokens_is_predicted_from_plain_steps_over_as_many_rows():
    profile = CostProfile(drafter_share=0.05)
    for batch, seconds in CPU_PLAIN.items():
        profile.observe_plain(batch, seconds)
    assert profile.step_seconds(NONE, 4) == pytest.approx(0.055)
    assert profile.forward_seconds(1, 4) == pytest.approx(0.055)  # 1 row x 4 tokens ~ 4 rows x 1 token
    assert profile.step_seconds(CHAIN1, 1) == pytest.approx(0.05 + 0.05 * 0.046)
    assert not profile.timed(CHAIN1)
    profile.verify[(1, 1)] = 0.04  # a timed table, where there is one, wins
    assert profile.timed(NONE) and profile.step_seconds(NONE, 1) == 0.04


def test_nothing_known_decodes_plainly_and_the_tail_is_tried_from_the_plain_curve():
    profile = CostProfile(drafter_share=0.05)
    selector = StrategySelector([CHAIN1], profile)
    assert selector.choose(64) == NONE  # no step seen at any size: measure plain first
    for batch, seconds in CPU_PLAIN.items():
        selector.observe(NONE, batch, batch, seconds)
    assert profile.plain == CPU_PLAIN
    assert selector.choose(64) == NONE  # 2 tokens per row at 64 rows cost about 128 rows: cannot pay
    assert selector.choose(1) == CHAIN1  # a second token at 1 row costs about a 2-row step: worth a try
    # The try turns out dearer than the curve said (the drafter, overheads): learnt, and plain again.
    for _ in range(6):
        selector.observe(CHAIN1, 1, 1, 2.0 * CPU_PLAIN[1])
    assert selector.relative_cost(CHAIN1, 1) > 1.8
    assert selector.choose(1) == NONE


def test_corrections_are_kept_in_the_profile_and_count_as_measured_when_cached():
    """The selectors' cost corrections live in the shared profile, so the cache carries them: a cached correction
    with enough steps behind it is trusted at once instead of being explored again."""
    profile = CostProfile(drafter_share=0.05)
    for batch, seconds in CPU_PLAIN.items():
        profile.observe_plain(batch, seconds)
    profile.corrections[(1, CHAIN1.name)] = (2.0, 10)  # an earlier run measured chain:1 at batch 1 as dear
    restored = CostProfile()
    restored.merge_dict(json.loads(json.dumps(profile.to_dict())))
    assert restored.plain == pytest.approx(profile.plain) and restored.corrections == profile.corrections
    assert restored.drafter_share is None  # the engine sets its own
    selector = StrategySelector([CHAIN1], restored)
    assert selector.cost_samples(CHAIN1, 1) == 10
    assert selector.choose(1) == NONE


def test_damaged_cache_entries_are_skipped_one_by_one():
    profile = CostProfile()
    profile.merge_dict({"verify": {"1x1": 0.01, "2xq": 0.5, "4x1": -1, "8x1": "nan"},
                        "plain": {"1": 0.02, "x": 1.0, "2": 0},
                        "corrections": {"1|chain:1": [1.5, 4], "2|chain:1": [1.5], "bad": 3}})
    assert profile.verify == {(1, 1): 0.01}
    assert profile.plain == {1: 0.02}
    assert profile.corrections == {(1, "chain:1"): (1.5, 4)}


def _engine(model, drafter, **config):
    return SpeculativeGenerator(model, drafter, TLTConfig(speculation="adaptive", **config))


def _generate(engine, seed=10):
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=seed)
    return engine.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=12,
                           eos_token_id=EOS, pad_token_id=PAD, generator=torch.Generator().manual_seed(0))


def test_a_second_engine_on_the_same_machine_starts_from_the_first_ones_costs():
    model = tiny_model("llama", logit_scale=4.0)
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model)
    first = _engine(model, drafter)
    _generate(first)
    files = list(cost_dir().glob("tlt-*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["key"]["policy"]["architectures"] == ["LlamaForCausalLM"] and stored["key"]["device"] == "cpu"
    assert stored["costs"]["plain"]
    second = _engine(model, drafter)
    assert second.cost_profile.plain == pytest.approx(first.cost_profile.plain)
    assert second.cost_profile.corrections == first.cost_profile.corrections
    # Another policy size (another key) starts cold; so does cost_cache="off".
    other = _engine(tiny_model("llama", num_hidden_layers=3), None)
    assert not other.cost_profile.plain
    assert not _engine(model, drafter, cost_cache="off").cost_profile.plain


def test_a_foreign_or_unreadable_cache_file_is_ignored(tmp_path, caplog):
    model = tiny_model("llama")
    engine = _engine(model, None, cost_cache=str(tmp_path))
    key = engine.cost_cache_key()
    path = save_costs(key, {"plain": {"4": 0.5}}, tmp_path)
    assert path.parent == tmp_path and load_costs(key, tmp_path) == {"plain": {"4": 0.5}}
    assert _engine(model, None, cost_cache=str(tmp_path)).cost_profile.plain == {4: 0.5}
    stored = json.loads(path.read_text())
    stored["key"]["torch"] = "0.0.1"  # measured under another version, copied into place by hand
    path.write_text(json.dumps(stored))
    assert load_costs(key, tmp_path) is None
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert not _engine(model, None, cost_cache=str(tmp_path)).cost_profile.plain
    assert "Ignoring the cost cache" in caplog.text


def test_costs_are_timed_only_when_asked_in_idle_time_smallest_batch_first():
    model = tiny_model("llama", logit_scale=4.0)
    torch.manual_seed(0)
    engine = _engine(model, EagleDrafter.from_target(model))
    assert engine.measure_costs(10.0) == []  # no rollout yet: nothing to size the table by
    _generate(engine)
    assert engine.cost_profile.seconds_spent == 0 and not engine.cost_profile.verify
    assert engine.measure_costs(10.0, should_stop=lambda: True) == []
    assert engine.measure_costs(0.0) == []
    model.gradient_checkpointing_enable()  # a trainer's policy between rollouts: timed as a rollout runs it
    model.train()
    assert engine.measure_costs(30.0) == [1, 2, 4, 6]
    assert model.training
    assert engine.measure_costs(30.0) == []  # once
    profile = engine.cost_profile
    assert profile.batch_sizes() == [1, 2, 4, 6] and profile.draft and profile.seconds_spent > 0
    assert _engine(model, engine.drafter).cost_profile.batch_sizes() == [1, 2, 4, 6]  # cached for the next run


def test_the_selector_logs_what_it_tried_and_what_it_measured():
    model = tiny_model("llama", logit_scale=4.0)
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(model)
    cold = _engine(model, drafter, min_speedup=1.0)
    _generate(cold)
    first = list(cold.selector(True, 1.0).decisions)[0]
    assert first["step"] == 1 and first["strategy"] == "none" and first["batch"] == 6  # nothing known: plain first
    # Costs under which speculation pays by construction (a timed table: a pass over 2 tokens per row costs what one
    # over 1 does, the drafter almost nothing), so what this run tries does not hang on this machine's timings: the
    # selector must try chain:1, and log each try with what it measured.
    engine = _engine(model, drafter, min_speedup=1.0, strategies=("chain:1",), cost_cache="off")
    for batch in range(1, 7):
        engine.cost_profile.verify[(batch, 1)] = engine.cost_profile.verify[(batch, 2)] = 0.01
        engine.cost_profile.draft[(batch, 1)] = 1e-4
    result = _generate(engine)
    decisions = list(engine.selector(True, 1.0).decisions)
    assert decisions[0]["step"] == 1 and decisions[0]["strategy"] == "chain:1" and decisions[0]["batch"] == 6
    assert all(d["seconds"] > 0 and d["tokens_per_row"] >= 1 for d in decisions)
    assert all(d["measured_relative_cost"] == pytest.approx(d["seconds"] / 0.01, rel=1e-3, abs=1e-3)
               for d in decisions)  # against the plain step of the table
    tried = {d["strategy"] for d in decisions} - {"none"}
    used = {name for counts in result.stats.strategies.values() for name in counts} - {"none"}
    assert tried == used == {"chain:1"}
    assert result.stats.draft_tokens > 0


def test_a_prior_cost_is_replaced_by_the_first_step_that_measures_it():
    """A timed cost is not doubted on a few slow steps; a prior from the plain curve is, at once: the step that
    measured it is all there is, and retrying a strategy the prior misjudged costs a step each time."""
    profile = CostProfile(drafter_share=0.05)
    for batch, seconds in CPU_PLAIN.items():
        profile.observe_plain(batch, seconds)
    selector = StrategySelector([CHAIN1], profile)
    assert selector.choose(1) == CHAIN1
    selector.observe(CHAIN1, 1, 2, 3.0 * CPU_PLAIN[1])
    assert selector.relative_cost(CHAIN1, 1) == pytest.approx(3.0, rel=0.01)
    assert selector.choose(1) == NONE
