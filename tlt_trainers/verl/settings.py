"""The ``tlt:`` section of a veRL config: the same settings as TLTGRPOConfig, with the same names and checks.

Its fields are generated from :class:`~tlt_trainers.config.TLTConfig` (the engine),
:class:`~tlt_trainers.settings.DrafterSettings` (less the warm-up, TRL's only) and
:class:`~tlt_trainers.settings.RolloutServerSettings`; the YAML's ``tlt:`` block is generated from them too
(``python -m tlt_trainers.settings``). veRL passes the section to the rollout servers inside
``actor_rollout_ref.rollout.custom.tlt`` (the rollout config's extension point), so only plain values live here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import TLTConfig
from ..settings import TRL_ONLY, VERL_SETTINGS, DrafterSettings, check_settings, source_values, with_settings


@dataclass
@with_settings(*VERL_SETTINGS, exclude=TRL_ONLY)
class TLTSection:
    """TLT settings for veRL. Names, defaults and meanings match :class:`tlt_trainers.TLTGRPOConfig`'s."""

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_mapping(cls, values: Any) -> TLTSection:
        """Build from a dict or DictConfig; an unknown key is an error that lists the known ones."""
        if values is None:
            return cls()
        if isinstance(values, TLTSection):
            return values
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(values, DictConfig):
                values = OmegaConf.to_container(values, resolve=True)
        except ImportError:  # plain dicts need no omegaconf
            pass
        values = dict(values)
        trl_only = sorted(set(values) & set(TRL_ONLY))
        if trl_only:
            raise ValueError(f"{trl_only} in the tlt: section: the drafter warm-up is TLTGRPOTrainer's only. veRL's "
                             "rollout servers start from a saved drafter: run `tlt warmup-drafter --model ... --out "
                             "DIR` and set tlt.drafter_name_or_path=DIR.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown key(s) in the tlt: section: {unknown}. Known keys: {sorted(known)}.")
        return cls(**values)

    def tlt_config(self) -> TLTConfig:
        """The engine's settings."""
        return TLTConfig(**source_values(self, TLTConfig))

    def drafter_settings(self) -> DrafterSettings:
        return DrafterSettings(**source_values(self, DrafterSettings))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
