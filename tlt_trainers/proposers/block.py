"""Proposals from a block drafter: ``block:K``, K drafts from one drafter pass.

The drafter first projects the policy's features of the tokens committed since it last ran into its cache (the
context, :meth:`BlockProposer.catch_up`), then reads one block per row: the pending token (which the policy scores
next) and K masked slots, attending to the row's committed context and to the whole block. Each masked slot's law
depends on the committed prefix only, not on the drafts before it; a draft sampled from that law is as valid a
proposal as any (rejection sampling corrects it against the policy), so the chain verifies exactly like an EAGLE
chain.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..drafter.block import BlockDrafter
from ..modeling.kv_cache import additive_mask
from ..modeling.rows import ActiveRows
from ..sampling.distribution import process_logits, sample_categorical
from ..sampling.verify import Proposal
from .eagle import STEADY_CATCH_UP, DraftSampling
from .strategy import Strategy


class BlockProposer:
    """``block:K``: the first K masked slots of one block pass, each drawn from the drafter's law (argmax greedy)."""

    def __init__(self, drafter: BlockDrafter, sampling: DraftSampling, clock: Callable[[], float] = time.perf_counter):
        self.drafter, self.sampling, self.clock = drafter, sampling, clock
        # The last catch-up after plain steps (a one-off the selector leaves out): marks of ``clock`` (the rollout's
        # StepTimer.mark: CUDA events on a GPU, read after the step's one read; the host's clock elsewhere)
        self.catch_up_span: tuple | None = None

    def catch_up(self, rows: ActiveRows) -> None:
        """Write the context keys and values of the slots committed since the drafter last ran."""
        dstate = rows.draft_state
        pending = rows.state.length - dstate.length
        width = rows.max_behind  # the host's bound on pending.max() (reading it would stall a GPU)
        if width <= 0:
            return
        start = self.clock() if width > STEADY_CATCH_UP else None
        # Rows with fewer pending slots write past their length: scratch slots that the block pass and later
        # catch-ups overwrite before anything attends to them.
        slots = (dstate.length[:, None] + torch.arange(width, device=pending.device)).clamp(max=rows.capacity - 1)
        features = rows.features.gather(1, slots[..., None].expand(-1, -1, rows.features.shape[-1]))
        positions = (slots - dstate.pad[:, None]).clamp(min=0)
        self.drafter.write_context(features, positions, rows.draft_kv, slots,
                                   kv_len=rows.kv_bound(width))
        dstate.length = rows.state.length.clone()
        rows.max_behind = 0
        if start is not None:
            self.catch_up_span = (start, self.clock())

    def propose(self, rows: ActiveRows, strategy: Strategy) -> Proposal:
        drafter, sampling = self.drafter, self.sampling
        self.catch_up(rows)
        length, pad = rows.state.length, rows.state.pad
        width = strategy.depth + 1
        slots = length[:, None] + torch.arange(width, device=length.device)
        kv_len = rows.kv_bound(width)  # the host's bound on slots.max() + 1
        keys = torch.arange(kv_len, device=length.device)[None, None, :]
        # the row's committed context, and the whole block (no causal mask inside it)
        allowed = (keys >= pad[:, None, None]) & (keys < length[:, None, None] + width)
        allowed = allowed.expand(-1, width, -1)
        hidden = drafter.draft(rows.seq.gather(1, length[:, None])[:, 0], slots - pad[:, None],
                               additive_mask(allowed, rows.features.dtype), rows.draft_kv, slots, kv_len=kv_len)
        logits = drafter.logits(hidden[:, 1:])  # [B, K, V']: masked slot j scores the token at length + j
        if not sampling.do_sample:
            draft_ids = logits.argmax(dim=-1)
            return Proposal.chain(drafter.to_target_ids(draft_ids))
        batch, depth, vocab = logits.shape
        probs = torch.softmax(process_logits(logits.reshape(batch * depth, vocab), sampling.params, None,
                                             sampling.warpers), dim=-1)
        draft_ids = sample_categorical(probs, sampling.generator).reshape(batch, depth)
        return Proposal.chain(drafter.to_target_ids(draft_ids), draft_probs=probs.reshape(batch, depth, vocab),
                              draft_ids=draft_ids, draft_to_target=drafter.d2t)


def block_proposers(drafter: BlockDrafter, sampling: DraftSampling,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[dict, BlockProposer]:
    """The proposer of a block drafter, ``block:K``; a :class:`~tlt_trainers.drafter.registry.DrafterKind`
    factory."""
    proposer = BlockProposer(drafter, sampling, clock)
    return {"block": proposer}, proposer
