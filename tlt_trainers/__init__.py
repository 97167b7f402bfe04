"""tlt-trainers: lossless adaptive speculative rollouts for RL post-training (TLT, ASPLOS 2026).

``import tlt_trainers`` needs only torch and transformers; the TRL and veRL adapters import
lazily, on first use of their names.
"""

from __future__ import annotations

import importlib

from . import kinds  # noqa: F401  (registers the built-in drafter kinds)
from .config import TLTConfig
from .drafter import BlockDrafter, Drafter, Eagle3Drafter, EagleDrafter, EagleDrafterConfig
from .rollout import GenerationResult, GenerationStats, SpeculativeGenerator
from .rollout.cost_cache import package_version as _package_version

__version__ = _package_version()  # from the package metadata: pyproject.toml is the one place it is written

_LAZY = {
    "DrafterTrainer": "tlt_trainers.drafter.trainer",
    "TLTGRPOConfig": "tlt_trainers.trl",
    "TLTGRPOTrainer": "tlt_trainers.trl",
    "TLTPPOTrainer": "tlt_trainers.verl",
}

__all__ = [
    "TLTConfig",
    "Drafter",
    "EagleDrafter",
    "Eagle3Drafter",
    "BlockDrafter",
    "EagleDrafterConfig",
    "SpeculativeGenerator",
    "GenerationResult",
    "GenerationStats",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tlt_trainers' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:
        raise ImportError(
            f"tlt_trainers.{name} cannot be imported ({err}). The TRL adapter needs "
            "`pip install tlt-trainers[trl]`; the veRL adapter needs `pip install tlt-trainers[verl]`."
        ) from err
