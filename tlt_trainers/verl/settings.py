"""The ``tlt:`` section of a veRL config: the same knobs as TLTGRPOConfig, checked the same way.

veRL passes it to the rollout servers inside ``actor_rollout_ref.rollout.custom.tlt`` (the rollout
config's extension point), so only plain values live here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..config import TLTConfig, check_trainer_settings


@dataclass
class TLTSection:
    """TLT settings for veRL. Field names and meanings match :class:`tlt_trainers.TLTGRPOConfig`."""

    speculation: str = "adaptive"
    num_speculative_tokens: int | None = None
    max_speculative_batch_size: int | None = None
    history_drafting: bool = True
    drafter_name_or_path: str | None = None
    draft_vocab_size: int | None = None
    drafter_lr: float = 3e-4
    drafter_unroll_steps: int = 2
    drafter_micro_batch_size: int = 8
    # No rollout replica was idle (one replica, or all finished together): train this long after the rollout,
    # as a fraction of the rollout's time, at most drafter_update_seconds.
    drafter_update_fraction: float = 0.1
    drafter_update_seconds: float = 30.0
    drafter_max_idle_seconds: float = 120.0  # most seconds an idle replica trains while others still generate
    drafter_max_steps_per_update: int | None = None
    drafter_buffer_bytes: int = 512 << 20
    batch_wait_ms: float = 20.0  # a server gathers requests this long before starting a batch
    dtype: str = "auto"  # policy dtype in the rollout server: auto (float32 on CPU, bfloat16 on CUDA), float32, ...
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0

    def __post_init__(self):
        check_trainer_settings(asdict(self))
        if self.batch_wait_ms < 0:
            raise ValueError(f"tlt.batch_wait_ms={self.batch_wait_ms} must be >= 0.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"tlt.dtype={self.dtype!r} must be one of auto, float32, bfloat16, float16.")

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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown key(s) in the tlt: section: {unknown}. Known keys: {sorted(known)}.")
        return cls(**values)

    def tlt_config(self) -> TLTConfig:
        return TLTConfig(speculation=self.speculation, num_speculative_tokens=self.num_speculative_tokens,
                         max_speculative_batch_size=self.max_speculative_batch_size, history=self.history_drafting)

    def to_dict(self) -> dict:
        return asdict(self)
