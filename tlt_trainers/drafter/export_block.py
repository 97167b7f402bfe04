"""Export a :class:`~tlt_trainers.drafter.block.BlockDrafter` to the DFlash layout vLLM loads (``method="dflash"``).

vLLM's ``DFlashQwen3ForCausalLM`` (``vllm/model_executor/models/qwen3_dflash.py``) computes what the drafter computes
here, under the same module names: ``fc`` and ``hidden_norm`` over the target's aux layers, ``layers.i.*`` (Qwen3
decoder layers with ``q_norm``/``k_norm``), ``norm`` and an own ``lm_head`` over the draft vocabulary with ``d2t``
as offsets (``d2t[i] = target_id - i``). What the export adds:

- config.json: a Qwen3 config with ``architectures=["DFlashDraftModel"]``, ``block_size`` and ``dflash_config``
  (``mask_token_id``, and ``target_layer_ids`` numbered by the layer whose output is read: ours minus one, vLLM adds
  the one back);
- ``mask_embedding.pt`` (``{"mask_token_id", "embedding"}``): the drafter's learnt mask embedding, which vLLM
  substitutes for the embedding of ``mask_token_id`` wherever that id is fed (the embedding itself is the
  target's, shared, so the export holds no ``embed_tokens``).

Serve with ``LLM(policy, speculative_config={"method": "dflash", "model": out_dir, "num_speculative_tokens": k})``,
k <= ``block_size - 1``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .block import BlockDrafter
from .export import _dtype_name, _embed_scale, _llama_config, _max_positions, _write
from .export_eagle3 import draft_vocab_maps

MASK_EMBEDDING_NAME = "mask_embedding.pt"


def block_weights(drafter: BlockDrafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's tensors by vLLM's DFlash names (``mask_embedding`` and ``d2t`` left out; ``d2t`` as offsets
    and ``t2d`` where the drafter has a draft vocabulary), on CPU in ``dtype`` (default: the drafter's)."""
    dtype = dtype or drafter.fc.weight.dtype
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous()
               for name, t in drafter.state_dict().items() if name not in ("d2t", "mask_embedding")}
    return tensors | draft_vocab_maps(drafter)


def dflash_config(drafter: BlockDrafter, verifier: str | nn.Module | None, max_positions: int | None,
                  dtype: torch.dtype) -> dict:
    """config.json of vLLM's DFlash layout for ``drafter``."""
    c = drafter.config
    config = _llama_config(drafter, ["DFlashDraftModel"], _max_positions(verifier, max_positions), dtype)
    config.update(
        model_type="qwen3",
        num_hidden_layers=c.num_hidden_layers,
        draft_vocab_size=drafter.draft_vocab_size,
        target_hidden_size=c.hidden_size,
        block_size=c.block_size,
        dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": [k - 1 for k in c.aux_layer_ids]},
        # the block attends to itself without a causal mask (vLLM picks a backend that supports it)
        is_causal=False,
    )
    config["torch_dtype"] = _dtype_name(dtype)
    return config


def export_block_vllm(
    drafter: BlockDrafter,
    out_dir: str | os.PathLike,
    verifier_name_or_path: str | nn.Module | None = None,
    *,
    num_speculative_tokens: int | None = None,
    max_position_embeddings: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``drafter`` in vLLM's DFlash layout; returns the folder. ``verifier_name_or_path``: the policy module
    (its ``max_position_embeddings`` sizes the drafter's RoPE cache) or its name. ``num_speculative_tokens`` (what
    the folder will be served with; vLLM takes it from the speculative config) is only checked against the block."""
    if num_speculative_tokens is not None and not 1 <= num_speculative_tokens < drafter.config.block_size:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: a block of {drafter.config.block_size} "
                         f"drafts 1 to {drafter.config.block_size - 1} tokens per pass.")
    if drafter.config.mask_token_id is None:
        raise ValueError("vLLM feeds a block's masked slots as a token id: create the drafter with mask_token_id=... "
                         "(any id the policy never emits, e.g. its pad token).")
    if _embed_scale(drafter.target.embed) is not None:
        raise ValueError("The policy scales its embedding (Gemma): vLLM hands a DFlash drafter the unscaled "
                         "embedding. Serve this drafter with tlt_trainers' own engine.")
    dtype = dtype or drafter.fc.weight.dtype
    out = Path(out_dir)
    _write(out, dflash_config(drafter, verifier_name_or_path, max_position_embeddings, dtype),
           block_weights(drafter, dtype), "dflash")
    write_mask_embedding(drafter, out, dtype)
    return out


def write_mask_embedding(drafter: BlockDrafter, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """``directory``/mask_embedding.pt (what vLLM's DFlash ``load_weights`` reads), replaced atomically."""
    file = Path(directory, MASK_EMBEDDING_NAME)
    tmp = file.with_name(f".{MASK_EMBEDDING_NAME}.tmp")
    embedding = drafter.mask_embedding.detach().to(device="cpu", dtype=dtype or drafter.mask_embedding.dtype)
    torch.save({"mask_token_id": int(drafter.config.mask_token_id), "embedding": embedding.clone()}, tmp)
    os.replace(tmp, file)
    return file
