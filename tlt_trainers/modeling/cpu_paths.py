"""CPU paths for the engine's policy forward: the LM head and the decoder's linears at a few rows, and
grouped-query attention without K/V copies.

All three compute what the model's own layers compute (linears to float32 rounding, attention exactly); they exist
because at the row counts of decode and verify steps, the stock CPU paths waste half the step or more.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import AttentionInterface

FEW_ROWS = 48
# transformers 5.2x hands a single query's grouped heads to SDPA without copies itself (``pack_gqa``), rounding as
# that layout does; 5.10 copies K/V (``repeat_kv``) for it as for any masked query.
_TRANSFORMERS_PACKS_ONE_QUERY = hasattr(sdpa_attention, "pack_gqa")


def cpu_head(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` computed as ``(weight @ hidden.T).T`` on one row more than one.

    The same product, but MKL's path for the transposed form is several times faster at the few rows a decode
    or verify step has (equal from about 16 rows on), and a small model's LM head is a large share of its step
    (figures in docs/adaptive_engine.md). A single row goes through as two: the matrix-vector path is the slow
    one. Results agree with F.linear to float32 rounding (<1e-5).
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = (weight @ flat.t()).t()[:rows].contiguous()
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


def _few_row_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` computed as ``(W @ x.T).T`` (as :func:`cpu_head`) when x has 2-48 rows and no gradient is
    wanted. The weight's device and dtype are checked once per forward by :class:`CpuDecodePaths`.

    With MKL, ``F.linear`` at a few rows runs far below the memory-bound speed its weights allow, which makes a
    verify pass over a few tokens per row, and every plain step at small batch, dearer than it needs to be; the
    transposed product streams the weights at full speed. From 64 rows on the two take the same time, so larger
    inputs keep ``F.linear`` (hence ``FEW_ROWS``). A single row keeps ``F.linear`` too (duplicating it, as
    :func:`cpu_head` does, costs more than it saves when every linear of the decoder pays it), and so does
    anything with a gradient. Figures in docs/adaptive_engine.md.
    """
    weight = module.weight
    rows = x.numel() // x.shape[-1] if x.dim() > 1 else 1
    stock = (rows < 2 or rows > FEW_ROWS or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu")
             or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
    if stock:
        return nn.functional.linear(x, weight, module.bias)
    out = (weight @ x.reshape(rows, x.shape[-1]).t()).t()
    if module.bias is not None:
        out = out + module.bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def sdpa_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention with grouped K/V handed to SDPA as they are (``enable_gqa``) on CPU.

    transformers copies K and V to every query head (``repeat_kv``) whenever a mask is passed, and the engine
    always passes one. The copies grow with batch and context, and at large batch they can cost as much as the
    rest of the step (figures in docs/adaptive_engine.md); with ``enable_gqa`` SDPA reads the grouped heads in
    place and the result is bit-identical (same kernel, same reduction order). Elsewhere it is transformers' own
    function: off CPU, without grouped heads, with ``output_attentions`` or an attention ``softcap`` (which
    transformers' sdpa ignores in 5.10 and refuses in 5.2x), and for a single query where transformers avoids the
    copies itself (5.2x), so that decode steps round exactly as ``generate``'s do.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if (query.device.type != "cpu" or groups == 1 or kwargs.get("output_attentions", False)
            or kwargs.get("softcap") is not None or (query.shape[2] == 1 and _TRANSFORMERS_PACKS_ONE_QUERY)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, is_causal=is_causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


SDPA_GQA = "tlt_sdpa_gqa"
AttentionInterface.register(SDPA_GQA, sdpa_gqa_attention)
# Masks are built exactly as for "sdpa" (an unregistered name would make transformers drop 2-D masks).
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_GQA, sdpa_mask)


class CpuDecodePaths:
    """While active, the policy's decoder runs the CPU paths above; outside it, the user's model is untouched.

    The linears' forward is set on the module instances and the attention implementation on the config for
    the duration of one engine forward, then put back, so no deepcopy, pickling or training step sees them.
    Only what is in its stock state at entry is switched: a model on ``eager`` or a flash kernel keeps its
    choice, a linear that already carries an instance forward (an accelerate hook, or an outer activation of
    this context) keeps it, and a nested activation leaves the outer one's switches alone. Another thread
    running the same decoder meanwhile gets one path or the other, which agree to float32 rounding.
    """

    def __init__(self, decoder: nn.Module, config):
        self.linears = [m for m in decoder.modules() if type(m) is nn.Linear]
        # one bound forward per linear, made once (an engine forward enters this context at every step)
        self._forwards = [partial(_few_row_linear, m) for m in self.linears]
        self.config = config if any(p.device.type == "cpu" for p in decoder.parameters()) else None
        self._patched: list[nn.Linear] = []
        self._previous_attention: str | None = None

    def __enter__(self):
        # Through __dict__ and _parameters rather than nn.Module's attribute hooks: this runs for every linear of
        # the decoder at every step, and the hooks cost a few percent of a batch-1 step of a small model.
        patched = []
        for module, forward in zip(self.linears, self._forwards):
            weight = module._parameters.get("weight")
            if ("forward" not in module.__dict__ and weight is not None and weight.device.type == "cpu"
                    and weight.dtype == torch.float32):
                module.__dict__["forward"] = forward
                patched.append(module)
        self._patched = patched
        self._previous_attention = None
        if self.config is not None and self.config._attn_implementation == "sdpa":
            self._previous_attention = "sdpa"
            self.config._attn_implementation = SDPA_GQA

    def __exit__(self, *exc):
        for module in self._patched:
            module.__dict__.pop("forward", None)
        self._patched = []
        if self._previous_attention is not None:
            self.config._attn_implementation = self._previous_attention
            self._previous_attention = None
