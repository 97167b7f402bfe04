"""veRL's task runner (the Ray actor that builds the workers and calls ``fit``), building a TLTPPOTrainer.

veRL 0.9.1's runner for RayPPOTrainer (``main_ppo_v0.TaskRunner``) names the trainer class inside ``run``;
this one follows the same steps with our trainer, reusing veRL's ``BaseTaskRunner`` for the worker and
resource-pool setup.
"""

from __future__ import annotations

import os
import socket
from pprint import pprint

import ray
from omegaconf import OmegaConf
from verl.trainer.main_ppo_v0 import BaseTaskRunner
from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler, need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.utils.dataset.rl_dataset import collate_fn
from verl.workers.config import HFModelConfig

from .replica import register
from .trainer import TLTPPOTrainer
from .vllm import BACKEND as VLLM_BACKEND


@ray.remote(num_cpus=1)
class TLTTaskRunner(BaseTaskRunner):
    def add_actor_rollout_worker(self, config):
        """veRL's actor worker; with ``rollout.name=vllm`` our subclass, whose rank 0 owns and trains the drafter
        (:class:`~.drafter_worker.TLTActorRolloutRefWorker`)."""
        actor_rollout_cls, ray_worker_group_cls = super().add_actor_rollout_worker(config)
        if config.actor_rollout_ref.rollout.name == VLLM_BACKEND:
            from verl.trainer.ppo.ray_trainer import Role

            from .drafter_worker import TLTActorRolloutRefWorker

            for role in (Role.ActorRollout, Role.ActorRolloutRef):
                if role in self.role_worker_mapping:
                    self.role_worker_mapping[role] = ray.remote(TLTActorRolloutRefWorker)
            actor_rollout_cls = TLTActorRolloutRefWorker
        return actor_rollout_cls, ray_worker_group_cls

    def run(self, config):
        register()
        print(f"TLTTaskRunner hostname: {socket.gethostname()}, PID: {os.getpid()}")
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)

        actor_rollout_cls, ray_worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_resource_pool(config)
        self.add_teacher_model_resource_pool(config)
        self.add_ref_policy_worker(config, actor_rollout_cls)
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))

        model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        tokenizer, processor = model_config.tokenizer, model_config.processor
        train_dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, processor, is_train=True,
                                          max_samples=config.data.get("train_max_samples", -1))
        val_dataset = create_rl_dataset(config.data.val_files, config.data, tokenizer, processor, is_train=False,
                                        max_samples=config.data.get("val_max_samples", -1))
        trainer = TLTPPOTrainer(
            config=config, tokenizer=tokenizer, processor=processor, role_worker_mapping=self.role_worker_mapping,
            resource_pool_manager=self.init_resource_pool_mgr(config), ray_worker_group_cls=ray_worker_group_cls,
            train_dataset=train_dataset, val_dataset=val_dataset, collate_fn=collate_fn,
            train_sampler=create_rl_sampler(config.data, train_dataset),
        )
        trainer.init_workers()
        trainer.fit()
