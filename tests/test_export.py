"""Publishing: vLLM / speculators / SGLang exports, their readers, the model card and push_to_hub (tiny models).

Round trips check that an export read back computes the drafter's draft logits. Independently of our reader, an
"engine view" rebuilds each export the way vLLM's and SGLang's EAGLE-1 llama drafters do (transformers'
LlamaDecoderLayer from config.json with the first input norm skipped, fc from the file, the target's raw embedding
table and LM head, the token map's rows) and must compute the same logits as the drafter.
"""

import dataclasses
import json
import shutil

import huggingface_hub
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tiny_models import tiny_model
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tlt_trainers import EagleDrafter
from tlt_trainers.drafter.export import (
    SGLANG_TOKEN_MAP,
    export_sglang,
    export_vllm,
    load_sglang_export,
    load_vllm_export,
)
from tlt_trainers.drafter.model_card import write_model_card
from tlt_trainers.rollout.stats import GenerationStats

LAYER = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}
POLICY = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind, logit_scale=4.0) for kind in ("llama", "qwen3", "gemma", "gemma2")}


def make_drafter(model, draft_vocab=None, seed=0, **config):
    """A drafter whose every weight differs from its init (norms start at exactly one); ``config`` sets
    EagleDrafterConfig fields from_target does not take (fc_bias, input_layernorm)."""
    drafter = EagleDrafter.from_target(model, draft_vocab_size=len(draft_vocab) if draft_vocab else None)
    if config:
        drafter = EagleDrafter(dataclasses.replace(drafter.config, **config), target=model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    if draft_vocab:
        drafter.set_draft_vocab(torch.tensor(draft_vocab))
    return drafter


def inputs(drafter, batch=2, length=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, drafter.config.hidden_size, generator=gen)
    tokens = torch.randint(0, drafter.config.vocab_size, (batch, length), generator=gen)
    return hidden, tokens, torch.arange(length).expand(batch, -1)


@torch.no_grad()
def draft_logits(drafter, hidden, tokens, positions):
    return drafter.logits(drafter(hidden, tokens, positions))


@torch.no_grad()
def engine_logits(path, model, hidden, tokens, positions):
    """Draft logits as vLLM/SGLang compute them from the export at ``path`` (see the module docstring)."""
    config = json.loads((path / "config.json").read_text())
    speculators = "speculators_model_type" in config
    layer_config = LlamaConfig.from_dict(config["transformer_layer_config"] if speculators else config)
    layer_config._attn_implementation = "eager"
    fc_prefix, layer_prefix = ("fusion_fc.", "transformer.") if speculators else ("fc.", "layers.0.")
    tensors = load_file(str(path / "model.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in tensors)

    layer = LlamaDecoderLayer(layer_config, layer_idx=0)
    layer.input_layernorm = nn.Identity()  # both engines skip the first layer's input norm (EAGLE-1)
    layer.load_state_dict({k[len(layer_prefix):]: v for k, v in tensors.items() if k.startswith(layer_prefix)})
    h = layer_config.hidden_size
    fc = nn.Linear(2 * h, h, bias=f"{fc_prefix}bias" in tensors)
    fc.load_state_dict({k[len(fc_prefix):]: v for k, v in tensors.items() if k.startswith(fc_prefix)})

    # The engines' embed_tokens is the target's table, unscaled (Gemma scales in its model forward).
    x = fc(torch.cat([F.embedding(tokens, model.get_input_embeddings().weight), hidden], dim=-1))
    cos_sin = LlamaRotaryEmbedding(layer_config)(x, positions)
    q = x.shape[1]
    mask = torch.full((q, q), torch.finfo(x.dtype).min).triu(1).expand(x.shape[0], 1, q, q)
    out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    out = out[0] if isinstance(out, tuple) else out
    head = model.get_output_embeddings().weight
    if (path / SGLANG_TOKEN_MAP).is_file():
        head = head[torch.load(path / SGLANG_TOKEN_MAP, weights_only=True)]
    logits = F.linear(out, head).float() * config.get("logit_scale", 1.0)
    softcap = config.get("final_logit_softcapping")
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def scaled_embedding(model):
    return hasattr(model.get_input_embeddings(), "embed_scale")  # Gemma's embedding module scales its output


def files(path):
    return sorted(p.name for p in path.iterdir())


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_vllm_round_trip_full_vocab(tmp_path, models, kind, layout):
    model = models[kind]
    drafter = make_drafter(model)
    export_vllm(drafter, tmp_path, verifier_name_or_path=model if layout == "vllm" else POLICY, layout=layout)
    loaded = load_vllm_export(tmp_path, model)
    args = inputs(drafter)
    expected = draft_logits(drafter, *args)
    if scaled_embedding(model):  # the embedding scale is folded into fc and unfolded again: equal up to rounding
        torch.testing.assert_close(draft_logits(loaded, *args), expected, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(draft_logits(loaded, *args), expected)
    torch.testing.assert_close(engine_logits(tmp_path, model, *args), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_vllm_draft_vocab_needs_the_full_head(tmp_path, models, layout):
    model = models["llama"]
    drafter = make_drafter(model, draft_vocab=list(range(20, 36)))
    with pytest.raises(ValueError, match="full_vocab_head=True"):
        export_vllm(drafter, tmp_path, verifier_name_or_path=POLICY, layout=layout)
    assert not (tmp_path / "config.json").exists()

    export_vllm(drafter, tmp_path, verifier_name_or_path=POLICY, layout=layout, full_vocab_head=True)
    loaded = load_vllm_export(tmp_path, model)
    assert loaded.d2t is None and loaded.config.draft_vocab_size is None
    args = inputs(drafter)
    expected = draft_logits(drafter, *args)
    # Over the draft vocabulary the full head computes the drafter's logits; it adds the other tokens.
    torch.testing.assert_close(draft_logits(loaded, *args)[..., drafter.d2t], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(engine_logits(tmp_path, model, *args)[..., drafter.d2t], expected, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma", "gemma2"])
@pytest.mark.parametrize("draft_vocab", [None, [3, 9, 11, 20, 21, 40, 41, 63]])
def test_sglang_round_trip(tmp_path, models, kind, draft_vocab):
    model = models[kind]
    drafter = make_drafter(model, draft_vocab=draft_vocab)
    export_sglang(drafter, tmp_path, target_model=model)
    assert (tmp_path / SGLANG_TOKEN_MAP).is_file() == (draft_vocab is not None)
    loaded = load_sglang_export(tmp_path, model)
    if draft_vocab is not None:
        assert torch.equal(loaded.d2t, drafter.d2t)
    args = inputs(drafter)
    expected = draft_logits(drafter, *args)
    if scaled_embedding(model):
        torch.testing.assert_close(draft_logits(loaded, *args), expected, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(draft_logits(loaded, *args), expected)
    torch.testing.assert_close(engine_logits(tmp_path, model, *args), expected, rtol=1e-4, atol=1e-4)


def test_sglang_full_head_on_request_and_no_stale_token_map(tmp_path, models):
    model = models["llama"]
    drafter = make_drafter(model, draft_vocab=list(range(10, 26)))
    export_sglang(drafter, tmp_path)
    assert (tmp_path / SGLANG_TOKEN_MAP).is_file()
    export_sglang(drafter, tmp_path, full_vocab_head=True)
    assert not (tmp_path / SGLANG_TOKEN_MAP).exists()
    loaded = load_sglang_export(tmp_path, model)
    args = inputs(drafter)
    torch.testing.assert_close(draft_logits(loaded, *args)[..., drafter.d2t], draft_logits(drafter, *args),
                               rtol=1e-6, atol=1e-6)


def test_export_in_lower_precision(tmp_path, models):
    model = models["llama"]
    drafter = make_drafter(model)
    export_vllm(drafter, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(tmp_path / "model.safetensors")).values()} == {torch.bfloat16}
    loaded = load_vllm_export(tmp_path, model)
    args = inputs(drafter)
    torch.testing.assert_close(draft_logits(loaded, *args), draft_logits(drafter, *args), rtol=0.05, atol=0.05)


# ------------------------------------------------------------------------------------------------ layouts
def test_vllm_layout_fields(tmp_path, models):
    model = models["qwen3"]  # head_dim (128) differs from hidden_size / heads: it must be written
    drafter = make_drafter(model)
    export_vllm(drafter, tmp_path, verifier_name_or_path=model, max_position_embeddings=4096)
    assert files(tmp_path) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    c = drafter.config
    assert config["architectures"] == ["LlamaForCausalLM"]  # vLLM's method="eagle" makes it EagleLlamaForCausalLM
    assert "speculators_config" not in config  # else vLLM would take it for a speculators checkpoint
    expected = dict(model_type="llama", num_hidden_layers=1, hidden_size=c.hidden_size, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                    vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, hidden_act="silu",
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, max_position_embeddings=4096,
                    torch_dtype="float32")
    assert {k: config[k] for k in expected} == expected
    assert "logit_scale" not in config
    assert set(load_file(str(tmp_path / "model.safetensors"))) == {"fc.weight"} | {f"layers.0.{k}" for k in LAYER}
    # What the engines parse with transformers:
    parsed = LlamaConfig.from_pretrained(tmp_path)
    assert (parsed.head_dim, parsed.num_key_value_heads, parsed.rope_parameters["rope_theta"]) == (
        c.head_dim, 2, c.rope_theta)


def test_speculators_layout_fields(tmp_path, models):
    model = tiny_model("llama", seed=5)
    model.config.architectures = ["LlamaForCausalLM"]
    drafter = make_drafter(model)
    export_vllm(drafter, tmp_path, verifier_name_or_path=POLICY, layout="speculators", num_speculative_tokens=4)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle"
    assert config["architectures"] == ["EagleSpeculator", "LlamaDecoderLayer"]
    assert config["transformer_layer_architecture"] == "LlamaDecoderLayer"
    assert config["layernorms"] is False and config["fusion_bias"] is False
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [
        {"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": POLICY, "architectures": []}
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["hidden_size"] == drafter.config.hidden_size and layer["head_dim"] == drafter.config.head_dim
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == {"fusion_fc.weight"} | {f"transformer.{k}" for k in LAYER}

    model.config._name_or_path = "someone/tiny-llama"
    export_vllm(drafter, tmp_path, verifier_name_or_path=model, layout="speculators")
    assert json.loads((tmp_path / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == (
        "someone/tiny-llama")
    assert json.loads((tmp_path / "config.json").read_text())["speculators_config"]["verifier"]["architectures"] == [
        "LlamaForCausalLM"]


def test_sglang_layout_fields(tmp_path, models):
    model = models["gemma2"]  # soft-capped logits: SGLang's LogitsProcessor reads final_logit_softcapping
    drafter = make_drafter(model, draft_vocab=[5, 6, 7, 30])
    export_sglang(drafter, tmp_path, target_model=POLICY)
    assert files(tmp_path) == ["config.json", SGLANG_TOKEN_MAP, "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == drafter.config.vocab_size  # the full vocabulary; the map gives the draft rows
    assert config["tie_word_embeddings"] is False
    assert config["final_logit_softcapping"] == drafter.config.final_logit_softcapping == 5.0
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == {"fc.weight", "fc.bias"} | {f"layers.0.{k}" for k in LAYER}
    assert torch.equal(tensors["fc.bias"], torch.zeros(drafter.config.hidden_size))  # SGLang's fc always has one
    token_map = torch.load(tmp_path / SGLANG_TOKEN_MAP, weights_only=True)  # as SGLang's load_token_map reads it
    assert token_map.dtype == torch.int64 and token_map.tolist() == [5, 6, 7, 30]


def test_embedding_scale_is_folded_into_fc(tmp_path, models):
    model = models["gemma"]
    drafter = make_drafter(model)
    export_sglang(drafter, tmp_path)
    fc = load_file(str(tmp_path / "model.safetensors"))["fc.weight"]
    h = drafter.config.hidden_size
    scale = float(model.get_input_embeddings().embed_scale)
    torch.testing.assert_close(fc[:, :h], drafter.fc.weight[:, :h].detach() * scale)
    assert torch.equal(fc[:, h:], drafter.fc.weight[:, h:].detach())


def test_no_pickle_files(tmp_path, models):
    """Weights are safetensors only; the one other binary is SGLang's token map, an int64 tensor that loads with
    ``torch.load(weights_only=True)`` (SGLang's own loader), written only for a draft vocabulary."""
    model = models["llama"]
    drafter = make_drafter(model, draft_vocab=list(range(3, 19)))
    export_vllm(drafter, tmp_path / "vllm", full_vocab_head=True)
    export_vllm(drafter, tmp_path / "spec", verifier_name_or_path=POLICY, layout="speculators", full_vocab_head=True)
    export_sglang(drafter, tmp_path / "sglang")
    drafter.save_pretrained(tmp_path / "hf", model_card={"policy_name": POLICY})
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["hf/README.md", "hf/config.json", "hf/model.safetensors", "sglang/config.json",
                       f"sglang/{SGLANG_TOKEN_MAP}", "sglang/model.safetensors", "spec/config.json",
                       "spec/model.safetensors", "vllm/config.json", "vllm/model.safetensors"]
    assert torch.equal(torch.load(tmp_path / "sglang" / SGLANG_TOKEN_MAP, weights_only=True), drafter.d2t)


# ---------------------------------------------------------------------------------------- what cannot be exported
def test_first_layer_input_norm_cannot_be_exported(tmp_path, models):
    drafter = make_drafter(models["llama"], input_layernorm=True)
    for export in (export_vllm, export_sglang):
        with pytest.raises(ValueError, match="input_layernorm"):
            export(drafter, tmp_path)


def test_fc_bias(tmp_path, models):
    model = models["llama"]
    drafter = make_drafter(model, fc_bias=True)
    with pytest.raises(ValueError, match="bias"):
        export_vllm(drafter, tmp_path / "vllm")
    args = inputs(drafter)
    export_vllm(drafter, tmp_path / "spec", verifier_name_or_path=POLICY, layout="speculators")
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["fusion_bias"] is True
    assert "fusion_fc.bias" in load_file(str(tmp_path / "spec" / "model.safetensors"))
    assert torch.equal(draft_logits(load_vllm_export(tmp_path / "spec", model), *args), draft_logits(drafter, *args))
    export_sglang(drafter, tmp_path / "sglang")
    assert torch.equal(draft_logits(load_sglang_export(tmp_path / "sglang", model), *args),
                       draft_logits(drafter, *args))

    with torch.no_grad():
        drafter.fc.bias.zero_()  # a zero bias is dropped for vLLM: it computes the same
    export_vllm(drafter, tmp_path / "vllm")
    assert "fc.bias" not in load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert torch.equal(draft_logits(load_vllm_export(tmp_path / "vllm", model), *args), draft_logits(drafter, *args))


def test_logit_transforms_each_engine_cannot_apply(tmp_path, models):
    with pytest.raises(ValueError, match="soft-capping"):
        export_vllm(make_drafter(models["gemma2"]), tmp_path / "capped")

    scaled = tiny_model("llama", seed=3)
    scaled.config.logit_scale = 0.5  # a Cohere/Granite-style logit scale
    drafter = make_drafter(scaled)
    with pytest.raises(ValueError, match="logit scale"):
        export_sglang(drafter, tmp_path / "sglang")
    export_vllm(drafter, tmp_path / "vllm")  # vLLM's EagleLlamaForCausalLM reads config.logit_scale
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["logit_scale"] == 0.5
    args = inputs(drafter)
    expected = draft_logits(drafter, *args)
    assert torch.equal(draft_logits(load_vllm_export(tmp_path / "vllm", scaled), *args), expected)
    torch.testing.assert_close(engine_logits(tmp_path / "vllm", scaled, *args), expected, rtol=1e-4, atol=1e-4)


def test_readers_check_the_policy(tmp_path, models):
    export_vllm(make_drafter(models["llama"]), tmp_path)
    with pytest.raises(ValueError, match="another model"):
        load_vllm_export(tmp_path, models["gemma2"])  # soft-capped policy: not what the export computes


def test_speculators_layout_needs_a_verifier(tmp_path, models):
    drafter = make_drafter(models["llama"])
    with pytest.raises(ValueError, match="verifier_name_or_path"):
        export_vllm(drafter, tmp_path, layout="speculators")
    with pytest.raises(ValueError, match="layout"):
        export_vllm(drafter, tmp_path, layout="eagle3")


def test_unbound_drafter_says_how_to_bind(tmp_path, models):
    drafter = make_drafter(models["llama"])
    drafter.save_pretrained(tmp_path / "saved")
    unbound = EagleDrafter.from_pretrained(tmp_path / "saved")
    with pytest.raises(RuntimeError, match="bind"):
        export_vllm(unbound, tmp_path / "vllm")


# ------------------------------------------------------------------------------------------------ model card
def test_model_card(tmp_path, models):
    drafter = make_drafter(models["llama"], draft_vocab=list(range(3, 19)))
    acceptance = {"greedy, k=4": {"acceptance_length": 1.9, "speedup": 1.16},
                  "temperature 1, k=4": {"acceptance_length": 1.52, "speedup": 0.98}}
    path = write_model_card(drafter, tmp_path, POLICY, acceptance, repo_id="someone/drafter",
                            num_speculative_tokens=4, training={"drafter steps": 1200})
    card = huggingface_hub.ModelCard.load(path)
    assert card.data.base_model == POLICY and card.data.library_name == "tlt-trainers"
    assert {"speculative-decoding", "eagle", "vllm", "sglang"} <= set(card.data.tags)
    text = card.text
    assert f"[`{POLICY}`](https://huggingface.co/{POLICY})" in text  # what it is aligned to
    assert "| setting | acceptance_length | speedup |" in text
    assert "| greedy, k=4 | 1.9 | 1.16 |" in text and "| temperature 1, k=4 | 1.52 | 0.98 |" in text
    assert "drafter steps: 1200" in text and "16 of the policy's 64 tokens" in text
    assert 'Drafter.from_pretrained("someone/drafter", target=model)' in text
    assert '"method": "eagle", "model": "drafter-vllm", "num_speculative_tokens": 4' in text
    assert "full_vocab_head=True" in text  # vLLM cannot keep the draft vocabulary
    assert "--speculative-algorithm EAGLE --speculative-draft-model-path drafter-sglang" in text
    assert "--speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5" in text
    assert "--speculative-token-map drafter-sglang/hot_token_map.pt" in text


def test_model_card_defaults(tmp_path, models):
    drafter = make_drafter(models["llama"])
    drafter.config.target_name_or_path = POLICY
    write_model_card(drafter, tmp_path, acceptance={"acceptance_length": 2.25}, vllm_model="someone/drafter-vllm",
                     sglang_model="someone/drafter-sglang")
    card = huggingface_hub.ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == POLICY
    assert "| metric | value |" in card.text and "| acceptance_length | 2.25 |" in card.text
    assert '"model": "someone/drafter-vllm"' in card.text and "export_vllm(" not in card.text
    assert "--speculative-draft-model-path someone/drafter-sglang" in card.text
    assert "token-map" not in card.text and "full_vocab_head" not in card.text

    write_model_card(drafter, tmp_path / "unmeasured")
    assert "Not measured yet" in (tmp_path / "unmeasured" / "README.md").read_text()


def test_model_card_from_generation_stats(tmp_path, models):
    """The ``.stats`` of a generate() call renders as counters plus a per-batch-size table."""
    stats = GenerationStats()
    stats.record_step(batch_size=1, emitted=3, drafted=4, accepted=2, seconds=0.1)
    stats.record_step(batch_size=1, emitted=1, drafted=4, accepted=0, seconds=0.1)
    write_model_card(make_drafter(models["llama"]), tmp_path, POLICY, stats)
    text = (tmp_path / "README.md").read_text()
    assert "| acceptance_length | 2 |" in text and "| draft_acceptance_rate | 0.25 |" in text
    assert "| buckets | steps |" in text


def test_save_pretrained_with_a_card_still_loads(tmp_path, models):
    model = models["llama"]
    drafter = make_drafter(model)
    drafter.save_pretrained(tmp_path, model_card={"policy_name": POLICY, "acceptance": {"acceptance_length": 1.7}})
    assert files(tmp_path) == ["README.md", "config.json", "model.safetensors"]
    loaded = EagleDrafter.from_pretrained(tmp_path, target=model)
    args = inputs(drafter)
    assert torch.equal(draft_logits(loaded, *args), draft_logits(drafter, *args))


def test_push_to_hub_includes_the_card(tmp_path, monkeypatch, models):
    """Only the Hub's network endpoint is mocked: ``HfApi.create_repo`` and ``HfApi.upload_folder`` copy the uploaded
    folder to a local "hub"; saving, the card and loading are real."""
    hub = tmp_path / "hub"

    def create_repo(self, repo_id, **kwargs):
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        shutil.copytree(folder_path, hub / repo_id)
        return f"https://huggingface.co/{repo_id}/commit/0123abc"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    model = models["llama"]
    drafter = make_drafter(model)
    card = {"policy_name": POLICY, "acceptance": {"acceptance_length": 1.8}}
    drafter.push_to_hub("someone/tiny-drafter", model_card=card)
    uploaded = hub / "someone" / "tiny-drafter"
    assert files(uploaded) == ["README.md", "config.json", "model.safetensors"]
    card = huggingface_hub.ModelCard.load(uploaded / "README.md")
    assert card.data.base_model == POLICY and "| acceptance_length | 1.8 |" in card.text
    assert 'Drafter.from_pretrained("someone/tiny-drafter", target=model)' in card.text
    loaded = EagleDrafter.from_pretrained(uploaded, target=model)
    args = inputs(drafter)
    assert torch.equal(draft_logits(loaded, *args), draft_logits(drafter, *args))
