"""What the rollout engine holds between ``generate()`` calls, and giving it back.

:class:`~.generator.SpeculativeGenerator` keeps a :class:`~.graphs.GraphSession` from one call to the next, so that the
next call replays the graphs the last one captured instead of capturing again: the policy's KV cache for the batch
bucket x capacity, the drafter's KV cache and the rows' buffers (the features the drafter reads among them), each
captured pass's static inputs and (on CUDA) its float32 logits output, the uniforms' buffer, the EOS ids, and on
CUDA the graphs' private memory pools. With a 1.5-7B policy, a 150k vocabulary and a few thousand slots that is
10-30 GB (:func:`session_bytes_formula`), which a training step colocated with the rollout needs back. The trainers
therefore call :func:`give_back` after each rollout unless ``TLTConfig.keep_engine_memory`` keeps it.

What is counted (:func:`held_bytes`, :func:`held_breakdown`): the bytes of the distinct tensor storages the engine's
session reaches (views share a storage and count once), never the policy's or the drafter's own parameters and
buffers. A CUDA graph's private pool holds intermediate tensors no Python object references: those show only in the
CUDA allocator's counters, which :func:`give_back` reports around the release (:class:`Release`).
"""

from __future__ import annotations

import gc
import math
import types
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..modeling.target import TargetModel

# Where the session keeps each part (attribute paths from the GraphSession), in the order a storage is attributed: a
# storage reached from two parts (a graph's static slots written into the cache's plan) counts under the first.
PARTS = (
    ("policy KV cache", ("cache",)),
    ("drafter KV cache", ("draft_kv",)),
    ("rows' buffers (features, tokens)", ("row_buffers",)),
    ("pass graphs' inputs and outputs", ("runner", "graphs")),
    ("step graphs' outputs", ("step_graphs", "entries")),
    ("uniforms", ("streams",)),
    ("EOS ids", ("eos",)),
)
OTHER = "other"

# Objects a walk never enters: the model and the model seen as parts (their weights are the policy's, not the
# engine's), references that do not keep anything alive or lead out of the session, and values that hold no tensor.
_OPAQUE = (nn.Module, TargetModel, weakref.ref, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           torch.Generator, torch.device, torch.dtype, str, bytes, int, float, bool, complex, type(None))


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return str(tensor.device), storage.data_ptr()


def _storage_bytes(tensor: torch.Tensor) -> int:
    return 0 if tensor.device.type == "meta" else tensor.untyped_storage().nbytes()


def _walk_tensors(root, visited: set[int]):
    """Every tensor reachable from ``root`` through containers and this package's objects (their ``__dict__``),
    each object entered once (``visited``: ids). Modules and objects of other libraries are not entered, except
    containers and tensors."""
    stack = [root]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, _OPAQUE):
            continue
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith("tlt_trainers"):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else ())
            stack.extend(getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name))


def _weight_storages(engine) -> set[tuple[str, int]]:
    """The storages of the policy's and the drafter's parameters and buffers: never counted as held by the engine."""
    keys = set()
    for module in (getattr(engine, "model", None), getattr(engine, "drafter", None)):
        if module is None:
            continue
        for tensor in [*module.parameters(), *module.buffers()]:
            key = _storage_key(tensor)
            if key is not None:
                keys.add(key)
    return keys


def _attribute(obj, path: tuple[str, ...]):
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def held_breakdown(engine) -> dict[str, int]:
    """Bytes the engine's kept graph session holds, by part (:data:`PARTS`, then ``"other"`` for anything else it
    reaches); each distinct storage counted once, under the first part that reaches it. Empty when no session is kept
    (``cuda_graphs`` off or not on CUDA, nothing generated yet, or given back)."""
    session = getattr(engine, "_graph_session", None)
    if session is None:
        return {}
    exclude = _weight_storages(engine)
    seen: set[tuple[str, int]] = set()
    visited: set[int] = set()
    out: dict[str, int] = {}
    roots = [(name, _attribute(session, path)) for name, path in PARTS] + [(OTHER, session)]
    for name, root in roots:
        total = 0
        for tensor in _walk_tensors(root, visited):
            key = _storage_key(tensor)
            if key is None or key in seen or key in exclude:
                continue
            seen.add(key)
            total += _storage_bytes(tensor)
        out[name] = out.get(name, 0) + total
    return out


def held_bytes(engine) -> int:
    """Bytes of the distinct tensor storages the engine keeps between ``generate()`` calls (its graph session: the
    caches, the rows' buffers, the graphs' static inputs and outputs, the uniforms and EOS ids), without the
    policy's and the drafter's weights. 0 when nothing is kept. A CUDA graph pool's intermediates are not tensors
    anyone references: :func:`give_back` reports them through the CUDA allocator."""
    return sum(held_breakdown(engine).values())


@dataclass
class Release:
    """What :func:`give_back` freed: the session's tensor bytes, and on CUDA the allocator's counters around the
    release (``allocated_*``: bytes in live tensors, graph pools' outputs included; ``reserved_*``: what the caching
    allocator holds from the device, graph pools and freed blocks included)."""

    held_bytes: int = 0
    session_freed: bool = True  # False: something still references the session (a rollout still running)
    collected: bool = False  # whether the garbage collector had to run (see give_back)
    device: str = "cpu"
    allocated_before: int | None = None
    allocated_after: int | None = None
    reserved_before: int | None = None
    reserved_after: int | None = None
    emptied_cache: bool = False

    @property
    def allocated_freed(self) -> int | None:
        if self.allocated_before is None or self.allocated_after is None:
            return None
        return self.allocated_before - self.allocated_after

    @property
    def reserved_freed(self) -> int | None:
        if self.reserved_before is None or self.reserved_after is None:
            return None
        return self.reserved_before - self.reserved_after


def _cuda_device(engine) -> torch.device | None:
    target = getattr(engine, "target", None)
    device = getattr(target, "device", None)
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device


def give_back(engine, empty_cache: bool = False) -> Release:
    """Drop the engine's kept graph session (:meth:`~.generator.SpeculativeGenerator.release_graphs`) and make sure
    its caches, buffers and graphs are freed now: the next ``generate()`` allocates and captures again.

    A finished rollout can still reference the session from a reference cycle (its drafter runner holds one of its
    bound methods), which only Python's cyclic garbage collector frees, at a time of its choosing: where the session
    outlives the release, the collector runs once here. A rollout still running keeps the session until it ends
    (``Release.session_freed`` is then False).

    ``empty_cache`` (CUDA): also return the freed blocks and the graphs' pools to the device. Needed where another
    process uses the memory next (veRL's rollout server is a Ray actor beside the training workers); not where the
    same process trains next (TRL): its caching allocator reuses the freed blocks, and frees the released graph pools
    itself when an allocation would otherwise fail, while emptying the cache would synchronize and make the next
    rollout and step allocate from the device again."""
    release = Release(held_bytes=held_bytes(engine))
    device = _cuda_device(engine)
    if device is not None:
        release.device = str(device)
        torch.cuda.synchronize(device)
        release.allocated_before = torch.cuda.memory_allocated(device)
        release.reserved_before = torch.cuda.memory_reserved(device)
    session = getattr(engine, "_graph_session", None)
    alive = weakref.ref(session) if session is not None else None
    del session
    engine.release_graphs()
    if alive is not None and alive() is not None:
        gc.collect()
        release.collected = True
    release.session_freed = alive is None or alive() is None
    if device is not None:
        if empty_cache:
            torch.cuda.empty_cache()
            release.emptied_cache = True
        release.allocated_after = torch.cuda.memory_allocated(device)
        release.reserved_after = torch.cuda.memory_reserved(device)
    return release


# ---------------------------------------------------------------------------------------------- computed shapes
@dataclass
class SessionShape:
    """A policy and drafter as the session's formula needs them (:func:`session_bytes_formula`)."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    dtype_bytes: int = 2  # bfloat16
    feature_width: int | None = None  # what the rows' features buffer keeps per slot; None: 3 x hidden (EAGLE-3)
    drafter_layers: int = 1
    drafter_kv_heads: int | None = None  # None: the policy's
    drafter_head_dim: int | None = None

    @classmethod
    def from_config(cls, config, dtype_bytes: int = 2, **overrides) -> SessionShape:
        """From a transformers config (Llama/Qwen2-style fields)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(layers=config.num_hidden_layers, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, hidden=config.hidden_size, vocab=config.vocab_size, dtype_bytes=dtype_bytes,
                   **overrides)


@dataclass
class SessionBytes:
    """The session's parts for one shape, in bytes (:func:`session_bytes_formula`)."""

    policy_kv: int
    drafter_kv: int
    features: int
    logits_outputs: int
    features_outputs: int
    masks: int
    pool_lower_bound: int
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def tensors(self) -> int:
        """What the session's tensors hold (the pools' intermediates not included)."""
        return (self.policy_kv + self.drafter_kv + self.features + self.logits_outputs + self.features_outputs
                + self.masks)


def graph_keys(max_batch: int, query_lengths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(bucket, tokens per row) of every pass graph a rollout of up to ``max_batch`` rows may capture: buckets 1, 2,
    4, ... up to the batch's, one per query length its strategies verify (1: plain decode; k + 1: a chain of k)."""
    top = 1 << max(0, (max_batch - 1).bit_length())
    buckets = [1 << i for i in range(top.bit_length())]
    return [(b, q) for b in buckets for q in query_lengths]


def session_bytes_formula(shape: SessionShape, rows: int, capacity: int,
                          query_lengths: tuple[int, ...] = (1, 5)) -> SessionBytes:
    """Computed (not measured) bytes of a CUDA graph session for ``rows`` rows (the batch bucket) of ``capacity``
    slots whose rollout captured the pass graphs of every bucket up to ``rows`` at ``query_lengths``:

    - the policy's KV cache: keys and values [rows, kv_heads, capacity, head_dim] per layer;
    - the drafter's KV cache: the same for its layers;
    - the rows' features buffer [rows, capacity, feature_width] (what the drafter reads);
    - per captured (bucket, q): the float32 logits output [bucket, q, vocab], the features output
      [bucket, q, feature_width] and the additive mask [bucket, 1, q, capacity] (in the compute dtype);
    - a lower bound of the pools: the largest pass's logits before their float32 copy and one float32 tensor of the
      largest step's probabilities ([rows, max q, vocab] each); the real pools hold more intermediates.

    The rows' token buffers, static ids, uniforms and EOS ids are under 1% of these at these shapes and left out.
    """
    b = shape.dtype_bytes
    width = shape.feature_width if shape.feature_width is not None else 3 * shape.hidden
    d_heads = shape.drafter_kv_heads if shape.drafter_kv_heads is not None else shape.kv_heads
    d_dim = shape.drafter_head_dim if shape.drafter_head_dim is not None else shape.head_dim
    policy_kv = 2 * shape.layers * rows * shape.kv_heads * capacity * shape.head_dim * b
    drafter_kv = 2 * shape.drafter_layers * rows * d_heads * capacity * d_dim * b
    features = rows * capacity * width * b
    keys = graph_keys(rows, query_lengths)
    logits = sum(bucket * q * shape.vocab * 4 for bucket, q in keys)
    feature_outputs = sum(bucket * q * width * b for bucket, q in keys)
    masks = sum(bucket * q * capacity * b for bucket, q in keys)
    widest = rows * max(query_lengths) * shape.vocab
    pool = widest * b + widest * 4
    parts = {"policy KV cache": policy_kv, "drafter KV cache": drafter_kv, "features buffer": features,
             "logits outputs (float32)": logits, "features outputs": feature_outputs, "masks": masks,
             "pools (lower bound)": pool}
    return SessionBytes(policy_kv, drafter_kv, features, logits, feature_outputs, masks, pool, parts)


def gib(n: int | float | None) -> str:
    """Bytes as GiB with 2 decimals ('-' for None)."""
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{n / 2**30:.2f}"


__all__ = ["PARTS", "Release", "SessionBytes", "SessionShape", "give_back", "graph_keys", "held_breakdown",
           "held_bytes", "session_bytes_formula"]
