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
from ..spec.history import HistoryIndex
from ..spec.rejection import ChainVerdict, verify_greedy, verify_sampled
from ..spec.sampling import SamplingParams, check_generation_config, process_logits, sample_categorical
from ..spec.strategy import NONE, Strategy
from ..spec.tree import DraftTree, verify_tree
from .costs import CostProfile, profile_costs
from .graphs import GraphRunner
from .kv_cache import RowState, WritePlan, additive_mask, attention_allowed, compact_in_place, compaction_plan
from .selector import StrategySelector
from .stats import GenerationStats
from .target import TargetModel

# The most slots one speculative step commits (a depth-8 path or an 8-token history chain, plus the bonus token):
# a drafter further behind has sat out plain steps, and its catch-up is the one-off cost of switching.
_STEADY_CATCH_UP = 12

SUPPORTED_SETTINGS = (
    "attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, "
    "eos_token_id, pad_token_id, generator"
)


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # [B, P + T]: prompts as given, completions right-padded with pad_token_id
    stats: GenerationStats


class _Rows:
    """Everything that has one entry per active row; ``compact`` drops finished rows from all of it."""

    def __init__(self, **tensors):
        self.names = list(tensors)
        for name, value in tensors.items():
            setattr(self, name, value)
        self.features_used = 0  # slots of ``features`` ever written (what compaction must move)

    def compact(self, finished: torch.Tensor) -> None:
        order, holes, movers = compaction_plan(finished)
        n = order.shape[0]
        for name in self.names:
            value = getattr(self, name)
            if value is None:
                continue
            if hasattr(value, "compact"):
                value.compact(holes, movers, n)
            elif hasattr(value, "select") and not isinstance(value, torch.Tensor):
                value.select(order)
            elif name == "features":  # [B, capacity, H]: the one large per-row buffer besides the caches
                setattr(self, name, compact_in_place(value, holes, movers, n, 1, self.features_used))
            else:
                setattr(self, name, value.index_select(0, order))


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
        if drafter is None and self.config.speculation != "never" and not self.config.history:
            raise ValueError(
                f"speculation={self.config.speculation!r} needs a drafter or history proposals: pass "
                "EagleDrafter.from_target(model) (or a trained one), keep TLTConfig(history=True), or use "
                "TLTConfig(speculation='never') for plain decoding."
            )
        if drafter is not None:
            drafter.ensure_bound(model)
        self.drafter = drafter
        self.strategies = self.config.speculation_strategies(has_drafter=drafter is not None)
        self.history: HistoryIndex | None = None
        if any(s.history for s in self.strategies):
            self.history = HistoryIndex(max_tokens=self.config.history_max_tokens,
                                        keep_steps=self.config.history_keep_steps)
        self.cost_profile = CostProfile()
        self._selectors: dict[tuple, StrategySelector] = {}

    def selector(self, do_sample: bool = True, temperature: float = 1.0) -> StrategySelector | None:
        """The adaptive selector for a sampling regime (acceptance differs between greedy and sampling)."""
        if self.config.speculation != "adaptive" or not self.strategies:
            return None
        key = (bool(do_sample), round(float(temperature), 3) if do_sample else 0.0)
        if key not in self._selectors:
            self._selectors[key] = StrategySelector(self.strategies, self.cost_profile, self.config.selector_window,
                                                    self.config.exploration, min_speedup=self.config.min_speedup)
        return self._selectors[key]

    def profile(self, batch_size: int, context: int) -> CostProfile:
        """Measure (once per batch size) what a step of each strategy costs; adaptive generate() calls this."""
        sizes = [1 << i for i in range(batch_size.bit_length()) if 1 << i <= batch_size] + [batch_size]
        cap = self.config.max_speculative_batch_size
        if cap is not None:
            sizes = [b for b in sizes if b <= cap]
        return profile_costs(self.target, self.drafter, self.strategies, sizes, context, self.cost_profile,
                             min_speedup=self.config.min_speedup)

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
        history_keys: list | None = None,
        **unsupported,
    ) -> GenerationResult:
        """Sample completions exactly as ``model.generate`` with the same settings would.

        ``feature_sink(tokens [L + 1], features [L, H])`` receives each finished row (prompt and completion)
        with the policy's hidden states from the verify passes, e.g. ``DrafterTrainer.add_features``, so the
        drafter trains on fresh rollouts without another policy forward.

        ``history_keys`` (one hashable per row) groups rows whose rollouts propose drafts for each other;
        by default rows with the same prompt form a group (GRPO's siblings, and the same prompt in later steps).
        """
        return self.start(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, min_p,
                          repetition_penalty, eos_token_id, pad_token_id, generator, feature_sink, history_keys,
                          **unsupported).run()

    @torch.no_grad()
    def start(
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
        history_keys: list | None = None,
        **unsupported,
    ) -> _Rollout:
        """:meth:`generate`, to be driven one step at a time: ``rollout.step()`` until it returns False, then
        ``rollout.finish()``. Benchmarks interleave two engines' steps this way, so both see the same machine.

        ``feature_sink(tokens [L + 1], features [L, H])`` receives each finished row (prompt and completion)
        with the policy's hidden states from the verify passes, e.g. ``DrafterTrainer.add_features``, so the
        drafter trains on fresh rollouts without another policy forward.

        ``history_keys`` (one hashable per row) groups rows whose rollouts propose drafts for each other;
        by default rows with the same prompt form a group (GRPO's siblings, and the same prompt in later steps).
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
        keys = None
        if self.history is not None:
            if history_keys is None:
                history_keys = [tuple(row[p:]) for row, p in zip(input_ids.tolist(), pad.tolist())]
            elif len(history_keys) != input_ids.shape[0]:
                raise ValueError(f"history_keys has {len(history_keys)} entries for {input_ids.shape[0]} rows.")
            keys = list(history_keys)
            self.history.new_step()
        return _Rollout(self, input_ids, pad, params, max_new_tokens, _eos_tensor(eos_token_id, input_ids.device),
                        pad_token_id, generator, feature_sink, keys)


class _Rollout:
    """State and steps of one generate() call."""

    def __init__(self, engine: SpeculativeGenerator, input_ids, pad, params: SamplingParams, max_new_tokens: int,
                 eos: torch.Tensor | None, pad_token_id: int, generator, feature_sink=None, history_keys=None):
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
        strategies = engine.strategies
        self.fixed = strategies[0] if self.config.speculation == "always" and strategies else NONE
        self.selector = engine.selector(params.do_sample, params.temperature)
        if self.selector is not None:
            engine.profile(batch, self.prompt_len + min(max_new_tokens, 128))
        # Slots past a row's length that one step may write: verified nodes, or the tree drafter's beams.
        extra = max([max(s.num_nodes + s.history, (s.depth - 1) * s.width) for s in strategies], default=0)
        self.capacity = self.prompt_len + max_new_tokens + extra + 1
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
        use_drafter = self.drafter is not None and any(s.uses_drafter for s in strategies)
        self.history, self.history_keys = engine.history, history_keys
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
        self.graphs = None
        graph_mode = self.config.cuda_graphs
        if graph_mode == "static" or (graph_mode == "auto" and self.device.type == "cuda"):
            self.graphs = GraphRunner(self.target, self.rows.cache, batch, self.capacity,
                                      mode="static" if graph_mode == "static" else "cuda")
        self.feature_sink = feature_sink
        self._proposals = None  # (step, k, proposals, contexts) of the current step
        self._switch_seconds = 0.0  # this step's catch-up after plain steps (see _catch_up)
        self._begin = None  # set by begin(): the clock of stats.total_seconds
        self._progress = None
        # Adaptive: history:K arms are valued from each step's proposals (which cost no compute).
        self.history_arm_tokens = 0
        if self.selector is not None and self.history is not None:
            self.history_arm_tokens = max((s.history for s in strategies if s.kind == "history"), default=0)

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

    def _policy_pass(self, tokens, positions, slots, mask_for) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and float32 logits of a decode/verify pass; ``mask_for(kv_len)`` builds its mask(s).

        Replayed from a CUDA graph (full-capacity masks, padded batch) when the engine has a graph runner.
        """
        rows = self.rows
        runner = self.graphs
        if runner is not None and runner.supports(tokens.shape[0]):
            mask = mask_for(self.capacity)
            masks = {"full": mask} if isinstance(mask, torch.Tensor) else {
                "full": mask["full_attention"], "sliding": mask["sliding_attention"]}
            return runner(tokens, positions, slots, masks)
        kv_len = int(slots.max()) + 1
        mask = mask_for(kv_len)
        rows.cache.plan = WritePlan(slots, kv_len)
        hidden = self.target.forward(tokens, positions, mask, rows.cache)
        return hidden, self.target.logits(hidden)

    def _store_features(self, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        if not (self.use_drafter or self.feature_sink is not None):
            return
        rows = self.rows
        if rows.features is None:
            rows.features = hidden.new_zeros(hidden.shape[0], self.capacity, hidden.shape[-1])
        rows.features.scatter_(1, slots[..., None].expand(-1, -1, hidden.shape[-1]), hidden)
        rows.features_used = max(rows.features_used, int(slots.max()) + 1)

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
    def _catch_up(self) -> torch.Tensor:
        """Feed the drafter the (feature, token) pairs committed since it last ran; returns its latest
        prediction [B, H], from which the first draft token is read. Switching strategies, or from plain
        decoding back to speculation, costs nothing more than this.
        """
        rows = self.rows
        dstate = rows.draft_state
        pending = rows.state.length - dstate.length  # pairs (h_s, x_{s+1}) the drafter has not seen yet
        width = int(pending.max())
        batch = pending.shape[0]
        start = self._now() if width > _STEADY_CATCH_UP else None
        slots = (dstate.length[:, None] + torch.arange(width, device=self.device)).clamp(max=self.capacity - 2)
        hidden_in = rows.features.gather(1, slots[..., None].expand(-1, -1, rows.features.shape[-1]))
        tokens_in = rows.seq.gather(1, slots + 1)
        feature = self._drafter_pass(hidden_in, tokens_in, slots)
        dstate.length = rows.state.length.clone()
        if start is not None:  # a switch from plain decoding: the selector leaves this one-off out of the cost
            self._switch_seconds = self._now() - start
        return feature[torch.arange(batch, device=self.device), pending - 1]

    def _draft(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Propose k tokens per row; returns (target ids [B,k], q [B,k,N] or None, draft ids [B,k])."""
        rows, drafter = self.rows, self.drafter
        feature = self._catch_up()

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

    def _drafter_pass(self, hidden, tokens, slots, positions=None, allowed=None) -> torch.Tensor:
        dstate = self.rows.draft_state
        kv_len = int(slots.max()) + 1
        if allowed is None:
            allowed = attention_allowed(dstate, slots, kv_len)
        mask = additive_mask(allowed[..., :kv_len], hidden.dtype)
        if positions is None:
            positions = (slots - dstate.pad[:, None]).clamp(min=0)
        return self.drafter(hidden, tokens, positions, mask, self.rows.draft_kv, slots, kv_len)

    def _draft_scores(self, feature: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [.., N] of the drafter's (warped) next-token law, finite so that every child
        scores strictly below its parent."""
        logits = self.drafter.logits(feature)
        if self.params.do_sample:
            logits = process_logits(logits, self.draft_params, None, self.warpers)
        return torch.log_softmax(logits, dim=-1).clamp(min=-1e4)

    def _draft_tree(self, strategy: Strategy, budget: int | None = None, keep: torch.Tensor | None = None) -> DraftTree:
        """EAGLE-2's dynamic tree: expand the ``width`` best nodes of each level into their ``width`` best
        children, then keep the ``budget`` (default ``num_nodes``) best nodes overall by drafted path log-probability.
        With ``keep`` [B], row b's first ``keep[b]`` nodes are its best ones (a closed subtree: a child always
        scores below its parent) and the rest follow, for the caller to replace.

        Candidates are deterministic given the prefix (point-mass proposals), so :func:`verify_tree`
        stays exact whatever is selected here.
        """
        rows, drafter, device = self.rows, self.drafter, self.device
        depth, width = strategy.depth, strategy.width
        budget = budget or strategy.num_nodes
        dstate = rows.draft_state
        batch = rows.seq.shape[0]
        length, pad = rows.state.length, dstate.pad
        feature = self._catch_up()
        scores = self._draft_scores(feature)  # [B, Nd]
        top_scores, top_ids = scores.topk(width, dim=-1)
        cand_tokens = [drafter.to_target_ids(top_ids)]
        cand_scores = [top_scores]
        cand_parents = [torch.full((batch, width), -1, dtype=torch.long, device=device)]
        beam = torch.arange(width, device=device).expand(batch, -1)  # candidate index of each beam node
        beam_tokens, beam_scores = cand_tokens[0], top_scores
        beam_feature = feature[:, None].expand(-1, width, -1)
        ancestry = torch.empty(batch, width, 0, dtype=torch.long, device=device)  # drafter slots of ancestors
        committed = None
        offset = width
        penalty = 1e-6  # strict decrease along paths even when a drafter is certain (log 1 = 0)
        for level in range(1, depth):
            slots = length[:, None] + (level - 1) * width + torch.arange(width, device=device)
            ancestry = torch.cat([ancestry, slots[..., None]], dim=2)
            kv_len = int(slots.max()) + 1
            if committed is None:
                keys = torch.arange(kv_len + (depth - 1) * width, device=device)
                committed = (keys[None] >= pad[:, None]) & (keys[None] < length[:, None])
            allowed = committed[:, None, :].expand(batch, width, -1).clone()
            allowed.scatter_(2, ancestry, True)
            positions = (length - pad)[:, None].expand(-1, width) + (level - 1)
            out = self._drafter_pass(beam_feature, beam_tokens, slots, positions, allowed)
            child_scores, child_ids = self._draft_scores(out).topk(width, dim=-1)  # [B, W, W]
            child_scores = beam_scores[..., None] + child_scores - penalty
            flat_scores = child_scores.reshape(batch, width * width)
            cand_scores.append(flat_scores)
            cand_tokens.append(drafter.to_target_ids(child_ids).reshape(batch, width * width))
            cand_parents.append(beam[..., None].expand(-1, -1, width).reshape(batch, width * width))
            best_scores, best = flat_scores.topk(width, dim=-1)
            parent_of_best = best // width
            beam = offset + best
            beam_scores = best_scores
            beam_tokens = cand_tokens[-1].gather(1, best)
            beam_feature = out.gather(1, parent_of_best[..., None].expand(-1, -1, out.shape[-1]))
            ancestry = ancestry.gather(1, parent_of_best[..., None].expand(-1, -1, ancestry.shape[2]))
            offset += width * width
        all_scores = torch.cat(cand_scores, dim=1)
        all_tokens = torch.cat(cand_tokens, dim=1)
        all_parents = torch.cat(cand_parents, dim=1)
        levels = [torch.ones(batch, width, dtype=torch.long, device=device)]
        levels += [torch.full((batch, width * width), lv + 1, dtype=torch.long, device=device)
                   for lv in range(1, depth)]
        all_depths = torch.cat(levels, dim=1)
        best = all_scores.topk(budget, dim=-1).indices  # best first
        if keep is not None:  # the kept nodes first (in candidate order), the others after them
            count = all_scores.shape[1]
            best = torch.where(torch.arange(budget, device=device)[None] < keep[:, None], best, best + count)
            chosen = best.sort(dim=-1).values % count
        else:
            chosen = best.sort(dim=-1).values  # parents precede children
        node_of = torch.zeros(batch, all_scores.shape[1] + 1, dtype=torch.long, device=device)
        node_of.scatter_(1, chosen + 1, torch.arange(1, budget + 1, device=device).expand(batch, -1))
        parents = node_of.gather(1, all_parents.gather(1, chosen) + 1)
        return DraftTree(all_tokens.gather(1, chosen), parents, all_depths.gather(1, chosen))

    # ------------------------------------------------------------------ one step
    def _step(self, strategy: Strategy) -> None:
        batch = self.rows.seq.shape[0]
        self._switch_seconds = 0.0
        self._expected_emitted = None
        start = self._now()
        if strategy.kind in ("tree", "history"):
            emitted, drafted, accepted = self._tree_step(strategy, start)
        else:
            emitted, drafted, accepted = self._chain_step(strategy.depth, start)
        seconds = self._now() - start
        self.stats.record_step(batch, emitted, drafted, accepted, seconds, strategy.name)
        if self.selector is not None:
            self.selector.observe(strategy, batch, emitted, seconds, accepted, catch_up_seconds=self._switch_seconds,
                                  expected_emitted=self._expected_emitted)

    def _tree_step(self, strategy: Strategy, start: float) -> tuple[int, int, int]:
        rows = self.rows
        batch = rows.seq.shape[0]
        tree = self._proposal_tree(strategy)
        if tree is None:  # nothing to verify: a plain step
            return self._chain_step(0, start)
        drafted = self._now()
        self.stats.draft_seconds += drafted - start
        length = rows.state.length
        nodes = tree.num_nodes
        closure = tree.ancestors()
        tokens = torch.cat([rows.seq.gather(1, length[:, None]), tree.tokens], dim=1)
        depths = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1)
        positions = (length - rows.state.pad)[:, None] + depths
        slots = length[:, None] + torch.arange(nodes + 1, device=self.device)
        hidden, logits = self._policy_pass(
            tokens, positions, slots, lambda kv_len: self.target.tree_attention_mask(rows.state, closure, positions,
                                                                                     kv_len))
        presence = self._presence_in_tree(tree, closure) if rows.presence is not None else None
        scores = self._scores(logits, presence)
        if self.params.do_sample:
            verdict = verify_tree(tree, torch.softmax(scores, dim=-1), self.generator)
        else:
            verdict = verify_tree(tree, None, target_argmax=scores.argmax(dim=-1))
        # The accepted path moves into consecutive slots after the root (keys, values and features).
        depth = verdict.path.shape[1]
        steps = torch.arange(depth, device=self.device)
        on_path = steps[None] < verdict.num_accepted[:, None]
        dest = length[:, None] + 1 + steps
        source = torch.where(on_path, length[:, None] + verdict.path, dest)
        rows.cache.move(source, dest)
        path_nodes = torch.cat([torch.zeros_like(verdict.path[:, :1]), torch.where(on_path, verdict.path, 0)], 1)
        self._store_features(hidden.gather(1, path_nodes[..., None].expand(-1, -1, hidden.shape[-1])),
                             torch.cat([length[:, None], dest], dim=1))
        path_tokens = tree.tokens.gather(1, (verdict.path - 1).clamp(min=0))
        emitted = torch.cat([path_tokens, path_tokens.new_zeros(batch, 1)], dim=1)
        emitted.scatter_(1, verdict.num_accepted[:, None], verdict.next_token[:, None])
        count = self._commit(emitted, verdict.num_accepted, length + 1, advance=verdict.num_accepted + 1)
        self.stats.verify_seconds += self._now() - drafted
        return count, batch * nodes, int(verdict.num_accepted.sum())

    def _proposal_tree(self, strategy: Strategy) -> DraftTree | None:
        """The drafter's tree, the history chain, or both; None when history alone has nothing to propose.

        Merged, every row verifies N + K nodes: a row whose history proposes L tokens gets them as one more
        branch from the root plus its N + K - L best drafted nodes, a row without a match N + K drafted nodes.
        """
        if strategy.kind == "history":
            tokens, lengths = self._history_chain(strategy.history)
            return None if int(lengths.max()) == 0 else DraftTree.chain(tokens)
        if not strategy.history:
            return self._draft_tree(strategy)
        chain, lengths = self._history_chain(strategy.history, pad_to=strategy.history)
        budget = strategy.num_nodes + strategy.history
        keep = budget - lengths
        tree = self._draft_tree(strategy, budget, keep)
        node = torch.arange(budget, device=self.device)[None]
        t = node - keep[:, None]  # position along the history branch, negative on drafted nodes
        on_chain = t >= 0
        t = t.clamp(min=0)
        tokens = torch.where(on_chain, chain.gather(1, t), tree.tokens)
        parents = torch.where(on_chain, torch.where(t == 0, 0, node), tree.parents)  # node j's previous is j
        depths = torch.where(on_chain, t + 1, tree.depths)
        return DraftTree(tokens, parents, depths)

    def _history_proposals(self, k: int) -> tuple[list, list[list[int]]]:
        """This step's history proposals (up to k tokens per row) and the rows' contexts, computed once per step."""
        step = self.stats.steps
        if self._proposals is None or self._proposals[0] != step or self._proposals[1] < k:
            rows = self.rows
            ends = (rows.state.length + 1).tolist()  # committed tokens and the pending one
            pads = rows.state.pad.tolist()
            seqs = rows.seq[:, : max(ends)].tolist()
            keys = [self.history_keys[i] for i in rows.index.tolist()]
            contexts = [seq[p:e] for seq, p, e in zip(seqs, pads, ends)]
            self._proposals = (step, k, self.history.propose_many(keys, contexts, k), contexts)
        return self._proposals[2], self._proposals[3]

    def _history_expected(self, k: int) -> list[float]:
        """Accepted tokens per row this step's proposals predict for chains of 1..k: the sum over positions of
        the product of each token's chance so far (the selector calibrates it).

        A token's chance is its share of the matching history, discounted by how much history backs it:
        ``count / (count + 1)`` times the share. One sibling that continued this way once is weak evidence (1/2),
        four that agree are strong (4/5). Undiscounted, a single sibling's 8-token continuation predicted 8 accepted
        tokens; at batch 1 the engine then verified 9 tokens (2.1x a plain step on a CPU) for 0-2 accepted.
        """
        totals = [0.0] * k
        proposals, _ = self._history_proposals(k)
        for proposal in proposals:
            survive, expected = 1.0, 0.0
            conf, support = proposal.token_confidence, proposal.token_support
            for w in range(k):
                if w < len(conf):
                    survive *= conf[w] * support[w] / (support[w] + 1)
                    expected += survive
                totals[w] += expected
        batch = max(self.rows.seq.shape[0], 1)
        return [t / batch for t in totals]

    def _history_chain(self, k: int, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, w] tokens continuing each row from rollout history, [B] proposal lengths): w <= k the longest
        proposal, or ``pad_to``. Shorter proposals repeat their last token (any candidate is exact: the verifier
        only follows the policy's own draws)."""
        proposals, contexts = self._history_proposals(k)
        lengths = [min(len(p.tokens), k) for p in proposals]
        width = pad_to or max(max(lengths), 1)
        chains = []
        for context, proposal, n in zip(contexts, proposals, lengths):
            tokens = proposal.tokens[:n] or [context[-1]]
            chains.append(tokens + [tokens[-1]] * (width - len(tokens)))
            self.stats.history_proposed += n
        return (torch.tensor(chains, dtype=torch.long, device=self.device),
                torch.tensor(lengths, dtype=torch.long, device=self.device))

    def _presence_in_tree(self, tree: DraftTree, closure: torch.Tensor) -> torch.Tensor:
        """Presence masks [B, 1+N, V] after each node: history plus the tokens on the path to the node."""
        presence = self.rows.presence[:, None].repeat(1, tree.num_nodes + 1, 1)
        b, i, j = closure[:, :, 1:].nonzero(as_tuple=True)
        presence[b, i, tree.tokens[b, j]] = True
        return presence

    def _chain_step(self, k: int, start: float) -> tuple[int, int, int]:
        rows = self.rows
        batch = rows.seq.shape[0]
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
        positions = (slots - rows.state.pad[:, None]).clamp(min=0)
        hidden, logits = self._policy_pass(
            tokens, positions, slots, lambda kv_len: self.target.attention_mask(rows.state, slots, kv_len))
        self._store_features(hidden, slots)
        presence = self._presence_along(drafts) if rows.presence is not None else None
        scores = self._scores(logits, presence)
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
        if verdict.first_acceptance is not None:  # the first draft's accept/reject replaced by its probability
            self._expected_emitted = emitted_count + float(
                (verdict.first_acceptance - (verdict.num_accepted > 0).to(verdict.first_acceptance.dtype)).sum())
        return emitted_count, batch * k, accepted

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
            if self.history is not None:
                pad = int(rows.state.pad[i])
                self.history.add(self.history_keys[int(rows.index[i])], rows.seq[i, pad : start + n].tolist())
            if self.feature_sink is not None:
                pad = int(rows.state.pad[i])
                # Features exist for every real token but the last (never fed back to the policy).
                # Copies: compaction later moves other rows into this row's buffers.
                self.feature_sink(rows.seq[i, pad : start + n].clone(), rows.features[i, pad : start + n - 1].clone())
        rows.compact(finished)

    # ------------------------------------------------------------------ main loop
    def _choose(self, batch: int) -> Strategy:
        if not self.engine.strategies:
            return NONE
        remaining = int((self.max_new - self.rows.generated).max())
        if remaining <= 1:
            return NONE  # the next token is the last one: nothing to draft for
        cap = self.config.max_speculative_batch_size
        if self.config.speculation == "adaptive" and cap is not None and batch > cap:
            return NONE
        if self.selector is None:
            strategy = self.fixed
        else:
            tokens = self.history_arm_tokens
            strategy = self.selector.choose(batch, (lambda: self._history_expected(tokens)) if tokens else None)
        if strategy.kind == "chain" and strategy.depth >= remaining:
            return Strategy("chain", depth=remaining - 1, num_nodes=remaining - 1)
        return strategy

    @torch.no_grad()
    def begin(self) -> None:
        """Prefill; the clock of ``stats.total_seconds`` starts here."""
        self._begin = self._now()
        if self.config.show_progress:
            from tqdm.auto import tqdm

            self._progress = tqdm(total=int(self.completions.numel()), desc="generate", unit="tok")
        self._prefill()
        self._record_memory()

    @torch.no_grad()
    def step(self) -> bool:
        """One decode step of the active rows (after :meth:`begin`); False once every row has finished."""
        if self._begin is None:
            raise RuntimeError("Call rollout.begin() (the prefill) before rollout.step().")
        if self.rows.seq.shape[0] == 0:
            return False
        before = self.stats.generated_tokens
        self._step(self._choose(self.rows.seq.shape[0]))
        self._record_memory()
        if self._progress is not None:
            self._progress.update(self.stats.generated_tokens - before)
        return self.rows.seq.shape[0] > 0

    def finish(self) -> GenerationResult:
        if self._progress is not None:
            self._progress.close()
        self.stats.total_seconds = self._now() - self._begin
        if self.history is not None:
            self.stats.history_bytes = self.history.nbytes()
        width = int(self.lengths.max())
        sequences = torch.cat([self.input_ids, self.completions[:, :width]], dim=1)
        return GenerationResult(sequences=sequences, stats=self.stats)

    @torch.no_grad()
    def run(self) -> GenerationResult:
        self.begin()
        while self.step():
            pass
        return self.finish()
