"""A KV cache in which every row has its own length.

Speculation makes rows advance by different amounts per step. Instead of copying caches to
realign them, each row writes its new keys at its own offset and rejected entries are simply
overwritten by the next step: rollback is a change of one integer per row. The attention mask
(built here too) tells each query which slots of its row are real.

Slot s of row b holds the token at position s - pad[b] (prompts are left padded), so the
committed slots of a row are exactly [pad[b], length[b]).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def compaction_plan(finished: list[bool]) -> tuple[list[int], list[int], list[int]]:
    """How to drop finished rows (``finished``: one flag per row, on the host) by moving as few as possible: the
    last live rows fill the holes.

    Returns (order [n]: old row of each new row, holes: new rows that receive a row, movers: their old rows).
    Copying only the movers makes compaction cost O(finished rows), not O(batch); planning on the host reads
    nothing back from the device.
    """
    n = len(finished) - sum(bool(f) for f in finished)
    holes = [i for i in range(n) if finished[i]]
    movers = [i for i in range(n, len(finished)) if not finished[i]]
    order = list(range(n))
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    return order, holes, movers


def compact_in_place(buffer: torch.Tensor, holes: torch.Tensor, movers: torch.Tensor, n: int,
                     slot_dim: int, used: int) -> torch.Tensor:
    """Move rows ``movers`` into ``holes`` (only the first ``used`` slots along ``slot_dim``); a view of n rows."""
    if holes.numel():
        index = (holes,) + (slice(None),) * (slot_dim - 1) + (slice(0, used),)
        source = (movers,) + (slice(None),) * (slot_dim - 1) + (slice(0, used),)
        buffer[index] = buffer[source]
    return buffer[:n]


class RowState:
    """Per-row bookkeeping shared by the target's and the drafter's caches: ``pad`` [B] (left padding of each row's
    prompt) and ``length`` [B] (committed slots, pad included), views of the first B rows of buffers that never
    move (see :class:`~.rows.ActiveRows`). Assigning a tensor of B rows writes into them; one of another size (the
    reserved rows) replaces the buffer."""

    def __init__(self, pad: torch.Tensor, length: torch.Tensor):
        self._pad, self._length, self._size = pad, length, pad.shape[0]

    def _assign(self, name: str, value: torch.Tensor) -> None:
        if value.shape[0] == self._size:
            getattr(self, name)[: self._size].copy_(value)
        else:
            setattr(self, name, value)

    @property
    def pad(self) -> torch.Tensor:
        return self._pad[: self._size]

    @pad.setter
    def pad(self, value: torch.Tensor) -> None:
        self._assign("_pad", value)

    @property
    def length(self) -> torch.Tensor:
        return self._length[: self._size]

    @length.setter
    def length(self, value: torch.Tensor) -> None:
        self._assign("_length", value)

    def view(self, rows: int) -> RowState:
        """The first ``rows`` rows of the same buffers."""
        view = RowState(self._pad, self._length)
        view._size = rows
        return view

    def compact(self, holes: torch.Tensor, movers: torch.Tensor, n: int) -> None:
        """Move rows ``movers`` into ``holes`` in place; n rows remain. The rows that leave get length 0, as rows
        that were never live have: a padded graph step computes on them (dead rows), and a stale length, up to the
        longest row that ever ran, would reach past the KV span of the step's graph (``ActiveRows.kv_bound``)."""
        if holes.numel():
            for buffer in (self._pad, self._length):
                buffer[holes] = buffer[movers]
        if n < self._size:
            self._length[n : self._size] = 0
        self._size = n


class RowKV:
    """Key/value buffers [B, H, capacity, D] written at per-row offsets."""

    def __init__(self, capacity: int, reserve_rows: int = 0):
        self.capacity = capacity
        self.reserve_rows = reserve_rows  # rows to allocate at least (a CUDA-graph bucket above the live batch)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.used = 0  # slots ever written: what compaction has to move
        self.storage: tuple[torch.Tensor, torch.Tensor] | None = None  # the full buffers (all rows ever allocated)

    def write(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, kv_len: int):
        """Write [B, H, q, D] states at slots ``index`` [B, q]; return the first ``kv_len`` slots.

        B may exceed the live rows (CUDA-graph padding): rows past them are finished rows of the same storage.
        """
        if self.keys is None:
            b, h, _, d = keys.shape
            rows = max(b, self.reserve_rows)
            self.storage = (keys.new_zeros(rows, h, self.capacity, d), values.new_zeros(rows, h, self.capacity, d))
            self.keys, self.values = self.storage[0][:b], self.storage[1][:b]
        if kv_len > self.capacity:
            raise RuntimeError(f"KV cache overflow: {kv_len} slots needed, {self.capacity} allocated.")
        b, h, q, d = keys.shape
        self.used = max(self.used, kv_len)
        key_buffer, value_buffer = self.keys, self.values
        if b != key_buffer.shape[0]:
            key_buffer, value_buffer = self.storage[0][:b], self.storage[1][:b]
        slot = index[:, None, :, None].expand(b, h, q, d)
        key_buffer.scatter_(2, slot, keys)
        value_buffer.scatter_(2, slot, values.to(value_buffer.dtype))
        return key_buffer[:, :, :kv_len], value_buffer[:, :, :kv_len]

    def reset(self, rows: int) -> None:
        """Start a new batch of ``rows`` rows on the same storage (what a CUDA graph captured keeps reading)."""
        if self.storage is not None:
            if rows > self.storage[0].shape[0]:
                raise ValueError(f"RowKV.reset: {rows} rows do not fit the {self.storage[0].shape[0]} allocated.")
            self.keys, self.values = self.storage[0][:rows], self.storage[1][:rows]
        self.used = 0

    def compact(self, holes: torch.Tensor, movers: torch.Tensor, n: int) -> None:
        """Drop finished rows in place: rows ``movers`` move into ``holes``, the buffers become views of n rows.

        Only the written slots of the moved rows are copied (O(finished rows)), and the storage stays put.
        """
        if self.keys is not None:
            self.keys = compact_in_place(self.keys, holes, movers, n, 2, self.used)
            self.values = compact_in_place(self.values, holes, movers, n, 2, self.used)

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy slots ``source`` [B, m] to ``dest`` [B, m] per row (all reads happen before the writes)."""
        if self.keys is None:
            return
        b = source.shape[0]  # the live rows, or a padded graph step's bucket
        _, h, _, d = self.keys.shape
        src = source[:, None, :, None].expand(b, h, -1, d)
        dst = dest[:, None, :, None].expand(b, h, -1, d)
        for buffer in (self.storage[0][:b], self.storage[1][:b]):
            buffer.scatter_(2, dst, buffer.gather(2, src))

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() * 2


class WritePlan:
    """Where the next forward writes: slots [B, q] and the visible cache length."""

    def __init__(self, index: torch.Tensor, kv_len: int):
        self.index = index
        self.kv_len = kv_len


def plan_writes(state: RowState, num_new: int, kv_len: int) -> WritePlan:
    offsets = torch.arange(num_new, device=state.length.device)
    return WritePlan(state.length[:, None] + offsets, kv_len)


class _RowCacheLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, owner: RowCache, reserve_rows: int = 0):
        super().__init__()
        self.owner = owner
        self.store = RowKV(owner.capacity, reserve_rows)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        plan = self.owner.plan
        return self.store.write(key_states, value_states, plan.index, plan.kv_len)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.plan.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.plan.kv_len if self.owner.plan is not None else 0

    def get_max_length(self) -> int:  # the abstract name from transformers 5.16 on
        return self.owner.capacity

    def get_max_cache_shape(self) -> int:  # the abstract name up to 5.15 (deprecated after)
        return self.owner.capacity


class RowCache(Cache):
    """A transformers ``Cache`` backed by :class:`RowKV`; the engine sets ``plan`` before each forward."""

    def __init__(self, num_layers: int, capacity: int, reserve_rows: int = 0):
        self.capacity = capacity
        self.plan: WritePlan | None = None
        super().__init__(layers=[_RowCacheLayer(self, reserve_rows) for _ in range(num_layers)])

    def reset(self, rows: int) -> None:
        """Reuse the cache's storage for a new batch of ``rows`` rows (stale slots are masked until rewritten)."""
        self.plan = None
        for layer in self.layers:
            layer.store.reset(rows)

    def compact(self, holes: torch.Tensor, movers: torch.Tensor, n: int) -> None:
        for layer in self.layers:
            layer.store.compact(holes, movers, n)

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Move the accepted path of a draft tree into consecutive slots, in every layer."""
        for layer in self.layers:
            layer.store.move(source, dest)

    def nbytes(self) -> int:
        return sum(layer.store.nbytes() for layer in self.layers)


def attention_allowed(state: RowState, query_slots: torch.Tensor, kv_len: int, window: int | None = None):
    """Bool [B, q, kv_len]: query at slot ``query_slots`` [B, q] may attend to key slot s.

    A query sees the committed slots of its row up to itself (causal, no left padding). Padding
    queries see only themselves so that no softmax row is empty.
    """
    slots = torch.arange(kv_len, device=query_slots.device)
    key = slots[None, None, :]
    query = query_slots[:, :, None]
    allowed = (key >= state.pad[:, None, None]) & (key <= query)
    if window is not None:
        allowed &= query - key < window
    return allowed | (key == query)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, q, kv] float mask (0 where allowed, dtype's min elsewhere): works with eager and sdpa."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def tree_attention_allowed(state: RowState, closure: torch.Tensor, positions: torch.Tensor, kv_len: int,
                           window: int | None = None) -> torch.Tensor:
    """Bool [B, 1+N, kv_len] for a draft tree written at slots ``length .. length+N`` of each row.

    Node i sees the committed slots of its row and the slots of its ancestors (and itself), as given by
    ``closure`` [B, 1+N, 1+N]; ``positions`` [B, 1+N] are the nodes' positions (used by sliding windows).
    """
    batch, nodes, _ = closure.shape
    device = closure.device
    slots = torch.arange(kv_len, device=device)
    committed = (slots[None] >= state.pad[:, None]) & (slots[None] < state.length[:, None])
    allowed = committed[:, None, :].expand(batch, nodes, kv_len).clone()
    tree_slots = state.length[:, None] + torch.arange(nodes, device=device)
    allowed.scatter_(2, tree_slots[:, None, :].expand(batch, nodes, nodes), closure)
    if window is not None:
        key_positions = (slots[None] - state.pad[:, None]).expand(batch, kv_len).clone()
        key_positions.scatter_(1, tree_slots, positions)
        near = positions[:, :, None] - key_positions[:, None, :] < window
        diagonal = torch.zeros_like(allowed).scatter_(2, tree_slots[:, :, None], True)
        allowed = (allowed & near) | diagonal
    return allowed


class LayeredKV:
    """A drafter's per-row cache with several decoder layers (block drafters, deeper EAGLE-3): one :class:`RowKV`
    per layer, reset, dropped and moved together."""

    def __init__(self, capacity: int, num_layers: int):
        self.capacity = capacity
        self.layers = [RowKV(capacity) for _ in range(num_layers)]

    @property
    def reserve_rows(self) -> int:
        return self.layers[0].reserve_rows if self.layers else 0

    @reserve_rows.setter
    def reserve_rows(self, rows: int) -> None:
        for layer in self.layers:
            layer.reserve_rows = rows

    def reset(self, rows: int) -> None:
        for layer in self.layers:
            layer.reset(rows)

    def compact(self, holes: torch.Tensor, movers: torch.Tensor, n: int) -> None:
        for layer in self.layers:
            layer.compact(holes, movers, n)

    def move(self, source: torch.Tensor, dest: torch.Tensor) -> None:
        for layer in self.layers:
            layer.move(source, dest)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
