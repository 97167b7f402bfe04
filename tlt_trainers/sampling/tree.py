"""Draft trees: several candidate continuations per row, verified in one policy pass.

A tree's candidates are a deterministic function of the drafter's state (the most likely
continuations, or matches from rollout history), i.e. each candidate is a point-mass proposal.
Multi-candidate rejection sampling with point masses reduces to something simple and exact:
at a node, accept candidate x_1 with probability p(x_1); on rejection the residual is p with
x_1 removed, so candidate x_2 is accepted with probability p(x_2) / (1 - p(x_1)), and so on;
when all are rejected, draw from what is left. That is exactly "draw y ~ p at the node and
descend to the child whose token is y, if any" - which is what :func:`verify_tree` does, so every
emitted token is a draw from the policy's own distribution whatever the tree holds. Greedy
decoding draws the argmax instead.

Layout (per row, fixed node count N per batch): node 0 is the root (the last committed token,
not yet seen by the policy), nodes 1..N are candidates in an order where parents come first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .distribution import inverse_cdf, uniform


@dataclass
class DraftTree:
    """A batch of draft trees with N candidate nodes per row (node 0, the root, is implicit)."""

    tokens: torch.Tensor  # [B, N] candidate tokens (target vocabulary)
    parents: torch.Tensor  # [B, N] parent node of each candidate, in 0..N (0 = the root)
    depths: torch.Tensor  # [B, N] 1 for children of the root
    # At least the deepest node's depth, as its builder knows it on the host (a chain's length, a tree's levels):
    # reading ``depths`` back would stall a GPU. None: read it.
    depth_bound: int | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        """Verification walks this many levels (more than the deepest node only costs levels where nothing
        matches)."""
        if self.depth_bound is not None:
            return min(self.depth_bound, self.num_nodes)
        return int(self.depths.max()) if self.tokens.numel() else 0

    def ancestors(self) -> torch.Tensor:
        """Bool [B, N+1, N+1]: entry [b, i, j] is True when node j is i or an ancestor of i (root included)."""
        batch, n = self.tokens.shape
        device = self.tokens.device
        # Parents come before children, so one pass in node order builds every row of the closure.
        closure = torch.zeros(batch, n + 1, n + 1, dtype=torch.bool, device=device)
        closure[:, 0, 0] = True
        rows = torch.arange(batch, device=device)
        for i in range(1, n + 1):
            closure[:, i] = closure[rows, self.parents[:, i - 1]]
            closure[:, i, i] = True
        return closure

    @staticmethod
    def chain(tokens: torch.Tensor) -> DraftTree:
        """A chain of k candidates per row as a tree (each node the parent of the next)."""
        batch, k = tokens.shape
        steps = torch.arange(k, device=tokens.device).expand(batch, -1)
        return DraftTree(tokens, steps.clone(), steps + 1, depth_bound=k)


def check_tree(tree: DraftTree) -> None:
    """Refuse malformed trees: a parent must come before its child, one level above it."""
    n = tree.num_nodes
    node = torch.arange(1, n + 1, device=tree.tokens.device)
    if (tree.parents < 0).any() or (tree.parents >= node).any():
        raise ValueError("DraftTree.parents must index earlier nodes (0 is the root).")
    parent_depth = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1).gather(1, tree.parents)
    if not torch.equal(parent_depth + 1, tree.depths):
        raise ValueError("DraftTree.depths must be the parent's depth plus one.")


@dataclass
class TreeVerdict:
    """What tree verification decided for each row."""

    num_accepted: torch.Tensor  # [B] candidates accepted along one root-to-node path
    path: torch.Tensor  # [B, D] accepted nodes (1..N) in order; entries past num_accepted are 0
    next_token: torch.Tensor  # [B] the policy's token after the accepted path


def verify_tree(tree: DraftTree, target_probs: torch.Tensor | None, generator: torch.Generator | None = None,
                target_argmax: torch.Tensor | None = None) -> TreeVerdict:
    """Walk each row's tree from the root, drawing the policy's token at every node and following it.

    Args:
        tree: N candidates per row.
        target_probs: [B, N+1, V] the policy's distribution after each node (node 0 = root); None when greedy.
        target_argmax: [B, N+1] the policy's argmax after each node, for greedy decoding.
    """
    if (target_probs is None) == (target_argmax is None):
        raise ValueError("verify_tree needs exactly one of target_probs (sampling) and target_argmax (greedy).")
    batch, n = tree.tokens.shape
    device = tree.tokens.device
    depth = tree.max_depth
    rows = torch.arange(batch, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    path = torch.zeros(batch, max(depth, 1), dtype=torch.long, device=device)
    draws = None if target_probs is None else uniform((batch, depth + 1), device, generator)
    token = torch.zeros(batch, dtype=torch.long, device=device)
    for level in range(depth + 1):
        if target_probs is None:
            drawn = target_argmax[rows, current]
        else:
            drawn = inverse_cdf(target_probs[rows, current], draws[:, level])
        token = torch.where(alive, drawn, token)
        if level == depth:
            break
        match = (tree.parents == current[:, None]) & (tree.tokens == token[:, None]) & alive[:, None]
        found = match.any(dim=1)
        child = match.to(torch.int64).argmax(dim=1) + 1
        path[:, level] = torch.where(found, child, 0)
        num_accepted += found.to(torch.long)
        current = torch.where(found, child, current)
        alive &= found
    return TreeVerdict(num_accepted, path, token)
