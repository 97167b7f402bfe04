"""GPU path without the tlt backend: veRL's vLLM rollout drafting with our drafter (vLLM's EAGLE speculation).

    kwargs = vllm_engine_kwargs(drafter, "/ckpt/drafter_vllm", policy_name_or_path, num_speculative_tokens=3)
    # -> actor_rollout_ref.rollout.engine_kwargs.vllm=<kwargs>, with actor_rollout_ref.rollout.name=vllm

vLLM keeps the drafter it loaded at start-up: this path does not retrain it during RL (the tlt backend does).
It is verified only in its export format (tests/test_export.py); vLLM itself needs a CUDA machine.
"""

from __future__ import annotations

import os

from torch import nn

from ..drafter.eagle import EagleDrafter
from ..drafter.export import export_vllm


def vllm_engine_kwargs(drafter: EagleDrafter, out_dir: str | os.PathLike, policy: str | nn.Module | None = None,
                       num_speculative_tokens: int = 3) -> dict:
    """Export ``drafter`` where vLLM's EAGLE loader reads it and return ``engine_kwargs.vllm`` that points at it."""
    path = export_vllm(drafter, out_dir, policy, num_speculative_tokens=num_speculative_tokens)
    return {"speculative_config": {"method": "eagle", "model": str(path),
                                   "num_speculative_tokens": int(num_speculative_tokens)}}
