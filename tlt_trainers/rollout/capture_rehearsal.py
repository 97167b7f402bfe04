"""A CUDA-graph capture rehearsed on the ``meta`` device: what would fail on a GPU, found on a CPU.

On a CPU every tensor already lives where the device is, so code that copies a host tensor into a step, reads a
value back or builds a tensor without naming the device runs fine there and fails only inside a GPU capture. The
``meta`` device has a capture's rules without a GPU: a model's forward runs on meta tensors (shapes, dtypes, no
data), an op that meets a CPU tensor raises, and a value cannot be read back. :class:`CaptureRehearsal` is a
dispatch mode that turns each of those into a :class:`CaptureFault` naming the rule, the op and the line of ours
that issued it:

- ``host read``: ``item``/``int``/``bool``/``nonzero``/``equal``/``tolist``/``cpu``/``numpy`` (a capture cannot
  wait for a value; a replay would not redo the read);
- ``host-to-device copy``: a host tensor copied onto the device inside the step (a pageable copy is not allowed in
  a capture; a pinned one would replay the capture-time values forever);
- ``device-to-host copy``: the reverse;
- ``host tensor in an op``: a CPU tensor reaching a device op (``inv_freq`` made on the host, say);
- ``tensor off the device``: an op inside the step creating a tensor on the host (``torch.arange(n)`` without
  ``device=``);
- ``autocast weight cache``: the step runs under autocast with its weight cache on (see :mod:`.capture`);
- ``device not bound``: the step runs outside :func:`~.capture.capture_context` for its device.

:func:`rehearse_step` drives one generate() call of a real engine (``cuda_graphs="static"``) on the host up to the
first step of the wanted strategy that the engine traces, moves every tensor that step can reach (the policy, the
drafter, the session's buffers, the rows, the proposers' caches) to ``meta``, and runs the step's graph region once
under the rehearsal, as a capture would run it. ``tests/test_capture_rehearsal.py`` runs it for every traced step
kind, ``benchmarks/bench_capture_rehearsal.py`` prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .step_probe import HOST_READ_OPS, graph_region

_aten = torch.ops.aten
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default, _aten.to.device, _aten.to.dtype_layout,
             _aten._copy_from.default, _aten._copy_from_and_resize.default}
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_HERE)
_SKIP_FILES = {os.path.join(_HERE, name) for name in ("capture_rehearsal.py", "capture.py", "step_probe.py")}


class CaptureFault(RuntimeError):
    """An op a CUDA-graph capture would refuse (or replay wrongly), found by :class:`CaptureRehearsal`."""

    def __init__(self, rule: str, op: str, where: str, detail: str = ""):
        self.rule, self.op, self.where, self.detail = rule, op, where, detail
        super().__init__(f"{rule}: {op} at {where}" + (f" ({detail})" if detail else ""))


def _where(stack: list[traceback.FrameSummary] | None = None) -> str:
    """The innermost line of ours (else the innermost outside torch) that led to the current op."""
    frames = stack if stack is not None else traceback.extract_stack()
    ours = [f for f in frames if f.filename.startswith(_PACKAGE) and f.filename not in _SKIP_FILES]
    outside_torch = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename
                     and f.filename not in _SKIP_FILES]
    frame = (ours or outside_torch or frames)[-1]
    return f"{os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))}:{frame.lineno} ({frame.name})"


def _device_of_output(func, args, kwargs) -> torch.device | None:
    device = kwargs.get("device")
    if device is None and func in (_aten._to_copy.default, _aten.to.device) and len(args) > 1:
        device = args[1] if isinstance(args[1], (str, torch.device)) else None
    return torch.device(device) if device is not None else None


class CaptureRehearsal(TorchDispatchMode):
    """Raises :class:`CaptureFault` at the first op inside it that a capture on ``device`` would refuse."""

    def __init__(self, device: torch.device | str = "meta"):
        super().__init__()
        self.device = torch.device(device)
        self._patches: list[tuple[str, object]] = []
        self.context_faults: list[CaptureFault] = []  # the capture's context rules broken (found on entry)

    def fault(self, rule: str, op: str, detail: str = "") -> CaptureFault:
        return CaptureFault(rule, op, _where(), detail)

    def _check_context(self) -> list[CaptureFault]:
        """The capture's context: autocast's weight cache off, the device bound (listed, the ops still run)."""
        faults = []
        cast_on = [kind for kind in ("cuda", "cpu") if torch.is_autocast_enabled(kind)]
        if cast_on and torch.is_autocast_cache_enabled():
            faults.append(self.fault("autocast weight cache", f"autocast({', '.join(cast_on)})",
                                     "cached casts are freed when the caller's autocast exits; the graph would "
                                     "read them"))
        try:
            from .capture import capture_device
        except ImportError:  # an engine from before capture_context
            bound = None
        else:
            bound = capture_device()
        if bound is None or bound.type != self.device.type:
            faults.append(self.fault("device not bound", "capture", f"current capture device {bound}, tensors on "
                                     f"{self.device}"))
        return faults

    def _patch_host_copies(self) -> None:
        mode = self

        def refuse(name):
            original = getattr(torch.Tensor, name)

            def refused(tensor, *args, **kwargs):
                if tensor.device == mode.device:
                    raise mode.fault("host read", f"Tensor.{name}")
                return original(tensor, *args, **kwargs)

            self._patches.append((name, original))
            setattr(torch.Tensor, name, refused)

        for name in ("tolist", "cpu", "numpy", "item"):
            refuse(name)

    def __enter__(self):
        self.context_faults = self._check_context()
        self._patch_host_copies()
        return super().__enter__()

    def _unpatch(self) -> None:
        for name, original in self._patches:
            setattr(torch.Tensor, name, original)
        self._patches.clear()

    def __exit__(self, *exc):
        self._unpatch()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        if func in HOST_READ_OPS:
            raise self.fault("host read", name)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        off_device = [t for t in inputs if t.device != self.device]
        target = _device_of_output(func, args, kwargs)
        if off_device:
            if func in _COPY_OPS and (target == self.device or func is _aten.copy_.default
                                      and args[0].device == self.device):
                raise self.fault("host-to-device copy", name,
                                 f"{tuple(off_device[0].shape)} {off_device[0].dtype} from {off_device[0].device}")
            raise self.fault("host tensor in an op", name,
                             f"{tuple(off_device[0].shape)} {off_device[0].dtype} on {off_device[0].device}")
        if func in _COPY_OPS and target is not None and target != self.device:
            raise self.fault("device-to-host copy", name, f"to {target}")
        out = func(*args, **kwargs)
        created = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device != self.device]
        if created:
            raise self.fault("tensor off the device", name, f"{tuple(created[0].shape)} on {created[0].device}")
        return out


# ---------------------------------------------------------------------------------------------- moving to meta
def _meta(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "meta":
        return tensor
    moved = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
    return nn.Parameter(moved, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved


def _ours(obj) -> bool:
    return type(obj).__module__.startswith("tlt_trainers.")


class _MetaMover:
    """Replaces, in place where it can, every tensor reachable from some roots with a meta tensor of its shape."""

    def __init__(self):
        self.seen: dict[int, object] = {}

    def move(self, obj):
        key = id(obj)
        if key in self.seen:
            return self.seen[key]
        if isinstance(obj, torch.Tensor):
            moved = self.seen[key] = _meta(obj)
            return moved
        if isinstance(obj, torch.device):  # the device a rollout or buffer remembers: the tensors' new one
            return torch.device("meta") if obj.type == "cpu" else obj
        self.seen[key] = obj
        if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.Generator,
                            weakref.ref, type)) or callable(obj) and not isinstance(obj, nn.Module) and not _ours(obj):
            return obj
        if isinstance(obj, nn.Module):
            obj.to("meta")
            for module in obj.modules():
                self.seen[id(module)] = module
                self._move_attributes(module, skip={"_parameters", "_buffers", "_modules"})
            return obj
        if isinstance(obj, dict):
            for k in list(obj):
                obj[k] = self.move(obj[k])
            return obj
        if isinstance(obj, list):
            obj[:] = [self.move(v) for v in obj]
            return obj
        if isinstance(obj, tuple):
            moved = [self.move(v) for v in obj]
            if all(a is b for a, b in zip(moved, obj, strict=True)):
                return obj
            new = type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
            self.seen[key] = new
            return new
        if _ours(obj) or dataclasses.is_dataclass(obj):
            self._move_attributes(obj)
        return obj

    def _move_attributes(self, obj, skip=frozenset()) -> None:
        names = list(getattr(obj, "__dict__", {}))
        names += [n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ()) if hasattr(obj, n)]
        for name in names:
            if name in skip or name.startswith("__"):
                continue
            value = getattr(obj, name)
            moved = self.move(value)
            if moved is not value:
                object.__setattr__(obj, name, moved)


def move_to_meta(*roots) -> None:
    """Every tensor reachable from ``roots`` (objects of this package, modules, containers, closures' cells) on
    ``meta``: modules in place, other tensors replaced where they are held."""
    mover = _MetaMover()
    for root in roots:
        if callable(root) and getattr(root, "__closure__", None):
            for cell in root.__closure__:
                with contextlib.suppress(ValueError):  # an empty cell
                    cell.cell_contents = mover.move(cell.cell_contents)
        else:
            mover.move(root)


# ---------------------------------------------------------------------------------------------- driving a step
@dataclass
class RehearsalResult:
    """What one rehearsed step found: ``fault`` None when the step would capture."""

    traced: str | None  # the strategy whose step was traced (None: the engine never traced one)
    fault: CaptureFault | None = None  # the first op a capture would refuse
    error: str | None = None  # an exception that is not a rule's (the rehearsal could not run the step)
    ops: int = 0  # ops the step dispatched in its graph region
    context_faults: list[CaptureFault] = dataclasses.field(default_factory=list)  # the capture's context

    @property
    def passes(self) -> bool:
        return self.traced is not None and self.fault is None and self.error is None and not self.context_faults

    def describe(self) -> str:
        if self.traced is None:
            return "never traced"
        parts = []
        if self.fault is not None:
            parts.append(f"{self.fault.rule}: {self.fault.op} at {self.fault.where}")
        if self.error is not None:
            parts.append(f"error: {self.error}")
        parts += [f"{f.rule} ({f.where})" for f in self.context_faults]
        return "; ".join(parts) or f"passes ({self.ops} ops)"


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _AutocastOnMeta(TorchFunctionMode):
    """Autocast's casts where it has no kernels (``meta``): the ops autocast runs in lower precision get their
    floating inputs in autocast's dtype, as ``torch.autocast`` gives them on CPU and CUDA."""

    LOWER_PRECISION = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                       F.scaled_dot_product_attention, torch.Tensor.__matmul__, torch.Tensor.matmul}

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.LOWER_PRECISION:
            def cast(t):
                return t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return func(*args, **kwargs)


def _autocast_dtype() -> torch.dtype | None:
    for kind in ("cuda", "cpu"):
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    return None


def _run_rehearsed(body, recording, device: torch.device) -> RehearsalResult:
    counter, rehearsal = _Counting(), CaptureRehearsal(device)
    result = RehearsalResult(None)
    cast = _autocast_dtype()
    autocast = _AutocastOnMeta(cast) if cast is not None else contextlib.nullcontext()
    try:
        with recording(), rehearsal, counter, autocast:
            body()
    except CaptureFault as fault:
        result.fault = fault
    except Exception as exc:  # noqa: BLE001 - reported: where the step broke on meta
        where = _where(traceback.extract_tb(exc.__traceback__))
        result.error = f"{type(exc).__name__} at {where}: {str(exc).splitlines()[0][:160]}"
    result.ops, result.context_faults = counter.ops, rehearsal.context_faults
    return result


class _Rehearsed(Exception):
    """Ends the generate() call once its step was rehearsed (its state is on meta by then)."""


def rehearse_step(engine, input_ids: torch.Tensor, wanted: str, max_steps: int = 16, **generate_kwargs
                  ) -> RehearsalResult:
    """Start ``engine.generate(input_ids, **generate_kwargs)`` (an engine with ``cuda_graphs="static"``) and, at the
    first step the engine traces for strategy ``wanted`` ("none" for a plain step), move everything on meta and run
    that step's graph region once under :class:`CaptureRehearsal`. Earlier steps run as usual. The engine, its
    policy and its drafter are left on meta: build them for the rehearsal alone."""
    device = torch.device("meta")
    rollout = engine.start(input_ids, **generate_kwargs)
    graphs = rollout.step_graphs
    if graphs is None:
        raise ValueError("rehearse_step needs an engine with TLTConfig(cuda_graphs='static').")
    original_run = graphs.run
    outcome: list[RehearsalResult] = []

    def run(key, body, snapshot, outputs_of, before_each):
        strategy = next(part for part in key if isinstance(part, str))  # the key's one string: the strategy's name
        if strategy != wanted:
            return original_run(key, body, snapshot, outputs_of, before_each)
        before_each()
        move_to_meta(rollout, body, engine)
        # The context the engine records a graph in (its capture's: device, autocast), where it has one
        recording = getattr(graphs, "recording", graph_region)
        result = _run_rehearsed(body, recording, device)
        result.traced = strategy
        outcome.append(result)
        raise _Rehearsed

    graphs.run = run
    rollout.begin()
    with contextlib.suppress(_Rehearsed):
        for _ in range(max_steps):
            if not rollout.step():
                break
    return outcome[0] if outcome else RehearsalResult(None)
