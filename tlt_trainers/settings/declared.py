"""Every TLT setting, declared once: the drafter's and veRL's rollout servers' dataclasses (the engine's is
:class:`~tlt_trainers.config.TLTConfig`), which settings each trainer takes, and a trainer's settings as one object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..config import TLTConfig
from ..drafter.registry import kind_names
from .derive import check_settings, setting_fields, source_values, with_settings


@dataclass
class DrafterSettings:
    """The drafter a trainer starts from and how it trains it during RL (online) and before (warm-up)."""

    drafter_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Drafter to start from: a folder written by save_pretrained (or by `tlt warmup-drafter`), "
                  "a public drafter in another tool's layout (the EAGLE authors' EAGLE-1/EAGLE-3, SpecForge/SGLang, "
                  "the speculators library's, the TLT authors' RL drafters: docs/export_formats.md), or the Hub "
                  "repo id of either. None: the drafter shipped with tlt-trainers for this policy and "
                  "drafter_architecture where there is one (SmolLM2-135M-Instruct, however it was loaded: EAGLE-3 "
                  "for 'auto' and 'eagle3', a block drafter for 'block', none where the rollout serves EAGLE-1 only), "
                  "else a fresh drafter of "
                  "drafter_architecture sized for the policy, which learns from the rollouts. "
                  "'fresh': always a fresh drafter."},
    )
    drafter_architecture: str = field(
        default="auto",
        metadata={"help": "Architecture of a fresh drafter: 'eagle3' (reads a fusion of a low, a middle and a high "
                  "layer of the policy and predicts tokens with its own head: EAGLE-3), 'eagle' (reads the last "
                  "hidden state: EAGLE-1), or 'auto': EAGLE-3 where the policy has at least 6 layers and the "
                  "rollout engine serves it (TLT's engine, TRL's colocated vLLM; TRL's vLLM server mode and veRL's "
                  "vLLM rollout serve EAGLE-1), else EAGLE-1; 'block': a block drafter (DFlash: a whole block of "
                  "drafts from one pass over the policy's fused layers; TLT's engine, and TRL's colocated vLLM as "
                  "vLLM's 'dflash'). A loaded drafter keeps its own architecture."},
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "Tokens a fresh drafter proposes from, picked as the most frequent ones of the first "
                  "rollouts: a smaller output layer drafts faster and is learnt sooner. None: 4096 when the "
                  "policy's vocabulary exceeds 8192 tokens, else the full vocabulary; 0: the full vocabulary."},
    )
    drafter_rebuild_draft_vocab: bool = field(
        default=False,
        metadata={"help": "Re-pick a loaded drafter's draft vocabulary from the most frequent tokens of the first "
                  "rollouts, as for a fresh drafter (head rows of tokens it keeps stay trained). False: a drafter "
                  "loaded from drafter_name_or_path (ours, or a public EAGLE / EAGLE-3 / speculators checkpoint) "
                  "keeps the vocabulary it was published with."},
    )
    drafter_lr: float = field(
        default=3e-4, metadata={"help": "AdamW learning rate of the drafter's training during RL."}
    )
    drafter_unroll_steps: int = field(
        default=2,
        metadata={"help": "Chained draft steps trained per position: the drafter learns to continue from its own "
                  "drafts, as it does when proposing a chain (1: the plain EAGLE loss)."},
    )
    drafter_micro_batch_size: int = field(
        default=8, metadata={"help": "Sequences per drafter training micro-step."}
    )
    drafter_precision: str = field(
        default="auto",
        metadata={"help": "Drafter training precision: 'auto' (bfloat16 autocast where the device multiplies "
                  "bfloat16 natively: CUDA, CPUs with AVX512-BF16 or AMX; float32 elsewhere), 'bfloat16' or "
                  "'float32'. Weights and optimizer state stay float32."},
    )
    drafter_attention: str = field(
        default="auto",
        metadata={"help": "How EAGLE-3 drafter training lays out a micro-batch: 'packed' (sequences end to end, no "
                  "padding; flash-attn's variable-length attention on CUDA with `pip install \"tlt-trainers[flash]\"`, "
                  "a per-sequence torch loop elsewhere), 'padded', or 'auto' (packed, except on CUDA without "
                  "flash-attn). The loss is the same either way; EAGLE-1 drafters always train padded."},
    )
    drafter_update_fraction: float = field(
        default=0.1,
        metadata={"help": "When no rank or rollout replica had idle time to train in (a single one, or all "
                  "finished together), the drafter trains after each rollout for this fraction of the rollout's "
                  "time, at least one micro-step and at most drafter_update_seconds. 0 switches this off."},
    )
    drafter_update_seconds: float = field(
        default=30.0,
        metadata={"help": "Most seconds of drafter training after a rollout (see drafter_update_fraction): it "
                  "delays the policy update. 0 switches this off."},
    )
    drafter_update_budget: str = field(
        default="payback",
        metadata={"help": "How long the drafter trains after a rollout when no rank had idle time: 'payback' (where "
                  "the rollout measures what speculation saved, today TRL's colocated vLLM engine with "
                  "speculation='adaptive': training is paid from a credit of drafter_payback_share of the seconds "
                  "saved plus drafter_explore_share of the rollout's, within the fixed budget; see docs/vllm.md) or "
                  "'fixed' (drafter_update_fraction of every rollout)."},
    )
    drafter_payback_share: float = field(
        default=0.5,
        metadata={"help": "With drafter_update_budget='payback': seconds of drafter training bought by each second "
                  "speculation saved in the rollouts."},
    )
    drafter_explore_share: float = field(
        default=0.02,
        metadata={"help": "With drafter_update_budget='payback': share of each rollout's seconds spent training the "
                  "drafter whatever speculation saved, so that a drafter that does not pay yet can start to."},
    )
    drafter_max_idle_seconds: float = field(
        default=120.0,
        metadata={"help": "With several ranks (TRL) or rollout replicas (veRL), one that has finished its share "
                  "of a rollout trains the drafter while the others still generate, for at most this many "
                  "seconds: the time would otherwise be spent waiting. 0 switches this off."},
    )
    drafter_max_steps_per_update: int | None = field(
        default=None,
        metadata={"help": "Most drafter micro-steps per update (0: no training during RL). None: only the time "
                  "budgets above apply."},
    )
    drafter_buffer_bytes: int = field(
        default=512 << 20,
        metadata={"help": "Byte cap of the buffer of recent rollouts (tokens and the policy's hidden states) the "
                  "drafter trains on; the oldest sequences are dropped first, so the drafter follows the policy."},
    )
    drafter_targets: str = field(
        default="auto",
        metadata={"help": "What an EAGLE-3 drafter learns from each rollout of TLT's engine (TRL's trainer, veRL's "
                  "tlt rollout): 'law' (one no-grad policy forward over the finished rollouts, a prefill's cost, "
                  "gives the policy's next-token law, its top 16, as the targets), 'sampled' (the features the "
                  "engine's passes computed anyway, no extra forward, and the one token the policy sampled as the "
                  "target, which at temperature 1 the drafter memorises instead of learning the law from), 'auto' "
                  "('law' where the drafter's loss reads it, EAGLE-3; EAGLE-1 drafters learn the law from the "
                  "policy's features and block drafters the sampled tokens either way, so they take 'sampled'). "
                  "Rollouts TLT's engine does not make always go through a forward: TRL's vLLM or stock generation, "
                  "and veRL's vLLM rollout, whose EAGLE-1 drafter learns from the actor's old-log-prob pass."},
    )
    drafter_warmup_prompts: int = field(
        default=0,
        metadata={"help": "Before RL starts, sample the policy's answers to this many prompts of the train dataset "
                  "and fit the drafter to them, so that drafts are accepted from the first steps. 0: no warm-up; "
                  "the drafter learns from the first rollouts."},
    )
    drafter_warmup_seconds: float = field(
        default=120.0, metadata={"help": "Training time of the drafter warm-up."}
    )
    drafter_warmup_lr: float = field(
        default=1e-3,
        metadata={"help": "AdamW learning rate of the drafter warm-up, decayed along a cosine to a tenth of it "
                  "over drafter_warmup_seconds (the shipped drafters' recipe): higher than drafter_lr, since the "
                  "warm-up trains a drafter far from the policy on a fixed set of answers."},
    )

    def __post_init__(self) -> None:
        if self.drafter_architecture != "auto" and self.drafter_architecture not in kind_names():
            raise ValueError(f"drafter_architecture={self.drafter_architecture!r}: choose one of "
                             f"{('auto', *kind_names())}.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be None (automatic), 0 (the full "
                             "vocabulary) or a positive size.")
        for name in ("drafter_lr", "drafter_warmup_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0.")
        for name in ("drafter_unroll_steps", "drafter_micro_batch_size", "drafter_buffer_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if self.drafter_update_budget not in ("payback", "fixed"):
            raise ValueError(f"drafter_update_budget={self.drafter_update_budget!r}: choose 'payback' (training paid "
                             "from what speculation saved) or 'fixed' (drafter_update_fraction of every rollout).")
        for name in ("drafter_update_fraction", "drafter_update_seconds", "drafter_max_idle_seconds",
                     "drafter_warmup_seconds", "drafter_payback_share", "drafter_explore_share"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 switches that training off).")
        if self.drafter_precision not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"drafter_precision={self.drafter_precision!r}: choose 'auto', 'float32' or 'bfloat16'.")
        if self.drafter_attention not in ("auto", "packed", "padded"):
            raise ValueError(f"drafter_attention={self.drafter_attention!r}: choose 'auto', 'packed' or 'padded'.")
        if self.drafter_max_steps_per_update is not None and self.drafter_max_steps_per_update < 0:
            raise ValueError(f"drafter_max_steps_per_update={self.drafter_max_steps_per_update} must be >= 0 or "
                             "None (time budgets only).")
        if self.drafter_targets not in ("auto", "law", "sampled"):
            raise ValueError(f"drafter_targets={self.drafter_targets!r}: choose 'auto', 'law' (the policy's "
                             "next-token law, one forward per rollout) or 'sampled' (the sampled tokens).")
        if self.drafter_warmup_prompts < 0:
            raise ValueError(f"drafter_warmup_prompts={self.drafter_warmup_prompts} must be >= 0 (0: no warm-up).")


ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class RolloutServerSettings:
    """veRL's rollout servers (one per replica). TRL's trainer generates in its own processes and uses its own
    settings for these (``seed``, the accelerator's device, the model's dtype)."""

    batch_wait_ms: float = field(
        default=20.0,
        metadata={"help": "A rollout server gathers the requests that arrive within this many milliseconds into "
                  "one batch: veRL's agent loops send requests one by one, and rows decoded together share each "
                  "forward pass."},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Policy dtype in the rollout server: 'auto' (float32 on CPU, bfloat16 on CUDA), "
                  "'float32', 'bfloat16' or 'float16'.", "choices": list(ROLLOUT_DTYPES)},
    )
    device: str = field(
        default="auto",
        metadata={"help": "Device of the rollout server: 'auto' takes cuda when available, else cpu; or a torch "
                  "device such as 'cuda:1'."},
    )
    seed: int = field(
        default=0,
        metadata={"help": "Seed of the rollout sampling (replica r uses seed + r) and of a fresh drafter, the same "
                  "on every replica."},
    )

    def __post_init__(self) -> None:
        if self.batch_wait_ms < 0:
            raise ValueError(f"tlt.batch_wait_ms={self.batch_wait_ms} must be >= 0.")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"tlt.dtype={self.dtype!r} must be one of {', '.join(ROLLOUT_DTYPES)}.")


# Settings only TRL's trainer has: veRL's rollout servers start from a saved drafter instead of warming one up.
TRL_ONLY = ("drafter_warmup_prompts", "drafter_warmup_seconds", "drafter_warmup_lr")
TRAINER_SETTINGS = (TLTConfig, DrafterSettings)  # TLTGRPOConfig's settings
VERL_SETTINGS = (TLTConfig, DrafterSettings, RolloutServerSettings)  # the tlt: section's (less TRL_ONLY)



def _names(cls: type) -> list[str]:
    return [name for name, _, _ in setting_fields(*cls._tlt_sources, exclude=cls._tlt_excluded)]


@dataclass
@with_settings(*TRAINER_SETTINGS)
class TLTSettings:
    """The TLT settings of a trainer (engine and drafter), read from a TLTGRPOConfig, a plain GRPOConfig (TLT
    defaults) or any object with these attributes; checked on construction."""

    def __post_init__(self) -> None:
        check_settings(self)

    @classmethod
    def from_object(cls, obj: Any) -> TLTSettings:
        """The settings ``obj`` has as attributes; the defaults for those it lacks."""
        return cls(**{name: getattr(obj, name) for name in _names(cls) if hasattr(obj, name)})

    def tlt_config(self) -> TLTConfig:
        """The engine's settings."""
        return TLTConfig(**source_values(self, TLTConfig))

    def drafter_settings(self) -> DrafterSettings:
        return DrafterSettings(**source_values(self, DrafterSettings))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
