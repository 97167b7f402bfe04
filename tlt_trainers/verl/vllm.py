"""veRL's vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) with TLT's drafter: the rollout's settings.

:func:`configure_vllm_rollout` runs in ``check_tlt_config`` (driver, before Ray starts) and completes the rollout
config (``rollout_backend=vllm``, ``config/rollout_backend/vllm.yaml``, selects it):

* the vLLM worker extension (:class:`~.vllm_worker.TLTColocateExtension`: veRL's policy sync plus TLT's drafter
  reload) and the checkpoint manager that pushes the drafter after every policy sync
  (:class:`~.vllm_manager.TLTCheckpointEngineManager`);
* where TLT speculates, vLLM's EAGLE speculative config pointing at ``<trainer.default_local_dir>/tlt_vllm_drafter``,
  which actor rank 0 writes in ``init_model`` (before veRL launches the vLLM servers) and whose weights the first
  push replaces (veRL starts vLLM with ``load_format=dummy``);
* with ``tlt.speculation=adaptive`` (the default) vLLM's dynamic speculative decoding with TLT's scheduler
  (``scheduler_cls``, ``additional_config.tlt_speculation``: :func:`~tlt_trainers.vllm.config.speculation_schedule`),
  which chooses each step's draft length per batch bucket from the server's measured step costs and acceptance;
  ``always`` drafts at every step (up to ``tlt.max_speculative_batch_size``);
* on the cpu platform, the CPU settings (:mod:`.vllm_cpu`). Speculative sampling at temperature > 0 is exact there
  through TLT's vLLM plugin (:mod:`tlt_trainers.vllm.cpu_sampling_fix`), which every vLLM process of the rollout
  loads.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from omegaconf import DictConfig, open_dict

from ..online import trains_after_rollout
from ..vllm.config import speculation_schedule
from .settings import TLTSection

logger = logging.getLogger(__name__)

BACKEND = "vllm"
EXPORT_DIR = "tlt_vllm_drafter"
# by name: those modules import veRL's vLLM rollout (and vLLM), which this module, read before Ray starts, must not
EXTENSION = "tlt_trainers.verl.vllm_worker.TLTColocateExtension"
MANAGER = "tlt_trainers.verl.vllm_manager.TLTCheckpointEngineManager"
FSDP_STRATEGIES = ("fsdp", "fsdp2")

def num_speculative_tokens(section: TLTSection) -> int:
    """Draft tokens per vLLM step: tlt.num_speculative_tokens, else tlt.default_num_speculative_tokens."""
    return int(section.num_speculative_tokens or section.default_num_speculative_tokens)


def drafter_trains(section: TLTSection) -> bool:
    """Whether the drafter trains during RL: tlt.speculation, drafter_update_seconds, drafter_update_fraction and
    drafter_max_steps_per_update all leave it on (0 switches each off)."""
    return section.speculation != "never" and trains_after_rollout(section)


def drafter_export_dir(rollout: Any) -> str | None:
    """The folder vLLM loads the drafter from at start-up, or None when the rollout does not speculate with it."""
    spec = ((rollout.get("engine_kwargs") or {}).get(BACKEND) or {}).get("speculative_config")
    if not spec or spec.get("method") != "eagle" or os.path.basename(str(spec.get("model", ""))) != EXPORT_DIR:
        return None
    return str(spec["model"])


def speculates(config: DictConfig, section: TLTSection) -> bool:
    """Whether vLLM serves the drafter: unless tlt.speculation=never."""
    return section.speculation != "never"


def configure_vllm_rollout(config: DictConfig, section: TLTSection) -> None:
    """Complete ``actor_rollout_ref.rollout`` for vLLM with TLT (idempotent); errors name their fix."""
    rollout = config.actor_rollout_ref.rollout
    manager = rollout.get("agent", {}).get("agent_loop_manager_class")
    if manager and manager.endswith("TLTAgentLoopManager"):
        raise ValueError("TLTAgentLoopManager drives the tlt rollout backend; with rollout.name=vllm set "
                         "actor_rollout_ref.rollout.agent.agent_loop_manager_class=null (rollout_backend=vllm "
                         "does).")
    checkpoint_manager = rollout.get("checkpoint_manager_class")
    if checkpoint_manager is not None and not _subclass_of(checkpoint_manager, MANAGER):
        raise ValueError(f"actor_rollout_ref.rollout.checkpoint_manager_class={checkpoint_manager!r}: TLT pushes the "
                         f"drafter to vLLM from its own manager; set it to {MANAGER} (or subclass that).")
    with open_dict(config):
        engine = rollout.get("engine_kwargs")
        if engine is None:
            rollout.engine_kwargs = {}
        if rollout.engine_kwargs.get(BACKEND) is None:
            rollout.engine_kwargs[BACKEND] = {}
        kwargs = rollout.engine_kwargs[BACKEND]
        extension = kwargs.get("worker_extension_cls")
        if extension is not None and not _subclass_of(extension, EXTENSION):
            raise ValueError(f"engine_kwargs.vllm.worker_extension_cls={extension!r}: TLT needs its own extension "
                             f"(veRL's plus the drafter reload): set it to {EXTENSION} or subclass that.")
        kwargs.worker_extension_cls = extension or EXTENSION
        rollout.checkpoint_manager_class = checkpoint_manager or MANAGER
        spec = kwargs.get("speculative_config")
        ours = drafter_export_dir(rollout) is not None
        if spec and not ours:
            raise ValueError("engine_kwargs.vllm.speculative_config is set: TLT serves its own drafter and builds "
                             "that config itself; remove it (the drafter starts from tlt.drafter_name_or_path).")
        if config.trainer.get("device") == "cpu":
            for change in _cpu_changes(rollout):
                logger.warning("TLT on CPU: %s", change)
        ulysses = max(int(config.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1),
                      int((config.actor_rollout_ref.actor.get("fsdp_config") or {}).get(
                          "ulysses_sequence_parallel_size", 1) or 1))
        if ulysses > 1 and section.speculation != "never":
            raise ValueError("The drafter learns from whole sequences of the actor's old-log-prob pass, which Ulysses "
                             "sequence parallelism splits across ranks: set actor_rollout_ref.actor."
                             "ulysses_sequence_parallel_size=1, or tlt.speculation=never (no drafter).")
        strategy = config.actor_rollout_ref.actor.get("strategy")
        if strategy not in FSDP_STRATEGIES and section.speculation != "never":
            raise ValueError(f"actor_rollout_ref.actor.strategy={strategy!r}: TLT's drafter reads the policy's hidden "
                             "states from an FSDP actor's decoder (strategy=fsdp or fsdp2); use one of those, or set "
                             "tlt.speculation=never (no drafter).")
        correction = config.get("algorithm", {}).get("rollout_correction") or {}
        if correction.get("bypass_mode", False) and drafter_trains(section):
            raise ValueError("algorithm.rollout_correction.bypass_mode=true takes the rollout's log-probabilities as "
                             "the old ones and skips the actor's old-log-prob pass, the pass TLT's drafter learns "
                             "from: set algorithm.rollout_correction.bypass_mode=false, or tlt.speculation=never (no "
                             "drafter), or tlt.drafter_update_seconds=0 (vLLM keeps the drafter it starts with).")
        if speculates(config, section):
            if rollout.get("tensor_model_parallel_size", 1) != 1:
                raise ValueError("TLT reloads its one-layer drafter whole in every vLLM worker: set actor_rollout_ref."
                                 "rollout.tensor_model_parallel_size=1 (or tlt.speculation=never).")
            k = num_speculative_tokens(section)
            out = os.path.join(os.path.abspath(str(config.trainer.default_local_dir)), EXPORT_DIR)
            settings = {"cost_cache": section.cost_cache} if section.speculation == "adaptive" else {}
            spec_extra, engine_extra = speculation_schedule(section.speculation, k, section.max_speculative_batch_size,
                                                            **settings)
            spec = {"method": "eagle", "model": out, "num_speculative_tokens": k}
            if spec_extra.get("num_speculative_tokens_per_batch_size") is not None:
                spec["num_speculative_tokens_per_batch_size"] = [
                    list(row) for row in spec_extra["num_speculative_tokens_per_batch_size"]]
            kwargs.speculative_config = spec
            for key, value in engine_extra.items():
                kwargs[key] = value
            kwargs.disable_log_stats = False  # vLLM's spec-decode counters
        elif ours:
            kwargs.speculative_config = None


def _subclass_of(name: str, base: str) -> bool:
    """Whether the class named ``name`` (module.Class) is ``base`` or a subclass of it (False if it does not load)."""
    if name == base:
        return True
    from verl.utils.import_utils import load_class_from_fqn

    try:
        return issubclass(load_class_from_fqn(name, "class"), load_class_from_fqn(base, "class"))
    except Exception:  # noqa: BLE001 (a name that does not load is not ours)
        return False


def _cpu_changes(rollout) -> list[str]:
    from .vllm_cpu import cpu_rollout_overrides

    return cpu_rollout_overrides(rollout)


def rollout_dtype(config: DictConfig) -> str | None:
    """The vLLM rollout's dtype (``actor_rollout_ref.rollout.dtype``), the dtype of the drafter tensors pushed to it."""
    value = config.actor_rollout_ref.rollout.get("dtype")
    return str(value) if value is not None else None


def vllm_engine_kwargs(drafter, out_dir: str | os.PathLike, policy=None, num_speculative_tokens: int = 3) -> dict:
    """A static drafter for a plain veRL vLLM rollout (no TLT trainer): export ``drafter`` where vLLM's EAGLE loader
    reads it and return ``engine_kwargs.vllm`` that points at it. vLLM keeps these weights (dummy ones with veRL's
    default ``load_format=dummy``): TLTPPOTrainer with rollout_backend=vllm trains and pushes the drafter."""
    from ..drafter.export import export_vllm
    from ..vllm.config import speculative_config

    path = export_vllm(drafter, out_dir, policy, num_speculative_tokens=num_speculative_tokens)
    return {"speculative_config": speculative_config(path, num_speculative_tokens)}
