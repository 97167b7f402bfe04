"""The vLLM worker extension for veRL's vLLM rollout with TLT: veRL's own (policy sync) plus TLT's drafter reload.

``tlt_trainers.verl.vllm.configure_vllm_rollout`` passes it (by name: ``tlt_trainers.verl.vllm.EXTENSION``) as
``engine_kwargs.vllm.worker_extension_cls`` (veRL's server builds vLLM's arguments as
``{..., "worker_extension_cls": <veRL's>, **engine_kwargs}``, so ours wins). It is veRL's
``vLLMColocateWorkerExtension`` (``update_weights_from_ipc`` and the rest, unchanged on GPUs) and TLT's
:class:`~tlt_trainers.vllm.worker.DrafterReloadExtension` (``tlt_reload_drafter``, ``tlt_drafter_info``).

On CPU the policy sync is done differently: veRL's ``_update_weights`` calls the model's plain ``load_weights``,
which fails on vLLM's CPU backend (it repacks linear weights after loading and leaves ``layer.weight`` empty), so
the buckets veRL sends are received with veRL's own receiver and loaded with vLLM's layer-wise reload
(``initialize_layerwise_reload`` -> ``load_weights`` -> ``finalize_layerwise_reload``), as for the drafter.

Importing this module imports veRL, which loads our ``verl.plugins`` entry point in vLLM's worker processes too:
that is where the cpu platform's ``importlib.metadata`` fix reaches them.
"""

from __future__ import annotations

import logging

import torch
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from ..vllm.worker import DrafterReloadExtension

logger = logging.getLogger(__name__)


class TLTColocateExtension(vLLMColocateWorkerExtension, DrafterReloadExtension):
    """veRL's colocated-worker extension with TLT's drafter reload; a layer-wise policy reload on CPU."""

    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False):
        if self.device is None or self.device.type != "cpu" or peft_config:
            return super().update_weights_from_ipc(peft_config=peft_config, base_sync_done=base_sync_done,
                                                   use_shm=use_shm)
        return self._tlt_layerwise_update(use_shm)

    def _tlt_layerwise_update(self, use_shm: bool) -> int:
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.model
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        count = 0

        def on_bucket(weights, is_last):
            nonlocal count
            # clone: on CPU the receiver's tensor.to("cpu") is a view into the shared-memory bucket, which the
            # sender overwrites with the next bucket and the receiver must close (BufferError while views live)
            model.load_weights([(name, tensor.clone()) for name, tensor in weights])
            count += len(weights)

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            try:
                receiver.receive_weights(on_bucket_received=on_bucket)
            finally:
                finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
        logger.info("TLTColocateExtension: layer-wise reload of %d policy tensors", count)
        return count

    def tlt_reload_drafter(self, weights=None, path=None, embed_scale=None, full_vocab_head=False) -> dict:
        # veRL's vLLMHttpServer.collective_rpc drops return values: the result is logged here as well
        result = super().tlt_reload_drafter(weights, path, embed_scale=embed_scale, full_vocab_head=full_vocab_head)
        logger.info("TLTColocateExtension: drafter reloaded (%d tensors, %.3f s)", result["tensors"],
                    result["seconds"])
        return result
