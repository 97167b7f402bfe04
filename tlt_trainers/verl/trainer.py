"""TLTPPOTrainer: veRL's RayPPOTrainer with TLT's rollout (PPO and GRPO alike, ``algorithm.adv_estimator``).

Why RayPPOTrainer and not the v1 trainers: in veRL 0.9.1 the v1 trainers (``trainer.use_v1=true``) need the
TransferQueue package, which veRL does not install, while RayPPOTrainer's ``fit`` is self-contained and runs
through the same agent loops and rollout replicas. Our rollout backend serves both.

Two rollouts: ``rollout.name=tlt`` (our backend, config ``tlt_ppo_trainer``) and ``rollout.name=vllm`` (veRL's vLLM
rollout serving our drafter as its EAGLE speculator, ``rollout_backend=vllm``; see :mod:`.vllm`).

What it adds, each in one overridden method:

* ``init_workers``: registers the ``tlt`` backend and checks the rollout's pieces;
* ``_compute_old_log_prob`` (vLLM): the actor's old-log-prob pass has fed the drafter (``drafter_worker``); it trains
  now for a budget proportional to the rollout, and the checkpoint manager pushes it after the next policy sync;
* ``_update_actor``: the step's ``tlt/*`` metrics (acceptance, idle time, drafter training) join veRL's;
* ``_save_checkpoint`` / ``_load_checkpoint``: the drafter (weights, optimizer, step) is saved in
  ``global_step_N/drafter`` and restored on resume, with the actor.
"""

from __future__ import annotations

import os
import time

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from .. import metric_names as metric
from ..online import after_rollout_budget
from .manager import TLTAgentLoopManager, find_servers
from .replica import BACKEND, register
from .settings import TLTSection
from .vllm import BACKEND as VLLM_BACKEND
from .vllm import configure_vllm_rollout, drafter_export_dir, drafter_trains, rollout_dtype

DRAFTER_DIR = "drafter"
ROLLOUTS = (BACKEND, VLLM_BACKEND)


def check_tlt_config(config: DictConfig) -> TLTSection:
    """The tlt: section, validated, and the veRL settings TLT depends on; each error names its fix."""
    tlt = TLTSection.from_mapping(config.get("tlt"))
    rollout = config.actor_rollout_ref.rollout
    if rollout.name not in ROLLOUTS:
        raise ValueError(f"TLTPPOTrainer needs actor_rollout_ref.rollout.name={BACKEND} (our rollout, the "
                         f"tlt_ppo_trainer config) or {VLLM_BACKEND} (veRL's vLLM rollout serving the drafter: "
                         f"rollout_backend=vllm); got {rollout.name!r}.")
    if config.trainer.get("use_v1", False):
        raise ValueError("TLTPPOTrainer subclasses RayPPOTrainer: set trainer.use_v1=false.")
    _copy_section(config, rollout, tlt)
    if rollout.name == VLLM_BACKEND:
        configure_vllm_rollout(config, tlt)
        return tlt
    parallel = (rollout.tensor_model_parallel_size, rollout.get("pipeline_model_parallel_size", 1),
                rollout.get("data_parallel_size", 1))
    if parallel != (1, 1, 1):
        raise ValueError(f"The tlt rollout runs the whole model in one server per replica: set actor_rollout_ref."
                         f"rollout.tensor_model_parallel_size=1 (and pipeline/data_parallel_size=1), got {parallel}.")
    manager = rollout.get("agent", {}).get("agent_loop_manager_class")
    if manager is None:
        raise ValueError("Set actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                         "tlt_trainers.verl.manager.TLTAgentLoopManager (drafter training in idle time).")
    return tlt


def _copy_section(config: DictConfig, rollout: DictConfig, tlt: TLTSection) -> None:
    """The rollout (servers, actor workers) sees only the rollout config: the tlt: section goes into its custom."""
    custom = rollout.get("custom") or {}
    if "tlt" not in custom:  # the rollout servers only see the rollout config
        with open_dict(config):
            rollout.custom = OmegaConf.merge(custom, {"tlt": tlt.to_dict()})
    elif TLTSection.from_mapping(custom["tlt"]) != tlt:
        raise ValueError("actor_rollout_ref.rollout.custom.tlt differs from the tlt: section; set only tlt: "
                         "(the config copies it with ${tlt}).")


class TLTPPOTrainer(RayPPOTrainer):
    """RayPPOTrainer whose rollout speculates losslessly and whose drafter trains in the rollout's idle time."""

    def __init__(self, config, *args, **kwargs):
        register()
        self.tlt = check_tlt_config(config)
        super().__init__(config, *args, **kwargs)

    @property
    def uses_vllm(self) -> bool:
        return self.config.actor_rollout_ref.rollout.name == VLLM_BACKEND

    def init_workers(self):
        super().init_workers()
        if self.uses_vllm:
            self._init_vllm()
            return
        if not isinstance(self.async_rollout_manager, TLTAgentLoopManager):
            raise TypeError(f"{type(self.async_rollout_manager).__name__} is not a TLTAgentLoopManager; set "
                            "actor_rollout_ref.rollout.agent.agent_loop_manager_class to it or a subclass.")

    # ---------------------------------------------------------------- vLLM rollout
    def _init_vllm(self) -> None:
        from .vllm_manager import TLTCheckpointEngineManager

        manager = self.checkpoint_manager
        if not isinstance(manager, TLTCheckpointEngineManager):
            raise TypeError(f"{type(manager).__name__} is not a TLTCheckpointEngineManager; set actor_rollout_ref."
                            "rollout.checkpoint_manager_class to it or a subclass (check_tlt_config does).")
        rollout = self.config.actor_rollout_ref.rollout
        manager.speculating = drafter_export_dir(rollout) is not None
        manager.dtype = rollout_dtype(self.config)
        # vLLM's sleep (level 2 for full weights) discards the drafter with the policy: push it after every sync then
        manager.weights_survive_sleep = not (rollout.get("enable_sleep_mode") and rollout.get("free_cache_engine"))
        self._tlt_drafter_metrics: dict[str, float] = {}

    def _compute_old_log_prob(self, batch):
        result = super()._compute_old_log_prob(batch)  # the actor's drafter has taken this rollout's features
        if self.uses_vllm and self.tlt.speculation != "never":
            self._train_drafter()
        return result

    def _train_drafter(self) -> None:
        """Train actor rank 0's drafter for drafter_update_fraction of the rollout (from the policy sync that
        preceded it to now), at most drafter_update_seconds, at least one micro-step; not at all when either is 0."""
        manager, tlt = self.checkpoint_manager, self.tlt
        rollout_seconds = time.perf_counter() - manager.last_sync_end if manager.last_sync_end else 0.0
        if not drafter_trains(tlt):
            self._tlt_drafter_metrics = {metric.ROLLOUT_SECONDS: rollout_seconds, metric.DRAFTER_STEPS: 0.0}
            return
        budget = after_rollout_budget(tlt, rollout_seconds)
        start = time.perf_counter()
        results = self.actor_rollout_wg.tlt_train_drafter(budget)
        result = next((r for r in results if r), {})
        nan = float("nan")
        self._tlt_drafter_metrics = {
            metric.ROLLOUT_SECONDS: rollout_seconds,
            metric.DRAFTER_UPDATE_SECONDS: time.perf_counter() - start,
            metric.DRAFTER_STEPS: float(result.get("steps", 0)),
            metric.DRAFTER_LOSS: float(result.get("loss", nan)),
            metric.DRAFTER_TOP1: float(result.get("top1", nan)),
            metric.DRAFTER_TOTAL_STEPS: float(result.get("total_steps", 0)),
            metric.DRAFTER_BUFFER_SEQUENCES: float(result.get("buffer_sequences", 0)),
        }

    def _vllm_metrics(self) -> dict[str, float]:
        manager = self.checkpoint_manager
        metrics, self._tlt_drafter_metrics = self._tlt_drafter_metrics, {}
        metrics.update({metric.SPECULATING: float(manager.speculating), metric.DRAFTER_PUSHES: float(manager.pushes),
                        metric.DRAFTER_PUSH_SECONDS: manager.last_push_seconds})
        counters = manager.spec_decode_counters() if manager.speculating else None
        if counters is not None:  # this step's rollout (and any validation since the last step)
            metrics.update({metric.ACCEPTANCE_LENGTH: counters.acceptance_length,
                            metric.DRAFT_TOKENS: float(counters.num_draft_tokens),
                            metric.ACCEPTED_TOKENS: float(counters.num_accepted_tokens)})
        return metrics

    # ---------------------------------------------------------------- metrics
    def _update_actor(self, batch):
        output = super()._update_actor(batch)
        metrics = self._vllm_metrics() if self.uses_vllm else self.async_rollout_manager.pop_metrics()
        output.meta_info["metrics"].update(metrics)
        return output

    # ---------------------------------------------------------------- checkpoints
    def _step_folder(self) -> str:
        return os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")

    def _save_checkpoint(self):
        super()._save_checkpoint()
        if self.uses_vllm:
            self.actor_rollout_wg.tlt_save_drafter(os.path.join(self._step_folder(), DRAFTER_DIR))
            return
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
            if self.uses_vllm:  # the first policy sync in fit() pushes it to vLLM
                restored = any(self.actor_rollout_wg.tlt_load_drafter(drafter))
            else:
                servers = find_servers()
                ray.get([s.load_drafter.remote(drafter) for s in servers])
                restored = bool(servers)
            if restored:
                print(f"TLT: drafter restored from {drafter}")
            else:
                print(f"TLT: the drafter in {drafter} was not restored: no drafter runs here (tlt.speculation=never)")
        else:
            print(f"TLT: no drafter in {folder}; the drafter starts as configured (tlt.drafter_name_or_path)")
        return result
