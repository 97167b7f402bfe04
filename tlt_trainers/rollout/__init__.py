"""The rollout engine: prefill, draft, verify, accept, per-row KV rollback, finished-row compaction."""

from .generator import GenerationResult, SpeculativeGenerator
from .stats import GenerationStats

__all__ = ["GenerationResult", "GenerationStats", "SpeculativeGenerator"]
