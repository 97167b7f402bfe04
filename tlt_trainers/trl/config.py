"""TLTGRPOConfig: TRL's GRPOConfig plus the settings of the speculative rollout and of the online drafter."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from types import SimpleNamespace

from trl import GRPOConfig

from ..config import SPECULATION_MODES, TLTConfig, check_trainer_settings


@dataclass
class TLTGRPOConfig(GRPOConfig):
    r"""Configuration of [`TLTGRPOTrainer`]: every [`trl.GRPOConfig`] field, plus the TLT fields below.

    A plain `GRPOConfig` works too: the trainer then uses these defaults.

    > Drafter

    Parameters:
        drafter_name_or_path (`str`, *optional*):
            Folder written by `EagleDrafter.save_pretrained` (or a Hub repo id) to start from. `None` creates a fresh
            drafter sized for the policy (`EagleDrafter.from_target`).
        draft_vocab_size (`int`, *optional*):
            Tokens the drafter proposes from (the most frequent ones seen). `None`: 4096 when the policy's vocabulary
            exceeds 8192 tokens, else the full vocabulary. `0`: the full vocabulary.
        drafter_warmup_prompts (`int`, *optional*, defaults to `0`):
            Before training, sample answers to this many prompts of the train dataset and fit the drafter to them
            (`warmup_drafter`). `0` skips the warm-up; the drafter then learns from the first rollouts.

    > Speculative rollout

    Parameters:
        speculation (`str`, *optional*, defaults to `"adaptive"`):
            `"adaptive"` speculates only while few rows are still decoding (the long tail), `"always"` at every step,
            `"never"` decodes one token per step with the same engine (no drafter is kept).
        num_speculative_tokens (`int`, *optional*):
            Fixed number of draft tokens per step; `None` lets the engine choose.
        max_speculative_batch_size (`int`, *optional*):
            With `speculation="adaptive"`, never speculate while more rows are active. `None` (default): the
            engine decides per step from costs measured on the device and the acceptance it observes.
        history_drafting (`bool`, *optional*, defaults to `True`):
            Also propose drafts from rollout history: finished completions of the same prompt (the GRPO group,
            and the same prompt in earlier steps) and the completion's own context. Exact like every draft.

    > Online drafter training

    Parameters:
        drafter_lr (`float`, *optional*, defaults to `3e-4`):
            AdamW learning rate of the drafter.
        drafter_unroll_steps (`int`, *optional*, defaults to `2`):
            Chained draft steps trained per position (1 = plain EAGLE loss).
        drafter_micro_batch_size (`int`, *optional*, defaults to `8`):
            Sequences per drafter micro-step.
        drafter_update_fraction (`float`, *optional*, defaults to `0.1`):
            Single-process runs (there is no idle time to use): drafter training after each rollout lasts this fraction
            of the rollout's time, at least one micro-step.
        drafter_update_seconds (`float`, *optional*, defaults to `30.0`):
            Single-process runs: most seconds of drafter training after each rollout.
        drafter_max_idle_seconds (`float`, *optional*, defaults to `120.0`):
            Multi-process runs: a rank that finished its rollout trains the drafter while it waits for slower ranks,
            for at most this many seconds.
        drafter_max_steps_per_update (`int`, *optional*):
            Cap on drafter micro-steps per update (`None`: only the time budgets apply).
        drafter_buffer_bytes (`int`, *optional*, defaults to `536870912`):
            Byte cap of the buffer of recent rollout hidden states the drafter trains on.
        drafter_warmup_seconds (`float`, *optional*, defaults to `120.0`):
            Training time of the warm-up (when `drafter_warmup_prompts > 0`).
    """

    drafter_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Drafter folder (EagleDrafter.save_pretrained) or Hub repo id to start from; None creates a "
                  "fresh drafter sized for the policy."},
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Tokens the drafter proposes from. None: 4096 when the policy's vocabulary exceeds 8192, "
                  "else the full vocabulary; 0: the full vocabulary."},
    )
    drafter_warmup_prompts: int = field(
        default=0,
        metadata={"help": "Warm the drafter up on answers to this many train-dataset prompts before training "
                  "(0: no warm-up)."},
    )
    drafter_warmup_seconds: float = field(
        default=120.0, metadata={"help": "Drafter training time of the warm-up."}
    )
    speculation: str = field(
        default="adaptive",
        metadata={"help": "'adaptive' speculates only while few rows are active (the long tail), 'always' at every "
                  "step, 'never' decodes without a drafter on the same engine.", "choices": list(SPECULATION_MODES)},
    )
    num_speculative_tokens: int | None = field(
        default=None, metadata={"help": "Fixed number of draft tokens per step; None lets the engine choose."}
    )
    max_speculative_batch_size: int | None = field(
        default=None,
        metadata={"help": "With speculation='adaptive', never speculate while more rows are active (None: decided "
                  "from costs measured on the device)."},
    )
    history_drafting: bool = field(
        default=True,
        metadata={"help": "Also propose drafts from rollout history: finished completions of the same prompt "
                  "(the GRPO group, and earlier steps) and the completion's own context. Exact like every draft."},
    )
    drafter_lr: float = field(default=3e-4, metadata={"help": "AdamW learning rate of the drafter."})
    drafter_unroll_steps: int = field(
        default=2, metadata={"help": "Chained draft steps trained per position (1 = plain EAGLE loss)."}
    )
    drafter_micro_batch_size: int = field(default=8, metadata={"help": "Sequences per drafter micro-step."})
    drafter_update_fraction: float = field(
        default=0.1,
        metadata={"help": "Single-process runs: drafter training after each rollout lasts this fraction of the "
                  "rollout's time (at least one micro-step), at most drafter_update_seconds."},
    )
    drafter_update_seconds: float = field(
        default=30.0,
        metadata={"help": "Single-process runs: most seconds of drafter training after each rollout."},
    )
    drafter_max_idle_seconds: float = field(
        default=120.0,
        metadata={"help": "Multi-process runs: most seconds a rank trains the drafter while waiting for slower ranks."},
    )
    drafter_max_steps_per_update: int | None = field(
        default=None, metadata={"help": "Cap on drafter micro-steps per update (None: time budgets only)."}
    )
    drafter_buffer_bytes: int = field(
        default=512 << 20, metadata={"help": "Byte cap of the drafter's buffer of rollout hidden states."}
    )

    def __post_init__(self):
        super().__post_init__()
        resolve_tlt_settings(self)


TLT_FIELDS = tuple(f.name for f in fields(TLTGRPOConfig) if f.name not in {g.name for g in fields(GRPOConfig)})


class TLTSettings(SimpleNamespace):
    """The TLT fields of a (TLT)GRPOConfig, with defaults filled in for a plain GRPOConfig; validated."""

    def tlt_config(self) -> TLTConfig:
        return TLTConfig(speculation=self.speculation, num_speculative_tokens=self.num_speculative_tokens,
                         max_speculative_batch_size=self.max_speculative_batch_size,
                         history=self.history_drafting)


def _default(name: str):
    spec = TLTGRPOConfig.__dataclass_fields__[name]
    return spec.default_factory() if spec.default is MISSING else spec.default


def resolve_tlt_settings(args) -> TLTSettings:
    """Read the TLT fields from ``args`` (defaults where a plain GRPOConfig lacks them) and check them."""
    values = {name: getattr(args, name, _default(name)) for name in TLT_FIELDS}
    check_trainer_settings(values)
    return TLTSettings(**values)
