"""Choosing a strategy per step: a sliding-window UCB bandit over expected speedup per batch bucket.

The reward of a strategy at batch size b is its speedup over plain decoding:
``accepted tokens per row and step / (step seconds / plain step seconds)``. Its two factors are
estimated separately because they generalise differently:

* tokens per row and step depend mostly on how well the drafter predicts the policy, so every step
  informs every bucket; a sliding window forgets what a stale drafter did. Which rows are still
  running differs by batch size, though (the tail is the long, often repetitive answers), so a
  bucket with its own observations shrinks the shared estimate toward them.
* the relative cost depends on the batch size and the device: the cost profile predicts it from the plain steps
  the engine ran (or timed passes, where there are some), and every speculative step corrects the prediction for its
  strategy and bucket (see :mod:`.costs`). Nothing known at a batch size means plain decoding there. A speculative
  step is measured against the bucket's recent plain steps: contexts grow during a rollout and a machine's speed
  drifts over minutes (a shared or busy CPU), so only steps close in time compare. When a bucket's plain reference
  is older than ``refresh_steps`` steps, the next step there is plain. The corrections live in the profile, which
  the engine's persistent cost cache carries to the next run; a strategy with ``min_trials`` steps behind its
  correction is costed from it, not explored.

Plain decoding has speedup 1 by definition and is always an arm, so speculation is used only
where it is expected to pay. TLT's table seeds the optimism of the first choices, nothing more.

History proposals cost no compute, so the engine looks at them before choosing: a ``history:K``
arm is valued from this step's proposals (tokens each row is expected to get accepted, from the
match statistics, times a calibration learnt per bucket from earlier history steps) and cut to the chain
length that pays best, or skipped when few rows have a match. At large batch, where verifying
a long chain for every row is dear, history is then used only when most rows have one.

The choice itself (the margin, exploration, the floor, the plain refresh) is made by the decider shared with vLLM
(:class:`~tlt_trainers.adaptive.decider.SpeculationDecider`); this module is the engine's side of it: what an arm is
(a :class:`Strategy`), how a step is priced (the cost profile and its corrections) and how acceptance is learnt.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from ..adaptive.decider import DecisionRules, Estimate, SpeculationDecider
from ..proposers.strategy import NONE, Strategy, tlt_prior
from .costs import CostProfile, log_smoothed, selector_bucket


class StrategySelector:
    """The engine's adapter to the shared decider: strategies priced from the cost profile and learnt acceptance."""

    def __init__(self, strategies: list[Strategy], profile: CostProfile, window: int = 256,
                 exploration: float = 0.1, prior_steps: float = 2.0, cost_smoothing: float = 0.2,
                 explore_below: float = 1.3, min_speedup: float = 1.25, bucket_weight: float = 8.0,
                 refresh_steps: int = 32, cost_pessimism: float = 0.5, min_trials: int = 4,
                 decision_log: int = 4096):
        self.strategies = [s for s in strategies if s.kind != "none"]
        self.profile = profile
        self.window = window
        self.exploration = exploration
        self.prior_steps = prior_steps
        self.cost_smoothing = cost_smoothing
        self.cost_pessimism = cost_pessimism
        self.bucket_weight = bucket_weight
        self.min_trials = min_trials
        self.decider: SpeculationDecider[Strategy] = SpeculationDecider(
            DecisionRules(min_speedup=min_speedup, explore_below=explore_below, refresh_steps=refresh_steps),
            NONE, name=lambda s: s.name)
        self.observed: dict[str, deque] = {s.name: deque() for s in self.strategies}  # (step, tokens per row)
        self.observed_in: dict[tuple[int, str], deque] = {}  # (bucket, strategy) -> (step, tokens per row)
        # bucket -> plain steps' measured / predicted seconds (the bucket's plain pace, local in time); a speculative
        # step's measured / predicted seconds relative to that pace live in ``profile.corrections`` (shared by the
        # engine's selectors and carried to the next run by the persistent cost cache)
        self.pace: dict[int, float] = {}
        # History calibration: (step, bucket, tokens accepted, tokens the proposals' match statistics predicted).
        self.history_calibration_prior = (2.0, 4.0)  # pseudo-counts: accepted, predicted (a 0.5 prior)
        self.history_outcomes: deque = deque()
        self._history_prediction: tuple[Strategy, float] | None = None
        # What it tried, when, and what it measured: one record each time a bucket's choice changes, completed by
        # that step's measurement (``decisions``; bounded).
        self.decisions: deque = deque(maxlen=decision_log)
        self._open_decision: dict | None = None

    # --------------------------------------------------------------- the decider's state, under the names it had here
    @property
    def steps(self) -> int:
        """Steps observed (the decider's clock: windows and the plain refresh count them)."""
        return self.decider.steps

    @property
    def min_speedup(self) -> float:
        return self.decider.rules.min_speedup

    @property
    def explore_below(self) -> float:
        return self.decider.rules.explore_below

    @property
    def refresh_steps(self) -> int:
        return self.decider.rules.refresh_steps

    @property
    def plain_seen(self) -> dict[int, int]:
        """Bucket -> step of its latest measured plain step."""
        return self.decider.plain_seen

    @property
    def chosen(self) -> dict[int, dict[str, int]]:
        """Bucket -> strategy name -> steps it was chosen for."""
        return self.decider.chosen

    # --------------------------------------------------------------- estimates
    def _prior(self, strategy: Strategy, batch: int) -> float:
        """Tokens per step assumed before any measurement; TLT's choice for the bucket ranks first.

        The first draft token counts 0.45, roughly how often a drafter warmed on the policy's answers gets it
        accepted, each further level 0.25: valuing the first level like the later ones would rank ``chain:1``,
        the cheapest arm, below what it pays, and it would rarely be tried."""
        levels = max(strategy.depth, 0.6 * strategy.history_tokens)
        value = 1.0 + 0.25 * levels + (0.2 if levels >= 1 else 0.0)
        if strategy == tlt_prior(batch):
            value += 0.5
        return min(value, strategy.max_emitted)

    def _recent(self, strategy: Strategy, bucket: int | None = None) -> deque:
        recent = self.observed[strategy.name] if bucket is None else self.observed_in.get((bucket, strategy.name))
        if recent is None:
            return deque()
        while recent and recent[0][0] <= self.steps - self.window:
            recent.popleft()
        return recent

    def acceptance(self, strategy: Strategy, batch: int, optimism: bool = False) -> float:
        """Tokens per row and step: windowed mean with the prior as pseudo-observations, shrunk toward this
        bucket's own observations (``bucket_weight`` pseudo-counts for the shared mean), plus a UCB bonus.

        Optimistically, an arm seen fewer than ``min_trials`` times in the window is valued at no less than its
        prior: at batch 1 one step of ``chain:1`` is a single accept/reject draw, and one unlucky rejection
        would otherwise rule the arm out for good (the bonus alone is too small to bring it back). The same
        holds for its cost in a bucket (see :meth:`speedup`): one slow step must not lock a cheap arm out.
        """
        measured, optimistic = self._acceptance_pair(strategy, batch)
        return optimistic if optimism else measured

    def _acceptance_pair(self, strategy: Strategy, batch: int) -> tuple[float, float]:
        """:meth:`acceptance` without and with optimism, from one pass over the window."""
        recent = self._recent(strategy)
        n = len(recent) + self.prior_steps
        prior = self._prior(strategy, batch)
        mean = (sum(a for _, a in recent) + self.prior_steps * prior) / n
        own = self._recent(strategy, selector_bucket(batch))
        if own:
            mean = (sum(a for _, a in own) + self.bucket_weight * mean) / (len(own) + self.bucket_weight)
        optimistic = max(mean, prior) if len(recent) < self.min_trials else mean
        optimistic += self.exploration * math.sqrt(math.log(self.steps + 2) / n) * (strategy.max_emitted - 1)
        return min(mean, strategy.max_emitted), min(optimistic, strategy.max_emitted)

    def relative_cost(self, strategy: Strategy, batch: int, corrected: bool = True) -> float:
        """Seconds of a step with ``strategy`` per plain step at this batch size.

        The profile's ratio, times what speculative steps in this bucket measured against the plain pace of their
        time (see :meth:`observe`). Corrections may raise the ratio above the profile's (overheads it cannot see),
        never lower it below that ratio, nor below 1: the profile is fastest-of-repeats and capped by larger work
        (:func:`.costs.monotone_envelope`), and what reads lower is a burst of slowness during the plain steps.
        """
        if strategy.kind == "none":
            return 1.0
        plain = self.profile.step_seconds(NONE, batch)
        if not (math.isfinite(plain) and plain > 0):
            return math.inf  # nothing known at this batch size yet: plain decoding measures it
        profiled = self.profile.step_seconds(strategy, batch) / plain
        floor = profiled if self.profile.timed(strategy) else 1.0  # a prior from the plain curve is no floor
        if not corrected:
            return max(profiled, 1.0)
        ratio = profiled * self.correction(strategy, batch)
        return max(ratio, floor, 1.0)

    def correction(self, strategy: Strategy, batch: int) -> float:
        """Measured / predicted seconds of the strategy's steps in this bucket, against the plain pace of their time."""
        return self.profile.corrections.get((selector_bucket(batch), strategy.name), (1.0, 0))[0]

    def cost_samples(self, strategy: Strategy, batch: int) -> int:
        """Steps behind the strategy's cost correction in this bucket (this run's and the cached runs')."""
        return self.profile.corrections.get((selector_bucket(batch), strategy.name), (1.0, 0))[1]

    def estimate(self, strategy: Strategy, batch: int) -> Estimate[Strategy]:
        """The strategy's price for the decider. Optimism is about what few steps measured: acceptance below
        ``min_trials`` steps in the window is valued at no less than the prior (see :meth:`acceptance`), and a timed
        cost is not doubted on a few slow steps (noise); a prior from the plain curve is replaced by the first step's
        measurement, which is all there is."""
        samples = self.cost_samples(strategy, batch)
        few_steps = self.profile.timed(strategy) and samples < self.min_trials
        cost = self.relative_cost(strategy, batch)
        tokens, optimistic_tokens = self._acceptance_pair(strategy, batch)
        measured = samples >= self.min_trials and len(self._recent(strategy, selector_bucket(batch))) >= self.min_trials
        return Estimate(strategy, tokens=tokens, cost=cost, optimistic_tokens=optimistic_tokens,
                        optimistic_cost=self.relative_cost(strategy, batch, corrected=False) if few_steps else cost,
                        measured=measured)

    def speedup(self, strategy: Strategy, batch: int, optimism: bool = False) -> float:
        """Expected speedup over plain decoding, as the decider values it. Exploration is optimistic only where a
        wrong guess is cheap (relative cost up to ``explore_below``): acceptance learnt in the tail serves every
        bucket."""
        if strategy.kind == "none":
            return 1.0
        return self.decider.rules.value(self.estimate(strategy, batch), optimism)

    def history_calibration(self, batch: int | None = None) -> float:
        """Tokens accepted per token the match statistics predicted, over the window (history steps only).

        With ``batch``, that bucket's own ratio, shrunk toward the overall one (worth ``prior_steps`` of the
        bucket's steps): matches at large batch (short, diverse contexts early in a rollout) come true less
        often than in the tail's long, repetitive answers.
        """
        while self.history_outcomes and self.history_outcomes[0][0] <= self.steps - self.window:
            self.history_outcomes.popleft()
        accepted, predicted = self.history_calibration_prior
        accepted += sum(a for _, _, a, _ in self.history_outcomes)
        predicted += sum(p for _, _, _, p in self.history_outcomes)
        overall = accepted / predicted
        if batch is None:
            return overall
        bucket = selector_bucket(batch)
        own = [(a, p) for _, b, a, p in self.history_outcomes if b == bucket]
        own_predicted = sum(p for _, p in own)
        if own_predicted <= 0:
            return overall
        weight = self.prior_steps * own_predicted / len(own)
        return (sum(a for a, _ in own) + overall * weight) / (own_predicted + weight)

    def history_speedup(self, arm: Strategy, batch: int, expected: Sequence[float]) -> tuple[float, Strategy]:
        """Best (speedup, chain) for a ``history:K`` arm given this step's proposals: ``expected[w - 1]`` is the
        tokens per row the proposals predict accepted with a chain of w (before calibration)."""
        kappa = self.history_calibration(batch)
        best_value, best = 0.0, arm
        for w in arm.history_widths:
            chain = Strategy("history", history_tokens=w)
            cost = self.relative_cost(chain, batch)
            if not math.isfinite(cost) or w > len(expected):
                continue
            value = (1.0 + kappa * expected[w - 1]) / cost
            if value > best_value:
                best_value, best = value, chain
        return best_value, best

    def history_bound(self, arm: Strategy, batch: int) -> float:
        """The most a ``history:K`` arm could be worth at ``batch``: every proposed token certain to be accepted
        (a chain of w predicts at most w accepted tokens per row)."""
        kappa = self.history_calibration(batch)
        bound = 0.0
        for w in arm.history_widths:
            cost = self.relative_cost(Strategy("history", history_tokens=w), batch)
            if math.isfinite(cost):
                bound = max(bound, (1.0 + kappa * w) / cost)
        return bound

    # --------------------------------------------------------------- decisions
    def choose(self, batch: int,
               history_expected: Sequence[float] | Callable[[], Sequence[float]] | None = None) -> Strategy:
        """The strategy the decider chooses from these prices: the best (optimistic) expected speedup if it beats
        plain decoding by ``min_speedup`` (a predicted gain of a few percent is within the noise of the estimates,
        and plain decoding is the safe bet).

        ``history_expected[w - 1]``: accepted tokens per row this step's history proposals predict for a chain of
        w; given, it values the ``history:K`` arms instead of their running mean. A callable is asked only where
        the arm could win with every proposal accepted: where verification is dear (large batch on a CPU) it
        cannot, and computing proposals for every row of a large batch is a cost outside the forward that is
        better skipped.
        """
        self._history_prediction = None
        expected: Sequence[float] | None = None

        def from_proposals(strategy: Strategy) -> bool:
            return strategy.kind == "history" and history_expected is not None

        def estimate(strategy: Strategy) -> Estimate[Strategy]:
            nonlocal expected
            if not from_proposals(strategy):
                return self.estimate(strategy, batch)
            if expected is None:
                expected = history_expected() if callable(history_expected) else history_expected
            # Valued from this step's own proposals, nothing optimistic: the speedup of the chain that pays best,
            # given to the decider as that many tokens at the cost of one plain step (none pays: unknown)
            value, chain = self.history_speedup(strategy, batch, expected)
            return Estimate(chain, tokens=value, cost=1.0 if value > 0 else math.inf)

        def bound(strategy: Strategy) -> float:
            return self.history_bound(strategy, batch) if from_proposals(strategy) else math.inf

        decision = self.decider.choose(batch, self.strategies, estimate, bound)
        best = decision.arm
        if best.kind == "history" and expected is not None:
            self._history_prediction = (best, expected[best.history_tokens - 1] * batch)
        if decision.changed:
            self._open_decision = {"step": self.steps + 1, "batch": batch, "strategy": best.name,
                                   "expected_speedup": round(decision.expected_speedup, 4),
                                   "relative_cost": round(self.relative_cost(best, batch), 4)}
            self.decisions.append(self._open_decision)
        return best

    def observe(self, strategy: Strategy, batch: int, emitted: int, seconds: float,
                accepted: int | None = None, catch_up_seconds: float = 0.0,
                expected_emitted: float | None = None, costed: bool = True) -> None:
        """Learn from a step: tokens emitted (acceptance), its seconds (cost correction) and, after a history
        step chosen from its proposals, the draft tokens accepted (history calibration).

        ``catch_up_seconds``: time the drafter spent catching up on a long stretch of plain steps (a one-off at
        a switch, paid whichever strategy follows); it is left out of the strategy's cost.
        ``expected_emitted``: the same count with the first draft's 0/1 acceptance replaced by its probability
        (sampled chains): the same expectation, far less noise, so a few steps at batch 1 already say how well
        the drafter does.
        ``costed=False``: the step's seconds include a one-off (a CUDA graph captured during it): only its tokens
        are learnt from, not its cost, nor the plain pace.
        """
        self.decider.step_taken()
        if self._open_decision is not None and costed:  # the step a changed choice led to: what it measured
            plain = self.profile.step_seconds(NONE, batch)
            self._open_decision.update(
                seconds=round(seconds, 6), tokens_per_row=round(emitted / batch, 4),
                measured_relative_cost=round(seconds / plain, 4) if math.isfinite(plain) and plain > 0 else None)
            self._open_decision = None
        prediction, self._history_prediction = self._history_prediction, None
        if prediction is not None and prediction[0] == strategy and accepted is not None:
            self.history_outcomes.append((self.steps, selector_bucket(batch), accepted, prediction[1]))
        bucket = selector_bucket(batch)
        if strategy.kind != "none":
            history = self.observed.get(strategy.name)
            if history is not None:
                per_row = (emitted if expected_emitted is None else expected_emitted) / batch
                history.append((self.steps, per_row))
                self.observed_in.setdefault((bucket, strategy.name), deque()).append((self.steps, per_row))
        if not costed:
            return
        predicted = self.profile.step_seconds(strategy, batch)
        if strategy.kind == "none":
            self.decider.plain_measured(batch)
            if math.isfinite(predicted) and predicted > 0:
                old = self.pace.get(bucket)
                self.pace[bucket] = log_smoothed(old, seconds / predicted, self.cost_smoothing)
            self.profile.observe_plain(batch, seconds)
            return
        if not (math.isfinite(predicted) and predicted > 0):
            return
        if catch_up_seconds:  # keep the catch-up a step pays in a run of speculative steps
            seconds = max(seconds - catch_up_seconds, 0.0) + self.profile.catch_up_seconds(batch)
        ratio = seconds / predicted / self.pace.get(bucket, 1.0)
        key = (bucket, strategy.name)
        old, samples = self.profile.corrections.get(key, (None, 0))
        # Pessimism is learnt fast, optimism slowly: a speculative step dearer than believed is a loss now, one
        # cheaper than believed only a gain forgone.
        alpha = self.cost_smoothing
        if old is not None and ratio > old:
            alpha = max(alpha, self.cost_pessimism)
        self.profile.corrections[key] = (log_smoothed(old, ratio, alpha), samples + 1)  # never windowed

    def summary(self) -> dict:
        """What the selector believes now: acceptance per strategy, relative cost and choices per bucket."""
        buckets = sorted({b for b, _ in self.profile.corrections} | set(self.pace) | set(self.chosen))
        return {
            "acceptance": {s.name: self.acceptance(s, 1) for s in self.strategies},
            "observed_steps": {s.name: len(self._recent(s)) for s in self.strategies},
            "relative_cost": {b: {s.name: self.relative_cost(s, b) for s in self.strategies} for b in buckets},
            "chosen": {b: dict(c) for b, c in self.chosen.items()},
            "history_calibration": self.history_calibration(),
            "history_calibration_by_bucket": {b: self.history_calibration(b) for b in buckets},
        }
