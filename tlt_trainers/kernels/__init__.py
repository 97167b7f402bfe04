"""Triton kernels for the rollout engine, installed as ``tlt_trainers.kernels``.

Each kernel has a pure-torch reference that defines its result; the kernel is only a faster way to
compute the same thing. Triton is optional (``pip install "tlt-trainers[kernels]"``): nothing here may
import it at module level, so ``import tlt_trainers.kernels`` works without it.

- :func:`verify_chain_reference` (``verify_reference.py``): chain rejection sampling with explicit
  uniforms, the reference for a fused verify kernel; equal to ``tlt_trainers.sampling.verify_sampled``.
- :func:`verify_chain_triton`, :func:`verify_tree_triton` (``verify_triton.py``, needs Triton): chain and tree
  verification in one launch per step, equal to the torch path on the same uniforms.
- :func:`packed_ttt_attention`, :class:`PackedSequences` (``packed_attention.py``): drafter training's attention
  over sequences packed end to end, flash-attn's varlen kernel on CUDA (optional) and a torch loop elsewhere.

Names are imported on first use, not here: run from the repository root (``python -m pytest``, ``python -c``),
this folder is also the top-level package ``kernels``, the name of Hugging Face's kernels library, which
transformers 5.16+ imports while it is itself importing (``is_kernels_available``). An eager import of
tlt_trainers here would then import transformers.modeling_utils inside that import: a circular ImportError.
"""

from __future__ import annotations

import importlib

_LAZY = {"verify_chain_reference": ".verify_reference", "verify_chain_triton": ".verify_triton",
         "verify_tree_triton": ".verify_triton", "packed_ttt_attention": ".packed_attention",
         "PackedSequences": ".packed_attention"}

__all__: list[str] = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
