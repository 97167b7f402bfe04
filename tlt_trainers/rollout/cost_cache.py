"""Measured step costs kept between runs, so that a second run on the same machine starts measured.

A file per key in ``costs/`` under the package's cache directory (``~/.cache/tlt_trainers``, see
:func:`tlt_trainers.pretrained.cache_root`), or in ``$TLT_COST_CACHE`` where that is set. The key is everything a
step's cost depends on: the device and its name, the threads a CPU runs on, the policy's architecture and size, its
dtype, the drafter's shape, the engine's CUDA-graph mode and the versions of torch, transformers and this package.
The file holds its key; a file whose key differs (a hash collision, a hand-copied file) or that does not parse is
ignored, and damaged entries are skipped one by one (:meth:`CostProfile.merge_dict`). Writes go to a temporary file
renamed into place, so two processes writing at once leave one whole file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT = 1


def cost_dir() -> Path:
    """Where measured costs are kept by default (not created)."""
    explicit = os.environ.get("TLT_COST_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    from ..pretrained import cache_root

    return cache_root() / "costs"


def device_name(device: torch.device) -> str:
    """The accelerator's or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cost_key(model: torch.nn.Module, drafter: torch.nn.Module | None, device: torch.device, dtype: torch.dtype,
             cuda_graphs: str) -> dict[str, Any]:
    """What the costs of this package's engine with this policy and drafter depend on."""
    config = getattr(model, "config", None)
    policy = {"architectures": list(getattr(config, "architectures", None) or [type(model).__name__]),
              "parameters": sum(p.numel() for p in model.parameters()), **model_shape(config)}
    drafter_info = None
    if drafter is not None:
        drafter_info = {"class": type(drafter).__name__, "feature_size": int(drafter.feature_size),
                        "draft_vocab_size": int(drafter.draft_vocab_size),
                        "parameters": sum(p.numel() for p in drafter.parameters())}
    return make_key("tlt", device, dtype, policy, drafter_info, cuda_graphs=cuda_graphs)


def model_shape(config: Any) -> dict[str, Any]:
    """The sizes of a Hugging Face model config that set a forward's cost."""
    shape = {}
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size"):
        value = getattr(config, name, None)
        if value is not None:
            shape[name] = value
    return shape


def package_version() -> str:
    """tlt-trainers' installed version, from the package metadata ("unknown" for a checkout run uninstalled)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tlt-trainers")
    except PackageNotFoundError:
        return "unknown"


def make_key(engine: str, device: torch.device, dtype: Any, policy: dict, drafter: dict | None,
             **extra: Any) -> dict[str, Any]:
    """A cache key: the engine (``tlt`` or ``vllm``), the device and its name, a CPU's threads, the dtype, the policy
    and drafter as dicts of what sets their cost, anything else that does (``extra``), and the library versions."""
    import transformers

    key = {"format": FORMAT, "engine": engine, "device": device.type, "device_name": device_name(device),
           "threads": torch.get_num_threads() if device.type == "cpu" else None, "dtype": str(dtype),
           "policy": policy, "drafter": drafter, "torch": torch.__version__, "transformers": transformers.__version__,
           "tlt_trainers": package_version(), **extra}
    return json.loads(json.dumps(key, default=str))


def _path(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return directory / f"{key.get('engine', 'tlt')}-{digest}.json"


def load_costs(key: dict, directory: Path | None = None) -> dict | None:
    """The costs stored under ``key``, or None (none stored, another key's file, or a file that does not parse)."""
    path = _path(directory or cost_dir(), key)
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("Ignoring the cost cache %s (%s); costs are learnt again from the steps.", path, error)
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        logger.info("Ignoring the cost cache %s: it was measured for another device, policy or version.", path)
        return None
    costs = stored.get("costs")
    return costs if isinstance(costs, dict) else None


def save_costs(key: dict, costs: dict, directory: Path | None = None) -> Path | None:
    """Store ``costs`` under ``key``; returns the file, or None where the directory cannot be written (logged)."""
    path = _path(directory or cost_dir(), key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            json.dump({"key": key, "costs": costs}, out, indent=1, sort_keys=True)
        os.replace(out.name, path)
    except OSError as error:
        logger.warning("Could not write the cost cache %s (%s); set TLT_COST_CACHE to a writable directory or "
                       "TLTConfig(cost_cache='off').", path, error)
        return None
    return path
