"""veRL's PPO/GRPO entry point with TLT: ``python -m tlt_trainers.verl.main_ppo <hydra overrides>``.

The config is ``tlt_ppo_trainer.yaml`` next to this module: veRL's ``ppo_trainer`` (found through the
installed package) with the ``tlt`` rollout backend and a ``tlt:`` section. Everything else is veRL's
own flow: ``run_ppo`` starts Ray and a task runner, which builds the workers and calls ``fit``.
"""

from __future__ import annotations

import os

import hydra
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from .task_runner import TLTTaskRunner
from .trainer import check_tlt_config


def use_cpu_platform(config) -> None:
    """``trainer.device=cpu``: select veRL's cpu platform here and, through the environment they inherit, in the
    Ray workers (tlt_trainers.verl.cpu_platform)."""
    from verl.plugin.platform.platform_manager import get_platform, set_platform

    from .cpu_platform import CPUPlatform, install

    if config.actor_rollout_ref.actor.strategy == "fsdp":
        raise ValueError("On CPU the actor needs actor_rollout_ref.actor.strategy=fsdp2 (FSDP1 requires an "
                         "accelerator); the tlt_ppo_trainer_cpu config sets it.")
    os.environ["VERL_PLATFORM"] = "cpu"
    install()
    if get_platform().device_name != "cpu":
        set_platform(CPUPlatform())


def run(config) -> None:
    """Validate and train: the body of ``main``, callable from Python with a composed config."""
    if config.trainer.get("device") == "cpu":
        use_cpu_platform(config)
    auto_set_device(config)
    check_tlt_config(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=TLTTaskRunner)


@hydra.main(config_path="config", config_name="tlt_ppo_trainer", version_base=None)
def main(config) -> None:
    run(config)


if __name__ == "__main__":
    main()
