"""The policy's features of whole conversations, computed once and kept on disk.

Training a drafter from a data folder starts with the policy's forward over every conversation (its features and
top-k next-token law), which on a CPU takes longer than an hour for a million tokens, and which every run would
repeat: a longer run, a resumed one, another recipe on the same data. :class:`FeatureCache` keeps each
conversation's buffered sequence in its own file, named by a hash of its tokens and of everything else that makes
the features (the policy, the layers the drafter reads, the window the buffer keeps, the dtype the forward ran in),
so a run computes only the conversations it has not seen under the same settings, and a folder that gains shards
reuses the old ones. The buffer is filled in the order :meth:`DrafterTrainer.add_token_rows` uses, cached or not,
so training from cached features samples the same batches as training from fresh ones (their features equal to the
last bits, which a forward's batch partners move).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..modeling.host_memory import release_freed_host_memory
from ..modeling.target import policy_fingerprint
from .buffer import BufferedSequence
from .trainer import TARGET_TOP_K, regresses_features, shortest_first, token_rows

RELEASE_EVERY = 64  # conversations read into the buffer between two releases of the freed host memory


def held(sequence: BufferedSequence, feature_dtype: torch.dtype | None) -> BufferedSequence:
    """``sequence`` with its features in ``feature_dtype`` (as it is for None): what a buffer of that dtype keeps."""
    if feature_dtype is None or sequence.features.dtype == feature_dtype:
        return sequence
    return dataclasses.replace(sequence, features=sequence.features.to(feature_dtype))


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FeatureCache:
    """One file per conversation under ``directory / <settings hash>``; ``settings`` is what, beside the tokens,
    makes the features (JSON-serialisable). :meth:`for_trainer` builds it for a :class:`DrafterTrainer`."""

    def __init__(self, directory: str | os.PathLike, settings: dict):
        self.settings = settings
        self.directory = Path(directory) / _digest(json.dumps(settings, sort_keys=True).encode())[:16]

    @classmethod
    def for_trainer(cls, directory: str | os.PathLike, trainer, autocast: bool = False, **extra) -> FeatureCache:
        """The cache of ``trainer``'s features: its policy (fingerprint), the layers its drafter reads, whether it
        learns the policy's law or regresses features, the buffer's window, and ``autocast`` (the forward ran under
        bfloat16 autocast); ``extra`` adds anything else the caller's forward depends on."""
        settings = {"policy": policy_fingerprint(trainer.target.model), "device": trainer.target.device.type,
                    "dtype": str(next(trainer.target.model.parameters()).dtype), "autocast": autocast,
                    "feature_layers": list(trainer.drafter.feature_layers or []),
                    "targets": None if regresses_features(trainer.drafter) else TARGET_TOP_K,
                    "max_tokens": trainer.buffer.max_tokens, **extra}
        return cls(directory, settings)

    def path(self, tokens: torch.Tensor) -> Path:
        return self.directory / f"{_digest(tokens.to(torch.int64).numpy().tobytes())[:32]}.pt"

    def load(self, tokens: torch.Tensor) -> BufferedSequence | None:
        path = self.path(tokens)
        return BufferedSequence(**torch.load(path)) if path.is_file() else None

    def save(self, tokens: torch.Tensor, sequence: BufferedSequence) -> None:
        path = self.path(tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save({k: v.cpu() if v is not None else None for k, v in dataclasses.asdict(sequence).items()}, staged)
        os.replace(staged, path)  # a killed run leaves no half-written file under the real name

    def fill(self, trainer, rows: Sequence[torch.Tensor | Sequence[int]], batch_rows: int = 64,
             on_batch: Callable[[int, int], None] | None = None) -> dict:
        """Put the features of ``rows`` (whole conversations) into ``trainer``'s buffer: loaded where cached,
        else computed by :meth:`DrafterTrainer.add_token_rows` (``batch_rows``, ``on_batch`` as there) and saved.
        Returns ``{"cached", "computed"}`` (conversations)."""
        rows = token_rows(rows)
        short = sum(len(r) < 2 for r in rows)
        if short:
            raise ValueError(f"{short} conversations have fewer than two tokens: nothing to learn from; leave them "
                             "out of the data.")
        order = shortest_first(rows)  # add_token_rows' order, so a run samples the same batches either way
        # The missing ones are computed a batch at a time, saved, and held in the buffer's dtype until their turn;
        # the cached ones are read one at a time as they go into the buffer, so memory holds the data once, in the
        # buffer's dtype (a float32 copy of a whole folder's features would not fit beside a bfloat16 buffer).
        missing = [i for i in order if not self.path(rows[i]).is_file()]
        computed: dict[int, BufferedSequence] = {}
        buffer = trainer.buffer
        if missing:  # computed in a buffer of their own, each batch saved as it finishes (a killed run keeps them)
            fresh = type(buffer)(1 << 62, buffer.max_tokens, buffer.device)
            saved = 0

            def save_batch(done: int, total: int) -> None:
                nonlocal saved
                for i, sequence in zip(missing[saved:done], fresh.sequences, strict=True):
                    self.save(rows[i], sequence)
                    computed[i] = held(sequence, buffer.feature_dtype)
                fresh.clear()
                saved = done
                if on_batch is not None:
                    on_batch(done, total)

            trainer.buffer = fresh
            try:
                trainer.add_token_rows([rows[i] for i in missing], batch_rows, sort_by_length=False,
                                       on_batch=save_batch)
            finally:
                trainer.buffer = buffer
            fresh.clear()
        for k, i in enumerate(order, start=1):
            s = computed.pop(i) if i in computed else self.load(rows[i])
            targets = None if s.target_ids is None else (s.target_ids, s.target_probs)
            buffer.add(s.tokens, s.features, targets)
            if k % RELEASE_EVERY == 0 or k == len(order):  # the files read, freed between kept sequences
                release_freed_host_memory()
        return {"cached": len(rows) - len(missing), "computed": len(missing)}
