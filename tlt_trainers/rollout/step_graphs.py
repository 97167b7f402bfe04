"""Whole speculative steps replayed from CUDA graphs.

On a GPU a speculative step is hundreds of small kernels: the drafter's passes, sampling, acceptance, the commit of
accepted tokens. Launched one by one from Python they cost more than the policy's verify pass they wrap, so a
step of ``chain:4`` ends up several times a plain one. Here the whole step (drafter catch-up and drafts, the
policy's verify pass, sampling and acceptance, commit, and the packing of what the host reads) is one graph per
(batch bucket, strategy), replayed on the rows' own buffers, which never move (``ActiveRows``: compaction is in
place, and a bucket's graph runs over the first ``bucket`` rows, the dead ones frozen by the ``live`` mask).

What the host contributes to a replay: the step's uniforms, drawn in one launch into a static buffer
(``UniformStream``) so that no graph owns a generator, and a history step's drafts (one copy); after it, the step's
one read.

A step is traced only in a steady state: a plain step, a history chain (matched on the host, its drafts copied into a
static buffer before the replay), or an EAGLE chain or tree or a block draft whose drafter is at most the traced
catch-up width behind (the deepest strategy's accepted path and bonus token); no repetition penalty (its presence
masks per tree node are built with ``nonzero``). Other steps (a tree merged with history; the catch-up after plain
steps) run eagerly, with the policy's pass still replayed by :class:`~.graphs.GraphRunner`.

A step graph is keyed by what shapes its ops: the batch bucket, the strategy, the catch-up width, the KV span its
passes attend over (:func:`~tlt_trainers.modeling.rows.kv_span` of the rows' longest length) and which sampling
warpers run; values (``max_new_tokens``, temperature, top-p, min-p) are read from device scalars the graph session
holds, written once per call, so a call with other values replays the graphs of earlier ones. At most
:data:`MAX_GRAPHS` graphs are kept, the least recently used going first.

Every capture is checked before its graph is used: the step runs eagerly (the warm-up), its state is put back, the
graph is captured and replayed, and both must emit the same tokens and counts; a disagreement or an exception makes
the step eager again (the state put back once more) and switches that step shape's graph off for the rest of the
process (other shapes keep theirs), with one warning per shape. ``mode="static"`` traces the same body without
capturing, on any device: the CPU tests count its ops (``step_probe``) and check its output against
``model.generate``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable

import torch

from .capture import capture_context
from .step_probe import graph_region

logger = logging.getLogger(__name__)

# (device, model class, bucket, KV span, strategy, catch-up width, proposal width) -> why its capture failed in this
# process.
# Another session or engine on the same shapes runs that step eagerly without trying (and warning) again.
_FAILED_STEPS: dict[tuple, str] = {}


def failed_step_captures() -> dict[tuple, str]:
    """The step shapes whose capture failed in this process, and why."""
    return dict(_FAILED_STEPS)


def reset_failed_step_captures() -> None:
    """Forget the failed step captures (tests)."""
    _FAILED_STEPS.clear()


# Graphs a StepGraphs (whole steps) or a GraphRunner (policy passes) keeps: the least recently used go beyond it. The
# adaptive engine's strategies x batch buckets x KV spans reach a few dozen in a long rollout; each graph holds its
# outputs and a share of the graph pool, so the bound keeps a long-lived session's memory bounded too.
MAX_GRAPHS = 64


def touch(entries: dict, key: Hashable) -> tuple | None:
    """``entries[key]`` made the most recently used (moved to the end of the dict's order); None if absent."""
    entry = entries.pop(key, None)
    if entry is not None:
        entries[key] = entry
    return entry


def make_room(entries: dict, limit: int) -> None:
    """Drop the least recently used entries (the first in the dict's order) until one more fits under ``limit``."""
    while entries and len(entries) >= limit:
        del entries[next(iter(entries))]


class StepGraphs:
    """Traced steps, kept with the engine's graph session across calls, keyed by (bucket, KV span, strategy name,
    catch-up width) and the settings that shape a trace (``Rollout._graph_step``); at most ``max_graphs``
    (default :data:`MAX_GRAPHS`) of them, the least recently used evicted first."""

    def __init__(self, mode: str, device: torch.device | str | None = None, model_name: str = "",
                 max_graphs: int | None = None):
        if mode not in ("cuda", "static"):
            raise ValueError(f"StepGraphs mode must be 'cuda' or 'static', got {mode!r}.")
        self.mode = mode
        # The device the steps' tensors live on: captures are bound to it, whatever the calling thread's is
        self.device = torch.device(device if device is not None else ("cuda" if mode == "cuda" else "cpu"))
        self.model_name = model_name
        self.entries: dict[tuple, tuple] = {}  # least recently used first
        self.max_graphs = MAX_GRAPHS if max_graphs is None else max_graphs
        self.pool = None
        self.captures = 0  # CUDA graphs captured
        self.capture_attempts = 0  # captures tried, failed ones included (a step that tried one prices nothing)
        self.shapes_prepared = 0  # keys set up: a capture with "cuda", its first trace with "static"
        self.replays = 0
        self.failed: dict[tuple, str] = {}  # keys of this engine whose capture failed: they run eagerly

    def run(self, key: tuple, body: Callable[[], object], snapshot: Callable[[], Callable[[], None]],
            outputs_of: Callable[[object], list[torch.Tensor]], before_each: Callable[[], None]):
        """``body()`` traced for ``key``: run inside a graph region ("static"), or captured once and replayed
        ("cuda"). ``before_each()`` prepares a run (fresh uniforms); ``snapshot()`` saves the rows' mutable state
        and returns a function that restores it (for the capture's check); ``outputs_of(result)`` are the tensors
        the check compares."""
        if self.mode == "cuda" and (key in self.failed or self._shape_of(key) in _FAILED_STEPS):
            self.failed.setdefault(key, _FAILED_STEPS.get(self._shape_of(key), "failed"))
            before_each()
            return body()  # eagerly: no graph of this shape in this process
        entry = touch(self.entries, key)
        if entry is None:
            self.shapes_prepared += 1
            make_room(self.entries, self.max_graphs)
        if self.mode == "static":
            self.entries[key] = (None, None)
            before_each()
            with self.recording():
                result = body()
            self.replays += 1
            return result
        if entry is None:
            return self._capture_checked(key, body, snapshot, outputs_of, before_each)
        graph, result = entry
        before_each()
        graph.replay()
        self.replays += 1
        return result

    def _capture_checked(self, key, body, snapshot, outputs_of, before_each):
        """Warm up (the step, eagerly), put the state back, capture, replay once and compare (see the module
        docstring). Returns this step's results: the graph's, or an eager run's where the check failed."""
        restore = snapshot()
        reason = None
        self.capture_attempts += 1
        try:
            before_each()
            expected = [t.clone() for t in outputs_of(self._warm_up(body))]
            restore()
            before_each(reset_only=True)
            graph, result = self._record(body)
            restore()  # a capture runs nothing; put back whatever a capture that did (a fake one, in tests) changed
            before_each(reset_only=True)
            graph.replay()
            got = outputs_of(result)
            if any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
                reason = "its first replay emitted other tokens or counts than the eager step"
        except Exception as exc:  # noqa: BLE001 - any failure to capture or replay means: stay eager
            reason = f"{type(exc).__name__} while capturing or replaying: {exc}"
        if reason is None:
            self.entries[key] = (graph, result)
            self.captures += 1
            self.replays += 1
            return result
        self.entries.pop(key, None)
        self.failed[key] = reason
        shape = self._shape_of(key)
        if shape not in _FAILED_STEPS:  # once per process and step shape
            _FAILED_STEPS[shape] = reason
            logger.warning("TLT: the CUDA graph of a whole speculative step (bucket, KV span, strategy, catch-up "
                           "width %s) failed its self-check: %s. Steps of this shape run eagerly for the rest of the "
                           "process (the same tokens; more launches per step); other steps keep their graphs. Please "
                           "report it with your GPU, torch and transformers versions.", key[:4], reason)
        restore()
        before_each(reset_only=True)
        return body()

    def _shape_of(self, key: tuple) -> tuple:
        """What a capture's failure is remembered by across engines: device, model, and the step's shape."""
        return (str(self.device), self.model_name, *key[:5])

    @contextlib.contextmanager
    def recording(self):
        """The context a step is traced in: its graph region, on its device, without autocast's weight cache
        (:func:`~.capture.capture_context`)."""
        with capture_context(self.device), graph_region():
            yield

    def _warm_up(self, body):
        """The step run eagerly on a side stream of its device, as a capture requires (plainly without CUDA)."""
        with capture_context(self.device):
            if self.device.type != "cuda":
                return body()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                result = body()
            torch.cuda.current_stream().wait_stream(stream)
        return result

    def _record(self, body):
        """Capture the step into a CUDA graph on its device: (graph, its static results)."""
        with capture_context(self.device):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                result = body()
        self.pool = graph.pool()
        return graph, result
