"""One generate() call, as a loop of speculative steps over the active rows.

Each step is :meth:`Rollout.speculative_step`: a proposer drafts (EAGLE chain or tree, rollout history, or their
merge), the policy scores the pending token and every draft in one pass, verification accepts a path and draws
the token after it, the path is committed and finished rows leave the batch. Choosing the strategy, timing and
the selector's feedback wrap the step (:meth:`Rollout.step`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

import torch

from ..modeling.features import capture_features
from ..modeling.kv_cache import RowState, WritePlan
from ..modeling.rows import ActiveRows
from ..proposers.block import BlockProposer
from ..proposers.eagle import DrafterRunner, DraftSampling, EagleChainProposer, EagleTreeProposer
from ..proposers.history import HistoryProposer, MergedProposer
from ..proposers.strategy import NONE, Strategy
from ..sampling.distribution import SamplingParams, process_logits
from ..sampling.tree import DraftTree
from ..sampling.verify import Proposal, Verdict, verify
from .stats import GenerationStats, StepTimer


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # [B, P + T]: prompts as given, completions right-padded with pad_token_id
    stats: GenerationStats


@dataclass
class StepReport:
    """What :meth:`Rollout._settle` read back from the device for one step."""

    emitted: int  # tokens appended over all rows
    counts: list[int]  # the step's statistics, in the order they were passed
    expected_gap: float | None = None  # sum of (first-draft acceptance probability - its 0/1 accept)


@dataclass
class StepOutcome:
    emitted: int  # tokens appended over all rows
    drafted: int  # draft nodes verified over all rows
    accepted: int  # drafts accepted over all rows
    first_accepted: int = 0  # rows whose first draft was accepted
    expected_emitted: float | None = None  # emitted, with the first draft's 0/1 accept replaced by its probability


class Rollout:
    """State and steps of one generate() call: ``begin()`` (prefill), ``step()`` until False, ``finish()``."""

    def __init__(self, engine, input_ids: torch.Tensor, pad: torch.Tensor, params: SamplingParams,
                 max_new_tokens: int, eos: torch.Tensor | None, pad_token_id: int,
                 generator: torch.Generator | None, feature_sink: Callable | None = None,
                 history_keys: list[Hashable] | None = None, feature_layers: tuple[int, ...] | None = None):
        self.engine, self.target, self.config = engine, engine.target, engine.config
        self.params, self.warpers = params, params.warpers()
        self.max_new, self.eos, self.pad_token_id, self.generator = max_new_tokens, eos, pad_token_id, generator
        self.input_ids, self.feature_sink = input_ids, feature_sink
        batch, self.prompt_len = input_ids.shape
        self.device = input_ids.device
        strategies = engine.strategies
        self.fixed = strategies[0] if self.config.speculation == "always" and strategies else NONE
        self.selector = engine.selector(params.do_sample, params.temperature)
        self.capacity = self.prompt_len + max_new_tokens + max([s.scratch_slots for s in strategies], default=0) + 1
        self.completions = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.stats = GenerationStats(prompt_tokens=int((input_ids.shape[1] - pad).sum()))
        self.timer = StepTimer(self.stats, self.device)
        self.use_drafter = engine.drafter is not None and any(s.uses_drafter for s in strategies)
        # Layers the drafter's features come from (None: the final hidden state, which the pass returns anyway)
        if feature_layers is None and engine.drafter is not None and (self.use_drafter or feature_sink is not None):
            feature_layers = engine.drafter.feature_layers
        elif feature_layers is not None and self.use_drafter and feature_layers != engine.drafter.feature_layers:
            raise ValueError(f"feature_layers={feature_layers} differs from the layers the engine's drafter reads "
                             f"({engine.drafter.feature_layers}); leave it unset to feed the sink what the drafter "
                             "reads.")
        self.feature_layers = tuple(feature_layers) if feature_layers is not None else None
        self.graphs = None
        session = engine.graph_session(self, batch, self.capacity, self.feature_layers)
        if session is not None:  # graphs (and the cache they read) kept from earlier calls where shapes fit
            self.capacity, self.graphs = session.capacity, session.runner
        self.rows = self._new_rows(input_ids, pad, params, session.cache if session is not None else None)
        self.proposers, self.drafting, self.history = self._new_proposers(params, history_keys)
        if self.history is not None:  # the history matches on the host: it keeps the rows' tokens there
            prompts, pads = input_ids.tolist(), pad.tolist()
            self.rows.host_tokens = [prompt[p:] for prompt, p in zip(prompts, pads)]
        # Adaptive: history:K arms are valued from each step's matches (which cost no compute).
        self.history_arm_tokens = 0
        if self.selector is not None and self.history is not None:
            self.history_arm_tokens = max((s.history_tokens for s in strategies if s.kind == "history"), default=0)
        self._begin: float | None = None  # set by begin(): the clock of stats.total_seconds
        self._progress = None

    def _new_rows(self, input_ids: torch.Tensor, pad: torch.Tensor, params: SamplingParams,
                  cache=None) -> ActiveRows:
        batch = input_ids.shape[0]
        seq = torch.full((batch, self.capacity), self.pad_token_id, dtype=torch.long, device=self.device)
        seq[:, : self.prompt_len] = input_ids
        presence = None
        if params.uses_presence:
            presence = torch.zeros(batch, self.target.vocab_size, dtype=torch.bool, device=self.device)
            presence.scatter_(1, input_ids, True)
        drafter = self.engine.drafter if self.use_drafter else None
        return ActiveRows(
            index=torch.arange(batch, device=self.device),
            seq=seq,
            state=RowState(pad.clone(), torch.zeros_like(pad)),
            draft_state=RowState(pad.clone(), torch.zeros_like(pad)) if drafter is not None else None,
            generated=torch.zeros(batch, dtype=torch.long, device=self.device),
            presence=presence,
            features=None,
            cache=cache if cache is not None else self.target.new_cache(self.capacity),
            draft_kv=drafter.new_kv(self.capacity) if drafter is not None else None,
        )

    def _new_proposers(self, params: SamplingParams, history_keys) -> tuple[
            dict, DrafterRunner | BlockProposer | None, HistoryProposer | None]:
        """The proposer of each kind this engine's strategies use, keyed by ``Strategy.proposer``."""
        proposers: dict = {}
        drafting = history = None
        if self.use_drafter:
            # The drafter's q may be any distribution we sample from; without the repetition penalty it needs no
            # per-position history, and verification corrects the difference.
            sampling = DraftSampling(replace(params, repetition_penalty=1.0), self.warpers, self.generator)
            if self.engine.drafter.drafts_blocks:
                drafting = proposers["block"] = BlockProposer(self.engine.drafter, sampling, self._now)
            else:
                drafting = DrafterRunner(self.engine.drafter, sampling, self._now)
                proposers["chain"] = EagleChainProposer(drafting)
                proposers["tree"] = EagleTreeProposer(drafting)
        if self.engine.rollout_history is not None:
            history = HistoryProposer(self.engine.rollout_history, history_keys)
            proposers["history"] = history
            if "tree" in proposers:
                proposers["tree+history"] = MergedProposer(proposers["tree"], history)
        return proposers, drafting, history

    def proposer_for(self, strategy: Strategy):
        return self.proposers[strategy.proposer]

    # ------------------------------------------------------------------ one step
    def speculative_step(self, strategy: Strategy) -> StepOutcome:
        """Propose, verify in one policy pass, accept, commit, retire (``strategy`` none: one plain token)."""
        rows, batch = self.rows, self.rows.size
        with self.timer.phase("draft"):
            proposal = self.proposer_for(strategy).propose(rows, strategy) if strategy.proposer else None
        with self.timer.phase("decode" if proposal is None else "verify"):
            proposal = proposal or Proposal.nothing(batch, self.device)
            tree, length = proposal.tree, rows.state.length
            # The policy scores the pending token (the tree's root) and every draft node in one pass.
            tokens = torch.cat([rows.seq.gather(1, length[:, None]), tree.tokens], dim=1)
            slots = length[:, None] + torch.arange(tree.num_nodes + 1, device=self.device)
            depths = torch.cat([torch.zeros_like(slots[:, :1]), tree.depths], dim=1)
            positions = (length - rows.state.pad)[:, None] + depths
            closure = None if proposal.is_chain and rows.presence is None else tree.ancestors()
            # slots.max() + 1 bounded on the host (rows that finished this step may still count in max_length)
            kv_len = min(rows.max_length + tree.num_nodes + 1, self.capacity)
            features, logits = self._policy_pass(tokens, positions, slots, kv_len,
                                                 self._mask_builder(proposal.is_chain, closure, positions, slots))
            scores = process_logits(logits, self.params, self._presence_in_tree(tree, closure), self.warpers)
            verdict = verify(proposal, scores, self.params.do_sample, self.generator)
            self._keep_accepted_path(proposal.is_chain, verdict, features, slots)
            emitted = verdict.emitted(tree)
            count, finished = self._commit(emitted, verdict.num_accepted, length + 1,
                                           advance=verdict.num_accepted + 1)
            accepted = verdict.num_accepted
            counts = [accepted.sum(), (accepted > 0).sum()]
            expected_gap = None
            if verdict.first_acceptance is not None:  # the first draft's accept/reject replaced by its probability
                expected_gap = (verdict.first_acceptance - (accepted > 0).to(verdict.first_acceptance.dtype)).sum()
            report = self._settle(emitted, count, finished, counts, expected_gap)
        emitted, accepted_total, first_accepted = report.emitted, report.counts[0], report.counts[1]
        outcome = StepOutcome(emitted, batch * tree.num_nodes, accepted_total, first_accepted if tree.num_nodes else 0)
        if report.expected_gap is not None:
            outcome.expected_emitted = emitted + report.expected_gap
        return outcome

    def _mask_builder(self, is_chain: bool, closure, positions, slots) -> Callable[[int], torch.Tensor]:
        """``kv_len -> mask`` of the verify pass: causal for a chain, each node's ancestors for a tree."""
        state = self.rows.state
        if is_chain:
            return lambda kv_len: self.target.attention_mask(state, slots, kv_len)
        return lambda kv_len: self.target.tree_attention_mask(state, closure, positions, kv_len)

    def _presence_in_tree(self, tree: DraftTree, closure: torch.Tensor | None) -> torch.Tensor | None:
        """Presence masks [B, 1+N, V] after each node (repetition penalty): history plus the tokens on the path
        to the node. None when the sampling settings do not need them."""
        if self.rows.presence is None:
            return None
        presence = self.rows.presence[:, None].repeat(1, tree.num_nodes + 1, 1)
        b, i, j = closure[:, :, 1:].nonzero(as_tuple=True)
        presence[b, i, tree.tokens[b, j]] = True
        return presence

    def _keep_accepted_path(self, is_chain: bool, verdict: Verdict, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """The accepted path (root first) takes consecutive slots: its keys, values and features.

        A chain's path already does; a tree's accepted nodes move down from wherever they were verified.
        """
        if is_chain:
            self._store_features(hidden, slots)
            return
        length = self.rows.state.length
        steps = torch.arange(verdict.path.shape[1], device=self.device)
        on_path = steps[None] < verdict.num_accepted[:, None]
        dest = length[:, None] + 1 + steps
        self.rows.cache.move(torch.where(on_path, length[:, None] + verdict.path, dest), dest)
        path_nodes = torch.cat([torch.zeros_like(verdict.path[:, :1]), torch.where(on_path, verdict.path, 0)], 1)
        self._store_features(hidden.gather(1, path_nodes[..., None].expand(-1, -1, hidden.shape[-1])),
                             torch.cat([length[:, None], dest], dim=1))

    # ------------------------------------------------------------------ policy passes
    def _now(self) -> float:
        return self.timer.now()

    def _policy_pass(self, tokens, positions, slots, kv_len: int, mask_for) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's features and float32 logits of a decode/verify pass over the first ``kv_len`` cache slots
        (at least ``slots.max() + 1``); ``mask_for(kv_len)`` builds its mask(s).

        Replayed from a CUDA graph (full-capacity masks, padded batch) when the engine has a graph runner; the
        graph outputs the drafter's features too (EAGLE-3's tapped layers included).
        """
        runner = self.graphs
        if runner is not None and runner.supports(tokens.shape[0]):
            mask = mask_for(self.capacity)
            masks = {"full": mask} if isinstance(mask, torch.Tensor) else {
                "full": mask["full_attention"], "sliding": mask["sliding_attention"]}
            return runner(tokens, positions, slots, masks)
        hidden, features = self._target_pass(tokens, positions, slots, kv_len, mask_for)
        return features, self.target.logits(hidden)

    def _target_pass(self, tokens, positions, slots, kv_len: int, mask_for) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states, the drafter's features) of one policy pass: the same tensor unless the drafter
        reads other layers (EAGLE-3), which hooks collect from this very pass."""
        self.rows.cache.plan = WritePlan(slots, kv_len)
        if self.feature_layers is None:
            hidden = self.target.forward(tokens, positions, mask_for(kv_len), self.rows.cache)
            return hidden, hidden
        with capture_features(self.target.decoder, self.feature_layers) as captured:
            hidden = self.target.forward(tokens, positions, mask_for(kv_len), self.rows.cache)
        return hidden, captured[-1][0]

    def _store_features(self, hidden: torch.Tensor, slots: torch.Tensor) -> None:
        if not (self.use_drafter or self.feature_sink is not None):
            return
        rows = self.rows
        if rows.features is None:
            rows.features = hidden.new_zeros(hidden.shape[0], self.capacity, hidden.shape[-1])
        rows.features.scatter_(1, slots[..., None].expand(-1, -1, hidden.shape[-1]), hidden)
        # slots run from a row's length over at most slots.shape[1] places: a bound that needs no read
        rows.features_used = min(max(rows.features_used, rows.max_length + slots.shape[1]), rows.capacity)

    def _record_memory(self) -> None:
        rows = self.rows
        total = rows.cache.nbytes()
        if rows.draft_kv is not None:
            total += rows.draft_kv.nbytes()
        if rows.features is not None:
            total += rows.features.numel() * rows.features.element_size()
        self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, total)

    def _prefill(self) -> None:
        rows = self.rows
        with self.timer.phase("prefill"):
            slots = torch.arange(self.prompt_len, device=self.device).expand(rows.size, -1)
            positions = (slots - rows.state.pad[:, None]).clamp(min=0)
            hidden, features = self._target_pass(self.input_ids, positions, slots, self.prompt_len,
                                                 lambda kv_len: self.target.attention_mask(rows.state, slots, kv_len))
            rows.state.length = torch.full_like(rows.state.length, self.prompt_len)
            self._store_features(features, slots)
            scores = process_logits(self.target.logits(hidden[:, -1]), self.params, rows.presence, self.warpers)
            first = verify(Proposal.nothing(rows.size, self.device), scores[:, None], self.params.do_sample,
                           self.generator).next_token
            count, finished = self._commit(first[:, None], torch.zeros_like(first), rows.state.length,
                                           advance=torch.zeros_like(first))
            self._settle(first[:, None], count, finished)

    # ------------------------------------------------------------------ commit
    def _commit(self, emitted: torch.Tensor, num_accepted: torch.Tensor, first_slot: torch.Tensor,
                advance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``num_accepted + 1`` tokens of ``emitted`` [B, w] per row from ``first_slot``, cut at EOS and
        ``max_new_tokens``; the policy's cache keeps ``advance`` more slots. Returns (tokens appended [B], finished
        [B]) on the device: :meth:`_settle` reads them, with the step's other counts, in one transfer.
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
        return count, finished

    def _settle(self, emitted: torch.Tensor, count: torch.Tensor, finished: torch.Tensor,
                counts: list[torch.Tensor] = (), expected_gap: torch.Tensor | None = None) -> StepReport:
        """The step's one device-to-host read: tokens appended, finished rows, the host's bounds for the next step
        (:class:`~tlt_trainers.modeling.rows.ActiveRows`), ``counts`` (the step's statistics) and, where the host
        keeps the rows' tokens (rollout history), the ``emitted`` [B, w] tokens and their ``count`` [B], as one
        tensor. Then finished rows retire (one more read, on the steps where rows finish)."""
        rows = self.rows
        values = [count.sum(), finished.sum(), rows.state.length.max(), rows.generated.min()]
        if rows.draft_state is not None:
            values.append((rows.state.length - rows.draft_state.length).max())
        values += list(counts)
        packed = torch.stack(values)
        tokens = rows.host_tokens is not None
        if tokens:
            packed = torch.cat([packed, count, emitted.reshape(-1)])
        if expected_gap is not None:
            packed = torch.cat([packed.to(torch.float64), expected_gap.to(torch.float64)[None]])
        host = packed.tolist()
        total, num_finished, rows.max_length, rows.min_generated = (int(v) for v in host[:4])
        rest = host[4:]
        if rows.draft_state is not None:
            rows.max_behind, rest = int(rest[0]), rest[1:]
        report = StepReport(total, [int(v) for v in rest[: len(counts)]],
                            None if expected_gap is None else float(rest[-1]))
        if tokens:
            batch, width = emitted.shape
            appended = [int(v) for v in rest[len(counts) : len(counts) + batch]]
            flat = rest[len(counts) + batch : len(counts) + batch + batch * width]
            for i, n in enumerate(appended):
                rows.host_tokens[i] = rows.host_tokens[i] + [int(v) for v in flat[i * width : i * width + n]]
        self.stats.generated_tokens += total
        if num_finished:
            self._retire(finished)
        return report

    def _retire(self, finished: torch.Tensor) -> None:
        """Finished rows hand their completion to the result, the history and the feature sink, then leave."""
        rows = self.rows
        per_row = torch.stack([finished.to(torch.long), rows.generated, rows.state.pad, rows.index], dim=1)
        host = per_row.tolist()  # this step's one more read: which rows finished, and what the host needs of them
        flags = [bool(values[0]) for values in host]
        start = self.prompt_len
        for i in (i for i, done in enumerate(flags) if done):
            n, pad, row = host[i][1:4]
            self.completions[row, :n] = rows.seq[i, start : start + n]
            self.lengths[row] = n
            if self.history is not None:
                self.history.remember(row, rows.host_tokens[i])  # the prompt and this row's n tokens
            if self.feature_sink is not None:
                # Features exist for every real token but the last (never fed back to the policy).
                # Copies: compaction later moves other rows into this row's buffers.
                self.feature_sink(rows.seq[i, pad : start + n].clone(), rows.features[i, pad : start + n - 1].clone())
        rows.compact(flags)

    # ------------------------------------------------------------------ main loop
    def _choose(self) -> Strategy:
        batch = self.rows.size
        if not self.engine.strategies:
            return NONE
        remaining = self.max_new - self.rows.min_generated  # the host's bound (no read)
        if remaining <= 1:
            return NONE  # the next token is the last one: nothing to draft for
        cap = self.config.max_speculative_batch_size
        if self.config.speculation == "adaptive" and cap is not None and batch > cap:
            return NONE
        if self.selector is None:
            return self.fixed.capped(remaining)
        tokens = self.history_arm_tokens
        expected = (lambda: self.history.expected_accepted(self.rows, tokens)) if tokens else None
        return self.selector.choose(batch, expected).capped(remaining)

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
        batch = self.rows.size
        if batch == 0:
            return False
        if self.history is not None:
            self.history.new_step()
        if self.drafting is not None:
            self.drafting.catch_up_seconds = 0.0
        strategy = self._choose()
        start = self._now()
        outcome = self.speculative_step(strategy)
        seconds = self._now() - start  # the device's time too: the step ends with its one read, which waits for it
        self.timer.flush()
        self.stats.record_step(batch, outcome.emitted, outcome.drafted, outcome.accepted, seconds, strategy.name,
                               first_accepted=outcome.first_accepted)
        if self.selector is not None:
            catch_up = self.drafting.catch_up_seconds if self.drafting is not None else 0.0
            self.selector.observe(strategy, batch, outcome.emitted, seconds, outcome.accepted,
                                  catch_up_seconds=catch_up, expected_emitted=outcome.expected_emitted)
        self._record_memory()
        if self._progress is not None:
            self._progress.update(outcome.emitted)
        return self.rows.size > 0

    def finish(self) -> GenerationResult:
        if self._progress is not None:
            self._progress.close()
        self.timer.flush(wait=True)
        self.stats.total_seconds = self._now() - self._begin
        if self.history is not None:
            self.stats.history_proposed = self.history.proposed_tokens
            self.stats.history_bytes = self.history.nbytes()
        if self.selector is not None:
            self.engine.save_costs()
        width = int(self.lengths.max())
        sequences = torch.cat([self.input_ids, self.completions[:, :width]], dim=1)
        return GenerationResult(sequences=sequences, stats=self.stats)

    @torch.no_grad()
    def run(self) -> GenerationResult:
        self.begin()
        while self.step():
            pass
        return self.finish()
