"""The block drafter (DFlash) as a drafter kind: ``block:K`` from one pass, the masked-slot loss, vLLM's ``dflash``
method (SGLang's DFlash loader reads the same folder)."""

from __future__ import annotations

from ..drafter.block import BlockDrafter
from ..drafter.block_training import block_training_loss
from ..drafter.export_block import block_weights, export_block_vllm, write_mask_embedding
from ..drafter.registry import DrafterKind, VLLMServing, register
from ..proposers.block import block_proposers
from ..shipped import HERE as SHIPPED


def _vllm_export(drafter, directory, policy, num_speculative_tokens: int, full_vocab_head: bool):
    return export_block_vllm(drafter, directory, policy)


def _vllm_weights(drafter, directory, dtype, full_vocab_head: bool):
    write_mask_embedding(drafter, directory, dtype)  # vLLM's load_weights reads it from the folder
    return block_weights(drafter, dtype)


KIND = register(DrafterKind(
    name="block",
    drafter_class=BlockDrafter,
    description="block drafter (DFlash)",
    proposers=block_proposers,
    strategy_kinds=("block",),
    training_loss=block_training_loss,
    exports={"vllm": export_block_vllm, "speculators": export_block_vllm},
    vllm=VLLMServing(method="dflash", export=_vllm_export, weights=_vllm_weights,
                     max_drafts=lambda drafter: drafter.max_drafts),
    shipped=(SHIPPED / "smollm2-135m-instruct-block",),
    auto_rank=2,  # opt-in: 'auto' starts from it only where no EAGLE drafter ships for the policy
    model_card_tags=("speculative-decoding", "draft-model", "tlt-trainers", "vllm", "dflash"),
))
