"""SpeculativeGenerator: batched, lossless speculative decoding over any Hugging Face causal LM.

One step for the active rows (:meth:`Rollout.speculative_step`): a proposer drafts a tree of tokens per row, the
policy scores all of them in one forward pass, each row keeps its own accepted path plus one token drawn by
verification, and both KV caches roll back per row by moving a length. Rows that hit EOS or ``max_new_tokens``
leave the batch at once, so the long tail runs at its true batch size. With ``speculation="never"`` the same
engine decodes one token per step: the baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..config import TLTConfig
from ..modeling.target import TargetModel
from ..proposers.rollout_history import RolloutHistory
from ..sampling.distribution import check_generation_config, resolve_sampling
from .capture import autocast_key
from .cost_cache import cost_key, load_costs, save_costs
from .costs import FIXED_SHARE_RATE, CostProfile, linear_weights, profile_costs
from .graphs import GraphRunner, GraphSession, parameters_key
from .rollout import GenerationResult, Rollout
from .selector import StrategySelector

# Share of an idle budget (a rank or replica that finished its rollout early) that may go to timing the engine's
# passes it has not timed yet (measure_costs, the tail's batch sizes first) before the drafter trains in the rest.
IDLE_COST_TIMING_SHARE = 0.25

SUPPORTED_SETTINGS = (
    "attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, min_p, repetition_penalty, "
    "eos_token_id, pad_token_id, generator"
)


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
        if drafter is None and self.config.speculation != "never" and not self.config.history_drafting:
            raise ValueError(
                f"speculation={self.config.speculation!r} needs a drafter or history proposals: pass "
                "EagleDrafter.from_target(model) (or a trained one), keep TLTConfig(history_drafting=True), or use "
                "TLTConfig(speculation='never') for plain decoding."
            )
        if drafter is not None:
            drafter.ensure_bound(model)
        self.drafter = drafter
        block_size = drafter.block_size if drafter is not None and drafter.drafts_blocks else None
        self.strategies = self.config.speculation_strategies(has_drafter=drafter is not None, block_size=block_size)
        self.rollout_history: RolloutHistory | None = None
        if any(s.history_tokens for s in self.strategies):
            self.rollout_history = RolloutHistory(max_tokens=self.config.history_max_tokens,
                                                  keep_steps=self.config.history_keep_steps)
        self.cost_profile = CostProfile(fixed_share_rate=FIXED_SHARE_RATE.get(self.target.device.type,
                                                                              FIXED_SHARE_RATE["cpu"]))
        if drafter is not None:
            self.cost_profile.drafter_share = linear_weights(drafter) / max(linear_weights(model), 1)
        self._selectors: dict[tuple, StrategySelector] = {}
        self._graph_session: GraphSession | None = None
        self._cost_key: dict | None = None
        self._last_batch, self._last_context = 0, 0  # of the latest adaptive rollout: what idle-time timing covers
        if self.config.speculation == "adaptive" and self.strategies:
            self.load_costs()

    def graph_session(self, rollout, batch: int, capacity: int, feature_layers) -> GraphSession | None:
        """The cache and CUDA-graph runner for a rollout of ``batch`` rows and ``capacity`` slots (None: eager
        passes, ``cuda_graphs`` off or not on CUDA). Kept across calls, so graphs are captured once per shape for
        the engine's life; a new session replaces it when shapes grow, parameters move to other memory or it is in
        use by another rollout of this engine (then that rollout's is private)."""
        mode = GraphRunner.mode_for(self.config.cuda_graphs, self.target.device, self.target, feature_layers)
        if mode is None:
            return None
        # Graphs bake in the caller's autocast (captured without its weight cache): another autocast state is
        # another session
        params = parameters_key(self.model, self.drafter) + (autocast_key(),)
        session = self._graph_session
        if session is not None and session.in_use():
            private = GraphSession(self.target, batch, GraphSession.capacity_for(capacity), mode, feature_layers,
                                   params)
            private.take(rollout, batch)
            return private
        if session is None or not session.fits(batch, capacity, mode, feature_layers, params):
            session = self._graph_session = GraphSession(
                self.target, max(batch, session.max_batch if session is not None else 1),
                GraphSession.capacity_for(capacity), mode, feature_layers, params)
        session.take(rollout, batch)
        return session

    def release_graphs(self) -> None:
        """Free the kept cache and CUDA graphs (their memory), e.g. before a training step that needs it; the next
        call captures again."""
        self._graph_session = None

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
        """Time (once per batch size, three passes) what a step of each strategy costs at batch sizes 1, 2, 4, ...
        up to ``batch_size``. The engine never needs this: it learns costs from the steps it runs. Benchmarks and
        GPU checks call it to start from a timed table."""
        return profile_costs(self.target, self.drafter, self.strategies, self._profile_sizes(batch_size), context,
                             self.cost_profile, min_speedup=self.config.min_speedup)

    def _profile_sizes(self, batch_size: int) -> list[int]:
        sizes = [1 << i for i in range(batch_size.bit_length()) if 1 << i <= batch_size] + [batch_size]
        cap = self.config.max_speculative_batch_size
        return sorted({b for b in sizes if cap is None or b <= cap})

    def measure_costs(self, max_seconds: float, should_stop: Callable[[], bool] | None = None) -> list[int]:
        """Time the strategies' passes at batch sizes 1, 2, 4, ... up to the latest rollout's batch, smallest first
        (the tail, where speculation pays), one pass each, for at most ``max_seconds`` or until ``should_stop()``.
        For time that is idle anyway: a rank that finished its rollout early. Returns the batch sizes timed (the
        table then serves every later step, and the cost cache the next run)."""
        if self.config.speculation != "adaptive" or not self.strategies or self._last_batch < 1 or max_seconds <= 0:
            return []
        deadline = time.perf_counter() + max_seconds
        done = []
        training = self.model.training
        self.model.eval()  # as in a rollout: a model training with gradient checkpointing would skip the KV cache
        try:
            for batch in self._profile_sizes(self._last_batch):
                if batch in self.cost_profile.batch_sizes():
                    continue
                if time.perf_counter() >= deadline or (should_stop is not None and should_stop()):
                    break
                profile_costs(self.target, self.drafter, self.strategies, [batch], self._last_context,
                              self.cost_profile, repeats=1, min_speedup=self.config.min_speedup)
                done.append(batch)
        finally:
            self.model.train(training)
        if done:
            self.save_costs()
        return done

    # ------------------------------------------------------------------ persistent costs
    def _cache_dir(self) -> Path | None:
        setting = self.config.cost_cache
        if setting == "off":
            return None
        return None if setting == "auto" else Path(setting).expanduser()

    def cost_cache_key(self) -> dict:
        """What this engine's step costs depend on (see :mod:`.cost_cache`)."""
        if self._cost_key is None:
            self._cost_key = cost_key(self.model, self.drafter, self.target.device, self.target.dtype,
                                      self.config.cuda_graphs)
        return self._cost_key

    def load_costs(self) -> bool:
        """Start from the costs an earlier run on this machine measured (``TLTConfig.cost_cache``); True if any."""
        if self.config.cost_cache == "off":
            return False
        stored = load_costs(self.cost_cache_key(), self._cache_dir())
        if not stored:
            return False
        self.cost_profile.merge_dict(stored)
        return True

    def save_costs(self) -> Path | None:
        """Store what the engine has measured, for the next run (the adaptive engine does this after each rollout)."""
        if self.config.cost_cache == "off":
            return None
        return save_costs(self.cost_cache_key(), self.cost_profile.to_dict(), self._cache_dir())

    # ------------------------------------------------------------------ public entry
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 256,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        feature_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        history_keys: list | None = None,
        feature_layers: tuple[int, ...] | None = None,
        **unsupported,
    ) -> GenerationResult:
        """Sample completions exactly as ``model.generate`` with the same settings would.

        Sampling settings left unset (None) take the values ``model.generate`` would use: the model's
        ``generation_config``, then transformers' defaults (``do_sample=False``; top-k 50 when sampling). Pass
        ``top_k=0`` for the full softmax. ``max_new_tokens`` defaults to 256 (``generate``'s ``max_length=20``
        counts the prompt).

        ``feature_sink(tokens [L + 1], features [L, F])`` receives each finished row (prompt and completion)
        with the policy's features from the verify passes, e.g. ``DrafterTrainer.add_features``, so the
        drafter trains on fresh rollouts without another policy forward. The features are the ones the engine's
        drafter reads (its ``feature_layers``); ``feature_layers`` sets them where the engine has no drafter or
        the sink trains another one (``drafter.feature_layers``; None with no drafter: final hidden states).

        ``history_keys`` (one hashable per row) groups rows whose rollouts propose drafts for each other;
        by default rows with the same prompt form a group (GRPO's siblings, and the same prompt in later steps).
        """
        return self.start(input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, min_p,
                          repetition_penalty, eos_token_id, pad_token_id, generator, feature_sink, history_keys,
                          feature_layers, **unsupported).run()

    @torch.no_grad()
    def start(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 256,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        feature_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        history_keys: list | None = None,
        feature_layers: tuple[int, ...] | None = None,
        **unsupported,
    ) -> Rollout:
        """:meth:`generate`, to be driven one step at a time: ``rollout.step()`` until it returns False, then
        ``rollout.finish()``. Benchmarks interleave two engines' steps this way, so both see the same machine.

        ``feature_sink(tokens [L + 1], features [L, F])`` receives each finished row (prompt and completion)
        with the policy's features from the verify passes, e.g. ``DrafterTrainer.add_features``, so the
        drafter trains on fresh rollouts without another policy forward. The features are the ones the engine's
        drafter reads (its ``feature_layers``); ``feature_layers`` sets them where the engine has no drafter or
        the sink trains another one (``drafter.feature_layers``; None with no drafter: final hidden states).

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
        generation_config = getattr(self.model, "generation_config", None)
        check_generation_config(generation_config)
        params = resolve_sampling(self.model, do_sample=do_sample, temperature=temperature, top_k=top_k,
                                  top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
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
        if self.rollout_history is not None:
            if history_keys is None:
                history_keys = [tuple(row[p:]) for row, p in zip(input_ids.tolist(), pad.tolist())]
            elif len(history_keys) != input_ids.shape[0]:
                raise ValueError(f"history_keys has {len(history_keys)} entries for {input_ids.shape[0]} rows.")
            keys = list(history_keys)
            self.rollout_history.new_step()
        if self.selector(params.do_sample, params.temperature) is not None:  # costs are learnt from the steps
            self._last_batch, self._last_context = input_ids.shape[0], input_ids.shape[1] + min(max_new_tokens, 128)
        return Rollout(self, input_ids, pad, params, max_new_tokens, _eos_tensor(eos_token_id, input_ids.device),
                       pad_token_id, generator, feature_sink, keys, feature_layers)

    # ------------------------------------------------------------------ memory kept between calls
    def held_bytes(self) -> int:
        """Bytes this engine keeps between calls (its graph session's caches, buffers and graphs' static tensors;
        not the weights): what a training step colocated with the rollout may want back
        (:func:`~tlt_trainers.rollout.memory.give_back`)."""
        from .memory import held_bytes

        return held_bytes(self)
