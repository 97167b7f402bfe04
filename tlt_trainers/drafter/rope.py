"""Rotary position embedding of a drafter's attention: plain RoPE, or a scaled one computed by transformers.

Public EAGLE-3 drafters for Llama-3.1 policies scale their RoPE as the policy does (``rope_type: "llama3"``); the
frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` so that the drafter rotates exactly as vLLM's and
SGLang's Llama layers do for the same config. Types whose frequencies depend on the sequence length (``dynamic``,
``longrope``) are refused: a drafter's attention sees one position at a time and would rotate differently.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def check_rope_scaling(scaling: dict) -> None:
    """Refuse a RoPE scaling the drafter cannot compute as the engines do."""
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling={scaling!r} must be a dict such as {{'rope_type': 'llama3', 'factor': 8.0}}.")
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported for drafters (its frequencies depend on the "
                         f"sequence length or the model); supported: {SUPPORTED_ROPE_TYPES}.")


@lru_cache(maxsize=32)
def _scaled(head_dim: int, theta: float, items: tuple) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(items)
    kind = rope_type(scaling)
    parameters = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": kind, "rope_theta": theta}
    original = int(scaling.get("original_max_position_embeddings") or 8192)
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                         max_position_embeddings=int(original * max(float(scaling.get("factor") or 1.0), 1.0)),
                         rope_parameters=parameters)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    return inv_freq.to(torch.float32), float(attention_factor)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32 on CPU, the factor cos and sin are multiplied by) for a drafter's RoPE."""
    if rope_type(scaling) == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    check_rope_scaling(scaling)
    return _scaled(head_dim, float(theta), tuple(sorted((k, _hashable(v)) for k, v in scaling.items())))


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


class RotaryFrequencies(nn.Module):
    """A drafter attention's RoPE frequencies, held on the module's device in float32.

    Computed once on the host at construction and moved with the module (``.to(device)``), so that a drafter step
    makes no host tensor and copies nothing onto the device (a CUDA-graph capture refuses both). Casting the module
    (``.to(torch.bfloat16)``) keeps them float32: RoPE angles in bfloat16 would rotate differently from vLLM's and
    SGLang's drafter layers. Not in the state dict (derived from the config).
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq, self.factor = inverse_frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)  # where fn put it, still float32
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, q, D] for integer positions [B, q], in ``dtype``."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        if self.factor != 1.0:
            return (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)
