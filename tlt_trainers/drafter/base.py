"""The interface every drafter implements: what the engine, the proposers and the cost profile call.

A drafter reads the policy's features (hidden states the verify passes produce anyway) and the tokens that
followed them, predicts the next features, and scores tokens over its draft vocabulary through the policy's own
LM head. EAGLE-1 (:class:`~tlt_trainers.drafter.eagle.EagleDrafter`) and EAGLE-3 drafters both implement it, so the
engine and the online trainer take either without knowing which.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from ..modeling.kv_cache import RowKV


class Drafter(nn.Module, ABC):
    """A drafter bound to a policy: ``forward`` predicts features, ``logits`` scores them.

    ``d2t`` maps draft-vocabulary ids to the policy's token ids (None when the drafter scores the full
    vocabulary); verification always runs over the full vocabulary, so a small draft vocabulary stays lossless.
    """

    d2t: torch.Tensor | None

    @property
    @abstractmethod
    def feature_size(self) -> int:
        """Width of the features the drafter reads per token (the policy's hidden size for EAGLE-1)."""

    @property
    @abstractmethod
    def draft_vocab_size(self) -> int:
        """Number of tokens the drafter scores (``len(d2t)``, or the policy's vocabulary)."""

    @abstractmethod
    def ensure_bound(self, model: nn.Module) -> Drafter:
        """Bind to ``model``'s embedding and LM head unless already bound; refuse a mismatched policy."""

    @abstractmethod
    def new_kv(self, capacity: int) -> RowKV:
        """An empty per-row KV cache of ``capacity`` slots for the drafter's own attention."""

    @abstractmethod
    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, kv: RowKV | None = None, slots: torch.Tensor | None = None,
                kv_len: int | None = None) -> torch.Tensor:
        """Predicted features [B, q, H] from features ``hidden`` [B, q, F] and the tokens that followed them.

        ``mask`` is additive [B, 1, q, kv]; with ``kv`` the new keys are written at ``slots`` [B, q].
        """

    @abstractmethod
    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary for predicted features [..., H]."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> the policy's token ids."""
        return draft_ids if self.d2t is None else self.d2t[draft_ids]
