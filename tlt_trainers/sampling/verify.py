"""One verification for every proposal: what the drafts carry decides how they are checked.

A proposal is a draft tree per row (a chain is the tree whose node j hangs from node j - 1). Drafts that were
sampled carry the distribution q they were drawn from and are verified by rejection sampling against it
(:func:`verify_sampled`); drafts without q are point masses (greedy drafts, top-k trees, rollout history) and are
verified by drawing the policy's own token at each node and following the child that matches it
(:func:`verify_tree`). Either way the emitted tokens have exactly the policy's distribution. On CUDA with Triton
installed, sampled chains and trees are verified by one fused kernel per step, from the same uniforms and with the
same decisions: the caller passes them (:class:`FusedVerification`, implemented in
:mod:`tlt_trainers.kernels.fused_verification`; the kernels depend on this module's verdicts, not the reverse).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .chain import verify_greedy, verify_sampled, verify_sampled_with_uniforms
from .distribution import sample_categorical, uniform
from .tree import DraftTree, verify_tree


@dataclass
class Proposal:
    """Draft tokens for one step of the active rows."""

    tree: DraftTree  # N draft nodes per row (N = 0: a plain decoding step)
    is_chain: bool  # node j's parent is node j - 1 for every row (causal attention suffices)
    draft_probs: torch.Tensor | None = None  # [B, N, V'] q of each sampled draft; None: point masses
    draft_ids: torch.Tensor | None = None  # [B, N] the drafts' ids in the draft vocabulary (with draft_probs)
    draft_to_target: torch.Tensor | None = None  # [V'] target ids of the draft vocabulary; None: the full one

    @staticmethod
    def chain(tokens: torch.Tensor, **sampled) -> Proposal:
        return Proposal(DraftTree.chain(tokens), is_chain=True, **sampled)

    @staticmethod
    def nothing(batch: int, device: torch.device | str) -> Proposal:
        """No drafts: the policy's pass decodes one token per row."""
        return Proposal.chain(torch.empty(batch, 0, dtype=torch.long, device=device))


@dataclass
class Verdict:
    """What verification decided for each row."""

    num_accepted: torch.Tensor  # [B] drafts accepted along one root-to-node path
    path: torch.Tensor  # [B, D] the accepted nodes (1..N) in order; 0 past num_accepted
    next_token: torch.Tensor  # [B] the policy's token after the accepted path (correction or bonus)
    # [B] sampled chains only: the probability that the first draft is kept, sum(min(p_1, q_1)) (see ChainVerdict)
    first_acceptance: torch.Tensor | None = None

    def emitted(self, tree: DraftTree) -> torch.Tensor:
        """[B, D + 1] tokens to append: the accepted path's tokens, then ``next_token`` (entries past
        ``num_accepted + 1`` are filler)."""
        if tree.num_nodes == 0:
            return self.next_token[:, None]
        path_tokens = tree.tokens.gather(1, (self.path - 1).clamp(min=0))
        emitted = torch.cat([path_tokens, path_tokens.new_zeros(path_tokens.shape[0], 1)], dim=1)
        return emitted.scatter_(1, self.num_accepted[:, None], self.next_token[:, None])


class FusedVerification(Protocol):
    """Fused kernels that verify sampled chains and trees in one launch per step
    (:mod:`tlt_trainers.kernels.fused_verification` implements it; the rollout passes one where they run)."""

    def launcher(self, kind: str, device: torch.device, shape: tuple) -> Callable | None:
        """The kernel for ``kind`` ("chain" or "tree") on ``device`` for this shape class, where it agreed with the
        torch path; None: verify with the torch path."""

    def failed(self, kind: str, launcher: Callable, device: torch.device, error: Exception) -> None:
        """A launch raised after the kernel passed its check: never use it on ``device`` again."""


# ------------------------------------------------------------------ verification
def verify(proposal: Proposal, scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None,
           fused: FusedVerification | None = None) -> Verdict:
    """Accept a path of ``proposal``'s drafts given the policy's processed logits ``scores`` [B, N + 1, V]
    (position 0: after the root, i.e. the last committed token; position j: after node j). ``fused``: kernels that
    verify sampled drafts in one launch, from the same uniforms with the same decisions (None: the torch path)."""
    tree = proposal.tree
    if tree.num_nodes == 0:
        first = scores[:, 0]
        token = sample_categorical(torch.softmax(first, dim=-1), generator) if do_sample else first.argmax(dim=-1)
        none = torch.zeros_like(token)
        return Verdict(none, none[:, None], token)
    batch, device = tree.tokens.shape[0], scores.device
    if proposal.draft_probs is not None:
        probs = torch.softmax(scores, dim=-1)
        n = proposal.draft_probs.shape[-1]
        shape = (tree.num_nodes, probs.shape[-1], n, proposal.draft_to_target is not None, tree.tokens.dtype)
        launcher = None if fused is None else fused.launcher("chain", device, shape)
        if launcher is None:
            chain = verify_sampled(tree.tokens, proposal.draft_probs, probs, generator, proposal.draft_to_target,
                                   proposal.draft_ids)
        else:  # the uniforms verify_sampled draws, in its order
            uniforms = uniform((batch, tree.num_nodes), device, generator)
            residual_uniforms = uniform((batch,), device, generator)
            args = (tree.tokens, proposal.draft_probs, probs, uniforms, residual_uniforms, proposal.draft_to_target,
                    proposal.draft_ids)
            try:
                chain = launcher(*args)
            except Exception as exc:  # noqa: BLE001 - a launch that failed after the check: the same uniforms in torch
                fused.failed("chain", launcher, device, exc)
                chain = verify_sampled_with_uniforms(*args)
    elif proposal.is_chain and not do_sample:
        chain = verify_greedy(tree.tokens, scores.argmax(dim=-1))
    else:
        probs = torch.softmax(scores, dim=-1) if do_sample else None
        launcher = depth = None
        if do_sample and fused is not None:
            depth = tree.max_depth
            shape = (tree.num_nodes, probs.shape[-1], depth, tree.tokens.dtype)
            launcher = fused.launcher("tree", device, shape)
        if launcher is not None:  # the uniforms verify_tree draws
            draws = uniform((batch, depth + 1), device, generator)
            try:
                return Verdict(*launcher(tree.tokens, tree.parents, probs, draws))
            except Exception as exc:  # noqa: BLE001 - a launch that failed after the check passed: torch from now on
                fused.failed("tree", launcher, device, exc)
                # verify_tree draws its own uniforms: new ones, the same law (these were not used)
        walked = verify_tree(tree, probs, generator, target_argmax=None if do_sample else scores.argmax(dim=-1))
        return Verdict(walked.num_accepted, walked.path, walked.next_token)
    nodes = torch.arange(1, tree.num_nodes + 1, device=tree.tokens.device)[None]
    path = torch.where(nodes <= chain.num_accepted[:, None], nodes, 0)
    return Verdict(chain.num_accepted, path, chain.next_token, chain.first_acceptance)
