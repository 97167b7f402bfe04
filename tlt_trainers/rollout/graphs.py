"""CUDA graphs for the policy's decode and verify passes.

At small batch a decode step is dominated by kernel launches, not arithmetic: replaying a captured
graph removes them. A graph fixes every shape and address, so the engine runs graph steps on static
buffers: the batch is padded up to a bucket (1, 2, 4, 8, ...) with rows that already finished
(in-place compaction leaves live rows first, so rows past them are dead and free to compute
garbage), attention spans a KV length bucket (:func:`~tlt_trainers.modeling.rows.kv_span`: 256, 512,
1024, ... slots, at least the rows' longest length plus the pass's tokens, capped at the capacity; the
mask hides the unused slots), and inputs are copied into per-shape static tensors before each replay.
One graph is captured per (bucket, tokens per row, KV span) on first use; the runner keeps at most
:data:`~.step_graphs.MAX_GRAPHS` of them, the least recently used going first.

EAGLE-3 drafters read the residual streams entering a few of the policy's layers. Forward hooks collect them
(:func:`~tlt_trainers.modeling.features.capture_features`); hooks are Python, so they run while a graph is being
captured, not at replay, but what they record there, the concatenation of the tapped layers, is a tensor the graph
writes on every replay: the features come out of the graph like the logits do, as static outputs.

Every capture is checked before its graph is used: the warm-up runs the pass eagerly on the static inputs, the
graph's first replay runs it again on the same inputs, and the two outputs (logits and the drafter's features, on a
few live rows) must agree (:data:`GRAPH_TOLERANCE`: replays are normally bit-identical; the margin is for reductions
whose order may differ between streams, far below what a graph that reads or writes the wrong memory produces). A
disagreement, or an exception while capturing or replaying, makes that pass eager again and switches graphs off for
that model class on that device for the rest of the process, with one warning. The check sees the capture's own
inputs: it catches a capture that fails, reads memory it does not own or computes something else, not a value the
capture baked in that later steps would change (the static-buffer path the CPU tests run covers those inputs).

``mode="static"`` runs the same static-buffer path without capturing, on any device: the CPU tests
use it to check that padding, KV-span masks and static inputs change nothing.
"""

from __future__ import annotations

import logging
import weakref

import torch

from ..modeling.features import capture_features
from ..modeling.kv_cache import RowCache, WritePlan
from ..sampling.distribution import SamplingScalars
from .capture import capture_context
from .step_graphs import MAX_GRAPHS, StepGraphs, make_room, reset_failed_step_captures, touch
from .step_probe import graph_region

logger = logging.getLogger(__name__)

# Largest difference between a graph's first replay and the eager pass, relative to the tensor's scale
GRAPH_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
GRAPH_TOLERANCE_16BIT = 5e-2  # float16 / bfloat16 passes (as flash-attn's check)

# (device, model class, reads EAGLE-3 features) -> why CUDA graphs are off for it in this process
_FAILED: dict[tuple, str] = {}
_CHECKS: list[dict] = []  # every capture's self-check in this process (benchmarks/gpu_check.py reports them)


def graph_self_checks() -> list[dict]:
    """The self-check of every graph captured in this process: device, model, features, (bucket, tokens per row),
    whether the first replay agreed with the eager pass, the difference, and the reason if not."""
    return list(_CHECKS)


def reset_graph_self_checks() -> None:
    """Forget the checks and switch graphs back on where a check failed, whole-step graphs included (tests)."""
    _CHECKS.clear()
    _FAILED.clear()
    reset_failed_step_captures()


def graph_bucket(batch: int) -> int:
    return 1 << max(0, (batch - 1).bit_length())


def _model_key(target, feature_layers) -> tuple:
    return str(target.device), type(target.model).__name__, feature_layers is not None


def _scale_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| relative to 1 + max |expected| (0 when bit-identical; inf on a shape or NaN mismatch)."""
    if got.shape != expected.shape:
        return float("inf")
    if torch.equal(got, expected):
        return 0.0
    got, expected = got.float(), expected.float()
    error = float((got - expected).abs().max() / (1 + expected.abs().max()))
    return error if error == error else float("inf")  # NaN: not equal


class GraphRunner:
    """Runs ``target.forward`` + ``target.logits`` for [batch, q] inputs on static buffers, replaying CUDA graphs."""

    def __init__(self, target, cache: RowCache, max_batch: int, capacity: int, mode: str = "cuda",
                 feature_layers: tuple[int, ...] | None = None, max_graphs: int | None = None):
        if mode not in ("cuda", "static"):
            raise ValueError(f"GraphRunner mode must be 'cuda' or 'static', got {mode!r}.")
        self.target, self.cache, self.max_batch, self.capacity, self.mode = target, cache, max_batch, capacity, mode
        self.feature_layers = feature_layers  # None: the drafter reads the final hidden state
        # (bucket, tokens per row, KV span) -> (static inputs, graph, outputs), least recently used first
        self.graphs: dict[tuple[int, int, int], tuple] = {}
        self.max_graphs = MAX_GRAPHS if max_graphs is None else max_graphs
        self.pool = None
        self.captures = 0  # CUDA graphs captured
        self.capture_attempts = 0  # captures tried, failed ones included (a step that tried one prices nothing)
        self.shapes_prepared = 0  # (bucket, tokens per row, span) set up: a capture ("cuda"), its dry run ("static")
        self.replays = 0
        self.disabled: str | None = None  # why this runner went back to eager passes (a failed self-check)

    @staticmethod
    def mode_for(setting: str, device: torch.device, target, feature_layers: tuple[int, ...] | None) -> str | None:
        """The runner a rollout uses for ``TLTConfig.cuda_graphs=setting``: "cuda" (capture) with 'auto' on CUDA
        unless a self-check failed for this model class in this process, "static" with 'static', else None."""
        if setting == "static":
            return "static"
        if setting == "auto" and device.type == "cuda" and _model_key(target, feature_layers) not in _FAILED:
            return "cuda"
        return None

    def supports(self, batch: int) -> bool:
        return self.disabled is None and graph_bucket(batch) <= self.max_batch

    def _static_inputs(self, bucket: int, q: int, span: int, masks: dict) -> dict:
        """Inputs of one (bucket, q, span) graph; padding rows write at the last ``q`` slots of the span."""
        device = self.target.device
        return {
            "tokens": torch.zeros(bucket, q, dtype=torch.long, device=device),
            "positions": torch.zeros(bucket, q, dtype=torch.long, device=device),
            "slots": (span - q + torch.arange(q, device=device)).expand(bucket, q).contiguous(),
            "masks": {name: torch.zeros(bucket, 1, q, span, dtype=m.dtype, device=device)
                      for name, m in masks.items()},
            "span": span,
        }

    def _run(self, static: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the drafter's features, logits) of one eager pass over the static inputs (as a capture records it: on
        the policy's device, without autocast's weight cache)."""
        with capture_context(self.target.device), graph_region():
            return self._pass(static)

    def _pass(self, static: dict) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.plan = WritePlan(static["slots"], static["span"])
        masks = static["masks"]
        mask = masks["full"] if set(masks) == {"full"} else {
            "full_attention": masks["full"], "sliding_attention": masks["sliding"]}
        if self.feature_layers is None:
            hidden = self.target.forward(static["tokens"], static["positions"], mask, self.cache)
            return hidden, self.target.logits(hidden)
        with capture_features(self.target.decoder, self.feature_layers) as captured:
            hidden = self.target.forward(static["tokens"], static["positions"], mask, self.cache)
        return captured[-1][0], self.target.logits(hidden)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 masks: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's features (the final hidden states, or EAGLE-3's tapped layers) and logits [batch, q, ...]
        of the live rows.

        ``masks`` maps "full" (and "sliding" for sliding-window models) to additive masks [batch, 1, q, span]: the
        pass attends over the first ``span`` cache slots (a :func:`~tlt_trainers.modeling.rows.kv_span`, which
        must hold ``slots``), and one graph serves each (batch bucket, q, span).
        """
        batch, q = tokens.shape
        bucket = graph_bucket(batch)
        span = next(iter(masks.values())).shape[-1]
        key = (bucket, q, span)
        entry = touch(self.graphs, key)
        if entry is None:
            make_room(self.graphs, self.max_graphs)  # the least recently used graph (and its outputs) go
            static = self._static_inputs(bucket, q, span, masks)
            entry = self.graphs[key] = (static, None, None)
            self.shapes_prepared += 1
        static = entry[0]
        static["tokens"][:batch].copy_(tokens)
        static["positions"][:batch].copy_(positions)
        static["slots"][:batch].copy_(slots)
        for name, mask in masks.items():
            buffer = static["masks"][name]
            buffer[:batch].copy_(mask)
            # Padding rows attend to their own (scratch) slot only: no empty softmax row, nothing live touched.
            if batch < bucket:
                buffer[batch:].fill_(torch.finfo(buffer.dtype).min)
                steps = torch.arange(q, device=buffer.device)
                buffer[batch:, 0, steps, span - q + steps] = 0
        if batch < bucket:
            static["slots"][batch:] = span - q + torch.arange(q, device=tokens.device)
        if self.mode == "static":
            features, logits = self._run(static)
        else:
            graph, outputs = entry[1], entry[2]
            if graph is None:
                outputs = self._capture_checked(key, static, batch)
            else:
                graph.replay()
            features, logits = outputs
        self.replays += 1
        return features[:batch], logits[:batch]

    def _capture_checked(self, key: tuple[int, int], static: dict, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Warm up, capture, replay once and compare with the warm-up's eager outputs (same inputs). Returns the
        outputs of this pass: the graph's where it agrees, else an eager pass's (graphs then go off, one warning)."""
        self.capture_attempts += 1
        try:
            # A few live rows of the eager outputs are kept for the comparison (logits [bucket, q, V] are large)
            rows = torch.tensor(sorted({0, 1, batch // 2, batch - 1} & set(range(batch))), device=self.target.device)
            eager = [t.index_select(0, rows) for t in self._warm_up(static)]
            graph, outputs = self._record(static)
            graph.replay()
            errors = [_scale_difference(got.index_select(0, rows), expected)
                      for got, expected in zip(outputs, eager, strict=True)]
        except Exception as exc:  # noqa: BLE001 - any failure to capture or replay means: stay eager
            errors, reason = [float("inf")], f"{type(exc).__name__} while capturing or replaying: {exc}"
        else:
            dtype = eager[0].dtype
            tolerance = GRAPH_TOLERANCE.get(dtype, GRAPH_TOLERANCE_16BIT)
            reason = None if max(errors) <= tolerance else (
                f"first replay differs from the eager pass by {max(errors):.3g} of the outputs' scale "
                f"(features, logits: {', '.join(f'{e:.3g}' for e in errors)}; tolerance {tolerance:g} in {dtype})")
        model_name, features = _model_key(self.target, self.feature_layers)[1:]
        _CHECKS.append({"device": str(self.target.device), "model": model_name, "eagle3_features": features,
                        "bucket": key[0], "tokens_per_row": key[1], "agrees": reason is None,
                        "difference": max(errors), "reason": reason})
        if reason is None:
            self.graphs[key] = (static, graph, outputs)
            self.captures += 1
            return outputs
        self._give_up(reason)
        # Eager once more: this pass's cache slots hold what the eager pass writes, whatever the replay wrote there
        return self._run(static)

    def _give_up(self, reason: str) -> None:
        self.disabled = reason
        self.graphs.clear()
        key = _model_key(self.target, self.feature_layers)
        if key in _FAILED:
            return
        _FAILED[key] = reason
        taps = "with EAGLE-3 feature taps" if key[2] else "of the final hidden state"
        logger.warning("TLT: CUDA graphs of %s's decode/verify passes (%s) on %s failed their self-check: %s. "
                       "These passes run eagerly for the rest of the process (the same tokens; small-batch steps "
                       "pay their kernel launches again). cuda_graphs='off' silences this; please report it with "
                       "your GPU, torch and transformers versions.", key[1], taps, key[0], reason)

    def _warm_up(self, static: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager passes on the static inputs (on a side stream on CUDA, as capture requires), which are also this
        step's real pass: the cache writes are idempotent. Returns the last one's outputs."""
        device = static["tokens"].device
        if device.type != "cuda":
            return self._run(static)
        with capture_context(device):  # the side stream on the policy's device, whatever this thread's is
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    outputs = self._run(static)
            torch.cuda.current_stream().wait_stream(stream)
            for tensor in outputs:  # read on this stream, allocated on the side one
                tensor.record_stream(torch.cuda.current_stream())
        return outputs

    def _record(self, static: dict):
        """Capture the pass into a CUDA graph: (graph, its static outputs)."""
        with capture_context(static["tokens"].device):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._run(static)
        self.pool = graph.pool()
        return graph, outputs


def parameters_key(*modules) -> tuple:
    """Where the modules' parameters live: graphs read them by address, so weights updated in place (an optimizer
    step, a drafter reload) keep a graph valid, and re-allocated ones (``load_state_dict(assign=True)``, ``.to()``)
    invalidate it."""
    return tuple((p.data_ptr(), p.dtype, tuple(p.shape)) for m in modules if m is not None for p in m.parameters())


# Capacities are rounded up to a multiple of this, so calls whose prompts differ a little reuse one set of graphs
CAPACITY_STEP = 256


class GraphSession:
    """The policy's cache and graph runner, kept by the engine across ``generate()`` calls: a later call with a
    batch bucket and capacity that fit replays the graphs captured by an earlier one (the cache's storage, which
    they read, stays put; its rows are reset). One rollout holds it at a time."""

    def __init__(self, target, max_batch: int, capacity: int, mode: str, feature_layers, params_key: tuple):
        self.max_batch, self.capacity, self.mode = graph_bucket(max_batch), capacity, mode
        self.feature_layers, self.params_key = feature_layers, params_key
        self.cache = target.new_cache(capacity, reserve_rows=self.max_batch)
        self.runner = GraphRunner(target, self.cache, self.max_batch, capacity, mode=mode,
                                  feature_layers=feature_layers)
        # Values the step graphs read from device memory, written by each call before its steps (not in their keys)
        self.sampling = SamplingScalars(target.device)
        self.max_new = torch.zeros((), dtype=torch.long, device=target.device)
        self.holder = None  # a weak reference to the rollout using it
        # Whole-step graphs and what they address besides the cache: the rows' buffers, the drafter's cache, the
        # uniforms' buffers per bucket and the EOS ids (tlt_trainers.rollout.step_graphs)
        self.step_graphs = StepGraphs(mode, target.device, type(target.model).__name__)
        self.row_buffers: dict[str, torch.Tensor] = {}
        self.draft_kv = None
        self.streams: dict = {}  # the uniforms of traced steps per batch bucket (one buffer, "all")
        self.eos: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def capacity_for(needed: int) -> int:
        return -(-needed // CAPACITY_STEP) * CAPACITY_STEP

    def fits(self, batch: int, capacity: int, mode: str, feature_layers, params_key: tuple) -> bool:
        """Whether a call of ``batch`` rows needing ``capacity`` slots can use this session. A larger capacity is
        no obstacle: graphs attend over KV spans that follow the rows' lengths, not over the capacity."""
        return (self.runner.disabled is None
                and graph_bucket(batch) <= self.max_batch
                and capacity <= self.capacity and mode == self.mode
                and feature_layers == self.feature_layers and params_key == self.params_key)

    def in_use(self) -> bool:
        holder = self.holder() if self.holder is not None else None
        return holder is not None and holder.rows.size > 0

    def release(self, rollout) -> None:
        """Let go of the session if ``rollout`` holds it (a rollout an exception ended)."""
        if self.holder is not None and self.holder() is rollout:
            self.holder = None

    def take(self, rollout, batch: int) -> None:
        self.holder = weakref.ref(rollout)
        self.cache.reset(batch)
