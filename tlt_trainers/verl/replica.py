"""The ``tlt`` rollout backend for veRL: a RolloutReplica that runs :class:`~.server.TLTRolloutServer`, and the
ServerAdapter through which the actor workers push new weights to it.

``actor_rollout_ref.rollout.name=tlt`` selects it. Both registries veRL looks names up in are filled by
:func:`register` (run on ``import verl`` in every process through the ``verl.plugins`` entry point, and again
by our entry point and trainer).

Why a separate server actor and not vLLM: the tlt backend runs anywhere PyTorch runs (CPU included) with the
adaptive engine, history drafting and idle-time drafter training. On GPUs at scale, vLLM's own EAGLE
speculative decoding with our exported drafter is the other path (see ``docs/verl.md``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from .server import TLTRolloutServer
from .settings import TLTSection

logger = logging.getLogger(__name__)

BACKEND = "tlt"


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"tlt_rollout_server_{replica_rank}{suffix}"


def model_field(model_config, name: str):
    """A field of the model config, which arrives as an HFModelConfig or as a plain DictConfig."""
    if hasattr(model_config, "get"):
        return model_config.get(name)
    return getattr(model_config, name, None)


def section_of(rollout_config) -> TLTSection:
    """The ``tlt:`` section as it reaches the rollout: ``rollout.custom.tlt`` (our config sets it to ``${tlt}``)."""
    custom = getattr(rollout_config, "custom", None) or {}
    return TLTSection.from_mapping(custom.get("tlt") if hasattr(custom, "get") else None)


class TLTReplica(RolloutReplica):
    """One server actor per replica, on the node of the replica's first worker (hybrid) or anywhere (standalone).

    The server uses no Ray GPU resources: on CPU it needs none, and on a GPU node it shares the device the
    trainer runs on, as veRL's colocated vLLM servers do.
    """

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_standalone(self):
        """No worker group: the server itself is the whole replica."""
        self.rollout_mode = RolloutMode.STANDALONE
        await self.launch_servers()

    async def init_colocated(self, resource_pool):
        self.rollout_mode = RolloutMode.COLOCATED
        self.resource_pool = resource_pool
        await self.launch_servers()

    async def launch_servers(self):
        options = dict(name=server_name(self.replica_rank, self.name_suffix), max_concurrency=self.max_concurrency,
                       num_cpus=0)
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False)
        server = ray.remote(TLTRolloutServer).options(**options).remote(
            model_path=model_field(self.model_config, "local_path") or model_field(self.model_config, "path"),
            settings=section_of(self.config).to_dict(),
            response_length=self.config.response_length,
            prompt_length=self.config.prompt_length,
            logprobs_mode=getattr(self.config, "logprobs_mode", None) or "processed_logprobs",
            max_num_seqs=self.config.max_num_seqs,
            replica_rank=self.replica_rank,
            tokenizer_path=(model_field(self.model_config, "local_tokenizer_path")
                            or model_field(self.model_config, "tokenizer_path")),
            trust_remote_code=bool(model_field(self.model_config, "trust_remote_code")),
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = options["name"]  # no HTTP endpoint: agent loops call the actor directly


class TLTServerAdapter(BaseRollout):
    """Lives in each actor worker (hybrid mode): hands the actor's weights to its replica's server.

    Only the first rank of each replica sends (every rank of an FSDP actor yields the full tensors).
    """

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % world == 0
        self.sleep_level = 1
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        """The server keeps its own copy of the weights resident; nothing to restore."""

    async def release(self):
        """Nothing in this worker to free: the engine's memory lives in the server, which gives it back when veRL puts
        the replica to sleep after a rollout (:meth:`TLTRolloutServer.sleep`)."""

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"The tlt rollout takes full named tensors, not {wire_format!r}; use "
                                      "actor_rollout_ref.rollout.checkpoint_engine.backend=naive.")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("The tlt rollout needs merged weights for LoRA: set "
                                      "actor_rollout_ref.model.lora.merge=True.")
        if not self.is_leader_rank:
            for _ in weights:  # every rank walks the generator: it may run collectives (FSDP all-gathers)
                pass
            return
        tensors = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        await self._server_handle().update_weights.remote(tensors)


def register() -> None:
    """Make ``rollout.name=tlt`` resolvable in this process (idempotent)."""
    from verl.workers.rollout import base, replica

    replica.RolloutReplicaRegistry.register(BACKEND, lambda: TLTReplica)
    base._ROLLOUT_REGISTRY[(BACKEND, "async")] = f"{__name__}.TLTServerAdapter"
