"""DrafterTrainer: fit the drafter to the policy from the policy's own detached hidden states.

Loss per position t (EAGLE): SmoothL1 between the drafter's predicted feature and the policy's
h_{t+1}, plus soft cross-entropy of the drafter's token distribution against the policy's
next-token distribution at t+1. Only the drafter's own parameters are optimised; the policy
runs under no_grad and its embedding and head are read, never written.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..rollout.target import TargetModel
from .eagle import EagleDrafter


class DrafterTrainer:
    """Trains an :class:`EagleDrafter` on token sequences sampled from its policy."""

    def __init__(
        self,
        drafter: EagleDrafter,
        model: nn.Module,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        feature_weight: float = 1.0,
        token_weight: float = 0.1,
        micro_batch_size: int = 8,
        max_grad_norm: float = 0.5,
    ):
        self.drafter, self.model = drafter, model
        self.target = TargetModel(model)
        if drafter._target is None or drafter.target.head is not model.get_output_embeddings():
            drafter.bind(model)  # train against this policy's head, whatever the drafter was bound to before
        weight = next(drafter.parameters())
        if weight.device != self.target.device or weight.dtype != self.target.dtype:
            raise ValueError(
                f"Drafter is on {weight.device}/{weight.dtype} but the policy on {self.target.device}/"
                f"{self.target.dtype}: call drafter.to(device=..., dtype=...) to match."
            )
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=weight_decay)
        self.feature_weight, self.token_weight = feature_weight, token_weight
        self.micro_batch_size, self.max_grad_norm = micro_batch_size, max_grad_norm
        self.step = 0

    @torch.no_grad()
    def _features(self, ids: torch.Tensor, mask: torch.Tensor, chunk: int = 8) -> torch.Tensor:
        """The policy's final hidden states for every sequence: one no-grad forward, reused by every epoch."""
        out = []
        for start in range(0, ids.shape[0], chunk):
            rows_ids, rows_mask = ids[start : start + chunk], mask[start : start + chunk]
            positions = (rows_mask.cumsum(-1) - 1).clamp(min=0)
            hidden = self.target.decoder(input_ids=rows_ids, attention_mask=rows_mask, position_ids=positions,
                                         use_cache=False).last_hidden_state
            out.append(hidden.detach())
        return torch.cat(out)

    def _loss(self, hidden, ids, mask) -> tuple[torch.Tensor, dict]:
        """Loss on one micro-batch of sequences [b, L] with features [b, L, H]."""
        drafter = self.drafter
        inputs, next_tokens = hidden[:, :-1], ids[:, 1:]
        valid = (mask[:, :-1] * mask[:, 1:]).bool()  # h_t and x_{t+1} are real tokens
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, :-1]
        length = inputs.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        allowed = causal[None] & valid[:, None, :] | torch.eye(length, dtype=torch.bool, device=ids.device)[None]
        attn = torch.zeros(allowed.shape, dtype=inputs.dtype, device=ids.device)
        attn = attn.masked_fill(~allowed, torch.finfo(inputs.dtype).min)[:, None]
        predicted = drafter(inputs, next_tokens, positions, attn)
        target_feature = hidden[:, 1:]
        with torch.no_grad():
            # The policy's next-token law restricted to the draft vocabulary: what the drafter can propose.
            policy_probs = drafter.logits(target_feature).softmax(-1)
        draft_logp = drafter.logits(predicted).log_softmax(-1)
        weight = valid.to(inputs.dtype)
        count = weight.sum().clamp(min=1)
        feature_loss = (F.smooth_l1_loss(predicted, target_feature, reduction="none").mean(-1) * weight).sum() / count
        token_loss = (-(policy_probs * draft_logp).sum(-1) * weight).sum() / count
        loss = self.feature_weight * feature_loss + self.token_weight * token_loss
        agree = ((draft_logp.argmax(-1) == policy_probs.argmax(-1)).to(inputs.dtype) * weight).sum() / count
        return loss, {"loss": loss.item(), "feature_loss": feature_loss.item(), "token_loss": token_loss.item(),
                      "top1": agree.item()}

    def train_on_sequences(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> dict:
        """Train on sequences [N, L] (prompt + completion, padded) until a budget or ``should_stop()``.

        With neither budget the data is used for one epoch. Returns the last micro-step's metrics plus
        ``steps`` and ``seconds``.
        """
        device = self.target.device
        input_ids = input_ids.to(device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
        start = time.perf_counter()
        if max_steps is None and max_seconds is None and should_stop is None:
            max_steps = -(-input_ids.shape[0] // self.micro_batch_size)
        features = self._features(input_ids, mask)
        order = torch.randperm(input_ids.shape[0])
        cursor, steps = 0, 0
        metrics = {"loss": float("nan"), "feature_loss": float("nan"), "token_loss": float("nan"), "top1": float("nan")}
        self.drafter.train()
        while True:
            if max_steps is not None and steps >= max_steps:
                break
            if max_seconds is not None and time.perf_counter() - start >= max_seconds:
                break
            if should_stop is not None and should_stop():
                break
            if cursor >= len(order):
                order, cursor = torch.randperm(input_ids.shape[0]), 0
            rows = order[cursor : cursor + self.micro_batch_size].to(device)
            cursor += self.micro_batch_size
            ids, m = input_ids[rows], mask[rows]
            loss, metrics = self._loss(features[rows], ids, m)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.max_grad_norm)
            self.optimizer.step()
            steps += 1
            self.step += 1
        self.drafter.eval()
        return {**metrics, "steps": steps, "seconds": time.perf_counter() - start}
