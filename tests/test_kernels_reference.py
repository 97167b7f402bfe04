"""The pure-torch verification reference (what Triton kernels must match) against the engine's verifier.

1. Fed the same uniforms, ``verify_chain_reference`` and ``verify_sampled`` make the same decisions.
2. The reference is lossless: for a 1-step chain its output law is computed exactly, by enumerating the
   draft token and every interval of the two uniforms on which the output is constant, and equals p.
3. A Monte-Carlo check of the same with random uniforms, as a sanity check on the enumeration itself.
"""

import pytest
import torch
from scipy.stats import chisquare

from tlt_trainers.kernels import verify_chain_reference
from tlt_trainers.sampling import verify_sampled, verify_sampled_with_uniforms


def random_dist(shape, gen, zeros=0.3):
    """Random distributions over the last dim, with some exact zeros (as top-k/top-p filtering leaves)."""
    logits = torch.randn(shape, generator=gen) * 2
    drop = torch.rand(shape, generator=gen) < zeros
    drop[..., 0] = False  # keep at least one token
    return logits.masked_fill(drop, float("-inf")).softmax(-1)


def chain_case(batch, k, vocab, seed, draft_vocab=None):
    """Drafts drawn from q; p equal to q on some rows (zero residual mass) and on some positions."""
    gen = torch.Generator().manual_seed(seed)
    n = draft_vocab or vocab
    q = random_dist((batch, k, n), gen)
    p = random_dist((batch, k + 1, vocab), gen)
    d2t = None
    if draft_vocab is not None:
        d2t = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    q_full = q if d2t is None else torch.zeros(batch, k, vocab).index_add_(2, d2t, q)
    same = torch.rand(batch, generator=gen) < 0.25
    p[same, :k] = q_full[same]
    index = torch.multinomial(q.reshape(-1, n), 1, generator=gen).reshape(batch, k)
    tokens = index if d2t is None else d2t[index]
    return tokens, q, p, d2t, index


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("draft_vocab", [None, 5])
def test_reference_equals_verify_sampled(k, draft_vocab):
    batch, vocab = 200, 8
    tokens, q, p, d2t, index = chain_case(batch, k, vocab, seed=k, draft_vocab=draft_vocab)
    gen = torch.Generator().manual_seed(100 + k)
    uniforms, residual_uniforms = torch.rand(batch, k, generator=gen), torch.rand(batch, generator=gen)

    ref = verify_chain_reference(tokens, q, p, uniforms, residual_uniforms, d2t, index)
    ours = verify_sampled_with_uniforms(tokens, q, p, uniforms, residual_uniforms, d2t, index)
    assert torch.equal(ref.num_accepted, ours.num_accepted)
    assert torch.equal(ref.next_token, ours.next_token)
    counts = torch.bincount(ref.num_accepted, minlength=k + 1)
    assert counts[0] > 0 and counts[k] > 0, "the case must exercise both rejection and full acceptance"

    # The public, generator-driven entry point draws exactly these uniforms, in this order.
    public = verify_sampled(tokens, q, p, torch.Generator().manual_seed(100 + k), d2t, index)
    assert torch.equal(public.num_accepted, ref.num_accepted)
    assert torch.equal(public.next_token, ref.next_token)


def test_reference_needs_draft_index_with_a_draft_vocabulary():
    tokens, q, p, d2t, _ = chain_case(2, 1, 8, seed=0, draft_vocab=5)
    with pytest.raises(ValueError, match="needs draft_index"):
        verify_chain_reference(tokens, q, p, torch.rand(2, 1), torch.rand(2), d2t)


def _midpoints(breaks):
    """Midpoints and widths of the intervals of [0, 1) cut at ``breaks``."""
    points = sorted({0.0, 1.0, *(min(max(float(b), 0.0), 1.0) for b in breaks)})
    return [((a + b) / 2, b - a) for a, b in zip(points, points[1:]) if b - a > 0]


def exact_law_k1(q, p0, p1, d2t=None):
    """Exact law of the reference's output for one draft: P(first token) and P(accepted, draft, bonus).

    The output is a deterministic function of (draft, u, r), constant between the acceptance threshold
    p(x)/q(x) in u and the CDF steps of the two possible next-token distributions in r: evaluating the
    reference once per cell and weighting by the cell's probability gives its law exactly.
    """
    vocab, n = p0.shape[0], q.shape[0]
    to_target = torch.arange(n) if d2t is None else d2t
    q_full = torch.zeros(vocab, dtype=q.dtype).index_add_(0, to_target, q)
    residual = (p0 - q_full).clamp(min=0)
    residual = residual if residual.sum() > 0 else p0
    r_breaks = [*(residual.cumsum(0) / residual.sum()).tolist(), *(p1.cumsum(0) / p1.sum()).tolist()]
    cells, weights = [], []
    for draft in range(n):
        if q[draft] == 0:
            continue
        x = int(to_target[draft])
        for u, wu in _midpoints([p0[x] / q[draft]]):
            for r, wr in _midpoints(r_breaks):
                cells.append((draft, x, u, r))
                weights.append(float(q[draft]) * wu * wr)
    draft_ids = torch.tensor([[c[0]] for c in cells])
    tokens = torch.tensor([[c[1]] for c in cells])
    verdict = verify_chain_reference(
        tokens,
        q.expand(len(cells), 1, n),
        torch.stack([p0, p1]).expand(len(cells), 2, vocab),
        torch.tensor([[c[2]] for c in cells], dtype=torch.float32),
        torch.tensor([c[3] for c in cells], dtype=torch.float32),
        d2t,
        draft_ids,
    )
    first = torch.zeros(vocab, dtype=torch.float64)
    accepted_then_bonus = torch.zeros(vocab, vocab, dtype=torch.float64)
    for (_, x, _, _), w, n_acc, nxt in zip(cells, weights, verdict.num_accepted.tolist(), verdict.next_token.tolist()):
        if n_acc == 1:
            first[x] += w
            accepted_then_bonus[x, nxt] += w
        else:
            first[nxt] += w
    return first, accepted_then_bonus


LAWS = {
    "random": None,
    "q equals p": "same",
    "q on a token p forbids": "forbidden",
    "q misses tokens p likes": "missing",
}


@pytest.mark.parametrize("case", list(LAWS))
@pytest.mark.parametrize("draft_vocab", [None, 4])
def test_exact_output_law_is_p_for_one_draft(case, draft_vocab):
    vocab = 6
    gen = torch.Generator().manual_seed(7)
    n = draft_vocab or vocab
    d2t = None if draft_vocab is None else torch.tensor([0, 2, 3, 5])
    p0, p1 = random_dist((vocab,), gen, zeros=0.2), random_dist((vocab,), gen, zeros=0.2)
    q = random_dist((n,), gen, zeros=0.0)
    if LAWS[case] == "same":
        if d2t is not None:
            p0 = torch.zeros(vocab).index_add_(0, d2t, q)
        else:
            p0 = q.clone()
    elif LAWS[case] == "forbidden":
        target = 0 if d2t is None else int(d2t[0])
        p0[target] = 0
        p0 = p0 / p0.sum()
        q = torch.full((n,), 0.05)
        q[0] = 1 - 0.05 * (n - 1)
    elif LAWS[case] == "missing":
        q = torch.zeros(n)
        q[:2] = torch.tensor([0.7, 0.3])

    first, joint = exact_law_k1(q, p0, p1, d2t)
    assert first.sum() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(first, p0.double(), atol=1e-6, rtol=0)
    # Accepting x has probability min(p, q)(x), and the bonus is then drawn from the next position's p.
    q_full = q if d2t is None else torch.zeros(vocab).index_add_(0, d2t, q)
    expected_joint = torch.minimum(p0, q_full).double()[:, None] * p1.double()[None]
    torch.testing.assert_close(joint, expected_joint, atol=1e-6, rtol=0)


def test_monte_carlo_output_law_is_p_for_one_draft():
    vocab, samples = 5, 10000
    gen = torch.Generator().manual_seed(3)
    p0 = torch.tensor([0.05, 0.40, 0.0, 0.25, 0.30])
    p1 = random_dist((vocab,), gen)
    q = torch.tensor([0.30, 0.10, 0.20, 0.35, 0.05])  # a poor drafter: proposes a token p forbids
    tokens = torch.multinomial(q, samples, replacement=True, generator=gen)[:, None]
    verdict = verify_chain_reference(
        tokens,
        q.expand(samples, 1, vocab),
        torch.stack([p0, p1]).expand(samples, 2, vocab),
        torch.rand(samples, 1, generator=gen),
        torch.rand(samples, generator=gen),
    )
    first = torch.where(verdict.num_accepted == 1, tokens[:, 0], verdict.next_token)
    counts = torch.bincount(first, minlength=vocab)
    assert counts[2] == 0, "a token the target forbids is never emitted"
    support = p0 > 0
    assert chisquare(counts[support].numpy(), (p0[support] * samples).numpy()).pvalue > 1e-3
    acceptance = verdict.num_accepted.double().mean().item()
    assert acceptance == pytest.approx(torch.minimum(p0, q).sum().item(), abs=0.02)
