"""Draft trees and mid-rollout strategy switching stay exact.

Greedy: token-for-token identical to ``model.generate`` for several tree shapes, architectures
(including Gemma2's sliding window, where tree positions differ from slots), the repetition
penalty, EOS inside accepted paths and rows finishing at different steps. Sampling: the two-sample
tests of test_engine_sampling with trees from a deliberately bad drafter, and with a scripted
selector that changes strategy at every step.
"""

import itertools

import pytest
import torch
from test_engine_greedy import staggered_eos, train_drafter
from test_engine_sampling import NEW_TOKENS, PROMPT, SAMPLES, _pad, hf_samples, two_sample_pvalue
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.proposers.strategy import parse_strategy
from tlt_trainers.sampling.tree import DraftTree, check_tree, verify_tree

TREES = ["tree:1x3:3", "tree:3x2:5", "tree:4x3:12", "tree:5x1:5"]


@pytest.fixture(scope="module")
def trained():
    model = tiny_model("llama", logit_scale=4.0)
    return model, train_drafter(model, steps=150)


class ScriptedSelector:
    """Cycles through strategies, one per step, so that every switch happens mid-rollout."""

    def __init__(self, names):
        self.cycle = itertools.cycle([parse_strategy(n) for n in names])
        self.used = []

    def choose(self, batch, history_expected=None):
        strategy = next(self.cycle)
        self.used.append(strategy.name)
        return strategy

    def observe(self, *args, **kwargs):
        pass


def scripted_engine(model, drafter, names):
    """An adaptive engine whose choices are scripted (the arms must cover what the script uses)."""
    arms = tuple(n for n in names if n != "none")
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="adaptive", strategies=arms))
    script = ScriptedSelector(names)
    engine.selector = lambda *args, **kwargs: script
    return engine, script


def greedy_both(engine, model, ids, mask, eos=EOS, **kwargs):
    ours = engine.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD, **kwargs)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                               **kwargs)
    return ours, reference


@pytest.mark.parametrize("strategy", TREES)
def test_tree_greedy_identical(trained, strategy):
    model, drafter = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=10)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=strategy))
    ours, reference = greedy_both(engine, model, ids, mask, max_new_tokens=24)
    assert torch.equal(ours.sequences, reference)
    assert 0 < ours.stats.accepted_tokens < ours.stats.draft_tokens
    assert ours.stats.strategies and set(ours.stats.strategies["5-16"]) <= {strategy, "none"}


def test_tree_beats_chain_acceptance(trained):
    """More candidates per level can only add accepted paths (greedy, same drafter)."""
    model, drafter = trained
    ids, mask = padded_prompts([4, 6, 5, 8], seed=21)
    results = {}
    for name in ["tree:4x1:4", "tree:4x3:12"]:
        engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy=name))
        results[name] = greedy_both(engine, model, ids, mask, max_new_tokens=32)[0].stats.acceptance_length
    assert results["tree:4x3:12"] >= results["tree:4x1:4"]


def test_tree_eos_and_repetition_penalty(trained):
    model, drafter = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=16)
    eos = staggered_eos(model, ids, mask, 24)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="tree:4x3:10"))
    ours, reference = greedy_both(engine, model, ids, mask, eos=eos, max_new_tokens=24)
    assert torch.equal(ours.sequences, reference)
    ours, reference = greedy_both(engine, model, ids, mask, max_new_tokens=20, repetition_penalty=1.3)
    assert torch.equal(ours.sequences, reference)


@pytest.mark.parametrize("kind", ["qwen2", "gemma2"])
def test_tree_other_architectures(kind):
    model = tiny_model(kind, logit_scale=4.0)
    drafter = train_drafter(model, steps=40)
    ids, mask = padded_prompts([3, 7, 5], seed=17)  # longer than gemma2's sliding window of 4
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", strategy="tree:3x3:7"))
    ours, reference = greedy_both(engine, model, ids, mask, max_new_tokens=16)
    assert torch.equal(ours.sequences, reference)


def test_switching_every_step_greedy(trained):
    model, drafter = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=19)
    eos = staggered_eos(model, ids, mask, 30)
    names = ["none", "tree:3x2:5", "chain:3", "none", "tree:4x3:12", "chain:1", "tree:2x2:3"]
    engine, script = scripted_engine(model, drafter, names)
    ours, reference = greedy_both(engine, model, ids, mask, eos=eos, max_new_tokens=30)
    assert torch.equal(ours.sequences, reference)
    assert len(set(script.used)) == len(set(names))


@pytest.fixture(scope="module")
def bad_drafter(sampling_model):
    torch.manual_seed(11)
    return EagleDrafter.from_target(sampling_model)


def engine_samples(engine, seed, **sampling):
    ids = PROMPT.expand(SAMPLES, -1)
    res = engine.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, eos_token_id=EOS, pad_token_id=PAD,
                          generator=torch.Generator().manual_seed(seed), **{"top_k": 0, **sampling})
    return _pad(res.sequences[:, PROMPT.shape[1]:]), res.stats


@pytest.mark.parametrize("strategy,sampling", [
    ("tree:3x2:5", dict(temperature=1.0)),
    ("tree:2x3:6", dict(temperature=0.8, top_k=4)),
    ("tree:3x2:4", dict(temperature=1.2, top_p=0.8, repetition_penalty=1.4)),
])
def test_tree_sampling_matches_generate(sampling_model, bad_drafter, strategy, sampling):
    engine = SpeculativeGenerator(sampling_model, bad_drafter, TLTConfig(speculation="always", strategy=strategy))
    reference = hf_samples(sampling_model, seed=31, **sampling)
    ours, stats = engine_samples(engine, seed=32, **sampling)
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert two_sample_pvalue(reference, ours) > 1e-3


def test_switching_every_step_sampling(sampling_model, bad_drafter):
    names = ["tree:3x2:5", "chain:2", "none", "tree:2x3:6"]
    engine, script = scripted_engine(sampling_model, bad_drafter, names)
    reference = hf_samples(sampling_model, seed=33, temperature=0.9, repetition_penalty=1.2)
    ours, stats = engine_samples(engine, seed=34, temperature=0.9, repetition_penalty=1.2)
    assert len(set(script.used)) >= 3  # 5 new tokens: a tree, a chain and a plain step at least
    assert two_sample_pvalue(reference, ours) > 1e-3


def test_verify_tree_walks_matching_children():
    # Root's children: 5 (node 1) and 7 (node 2); node 1's child: 6 (node 3); node 2's child: 4 (node 4).
    tree = DraftTree(tokens=torch.tensor([[5, 7, 6, 4]]), parents=torch.tensor([[0, 0, 1, 2]]),
                     depths=torch.tensor([[1, 1, 2, 2]]))
    check_tree(tree)
    argmax = torch.tensor([[7, 6, 4, 9, 9]])  # after root: 7 -> node 2; after node 2: 4 -> node 4; then 9
    verdict = verify_tree(tree, None, target_argmax=argmax)
    assert verdict.num_accepted.tolist() == [2]
    assert verdict.path.tolist() == [[2, 4]]
    assert verdict.next_token.tolist() == [9]
    closure = tree.ancestors()[0].to(torch.int64).tolist()
    assert closure[4] == [1, 0, 1, 0, 1] and closure[3] == [1, 1, 0, 1, 0]


def test_verify_tree_exact_law():
    """Tokens drawn at the root follow p exactly, whatever the candidates (enumeration of one level)."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    tree = DraftTree(tokens=torch.tensor([[2, 4]]), parents=torch.tensor([[0, 0]]), depths=torch.tensor([[1, 1]]))
    probs = p.expand(1, 3, 6).contiguous()
    n = 60000
    batch = DraftTree(tree.tokens.expand(n, -1), tree.parents.expand(n, -1), tree.depths.expand(n, -1))
    verdict = verify_tree(batch, probs.expand(n, -1, -1), torch.Generator().manual_seed(1))
    first = torch.where(verdict.num_accepted > 0, batch.tokens.gather(1, (verdict.path[:, :1] - 1).clamp(min=0))[:, 0],
                        verdict.next_token)
    freq = torch.bincount(first, minlength=6).float() / n
    assert torch.allclose(freq, p, atol=0.01)
    assert abs(float((verdict.num_accepted > 0).float().mean()) - float(p[2] + p[4])) < 0.01


def test_bad_trees_and_strategies_are_refused():
    with pytest.raises(ValueError, match="parents must index earlier nodes"):
        check_tree(DraftTree(torch.tensor([[1, 2]]), torch.tensor([[0, 2]]), torch.tensor([[1, 2]])))
    with pytest.raises(ValueError, match="tree:DxW:N"):
        parse_strategy("tree:8x4")
    with pytest.raises(ValueError, match="between the depth"):
        parse_strategy("tree:4x1:9")
    with pytest.raises(ValueError, match="tree:DxW:N"):
        TLTConfig(speculation="always", strategy="fan:3")
