"""Write one of our drafters in the layouts other tools publish, for tests that start from such a checkpoint.

Names follow the sources cited in tests/test_drafter_layouts.py: the EAGLE authors' EAGLE-3 (SafeAILab/EAGLE
``eagle/traineagle3``: a Llama config with ``draft_vocab_size`` and no layer ids, ``pytorch_model.bin`` with ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` as offsets and ``t2d``, without the frozen embedding) and the TLT
authors' EAGLE drafters for Qwen2.5 (mit-han-lab/fastrl ``eagle-train/model/qwen2_eagle.py``: ``model.``-prefixed
names with the embedding, Qwen2 attention with q/k/v biases, served as ``Qwen2ForCausalLMEagle``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tlt_trainers import Eagle3Drafter, EagleDrafter
from tlt_trainers.drafter.export import _llama_config
from tlt_trainers.drafter.export_eagle3 import eagle3_weights
from tlt_trainers.modeling.target import text_config


def write_eagle_authors_eagle3(drafter: Eagle3Drafter, policy, folder: Path) -> Path:
    layers = text_config(policy).num_hidden_layers
    assert list(drafter.config.aux_layer_ids) == [2, layers // 2, layers - 3], "the layout names no layer ids"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(eagle3_weights(drafter, torch.float16), folder / "pytorch_model.bin")  # their files are fp16
    config = _llama_config(drafter, ["LlamaForCausalLM"], 2048, torch.float16)
    config = {k: v for k, v in config.items() if k not in ("rope_parameters", "head_dim", "rope_scaling")}
    config["draft_vocab_size"] = drafter.draft_vocab_size
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_fastrl_eagle(drafter: EagleDrafter, policy, folder: Path) -> Path:
    assert drafter.config.qkv_bias and not drafter.config.fc_bias
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in drafter.state_dict().items() if k != "d2t"}
    tensors = {("model." + k if k.startswith("fc.") else "model.layers.0." + k): v.detach().float().contiguous()
               for k, v in state.items()}
    tensors["model.embed_tokens.weight"] = policy.get_input_embeddings().weight.detach().float().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = _llama_config(drafter, ["Qwen2ForCausalLMEagle"], 2048, torch.float32) | {"model_type": "qwen2"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
