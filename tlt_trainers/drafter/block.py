"""BlockDrafter: drafts a whole block of tokens in one pass (DFlash, z-lab 2026).

The policy's features of the committed tokens (the residual streams leaving a few of its layers, concatenated) are
fused by ``fc`` and normed by ``hidden_norm`` into one context vector per position. Every decoder layer projects
that context to keys and values only (its own ``k_proj``/``v_proj``, ``k_norm`` and RoPE at the context positions),
so the context costs one small projection per committed token, kept in the drafter's cache. One pass then reads a
block ``[x_t, <mask>, ..., <mask>]`` (the last committed token, which the policy has not processed yet, and
``block_size - 1`` masked slots that share one learnt embedding) at positions t .. t + K: the block attends to all
of the context and to itself without a causal mask, and the output at masked slot j scores the token at t + j.

Module names and the computation follow vLLM's ``DFlashQwen3Model`` (``vllm/model_executor/models/qwen3_dflash.py``:
Qwen3 decoder layers with per-head ``q_norm``/``k_norm``, ``fc`` and ``hidden_norm`` over the context, own ``norm``
and ``lm_head`` over the draft vocabulary, ``mask_embedding`` substituted for ``mask_token_id``), so the export
(:func:`tlt_trainers.drafter.export_block.export_block_vllm`) is a renaming.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..modeling.kv_cache import LayeredKV
from ..modeling.target import text_config
from .base import Drafter
from .config import EagleDrafterConfig
from .eagle import DrafterMLP, RMSNorm, new_drafter, rotate
from .eagle3 import FusedLayers, OwnHead
from .rope import RotaryFrequencies

# (layer index, keys, values) of the block -> the keys and values the block attends to in that layer
KeyMerge = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def default_block_layers(num_layers: int, count: int) -> list[int]:
    """``count`` policy layers spread from the second to the fourth-last (DFlash's ``build_target_layer_ids``; over
    all layers for a policy too shallow for that), in vLLM's aux-layer numbering (id k: the output of decoder layer
    k - 1)."""
    if num_layers < 1 or count < 1:
        raise ValueError(f"A block drafter reads {count} of the policy's layers; the policy has {num_layers}.")
    low, high = 1, num_layers - 3  # DFlash's range, numbered by the layer whose output is read
    if high - low + 1 < count:
        low, high = 0, num_layers - 1
    if count == 1:
        return [num_layers // 2 + 1]
    return sorted({int(round(low + i * (high - low) / (count - 1))) + 1 for i in range(count)})


class BlockAttention(nn.Module):
    """Qwen3-style attention: q/k/v projections, per-head RMSNorm of queries and keys, RoPE, no bias."""

    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        self.rope = RotaryFrequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.rope(positions, dtype)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [B, kv_heads, q, D] of inputs ``x`` [B, q, H] (the context's or the block's)."""
        b, q, _ = x.shape
        key = self.k_norm(self.k_proj(x).view(b, q, self.kv_heads, self.head_dim)).transpose(1, 2)
        value = self.v_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._rope(positions, x.dtype)
        return rotate(key, cos, sin), value

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, merge) -> torch.Tensor:
        """The block's attention output; ``merge(keys, values)`` returns what the block attends to (its own keys
        and values joined to the context's), ``mask`` is additive [B, 1, q, kv]."""
        b, q, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(b, q, self.heads, self.head_dim)).transpose(1, 2)
        cos, sin = self._rope(positions, x.dtype)
        keys, values = merge(*self.keys_values(x, positions))
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(rotate(query, cos, sin), keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class BlockLayer(nn.Module):
    """A pre-norm decoder layer (vLLM's ``DFlashQwen3DecoderLayer``)."""

    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, merge) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, merge)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDrafter(FusedLayers, OwnHead, Drafter):
    """A block drafter bound to a policy's embedding; its own head scores the draft vocabulary."""

    def __init__(self, config: EagleDrafterConfig, target: nn.Module | None = None):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        if target is not None:
            self.bind(target)

    @classmethod
    def from_target(cls, model: nn.Module, block_size: int = 8, num_hidden_layers: int = 2,
                    aux_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                    **overrides) -> BlockDrafter:
        """A fresh block drafter for ``model``: ``block_size`` tokens per pass (``block_size - 1`` drafts),
        ``num_hidden_layers`` decoder layers over the policy's layers ``aux_layer_ids`` (default: as many as the
        drafter has layers, at least 3, spread as DFlash spreads them). Norm and head start as the policy's, the
        mask embedding as the embedding of ``mask_token_id`` (default: the policy's pad token, else its EOS: a row
        ends at EOS, so it is never the token a block starts from), the layers as random."""
        config = text_config(model)
        layers = list(aux_layer_ids) if aux_layer_ids else default_block_layers(config.num_hidden_layers,
                                                                                max(num_hidden_layers, 3))
        if mask_token_id is None:
            mask_token_id = _special_token(model)
        extra = {"aux_layer_ids": layers, "block_size": block_size, "num_hidden_layers": num_hidden_layers,
                 "mask_token_id": mask_token_id}
        drafter = new_drafter(cls, model, extra, overrides)
        drafter.init_from_policy(model)
        return drafter

    def init_from_policy(self, model: nn.Module) -> None:
        super().init_from_policy(model)
        with torch.no_grad():
            embedding = model.get_input_embeddings().weight
            row = embedding[self.config.mask_token_id] if self.config.mask_token_id is not None else embedding.mean(0)
            self.mask_embedding.copy_(row)

    @classmethod
    def check_config(cls, config: EagleDrafterConfig) -> None:
        ids = list(config.aux_layer_ids or [])
        if not ids or ids != sorted(set(ids)) or ids[0] < 1:
            raise ValueError(f"aux_layer_ids={config.aux_layer_ids}: a BlockDrafter reads one or more distinct "
                             "policy layers in increasing order (the outputs of decoder layers, ids >= 1).")
        if config.block_size is None or config.block_size < 2:
            raise ValueError(f"block_size={config.block_size}: a block holds the last committed token and at least "
                             "one masked slot (block_size >= 2; DFlash uses 8 to 16).")
        if config.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers={config.num_hidden_layers} must be >= 1.")
        if config.mask_token_id is not None and not 0 <= config.mask_token_id < config.vocab_size:
            raise ValueError(f"mask_token_id={config.mask_token_id} is outside the vocabulary "
                             f"(0..{config.vocab_size - 1}).")
        if config.qkv_bias:
            raise ValueError("qkv_bias=True is an EAGLE-1 (Qwen2-style) option; block drafters have no attention "
                             "biases in any layout vLLM or SGLang loads.")

    # ----------------------------------------------------------------- what the engine asks
    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def max_drafts(self) -> int:
        """Drafts one pass proposes: the block's masked slots."""
        return self.block_size - 1

    def new_kv(self, capacity: int) -> LayeredKV:
        return LayeredKV(capacity, len(self.layers))

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The context vectors [.., H] of policy features [.., F]."""
        return self.hidden_norm(self.fc(features))

    def context_keys_values(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor,
                                                                                                 torch.Tensor]]:
        """Per layer, the context's keys and values [B, kv_heads, n, D] for features [B, n, F] at ``positions``."""
        context = self.context(features)
        return [layer.self_attn.keys_values(context, positions) for layer in self.layers]

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, kv: LayeredKV,
                      slots: torch.Tensor, kv_len: int | None = None) -> None:
        """Project features [B, n, F] of committed tokens into the cache at ``slots`` [B, n] (``kv_len``: a bound
        on ``slots.max() + 1`` known on the host, so that a GPU need not be read)."""
        kv_len = int(slots.max()) + 1 if kv_len is None else kv_len
        for cache, (key, value) in zip(kv.layers, self.context_keys_values(features, positions), strict=True):
            cache.write(key, value, slots, kv_len)

    def block_inputs(self, first_tokens: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width, H]: the embedding of each block's first token, then ``width - 1`` mask embeddings."""
        first = self.embed(first_tokens).to(self.mask_embedding.dtype)
        masks = self.mask_embedding.to(first.dtype).expand(*first.shape[:-1], width - 1, first.shape[-1])
        return torch.cat([first[..., None, :], masks], dim=-2)

    def forward(self, block: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, merge: KeyMerge
                ) -> torch.Tensor:
        """Hidden states [B, q, H] (before the final norm) of block inputs ``block`` [B, q, H] at ``positions``;
        ``merge(layer, keys, values)`` joins the block's keys and values to the context's in each layer."""
        x = block
        for index, layer in enumerate(self.layers):
            x = layer(x, positions, mask, lambda k, v, index=index: merge(index, k, v))
        return x

    def draft(self, first_tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv: LayeredKV,
              slots: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        """One drafting pass over blocks written at ``slots`` [B, q] of the cache: hidden states [B, q, H], attending
        to its first ``kv_len`` slots (default ``slots.max() + 1``; the mask's last dimension)."""
        kv_len = int(slots.max()) + 1 if kv_len is None else kv_len

        def merge(index, key, value):
            return kv.layers[index].write(key, value, slots, kv_len)

        return self(self.block_inputs(first_tokens, slots.shape[1]), positions, mask, merge)


def _special_token(model: nn.Module) -> int | None:
    """The policy's pad token id, else its EOS id (the first of a list), else None."""
    for source in (getattr(model, "generation_config", None), text_config(model)):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return None
