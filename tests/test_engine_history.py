"""History drafting in the engine: proposals from siblings, earlier steps and the row's own context are
point masses, verified exactly like the drafter's trees (greedy identity, two-sample tests), alone
or as one more branch of a drafter tree."""

import pytest
import torch
from test_engine_greedy import staggered_eos, train_drafter
from test_engine_sampling import hf_samples, two_sample_pvalue
from test_engine_trees import engine_samples, scripted_engine
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.proposers.strategy import parse_strategy
from tlt_trainers.rollout.rollout import Rollout
from tlt_trainers.sampling.distribution import SamplingParams


@pytest.fixture(scope="module")
def trained():
    model = tiny_model("llama", logit_scale=4.0)
    return model, train_drafter(model, steps=60)


def greedy_both(engine, model, ids, mask, eos=EOS, **kwargs):
    ours = engine.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD, **kwargs)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                               **kwargs)
    return ours, reference


def test_history_alone_needs_no_drafter_and_learns_across_steps(trained):
    model, _ = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=10)
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)  # two samples per prompt: siblings
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="always", strategy="history:6"))
    first, reference = greedy_both(engine, model, ids, mask, max_new_tokens=30)
    assert torch.equal(first.sequences, reference)
    second, _ = greedy_both(engine, model, ids, mask, max_new_tokens=30)  # the next RL step: same prompts
    assert torch.equal(second.sequences, reference)
    assert second.stats.acceptance_length > first.stats.acceptance_length > 1.0
    assert second.stats.history_proposed > 0 and 0 < second.stats.history_bytes == engine.rollout_history.nbytes()


def test_history_with_drafter_tree_and_switching(trained):
    model, drafter = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=16)
    eos = staggered_eos(model, ids, mask, 24)
    names = ["tree:3x2:5+history:4", "history:5", "none", "chain:2", "tree:2x2:3"]
    engine, script = scripted_engine(model, drafter, names)
    for _ in range(2):
        ours, reference = greedy_both(engine, model, ids, mask, eos=eos, max_new_tokens=24, repetition_penalty=1.2)
        assert torch.equal(ours.sequences, reference)
    assert set(script.used) == set(names)


def test_merged_tree_gives_rows_without_a_match_the_history_slots(trained):
    """Every row verifies N + K nodes: a matched row's history branch displaces its weakest drafted nodes, a row
    without a match verifies N + K drafted ones instead of K copies of a token."""
    model, drafter = trained
    strategy = parse_strategy("tree:3x2:5+history:4")
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=strategy.name))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25]])  # no token repeats: no own-context match
    first = model(ids).logits[:, -1].argmax(-1).tolist()  # the token prefill commits (greedy)
    engine.rollout_history.add("a", ids[0].tolist() + [first[0], 9, 10, 11, 12, 13])  # row 0 continues in history
    params = SamplingParams(False, 1.0, 0, 1.0, None, 1.0)
    rollout = Rollout(engine, ids, torch.zeros(2, dtype=torch.long), params, 8, torch.tensor([EOS]), PAD, None,
                      history_keys=["a", "b"])
    rollout._prefill()
    tree = rollout.proposer_for(strategy).propose(rollout.rows, strategy).tree
    assert tree.num_nodes == 9
    assert tree.tokens[0, 5:].tolist() == [9, 10, 11, 12]
    assert tree.depths[0, 5:].tolist() == [1, 2, 3, 4] and tree.parents[0, 5:].tolist() == [0, 6, 7, 8]
    for row, drafted in ((0, 5), (1, 9)):
        for j in range(drafted):  # a valid drafted subtree: parents first, one level deeper than the parent
            parent = int(tree.parents[row, j])
            assert parent <= j
            assert int(tree.depths[row, j]) == (1 if parent == 0 else int(tree.depths[row, parent - 1]) + 1)
        assert int(tree.depths[row, :drafted].max()) <= strategy.depth
    with pytest.raises(ValueError, match="N \\+ K"):
        parse_strategy("tree:2x2:5+history:3")


def test_history_keys_group_rows(trained):
    model, _ = trained
    ids, mask = padded_prompts([4, 4, 4, 4], seed=3)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="always", strategy="history:4"))
    ours = engine.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=EOS,
                           pad_token_id=PAD, history_keys=["a", "a", "b", "b"])
    assert set(engine.rollout_history._groups) == {"a", "b"}
    assert ours.sequences.shape[0] == 4
    with pytest.raises(ValueError, match="history_keys has 3 entries for 4 rows"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD,
                        history_keys=["a", "b", "c"])


def test_history_can_be_switched_off(trained):
    model, drafter = trained
    engine = SpeculativeGenerator(model, drafter, TLTConfig(history_drafting=False))
    assert engine.rollout_history is None and not any(s.history_tokens for s in engine.strategies)
    assert {s.name for s in SpeculativeGenerator(model, None, TLTConfig()).strategies} == {"history:8"}
    with pytest.raises(ValueError, match="needs a drafter or history"):
        SpeculativeGenerator(model, None, TLTConfig(history_drafting=False))
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeGenerator(model, None, TLTConfig(speculation="always", strategy="tree:2x2:3+history:2"))
    with pytest.raises(ValueError, match="only a tree combines with history"):
        TLTConfig(speculation="always", strategy="chain:3+history:2")


@pytest.mark.parametrize("strategy,sampling", [
    ("history:4", dict(temperature=1.0)),
    ("history:3", dict(temperature=0.8, top_p=0.9, repetition_penalty=1.3)),
    ("tree:2x2:3+history:3", dict(temperature=1.0)),
])
def test_history_sampling_matches_generate(sampling_model, strategy, sampling):
    torch.manual_seed(11)
    drafter = EagleDrafter.from_target(sampling_model) if strategy.startswith("tree") else None
    engine = SpeculativeGenerator(sampling_model, drafter, TLTConfig(speculation="always", strategy=strategy))
    engine_samples(engine, seed=40, **sampling)  # a first step fills the history (all rows share the prompt)
    reference = hf_samples(sampling_model, seed=41, **sampling)
    ours, stats = engine_samples(engine, seed=42, **sampling)
    assert stats.history_proposed > 0
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert two_sample_pvalue(reference, ours) > 1e-3
