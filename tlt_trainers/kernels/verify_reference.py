"""Pure-torch reference of chain verification: what a Triton verify kernel must compute, bit for bit.

Same result as :func:`tlt_trainers.sampling.chain.verify_sampled`, but with its randomness passed in
(``uniforms`` decide acceptance, ``residual_uniforms`` draw the next token), so a kernel and this
reference can be fed the same numbers and compared exactly. Written as plain loops, one row and one
draft at a time, to be read rather than run fast:

    for each row b:
        n = 0
        while n < k and uniforms[b, n] * q_n(x_n) < p_n(x_n):   # accept x_n with probability min(1, p/q)
            n += 1
        dist = max(0, p_n - q_n) if n < k else p_k              # residual after a rejection, else bonus
        dist = p_n if dist sums to 0                            # p and q agree: p itself is right
        next_token = first i with cumsum(dist)[i] > residual_uniforms[b] * sum(dist)
"""

from __future__ import annotations

import torch

from tlt_trainers.sampling.chain import ChainVerdict


def _inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> int:
    """The token at which the CDF of the (unnormalised) distribution ``dist`` [V] first exceeds ``u`` * total."""
    cdf = torch.cumsum(dist.to(torch.float32), dim=0)
    threshold = u.to(torch.float32) * cdf[-1]
    token = int((cdf <= threshold).sum())  # cdf is non-decreasing: the count of entries <= threshold
    return min(token, dist.shape[0] - 1)


def verify_chain_reference(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    draft_to_target: torch.Tensor | None = None,
    draft_index: torch.Tensor | None = None,
) -> ChainVerdict:
    """Lossless rejection sampling of a chain of k drafts per row, with explicit uniforms.

    Args:
        draft_tokens: [B, k] drafted token ids (target vocabulary).
        draft_probs: [B, k, N] the distributions the drafts were drawn from (N = V, or the draft
            vocabulary size when ``draft_to_target`` [N] maps draft ids to target ids).
        target_probs: [B, k+1, V] target distributions at each draft position and one past the last.
        uniforms: [B, k] in [0, 1); draft j of row b is accepted when ``uniforms[b, j] * q < p``.
        residual_uniforms: [B] in [0, 1); pick the correction or bonus token by inverse CDF.
        draft_index: [B, k] the drafts' ids in the draft vocabulary (required with ``draft_to_target``).

    Returns:
        ChainVerdict(num_accepted [B], next_token [B]).
    """
    batch, k = draft_tokens.shape
    if draft_to_target is not None and draft_index is None:
        raise ValueError("verify_chain_reference needs draft_index when a draft vocabulary is used.")
    num_accepted = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)
    next_token = torch.zeros(batch, dtype=torch.long, device=draft_tokens.device)

    for b in range(batch):
        # 1. Walk the chain while drafts are accepted.
        n = 0
        while n < k:
            token = int(draft_tokens[b, n])
            q_id = token if draft_to_target is None else int(draft_index[b, n])
            p = target_probs[b, n, token]
            q = draft_probs[b, n, q_id]
            if uniforms[b, n] * q < p:
                n += 1
            else:
                break
        num_accepted[b] = n

        # 2. The distribution of the token that follows the accepted drafts.
        p_next = target_probs[b, n]
        q_next = torch.zeros_like(p_next)
        if n < k:  # rejected at position n: subtract the draft distribution there (in target ids)
            for q_id in range(draft_probs.shape[-1]):
                token = q_id if draft_to_target is None else int(draft_to_target[q_id])
                q_next[token] += draft_probs[b, n, q_id]
        residual = torch.clamp(p_next - q_next, min=0)
        if not residual.sum() > 0:
            residual = p_next

        # 3. Draw it by inverse CDF.
        next_token[b] = _inverse_cdf(residual, residual_uniforms[b])

    return ChainVerdict(num_accepted, next_token)
