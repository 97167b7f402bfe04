"""A vLLM general plugin: exact speculative sampling on vLLM's CPU backend, proven by running it.

The bug (vllm-project/vllm issue #55005, fix in PR #55006): without a Triton CPU backend, vLLM's CPU platform
replaces the rejection sampler's Triton kernels with C++ ops (``vllm/utils/cpu_triton_utils.py``). Its
``_expand_kernel_impl`` hands the op ``_ensure_int64(output)`` and ``_ensure_int64(input_val)``. For the float32
per-request temperatures that ``expand_batch_to_tokens`` (``vllm/v1/sample/rejection_sampler.py``) spreads over the
draft positions, both are throw-away int64 copies: the temperatures are truncated to integers, the op fills a copy
nobody reads, and the output buffer (allocated with ``new_empty``) keeps uninitialised memory. The target logits
are then divided by that memory, so every sampled speculative step (T > 0) draws from a wrong law; greedy steps
return before this code, which is why greedy outputs stay identical.

Nothing here is decided from vLLM's version or source text. :func:`expand_is_exact` runs an expand function the way
the rejection sampler runs it for temperatures (fractional float32 values, the greedy sentinel replaced, into an
output filled with NaN so that an expand which writes nothing cannot pass by luck) and compares it with the exact
expansion:

* :func:`register`, the ``vllm.general_plugins`` entry point (vLLM loads it in every process that builds an engine or
  a worker, *before* the CPU platform registers its kernel replacements), runs vLLM's own CPU expand. Only if it is
  wrong does it replace it with :func:`expand_batch_values` (``where`` + ``repeat_interleave`` into ``output``), and
  then it runs the replacement through the same check. A vLLM whose expand is right (a release with PR #55006) is
  left alone. The plugin never raises: vLLM calls plugins without a ``try``, and an exception here would stop every
  vLLM engine of the environment; a failure is logged and recorded instead.
* :func:`check` tells whether sampled speculative steps are exact in this process *now*: it runs the expand that
  vLLM's rejection sampler uses (the one registered with vLLM's kernel dispatcher, or the one the worker is about to
  register) and says, where it is wrong, why and what fixes it. TLT's vLLM schedulers run it when the engine starts
  and then draft only for steps whose requests are all greedy (:mod:`tlt_trainers.vllm.scheduler`).

``TLT_VLLM_CPU_SAMPLING_FIX=0`` switches the replacement off (for measuring the bug); :func:`check` then reports the
bug and the schedulers keep sampled steps plain.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("vllm.tlt_trainers")  # under vLLM's logger: its handler and level

UPSTREAM_ISSUE = "https://github.com/vllm-project/vllm/issues/55005"
UPSTREAM_FIX = "https://github.com/vllm-project/vllm/pull/55006"
SWITCH = "TLT_VLLM_CPU_SAMPLING_FIX"
PLUGIN_NAME = "tlt_cpu_sampling_fix"  # the entry point's name (pyproject.toml); VLLM_PLUGINS must allow it
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"  # its name in vLLM's kernel dispatcher


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


# The check's buffer: four requests' temperatures (one greedy: 0 is vLLM's GREEDY_TEMPERATURE, replaced by 1) over
# 2, 1, 3 and 1 draft positions, as the rejection sampler expands them before dividing the target logits.
_TEMPERATURES = (0.7, 0.0, 1.3, 0.25)
_CU_NUM_TOKENS = (2, 3, 6, 7)
_EXPECTED = (0.7, 0.7, 1.0, 1.3, 1.3, 1.3, 0.25)


def expand_is_exact(expand: Callable[..., None]) -> bool:
    """Whether ``expand`` (called as vLLM's dispatcher calls an ``expand_kernel`` replacement) writes the exact
    expansion of fractional float32 temperatures. An expand that raises is not exact."""
    values = torch.tensor(_TEMPERATURES, dtype=torch.float32)
    output = torch.full((len(_EXPECTED),), float("nan"), dtype=torch.float32)
    try:
        expand(output, values, torch.tensor(_CU_NUM_TOKENS, dtype=torch.int32), 0, 1, MAX_NUM_TOKENS=8)
    except Exception as err:  # noqa: BLE001 (whatever it raises, it is not an exact expand)
        logger.debug("tlt_trainers: the expand check raised %r", err)
        return False
    return torch.equal(output, torch.tensor(_EXPECTED, dtype=torch.float32))


@dataclass(frozen=True)
class SamplingCheck:
    """Whether vLLM's speculative steps sample the exact law at T > 0 in this process, and if not why and the fix."""

    exact: bool
    reason: str
    fix: str = ""
    patched: bool = False  # TLT's replacement is the expand vLLM runs


_state: dict[str, str] = {}  # what register() did in this process: "replaced", "not_needed", "error", "switched_off"
_originals: dict[str, Callable[..., None]] = {}  # vLLM's functions register() replaced, by name
_announced: list[bool] = []


def _announce() -> None:
    """Say once per process, where vLLM's logging is set up (the first speculative step, not the plugin's load,
    which comes before vLLM configures its loggers), what was replaced and why."""
    _announced.append(True)
    logger.info("tlt_trainers: replaced vLLM's CPU %s (it divides the rejection sampler's target logits by "
                "uninitialised memory at temperature > 0, %s) with an exact PyTorch version.",
                _state.get("replaced", "_expand_kernel_impl"), UPSTREAM_ISSUE)


def _platform_name() -> str | None:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(getattr(current_platform, "device_type", None))


def _uses_cpu_replacements() -> bool:
    """Whether vLLM replaces its Triton kernels with C++ ones here: the cpu platform without a Triton CPU backend."""
    from vllm.triton_utils import HAS_TRITON

    return _platform_name() == "cpu" and not HAS_TRITON


def _load_cpu_ops() -> None:
    """vLLM's C++ ops (``torch.ops._C``), which its CPU expand calls; the platform imports them in its workers."""
    try:
        torch.ops._C.expand_kernel_impl  # noqa: B018 (the attribute access is the check)
    except (AttributeError, RuntimeError):
        from vllm.platforms import current_platform

        current_platform.import_kernels()


def register() -> None:
    """The entry point (``vllm.general_plugins``): where vLLM's CPU expand is wrong, replace it with an exact one.

    Never raises: a failure is logged (with its traceback) and recorded, vLLM goes on, and :func:`check` reports it.
    """
    try:
        _register()
    except Exception as err:  # noqa: BLE001 (vLLM loads plugins without a try: an error here stops its engines)
        _state["error"] = repr(err)
        logger.exception("tlt_trainers: its fix of vLLM's CPU speculative sampling failed (%r). vLLM runs on; TLT's "
                         "schedulers keep steps with sampled requests plain in this process.", err)


def _register() -> None:
    if _state:
        return
    if os.environ.get(SWITCH, "1") == "0":
        _state["switched_off"] = SWITCH
        return
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a vLLM without CPU kernel replacements: nothing to fix
        _state["not_needed"] = "this vLLM has no CPU kernel replacements"
        return
    if not _uses_cpu_replacements():
        _state["not_needed"] = f"vLLM runs the Triton kernels on {_platform_name()}"
        return
    original = cpu_triton_utils._expand_kernel_impl
    if original is expand_batch_values:
        return
    _load_cpu_ops()
    if expand_is_exact(original):
        _state["not_needed"] = f"vLLM's {original.__module__}.{original.__qualname__} expands exactly"
        return
    cpu_triton_utils._expand_kernel_impl = expand_batch_values
    _originals.setdefault("expand", original)
    if not expand_is_exact(expand_batch_values):  # cannot happen unless torch itself misbehaves: say so, undo
        cpu_triton_utils._expand_kernel_impl = original
        raise RuntimeError("the replacement expand failed its own check")
    _state["replaced"] = f"{original.__module__}.{original.__qualname__}"
    from vllm.triton_utils import dispatcher

    if EXPAND_KERNEL in getattr(dispatcher, "_registry", {}):
        logger.warning("tlt_trainers: vLLM registered its CPU kernel replacements before TLT's plugin loaded; "
                       "speculative sampling at temperature > 0 stays wrong in this process (%s).", UPSTREAM_ISSUE)


def _expand_in_use() -> Callable[..., None]:
    """The expand vLLM's rejection sampler runs in this process: the one registered with the kernel dispatcher, or
    before registration (a scheduler process, a worker not started yet) the one the CPU platform will register."""
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    entry = getattr(dispatcher, "_registry", {}).get(EXPAND_KERNEL)
    return entry[1] if entry is not None else cpu_triton_utils._expand_kernel_impl


def _why_not_exact() -> tuple[str, str]:
    """(reason, fix) for an expand that failed the check, from what :func:`register` did in this process."""
    upgrade = f"or use a vLLM with the upstream fix ({UPSTREAM_FIX})"
    if "switched_off" in _state or os.environ.get(SWITCH) == "0":
        return (f"{SWITCH}=0 switched TLT's fix off", f"unset {SWITCH} {upgrade}")
    if "error" in _state:
        return (f"TLT's fix failed when vLLM loaded it: {_state['error']}", f"report it with the log above, {upgrade}")
    if "replaced" in _state:
        return ("vLLM registered its CPU kernels before TLT's plugin loaded",
                f"let vLLM load the plugin before its workers start (its general plugins), {upgrade}")
    return (f"TLT's vLLM plugin did not run in this process (its `vllm.general_plugins` entry point {PLUGIN_NAME!r} "
            "is not installed, or VLLM_PLUGINS leaves it out)",
            f"install tlt-trainers into this environment (`pip install tlt-trainers`, or `pip install -e .` in a "
            f"checkout) and, if VLLM_PLUGINS is set, add {PLUGIN_NAME} to it; {upgrade}")


def check() -> SamplingCheck:
    """Run the expand vLLM's rejection sampler uses in this process and say whether sampled speculative steps
    (T > 0) are exact, and if not why and what fixes it. Never raises."""
    try:
        if not _uses_cpu_replacements():
            return SamplingCheck(True, f"vLLM runs its Triton rejection-sampler kernels on {_platform_name()}")
        _load_cpu_ops()
        expand = _expand_in_use()
    except Exception as err:  # noqa: BLE001 (a vLLM without what this reads: the check cannot vouch for it)
        return SamplingCheck(False, f"the check of vLLM's CPU expand could not run ({err!r})",
                             f"report it, or use a vLLM with the upstream fix ({UPSTREAM_FIX})")
    patched = expand is expand_batch_values
    if expand_is_exact(expand):
        reason = ("TLT's replacement of vLLM's CPU expand is in use and exact" if patched
                  else "vLLM's CPU expand is exact as installed")
        return SamplingCheck(True, reason, patched=patched)
    reason, fix = _why_not_exact()
    return SamplingCheck(False, f"vLLM's CPU expand divides the target logits by wrong temperatures ({UPSTREAM_ISSUE})"
                                f": {reason}", fix, patched=patched)


def applied() -> bool:
    """Whether TLT's replacement is the expand vLLM runs in this process, and it passed the check."""
    result = check()
    return result.patched and result.exact
