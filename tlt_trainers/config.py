"""Settings of the speculative rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec.strategy import Strategy, parse_strategy

SPECULATION_MODES = ("adaptive", "always", "never")
# Chains for sampling (a drafter's q is used, not only its top choices), trees for confident drafters. A chain of
# one is the CPU's arm: verifying a second token per row costs next to nothing at batch 1 there, a third does not.
DEFAULT_STRATEGIES = ("chain:1", "chain:2", "chain:4", "tree:4x2:8", "tree:6x4:16", "tree:8x4:32", "tree:8x4:48")
# Proposals from rollout history: alone (no drafter compute) and as one more branch of a drafter tree.
DEFAULT_HISTORY_STRATEGIES = ("history:8", "tree:6x4:16+history:8")


@dataclass
class TLTConfig:
    """How the rollout engine speculates.

    The defaults are safe for any model: speculation is used only where it is expected to pay
    (small active batches) and the draft length stays short.
    """

    speculation: str = field(
        default="adaptive",
        metadata={"help": "'adaptive' speculates only while the active batch is small, 'always' at every step, "
                  "'never' decodes one token per step with the same engine (the baseline)."},
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata={"help": "Fixed chain length k. None lets the engine choose (default_num_speculative_tokens)."},
    )
    default_num_speculative_tokens: int = field(
        default=4, metadata={"help": "Chain length used when num_speculative_tokens is not fixed."}
    )
    max_speculative_batch_size: int | None = field(
        default=None,
        metadata={"help": "With speculation='adaptive', never speculate while more rows than this are active. None "
                  "(default): decided from measured costs on the device in use."},
    )
    strategy: str | None = field(
        default=None,
        metadata={"help": "With speculation='always', the strategy of every step: 'chain:K' or 'tree:DxW:N' "
                  "(default: a chain of num_speculative_tokens or default_num_speculative_tokens)."},
    )
    strategies: tuple[str, ...] | None = field(
        default=None,
        metadata={"help": "With speculation='adaptive', the strategies the selector chooses among besides plain "
                  f"decoding (default: {', '.join(DEFAULT_STRATEGIES)}; only the fixed chain when "
                  "num_speculative_tokens is set)."},
    )
    history: bool = field(
        default=True,
        metadata={"help": "Propose draft tokens from rollout history (finished siblings of the same prompt, earlier "
                  "steps' rollouts, the row's own context) as extra strategies; exact like every proposal."},
    )
    history_max_tokens: int = field(
        default=500_000, metadata={"help": "Tokens of rollout history kept (oldest evicted first)."}
    )
    history_keep_steps: int = field(
        default=4, metadata={"help": "generate() calls (RL steps) whose rollouts stay in the history."}
    )
    min_speedup: float = field(
        default=1.25,
        metadata={"help": "The adaptive selector speculates only where it expects at least this speedup over plain "
                  "decoding per step: smaller predicted gains are within the noise of its estimates (step times on a "
                  "busy CPU vary by 10-15%), and a per-step gain does not see that speculation spreads the rows' "
                  "finishing steps (the steps after the first rows finish cost nearly as much on a CPU). Where "
                  "speculation really pays (the tail on a GPU, long history matches) it pays far more."},
    )
    cuda_graphs: str = field(
        default="auto",
        metadata={"help": "'auto': replay CUDA graphs of the decode/verify passes on CUDA devices (eager elsewhere); "
                  "'off': never; 'static': the graphs' static-buffer path without capturing, on any device (tests)."},
    )
    selector_window: int = field(
        default=256, metadata={"help": "Steps of acceptance history the adaptive selector remembers."}
    )
    exploration: float = field(
        default=0.1, metadata={"help": "UCB exploration weight of the adaptive selector (0: always exploit)."}
    )
    show_progress: bool = field(default=False, metadata={"help": "Show a progress bar over decode steps."})

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(
                f"TLTConfig.speculation={self.speculation!r} is not one of {SPECULATION_MODES}; "
                "use 'never' for plain decoding with the same engine."
            )
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                f"TLTConfig.num_speculative_tokens={self.num_speculative_tokens} must be >= 1 "
                "(or None to let the engine choose); use speculation='never' to switch drafting off."
            )
        if self.default_num_speculative_tokens < 1:
            raise ValueError("TLTConfig.default_num_speculative_tokens must be >= 1.")
        if self.max_speculative_batch_size is not None and self.max_speculative_batch_size < 1:
            raise ValueError("TLTConfig.max_speculative_batch_size must be >= 1 (or None: decided from costs).")
        if self.cuda_graphs not in ("auto", "off", "static"):
            raise ValueError(f"TLTConfig.cuda_graphs={self.cuda_graphs!r} must be 'auto', 'off' or 'static'.")
        if self.history_max_tokens < 0 or self.history_keep_steps < 1:
            raise ValueError("TLTConfig.history_max_tokens must be >= 0 and history_keep_steps >= 1.")
        if self.min_speedup < 1.0:
            raise ValueError(f"TLTConfig.min_speedup={self.min_speedup} must be >= 1 (1: no margin).")
        if self.selector_window < 1 or self.exploration < 0:
            raise ValueError("TLTConfig.selector_window must be >= 1 and exploration >= 0.")
        self.speculation_strategies()  # parse errors surface at construction

    @property
    def chain_length(self) -> int:
        """The number of draft tokens proposed per row and step by the default chain."""
        return self.num_speculative_tokens or self.default_num_speculative_tokens

    def speculation_strategies(self, has_drafter: bool = True) -> list[Strategy]:
        """The strategies this config may use: the fixed one ('always') or the selector's arms ('adaptive')."""
        if self.speculation == "never":
            return []
        if self.speculation == "always":
            default = f"chain:{self.chain_length}" if has_drafter else f"history:{self.chain_length}"
            arms = [parse_strategy(self.strategy or default)]
        else:
            if self.strategies is not None:
                names = list(self.strategies)
            elif self.num_speculative_tokens is not None:
                names = [f"chain:{self.num_speculative_tokens}"]
            else:
                names = list(DEFAULT_STRATEGIES) + (list(DEFAULT_HISTORY_STRATEGIES) if self.history else [])
            arms = [parse_strategy(name) for name in names]
            arms = [a for a in arms if a.kind != "none"]
            if not has_drafter:
                arms = [a for a in arms if not a.uses_drafter]
            if not self.history:
                arms = [a for a in arms if not a.history]
            if not arms:
                raise ValueError(
                    "TLTConfig leaves the adaptive engine no speculative strategy (strategies that need a drafter "
                    "without one, or history strategies with history=False); use speculation='never' instead."
                )
        for arm in arms:
            if arm.uses_drafter and not has_drafter:
                raise ValueError(f"Strategy {arm.name!r} needs a drafter: pass one, or use 'history:K'.")
            if arm.history and not self.history:
                raise ValueError(f"Strategy {arm.name!r} proposes from history but TLTConfig.history is False.")
        return arms


def check_trainer_settings(values: dict) -> None:
    """Validate the trainer-level TLT settings shared by the TRL config and veRL's ``tlt:`` section.

    Only the names present in ``values`` are checked, so each adapter passes the fields it has.
    """
    def given(name):
        return values.get(name) is not None

    if "speculation" in values and values["speculation"] not in SPECULATION_MODES:
        raise ValueError(f"speculation={values['speculation']!r} is not one of {SPECULATION_MODES}.")
    if given("num_speculative_tokens") and values["num_speculative_tokens"] < 1:
        raise ValueError(f"num_speculative_tokens={values['num_speculative_tokens']} must be >= 1 (or None); use "
                         "speculation='never' to stop drafting.")
    if given("draft_vocab_size") and values["draft_vocab_size"] < 0:
        raise ValueError("draft_vocab_size must be None (automatic), 0 (full vocabulary) or a positive size.")
    for name in ("drafter_update_fraction", "drafter_update_seconds", "drafter_max_idle_seconds",
                 "drafter_warmup_seconds"):
        if given(name) and values[name] < 0:
            raise ValueError(f"{name}={values[name]} must be >= 0 (0 switches that training off).")
    if given("max_speculative_batch_size") and values["max_speculative_batch_size"] < 1:
        raise ValueError("max_speculative_batch_size must be >= 1, or None to decide from measured costs.")
    for name in ("drafter_unroll_steps", "drafter_micro_batch_size", "drafter_buffer_bytes"):
        if given(name) and values[name] < 1:
            raise ValueError(f"{name}={values[name]} must be >= 1.")
    if given("drafter_max_steps_per_update") and values["drafter_max_steps_per_update"] < 0:
        raise ValueError("drafter_max_steps_per_update must be >= 0 or None.")
    if given("drafter_warmup_prompts") and values["drafter_warmup_prompts"] < 0:
        raise ValueError("drafter_warmup_prompts must be >= 0.")
    if "drafter_lr" in values and not (values["drafter_lr"] or 0) > 0:
        raise ValueError(f"drafter_lr={values['drafter_lr']} must be > 0.")
