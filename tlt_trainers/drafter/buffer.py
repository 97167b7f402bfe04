"""A byte-capped buffer of recent rollouts: token ids and the policy's hidden states for them.

Hidden states are big (a 32k-token answer of a 7B model is 256 MB in bf16), so the buffer keeps a
window per sequence and evicts the oldest sequences once its byte cap is reached. It also counts
token frequencies, from which the drafter's draft vocabulary is rebuilt.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class BufferedSequence:
    tokens: torch.Tensor  # [L + 1]: tokens[t + 1] follows features[t]
    features: torch.Tensor  # [L, F] the policy's features the drafter reads (final hidden states for EAGLE-1)
    # The policy's next-token law at t + 1 (what a draft made at t should match), computed once: its top-k token ids
    # [L, k] and probabilities [L, k] (the last row: the law after the last token). None: not computed yet (below),
    # or train on the tokens themselves.
    target_ids: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    # Or the policy's final hidden states at t + 1 [L, H], from which the trainer computes that law the first time a
    # micro-batch reads the sequence (a deferred law: its cost lands in the drafter's training budget, and a sequence
    # the drafter never trains on never pays it). None once computed, or where there is no law to learn.
    final: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        tensors = (self.tokens, self.features, self.target_ids, self.target_probs, self.final)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class FeatureBuffer:
    """FIFO of :class:`BufferedSequence` bounded by ``max_bytes``; windows longer than ``max_tokens`` are cut.

    ``feature_dtype`` keeps the features in that dtype (``torch.bfloat16`` halves a float32 policy's features, so
    twice the data fits in memory; training batches are cast back to the policy's dtype); None keeps them as given.
    """

    def __init__(self, max_bytes: int = 512 << 20, max_tokens: int = 2048, device: str | torch.device | None = None,
                 feature_dtype: torch.dtype | None = None):
        if max_bytes <= 0 or max_tokens < 2:
            raise ValueError("FeatureBuffer needs max_bytes > 0 and max_tokens >= 2.")
        if feature_dtype is not None and not feature_dtype.is_floating_point:
            raise ValueError(f"FeatureBuffer's feature_dtype must be a floating dtype (torch.bfloat16, "
                             f"torch.float32); got {feature_dtype}.")
        self.max_bytes, self.max_tokens, self.device = max_bytes, max_tokens, device
        self.feature_dtype = feature_dtype
        self.sequences: deque[BufferedSequence] = deque()
        self.nbytes = 0
        self.token_counts: torch.Tensor | None = None
        self.added_sequences = 0
        self.evicted_sequences = 0

    @classmethod
    def counting(cls, rows: Iterable[torch.Tensor]) -> FeatureBuffer:
        """An empty buffer that has counted the tokens of ``rows`` (token-id tensors or lists): the draft vocabulary
        of a data set, by :meth:`most_frequent`, without its features."""
        counts = cls(1)
        for row in rows:
            tokens = torch.as_tensor(row, dtype=torch.long).flatten()
            if tokens.numel():
                counts._count(tokens)
        return counts

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(seq.features.shape[0] for seq in self.sequences)

    def add(self, tokens: torch.Tensor, features: torch.Tensor,
            targets: tuple[torch.Tensor, torch.Tensor] | None = None, final: torch.Tensor | None = None) -> None:
        """Add one sequence: ``tokens`` [L + 1], ``features`` [L, F] and optionally the policy's top-k
        ``targets`` (ids [L, k], probabilities [L, k]) or the ``final`` hidden states [L, H] they are computed from
        later (:meth:`settle_law`); detached, stored on ``device``."""
        if tokens.dim() != 1 or features.dim() != 2 or tokens.shape[0] != features.shape[0] + 1:
            raise ValueError(
                f"FeatureBuffer.add needs tokens [L+1] and features [L, H]; got {tuple(tokens.shape)} and "
                f"{tuple(features.shape)}."
            )
        if targets is not None and (targets[0].shape != targets[1].shape or targets[0].shape[0] != features.shape[0]):
            raise ValueError(f"FeatureBuffer.add needs targets ids and probabilities [L, k] for L="
                             f"{features.shape[0]}; got {tuple(targets[0].shape)} and {tuple(targets[1].shape)}.")
        if final is not None and (targets is not None or final.shape[0] != features.shape[0]):
            raise ValueError(f"FeatureBuffer.add takes targets or the final states [L, H] they come from, not both, "
                             f"for L={features.shape[0]}; got final {tuple(final.shape)}.")
        if features.shape[0] == 0:
            return
        start = max(0, features.shape[0] - self.max_tokens)  # keep the most recent window of each sequence
        device = self.device if self.device is not None else features.device

        def keep(t, dtype=None):
            return None if t is None else t[start:].detach().to(device=device, dtype=dtype)

        ids, probs = targets if targets is not None else (None, None)
        item = BufferedSequence(keep(tokens), keep(features, self.feature_dtype), keep(ids), keep(probs), keep(final))
        self._count(item.tokens)
        self.sequences.append(item)
        self.nbytes += item.nbytes
        self.added_sequences += 1
        while self.nbytes > self.max_bytes and len(self.sequences) > 1:
            old = self.sequences.popleft()
            self.nbytes -= old.nbytes
            self.evicted_sequences += 1

    def _count(self, tokens: torch.Tensor) -> None:
        size = int(tokens.max()) + 1
        if self.token_counts is None or self.token_counts.numel() < size:
            grown = torch.zeros(max(size, 1024), dtype=torch.long)
            if self.token_counts is not None:
                grown[: self.token_counts.numel()] = self.token_counts
            self.token_counts = grown
        self.token_counts += torch.bincount(tokens.cpu(), minlength=self.token_counts.numel())

    def most_frequent(self, count: int, vocab_size: int) -> torch.Tensor:
        """The ``count`` most frequent token ids seen (unseen ids, lowest first, fill the rest)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        if self.token_counts is not None:
            n = min(vocab_size, self.token_counts.numel())
            counts[:n] = self.token_counts[:n]
        # Stable order: by count descending, then id ascending.
        order = torch.argsort(counts * vocab_size + (vocab_size - 1 - torch.arange(vocab_size)), descending=True)
        return order[:count]

    def settle_law(self, sequence: BufferedSequence, targets: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Replace a buffered sequence's deferred final states with the law computed from them (ids, probabilities
        [L, k]), and count the bytes it now holds."""
        if sequence.final is None:
            raise ValueError("settle_law: this sequence's law is not deferred (it has no final states).")
        before = sequence.nbytes
        device = sequence.final.device  # the buffer's, where the law may have been computed elsewhere
        ids, probs = (t.detach().to(device) for t in targets)
        sequence.target_ids, sequence.target_probs, sequence.final = ids, probs, None
        if any(item is sequence for item in self.sequences):
            self.nbytes += sequence.nbytes - before

    def sample(self, count: int, generator: torch.Generator | None = None) -> list[BufferedSequence]:
        index = torch.randint(len(self.sequences), (count,), generator=generator)
        return [self.sequences[i] for i in index.tolist()]

    def clear(self) -> None:
        self.sequences.clear()
        self.nbytes = 0
