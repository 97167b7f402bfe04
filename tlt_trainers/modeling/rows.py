"""The per-row state of a batch being decoded, dropped together when rows finish."""

from __future__ import annotations

import torch

from .kv_cache import compact_in_place, compaction_plan


class ActiveRows:
    """Everything that has one entry per active row; ``compact`` drops finished rows from all of it.

    Fields the engine and the proposers share: ``index`` [B] (the row's place in the caller's batch), ``seq``
    [B, capacity] (prompt, committed tokens, the pending one), ``state`` (the policy cache's ``RowState``),
    ``generated`` [B], ``presence`` [B, V] or None (tokens seen, for the repetition penalty), ``features``
    [B, capacity, H] or None (the policy's hidden states per slot), ``cache``, and the drafter's ``draft_state``
    and ``draft_kv`` (None without a drafter).
    """

    def __init__(self, **tensors):
        self.names = list(tensors)
        for name, value in tensors.items():
            setattr(self, name, value)
        self.features_used = 0  # slots of ``features`` ever written (what compaction must move)

    @property
    def size(self) -> int:
        return self.seq.shape[0]

    @property
    def capacity(self) -> int:
        return self.seq.shape[1]

    def compact(self, finished: torch.Tensor) -> None:
        order, holes, movers = compaction_plan(finished)
        n = order.shape[0]
        for name in self.names:
            value = getattr(self, name)
            if value is None:
                continue
            if hasattr(value, "compact"):
                value.compact(holes, movers, n)
            elif hasattr(value, "select") and not isinstance(value, torch.Tensor):
                value.select(order)
            elif name == "features":  # [B, capacity, H]: the one large per-row buffer besides the caches
                setattr(self, name, compact_in_place(value, holes, movers, n, 1, self.features_used))
            else:
                setattr(self, name, value.index_select(0, order))
