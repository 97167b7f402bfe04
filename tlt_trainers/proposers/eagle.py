"""Proposals from an EAGLE drafter: a sampled or greedy chain, or an EAGLE-2 dynamic tree.

Both run the drafter over the policy's features of the committed tokens first (:meth:`DrafterRunner.catch_up`),
then draft from its latest prediction. A chain samples each draft from the drafter's (warped) distribution and
hands that q to the verifier; a tree keeps the most likely continuations, point masses, which the verifier
follows wherever the policy's own draw goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..drafter.base import Drafter
from ..modeling.kv_cache import additive_mask, attention_allowed
from ..modeling.rows import ActiveRows
from ..sampling.distribution import SamplingParams, process_logits, sample_categorical
from ..sampling.tree import DraftTree
from ..sampling.verify import Proposal
from .strategy import Strategy

# The most slots one speculative step commits (a depth-8 path or an 8-token history chain, plus the bonus token):
# a drafter further behind has sat out plain steps, and its catch-up is the one-off cost of switching.
STEADY_CATCH_UP = 12


@dataclass
class DraftSampling:
    """How drafts are drawn: the rollout's warpers without the repetition penalty (q may be any law that we
    sample from; verification corrects the difference), from the rollout's generator."""

    params: SamplingParams
    warpers: list
    generator: torch.Generator | None

    @property
    def do_sample(self) -> bool:
        return self.params.do_sample


class DrafterRunner:
    """Runs the drafter over the active rows: its per-row cache lives in ``rows.draft_state``/``rows.draft_kv``."""

    def __init__(self, drafter: Drafter, sampling: DraftSampling, clock: Callable[[], float] = time.perf_counter):
        self.drafter, self.sampling, self.clock = drafter, sampling, clock
        # The last catch-up after plain steps (a one-off the selector leaves out): marks of ``clock`` (the rollout's
        # StepTimer.mark: CUDA events on a GPU, read after the step's one read; the host's clock elsewhere)
        self.catch_up_span: tuple | None = None

    def catch_up(self, rows: ActiveRows) -> torch.Tensor:
        """Feed the drafter the (feature, token) pairs committed since it last ran; returns its latest
        prediction [B, H], from which the first draft token is read. Switching strategies, or from plain
        decoding back to speculation, costs nothing more than this.
        """
        dstate = rows.draft_state
        pending = rows.state.length - dstate.length  # pairs (h_s, x_{s+1}) the drafter has not seen yet
        # The host's bound on the widest row (no read of ``pending``): rows with fewer pending pairs compute past
        # their length into scratch slots, which later passes overwrite before anything attends to them.
        width = rows.max_behind
        start = self.clock() if width > STEADY_CATCH_UP else None
        slots = (dstate.length[:, None] + torch.arange(width, device=pending.device)).clamp(max=rows.capacity - 2)
        hidden_in = rows.features.gather(1, slots[..., None].expand(-1, -1, rows.features.shape[-1]))
        tokens_in = rows.seq.gather(1, slots + 1)
        feature = self.run(rows, hidden_in, tokens_in, slots, kv_len=rows.kv_bound(width))
        dstate.length = rows.state.length.clone()
        rows.max_behind = 0
        if start is not None:
            self.catch_up_span = (start, self.clock())
        # (a dead row of a padded graph step may be further behind: its prediction is garbage nobody reads)
        return feature[torch.arange(pending.shape[0], device=pending.device), (pending - 1).clamp(0, width - 1)]

    def run(self, rows: ActiveRows, hidden, tokens, slots, positions=None, allowed=None,
            kv_len: int | None = None) -> torch.Tensor:
        """One drafter pass writing its keys at ``slots`` [B, q]; causal over the row unless ``allowed`` is given.
        ``kv_len``: the host's bound on ``slots.max() + 1`` (reading it would stall a GPU)."""
        dstate = rows.draft_state
        if kv_len is None:
            kv_len = int(slots.max()) + 1
        if allowed is None:
            allowed = attention_allowed(dstate, slots, kv_len)
        mask = additive_mask(allowed[..., :kv_len], hidden.dtype)
        if positions is None:
            positions = (slots - dstate.pad[:, None]).clamp(min=0)
        return self.drafter(hidden, tokens, positions, mask, rows.draft_kv, slots, kv_len)

    def log_probs(self, feature: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [.., N] of the drafter's (warped) next-token law, finite so that every child
        scores strictly below its parent."""
        logits = self.drafter.logits(feature)
        if self.sampling.do_sample:
            logits = process_logits(logits, self.sampling.params, None, self.sampling.warpers)
        return torch.log_softmax(logits, dim=-1).clamp(min=-1e4)


class EagleChainProposer:
    """``chain:K``: K drafts per row, each drawn from the drafter's distribution (its argmax when greedy)."""

    def __init__(self, runner: DrafterRunner):
        self.runner = runner

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft per row from the drafter's logits: its draft-vocabulary index and the law q it was drawn from
        (None: a point mass, the argmax when greedy)."""
        sampling = self.runner.sampling
        if not sampling.do_sample:
            return logits.argmax(dim=-1), None
        probs = torch.softmax(process_logits(logits, sampling.params, None, sampling.warpers), dim=-1)
        return sample_categorical(probs, sampling.generator), probs

    def propose(self, rows: ActiveRows, strategy: Strategy) -> Proposal:
        runner, drafter = self.runner, self.runner.drafter
        feature = runner.catch_up(rows)
        draft_ids, draft_tokens, draft_probs = [], [], []
        for j in range(strategy.depth):
            index, probs = self.draw(drafter.logits(feature))
            if probs is not None:
                draft_probs.append(probs)
            token = drafter.to_target_ids(index)
            draft_ids.append(index)
            draft_tokens.append(token)
            if j + 1 < strategy.depth:
                slot = (rows.state.length + j)[:, None]
                feature = runner.run(rows, feature[:, None], token[:, None], slot,
                                     kv_len=rows.kv_bound(j + 1))[:, 0]
        tokens = torch.stack(draft_tokens, dim=1)
        if not draft_probs:
            return Proposal.chain(tokens)
        return Proposal.chain(tokens, draft_probs=torch.stack(draft_probs, dim=1),
                              draft_ids=torch.stack(draft_ids, dim=1), draft_to_target=drafter.d2t)


class EagleTreeProposer:
    """``tree:DxW:N``: EAGLE-2's dynamic tree of the drafter's most likely continuations."""

    def __init__(self, runner: DrafterRunner):
        self.runner = runner

    def propose(self, rows: ActiveRows, strategy: Strategy) -> Proposal:
        return Proposal(self.draft_tree(rows, strategy), is_chain=False)

    def draft_tree(self, rows: ActiveRows, strategy: Strategy, budget: int | None = None,
                   keep: torch.Tensor | None = None) -> DraftTree:
        """Expand the ``width`` best nodes of each level into their ``width`` best children, then keep the
        ``budget`` (default ``num_nodes``) best nodes overall by drafted path log-probability. With ``keep`` [B],
        row b's first ``keep[b]`` nodes are its best ones (a closed subtree: a child always scores below its
        parent) and the rest follow, for the caller to replace.

        Candidates are deterministic given the prefix (point-mass proposals), so verification stays exact
        whatever is selected here.
        """
        runner, drafter = self.runner, self.runner.drafter
        depth, width = strategy.depth, strategy.width
        budget = budget or strategy.num_nodes
        batch, device = rows.size, rows.seq.device
        length, pad = rows.state.length, rows.draft_state.pad
        feature = runner.catch_up(rows)
        top_scores, top_ids = runner.log_probs(feature).topk(width, dim=-1)  # [B, W]
        cand_tokens = [drafter.to_target_ids(top_ids)]
        cand_scores = [top_scores]
        cand_parents = [torch.full((batch, width), -1, dtype=torch.long, device=device)]
        beam = torch.arange(width, device=device).expand(batch, -1)  # candidate index of each beam node
        beam_tokens, beam_scores = cand_tokens[0], top_scores
        beam_feature = feature[:, None].expand(-1, width, -1)
        ancestry = torch.empty(batch, width, 0, dtype=torch.long, device=device)  # drafter slots of ancestors
        committed = None
        offset = width
        penalty = 1e-6  # strict decrease along paths even when a drafter is certain (log 1 = 0)
        for level in range(1, depth):
            slots = length[:, None] + (level - 1) * width + torch.arange(width, device=device)
            ancestry = torch.cat([ancestry, slots[..., None]], dim=2)
            kv_len = rows.kv_bound(level * width)  # the host's bound on slots.max() + 1
            if committed is None:
                keys = torch.arange(kv_len + (depth - 1) * width, device=device)
                committed = (keys[None] >= pad[:, None]) & (keys[None] < length[:, None])
            allowed = committed[:, None, :].expand(batch, width, -1).clone()
            allowed.scatter_(2, ancestry, True)
            positions = (length - pad)[:, None].expand(-1, width) + (level - 1)
            out = runner.run(rows, beam_feature, beam_tokens, slots, positions, allowed, kv_len=kv_len)
            child_scores, child_ids = runner.log_probs(out).topk(width, dim=-1)  # [B, W, W]
            child_scores = beam_scores[..., None] + child_scores - penalty
            flat_scores = child_scores.reshape(batch, width * width)
            cand_scores.append(flat_scores)
            cand_tokens.append(drafter.to_target_ids(child_ids).reshape(batch, width * width))
            cand_parents.append(beam[..., None].expand(-1, -1, width).reshape(batch, width * width))
            best_scores, best = flat_scores.topk(width, dim=-1)
            parent_of_best = best // width
            beam = offset + best
            beam_scores = best_scores
            beam_tokens = cand_tokens[-1].gather(1, best)
            beam_feature = out.gather(1, parent_of_best[..., None].expand(-1, -1, out.shape[-1]))
            ancestry = ancestry.gather(1, parent_of_best[..., None].expand(-1, -1, ancestry.shape[2]))
            offset += width * width
        all_scores = torch.cat(cand_scores, dim=1)
        all_tokens = torch.cat(cand_tokens, dim=1)
        all_parents = torch.cat(cand_parents, dim=1)
        levels = [torch.ones(batch, width, dtype=torch.long, device=device)]
        levels += [torch.full((batch, width * width), lv + 1, dtype=torch.long, device=device)
                   for lv in range(1, depth)]
        all_depths = torch.cat(levels, dim=1)
        best = all_scores.topk(budget, dim=-1).indices  # best first
        if keep is not None:  # the kept nodes first (in candidate order), the others after them
            count = all_scores.shape[1]
            best = torch.where(torch.arange(budget, device=device)[None] < keep[:, None], best, best + count)
            chosen = best.sort(dim=-1).values % count
        else:
            chosen = best.sort(dim=-1).values  # parents precede children
        node_of = torch.zeros(batch, all_scores.shape[1] + 1, dtype=torch.long, device=device)
        node_of.scatter_(1, chosen + 1, torch.arange(1, budget + 1, device=device).expand(batch, -1))
        parents = node_of.gather(1, all_parents.gather(1, chosen) + 1)
        return DraftTree(all_tokens.gather(1, chosen), parents, all_depths.gather(1, chosen), depth_bound=depth)


def token_proposers(drafter: Drafter, sampling: DraftSampling,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[dict, DrafterRunner]:
    """The proposers of a drafter that drafts one token per pass (EAGLE-1, EAGLE-3): ``chain:K`` and trees, sharing
    one runner (which keeps the drafter caught up); a :class:`~tlt_trainers.drafter.registry.DrafterKind` factory."""
    runner = DrafterRunner(drafter, sampling, clock)
    return {"chain": EagleChainProposer(runner), "tree": EagleTreeProposer(runner)}, runner
