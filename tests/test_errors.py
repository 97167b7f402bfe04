"""Every bad input gets a clear error at the right place, before any work, saying what to do.

Errors about a call's arguments are raised by ``generate`` before the policy runs a single forward
(checked with a forward hook); errors about the set-up are raised at construction.
"""

import re

import pytest
import torch
from tiny_models import EOS, PAD, padded_prompts, tiny_model
from transformers import GenerationConfig

from tlt_trainers import DrafterTrainer, EagleDrafter, SpeculativeGenerator, TLTConfig
from tlt_trainers.sampling.distribution import SamplingParams, check_generation_config


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def engine(model):
    return SpeculativeGenerator(model, None, TLTConfig(speculation="never"))


@pytest.fixture
def forward_calls(model):
    """Counts the policy's forward passes from now on."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *args: calls.append(1))
    yield calls
    handle.remove()


PROMPTS = padded_prompts([3, 5])


def generate(engine, **kwargs):
    ids, mask = PROMPTS
    settings = dict(attention_mask=mask, max_new_tokens=4, eos_token_id=EOS, pad_token_id=PAD)
    return engine.generate(kwargs.pop("input_ids", ids), **{**settings, **kwargs})


# ---------------------------------------------------------------------------------------- generate() arguments
BAD_CALLS = [
    pytest.param(dict(attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])), ValueError,
                 "must be left padded.*padding_side = 'left'", id="right-padded-mask"),
    pytest.param(dict(attention_mask=torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])), ValueError,
                 "prompt in the batch is empty", id="empty-prompt"),
    pytest.param(dict(num_beams=2), TypeError, r"does not support \['num_beams'\]; supported: attention_mask",
                 id="num_beams"),
    pytest.param(dict(no_repeat_ngram_size=2), TypeError, r"does not support \['no_repeat_ngram_size'\]",
                 id="no_repeat_ngram_size"),
    pytest.param(dict(do_sample=True, temperature=0.0), ValueError,
                 r"temperature=0.0 must be > 0 when do_sample=True; use do_sample=False for greedy",
                 id="temperature=0"),
    pytest.param(dict(top_p=0.0), ValueError, r"top_p=0.0 must be in \(0, 1\] \(1.0 disables", id="top_p=0"),
    pytest.param(dict(top_p=1.5), ValueError, r"top_p=1.5 must be in \(0, 1\]", id="top_p>1"),
    pytest.param(dict(top_k=-1), ValueError, r"top_k=-1 must be a non-negative int \(0 disables", id="top_k=-1"),
    pytest.param(dict(top_k=2.5), ValueError, r"top_k=2.5 must be a non-negative int", id="top_k-float"),
    pytest.param(dict(min_p=2.0), ValueError, r"min_p=2.0 must be in \[0, 1\] or None", id="min_p=2"),
    pytest.param(dict(repetition_penalty=0.0), ValueError, r"repetition_penalty=0.0 must be > 0 \(1.0 disables",
                 id="repetition_penalty=0"),
    pytest.param(dict(max_new_tokens=0), ValueError, "max_new_tokens=0 must be a positive int", id="max_new_tokens=0"),
    pytest.param(dict(max_new_tokens=2.0), ValueError, "max_new_tokens=2.0 must be a positive int",
                 id="max_new_tokens-float"),
    pytest.param(dict(input_ids=torch.tensor([3, 4, 5]), attention_mask=None), ValueError,
                 r"input_ids must be \[batch, prompt_len\], got shape \(3,\)", id="1-D-input_ids"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_CALLS)
def test_bad_generate_arguments(engine, forward_calls, kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(engine, **kwargs)
    assert not forward_calls, "the error must come before the policy runs"


def test_no_pad_and_no_eos_anywhere(engine, forward_calls):
    """Neither passed nor in the model's generation_config (generate() would fall back to it too)."""
    config = engine.model.generation_config
    saved = config.pad_token_id, config.eos_token_id
    config.pad_token_id = config.eos_token_id = None
    try:
        with pytest.raises(ValueError, match="Pass pad_token_id \\(or eos_token_id"):
            generate(engine, eos_token_id=None, pad_token_id=None)
    finally:
        config.pad_token_id, config.eos_token_id = saved
    assert not forward_calls


def test_greedy_ignores_temperature(engine):
    """temperature=0 is only an error when sampling: greedy decoding does not read it (as in generate)."""
    out = generate(engine, do_sample=False, temperature=0.0)
    assert out.sequences.shape[0] == 2


def test_sampling_params_validate_on_their_own():
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    SamplingParams(do_sample=False, temperature=0.0)  # greedy: fine


# ---------------------------------------------------------------------------------------- construction
def test_speculation_without_a_drafter(model):
    with pytest.raises(ValueError, match=r"speculation='always' needs a drafter or history proposals: pass "
                                         r"EagleDrafter.from_target"):
        SpeculativeGenerator(model, None, TLTConfig(speculation="always", history_drafting=False))
    with pytest.raises(ValueError, match=r"speculation='adaptive' needs a drafter.*speculation='never'"):
        SpeculativeGenerator(model, None, TLTConfig(history_drafting=False))
    with pytest.raises(ValueError, match=r"Strategy 'chain:3' needs a drafter: pass one, or use 'history:K'"):
        SpeculativeGenerator(model, None, TLTConfig(speculation="always", strategy="chain:3"))
    # Without a drafter, history proposals are the only strategy (no neural drafting at all).
    assert [s.name for s in SpeculativeGenerator(model).strategies] == ["history:8"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculation="sometimes"), r"speculation='sometimes' is not one of \('adaptive', 'always', 'never'\)"),
    (dict(num_speculative_tokens=0), r"num_speculative_tokens=0 must be >= 1.*speculation='never'"),
    (dict(num_speculative_tokens=-2), r"num_speculative_tokens=-2 must be >= 1"),
    (dict(default_num_speculative_tokens=0), "default_num_speculative_tokens must be >= 1"),
    (dict(max_speculative_batch_size=0), "max_speculative_batch_size must be >= 1"),
])
def test_bad_tlt_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TLTConfig(**kwargs)


def test_drafter_on_another_dtype(model):
    drafter = EagleDrafter.from_target(model).to(torch.float64)
    with pytest.raises(ValueError, match=r"float64.*float32: call drafter\.to\(device=\.\.\., dtype=\.\.\.\)"):
        SpeculativeGenerator(model, drafter, TLTConfig(speculation="always"))
    with pytest.raises(ValueError, match=r"call drafter\.to\(device=\.\.\., dtype=\.\.\.\)"):
        DrafterTrainer(drafter, model)


def test_drafter_for_another_model(model):
    other = tiny_model("llama", hidden_size=48)
    drafter = EagleDrafter.from_target(other)
    with pytest.raises(ValueError, match=r"hidden_size=48 does not match the policy's 32.*EagleDrafter\.from_target"):
        SpeculativeGenerator(model, drafter, TLTConfig(speculation="always"))
    with pytest.raises(ValueError, match=r"hidden_size=48 does not match.*EagleDrafter\.from_target"):
        DrafterTrainer(drafter, model)


# ---------------------------------------------------------------------------------------- generation_config
@pytest.mark.parametrize("key, value", [
    ("no_repeat_ngram_size", 3),
    ("num_beams", 2),
    ("num_return_sequences", 2),
    ("min_new_tokens", 2),
    ("min_length", 5),
    ("forced_bos_token_id", 0),  # token id 0 is a real token: forcing it changes the first sample
    ("forced_eos_token_id", EOS),
    ("bad_words_ids", [[5]]),
    ("suppress_tokens", [5]),
    ("begin_suppress_tokens", [5]),
    ("sequence_bias", {(5,): -1.0}),
    ("exponential_decay_length_penalty", (2, 1.5)),
    ("guidance_scale", 1.5),
    ("typical_p", 0.9),
    ("epsilon_cutoff", 0.01),
    ("eta_cutoff", 0.01),
    ("top_h", 0.5),
    ("renormalize_logits", True),
    ("remove_invalid_values", True),
])
def test_generation_config_the_engine_does_not_reproduce(key, value):
    """A model whose generation_config changes what generate samples is refused, never sampled differently."""
    model = tiny_model("llama")
    setattr(model.generation_config, key, value)
    engine = SpeculativeGenerator(model, None, TLTConfig(speculation="never"))
    with pytest.raises(ValueError, match=rf"generation_config sets {key}=.*set model\.generation_config\.{key} = "):
        generate(engine)


@pytest.mark.parametrize("generation_config", [
    pytest.param(GenerationConfig(), id="default"),
    # The explicit "off" values older transformers releases (4.x) used as defaults, and other neutral values.
    pytest.param(GenerationConfig(num_beams=1, num_return_sequences=1, no_repeat_ngram_size=0, min_length=0,
                                  min_new_tokens=0, encoder_repetition_penalty=1.0, typical_p=1.0, epsilon_cutoff=0.0,
                                  eta_cutoff=0.0, guidance_scale=1.0, renormalize_logits=False,
                                  remove_invalid_values=False, suppress_tokens=[], begin_suppress_tokens=[]),
                 id="explicit-neutral"),
    None,
])
def test_neutral_generation_configs_pass(generation_config):
    check_generation_config(generation_config)


def test_generate_global_defaults_pass():
    """transformers 5 fills unset fields with these at generate() time (min_length=0, num_beams=1, ...)."""
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is None:
        pytest.skip("this transformers release has no global generation defaults")
    check_generation_config(GenerationConfig(**defaults()))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma", "gemma2"])
def test_tiny_models_generation_configs_pass(kind):
    model = tiny_model(kind)
    check_generation_config(model.generation_config)
    check_generation_config(GenerationConfig.from_model_config(model.config))


def test_generation_config_message_names_the_key():
    config = GenerationConfig(no_repeat_ngram_size=3)
    with pytest.raises(ValueError) as info:
        check_generation_config(config)
    assert re.search(r"no_repeat_ngram_size=3, which SpeculativeGenerator does not reproduce", str(info.value))
    assert "model.generation_config.no_repeat_ngram_size = 0" in str(info.value)
