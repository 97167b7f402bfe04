"""One decider of when and how much to speculate, for TLT's own engine and for vLLM's scheduler.

An engine step either decodes plainly or speculates with one *arm*: a :class:`~tlt_trainers.proposers.strategy.
Strategy` in TLT's engine (chains, trees, blocks, history), a draft length on vLLM. Each engine prices its arms its own
way, because what it can observe differs (per-strategy tokens and a timed cost table in TLT's engine; vLLM's
per-position acceptance counters and the seconds between scheduler calls), and hands the decider an
:class:`Estimate` per arm and batch size: tokens per row and step, and the step's cost relative to a plain step.
The decider owns every rule of the choice, so a fix to "when to speculate" is made here once:

* **plain is the default**: speculation is chosen only where some arm is priced; where nothing is known (no plain
  step measured yet), the step is plain, which measures it.
* **one margin**, ``min_speedup`` (1.25 by default): an arm is chosen when its expected speedup over plain decoding,
  ``tokens / cost``, exceeds it. Both engines estimate costs from steps timed on busy machines and acceptance from
  a few hundred drafts; a predicted gain of a few percent is within that noise, and a wrong "on" is a loss now
  while a wrong "off" is only a gain forgone. vLLM's ``min_gain`` used to be 0.03: with it a drafter whose true
  speedup is 1.0 is switched on by noise alone, which is how vLLM's adaptive path fell under 0.97x of plain decoding.
  ``SpeculationSettings.min_gain`` maps onto it (``min_speedup = 1 + min_gain``).
* **exploration is optimism about what was not measured**, nothing else: an arm with fewer than the engine's
  minimum of trials is valued at its optimistic estimate (the prior of its acceptance, the uncorrected cost),
  and optimism about acceptance only where a wrong guess is cheap (cost up to ``explore_below`` plain steps).
  vLLM's trials of a fixed number of steps are this rule with its ``trial_steps`` as the minimum of trials; its
  back-off is how long its acceptance stands without drafts (an estimate of the adapter, not a rule here).
* **the floor**: an arm whose measured speedup (no optimism) is under ``floor`` (0.97) is never chosen, whatever
  an optimistic estimate says. Optimism may try an arm; once measured, it may not keep a losing one (a margin set
  below the floor, e.g. to test switching, lowers the floor with it).
* **one refresh**: speculative costs are relative to the bucket's plain pace, and contexts grow and machines
  drift, so only steps close in time compare. When a bucket's latest measured plain step is ``refresh_steps`` (32)
  steps old, the next steps there are plain until one is measured. TLT's engine counted steps of the whole rollout,
  vLLM steps of the bucket (64): drift is a matter of time, so steps of the whole engine count here, and vLLM
  re-measures after 32 of them.
* **a batch cap**: above ``max_batch`` running rows nothing is speculated.

Costs and choices are kept per power-of-two batch bucket (:func:`.buckets.selector_bucket`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .buckets import selector_bucket

Arm = TypeVar("Arm")


@dataclass(frozen=True)
class Estimate(Generic[Arm]):
    """What an engine knows about one arm at one batch size.

    ``arm``: the arm a step would run (it may differ from the arm asked about: TLT's history arms are cut to the
    chain length that pays). ``tokens``: tokens per row and step expected from the measurements (the arm's prior
    where there are none). ``cost``: seconds of a step with the arm per plain step at this batch size (inf: unknown).
    ``optimistic_tokens`` / ``optimistic_cost``: the same while the arm is being explored (None: no optimism).
    ``measured``: enough steps of the arm in this bucket that its price is a measurement, not a guess (the floor
    applies to it).
    """

    arm: Arm
    tokens: float
    cost: float
    optimistic_tokens: float | None = None
    optimistic_cost: float | None = None
    measured: bool = False


@dataclass(frozen=True)
class DecisionRules:
    """The settings of the rules in the module doc (what both engines map their settings onto)."""

    min_speedup: float = 1.25
    floor: float = 0.97
    explore_below: float = 1.3
    refresh_steps: int = 32
    max_batch: int | None = None

    def __post_init__(self):
        if self.refresh_steps < 1:
            raise ValueError(f"refresh_steps={self.refresh_steps} must be >= 1.")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch} must be >= 1 (or None: no cap).")

    @property
    def effective_floor(self) -> float:
        """The floor, or the margin where that is set lower (a margin below the floor asks for losing arms)."""
        return min(self.floor, self.min_speedup)

    def value(self, estimate: Estimate, optimism: bool = True) -> float:
        """Expected speedup over plain decoding (0 where the cost is unknown). Optimistically, the uncorrected cost,
        and the optimistic acceptance where that cost is at most ``explore_below`` plain steps."""
        cost = estimate.cost
        if optimism and estimate.optimistic_cost is not None:
            cost = estimate.optimistic_cost
        if not (math.isfinite(cost) and cost > 0):
            return 0.0
        tokens = estimate.tokens
        if optimism and estimate.optimistic_tokens is not None and cost <= self.explore_below:
            tokens = estimate.optimistic_tokens
        return tokens / cost


@dataclass(frozen=True)
class Decision(Generic[Arm]):
    """One step's choice: the arm (the plain arm when not speculating), its expected speedup (1 for plain), why, and
    whether it changed the bucket's choice (the bucket's first decision counts as a change)."""

    arm: Arm
    speculative: bool
    expected_speedup: float
    reason: str
    bucket: int
    changed: bool


class SpeculationDecider(Generic[Arm]):
    """The rules of the module doc over arms priced by an engine.

    The engine calls :meth:`choose` before a step, :meth:`step_taken` once per step it runs (its clock) and
    :meth:`plain_measured` after a plain step whose seconds it measured (the bucket's plain reference).
    """

    def __init__(self, rules: DecisionRules, plain: Arm, name: Callable[[Arm], str] = str):
        self.rules = rules
        self.plain = plain
        self._name = name
        self.steps = 0
        self.plain_seen: dict[int, int] = {}  # bucket -> the step of its latest measured plain step
        self.in_force: dict[int, Arm] = {}  # bucket -> the arm of its latest decision
        self.chosen: dict[int, dict[str, int]] = {}  # bucket -> arm name -> decisions
        self.last_decision: Decision[Arm] | None = None

    # ---------------------------------------------------------------- the engine's clock
    def step_taken(self) -> None:
        """One engine step ran (whatever it decoded with)."""
        self.steps += 1

    def plain_measured(self, batch: int) -> None:
        """A plain step at ``batch`` was measured: the bucket's plain reference is fresh."""
        self.plain_seen[selector_bucket(batch)] = self.steps

    def stale(self, bucket: int) -> bool:
        """Whether the bucket's plain reference is ``refresh_steps`` steps old (never measured: not stale, the
        engine's prediction is its reference)."""
        seen = self.plain_seen.get(bucket)
        return seen is not None and self.steps - seen >= self.rules.refresh_steps

    # ---------------------------------------------------------------- the choice
    def choose(self, batch: int, arms: Iterable[Arm], estimate: Callable[[Arm], Estimate[Arm]],
               bound: Callable[[Arm], float] | None = None) -> Decision[Arm]:
        """The arm for a step of ``batch`` rows. ``estimate(arm)`` prices an arm; ``bound(arm)``, where given, is the
        most it could be worth, and an arm bounded below the best so far is not priced (pricing may cost: TLT's
        history proposals for every row of a large batch)."""
        rules = self.rules
        bucket = selector_bucket(batch)
        previous = self.in_force.get(bucket, self.plain)
        best, best_value, best_measured = self.plain, rules.min_speedup, False
        previous_value, priced = None, False
        if rules.max_batch is not None and batch > rules.max_batch:
            reason = f"above max batch size {rules.max_batch}"
        else:
            for arm in arms:
                if bound is not None and bound(arm) <= best_value:
                    continue
                found = estimate(arm)
                value = rules.value(found)
                priced = priced or value > 0
                measured_value = rules.value(found, optimism=False)
                if found.arm == previous:
                    previous_value = measured_value if found.measured else value
                if found.measured and measured_value < rules.effective_floor:
                    continue  # measured to lose: optimism may not bring it back
                if value > best_value:
                    best, best_value, best_measured = found.arm, value, found.measured
            if best != self.plain and self.stale(bucket):
                best, reason = self.plain, "plain refresh"
            elif best != self.plain:
                reason = f"pays ({best_value:.2f}x)" if best_measured else f"trial (best case {best_value:.2f}x)"
            elif previous != self.plain and previous_value is not None:
                reason = f"loses ({previous_value:.2f}x)"
            else:
                reason = "off" if priced else "measuring plain"
        speculative = best != self.plain
        changed = bucket not in self.in_force or best != previous
        self.in_force[bucket] = best
        counts = self.chosen.setdefault(bucket, {})
        counts[self._name(best)] = counts.get(self._name(best), 0) + 1
        self.last_decision = Decision(best, speculative, best_value if speculative else 1.0, reason, bucket, changed)
        return self.last_decision
