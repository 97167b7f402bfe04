"""One generate() call, as a loop of speculative steps over the active rows.

Each step is :meth:`Rollout.speculative_step`: a proposer drafts (EAGLE chain or tree, rollout history, or their
merge), the policy scores the pending token and every draft in one pass, verification accepts a path and draws
the token after it, the path is committed and finished rows leave the batch. Choosing the strategy, timing and
the selector's feedback wrap the step (:meth:`Rollout.step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..drafter.registry import kind_of
from ..kernels.fused_verification import fused_verification
from ..modeling.features import capture_features
from ..modeling.kv_cache import RowState, WritePlan
from ..modeling.rows import ActiveRows, kv_span
from ..proposers.eagle import DraftSampling
from ..proposers.history import HistoryProposer, MergedProposer
from ..proposers.strategy import NONE, Strategy
from ..sampling.distribution import SamplingParams, UniformStream, process_logits
from ..sampling.tree import DraftTree
from ..sampling.verify import Proposal, Verdict, verify
from .graphs import graph_bucket
from .stats import GenerationStats, StepTimer


@dataclass
class GenerationResult:
    sequences: torch.LongTensor  # [B, P + T]: prompts as given, completions right-padded with pad_token_id
    stats: GenerationStats
    completion_lengths: torch.LongTensor | None = None  # [B]: tokens each row generated (its EOS included)

    def token_rows(self, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each row's prompt (the tokens ``attention_mask`` keeps; all of them without one) and its completion, on
        the host: the rows a feature sink receives, read from the result. Where pad equals EOS, ``sequences`` alone
        cannot tell a completion's end; ``completion_lengths`` does."""
        if self.completion_lengths is None:
            raise ValueError("This GenerationResult has no completion_lengths: make it with Rollout.finish.")
        sequences, lengths = self.sequences.cpu(), self.completion_lengths.tolist()
        prompt_width = sequences.shape[1] - max(lengths, default=0)  # the completions' width is the longest's
        keep = None if attention_mask is None else attention_mask.bool().cpu()
        rows = []
        for i, n in enumerate(lengths):
            prompt = sequences[i, :prompt_width]
            if keep is not None:
                prompt = prompt[keep[i]]
            rows.append(torch.cat([prompt, sequences[i, prompt_width : prompt_width + n]]))
        return rows


class NonFiniteLogitsError(ValueError):
    """The policy's logits held NaN or inf: no token can be sampled (or chosen greedily) from them."""

    def __init__(self, rows: int, active: int, generated: int):
        super().__init__(
            f"The policy's logits hold NaN or inf in {rows} of {active} active rows (after {generated} generated "
            "tokens): the policy produced them (NaN weights, or activations that overflowed), so no token can be "
            "drawn from them. model.generate stops the same way when it samples ('probability tensor contains either "
            "`inf`, `nan` or element < 0'). Check the checkpoint and the last optimizer step for NaN weights; in "
            "float16 use bfloat16 or float32, whose range the activations fit.")
        self.rows, self.active, self.generated = rows, active, generated


@dataclass
class StepReport:
    """What :meth:`Rollout._read_report` read back from the device for one step."""

    emitted: int  # tokens appended over all rows
    counts: list[int]  # the step's statistics, in the order they were passed
    expected_gap: float | None = None  # sum of (first-draft acceptance probability - its 0/1 accept)


@dataclass
class StepTensors:
    """A step's results on the device, for its one read (:meth:`Rollout._read_report`)."""

    packed: torch.Tensor  # the counts and bounds the host reads (Rollout._pack_report)
    emitted: torch.Tensor  # [B, w] tokens the step emitted per row
    finished: torch.Tensor  # [B] rows that finished
    num_counts: int = 0  # statistics in ``packed``
    has_gap: bool = False  # ``packed`` ends with the first drafts' expected-minus-actual acceptance
    num_nodes: int = 0  # draft nodes verified per row


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
        self._tracing = False  # inside a step traced into a graph (StepGraphs)
        self._abandoned = False  # an exception ended it (see _abandoned_on_error)
        self._one_off = False  # this step ran a traced strategy eagerly (a one-off the selector does not price)
        self.session = session
        self.step_graphs = session.step_graphs if session is not None else None
        # max_new_tokens as the steps' ops read it: a device scalar of the session, which traced steps read instead
        # of baking the value in (so do the warpers: temperature, top-p, min-p), or the plain int
        self.max_new_limit: torch.Tensor | int = max_new_tokens
        if session is not None:
            session.max_new.fill_(max_new_tokens)
            session.sampling.fill(params)
            self.max_new_limit, self.warpers = session.max_new, session.sampling.warpers(params)
        self._step_generator = None
        reserved = session.max_batch if session is not None else batch
        self.rows = self._new_rows(input_ids, pad, params, session.cache if session is not None else None, reserved)
        if session is not None:  # the buffers earlier calls' step graphs address
            self.rows.share_buffers(session.row_buffers)
            k = max((s.history_tokens for s in strategies), default=0)
            kept = session.row_buffers.get("history_drafts")
            if k and (kept is None or kept.shape[1] < k):  # the history steps' drafts enter their graphs here
                session.row_buffers["history_drafts"] = torch.zeros(reserved, k, dtype=torch.long, device=self.device)
            if self.eos is not None:
                self.eos = session.eos.setdefault(tuple(self.eos.tolist()), self.eos)
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
                  cache=None, reserved: int = 0) -> ActiveRows:
        batch = input_ids.shape[0]
        seq = torch.full((batch, self.capacity), self.pad_token_id, dtype=torch.long, device=self.device)
        seq[:, : self.prompt_len] = input_ids
        presence = None
        if params.uses_presence:
            presence = torch.zeros(batch, self.target.vocab_size, dtype=torch.bool, device=self.device)
            presence.scatter_(1, input_ids, True)
        drafter = self.engine.drafter if self.use_drafter else None
        draft_kv = drafter.new_kv(self.capacity) if drafter is not None else None
        if draft_kv is not None:
            draft_kv.reserve_rows = reserved  # padded graph steps write the drafter's keys of dead rows too
            if self.session is not None:  # kept for the step graphs of later calls
                kept = self.session.draft_kv
                if (type(kept) is type(draft_kv) and kept.capacity == draft_kv.capacity
                        and len(getattr(kept, "layers", ())) == len(getattr(draft_kv, "layers", ()))):
                    kept.reset(batch)
                    draft_kv = kept
                self.session.draft_kv = draft_kv
        return ActiveRows(
            reserved=reserved,
            index=torch.arange(batch, device=self.device),
            seq=seq,
            state=RowState(pad.clone(), torch.zeros_like(pad)),
            draft_state=RowState(pad.clone(), torch.zeros_like(pad)) if drafter is not None else None,
            generated=torch.zeros(batch, dtype=torch.long, device=self.device),
            presence=presence,
            features=None,
            cache=cache if cache is not None else self.target.new_cache(self.capacity),
            draft_kv=draft_kv,
        )

    def _new_proposers(self, params: SamplingParams, history_keys) -> tuple[
            dict, Any, HistoryProposer | None]:
        """The proposer of each kind this engine's strategies use, keyed by ``Strategy.proposer`` (the drafter's
        from its kind's factory), the one that keeps the drafter caught up, and the history proposer."""
        proposers: dict = {}
        drafting = history = None
        if self.use_drafter:
            # The drafter's q may be any distribution we sample from; without the repetition penalty it needs no
            # per-position history, and verification corrects the difference.
            sampling = DraftSampling(replace(params, repetition_penalty=1.0), self.warpers, self.generator)
            # The clock marks the catch-up's span on the device (CUDA events), read after the step's one read
            made, drafting = kind_of(self.engine.drafter).proposers(self.engine.drafter, sampling, self.timer.mark)
            proposers.update(made)
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
        """Propose, verify in one policy pass, accept, commit (all on the device, replayed from one CUDA graph where
        the step allows it), then the step's one read and the retirement of finished rows."""
        batch = self.rows.size
        self._one_off = False
        tensors = self._graph_step(strategy) if self.step_graphs is not None else None
        if tensors is None:
            tensors = self._step_tensors(strategy)
        report = self._read_report(tensors)
        emitted, accepted_total, first_accepted = report.emitted, report.counts[0], report.counts[1]
        outcome = StepOutcome(emitted, batch * tensors.num_nodes, accepted_total,
                              first_accepted if tensors.num_nodes else 0)
        if report.expected_gap is not None:
            outcome.expected_emitted = emitted + report.expected_gap
        return outcome

    def _graph_step(self, strategy: Strategy) -> StepTensors | None:
        """The step replayed from a graph of its (batch bucket, strategy), or None where it cannot be (see
        :mod:`.step_graphs`): then it runs eagerly."""
        rows, graphs = self.rows, self.step_graphs
        if rows.presence is not None:
            return None
        if strategy.uses_drafter and not strategy.history_tokens and self.drafting is not None:
            # The drafter's catch-up: the rows' accepted paths (or a block's context) and bonus tokens of the
            # deepest proposal the engine drafts with it (a chain cut short near max_new_tokens follows a longer one)
            drafted = kind_of(self.engine.drafter).strategy_kinds
            width = max(s.depth for s in self.engine.strategies if s.kind in drafted) + 1
            if rows.max_behind > width:
                self._one_off = True  # its seconds price nothing: the strategy's steps are replayed, not this one
                return None  # after plain steps: a one-off wider catch-up, eagerly
        elif strategy.kind in ("none", "history"):
            width = 0
        else:
            return None
        bucket = graph_bucket(rows.size)
        if bucket > rows.reserved:
            return None
        traced, proposal_width, drafts = strategy, 0, None
        if strategy.kind == "history":  # matched on the host; the drafts enter the graph through a static buffer
            drafts = self._history_drafts(strategy, bucket)
            if drafts is None:
                traced = NONE  # no row has a match: a plain step
            else:
                proposal_width = drafts.shape[1]
        # Every pass of the step attends over one KV span, from the host's bound on the rows' lengths and the most
        # slots past them that any pass of the step writes: the catch-up, the drafts, the verified nodes
        extra = max(width, traced.scratch_slots + 1, traced.depth + 1, proposal_width + 1)
        span = kv_span(rows.max_length + extra, rows.capacity)
        view = rows.padded(bucket)
        view.static_span = span
        stream = self._uniform_stream(bucket)
        sampling = getattr(self.drafting, "sampling", None)

        def body() -> StepTensors:
            saved = self.rows, self.generator
            view.max_behind = width  # what the traced catch-up spans (a run sets it to 0: the body may run twice)
            self.rows, self.generator, self._tracing = view, stream, True
            if sampling is not None:
                sampling.generator = stream
            try:
                return self._step_tensors(traced, None if drafts is None else Proposal.chain(drafts))
            finally:
                self.rows, self.generator, self._tracing = saved[0], saved[1], False
                if sampling is not None:
                    sampling.generator = saved[1]

        # Everything the traced step bakes in besides addresses: its shapes and which ops sample (values such as
        # max_new_tokens and the temperature are read from the session's device scalars)
        key = (bucket, span, traced.name, width, proposal_width, self.params.structure(),
               self.feature_sink is not None, rows.host_tokens is not None,
               None if self.eos is None else self.eos.data_ptr())
        if self.use_drafter:
            self.engine.drafter.refresh_caches()  # what the graph reads by address, refilled outside it
        result = graphs.run(key, body, rows.snapshot,
                            lambda t: [t.packed, t.emitted, t.finished],
                            lambda reset_only=False: stream.refill(self._uniform_generator(),
                                                                   reset_only or not self.params.do_sample))
        rows.features_used = max(rows.features_used, span)  # every slot a traced step writes is below its span
        return result

    def _history_drafts(self, strategy: Strategy, bucket: int) -> torch.Tensor | None:
        """This step's history proposals [bucket, w] in the session's static buffer (w: the longest match rounded
        up to a power of two, so that a few graphs serve every step; shorter matches repeat their last token, which
        the verifier follows only where the policy draws it), or None where no row has a match."""
        k = strategy.history_tokens
        matches, _ = self.history.matches(self.rows, k)  # this step's matches (cached): the longest sets the width
        longest = max((min(len(m.tokens), k) for m in matches), default=0)
        if longest == 0:
            return None
        width = min(k, 1 << (longest - 1).bit_length())
        chains = self.history.chain_lists(self.rows, k, pad_to=width)
        host = torch.tensor(chains, dtype=torch.long)
        if self.device.type == "cuda":  # one asynchronous copy from page-locked memory, ordered before the replay
            host = host.pin_memory()
        buffer = self.session.row_buffers["history_drafts"]
        buffer[: len(chains), :width].copy_(host, non_blocking=True)
        return buffer[:bucket, :width]

    def _uniform_stream(self, bucket: int) -> UniformStream:
        """The static buffer of a graph step's uniforms at this bucket: enough for any traced strategy's step."""
        streams = self.session.streams
        if bucket not in streams:
            if "all" not in streams:  # one buffer for every bucket: a smaller one reads its first rows
                # a chain: its draws, acceptance tests and residual draw; a tree or history: a draw per level and
                # the last
                columns = max([2 * s.depth + 1 if s.kind in ("chain", "block") else
                               max(s.depth, s.history_tokens) + 1 for s in self.engine.strategies], default=1)
                streams["all"] = UniformStream(self.rows.reserved, columns, self.device)
            streams[bucket] = streams["all"].first_rows(bucket)
        return streams[bucket]

    def _uniform_generator(self) -> torch.Generator | None:
        """Where a graph step's uniforms come from: the caller's generator when it lives on the rows' device (or
        None: the device's default), else one on the device seeded once from it (one launch fills a step's
        buffer; a host generator would need a copy per step)."""
        generator = self.generator
        if generator is None or generator.device == self.device:
            return generator
        if self._step_generator is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            self._step_generator = torch.Generator(device=self.device).manual_seed(seed)
        return self._step_generator

    def _phase(self, name: str):
        """The timer's phase, or nothing inside a step traced into a graph (the step is timed as a whole)."""
        return contextlib.nullcontext() if self._tracing else self.timer.phase(name)

    def _step_tensors(self, strategy: Strategy, proposal: Proposal | None = None) -> StepTensors:
        """One step on the device, reading nothing back: what :meth:`_read_report` reads. ``proposal``: drafts made
        before the step (rollout history's, traced steps)."""
        rows, batch = self.rows, self.rows.size
        with self._phase("draft"):
            if proposal is None and strategy.proposer:
                proposal = self.proposer_for(strategy).propose(rows, strategy)
        with self._phase("decode" if proposal is None else "verify"):
            proposal = proposal or Proposal.nothing(batch, self.device)
            tree, length = proposal.tree, rows.state.length
            # The policy scores the pending token (the tree's root) and every draft node in one pass.
            tokens = torch.cat([rows.seq.gather(1, length[:, None]), tree.tokens], dim=1)
            slots = length[:, None] + torch.arange(tree.num_nodes + 1, device=self.device)
            depths = torch.cat([torch.zeros_like(slots[:, :1]), tree.depths], dim=1)
            positions = (length - rows.state.pad)[:, None] + depths
            closure = None if proposal.is_chain and rows.presence is None else tree.ancestors()
            # slots.max() + 1 bounded on the host (rows that finished this step may still count in max_length)
            kv_len = rows.kv_bound(tree.num_nodes + 1)
            features, logits = self._policy_pass(tokens, positions, slots, kv_len,
                                                 self._mask_builder(proposal.is_chain, closure, positions, slots))
            nonfinite = self._nonfinite_rows(logits)
            scores = process_logits(logits, self.params, self._presence_in_tree(tree, closure), self.warpers)
            verdict = verify(proposal, scores, self.params.do_sample, self.generator,
                             fused_verification(scores.device))
            self._keep_accepted_path(proposal.is_chain, verdict, features, slots)
            emitted = verdict.emitted(tree)
            count, finished = self._commit(emitted, verdict.num_accepted, length + 1,
                                           advance=verdict.num_accepted + 1)
            accepted = torch.where(rows.live, verdict.num_accepted, 0)
            counts = [accepted.sum(), (accepted > 0).sum()]
            expected_gap = None
            if verdict.first_acceptance is not None:  # the first draft's accept/reject replaced by its probability
                gap = verdict.first_acceptance - (accepted > 0).to(verdict.first_acceptance.dtype)
                expected_gap = torch.where(rows.live, gap, 0).sum()
            return self._pack_report(emitted, count, finished, counts, expected_gap, tree.num_nodes, nonfinite)

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

        Replayed from a CUDA graph (masks over a KV span of at least ``kv_len``, padded batch) when the engine has a
        graph runner; the graph outputs the drafter's features too (EAGLE-3's tapped layers included).
        """
        runner = self.graphs
        if runner is not None and not self._tracing and runner.supports(tokens.shape[0]):
            mask = mask_for(kv_span(kv_len, self.capacity))
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
            rows.features = hidden.new_zeros(rows.reserved, self.capacity, hidden.shape[-1])
            if self.session is not None:
                self.session.row_buffers["features"] = rows._full["features"]
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
            rows.state.length.fill_(self.prompt_len)
            self._store_features(features, slots)
            logits = self.target.logits(hidden[:, -1])
            nonfinite = self._nonfinite_rows(logits[:, None])
            scores = process_logits(logits, self.params, rows.presence, self.warpers)
            first = verify(Proposal.nothing(rows.size, self.device), scores[:, None], self.params.do_sample,
                           self.generator).next_token
            count, finished = self._commit(first[:, None], torch.zeros_like(first), rows.state.length,
                                           advance=torch.zeros_like(first))
            self._read_report(self._pack_report(first[:, None], count, finished, nonfinite=nonfinite))

    # ------------------------------------------------------------------ commit
    def _commit(self, emitted: torch.Tensor, num_accepted: torch.Tensor, first_slot: torch.Tensor,
                advance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``num_accepted + 1`` tokens of ``emitted`` [B, w] per row from ``first_slot``, cut at EOS and
        ``max_new_tokens``; the policy's cache keeps ``advance`` more slots. Dead rows (past the live ones, in a
        padded graph step) keep nothing. Returns (tokens appended [B], finished [B]) on the device: the step's one
        read (:meth:`_read_report`) takes them with its other counts.
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
        remaining = self.max_new_limit - rows.generated
        count = torch.where(rows.live, torch.minimum(count, remaining), 0)
        advance = torch.where(rows.live, advance, 0)
        hit_eos = has_eos
        if self.eos is not None:  # the row ends on EOS only if the cut by max_new_tokens kept it
            hit_eos = torch.isin(emitted.gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1), self.eos)
        keep_token = offsets[None] < count[:, None]
        dest = first_slot[:, None] + offsets[None]
        old = rows.seq.gather(1, dest)
        rows.seq.scatter_(1, dest, torch.where(keep_token, emitted, old))
        if rows.presence is not None:
            marks = torch.where(keep_token, emitted, emitted[:, :1])
            rows.presence.scatter_(1, marks, True)
        rows.generated.add_(count)
        rows.state.length.add_(advance)
        finished = (hit_eos | (rows.generated >= self.max_new_limit)) & rows.live
        return count, finished

    def _pack_report(self, emitted: torch.Tensor, count: torch.Tensor, finished: torch.Tensor,
                     counts: list[torch.Tensor] = (), expected_gap: torch.Tensor | None = None,
                     num_nodes: int = 0, nonfinite: torch.Tensor | None = None) -> StepTensors:
        """What the host needs of a step, as one tensor: tokens appended, finished rows, the host's bounds for the
        next step (:class:`~tlt_trainers.modeling.rows.ActiveRows`, over live rows), ``counts`` (the step's
        statistics) and, where the host keeps the rows' tokens (rollout history), the ``emitted`` [B, w] tokens
        and their ``count`` [B]. ``nonfinite``: live rows whose policy logits held NaN or inf this step."""
        rows = self.rows
        live = rows.live
        values = [count.sum(), finished.sum(), torch.where(live, rows.state.length, 0).max(),
                  torch.where(live, rows.generated, self.max_new_limit).min(),
                  count.new_zeros(()) if nonfinite is None else nonfinite]
        if rows.draft_state is not None:
            values.append(torch.where(live, rows.state.length - rows.draft_state.length, 0).max())
        values += list(counts)
        packed = torch.stack(values)
        if rows.host_tokens is not None:
            packed = torch.cat([packed, count, emitted.reshape(-1)])
        if expected_gap is not None:
            packed = torch.cat([packed.to(torch.float64), expected_gap.to(torch.float64)[None]])
        return StepTensors(packed, emitted, finished, len(counts), expected_gap is not None, num_nodes)

    def _nonfinite_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Live rows whose [B, n, vocab] policy logits hold NaN or inf (on the device, read with the step's report)."""
        bad = (~torch.isfinite(logits)).flatten(1).any(dim=1)
        return (bad & self.rows.live[: bad.shape[0]]).sum()

    def _read_report(self, step: StepTensors) -> StepReport:
        """The step's one device-to-host read (:meth:`_pack_report`), the host's bookkeeping from it, then the
        retirement of finished rows (one more read, on the steps where rows finish)."""
        rows = self.rows
        host = step.packed.tolist()
        total, num_finished, rows.max_length, rows.min_generated, nonfinite = (int(v) for v in host[:5])
        if nonfinite:
            raise NonFiniteLogitsError(nonfinite, rows.size, self.stats.generated_tokens)
        rest = host[5:]
        if rows.draft_state is not None:
            rows.max_behind, rest = int(rest[0]), rest[1:]
        report = StepReport(total, [int(v) for v in rest[: step.num_counts]],
                            float(rest[-1]) if step.has_gap else None)
        if rows.host_tokens is not None:
            batch, width = step.emitted.shape  # a padded step's batch: live rows come first
            appended = rest[step.num_counts : step.num_counts + batch]
            flat = rest[step.num_counts + batch : step.num_counts + batch + batch * width]
            for i in range(rows.size):
                n = int(appended[i])
                rows.host_tokens[i].extend(int(v) for v in flat[i * width : i * width + n])
        self.stats.generated_tokens += total
        if num_finished:
            self._retire(step.finished[: rows.size])
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
        with self._abandoned_on_error():
            self._prefill()
        self._record_memory()

    @contextlib.contextmanager
    def _abandoned_on_error(self):
        """An exception (an interrupt, a fault) inside the prefill or a step ends this rollout: it lets go of the
        engine's kept graph session at once. Its traceback may outlive it (an interactive session keeps the last
        one), and a session held by a rollout that never finishes would send every later call of the engine to a
        private session of its own (a second cache, graphs captured again)."""
        try:
            yield
        except BaseException:
            self._abandoned = True
            if self.session is not None:
                self.session.release(self)
            if self._progress is not None:
                self._progress.close()
            raise

    @torch.no_grad()
    def step(self) -> bool:
        """One decode step of the active rows (after :meth:`begin`); False once every row has finished."""
        if self._begin is None:
            raise RuntimeError("Call rollout.begin() (the prefill) before rollout.step().")
        if self._abandoned:
            raise RuntimeError("This rollout was stopped by an exception in an earlier step; start a new one "
                               "(engine.start or engine.generate).")
        with self._abandoned_on_error():
            return self._step()

    def _step(self) -> bool:
        batch = self.rows.size
        if batch == 0:
            return False
        if self.history is not None:
            self.history.new_step()
        if self.drafting is not None:
            self.drafting.catch_up_span = None
        strategy = self._choose()
        captures = self._captures()
        start = self._now()
        outcome = self.speculative_step(strategy)
        seconds = self._now() - start  # the device's time too: the step ends with its one read, which waits for it
        self.timer.flush()
        self.stats.record_step(batch, outcome.emitted, outcome.drafted, outcome.accepted, seconds, strategy.name,
                               first_accepted=outcome.first_accepted)
        if self.selector is not None:
            span = getattr(self.drafting, "catch_up_span", None)
            catch_up = self.timer.seconds_between(*span) if span is not None else 0.0
            # A step that tried to capture a graph (whether or not it succeeded) took the capture's time too, and a
            # traced strategy's step run eagerly (the wide catch-up after plain steps) is not what its replays cost:
            # one-offs, whose seconds price nothing
            self.selector.observe(strategy, batch, outcome.emitted, seconds, outcome.accepted,
                                  catch_up_seconds=catch_up, expected_emitted=outcome.expected_emitted,
                                  costed=self._captures() == captures and not self._one_off)
        self._record_memory()
        if self._progress is not None:
            self._progress.update(outcome.emitted)
        return self.rows.size > 0

    def _captures(self) -> int:
        """CUDA-graph captures tried so far by this rollout's runners, failed ones included (0 without graphs, and
        in static mode)."""
        return sum(r.capture_attempts for r in (self.graphs, self.step_graphs) if r is not None)

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
        return GenerationResult(sequences=sequences, stats=self.stats, completion_lengths=self.lengths.clone())

    @torch.no_grad()
    def run(self) -> GenerationResult:
        self.begin()
        while self.step():
            pass
        return self.finish()
