"""Export an :class:`~tlt_trainers.drafter.eagle3.Eagle3Drafter` where vLLM and SGLang load EAGLE-3 drafters.

Both engines run the same EAGLE-3 layer as ours (``midlayer``: q/k/v over ``[input_layernorm(embed);
hidden_norm(feature)]``, residual from the un-normed feature, then ``norm`` and an own ``lm_head`` over the draft
vocabulary), take the embedding from the target, and store the draft-to-target map as offsets
(``d2t[i] = target_id - i``) plus a boolean ``t2d`` over the target vocabulary. What differs:

- vLLM (:func:`export_eagle3_vllm`): the ``speculators`` layout (``speculators_model_type="eagle3"``,
  ``transformer_layer_config``, ``speculators_config`` with the verifier and the number of speculative tokens,
  ``eagle_aux_hidden_state_layer_ids`` in vLLM's numbering, which is ours; the layer as ``layers.0.*``, the only name
  the speculators library's loader reads, and a deeper drafter's later layers as ``layers.1.*`` and on). Serve with
  ``LLM(policy, speculative_config={"method": "eagle3", "model": out_dir, "num_speculative_tokens": k})`` or
  ``LLM(out_dir)`` (vLLM then serves the verifier the config names with the drafter).
- SGLang (:func:`export_eagle3_sglang`): the EAGLE-3 reference layout, a Llama config with
  ``architectures=["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size``. SGLang numbers aux layers by the layer whose
  output is taken (it captures ``id + 1``), so ``eagle_config.eagle_aux_hidden_state_layer_ids`` holds ours minus
  one. Serve with ``--speculative-algorithm EAGLE3 --speculative-draft-model-path out_dir``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .eagle3 import Eagle3Drafter
from .export import (
    _dtype_name,
    _embed_scale,
    _llama_config,
    _max_positions,
    _name_or_path,
    _write,
    speculators_config,
)


def eagle3_weights(drafter: Eagle3Drafter, dtype: torch.dtype | None = None,
                   layer_prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """The drafter's tensors by the names the engines read (``fc``, the layer under ``layer_prefix``, ``norm``,
    ``lm_head``, and with a draft vocabulary ``d2t`` as offsets and ``t2d``), on CPU in ``dtype`` (default: the
    drafter's). ``layer_prefix``: ``"midlayer."`` (the EAGLE authors' and SGLang's name, which skips any other
    silently; vLLM reads both) or ``"layers.0."`` (the speculators library's, whose loader reads only that)."""
    if _embed_scale(drafter.target.embed) is not None:
        raise ValueError("The policy scales its embedding (Gemma): vLLM and SGLang hand an EAGLE-3 drafter the "
                         "unscaled embedding and run EAGLE-3 for Llama and Qwen3 policies only. Serve this drafter "
                         "with tlt_trainers' own engine.")
    dtype = dtype or drafter.fc.weight.dtype
    tensors = {engine_name(name, layer_prefix): t.detach().to(device="cpu", dtype=dtype).contiguous()
               for name, t in drafter.state_dict().items() if name != "d2t"}
    return tensors | draft_vocab_maps(drafter)


def engine_name(name: str, layer_prefix: str = "midlayer.") -> str:
    """An Eagle3Drafter tensor's name in the engines' layouts: the first layer under ``layer_prefix``, a deeper
    drafter's ``later_layers.i`` as ``layers.{i + 1}`` (vLLM's numbering)."""
    if name.startswith("midlayer."):
        return layer_prefix + name[len("midlayer."):]
    if name.startswith("later_layers."):
        index, rest = name[len("later_layers."):].split(".", 1)
        return f"layers.{int(index) + 1}.{rest}"
    return name


def draft_vocab_maps(drafter) -> dict[str, torch.Tensor]:
    """A draft vocabulary as the engines store it: ``d2t`` as offsets (``d2t[i] = target_id - i``, what they add to
    ``arange``) and a boolean ``t2d`` over the target vocabulary; none for a full-vocabulary drafter (vLLM has no
    parameter for a map then)."""
    if drafter.d2t is None:
        return {}
    d2t = drafter.d2t.cpu()
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    return {"d2t": (d2t - torch.arange(len(d2t))).contiguous(), "t2d": t2d}


def _layer_config(drafter: Eagle3Drafter, architectures: list[str], verifier, max_positions: int | None,
                  dtype: torch.dtype) -> dict:
    config = _llama_config(drafter, architectures, _max_positions(verifier, max_positions), dtype)
    config["draft_vocab_size"] = drafter.draft_vocab_size
    config["num_hidden_layers"] = drafter.config.num_hidden_layers  # vLLM stacks layers.1, ... after the first
    return config


def export_eagle3_vllm(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    verifier_name_or_path: str | nn.Module | None = None,
    *,
    num_speculative_tokens: int = 3,
    max_position_embeddings: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``drafter`` in the speculators EAGLE-3 layout vLLM loads (``Eagle3LlamaForCausalLM``).

    ``verifier_name_or_path``: the policy's Hub id or path (default: the drafter's ``target_name_or_path``), or the
    policy module (its config gives the name, architectures and ``max_position_embeddings``). Returns the folder.
    """
    c = drafter.config
    dtype = dtype or drafter.fc.weight.dtype
    name = _name_or_path(verifier_name_or_path) or c.target_name_or_path
    layer = _layer_config(drafter, ["LlamaForCausalLM"], verifier_name_or_path, max_position_embeddings, dtype)
    layer = {k: v for k, v in layer.items() if k not in ("architectures", "torch_dtype", "draft_vocab_size")}
    config = speculators_eagle3_config(
        layer, draft_vocab_size=drafter.draft_vocab_size, norm_before_residual=c.norm_before_residual,
        aux_layer_ids=list(c.aux_layer_ids),
        proposal=speculators_config("eagle3", name, verifier_name_or_path, num_speculative_tokens))
    config["torch_dtype"] = _dtype_name(dtype)
    out = Path(out_dir)
    tensors = eagle3_weights(drafter, dtype, layer_prefix="layers.0.")
    # The speculators library saves the verifier's embedding with the drafter, and its loader (0.9) reads it from
    # the checkpoint: without it the embedding stays uninitialised there. vLLM shares it with the target when equal.
    tensors["embed_tokens.weight"] = drafter.target.embed.weight.detach().to(device="cpu", dtype=dtype).contiguous()
    _write(out, config, tensors, "speculators eagle3")
    return out


def speculators_eagle3_config(layer: dict, *, draft_vocab_size: int, norm_before_residual: bool,
                              aux_layer_ids: list[int], proposal: dict) -> dict:
    """config.json of the speculators EAGLE-3 layout (what vLLM reads for ``method="eagle3"``).

    Built by the ``speculators`` library's own config classes where it is installed (``pip install
    tlt-trainers[speculators]``): the library is the authority for its format. Without it, the same fields are
    written directly (tests compare the two).
    """
    fields = {"draft_vocab_size": int(draft_vocab_size), "norm_before_residual": bool(norm_before_residual),
              "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    try:
        from speculators import SpeculatorsConfig, VerifierConfig
        from speculators.models import Eagle3SpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig
        from transformers import LlamaConfig
    except ImportError:
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": "0.3.0", "transformer_layer_config": layer, **fields,
                "speculators_config": proposal}
    method = proposal["proposal_methods"][0]
    library = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(**{k: v for k, v in layer.items() if k not in ("rope_theta",
                                                                                           "rope_scaling")}),
        speculators_config=SpeculatorsConfig(
            algorithm=proposal["algorithm"],
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=method["speculative_tokens"])],
            default_proposal_method=proposal["default_proposal_method"],
            verifier=VerifierConfig(**proposal["verifier"])),
        **fields)
    config = library.to_dict()
    config.pop("auto_map", None)  # points at a config.py next to a save_pretrained folder; none is written here
    # The library writes transformers 5's rope_parameters only; readers on transformers 4.x read these two.
    config["transformer_layer_config"] |= {k: layer[k] for k in ("rope_theta", "rope_scaling") if k in layer}
    return config


def export_eagle3_sglang(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike,
    target_model: str | nn.Module | None = None,
    *,
    max_position_embeddings: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``drafter`` in the EAGLE-3 reference layout SGLang loads (``LlamaForCausalLMEagle3``)."""
    c = drafter.config
    if c.num_hidden_layers != 1:
        raise ValueError(f"This EAGLE-3 drafter has {c.num_hidden_layers} decoder layers; SGLang's EAGLE-3 model "
                         "(LlamaForCausalLMEagle3) has one. Serve it with vLLM (export_eagle3_vllm), which stacks "
                         "them.")
    if c.norm_before_residual:
        raise ValueError("SGLang's EAGLE-3 layer keeps the un-normed feature as its residual; this drafter was "
                         "trained with norm_before_residual=True. Serve it with vLLM (export_eagle3_vllm).")
    dtype = dtype or drafter.fc.weight.dtype
    config = _layer_config(drafter, ["LlamaForCausalLMEagle3"], target_model, max_position_embeddings, dtype)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in c.aux_layer_ids],
                              "use_aux_hidden_state": True}
    if c.target_name_or_path:
        config["target_model"] = c.target_name_or_path
    out = Path(out_dir)
    _write(out, config, eagle3_weights(drafter, dtype), "sglang eagle3")
    return out
