"""GPU path without the tlt backend: veRL's vLLM rollout drafting with our drafter (vLLM's EAGLE speculation).

    kwargs = vllm_engine_kwargs(drafter, "/ckpt/drafter_vllm", policy_name_or_path, num_speculative_tokens=3)
    # -> actor_rollout_ref.rollout.engine_kwargs.vllm=<kwargs>, with actor_rollout_ref.rollout.name=vllm

vLLM keeps the drafter it loaded at start-up: this path does not retrain it during RL (the tlt backend does).
Refreshing the served drafter after updates is what :mod:`tlt_trainers.vllm` does (a worker extension that reloads
its weights in the running engine, tested with the real vLLM on CPU in tests/test_vllm.py); veRL's vLLM rollout is
not wired to it yet.
"""

from __future__ import annotations

import os

from torch import nn

from ..drafter.eagle import EagleDrafter
from ..drafter.export import export_vllm
from ..vllm.config import speculative_config


def vllm_engine_kwargs(drafter: EagleDrafter, out_dir: str | os.PathLike, policy: str | nn.Module | None = None,
                       num_speculative_tokens: int = 3) -> dict:
    """Export ``drafter`` where vLLM's EAGLE loader reads it and return ``engine_kwargs.vllm`` that points at it."""
    path = export_vllm(drafter, out_dir, policy, num_speculative_tokens=num_speculative_tokens)
    return {"speculative_config": speculative_config(path, num_speculative_tokens)}
