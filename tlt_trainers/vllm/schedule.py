"""The speculative length per running-batch-size bucket on vLLM, chosen from what the running engine measures.

``speculation="adaptive"`` means on vLLM what it means in TLT's own engine: speculate only where it pays, decided by
the same rules (:class:`~tlt_trainers.adaptive.decider.SpeculationDecider`: the margin, exploration, the 0.97x floor,
the plain refresh). vLLM speculates with a per-batch-size schedule (its ``num_speculative_tokens_per_batch_size``: K
draft tokens per request while b requests run, 0 = off); :class:`AdaptiveSpeculation` keeps that schedule and is
vLLM's side of the decider: its arm is the draft length, priced from two measurements taken from the steps the
engine runs anyway (no profiling pass):

* **the step cost** per power-of-two batch bucket and draft length (0 = plain), an exponential moving average of
  the seconds a decode step took (:meth:`observe_step`). Steps that mix prefill in, or that change the draft length
  (the first step after a switch verifies the old length and proposes the new one), are not counted. A bucket whose
  plain steps are not measured yet is not priced (plain decoding measures it); a length not measured in a bucket
  costs what the plain steps over as many rows predict (TLT's cost model, :mod:`tlt_trainers.rollout.costs`), at
  least what the nearest smaller measured bucket costs, and 1 where the plain steps do not cover its size yet.
* **the drafter's live acceptance**, from the per-request draft and accepted-token counts vLLM's own
  ``spec_decode`` counters are made of, over a window of recent drafts. ``accepted_per_position[i] / drafts`` is
  the chance that at least i + 1 draft tokens are accepted, so a draft of length K yields
  ``1 + sum(accepted_per_position[:K]) / drafts`` tokens per verify step. Until ``trial_steps`` steps have drafted
  (after a start, a drafter update or a weight reload) it is valued at no less than its prior, and it stands only
  while drafts keep coming: without a draft for ``explore_interval`` steps (doubling after each such retry, up to
  ``max_explore_interval``; a weight change resets it) the prior replaces it, so a length that lost is retried
  after a vanishing share of steps, and a drafter that got better is found. A push may carry the acceptance the
  drafter's training measured (:func:`acceptance_from_top1`), which then stands in for the prior.

It also counts what speculation saved (``saved_seconds``): each timed speculative step's tokens at the bucket's plain
cost per token, minus what the step took. The payback budget of drafter training (:mod:`tlt_trainers.online.payback`)
is paid from it.

Pure Python, no vLLM: :mod:`tlt_trainers.vllm.scheduler` feeds it from inside vLLM's scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..adaptive.decider import DecisionRules, Estimate, SpeculationDecider
from ..proposers.strategy import NONE, parse_strategy
from ..rollout.costs import CostProfile, selector_bucket


@dataclass(frozen=True)
class SpeculationSettings:
    """What :class:`AdaptiveSpeculation` decides with; the defaults suit CPUs and GPUs alike. The rules' settings
    (``min_gain``, ``floor``, ``explore_below``, ``refresh_steps``, ``max_speculative_batch_size``) are those of
    :class:`~tlt_trainers.adaptive.decider.DecisionRules`, with TLT's engine's defaults."""

    num_speculative_tokens: int = 3
    max_speculative_batch_size: int | None = None  # never speculate above this many running requests
    min_gain: float = 0.25  # speculate where expected to be at least this much faster than plain (min_speedup - 1)
    trial_steps: int = 4  # drafting steps before acceptance is believed over its prior (exploration's minimum)
    refresh_steps: int = 32  # re-measure plain in a bucket when its latest plain step is this many steps old
    explore_interval: int = 32  # steps without a draft after which acceptance is unknown again (doubles per retry)
    max_explore_interval: int = 1024
    window_drafts: int = 512  # acceptance over the most recent drafts
    cost_smoothing: float = 0.3  # weight of the newest step in a cost's moving average
    prior_accepted_per_position: tuple[float, ...] = (0.5, 0.3, 0.2, 0.1)  # before any draft: worth one trial
    drafter_share: float = 0.05  # a drafter pass per plain step over as many rows, before one is measured
    cost_cache: str = "auto"  # where measured costs are kept between runs ('auto', a directory, or 'off')
    floor: float = 0.97  # never keep a length whose measured speedup is below this
    explore_below: float = 1.3  # optimism about acceptance only where a step costs at most this many plain steps

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1.")
        if self.max_speculative_batch_size is not None and self.max_speculative_batch_size < 1:
            raise ValueError("max_speculative_batch_size must be >= 1 (or None: decided from measured costs).")
        if self.trial_steps < 1 or self.refresh_steps < 1 or self.explore_interval < 1:
            raise ValueError("trial_steps, refresh_steps and explore_interval must be >= 1.")

    def rules(self) -> DecisionRules:
        """The shared decider's settings."""
        return DecisionRules(min_speedup=1.0 + self.min_gain, floor=self.floor, explore_below=self.explore_below,
                             refresh_steps=self.refresh_steps, max_batch=self.max_speculative_batch_size)


@dataclass
class _Cost:
    seconds: float = math.nan
    samples: int = 0


@dataclass
class _Bucket:
    steps: int = 0  # decisions taken in this bucket
    length: int = 0  # the length in force
    costs: dict[int, _Cost] = field(default_factory=dict)


class AdaptiveSpeculation:
    """Choose vLLM's draft length per batch bucket with the shared decider, priced from measured step costs and live
    acceptance (module doc)."""

    def __init__(self, settings: SpeculationSettings | None = None):
        self.settings = settings or SpeculationSettings()
        self.decider: SpeculationDecider[int] = SpeculationDecider(self.settings.rules(), 0)
        self.buckets: dict[int, _Bucket] = {}
        # The cost model of TLT's own engine (rollout/costs.py), fed with the plain steps: it predicts what a bucket
        # not measured yet costs, from the plain steps over as many rows (a verify of k + 1 tokens per request)
        self.profile = CostProfile(drafter_share=self.settings.drafter_share)
        self._drafts: deque[tuple[int, tuple[int, ...]]] = deque()  # (drafts, accepted per position) per step
        self._window = [0, [0] * self.settings.num_speculative_tokens]
        self._stale = False  # drafts seen so far belong to weights that have been replaced
        self._drafting_steps = 0  # steps with drafts since acceptance was last unknown (exploration's count)
        self._retries = 0  # retries after acceptance lapsed (each doubles the next interval)
        self.decisions: list[dict] = []  # changes of the length in force, with what they were decided on
        self.drafter_updates = 0
        self.steps = 0
        self.speculative_steps = 0
        self._last_draft_step = 0
        self._expected_acceptance: tuple[float, ...] | None = None  # the pushed drafter's, from its training
        self.saved_seconds = 0.0  # what speculation saved against plain decoding (negative: lost), summed over steps
        self._timed_draft_step: tuple[int, float] | None = None  # (batch, seconds) of the step whose drafts come next

    # ----------------------------------------------------------------- acceptance
    def observe_drafts(self, drafts: int, accepted_per_position: list[int] | tuple[int, ...]) -> None:
        """One step's drafts: how many requests carried a draft and, per position i, how many had token i accepted."""
        if drafts <= 0:
            return
        self._count_saving(sum(int(a) for a in accepted_per_position))
        if self._stale:
            self._clear_window()
        elif self._window[0] and not self._acceptance_stands():
            self._retries += 1  # a retry after acceptance lapsed: the next one waits twice as long
            self._drafting_steps = 0
        k = self.settings.num_speculative_tokens
        row = tuple(int(a) for a in list(accepted_per_position)[:k]) + (0,) * max(0, k - len(accepted_per_position))
        self._drafts.append((int(drafts), row))
        self._last_draft_step = self.steps
        self._drafting_steps += 1
        self._window[0] += int(drafts)
        self._window[1] = [a + b for a, b in zip(self._window[1], row)]
        while len(self._drafts) > 1 and self._window[0] - self._drafts[0][0] >= self.settings.window_drafts:
            old, old_row = self._drafts.popleft()
            self._window[0] -= old
            self._window[1] = [a - b for a, b in zip(self._window[1], old_row)]

    def _count_saving(self, accepted: int) -> None:
        """The seconds the last timed speculative step saved: its batch's tokens plus the ``accepted`` draft tokens
        at the bucket's plain cost per token, minus what the step took. Steps not timed (switches, prefill) and
        buckets whose plain steps are not measured count nothing."""
        timed, self._timed_draft_step = self._timed_draft_step, None
        if timed is None:
            return
        batch, seconds = timed
        plain = self._cost(selector_bucket(batch), 0)
        if math.isfinite(plain):
            self.saved_seconds += (batch + accepted) / batch * plain - seconds

    @property
    def observed_drafts(self) -> int:
        return self._window[0]

    def expected_tokens(self, length: int) -> float:
        """Tokens per verify step with drafts of ``length`` (1 = plain), from the acceptance window (the prior
        before any draft)."""
        if length <= 0:
            return 1.0
        drafts, accepted = self._window
        if drafts == 0:
            return self._prior_tokens(length)
        return 1.0 + sum(accepted[:length]) / drafts

    def _acceptance_stands(self) -> bool:
        """Whether the window says what drafting would yield now: drafts of these weights, and recent ones."""
        s = self.settings
        interval = min(s.explore_interval * 2 ** min(self._retries, 30), s.max_explore_interval)
        return bool(self._window[0]) and not self._stale and self.steps - self._last_draft_step <= interval

    def note_drafter_update(self, expected_acceptance: Sequence[float] | None = None) -> None:
        """The drafter's weights changed: forget its acceptance and try it again where it lost.

        ``expected_acceptance[i]``: the chance that at least i + 1 draft tokens are accepted, as the trainer expects
        it (:func:`acceptance_from_top1`). It stands in for the fixed prior until the new weights' drafts are
        measured, so a drafter that trained well is tried even where a step costs more than the prior could pay
        for, and one that did not is not tried where it cannot pay."""
        self.drafter_updates += 1
        self._clear_window()
        self._retries = 0
        if expected_acceptance is not None:  # () : the trainer has no figure for these weights: the fixed prior
            values = [float(v) for v in expected_acceptance]
            if not all(0.0 <= v <= 1.0 for v in values):
                raise ValueError(f"expected_acceptance={values!r}: give one chance in [0, 1] per draft position.")
            self._expected_acceptance = tuple(values) or None

    def note_weights_may_have_changed(self) -> None:
        """Weights were reloaded, the policy's or the drafter's (vLLM's prefix cache was reset, as after every weight
        sync): drafts made from now on replace the acceptance window, which is not believed until then (the prior
        stands in), and the back-off restarts, so a drafter that got better is tried again."""
        self._stale = True
        self._drafting_steps = 0
        self._retries = 0

    def _clear_window(self) -> None:
        self._drafts.clear()
        self._window = [0, [0] * self.settings.num_speculative_tokens]
        self._stale = False
        self._drafting_steps = 0

    # ----------------------------------------------------------------- costs
    def _bucket(self, batch: int) -> _Bucket:
        return self.buckets.setdefault(selector_bucket(batch), _Bucket())

    def observe_step(self, batch: int, length: int, seconds: float) -> None:
        """A decode step of ``batch`` requests that verified and proposed drafts of ``length`` (0: plain)."""
        self._timed_draft_step = None
        if batch < 1 or not (seconds > 0) or not math.isfinite(seconds):
            return
        if length > 0:
            self._timed_draft_step = (batch, seconds)
        bucket = self._bucket(batch)
        cost = bucket.costs.setdefault(length, _Cost())
        alpha = self.settings.cost_smoothing
        cost.seconds = seconds if cost.samples == 0 else (1 - alpha) * cost.seconds + alpha * seconds
        cost.samples += 1
        if length == 0:
            self.profile.observe_plain(batch, seconds)
            self.decider.plain_measured(batch)

    def _cost(self, bucket_key: int, length: int) -> float:
        cost = self.buckets.get(bucket_key, _Bucket()).costs.get(length)
        return cost.seconds if cost is not None and cost.samples else math.nan

    def cost_ratio(self, bucket_key: int, length: int) -> float:
        """cost(length) / cost(plain) measured at this bucket (NaN where either is not measured)."""
        return self._cost(bucket_key, length) / self._cost(bucket_key, 0)

    def relative_cost(self, batch: int, length: int) -> float:
        """A step of ``length`` per plain step at this batch size, as the decisions price it: measured where both
        are, predicted where the length is not (:meth:`_unmeasured_ratio`), unknown (inf) where plain is not. Never
        below 1, as in TLT's engine: a speculative step does a plain step's work and more, so a ratio that reads
        lower is a burst of slowness during the plain steps (a busy machine's noise is one-sided)."""
        key = selector_bucket(batch)
        if math.isnan(self._cost(key, 0)):
            return math.inf
        own = self.cost_ratio(key, length)
        return max(own if not math.isnan(own) else self._unmeasured_ratio(key, batch, length), 1.0)

    def value(self, batch: int, length: int) -> float:
        """Expected tokens per second relative to plain decoding at this batch size (NaN: cost unknown)."""
        return 1.0 if length == 0 else self.expected_tokens(length) / self.cost_ratio(selector_bucket(batch), length)

    # ----------------------------------------------------------------- decisions
    def estimate(self, batch: int, length: int) -> Estimate[int]:
        """The length's price for the decider: acceptance from the window while it stands (else the prior), valued
        at no less than the prior for the first ``trial_steps`` drafting steps; the cost of :meth:`relative_cost`."""
        stands = self._acceptance_stands()
        prior = self._prior_tokens(length)
        tokens = self.expected_tokens(length) if stands else prior
        exploring = not stands or self._drafting_steps < self.settings.trial_steps
        samples = self.buckets.get(selector_bucket(batch), _Bucket()).costs.get(length, _Cost()).samples
        return Estimate(length, tokens=tokens, cost=self.relative_cost(batch, length),
                        optimistic_tokens=max(tokens, prior) if exploring else None,
                        measured=not exploring and samples >= self.settings.trial_steps)

    def choose(self, batch: int) -> int:
        """The draft length for a step of ``batch`` running requests (0: plain)."""
        k = self.settings.num_speculative_tokens
        self.steps += 1
        bucket = self._bucket(batch)
        bucket.steps += 1
        decision = self.decider.choose(batch, (k,), lambda length: self.estimate(batch, length))
        self.decider.step_taken()
        return self._set(decision.bucket, bucket, decision.arm, decision.reason)

    def _unmeasured_ratio(self, key: int, batch: int, length: int | None = None) -> float:
        k = self.settings.num_speculative_tokens if length is None else length
        known = [b for b in self.buckets if b < key and not math.isnan(self.cost_ratio(b, k))]
        smaller = self.cost_ratio(max(known), k) if known else 1.0
        if not self.profile.plain or batch * (k + 1) > max(self.profile.plain):
            return smaller  # the plain steps do not cover a verify of this size yet: no prediction beyond them
        chain = parse_strategy(f"chain:{k}")
        predicted = self.profile.step_seconds(chain, batch) / self.profile.step_seconds(NONE, batch)
        return max(smaller, predicted) if math.isfinite(predicted) else smaller

    # ----------------------------------------------------------------- kept between runs
    def to_dict(self) -> dict:
        """The measured costs (for the persistent cost cache, :mod:`tlt_trainers.rollout.cost_cache`)."""
        return {"buckets": {str(key): {str(length): [c.seconds, c.samples] for length, c in bucket.costs.items()
                                       if c.samples}
                            for key, bucket in sorted(self.buckets.items())},
                "profile": self.profile.to_dict()}

    def merge_dict(self, data: dict) -> None:
        """Start from costs an earlier run measured; entries that do not parse are skipped. The plain reference of
        each bucket is re-measured before it is compared against (as if ``refresh_steps`` had passed)."""
        for key, costs in (data.get("buckets") or {}).items():
            for length, value in (costs or {}).items() if isinstance(costs, dict) else ():
                try:
                    key_, length_, seconds, samples = int(key), int(length), float(value[0]), int(value[1])
                except (TypeError, ValueError, IndexError):
                    continue
                if key_ >= 1 and 0 <= length_ and math.isfinite(seconds) and seconds > 0 and samples >= 1:
                    bucket = self.buckets.setdefault(key_, _Bucket())
                    bucket.costs[length_] = _Cost(seconds, samples)
                    if length_ == 0:
                        self.decider.plain_seen[key_] = self.decider.steps - self.settings.refresh_steps
        if isinstance(data.get("profile"), dict):
            self.profile.merge_dict(data["profile"])

    def _prior_tokens(self, length: int) -> float:
        prior = self._expected_acceptance or self.settings.prior_accepted_per_position
        return 1.0 + sum(prior[i] if i < len(prior) else 0.0 for i in range(length))

    def _set(self, key: int, bucket: _Bucket, length: int, reason: str) -> int:
        self.speculative_steps += length > 0
        if length != bucket.length:
            self.decisions.append({
                "step": self.steps, "bucket": key, "length": length, "reason": reason,
                "expected_tokens": round(self.expected_tokens(self.settings.num_speculative_tokens), 3),
                "cost_ratio": round(self.cost_ratio(key, self.settings.num_speculative_tokens), 3),
                "drafts": self.observed_drafts, "drafter_updates": self.drafter_updates})
            bucket.length = length
        return length

    # ----------------------------------------------------------------- the schedule
    def schedule(self) -> dict[int, int]:
        """The length in force per bucket (upper end of the bucket's batch sizes -> length)."""
        return {key: bucket.length for key, bucket in sorted(self.buckets.items())}

    def state(self) -> dict:
        """Everything the decisions rest on, for logs and metrics."""
        k = self.settings.num_speculative_tokens
        return {
            "schedule": self.schedule(),
            "expected_tokens": self.expected_tokens(k),
            "drafts": self.observed_drafts,
            "drafter_updates": self.drafter_updates,
            "saved_seconds": self.saved_seconds,
            "steps": self.steps,
            "speculative_steps": self.speculative_steps,
            "costs": {key: {length: round(c.seconds, 6) for length, c in bucket.costs.items() if c.samples}
                      for key, bucket in sorted(self.buckets.items())},
        }


def acceptance_from_top1(top1_by_step: Sequence[float] | float, length: int) -> tuple[float, ...]:
    """The chance that at least i + 1 of ``length`` greedy draft tokens are accepted, from the drafter's training
    agreement with the policy's top token (``top1_by_step``: per unrolled step, or one figure for all): the product
    of the agreements up to position i, the last one repeated past the unrolled steps. NaN or no figure: ().
    Agreement on the batches just trained on runs above held-out acceptance; the scheduler measures the truth within
    ``trial_steps`` drafting steps."""
    from ..drafter.trainer import acceptance_by_position  # not at import: vLLM's scheduler loads this module

    values = [top1_by_step] if isinstance(top1_by_step, (int, float)) else list(top1_by_step)
    values = [float(v) for v in values]
    if not values or not all(math.isfinite(v) for v in values):
        return ()
    return tuple(acceptance_by_position([min(max(v, 0.0), 1.0) for v in values], length))


def engine_scheduler(llm) -> Any | None:
    """The scheduler of an ``LLM`` whose engine core runs in this process (None where it runs in another)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    core = getattr(client, "engine_core", None)
    return getattr(core, "scheduler", None)
