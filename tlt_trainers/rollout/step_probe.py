"""What an engine step would cost a GPU in host round trips, counted on any device.

On a GPU a speculative step is fast only if the host never waits for the device inside it and the device never
waits for the host between kernels: every value read back to the host (``.item()``, ``int(t)``, ``bool(t)``,
``nonzero``, ``.tolist()``, ``.cpu()``) stalls the launch queue, and every op dispatched outside a CUDA-graph replay
is one more launch. A CPU has neither cost, so it cannot time them, but it can count them: :class:`StepProbe` is a
``TorchDispatchMode`` that sees every aten op the engine dispatches and sorts it into

- ``host_reads``: ops whose result the host waits for (``aten._local_scalar_dense``: ``item``/``int``/``bool``;
  ``aten.nonzero`` and its kin: a data-dependent shape; ``aten.equal``), plus the copies to the host that dispatch
  no aten op when the engine itself runs on the CPU, so they are patched: ``Tensor.tolist``, ``cpu``, ``numpy``,
  ``to("cpu")``, and ``copy_`` into a host buffer (a tensor on the CPU filled from another
  device, a page-locked one, or one the engine marks with :func:`host_buffer`);
- ``graph_ops``: ops dispatched inside :func:`graph_region`, i.e. what a CUDA graph replays (the static-buffer mode,
  ``TLTConfig(cuda_graphs="static")``, runs exactly the ops a capture would record, so on CPU they are counted);
- ``eager_ops``: every other op: a kernel launch of its own on a GPU.

Used by ``benchmarks/bench_step_proxies.py`` and tests/test_step_proxies.py, so that the work of keeping a step
inside graphs and off the host can be judged without a GPU.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_aten = torch.ops.aten
# aten ops whose result the host must wait for (a scalar, or a shape that depends on the data)
HOST_READ_OPS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.nonzero_static.default,
    _aten.equal.default,
    _aten.masked_select.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
}
# Metadata-only ops that launch nothing on a device (views and aliases)
_NO_LAUNCH_TAGS = (torch.Tag.view_copy,)

_REGION_DEPTH = [0]


@contextlib.contextmanager
def graph_region():
    """Marks ops that a CUDA graph replays (entered by the graph runners around the static pass they capture)."""
    _REGION_DEPTH[0] += 1
    try:
        yield
    finally:
        _REGION_DEPTH[0] -= 1


def in_graph_region() -> bool:
    return _REGION_DEPTH[0] > 0


def host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """Marks a tensor as the host side of a device-to-host copy (a staging buffer the host reads), so that
    :class:`StepProbe` counts a ``copy_`` into it as a host read even where the engine runs on the CPU and the copy
    moves nothing. Returns the tensor."""
    tensor._tlt_host_buffer = True
    return tensor


def _moves_to_host(tensor: torch.Tensor, *args, **kwargs) -> bool:
    """Whether ``Tensor.to(...)`` names the host: ``to("cpu")``, ``to(device="cpu")``, ``to("cpu", torch.float16)``.

    Only the host named as a string counts. On a CPU run ``to(x.device)`` (the engine moving a tensor to its own
    device, as transformers' rotary embedding does every pass) passes the same ``torch.device("cpu")`` as a read
    would, so a ``torch.device`` cannot be told apart; where the source is on another device the copy is a read
    whatever names the target."""
    device = kwargs.get("device", args[0] if args else None)
    if isinstance(device, torch.Tensor):
        device = device.device
    if isinstance(device, str):
        return torch.device(device).type == "cpu"
    return isinstance(device, torch.device) and device.type == "cpu" and tensor.device.type not in ("cpu", "meta")


def _copies_to_host(destination: torch.Tensor, source) -> bool:
    """Whether ``destination.copy_(source)`` is a device-to-host copy the host will read."""
    if destination.device.type != "cpu":
        return False
    if getattr(destination, "_tlt_host_buffer", False):
        return True
    if isinstance(source, torch.Tensor) and source.device.type not in ("cpu", "meta"):
        return True
    with _disable_current_modes():  # asking is an aten op of its own, not the engine's
        return destination.is_pinned()


def _launches_nothing(func) -> bool:
    """Views, reshapes and other aliasing ops: metadata on the host, no kernel on a device."""
    schema = func._schema
    if func in (_aten.detach.default, _aten.alias.default, _aten.lift_fresh.default):
        return True
    returns = schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclass
class StepCounts:
    host_reads: int = 0
    eager_ops: int = 0
    graph_ops: int = 0
    reads_by_op: Counter = field(default_factory=Counter)
    eager_by_op: Counter = field(default_factory=Counter)


class StepProbe(TorchDispatchMode):
    """Counts host reads and ops outside/inside graph regions while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.counts = StepCounts()
        self._patches: list[tuple[str, object]] = []

    # -- host copies that dispatch no aten op on CPU tensors
    def _patch(self) -> None:
        counts = self.counts

        def wrap(name, reads_host=None):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, **kwargs):
                if reads_host is None or reads_host(tensor, *args, **kwargs):
                    counts.host_reads += 1
                    counts.reads_by_op[f"Tensor.{name}"] += 1
                return original(tensor, *args, **kwargs)

            self._patches.append((name, original))
            setattr(torch.Tensor, name, counted)

        for name in ("tolist", "cpu", "numpy"):
            wrap(name)
        wrap("to", _moves_to_host)
        wrap("copy_", lambda tensor, source, *args, **kwargs: _copies_to_host(tensor, source))

    def _unpatch(self) -> None:
        for name, original in self._patches:
            setattr(torch.Tensor, name, original)
        self._patches.clear()

    def __enter__(self):
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        self._unpatch()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        counts = self.counts
        if func in HOST_READ_OPS:
            counts.host_reads += 1
            counts.reads_by_op[str(func.overloadpacket.__name__)] += 1
        elif _launches_nothing(func):
            return out
        if in_graph_region():
            counts.graph_ops += 1
        else:
            counts.eager_ops += 1
            counts.eager_by_op[str(func.overloadpacket.__name__)] += 1
        return out

    def take(self) -> StepCounts:
        """The counts so far, and start counting anew."""
        counts, self.counts = self.counts, StepCounts()
        self._unpatch()
        self._patch()
        return counts
