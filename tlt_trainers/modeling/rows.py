"""The per-row state of a batch being decoded, dropped together when rows finish.

Every per-row tensor lives in a buffer with room for ``reserved`` rows (a CUDA-graph bucket at least as large as
the batch) and the live rows are its first ``size`` rows, a view. Dropping finished rows moves the last live rows
into their places inside the same buffers (:func:`~.kv_cache.compaction_plan`), so nothing is ever re-allocated: a
graph captured over the first ``bucket`` rows (:meth:`ActiveRows.padded`) keeps reading and writing the right
memory for the whole call. Rows past the live ones are dead: ``live`` is False there, and a step advances nothing
of theirs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kv_cache import RowState, compact_in_place, compaction_plan

# The KV spans of passes traced into graphs: KV_SPAN_STEP * 2**i slots, capped at the capacity (see ``kv_span``)
KV_SPAN_STEP = 256


def kv_span(needed: int, capacity: int) -> int:
    """The KV length a pass replayed from a graph attends over when it needs ``needed`` slots: the smallest
    ``KV_SPAN_STEP * 2**i`` at least ``needed``, capped at ``capacity``.

    A graph fixes its shapes, so its attention cannot follow the rows' lengths step by step; spanning the whole
    capacity would make every step of a short answer in a large session pay for the capacity (scores, softmax and,
    off CPU, SDPA's per-head copies of K/V over every slot). Doubling spans keep the cost within 2x of the work (and
    at least ``KV_SPAN_STEP``) with a few graphs per shape: log2(capacity / KV_SPAN_STEP) + 1 of them.
    """
    span = KV_SPAN_STEP
    while span < needed:
        span *= 2
    return min(span, capacity)


class ActiveRows:
    """Everything that has one entry per active row; ``compact`` drops finished rows from all of it.

    Fields the engine and the proposers share: ``index`` [B] (the row's place in the caller's batch), ``seq``
    [B, capacity] (prompt, committed tokens, the pending one), ``state`` (the policy cache's ``RowState``),
    ``generated`` [B], ``live`` [B] (True: a row of the batch; False only in a :meth:`padded` view), ``presence``
    [B, V] or None (tokens seen, for the repetition penalty), ``features`` [B, capacity, H] or None (the policy's
    hidden states per slot), ``cache``, and the drafter's ``draft_state`` and ``draft_kv`` (None without a drafter).
    """

    TENSORS = ("index", "seq", "generated", "live", "presence", "features")

    def __init__(self, state: RowState, draft_state: RowState | None, cache, draft_kv, reserved: int = 0,
                 **tensors: torch.Tensor | None):
        batch = tensors["seq"].shape[0]
        self.reserved = max(reserved, batch)
        self._size = batch
        self.state, self.draft_state, self.cache, self.draft_kv = state, draft_state, cache, draft_kv
        self._full: dict[str, torch.Tensor | None] = {}
        tensors.setdefault("live", torch.ones(batch, dtype=torch.bool, device=tensors["seq"].device))
        for name in self.TENSORS:
            self._full[name] = self._reserve(tensors.get(name))
        for row_state in (state, draft_state):
            if row_state is not None:
                row_state.pad, row_state.length = self._reserve(row_state.pad), self._reserve(row_state.length)
        if self._full["live"] is not None:
            self._full["live"][batch:] = False
        self.features_used = 0  # slots of ``features`` ever written (what compaction must move)
        # Host-side bounds, read back once per step with the step's counts (rollout.Rollout._read_report), so that
        # no pass reads a device tensor to size itself: the largest ``state.length`` and ``state.length -
        # draft_state.length`` of any live row, and the fewest tokens any live row has generated. Compaction keeps
        # them valid (a maximum over fewer rows is no larger, a minimum no smaller).
        self.max_length = 0
        self.max_behind = 0
        self.min_generated = 0
        # Host copies where the host works on tokens (rollout history): each live row's place in the caller's
        # batch, and its tokens (prompt without padding, then everything committed), extended by the step's read.
        self.host_index: list[int] = list(range(batch))
        self.host_tokens: list[list[int]] | None = None
        self.static_span: int | None = None  # a padded view traced into a graph: the KV span of all its passes

    def _reserve(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor`` [batch, ...] copied into a buffer of ``reserved`` rows (the extra rows repeat row 0: valid
        values for a dead row to compute on)."""
        if tensor is None or tensor.shape[0] == self.reserved:
            return tensor
        extra = tensor[:1].expand(self.reserved - tensor.shape[0], *tensor.shape[1:])
        return torch.cat([tensor, extra])

    def __getattr__(self, name: str):
        full = self.__dict__.get("_full")
        if full is not None and name in full:
            value = full[name]
            return None if value is None else value[: self._size]
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:
        if name in ActiveRows.TENSORS and "_full" in self.__dict__:
            if value is not None and value.shape[0] < self.reserved:  # a new buffer (features, allocated late)
                value = self._reserve(value)
            self._full[name] = value
            return
        super().__setattr__(name, value)

    @property
    def size(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return self._full["seq"].shape[1]

    def kv_bound(self, extra: int) -> int:
        """Cache slots a pass must span when rows write up to ``extra`` slots past their length: the host's bound,
        or in a view traced into a graph its ``static_span`` (the step's graph is keyed by it, so every pass of the
        step spans it; :func:`kv_span` of the host's bound for the step's widest pass)."""
        needed = min(self.max_length + extra, self.capacity)
        if self.static_span is None:
            return needed
        if needed > self.static_span:
            raise RuntimeError(f"A traced step's pass needs {needed} cache slots, more than the {self.static_span} "
                               "its graph spans: the step's span was computed from too small a bound (a bug).")
        return self.static_span

    def padded(self, bucket: int) -> ActiveRows:
        """A view of the first ``bucket`` rows (the live ones, then dead ones) over the same buffers, for a step
        traced into a graph of that batch size."""
        if bucket > self.reserved:
            raise ValueError(f"ActiveRows.padded({bucket}): only {self.reserved} rows are reserved.")
        view = object.__new__(ActiveRows)
        vars(view).update(vars(self))
        vars(view)["_size"] = bucket
        for name in ("state", "draft_state"):
            row_state = getattr(self, name)
            vars(view)[name] = None if row_state is None else row_state.view(bucket)
        return view

    def snapshot(self) -> Callable[[], None]:
        """Save what a step changes in place besides cache slots it rewrites identically (tokens, counts,
        lengths); returns the function that puts it back (a graph's capture check runs the step twice)."""
        buffers = [self._full["seq"], self._full["generated"], self.state._length]
        if self.draft_state is not None:
            buffers.append(self.draft_state._length)
        saved = [(buffer, buffer.clone()) for buffer in buffers]

        def restore() -> None:
            for buffer, copy in saved:
                buffer.copy_(copy)

        return restore

    def share_buffers(self, kept: dict[str, torch.Tensor]) -> None:
        """Move this batch into ``kept``, buffers an earlier batch used (the ones graphs captured then address),
        where shapes and dtypes agree; store this batch's own buffers there otherwise."""
        own = {name: self._full[name] for name in self.TENSORS if name != "presence"}
        for prefix, row_state in (("state", self.state), ("draft_state", self.draft_state)):
            if row_state is not None:
                own[f"{prefix}.pad"], own[f"{prefix}.length"] = row_state._pad, row_state._length
        for name, buffer in own.items():
            if buffer is None:
                continue
            previous = kept.get(name)
            if previous is not None and previous.shape == buffer.shape and previous.dtype == buffer.dtype:
                previous.copy_(buffer)
                buffer = previous
            kept[name] = buffer
            prefix, _, field = name.partition(".")
            if field:
                setattr(getattr(self, prefix), f"_{field}", buffer)
            else:
                self._full[name] = buffer
        if self._full["features"] is None and "features" in kept:  # written before it is read, as a new one
            self._full["features"] = kept["features"]

    def compact(self, finished: list[bool]) -> None:
        """Drop the rows flagged in ``finished`` (one host-side flag per live row), in place."""
        order_list, holes, movers = compaction_plan(finished)
        device = self._full["seq"].device
        holes, movers = (torch.tensor(v, dtype=torch.long).to(device, non_blocking=True) for v in (holes, movers))
        n = len(order_list)
        self.host_index = [self.host_index[i] for i in order_list]
        if self.host_tokens is not None:
            self.host_tokens = [self.host_tokens[i] for i in order_list]
        for name in self.TENSORS:
            buffer = self._full[name]
            if buffer is None:
                continue
            if name == "features":  # [B, capacity, H]: the one large per-row buffer besides the caches
                compact_in_place(buffer, holes, movers, n, 1, self.features_used)
            elif holes.numel():
                buffer[holes] = buffer[movers]
        self._full["live"][n:] = False
        for row_state in (self.state, self.draft_state):
            if row_state is not None:
                row_state.compact(holes, movers, n)
        for cache in (self.cache, self.draft_kv):
            if cache is not None:
                cache.compact(holes, movers, n)
        self._size = n
