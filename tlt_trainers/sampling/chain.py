"""Chain verification: accept a prefix of the drafts and draw the one token that follows it.

Sampling follows Leviathan et al. / Chen et al.: accept draft x_j with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection draw from norm(max(0, p_j - q_j)); when
every draft is accepted draw a bonus token from p_k. The result has exactly the target's
distribution whatever q is, as long as q_j is the distribution x_j was drawn from. Greedy
decoding accepts while the target's argmax agrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .distribution import inverse_cdf, uniform


@dataclass
class ChainVerdict:
    """What verification decided for each row."""

    num_accepted: torch.Tensor  # [B] number of leading drafts kept (0..k)
    next_token: torch.Tensor  # [B] token emitted after the accepted drafts (correction or bonus)
    # [B] sampling only: the probability that the first draft is accepted, sum(min(p_1, q_1)). Its expectation
    # is what a 0/1 accept of that draft estimates, without the coin flip's variance (for the selector).
    first_acceptance: torch.Tensor | None = None


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-true prefix of each row of a [B, k] bool tensor."""
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> ChainVerdict:
    """``draft_tokens`` [B, k], ``target_argmax`` [B, k+1]: keep drafts while they equal the argmax."""
    k = draft_tokens.shape[1]
    num_accepted = leading_true(draft_tokens == target_argmax[:, :k])
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return ChainVerdict(num_accepted, next_token)


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    draft_to_target: torch.Tensor | None = None,
    draft_index: torch.Tensor | None = None,
) -> ChainVerdict:
    """Lossless rejection sampling for a chain of k drafts per row.

    Args:
        draft_tokens: [B, k] drafted token ids (target vocabulary).
        draft_probs: [B, k, N] the distributions the drafts were drawn from. N is the target vocabulary
            size, or the draft vocabulary size when ``draft_to_target`` [N] maps draft ids to target ids.
        target_probs: [B, k+1, V] target distributions at each draft position and one past the last.
        draft_index: [B, k] the drafts' ids in the draft vocabulary (required with ``draft_to_target``).
    """
    batch, k = draft_tokens.shape
    uniforms = uniform((batch, k), target_probs.device, generator)
    residual_uniforms = uniform((batch,), target_probs.device, generator)
    return verify_sampled_with_uniforms(draft_tokens, draft_probs, target_probs, uniforms, residual_uniforms,
                                        draft_to_target, draft_index)


def verify_sampled_with_uniforms(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    draft_to_target: torch.Tensor | None = None,
    draft_index: torch.Tensor | None = None,
) -> ChainVerdict:
    """:func:`verify_sampled` with its randomness passed in: ``uniforms`` [B, k] decide acceptance (draft j is
    kept when ``uniforms[:, j] * q < p``) and ``residual_uniforms`` [B] pick the next token by inverse CDF.
    """
    batch, k = draft_tokens.shape
    if draft_to_target is not None and draft_index is None:
        raise ValueError("verify_sampled needs draft_index when a draft vocabulary is used.")
    q_index = draft_tokens if draft_to_target is None else draft_index
    p_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)
    q_draft = draft_probs.gather(2, q_index[..., None]).squeeze(2)
    num_accepted = leading_true(uniforms.to(target_probs.device) * q_draft < p_draft)
    p_first = target_probs[:, 0] if draft_to_target is None else target_probs[:, 0].index_select(1, draft_to_target)
    first_acceptance = torch.minimum(p_first, draft_probs[:, 0].to(p_first.dtype)).sum(-1)

    rows = torch.arange(batch, device=target_probs.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < k
    q_at = draft_probs[rows, num_accepted.clamp(max=k - 1)] * rejected[:, None].to(draft_probs.dtype)
    if draft_to_target is None:
        q_next = q_at
    else:
        q_next = torch.zeros_like(p_next).index_add_(1, draft_to_target, q_at.to(p_next.dtype))
    residual = (p_next - q_next).clamp_(min=0)
    # A rejection happens with probability sum(max(0, q - p)) = sum(max(0, p - q)); when that mass is zero
    # up to rounding, p and q agree and p itself is the right distribution.
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual, p_next)
    next_token = inverse_cdf(residual, residual_uniforms)
    return ChainVerdict(num_accepted, next_token, first_acceptance)
