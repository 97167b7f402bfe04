"""TLTGRPOTrainer: TRL's GRPOTrainer with lossless speculative rollouts and a drafter trained in idle time.

Change one import::

    from tlt_trainers import TLTGRPOTrainer as GRPOTrainer

and the script runs as before: same datasets, rewards, PEFT, logging and checkpoints, and the completions
are drawn from exactly the distribution ``model.generate`` would use. What changes is inside TRL's
``_generate_single_turn``: the completions come from :class:`SpeculativeGenerator`, whose verify passes
also hand the policy's hidden states to a :class:`DrafterTrainer` (an EAGLE-3 drafter's rollouts go through one
no-grad policy forward instead, which also gives the policy's next-token law it learns: ``drafter_targets``). After
each rollout the drafter trains:
in a multi-process run while a rank waits for slower ranks (then all ranks take the same drafter), in a
single process for a short time budget.

With ``use_vllm=True, vllm_mode="colocate"`` TRL's own vLLM engine generates, with the drafter served inside it as
vLLM's EAGLE speculator (:mod:`tlt_trainers.trl.vllm_colocate`). The drafter then trains on the policy's hidden
states from the forward TRL runs anyway over every completion (the no-grad pass that computes the old log-probs for
vLLM's importance-sampling correction), and each update is pushed into the running engine. In a single process it
trains right after that pass, on the rollout just made; with several ranks a rank trains while it waits for slower
ranks' vLLM generation, on the features of earlier rollouts (this rollout's do not exist yet), and every rank's
engine then loads the same drafter before the next rollout.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import GenerationConfig
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from .. import metric_names as metric
from ..drafter.base import Drafter
from ..drafter.trainer import TRAINER_STATE, learns_law_by_forward
from ..kinds.setup import rollout_drafter
from ..modeling.features import capture_features
from ..online import (
    IDLE,
    POST_ROLLOUT,
    MergeRule,
    PaybackBudget,
    SliceReport,
    after_rollout_budget,
    finish_update,
    train_slice,
    update_metrics,
    waited_seconds,
)
from ..rollout.generator import IDLE_COST_TIMING_SHARE, SpeculativeGenerator
from ..rollout.memory import Release, give_back
from ..rollout.stats import RolloutCounters
from ..sampling.distribution import effective_generation_config
from .config import TLTGRPOConfig, resolve_tlt_settings
from .stock_generation import generation_settings, replaced_generate, stock_generation_reason
from .sync import COLUMN, ROLLOUT_FIELDS, RankDrafterTransport, RankGroup

logger = logging.get_logger(__name__)

DRAFTER_DIR = "drafter"
VLLM_DRAFTER_DIR = "tlt_vllm_drafter"  # under output_dir: the drafter's export that TRL's vLLM engine loads
PAYBACK_STATE = "payback.json"  # in the drafter checkpoint: the payback budget's credit (online/payback.py)
RNG_STATE_NAME = "tlt_rng_state_{}.pth"

_CONTINUOUS_BATCHING_REASON = (
    "use_transformers_continuous_batching=True: transformers' generate_batch generates (TLT's engine, which also "
    "drops finished rows from the batch, needs use_transformers_continuous_batching=False)"
)
_VLLM_SERVER_CPU_ERROR = (
    "vllm_mode='server' needs CUDA: TRL sends the policy's weights to `trl vllm-serve` over NCCL "
    "(trl/generation/vllm_client.py, init_communicator), and the stock GRPOTrainer stops there too on a CPU. On CPUs "
    "use vllm_mode='colocate' (TRL's engine inside the trainer's process, where TLT serves and refreshes the "
    "drafter), or use_vllm=False for TLT's own speculative engine."
)


def refuse_zero3(accelerator_state) -> None:
    """DeepSpeed ZeRO-3 partitions the policy's LM head outside generation, where the drafter reads it."""
    plugin = getattr(accelerator_state, "deepspeed_plugin", None)
    if plugin is not None and getattr(plugin, "zero_stage", None) == 3:
        raise ValueError("DeepSpeed ZeRO-3 is not supported by TLTGRPOTrainer yet (the drafter reads the policy's "
                         "LM head outside generation, where ZeRO-3 keeps it partitioned); use ZeRO-2, FSDP or DDP.")


def _policy_of(unwrapped):
    """The transformers model that generate() runs: the base model (LoRA layers live) for a PEFT model."""
    get_base = getattr(unwrapped, "get_base_model", None)
    return get_base() if callable(get_base) else unwrapped


def _rollout_engine(trainer) -> str:
    """What generates (see ``drafter_class``): TLT's engine, TRL's colocated vLLM engine (EAGLE-1 or EAGLE-3), or a
    ``trl vllm-serve`` server (EAGLE-1)."""
    if not getattr(trainer, "use_vllm", False):
        return "tlt"
    return "vllm-eagle1" if getattr(trainer.args, "vllm_mode", "colocate") == "server" else "vllm"


def _vllm_sampling_config(trainer) -> GenerationConfig:
    """With vLLM, TRL builds no GenerationConfig; the drafter's warm-up samples with the same settings it gives
    vLLM (what TRL would have given ``generate``)."""
    return GenerationConfig(max_new_tokens=trainer.max_completion_length, do_sample=True,
                            pad_token_id=trainer._tokenizer.pad_token_id, eos_token_id=trainer.eos_token_ids,
                            temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k,
                            min_p=trainer.min_p, repetition_penalty=trainer.repetition_penalty)


def _tlt_vllm_engine():
    from .vllm_colocate import tlt_vllm_generation

    return tlt_vllm_generation()


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


class TLTGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose rollouts use TLT's speculative engine and whose drafter keeps up with the policy.

    Takes exactly GRPOTrainer's arguments. ``args`` may be a plain ``GRPOConfig`` (TLT defaults) or a
    :class:`TLTGRPOConfig`. ``drafter`` (keyword only): a drafter (``EagleDrafter`` or ``Eagle3Drafter``) to start
    from, instead of ``args.drafter_name_or_path``, the drafter shipped for the policy, or a fresh one.
    ``vllm_engine_kwargs`` (keyword only, ``use_vllm=True, vllm_mode="colocate"``): extra ``vllm.LLM`` arguments for
    TRL's colocated engine, e.g. ``{"dtype": "float32"}``: TRL passes no dtype, and vLLM's ``"auto"`` runs a float32
    checkpoint in bfloat16, so a policy trained in float32 is sampled by a bfloat16 copy of itself
    (docs/importance_ratio.md; ``tlt/rollout_*`` metrics below).

    With vLLM, every rollout logs how closely vLLM's log-probabilities of the sampled tokens match the trained
    policy's (TRL's no-grad pass right after the rollout, same weights, on the completion tokens TRL scores):
    ``tlt/rollout_logp_diff_mean`` and ``tlt/rollout_logp_diff_max`` (absolute difference per token, over all
    ranks), ``tlt/rollout_seq_logp_diff_max`` (largest absolute sum over one completion: the log of the ratio TRL's
    default ``vllm_importance_sampling_mode="sequence_mask"`` applies), ``tlt/rollout_is_outside_clip_fraction``
    (share of completions, or of tokens in TRL's ``token_*`` modes, whose ratio fell outside
    ``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]``: masked or clipped by TRL) and, in
    colocate mode, ``tlt/rollout_dtype_matches_policy`` (1: vLLM computes in the policy's dtype).

    Where TLT's engine cannot reproduce what stock generation would do (see :mod:`tlt_trainers.trl.stock_generation`:
    a replaced ``generate``, beam search, hybrid models, ...), those rollouts are generated by GRPOTrainer's own code,
    the reason is logged once, and the drafter learns from them through one no-grad forward.

    Callbacks with a method ``on_drafter_update(args, state, control, **kwargs)`` are called after every drafter
    update with ``drafter``, ``trigger`` (``"idle"``: this rank trained while waiting for slower ranks;
    ``"post_rollout"``: it had nobody to wait for), ``rank`` and ``metrics`` (steps, loss, seconds, ...).
    """

    _tag_names = ["trl", "grpo", "tlt"]

    def __init__(self, model, reward_funcs=None, args=None, *positional, drafter: Drafter | None = None,
                 vllm_engine_kwargs: dict | None = None, **kwargs):
        if args is not None:
            _check_args(args)
        self._tlt_vllm_engine_kwargs = dict(vllm_engine_kwargs or {})
        if self._tlt_vllm_engine_kwargs and not (getattr(args, "use_vllm", False)
                                                 and getattr(args, "vllm_mode", "colocate") == "colocate"):
            raise ValueError("vllm_engine_kwargs are vllm.LLM arguments for TRL's colocated engine: they need "
                             "use_vllm=True, vllm_mode='colocate' (a `trl vllm-serve` server takes its own, e.g. "
                             "--dtype float32).")
        with _tlt_vllm_engine() if getattr(args, "use_vllm", False) else contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._tlt_setup(drafter)
        if self.use_vllm:
            self._tlt_start_vllm()

    # ------------------------------------------------------------------ setup
    def _tlt_setup(self, drafter: Drafter | None) -> None:
        args = self.args
        _check_args(args)
        self.tlt_settings = resolve_tlt_settings(args)
        self._tlt_config = self.tlt_settings.tlt_config()
        self._tlt_ranks = RankGroup()
        self._tlt_generator = torch.Generator().manual_seed(int(args.seed) + self.accelerator.process_index)
        self._tlt_engine: SpeculativeGenerator | None = None
        self._tlt_memory_release: Release | None = None  # the last rollout's (see _tlt_give_back_memory)
        self._tlt_pending = False
        self._tlt_in_tool_loop = False
        self._tlt_rollout_start = time.perf_counter()
        self._tlt_counters = RolloutCounters()
        self._tlt_warned: set[str] = set()
        self._tlt_stock_reason = None
        self._tlt_vllm_sync = None  # set by _tlt_start_vllm: the drafter served in TRL's vLLM engine
        self._tlt_vllm_scheduler = None  # the colocated engine's adaptive scheduler (speculation="adaptive")
        self._tlt_vllm_serves_drafter = False  # whether vLLM drafts with it (on every rank, in server mode too)
        self._tlt_saved_seconds = math.nan  # what speculation saved in this rollout (NaN: not measured)
        self._tlt_payback = PaybackBudget(self.tlt_settings.drafter_payback_share,
                                          self.tlt_settings.drafter_explore_share)
        if getattr(self, "_is_vlm", False):
            self._tlt_stock_reason = "vision-language models keep TRL's generation (speculation off)"
        if getattr(self, "rollout_func", None) is not None:
            logger.warning("TLTGRPOTrainer: a rollout_func replaces TRL's generation, so TLT's speculative engine "
                           "is not used; drafter updates only train on what the engine generates.")

        refuse_zero3(self.accelerator.state)
        policy = _policy_of(self.accelerator.unwrap_model(self.model))
        config = self.generation_config if not self.use_vllm else _vllm_sampling_config(self)
        config = effective_generation_config(config, policy)
        if self._tlt_stock_reason is None and not self.use_vllm:
            batching = getattr(self, "use_transformers_continuous_batching", False)
            self._tlt_stock_reason = (_CONTINUOUS_BATCHING_REASON if batching
                                      else stock_generation_reason(policy, config))
        # With stock generation for every rollout, the drafter's warm-up still samples with TLT's engine where the
        # model allows it (settings it cannot reproduce: plain sampling at TRL's temperature).
        try:
            self._tlt_sampling = generation_settings(config)
        except ValueError as err:
            self._tlt_sampling = generation_settings(_vllm_sampling_config(self))
            logger.warning(f"TLTGRPOTrainer: the generation settings are not ones TLT's engine reproduces ({err}); "
                           "the drafter's warm-up and training samples use TRL's plain sampling settings instead "
                           f"(temperature={self._tlt_sampling['temperature']}, top_k={self._tlt_sampling['top_k']}, "
                           f"top_p={self._tlt_sampling['top_p']}). Rollouts are unaffected.")
        self._tlt_max_new_tokens = config.max_new_tokens
        self._tlt_max_length = config.max_length

        self.drafter, self.drafter_trainer = None, None
        self._tlt_draft_vocab_ready, self._tlt_learns_law = True, False
        if self._tlt_config.speculation == "never":
            return
        # The same fresh drafter on every rank; it drafts over the most frequent tokens of the first rollouts.
        self.drafter, self.drafter_trainer, self._tlt_draft_vocab_ready = rollout_drafter(
            policy, self.tlt_settings, int(args.seed), self.accelerator.process_index, drafter,
            engine=_rollout_engine(self))
        # What the drafter learns from the engine's rollouts: the policy's law needs one forward over them (the
        # engine's sink hands features and the sampled tokens only)
        self._tlt_learns_law = learns_law_by_forward(self.drafter, self.tlt_settings.drafter_targets)

    @property
    def _tlt_trains_at_generation_end(self) -> bool:
        """Whether the drafter update runs as soon as this rank's generation ends (before TRL's gathers, so a fast
        rank trains while slower ranks generate); otherwise after the old-logps pass, on the features of the rollout
        just generated, for a budget. The latter with vLLM wherever no rank can finish before another: one process,
        server mode (the main process generates for all ranks), or one tensor-parallel group spanning all ranks."""
        if not self.use_vllm:
            return True
        return (self._tlt_ranks.distributed and self.vllm_mode == "colocate"
                and self.vllm_tensor_parallel_size < self._tlt_ranks.world)

    def _tlt_warn_once(self, key: str, message: str) -> None:
        if key not in self._tlt_warned:
            self._tlt_warned.add(key)
            logger.warning(message)

    # ------------------------------------------------------------------ generation
    @contextlib.contextmanager
    def _tlt_unwrapped(self):
        """The policy as TRL's generate path sees it: unwrapped, gradient checkpointing off, full parameters."""
        accepted = inspect.signature(unwrap_model_for_generation).parameters
        kwargs = {"gather_deepspeed3_params": self.args.ds3_gather_for_generation}
        if "generation_kwargs" in accepted:
            kwargs["generation_kwargs"] = getattr(self, "generation_kwargs", None)
        if "gradient_checkpointing_kwargs" in accepted:
            kwargs["gradient_checkpointing_kwargs"] = self.args.gradient_checkpointing_kwargs
        with contextlib.ExitStack() as stack:
            unwrapped = stack.enter_context(unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                                                        **kwargs))
            stack.enter_context(torch.no_grad())
            backend = getattr(self, "_dist", None)
            if backend is not None and hasattr(backend, "summon_full_params"):
                stack.enter_context(backend.summon_full_params(self.model_wrapped, recurse=False))
            yield unwrapped

    def _tlt_autocast(self, policy):
        # accelerate wraps the prepared model's forward in autocast under mixed precision; generate() runs that
        # forward, so the engine (which calls decoder and head directly) runs under the same autocast.
        if "_original_forward" in vars(policy):
            return self.accelerator.autocast()
        return contextlib.nullcontext()

    def _tlt_generate(self, prompt_ids) -> list[list[int]]:
        device = self.accelerator.device
        prompt_tensors = [torch.tensor(ids) for ids in prompt_ids]
        multiple = getattr(self, "pad_to_multiple_of", None)
        extra = {"pad_to_multiple_of": multiple} if multiple else {}
        input_ids = pad(prompt_tensors, padding_value=self._tokenizer.pad_token_id, padding_side="left", **extra)
        attention_mask = pad([torch.ones_like(t) for t in prompt_tensors], padding_value=0, padding_side="left",
                             **extra)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        prompt_length = input_ids.shape[1]
        max_new_tokens = self._tlt_max_new_tokens
        if max_new_tokens is None:  # generate(): max_length counts the prompt
            max_new_tokens = max(1, (self._tlt_max_length or 20) - prompt_length)
        sink = None
        if self.model.training and self.drafter_trainer is not None and not self._tlt_learns_law:
            sink = self.drafter_trainer.add_features
        with self._tlt_unwrapped() as unwrapped:
            policy = _policy_of(unwrapped)
            with self._tlt_autocast(policy):
                if self._tlt_engine is None or self._tlt_engine.model is not policy:
                    self._tlt_engine = SpeculativeGenerator(policy, self.drafter, self._tlt_config)
                result = self._tlt_engine.generate(input_ids, attention_mask=attention_mask,
                                                   max_new_tokens=int(max_new_tokens), generator=self._tlt_generator,
                                                   feature_sink=sink, **self._tlt_sampling)
        self._tlt_counters.add(result.stats)
        completion_ids = result.sequences[:, prompt_length:]
        # Exactly TRL's post-processing of generate()'s output: keep up to and including the first EOS.
        eos_token_ids = getattr(self, "eos_token_ids", None) or [self._tokenizer.eos_token_id]
        is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=completion_ids.device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1), device=completion_ids.device).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
        completions = [c[m].tolist() for c, m in zip(completion_ids.cpu(), completion_mask.bool().cpu())]
        if self._tlt_learns_law:
            self._tlt_learn_from(prompt_ids, completions)
        return completions

    def _generate_single_turn(self, prompt_ids, images=None, multimodal_fields=None, *args, **kwargs):
        if self.use_vllm:
            return self._tlt_generate_with_vllm(prompt_ids, images, multimodal_fields, *args, **kwargs)
        try:
            bound = inspect.signature(super()._generate_single_turn).bind_partial(
                prompt_ids, images, multimodal_fields, *args, **kwargs).arguments
        except TypeError:
            bound = kwargs
        has_tool_images = bool(bound.get("has_tool_images", False))
        reason = self._tlt_stock_reason
        if reason is None and (images is not None or multimodal_fields or has_tool_images):
            reason = "image inputs go through TRL's generate (speculation off for these batches)"
        if reason is None:
            reason = replaced_generate(self.accelerator.unwrap_model(self.model))
        if reason is not None:
            self._tlt_warn_once(reason, f"TLTGRPOTrainer: {reason}: these rollouts are generated the stock way "
                                        "(TRL's own generation, no speculation); the drafter still learns from them.")
            output = super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
            self._tlt_learn_from(prompt_ids, output[0])
        else:
            output = (self._tlt_generate(prompt_ids), None)
        if not self._tlt_in_tool_loop and not getattr(self, "tools", None):
            self._tlt_after_rollout()  # before _generate's gathers, where a fast rank would otherwise sit idle
        return output

    def _tlt_learn_from(self, prompt_ids, completion_ids) -> None:
        """Rollouts enter the drafter's buffer through one no-grad forward of the policy, which gives their features
        and the final states of the policy's next-token law (computed when an update first trains on a rollout):
        rollouts generated the stock way, and TLT's engine's where the drafter learns the law (``drafter_targets``;
        otherwise the engine hands over features from its own passes)."""
        if not (self.model.training and self.drafter_trainer is not None and completion_ids):
            return
        rows = [torch.tensor(list(p) + list(c)) for p, c in zip(prompt_ids, completion_ids)]
        input_ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="right")
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="right")
        with self._tlt_unwrapped() as unwrapped:
            policy = _policy_of(unwrapped)
            with self._tlt_autocast(policy):
                self.drafter_trainer.add_sequences(input_ids, attention_mask, defer_law=True)  # law: when trained

    def _tool_call_loop(self, *args, **kwargs):
        # The loop calls _generate_single_turn a data-dependent number of times per rank: no collective in there.
        self._tlt_in_tool_loop = True
        try:
            output = super()._tool_call_loop(*args, **kwargs)
        finally:
            self._tlt_in_tool_loop = False
        if self._tlt_trains_at_generation_end:
            self._tlt_after_rollout()
        return output

    def _generate(self, *args, **kwargs):
        self._tlt_pending = True
        self._tlt_rollout_start = time.perf_counter()
        self._tlt_counters = RolloutCounters()
        self._tlt_saved_seconds = math.nan
        output = super()._generate(*args, **kwargs)
        if self._tlt_trains_at_generation_end:
            self._tlt_after_rollout()  # no-op unless generation did not pass through the hooks above (rollout_func)
        self._tlt_give_back_memory()  # already done by _tlt_after_rollout, unless it waits for the old-logps pass
        return output

    def _tlt_give_back_memory(self) -> None:
        """Free what TLT's engine keeps between rollouts (its caches, features buffer and graphs) before the drafter
        update and the training step, which need the memory, unless ``keep_engine_memory``. Without emptying CUDA's
        cache: the training step runs in this process, whose caching allocator reuses the freed blocks (and frees
        the released graph pools itself if an allocation needs them), while emptying it would synchronize and make
        the next rollout allocate from the device again (TrainingArguments' ``torch_empty_cache_steps`` does it
        where wanted). With ``use_vllm`` TLT's engine never runs (TRL's vLLM engine generates and its own
        ``vllm_enable_sleep_mode`` governs that engine's memory): nothing to free."""
        if self._tlt_engine is None or self._tlt_config.keep_engine_memory:
            return
        release = give_back(self._tlt_engine, empty_cache=False)
        if release.held_bytes or not release.session_freed:  # not a second call of the same rollout
            self._tlt_memory_release = release

    # ------------------------------------------------------------------ vLLM (colocate)
    def _tlt_start_vllm(self) -> None:
        """Start TRL's colocated engine with the drafter as its EAGLE speculator (plain vLLM without a drafter); in
        server mode, check that the server serves a drafter TLT can refresh and load this drafter into it."""
        from ..vllm import VLLMDrafterSync
        from ..vllm.config import speculation_schedule
        from ..vllm.schedule import engine_scheduler

        self._tlt_vllm_pushes = 0
        if self.vllm_mode == "server":
            error = None
            if self.drafter is not None and self.accelerator.is_main_process:  # the rank that talks to the server
                from ..vllm.server import VLLMServerDrafterSync

                directory = Path(self.args.output_dir) / VLLM_DRAFTER_DIR / "server"
                try:
                    sync = VLLMServerDrafterSync(self.vllm_generation.vllm_client.base_url, self.drafter, directory,
                                                 full_vocab_head=self.drafter.config.uses_draft_vocab)
                    sync.push(self.drafter)  # the server started with another drafter's weights (or dummy ones)
                    self._tlt_vllm_sync, self._tlt_vllm_seen = sync, sync.counters()
                except (ValueError, RuntimeError) as err:
                    error = err
            # Every rank raises the main process's error: the others would otherwise wait in TRL's collectives.
            message = self._tlt_ranks.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
            if error is not None:
                raise error
            if message is not None:
                raise RuntimeError(f"The main process could not use the vLLM server: {message}")
            self._tlt_vllm_serves_drafter = self.drafter is not None
            return
        if self.drafter is None:
            self.vllm_generation.start(None, self._tlt_vllm_engine_kwargs)
            self._tlt_check_vllm_dtype()
            return
        policy = _policy_of(self.accelerator.unwrap_model(self.model))
        directory = Path(self.args.output_dir) / VLLM_DRAFTER_DIR / f"rank{self.accelerator.process_index}"
        chain = self._tlt_config.chain_length
        if self.drafter.drafts_blocks:  # vLLM's DFlash drafts up to the block's masked slots
            chain = min(chain, self.drafter.max_drafts)
        sync = VLLMDrafterSync(self.drafter, policy, directory=directory, num_speculative_tokens=chain,
                               full_vocab_head=self.drafter.config.uses_draft_vocab)
        # speculation="adaptive": TLT's scheduler chooses each step's draft length from the engine's measured costs
        # and live acceptance; "always": the chain at every step (up to max_speculative_batch_size, where set).
        settings = {"cost_cache": self._tlt_config.cost_cache} if self._tlt_config.speculation == "adaptive" else {}
        spec_extra, engine_extra = speculation_schedule(self._tlt_config.speculation, chain,
                                                        self._tlt_config.max_speculative_batch_size, **settings)
        self.vllm_generation.start(sync, {**engine_extra, **self._tlt_vllm_engine_kwargs}, **spec_extra)
        self._tlt_check_vllm_dtype()
        self._tlt_vllm_sync, self._tlt_vllm_serves_drafter = sync, True
        self._tlt_vllm_seen = sync.counters()
        scheduler = engine_scheduler(self.vllm_generation.llm)
        self._tlt_vllm_scheduler = scheduler if hasattr(scheduler, "tlt_speculation_state") else None
        if self._tlt_vllm_scheduler is not None:
            self._tlt_vllm_saved_seen = self._tlt_vllm_scheduler.tlt_speculation.saved_seconds

    def _tlt_push_drafter(self, top1: float = float("nan")) -> float:
        """Load the drafter's current weights into the running vLLM engine; returns the seconds it took. ``top1``:
        the update's agreement with the policy, from which an adaptive schedule prices its trial of the new weights
        (NaN: its fixed prior)."""
        timing, error = None, None
        if self._tlt_vllm_sync is not None:  # every rank in colocate mode, the main process in server mode
            options = {}
            if self._tlt_vllm_scheduler is not None:  # TLT's adaptive schedule runs in this process (colocate)
                from ..vllm.schedule import acceptance_from_top1

                length = self._tlt_vllm_scheduler.tlt_speculation.settings.num_speculative_tokens
                options["expected_acceptance"] = acceptance_from_top1(top1, length)
            try:
                timing = self._tlt_vllm_sync.push(self.drafter, **options)
            except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
                error = err
        # Called on every rank in step: all of them raise a failure, none waits for the failed one in a collective.
        message = self._tlt_ranks.first_error(error)
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(f"Loading the drafter into vLLM failed on {message}")
        if timing is None:
            return 0.0
        self._tlt_vllm_pushes += 1
        return timing.total_seconds

    def _tlt_generate_with_vllm(self, prompt_ids, images=None, multimodal_fields=None, *args, **kwargs):
        """TRL's vLLM generation; vLLM's speculative-decoding counters become this rollout's ``tlt/*`` counts."""
        output = super()._generate_single_turn(prompt_ids, images, multimodal_fields, *args, **kwargs)
        if self._tlt_vllm_sync is not None:
            now = self._tlt_vllm_sync.counters()
            self._tlt_counters.add_spec_decode(now - self._tlt_vllm_seen)
            self._tlt_vllm_seen = now
        if self._tlt_vllm_scheduler is not None:  # the adaptive schedule measures what speculation saved
            saved = self._tlt_vllm_scheduler.tlt_speculation.saved_seconds
            if math.isnan(self._tlt_saved_seconds):
                self._tlt_saved_seconds = 0.0
            self._tlt_saved_seconds += saved - self._tlt_vllm_saved_seen
            self._tlt_vllm_saved_seen = saved
        if self._tlt_trains_at_generation_end and not self._tlt_in_tool_loop and not getattr(self, "tools", None):
            self._tlt_after_rollout()  # several ranks: train on earlier rollouts' features while slower ranks generate
        return output

    def _tlt_check_vllm_dtype(self) -> None:
        """Note whether the colocated engine computes in the policy's dtype (``tlt/rollout_dtype_matches_policy``);
        warn once where it does not (vLLM's ``dtype="auto"`` runs a float32 checkpoint in bfloat16)."""
        config = getattr(getattr(self.vllm_generation.llm, "llm_engine", None), "model_config", None)
        if config is None:  # a vLLM that keeps it elsewhere: no dtype metric
            return
        engine = str(config.dtype).removeprefix("torch.")
        policy = _compute_dtype(self.accelerator, _policy_of(self.accelerator.unwrap_model(self.model)))
        self._tlt_vllm_dtypes = (engine, policy)
        if engine != policy:
            logger.warning(f"TLTGRPOTrainer: TRL's vLLM engine computes in {engine} and the policy is trained in "
                           f"{policy}: vLLM's log-probabilities of the sampled tokens differ from the policy's by "
                           "rounding (tlt/rollout_logp_diff_*), which TRL's importance-sampling ratio shows as drift "
                           "and its default sequence-level masking as dropped completions. To sample from the trained "
                           f"policy itself: TLTGRPOTrainer(..., vllm_engine_kwargs={{'dtype': '{policy}'}}) "
                           "(docs/importance_ratio.md).")

    def _tlt_log_rollout_agreement(self, output: dict) -> None:
        """``tlt/rollout_*``: vLLM's log-probabilities of the sampled tokens against the trained policy's, from the
        tensors TRL just computed (no extra pass); see the class docstring."""
        old, sampled = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
        if old is None or sampled is None:
            return
        mask = output["completion_mask"].bool()
        if "tool_mask" in output:
            mask = mask & output["tool_mask"].bool()
        diff = old.float() - sampled.float()  # log(trainer / vLLM): TRL's per-token log importance ratio
        mask = mask & ~torch.isnan(diff)  # tokens vLLM could not score (TRL leaves them out too)
        diff = diff.masked_fill(~mask, 0.0)
        sequence = diff.sum(dim=1)
        args = self.args
        if args.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
            ratios = torch.exp(sequence)[mask.any(dim=1)]
        else:
            ratios = torch.exp(diff[mask])
        low = args.vllm_importance_sampling_clip_min
        high = args.vllm_importance_sampling_clip_max
        outside = torch.zeros_like(ratios, dtype=torch.bool)
        if low is not None:
            outside |= ratios < low
        if high is not None:
            outside |= ratios > high
        device = self.accelerator.device
        sums = torch.stack([diff.abs().sum(), mask.sum().float(), outside.sum().float(),
                            torch.tensor(float(ratios.numel()), device=diff.device)]).to(device)
        maxima = torch.stack([diff.abs().max() if diff.numel() else diff.new_zeros(()),
                              sequence.abs().max() if sequence.numel() else diff.new_zeros(())]).to(device)
        sums = self.accelerator.gather(sums.unsqueeze(0)).sum(dim=0)
        maxima = self.accelerator.gather(maxima.unsqueeze(0)).max(dim=0).values
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics[metric.ROLLOUT_LOGP_DIFF_MEAN].append(_ratio(sums[0].item(), sums[1].item()))
        metrics[metric.ROLLOUT_LOGP_DIFF_MAX].append(maxima[0].item())
        metrics[metric.ROLLOUT_SEQ_LOGP_DIFF_MAX].append(maxima[1].item())
        metrics[metric.ROLLOUT_IS_OUTSIDE_CLIP_FRACTION].append(_ratio(sums[2].item(), sums[3].item()))
        dtypes = getattr(self, "_tlt_vllm_dtypes", None)
        if dtypes is not None:
            metrics[metric.ROLLOUT_DTYPE_MATCHES_POLICY].append(float(dtypes[0] == dtypes[1]))

    def _generate_and_score_completions(self, *args, **kwargs):
        output = super()._generate_and_score_completions(*args, **kwargs)
        if self.use_vllm:
            self._tlt_log_rollout_agreement(output)
        if not self._tlt_trains_at_generation_end:  # the old-logps pass inside has just handed over the features
            self._tlt_after_rollout()
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *args, **kwargs):
        """With vLLM, the no-grad pass over the rollout (old log-probs) also hands the drafter its features."""
        capture = (self.use_vllm and self.drafter_trainer is not None and model is self.model and model.training
                   and not torch.is_grad_enabled())
        if not capture:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)
        decoder = _policy_of(self.accelerator.unwrap_model(model)).get_decoder()
        with capture_features(decoder, self.drafter.feature_layers) as captured:
            output = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)
        features = torch.cat([pair[0] for pair in captured], dim=0)
        final = torch.cat([pair[1] for pair in captured], dim=0)
        for row, mask in enumerate(attention_mask.bool()):
            tokens = input_ids[row][mask]  # with the final states, an EAGLE-3 drafter learns the policy's whole law,
            # computed when an update first trains on the row (inside its budget), not here on the step's path
            self.drafter_trainer.add_features(tokens, features[row][mask][:-1], final[row][mask], defer_law=True)
        return output

    # ------------------------------------------------------------------ drafter updates
    def _tlt_after_rollout(self) -> None:
        """Once per ``_generate`` on every rank: train the drafter in idle time, then the update cycle
        (:func:`~tlt_trainers.online.finish_update`: the fallback, the merge by ``most_trained``), log, fire
        callbacks."""
        if not self._tlt_pending:
            return
        self._tlt_pending = False
        self._tlt_give_back_memory()  # the rollout is over on this rank: the drafter update and the step need it
        counters = self._tlt_counters.values
        if not self.model.training:
            self._tlt_log_generation("eval", counters)
            return
        settings, ranks, trainer = self.tlt_settings, self._tlt_ranks, self.drafter_trainer
        rollout_seconds = time.perf_counter() - self._tlt_rollout_start
        posted = time.perf_counter()
        work = ranks.post_arrival(rollout_seconds)
        costs_timed: list[int] = []
        idle = {}
        if ranks.distributed and self._tlt_trains_at_generation_end:  # train while slower ranks still generate
            if self._tlt_engine is not None:  # first time what the engine has not timed yet: the idle time is free
                with self._tlt_unwrapped() as unwrapped, self._tlt_autocast(_policy_of(unwrapped)):
                    costs_timed = self._tlt_engine.measure_costs(
                        IDLE_COST_TIMING_SHARE * settings.drafter_max_idle_seconds, lambda: ranks.arrived(work))
            idle = self._tlt_train_drafter(settings.drafter_max_idle_seconds, lambda: ranks.arrived(work))
        ranks.wait(work)
        waited = time.perf_counter() - posted
        total_steps = trainer.step if trainer is not None else 0
        local_idle = SliceReport.from_metrics(idle, total_steps=total_steps, costs_timed=len(costs_timed))
        row = dict(rollout_seconds=rollout_seconds, wait_seconds=waited, saved_seconds=self._tlt_saved_seconds,
                   **counters)
        table = ranks.gather([float(row[name]) for name in ROLLOUT_FIELDS] + local_idle.as_row())
        column = {name: table[:, COLUMN[name]] for name in ROLLOUT_FIELDS}

        budget = after_rollout_budget(settings, rollout_seconds)
        paid = settings.drafter_update_budget == "payback" and not torch.isnan(column["saved_seconds"]).any()
        if budget is not None and paid:  # from gathered figures only: every rank takes the same decision
            longest = column["rollout_seconds"].max().item()
            budget = self._tlt_payback.budget(longest, column["saved_seconds"].mean().item(),
                                              cap=after_rollout_budget(settings, longest))
        fallback = None
        # No fallback without a drafter trainer, or where vLLM runs without the drafter (training would only cost time)
        if budget is not None and trainer is not None and not (self.use_vllm and not self._tlt_vllm_serves_drafter):
            def fallback() -> list[SliceReport]:
                steps = self._tlt_payback.affordable_steps(budget) if paid else None
                update = self._tlt_train_drafter(budget, at_least_one=True, max_steps=steps)
                return ranks.gather_reports(SliceReport.from_metrics(update, total_steps=trainer.step))

        transport = RankDrafterTransport(ranks, self.drafter, trainer, local_idle.steps, self._tlt_draft_vocab_ready)
        outcome = finish_update(ranks.reports(table), transport, MergeRule.MOST_TRAINED, fallback)
        merged = outcome.merged
        if paid and outcome.trigger == POST_ROLLOUT:
            self._tlt_payback.spent(outcome.fallback_seconds, max((r.steps for r in outcome.trained), default=0))
        if merged is not None:
            self._tlt_draft_vocab_ready = True
        push_seconds = self._tlt_push_drafter(merged.top1) if merged is not None else 0.0

        self._tlt_log_generation("train", {name: float(column[name].sum()) for name in counters})
        metrics = self._metrics["train"]
        metrics[metric.ROLLOUT_SECONDS].append(column["rollout_seconds"].max().item())
        metrics[metric.IDLE_SECONDS].append(waited_seconds(column["rollout_seconds"].tolist()))
        for name, value in update_metrics(outcome).items():
            metrics[name].append(value)
        if not torch.isnan(column["saved_seconds"]).any():
            metrics[metric.SPECULATION_SAVED_SECONDS].append(column["saved_seconds"].mean().item())
        if paid:
            metrics[metric.DRAFTER_CREDIT_SECONDS].append(self._tlt_payback.credit)
        if self._tlt_vllm_sync is not None:
            metrics[metric.DRAFTER_UPDATES_LOADED].append(float(self._tlt_vllm_pushes))
            metrics[metric.DRAFTER_PUSH_SECONDS].append(push_seconds)
        if self._tlt_vllm_scheduler is not None:
            self._tlt_log_vllm_schedule(metrics)

        if merged is not None:
            local = outcome.trained[ranks.rank]
            trigger = IDLE if outcome.trigger == IDLE and local.steps > 0 else POST_ROLLOUT
            self._tlt_fire_drafter_update(trigger, {
                "steps": local.steps, "loss": local.loss, "seconds": local.seconds, "top1": local.top1,
                "wait_seconds": waited, "rollout_seconds": rollout_seconds, "source_rank": merged.source,
                "source_steps": merged.steps, "total_steps": trainer.step,
                "buffer_sequences": len(trainer.buffer), "buffer_bytes": trainer.buffer.nbytes,
                "costs_timed": costs_timed,
            })

    def _tlt_train_drafter(self, max_seconds: float, should_stop=None, at_least_one: bool = False,
                           max_steps: int | None = None) -> dict:
        """This rank's training slice (:func:`~tlt_trainers.online.train_slice`); ``{}`` without a drafter.
        ``max_steps``: a cap below ``drafter_max_steps_per_update`` (what the payback budget can pay for)."""
        if self.drafter_trainer is None:
            return {}
        caps = [cap for cap in (self.tlt_settings.drafter_max_steps_per_update, max_steps) if cap is not None]
        return train_slice(self.drafter_trainer, max_seconds, max_steps=min(caps) if caps else None,
                           at_least_one=at_least_one, interrupted=should_stop,
                           rebuild_draft_vocab=not self._tlt_draft_vocab_ready)

    def _tlt_log_generation(self, mode: str, counters: dict) -> None:
        metrics = self._metrics[mode]
        metrics[metric.ACCEPTANCE_LENGTH].append(_ratio(counters["emitted_tokens"], counters["row_forwards"]))
        metrics[metric.DRAFT_TOKENS].append(float(counters["draft_tokens"]))
        metrics[metric.ACCEPTED_TOKENS].append(float(counters["accepted_tokens"]))
        metrics[metric.SPECULATIVE_STEP_FRACTION].append(_ratio(counters["speculative_steps"],
                                                                counters["decode_steps"]))
        metrics[metric.HISTORY_PROPOSED_TOKENS].append(float(counters["history_proposed"]))

    def _tlt_log_vllm_schedule(self, metrics) -> None:
        """The adaptive vLLM schedule in force after this rollout: draft length per batch bucket
        (``tlt/vllm_draft_length_b<bucket>``), tokens per verify step it expects, share of this rollout's steps that
        drafted (vLLM's log has every change, with what it was decided on)."""
        state = self._tlt_vllm_scheduler.tlt_speculation_state()
        for bucket, length in state["schedule"].items():
            metrics[metric.vllm_draft_length(bucket)].append(float(length))
        metrics[metric.VLLM_EXPECTED_TOKENS_PER_STEP].append(float(state["expected_tokens"]))
        steps, speculative = state["steps"], state["speculative_steps"]
        last_steps, last_speculative = getattr(self, "_tlt_vllm_schedule_seen", (0, 0))
        metrics[metric.VLLM_SPECULATIVE_STEP_FRACTION].append(
            _ratio(speculative - last_speculative, steps - last_steps))
        self._tlt_vllm_schedule_seen = (steps, speculative)

    def _tlt_fire_drafter_update(self, trigger: str, metrics: dict) -> None:
        # CallbackHandler.call_event would raise on callbacks without this method: call those that have it.
        handler = self.callback_handler
        for callback in handler.callbacks:
            method = getattr(callback, "on_drafter_update", None)
            if not callable(method):
                continue
            result = method(self.args, self.state, self.control, drafter=self.drafter, trigger=trigger,
                            rank=self._tlt_ranks.rank, metrics=dict(metrics), model=self.model,
                            processing_class=self.processing_class, optimizer=self.optimizer,
                            lr_scheduler=self.lr_scheduler)
            if result is not None:
                self.control = result

    # ------------------------------------------------------------------ warm-up and training entry
    def train(self, *args, **kwargs):
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if self.drafter_trainer is not None and self.tlt_settings.drafter_warmup_prompts > 0 and not resume:
            self._tlt_warmup()
        output = super().train(*args, **kwargs)
        if self.drafter_trainer is not None and self.args.should_save:
            self.drafter_trainer.save_checkpoint(Path(self.args.output_dir) / DRAFTER_DIR)
        return output

    def _tlt_warmup_prompts(self, count: int) -> list[str]:
        from trl.data_utils import is_conversational

        data = self.train_dataset
        if data is None:
            raise ValueError("drafter_warmup_prompts > 0 needs a train_dataset with a 'prompt' column.")
        if hasattr(data, "select") and hasattr(data, "__len__"):
            rows = data.select(range(min(count, len(data))))
        else:
            rows = list(itertools.islice(iter(data), count))
        prompts = []
        for row in rows:
            prompt = row["prompt"]
            if is_conversational({"prompt": prompt}):
                prompt = self._tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                             **(getattr(self, "chat_template_kwargs", None) or {}))
            prompts.append(prompt)
        return prompts

    def _tlt_warmup(self) -> None:
        """Fit the drafter to the policy's answers before RL starts (main process; then shared with all ranks)."""
        from ..warmup import warmup_drafter

        settings = self.tlt_settings
        if self.accelerator.is_main_process:
            prompts = self._tlt_warmup_prompts(settings.drafter_warmup_prompts)
            sampling = self._tlt_sampling
            temperatures = (sampling["temperature"], 0.0) if sampling["do_sample"] else (0.0,)
            side = self._tokenizer.padding_side
            self._tokenizer.padding_side = "left"
            try:
                with self._tlt_unwrapped() as unwrapped, torch.random.fork_rng(devices=[]), torch.enable_grad():
                    policy = _policy_of(unwrapped)
                    with self._tlt_autocast(policy):
                        _, report = warmup_drafter(
                            policy, self._tokenizer, prompts, drafter=self.drafter,
                            max_new_tokens=int(self._tlt_max_new_tokens or 64), temperatures=temperatures,
                            batch_size=8, train_seconds=settings.drafter_warmup_seconds,
                            unroll_steps=settings.drafter_unroll_steps, lr=settings.drafter_warmup_lr,
                            seed=int(self.args.seed), show_progress=False, log=logger.info)
            finally:
                self._tokenizer.padding_side = side
            self.drafter.bind(_policy_of(self.accelerator.unwrap_model(self.model)))
            trained = report.training
            logger.info(f"TLTGRPOTrainer: drafter warm-up: {report.answer_tokens} answer tokens, "
                        f"{trained.get('steps', 0)} steps, loss {trained.get('loss', float('nan')):.3f}")
        self.drafter.eval()
        self._tlt_ranks.broadcast_drafter(self.drafter, None, src=0)
        self._tlt_draft_vocab_ready = True
        self._tlt_push_drafter()

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict=state_dict)
        if self.drafter_trainer is not None:
            directory = Path(output_dir if output_dir is not None else self.args.output_dir) / DRAFTER_DIR
            # The card makes the drafter folder of a pushed run (trainer.push_to_hub uploads output_dir) say what it
            # is and how to load it: Drafter.from_pretrained(<download>/drafter, target=policy).
            card = {"policy_name": self.args.hub_model_id or self.drafter.config.target_name_or_path,
                    "training": {"GRPO steps": self.state.global_step, "drafter steps": self.drafter_trainer.step}}
            self.drafter_trainer.save_checkpoint(directory, model_card=card)
            (directory / PAYBACK_STATE).write_text(json.dumps(self._tlt_payback.state()))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        source = Path(checkpoint_folder) / DRAFTER_DIR
        if self.is_world_process_zero() and source.is_dir():
            shutil.copytree(source, Path(self.args.output_dir) / DRAFTER_DIR, dirs_exist_ok=True)
        super()._push_from_checkpoint(checkpoint_folder)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.drafter_trainer is None:
            return
        directory = Path(checkpoint) / DRAFTER_DIR
        if (directory / TRAINER_STATE).is_file():
            self.drafter_trainer.load_checkpoint(directory)
            if (directory / PAYBACK_STATE).is_file():
                self._tlt_payback.load_state(json.loads((directory / PAYBACK_STATE).read_text()))
            self.drafter.eval()
            self._tlt_draft_vocab_ready = True
            self._tlt_push_drafter()
        else:
            logger.warning(f"TLTGRPOTrainer: {checkpoint} holds no drafter ({DRAFTER_DIR}/); continuing with the "
                           "current one.")

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        state = {"rollout": self._tlt_generator.get_state()}
        if self.drafter_trainer is not None:
            state["drafter"] = self.drafter_trainer.generator.get_state()
        os.makedirs(output_dir, exist_ok=True)
        torch.save(state, os.path.join(output_dir, RNG_STATE_NAME.format(self.args.process_index)))

    def _load_rng_state(self, checkpoint) -> None:
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, RNG_STATE_NAME.format(self.args.process_index))
        if not os.path.isfile(path):
            logger.warning(f"TLTGRPOTrainer: {checkpoint} holds no {os.path.basename(path)} (written by stock "
                           "GRPOTrainer or an older tlt-trainers): the rollout sampler and the drafter's training "
                           "restart from their seeds, so this resumed run will not reproduce an uninterrupted one.")
            return
        state = torch.load(path, weights_only=True)
        self._tlt_generator.set_state(state["rollout"])
        if self.drafter_trainer is not None and "drafter" in state:
            self.drafter_trainer.generator.set_state(state["drafter"])


def _compute_dtype(accelerator, policy) -> str:
    """The dtype the trainer's forward computes in: accelerate's mixed precision, else the policy's weights."""
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed in ("bf16", "fp16"):
        return {"bf16": "bfloat16", "fp16": "float16"}[mixed]
    return str(policy.dtype).removeprefix("torch.")


def _check_args(args) -> None:
    """Settings TLT cannot honour, refused before anything is built."""
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", "colocate") == "server" and (
            getattr(args, "use_cpu", False) or not torch.cuda.is_available()):
        raise ValueError(_VLLM_SERVER_CPU_ERROR)
    resolve_tlt_settings(args)


__all__ = ["TLTGRPOConfig", "TLTGRPOTrainer", "DRAFTER_DIR", "effective_generation_config", "generation_settings"]
