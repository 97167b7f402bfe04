"""EagleDrafter: one decoder layer over the policy's own hidden states (EAGLE).

The drafter predicts the policy's next final hidden state h_{t+1} from fc([embed(x_{t+1}); h_t]),
and reads tokens through the policy's LM head. Embedding and head are the policy's modules,
held by reference and never registered as the drafter's parameters: the drafter cannot change
the policy, and its checkpoints hold only what it learned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.packed_attention import PackedSequences, packed_ttt_attention
from ..modeling.kv_cache import RowKV
from ..modeling.target import apply_logit_transform, compute_dtype, logit_transform, text_config
from .base import AutoregressiveDrafter
from .config import EagleDrafterConfig
from .rope import RotaryFrequencies


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DrafterAttention(nn.Module):
    def __init__(self, config: EagleDrafterConfig, input_size: int | None = None):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope = RotaryFrequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        h = config.hidden_size
        x = input_size or h  # EAGLE-3 projects q, k, v from [embedding; feature] (2h)
        bias = config.qkv_bias
        self.q_proj = nn.Linear(x, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(x, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(x, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def project(self, x, positions):
        """Rotated queries [B, heads, q, D] and keys/values [B, kv_heads, q, D]."""
        b, q, _ = x.shape
        query = self.q_proj(x).view(b, q, self.heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rope(positions, x.dtype)
        return rotate(query, cos, sin), rotate(key, cos, sin), value

    def attend(self, query, key, value, mask):
        if self.kv_heads != self.heads:
            repeat = self.heads // self.kv_heads
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        b, _, q, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))

    def forward(self, x, positions, mask, kv: RowKV | None = None, slots=None, kv_len=None):
        query, key, value = self.project(x, positions)
        if kv is not None:
            key, value = kv.write(key, value, slots, kv_len)
        return self.attend(query, key, value, mask)


class DrafterMLP(nn.Module):
    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def ttt_mask(step: int, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, L, (step + 1) L] of draft step ``step`` in training-time test.

    Real keys s <= t - step (s <= t for step 0), then step j's key at t - step + j on the diagonal; a query
    always sees itself, so no softmax row is empty.
    """
    batch, length = valid.shape
    idx = torch.arange(length, device=valid.device)
    blocks = [(idx[None, :] <= idx[:, None] - step) & valid[:, None, :]]
    for j in range(1, step + 1):
        blocks.append((idx[None, :] == idx[:, None] - step + j).expand(batch, -1, -1))
    allowed = torch.cat(blocks, dim=-1)
    allowed[:, idx, step * length + idx] = True
    mask = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def unroll(attention: DrafterAttention | Sequence[DrafterAttention], layer, first_features: torch.Tensor,
           positions: torch.Tensor, valid: torch.Tensor | PackedSequences, depth: int) -> list[torch.Tensor]:
    """Run ``layer(features, attend)`` for ``depth`` chained draft steps (training-time test).

    Step 0 reads ``first_features`` [B, L, F]; step d at position t reads step d-1's prediction at t-1.
    ``attend(x, index=0)`` is the output of attention module ``index`` (of ``attention``: one module, or one per
    decoder layer of a deeper drafter) for its input x, against that module's keys of every step so far, masked by
    :func:`ttt_mask`. Returns each step's prediction [B, L, H].

    ``valid`` [B, L] marks the real tokens of padded rows; a :class:`PackedSequences` instead says that the one row
    (B = 1) holds whole sequences end to end, attended without padding by
    :func:`~tlt_trainers.kernels.packed_attention.packed_ttt_attention` (flash-attn's varlen kernel where it runs).
    A sequence's first token then reads the previous sequence's last prediction at steps d >= 1: never scored.
    """
    packed = valid if isinstance(valid, PackedSequences) else None
    if packed is not None and (first_features.shape[0] != 1 or first_features.shape[1] != packed.total):
        raise ValueError(f"Packed sequences of {packed.total} tokens go in one row [1, {packed.total}, F], got "
                         f"{tuple(first_features.shape)}.")
    attentions = [attention] if isinstance(attention, DrafterAttention) else list(attention)
    keys: list[list[torch.Tensor]] = [[] for _ in attentions]  # per attention module, one entry per step
    values: list[list[torch.Tensor]] = [[] for _ in attentions]
    outputs = []
    for step in range(depth):
        if step == 0:
            features = first_features
        else:  # shift: position t reads the previous step's prediction made at t-1 (position 0 is never scored)
            features = torch.cat([outputs[-1][:, :1], outputs[-1][:, :-1]], dim=1)
        mask = None

        def attend(x, index: int = 0, step=step):
            nonlocal mask
            module = attentions[index]
            query, key, value = module.project(x, positions)  # [B, heads, L, D]
            if packed is None:
                keys[index].append(key)
                values[index].append(value)
                if mask is None:  # one mask per step, shared by the layers
                    mask = ttt_mask(step, valid, x.dtype)
                return module.attend(query, torch.cat(keys[index], dim=2), torch.cat(values[index], dim=2), mask)
            keys[index].append(key[0].transpose(0, 1))  # [T, heads, D]
            values[index].append(value[0].transpose(0, 1))
            out = packed_ttt_attention(query[0].transpose(0, 1), keys[index], values[index], packed)
            return module.o_proj(out.reshape(1, packed.total, -1))

        outputs.append(layer(features, attend))
    return outputs


def new_drafter(cls, model: nn.Module, extra: dict, overrides: dict):
    """A fresh ``cls`` drafter sized for ``model`` (its config's shapes, plus ``extra``; ``overrides`` win), on the
    policy's device and dtype, bound to it."""
    config = text_config(model)
    softcap, scale = logit_transform(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    values = dict(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
        vocab_size=model.get_output_embeddings().weight.shape[0],
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        qkv_bias=False,
        final_logit_softcapping=softcap,
        logit_scale=scale,
        target_model_type=getattr(config, "model_type", None),
        target_name_or_path=getattr(config, "_name_or_path", None) or None,
        architecture=cls.__name__,
        **extra,
    )
    unknown = sorted(set(overrides) - set(values) - {"draft_vocab_size", "num_hidden_layers"})
    if unknown:
        raise TypeError(f"{cls.__name__}.from_target got unknown settings {unknown}.")
    values.update(overrides)
    drafter = cls(EagleDrafterConfig(**values))
    drafter.to(device=model.get_output_embeddings().weight.device, dtype=compute_dtype(model))
    drafter.bind(model)
    return drafter


class EagleDrafter(AutoregressiveDrafter):
    """A one-layer EAGLE drafter bound to a policy's embedding and LM head."""

    def __init__(self, config: EagleDrafterConfig, target: nn.Module | None = None):
        super().__init__(config)
        h = config.hidden_size
        # Module names and the optional norm follow EAGLE-1 as vLLM and SGLang load it (llama_eagle): the
        # first layer has no input norm, fc has no bias, and the layer's output feeds the LM head directly.
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps) if config.input_layernorm else nn.Identity()
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)
        self._head_cache: tuple | None = None
        if target is not None:
            self.bind(target)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_target(cls, model: nn.Module, **overrides) -> EagleDrafter:
        """A fresh drafter sized for ``model``; ``overrides`` set any EagleDrafterConfig field."""
        return new_drafter(cls, model, {}, overrides)

    def _check_policy(self, model: nn.Module) -> None:
        softcap, scale = logit_transform(text_config(model))
        if softcap != self.config.final_logit_softcapping or abs(scale - self.config.logit_scale) > 1e-6:
            raise ValueError("The drafter's logit soft-capping/scale differs from the policy's; recreate it with "
                             "EagleDrafter.from_target(model).")

    # ----------------------------------------------------------------- vocabulary
    @property
    def feature_size(self) -> int:
        """EAGLE-1 reads the policy's last hidden state: the policy's hidden size."""
        return self.config.hidden_size

    def head_weight(self) -> torch.Tensor:
        """The LM head rows the drafter scores, re-sliced only when the policy's head or the draft vocabulary
        changes, and then into the same tensor: a step graph reads it by address, so it is refilled, never replaced
        (a replaced one would be freed under the graph)."""
        weight = self.target.head.weight
        if self.d2t is None:
            # Detached: a drafter loss must never put a gradient into the policy's head (.grad of a frozen,
            # shared weight would leak into the policy's next optimizer step).
            return weight.detach()
        key = (weight.data_ptr(), weight._version, self.d2t._version)
        cached = self._head_cache
        shape = (self.d2t.numel(), weight.shape[1])
        if cached is None or (cached[1].shape, cached[1].dtype, cached[1].device) != (shape, weight.dtype,
                                                                                        weight.device):
            self._head_cache = (key, weight.detach()[self.d2t])
        elif cached[0] != key:
            torch.index_select(weight.detach(), 0, self.d2t, out=cached[1])
            self._head_cache = (key, cached[1])
        return self._head_cache[1]

    def refresh_caches(self) -> None:
        if self.d2t is not None and self._target is not None:
            self.head_weight()

    # ----------------------------------------------------------------- compute
    def forward(self, hidden, next_tokens, positions, mask=None, kv: RowKV | None = None, slots=None, kv_len=None):
        """Predicted next hidden states [B, q, H] from policy features ``hidden`` [B, q, H] and tokens [B, q].

        ``mask`` is an additive attention mask [B, 1, q, kv]; with ``kv`` the keys are written at ``slots``.
        Without a cache the mask defaults to causal.
        """
        x = self.fc(torch.cat([self.embed(next_tokens).to(hidden.dtype), hidden], dim=-1))
        if mask is None and kv is None:
            q = x.shape[1]
            mask = torch.full((q, q), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, kv, slots, kv_len)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_unrolled(self, hidden, next_tokens, positions, valid, depth: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): predictions [B, L, H] at each of ``depth`` chained draft steps.

        Step 0 reads the policy's features. Step d at position t reads step d-1's prediction at t-1 in place
        of the real feature, and attends, as at inference, to real-feature keys up to t-d and to the keys of
        the steps before it on its own diagonal (positions t-d+1 .. t). ``valid`` [B, L] marks real pairs.
        """
        embedded = self.embed(next_tokens).to(hidden.dtype)

        def layer(features, attend):
            x = self.fc(torch.cat([embedded, features], dim=-1))
            x = x + attend(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

        return unroll(self.self_attn, layer, hidden, positions, valid, depth)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary (index with ``d2t`` to get target ids)."""
        weight = self.head_weight()
        logits = F.linear(predicted.to(weight.dtype), weight).to(torch.float32)
        return apply_logit_transform(logits, self.config.final_logit_softcapping, self.config.logit_scale)
