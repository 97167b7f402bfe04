"""A sampled law tested token by token: the randomized probability integral transform and a Kolmogorov-Smirnov test
of it against the uniform law (used by test_vllm_law.py and test_real_model.py).

Under the exact law, the randomized PIT of token t, ``u_t = F_t(x_t - 1) + V * p_t(x_t)`` (F_t the policy's
cumulative distribution over token ids at that position, V uniform), is uniform on [0, 1] and independent of the
others whatever came before, so one KS test of all u_t tests the whole sampled law at once, speculated positions
included.
"""

from __future__ import annotations

import torch


def randomized_pit(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, generator: torch.Generator
                   ) -> torch.Tensor:
    """``u_t = F_t(x_t - 1) + V * p_t(x_t)`` per position, for ``logits`` [T, vocab] and sampled ``tokens`` [T]."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    below = torch.cumsum(probs, dim=-1).gather(1, tokens[:, None])[:, 0] - probs.gather(1, tokens[:, None])[:, 0]
    own = probs.gather(1, tokens[:, None])[:, 0]
    return (below + torch.rand(len(tokens), generator=generator, dtype=torch.float64) * own).clamp(0.0, 1.0)


def ks_uniform_pvalue(u: torch.Tensor) -> float:
    """Two-sided one-sample Kolmogorov-Smirnov p-value of ``u`` against Uniform(0, 1) (asymptotic series)."""
    n = len(u)
    x = torch.sort(u.double()).values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum(i / n - x, x - (i - 1) / n).max())
    lam = (n ** 0.5 + 0.12 + 0.11 / n ** 0.5) * d
    p = 2 * sum((-1) ** (k - 1) * torch.exp(torch.tensor(-2.0 * k * k * lam * lam)).item() for k in range(1, 101))
    return float(min(max(p, 0.0), 1.0))
