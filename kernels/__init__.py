"""Triton kernels for the rollout engine, installed as ``tlt_trainers.kernels``.

Each kernel has a pure-torch reference in ``tlt_trainers.spec`` that defines its result; the kernel
is only a faster way to compute the same thing. Triton is optional (``pip install "tlt-trainers[kernels]"``):
nothing here may import it at module level, so ``import tlt_trainers.kernels`` works without it.
"""

__all__: list[str] = []
