"""What a step costs on this device: a one-off profile of the policy and drafter, refined by every step.

Whether speculation pays at a batch size is a question about the device: on a GPU a forward over
8 rows costs about what 1 row costs, on a CPU it does not. The profile times one policy forward
(decoder, LM head, softmax) over q new tokens per row for a few batch sizes, with a realistic
cache length, and one drafter pass. Each engine step then corrects the prediction for its
strategy and batch bucket (an exponential moving average of measured / predicted), so the model
follows what the hardware really does, including overheads the profile cannot see.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..modeling.kv_cache import RowKV, RowState, WritePlan, additive_mask, attention_allowed
from ..proposers.strategy import Strategy


def selector_bucket(batch_size: int) -> int:
    """Power-of-two buckets (1, 2, 3-4, 5-8, ...): costs within one differ little."""
    return 1 << max(0, math.ceil(math.log2(max(batch_size, 1))))


def _timed(fn, sync: bool) -> float:
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass
class CostProfile:
    """Seconds of one policy forward (``verify``) and one drafter pass (``draft``) by (batch, tokens per row)."""

    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[tuple[int, int], float] = field(default_factory=dict)
    seconds_spent: float = 0.0

    def batch_sizes(self) -> list[int]:
        return sorted({b for b, _ in self.verify})

    def _lookup(self, table: dict, batch: int, tokens: int) -> float:
        """Linear interpolation in the batch size between measured sizes (inf where not measured)."""
        sizes = sorted({b for b, q in table if q == tokens})
        if not sizes:
            return math.inf
        if batch <= sizes[0]:
            return table[(sizes[0], tokens)]
        if batch >= sizes[-1]:
            return table[(sizes[-1], tokens)] * batch / sizes[-1]
        upper = next(b for b in sizes if b >= batch)
        lower = max(b for b in sizes if b <= batch)
        if upper == lower:
            return table[(lower, tokens)]
        w = (batch - lower) / (upper - lower)
        return (1 - w) * table[(lower, tokens)] + w * table[(upper, tokens)]

    def catch_up_seconds(self, batch: int) -> float:
        """The drafter's pass over the one token per row a plain step commits (0 without a drafter profile)."""
        seconds = self._lookup(self.draft, batch, 1)
        return seconds if math.isfinite(seconds) else 0.0

    def step_seconds(self, strategy: Strategy, batch: int) -> float:
        """Predicted seconds of one engine step with ``strategy`` at ``batch`` active rows."""
        verify = self._lookup(self.verify, batch, strategy.tokens_per_row)
        if strategy.kind in ("none", "history"):
            return verify
        catch_up = self._lookup(self.draft, batch, 1)
        if strategy.kind == "chain":
            return verify + strategy.depth * catch_up
        return verify + catch_up + (strategy.depth - 1) * self._lookup(self.draft, batch, strategy.width)

    def to_dict(self) -> dict:
        return {"verify": {f"{b}x{q}": s for (b, q), s in sorted(self.verify.items())},
                "draft": {f"{b}x{q}": s for (b, q), s in sorted(self.draft.items())},
                "seconds_spent": self.seconds_spent}


def _rows_at(batch: int, context: int, device) -> RowState:
    """``batch`` unpadded rows with ``context`` cached tokens each."""
    return RowState(torch.zeros(batch, dtype=torch.long, device=device),
                    torch.full((batch,), context, dtype=torch.long, device=device))


def _verify_runs(target, batch: int, token_counts: list[int], context: int) -> dict[int, Callable[[], None]]:
    """One policy forward (decoder, LM head, softmax) over q new tokens per row, per q, on a fresh cache."""
    device = target.device
    state = _rows_at(batch, context, device)
    cache = target.new_cache(context + max(token_counts) + 1)
    runs = {}
    for q in token_counts:
        slots = context + torch.arange(q, device=device).expand(batch, -1)
        tokens = torch.randint(0, target.vocab_size, (batch, q), device=device)
        mask = target.attention_mask(state, slots, context + q)

        def run(tokens=tokens, slots=slots, mask=mask, q=q):
            cache.plan = WritePlan(slots, context + q)
            hidden = target.forward(tokens, slots, mask, cache)
            torch.softmax(target.logits(hidden), dim=-1)

        runs[q] = run
    runs[token_counts[0]]()  # allocates the cache and warms kernels up
    return runs


def _draft_runs(target, drafter, batch: int, widths: list[int], context: int) -> dict[int, Callable[[], None]]:
    """One drafter pass over ``width`` tokens per row (and its top-k), per width."""
    device = target.device
    state = _rows_at(batch, context, device)
    kv = RowKV(context + max(widths) + 1)
    runs = {}
    for width in widths:
        slots = context + torch.arange(width, device=device).expand(batch, -1)
        mask = additive_mask(attention_allowed(state, slots, context + width), target.dtype)
        hidden = torch.zeros(batch, width, drafter.feature_size, dtype=target.dtype, device=device)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)

        def run(hidden=hidden, tokens=tokens, slots=slots, mask=mask, width=width):
            out = drafter(hidden, tokens, slots, mask, kv, slots, context + width)
            torch.log_softmax(drafter.logits(out), dim=-1).topk(max(widths), dim=-1)

        runs[width] = run
    runs[widths[0]]()
    return runs


@torch.no_grad()
def profile_costs(target, drafter, strategies: list[Strategy], batch_sizes: list[int], context: int,
                  profile: CostProfile | None = None, repeats: int = 3, min_speedup: float = 1.0) -> CostProfile:
    """Measure what ``strategies`` need at ``batch_sizes`` (skipping sizes already in ``profile``).

    Token counts are measured in increasing order per batch size and stop once a forward costs more
    than the most any remaining strategy could emit per row, over ``min_speedup``: such strategies cannot
    pay there, and on a CPU at large batch those are the slowest forwards of the table. Each
    entry is the fastest of ``repeats`` timings taken in separate passes over the whole table: a busy
    CPU's bursts of slowness can last seconds, so back-to-back repeats would fall into the same burst, and a
    plain step timed in one makes every strategy at that batch size look cheap relative to it.
    """
    profile = profile or CostProfile()
    todo = sorted(set(batch_sizes) - set(profile.batch_sizes()))
    if not todo:
        return profile
    begin = time.perf_counter()
    sync = target.device.type == "cuda"
    token_counts = sorted({1} | {s.tokens_per_row for s in strategies}
                          | {w + 1 for s in strategies for w in s.history_widths})
    widths = sorted({1} | {s.width for s in strategies if s.kind == "tree"})
    verify: dict[tuple[int, int], float] = {}
    draft: dict[tuple[int, int], float] = {}
    measured: dict[int, list[int]] = {}
    for batch in todo:  # first pass: which token counts are worth measuring
        runs = _verify_runs(target, batch, token_counts, context)
        measured[batch] = []
        for q in token_counts:
            best_possible = max((s.max_emitted for s in strategies if s.tokens_per_row >= q), default=1)
            if measured[batch] and \
                    verify[(batch, measured[batch][-1])] * min_speedup > best_possible * verify[(batch, 1)]:
                break
            verify[(batch, q)] = _timed(runs[q], sync)
            measured[batch].append(q)
        del runs
    for repeat in range(repeats):  # the first pass timed the policy once already
        for batch in todo:
            if repeat > 0:
                runs = _verify_runs(target, batch, measured[batch], context)
                for q in measured[batch]:
                    verify[(batch, q)] = min(verify[(batch, q)], _timed(runs[q], sync))
                del runs
            if drafter is not None:
                runs = _draft_runs(target, drafter, batch, widths, context)
                for width in widths:
                    draft[(batch, width)] = min(draft.get((batch, width), math.inf), _timed(runs[width], sync))
    profile.verify = monotone_envelope({**profile.verify, **verify})
    profile.draft = monotone_envelope({**profile.draft, **draft})
    profile.seconds_spent += time.perf_counter() - begin
    return profile


def monotone_envelope(table: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Each (batch, tokens) entry capped by the cheapest entry with at least as many rows and tokens.

    More rows or more tokens per row is never less work, so an entry above a larger one's was timed in a burst
    of slowness (a busy CPU's noise is one-sided). Left as measured, a spike on a plain step (b, 1) would make
    every speculative strategy at batch b look cheap relative to plain decoding, and the engine would speculate
    at a loss.
    """
    return {(b, q): min(s for (b2, q2), s in table.items() if b2 >= b and q2 >= q) for (b, q) in table}
