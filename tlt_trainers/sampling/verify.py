"""One verification for every proposal: what the drafts carry decides how they are checked.

A proposal is a draft tree per row (a chain is the tree whose node j hangs from node j - 1). Drafts that were
sampled carry the distribution q they were drawn from and are verified by rejection sampling against it
(:func:`verify_sampled`); drafts without q are point masses (greedy drafts, top-k trees, rollout history) and are
verified by drawing the policy's own token at each node and following the child that matches it
(:func:`verify_tree`). Either way the emitted tokens have exactly the policy's distribution. On CUDA with Triton
installed, sampled chains and trees are verified by one fused kernel per step (``tlt_trainers.kernels``), from the
same uniforms and with the same decisions.

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
from dataclasses import dataclass

import torch

from .chain import ChainVerdict, verify_greedy, verify_sampled, verify_sampled_with_uniforms
from .distribution import sample_categorical, uniform
from .tree import DraftTree, verify_tree

logger = logging.getLogger(__name__)


@dataclass
class Proposal:
    """Draft tokens for one step of the active rows."""

    tree: DraftTree  # N draft nodes per row (N = 0: a plain decoding step)
    is_chain: bool  # node j's parent is node j - 1 for every row (causal attention suffices)
    draft_probs: torch.Tensor | None = None  # [B, N, V'] q of each sampled draft; None: point masses
    draft_ids: torch.Tensor | None = None  # [B, N] the drafts' ids in the draft vocabulary (with draft_probs)
    draft_to_target: torch.Tensor | None = None  # [V'] target ids of the draft vocabulary; None: the full one

    @staticmethod
    def chain(tokens: torch.Tensor, **sampled) -> Proposal:
        return Proposal(DraftTree.chain(tokens), is_chain=True, **sampled)

    @staticmethod
    def nothing(batch: int, device: torch.device | str) -> Proposal:
        """No drafts: the policy's pass decodes one token per row."""
        return Proposal.chain(torch.empty(batch, 0, dtype=torch.long, device=device))


@dataclass
class Verdict:
    """What verification decided for each row."""

    num_accepted: torch.Tensor  # [B] drafts accepted along one root-to-node path
    path: torch.Tensor  # [B, D] the accepted nodes (1..N) in order; 0 past num_accepted
    next_token: torch.Tensor  # [B] the policy's token after the accepted path (correction or bonus)
    # [B] sampled chains only: the probability that the first draft is kept, sum(min(p_1, q_1)) (see ChainVerdict)
    first_acceptance: torch.Tensor | None = None

    def emitted(self, tree: DraftTree) -> torch.Tensor:
        """[B, D + 1] tokens to append: the accepted path's tokens, then ``next_token`` (entries past
        ``num_accepted + 1`` are filler)."""
        if tree.num_nodes == 0:
            return self.next_token[:, None]
        path_tokens = tree.tokens.gather(1, (self.path - 1).clamp(min=0))
        emitted = torch.cat([path_tokens, path_tokens.new_zeros(path_tokens.shape[0], 1)], dim=1)
        return emitted.scatter_(1, self.num_accepted[:, None], self.next_token[:, None])


def fused_kernels(device: torch.device):
    """The Triton verification kernels (``tlt_trainers.kernels.verify_triton``) where they run and pay: CUDA with
    Triton installed. None elsewhere: the torch path."""
    return _triton_verification() if device.type == "cuda" else None


@functools.cache
def _triton_verification():
    # Looked up once: a failed import is not cached by Python, and this runs at every verify step.
    try:
        from tlt_trainers.kernels import verify_triton
    except ImportError:
        return None
    return verify_triton


# ------------------------------------------------------------------ the kernels' self-check
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


# ------------------------------------------------------------------ verification
def verify(proposal: Proposal, scores: torch.Tensor, do_sample: bool,
           generator: torch.Generator | None = None) -> Verdict:
    """Accept a path of ``proposal``'s drafts given the policy's processed logits ``scores`` [B, N + 1, V]
    (position 0: after the root, i.e. the last committed token; position j: after node j)."""
    tree = proposal.tree
    if tree.num_nodes == 0:
        first = scores[:, 0]
        token = sample_categorical(torch.softmax(first, dim=-1), generator) if do_sample else first.argmax(dim=-1)
        none = torch.zeros_like(token)
        return Verdict(none, none[:, None], token)
    kernels = fused_kernels(scores.device)
    batch, device = tree.tokens.shape[0], scores.device
    if proposal.draft_probs is not None:
        probs = torch.softmax(scores, dim=-1)
        n = proposal.draft_probs.shape[-1]
        shape = (tree.num_nodes, probs.shape[-1], n, proposal.draft_to_target is not None, tree.tokens.dtype)
        launcher = None if kernels is None else kernel_self_check(kernels, CHAIN, device, shape)
        if launcher is None:
            chain = verify_sampled(tree.tokens, proposal.draft_probs, probs, generator, proposal.draft_to_target,
                                   proposal.draft_ids)
        else:  # the uniforms verify_sampled draws, in its order
            uniforms = uniform((batch, tree.num_nodes), device, generator)
            residual_uniforms = uniform((batch,), device, generator)
            chain = _launch_chain(launcher, device, tree.tokens, proposal, probs, uniforms, residual_uniforms)
    elif proposal.is_chain and not do_sample:
        chain = verify_greedy(tree.tokens, scores.argmax(dim=-1))
    else:
        probs = torch.softmax(scores, dim=-1) if do_sample else None
        launcher = depth = None
        if do_sample and kernels is not None:
            depth = tree.max_depth
            shape = (tree.num_nodes, probs.shape[-1], depth, tree.tokens.dtype)
            launcher = kernel_self_check(kernels, TREE, device, shape)
        if launcher is not None:  # the uniforms verify_tree draws
            draws = uniform((batch, depth + 1), device, generator)
            try:
                return Verdict(*launcher(tree.tokens, tree.parents, probs, draws))
            except Exception as exc:  # noqa: BLE001 - a launch that failed after the check passed: torch from now on
                _switch_off(TREE, launcher, device, f"{type(exc).__name__} at launch: {exc}")
                # verify_tree draws its own uniforms: new ones, the same law (these were not used)
        walked = verify_tree(tree, probs, generator, target_argmax=None if do_sample else scores.argmax(dim=-1))
        return Verdict(walked.num_accepted, walked.path, walked.next_token)
    nodes = torch.arange(1, tree.num_nodes + 1, device=tree.tokens.device)[None]
    path = torch.where(nodes <= chain.num_accepted[:, None], nodes, 0)
    return Verdict(chain.num_accepted, path, chain.next_token, chain.first_acceptance)


def _launch_chain(launcher, device, tokens, proposal: Proposal, probs, uniforms, residual_uniforms) -> ChainVerdict:
    """The chain kernel; the torch path on the same uniforms (the same result) if a launch fails after the check
    passed (then the kernel is off on ``device`` from here on)."""
    args = (tokens, proposal.draft_probs, probs, uniforms, residual_uniforms, proposal.draft_to_target,
            proposal.draft_ids)
    try:
        return launcher(*args)
    except Exception as exc:  # noqa: BLE001
        _switch_off(CHAIN, launcher, device, f"{type(exc).__name__} at launch: {exc}")
        return verify_sampled_with_uniforms(*args)
