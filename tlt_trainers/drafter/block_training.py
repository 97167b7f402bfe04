"""Block-parallel training of a :class:`~tlt_trainers.drafter.block.BlockDrafter` (DFlash's recipe).

From each sequence of a micro-batch, random anchor positions a are drawn; each anchor makes one block ``[x_a,
<mask> x K]`` at positions a .. a + K that attends to the context of the positions before a (the policy's features,
computed once per sequence and shared by all of its blocks) and to itself, exactly as at inference. Every block of
every sequence runs in one pass, so a step costs one drafter forward however long the blocks are: no unrolled
training-time test. Masked slot j is scored against the policy's next-token law at a + j (its top-k restricted to
the draft vocabulary, when the rollout came with it) or the token itself, weighted by ``exp(-(j - 1) / gamma)``:
early slots decide whether later ones are reached at all.
"""

from __future__ import annotations

import math

import torch

from ..modeling.kv_cache import additive_mask
from .block import BlockDrafter
from .losses import chunked_soft_cross_entropy


def default_gamma(block_size: int) -> float:
    """DFlash's decay of the position weights: about half the block (4 for blocks of 8, 7-8 for 16)."""
    return max(1.0, block_size / 2)


def sample_anchors(lengths: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct anchors per row of [b] sequence lengths n (features of positions 0 .. n - 1, tokens
    0 .. n): anchors a in 1 .. n - 1, [b, A] with a validity mask (rows shorter than ``count`` have fewer)."""
    width = int(lengths.max())
    count = max(1, min(count, width - 1))
    scores = torch.rand(lengths.shape[0], width, generator=generator).to(lengths.device)
    position = torch.arange(width, device=lengths.device)
    eligible = (position[None] >= 1) & (position[None] < lengths[:, None])
    scores = scores.masked_fill(~eligible, -1.0)
    top = scores.topk(count, dim=1)
    return top.indices, top.values >= 0


def block_loss(drafter: BlockDrafter, hidden: torch.Tensor, next_tokens: torch.Tensor, lengths: torch.Tensor,
               targets: tuple[torch.Tensor, torch.Tensor] | None, target_to_draft: torch.Tensor, anchors: int,
               generator: torch.Generator, gamma: float | None = None, chunk: int = 2048) -> tuple[torch.Tensor, dict]:
    """Loss and metrics on a padded micro-batch: features ``hidden`` [b, L, F] of positions 0 .. L - 1, tokens
    ``next_tokens`` [b, L] (x_1 .. x_L), ``lengths`` [b] (real positions n), ``targets`` the policy's top-k law of
    x_{t+2} at t ([b, L, k] ids and probabilities) or None.

    Metrics: ``top1_by_step`` (slot j's agreement with the policy's top choice, given slots 1 .. j - 1 agreed: the
    chance a greedy verifier accepts it) and ``acceptance_length`` (1 + the mean run of agreeing slots).
    """
    device = hidden.device
    b, length, _ = hidden.shape
    width = drafter.block_size
    depth = width - 1
    anchor, anchor_ok = sample_anchors(lengths, anchors, generator)  # [b, A]
    count = anchor.shape[1]
    steps = torch.arange(1, width, device=device)  # masked slot j = 1 .. K
    target_pos = anchor[..., None] + steps  # [b, A, K]: position of the token slot j drafts
    real = anchor_ok[..., None] & (target_pos <= lengths[:, None, None])

    # One block per anchor, attending to the context before its anchor and to its own slots.
    first = next_tokens.gather(1, (anchor - 1).clamp(min=0))
    block_positions = (anchor[..., None] + torch.arange(width, device=device)).reshape(b, count * width)
    inputs = drafter.block_inputs(first, width).reshape(b, count * width, -1).to(hidden.dtype)
    context = drafter.context_keys_values(hidden, torch.arange(length, device=device).expand(b, -1))
    query_anchor = anchor.repeat_interleave(width, dim=1)  # [b, Q]
    sees_context = torch.arange(length, device=device)[None, None, :] < query_anchor[..., None]
    block_of = torch.arange(count, device=device).repeat_interleave(width)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    mask = additive_mask(torch.cat([sees_context, sees_block], dim=2), inputs.dtype)

    def merge(index, key, value):
        context_key, context_value = context[index]
        return torch.cat([context_key, key], dim=2), torch.cat([context_value, value], dim=2)

    out = drafter(inputs, block_positions, mask, merge).view(b, count, width, -1)[:, :, 1:]  # [b, A, K, H]

    # What each slot is scored against: the policy's law of x_{a+j} (cached at a + j - 2), or x_{a+j} itself.
    token_index = (target_pos - 1).clamp(max=length - 1)
    following = next_tokens.gather(1, token_index.reshape(b, -1)).view(b, count, depth)
    if targets is not None:
        law_index = (target_pos - 2).clamp(min=0, max=length - 1).reshape(b, -1)
        k = targets[0].shape[-1]
        ids = targets[0].gather(1, law_index[..., None].expand(-1, -1, k)).view(b, count, depth, k)
        probs = targets[1].gather(1, law_index[..., None].expand(-1, -1, k)).view(b, count, depth, k)
        draft_ids = target_to_draft[ids]
        probs = probs * (draft_ids >= 0)
        mass = probs.sum(-1)
        probs = probs / mass.clamp(min=1e-6)[..., None]
        top1 = draft_ids[..., 0]
        scored = real & (mass > 1e-6)
    else:
        draft_ids = target_to_draft[following][..., None]
        probs = torch.ones_like(draft_ids, dtype=torch.float32)
        top1 = draft_ids[..., 0]
        scored = real & (top1 >= 0)

    gamma = gamma or default_gamma(width)
    weights = torch.exp(-(steps - 1).to(torch.float32) / gamma).expand(b, count, -1)[scored]
    head_input, head_weight = drafter.head_inputs(out[scored])
    losses, argmax = chunked_soft_cross_entropy(head_input, head_weight, draft_ids.clamp(min=0)[scored],
                                                probs[scored], chunk)
    loss = (losses * weights).sum() / weights.sum().clamp(min=1e-6)

    with torch.no_grad():
        agrees = torch.zeros(b, count, depth, dtype=torch.bool, device=device)
        agrees[scored] = argmax == top1[scored]
        run = agrees.to(torch.int64).cumprod(dim=-1)  # slots 1 .. j all agreed
        reached = torch.cat([scored[..., :1], run[..., :-1].bool() & scored[..., 1:]], dim=-1)
        # a slot no block reached follows a slot that never agreed: its own agreement counts for nothing
        by_step = [float(run[..., j][reached[..., j]].float().mean()) if bool(reached[..., j].any()) else 0.0
                   for j in range(depth)]
        blocks = scored[..., 0]
        acceptance = 1.0 + float(run.sum(-1)[blocks].float().mean()) if bool(blocks.any()) else math.nan
    return loss, {"loss": loss.item(), "feature_loss": 0.0, "token_loss": loss.item(), "top1": by_step[0],
                  "top1_by_step": by_step, "acceptance_length": acceptance, "blocks": int(blocks.sum())}


def block_training_loss(trainer, batch) -> tuple[torch.Tensor, dict]:
    """:func:`block_loss` on a :class:`~.trainer.DrafterTrainer`'s micro-batch with the trainer's settings: the block
    kind's training loss (its :class:`~.registry.DrafterKind` record)."""
    return block_loss(trainer.drafter, batch.hidden, batch.next_tokens, batch.lengths[:, 0], batch.targets,
                      trainer.target_to_draft(), trainer.block_anchors, trainer.generator, trainer.block_gamma,
                      trainer.loss_chunk_size or 2048)
