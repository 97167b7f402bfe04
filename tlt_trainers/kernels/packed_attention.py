"""Attention of the drafter's training-time test over packed sequences: no padding, flash-attn where it runs.

Drafter training unrolls ``depth`` draft steps (EAGLE-3's training-time test). At step ``k`` the query at position t
of a sequence attends to

- the keys of step 0 at positions ``0 .. t - k`` of its own sequence (a causal prefix, shifted by ``k``), and
- on its diagonal, the key of each step ``j = 1 .. k`` at position ``t - k + j`` (``j = k``: itself).

Rollouts differ wildly in length, so a padded micro-batch is mostly padding; here the sequences are concatenated
into one row of T tokens (:class:`PackedSequences`). The prefix part is a causal variable-length attention, which
flash-attn computes without padding (``flash_attn_varlen``); the diagonal part is k dot products per query, done in
torch; the two are merged through their log-sum-exps into one softmax.

flash-attn does not differentiate its log-sum-exp (it returns it but drops its gradient), so the merge cannot be
left to autograd. :class:`PackedTTTAttention` is one autograd function for the whole merged softmax: its backward
hands flash-attn's backward the merged output and log-sum-exp, which is exactly the prefix part's share of the
merged softmax's gradient (as ring attention does with its blocks), and adds the diagonal part's in torch.

The prefix attention has two interchangeable backends with the same signature: :class:`TorchVarlen` (per sequence,
in torch: the reference, and the path on every device without flash-attn) and :class:`FlashVarlen` (flash-attn
2.7 - 2.8's ``_flash_attn_varlen_forward/backward``, CUDA, float16/bfloat16). Tests compare the torch backend, run
through the same autograd function, with the padded masked attention; ``benchmarks/gpu_check.py`` compares the
flash backend with the torch one on a GPU.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch

FLASH_VERSIONS = ("2.7", "2.9")  # the private varlen forward/backward signature read here: [2.7, 2.9)
FLASH_TOLERANCE = 5e-2  # flash against torch in bfloat16, relative to scale (see backend_difference)


@dataclass(frozen=True)
class PackedSequences:
    """Sequences of ``lengths`` tokens laid end to end: ``cu_seqlens`` [b + 1] (int32, where each starts),
    ``positions`` [T] (each token's position in its sequence), ``max_len``."""

    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    max_len: int

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> PackedSequences:
        if not lengths or min(lengths) < 1:
            raise ValueError(f"Packed sequences need at least one token each, got lengths {lengths}.")
        lengths_t = torch.tensor(lengths, dtype=torch.int32, device=device)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
        cu[1:] = lengths_t.cumsum(0)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return cls(lengths_t, cu, positions, max(lengths))

    @property
    def total(self) -> int:
        return int(self.positions.shape[0])

    @functools.cached_property
    def token_lengths(self) -> torch.Tensor:
        """The length of each token's sequence [T] (int64)."""
        return self.lengths.long().repeat_interleave(self.lengths.long())

    def prefix(self, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The causal prefix of draft step ``shift``: queries at positions >= shift attend to keys at positions
        <= t - shift. Returns (query rows, key rows, cu_seqlens, max length) of the equal-length causal problem
        (sequences shorter than ``shift + 1`` drop out)."""
        query_rows = (self.positions >= shift).nonzero().squeeze(1)
        key_rows = (self.positions < self.token_lengths - shift).nonzero().squeeze(1)
        kept = (self.lengths - shift).clamp(min=0)
        kept = kept[kept > 0]
        cu = torch.zeros(kept.shape[0] + 1, dtype=torch.int32, device=self.cu_seqlens.device)
        cu[1:] = kept.cumsum(0)
        return query_rows, key_rows, cu, max(self.max_len - shift, 0)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[.., kv_heads, D] -> [.., heads, D] (grouped-query attention)."""
    return x.repeat_interleave(heads // x.shape[-2], dim=-2)


def _sum_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[.., heads, D] -> [.., kv_heads, D], summing each group's heads (the adjoint of :func:`_expand_heads`)."""
    *lead, heads, dim = x.shape
    return x.reshape(*lead, kv_heads, heads // kv_heads, dim).sum(-2)


class TorchVarlen:
    """Causal variable-length attention in torch, one sequence at a time (float32 scores)."""

    @staticmethod
    def forward(q, k, v, cu_seqlens, max_len, scale):
        """(out [T, H, D] in q's dtype, log-sum-exp [H, T] float32)."""
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
            scores, values = TorchVarlen._scores(q, k, v, start, end, scale)
            lse[:, start:end] = scores.logsumexp(-1)
            out[start:end] = (scores.softmax(-1) @ values).transpose(0, 1).to(q.dtype)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_seqlens, max_len, scale):
        """Gradients (dq, dk, dv) of a softmax whose normaliser is ``lse`` [H, T] and output ``out`` (which may belong
        to a larger softmax than these keys: then these are its share, as in flash-attn's backward)."""
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        kv_heads = k.shape[1]
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
            scores, values = TorchVarlen._scores(q, k, v, start, end, scale)
            probs = (scores - lse[:, start:end, None]).exp()  # [H, n, n]
            grad_out = dout[start:end].transpose(0, 1).float()  # [H, n, D]
            delta = (grad_out * out[start:end].transpose(0, 1).float()).sum(-1, keepdim=True)
            grad_scores = probs * (grad_out @ values.transpose(1, 2) - delta) * scale
            keys = _expand_heads(k[start:end].float(), q.shape[1]).transpose(0, 1)
            dq[start:end] = (grad_scores @ keys).transpose(0, 1).to(dq.dtype)
            grad_keys = (grad_scores.transpose(1, 2) @ q[start:end].transpose(0, 1).float()).transpose(0, 1)
            grad_values = (probs.transpose(1, 2) @ grad_out).transpose(0, 1)
            dk[start:end] = _sum_groups(grad_keys, kv_heads).to(dk.dtype)
            dv[start:end] = _sum_groups(grad_values, kv_heads).to(dv.dtype)
        return dq, dk, dv

    @staticmethod
    def _scores(q, k, v, start, end, scale):
        heads, n = q.shape[1], end - start
        query = q[start:end].transpose(0, 1).float()  # [H, n, D]
        keys = _expand_heads(k[start:end].float(), heads).transpose(0, 1)
        values = _expand_heads(v[start:end].float(), heads).transpose(0, 1)
        scores = (query @ keys.transpose(1, 2)) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~causal, float("-inf")), values


class FlashVarlen:
    """flash-attn's variable-length forward and backward (private functions of flash-attn 2.7 - 2.8, the only ones
    that return the log-sum-exp and take an output and log-sum-exp in the backward)."""

    def __init__(self, interface):
        self._forward = interface._wrapped_flash_attn_varlen_forward
        self._backward = interface._wrapped_flash_attn_varlen_backward

    def forward(self, q, k, v, cu_seqlens, max_len, scale):
        out, lse, _, _ = self._forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, scale, causal=True,
                                       window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                       return_softmax=False)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_seqlens, max_len, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._backward(dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), dq, dk, dv, cu_seqlens,
                       cu_seqlens, max_len, max_len, 0.0, scale, True, -1, -1, 0.0, None, False, rng_state=None)
        return dq, dk, dv


@functools.cache
def _flash_interface():
    """flash-attn's interface module when an installed version has the functions :class:`FlashVarlen` calls."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except ImportError:
        return None
    version = tuple(int(p) for p in flash_attn.__version__.split(".")[:2])
    low, high = (tuple(int(p) for p in v.split(".")) for v in FLASH_VERSIONS)
    if not low <= version < high:
        warnings.warn(f"flash-attn {flash_attn.__version__} is installed but packed drafter attention reads the "
                      f"varlen functions of flash-attn >= {FLASH_VERSIONS[0]}, < {FLASH_VERSIONS[1]}; using the "
                      "torch path (install a version in that range for the fast one).", stacklevel=2)
        return None
    return flash_attn_interface


def flash_varlen_available(device: torch.device) -> bool:
    """Whether :class:`FlashVarlen` runs on ``device``: CUDA with a supported flash-attn whose forward and backward,
    run once on a small problem through :class:`PackedTTTAttention`, agree with :class:`TorchVarlen` (the functions
    read are private to flash-attn; a release that changed them falls back to torch with a warning, not a wrong
    gradient)."""
    return device.type == "cuda" and _flash_interface() is not None and _flash_agrees(device.index or 0)


@functools.cache
def _flash_agrees(device_index: int) -> bool:
    try:
        error = backend_difference(FlashVarlen(_flash_interface()), PackedSequences.from_lengths(
            [5, 1, 19, 8], torch.device("cuda", device_index)), step=1, heads=4, kv_heads=2)
    except Exception as exc:  # noqa: BLE001 - any failure of a private API means: do not use it
        error, reason = float("inf"), f"{type(exc).__name__}: {exc}"
    else:
        reason = f"max difference {error:.3g} of the tensors' scale"
    if error < FLASH_TOLERANCE:
        return True
    warnings.warn(f"flash-attn's varlen attention disagrees with the torch path ({reason}); packed drafter training "
                  "uses the torch path. Please report this with your flash-attn version.", stacklevel=3)
    return False


def backend_difference(backend, packed: PackedSequences, step: int, heads: int = 8, kv_heads: int = 2,
                       head_dim: int = 64, seed: int = 0) -> float:
    """How far ``backend`` is from :class:`TorchVarlen` on draft step ``step`` of random bfloat16 inputs over
    ``packed``: the largest difference of the output and of every gradient, relative to each tensor's scale (flash
    rounds P and dS to bfloat16 in its backward). Below :data:`FLASH_TOLERANCE` counts as equal."""
    device = packed.positions.device
    generator = torch.Generator(device=device).manual_seed(seed)
    leaves = [torch.randn(packed.total, h, head_dim, generator=generator, device=device, dtype=torch.bfloat16)
              .requires_grad_() for h in [heads] + [kv_heads] * 2 * (step + 1)]
    grad_out = torch.randn(packed.total, heads, head_dim, generator=generator, device=device, dtype=torch.bfloat16)
    results = []
    # the first caller may be under no_grad (evaluate) or autocast: the comparison needs neither
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for candidate in (TorchVarlen(), backend):
            out = packed_ttt_attention(leaves[0], leaves[1 : step + 2], leaves[step + 2 :], packed, candidate)
            results.append([out.detach(), *torch.autograd.grad(out, leaves, grad_out)])
    return max(float((a.float() - b.float()).abs().max() / (1 + b.float().abs().max()))
               for a, b in zip(*results, strict=True))


def varlen_backend(q: torch.Tensor, prefer: str = "auto"):
    """The prefix backend for queries ``q``: flash-attn on CUDA in float16/bfloat16 with a head size it takes (a
    multiple of 8, at most 256), else torch. ``prefer="torch"`` forces torch; ``"flash-attn"`` refuses to fall back."""
    if prefer not in ("auto", "torch", "flash-attn"):
        raise ValueError(f"backend={prefer!r}: choose 'auto', 'torch' or 'flash-attn'.")
    usable = (flash_varlen_available(q.device) and q.dtype in (torch.float16, torch.bfloat16)
              and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)
    if prefer == "flash-attn" and not usable:
        raise RuntimeError("flash-attn's varlen attention cannot run here: it needs CUDA, float16/bfloat16 queries, "
                           f"a head size that is a multiple of 8, and flash-attn >= {FLASH_VERSIONS[0]}, "
                           f"< {FLASH_VERSIONS[1]} (pip install 'tlt-trainers[flash]').")
    return FlashVarlen(_flash_interface()) if usable and prefer != "torch" else TorchVarlen()


class PackedTTTAttention(torch.autograd.Function):
    """One draft step's attention over packed sequences: the causal prefix (through ``backend``) and the diagonal
    keys merged into one softmax. See the module docstring."""

    @staticmethod
    def forward(ctx, q, prefix_keys, prefix_values, diagonal_keys, diagonal_values, diagonal_valid, prefix, scale,
                backend):
        # q [T, H, D]; prefix_keys/values [T, Hkv, D]; diagonal_* [k, T, Hkv, D], diagonal_valid [k, T]
        with torch.autocast(q.device.type, enabled=False):  # float32 merge whatever the caller's autocast
            return PackedTTTAttention._forward(ctx, q, prefix_keys, prefix_values, diagonal_keys, diagonal_values,
                                               diagonal_valid, prefix, scale, backend)

    @staticmethod
    def _forward(ctx, q, prefix_keys, prefix_values, diagonal_keys, diagonal_values, diagonal_valid, prefix, scale,
                 backend):
        query_rows, key_rows, cu_seqlens, max_len = prefix
        total, heads, _ = q.shape
        prefix_lse = torch.full((total, heads), float("-inf"), dtype=torch.float32, device=q.device)
        prefix_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if query_rows.numel():
            out, lse = backend.forward(q[query_rows].contiguous(), prefix_keys[key_rows].contiguous(),
                                       prefix_values[key_rows].contiguous(), cu_seqlens, max_len, scale)
            prefix_out[query_rows] = out.float()
            prefix_lse[query_rows] = lse.t()
        diag_scores = _diagonal_scores(q, diagonal_keys, diagonal_valid, scale)
        lse = torch.cat([prefix_lse[None], diag_scores]).logsumexp(0)  # [T, H]: the diagonal holds the query itself
        out = (prefix_lse - lse).exp()[..., None] * prefix_out
        out = out + _grouped("ktng,ktnd->tngd", (diag_scores - lse).exp(), diagonal_values)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, prefix_keys, prefix_values, diagonal_keys, diagonal_values, diagonal_valid, out, lse,
                              query_rows, key_rows, cu_seqlens)
        ctx.max_len, ctx.scale, ctx.backend = max_len, scale, backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return PackedTTTAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        (q, prefix_keys, prefix_values, diagonal_keys, diagonal_values, diagonal_valid, out, lse, query_rows, key_rows,
         cu_seqlens) = ctx.saved_tensors
        scale, kv_heads = ctx.scale, prefix_keys.shape[1]
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_keys, grad_values = torch.zeros_like(prefix_keys), torch.zeros_like(prefix_values)
        if query_rows.numel():  # the prefix keys' share of the merged softmax: flash's backward on merged out/lse
            dq, dk, dv = ctx.backend.backward(
                grad_out[query_rows].to(q.dtype), q[query_rows].contiguous(), prefix_keys[key_rows].contiguous(),
                prefix_values[key_rows].contiguous(), out[query_rows], lse[query_rows].t().contiguous(), cu_seqlens,
                ctx.max_len, scale)
            grad_q[query_rows] = dq.float()
            grad_keys[key_rows] = dk.to(grad_keys.dtype)
            grad_values[key_rows] = dv.to(grad_values.dtype)
        probs = (_diagonal_scores(q, diagonal_keys, diagonal_valid, scale) - lse).exp()  # [k, T, H]
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(-1)  # [T, H]
        grad_scores = probs * (_grouped("tngd,ktnd->ktng", grad_out, diagonal_values) - delta) * scale  # [k, T, H]
        grad_q += _grouped("ktng,ktnd->tngd", grad_scores, diagonal_keys)
        grad_diag_keys = _grouped("ktng,tngd->ktnd", grad_scores, q, kv_heads)
        grad_diag_values = _grouped("ktng,tngd->ktnd", probs, grad_out, kv_heads)
        return (grad_q.to(q.dtype), grad_keys, grad_values, grad_diag_keys.to(diagonal_keys.dtype),
                grad_diag_values.to(diagonal_values.dtype), None, None, None, None)


def _diagonal_scores(q, keys, valid, scale):
    """Scores [k, T, H] of each query against its diagonal keys (-inf where a diagonal key does not exist)."""
    scores = _grouped("tngd,ktnd->ktng", q, keys) * scale
    return scores.masked_fill(~valid[..., None], float("-inf"))


def _grouped(equation: str, a: torch.Tensor, b: torch.Tensor, kv_heads: int | None = None) -> torch.Tensor:
    """``einsum`` in float32 over grouped-query heads without expanding the kv heads: per-head operands ([.., H] or
    [.., H, D], head h = kv head h // G) are viewed as [.., kv_heads, G(, D)] (subscripts n, g), kv operands
    [.., kv_heads, D] as they are; a per-head result comes back as [.., H(, D)]. ``kv_heads`` is needed only when
    neither operand has the kv layout (the result then has it)."""
    inputs, output = equation.split("->")
    operands = []
    for subscripts, x in zip(inputs.split(","), (a, b), strict=True):
        x = x.float()
        if "g" in subscripts:  # per-head: split H into (kv_heads, G)
            kv = kv_heads or next(y.shape[-2] for s, y in zip(inputs.split(","), (a, b), strict=True) if "g" not in s)
            if subscripts.endswith("g"):  # [.., H]
                x = x.reshape(*x.shape[:-1], kv, x.shape[-1] // kv)
            else:  # [.., H, D]
                x = x.reshape(*x.shape[:-2], kv, x.shape[-2] // kv, x.shape[-1])
        operands.append(x)
    result = torch.einsum(equation, *operands)
    if "g" in output:  # merge (kv_heads, G) back into H
        result = result.flatten(-2, -1) if output.endswith("g") else result.flatten(-3, -2)
    return result


def packed_ttt_attention(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         packed: PackedSequences, backend=None) -> torch.Tensor:
    """Draft step ``k = len(keys) - 1``'s attention over packed sequences.

    ``query`` [T, H, D] (step k's queries), ``keys``/``values``: each step's [T, Hkv, D] so far (step 0 first).
    Returns [T, H, D]. ``backend``: :class:`TorchVarlen`, :class:`FlashVarlen` or None for :func:`varlen_backend`.
    """
    step = len(keys) - 1
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # rotary embeddings in float32 can promote q and k: cast them back
        dtype = torch.get_autocast_dtype(device_type)
        query, keys, values = query.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    positions = packed.positions
    diagonal_keys, diagonal_values, diagonal_valid = [], [], []
    for j in range(1, step + 1):  # step j's key at t - step + j: its own sequence's, where that position exists
        shift = step - j
        diagonal_keys.append(_shift_rows(keys[j], shift))
        diagonal_values.append(_shift_rows(values[j], shift))
        diagonal_valid.append(positions >= shift)
    if step == 0:
        empty = keys[0].new_zeros((0, *keys[0].shape))
        diagonal_k, diagonal_v = empty, empty
        valid = torch.zeros(0, packed.total, dtype=torch.bool, device=query.device)
    else:
        diagonal_k, diagonal_v = torch.stack(diagonal_keys), torch.stack(diagonal_values)
        valid = torch.stack(diagonal_valid)
    backend = backend or varlen_backend(query)
    scale = 1.0 / math.sqrt(query.shape[-1])
    return PackedTTTAttention.apply(query, keys[0], values[0], diagonal_k, diagonal_v, valid, packed.prefix(step),
                                    scale, backend)


def _shift_rows(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Row t of the result is row t - shift of ``x`` (zeros before the start; rows that cross a sequence boundary
    are masked out by the caller)."""
    if shift == 0:
        return x
    kept = max(x.shape[0] - shift, 0)
    return torch.cat([x.new_zeros((x.shape[0] - kept, *x.shape[1:])), x[:kept]])
