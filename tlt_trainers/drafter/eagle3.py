"""Eagle3Drafter: decoder layers over a fusion of the policy's low, middle and high layers (EAGLE-3).

What differs from EAGLE-1 (:class:`~tlt_trainers.drafter.eagle.EagleDrafter`):

- features: the residual streams entering three of the policy's layers (default ``(2, n // 2, n - 3)`` of n,
  vLLM's choice), concatenated [3H] and fused by ``fc`` to H; later draft steps read the drafter's own output;
- the layer sees ``[input_layernorm(embed(x_{t+1})); hidden_norm(feature)]`` (2H) through its q/k/v projections;
- it predicts tokens only (no regression onto the policy's features), through its own ``norm`` and ``lm_head``
  over the draft vocabulary, which start as the policy's final norm and head rows;
- ``num_hidden_layers`` > 1 stacks plain pre-norm decoder layers (``later_layers``, vLLM's ``layers.1``, ...) on
  the first: each attends over its own keys, and the last one's output is the next draft step's feature.

Module names and the computation follow vLLM's ``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``), so the export
(:func:`tlt_trainers.drafter.export_eagle3.export_eagle3_vllm`) is a renaming, and what vLLM serves is what was
trained here.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling.kv_cache import LayeredKV, RowKV
from ..modeling.target import text_config
from .base import AutoregressiveDrafter
from .config import EagleDrafterConfig
from .eagle import DrafterAttention, DrafterMLP, RMSNorm, new_drafter, unroll


def default_aux_layers(num_layers: int) -> list[int]:
    """The EAGLE-3 layers of a policy with ``num_layers`` layers: low, middle and high. vLLM's default
    ``(2, n // 2, n - 3)`` where those are distinct, else ``(1, n // 2, n - 1)`` (exports name them explicitly)."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 reads three distinct layers of the policy, but it has only {num_layers}; pass "
                         "aux_layer_ids=[...] or use the EAGLE-1 drafter (EagleDrafter).")
    layers = [2, num_layers // 2, num_layers - 3]
    return layers if len(set(layers)) == 3 and layers == sorted(layers) else [1, num_layers // 2, num_layers - 1]


class OwnHead:
    """A drafter with its own final ``norm`` and ``lm_head`` over the draft vocabulary, which start as the policy's
    final norm and head rows (EAGLE-3 and block drafters)."""

    norm: RMSNorm
    lm_head: nn.Linear

    def init_from_policy(self, model: nn.Module) -> None:
        """Copy the policy's final norm weight and the LM head rows of the draft vocabulary into the drafter."""
        with torch.no_grad():
            norm = getattr(model.get_decoder(), "norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == (
                    self.config.hidden_size,):
                self.norm.weight.copy_(norm.weight)
            head = model.get_output_embeddings().weight
            rows = head if self.d2t is None else head[self.d2t]
            self.lm_head.weight.copy_(rows)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over ``token_ids``: tokens already drafted keep their trained head rows, new ones start from the
        policy's head rows."""
        old_ids = None if self.d2t is None else self.d2t.clone()
        old_rows = self.lm_head.weight.detach().clone()
        super().set_draft_vocab(token_ids)  # refuses a drafter without a draft vocabulary
        if self._target is None:
            return
        self._keep_head_rows(old_ids, old_rows)

    @torch.no_grad()
    def _keep_head_rows(self, old_ids: torch.Tensor, old_rows: torch.Tensor) -> None:
        """Head rows for the draft vocabulary ``d2t``: ``old_rows`` where the token was among ``old_ids``, the
        policy's head rows for the others."""
        rows = self.target.head.weight[self.d2t].to(old_rows.dtype)
        position = torch.searchsorted(old_ids, self.d2t).clamp(max=len(old_ids) - 1)
        kept = old_ids[position] == self.d2t
        rows[kept] = old_rows[position[kept]]
        self.lm_head.weight.copy_(rows)

    def with_draft_vocab(self, token_ids: torch.Tensor):
        """A copy of this (bound) drafter over ``token_ids``, of any size: its layers as trained, its trained head
        rows for the tokens it keeps and the policy's head rows for the new ones. :meth:`set_draft_vocab` keeps the
        size; this grows or shrinks a trained drafter's draft vocabulary."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        config = copy.deepcopy(self.config)
        config.draft_vocab_size = len(token_ids)
        weight = self.lm_head.weight
        grown = type(self)(config).to(device=weight.device, dtype=weight.dtype)
        grown._target = self.target  # refuses an unbound drafter: the new rows are the policy's
        grown.load_state_dict({k: v for k, v in self.state_dict().items() if k not in ("d2t", "lm_head.weight")},
                              strict=False)
        super(OwnHead, grown).set_draft_vocab(token_ids)  # checks the ids
        grown._keep_head_rows(self.d2t, weight.detach())
        return grown

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary (index with ``d2t`` to get target ids)."""
        return F.linear(*self.head_inputs(predicted)).to(torch.float32)

    def head_inputs(self, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, W) with ``logits = x @ W.T``: what a fused linear cross-entropy needs instead of the logits."""
        return self.norm(predicted), self.lm_head.weight


class FusedLayers:
    """A drafter that reads several of the policy's layers (``config.aux_layer_ids``), fused by its ``fc``."""

    fc: nn.Linear

    def _check_policy(self, model: nn.Module) -> None:
        layers = text_config(model).num_hidden_layers
        bad = [k for k in self.config.aux_layer_ids if not 0 <= k <= layers]
        if bad:
            raise ValueError(f"The drafter reads policy layers {self.config.aux_layer_ids} but the policy has "
                             f"{layers}: this drafter was made for another model.")

    @property
    def feature_size(self) -> int:
        return self.fc.in_features

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layer_ids)


class Eagle3Layer(nn.Module):
    """The drafter's decoder layer (vLLM's ``midlayer``): attention over [embedding; feature], then the MLP."""

    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embedded: torch.Tensor, feature: torch.Tensor, attend) -> torch.Tensor:
        """The layer's output before the final norm (the next draft step's feature); ``attend(x)`` runs the
        attention on its 2H input."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = residual + attend(torch.cat([self.input_layernorm(embedded), normed], dim=-1))
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3LaterLayer(nn.Module):
    """A decoder layer after the first (vLLM's ``layers.1`` and on): pre-norm attention over the previous layer's
    output [H], then the MLP."""

    def __init__(self, config: EagleDrafterConfig):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        x = x + attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    @torch.no_grad()
    def zero_residual_branches(self) -> None:
        """Output projections to zero: the layer passes its input through unchanged (a deeper drafter made from a
        trained one starts as that drafter, and training grows the new layer from there)."""
        self.self_attn.o_proj.weight.zero_()
        self.mlp.down_proj.weight.zero_()


class Eagle3Drafter(FusedLayers, OwnHead, AutoregressiveDrafter):
    """An EAGLE-3 drafter bound to a policy's embedding; its own head scores the draft vocabulary."""

    stacks_layers = True

    @classmethod
    def check_config(cls, config: EagleDrafterConfig) -> None:
        super().check_config(config)
        ids = list(config.aux_layer_ids or [])
        if len(ids) != 3 or ids != sorted(set(ids)) or ids[0] < 0:
            raise ValueError(f"aux_layer_ids={config.aux_layer_ids}: an Eagle3Drafter reads three distinct policy "
                             "layers in increasing order (low, middle, high), as vLLM and SGLang do.")
        if config.qkv_bias:
            raise ValueError("qkv_bias=True is an EAGLE-1 (Qwen2-style) option; EAGLE-3 drafters have no attention "
                             "biases in any layout vLLM or SGLang loads.")

    def __init__(self, config: EagleDrafterConfig, target: nn.Module | None = None):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.later_layers = nn.ModuleList(Eagle3LaterLayer(config) for _ in range(config.num_hidden_layers - 1))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        if target is not None:
            self.bind(target)

    @classmethod
    def from_target(cls, model: nn.Module, aux_layer_ids: list[int] | None = None, **overrides) -> Eagle3Drafter:
        """A fresh drafter for ``model``: norm and head start as the policy's final norm and LM head (rows of the
        draft vocabulary), the layer as random. ``overrides`` set any EagleDrafterConfig field."""
        layers = list(aux_layer_ids) if aux_layer_ids else default_aux_layers(text_config(model).num_hidden_layers)
        drafter = new_drafter(cls, model, {"aux_layer_ids": layers}, overrides)
        drafter.init_from_policy(model)
        return drafter

    # ----------------------------------------------------------------- what the engine asks
    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """Policy features [.., 3H] -> [.., H]; the drafter's own predictions [.., H] pass through."""
        return self.fc(hidden) if hidden.shape[-1] == self.fc.in_features else hidden

    @property
    def attentions(self) -> list[DrafterAttention]:
        """The attention module of each decoder layer, first to last."""
        return [self.midlayer.self_attn] + [layer.self_attn for layer in self.later_layers]

    def new_kv(self, capacity: int) -> RowKV | LayeredKV:
        """One :class:`RowKV` per decoder layer (a single one for the one-layer drafter)."""
        return RowKV(capacity) if not self.later_layers else LayeredKV(capacity, 1 + len(self.later_layers))

    def layers_forward(self, embedded: torch.Tensor, feature: torch.Tensor, attend) -> torch.Tensor:
        """Every decoder layer in turn; ``attend(x, index)`` runs layer ``index``'s attention on its input."""
        x = self.midlayer(embedded, feature, lambda h: attend(h, 0))
        for index, layer in enumerate(self.later_layers, start=1):
            x = layer(x, lambda h, index=index: attend(h, index))
        return x

    def forward(self, hidden, next_tokens, positions, mask=None, kv: RowKV | LayeredKV | None = None, slots=None,
                kv_len=None):
        """Predicted features [B, q, H] (before the final norm) from the policy's fused layers [B, q, 3H] or the
        drafter's previous predictions [B, q, H], and the tokens [B, q] that followed them."""
        feature = self.fuse(hidden)
        embedded = self.embed(next_tokens).to(feature.dtype)
        if mask is None and kv is None:
            q = feature.shape[1]
            mask = torch.full((q, q), torch.finfo(feature.dtype).min, device=feature.device,
                              dtype=feature.dtype).triu(1)
        layers = 1 + len(self.later_layers)
        caches = kv.layers if isinstance(kv, LayeredKV) else [kv] * (1 if kv is not None else layers)
        if len(caches) != layers:  # one cache shared by several layers would mix their keys
            raise ValueError(f"A KV cache of {len(caches)} layer(s) for a drafter of {layers}: make it with "
                             "drafter.new_kv(capacity).")
        attentions = self.attentions
        return self.layers_forward(embedded, feature, lambda x, index: attentions[index](
            x, positions, mask, caches[index], slots, kv_len))

    def forward_unrolled(self, hidden, next_tokens, positions, valid, depth: int) -> list[torch.Tensor]:
        """Training-time test over ``depth`` chained draft steps (see :func:`tlt_trainers.drafter.eagle.unroll`)."""
        embedded = self.embed(next_tokens).to(hidden.dtype)
        return unroll(self.attentions, lambda features, attend: self.layers_forward(embedded, features, attend),
                      self.fuse(hidden), positions, valid, depth)

    def stacked(self, num_hidden_layers: int) -> Eagle3Drafter:
        """A copy of this (bound) drafter with ``num_hidden_layers`` decoder layers: its trained layers kept, each
        new layer added after them with zeroed output projections, so the copy drafts exactly as this one until
        training moves the new layers."""
        if num_hidden_layers <= len(self.attentions):
            raise ValueError(f"stacked({num_hidden_layers}): the drafter already has {len(self.attentions)} layers.")
        config = copy.deepcopy(self.config)
        config.num_hidden_layers = num_hidden_layers
        weight = self.lm_head.weight
        deeper = type(self)(config).to(device=weight.device, dtype=weight.dtype)
        missing, unexpected = deeper.load_state_dict(self.state_dict(), strict=False)
        if unexpected or any(not name.startswith("later_layers.") for name in missing):
            raise RuntimeError(f"stacked: weights that do not carry over: {missing + unexpected}")
        for layer in deeper.later_layers[len(self.later_layers):]:
            layer.zero_residual_branches()
        if self._target is not None:
            deeper._target = self._target
        return deeper
