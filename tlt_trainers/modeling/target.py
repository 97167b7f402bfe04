"""The policy seen by the engine: a decoder that yields hidden states, and its LM head.

Splitting ``model(...)`` into ``decoder`` + ``head`` lets one verify pass give both the logits
the verifier needs and the hidden states the drafter reads and trains on, without a second
forward. The split is checked against ``model(...).logits`` once, at construction, so a model
whose head does something we do not reproduce is refused instead of silently sampled wrongly.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .cpu_paths import CpuDecodePaths, cpu_head
from .kv_cache import RowCache, RowState, additive_mask, attention_allowed, tree_attention_allowed

FINGERPRINT_ROWS = 256  # the embedding rows the policy fingerprint sums


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def policy_fingerprint(policy: nn.Module) -> dict:
    """What identifies a policy: model type, shapes, and the sum of |w| over its first embedding rows (shipped drafters
    check it before they serve a policy; cached features name it)."""
    config = text_config(policy)
    embed = policy.get_input_embeddings().weight
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": int(config.hidden_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "vocab_size": int(embed.shape[0]),
        "embedding_checksum": float(embed.detach()[:FINGERPRINT_ROWS].to(torch.float64).abs().sum()),
    }


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the policy's layers compute in: that of its first decoder layer's floating-point weights. The LM
    head may differ (TRL's ``cast_lm_head_to_fp32`` keeps a float32 head on a bfloat16 model), and so may a tied
    input embedding, which then shares the head's float32 weight."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is not None and len(layers) > 0:
        for param in layers[0].parameters():
            if param.is_floating_point():
                return param.dtype
    return model.get_input_embeddings().weight.dtype


# Models whose ``logits_scaling`` multiplies the head's output; elsewhere (Granite and its MoE/hybrid kin) it divides.
_MULTIPLYING_LOGITS_SCALING = {"hyperclovax"}
# Configs that carry a ``logit_scale`` their transformers model never applies.
_UNUSED_LOGIT_SCALE = {"mpt"}


def head_ops(config) -> tuple[tuple[str, float], ...]:
    """What the model's forward does to ``lm_head`` output, in its order: ``("mul", s)`` (Cohere's ``logit_scale``,
    HyperCLOVAX's ``logits_scaling``), ``("div", s)`` (Granite's ``logits_scaling``), ``("softcap", c)`` (Gemma's
    ``final_logit_softcapping``: ``/ c``, ``tanh``, ``* c``). Empty for a plain head.

    Kept as the model writes it (a division stays a division) so :func:`apply_head_ops` rounds as it does."""
    ops = []
    model_type = getattr(config, "model_type", None)
    logit_scale = None if model_type in _UNUSED_LOGIT_SCALE else getattr(config, "logit_scale", None)
    if logit_scale is not None and logit_scale != 1.0:
        ops.append(("mul", logit_scale))
    logits_scaling = getattr(config, "logits_scaling", None)
    if logits_scaling is not None and logits_scaling != 1.0:
        ops.append(("mul" if model_type in _MULTIPLYING_LOGITS_SCALING else "div", logits_scaling))
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        ops.append(("softcap", softcap))
    return tuple(ops)


def apply_head_ops(logits: torch.Tensor, ops) -> torch.Tensor:
    """``ops`` (:func:`head_ops`) applied as the model's forward applies them: the same operations with the same
    Python scalars, in the dtype ``logits`` has (a bfloat16 head's output stays bfloat16, as in transformers), so
    the result is bit-identical to ``model(...).logits``. Cast to float32 afterwards, as ``generate`` does."""
    for op, value in ops:
        if op == "mul":
            logits = logits * value
        elif op == "div":
            logits = logits / value
        else:
            logits = logits / value
            logits = torch.tanh(logits)
            logits = logits * value
    return logits


def cache_argument(decoder: nn.Module) -> str:
    """The name under which ``decoder.forward`` takes its KV cache: ``cache`` where transformers has renamed it
    (5.2x; ``past_key_values`` then warns that it goes in 5.40), else ``past_key_values`` (5.10 and older, where an
    unknown ``cache=`` would vanish into ``**kwargs`` and the decoder would run without our cache)."""
    try:
        parameters = inspect.signature(decoder.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters and "past_key_values" not in parameters else "past_key_values"


def logit_transform(config) -> tuple[float | None, float]:
    """(soft-cap, scale) of :func:`head_ops` folded into one factor: the form drafters carry (their config, and the
    ``logit_scale`` vLLM's and SGLang's drafter heads multiply by). A drafter's logits only need to be close to the
    policy's (they propose; the policy's own, :meth:`TargetModel.logits`, decide), so they compute in float32."""
    softcap, scale = None, 1.0
    for op, value in head_ops(config):
        if op == "mul":
            scale *= float(value)
        elif op == "div":
            scale /= float(value)
        else:
            softcap = value
    return softcap, scale


def apply_logit_transform(logits: torch.Tensor, softcap: float | None, scale: float) -> torch.Tensor:
    """A drafter's (soft-cap, scale) (:func:`logit_transform`) applied to its float32 logits."""
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class TargetModel:
    """Runs the policy's decoder on a :class:`RowCache`, and its head as the model's forward does (soft-cap and
    scaling in the head's output dtype), giving float32 logits."""

    def __init__(self, model: nn.Module):
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError(
                f"{type(model).__name__} has no output embeddings (LM head); SpeculativeGenerator needs a causal "
                "LM such as AutoModelForCausalLM."
            )
        self.model = model
        self.config = text_config(model)
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.head_ops = head_ops(self.config)
        self.num_layers = self.config.num_hidden_layers
        layer_types = getattr(self.config, "layer_types", None) or []
        has_sliding = "sliding_attention" in layer_types
        self.sliding_window = getattr(self.config, "sliding_window", None) if has_sliding else None
        self._checked = False
        head = self.head
        self._dtype = compute_dtype(model)
        # The head's own forward where it is not a plain Linear in the layers' dtype (e.g. a float32 head casting
        # its input: TRL's cast_lm_head_to_fp32).
        self._head_as_weight_times_hidden = (type(head) is nn.Linear and head.bias is None and "forward" not in
                                             vars(head) and head.weight.dtype == self._dtype
                                             and head.weight.device.type == "cpu")
        self._cpu_paths = CpuDecodePaths(self.decoder, self.config)
        self._cache_argument = cache_argument(self.decoder)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    def new_cache(self, capacity: int, reserve_rows: int = 0) -> RowCache:
        return RowCache(self.num_layers, capacity, reserve_rows)

    def attention_mask(self, state: RowState, query_slots: torch.Tensor, kv_len: int):
        full = additive_mask(attention_allowed(state, query_slots, kv_len), self.dtype)
        if self.sliding_window is None:
            return full
        sliding = additive_mask(attention_allowed(state, query_slots, kv_len, self.sliding_window), self.dtype)
        return {"full_attention": full, "sliding_attention": sliding}

    def tree_attention_mask(self, state: RowState, closure: torch.Tensor, positions: torch.Tensor, kv_len: int):
        """Masks for a draft tree verified at slots ``length .. length + N`` (see ``tree_attention_allowed``)."""
        full = additive_mask(tree_attention_allowed(state, closure, positions, kv_len), self.dtype)
        if self.sliding_window is None:
            return full
        sliding = tree_attention_allowed(state, closure, positions, kv_len, self.sliding_window)
        return {"full_attention": full, "sliding_attention": additive_mask(sliding, self.dtype)}

    def forward(self, input_ids, position_ids, attention_mask, cache: RowCache) -> torch.Tensor:
        """Final (normed) hidden states [B, q, H] of the policy."""
        with self._cpu_paths:
            out = self.decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                **{self._cache_argument: cache},
            )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits equal to ``model(...).logits.float()``: the head, then the model's soft-cap or scaling in
        the head's output dtype (``cpu_head`` returns the weight's dtype, like ``F.linear``), then the cast. A
        bfloat16 Gemma, Cohere or Granite head rounds each step to bfloat16; applying them after the cast would
        sample from a (slightly) different distribution than ``generate``."""
        if self._head_as_weight_times_hidden:
            logits = cpu_head(self.head.weight, hidden)
        else:
            logits = self.head(hidden)
        return apply_head_ops(logits, self.head_ops).to(torch.float32)

    @torch.no_grad()
    def check_split(self) -> None:
        """Refuse models whose forward computes logits differently from decoder + head."""
        if self._checked:
            return
        ids = torch.arange(3, device=self.device)[None] % self.vocab_size
        reference = self.model(input_ids=ids, use_cache=False).logits.to(torch.float32)
        hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state
        ours = self.logits(hidden)
        if not torch.isfinite(reference).all():
            raise ValueError(
                f"{type(self.model).__name__}: its logits hold NaN or inf on a three-token test input, so no token "
                "can be drawn from them. Check the checkpoint for NaN weights; in float16 use bfloat16 or float32, "
                "whose range the activations fit."
            )
        if not torch.allclose(reference, ours, rtol=1e-3, atol=1e-3 * (1 + reference.abs().max().item())):
            raise ValueError(
                f"{type(self.model).__name__}: logits from get_decoder() + get_output_embeddings() do not match "
                "model(...).logits, so the engine cannot reproduce this model's distribution. Supported heads: "
                "plain, soft-capped (Gemma) and scaled (Cohere, Granite)."
            )
        self._checked = True
