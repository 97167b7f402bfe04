"""Proposals from rollout history (no neural compute), alone or merged into a drafter tree.

``history:K`` continues each row with up to K tokens that followed its current suffix in earlier rollouts of the
same group (:class:`~tlt_trainers.proposers.rollout_history.RolloutHistory`), as a chain of point masses.
``tree:DxW:N+history:K`` adds that chain as one more branch of the drafter's tree.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..modeling.rows import ActiveRows
from ..sampling.tree import DraftTree
from ..sampling.verify import Proposal
from .eagle import EagleTreeProposer
from .rollout_history import HistoryMatch, RolloutHistory
from .strategy import Strategy


class HistoryProposer:
    """Looks every active row up in the rollout history, at most once per engine step.

    ``keys[i]`` is the history group of the caller's row i (rows with the same prompt, by default).
    """

    def __init__(self, history: RolloutHistory, keys: list[Hashable]):
        self.history, self.keys = history, keys
        self.proposed_tokens = 0  # tokens proposed so far (for the stats)
        self._cached: tuple[int, list[HistoryMatch], list[list[int]]] | None = None  # (k, matches, contexts)

    def remember(self, row: int, tokens: list[int]) -> None:
        """Add the caller's row ``row``, finished (prompt and completion, no padding), to its group's history."""
        self.history.add(self.keys[row], tokens)

    def nbytes(self) -> int:
        return self.history.nbytes()

    def new_step(self) -> None:
        """Forget this step's matches: the rows have moved on."""
        self._cached = None

    def matches(self, rows: ActiveRows, k: int) -> tuple[list[HistoryMatch], list[list[int]]]:
        """This step's matches (up to k tokens per row) and the rows' contexts."""
        if self._cached is None or self._cached[0] < k:
            # The rows' tokens as the host holds them (committed ones and the pending one; the engine extends
            # them from each step's one read), so matching reads nothing back from the device.
            contexts = rows.host_tokens
            keys = [self.keys[i] for i in rows.host_index]
            self._cached = (k, self.history.propose_many(keys, contexts, k), contexts)
        return self._cached[1], self._cached[2]

    def expected_accepted(self, rows: ActiveRows, k: int) -> list[float]:
        """Accepted tokens per row this step's matches predict for chains of 1..k: the sum over positions of
        the product of each token's chance so far (the selector calibrates it).

        A token's chance is its share of the matching history, discounted by how much history backs it:
        ``count / (count + 1)`` times the share, so one sibling that continued this way once is weak evidence
        (1/2) and four that agree are strong (4/5).
        """
        totals = [0.0] * k
        matches, _ = self.matches(rows, k)
        for match in matches:
            survive, expected = 1.0, 0.0
            conf, support = match.token_confidence, match.token_support
            for w in range(k):
                if w < len(conf):
                    survive *= conf[w] * support[w] / (support[w] + 1)
                    expected += survive
                totals[w] += expected
        batch = max(rows.size, 1)
        return [t / batch for t in totals]

    def chains(self, rows: ActiveRows, k: int, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, w] tokens continuing each row, [B] match lengths): w <= k the longest match, or ``pad_to``.
        Shorter matches repeat their last token (any candidate is exact: the verifier only follows the policy's
        own draws)."""
        chains = self.chain_lists(rows, k, pad_to)
        device = rows.seq.device
        return (torch.tensor(chains, dtype=torch.long, device=device),
                torch.tensor(self.lengths, dtype=torch.long, device=device))

    def chain_lists(self, rows: ActiveRows, k: int, pad_to: int | None = None) -> list[list[int]]:
        """The chains of :meth:`chains` as host lists (a traced step copies them into its static buffer once);
        their match lengths in ``self.lengths``."""
        matches, contexts = self.matches(rows, k)
        self.lengths = [min(len(m.tokens), k) for m in matches]
        self.longest = max(self.lengths, default=0)
        width = pad_to or max(self.longest, 1)
        chains = []
        for context, match, n in zip(contexts, matches, self.lengths):
            tokens = match.tokens[:n] or [context[-1]]
            chains.append(tokens + [tokens[-1]] * (width - len(tokens)))
        self.proposed_tokens += sum(self.lengths)
        return chains

    def propose(self, rows: ActiveRows, strategy: Strategy) -> Proposal | None:
        """The rows' history chains; None (a plain step) when no row has a match."""
        tokens, lengths = self.chains(rows, strategy.history_tokens)
        return None if self.longest == 0 else Proposal.chain(tokens)


class MergedProposer:
    """``tree:DxW:N+history:K``: every row verifies N + K nodes. A row whose history proposes L tokens gets them
    as one more branch from the root plus its N + K - L best drafted nodes; a row without a match gets N + K
    drafted nodes."""

    def __init__(self, tree: EagleTreeProposer, history: HistoryProposer):
        self.tree, self.history = tree, history

    def propose(self, rows: ActiveRows, strategy: Strategy) -> Proposal:
        k = strategy.history_tokens
        chain, lengths = self.history.chains(rows, k, pad_to=k)
        budget = strategy.num_nodes + k
        keep = budget - lengths
        tree = self.tree.draft_tree(rows, strategy, budget, keep)
        node = torch.arange(budget, device=chain.device)[None]
        t = node - keep[:, None]  # position along the history branch, negative on drafted nodes
        on_chain = t >= 0
        t = t.clamp(min=0)
        tokens = torch.where(on_chain, chain.gather(1, t), tree.tokens)
        parents = torch.where(on_chain, torch.where(t == 0, 0, node), tree.parents)  # node j's previous is j
        depths = torch.where(on_chain, t + 1, tree.depths)
        return Proposal(DraftTree(tokens, parents, depths, depth_bound=max(strategy.depth, k)), is_chain=False)
