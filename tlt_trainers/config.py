"""Settings of the speculative rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field

SPECULATION_MODES = ("adaptive", "always", "never")


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
    max_speculative_batch_size: int = field(
        default=8,
        metadata={"help": "With speculation='adaptive', speculate only while at most this many rows are active: "
                  "large batches are compute-bound and verification stops being nearly free."},
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
        if self.max_speculative_batch_size < 1:
            raise ValueError("TLTConfig.max_speculative_batch_size must be >= 1.")

    @property
    def chain_length(self) -> int:
        """The number of draft tokens proposed per row and step."""
        return self.num_speculative_tokens or self.default_num_speculative_tokens
