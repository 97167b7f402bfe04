"""The engine samples from exactly the distribution ``model.generate`` samples from.

Two-sample chi-square tests over whole short continuations of a small-vocabulary model, with a
deliberately bad (random) drafter so that rejections and residual draws happen at every step.
The last test checks that the test itself notices a small change of temperature.
"""

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency
from tiny_models import EOS, PAD, tiny_model

from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig

VOCAB = 8
SAMPLES = 4000
NEW_TOKENS = 5
PROMPT = torch.tensor([[3, 5, 4, 6]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=VOCAB, logit_scale=12.0, seed=3)


def hf_samples(model, seed, **sampling):
    torch.manual_seed(seed)
    sampling = dict(sampling)
    ids = PROMPT.expand(SAMPLES, -1)
    sampling.setdefault("top_k", 0)  # generate's default would otherwise be the model's top_k
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=True,
                         eos_token_id=EOS, pad_token_id=PAD, **sampling)
    return _pad(out[:, PROMPT.shape[1]:])


def engine_samples(model, drafter, seed, k=3, **sampling):
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation="always", num_speculative_tokens=k))
    ids = PROMPT.expand(SAMPLES, -1)
    sampling = {"top_k": 0, **sampling}
    res = engine.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, eos_token_id=EOS, pad_token_id=PAD,
                          generator=torch.Generator().manual_seed(seed), **sampling)
    return _pad(res.sequences[:, PROMPT.shape[1]:]), res.stats


def _pad(completions):
    out = torch.full((completions.shape[0], NEW_TOKENS), PAD)
    out[:, : completions.shape[1]] = completions
    return [tuple(row) for row in out.tolist()]


def _chi2_pvalue(a, b, min_count=10):
    counts_a, counts_b = Counter(a), Counter(b)
    keys = sorted(set(counts_a) | set(counts_b))
    common = [k for k in keys if counts_a[k] + counts_b[k] >= min_count]
    rare_a = sum(counts_a[k] for k in keys if k not in common)
    rare_b = sum(counts_b[k] for k in keys if k not in common)
    table = [[counts_a[k] for k in common] + [rare_a], [counts_b[k] for k in common] + [rare_b]]
    if rare_a + rare_b == 0:
        table = [row[:-1] for row in table]
    return chi2_contingency(table)[1]


def two_sample_pvalue(a, b):
    """Smallest Bonferroni-corrected p-value over the joint law and every 1- and 2-position marginal.

    The joint over whole continuations has many rare categories; the marginals give the test power.
    """
    statistics = [lambda s: s] + [lambda s, j=j: s[j] for j in range(NEW_TOKENS)]
    statistics += [lambda s, j=j: s[j : j + 2] for j in range(NEW_TOKENS - 1)]
    pvalues = [_chi2_pvalue([f(s) for s in a], [f(s) for s in b]) for f in statistics]
    return min(1.0, min(pvalues) * len(pvalues))


@pytest.fixture(scope="module")
def bad_drafter(model):
    torch.manual_seed(11)
    return EagleDrafter.from_target(model)


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=1.0, repetition_penalty=1.5),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=1.3, top_k=5, top_p=0.9, repetition_penalty=1.3),
]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_engine_matches_generate_distribution(model, bad_drafter, sampling):
    reference = hf_samples(model, seed=1, **sampling)
    ours, stats = engine_samples(model, bad_drafter, seed=2, **sampling)
    assert 0 < stats.accepted_tokens < stats.draft_tokens, "the test needs both acceptances and rejections"
    assert two_sample_pvalue(reference, ours) > 1e-3


def test_draft_vocabulary_is_lossless(model):
    torch.manual_seed(5)
    drafter = EagleDrafter.from_target(model, draft_vocab_size=5)
    drafter.set_draft_vocab(torch.tensor([1, 3, 4, 5, 6]))
    reference = hf_samples(model, seed=3, temperature=1.0)
    ours, stats = engine_samples(model, drafter, seed=4, k=2, temperature=1.0)
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert two_sample_pvalue(reference, ours) > 1e-3


def test_never_mode_matches_generate_distribution(model):
    reference = hf_samples(model, seed=5, temperature=0.8)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    ids = PROMPT.expand(SAMPLES, -1)
    res = engine.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_k=0, eos_token_id=EOS,
                          pad_token_id=PAD, generator=torch.Generator().manual_seed(6))
    assert two_sample_pvalue(reference, _pad(res.sequences[:, PROMPT.shape[1]:])) > 1e-3


def test_unset_settings_come_from_the_models_generation_config(bad_drafter):
    """``engine.generate(ids)`` and ``model.generate(ids)`` with nothing set sample the same law: both read
    do_sample, temperature, top_k and top_p from the model's generation_config."""
    model = tiny_model("llama", vocab_size=VOCAB, logit_scale=12.0, seed=3)
    model.generation_config.update(do_sample=True, temperature=0.7, top_k=3, top_p=0.9)
    ids = PROMPT.expand(SAMPLES, -1)
    torch.manual_seed(9)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, eos_token_id=EOS,
                         pad_token_id=PAD)
    reference = _pad(out[:, PROMPT.shape[1]:])
    engine = SpeculativeGenerator(model, bad_drafter, TLTConfig(speculation="always", num_speculative_tokens=3))
    res = engine.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=PAD,
                          generator=torch.Generator().manual_seed(10))
    ours = _pad(res.sequences[:, PROMPT.shape[1]:])
    assert two_sample_pvalue(reference, ours) > 1e-3
    # The configured law is far from the plain softmax, so the comparison above has power.
    plain, _ = engine_samples(model, bad_drafter, seed=11, temperature=1.0)
    assert two_sample_pvalue(reference, plain) < 1e-3


def test_do_sample_alone_applies_transformers_default_top_k():
    """``do_sample=True`` alone: generate() keeps the 50 most likely tokens (transformers' default top_k); so
    does the engine, so no token outside the top 50 is ever drawn."""
    vocab = 96
    model = tiny_model("llama", vocab_size=vocab, seed=4)
    prompt = torch.tensor([[3, 5, 4, 6]])
    logits = model(prompt).logits[0, -1]
    outside = set(torch.topk(logits, vocab - 50, largest=False).indices.tolist())
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    res = engine.generate(prompt.expand(3000, -1), max_new_tokens=1, do_sample=True, eos_token_id=EOS,
                          pad_token_id=PAD, generator=torch.Generator().manual_seed(12))
    drawn = set(res.sequences[:, -1].tolist())
    assert not drawn & outside, sorted(drawn & outside)
    full = engine.generate(prompt.expand(3000, -1), max_new_tokens=1, do_sample=True, top_k=0, eos_token_id=EOS,
                           pad_token_id=PAD, generator=torch.Generator().manual_seed(12))
    assert set(full.sequences[:, -1].tolist()) & outside, "top_k=0 must reach the tail (the test's power)"


@pytest.mark.parametrize("model_config,kwargs", [
    ({}, {}),
    ({}, {"do_sample": True}),
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95}, {}),
    ({"do_sample": True, "top_k": 20, "repetition_penalty": 1.1}, {"top_k": 0, "temperature": 1.3}),
    ({"min_p": 0.05}, {"do_sample": True}),
])
def test_resolved_settings_are_generates(model_config, kwargs):
    """Oracle: transformers' own resolution of generate()'s settings (``_prepare_generation_config``)."""
    from tlt_trainers.sampling.distribution import SAMPLING_FIELDS, resolve_sampling

    model = tiny_model("llama", vocab_size=VOCAB, seed=3)
    model.generation_config.update(**model_config)
    expected, _ = model._prepare_generation_config(None, **kwargs)
    ours = resolve_sampling(model, **kwargs)
    for name in SAMPLING_FIELDS:
        value = getattr(expected, name)
        assert getattr(ours, name) == value, (name, getattr(ours, name), value)


def test_the_test_detects_a_small_temperature_change(model, bad_drafter):
    reference = hf_samples(model, seed=7, temperature=1.0)
    ours, _ = engine_samples(model, bad_drafter, seed=8, temperature=1.15)
    assert two_sample_pvalue(reference, ours) < 1e-3


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_first_acceptance_is_the_probability_the_first_draft_is_kept(draft_vocab):
    """The selector learns from sum(min(p_1, q_1)) instead of a 0/1 accept: it must be that probability."""
    from tlt_trainers.sampling.chain import verify_sampled

    gen = torch.Generator().manual_seed(0)
    vocab, k, rows = 12, 2, 4
    p = torch.softmax(torch.randn(rows, k + 1, vocab, generator=gen) * 2, dim=-1)
    d2t = torch.tensor([0, 2, 3, 5, 7, 8, 11]) if draft_vocab else None
    n = len(d2t) if draft_vocab else vocab
    q = torch.softmax(torch.randn(rows, k, n, generator=gen) * 2, dim=-1)
    p_first = p[:, 0, d2t] if draft_vocab else p[:, 0]
    expected = torch.minimum(p_first, q[:, 0]).sum(-1)
    kept = torch.zeros(rows)
    trials = 5_000
    for _ in range(trials):
        index = torch.multinomial(q.reshape(-1, n), 1, generator=gen).reshape(rows, k)
        drafts = d2t[index] if draft_vocab else index
        verdict = verify_sampled(drafts, q, p, gen, d2t, index if draft_vocab else None)
        assert torch.allclose(verdict.first_acceptance, expected)
        kept += (verdict.num_accepted > 0).float()
    assert torch.allclose(kept / trials, expected, atol=0.03), (kept / trials, expected)
