"""Greedy decoding with speculation is token-for-token identical to ``model.generate``."""

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model

from tlt_trainers import DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig


def train_drafter(model, steps, seed=0, prompts=32, new_tokens=40):
    """A drafter that agrees with the policy often but not always, so partial acceptance happens."""
    ids, mask = padded_prompts([5] * prompts, vocab_size=model.config.vocab_size, seed=seed)
    seqs = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=PAD, eos_token_id=None)
    full_mask = torch.cat([mask, torch.ones(prompts, seqs.shape[1] - ids.shape[1], dtype=torch.long)], dim=1)
    torch.manual_seed(seed)
    drafter = EagleDrafter.from_target(model)
    DrafterTrainer(drafter, model, lr=3e-3).train_on_sequences(seqs, full_mask, max_steps=steps)
    return drafter


@pytest.fixture(scope="module")
def trained():
    model = tiny_model("llama", logit_scale=4.0)
    return model, train_drafter(model, steps=150)


def generate_both(model, drafter, ids, mask, k, speculation="always", eos=EOS, **kwargs):
    config = TLTConfig(speculation=speculation, num_speculative_tokens=k, max_speculative_batch_size=2)
    ours = SpeculativeGenerator(model, drafter, config).generate(
        ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD, **kwargs)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=eos, pad_token_id=PAD,
                               **kwargs)
    return ours, reference


@pytest.mark.parametrize("k", [1, 3, 8])
def test_mixed_prompt_lengths(trained, k):
    model, drafter = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=10)
    ours, reference = generate_both(model, drafter, ids, mask, k, max_new_tokens=24)
    assert torch.equal(ours.sequences, reference)
    assert 0 < ours.stats.accepted_tokens < ours.stats.draft_tokens
    assert ours.stats.acceptance_length > 1.0


def test_eos_inside_a_draft(trained):
    model, drafter = trained
    ids, mask = padded_prompts([4, 6, 5, 8], seed=12)
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD,
                          eos_token_id=None)[:, ids.shape[1]:]
    eos = int(free[0, 6])  # a token the policy really emits mid-way: rows stop inside accepted chains
    ours, reference = generate_both(model, drafter, ids, mask, 8, eos=eos, max_new_tokens=20)
    assert torch.equal(ours.sequences, reference)
    completions = ours.sequences[:, ids.shape[1]:]
    assert (completions == eos).any(dim=1).any()
    assert ours.sequences.shape[1] <= ids.shape[1] + 20


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_max_new_tokens_smaller_than_k(trained, max_new_tokens):
    model, drafter = trained
    ids, mask = padded_prompts([4, 2, 6], seed=13)
    ours, reference = generate_both(model, drafter, ids, mask, 8, max_new_tokens=max_new_tokens)
    assert torch.equal(ours.sequences, reference)


def test_batch_size_one(trained):
    model, drafter = trained
    ids, mask = padded_prompts([6], seed=14)
    ours, reference = generate_both(model, drafter, ids, mask, 3, max_new_tokens=30)
    assert torch.equal(ours.sequences, reference)
    assert ours.stats.accepted_tokens > 0


def test_repetition_penalty(trained):
    model, drafter = trained
    ids, mask = padded_prompts([3, 8, 5], seed=15)
    ours, reference = generate_both(model, drafter, ids, mask, 4, max_new_tokens=20, repetition_penalty=1.3)
    assert torch.equal(ours.sequences, reference)


def staggered_eos(model, ids, mask, max_new_tokens):
    """A token that ends the rows of a greedy rollout at as many different steps as possible (a long tail)."""
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=PAD, eos_token_id=None)[:, ids.shape[1]:]

    def spread(token):
        hits = free == token
        first = torch.where(hits.any(1), hits.to(torch.int64).argmax(1), max_new_tokens)
        return len(set(first.tolist()))

    return max(range(3, model.config.vocab_size), key=spread)


@pytest.mark.parametrize("speculation", ["never", "adaptive"])
def test_other_modes(trained, speculation):
    model, drafter = trained
    ids, mask = padded_prompts([3, 9, 5, 1, 7, 2], seed=16)
    eos = staggered_eos(model, ids, mask, 24)
    ours, reference = generate_both(model, drafter, ids, mask, 3, speculation=speculation, max_new_tokens=24,
                                    eos=eos)
    assert torch.equal(ours.sequences, reference)
    if speculation == "never":
        assert ours.stats.draft_tokens == 0
    else:  # max_speculative_batch_size=2: plain decoding while more rows are active (below it, measured costs decide)
        assert ours.stats.speculative_steps < ours.stats.steps
        assert all(r.strategy == "none" for r in ours.stats.trace if r.batch_size > 2)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma", "gemma2"])
def test_other_architectures(kind):
    model = tiny_model(kind, logit_scale=4.0)
    drafter = train_drafter(model, steps=40)
    ids, mask = padded_prompts([3, 7, 5], seed=17)  # longer than gemma2's sliding window of 4
    ours, reference = generate_both(model, drafter, ids, mask, 3, max_new_tokens=16)
    assert torch.equal(ours.sequences, reference)


def test_policy_parameters_bit_identical_after_generation(trained):
    model, drafter = trained
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids, mask = padded_prompts([3, 5], seed=18)
    SpeculativeGenerator(model, drafter, TLTConfig(speculation="always")).generate(
        ids, attention_mask=mask, max_new_tokens=10, temperature=0.9, eos_token_id=EOS, pad_token_id=PAD,
        generator=torch.Generator().manual_seed(0))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_special_tokens_and_mask_default_like_generate():
    """Unset eos comes from generation_config and a missing attention_mask is inferred from padding."""
    model = tiny_model("llama", logit_scale=4.0)
    ids, mask = padded_prompts([4, 6], seed=12)
    free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                          eos_token_id=None)
    model.generation_config.eos_token_id = int(free[0, ids.shape[1] + 3])
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    ours = engine.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    reference = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD)
    assert torch.equal(ours.sequences, reference)
    model.generation_config.eos_token_id = EOS
    ids, _ = padded_prompts([2, 6], seed=12)
    ours = engine.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS)
    reference = model.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS)
    assert torch.equal(ours.sequences, reference)
