"""Triton kernels for the rollout engine, installed as ``tlt_trainers.kernels``.

Each kernel has a pure-torch reference that defines its result; the kernel is only a faster way to
compute the same thing. Triton is optional (``pip install "tlt-trainers[kernels]"``): nothing here may
import it at module level, so ``import tlt_trainers.kernels`` works without it.

- :func:`verify_chain_reference` (``verify_reference.py``): chain rejection sampling with explicit
  uniforms, the reference for a fused verify kernel; equal to ``tlt_trainers.sampling.verify_sampled``.
"""

from .verify_reference import verify_chain_reference

__all__: list[str] = ["verify_chain_reference"]
