"""TLTGRPOConfig: TRL's GRPOConfig plus the settings of the speculative rollout and of the drafter.

The TLT fields are not declared here: they are generated from :class:`~tlt_trainers.config.TLTConfig` (the engine)
and :class:`~tlt_trainers.settings.DrafterSettings`, with their names, defaults, help and checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trl import GRPOConfig

from ..settings import TRAINER_SETTINGS, TLTSettings, parameters_doc, with_settings


@dataclass
@with_settings(*TRAINER_SETTINGS)
class TLTGRPOConfig(GRPOConfig):
    def __post_init__(self):
        super().__post_init__()
        resolve_tlt_settings(self)


TLTGRPOConfig.__doc__ = (
    "Configuration of [`TLTGRPOTrainer`]: every [`trl.GRPOConfig`] field, plus the TLT settings below.\n\n"
    "    A plain `GRPOConfig` works too: the trainer then uses these defaults. The settings are generated from\n"
    "    [`TLTConfig`] (the speculative rollout engine) and `DrafterSettings`; docs/settings.md lists them all.\n\n"
    + parameters_doc(TRAINER_SETTINGS, indent="    ")
)

TLT_FIELDS = tuple(f.name for f in dataclasses.fields(TLTGRPOConfig)
                   if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)})


def resolve_tlt_settings(args) -> TLTSettings:
    """Read the TLT settings from ``args`` (defaults where a plain GRPOConfig lacks them) and check them.

    ``.tlt_config()`` of the result is the engine's :class:`~tlt_trainers.config.TLTConfig`."""
    return TLTSettings.from_object(args)


__all__ = ["TLTGRPOConfig", "TLTSettings", "TLT_FIELDS", "resolve_tlt_settings"]
