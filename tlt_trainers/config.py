"""Settings of the speculative rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from .proposers.strategy import Strategy, parse_strategy

SPECULATION_MODES = ("adaptive", "always", "never")
# Chains for sampling (a drafter's q is used, not only its top choices), trees for confident drafters. A chain of
# one is the CPU's arm: verifying a second token per row costs next to nothing at batch 1 there, a third does not.
DEFAULT_STRATEGIES = ("chain:1", "chain:2", "chain:4", "tree:4x2:8", "tree:6x4:16", "tree:8x4:32", "tree:8x4:48")
# Proposals from rollout history: alone (no drafter compute) and as one more branch of a drafter tree.
DEFAULT_HISTORY_STRATEGIES = ("history:8", "tree:6x4:16+history:8")
# A block drafter's arms: blocks of 1, 2, 4 drafts and its whole block (one drafter pass each).
DEFAULT_BLOCK_DRAFTS = (1, 2, 4)


def default_block_strategies(block_size: int) -> list[str]:
    """``block:K`` for K in 1, 2, 4 and the drafter's whole block (``block_size - 1`` drafts)."""
    most = block_size - 1
    return [f"block:{k}" for k in sorted({k for k in DEFAULT_BLOCK_DRAFTS if k < most} | {most})]


@dataclass
class TLTConfig:
    """How the rollout engine speculates.

    The defaults are safe for any model: speculation is used only where it is expected to pay
    (small active batches) and the draft length stays short.
    """

    speculation: str = field(
        default="adaptive",
        metadata={"help": "'adaptive' speculates only where it is expected to pay: while the active batch is small "
                  "(the long tail of a rollout, where a step costs nearly the same for more tokens), with the "
                  "strategy the selector expects to be fastest. 'always' speculates at every step; 'never' decodes "
                  "one token per step with the same engine (the baseline, no drafter).",
                  "choices": list(SPECULATION_MODES)},
    )
    num_speculative_tokens: int | None = field(
        default=None,
        metadata={"help": "Fixed chain length k (draft tokens per row and step): the adaptive engine then only "
                  "chooses between that chain and plain decoding. None lets it choose among its strategies."},
    )
    default_num_speculative_tokens: int = field(
        default=4,
        metadata={"help": "Draft length of speculation='always' (a chain, or history:K without a drafter) when "
                  "neither num_speculative_tokens nor strategy is set."},
    )
    max_speculative_batch_size: int | None = field(
        default=None,
        metadata={"help": "With speculation='adaptive', never speculate while more rows than this are active. None "
                  "(default): decided from measured costs on the device in use."},
    )
    strategy: str | None = field(
        default=None,
        metadata={"help": "With speculation='always', the strategy of every step: 'chain:K' (K drafted tokens), "
                  "'tree:DxW:N' (a draft tree of depth D, width W, N verified nodes), 'history:K' (K tokens from "
                  "rollout history, no drafter), 'tree:DxW:N+history:K', or with a block drafter 'block:K' (K "
                  "drafts from one drafter pass). Default: a chain of num_speculative_tokens or "
                  "default_num_speculative_tokens; with a block drafter, a block of num_speculative_tokens or of "
                  "its whole block."},
    )
    strategies: tuple[str, ...] | None = field(
        default=None,
        metadata={"help": "With speculation='adaptive', the strategies (as in strategy) the selector chooses among "
                  f"besides plain decoding. Default: {', '.join(DEFAULT_STRATEGIES)}, and with history_drafting "
                  f"{', '.join(DEFAULT_HISTORY_STRATEGIES)}; with a block drafter block:1, block:2, block:4 and its "
                  "whole block (and history:8); only the fixed chain (block) when num_speculative_tokens is set."},
    )
    history_drafting: bool = field(
        default=True,
        metadata={"help": "Also propose draft tokens from rollout history: finished completions of the same prompt "
                  "(a GRPO group's siblings, earlier steps' rollouts) and the row's own context. RL rollouts of one "
                  "prompt repeat each other, and these proposals cost no drafter compute; exact like every "
                  "proposal."},
    )
    history_max_tokens: int = field(
        default=500_000,
        metadata={"help": "Tokens of rollout history kept for history drafting (oldest evicted first): bounds its "
                  "memory."},
    )
    history_keep_steps: int = field(
        default=4,
        metadata={"help": "generate() calls (RL steps) whose rollouts stay in the history: the policy moves away "
                  "from older rollouts."},
    )
    min_speedup: float = field(
        default=1.25,
        metadata={"help": "The adaptive selector speculates only where it expects at least this speedup per step "
                  "over plain decoding. The margin covers the noise of its cost and acceptance estimates, and "
                  "a cost a per-step estimate does not see: speculation spreads the steps at which the rows "
                  "finish, so the batch stays wider for longer. 1 speculates at any expected gain."},
    )
    cuda_graphs: str = field(
        default="auto",
        metadata={"help": "'auto': on CUDA devices, replay whole steps (plain, EAGLE chains: drafter, verify pass, "
                  "sampling, acceptance, commit) from CUDA graphs, and the policy's pass of the other steps, which "
                  "saves the kernel launches that dominate small-batch steps; graphs are kept across calls while "
                  "shapes fit (eager elsewhere). Each capture's first replay is checked against the eager step or "
                  "pass; on a mismatch or a capture error they run eagerly, with one warning. 'off': never; "
                  "'static': the graphs' static-buffer path without capturing, on any device (for tests).",
                  "choices": ["auto", "off", "static"]},
    )
    keep_engine_memory: bool = field(
        default=False,
        metadata={"help": "Keep what the engine holds between rollouts (the policy's and the drafter's KV caches, "
                  "the features buffer, the graphs' logits outputs and memory pools) through the training step. "
                  "False (the default): TLTGRPOTrainer and veRL's tlt rollout servers give it back after each "
                  "rollout, because a training step colocated with the rollout needs it: with a policy of billions "
                  "of parameters, a vocabulary of about 150 thousand tokens and a few thousand slots it is tens of "
                  "GB (docs/adaptive_engine.md). True saves allocating it and capturing the graphs again at the next "
                  "rollout, where the memory can be spared. SpeculativeGenerator used alone keeps it until "
                  "release_graphs()."},
    )
    selector_window: int = field(
        default=256,
        metadata={"help": "Steps of acceptance history the adaptive selector remembers: a shorter window follows a "
                  "drafter that improves during RL sooner, a longer one averages more noise out."},
    )
    exploration: float = field(
        default=0.1,
        metadata={"help": "UCB exploration weight of the adaptive selector: how often it retries strategies that "
                  "look worse, whose acceptance changes as the drafter trains (0: always exploit)."},
    )
    cost_cache: str = field(
        default="auto",
        metadata={"help": "Where the adaptive engine keeps the step costs it measured, so that the next run on the "
                  "same machine, policy and versions starts measured: 'auto' (~/.cache/tlt_trainers/costs, or "
                  "$TLT_COST_CACHE where set), a directory, or 'off' (costs are learnt from each run's steps alone)."},
    )
    show_progress: bool = field(default=False, metadata={"help": "Show a progress bar over the decode steps."})

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
        if not isinstance(self.cost_cache, str) or not self.cost_cache:
            raise ValueError(f"TLTConfig.cost_cache={self.cost_cache!r} must be 'auto', 'off' or a directory.")
        self._strategies(True, None, check_drafter=False)  # parse errors surface at construction

    @property
    def chain_length(self) -> int:
        """The number of draft tokens proposed per row and step by the default chain."""
        return self.num_speculative_tokens or self.default_num_speculative_tokens

    def speculation_strategies(self, has_drafter: bool = True, block_size: int | None = None) -> list[Strategy]:
        """The strategies this config may use: the fixed one ('always') or the selector's arms ('adaptive').

        ``block_size``: the engine's drafter is a block drafter of that size, which drafts with ``block:K`` (K <
        ``block_size``) where an EAGLE drafter drafts chains and trees.
        """
        return self._strategies(has_drafter, block_size, check_drafter=True)

    def _strategies(self, has_drafter: bool, block_size: int | None, check_drafter: bool) -> list[Strategy]:
        if self.speculation == "never":
            return []
        block = block_size is not None
        if self.speculation == "always":
            if self.strategy:
                default = self.strategy
            elif block:
                default = f"block:{self.num_speculative_tokens or block_size - 1}"
            else:
                default = f"chain:{self.chain_length}" if has_drafter else f"history:{self.chain_length}"
            arms = [parse_strategy(default)]
        else:
            if self.strategies is not None:
                names = list(self.strategies)
            elif self.num_speculative_tokens is not None:
                names = [f"{'block' if block else 'chain'}:{self.num_speculative_tokens}"]
            elif block:
                names = default_block_strategies(block_size) + (["history:8"] if self.history_drafting else [])
            else:
                names = list(DEFAULT_STRATEGIES) + (list(DEFAULT_HISTORY_STRATEGIES) if self.history_drafting else [])
            arms = [parse_strategy(name) for name in names]
            arms = [a for a in arms if a.kind != "none"]
            if not has_drafter:
                arms = [a for a in arms if not a.uses_drafter]
            if not self.history_drafting:
                arms = [a for a in arms if not a.history_tokens]
            if not arms:
                raise ValueError(
                    "TLTConfig leaves the adaptive engine no speculative strategy (strategies that need a drafter "
                    "without one, or history strategies with history_drafting=False); use speculation='never' instead."
                )
        for arm in arms:
            if arm.uses_drafter and not has_drafter:
                raise ValueError(f"Strategy {arm.name!r} needs a drafter: pass one, or use 'history:K'.")
            if arm.history_tokens and not self.history_drafting:
                raise ValueError(f"Strategy {arm.name!r} proposes from history but history_drafting is False.")
            if not (check_drafter and arm.uses_drafter):
                continue
            if block and not arm.uses_block_drafter:
                raise ValueError(f"Strategy {arm.name!r} drafts token by token with an EAGLE drafter, but the engine's "
                                 f"drafter is a block drafter: use 'block:K' (K <= {block_size - 1}).")
            if block and arm.depth > block_size - 1:
                raise ValueError(f"Strategy {arm.name!r} drafts more than the block drafter's {block_size - 1} masked "
                                 f"slots: use 'block:K' with K <= {block_size - 1}.")
            if not block and arm.uses_block_drafter:
                raise ValueError(f"Strategy {arm.name!r} needs a block drafter (BlockDrafter); the engine's drafter "
                                 "drafts token by token: use 'chain:K' or a tree.")
        return arms
