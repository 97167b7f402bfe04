"""What a step costs on this device, learnt from the steps the engine runs.

Whether speculation pays at a batch size is a question about the device: on a GPU a forward over 8 rows costs about
what 1 row costs, on a CPU it does not. Nothing is timed before the first rollout. Every plain step records what a
step at its exact batch size costs (:meth:`CostProfile.observe_plain`), and a speculative step is predicted from
that curve: a policy pass over q new tokens for b rows costs about what a plain step over b * q rows costs (the
linear layers see the same number of rows), and a drafter pass a fixed share of it (its linear weights over the
policy's). Where nothing is known the prediction is infinite and the engine decodes plainly. The selector then
corrects each prediction for its strategy and batch bucket from the steps it takes (:mod:`.selector`).

Timed passes (:func:`profile_costs`) refine the table where they exist: an explicit ``engine.profile()``, a
measurement in a rank's idle time (``engine.measure_costs``), or the persistent cache of an earlier run on the same
machine (:mod:`.cost_cache`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..adaptive.buckets import selector_bucket as selector_bucket  # its home is adaptive/; imported from here too
from ..modeling.kv_cache import RowState, WritePlan, additive_mask, attention_allowed
from ..proposers.strategy import Strategy


def _timed(fn, sync: bool) -> float:
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def log_smoothed(old: float | None, new: float, alpha: float) -> float:
    """A moving average in log space (seconds and their ratios: a burst of slowness is one-sided)."""
    return new if old is None else math.exp((1 - alpha) * math.log(old) + alpha * math.log(new))


def linear_weights(module: torch.nn.Module) -> int:
    """Weights of the module's linear layers: what a pass over one row multiplies (embeddings are lookups)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


# A forward's seconds at n rows modelled as fixed + per-row * n, where one batch size n1 is all that is known: the
# fixed share (streaming the weights, launching kernels) is 1 / (1 + rate * n1) of it. On a CPU a second row cost
# ~1.1x one row and 64 rows ~5x (SmolLM2-135M, 2 cores); a GPU stays flat far longer. Only a prior: the second
# batch size measured replaces it with the slope between the two.
FIXED_SHARE_RATE = {"cpu": 0.11, "cuda": 0.002}


def _curve(points: dict[int, float], batch: float, fixed_share_rate: float = FIXED_SHARE_RATE["cpu"]) -> float:
    """Seconds at ``batch`` from seconds measured at some batch sizes: linear between them; beyond the largest, along
    the slope from a size at most half as large, and no cheaper than the fixed-share model of the largest size alone;
    below the smallest, its cost."""
    if not points:
        return math.inf
    sizes = sorted(points)
    if batch <= sizes[0]:
        return points[sizes[0]]
    if batch >= sizes[-1]:
        top = sizes[-1]
        fixed = 1.0 / (1.0 + fixed_share_rate * top)
        one_size = points[top] * (fixed + (1.0 - fixed) * batch / top)
        if len(sizes) == 1:
            return one_size
        # The slope from the top size to the largest at most half as large (adjacent sizes differ by noise alone),
        # never flatter than the fixed-share model: a noisy pair must not make many more rows look free.
        below = max([b for b in sizes if b <= top / 2] or sizes[:1])
        slope = max(points[top] - points[below], 0.0) / (top - below)
        return max(points[top] + slope * (batch - top), one_size)
    upper = next(b for b in sizes if b >= batch)
    lower = max(b for b in sizes if b <= batch)
    if upper == lower:
        return points[lower]
    w = (batch - lower) / (upper - lower)
    return (1 - w) * points[lower] + w * points[upper]


@dataclass
class CostProfile:
    """Seconds of a step, by batch size: plain steps as the engine ran them (``plain``, learnt online) and, where
    timed, one policy forward (``verify``) and one drafter pass (``draft``) by (batch, tokens per row).

    ``corrections``: what the selectors learnt about each speculative strategy per batch bucket, as (measured /
    predicted seconds, steps behind it); kept here so that the persistent cache carries them to the next run.
    """

    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[tuple[int, int], float] = field(default_factory=dict)
    plain: dict[int, float] = field(default_factory=dict)
    plain_steps: dict[int, int] = field(default_factory=dict)
    corrections: dict[tuple[int, str], tuple[float, int]] = field(default_factory=dict)
    drafter_share: float | None = None  # a drafter pass per policy pass over as many rows (linear weights' ratio)
    fixed_share_rate: float = FIXED_SHARE_RATE["cpu"]  # the device's prior where one batch size is known (_curve)
    seconds_spent: float = 0.0  # timing passes (profile_costs), not the steps learnt from
    plain_smoothing: float = 0.3

    def batch_sizes(self) -> list[int]:
        """Batch sizes with timed passes."""
        return sorted({b for b, _ in self.verify})

    def observe_plain(self, batch: int, seconds: float) -> None:
        """A plain step's seconds at exactly ``batch`` rows (a moving average in log space: noise is one-sided)."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        self.plain[batch] = log_smoothed(self.plain.get(batch), seconds, self.plain_smoothing)
        self.plain_steps[batch] = self.plain_steps.get(batch, 0) + 1

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

    def _plain_curve(self) -> dict[int, float]:
        return {b: s for (b, q), s in self.verify.items() if q == 1} or self.plain

    def forward_seconds(self, batch: int, tokens: int) -> float:
        """One policy pass over ``tokens`` new tokens for ``batch`` rows. From timed passes where the table has them
        (a token count left out there was too dear to pay: inf); else a plain step over batch * tokens rows (inf
        while no plain step has been seen)."""
        if self.verify:
            return self._lookup(self.verify, batch, tokens)
        return _curve(self.plain, batch * tokens, self.fixed_share_rate)

    def drafter_seconds(self, batch: int, width: int) -> float:
        """One drafter pass over ``width`` tokens per row: timed, else its share of a plain step over as many rows."""
        if self.draft:
            return self._lookup(self.draft, batch, width)
        if self.drafter_share is None:
            return math.inf
        return self.drafter_share * _curve(self._plain_curve(), batch * width, self.fixed_share_rate)

    def timed(self, strategy: Strategy) -> bool:
        """Whether the strategy's prediction comes from timed passes rather than from the plain-step curve."""
        return bool(self.verify) and (not strategy.uses_drafter or bool(self.draft))

    def catch_up_seconds(self, batch: int) -> float:
        """The drafter's pass over the one token per row a plain step commits (0 where unknown)."""
        seconds = self.drafter_seconds(batch, 1)
        return seconds if math.isfinite(seconds) else 0.0

    def step_seconds(self, strategy: Strategy, batch: int) -> float:
        """Predicted seconds of one engine step with ``strategy`` at ``batch`` active rows (inf: unknown)."""
        verify = self.forward_seconds(batch, strategy.tokens_per_row)
        if strategy.kind in ("none", "history"):
            return verify
        catch_up = self.drafter_seconds(batch, 1)
        if strategy.kind == "chain":
            return verify + strategy.depth * catch_up
        if strategy.kind == "block":  # the context of the committed tokens, then one pass over the block
            return verify + catch_up + self.drafter_seconds(batch, strategy.depth + 1)
        return verify + catch_up + (strategy.depth - 1) * self.drafter_seconds(batch, strategy.width)

    def to_dict(self) -> dict:
        return {"verify": {f"{b}x{q}": s for (b, q), s in sorted(self.verify.items())},
                "draft": {f"{b}x{q}": s for (b, q), s in sorted(self.draft.items())},
                "plain": {str(b): s for b, s in sorted(self.plain.items())},
                "plain_steps": {str(b): n for b, n in sorted(self.plain_steps.items())},
                "corrections": {f"{b}|{name}": [ratio, n]
                                for (b, name), (ratio, n) in sorted(self.corrections.items())},
                "drafter_share": self.drafter_share,
                "seconds_spent": self.seconds_spent}

    def merge_dict(self, data: dict) -> None:
        """Take what :meth:`to_dict` wrote (the persistent cache); entries that do not parse or are not positive
        finite numbers are skipped, so a damaged file costs nothing but its own entries."""

        def pairs(table):
            for key, seconds in (table or {}).items():
                try:
                    b, q = (int(x) for x in str(key).split("x"))
                    seconds = float(seconds)
                except (TypeError, ValueError):
                    continue
                if b >= 1 and q >= 1 and math.isfinite(seconds) and seconds > 0:
                    yield (b, q), seconds

        self.verify.update(pairs(data.get("verify")))
        self.draft.update(pairs(data.get("draft")))
        steps = data.get("plain_steps") or {}
        for key, seconds in (data.get("plain") or {}).items():
            try:
                b, seconds, n = int(key), float(seconds), int(steps.get(key, 1))
            except (TypeError, ValueError):
                continue
            if b >= 1 and math.isfinite(seconds) and seconds > 0:
                self.plain[b], self.plain_steps[b] = seconds, max(n, 1)
        for key, value in (data.get("corrections") or {}).items():
            try:
                bucket, name = str(key).split("|", 1)
                ratio, n = float(value[0]), int(value[1])
                bucket = int(bucket)
            except (TypeError, ValueError, IndexError):
                continue
            if bucket >= 1 and math.isfinite(ratio) and ratio > 0 and n >= 1:
                self.corrections[(bucket, name)] = (ratio, n)


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
    kv = drafter.new_kv(context + max(widths) + 1)
    runs = {}
    for width in widths:
        slots = context + torch.arange(width, device=device).expand(batch, -1)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
        if drafter.drafts_blocks:  # a block over the context (a width of 1: the context of one committed token)
            mask = additive_mask(torch.ones(batch, width, context + width, dtype=torch.bool, device=device),
                                 target.dtype)  # the block sees all of the context and itself
            features = torch.zeros(batch, context, drafter.feature_size, dtype=target.dtype, device=device)
            context_slots = torch.arange(context, device=device).expand(batch, -1)
            drafter.write_context(features, context_slots, kv, context_slots)
            one = features[:, :1]

            def run(tokens=tokens, slots=slots, mask=mask, width=width, one=one):
                if width == 1:
                    drafter.write_context(one, slots, kv, slots)
                    return
                out = drafter.draft(tokens[:, 0], slots, mask, kv, slots)
                torch.softmax(drafter.logits(out[:, 1:]), dim=-1)
        else:
            mask = additive_mask(attention_allowed(state, slots, context + width), target.dtype)
            hidden = torch.zeros(batch, width, drafter.feature_size, dtype=target.dtype, device=device)

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
    widths = sorted({1} | {s.width for s in strategies if s.kind == "tree"}
                    | {s.depth + 1 for s in strategies if s.kind == "block"})
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
