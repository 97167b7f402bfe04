"""Fused verification in Triton: one launch per step decides every row of a chain or a draft tree.

The torch path (``tlt_trainers.sampling``) is a dozen small ops per step (gather p and q, ratio test, residual
max(0, p - q), renormalise, inverse CDF, bonus); on a GPU each is a kernel launch on a step that should cost one.
These kernels compute the same thing, one program per row, from the same uniforms:

- :func:`verify_chain_triton`: rejection sampling of a sampled chain (``verify_sampled_with_uniforms``): accept
  draft j while ``u_j * q_j(x_j) < p_j(x_j)``; then draw from ``max(0, p_n - q_n)`` (p_n when that is all zero)
  after a rejection at n, or from ``p_k`` when all k were kept, by inverse CDF with ``residual_uniforms``. With a
  draft vocabulary, q lives on it and ``target_to_draft`` [V] maps each target id to its draft id (-1: none).
- :func:`verify_tree_triton`: the walk of ``verify_tree`` for point-mass trees: at each level draw the policy's
  token at the current node by inverse CDF and descend into the child holding it, if any.

Decisions are bit-identical to the torch path (the same float32 products and comparisons). The inverse CDF sums
in blocks where torch's ``cumsum`` sums one by one, so a uniform within rounding (~1e-7 relative) of a CDF step
can pick the neighbouring token: a measure-zero difference in law, not a different distribution.

Runs on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run). Triton is imported here, so
import this module only where Triton is installed (``tlt_trainers.kernels`` does it lazily).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tlt_trainers.sampling.chain import ChainVerdict

BLOCK_V = 1024


@triton.jit
def _residual_block(p_row, q_row, t2d_ptr, offs, mask, USE_Q: tl.constexpr, HAS_T2D: tl.constexpr):
    """max(0, p - q) on a block of target ids (p where USE_Q is off); q read through target_to_draft."""
    p = tl.load(p_row + offs, mask=mask, other=0.0)
    if USE_Q:
        if HAS_T2D:
            draft_id = tl.load(t2d_ptr + offs, mask=mask, other=-1)
            q = tl.load(q_row + draft_id, mask=mask & (draft_id >= 0), other=0.0)
        else:
            q = tl.load(q_row + offs, mask=mask, other=0.0)
        p = tl.maximum(p - q, 0.0)
    return p


@triton.jit
def _block(p_row, q_row, t2d_ptr, offs, mask, use_residual, USE_Q: tl.constexpr, HAS_T2D: tl.constexpr):
    if USE_Q:
        if use_residual:
            x = _residual_block(p_row, q_row, t2d_ptr, offs, mask, True, HAS_T2D)
        else:
            x = _residual_block(p_row, q_row, t2d_ptr, offs, mask, False, HAS_T2D)
    else:
        x = _residual_block(p_row, q_row, t2d_ptr, offs, mask, False, HAS_T2D)
    return x


@triton.jit
def _inverse_cdf(p_row, q_row, t2d_ptr, u, V, rejected, USE_Q: tl.constexpr, HAS_T2D: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The token at which the running sum of p (USE_Q off), or of max(0, p - q) after a rejection (p when that is
    all zero), first exceeds u * total; total is the sum's last value, as ``cdf[-1]`` in the torch path."""
    use_residual = rejected
    if USE_Q:  # the residual's largest entry is zero iff its mass is, in any summation order
        largest = 0.0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            largest = tl.maximum(largest, tl.max(_residual_block(p_row, q_row, t2d_ptr, offs, offs < V, True,
                                                                 HAS_T2D), 0))
        use_residual = rejected & (largest > 0.0)
    # Pass 1: the total, summed exactly as pass 2 sums (block cumsum plus the running value).
    total = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = _block(p_row, q_row, t2d_ptr, offs, mask, use_residual, USE_Q, HAS_T2D)
        total = tl.max(tl.where(mask, tl.cumsum(x, 0) + total, 0.0), 0)  # non-decreasing: the last is the max
    threshold = u * total
    # Pass 2: count the CDF entries <= threshold (the CDF is non-decreasing).
    count = 0
    running = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = _block(p_row, q_row, t2d_ptr, offs, mask, use_residual, USE_Q, HAS_T2D)
        cdf = tl.cumsum(x, 0) + running
        count += tl.sum(((cdf <= threshold) & mask).to(tl.int32), 0)
        running = tl.max(tl.where(mask, cdf, 0.0), 0)
    return tl.minimum(count, V - 1)


@triton.jit
def _verify_chain_kernel(draft_tokens, draft_index, p_ptr, q_ptr, t2d_ptr, uniforms, residual_uniforms,
                         num_accepted_out, next_token_out, first_acceptance_out, d2t_ptr,
                         K, V, N, HAS_T2D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # 1. Walk the chain while drafts are accepted (u * q < p: accept with probability min(1, p / q)).
    n = 0
    alive = 1
    for j in range(0, K):
        token = tl.load(draft_tokens + row * K + j)
        q_id = tl.load(draft_index + row * K + j)
        p = tl.load(p_ptr + (row * (K + 1) + j) * V + token)
        q = tl.load(q_ptr + (row * K + j) * N + q_id)
        u = tl.load(uniforms + row * K + j)
        alive = alive * (u * q < p).to(tl.int32)
        n += alive
    tl.store(num_accepted_out + row, n.to(tl.int64))
    # 2. The token after the accepted drafts: from the residual after a rejection at n, else the bonus from p_k.
    p_row = p_ptr + (row * (K + 1) + n) * V
    q_row = q_ptr + (row * K + tl.minimum(n, K - 1)) * N
    u = tl.load(residual_uniforms + row)
    token = _inverse_cdf(p_row, q_row, t2d_ptr, u, V, n < K, True, HAS_T2D, BLOCK)
    tl.store(next_token_out + row, token.to(tl.int64))
    # 3. The first draft's acceptance probability, sum over the draft vocabulary of min(p_1, q_1) (for the selector).
    accepted = 0.0
    for start in range(0, N, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        q = tl.load(q_ptr + row * K * N + offs, mask=mask, other=0.0)
        if HAS_T2D:
            target = tl.load(d2t_ptr + offs, mask=mask, other=0)
        else:
            target = offs
        p = tl.load(p_ptr + row * (K + 1) * V + target, mask=mask, other=0.0)
        accepted += tl.sum(tl.minimum(p, q), 0)
    tl.store(first_acceptance_out + row, accepted)


def verify_chain_triton(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    draft_to_target: torch.Tensor | None = None,
    draft_index: torch.Tensor | None = None,
    target_to_draft: torch.Tensor | None = None,
) -> ChainVerdict:
    """``verify_sampled_with_uniforms`` in one launch (same arguments; ``target_to_draft`` [V], the inverse of
    ``draft_to_target`` with -1 for target ids outside the draft vocabulary, is built here when not given)."""
    batch, k = draft_tokens.shape
    vocab, n = target_probs.shape[-1], draft_probs.shape[-1]
    if draft_to_target is not None and draft_index is None:
        raise ValueError("verify_chain_triton needs draft_index when a draft vocabulary is used.")
    device = target_probs.device
    if draft_to_target is not None and target_to_draft is None:
        target_to_draft = torch.full((vocab,), -1, dtype=torch.long, device=device)
        target_to_draft[draft_to_target] = torch.arange(n, device=device)
    p = target_probs.to(torch.float32).contiguous()
    q = draft_probs.to(torch.float32).contiguous()
    index = (draft_tokens if draft_index is None else draft_index).contiguous()
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    next_token = torch.empty(batch, dtype=torch.long, device=device)
    first_acceptance = torch.empty(batch, dtype=torch.float32, device=device)
    has_t2d = target_to_draft is not None
    t2d = target_to_draft.contiguous() if has_t2d else index  # unused when has_t2d is False
    d2t = draft_to_target.contiguous() if has_t2d else index
    _verify_chain_kernel[(batch,)](
        draft_tokens.contiguous(), index, p, q, t2d, uniforms.to(device, torch.float32).contiguous(),
        residual_uniforms.to(device, torch.float32).contiguous(), num_accepted, next_token, first_acceptance, d2t,
        k, vocab, n, HAS_T2D=has_t2d, BLOCK=min(BLOCK_V, triton.next_power_of_2(max(vocab, n))))
    return ChainVerdict(num_accepted, next_token, first_acceptance)


@triton.jit
def _verify_tree_kernel(tokens_ptr, parents_ptr, p_ptr, uniforms, num_accepted_out, path_out, next_token_out,
                        N, V, D, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK_N)
    node_mask = nodes < N
    tokens = tl.load(tokens_ptr + row * N + nodes, mask=node_mask, other=-1)
    parents = tl.load(parents_ptr + row * N + nodes, mask=node_mask, other=-1)
    current = 0
    alive = 1
    accepted = 0
    token = 0
    for level in range(0, D + 1):
        u = tl.load(uniforms + row * (D + 1) + level)
        p_row = p_ptr + (row * (N + 1) + current) * V
        drawn = _inverse_cdf(p_row, p_row, p_row, u, V, False, False, False, BLOCK)
        token = tl.where(alive > 0, drawn, token)
        if level < D:
            match = (parents == current) & (tokens == token) & node_mask & (alive > 0)
            found = tl.max(match.to(tl.int32), 0)
            child = tl.min(tl.where(match, nodes, BLOCK_N), 0) + 1
            tl.store(path_out + row * D + level, tl.where(found > 0, child, 0).to(tl.int64))
            accepted += found
            current = tl.where(found > 0, child, current)
            alive = alive * found
    tl.store(num_accepted_out + row, accepted.to(tl.int64))
    tl.store(next_token_out + row, token.to(tl.int64))


def verify_tree_triton(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                       uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``verify_tree`` (sampling) in one launch: ``tokens``/``parents`` [B, N] (parents 0..N, 0 = root),
    ``target_probs`` [B, N + 1, V], ``uniforms`` [B, D + 1] for the D levels of the deepest tree.
    Returns (num_accepted [B], path [B, max(D, 1)], next_token [B])."""
    batch, n = tokens.shape
    depth = uniforms.shape[1] - 1
    vocab = target_probs.shape[-1]
    device = target_probs.device
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    path = torch.zeros(batch, max(depth, 1), dtype=torch.long, device=device)
    next_token = torch.empty(batch, dtype=torch.long, device=device)
    _verify_tree_kernel[(batch,)](
        tokens.contiguous(), parents.contiguous(), target_probs.to(torch.float32).contiguous(),
        uniforms.to(device, torch.float32).contiguous(), num_accepted, path, next_token, n, vocab, depth,
        BLOCK=min(BLOCK_V, triton.next_power_of_2(vocab)), BLOCK_N=triton.next_power_of_2(max(n, 1)))
    return num_accepted, path, next_token


__all__ = ["verify_chain_triton", "verify_tree_triton"]
