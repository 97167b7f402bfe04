"""TLTPPOTrainer: veRL's RayPPOTrainer with TLT's rollout (PPO and GRPO alike, ``algorithm.adv_estimator``).

Why RayPPOTrainer and not the v1 trainers: in veRL 0.9.1 the v1 trainers (``trainer.use_v1=true``) need the
TransferQueue package, which veRL does not install, while RayPPOTrainer's ``fit`` is self-contained and runs
through the same agent loops and rollout replicas. Our rollout backend serves both.

What it adds, each in one overridden method:

* ``init_workers``: registers the ``tlt`` backend and checks that the rollout uses it;
* ``_update_actor``: the step's ``tlt/*`` metrics (acceptance, idle time, drafter training) join veRL's;
* ``_save_checkpoint`` / ``_load_checkpoint``: the drafter (weights, optimizer, step) is saved in
  ``global_step_N/drafter`` and restored on resume, with the actor.
"""

from __future__ import annotations

import os

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from .manager import TLTAgentLoopManager, find_servers
from .replica import BACKEND, register
from .settings import TLTSection

DRAFTER_DIR = "drafter"


def check_tlt_config(config: DictConfig) -> TLTSection:
    """The tlt: section, validated, and the veRL settings TLT depends on; each error names its fix."""
    tlt = TLTSection.from_mapping(config.get("tlt"))
    rollout = config.actor_rollout_ref.rollout
    if rollout.name != BACKEND:
        raise ValueError(f"TLTPPOTrainer needs actor_rollout_ref.rollout.name={BACKEND} (got {rollout.name!r}); "
                         "the tlt_ppo_trainer config sets it.")
    parallel = (rollout.tensor_model_parallel_size, rollout.get("pipeline_model_parallel_size", 1),
                rollout.get("data_parallel_size", 1))
    if parallel != (1, 1, 1):
        raise ValueError(f"The tlt rollout runs the whole model in one server per replica: set actor_rollout_ref."
                         f"rollout.tensor_model_parallel_size=1 (and pipeline/data_parallel_size=1), got {parallel}.")
    manager = rollout.get("agent", {}).get("agent_loop_manager_class")
    if manager is None:
        raise ValueError("Set actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                         "tlt_trainers.verl.manager.TLTAgentLoopManager (drafter training in idle time).")
    if config.trainer.get("use_v1", False):
        raise ValueError("TLTPPOTrainer subclasses RayPPOTrainer: set trainer.use_v1=false.")
    custom = rollout.get("custom") or {}
    if "tlt" not in custom:  # the rollout servers only see the rollout config
        with open_dict(config):
            rollout.custom = OmegaConf.merge(custom, {"tlt": tlt.to_dict()})
    elif TLTSection.from_mapping(custom["tlt"]) != tlt:
        raise ValueError("actor_rollout_ref.rollout.custom.tlt differs from the tlt: section; set only tlt: "
                         "(the config copies it with ${tlt}).")
    return tlt


class TLTPPOTrainer(RayPPOTrainer):
    """RayPPOTrainer whose rollout speculates losslessly and whose drafter trains in the rollout's idle time."""

    def __init__(self, config, *args, **kwargs):
        register()
        self.tlt = check_tlt_config(config)
        super().__init__(config, *args, **kwargs)

    def init_workers(self):
        super().init_workers()
        if not isinstance(self.async_rollout_manager, TLTAgentLoopManager):
            raise TypeError(f"{type(self.async_rollout_manager).__name__} is not a TLTAgentLoopManager; set "
                            "actor_rollout_ref.rollout.agent.agent_loop_manager_class to it or a subclass.")

    # ---------------------------------------------------------------- metrics
    def _update_actor(self, batch):
        output = super()._update_actor(batch)
        output.meta_info["metrics"].update(self.async_rollout_manager.pop_metrics())
        return output

    # ---------------------------------------------------------------- checkpoints
    def _step_folder(self) -> str:
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")

    def _save_checkpoint(self):
        super()._save_checkpoint()
        servers = find_servers()
        if servers:  # replicas hold identical drafters after every sync: the first one speaks for all
            ray.get(servers[0].save_drafter.remote(os.path.join(self._step_folder(), DRAFTER_DIR)))

    def _load_checkpoint(self):
        result = super()._load_checkpoint()
        if self.global_steps == 0:
            return result
        folder = self.config.trainer.get("resume_from_path") if self.config.trainer.resume_mode == "resume_path" \
            else self._step_folder()
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        drafter = os.path.join(folder, DRAFTER_DIR)
        if os.path.isdir(drafter):
            ray.get([s.load_drafter.remote(drafter) for s in find_servers()])
            print(f"TLT: drafter restored from {drafter}")
        else:
            print(f"TLT: no drafter in {folder}; the drafter starts as configured (tlt.drafter_name_or_path)")
        return result
