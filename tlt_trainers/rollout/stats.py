"""What a generate() call measured: acceptance, token counts, time, memory, per batch-size bucket."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 1 << 30))


def bucket_name(batch_size: int) -> str:
    for low, high in BUCKETS:
        if low <= batch_size <= high:
            return str(low) if low == high else (f"{low}+" if high >= 1 << 30 else f"{low}-{high}")
    raise ValueError(batch_size)


@dataclass
class BucketStats:
    steps: int = 0
    speculative_steps: int = 0
    row_forwards: int = 0  # sum over steps of active rows: policy forwards per row
    emitted_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    seconds: float = 0.0

    @property
    def acceptance_length(self) -> float:
        return self.emitted_tokens / self.row_forwards if self.row_forwards else 0.0


@dataclass
class StepRecord:
    """One engine step: the active rows, the strategy used, tokens emitted and seconds taken."""

    batch_size: int
    strategy: str
    emitted: int
    seconds: float


@dataclass
class GenerationStats:
    """Counters of one generate() call. ``acceptance_length`` is tokens emitted per policy forward per row."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    row_forwards: int = 0
    steps: int = 0
    speculative_steps: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    peak_cache_bytes: int = 0
    drafted_rows: int = 0  # row-steps that verified at least one draft
    first_accepted: int = 0  # of those, the ones whose first draft was accepted
    history_proposed: int = 0  # tokens proposed from rollout history
    history_bytes: int = 0  # memory held by the history index after the call
    buckets: dict[str, BucketStats] = field(default_factory=dict)
    strategies: dict[str, dict[str, int]] = field(default_factory=dict)  # bucket -> strategy -> steps
    trace: list[StepRecord] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        return self.generated_tokens_in_steps / self.row_forwards if self.row_forwards else 0.0

    @property
    def generated_tokens_in_steps(self) -> int:
        return sum(b.emitted_tokens for b in self.buckets.values())

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def first_draft_acceptance(self) -> float:
        """Share of speculating row-steps whose first draft token was accepted."""
        return self.first_accepted / self.drafted_rows if self.drafted_rows else 0.0

    def record_step(self, batch_size: int, emitted: int, drafted: int, accepted: int, seconds: float,
                    strategy: str = "none", first_accepted: int = 0) -> None:
        name = bucket_name(batch_size)
        bucket = self.buckets.setdefault(name, BucketStats())
        chosen = self.strategies.setdefault(name, {})
        chosen[strategy] = chosen.get(strategy, 0) + 1
        self.trace.append(StepRecord(batch_size, strategy, emitted, seconds))
        bucket.steps += 1
        bucket.speculative_steps += int(drafted > 0)
        bucket.row_forwards += batch_size
        bucket.emitted_tokens += emitted
        bucket.draft_tokens += drafted
        bucket.accepted_tokens += accepted
        bucket.seconds += seconds
        self.steps += 1
        self.speculative_steps += int(drafted > 0)
        self.row_forwards += batch_size
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.drafted_rows += batch_size if drafted else 0
        self.first_accepted += first_accepted

    def to_dict(self) -> dict:
        data = asdict(self)
        data["acceptance_length"] = self.acceptance_length
        data["draft_acceptance_rate"] = self.draft_acceptance_rate
        for name, bucket in self.buckets.items():
            data["buckets"][name]["acceptance_length"] = bucket.acceptance_length
        return data


class RolloutCounters:
    """GenerationStats summed over the generate() calls of one rollout (the trainers' metrics)."""

    FIELDS = ("emitted_tokens", "row_forwards", "draft_tokens", "accepted_tokens", "decode_steps",
              "speculative_steps", "history_proposed")

    def __init__(self):
        self.values = dict.fromkeys(self.FIELDS, 0)

    def add(self, stats) -> None:
        self.values["emitted_tokens"] += stats.generated_tokens_in_steps
        self.values["row_forwards"] += stats.row_forwards
        self.values["draft_tokens"] += stats.draft_tokens
        self.values["accepted_tokens"] += stats.accepted_tokens
        self.values["decode_steps"] += stats.steps
        self.values["speculative_steps"] += stats.speculative_steps
        self.values["history_proposed"] += stats.history_proposed

    def add_spec_decode(self, counts) -> None:
        """Add vLLM's speculative-decoding counts of one interval (``tlt_trainers.vllm.SpecDecodeCounters``): each
        draft is one verify pass of one row, which emits its accepted tokens plus one."""
        drafts = counts.num_drafts
        self.values["emitted_tokens"] += drafts + counts.num_accepted_tokens
        self.values["row_forwards"] += drafts
        self.values["draft_tokens"] += counts.num_draft_tokens
        self.values["accepted_tokens"] += counts.num_accepted_tokens
        self.values["decode_steps"] += drafts
        self.values["speculative_steps"] += drafts

    @property
    def acceptance_length(self) -> float:
        rows = self.values["row_forwards"]
        return self.values["emitted_tokens"] / rows if rows else float("nan")


class StepTimer:
    """Adds the time of a phase (``prefill``, ``draft``, ``verify``, ``decode``) to ``stats.<phase>_seconds``.

    On CUDA a phase is timed by CUDA events, read once they have completed (:meth:`flush`, after the step's one
    read has waited for the device anyway): the loop never synchronizes the device to time itself. Elsewhere, the
    host's clock (the host runs the ops)."""

    def __init__(self, stats: GenerationStats, device: torch.device):
        self.stats, self.device = stats, device
        self.events = device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []  # (phase, start event, end event) not yet read

    def now(self) -> float:
        return time.perf_counter()

    def mark(self):
        """A point in the device's timeline: a recorded CUDA event on CUDA (the host never waits for it), the
        host's clock elsewhere. Two marks give seconds with :meth:`seconds_between` once the device passed both."""
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds_between(self, start, end) -> float:
        """Seconds between two :meth:`mark` s (on CUDA, waits for ``end``: call it after the step's one read)."""
        if self.events:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start

    def _add(self, name: str, seconds: float) -> None:
        field_name = f"{name}_seconds"
        setattr(self.stats, field_name, getattr(self.stats, field_name) + seconds)

    @contextmanager
    def phase(self, name: str):
        if self.events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, time.perf_counter() - start)

    def flush(self, wait: bool = False) -> None:
        """Add the phases whose events have completed (all of them with ``wait``: the end of a call)."""
        if not self._pending:
            return
        if wait:
            self._pending[-1][2].synchronize()
        keep = []
        for name, start, end in self._pending:
            if end.query():
                self._add(name, start.elapsed_time(end) / 1000.0)
            else:
                keep.append((name, start, end))
        self._pending = keep
