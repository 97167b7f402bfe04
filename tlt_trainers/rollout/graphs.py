"""CUDA graphs for the policy's decode and verify passes.

At small batch a decode step is dominated by kernel launches, not arithmetic: replaying a captured
graph removes them. A graph fixes every shape and address, so the engine runs graph steps on static
buffers: the batch is padded up to a bucket (1, 2, 4, 8, ...) with rows that already finished
(in-place compaction leaves live rows first, so rows past them are dead and free to compute
garbage), attention spans the whole cache capacity (the mask hides the unused slots), and inputs
are copied into per-shape static tensors before each replay. One graph is captured per (bucket,
tokens per row) on first use, within one generate() call (its cache is the graphs' memory).

``mode="static"`` runs the same static-buffer path without capturing, on any device: the CPU tests
use it to check that padding, full-capacity masks and static inputs change nothing.
"""

from __future__ import annotations

import torch

from ..modeling.kv_cache import RowCache, WritePlan


def graph_bucket(batch: int) -> int:
    return 1 << max(0, (batch - 1).bit_length())


class GraphRunner:
    """Runs ``target.forward`` + ``target.logits`` for [batch, q] inputs on static buffers, replaying CUDA graphs."""

    def __init__(self, target, cache: RowCache, max_batch: int, capacity: int, mode: str = "cuda"):
        if mode not in ("cuda", "static"):
            raise ValueError(f"GraphRunner mode must be 'cuda' or 'static', got {mode!r}.")
        self.target, self.cache, self.max_batch, self.capacity, self.mode = target, cache, max_batch, capacity, mode
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None
        self.captures = 0
        self.replays = 0

    def supports(self, batch: int) -> bool:
        return graph_bucket(batch) <= self.max_batch

    def _static_inputs(self, bucket: int, q: int, masks: dict) -> dict:
        device = self.target.device
        return {
            "tokens": torch.zeros(bucket, q, dtype=torch.long, device=device),
            "positions": torch.zeros(bucket, q, dtype=torch.long, device=device),
            "slots": (self.capacity - q + torch.arange(q, device=device)).expand(bucket, q).contiguous(),
            "masks": {name: torch.zeros(bucket, 1, q, self.capacity, dtype=m.dtype, device=device)
                      for name, m in masks.items()},
        }

    def _run(self, static: dict):
        self.cache.plan = WritePlan(static["slots"], self.capacity)
        masks = static["masks"]
        mask = masks["full"] if set(masks) == {"full"} else {
            "full_attention": masks["full"], "sliding_attention": masks["sliding"]}
        hidden = self.target.forward(static["tokens"], static["positions"], mask, self.cache)
        return hidden, self.target.logits(hidden)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 masks: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and logits [batch, q, ...] of the live rows.

        ``masks`` maps "full" (and "sliding" for sliding-window models) to additive masks [batch, 1, q, capacity].
        """
        batch, q = tokens.shape
        bucket = graph_bucket(batch)
        key = (bucket, q)
        entry = self.graphs.get(key)
        if entry is None:
            static = self._static_inputs(bucket, q, masks)
            entry = self.graphs[key] = (static, None, None)
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
                buffer[batch:, 0, steps, self.capacity - q + steps] = 0
        if batch < bucket:
            static["slots"][batch:] = self.capacity - q + torch.arange(q, device=tokens.device)
        if self.mode == "static":
            hidden, logits = self._run(static)
        else:
            graph, outputs = entry[1], entry[2]
            if graph is None:
                graph, outputs = self._capture(static)
                self.graphs[key] = (static, graph, outputs)
            graph.replay()
            hidden, logits = outputs
        self.replays += 1
        return hidden[:batch], logits[:batch]

    def _capture(self, static: dict):
        """Warm up on a side stream (also the first real run: the cache writes are idempotent), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._run(static)
        self.pool = graph.pool()
        self.captures += 1
        return graph, outputs
