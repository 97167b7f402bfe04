"""EAGLE-1 as a drafter kind: chains and trees, training-time test with feature regression, vLLM's ``eagle``
method (its EAGLE-1 layout, reloaded in place by every vLLM rollout), SGLang's EAGLE and the speculators layout."""

from __future__ import annotations

from functools import partial

from ..drafter.eagle import EagleDrafter
from ..drafter.export import export_sglang, export_vllm, vllm_weights
from ..drafter.registry import DrafterKind, VLLMServing, register
from ..drafter.trainer import DrafterTrainer
from ..proposers.eagle import token_proposers


def _vllm_export(drafter, directory, policy, num_speculative_tokens: int, full_vocab_head: bool):
    return export_vllm(drafter, directory, policy, num_speculative_tokens=num_speculative_tokens,
                       full_vocab_head=full_vocab_head)


def _vllm_weights(drafter, directory, dtype, full_vocab_head: bool):
    return vllm_weights(drafter, full_vocab_head=full_vocab_head, dtype=dtype)


KIND = register(DrafterKind(
    name="eagle",
    drafter_class=EagleDrafter,
    description="EAGLE-1",
    proposers=token_proposers,
    strategy_kinds=("chain", "tree"),
    training_loss=DrafterTrainer.autoregressive_loss,
    exports={"vllm": partial(export_vllm, layout="vllm"), "speculators": partial(export_vllm, layout="speculators"),
             "sglang": export_sglang},
    vllm=VLLMServing(method="eagle", export=_vllm_export, weights=_vllm_weights, eagle1_compatible=True),
    auto_rank=1,
    model_card_tags=("speculative-decoding", "eagle", "draft-model", "tlt-trainers", "vllm", "sglang"),
))
