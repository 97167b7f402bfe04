"""The policy seen by the engine: a decoder that yields hidden states, and its LM head.

Splitting ``model(...)`` into ``decoder`` + ``head`` lets one verify pass give both the logits
the verifier needs and the hidden states the drafter reads and trains on, without a second
forward. The split is checked against ``model(...).logits`` once, at construction, so a model
whose head does something we do not reproduce is refused instead of silently sampled wrongly.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_paths import CpuDecodePaths, cpu_head
from .kv_cache import RowCache, RowState, additive_mask, attention_allowed, tree_attention_allowed


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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


def logit_transform(config) -> tuple[float | None, float]:
    """(soft-cap, scale) applied to ``lm_head`` output by the model's forward (Gemma, Cohere, Granite)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    return softcap, scale


def apply_logit_transform(logits: torch.Tensor, softcap: float | None, scale: float) -> torch.Tensor:
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class TargetModel:
    """Runs the policy's decoder on a :class:`RowCache` and its head in float32."""

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
        self.softcap, self.scale = logit_transform(self.config)
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

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    def new_cache(self, capacity: int) -> RowCache:
        return RowCache(self.num_layers, capacity)

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
                past_key_values=cache,
                use_cache=True,
            )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head_as_weight_times_hidden:
            logits = cpu_head(self.head.weight, hidden)
        else:
            logits = self.head(hidden)
        return apply_logit_transform(logits.to(torch.float32), self.softcap, self.scale)

    @torch.no_grad()
    def check_split(self) -> None:
        """Refuse models whose forward computes logits differently from decoder + head."""
        if self._checked:
            return
        ids = torch.arange(3, device=self.device)[None] % self.vocab_size
        reference = self.model(input_ids=ids, use_cache=False).logits.to(torch.float32)
        hidden = self.decoder(input_ids=ids, use_cache=False).last_hidden_state
        ours = self.logits(hidden)
        if not torch.allclose(reference, ours, rtol=1e-3, atol=1e-3 * (1 + reference.abs().max().item())):
            raise ValueError(
                f"{type(self.model).__name__}: logits from get_decoder() + get_output_embeddings() do not match "
                "model(...).logits, so the engine cannot reproduce this model's distribution. Supported heads: "
                "plain, soft-capped (Gemma) and scaled (Cohere, Granite)."
            )
        self._checked = True
