"""vLLM's speculative-decoding counters (``LLM.get_metrics()``) as a plain dataclass."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_PREFIX = "vllm:spec_decode_"
# Prometheus counters carry a _total suffix (their *_created twins are timestamps).
_METRIC = re.compile(r"^vllm:spec_decode_(\w+?)_total(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$")


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative counts since the engine started (subtract two snapshots for one interval).

    ``num_drafts``: draft chains proposed (one per request per decoding step); ``num_draft_tokens``: tokens in them;
    ``num_accepted_tokens``: draft tokens the target accepted; ``accepted_per_position[i]``: drafts whose token i was
    accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = field(default=())

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward: 1 + accepted / drafts (NaN before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens (NaN before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    def _combine(self, other: SpecDecodeCounters, sign: int) -> SpecDecodeCounters:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = tuple(self.accepted_per_position) + (0,) * (n - len(self.accepted_per_position))
        theirs = tuple(other.accepted_per_position) + (0,) * (n - len(other.accepted_per_position))
        return SpecDecodeCounters(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            tuple(a + sign * b for a, b in zip(mine, theirs)),
        )

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, 1)

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, -1)

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "acceptance_length": self.acceptance_length, "acceptance_rate": self.acceptance_rate}


def spec_decode_counters(llm) -> SpecDecodeCounters:
    """Read vLLM's ``vllm:spec_decode_*`` counters from ``llm.get_metrics()`` (summed over engines and labels).

    The counters exist only when the engine logs stats (``LLM(..., disable_log_stats=False)``; ``LLM`` turns stats
    off by default) and speculates (``speculative_config``); otherwise this raises a RuntimeError naming both.
    vLLM keeps its metrics in the process-wide Prometheus registry: subtract a snapshot taken before a call to see
    that call's counts.
    """
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_position: list[int] = []
    seen = False
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "")
        if not name.startswith(_PREFIX):
            continue
        key = name[len(_PREFIX):]
        if key in totals:
            totals[key] += int(metric.value)
            seen = True
        elif key == "num_accepted_tokens_per_pos":
            values = list(getattr(metric, "values", []))
            per_position += [0] * (len(values) - len(per_position))
            for i, value in enumerate(values):
                per_position[i] += int(value)
    if not seen:
        raise RuntimeError(
            "llm.get_metrics() has no vllm:spec_decode_* counters: build the LLM with disable_log_stats=False (LLM's "
            "default is True) and a speculative_config (VLLMDrafterSync.engine_kwargs() sets both)."
        )
    return SpecDecodeCounters(**totals, accepted_per_position=tuple(per_position))


def parse_spec_decode_metrics(text: str) -> SpecDecodeCounters | None:
    """vLLM's ``vllm:spec_decode_*`` counters from a Prometheus ``/metrics`` page (None when it has none)."""
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_position: dict[int, int] = {}
    seen = False
    for line in text.splitlines():
        match = _METRIC.match(line.strip())
        if match is None:
            continue
        key, labels, value = match.groups()
        if key in totals:
            totals[key] += int(float(value))
            seen = True
        elif key == "num_accepted_tokens_per_pos":
            position = re.search(r'position="(\d+)"', labels or "")
            if position is not None:
                index = int(position.group(1))
                per_position[index] = per_position.get(index, 0) + int(float(value))
    if not seen:
        return None
    positions = tuple(per_position.get(i, 0) for i in range(max(per_position) + 1)) if per_position else ()
    return SpecDecodeCounters(**totals, accepted_per_position=positions)
