"""SpeculativeGenerator: batched, lossless speculative decoding over any Hugging Face causal LM.

One step for the active rows: the drafter proposes a chain of k tokens per row, the policy
scores all of them in one forward pass, each row keeps its own accepted prefix plus one token
drawn by rejection sampling, and both KV caches roll back per row by moving a length. Rows that
hit EOS or ``max_new_tokens`` leave the batch at once, so the long tail runs at its true batch
size. With ``speculation="never"`` the same engine decodes one token per step: the baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..config import TLTConfig
from ..spec.rejection import ChainVerdict, verify_greedy, verify_sampled
from ..spec.sampling import SamplingParams, check_generation_config, process_logits, sample_categorical
from .kv_cache import RowState, WritePlan, additive_mask, attention_allowed
from .stats import GenerationStats
from .target import TargetModel

SUPPORTED_SETTINGS = (
    "attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, "
    "eos_token_id, pad_token_id, generator"
)


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # [B, P + T]: prompts as given, completions right-padded with pad_token_id
    stats: GenerationStats


class _Rows:
    """Everything that has one entry per active row; ``select`` drops finished rows from all of it."""

    def __init__(self, **tensors):
        self.names = list(tensors)
        for name, value in tensors.items():
            setattr(self, name, value)

    def select(self, keep: torch.Tensor) -> None:
        for name in self.names:
            value = getattr(self, name)
            if value is None:
                continue
            if hasattr(value, "select") and not isinstance(value, torch.Tensor):
                value.select(keep)
            else:
                setattr(self, name, value.index_select(0, keep))


def _left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    pad = (attention_mask == 0).sum(dim=1)
    slots = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    expected = (slots[None] >= pad[:, None]).to(attention_mask.dtype)
    if not torch.equal(attention_mask, expected):
        raise ValueError(
            "attention_mask must be left padded (zeros then ones in every row); tokenize with "
            "tokenizer.padding_side = 'left'."
        )
    if (pad == attention_mask.shape[1]).any():
        raise ValueError("A prompt in the batch is empty (its attention_mask is all zeros).")
    return pad


def _infer_attention_mask(input_ids: torch.Tensor, pad_token_id: int, eos_token_id) -> torch.Tensor:
    """generate()'s rule: padding is where pad tokens are, unless pad doubles as EOS."""
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if pad_token_id in eos or not (input_ids == pad_token_id).any():
        return torch.ones_like(input_ids)
    return (input_ids != pad_token_id).to(torch.long)


def _eos_tensor(eos_token_id, device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


class SpeculativeGenerator:
    """Generates with ``model`` exactly as ``model.generate`` would, faster where a drafter predicts it well."""

    def __init__(self, model: nn.Module, drafter: nn.Module | None = None, config: TLTConfig | None = None):
        self.config = config or TLTConfig()
        self.model = model
        self.target = TargetModel(model)
        self.target.check_split()
        if drafter is None and self.config.speculation != "never":
            raise ValueError(
                f"speculation={self.config.speculation!r} needs a drafter: pass EagleDrafter.from_target(model) "
                "(or a trained one), or use TLTConfig(speculation='never') for plain decoding."
            )
        if drafter is not None:
            drafter.ensure_bound(model)
        self.drafter = drafter

    # ------------------------------------------------------------------ public entry
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 256,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        feature_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        **unsupported,
    ) -> GenerationResult:
        """Sample completions exactly as ``model.generate`` with the same settings would.

        ``feature_sink(tokens [L + 1], features [L, H])`` receives each finished row (prompt and completion)
        with the policy's hidden states from the verify passes, e.g. ``DrafterTrainer.add_features``, so the
        drafter trains on fresh rollouts without another policy forward.
        """
        if unsupported:
            raise TypeError(
                f"SpeculativeGenerator.generate does not support {sorted(unsupported)}; "
                f"supported: {SUPPORTED_SETTINGS}."
            )
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, prompt_len], got shape {tuple(input_ids.shape)}.")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int.")
        params = SamplingParams(do_sample, temperature, top_k, top_p, min_p, repetition_penalty)
        generation_config = getattr(self.model, "generation_config", None)
        check_generation_config(generation_config)
        # Like generate(): unset special tokens come from the model's generation_config.
        if eos_token_id is None and generation_config is not None:
            eos_token_id = generation_config.eos_token_id
        if pad_token_id is None and generation_config is not None:
            pad_token_id = generation_config.pad_token_id
        if pad_token_id is None:
            if eos_token_id is None:
                raise ValueError("Pass pad_token_id (or eos_token_id, which is then used for padding, as in generate).")
            pad_token_id = eos_token_id if isinstance(eos_token_id, int) else list(eos_token_id)[0]
        input_ids = input_ids.to(self.target.device)
        if attention_mask is None:
            attention_mask = _infer_attention_mask(input_ids, pad_token_id, eos_token_id)
        attention_mask = attention_mask.to(self.target.device)
        pad = _left_padding(attention_mask)
        return _Rollout(self, input_ids, pad, params, max_new_tokens, _eos_tensor(eos_token_id, input_ids.device),
                        pad_token_id, generator, feature_sink).run()


class _Rollout:
    """State and steps of one generate() call."""

    def __init__(self, engine: SpeculativeGenerator, input_ids, pad, params: SamplingParams, max_new_tokens: int,
                 eos: torch.Tensor | None, pad_token_id: int, generator, feature_sink=None):
        self.engine, self.target, self.drafter = engine, engine.target, engine.drafter
        self.config = engine.config
        self.params, self.warpers = params, params.warpers()
        # The drafter's q may be any distribution we sample from; without the repetition penalty it needs no
        # per-position history, and verification corrects the difference.
        self.draft_params = replace(params, repetition_penalty=1.0)
        self.max_new, self.eos, self.pad_token_id, self.generator = max_new_tokens, eos, pad_token_id, generator
        self.input_ids = input_ids
        batch, self.prompt_len = input_ids.shape
        self.device = input_ids.device
        self.k_max = 0 if self.config.speculation == "never" else self.config.chain_length
        self.capacity = self.prompt_len + max_new_tokens + self.k_max + 1
        self.completions = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.stats = GenerationStats(prompt_tokens=int((input_ids.shape[1] - pad).sum()))
        self.sync = self.device.type == "cuda"

        seq = torch.full((batch, self.capacity), pad_token_id, dtype=torch.long, device=self.device)
        seq[:, : self.prompt_len] = input_ids
        presence = None
        if params.uses_presence:
            presence = torch.zeros(batch, self.target.vocab_size, dtype=torch.bool, device=self.device)
            presence.scatter_(1, input_ids, True)
        use_drafter = self.drafter is not None and self.k_max > 0
        self.rows = _Rows(
            index=torch.arange(batch, device=self.device),
            seq=seq,
            state=RowState(pad.clone(), torch.zeros_like(pad)),
            draft_state=RowState(pad.clone(), torch.zeros_like(pad)) if use_drafter else None,
            generated=torch.zeros(batch, dtype=torch.long, device=self.device),
            presence=presence,
            features=None,
            cache=self.target.new_cache(self.capacity),
            draft_kv=self.drafter.new_kv(self.capacity) if use_drafter else None,
        )
        self.use_drafter = use_drafter
        self.feature_sink = feature_sink

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _scores(self, logits: torch.Tensor, presence: torch.Tensor | None) -> torch.Tensor:
        return process_logits(logits, self.params, presence, self.warpers)

    def _target_pass(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        kv_len = int(slots.max()) + 1
        mask = self.target.attention_mask(rows.state, slots, kv_len)
        rows.cache.plan = WritePlan(slots, kv_len)
        positions = (slots - rows.state.pad[:, None]).clamp(min=0)
        return self.target.forward(tokens, positions, mask, rows.cache)

    def _store_features(self, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        if not (self.use_drafter or self.feature_sink is not None):
            return
        rows = self.rows
        if rows.features is None:
            rows.features = hidden.new_zeros(hidden.shape[0], self.capacity, hidden.shape[-1])
        rows.features.scatter_(1, slots[..., None].expand(-1, -1, hidden.shape[-1]), hidden)

    def _record_memory(self) -> None:
        rows = self.rows
        total = rows.cache.nbytes()
        if rows.draft_kv is not None:
            total += rows.draft_kv.nbytes()
        if rows.features is not None:
            total += rows.features.numel() * rows.features.element_size()
        self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, total)

    # ------------------------------------------------------------------ prefill
    def _prefill(self) -> None:
        rows = self.rows
        start = self._now()
        slots = torch.arange(self.prompt_len, device=self.device).expand(rows.seq.shape[0], -1)
        hidden = self._target_pass(self.input_ids, slots)
        rows.state.length = torch.full_like(rows.state.length, self.prompt_len)
        self._store_features(hidden, slots)
        scores = self._scores(self.target.logits(hidden[:, -1]), rows.presence)
        if self.params.do_sample:
            first = sample_categorical(torch.softmax(scores, dim=-1), self.generator)
        else:
            first = scores.argmax(dim=-1)
        self._commit(first[:, None], torch.zeros_like(first), rows.state.length, advance=torch.zeros_like(first))
        self.stats.prefill_seconds += self._now() - start

    # ------------------------------------------------------------------ drafting
    def _draft(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Propose k tokens per row; returns (target ids [B,k], q [B,k,N] or None, draft ids [B,k])."""
        rows, drafter = self.rows, self.drafter
        dstate = rows.draft_state
        pending = rows.state.length - dstate.length  # pairs (h_s, x_{s+1}) the drafter has not seen yet
        width = int(pending.max())
        batch = pending.shape[0]
        slots = (dstate.length[:, None] + torch.arange(width, device=self.device)).clamp(max=self.capacity - 2)
        hidden_in = rows.features.gather(1, slots[..., None].expand(-1, -1, rows.features.shape[-1]))
        tokens_in = rows.seq.gather(1, slots + 1)
        feature = self._drafter_pass(hidden_in, tokens_in, slots)
        feature = feature[torch.arange(batch, device=self.device), pending - 1]
        dstate.length = rows.state.length.clone()

        draft_ids, draft_tokens, draft_probs = [], [], []
        for j in range(k):
            logits = drafter.logits(feature)
            if self.params.do_sample:
                probs = torch.softmax(process_logits(logits, self.draft_params, None, self.warpers), dim=-1)
                index = sample_categorical(probs, self.generator)
                draft_probs.append(probs)
            else:
                index = logits.argmax(dim=-1)
            token = drafter.to_target_ids(index)
            draft_ids.append(index)
            draft_tokens.append(token)
            if j + 1 < k:
                slot = (rows.state.length + j)[:, None]
                feature = self._drafter_pass(feature[:, None], token[:, None], slot)[:, 0]
        q = torch.stack(draft_probs, dim=1) if draft_probs else None
        return torch.stack(draft_tokens, dim=1), q, torch.stack(draft_ids, dim=1)

    def _drafter_pass(self, hidden, tokens, slots) -> torch.Tensor:
        dstate = self.rows.draft_state
        kv_len = int(slots.max()) + 1
        mask = additive_mask(attention_allowed(dstate, slots, kv_len), hidden.dtype)
        positions = (slots - dstate.pad[:, None]).clamp(min=0)
        return self.drafter(hidden, tokens, positions, mask, self.rows.draft_kv, slots, kv_len)

    # ------------------------------------------------------------------ one step
    def _step(self, k: int) -> None:
        rows = self.rows
        batch = rows.seq.shape[0]
        start = self._now()
        if k > 0:
            drafts, q, draft_ids = self._draft(k)
            drafted = self._now()
            self.stats.draft_seconds += drafted - start
        else:
            drafts = torch.empty(batch, 0, dtype=torch.long, device=self.device)
            drafted = start
        length = rows.state.length
        pending = rows.seq.gather(1, length[:, None])
        tokens = torch.cat([pending, drafts], dim=1)
        slots = length[:, None] + torch.arange(k + 1, device=self.device)
        hidden = self._target_pass(tokens, slots)
        self._store_features(hidden, slots)
        presence = self._presence_along(drafts) if rows.presence is not None else None
        scores = self._scores(self.target.logits(hidden), presence)
        if k == 0:
            if self.params.do_sample:
                token = sample_categorical(torch.softmax(scores[:, 0], dim=-1), self.generator)
            else:
                token = scores[:, 0].argmax(dim=-1)
            verdict = ChainVerdict(torch.zeros_like(token), token)
        elif self.params.do_sample:
            verdict = verify_sampled(drafts, q, torch.softmax(scores, dim=-1), self.generator,
                                     self.drafter.d2t, draft_ids)
        else:
            verdict = verify_greedy(drafts, scores.argmax(dim=-1))
        emitted = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
        emitted.scatter_(1, verdict.num_accepted[:, None], verdict.next_token[:, None])
        emitted_count = self._commit(emitted, verdict.num_accepted, length + 1, advance=verdict.num_accepted + 1)
        end = self._now()
        if k > 0:
            self.stats.verify_seconds += end - drafted
        else:
            self.stats.decode_seconds += end - start
        accepted = int(verdict.num_accepted.sum()) if k > 0 else 0
        self.stats.record_step(batch, emitted_count, batch * k, accepted, end - start)

    def _presence_along(self, drafts: torch.Tensor) -> torch.Tensor:
        """Presence masks [B, k+1, V] for each verified position: history plus the drafts before it."""
        base = self.rows.presence
        k = drafts.shape[1]
        presence = base[:, None].repeat(1, k + 1, 1)
        for j in range(k):
            presence[:, j + 1 :].scatter_(2, drafts[:, j, None, None].expand(-1, k - j, 1), True)
        return presence

    # ------------------------------------------------------------------ bookkeeping
    def _commit(self, emitted: torch.Tensor, num_accepted: torch.Tensor, first_slot: torch.Tensor,
                advance: torch.Tensor) -> int:
        """Write ``num_accepted + 1`` tokens of ``emitted`` [B, w] per row from ``first_slot``, cut at EOS and
        ``max_new_tokens``; the policy's cache keeps ``advance`` more slots. Returns tokens appended.
        """
        rows = self.rows
        width = emitted.shape[1]
        offsets = torch.arange(width, device=self.device)
        count = num_accepted + 1
        if self.eos is not None:
            is_eos = torch.isin(emitted, self.eos) & (offsets[None] < count[:, None])
            has_eos = is_eos.any(dim=1)
            count = torch.where(has_eos, is_eos.to(torch.int64).argmax(dim=1) + 1, count)
        else:
            has_eos = torch.zeros_like(count, dtype=torch.bool)
        remaining = self.max_new - rows.generated
        count = torch.minimum(count, remaining)
        hit_eos = has_eos
        if self.eos is not None:  # the row ends on EOS only if the cut by max_new_tokens kept it
            hit_eos = torch.isin(emitted.gather(1, (count - 1)[:, None]).squeeze(1), self.eos)
        keep_token = offsets[None] < count[:, None]
        dest = first_slot[:, None] + offsets[None]
        old = rows.seq.gather(1, dest)
        rows.seq.scatter_(1, dest, torch.where(keep_token, emitted, old))
        if rows.presence is not None:
            marks = torch.where(keep_token, emitted, emitted[:, :1])
            rows.presence.scatter_(1, marks, True)
        rows.generated += count
        rows.state.length = rows.state.length + advance
        finished = hit_eos | (rows.generated >= self.max_new)
        total = int(count.sum())
        self.stats.generated_tokens += total
        if finished.any():
            self._retire(finished)
        return total

    def _retire(self, finished: torch.Tensor) -> None:
        rows = self.rows
        done = finished.nonzero().squeeze(1)
        for i in done.tolist():
            n = int(rows.generated[i])
            start = self.prompt_len
            self.completions[rows.index[i], :n] = rows.seq[i, start : start + n]
            self.lengths[rows.index[i]] = n
            if self.feature_sink is not None:
                pad = int(rows.state.pad[i])
                # Features exist for every real token but the last (never fed back to the policy).
                self.feature_sink(rows.seq[i, pad : start + n], rows.features[i, pad : start + n - 1])
        keep = (~finished).nonzero().squeeze(1)
        rows.select(keep)

    # ------------------------------------------------------------------ main loop
    def _chain_length(self, batch: int) -> int:
        mode = self.config.speculation
        if mode == "never" or not self.use_drafter:
            return 0
        if mode == "adaptive" and batch > self.config.max_speculative_batch_size:
            return 0
        remaining = int((self.max_new - self.rows.generated).max())
        return max(0, min(self.k_max, remaining - 1))

    def run(self) -> GenerationResult:
        begin = self._now()
        progress = None
        if self.config.show_progress:
            from tqdm.auto import tqdm

            progress = tqdm(total=int(self.completions.numel()), desc="generate", unit="tok")
        self._prefill()
        self._record_memory()
        while self.rows.seq.shape[0] > 0:
            before = self.stats.generated_tokens
            self._step(self._chain_length(self.rows.seq.shape[0]))
            self._record_memory()
            if progress is not None:
                progress.update(self.stats.generated_tokens - before)
        if progress is not None:
            progress.close()
        self.stats.total_seconds = self._now() - begin
        width = int(self.lengths.max())
        sequences = torch.cat([self.input_ids, self.completions[:, :width]], dim=1)
        return GenerationResult(sequences=sequences, stats=self.stats)
