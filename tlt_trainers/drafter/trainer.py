"""DrafterTrainer: fit the drafter to the policy from the policy's own detached hidden states.

Loss per position t, EAGLE-1: SmoothL1 between the drafter's predicted feature and the policy's h_{t+1}, plus
soft cross-entropy of the drafter's token distribution against the policy's next-token distribution at t+1.
EAGLE-3 (a drafter that predicts tokens only): the cross-entropy alone, against the policy's top-k law at t+1
computed once when a sequence enters the buffer (restricted to the draft vocabulary), or against the next token
itself for rollouts that came without it (the engine's own samples of the policy). With ``unroll_steps > 1`` the
same loss is applied to chained steps that read the drafter's own predictions (training-time test), so later draft
positions stay accurate. A block drafter (DFlash) trains block-parallel instead: random anchors per sequence, each
a block of masked slots scored in one pass (:mod:`tlt_trainers.drafter.block_training`). Only the drafter's own
parameters are optimised; the policy runs under no_grad and its
embedding and head are read, never written. An EAGLE-3 micro-batch is packed end to end rather than padded to its
longest sequence (:func:`packs_sequences`): the same loss on real tokens only.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.packed_attention import PackedSequences, flash_varlen_available
from ..modeling.features import capture_features
from ..modeling.host_memory import release_freed_host_memory
from ..modeling.target import TargetModel
from .base import Drafter
from .buffer import BufferedSequence, FeatureBuffer
from .config import WEIGHTS_NAME, EagleDrafterConfig
from .files import load_weights, staged_save
from .losses import linear_cross_entropy_sum
from .registry import kind_of

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.pt"
PRECISIONS = ("auto", "float32", "bfloat16")
ATTENTION_LAYOUTS = ("auto", "packed", "padded")
TARGET_TOP_K = 16  # the policy's most likely next tokens kept per position as a token-only drafter's target


# On a CPU, micro-steps between two releases of freed host memory (modeling/host_memory.py): each release costs the
# next step its pages again, and between releases the heap grows by the steps' transients
RELEASE_EVERY_STEPS = 16


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or
    AMX-BF16 (elsewhere bfloat16 matmuls on a CPU are emulated and slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cosine_lr(lr: float, fraction: float, floor: float = 0.1) -> float:
    """The learning rate ``fraction`` (0 to 1, clamped) of the way through a cosine decay from ``lr`` down to
    ``floor * lr``: the recipe the shipped drafters train with (a decaying rate keeps what a drafter it continues
    knew, where a constant 1e-3 costs acceptance; docs/benchmarks.md, the recipe table)."""
    fraction = min(max(fraction, 0.0), 1.0)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * fraction)))


def training_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of drafter training for ``precision`` (None: plain float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {PRECISIONS}.")
    if precision == "bfloat16" or (precision == "auto" and native_bf16(device)):
        return torch.bfloat16
    return None


def acceptance_by_position(agreement_by_step: Sequence[float], chain_length: int) -> list[float]:
    """Per draft position d of a greedy chain of ``chain_length`` drafts, the chance that drafts 0..d are all
    accepted: the product of the agreements up to d. ``agreement_by_step[d]`` is the top-1 agreement of draft step d
    given earlier steps were right; steps past the measured ones reuse the last measured value (none measured: [])."""
    if not agreement_by_step:
        return []
    chances, survive = [], 1.0
    for step in range(chain_length):
        survive *= agreement_by_step[min(step, len(agreement_by_step) - 1)]
        chances.append(survive)
    return chances


def estimated_acceptance_length(agreement_by_step: list[float], chain_length: int) -> float:
    """Expected tokens per policy forward for a greedy chain of ``chain_length`` drafts
    (:func:`acceptance_by_position`, plus the policy's own token)."""
    return 1.0 + sum(acceptance_by_position(agreement_by_step, chain_length))


@torch.no_grad()
def token_rows(rows: Sequence[torch.Tensor | Sequence[int]]) -> list[torch.Tensor]:
    """Conversations given as token-id lists or tensors, as 1-D long tensors."""
    return [torch.as_tensor(r, dtype=torch.long).flatten() for r in rows]


def shortest_first(rows: Sequence[torch.Tensor]) -> list[int]:
    """The order :meth:`DrafterTrainer.add_token_rows` adds rows in (shortest first, ties as given): a feature cache
    that fills the buffer itself keeps to it, so a run samples the same batches from cached and fresh features."""
    return sorted(range(len(rows)), key=lambda i: len(rows[i]))


def policy_targets(target: TargetModel, final: torch.Tensor, k: int = TARGET_TOP_K,
                   chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's top-``k`` next-token law from its final hidden states [L, H]: ids (int32) and probabilities
    (float16), [L, k] each, computed ``chunk`` rows at a time (a full-vocabulary row is large)."""
    length = final.shape[0]
    ids = torch.zeros(length, k, dtype=torch.int32, device=final.device)
    probs = torch.zeros(length, k, dtype=torch.float16, device=final.device)
    for start in range(0, length, chunk):
        top = target.logits(final[start : start + chunk]).softmax(-1).topk(k, dim=-1)
        ids[start : start + chunk] = top.indices.to(torch.int32)
        probs[start : start + chunk] = top.values.to(torch.float16)
    return ids, probs


@dataclass
class DrafterBatch:
    """One micro-batch, [b, L] padded or [1, T] packed (``packed``: the :class:`PackedSequences`): features [.., F],
    the next token x_{t+1} and the one after it, each position's place in its sequence and that sequence's length,
    and the policy's top-k targets (ids, probabilities) if cached."""

    hidden: torch.Tensor
    next_tokens: torch.Tensor
    following: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor
    targets: tuple[torch.Tensor, torch.Tensor] | None
    packed: PackedSequences | None = None

    @property
    def real(self) -> torch.Tensor:
        """The positions that hold a token [.., L] (all of them when packed)."""
        return self.positions < self.lengths

    @property
    def layout(self) -> torch.Tensor | PackedSequences:
        """What ``forward_unrolled`` attends by: the packed sequences, or the padded rows' real positions."""
        return self.real if self.packed is None else self.packed

    @property
    def num_tokens(self) -> int:
        return int(self.real.sum())


def regresses_features(drafter: Drafter) -> bool:
    """EAGLE-1 drafters also learn the policy's next feature; EAGLE-3 drafters predict tokens only."""
    return drafter.feature_layers is None


def learns_policy_law(drafter: Drafter) -> bool:
    """Whether the drafter's loss matches the policy's next-token law when a sequence arrives with it (EAGLE-3's
    token loss, from the final hidden states ``add_features`` is handed); otherwise it learns the token that was
    sampled. EAGLE-1 drafters derive the law from the policy's features; block drafters train on sampled tokens."""
    return not regresses_features(drafter) and kind_of(drafter).training_loss is DrafterTrainer.autoregressive_loss


def learns_law_by_forward(drafter: Drafter, targets: str) -> bool:
    """The setting ``drafter_targets`` (``targets``) resolved for ``drafter``: whether the engine's finished rollouts
    reach its buffer through one no-grad policy forward, which gives the law, instead of the engine's feature sink,
    which gives features and the sampled tokens ('auto': where :func:`learns_policy_law`)."""
    return targets == "law" or (targets == "auto" and learns_policy_law(drafter))


def packs_sequences(attention: str, drafter: Drafter, device: torch.device) -> bool:
    """Whether drafter training packs its micro-batches for ``attention`` ('auto', 'packed' or 'padded').

    Packing drops the padding a long-tailed micro-batch is mostly made of (the loss is the same); its attention is
    flash-attn's variable-length kernel on CUDA (``pip install "tlt-trainers[flash]"``) and a per-sequence torch
    loop elsewhere. 'auto' packs EAGLE-3 drafters except on CUDA without flash-attn, where the padded batch's fused
    attention is kept. EAGLE-1 drafters (which also regress the policy's next feature) train padded.
    """
    if attention not in ATTENTION_LAYOUTS:
        raise ValueError(f"attention={attention!r}: choose one of {ATTENTION_LAYOUTS}.")
    if drafter.drafts_blocks:
        if attention == "packed":
            raise ValueError("attention='packed' trains EAGLE-3 drafters; a block drafter trains its blocks padded: "
                             "pass attention='padded' or 'auto'.")
        return False
    if attention == "packed" and regresses_features(drafter):
        raise ValueError("attention='packed' trains EAGLE-3 drafters (Eagle3Drafter); EAGLE-1 drafters train "
                         "padded: pass attention='padded' or 'auto'.")
    if attention == "auto":
        return not regresses_features(drafter) and (device.type != "cuda" or flash_varlen_available(device))
    return attention == "packed"


class DrafterTrainer:
    """Trains a drafter (EAGLE-1, EAGLE-3 or a block drafter) on rollouts of its policy, kept in a bounded
    :class:`FeatureBuffer`.

    ``block_anchors``: blocks per sequence and micro-step of a block drafter's training, ``block_gamma`` the decay of
    its slots' loss weights (default: half the block).
    """

    def __init__(
        self,
        drafter: Drafter,
        model: nn.Module,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        feature_weight: float = 1.0,
        token_weight: float = 0.1,
        micro_batch_size: int = 8,
        max_grad_norm: float = 0.5,
        unroll_steps: int = 1,
        unroll_decay: float = 0.8,
        buffer_bytes: int = 512 << 20,
        max_tokens_per_sequence: int = 1024,
        show_progress: bool = False,
        seed: int = 0,
        precision: str = "auto",
        loss_chunk_size: int = 2048,
        attention: str = "auto",
        block_anchors: int = 32,
        block_gamma: float | None = None,
        feature_noise: float = 0.0,
        tv_weight: float = 0.0,
    ):
        if unroll_steps < 1:
            raise ValueError(f"unroll_steps={unroll_steps} must be >= 1 (1 = plain EAGLE training).")
        if block_anchors < 1 or (block_gamma is not None and block_gamma <= 0):
            raise ValueError(f"block_anchors={block_anchors} must be >= 1 and block_gamma={block_gamma} > 0.")
        if feature_noise < 0 or tv_weight < 0:
            raise ValueError(f"feature_noise={feature_noise} and tv_weight={tv_weight} must be >= 0 (0: off).")
        self.drafter, self.model = drafter, model
        self.target = TargetModel(model)
        drafter.ensure_bound(model)  # train against this policy's head, whatever it was bound to before
        self.lr = lr
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay)
        self.feature_weight, self.token_weight = feature_weight, token_weight
        self.micro_batch_size, self.max_grad_norm = micro_batch_size, max_grad_norm
        self.unroll_steps, self.unroll_decay = unroll_steps, unroll_decay
        self.block_anchors, self.block_gamma = block_anchors, block_gamma
        # EAGLE's augmentation: Gaussian noise of this size relative to each feature's RMS, in training only
        self.feature_noise = feature_noise
        # EAGLE-3: add tv_weight x the total-variation distance between the drafter's and the policy's laws, which
        # is one minus a draft's acceptance chance when both sample (1 - sum min(p, q)); the cross-entropy alone
        # fits the policy's top token and spreads the rest
        self.tv_weight = tv_weight
        self.buffer = FeatureBuffer(buffer_bytes, max_tokens_per_sequence)
        # bfloat16 autocast of the drafter's forward and backward (the weights and the optimizer stay float32)
        self.autocast_dtype = training_dtype(precision, self.target.device)
        # EAGLE-3: the head's cross-entropy over this many positions at a time, on scored positions only (0: dense)
        self.loss_chunk_size = loss_chunk_size
        # EAGLE-3: micro-batches packed end to end (no padding; flash-attn's varlen attention where it runs)
        self.packed = packs_sequences(attention, drafter, self.target.device)
        self.show_progress = show_progress
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0

    # ------------------------------------------------------------------ data in
    def add_token_rows(self, rows: Sequence[torch.Tensor | Sequence[int]], batch_rows: int = 64,
                       sort_by_length: bool = True, on_batch: Callable[[int, int], None] | None = None) -> int:
        """:meth:`add_sequences` over whole conversations of any lengths (token-id lists or 1-D tensors): right-padded
        ``batch_rows`` at a time, shortest first (``sort_by_length``) so that batches are mostly real tokens.
        ``on_batch(done, total)`` runs after each batch (progress, or what the caller does to the new features).
        Returns how many rows entered the buffer."""
        rows = token_rows(rows)
        order = shortest_first(rows) if sort_by_length else list(range(len(rows)))
        added = 0
        for first in range(0, len(order), batch_rows):
            chunk = [rows[i] for i in order[first : first + batch_rows]]
            ids = torch.zeros(len(chunk), max(1, *map(len, chunk)), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(chunk):
                ids[j, : len(r)], mask[j, : len(r)] = r, 1
            added += self.add_sequences(ids, mask)
            if on_batch is not None:
                on_batch(first + len(chunk), len(order))
        return added

    @torch.no_grad()
    def add_sequences(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, chunk: int = 8,
                      defer_law: bool = False) -> int:
        """One no-grad policy forward over [N, L] sequences; their real tokens and features enter the buffer
        (``defer_law``: as :meth:`add_features`).

        Rows run in chunks of similar length, each cut to the columns its rows use: long-tailed rollouts padded
        to the longest answer are mostly padding, and a forward over it would cost more than the rows' own
        tokens. Rows are sorted within blocks of ``8 * chunk`` taken in the order given, and enter the buffer in
        that order, so at most one block's features are held at once.
        """
        device = self.target.device
        input_ids = input_ids.to(device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must have input_ids' shape {tuple(input_ids.shape)}.")
        real = mask.sum(dim=1)
        block = 8 * chunk
        added = 0
        for first_row in range(0, input_ids.shape[0], block):
            order = first_row + real[first_row : first_row + block].argsort(descending=True, stable=True)
            features: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * order.shape[0]  # by row in block
            for start in range(0, order.shape[0], chunk):
                rows = order[start : start + chunk]
                m = mask[rows]
                used = m.any(dim=0).nonzero().squeeze(1)
                if used.numel() == 0:
                    continue
                lo, hi = int(used[0]), int(used[-1]) + 1
                ids, m = input_ids[rows, lo:hi], m[:, lo:hi]
                positions = (m.cumsum(-1) - 1).clamp(min=0)
                with capture_features(self.target.decoder, self.drafter.feature_layers) as captured:
                    self.target.decoder(input_ids=ids, attention_mask=m, position_ids=positions, use_cache=False)
                hidden, final = captured[-1]
                for i, row in enumerate(rows.tolist()):
                    keep = m[i].bool()
                    tokens = ids[i][keep]
                    if tokens.numel() >= 2:
                        features[row - first_row] = (tokens, hidden[i][keep][:-1], final[i][keep])
            for item in features:
                if item is not None:
                    self.add_features(*item, defer_law=defer_law)
                    added += 1
            del features
            if device.type == "cpu":  # the block's activations, freed between kept features (modeling/host_memory.py)
                release_freed_host_memory()
        return added

    def add_features(self, tokens: torch.Tensor, features: torch.Tensor, final: torch.Tensor | None = None,
                     defer_law: bool = False) -> None:
        """Add one rollout whose features a pass that ran anyway computed (no extra forward).

        ``tokens`` [L + 1], ``features`` [L, F]; ``final`` [L + 1, H], the policy's final hidden states of all
        tokens, lets a token-only (EAGLE-3) drafter learn the policy's whole next-token law instead of the one
        token that was drawn from it. ``defer_law``: keep the final states and compute the law (an LM-head pass over
        every position) the first time a micro-batch reads the sequence, inside the training that a budget limits,
        instead of now, on the rollout's path: what an online update does, whose buffer mostly holds sequences it
        may never train on. The law is then the policy head's at that time (one update later at most, for a
        sequence the update after its rollout trains on).
        """
        if features.shape[-1] != self.drafter.feature_size:
            raise ValueError(
                f"Features of width {features.shape[-1]} for a drafter that reads {self.drafter.feature_size} per "
                f"token (layers {self.drafter.feature_layers or 'final'}): pass feature_layers=drafter.feature_layers "
                "to SpeculativeGenerator.generate when its engine has no drafter or another one."
            )
        start = max(0, features.shape[0] - self.buffer.max_tokens)  # the window the buffer keeps
        tokens, features = tokens[start:], features[start:]
        targets = None
        if final is not None and not regresses_features(self.drafter):
            if defer_law:
                self.buffer.add(tokens, features, final=final[start + 1 :])
                return
            targets = policy_targets(self.target, final[start + 1 :])
        self.buffer.add(tokens, features, targets)

    @torch.no_grad()
    def settle_laws(self, sequences: Sequence[BufferedSequence]) -> None:
        """Compute the deferred laws of ``sequences`` (``add_features(defer_law=True)``) from their final states."""
        weight = self.target.head.weight
        for sequence in sequences:
            if sequence.final is not None:  # a sequence sampled twice in one batch is settled once
                final = sequence.final.to(device=weight.device, dtype=weight.dtype)
                self.buffer.settle_law(sequence, policy_targets(self.target, final))

    def rebuild_draft_vocab(self) -> torch.Tensor | None:
        """Draft over the most frequent tokens seen so far (no-op for a full-vocabulary drafter)."""
        if not self.drafter.config.uses_draft_vocab:
            return None
        ids = self.buffer.most_frequent(self.drafter.draft_vocab_size, self.drafter.config.vocab_size)
        self.drafter.set_draft_vocab(ids)
        return self.drafter.d2t

    # ------------------------------------------------------------------ training
    def _batch(self, sequences: list[BufferedSequence]) -> DrafterBatch:
        """A micro-batch, packed end to end (:attr:`packed`) or padded to its longest sequence."""
        self.settle_laws(sequences)
        return self._packed_batch(sequences) if self.packed else self._padded_batch(sequences)

    def _padded_batch(self, sequences: list[BufferedSequence]) -> DrafterBatch:
        device = self.target.device
        length = max(seq.features.shape[0] for seq in sequences)
        hidden_size = sequences[0].features.shape[1]
        hidden = torch.zeros(len(sequences), length, hidden_size, dtype=self.target.dtype, device=device)
        tokens = torch.zeros(len(sequences), length + 1, dtype=torch.long, device=device)
        lengths = torch.tensor([seq.features.shape[0] for seq in sequences], device=device)
        with_targets = all(seq.target_ids is not None for seq in sequences)
        targets = None
        if with_targets:
            k = sequences[0].target_ids.shape[1]
            targets = (torch.zeros(len(sequences), length, k, dtype=torch.long, device=device),
                       torch.zeros(len(sequences), length, k, dtype=torch.float32, device=device))
        for row, seq in enumerate(sequences):
            n = seq.features.shape[0]
            hidden[row, :n] = seq.features.to(device)
            tokens[row, : n + 1] = seq.tokens.to(device)
            if targets is not None:
                targets[0][row, :n] = seq.target_ids.to(device)
                targets[1][row, :n] = seq.target_probs.to(device)
        positions = torch.arange(length, device=device).expand(len(sequences), -1)
        return DrafterBatch(hidden=hidden, next_tokens=tokens[:, 1:],
                            following=torch.cat([tokens[:, 2:], tokens[:, -1:]], dim=1), positions=positions,
                            lengths=lengths[:, None].expand(-1, length), targets=targets)

    def _packed_batch(self, sequences: list[BufferedSequence]) -> DrafterBatch:
        device = self.target.device
        packed = PackedSequences.from_lengths([seq.features.shape[0] for seq in sequences], device)
        hidden = torch.cat([seq.features for seq in sequences]).to(device=device, dtype=self.target.dtype)
        next_tokens = torch.cat([seq.tokens[1:] for seq in sequences]).to(device)
        # the token after the next one (the last position of each sequence has none: a placeholder, never scored)
        following = torch.cat([torch.cat([seq.tokens[2:], seq.tokens[-1:]]) for seq in sequences]).to(device)
        targets = None
        if all(seq.target_ids is not None for seq in sequences):
            targets = (torch.cat([seq.target_ids for seq in sequences]).to(device=device, dtype=torch.long)[None],
                       torch.cat([seq.target_probs for seq in sequences]).to(device=device, dtype=torch.float32)[None])
        return DrafterBatch(hidden=hidden[None], next_tokens=next_tokens[None], following=following[None],
                            positions=packed.positions[None], lengths=packed.token_lengths[None], targets=targets,
                            packed=packed)

    def _with_feature_noise(self, batch: DrafterBatch) -> DrafterBatch:
        """The batch with Gaussian noise on its features, ``feature_noise`` times each position's feature RMS."""
        hidden = batch.hidden
        scale = hidden.float().pow(2).mean(-1, keepdim=True).sqrt() * self.feature_noise
        noise = torch.randn(hidden.shape, generator=self.generator, dtype=torch.float32).to(hidden.device)
        return replace(batch, hidden=hidden + (noise * scale).to(hidden.dtype))

    def _loss(self, batch: DrafterBatch) -> tuple[torch.Tensor, dict]:
        """Loss on one micro-batch and its metrics: the training loss the drafter's kind names."""
        return kind_of(self.drafter).training_loss(self, batch)

    def autoregressive_loss(self, batch: DrafterBatch) -> tuple[torch.Tensor, dict]:
        """A drafter of one token per pass, trained with training-time test: EAGLE-3's token loss where it reads
        fused layers, EAGLE-1's feature regression plus token loss where it reads the policy's last hidden state."""
        if not regresses_features(self.drafter):
            return self._token_loss(batch)
        return self._feature_loss(batch)

    def _feature_loss(self, batch: DrafterBatch) -> tuple[torch.Tensor, dict]:
        """EAGLE-1's loss: each unrolled step regresses the policy's next feature and matches its token law."""
        drafter = self.drafter  # EAGLE-1: always padded (packs_sequences)
        hidden, positions, lengths = batch.hidden, batch.positions, batch.lengths
        valid = batch.real  # pair (h_t, x_{t+1}) exists
        has_target = positions + 1 < lengths  # h_{t+1} exists to be predicted
        outputs = drafter.forward_unrolled(hidden, batch.next_tokens, positions, valid, self.unroll_steps)
        target_feature = torch.cat([hidden[:, 1:], hidden[:, -1:]], dim=1)
        with torch.no_grad():
            # The policy's next-token law restricted to the draft vocabulary: what the drafter can propose.
            policy_probs = drafter.logits(target_feature).softmax(-1)
            policy_top1 = policy_probs.argmax(-1)
        loss, metrics, agreement = 0.0, {}, []
        for step, predicted in enumerate(outputs):
            weight = (has_target & (positions >= step)).to(hidden.dtype)
            count = weight.sum().clamp(min=1)
            feature_loss = (F.smooth_l1_loss(predicted, target_feature, reduction="none").mean(-1) * weight).sum()
            draft_logp = drafter.logits(predicted).log_softmax(-1)
            token_loss = (-(policy_probs * draft_logp).sum(-1) * weight).sum()
            step_loss = (self.feature_weight * feature_loss + self.token_weight * token_loss) / count
            loss = loss + (self.unroll_decay**step) * step_loss
            agree = ((draft_logp.argmax(-1) == policy_top1).to(hidden.dtype) * weight).sum() / count
            agreement.append(agree.item())
            if step == 0:
                metrics = {"feature_loss": (feature_loss / count).item(), "token_loss": (token_loss / count).item()}
        metrics.update(loss=loss.item(), top1=agreement[0], top1_by_step=agreement)
        return loss, metrics

    def _token_loss(self, batch: DrafterBatch) -> tuple[torch.Tensor, dict]:
        """EAGLE-3's loss: cross-entropy of each draft step's law over the draft vocabulary against the policy's
        (its top-k restricted to the draft vocabulary and renormalised, or the next token itself)."""
        drafter = self.drafter
        positions, lengths, targets = batch.positions, batch.lengths, batch.targets
        outputs = drafter.forward_unrolled(batch.hidden, batch.next_tokens, positions, batch.layout,
                                           self.unroll_steps)
        t2d = self.target_to_draft()
        if targets is not None:
            draft_ids = t2d[targets[0]]  # [b, L, k], -1 outside the draft vocabulary
            probs = targets[1] * (draft_ids >= 0)
            policy_mass = probs  # the policy's probability of each draftable target id
            mass = probs.sum(-1)
            target_probs = probs / mass.clamp(min=1e-6)[..., None]
            top1 = draft_ids[..., 0]  # the policy's most likely token (-1: not draftable)
            scored = batch.real & (mass > 1e-6)
        else:  # the token that followed: drawn from the policy by the rollout itself
            draft_ids = t2d[batch.following][..., None]
            target_probs = torch.ones_like(draft_ids, dtype=torch.float32)
            top1 = draft_ids[..., 0]
            policy_mass = target_probs * (draft_ids >= 0)
            scored = (positions + 1 < lengths) & (top1 >= 0)
        gather_ids = draft_ids.clamp(min=0)
        loss, agreement, sampled = 0.0, [], []
        # A draft's chance of acceptance when both sample, sum min(p, q) over the policy's top-k (a lower bound):
        # the loss's TV term, and a metric whenever no gradient is taken (evaluate)
        with_sampled = self.tv_weight > 0 or not torch.is_grad_enabled()
        for step, predicted in enumerate(outputs):
            counted = scored & (positions >= step)
            count = counted.sum().clamp(min=1)
            if self.loss_chunk_size:  # only the counted positions, a chunk of them at a time
                total, argmax = linear_cross_entropy_sum(*drafter.head_inputs(predicted[counted]),
                                                         gather_ids[counted], target_probs[counted],
                                                         self.loss_chunk_size)
                token_loss = total / count
                agree = (argmax == top1[counted]).sum() / count
            else:
                weight = counted.to(torch.float32)
                logp = drafter.logits(predicted).log_softmax(-1)
                token_loss = (-(target_probs * logp.gather(-1, gather_ids)).sum(-1) * weight).sum() / count
                agree = ((logp.argmax(-1) == top1).float() * weight).sum() / count
            if with_sampled:
                q = F.linear(*drafter.head_inputs(predicted[counted])).float().softmax(-1)
                overlap = torch.minimum(q.gather(-1, gather_ids[counted]), policy_mass[counted].float()).sum(-1)
                sampled.append((overlap.sum() / count).item())
                if self.tv_weight:
                    token_loss = token_loss + self.tv_weight * (1 - overlap).sum() / count
            loss = loss + (self.unroll_decay**step) * token_loss
            agreement.append(agree.item())
            if step == 0:
                first_loss = token_loss.item()
        metrics = {"loss": loss.item(), "feature_loss": 0.0, "token_loss": first_loss, "top1": agreement[0],
                   "top1_by_step": agreement, "sampled_acceptance_by_step": sampled}
        return loss, metrics

    @property
    def agreement_steps(self) -> int:
        """Entries of ``top1_by_step``: the unrolled steps, or a block drafter's masked slots."""
        return self.drafter.max_drafts if self.drafter.drafts_blocks else self.unroll_steps

    @property
    def chain_length(self) -> int:
        """Drafts per step that ``estimated_acceptance_length`` assumes: 4, or a block drafter's whole block."""
        return self.drafter.max_drafts if self.drafter.drafts_blocks else 4

    def target_to_draft(self) -> torch.Tensor:
        """The drafter's policy-id -> draft-id map, rebuilt only when its draft vocabulary changes."""
        d2t = self.drafter.d2t
        key = None if d2t is None else (d2t.data_ptr(), d2t._version)
        if getattr(self, "_t2d", None) is None or self._t2d[0] != key:
            self._t2d = (key, self.drafter.target_to_draft().to(self.target.device))
        return self._t2d[1]

    def train(
        self,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        lr_schedule: str = "constant",
    ) -> dict:
        """Micro-steps on the buffer until a budget runs out or ``should_stop()`` (checked between micro-steps).

        ``lr_schedule="cosine"`` decays the rate from :attr:`lr` to a tenth of it over this call's budget
        (``max_seconds`` by the clock, else ``max_steps``; :func:`cosine_lr`), the shipped drafters' recipe; the
        rate is :attr:`lr` again after the call. With no budget at all, one pass's worth of micro-steps over the
        buffer. Returns metrics averaged over
        the micro-steps of this call: loss, top-1 agreement with the policy (per unrolled step), the
        estimated acceptance length of a 4-token chain (a block drafter: of its whole block), ``steps``, ``tokens``
        (positions trained) and ``seconds``.
        """
        start = time.perf_counter()
        if len(self.buffer) == 0:
            raise ValueError("The drafter's buffer is empty: add rollouts with add_sequences() or add_features().")
        if max_steps is None and max_seconds is None and should_stop is None:
            max_steps = -(-len(self.buffer) // self.micro_batch_size)
        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule={lr_schedule!r}: choose 'constant' or 'cosine'.")
        if lr_schedule == "cosine" and max_seconds is None and max_steps is None:
            raise ValueError("lr_schedule='cosine' decays over a budget: give max_seconds or max_steps.")
        progress = None
        if self.show_progress:
            from tqdm.auto import tqdm

            progress = tqdm(total=max_steps, desc="drafter", unit="step")
        sums: dict[str, float] = {}
        agreement_sums = [0.0] * self.agreement_steps
        steps = trained_tokens = 0
        self.drafter.train()
        try:
            while True:
                if max_steps is not None and steps >= max_steps:
                    break
                if max_seconds is not None and time.perf_counter() - start >= max_seconds:
                    break
                if should_stop is not None and should_stop():
                    break
                if lr_schedule == "cosine":
                    fraction = ((time.perf_counter() - start) / max_seconds if max_seconds is not None
                                else steps / max_steps)
                    for group in self.optimizer.param_groups:
                        group["lr"] = cosine_lr(self.lr, fraction)
                count = min(self.micro_batch_size, len(self.buffer))
                batch = self._batch(self.buffer.sample(count, self.generator))
                if self.feature_noise:
                    batch = self._with_feature_noise(batch)
                trained_tokens += batch.num_tokens
                device_type = batch.hidden.device.type
                with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                                    enabled=self.autocast_dtype is not None):
                    loss, metrics = self._loss(batch)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.max_grad_norm)
                self.optimizer.step()
                steps += 1
                self.step += 1
                if device_type == "cpu" and self.step % RELEASE_EVERY_STEPS == 0:
                    release_freed_host_memory()  # the steps' transients, freed between what lives on (host_memory.py)
                for key in ("loss", "feature_loss", "token_loss", "top1"):
                    sums[key] = sums.get(key, 0.0) + metrics[key]
                for d, value in enumerate(metrics["top1_by_step"]):
                    agreement_sums[d] += value
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}")
        finally:
            self.drafter.eval()
            if lr_schedule == "cosine":
                for group in self.optimizer.param_groups:
                    group["lr"] = self.lr
            if progress is not None:
                progress.close()
        nan = float("nan")
        result = {key: (sums[key] / steps if steps else nan) for key in ("loss", "feature_loss", "token_loss", "top1")}
        agreement = [value / steps for value in agreement_sums] if steps else []
        result.update(
            top1_by_step=agreement,
            estimated_acceptance_length=estimated_acceptance_length(agreement, self.chain_length) if steps else nan,
            steps=steps,
            tokens=trained_tokens,
            total_steps=self.step,
            seconds=time.perf_counter() - start,
            buffer_sequences=len(self.buffer),
            buffer_bytes=self.buffer.nbytes,
        )
        return result

    @torch.no_grad()
    def evaluate(self, sequences: list[BufferedSequence] | None = None) -> dict:
        """Loss and agreement of the drafter on ``sequences`` (default: the whole buffer), without training; for an
        EAGLE-3 drafter also ``sampled_acceptance_by_step``, each draft step's chance of acceptance when policy and
        drafter both sample (sum of min(p, q) over the policy's cached top-k, so a lower bound)."""
        sequences = list(self.buffer.sequences) if sequences is None else sequences
        if not sequences:
            raise ValueError("Nothing to evaluate: the buffer is empty.")
        was_training = self.drafter.training
        self.drafter.eval()
        totals, agreement, sampled, batches = {}, [0.0] * self.agreement_steps, [], 0
        for start in range(0, len(sequences), self.micro_batch_size):
            _, metrics = self._loss(self._batch(sequences[start : start + self.micro_batch_size]))
            for key in ("loss", "feature_loss", "token_loss", "top1"):
                totals[key] = totals.get(key, 0.0) + metrics[key]
            for d, value in enumerate(metrics["top1_by_step"]):
                agreement[d] += value
            by_step = metrics.get("sampled_acceptance_by_step", [])
            sampled = [a + b for a, b in zip(sampled or [0.0] * len(by_step), by_step)]
            batches += 1
        self.drafter.train(was_training)
        result = {key: value / batches for key, value in totals.items()}
        result["top1_by_step"] = [value / batches for value in agreement]
        result["estimated_acceptance_length"] = estimated_acceptance_length(result["top1_by_step"], self.chain_length)
        if sampled:  # EAGLE-3: a sampled chain's expected length from the per-step acceptance chances
            result["sampled_acceptance_by_step"] = [value / batches for value in sampled]
            result["estimated_sampled_acceptance_length"] = estimated_acceptance_length(
                result["sampled_acceptance_by_step"], self.chain_length)
        return result

    def train_on_sequences(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> dict:
        """Add [N, L] sequences (prompt + completion, padded; one no-grad forward) and train on the buffer.

        ``max_seconds`` counts the forward too. With no budget, one pass's worth of micro-steps.
        """
        start = time.perf_counter()
        self.add_sequences(input_ids, attention_mask)
        if max_seconds is not None:
            max_seconds = max(0.0, max_seconds - (time.perf_counter() - start))
        return self.train(max_steps=max_steps, max_seconds=max_seconds, should_stop=should_stop)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | Path, model_card: dict | None = None) -> None:
        """Drafter (weights + draft vocabulary), optimizer and step: everything needed to resume exactly.
        ``model_card``: keyword arguments of ``write_model_card`` for a README.md next to the drafter."""
        path = Path(directory)
        with staged_save(path) as files:  # all or nothing: a failed write leaves the previous checkpoint intact
            self.drafter.save_files(files)
            torch.save(self.optimizer.state_dict(), files.path(OPTIMIZER_STATE))
            state = {"format": 1, "step": self.step, "lr": self.lr, "unroll_steps": self.unroll_steps,
                     "drafter_config": self.drafter.config.to_dict()}
            files.path(TRAINER_STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        if model_card is not None:
            from .model_card import write_model_card

            write_model_card(self.drafter, path, **model_card)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`; any mismatch or corruption is an error."""
        path = Path(directory)
        state_file = path / TRAINER_STATE
        try:
            state = json.loads(state_file.read_text())
        except FileNotFoundError as err:
            raise FileNotFoundError(f"No drafter trainer checkpoint at {path} ({TRAINER_STATE} is missing).") from err
        except json.JSONDecodeError as err:
            raise ValueError(f"{state_file} is corrupt ({err}); restore it or start from another checkpoint.") from err
        saved = EagleDrafterConfig.with_defaults(state.get("drafter_config", {}))
        ours = EagleDrafterConfig.with_defaults(self.drafter.config.to_dict())
        keys = (set(saved) | set(ours)) - {"target_name_or_path"}
        differing = sorted(k for k in keys if saved.get(k) != ours.get(k))
        if differing:
            raise ValueError(
                f"The drafter checkpoint at {path} was made for another drafter (fields differ: {differing}); "
                "resume with the same drafter settings, or load it with Drafter.from_pretrained."
            )
        try:
            weights = load_weights(path / WEIGHTS_NAME)  # names the file and the fix when it is truncated or corrupt
            self.drafter.load_state_dict({k: v.to(self.target.device) for k, v in weights.items()})
            optimizer_state = torch.load(path / OPTIMIZER_STATE, map_location=self.target.device, weights_only=True)
            self.optimizer.load_state_dict(optimizer_state)
        except (FileNotFoundError, RuntimeError, ValueError, KeyError, pickle.UnpicklingError) as err:
            raise ValueError(f"The drafter checkpoint at {path} is incomplete or corrupt: {err}. Resume from an "
                             "earlier checkpoint, or delete its drafter folder to go on with the drafter the run "
                             "starts with.") from err
        self.step = int(state["step"])
