"""Export an :class:`EagleDrafter` to the EAGLE-1 layouts vLLM and SGLang load, and read such exports back.

Both engines run the same EAGLE-1 drafter as ours: ``fc`` over ``cat([embed(x_{t+1}), h_t])``, one Llama decoder
layer whose input norm is skipped, the output fed to the policy's LM head. Both take the embedding and the LM head
from the served target model, so no export here contains ``embed_tokens`` or ``lm_head`` weights. What differs is the
file layout (see docs/export_formats.md for the sources):

- vLLM (``speculative_config={"method": "eagle", "model": dir}``): a Llama config.json (``num_hidden_layers=1``,
  ``architectures=["LlamaForCausalLM"]``, which vLLM renames to ``EagleLlamaForCausalLM``) and ``fc.weight`` plus
  ``layers.0.*`` in model.safetensors. vLLM's ``fc`` has no bias and its drafter scores the full vocabulary.
- speculators (``layout="speculators"`` of :func:`export_vllm`): the ``speculators`` library's EAGLE-1 layout
  (``speculators_model_type="eagle"``, ``fusion_fc.*``, ``transformer.*``). vLLM reads speculators configs only for
  the model types it registers (eagle3 and newer, not "eagle"), so serve vLLM from the default layout.
- SGLang (``--speculative-algorithm EAGLE --speculative-draft-model-path dir``): a Llama config.json with
  ``architectures=["LlamaForCausalLMEagle"]`` and ``fc.weight``, ``fc.bias`` (SGLang's fc always has a bias: ours is
  written as zeros when we have none) plus ``layers.0.*``. A draft vocabulary becomes SGLang's FR-Spec token map,
  ``hot_token_map.pt``, passed with ``--speculative-token-map``: SGLang slices the target's head with it exactly as
  ``d2t`` does here.

Exports compute what the drafter computes: a setting a format cannot express raises a ValueError naming the way out.
The one exception is opt-in: ``full_vocab_head=True`` drafts over the full vocabulary where an engine has no draft
vocabulary (other draft probabilities, same decoded output, since the target verifies every token).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..modeling.target import logit_transform, text_config
from .config import CONFIG_NAME, WEIGHTS_NAME, EagleDrafterConfig
from .eagle import EagleDrafter

SGLANG_TOKEN_MAP = "hot_token_map.pt"
# Written when neither the policy nor an explicit value says how long the served context may be. vLLM caps the
# drafter's context at this and sizes its RoPE cache by it: pass the policy (or max_position_embeddings) to match it.
DEFAULT_MAX_POSITIONS = 131072

_LAYOUTS = ("vllm", "speculators")


# ------------------------------------------------------------------------------------------------ helpers
def _embed_scale(embed: nn.Module) -> float | None:
    """The factor a scaled embedding module (Gemma) multiplies into its output; None for a plain nn.Embedding.

    vLLM and SGLang hand the drafter the target's raw ``embed_tokens`` (their Gemma models scale in the model's
    forward instead), so the exporters fold this factor into the embedding half of ``fc``.
    """
    scale = getattr(embed, "embed_scale", None)
    if scale is None:
        return None
    value = float(torch.as_tensor(scale).to(embed.weight.dtype))
    return None if value == 1.0 else value


def _name_or_path(target) -> str | None:
    if target is None or isinstance(target, str):
        return target
    if isinstance(target, os.PathLike):
        return os.fspath(target)
    return getattr(text_config(target), "_name_or_path", None) or getattr(target, "name_or_path", None) or None


def _max_positions(target, explicit: int | None) -> int:
    if explicit is not None:
        return int(explicit)
    if isinstance(target, nn.Module):
        value = getattr(text_config(target), "max_position_embeddings", None)
        if value:
            return int(value)
    return DEFAULT_MAX_POSITIONS


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_layer(drafter: EagleDrafter, engine: str) -> None:
    if drafter.config.input_layernorm:
        raise ValueError(
            f"{engine} skips the input norm of the drafter's first decoder layer (EAGLE-1), but this drafter has "
            "one (config.input_layernorm=True): it cannot be exported without changing what it computes. Train a "
            "drafter with input_layernorm=False to serve it there."
        )


def _check_vocab(drafter: EagleDrafter, engine: str, full_vocab_head: bool) -> bool:
    """True when the export drafts over the full vocabulary although the drafter has a draft vocabulary."""
    if not drafter.config.uses_draft_vocab:
        return False
    if full_vocab_head:
        return True
    raise ValueError(
        f"{engine}'s EAGLE-1 drafter scores the target's full vocabulary and has no draft-to-target id map, but this "
        f"drafter drafts over {drafter.config.draft_vocab_size} of {drafter.config.vocab_size} tokens. Pass "
        "full_vocab_head=True to export it with the full head (decoding stays lossless: the target verifies every "
        "token; drafting costs more and acceptance may differ from what was measured), or serve it with SGLang, "
        "whose token map keeps the draft vocabulary exactly."
    )


_LAYER_PREFIXES = ("self_attn.", "post_attention_layernorm.", "mlp.")


def _layer_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype | None
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The decoder layer's tensors of an EagleDrafter state dict under their Llama names (no prefix), and fc's
    bias (None without one). ``dtype=None`` keeps each tensor's dtype.

    fc.weight is returned separately by :func:`_fc_weight`; d2t and the input norm are not layer tensors.
    """
    def plain(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()

    layer = {name: plain(tensor) for name, tensor in state.items() if name.startswith(_LAYER_PREFIXES)}
    if "self_attn.q_proj.bias" in layer and "self_attn.o_proj.bias" not in layer:
        # Llama layers with attention_bias=True (vLLM's, SGLang's, transformers') also bias o_proj: zeros compute
        # what the drafter's Qwen2-style q/k/v-only biases compute.
        o_proj = layer["self_attn.o_proj.weight"]
        layer["self_attn.o_proj.bias"] = torch.zeros(o_proj.shape[0], dtype=o_proj.dtype)
    bias = state.get("fc.bias")
    return layer, None if bias is None else plain(bias)


def _fc_weight(state: dict[str, torch.Tensor], embed_scale: float | None, dtype: torch.dtype | None) -> torch.Tensor:
    """fc.weight with the policy's embedding scale (if any) folded into its embedding half (the first
    ``hidden_size`` input columns: fc reads ``cat([embed(x), h])``)."""
    weight = state["fc.weight"]
    out_dtype = dtype or weight.dtype
    weight = weight.detach().to(device="cpu", dtype=torch.float32).clone()
    if embed_scale is not None:
        weight[:, : weight.shape[0]] *= embed_scale
    return weight.to(out_dtype).contiguous()


def eagle_state_dict_to_vllm(
    state: dict[str, torch.Tensor],
    *,
    embed_scale: float | None = None,
    full_vocab_head: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """An :class:`EagleDrafter` state dict under the names vLLM's EAGLE-1 checkpoint uses: ``fc.weight`` and
    ``layers.0.{self_attn,post_attention_layernorm,mlp}.*`` (what :func:`export_vllm` writes and what
    ``EagleLlamaForCausalLM.load_weights`` reads), on CPU, in ``dtype`` (default: as given).

    ``embed_scale``: the factor a scaled policy embedding (Gemma) multiplies in, folded into ``fc`` because vLLM
    hands the drafter the unscaled ``embed_tokens``; :func:`vllm_weights` reads it from a bound drafter. The checks
    a bare state dict allows are made here (first-layer input norm, draft vocabulary, a non-zero fc bias); the
    ones that need the drafter's config (logit soft-capping) are made by :func:`vllm_weights`.
    """
    if "input_layernorm.weight" in state:
        raise ValueError(
            "vLLM skips the input norm of the drafter's first decoder layer (EAGLE-1), but this drafter has one "
            "(config.input_layernorm=True): it cannot be exported without changing what it computes. Train a "
            "drafter with input_layernorm=False to serve it there."
        )
    if "d2t" in state and not full_vocab_head:
        raise ValueError(
            f"vLLM's EAGLE-1 drafter scores the target's full vocabulary and has no draft-to-target id map, but this "
            f"drafter drafts over {state['d2t'].numel()} tokens of the vocabulary. Pass full_vocab_head=True to "
            "export it with the full head (decoding stays lossless: the target verifies every token; drafting costs "
            "more and acceptance may differ from what was measured), or serve it with SGLang, whose token map keeps "
            "the draft vocabulary exactly."
        )
    unknown = sorted(name for name in state if name not in ("fc.weight", "fc.bias", "d2t")
                     and not name.startswith(_LAYER_PREFIXES))
    if unknown:
        raise ValueError(f"Not an EagleDrafter state dict: it holds tensors an EAGLE-1 drafter lacks: {unknown}.")
    if "fc.weight" not in state:
        raise ValueError("Not an EagleDrafter state dict: it has no fc.weight.")
    layer, bias = _layer_tensors(state, dtype)
    if bias is not None and torch.count_nonzero(bias):
        raise ValueError(
            "vLLM's EAGLE-1 fc has no bias (llama_eagle.py builds it with bias=False) and this drafter's fc bias "
            "is not zero. Export with layout='speculators' (fusion_bias), serve with SGLang, or train with "
            "fc_bias=False."
        )
    # An all-zero bias is dropped: without it fc computes the same.
    return {"fc.weight": _fc_weight(state, embed_scale, dtype)} | {f"layers.0.{k}": v for k, v in layer.items()}


def speculators_config(algorithm: str, name: str | None, verifier, num_speculative_tokens: int) -> dict:
    """The ``speculators_config`` block of a speculators checkpoint: a greedy proposal of ``num_speculative_tokens``
    and the verifier (``name``; its architectures when ``verifier`` is the policy module)."""
    if not name:
        raise ValueError("The speculators layout names its verifier: pass verifier_name_or_path (the policy's Hub id "
                         "or path).")
    architectures = []
    if isinstance(verifier, nn.Module):
        architectures = list(getattr(verifier.config, "architectures", None) or [])
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                              "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": name, "architectures": architectures},
    }


def _llama_config(drafter: EagleDrafter, architectures: list[str], max_positions: int, dtype: torch.dtype) -> dict:
    """The Llama fields both engines read for the drafter's decoder layer (explicit, transformers-version free)."""
    c = drafter.config
    return {
        "architectures": architectures,
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        # rope_theta/rope_scaling for readers on transformers 4.x, rope_parameters for transformers 5.
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rope_parameters": (c.rope_scaling or {"rope_type": "default"}) | {"rope_theta": c.rope_theta},
        "max_position_embeddings": max_positions,
        "vocab_size": c.vocab_size,
        "attention_bias": bool(c.qkv_bias),
        "mlp_bias": False,
        # Never tie: SGLang would then slice its embedding along with a token-mapped head.
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
    }


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], fmt: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt", "exported_by": f"tlt_trainers ({fmt})"})


# ------------------------------------------------------------------------------------------------ vLLM
def _check_vllm(drafter: EagleDrafter, full_vocab_head: bool) -> None:
    _check_layer(drafter, "vLLM")
    _check_vocab(drafter, "vLLM", full_vocab_head)
    if drafter.config.final_logit_softcapping is not None:
        raise ValueError(
            "vLLM's EAGLE drafter applies no logit soft-capping, but this drafter's policy soft-caps its logits "
            f"({drafter.config.final_logit_softcapping}): the exported drafter would sample from other probabilities."
        )


def vllm_weights(
    drafter: EagleDrafter, *, full_vocab_head: bool = False, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The tensors :func:`export_vllm` writes (default layout) for ``drafter``, by the names vLLM's
    ``EagleLlamaForCausalLM.load_weights`` reads, on CPU in ``dtype`` (default: the drafter's).

    This is the one mapping from an :class:`EagleDrafter` to vLLM's EAGLE-1: the export writes it to
    model.safetensors, and :mod:`tlt_trainers.vllm` loads it into a running engine. Raises ValueError for what
    vLLM's drafter cannot compute as ours does (see :func:`export_vllm`).
    """
    _check_vllm(drafter, full_vocab_head)
    return eagle_state_dict_to_vllm(drafter.state_dict(), embed_scale=_embed_scale(drafter.target.embed),
                                    full_vocab_head=full_vocab_head, dtype=dtype or drafter.fc.weight.dtype)


def export_vllm(
    drafter: EagleDrafter,
    out_dir: str | os.PathLike,
    verifier_name_or_path: str | nn.Module | None = None,
    *,
    layout: str = "vllm",
    num_speculative_tokens: int = 3,
    max_position_embeddings: int | None = None,
    full_vocab_head: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``drafter`` where vLLM's EAGLE-1 drafter (``llama_eagle.EagleLlamaForCausalLM``) loads it.

    ``layout="vllm"`` (default): config.json is a Llama config with one layer and
    ``architectures=["LlamaForCausalLM"]`` (vLLM's ``method="eagle"`` prefixes it to ``EagleLlamaForCausalLM``);
    model.safetensors holds ``fc.weight`` and ``layers.0.{self_attn,post_attention_layernorm,mlp}.*``. Serve with
    ``LLM(policy, speculative_config={"method": "eagle", "model": out_dir, "num_speculative_tokens": k})``.

    ``layout="speculators"``: the ``speculators`` library's EAGLE-1 checkpoint (``speculators_model_type="eagle"``,
    ``speculators_config`` with a greedy proposal of ``num_speculative_tokens`` and the ``verifier``,
    ``transformer_layer_config``, ``layernorms=False``, ``fusion_bias``; weights ``fusion_fc.*`` and
    ``transformer.*``). vLLM reads speculators configs only for the types it registers (eagle3 and newer), so this
    layout is for the speculators tooling; serve vLLM from the default layout.

    No ``embed_tokens`` or ``lm_head`` is written: vLLM shares the target's when the checkpoint has none (its
    ``has_own_lm_head``/``has_own_embed_tokens`` checks), which is what this drafter was trained against. A policy
    whose embedding module scales its output (Gemma) has that scale folded into ``fc``, because vLLM hands the
    drafter the unscaled ``embed_tokens``.

    ``verifier_name_or_path``: the policy's Hub id or path (default: the drafter's ``target_name_or_path``), or the
    policy module itself (its config gives the name, architectures and ``max_position_embeddings``).

    Raises ValueError for what vLLM's drafter cannot compute as ours does: a draft vocabulary (unless
    ``full_vocab_head=True``, which drafts over the full vocabulary instead: still lossless, as vLLM verifies every
    token), an fc bias that is not zero, a first-layer input norm, or a policy with logit soft-capping.
    Returns the output directory.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {_LAYOUTS}.")
    c = drafter.config
    dtype = dtype or drafter.fc.weight.dtype
    out = Path(out_dir)
    name = _name_or_path(verifier_name_or_path) or c.target_name_or_path
    max_positions = _max_positions(verifier_name_or_path, max_position_embeddings)
    llama = _llama_config(drafter, ["LlamaForCausalLM"], max_positions, dtype)
    if c.logit_scale != 1.0:
        llama["logit_scale"] = c.logit_scale  # EagleLlamaForCausalLM passes config.logit_scale to its LogitsProcessor

    if layout == "vllm":
        _write(out, llama, vllm_weights(drafter, full_vocab_head=full_vocab_head, dtype=dtype), "vllm eagle")
        return out

    _check_vllm(drafter, full_vocab_head)
    state = drafter.state_dict()
    layer, bias = _layer_tensors(state, dtype)
    fc = {"weight": _fc_weight(state, _embed_scale(drafter.target.embed), dtype)}
    if bias is not None:
        fc["bias"] = bias
    layer_config = {k: v for k, v in llama.items() if k not in ("architectures", "torch_dtype", "logit_scale")}
    config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer_config,
        "layernorms": False,
        "fusion_bias": bias is not None,
        "speculators_config": speculators_config("eagle", name, verifier_name_or_path, num_speculative_tokens),
        "torch_dtype": _dtype_name(dtype),
    }
    if c.logit_scale != 1.0:
        config["logit_scale"] = c.logit_scale
    tensors = {f"fusion_fc.{k}": v for k, v in fc.items()} | {f"transformer.{k}": v for k, v in layer.items()}
    _write(out, config, tensors, "speculators eagle")
    return out


# ------------------------------------------------------------------------------------------------ SGLang
def export_sglang(
    drafter: EagleDrafter,
    out_dir: str | os.PathLike,
    target_model: str | nn.Module | None = None,
    *,
    max_position_embeddings: int | None = None,
    full_vocab_head: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``drafter`` where SGLang's EAGLE-1 drafter (``llama_eagle.LlamaForCausalLMEagle``) loads it.

    config.json: a Llama config with one layer and ``architectures=["LlamaForCausalLMEagle"]`` (plus
    ``final_logit_softcapping`` when the policy soft-caps, which SGLang's LogitsProcessor reads). model.safetensors:
    ``fc.weight``, ``fc.bias`` (SGLang's fc always has a bias; zeros when ours has none, which computes the same)
    and ``layers.0.{self_attn,post_attention_layernorm,mlp}.*``. No ``embed_tokens``/``lm_head``: SGLang's EAGLE
    worker replaces both with the target's (``set_embed_and_head``). A scaled policy embedding (Gemma) is folded into
    ``fc`` as for vLLM.

    A draft vocabulary is written as SGLang's token map, ``hot_token_map.pt`` (the draft ids' target ids, read by
    SGLang with ``torch.load(weights_only=True)``; the one non-safetensors file, holding only an int64 tensor). SGLang
    then drafts over ``head[hot_token_id]`` and maps draft ids through it, as ``d2t`` does here. Serve with
    ``--speculative-algorithm EAGLE --speculative-draft-model-path out_dir --speculative-token-map
    out_dir/hot_token_map.pt``; without the flag SGLang would draft over the full vocabulary.
    ``full_vocab_head=True`` skips the map (full-vocabulary drafting, still lossless).

    ``target_model``: the policy's name or the policy module (its config gives ``max_position_embeddings``).
    Raises ValueError for a first-layer input norm or a policy logit scale other than 1 (SGLang's EAGLE drafter
    applies none). Returns the output directory.
    """
    _check_layer(drafter, "SGLang")
    full_head = full_vocab_head or not drafter.config.uses_draft_vocab
    c = drafter.config
    if c.logit_scale != 1.0:
        raise ValueError(
            f"SGLang's EAGLE drafter applies no logit scale, but this drafter's policy scales its logits by "
            f"{c.logit_scale}: the exported drafter would sample from other probabilities."
        )
    dtype = dtype or drafter.fc.weight.dtype
    state = drafter.state_dict()
    layer, bias = _layer_tensors(state, dtype)
    if bias is None:
        bias = torch.zeros(c.hidden_size, dtype=dtype)
    config = _llama_config(drafter, ["LlamaForCausalLMEagle"], _max_positions(target_model, max_position_embeddings),
                           dtype)
    if c.final_logit_softcapping is not None:
        config["final_logit_softcapping"] = c.final_logit_softcapping
    tensors = {"fc.weight": _fc_weight(state, _embed_scale(drafter.target.embed), dtype), "fc.bias": bias}
    tensors |= {f"layers.0.{k}": v for k, v in layer.items()}
    out = Path(out_dir)
    _write(out, config, tensors, "sglang eagle")
    token_map = out / SGLANG_TOKEN_MAP
    if not full_head:
        torch.save(drafter.d2t.detach().to(device="cpu", dtype=torch.int64).clone(), token_map)
    elif token_map.exists():
        token_map.unlink()  # a stale map from an earlier export would change what SGLang drafts
    return out


# ------------------------------------------------------------------------------------------------ readers
def _read_config(path: Path) -> dict:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"No config.json at {path}: not an export directory.")
    return json.loads(file.read_text())


def _rope_theta(config: dict) -> float:
    if "rope_theta" in config:
        return float(config["rope_theta"])
    return float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _rope_scaling(config: dict) -> dict | None:
    """A scaled RoPE named by a Llama config (``rope_scaling``, or transformers 5's ``rope_parameters``); None for
    plain RoPE."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or None
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}
    if kind == "yarn" and not scaling.get("original_max_position_embeddings") and config.get(
            "max_position_embeddings"):
        # vLLM and transformers scale yarn from the config's own context length when the scaling does not say it.
        scaling["original_max_position_embeddings"] = int(config["max_position_embeddings"])
    return scaling


def _rebuild(path: Path, llama: dict, fc: dict, layer: dict, target: nn.Module, *, logit_scale: float,
             softcap: float | None, d2t: torch.Tensor | None) -> EagleDrafter:
    """An EagleDrafter bound to ``target`` from an export's Llama fields and tensors (inverse of the exporters)."""
    if llama.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"The export at {path} has {llama['num_hidden_layers']} layers; EagleDrafter has one.")
    policy_softcap, policy_scale = logit_transform(text_config(target))
    if softcap != policy_softcap or abs(logit_scale - policy_scale) > 1e-6:
        raise ValueError(
            f"The export at {path} computes logits with soft-cap {softcap} and scale {logit_scale}, the policy with "
            f"{policy_softcap} and {policy_scale}: it was exported for another model."
        )
    layer = dict(layer)
    o_bias = layer.pop("self_attn.o_proj.bias", None)
    if o_bias is not None and torch.count_nonzero(o_bias):
        raise ValueError(f"The drafter at {path} has a non-zero o_proj bias; EagleDrafter biases q/k/v only "
                         "(Qwen2-style attention). It cannot be loaded without changing what it computes.")
    heads = llama["num_attention_heads"]
    config = EagleDrafterConfig(
        hidden_size=llama["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=llama.get("num_key_value_heads") or heads,
        head_dim=llama.get("head_dim") or llama["hidden_size"] // heads,
        intermediate_size=llama["intermediate_size"],
        vocab_size=llama["vocab_size"],
        draft_vocab_size=None if d2t is None else int(d2t.numel()),
        rms_norm_eps=llama.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(llama),
        rope_scaling=_rope_scaling(llama),
        fc_bias="bias" in fc,
        qkv_bias="self_attn.q_proj.bias" in layer,
        final_logit_softcapping=policy_softcap,
        logit_scale=policy_scale,
        target_model_type=getattr(text_config(target), "model_type", None),
        target_name_or_path=getattr(text_config(target), "_name_or_path", None) or None,
    )
    drafter = EagleDrafter(config)
    state = {f"fc.{k}": v for k, v in fc.items()} | dict(layer)
    if d2t is not None:
        state["d2t"] = torch.arange(config.draft_vocab_size)  # set below, sorted as set_draft_vocab wants
    weight = state["fc.weight"].to(torch.float32).clone()
    scale = _embed_scale(target.get_input_embeddings())
    if scale is not None:
        weight[:, : config.hidden_size] /= scale
    state["fc.weight"] = weight
    state = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"The tensors at {path} do not match its config.json: {err}") from err
    head = target.get_output_embeddings().weight
    drafter.to(device=head.device, dtype=head.dtype)
    drafter.bind(target)
    if d2t is not None:
        drafter.set_draft_vocab(d2t)
    return drafter


def _split(tensors: dict[str, torch.Tensor], fc_prefix: str, layer_prefix: str, path: Path):
    fc, layer, unknown = {}, {}, []
    for name, tensor in tensors.items():
        if name.startswith(fc_prefix):
            fc[name[len(fc_prefix):]] = tensor
        elif name.startswith(layer_prefix):
            layer[name[len(layer_prefix):]] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"The export at {path} holds tensors an EAGLE-1 drafter does not have: {sorted(unknown)}.")
    return fc, layer


def load_vllm_export(path: str | os.PathLike, target: nn.Module) -> EagleDrafter:
    """Rebuild the drafter a vLLM export (either layout of :func:`export_vllm`) describes, bound to ``target``.

    It computes what vLLM computes from those files: over the full vocabulary (vLLM's EAGLE-1 has no draft
    vocabulary) and with the embedding scale folded into ``fc`` unfolded again for the policy's scaled embedding.
    """
    path = Path(path)
    config = _read_config(path)
    tensors = load_file(str(path / WEIGHTS_NAME))
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle" or config.get("layernorms"):
            raise ValueError(f"{path} is a speculators {config['speculators_model_type']!r} checkpoint "
                             f"(layernorms={config.get('layernorms')}); EagleDrafter reads EAGLE-1 without layernorms.")
        llama = config["transformer_layer_config"]
        fc, layer = _split(tensors, "fusion_fc.", "transformer.", path)
    else:
        llama = config
        fc, layer = _split(tensors, "fc.", "layers.0.", path)
    return _rebuild(path, llama, fc, layer, target, logit_scale=float(config.get("logit_scale", 1.0)), softcap=None,
                    d2t=None)


def load_sglang_export(path: str | os.PathLike, target: nn.Module) -> EagleDrafter:
    """Rebuild the drafter an SGLang export describes, bound to ``target``: the draft vocabulary comes from the
    token map when the directory has one (as SGLang's ``--speculative-token-map`` would give it)."""
    path = Path(path)
    config = _read_config(path)
    fc, layer = _split(load_file(str(path / WEIGHTS_NAME)), "fc.", "layers.0.", path)
    d2t = None
    if (path / SGLANG_TOKEN_MAP).is_file():
        d2t = torch.as_tensor(torch.load(path / SGLANG_TOKEN_MAP, weights_only=True), dtype=torch.long)
    if "bias" in fc and not torch.count_nonzero(fc["bias"]):
        fc.pop("bias")  # the zeros the exporter adds for SGLang's always-biased fc
    return _rebuild(path, config, fc, layer, target, logit_scale=1.0,
                    softcap=config.get("final_logit_softcapping"), d2t=d2t)
