"""Ranks and the drafter: announce the end of a rollout without blocking, then agree on one drafter.

A rank that is done with its rollout posts an asynchronous all-reduce of its rollout time on a dedicated
gloo group and trains the drafter until that collective completes, i.e. until the slowest rank is done too.
Then a fixed sequence of synchronous collectives makes every rank hold the same drafter: all ranks gather
each other's figures, the rank that trained most becomes the source, and its drafter weights (with the
draft vocabulary) and optimizer state are broadcast. Every call here is made the same number of times on
every rank, once per rollout, never inside TRL's (rank-dependent) tool loop.
"""

from __future__ import annotations

import atexit
import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..online import REPORT_FIELDS, DrafterPayload, DrafterTransport, SliceReport

# Columns of the table every rank contributes one row to, once per rollout: the rollout's figures, then what its
# idle training slice did (SliceReport's fields).
ROLLOUT_FIELDS = (
    "rollout_seconds",  # this rank's rollout, from the start of _generate to the end of its generation
    "wait_seconds",  # seconds from posting its arrival until every rank had arrived
    "emitted_tokens",  # tokens emitted by decode steps (acceptance = emitted / row_forwards)
    "row_forwards",
    "draft_tokens",
    "accepted_tokens",
    "decode_steps",
    "speculative_steps",
    "history_proposed",  # draft tokens proposed from rollout history
    "saved_seconds",  # what speculation saved in this rank's rollout (NaN: not measured; vLLM's adaptive schedule)
)
STAT_FIELDS = ROLLOUT_FIELDS + REPORT_FIELDS
COLUMN = {name: i for i, name in enumerate(STAT_FIELDS)}
# A rank whose arrival completes the all-reduce should not start a drafter micro-step (and make the others
# wait for it) only because the completion has not been observed yet.
_ARRIVAL_GRACE_SECONDS = 0.005


def distributed_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RankGroup:
    """The collectives of TLT's idle-time drafter training; a no-op stand-in in a single process."""

    def __init__(self):
        self.rank, self.world = distributed_world()
        # A group of our own: an asynchronous collective pending on it cannot interleave with TRL's collectives,
        # and gloo can be polled from the host whatever backend the default group uses.
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        if self.group is not None:  # before the interpreter tears threads down: gloo's must not outlive it
            atexit.register(self.close)

    def close(self) -> None:
        """Destroy the group (at exit; a no-op once the default group, and with it every group, is gone)."""
        if self.group is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------ arrival
    def post_arrival(self, rollout_seconds: float):
        """Start the all-reduce that completes once every rank has finished its rollout; returns (tensor, work)."""
        if not self.distributed:
            return None
        seconds = torch.zeros(self.world, dtype=torch.float64)
        seconds[self.rank] = rollout_seconds
        work = dist.all_reduce(seconds, group=self.group, async_op=True)
        deadline = time.perf_counter() + _ARRIVAL_GRACE_SECONDS
        while not work.is_completed() and time.perf_counter() < deadline:
            time.sleep(0.0005)
        return work

    @staticmethod
    def arrived(work) -> bool:
        return work is None or work.is_completed()

    @staticmethod
    def wait(work) -> None:
        if work is not None:
            work.wait()

    def broadcast_object(self, value, src: int = 0):
        """``src``'s picklable ``value`` on every rank (``value`` itself in a single process)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def first_error(self, error: BaseException | None) -> str | None:
        """The first rank's error in words, on every rank (None when no rank had one): a rank that raised alone
        would leave the others waiting in their next collective."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        if not self.distributed:
            return message
        messages = [None] * self.world
        dist.all_gather_object(messages, message, group=self.group)
        return next((f"rank {rank}: {m}" for rank, m in enumerate(messages) if m is not None), None)

    # ------------------------------------------------------------------ figures
    def gather(self, row: list[float]) -> torch.Tensor:
        """Every rank's row of STAT_FIELDS figures, as a [world, fields] float64 table."""
        local = torch.tensor(row, dtype=torch.float64)
        if not self.distributed:
            return local[None]
        rows = [torch.zeros_like(local) for _ in range(self.world)]
        dist.all_gather(rows, local, group=self.group)
        return torch.stack(rows)

    @staticmethod
    def reports(table: torch.Tensor) -> list[SliceReport]:
        """Every rank's SliceReport from a gathered table of STAT_FIELDS rows."""
        first = COLUMN[REPORT_FIELDS[0]]
        return [SliceReport.from_row(row[first:first + len(REPORT_FIELDS)].tolist()) for row in table]

    def gather_reports(self, report: SliceReport) -> list[SliceReport]:
        """Every rank's SliceReport, in rank order."""
        return [SliceReport.from_row(row.tolist()) for row in self.gather(report.as_row())]

    # ------------------------------------------------------------------ drafter state
    def broadcast_drafter(self, drafter: torch.nn.Module, optimizer: torch.optim.Optimizer | None, src: int) -> None:
        """Make every rank's drafter (weights, draft vocabulary) and optimizer state bit-identical to ``src``'s."""
        if not self.distributed:
            return
        tensors = list(drafter.state_dict().values())  # detached views sharing the parameters' storage
        if optimizer is not None:
            tensors += self._optimizer_tensors(optimizer, src)
        self._broadcast_tensors(tensors, src)
        if hasattr(drafter, "_head_cache"):
            drafter._head_cache = None

    def _optimizer_tensors(self, optimizer: torch.optim.Optimizer, src: int) -> list[torch.Tensor]:
        """Give every rank the source's optimizer-state layout (ranks that never stepped have none); its tensors."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        layout = None
        if self.rank == src:
            layout = [
                {key: (("tensor", tuple(value.shape), value.dtype, value.device.type) if torch.is_tensor(value)
                       else ("value", value)) for key, value in optimizer.state.get(p, {}).items()}
                for p in params
            ]
        box = [layout]
        dist.broadcast_object_list(box, src=src, group=self.group)
        layout = box[0]
        tensors = []
        for param, keys in zip(params, layout):
            state = optimizer.state[param]
            for key in list(state):
                if key not in keys:
                    del state[key]
            for key in sorted(keys):
                kind, *spec = keys[key]
                if kind == "value":
                    state[key] = spec[0]
                    continue
                shape, dtype, device_type = spec
                device = torch.device("cpu") if device_type == "cpu" else param.device
                current = state.get(key)
                if (not torch.is_tensor(current) or tuple(current.shape) != shape or current.dtype != dtype
                        or current.device != device):
                    state[key] = torch.zeros(shape, dtype=dtype, device=device)
                tensors.append(state[key])
        return tensors

    def _broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcast in place, one flat buffer per (device, dtype); NCCL for CUDA tensors when that is the default."""
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for tensor in tensors:
            buckets.setdefault((str(tensor.device), tensor.dtype), []).append(tensor)
        default_nccl = dist.get_backend() == "nccl"
        for (device, _), members in sorted(buckets.items(), key=lambda item: (item[0][0], str(item[0][1]))):
            flat = _flatten_dense_tensors([t.detach() for t in members])
            if device.startswith("cuda") and default_nccl:
                dist.broadcast(flat, src=src)
            else:
                staged = flat.cpu()
                dist.broadcast(staged, src=src, group=self.group)
                flat = staged.to(flat.device)
            if self.rank != src:
                with torch.no_grad():
                    for tensor, value in zip(members, _unflatten_dense_tensors(flat, members)):
                        tensor.copy_(value)


class RankDrafterTransport(DrafterTransport):
    """The drafter-update transport between TRL's ranks: torch.distributed collectives on the RankGroup's gloo
    group (a no-op in a single process). ``steps``: the micro-steps this rank made in this update."""

    def __init__(self, ranks: RankGroup, drafter: torch.nn.Module, trainer, steps: int, draft_vocab_ready: bool):
        self.ranks, self.drafter, self.trainer = ranks, drafter, trainer
        self.steps, self.draft_vocab_ready = steps, draft_vocab_ready

    def share_from(self, source: int, total_steps: int) -> None:
        """Broadcast ``source``'s drafter and optimizer state: every rank continues bit-identical to it."""
        if self.ranks.distributed:
            self.ranks.broadcast_drafter(self.drafter, self.trainer.optimizer, source)
            self.trainer.step = total_steps

    def collect(self) -> list[DrafterPayload | None]:
        payload: DrafterPayload = {"state": {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()},
                                   "steps": self.steps, "total_steps": self.trainer.step,
                                   "draft_vocab_ready": self.draft_vocab_ready}
        if not self.ranks.distributed:
            return [payload]
        payloads: list[DrafterPayload | None] = [None] * self.ranks.world
        dist.all_gather_object(payloads, payload, group=self.ranks.group)
        return payloads

    def load_everywhere(self, payload: DrafterPayload) -> None:
        self.drafter.load_state_dict(payload["state"])
        if hasattr(self.drafter, "_head_cache"):
            self.drafter._head_cache = None
        self.trainer.step = max(self.trainer.step, int(payload["total_steps"]))
        self.steps = 0
