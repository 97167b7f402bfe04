"""Cross-entropy of a linear head against sparse soft targets, computed a chunk of rows at a time.

The drafter's loss reads ``hidden @ weight.T`` over the whole draft vocabulary only to take a log-sum-exp and a few
target entries. Materialising those logits for every position (and keeping them, their softmax and their gradient
for the backward) costs memory and bandwidth that grow with positions x vocabulary; here each chunk's logits live
only inside the forward, and the backward recomputes them chunk by chunk (the fused linear cross-entropy of
liger-kernel, in plain torch so that it runs on any device).
"""

from __future__ import annotations

import functools

import torch


def _matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class _ChunkedSoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, probs, chunk: int):
        dtype = _matmul_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            argmax = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = start + chunk
                logits = (hidden[start:end].to(dtype) @ w.t()).float()
                lse = logits.logsumexp(-1, keepdim=True)
                losses[start:end] = (probs[start:end] * (lse - logits.gather(-1, ids[start:end]))).sum(-1)
                argmax[start:end] = logits.argmax(-1)
        ctx.save_for_backward(hidden, weight, ids, probs)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(argmax)
        return losses, argmax

    @staticmethod
    def backward(ctx, grad_losses, _grad_argmax):
        hidden, weight, ids, probs = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk):
                end = start + chunk
                h = hidden[start:end].to(dtype)
                p = probs[start:end]
                # d/dlogits of sum_j p_j (lse - z_{ids_j}) = (sum_j p_j) softmax(z) - sum_j p_j e_{ids_j}
                grad = (h @ w.t()).float().softmax(-1) * p.sum(-1, keepdim=True)
                grad.scatter_add_(-1, ids[start:end], -p)
                grad = (grad * grad_losses[start:end, None]).to(dtype)
                if need_hidden:
                    grad_hidden[start:end] = (grad @ w).to(hidden.dtype)
                if need_weight:
                    grad_weight += (grad.t() @ h).float()
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_soft_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                               chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``sum_j probs[n, j] * -log_softmax(hidden[n] @ weight.T)[ids[n, j]]`` and each row's argmax.

    ``hidden`` [N, H], ``weight`` [V, H], ``ids`` [N, k] (valid column ids), ``probs`` [N, k] float32 (zero where an
    entry does not count). Gradients flow to ``hidden`` and ``weight``; the argmax [N] has none. Under autocast the
    products run in the autocast dtype, the log-sum-exp in float32.
    """
    return _ChunkedSoftCrossEntropy.apply(hidden, weight, ids, probs.to(torch.float32), chunk)


def liger_fused_cross_entropy(device: torch.device):
    """liger-kernel's fused linear cross-entropy (Triton) where it runs and pays: CUDA with liger-kernel installed;
    None elsewhere (the torch version above)."""
    return _liger() if device.type == "cuda" else None


@functools.cache
def _liger():
    # Looked up once: a failed import is not cached by Python, and this runs at every training micro-step.
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                             chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over rows of :func:`chunked_soft_cross_entropy`, and each row's argmax.

    Hard labels (one target per row with weight 1: the rollout's own next token) go through liger-kernel's fused
    linear cross-entropy where it runs (:func:`liger_fused_cross_entropy`); soft top-k targets, and every device
    without it, through the torch version (liger has no loss against a sparse soft distribution)."""
    liger = liger_fused_cross_entropy(hidden.device) if ids.shape[-1] == 1 else None
    if liger is not None and bool((probs == 1).all()):
        dtype = _matmul_dtype(hidden)
        out = liger(hidden.to(dtype), weight.to(dtype), ids[:, 0], reduction="sum", return_predicted_tokens=True)
        return out.loss, out.predicted_tokens
    losses, argmax = chunked_soft_cross_entropy(hidden, weight, ids, probs, chunk)
    return losses.sum(), argmax
