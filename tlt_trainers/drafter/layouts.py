"""Read drafters in the layouts other tools publish, as this package's drafters bound to the policy.

``Drafter.from_pretrained`` (and so ``drafter_name_or_path`` of every trainer) sends a folder whose config.json is
not ours here. The layout is detected from config.json and the tensor names; docs/export_formats.md has the table.

- ``eagle3``: EAGLE-3 in the EAGLE authors' layout (SafeAILab/EAGLE ``eagle/model/cnets.py``: a Llama config with
  ``draft_vocab_size``, ``pytorch_model.bin``, ``fc`` [H, 3H], ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` as
  offsets, ``t2d``), which SpecForge and SGLang share (``architectures: ["LlamaForCausalLMEagle3"]``, also for Qwen
  policies; ``eagle_config.eagle_aux_hidden_state_layer_ids`` numbers layers by their output, SGLang adds one).
- ``speculators-eagle3``: the ``speculators`` library's EAGLE-3 (``speculators_model_type: "eagle3"``,
  ``transformer_layer_config``, ``layers.0.*`` and the verifier's ``embed_tokens``; aux ids in vLLM's numbering,
  the residual stream entering a layer; ``norm_before_residual`` True when absent, as vLLM reads it).
- ``eagle``: EAGLE-1/2 (a one-layer Llama or Qwen2 config; ``fc`` [H, 2H] with or without a bias, ``layers.0.*``
  without an input norm): the EAGLE authors', vLLM's and SGLang's EAGLE-1 (``LlamaForCausalLMEagle``,
  ``Qwen2ForCausalLMEagle``) and the TLT authors' RL drafters (mit-han-lab/fastrl: ``model.``-prefixed names and
  Qwen2's q/k/v biases).
- ``speculators-eagle``: the speculators library's EAGLE-1 (``fusion_fc.*``, ``transformer.*``; releases <= 0.4).

What a layout holds that our drafters do not compute (norms before ``fc``, a draft hidden size other than the
policy's, an embedding or LM head of its own that differs from the policy's) is refused with the reason, never
dropped: a copy of the policy's embedding or head is checked equal to it and then shared, as vLLM and SGLang do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..modeling.target import compute_dtype, logit_transform, text_config
from .base import Drafter
from .config import CONFIG_NAME, EagleDrafterConfig
from .eagle3 import Eagle3Drafter
from .export import SGLANG_TOKEN_MAP, _rebuild, _rope_scaling, _rope_theta, _split
from .registry import is_registered, set_other_layout_reader

logger = logging.getLogger(__name__)

LAYOUTS = ("tlt", "eagle3", "speculators-eagle3", "eagle", "speculators-eagle")
_SPECULATORS_TYPES = {"eagle3": "speculators-eagle3", "eagle": "speculators-eagle"}


# ------------------------------------------------------------------------------------------------ files
def read_config(directory: str | Path) -> dict:
    path = Path(directory, CONFIG_NAME)
    if not path.is_file():
        raise FileNotFoundError(f"No config.json in {directory}: not a drafter folder.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}).") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds {type(data).__name__}, not a config object.")
    return data


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder: ``model.safetensors`` (or its sharded index), else ``pytorch_model.bin``
    (or its index), loaded with ``weights_only=True`` (no pickled code runs)."""
    directory = Path(directory)
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (directory / index).is_file():
            shards = sorted(set(json.loads((directory / index).read_text())["weight_map"].values()))
            files = [directory / shard for shard in shards]
        elif (directory / single).is_file():
            files = [directory / single]
        else:
            continue
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            if file.suffix == ".safetensors":
                tensors.update(load_file(str(file)))
            else:
                state = torch.load(file, map_location="cpu", weights_only=True)
                if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
                    state = state["state_dict"]
                tensors.update(state)
        return tensors
    raise FileNotFoundError(f"No weights in {directory}: expected model.safetensors or pytorch_model.bin.")


# ------------------------------------------------------------------------------------------------ detection
def _strip_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``model.`` prefix some writers put on every name but ``lm_head`` (FastRL, HF-style saves)."""
    if not any(name.startswith("model.") for name in tensors):
        return tensors
    return {name.removeprefix("model."): t for name, t in tensors.items()}


def detect_layout(config: dict, tensors: dict[str, torch.Tensor] | None = None) -> str:
    """The layout of a drafter folder from its config.json (and its tensor names where the config is a plain
    Llama/Qwen config): one of :data:`LAYOUTS`."""
    if is_registered(str(config.get("architecture"))):
        return "tlt"
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind not in _SPECULATORS_TYPES:
            raise ValueError(f"A speculators {kind!r} drafter: tlt-trainers reads the speculators layouts "
                             f"{sorted(_SPECULATORS_TYPES)} (EAGLE-1 and EAGLE-3); {kind!r} drafts differently.")
        return _SPECULATORS_TYPES[kind]
    names = _strip_prefix(tensors or {})
    if any(name.startswith("midlayer.") for name in names):
        return "eagle3"
    fc = names.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] % fc.shape[0] == 0:
        ratio = fc.shape[1] // fc.shape[0]
        if ratio == 2:
            return "eagle"
        if ratio >= 3 and any(name.startswith("layers.0.") for name in names):
            return "eagle3"
    architectures = config.get("architectures")
    raise ValueError(f"Not a drafter layout tlt-trainers reads (architectures={architectures}, tensors "
                     f"{sorted(names)[:6]}...): it reads {LAYOUTS[1:]} and its own save_pretrained folders.")


# ------------------------------------------------------------------------------------------------ checks
def _equal_to_policy(name: str, tensor: torch.Tensor, policy: nn.Module, path: Path) -> None:
    """Refuse an embedding or head of the checkpoint's own that is not the policy's (up to the coarser dtype's
    rounding): the drafters here share the policy's. A policy whose weights arrive later (veRL's drafter worker
    holds a shell until the first weight sync) runs the check then, through its ``defer_weight_check``."""
    module = policy.get_input_embeddings() if name == "embed_tokens" else policy.get_output_embeddings()
    if tuple(tensor.shape) != tuple(module.weight.shape):
        raise ValueError(f"The drafter at {path} has {name} of shape {tuple(tensor.shape)}, the policy's is "
                         f"{tuple(module.weight.shape)}: it was made for another model (vocabulary or hidden size "
                         "differs).")
    defer = getattr(policy, "defer_weight_check", None)
    if defer is not None:
        defer(lambda: _compare(name, tensor, module.weight, path))
        return
    _compare(name, tensor, module.weight, path)


def _compare(name: str, tensor: torch.Tensor, weight: torch.Tensor, path: Path, rows: int = 8192) -> None:
    if not (tensor.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"The drafter at {path} or its policy holds a non-floating {name} ({tensor.dtype}, "
                         f"{weight.dtype}); a quantised policy cannot be checked against a drafter's copy.")
    coarser = max((tensor.dtype, weight.dtype), key=lambda d: torch.finfo(d).eps)
    eps = torch.finfo(coarser).eps
    scale = weight.detach().abs().max().item() * eps
    worst = 0.0
    for start in range(0, weight.shape[0], rows):  # row chunks: a 128k x 4096 table never doubles in float32
        theirs = weight.detach()[start:start + rows].to(torch.float32)
        mine = tensor[start:start + rows].to(device=theirs.device, dtype=torch.float32)
        if torch.equal(mine, theirs):
            continue
        difference = (mine - theirs).abs()
        if bool((difference > eps * (theirs.abs() + scale)).any()):
            worst = max(worst, difference.max().item())
    if worst:
        raise ValueError(
            f"The drafter at {path} carries its own {name}, which differs from the policy's (by up to {worst:.3g}): "
            f"tlt-trainers' drafters share the policy's {name}, so this one would compute something else. Load it "
            "with the policy it was trained for, or start from a fresh drafter.")


def _field(config: dict, name: str, path: Path, where: str = "config.json"):
    try:
        return config[name]
    except KeyError:
        raise ValueError(f"The drafter at {path} has no {name!r} in {where}; it is not a complete checkpoint of the "
                         "layout it looks like.") from None


def _check_verifier(config: dict, policy: nn.Module, path: Path) -> None:
    """The verifier a speculators config names: other architectures are an error; another name is logged (an RL
    policy is often a fine-tune or a local copy of the named one; shapes and vocabulary are checked anyway)."""
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {})
    named = [a for a in verifier.get("architectures") or [] if a]
    own = list(getattr(text_config(policy), "architectures", None) or getattr(policy.config, "architectures", None)
               or [])
    if named and own and not set(named) & set(own):
        raise ValueError(f"The drafter at {path} names its verifier's architectures {named} "
                         f"(speculators_config.verifier.architectures), the policy is {own}: it was trained for "
                         "another model. Load the drafter made for this policy, or start from a fresh one.")
    name = verifier.get("name_or_path") or config.get("target_model")
    mine = getattr(text_config(policy), "_name_or_path", "") or ""
    if name and mine and Path(str(name)).name.lower() != Path(str(mine)).name.lower():
        logger.warning(f"The drafter at {path} was made for {name} (its verifier name_or_path); the policy is {mine}. "
                       "Shapes, vocabulary and layers agree, so it loads; acceptance shows how well it fits.")


# ------------------------------------------------------------------------------------------------ EAGLE-3
_EAGLE3_FLAGS = ("norm_before_fc", "fc_norm")


def _eagle3_name(name: str) -> str:
    """An engine's EAGLE-3 tensor name as Eagle3Drafter's (the inverse of ``export_eagle3.engine_name``): ``layers.0``
    is ``midlayer``, ``layers.{i}`` for i >= 1 is ``later_layers.{i - 1}``."""
    if name.startswith("layers."):
        index, rest = name[len("layers."):].split(".", 1)
        return f"midlayer.{rest}" if index == "0" else f"later_layers.{int(index) - 1}.{rest}"
    return name


def _eagle3(path: Path, config: dict, tensors: dict[str, torch.Tensor], policy: nn.Module,
            layout: str) -> Eagle3Drafter:
    speculators = layout == "speculators-eagle3"
    layer = _field(config, "transformer_layer_config", path) if speculators else config
    flags = [f for f in _EAGLE3_FLAGS + (("norm_output",) if speculators else ()) if config.get(f)]
    if flags:
        raise ValueError(f"The EAGLE-3 drafter at {path} sets {flags}: extra norms around fc or the output that "
                         "tlt-trainers' Eagle3Drafter does not compute (vLLM's and the EAGLE authors' default layer "
                         "has none). It cannot be loaded without changing what it computes.")
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError(f"The drafter at {path} reads only the policy's last layer (eagle_config.use_aux_hidden_state="
                         "false); tlt-trainers' EAGLE-3 reads three layers.")
    tensors = {_eagle3_name(name): t for name, t in _strip_prefix(tensors).items()}
    stacked = sorted({int(name.split(".")[1]) for name in tensors if name.startswith("later_layers.")})
    if stacked != list(range(len(stacked))):
        raise ValueError(f"The EAGLE-3 drafter at {path} has decoder layers {[0] + [i + 1 for i in stacked]}: "
                         "layers.1.* and on must follow layers.0 without a gap.")
    num_layers = int(layer.get("num_hidden_layers") or 1)
    if num_layers != 1 + len(stacked):
        raise ValueError(f"The EAGLE-3 drafter at {path} says num_hidden_layers={num_layers} but holds the weights "
                         f"of {1 + len(stacked)} decoder layers.")
    hidden = int(_field(layer, "hidden_size", path))
    target_hidden = config.get("target_hidden_size") or layer.get("target_hidden_size")
    if target_hidden and int(target_hidden) != hidden:
        raise ValueError(f"The drafter at {path} has hidden size {hidden} and reads a policy of hidden size "
                         f"{target_hidden} (target_hidden_size): tlt-trainers' drafters work at the policy's width.")
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None:
        _equal_to_policy("embed_tokens", embed, policy, path)
    bias = tensors.pop("fc.bias", None)
    if bias is not None and torch.count_nonzero(bias):
        raise ValueError(f"The drafter at {path} has a non-zero fc bias; EAGLE-3's fc has none in vLLM, SGLang and "
                         "tlt-trainers (bias=False).")
    offsets, mask = tensors.pop("d2t", None), tensors.pop("t2d", None)
    head = tensors.get("lm_head.weight")
    if head is None or "fc.weight" not in tensors:
        raise ValueError(f"The EAGLE-3 drafter at {path} lacks {'lm_head.weight' if head is None else 'fc.weight'}.")
    vocab = int(mask.numel()) if mask is not None else int(layer.get("vocab_size") or head.shape[0])
    draft_vocab = int(config.get("draft_vocab_size") or layer.get("draft_vocab_size") or head.shape[0])
    if head.shape[0] != draft_vocab:
        raise ValueError(f"The drafter at {path} has lm_head of {head.shape[0]} rows but draft_vocab_size="
                         f"{draft_vocab}.")
    policy_vocab = policy.get_output_embeddings().weight.shape[0]
    if vocab != policy_vocab:
        raise ValueError(f"The drafter at {path} drafts for a vocabulary of {vocab} tokens (t2d / vocab_size), the "
                         f"policy has {policy_vocab}: it was made for another model.")
    target_ids = None
    if draft_vocab == vocab and offsets is not None and bool(offsets.any()):
        # A full-vocabulary head in another order: put each row at its token.
        order = torch.arange(vocab) + offsets.to(torch.long)
        if not torch.equal(order.sort().values, torch.arange(vocab)):
            raise ValueError(f"The d2t map at {path} is not a permutation of the {vocab} tokens.")
        tensors["lm_head.weight"] = head[torch.argsort(order)]
    if draft_vocab < vocab:
        if offsets is None:
            raise ValueError(f"The drafter at {path} drafts over {draft_vocab} of {vocab} tokens but has no d2t map.")
        target_ids = torch.arange(draft_vocab) + offsets.to(torch.long)
        if target_ids.min() < 0 or target_ids.max() >= vocab or target_ids.unique().numel() != draft_vocab:
            raise ValueError(f"The d2t map at {path} does not map the draft vocabulary to distinct tokens of the "
                             f"policy's {vocab}.")
        if mask is not None and (not bool(mask.to(torch.bool)[target_ids].all())
                                 or int(mask.to(torch.bool).sum()) != draft_vocab):
            raise ValueError(f"The d2t and t2d maps at {path} disagree (a drafted token t2d does not mark).")
        order = torch.argsort(target_ids)  # our d2t holds sorted target ids
        target_ids, tensors["lm_head.weight"] = target_ids[order], head[order]
    layers = text_config(policy).num_hidden_layers
    if config.get("eagle_aux_hidden_state_layer_ids"):  # speculators / vLLM: the stream entering layer k
        aux = [int(k) for k in config["eagle_aux_hidden_state_layer_ids"]]
    elif (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        # SpecForge / SGLang number the layer whose output is taken; SGLang captures id + 1 (vLLM reads the same
        # field without the + 1: SpecForge trains with SGLang's meaning, so that one is followed here).
        aux = [int(k) + 1 for k in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    else:  # the EAGLE authors' and every engine's default: the streams entering layers 2, n // 2 and n - 3
        aux = [2, layers // 2, layers - 3]
    fc_in = tensors["fc.weight"].shape[1]
    if fc_in != len(aux) * hidden or len(aux) != 3:
        raise ValueError(f"The drafter at {path} fuses {fc_in // hidden} policy layers (fc.weight is "
                         f"{tuple(tensors['fc.weight'].shape)}), aux layer ids {aux}: tlt-trainers' EAGLE-3 fuses 3.")
    bad = [k for k in aux if not 0 <= k <= layers]
    if bad or aux != sorted(set(aux)):
        raise ValueError(f"The drafter at {path} reads policy layers {aux} (eagle_aux_hidden_state_layer_ids or the "
                         f"default 2, n // 2, n - 3) but the policy has {layers} layers: it was made for another "
                         "model.")
    if speculators:
        _check_verifier(config, policy, path)
    heads = int(_field(layer, "num_attention_heads", path))
    softcap, scale = logit_transform(text_config(policy))
    drafter_config = EagleDrafterConfig(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(_field(layer, "intermediate_size", path)), vocab_size=vocab,
        draft_vocab_size=draft_vocab if draft_vocab < vocab else None,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(layer),
        rope_scaling=_rope_scaling(layer), final_logit_softcapping=softcap, logit_scale=scale,
        target_model_type=getattr(text_config(policy), "model_type", None),
        target_name_or_path=getattr(text_config(policy), "_name_or_path", None) or None,
        architecture="Eagle3Drafter", aux_layer_ids=aux, num_hidden_layers=num_layers,
        # speculators configs: absent means True, as vLLM reads them; the EAGLE authors' layer keeps the un-normed
        # residual (cnets.py), as vLLM and SGLang read plain configs.
        norm_before_residual=bool(config.get("norm_before_residual", speculators)),
    )
    drafter = Eagle3Drafter(drafter_config)
    state = {name: t.to(torch.float32) for name, t in tensors.items()}
    if target_ids is not None:
        state["d2t"] = target_ids
    _load_state(drafter, state, path)
    return drafter


# ------------------------------------------------------------------------------------------------ EAGLE-1
def _eagle(path: Path, config: dict, tensors: dict[str, torch.Tensor], policy: nn.Module, layout: str) -> Drafter:
    softcap, scale = logit_transform(text_config(policy))  # what the policy's head applies, unless the config says
    softcap = config.get("final_logit_softcapping", softcap)
    scale = float(config.get("logit_scale", scale))
    d2t = None
    if layout == "speculators-eagle":
        if config.get("layernorms"):
            raise ValueError(f"The speculators EAGLE-1 drafter at {path} has layernorms=true (HASS: norms on the "
                             "embedding, the first layer's input and before the LM head), which tlt-trainers' "
                             "EagleDrafter does not compute.")
        _check_verifier(config, policy, path)
        fc, layer = _split(tensors, "fusion_fc.", "transformer.", path)
        llama = _field(config, "transformer_layer_config", path)
    else:
        tensors = _strip_prefix(tensors)
        embed = tensors.pop("embed_tokens.weight", None)
        if embed is not None:
            _equal_to_policy("embed_tokens", embed, policy, path)
        head = tensors.pop("lm_head.weight", None)
        if head is not None:
            _equal_to_policy("lm_head", head, policy, path)
        fc, layer = _split(tensors, "fc.", "layers.0.", path)
        if "bias" in fc and not torch.count_nonzero(fc["bias"]):
            fc.pop("bias")  # zeros (SGLang's always-biased fc, as our SGLang export writes it) compute no bias
        token_map = path / SGLANG_TOKEN_MAP
        if token_map.is_file():  # SGLang's FR-Spec map (--speculative-token-map): the draft vocabulary
            d2t = torch.as_tensor(torch.load(token_map, weights_only=True), dtype=torch.long)
        if "input_layernorm.weight" in layer:
            raise ValueError(f"The EAGLE-1 drafter at {path} has an input norm on its first layer; the EAGLE "
                             "authors, vLLM and SGLang replace it by the identity, so its weight would be ignored "
                             "there and was likely never trained.")
        llama = config
    if int(llama.get("vocab_size") or 0) not in (0, policy.get_output_embeddings().weight.shape[0]):
        raise ValueError(f"The drafter at {path} was made for a vocabulary of {llama['vocab_size']} tokens "
                         f"(vocab_size), the policy has {policy.get_output_embeddings().weight.shape[0]}.")
    llama = dict(llama, vocab_size=policy.get_output_embeddings().weight.shape[0])
    if int(llama.get("hidden_size", 0)) != policy.get_input_embeddings().weight.shape[1]:
        raise ValueError(f"The drafter at {path} has hidden_size={llama.get('hidden_size')}, the policy "
                         f"{policy.get_input_embeddings().weight.shape[1]}: it was made for another model.")
    return _rebuild(path, llama, fc, layer, policy, logit_scale=scale, softcap=softcap, d2t=d2t)


# ------------------------------------------------------------------------------------------------ entry point
def _load_state(drafter: Drafter, state: dict[str, torch.Tensor], path: Path) -> None:
    try:
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    except RuntimeError as err:
        raise ValueError(f"The tensors at {path} do not match its config.json: {err}") from err
    if missing or unexpected:
        raise ValueError(f"The drafter at {path} does not match tlt-trainers' {type(drafter).__name__}: missing "
                         f"{sorted(missing)}, tensors it has that the drafter does not compute {sorted(unexpected)}.")


def load_drafter(directory: str | Path, target: nn.Module, layout: str | None = None) -> Drafter:
    """The drafter a folder in another tool's layout describes, as a tlt-trainers drafter bound to ``target`` (on
    its device and compute dtype), checked against it: hidden size, vocabulary, the layers it reads and the
    verifier its config names. ``layout``: one of :data:`LAYOUTS` (default: detected)."""
    path = Path(directory)
    config = read_config(path)
    tensors = read_weights(path)
    found = detect_layout(config, tensors)
    if layout is not None and layout != found:
        raise ValueError(f"The drafter at {path} is in the {found!r} layout, not {layout!r}.")
    if found == "tlt":
        raise ValueError(f"{path} is a tlt-trainers drafter: load it with Drafter.from_pretrained.")
    if found in ("eagle3", "speculators-eagle3"):
        drafter = _eagle3(path, config, tensors, target, found)
    else:
        drafter = _eagle(path, config, tensors, target, found)
    drafter.to(device=target.get_output_embeddings().weight.device, dtype=compute_dtype(target))
    drafter.bind(target)
    logger.info(f"Loaded a {type(drafter).__name__} from the {found!r} layout at {path}.")
    return drafter


set_other_layout_reader(load_drafter)
