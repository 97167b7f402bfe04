"""Speculation strategies: what one engine step proposes before the policy verifies.

``none``          plain decoding, one token per row and step;
``chain:K``       K drafts sampled from the drafter (rejection sampling against its q);
``block:K``       K drafts from one pass of a block drafter (DFlash), verified as a chain;
``tree:DxW:N``    EAGLE-2 style dynamic tree: D levels, the W best nodes expanded per level into
                  their W best children, the N best nodes overall (by drafted path probability)
                  verified in one pass with tree attention.
``history:K``     up to K tokens continuing the row from rollout history (siblings, earlier steps,
                  its own context): no neural compute at all.
``tree:DxW:N+history:K``  both in one tree of N + K nodes per row: a row whose history proposes L tokens
                  gets them as one more branch from the root plus the N + K - L best drafted nodes; a
                  row without a match gets N + K drafted nodes. The verifier follows whichever branch
                  the policy's own draw agrees with.

Names are what users write in ``TLTConfig`` and what the stats report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TREE = re.compile(r"^tree:(\d+)x(\d+):(\d+)$")
_CHAIN = re.compile(r"^chain:(\d+)$")
_BLOCK = re.compile(r"^block:(\d+)$")
_HISTORY = re.compile(r"^history:(\d+)$")


@dataclass(frozen=True)
class Strategy:
    kind: str  # "none" | "chain" | "block" | "tree" | "history"
    depth: int = 0  # model-drafter levels (chain length for chains)
    width: int = 1  # nodes expanded per level and children per node (trees)
    num_nodes: int = 0  # model-drafted candidates verified per row (excluding the root)
    history_tokens: int = 0  # tokens proposed from rollout history (one more branch of the tree)

    @property
    def name(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind in ("chain", "block"):
            return f"{self.kind}:{self.depth}"
        if self.kind == "history":
            return f"history:{self.history_tokens}"
        tree = f"tree:{self.depth}x{self.width}:{self.num_nodes}"
        return tree + (f"+history:{self.history_tokens}" if self.history_tokens else "")

    @property
    def uses_drafter(self) -> bool:
        return self.kind in ("chain", "block", "tree")

    @property
    def uses_block_drafter(self) -> bool:
        """Drafted by a block drafter (``block:K``); ``chain`` and ``tree`` need an autoregressive (EAGLE) one."""
        return self.kind == "block"

    @property
    def proposer(self) -> str | None:
        """The proposer that drafts for this strategy: "chain", "block", "tree", "history", "tree+history" (None:
        plain)."""
        if self.kind == "none":
            return None
        return "tree+history" if self.kind == "tree" and self.history_tokens else self.kind

    @property
    def scratch_slots(self) -> int:
        """Cache slots past a row's length that one step may write: its verified nodes, or the tree drafter's
        beams."""
        return max(self.num_nodes + self.history_tokens, (self.depth - 1) * self.width)

    def capped(self, remaining: int) -> Strategy:
        """This strategy for a step where at most ``remaining`` more tokens may be emitted: a chain or block drafts
        no more than ``remaining - 1`` (trees and history are cut at commit, their width is what they verify)."""
        if self.kind in ("chain", "block") and self.depth >= remaining:
            return Strategy(self.kind, depth=remaining - 1, num_nodes=remaining - 1)
        return self

    @property
    def tokens_per_row(self) -> int:
        """Tokens per row in the verify pass (the root included)."""
        return self.num_nodes + self.history_tokens + 1

    @property
    def drafted_candidates(self) -> int:
        """Nodes a tree's drafter produces (W at the first level, W*W at each later one): the most it can verify."""
        return self.width + (self.depth - 1) * self.width * self.width if self.kind == "tree" else self.depth

    @property
    def max_emitted(self) -> int:
        return max(self.depth, self.history_tokens) + 1

    @property
    def history_widths(self) -> tuple[int, ...]:
        """Chain lengths a ``history:K`` step may be cut to (powers of two below K, and K): the engine looks at the
        step's proposals, which cost nothing, before it pays for verifying them."""
        if self.kind != "history":
            return ()
        return tuple(sorted({1 << i for i in range(self.history_tokens.bit_length()) if 1 << i < self.history_tokens}
                            | {self.history_tokens}))

    def __str__(self) -> str:
        return self.name


NONE = Strategy("none")


def parse_strategy(name: str) -> Strategy:
    """``"none"``, ``"chain:K"`` or ``"tree:DxW:N"`` -> Strategy, with an error that shows the syntax."""
    text = str(name).strip().lower().replace(" ", "")
    if text == "none":
        return NONE
    if "+" in text:
        tree_part, _, history_part = text.partition("+")
        tree, history = parse_strategy(tree_part), _HISTORY.match(history_part)
        if tree.kind != "tree" or history is None or int(history.group(1)) < 1:
            raise ValueError(
                f"Strategy {name!r}: only a tree combines with history, as 'tree:DxW:N+history:K' (a sampled "
                "chain's q cannot share a verification with point-mass proposals)."
            )
        k = int(history.group(1))
        most = tree.drafted_candidates
        if tree.num_nodes + k > most:
            raise ValueError(
                f"Strategy {name!r}: rows without a history match fill the history branch's {k} slots with drafted "
                f"nodes, so N + K ({tree.num_nodes + k}) must be at most the drafted nodes ({most} = W + (D-1)*W*W)."
            )
        return Strategy("tree", tree.depth, tree.width, tree.num_nodes, history_tokens=k)
    if match := _HISTORY.match(text):
        k = int(match.group(1))
        if k < 1:
            raise ValueError(f"Strategy {name!r}: history needs at least 1 proposed token.")
        return Strategy("history", history_tokens=k)
    if match := _CHAIN.match(text) or _BLOCK.match(text):
        k = int(match.group(1))
        kind = text.partition(":")[0]
        if k < 1:
            raise ValueError(f"Strategy {name!r}: a {kind} needs at least 1 draft token.")
        return Strategy(kind, depth=k, width=1, num_nodes=k)
    if match := _TREE.match(text):
        depth, width, nodes = (int(g) for g in match.groups())
        if depth < 1 or width < 1:
            raise ValueError(f"Strategy {name!r}: depth and width must be >= 1.")
        most = Strategy("tree", depth=depth, width=width).drafted_candidates
        if not depth <= nodes <= most:
            raise ValueError(
                f"Strategy {name!r}: the number of verified nodes must be between the depth ({depth}) and the "
                f"number of drafted nodes ({most} = W + (D-1)*W*W)."
            )
        return Strategy("tree", depth=depth, width=width, num_nodes=nodes)
    raise ValueError(
        f"Unknown speculation strategy {name!r}; use 'none', 'chain:K' (e.g. 'chain:4'), 'tree:DxW:N' "
        "(e.g. 'tree:8x4:48': depth 8, top-4 expansion, 48 verified tokens), 'history:K', "
        "'tree:DxW:N+history:K' or, with a block drafter, 'block:K' (K drafts from one pass)."
    )


def tlt_prior(batch_size: int) -> Strategy:
    """TLT's table (depth 8, top-k 4; 48/32/16/8 verified tokens for batch 1 / 2-4 / 5-20 / 21+).

    Only a starting point: the selector measures and moves away from it.
    """
    nodes = 48 if batch_size <= 1 else 32 if batch_size <= 4 else 16 if batch_size <= 20 else 8
    return Strategy("tree", depth=8, width=4, num_nodes=nodes)
