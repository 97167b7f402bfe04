"""What ``LLM(speculative_config=...)`` needs to serve an exported EagleDrafter, and the checks that it fits."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..drafter.base import Drafter
from ..drafter.config import CONFIG_NAME, WEIGHTS_NAME

EXTENSION = "tlt_trainers.vllm.worker.DrafterReloadExtension"

_EXPORT_HINT = (
    "Export the drafter with tlt_trainers.drafter.export.export_vllm(drafter, out_dir, policy) (default layout) "
    "or let VLLMDrafterSync export it."
)


def read_drafter_export(drafter_dir: str | os.PathLike) -> dict:
    """The config of a drafter export vLLM serves, checked: an :func:`~tlt_trainers.drafter.export.export_vllm`
    folder (default layout: one Llama decoder layer, ``method="eagle"``), an
    :func:`~tlt_trainers.drafter.export_eagle3.export_eagle3_vllm` folder (speculators EAGLE-3, ``method="eagle3"``;
    its ``transformer_layer_config`` is returned, with ``method`` added) or an
    :func:`~tlt_trainers.drafter.export_block.export_block_vllm` folder (DFlash, ``method="dflash"``)."""
    path = Path(drafter_dir)
    file = path / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"No {CONFIG_NAME} in {path}: not a drafter export. {_EXPORT_HINT}")
    config = json.loads(file.read_text())
    if config.get("architectures") == ["DFlashDraftModel"]:
        from ..drafter.export_block import MASK_EMBEDDING_NAME

        for name in (WEIGHTS_NAME, MASK_EMBEDDING_NAME):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path} has a DFlash {CONFIG_NAME} but no {name}: export the block drafter "
                                        "with drafter.export(dir, 'vllm', policy).")
        return {**config, "method": "dflash"}
    if config.get("speculators_model_type") == "eagle3":
        if not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"{path} has a {CONFIG_NAME} but no {WEIGHTS_NAME}. {_EXPORT_HINT}")
        return {**config["transformer_layer_config"], "method": "eagle3"}
    if "speculators_model_type" in config:
        raise ValueError(
            f"{path} is in the speculators layout, which vLLM reads only for eagle3 and newer types, not for the "
            f"EAGLE-1 drafter this is. {_EXPORT_HINT}"
        )
    if config.get("model_type") != "llama" or config.get("num_hidden_layers") != 1:
        raise ValueError(
            f"{path} is not a one-layer Llama EAGLE-1 export (model_type={config.get('model_type')!r}, "
            f"num_hidden_layers={config.get('num_hidden_layers')!r}). {_EXPORT_HINT}"
        )
    if not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{path} has a {CONFIG_NAME} but no {WEIGHTS_NAME}. {_EXPORT_HINT}")
    return {**config, "method": "eagle"}


def _read_policy_config(path: Path) -> dict:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"No {CONFIG_NAME} in {path}: pass the policy's folder, its model or its config.")
    config = json.loads(file.read_text())
    return config.get("text_config") or config


def policy_shape(policy: Any) -> tuple[int, int, str]:
    """(hidden_size, vocab_size, a name for messages) of a policy given as a model, a transformers config, a local
    folder, or a vLLM ``LLM``."""
    if isinstance(policy, nn.Module):
        config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
        head = policy.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else config.vocab_size
        return int(config.hidden_size), int(vocab), type(policy).__name__
    if isinstance(policy, (str, os.PathLike)):
        config = _read_policy_config(Path(policy))
        return int(config["hidden_size"]), int(config["vocab_size"]), str(policy)
    model_config = getattr(policy, "model_config", None)  # vllm.LLM, or an engine
    if model_config is not None and hasattr(model_config, "hf_text_config"):
        hf = model_config.hf_text_config
        return int(hf.hidden_size), int(hf.vocab_size), str(getattr(model_config, "model", "the engine's model"))
    config = policy.get_text_config() if hasattr(policy, "get_text_config") else policy
    if hasattr(config, "hidden_size") and hasattr(config, "vocab_size"):
        return int(config.hidden_size), int(config.vocab_size), type(config).__name__
    raise TypeError(f"Cannot read hidden_size/vocab_size from a {type(policy).__name__}: pass the policy's model, "
                    "config, local folder or vllm.LLM.")


def check_drafter_matches(drafter: Drafter | dict | str | os.PathLike, policy: Any) -> None:
    """Raise ValueError when ``drafter`` (a Drafter, an export folder or its config dict) was not made for
    ``policy``: vLLM feeds the drafter the policy's hidden states and embedding and reads its tokens through the
    policy's LM head, so hidden size and vocabulary must agree exactly."""
    if isinstance(drafter, Drafter):
        hidden, vocab, where = drafter.config.hidden_size, drafter.config.vocab_size, "The drafter"
    else:
        config = drafter if isinstance(drafter, dict) else read_drafter_export(drafter)
        hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
        where = "The drafter" if isinstance(drafter, dict) else f"The drafter at {drafter}"
    policy_hidden, policy_vocab, name = policy_shape(policy)
    fix = ("it was made for another model. Create one for this policy with EagleDrafter.from_target(policy) (or load "
           "the drafter trained for it) and export that.")
    if hidden != policy_hidden:
        raise ValueError(f"{where} has hidden_size={hidden} but the policy ({name}) has {policy_hidden}: {fix}")
    if vocab != policy_vocab:
        raise ValueError(f"{where} has vocab_size={vocab} but the policy ({name}) has {policy_vocab} tokens: {fix}")


def speculative_config(
    drafter_dir: str | os.PathLike,
    num_speculative_tokens: int = 3,
    *,
    policy: Any = None,
    **extra: Any,
) -> dict:
    """The dict for ``vllm.LLM(policy, speculative_config=...)`` that serves an exported drafter.

    ``drafter_dir``: an :func:`~tlt_trainers.drafter.export.export_vllm` folder (default layout: vLLM's
    ``method="eagle"`` loads it as ``EagleLlamaForCausalLM`` and shares the policy's embedding and LM head with it)
    or an :func:`~tlt_trainers.drafter.export_eagle3.export_eagle3_vllm` folder (``method="eagle3"``,
    ``Eagle3LlamaForCausalLM``, sharing the embedding).
    ``policy`` (optional: model, config, local folder or ``LLM``): checked to match the drafter's hidden size and
    vocabulary. ``extra``: any other SpeculativeConfig field of the installed vLLM (``draft_tensor_parallel_size``,
    ``max_model_len``, ...), passed through as given.
    """
    config = read_drafter_export(drafter_dir)
    if int(num_speculative_tokens) < 1:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1.")
    if policy is not None:
        check_drafter_matches(config, policy)
    for key in ("method", "model", "num_speculative_tokens"):
        if key in extra:
            raise TypeError(f"speculative_config() sets {key!r} itself.")
    return {"method": config["method"], "model": str(Path(drafter_dir)),
            "num_speculative_tokens": int(num_speculative_tokens), **extra}


def batch_size_schedule(num_speculative_tokens: int, max_speculative_batch_size: int | None,
                        max_batch_size: int = 1 << 16) -> list[tuple[int, int, int]] | None:
    """vLLM's ``num_speculative_tokens_per_batch_size`` for TLT's ``max_speculative_batch_size``: k drafts per step
    while at most that many requests run, none above (None: no cut-off, vLLM speculates at every batch size).

    Pass it as ``speculative_config(..., num_speculative_tokens_per_batch_size=schedule)`` (vLLM 0.31 and later).
    """
    if max_speculative_batch_size is None:
        return None
    cap, k = int(max_speculative_batch_size), int(num_speculative_tokens)
    if cap < 1 or k < 1:
        raise ValueError(f"max_speculative_batch_size={cap} and num_speculative_tokens={k} must be >= 1.")
    if cap >= max_batch_size:
        return [(1, max_batch_size, k)]
    return [(1, cap, k), (cap + 1, max_batch_size, 0)]


ADAPTIVE_SCHEDULER = "tlt_trainers.vllm.scheduler.AdaptiveSpeculationScheduler"
GUARD_SCHEDULER = "tlt_trainers.vllm.scheduler.SampledSpeculationGuardScheduler"
# The initial schedule's cut-off when none is set: with an adaptive schedule only CUDA-graph capture reads it (vLLM
# captures decode graphs for the draft lengths and batch sizes it contains), so it is where speculation is likely to
# pay on a GPU; the steps' lengths are chosen by the scheduler.
INITIAL_SPECULATIVE_BATCH_SIZE = 32
SPECULATION_MODES = ("adaptive", "always", "never")


def _vllm_on_cpu() -> bool:
    """Whether vLLM here runs on its CPU backend (False where vLLM does not import)."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # noqa: BLE001 (a broken vLLM install raises more than ImportError)
        return False
    return bool(current_platform.is_cpu())


def speculation_schedule(speculation: str, num_speculative_tokens: int,
                         max_speculative_batch_size: int | None = None, **settings: Any) -> tuple[dict, dict]:
    """How vLLM speculates under TLT's ``speculation`` setting: ``(speculative_config fields, LLM keyword
    arguments)``.

    * ``"adaptive"``: vLLM's dynamic speculative decoding with TLT's scheduler
      (:class:`~tlt_trainers.vllm.scheduler.AdaptiveSpeculationScheduler`), which chooses each step's draft length
      (``num_speculative_tokens`` or 0) per batch bucket from the running engine's measured step costs and live
      acceptance; ``max_speculative_batch_size`` caps it; ``settings``: other
      :class:`~tlt_trainers.vllm.schedule.SpeculationSettings` fields.
    * ``"always"``: ``num_speculative_tokens`` at every step, or up to ``max_speculative_batch_size`` running requests
      (vLLM's static schedule). On vLLM's CPU backend with TLT's guard
      (:class:`~tlt_trainers.vllm.scheduler.SampledSpeculationGuardScheduler`): steps with a sampled request stay
      plain if the engine's speculative sampling fails its check at start.
    * ``"never"``: raises; start the engine without a speculative config instead.
    """
    if speculation not in SPECULATION_MODES:
        raise ValueError(f"speculation={speculation!r} is not one of {SPECULATION_MODES}.")
    if speculation == "never":
        raise ValueError("speculation='never' runs vLLM without a speculative config; there is no schedule to build.")
    k = int(num_speculative_tokens)
    if speculation == "always":
        if _vllm_on_cpu():  # the guard needs a per-step length, which vLLM honours only with a schedule
            schedule = batch_size_schedule(k, max_speculative_batch_size or (1 << 16))
            return {"num_speculative_tokens_per_batch_size": schedule}, {"scheduler_cls": GUARD_SCHEDULER}
        schedule = batch_size_schedule(k, max_speculative_batch_size)
        return ({"num_speculative_tokens_per_batch_size": schedule} if schedule is not None else {}), {}
    from .schedule import SpeculationSettings

    SpeculationSettings(num_speculative_tokens=k, max_speculative_batch_size=max_speculative_batch_size,
                        **settings)  # errors at configuration time, not in the engine process
    initial = batch_size_schedule(k, max_speculative_batch_size or INITIAL_SPECULATIVE_BATCH_SIZE)
    tlt = {"num_speculative_tokens": k, "max_speculative_batch_size": max_speculative_batch_size, **settings}
    return ({"num_speculative_tokens_per_batch_size": initial},
            {"scheduler_cls": ADAPTIVE_SCHEDULER, "additional_config": {"tlt_speculation": tlt}})
