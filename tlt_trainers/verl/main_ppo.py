"""veRL's PPO/GRPO entry point with TLT: ``python -m tlt_trainers.verl.main_ppo <hydra overrides>``.

The config is ``tlt_ppo_trainer.yaml`` next to this module: veRL's ``ppo_trainer`` (found through the
installed package) with the ``tlt`` rollout backend and a ``tlt:`` section. Everything else is veRL's
own flow: ``run_ppo`` starts Ray and a task runner, which builds the workers and calls ``fit``.
"""

from __future__ import annotations

import hydra
import ray
from verl.trainer import main_ppo_v0
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from .replica import register
from .trainer import TLTPPOTrainer, check_tlt_config


class _TLTTaskRunner(main_ppo_v0.TaskRunner.__ray_actor_class__):
    """veRL's task runner, building a TLTPPOTrainer. It constructs ``RayPPOTrainer`` by its module-level name,
    so inside this (dedicated) actor process that name is pointed at our subclass before the run."""

    def run(self, config):
        register()
        main_ppo_v0.RayPPOTrainer = TLTPPOTrainer
        return super().run(config)


TLTTaskRunner = ray.remote(num_cpus=1)(_TLTTaskRunner)


def run(config) -> None:
    """Validate and train: the body of ``main``, callable from Python with a composed config."""
    auto_set_device(config)
    check_tlt_config(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=TLTTaskRunner)


@hydra.main(config_path="config", config_name="tlt_ppo_trainer", version_base=None)
def main(config) -> None:
    run(config)


if __name__ == "__main__":
    main()
