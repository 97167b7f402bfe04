"""The block drafter (DFlash): exact in the engine (greedy identical to ``model.generate``, the sampled law equal),
trained block-parallel as it drafts, saved and resumed like the others, and refused where it cannot draft."""

import pytest
import torch
from test_engine_sampling import (
    SAMPLES,
    engine_samples,
    hf_samples,
    two_sample_pvalue,
)
from test_engine_sampling import (
    model as sampling_model,  # noqa: F401 (a fixture)
)
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import BlockDrafter, Drafter, DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.drafter.block import default_block_layers
from tlt_trainers.modeling.kv_cache import additive_mask

BLOCK = 5  # four drafts per pass


def policy_rollouts(model, prompts=32, new_tokens=40, seed=0):
    ids, mask = padded_prompts([5] * prompts, vocab_size=model.config.vocab_size, seed=seed)
    seqs = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD,
                          eos_token_id=None)
    full_mask = torch.cat([mask, torch.ones(prompts, seqs.shape[1] - ids.shape[1], dtype=torch.long)], dim=1)
    return seqs, full_mask


@pytest.fixture(scope="module")
def trained():
    """A block drafter that agrees with the policy often but not always, so partial acceptance happens."""
    model = tiny_model("llama", logit_scale=4.0)
    torch.manual_seed(0)
    drafter = BlockDrafter.from_target(model, block_size=BLOCK)
    trainer = DrafterTrainer(drafter, model, lr=3e-3)
    first = trainer.train_on_sequences(*policy_rollouts(model), max_steps=20)
    last = trainer.train(max_steps=200)
    return model, drafter, first, last


def generate_both(model, drafter, ids, mask, k, speculation="always", eos=EOS, **kwargs):
    config = TLTConfig(speculation=speculation, num_speculative_tokens=k, max_speculative_batch_size=2)
    ours = SpeculativeGenerator(model, drafter, config).generate(
        ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD, **kwargs)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                               **kwargs)
    return ours, reference


def test_training_raises_agreement(trained):
    _, _, first, last = trained
    assert last["loss"] < first["loss"]
    assert last["top1"] > first["top1"] + 0.1
    assert len(last["top1_by_step"]) == BLOCK - 1
    assert last["estimated_acceptance_length"] > 1.3


@pytest.mark.parametrize("k", [1, 2, BLOCK - 1])
def test_greedy_identical_mixed_prompt_lengths(trained, k):
    model, drafter, _, _ = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=10)
    ours, reference = generate_both(model, drafter, ids, mask, k, max_new_tokens=24)
    assert torch.equal(ours.sequences, reference)
    assert 0 < ours.stats.accepted_tokens < ours.stats.draft_tokens
    drafted = {r.strategy for r in ours.stats.trace if r.strategy != "none"}
    assert f"block:{k}" in drafted and all(name.startswith("block:") for name in drafted)  # cut at the budget


def test_greedy_eos_inside_a_block_and_short_budgets(trained):
    model, drafter, _, _ = trained
    ids, mask = padded_prompts([4, 6, 5, 8], seed=12)
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD,
                          eos_token_id=None)[:, ids.shape[1]:]
    eos = int(free[0, 6])
    ours, reference = generate_both(model, drafter, ids, mask, BLOCK - 1, eos=eos, max_new_tokens=20)
    assert torch.equal(ours.sequences, reference)
    for budget in (1, 2, 3):
        ours, reference = generate_both(model, drafter, ids, mask, BLOCK - 1, max_new_tokens=budget)
        assert torch.equal(ours.sequences, reference)


def test_greedy_repetition_penalty_batch_one_and_adaptive(trained):
    model, drafter, _, _ = trained
    ids, mask = padded_prompts([3, 8, 5], seed=15)
    ours, reference = generate_both(model, drafter, ids, mask, 3, max_new_tokens=20, repetition_penalty=1.3)
    assert torch.equal(ours.sequences, reference)
    ids, mask = padded_prompts([6], seed=14)
    ours, reference = generate_both(model, drafter, ids, mask, BLOCK - 1, max_new_tokens=30)
    assert torch.equal(ours.sequences, reference)
    assert ours.stats.accepted_tokens > 0
    # Adaptive: costs under which a block pays by construction (a timed table: a pass over a whole block costs
    # what a plain one does, the drafter almost nothing), so that the selector drafts blocks whatever this machine's
    # timings; the rows stay in one speculative bucket (6 <= max_speculative_batch_size)
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=16)
    config = TLTConfig(max_speculative_batch_size=8, min_speedup=1.0, cost_cache="off")
    engine = SpeculativeGenerator(model, drafter, config)
    for batch in range(1, 9):
        for tokens in range(1, BLOCK + 1):
            engine.cost_profile.verify[(batch, tokens)] = 0.01
            engine.cost_profile.draft[(batch, tokens)] = 1e-4
    ours = engine.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
                           max_new_tokens=24)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
                               max_new_tokens=24)
    assert torch.equal(ours.sequences, reference)
    blocks = [r for r in ours.stats.trace if r.strategy.startswith("block:")]
    assert ours.stats.trace[0].strategy == f"block:{BLOCK - 1}"  # the whole block first: the best prior
    assert len(blocks) >= 3 and any(r.emitted > r.batch_size for r in blocks)  # a block step accepted drafts
    assert 0 < ours.stats.accepted_tokens < ours.stats.draft_tokens


def test_engine_pass_computes_what_training_computes(trained):
    """A block drafted from the engine's cache (context written in two catch-ups) equals the training pass that
    joins all context keys in one go: what is trained is what drafts."""
    model, drafter, _, _ = trained
    torch.manual_seed(3)
    n, width = 9, BLOCK
    features = torch.randn(1, n, drafter.feature_size)
    first = torch.tensor([7])
    positions = torch.arange(n)[None]
    block_positions = n + torch.arange(width)[None]
    with torch.no_grad():
        kv = drafter.new_kv(n + width)
        drafter.write_context(features[:, :4], positions[:, :4], kv, positions[:, :4])
        drafter.write_context(features[:, 4:], positions[:, 4:], kv, positions[:, 4:])
        everything = torch.ones(1, width, n + width, dtype=torch.bool)
        cached = drafter.draft(first, block_positions, additive_mask(everything, features.dtype), kv,
                               block_positions)
        context = drafter.context_keys_values(features, positions)

        def merge(index, key, value):
            return torch.cat([context[index][0], key], 2), torch.cat([context[index][1], value], 2)

        joined = drafter(drafter.block_inputs(first, width), block_positions,
                         additive_mask(everything, features.dtype), merge)
    torch.testing.assert_close(cached, joined, rtol=1e-5, atol=1e-5)


SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8,
                                                                          repetition_penalty=1.3)]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampling_matches_generate_distribution(sampling_model, sampling):  # noqa: F811 (the fixture)
    torch.manual_seed(11)
    drafter = BlockDrafter.from_target(sampling_model, block_size=4)  # random: rejections at every step
    reference = hf_samples(sampling_model, seed=1, **sampling)
    ours, stats = engine_samples(sampling_model, drafter, seed=2, k=3, **sampling)
    assert len(ours) == SAMPLES
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "the test needs both acceptances and rejections"
    assert two_sample_pvalue(reference, ours) > 1e-3


def test_draft_vocabulary_is_lossless(sampling_model):  # noqa: F811 (the fixture)
    torch.manual_seed(5)
    drafter = BlockDrafter.from_target(sampling_model, block_size=3, draft_vocab_size=5)
    drafter.set_draft_vocab(torch.tensor([1, 3, 4, 5, 6]))
    reference = hf_samples(sampling_model, seed=3, temperature=1.0)
    ours, stats = engine_samples(sampling_model, drafter, seed=4, k=2, temperature=1.0)
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert two_sample_pvalue(reference, ours) > 1e-3


def test_save_load_and_checkpoint_resume(trained, tmp_path):
    model, drafter, _, _ = trained
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = Drafter.from_pretrained(tmp_path / "drafter", target=model)
    assert isinstance(loaded, BlockDrafter) and loaded.config == drafter.config
    ids, mask = padded_prompts([3, 9, 5], seed=19)
    config = TLTConfig(speculation="always", num_speculative_tokens=3)
    runs = [SpeculativeGenerator(model, d, config).generate(ids, attention_mask=mask, do_sample=False,
                                                            eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=16)
            for d in (drafter, loaded)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.accepted_tokens == runs[1].stats.accepted_tokens

    seqs, mask = policy_rollouts(model, prompts=8, seed=4)
    trainers = []
    for _ in range(2):
        torch.manual_seed(0)
        fresh = BlockDrafter.from_target(model, block_size=BLOCK)
        trainers.append(DrafterTrainer(fresh, model, lr=3e-3, seed=1))
        trainers[-1].add_sequences(seqs, mask)
    trainers[0].train(max_steps=3)
    trainers[0].save_checkpoint(tmp_path / "ckpt")
    trainers[1].load_checkpoint(tmp_path / "ckpt")
    trainers[1].generator.set_state(trainers[0].generator.get_state())
    after = [t.train(max_steps=2)["loss"] for t in trainers]
    assert after[0] == pytest.approx(after[1], rel=1e-5)


def test_strategies_that_do_not_fit_the_drafter_are_refused():
    model = tiny_model("llama")
    block = BlockDrafter.from_target(model, block_size=4)
    eagle = EagleDrafter.from_target(model)
    with pytest.raises(ValueError, match="block drafter: use 'block:K'"):
        SpeculativeGenerator(model, block, TLTConfig(speculation="always", strategy="chain:2"))
    with pytest.raises(ValueError, match="K <= 3"):
        SpeculativeGenerator(model, block, TLTConfig(speculation="always", num_speculative_tokens=4))
    with pytest.raises(ValueError, match="needs a block drafter"):
        SpeculativeGenerator(model, eagle, TLTConfig(strategies=("block:2",)))
    with pytest.raises(ValueError, match="at least 1 draft"):
        TLTConfig(speculation="always", strategy="block:0")
    with pytest.raises(ValueError, match="block_size"):
        BlockDrafter.from_target(model, block_size=1)
    engine = SpeculativeGenerator(model, block, TLTConfig())
    assert [s.name for s in engine.strategies] == ["block:1", "block:2", "block:3", "history:8"]
    with pytest.raises(ValueError, match="attention='padded'"):
        DrafterTrainer(block, model, attention="packed")


def test_default_layers_follow_dflash():
    assert default_block_layers(36, 5) == [2, 10, 18, 26, 34]  # Qwen3-8B's DFlash drafter reads 1, 9, 17, 25, 33
    assert default_block_layers(30, 3) == [2, 15, 28]
    assert default_block_layers(2, 3) == [1, 2]
