"""EAGLE-3 as a drafter kind: chains and trees, training-time test with the token loss (packed where it can be),
vLLM's ``eagle3`` method from the speculators layout, SGLang's EAGLE-3. 'auto' prefers its shipped drafters."""

from __future__ import annotations

from ..drafter.eagle3 import Eagle3Drafter
from ..drafter.export_eagle3 import eagle3_weights, export_eagle3_sglang, export_eagle3_vllm
from ..drafter.registry import DrafterKind, VLLMServing, register
from ..drafter.trainer import DrafterTrainer
from ..proposers.eagle import token_proposers
from ..shipped import HERE as SHIPPED


def _vllm_export(drafter, directory, policy, num_speculative_tokens: int, full_vocab_head: bool):
    return export_eagle3_vllm(drafter, directory, policy or drafter.config.target_name_or_path or "policy",
                              num_speculative_tokens=num_speculative_tokens)


def _vllm_weights(drafter, directory, dtype, full_vocab_head: bool):
    return eagle3_weights(drafter, dtype)


KIND = register(DrafterKind(
    name="eagle3",
    drafter_class=Eagle3Drafter,
    description="EAGLE-3",
    proposers=token_proposers,
    strategy_kinds=("chain", "tree"),
    training_loss=DrafterTrainer.autoregressive_loss,
    exports={"vllm": export_eagle3_vllm, "speculators": export_eagle3_vllm, "sglang": export_eagle3_sglang},
    vllm=VLLMServing(method="eagle3", export=_vllm_export, weights=_vllm_weights),
    shipped=(SHIPPED / "smollm2-135m-instruct-eagle3",),
    auto_rank=0,
    model_card_tags=("speculative-decoding", "eagle", "draft-model", "tlt-trainers", "vllm", "sglang"),
))
