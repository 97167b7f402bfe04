"""Exactness on a GPU, stated as it holds: greedy identity in float32, the sampled law in bfloat16.

In float32 the engine's greedy rollouts equal ``model.generate``'s token for token. In bfloat16 they need not: a verify
pass scores several tokens at once, and its matrix products round differently from one-token decoding, so a near-tie
between two tokens can flip (the first divergence statistics show where). What speculation must not change is the
law the tokens are drawn from, and that is tested: completions sampled at temperature 1 by ``model.generate`` and by
the engine, each scored by its log-probability under the float32 policy, compared by a two-sample Kolmogorov-Smirnov
test. Used by ``gpu_check.py`` and ``gpu_speed.py``; needs only torch.
"""

from __future__ import annotations

import math

import torch


def ks_pvalue(a: list[float], b: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov test, asymptotic p-value (enough for samples of a few hundred)."""
    a, b = sorted(a), sorted(b)
    n, m = len(a), len(b)
    i = j = 0
    d = 0.0
    while i < n and j < m:
        x = min(a[i], b[j])
        while i < n and a[i] <= x:
            i += 1
        while j < m and b[j] <= x:
            j += 1
        d = max(d, abs(i / n - j / m))
    lam = (math.sqrt(n * m / (n + m)) + 0.12 + 0.11 / math.sqrt(n * m / (n + m))) * d
    return max(0.0, min(1.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))))


@torch.no_grad()
def completion_log_probs(scorer, sequences: torch.Tensor, prompt_len: int) -> list[float]:
    """Each completion's log-probability under ``scorer`` (the float32 policy)."""
    logits = scorer(sequences).logits.float()[:, prompt_len - 1 : -1]
    tokens = sequences[:, prompt_len:]
    return torch.log_softmax(logits, -1).gather(2, tokens[..., None]).squeeze(2).sum(1).tolist()


def first_divergences(ours: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> dict:
    """How many rows equal the reference, and where (tokens into the completion) the others first differ."""
    width = min(ours.shape[1], reference.shape[1])
    differs = (ours[:, :width] != reference[:, :width])
    same = ~differs.any(dim=1)
    first = [int(row.int().argmax()) - prompt_len for row, s in zip(differs, same, strict=True) if not s]
    return {"identical_rows": int(same.sum()), "rows": len(same), "first_divergence": first}


def sampled_law_check(model, engine, scorer, device, samples: int = 256, new_tokens: int = 16,
                      seed: int = 0) -> dict:
    """``samples`` completions of one prompt at temperature 1 from ``model.generate`` and from ``engine``, scored
    under ``scorer``: the KS p-value of the two score samples, their means, and the completions' mean lengths."""
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (1, 12), generator=torch.Generator().manual_seed(seed)).to(device)
    ids = prompt.expand(samples, -1).contiguous()
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # every completion new_tokens long, in both samplers
    try:
        torch.manual_seed(seed + 1)
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                   top_k=0, top_p=1.0, max_new_tokens=new_tokens, pad_token_id=0)
        result = engine.generate(ids, max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 pad_token_id=0, generator=torch.Generator().manual_seed(seed + 2))
    finally:
        model.generation_config.eos_token_id = saved_eos
    a = completion_log_probs(scorer, reference, ids.shape[1])
    b = completion_log_probs(scorer, result.sequences, ids.shape[1])
    return {"samples": samples, "new_tokens": new_tokens, "ks_pvalue": ks_pvalue(a, b),
            "mean_log_prob_generate": sum(a) / len(a), "mean_log_prob_engine": sum(b) / len(b),
            "acceptance_length": result.stats.acceptance_length}
