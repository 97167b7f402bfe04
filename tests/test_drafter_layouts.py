"""Drafters published in other tools' layouts load as tlt-trainers drafters, compute what their source computes,
round-trip through our exporters, and are refused, naming the field, when they were made for another policy.

Sources of truth, per layout:

- speculators EAGLE-3: written by the ``speculators`` library itself (``Eagle3DraftModel.save_pretrained``); its
  own forward gives the reference logits and its own loader reads our exports back. Skipped where it does not
  install (.ci/run installs it with ``--no-deps``; its pins pull other torch/transformers releases).
- the EAGLE authors' EAGLE-3 (SafeAILab/EAGLE ``eagle/model/cnets.py``: ``fc``, ``midlayer.*``, ``norm``,
  ``lm_head``, ``d2t`` offsets, ``t2d``; ``traineagle3/main.py`` saves ``pytorch_model.bin`` without the frozen
  ``embed_tokens``; a Llama config with ``draft_vocab_size`` and no layer ids: layers 2, n // 2, n - 3) and
  SpecForge / SGLang's (``architectures: ["LlamaForCausalLMEagle3"]``, ``eagle_config`` ids numbered by the layer
  whose output is taken; SpecForge's early saves include ``embed_tokens``): written from those names. The
  speculators converter (``convert/eagle/eagle3_converter.py``) maps them to its layout by renaming ``midlayer.`` to
  ``layers.0.`` only, so the speculators model computes what they compute and is their reference too.
- EAGLE-1 (the EAGLE authors' ``cnets1.py``: ``fc`` with a bias over ``cat(embed, hidden)``, one Llama layer
  without an input norm, the policy's head; the TLT authors' FastRL drafters for Qwen2.5: ``model.``-prefixed
  names, Qwen2's q/k/v biases, no fc bias): written from those names; the reference is transformers' own
  ``LlamaDecoderLayer`` / ``Qwen2DecoderLayer`` with the input norm replaced by the identity, as those codes do.

The Hub's network is the only thing mocked (``snapshot_download`` and ``HfApi`` uploads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_model
from torch import nn

from tlt_trainers import Drafter, Eagle3Drafter, EagleDrafter
from tlt_trainers.drafter.export import export_sglang, export_vllm, load_sglang_export, load_vllm_export
from tlt_trainers.drafter.export_eagle3 import export_eagle3_sglang, export_eagle3_vllm
from tlt_trainers.drafter.layouts import detect_layout, read_weights

DRAFT_VOCAB, T = 40, 7
AUX = [2, 4, 5]  # EAGLE's default for 8 layers: the streams entering layers 2, n // 2 and n - 3


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model = tiny_model("llama", num_hidden_layers=8)
    folder = tmp_path_factory.mktemp("policy")
    model.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    return model


def _inputs(hidden_size: int, features: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, features * hidden_size, generator=gen), torch.randint(3, 64, (1, T), generator=gen),
            torch.arange(T)[None])


def _draft_logits(drafter: Drafter, hidden, ids, positions) -> torch.Tensor:
    with torch.no_grad():
        return drafter.logits(drafter(hidden, ids, positions))


# ------------------------------------------------------------------------------------------------ EAGLE-3 sources
@pytest.fixture(scope="module")
def speculators_model(policy):
    """A random EAGLE-3 drafter built by the speculators library for the tiny policy, and its reference logits."""
    return speculators_drafter(policy, layers=1)


@pytest.fixture(scope="module")
def speculators_two_layers(policy):
    """The same with two decoder layers (the library's first layer, then a plain Llama decoder layer)."""
    return speculators_drafter(policy, layers=2)


def speculators_drafter(policy, layers: int):
    pytest.importorskip("speculators", reason="the speculators library is not installed (.ci/run installs it)")
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    c = policy.config
    layer = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=AUX,
        norm_before_residual=False,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=c._name_or_path, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(1)
    model = Eagle3DraftModel(config)
    chosen = torch.randperm(c.vocab_size)[:DRAFT_VOCAB].sort().values
    mask = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, chosen, True)
    model.load_vocab_mappings(mask, chosen - torch.arange(DRAFT_VOCAB))
    model.load_verifier_weights()  # embed_tokens, lm_head rows and norm from the (local) verifier folder
    with torch.no_grad():  # make every norm and the head differ from their starting values
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    return model.eval(), chosen


def _speculators_reference(model, hidden, ids) -> torch.Tensor:
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    try:
        with torch.no_grad():
            model(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
    finally:
        hook.remove()
    return captured[0].float().reshape(1, T, -1)


def _eagle3_tensors(model) -> dict[str, torch.Tensor]:
    """The drafter's tensors by the EAGLE authors' names (speculators' ``layers.0.`` is their ``midlayer.``)."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("verifier_")}
    return {k.replace("layers.0.", "midlayer.", 1): v.detach().clone().contiguous() for k, v in state.items()}


def _eagle3_llama_config(model, **extra) -> dict:
    layer = model.config.transformer_layer_config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": layer.hidden_size,
            "intermediate_size": layer.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": layer.num_attention_heads, "num_key_value_heads": layer.num_key_value_heads,
            "rms_norm_eps": layer.rms_norm_eps, "vocab_size": layer.vocab_size, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "torch_dtype": "float32", "draft_vocab_size": DRAFT_VOCAB, **extra}


def write_eagle3(model, folder: Path, layout: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "speculators":
        model.save_pretrained(folder)  # the library's own writer
        return folder
    tensors = _eagle3_tensors(model)
    if layout == "eagle-authors":  # traineagle3/main.py: pytorch_model.bin, frozen embed_tokens excluded
        tensors.pop("embed_tokens.weight")
        torch.save(tensors, folder / "pytorch_model.bin")
        config = _eagle3_llama_config(model)
    else:  # SpecForge (configs/*-eagle3.json; early saves kept embed_tokens); ids by the layer whose output is taken
        save_file(tensors, str(folder / "model.safetensors"))
        config = _eagle3_llama_config(model, architectures=["LlamaForCausalLMEagle3"],
                                      eagle_config={"eagle_aux_hidden_state_layer_ids": [k - 1 for k in AUX],
                                                    "use_aux_hidden_state": True})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


EAGLE3_LAYOUTS = {"speculators": "speculators-eagle3", "eagle-authors": "eagle3", "specforge": "eagle3"}


@pytest.mark.parametrize("layout", list(EAGLE3_LAYOUTS))
def test_eagle3_layout_loads_and_computes_what_its_source_computes(tmp_path, policy, speculators_model, layout):
    model, chosen = speculators_model
    folder = write_eagle3(model, tmp_path / layout, layout)
    assert detect_layout(json.loads((folder / "config.json").read_text()), read_weights(folder)) == \
        EAGLE3_LAYOUTS[layout]
    drafter = Drafter.from_pretrained(folder, target=policy)
    assert isinstance(drafter, Eagle3Drafter)
    assert drafter.config.aux_layer_ids == AUX and torch.equal(drafter.d2t, chosen)
    assert drafter.config.norm_before_residual is False
    hidden, ids, positions = _inputs(policy.config.hidden_size)
    reference = _speculators_reference(model, hidden, ids)
    torch.testing.assert_close(_draft_logits(drafter, hidden, ids, positions), reference, atol=1e-5, rtol=1e-5)


def test_an_unsorted_draft_vocabulary_keeps_each_head_row_with_its_token(tmp_path, policy, speculators_model):
    model, chosen = speculators_model
    folder = tmp_path / "shuffled"
    folder.mkdir()
    tensors = _eagle3_tensors(model)
    order = torch.randperm(DRAFT_VOCAB)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][order].contiguous()
    tensors["d2t"] = (chosen[order] - torch.arange(DRAFT_VOCAB)).contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_eagle3_llama_config(model)))
    drafter = Drafter.from_pretrained(folder, target=policy)
    hidden, ids, positions = _inputs(policy.config.hidden_size)
    torch.testing.assert_close(_draft_logits(drafter, hidden, ids, positions),
                               _speculators_reference(model, hidden, ids), atol=1e-5, rtol=1e-5)


def test_eagle3_round_trips_through_our_exports_and_the_library_reads_them(tmp_path, policy, speculators_model):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    model, _ = speculators_model
    drafter = Drafter.from_pretrained(write_eagle3(model, tmp_path / "src", "eagle-authors"), target=policy)
    hidden, ids, positions = _inputs(policy.config.hidden_size)
    reference = _speculators_reference(model, hidden, ids)
    vllm_dir = export_eagle3_vllm(drafter, tmp_path / "vllm", policy)
    sglang_dir = export_eagle3_sglang(drafter, tmp_path / "sglang", policy)
    for folder in (vllm_dir, sglang_dir):
        again = Drafter.from_pretrained(folder, target=policy)
        torch.testing.assert_close(_draft_logits(again, hidden, ids, positions), reference, atol=1e-5, rtol=1e-5)
    config = SpeculatorModelConfig.from_pretrained(str(vllm_dir))
    config.transformer_layer_config._attn_implementation = "eager"  # its default needs flex attention's kernels
    library = SpeculatorModel.from_pretrained(str(vllm_dir), config=config).eval()  # the library's own loader
    torch.testing.assert_close(_speculators_reference(library, hidden, ids), reference, atol=1e-5, rtol=1e-5)


def test_the_export_config_is_the_librarys(tmp_path, policy, speculators_model, monkeypatch):
    """With speculators installed the export's config.json is built by its classes; without it the same fields
    are written directly: both carry what vLLM reads."""
    import sys

    drafter = Drafter.from_pretrained(write_eagle3(speculators_model[0], tmp_path / "src", "speculators"),
                                      target=policy)
    library = json.loads((export_eagle3_vllm(drafter, tmp_path / "lib", policy) / "config.json").read_text())
    monkeypatch.setitem(sys.modules, "speculators", None)  # import speculators now raises ImportError
    direct = json.loads((export_eagle3_vllm(drafter, tmp_path / "direct", policy) / "config.json").read_text())
    assert library["speculators_version"] != direct["speculators_version"]  # the library wrote the first one
    for key in ("speculators_model_type", "draft_vocab_size", "norm_before_residual",
                "eagle_aux_hidden_state_layer_ids", "speculators_config"):
        assert library[key] == direct[key], key
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "vocab_size", "model_type", "rope_parameters", "rope_theta", "rope_scaling"):
        assert library["transformer_layer_config"][key] == direct["transformer_layer_config"][key], key
    vllm_configs = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    for folder in (tmp_path / "lib", tmp_path / "direct"):
        parsed = vllm_configs.SpeculatorsConfig.from_pretrained(str(folder))  # what vLLM builds its drafter from
        assert parsed.architectures == ["Eagle3LlamaForCausalLM"] and parsed.draft_vocab_size == DRAFT_VOCAB
        assert parsed.eagle_aux_hidden_state_layer_ids == AUX and parsed.norm_before_residual is False


# ------------------------------------------------------------------------------------------------ EAGLE-1 sources
def _eagle1_source(policy, kind: str, seed: int = 2):
    """Random EAGLE-1 tensors by the source's names, and the source's computation as transformers runs it."""
    from transformers import LlamaConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    c = policy.config
    fields = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
                  num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                  vocab_size=c.vocab_size, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False)
    qwen = kind == "fastrl"
    config = (Qwen2Config if qwen else LlamaConfig)(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = (Qwen2DecoderLayer if qwen else LlamaDecoderLayer)(config, 0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn_like(parameter) * (0.05 if parameter.dim() > 1 else 0.3) + (
                1.0 if parameter.dim() == 1 and parameter.shape[0] == c.hidden_size else 0.0))
    layer.input_layernorm = nn.Identity()  # cnets1.py: layer 0 has no input norm (FastRL: nn.Identity)
    fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=not qwen)  # EAGLE-1's default bias=True; FastRL: False
    rotary = LlamaRotaryEmbedding(config)

    def reference(hidden, ids, positions):
        with torch.no_grad():
            x = fc(torch.cat([policy.get_input_embeddings()(ids), hidden], dim=-1))
            mask = torch.full((T, T), torch.finfo(x.dtype).min).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=positions,
                        position_embeddings=rotary(x, positions))
            return policy.get_output_embeddings()(out).float()

    tensors = {f"fc.{k}": v for k, v in fc.state_dict().items()}
    tensors |= {f"layers.0.{k}": v for k, v in layer.state_dict().items()}
    tensors["embed_tokens.weight"] = policy.get_input_embeddings().weight.detach().clone()
    config_dict = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
    return {k: v.detach().clone().contiguous() for k, v in tensors.items()}, config_dict, reference


def write_eagle1(policy, folder: Path, kind: str):
    tensors, config, reference = _eagle1_source(policy, kind)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "eagle-authors":  # ea_model.py: pytorch_model.bin, a Llama config with "bias"
        torch.save(tensors, folder / "pytorch_model.bin")
        config |= {"architectures": ["LlamaForCausalLM"], "bias": True}
    else:  # FastRL's RL drafters (eagle-train/model/qwen2_eagle.py): model.-prefixed, served as Qwen2ForCausalLMEagle
        save_file({f"model.{k}": v for k, v in tensors.items()}, str(folder / "model.safetensors"))
        config |= {"architectures": ["Qwen2ForCausalLMEagle"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, reference


@pytest.mark.parametrize("kind", ["eagle-authors", "fastrl"])
def test_eagle1_layout_loads_and_computes_what_its_source_computes(tmp_path, policy, kind):
    folder, reference = write_eagle1(policy, tmp_path / kind, kind)
    drafter = Drafter.from_pretrained(folder, target=policy)
    assert isinstance(drafter, EagleDrafter)
    assert drafter.config.fc_bias == (kind == "eagle-authors") and drafter.config.qkv_bias == (kind == "fastrl")
    hidden, ids, positions = _inputs(policy.config.hidden_size, features=1)
    expected = reference(hidden, ids, positions)
    torch.testing.assert_close(_draft_logits(drafter, hidden, ids, positions), expected, atol=1e-5, rtol=1e-5)
    # Round trip through the EAGLE-1 exports (the q/k/v biases travel as a Llama layer with a zero o_proj bias).
    if kind == "fastrl":
        again = [load_vllm_export(export_vllm(drafter, tmp_path / "vllm", policy), policy),
                 load_sglang_export(export_sglang(drafter, tmp_path / "sglang", policy), policy)]
    else:  # vLLM's EAGLE-1 fc has no bias: the speculators EAGLE-1 layout (fusion_bias) and SGLang keep it
        again = [load_vllm_export(export_vllm(drafter, tmp_path / "spec", policy, layout="speculators"), policy),
                 load_sglang_export(export_sglang(drafter, tmp_path / "sglang", policy), policy)]
        again.append(Drafter.from_pretrained(tmp_path / "spec", target=policy))
    for loaded in again:
        torch.testing.assert_close(_draft_logits(loaded, hidden, ids, positions), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ wrong policies
def _edit(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        parts = key.split("__")
        target = config
        for part in parts[:-1]:
            target = target[part]
        target[parts[-1]] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layout", list(EAGLE3_LAYOUTS))
def test_an_eagle3_drafter_of_another_policy_is_refused_naming_the_field(tmp_path, policy, speculators_model, layout):
    model, _ = speculators_model
    folder = write_eagle3(model, tmp_path / layout, layout)
    wider = tiny_model("llama", num_hidden_layers=8, hidden_size=64)
    with pytest.raises(ValueError, match="hidden|embed_tokens"):
        Drafter.from_pretrained(folder, target=wider)
    other_vocab = tiny_model("llama", num_hidden_layers=8, vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary|embed_tokens"):
        Drafter.from_pretrained(folder, target=other_vocab)
    shallow = tiny_model("llama", num_hidden_layers=4)
    with torch.no_grad():  # the same token tables, so that only the layers differ
        shallow.get_input_embeddings().weight.copy_(policy.get_input_embeddings().weight)
        shallow.get_output_embeddings().weight.copy_(policy.get_output_embeddings().weight)
    with pytest.raises(ValueError, match=r"reads policy layers .* the policy has 4 layers"):
        Drafter.from_pretrained(folder, target=shallow)
    if layout == "speculators":
        _edit(folder, speculators_config__verifier__architectures=["Qwen2ForCausalLM"])
        with pytest.raises(ValueError, match=r"speculators_config.verifier.architectures"):
            Drafter.from_pretrained(folder, target=policy)


def test_an_eagle1_drafter_of_another_policy_is_refused_naming_the_field(tmp_path, policy):
    folder, _ = write_eagle1(policy, tmp_path / "e1", "eagle-authors")
    with pytest.raises(ValueError, match="embed_tokens .* another model"):
        Drafter.from_pretrained(folder, target=tiny_model("llama", num_hidden_layers=8, hidden_size=64))
    with pytest.raises(ValueError, match="carries its own embed_tokens"):  # same shapes, another policy's weights
        Drafter.from_pretrained(folder, target=tiny_model("llama", num_hidden_layers=8, seed=5))


def test_what_our_drafters_do_not_compute_is_refused_with_the_reason(tmp_path, policy, speculators_model):
    model, _ = speculators_model
    folder = write_eagle3(model, tmp_path / "spec", "speculators")
    for change, reason in (({"fc_norm": True}, "fc_norm"), ({"target_hidden_size": 64}, "target_hidden_size"),
                           ({"speculators_model_type": "dflash"}, "'dflash' drafts differently")):
        copy = tmp_path / f"copy-{reason[:6]}"
        shutil.copytree(folder, copy)
        _edit(copy, **change)
        with pytest.raises(ValueError, match=reason):
            Drafter.from_pretrained(copy, target=policy)
    with pytest.raises(ValueError, match="pass target=policy"):
        Drafter.from_pretrained(folder)
    for extra, reason in ((1, "says num_hidden_layers=1 but holds the weights of 2 decoder layers"),
                          (2, r"decoder layers \[0, 2\]: layers.1.\* and on must follow")):
        deeper = tmp_path / f"extra-layer-{extra}"
        shutil.copytree(folder, deeper)
        tensors = read_weights(deeper)
        tensors |= {k.replace("layers.0.", f"layers.{extra}."): v.clone() for k, v in tensors.items()
                    if k.startswith("layers.0.")}
        save_file(tensors, str(deeper / "model.safetensors"))
        with pytest.raises(ValueError, match=reason):
            Drafter.from_pretrained(deeper, target=policy)


def test_a_two_layer_eagle3_drafter_loads_computes_and_exports_what_the_library_computes(
        tmp_path, policy, speculators_two_layers):
    """vLLM and the speculators library stack plain decoder layers after EAGLE-3's first one (``layers.1.*``)."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    model, chosen = speculators_two_layers
    drafter = Drafter.from_pretrained(write_eagle3(model, tmp_path / "src", "speculators"), target=policy)
    assert isinstance(drafter, Eagle3Drafter) and drafter.config.num_hidden_layers == 2
    assert len(drafter.later_layers) == 1 and torch.equal(drafter.d2t, chosen)
    hidden, ids, positions = _inputs(policy.config.hidden_size)
    reference = _speculators_reference(model, hidden, ids)
    torch.testing.assert_close(_draft_logits(drafter, hidden, ids, positions), reference, atol=1e-5, rtol=1e-5)
    vllm_dir = export_eagle3_vllm(drafter, tmp_path / "vllm", policy)
    assert json.loads((vllm_dir / "config.json").read_text())["transformer_layer_config"]["num_hidden_layers"] == 2
    assert "layers.1.self_attn.q_proj.weight" in read_weights(vllm_dir)
    config = SpeculatorModelConfig.from_pretrained(str(vllm_dir))
    config.transformer_layer_config._attn_implementation = "eager"
    library = SpeculatorModel.from_pretrained(str(vllm_dir), config=config).eval()
    torch.testing.assert_close(_speculators_reference(library, hidden, ids), reference, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="SGLang's EAGLE-3 model .* has one"):
        export_eagle3_sglang(drafter, tmp_path / "sglang", policy)


# ------------------------------------------------------------------------------------------------ the Hub
@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    """Only the Hub's network is mocked: uploads are copied to a local folder, downloads read from it."""
    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: repo_id)

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        shutil.copytree(folder_path, hub / repo_id, dirs_exist_ok=True)
        return f"https://huggingface.co/{repo_id}/commit/0123abc"

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    def snapshot_download(repo_id, allow_patterns=None, **kwargs):  # copies what the patterns allow
        import fnmatch

        local = hub.parent / "downloads" / repo_id
        for file in (hub / repo_id).iterdir():
            if allow_patterns is None or any(fnmatch.fnmatch(file.name, p) for p in allow_patterns):
                local.mkdir(parents=True, exist_ok=True)
                shutil.copy(file, local / file.name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return hub


def test_a_hub_id_in_another_layout_loads(local_hub, policy, speculators_model):
    model, chosen = speculators_model
    repo = write_eagle3(model, local_hub / "someone" / "eagle3-drafter", "eagle-authors")
    (repo / "optimizer_state.pt").write_bytes(b"0" * 1000)  # training states some repos hold are not downloaded
    drafter = Drafter.from_pretrained("someone/eagle3-drafter", target=policy)
    assert torch.equal(drafter.d2t, chosen)
    downloaded = local_hub.parent / "downloads" / "someone" / "eagle3-drafter"
    assert sorted(p.name for p in downloaded.iterdir()) == ["config.json", "pytorch_model.bin"]


def test_push_to_hub_in_the_speculators_layout_uploads_what_vllm_loads(local_hub, policy, speculators_model):
    drafter = Drafter.from_pretrained(write_eagle3(speculators_model[0], local_hub.parent / "src", "eagle-authors"),
                                      target=policy)
    drafter.push_to_hub("someone/tiny-eagle3", layout="speculators", verifier_name_or_path=policy)
    uploaded = local_hub / "someone" / "tiny-eagle3"
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    card = (uploaded / "README.md").read_text()
    assert '"model": "someone/tiny-eagle3"' in card and "eagle3" in card
    hidden, ids, positions = _inputs(policy.config.hidden_size)
    again = Drafter.from_pretrained("someone/tiny-eagle3", target=policy)
    torch.testing.assert_close(_draft_logits(again, hidden, ids, positions),
                               _draft_logits(drafter, hidden, ids, positions), atol=1e-6, rtol=1e-6)
    vllm_configs = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    parsed = vllm_configs.SpeculatorsConfig.from_pretrained(str(uploaded))
    assert parsed.architectures == ["Eagle3LlamaForCausalLM"]
    config = json.loads((uploaded / "config.json").read_text())
    assert vllm_configs.SpeculatorsConfig.extract_vllm_speculative_config(config) == {
        "method": "eagle3", "num_speculative_tokens": 3}


# ------------------------------------------------------------------------------------------------ file details
@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
], ids=lambda s: s["rope_type"])
def test_a_scaled_rope_rotates_as_transformers_does(scaling):
    """Public drafters for Llama-3.1 policies carry the policy's scaled RoPE; the drafter rotates as transformers'
    own Llama layer does for that config (which vLLM and SGLang follow)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from tlt_trainers.drafter.rope import RotaryFrequencies

    original = scaling.get("original_max_position_embeddings", 2048)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                         max_position_embeddings=int(original * scaling["factor"]),
                         rope_parameters={**scaling, "rope_theta": 500000.0})
    positions = torch.tensor([[0, 5, 1000, 30000]])
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, 4, 64), positions)
    ours_cos, ours_sin = RotaryFrequencies(16, 500000.0, scaling)(positions, torch.float32)
    torch.testing.assert_close(ours_cos[:, 0], cos, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours_sin[:, 0], sin, atol=1e-6, rtol=1e-5)


def test_scaled_rope_travels_through_load_and_export(tmp_path, policy, speculators_model):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    folder = write_eagle3(speculators_model[0], tmp_path / "authors", "eagle-authors")
    _edit(folder, rope_theta=500000.0, rope_scaling=scaling)
    drafter = Drafter.from_pretrained(folder, target=policy)
    assert drafter.config.rope_theta == 500000.0 and drafter.config.rope_scaling == scaling
    again = Drafter.from_pretrained(export_eagle3_vllm(drafter, tmp_path / "vllm", policy), target=policy)
    assert again.config.rope_scaling == scaling
    _edit(folder, rope_scaling={"rope_type": "yarn", "factor": 4.0})  # scales from max_position_embeddings
    assert Drafter.from_pretrained(folder, target=policy).config.rope_scaling["original_max_position_embeddings"] \
        == 2048
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        _edit(folder, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
        Drafter.from_pretrained(folder, target=policy)


def test_an_sglang_eagle1_export_loads_back_with_its_draft_vocabulary(tmp_path):
    policy = tiny_model("llama")
    drafter = EagleDrafter.from_target(policy, draft_vocab_size=24)
    drafter.set_draft_vocab(torch.arange(30, 54))
    loaded = Drafter.from_pretrained(export_sglang(drafter, tmp_path / "sglang", policy), target=policy)
    assert torch.equal(loaded.d2t, drafter.d2t) and not loaded.config.fc_bias  # the zero bias SGLang needs is gone
    hidden, ids, positions = _inputs(32, features=1)
    torch.testing.assert_close(_draft_logits(loaded, hidden, ids, positions),
                               _draft_logits(drafter, hidden, ids, positions), atol=1e-6, rtol=1e-6)


def test_pytorch_model_bin_is_read_without_running_pickled_code(tmp_path, policy):
    folder, _ = write_eagle1(policy, tmp_path / "e1", "eagle-authors")
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    state["extra"] = Path("not-a-tensor")  # a pickled object of another class: weights_only refuses it
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        Drafter.from_pretrained(folder, target=policy)
