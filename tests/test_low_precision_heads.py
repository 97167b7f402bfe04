"""bfloat16 policies whose forward soft-caps or scales the LM head's output (Gemma-2, Cohere, Granite,
HyperCLOVAX): the engine's logits are the model's own, bit for bit.

transformers applies ``final_logit_softcapping`` (``/ c``, ``tanh``, ``* c``), Cohere's ``logit_scale`` (``*``),
Granite's ``logits_scaling`` (``/``) and HyperCLOVAX's (``*``) in the head's output dtype, and ``generate`` casts to
float32 only afterwards. Applied in float32 after the cast (or as a multiplication by ``1 / logits_scaling``), a
bfloat16 policy samples a slightly different law, and the engine's own split check refuses some models outright.
The factors are not powers of two, so each rounding differs.
"""

import pytest
import torch
from test_engine_sampling import engine_samples, hf_samples, two_sample_pvalue
from tiny_models import EOS, PAD, padded_prompts
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig

import tlt_trainers.rollout.rollout as rollout_module
from tlt_trainers import EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.modeling import target as target_module
from tlt_trainers.modeling.target import TargetModel

VOCAB = 64
_COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=2)
# Head weights are multiplied by ``sharpen`` so that the transformed logits reach ~10-25: there a bfloat16 ulp is
# 1/16 to 1/8, next-token laws are peaked, and a soft-cap of 30 bends the top logits visibly.
KINDS = {
    "gemma2": (lambda: Gemma2Config(**_COMMON, head_dim=8, final_logit_softcapping=30.0, sliding_window=4,
                                    query_pre_attn_scalar=8, tie_word_embeddings=True), 50.0),
    "cohere": (lambda: CohereConfig(**_COMMON, logit_scale=0.3, tie_word_embeddings=False), 100.0),
    "granite": (lambda: GraniteConfig(**_COMMON, logits_scaling=6.0, tie_word_embeddings=False), 200.0),
}


def _hyperclovax_config():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "HyperCLOVAXConfig"):
        pytest.skip("this transformers has no HyperCLOVAX")
    return transformers.HyperCLOVAXConfig(**_COMMON, logits_scaling=0.3, tie_word_embeddings=False)


def low_precision_model(kind: str, vocab_size: int = VOCAB, seed: int = 0):
    make, sharpen = KINDS[kind] if kind in KINDS else (_hyperclovax_config, 200.0)
    torch.manual_seed(seed)
    config = make()
    config.vocab_size = vocab_size
    # Gemma-2 soft-caps attention scores: eager (transformers 5.2x refuses sdpa for it; 5.10 sdpa ignores the cap).
    attention = "eager" if isinstance(config, Gemma2Config) else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.pad_token_id = PAD
    return model.to(torch.bfloat16)


@pytest.fixture(scope="module", params=list(KINDS))
def model(request):
    return low_precision_model(request.param)


def test_head_ops_follow_each_models_forward():
    head_ops = target_module.head_ops
    assert head_ops(KINDS["gemma2"][0]()) == (("softcap", 30.0),)
    assert head_ops(KINDS["cohere"][0]()) == (("mul", 0.3),)
    assert head_ops(KINDS["granite"][0]()) == (("div", 6.0),)  # a division, not a product with 1/6
    assert head_ops(GraniteConfig(logits_scaling=1.0)) == ()


@pytest.mark.parametrize("kind", [*KINDS, "hyperclovax"])
@torch.no_grad()
def test_logits_equal_the_models_bit_for_bit(kind):
    model = low_precision_model(kind)
    target = TargetModel(model)
    target.check_split()
    for ids in (torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1)),
                torch.tensor([[5]])):  # many rows, and the single row cpu_head duplicates
        reference = model(ids).logits
        assert reference.dtype == torch.bfloat16 and reference.abs().max() > 4
        hidden = target.decoder(input_ids=ids).last_hidden_state
        ours = target.logits(hidden)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, reference.float())


@pytest.mark.parametrize("speculation,k", [("never", None), ("always", 3)])
def test_greedy_equals_generate(model, speculation, k):
    """Left-padded prompts, greedy: the engine emits what ``generate`` emits.

    With ``always`` the policy scores a pending token and 3 drafts in one pass. In bfloat16, CPU attention over a
    masked key range does not always round as a one-token decode step does (a different kernel path), so a
    near-tie can in principle flip there whatever the head does; these prompts have none.
    """
    ids, mask = padded_prompts([3, 7, 5, 1, 6, 2], vocab_size=VOCAB, seed=0)
    drafter = None
    if speculation != "never":
        torch.manual_seed(1)
        drafter = EagleDrafter.from_target(model)
    engine = SpeculativeGenerator(model, drafter, TLTConfig(speculation=speculation, num_speculative_tokens=k))
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    ours = engine.generate(ids, **kwargs)
    assert torch.equal(ours.sequences, model.generate(ids, **kwargs))
    if drafter is not None:
        assert ours.stats.draft_tokens > 0


def test_verifier_scores_are_the_models_logits(model, monkeypatch):
    """At T=1 the verifier samples from softmax(scores): each step's scores equal ``generate``'s float32 logits
    for the same sequence (the model decoding one token at a time on its own cache), bit for bit."""
    seen = []
    verify = rollout_module.verify

    def spy(proposal, scores, *args):
        seen.append(scores[:, 0].clone())
        return verify(proposal, scores, *args)

    monkeypatch.setattr(rollout_module, "verify", spy)
    prompt = torch.tensor([[5, 9, 4, 11]])
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    seq = engine.generate(prompt, max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, eos_token_id=EOS,
                          pad_token_id=PAD, generator=torch.Generator().manual_seed(0)).sequences
    monkeypatch.setattr(rollout_module, "verify", verify)
    steps = seq.shape[1] - prompt.shape[1]
    assert len(seen) == steps
    cache = target_module.cache_argument(model)  # past_key_values (transformers 5.10) or cache (5.2x), in and out
    with torch.no_grad():
        out = model(seq[:, :4], use_cache=True)
        reference = [out.logits[:, -1].float()]
        for t in range(4, seq.shape[1] - 1):
            out = model(seq[:, t : t + 1], use_cache=True, **{cache: getattr(out, cache)})
            reference.append(out.logits[:, -1].float())
    for ours, theirs in zip(seen, reference):
        assert torch.equal(ours, theirs)
        assert torch.equal(ours.softmax(-1), theirs.softmax(-1))


def test_speculative_sampling_law_of_a_bfloat16_soft_capped_policy():
    """Two-sample test (tests/test_engine_sampling.py's) on a small-vocabulary bfloat16 Gemma-2 with a random
    drafter: rejections and residual draws at every step, the law still generate()'s."""
    model = low_precision_model("gemma2", vocab_size=8, seed=3)
    torch.manual_seed(11)
    drafter = EagleDrafter.from_target(model)
    reference = hf_samples(model, seed=1, temperature=1.0)
    ours, stats = engine_samples(model, drafter, seed=2, temperature=1.0)
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert two_sample_pvalue(reference, ours) > 1e-3
