"""The fused verification kernels where they run and pay, each checked against the torch path before first use.

:func:`fused_verification` gives :func:`tlt_trainers.sampling.verify.verify` the Triton kernels
(:mod:`tlt_trainers.kernels.verify_triton`) on CUDA with Triton installed, None elsewhere (the torch path).

Before a kernel's first use in a process, for each device and shape class it will be compiled for (chain length,
vocabulary, draft vocabulary; tree nodes, vocabulary, depth), :func:`kernel_self_check` runs it once on a small
batch against the torch path and compares the results exactly: the check's probabilities are integer multiples of
2**-12 with totals below 2**24, so every sum either path forms, in any order, is exact, and fed the same uniforms
both must take the same decisions and emit the same tokens bit for bit. A mismatch, or an exception while Triton
compiles or launches the kernel, switches that kernel off on that device for the rest of the process with one
warning; the torch path then verifies (same results, more kernel launches per step).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from ..sampling.chain import verify_sampled_with_uniforms
from ..sampling.distribution import uniform
from ..sampling.tree import DraftTree, verify_tree

logger = logging.getLogger(__name__)


def fused_kernels(device: torch.device):
    """The Triton verification kernels (``tlt_trainers.kernels.verify_triton``) where they run and pay: CUDA with
    Triton installed. None elsewhere: the torch path."""
    return _triton_verification() if device.type == "cuda" else None


@functools.cache
def _triton_verification():
    # Looked up once: a failed import is not cached by Python, and this runs at every verify step.
    try:
        from . import verify_triton
    except ImportError:
        return None
    return verify_triton


CHAIN, TREE = "verify_chain_triton", "verify_tree_triton"
_CHECK_ROWS = 8
_UNIT = 2.0**-12  # the check's probabilities are integer multiples of this: every partial sum is exact
_EXACT_UNITS = 2**23  # ... as long as a row's total stays below 2**24 units (float32's 24-bit significand)

# (kernel, launcher, device, shape class) -> None where the kernel agreed with the torch path, else the reason
_CHECKS: dict[tuple, str | None] = {}
_OFF: dict[tuple, str] = {}  # (kernel, launcher, device) -> why that kernel is off on that device in this process


def kernel_self_checks() -> list[dict]:
    """The kernels' self-checks run in this process: kernel, device, shape class, whether it agreed, and why not."""
    return [{"kernel": name, "device": str(device), "shape": shape, "agrees": reason is None, "reason": reason}
            for (name, _, device, shape), reason in _CHECKS.items()]


def reset_kernel_self_checks() -> None:
    """Forget every self-check and switched-off kernel (tests; a process normally checks each shape once)."""
    _CHECKS.clear()
    _OFF.clear()


def _switch_off(name: str, launcher, device: torch.device, reason: str) -> None:
    if (name, launcher, device) in _OFF:
        return
    _OFF[(name, launcher, device)] = reason
    logger.warning("TLT: the Triton kernel %s disagrees with the torch path on %s (%s); verifying with the torch "
                   "path on this device for the rest of the process (the same results, a dozen more kernel launches "
                   "per verify step). Please report this with your GPU, torch and Triton versions.", name, device,
                   reason)


def kernel_self_check(kernels, name: str, device: torch.device, shape: tuple):
    """``kernels.<name>`` (the launcher) when it agrees with the torch path on ``device`` for this shape class, else
    None. The first call per (launcher, device, shape class) runs the check (:func:`_check_chain`,
    :func:`_check_tree`); a failure switches the kernel off on ``device`` with one warning."""
    launcher = getattr(kernels, name)
    if (name, launcher, device) in _OFF:
        return None
    key = (name, launcher, device, shape)
    if key not in _CHECKS:
        try:
            reason = (_check_chain if name == CHAIN else _check_tree)(launcher, device, *shape)
        except Exception as exc:  # noqa: BLE001 - any failure to compile or launch means: do not use it
            reason = f"{type(exc).__name__} while compiling or launching it: {exc}"
        _CHECKS[key] = reason
        if reason is not None:
            _switch_off(name, launcher, device, f"self-check for shape {shape}: {reason}")
    return None if _CHECKS[key] is not None else launcher


def _units(generator: torch.Generator, shape: tuple, high: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=generator, device=device).to(torch.float32) * _UNIT


def _differences(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    wrong = [f"{name}: kernel {got.tolist()} vs torch {expected.tolist()}" for name, (got, expected) in pairs.items()
             if got.shape != expected.shape or not torch.equal(got.to(expected.dtype), expected)]
    return "; ".join(wrong) or None


def _check_chain(launcher, device: torch.device, k: int, vocab: int, draft_vocab: int, has_t2d: bool,
                 dtype: torch.dtype) -> str | None:
    """The chain kernel against ``verify_sampled_with_uniforms`` on 8 rows of ``k`` drafts over ``vocab`` (a draft
    vocabulary of ``draft_vocab`` ids when ``has_t2d``). Row 0 keeps every draft (the bonus draw from p_k), row 1
    rejects the first (the residual draw), row 2 rejects where the residual is zero (the draw from p), the others
    are random. None when decisions, tokens and first-draft acceptances are identical."""
    rows = _CHECK_ROWS
    gen = torch.Generator(device=device).manual_seed(20261130 + k)
    if vocab >= _EXACT_UNITS // 8 or draft_vocab > vocab:
        return f"no exact check case for a vocabulary of {vocab} (draft {draft_vocab}) tokens"
    d2t = torch.randperm(vocab, generator=gen, device=device)[:draft_vocab] if has_t2d else None
    index = torch.randint(0, draft_vocab, (rows, k), generator=gen, device=device).to(dtype)
    tokens = index if d2t is None else d2t[index].to(dtype)
    q = 4 * _units(gen, (rows, k, draft_vocab), 4, device)  # multiples of 4 units, at least 4 at each draft
    q.scatter_add_(2, index[..., None].long(), torch.full((rows, k, 1), 4 * _UNIT, device=device))
    p = _units(gen, (rows, k + 1, vocab), 4, device)
    at_draft = tokens[..., None].long()
    # p / q at the draft in {0, 1/4, ..., 3/2} (whole units still): the uniform decides most accepts and rejects
    p[:, :k].scatter_(2, at_draft, q.gather(2, index[..., None].long()) / 4 * _units(gen, (rows, k, 1), 7, device)
                      / _UNIT)
    uniforms = torch.rand(rows, k, generator=gen, device=device)
    residual_uniforms = torch.rand(rows, generator=gen, device=device)
    uniforms[0] = 0.0
    p[0, :k].scatter_(1, at_draft[0], _UNIT)  # u = 0 < p at every draft: all kept
    p[1, 0, tokens[1, 0]] = 0.0  # p = 0 at the first draft: rejected
    residual = torch.zeros(vocab, device=device)  # row 2: p = q / 2 on q's support, so max(0, p - q) = 0
    if d2t is None:
        residual = q[2, 0] / 2
    else:
        residual[d2t] = q[2, 0] / 2
    p[2, 0] = residual
    uniforms[2, 0] = 0.75
    d2t_arg, index_arg = (d2t, index) if has_t2d else (None, None)
    expected = verify_sampled_with_uniforms(tokens, q, p, uniforms, residual_uniforms, d2t_arg, index_arg)
    got = launcher(tokens, q, p, uniforms, residual_uniforms, d2t_arg, index_arg)
    return _differences({"accepted drafts": (got.num_accepted, expected.num_accepted),
                         "next tokens": (got.next_token, expected.next_token),
                         "first-draft acceptance": (got.first_acceptance, expected.first_acceptance)})


def _check_tree(launcher, device: torch.device, nodes: int, vocab: int, depth: int,
                dtype: torch.dtype) -> str | None:
    """The tree kernel against ``verify_tree`` on 4 rows of a tree of ``nodes`` nodes and ``depth`` levels (a chain
    of ``depth`` nodes, the others children of the root) over ``vocab``, every candidate likely at its parent (paths
    of many lengths; 4 rows: [4, nodes + 1, vocab] probabilities are large). None when accepted counts, paths and
    tokens are identical."""
    rows = _CHECK_ROWS // 2
    if not 1 <= depth <= nodes or vocab >= _EXACT_UNITS // 2:
        return f"no exact check case for {nodes} nodes of depth {depth} over {vocab} tokens"
    gen = torch.Generator(device=device).manual_seed(20261201 + nodes)
    node = torch.arange(1, nodes + 1, device=device)
    parents = torch.where(node <= depth, node - 1, 0).expand(rows, -1).contiguous()
    depths = torch.where(node <= depth, node, 1).expand(rows, -1).contiguous()
    tokens = torch.randint(0, vocab, (rows, nodes), generator=gen, device=device).to(dtype)
    p = _units(gen, (rows, nodes + 1, vocab), 2, device)
    # The chain's candidates hold about a third of their parent's mass, the root's other children a sixth together
    boost = max(1, min(vocab, (_EXACT_UNITS - vocab) // (depth + 1)))
    side = max(1, boost // (2 * max(nodes - depth, 1)))
    weight = torch.where(node <= depth, boost, side).to(torch.float32).expand(rows, -1) * _UNIT
    p.view(rows, -1).scatter_add_(1, parents * vocab + tokens.long(), weight.contiguous())
    tree = DraftTree(tokens, parents, depths)
    seed = 20261202 + depth
    draws = uniform((rows, depth + 1), device, torch.Generator(device=device).manual_seed(seed))
    expected = verify_tree(tree, p, torch.Generator(device=device).manual_seed(seed))  # draws the same uniforms
    accepted, path, token = launcher(tokens, parents, p, draws)
    return _differences({"accepted nodes": (accepted, expected.num_accepted), "paths": (path, expected.path),
                         "next tokens": (token, expected.next_token)})



KERNEL_NAMES = {"chain": CHAIN, "tree": TREE}


class TritonVerification:
    """:class:`~tlt_trainers.sampling.verify.FusedVerification` over a module of kernels (``verify_chain_triton``,
    ``verify_tree_triton``): each launcher after its self-check for the shape class."""

    def __init__(self, kernels):
        self.kernels = kernels

    def launcher(self, kind: str, device: torch.device, shape: tuple) -> Callable | None:
        return kernel_self_check(self.kernels, KERNEL_NAMES[kind], device, shape)

    def failed(self, kind: str, launcher: Callable, device: torch.device, error: Exception) -> None:
        _switch_off(KERNEL_NAMES[kind], launcher, device, f"{type(error).__name__} at launch: {error}")


_VERIFICATIONS: dict[int, tuple[object, TritonVerification]] = {}


def fused_verification(device: torch.device) -> TritonVerification | None:
    """What verifies sampled drafts on ``device`` in one launch (:func:`fused_kernels`), or None: the torch path."""
    kernels = fused_kernels(device)
    if kernels is None:
        return None
    entry = _VERIFICATIONS.get(id(kernels))
    if entry is None or entry[0] is not kernels:
        entry = _VERIFICATIONS[id(kernels)] = (kernels, TritonVerification(kernels))
    return entry[1]
