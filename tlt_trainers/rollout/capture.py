"""The context every graph capture, its warm-up and the static-buffer mode run in.

Two things a capture must not inherit from its caller:

- **The current device.** A capture and its side stream belong to the device that is current in the calling thread;
  veRL generates in ``asyncio.to_thread`` workers, whose current device is device 0 whatever the engine's tensors
  are on. The capture is bound to the device of the tensors it records.
- **Autocast's weight cache.** Under ``torch.autocast`` (TRL generates under ``accelerator.autocast()``) the first
  use of an fp32 weight in a context casts it once and caches the bf16 copy until the context exits. A graph
  captured with the cache on reads those copies, which are freed on exit: the next call's replay reads freed memory,
  and an in-place optimizer step between calls leaves the copies stale (PyTorch's ``make_graphed_callables``
  refuses cached autocast for this reason). With the cache off inside the capture the graph casts from the fp32
  weights themselves on every replay. Whether autocast was on, and its dtype, is part of the graph session's key
  (:func:`autocast_key`): graphs captured under autocast are never replayed outside it, and the reverse.
"""

from __future__ import annotations

import contextlib

import torch

_AUTOCAST_DEVICES = ("cuda", "cpu")
_CAPTURE_DEVICE: list[torch.device | None] = [None]


def autocast_key() -> tuple:
    """The caller's autocast state for the device types that have one: (type, enabled, dtype) each."""
    return tuple((kind, torch.is_autocast_enabled(kind),
                  torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
                 for kind in _AUTOCAST_DEVICES)


def capture_device() -> torch.device | None:
    """The device the innermost :func:`capture_context` was bound to (None outside one)."""
    return _CAPTURE_DEVICE[0]


@contextlib.contextmanager
def capture_context(device: torch.device | str):
    """Run a capture (or its warm-up, or a static-buffer pass) on ``device``: that device current in this thread
    (CUDA) and autocast's weight cache off, autocast itself left as the caller set it."""
    device = torch.device(device)
    previous_cache = torch.is_autocast_cache_enabled()
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    previous_device = _CAPTURE_DEVICE[0]
    with on_device:
        torch.set_autocast_cache_enabled(False)
        _CAPTURE_DEVICE[0] = device
        try:
            yield
        finally:
            _CAPTURE_DEVICE[0] = previous_device
            torch.set_autocast_cache_enabled(previous_cache)
