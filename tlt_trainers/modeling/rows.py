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
        # Host-side bounds, read back once per step with the step's counts (rollout.Rollout._settle), so that no
        # pass reads a device tensor to size itself: the largest ``state.length`` and ``state.length -
        # draft_state.length`` of any live row, and the fewest tokens any live row has generated. Compaction keeps
        # them valid (a maximum over fewer rows is no larger, a minimum no smaller).
        self.max_length = 0
        self.max_behind = 0
        self.min_generated = 0
        # Host copies where the host works on tokens (rollout history): each live row's place in the caller's
        # batch, and its tokens (prompt without padding, then everything committed), extended by the step's read.
        self.host_index: list[int] = list(range(self.size))
        self.host_tokens: list[list[int]] | None = None

    @property
    def size(self) -> int:
        return self.seq.shape[0]

    @property
    def capacity(self) -> int:
        return self.seq.shape[1]

    def compact(self, finished: list[bool]) -> None:
        """Drop the rows flagged in ``finished`` (one host-side flag per row)."""
        order_list, holes, movers = compaction_plan(finished)
        device = self.seq.device
        order, holes, movers = (torch.tensor(v, dtype=torch.long).to(device, non_blocking=True)
                                for v in (order_list, holes, movers))
        n = len(order_list)
        self.host_index = [self.host_index[i] for i in order_list]
        if self.host_tokens is not None:
            self.host_tokens = [self.host_tokens[i] for i in order_list]
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
