"""Settings of the speculative rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec.strategy import Strategy, parse_strategy

SPECULATION_MODES = ("adaptive", "always", "never")
# Chains for sampling (a drafter's q is used, not only its top choices), trees for confident drafters.
DEFAULT_STRATEGIES = ("chain:2", "chain:4", "tree:4x2:8", "tree:6x4:16", "tree:8x4:32", "tree:8x4:48")


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
        if self.selector_window < 1 or self.exploration < 0:
            raise ValueError("TLTConfig.selector_window must be >= 1 and exploration >= 0.")
        self.speculation_strategies()  # parse errors surface at construction

    @property
    def chain_length(self) -> int:
        """The number of draft tokens proposed per row and step by the default chain."""
        return self.num_speculative_tokens or self.default_num_speculative_tokens

    def speculation_strategies(self) -> list[Strategy]:
        """The strategies this config may use: the fixed one ('always') or the selector's arms ('adaptive')."""
        if self.speculation == "never":
            return []
        if self.speculation == "always":
            return [parse_strategy(self.strategy or f"chain:{self.chain_length}")]
        if self.strategies is not None:
            names = list(self.strategies)
        elif self.num_speculative_tokens is not None:
            names = [f"chain:{self.num_speculative_tokens}"]
        else:
            names = list(DEFAULT_STRATEGIES)
        arms = [parse_strategy(name) for name in names]
        arms = [a for a in arms if a.kind != "none"]
        if not arms:
            raise ValueError("TLTConfig.strategies has no speculative strategy; use speculation='never' instead.")
        return arms
