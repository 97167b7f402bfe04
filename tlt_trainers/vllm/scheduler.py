"""vLLM's scheduler with TLT's adaptive speculation: the draft length of every step chosen from measured costs.

Start the engine with ``scheduler_cls="tlt_trainers.vllm.scheduler.AdaptiveSpeculationScheduler"`` and
``additional_config={"tlt_speculation": {...}}`` (the fields of
:class:`~tlt_trainers.vllm.schedule.SpeculationSettings`), plus a speculative config with a
``num_speculative_tokens_per_batch_size`` schedule (vLLM's dynamic speculative decoding, which lets the draft length
change from step to step): :func:`tlt_trainers.vllm.config.speculation_schedule` returns all three. vLLM builds
the scheduler in its engine-core process, wherever that runs (in the caller's process, ``vllm serve``, veRL's vLLM
servers), so the decisions are taken where the steps run:

* each step's draft length (``SchedulerOutput.num_spec_tokens_to_schedule``: the drafts proposed at the end of this
  step, verified in the next) is set by :class:`~tlt_trainers.vllm.schedule.AdaptiveSpeculation` for the step's
  batch size, in ``_update_after_schedule`` (before the async scheduler reads it for its placeholders);
* the step's seconds are measured between consecutive ``update_from_output`` calls (or from the ``schedule`` call
  when the engine was idle before it), so they include everything a step costs: scheduling, the policy's forward,
  rejection sampling and the drafter's passes;
* acceptance comes from the per-request draft and accepted-token counts that vLLM's ``spec_decode`` counters are
  made of (``make_spec_decoding_stats``);
* ``reset_prefix_cache``, which follows every weight sync (TLT's drafter pushes, TRL's and veRL's policy syncs), tells
  the schedule that the weights may have changed; an engine in the trainer's process is told of each drafter
  update directly (:meth:`~tlt_trainers.vllm.sync.VLLMDrafterSync.push`).

Where vLLM's speculative steps would not sample the exact law at T > 0 in the engine's process
(:func:`tlt_trainers.vllm.cpu_sampling_fix.check`, run when the scheduler starts: vLLM's CPU backend without TLT's
fix), a step that runs a sampled request drafts nothing: greedy batches still speculate, sampled ones decode plainly,
and the engine says once why and what fixes it. :class:`SampledSpeculationGuardScheduler` is that guard alone, for
a fixed draft length (``speculation="always"``) on the CPU backend.

The schedule's changes are logged (``vllm.tlt_trainers``) and kept in ``scheduler.tlt_speculation.decisions``;
``tlt_speculation_state()`` (reached in-process through :func:`engine_scheduler`) returns them with the costs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ..rollout.cost_cache import load_costs, make_key, model_shape, save_costs
from . import cpu_sampling_fix
from .schedule import AdaptiveSpeculation, SpeculationSettings, engine_scheduler

logger = logging.getLogger("vllm.tlt_trainers")

CONFIG_KEY = "tlt_speculation"
COST_SAVE_STEPS = 512


def vllm_cost_key(vllm_config) -> dict:
    """What vLLM's step costs depend on: the policy, the draft model and method, the dtype, the device, vLLM's
    version (and the rest of :func:`~tlt_trainers.rollout.cost_cache.make_key`)."""
    import vllm

    model = vllm_config.model_config
    spec = vllm_config.speculative_config
    policy = {"model": str(model.model), "architectures": list(getattr(model.hf_config, "architectures", None) or []),
              **model_shape(model.hf_text_config)}
    drafter = None
    if spec is not None:
        drafter = {"method": str(spec.method), "num_speculative_tokens": spec.num_speculative_tokens}
        if spec.draft_model_config is not None:
            drafter.update(model_shape(spec.draft_model_config.hf_config))
    device = torch.device(vllm_config.device_config.device_type)
    return make_key("vllm", device, model.dtype, policy, drafter, vllm=vllm.__version__,
                    enforce_eager=bool(model.enforce_eager))


_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a request below this temperature is greedy


def _is_sampled(request) -> bool:
    params = getattr(request, "sampling_params", None)
    return params is not None and params.temperature >= _GREEDY_BELOW


class _SampledSpeculationGuard:
    """No drafts in a step that runs a sampled request where this engine's speculative sampling is not exact at
    T > 0 (module doc). ``tlt_sampling_check`` holds the check; ``tlt_guarded_steps`` counts the steps it kept
    plain."""

    def _tlt_guard_init(self) -> None:
        self.tlt_sampling_check = cpu_sampling_fix.check()
        self.tlt_guarded_steps = 0
        if not self.tlt_sampling_check.exact:
            logger.warning("tlt_trainers: %s. Steps with a sampled request (temperature > 0) decode without "
                           "speculation in this engine; greedy ones still speculate. Fix: %s.",
                           self.tlt_sampling_check.reason, self.tlt_sampling_check.fix)

    def _tlt_guarded(self, scheduler_output) -> bool:
        """Whether this step must draft nothing: the check failed and the step runs a sampled request."""
        if self.tlt_sampling_check.exact:
            return False
        if any(_is_sampled(self.requests.get(req)) for req in scheduler_output.num_scheduled_tokens):
            self.tlt_guarded_steps += 1
            return True
        return False


class SampledSpeculationGuardScheduler(_SampledSpeculationGuard, Scheduler):
    """vLLM's Scheduler with a fixed draft length, kept plain at T > 0 where this engine would not sample the exact
    law (module doc). Needs a ``num_speculative_tokens_per_batch_size`` schedule (vLLM only honours a per-step
    length with one): :func:`tlt_trainers.vllm.config.speculation_schedule` builds it."""

    def __new__(cls, vllm_config, *args: Any, **kwargs: Any):
        if cls is SampledSpeculationGuardScheduler and vllm_config.scheduler_config.async_scheduling:
            return SampledSpeculationGuardAsyncScheduler(vllm_config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tlt_guard_init()

    def _update_after_schedule(self, scheduler_output) -> None:
        if scheduler_output.num_scheduled_tokens and self._tlt_guarded(scheduler_output):
            scheduler_output.num_spec_tokens_to_schedule = 0
        super()._update_after_schedule(scheduler_output)


class SampledSpeculationGuardAsyncScheduler(SampledSpeculationGuardScheduler, AsyncScheduler):
    """:class:`SampledSpeculationGuardScheduler` for vLLM's async scheduling."""


class _AdaptiveSpeculationMixin(_SampledSpeculationGuard):
    """The part shared by the synchronous and the async scheduler (see the module doc)."""

    def _tlt_init(self) -> None:
        self._tlt_guard_init()
        spec = self.vllm_config.speculative_config
        if spec is None or self.dynamic_sd_lookup is None:
            raise ValueError("AdaptiveSpeculationScheduler needs a speculative_config with "
                             "num_speculative_tokens_per_batch_size (vLLM's dynamic speculative decoding): build the "
                             "engine with what tlt_trainers.vllm.config.speculation_schedule('adaptive', k) "
                             "returns.")
        settings = dict((self.vllm_config.additional_config or {}).get(CONFIG_KEY) or {})
        settings.setdefault("num_speculative_tokens", int(self.num_spec_tokens))
        if int(settings["num_speculative_tokens"]) != int(self.num_spec_tokens):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] has num_speculative_tokens="
                             f"{settings['num_speculative_tokens']} but the engine drafts {self.num_spec_tokens}.")
        self.tlt_speculation = AdaptiveSpeculation(SpeculationSettings(**settings))
        self._tlt_cost_key = None
        self._tlt_saved_at = 0
        if self.tlt_speculation.settings.cost_cache != "off":
            self._tlt_cost_key = vllm_cost_key(self.vllm_config)
            stored = load_costs(self._tlt_cost_key, self._tlt_cost_dir())
            if stored:
                self.tlt_speculation.merge_dict(stored)
                logger.info("tlt speculation: starting from the costs an earlier run measured (%d buckets)",
                            len(self.tlt_speculation.buckets))
        self._tlt_pending: dict[int, tuple[float, int, int]] = {}  # id(output) -> (scheduled at, batch, length)
        self._tlt_last_update = None
        self._tlt_step_drafts = [0, [0] * int(self.num_spec_tokens)]
        self._tlt_logged = 0

    # ---------------------------------------------------------------- choosing
    def schedule(self, *args: Any, **kwargs: Any):
        self._tlt_schedule_start = time.perf_counter()
        return super().schedule(*args, **kwargs)

    def _update_after_schedule(self, scheduler_output) -> None:
        batch = len(scheduler_output.num_scheduled_tokens)
        if batch:
            # a guarded step is plain whatever the schedule says, and leaves the schedule's state alone
            length = 0 if self._tlt_guarded(scheduler_output) else self.tlt_speculation.choose(batch)
            scheduler_output.num_spec_tokens_to_schedule = length
            verified = max((len(ids) for ids in scheduler_output.scheduled_spec_decode_tokens.values()), default=0)
            pure_decode = scheduler_output.total_num_scheduled_tokens == sum(
                1 + len(scheduler_output.scheduled_spec_decode_tokens.get(req, ()))
                for req in scheduler_output.num_scheduled_tokens)
            steady = verified == length and pure_decode  # a step that verifies and proposes the same length
            if len(self._tlt_pending) > 64:  # outputs that never came back (aborted engine steps): not steps to time
                self._tlt_pending.clear()
            self._tlt_pending[id(scheduler_output)] = (self._tlt_schedule_start, batch, length if steady else -1)
            self._tlt_log_decisions()
        super()._update_after_schedule(scheduler_output)

    # ---------------------------------------------------------------- measuring
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens: int, num_accepted_tokens: int,
                                 *args: Any, **kwargs: Any):
        if num_draft_tokens:
            drafts = self._tlt_step_drafts
            drafts[0] += 1
            for i in range(min(int(num_accepted_tokens), len(drafts[1]))):
                drafts[1][i] += 1
        return super().make_spec_decoding_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                                *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        now = time.perf_counter()
        pending = self._tlt_pending.pop(id(scheduler_output), None)
        if pending is not None:
            scheduled_at, batch, length = pending
            start = scheduled_at if self._tlt_last_update is None else max(self._tlt_last_update, scheduled_at)
            if length >= 0:
                self.tlt_speculation.observe_step(batch, length, now - start)
            self._tlt_last_update = now
        drafts = self._tlt_step_drafts
        if drafts[0]:
            self.tlt_speculation.observe_drafts(drafts[0], drafts[1])
            self._tlt_step_drafts = [0, [0] * len(drafts[1])]
        if not self.has_requests():
            self._tlt_last_update = None  # the next step starts after an idle wait: time it from its schedule call
        return outputs

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        """vLLM's prefix-cache reset, which follows every weight sync (TLT's drafter pushes, TRL's and veRL's policy
        syncs): the weights may have changed, so acceptance is measured afresh (see
        :meth:`~tlt_trainers.vllm.schedule.AdaptiveSpeculation.note_weights_may_have_changed`)."""
        self.tlt_speculation.note_weights_may_have_changed()
        return super().reset_prefix_cache(*args, **kwargs)

    # ---------------------------------------------------------------- kept between runs
    def _tlt_cost_dir(self) -> Path | None:
        setting = self.tlt_speculation.settings.cost_cache
        return None if setting == "auto" else Path(setting).expanduser()

    def _tlt_save_costs(self) -> None:
        """Store the measured costs for the next engine on this machine: after each change of the schedule and
        every ``COST_SAVE_STEPS`` steps (the scheduler sees no end of a run)."""
        if self._tlt_cost_key is None:
            return
        self._tlt_saved_at = self.tlt_speculation.steps
        save_costs(self._tlt_cost_key, self.tlt_speculation.to_dict(), self._tlt_cost_dir())

    # ---------------------------------------------------------------- reporting
    def _tlt_log_decisions(self) -> None:
        decisions = self.tlt_speculation.decisions
        if len(decisions) > self._tlt_logged or self.tlt_speculation.steps - self._tlt_saved_at >= COST_SAVE_STEPS:
            self._tlt_save_costs()
        for decision in decisions[self._tlt_logged:]:
            logger.info("tlt speculation: batch bucket <=%d -> %d draft tokens (%s; %.2f tokens per verify step over "
                        "%d drafts, cost ratio %.2f)", decision["bucket"], decision["length"], decision["reason"],
                        decision["expected_tokens"], decision["drafts"], decision["cost_ratio"])
        self._tlt_logged = len(decisions)

    def tlt_speculation_state(self) -> dict:
        """The schedule in force, the acceptance and the costs it rests on, and every change so far."""
        return {**self.tlt_speculation.state(), "decisions": list(self.tlt_speculation.decisions),
                "sampled_speculation_exact": self.tlt_sampling_check.exact,
                "sampled_speculation_check": self.tlt_sampling_check.reason,
                "guarded_steps": self.tlt_guarded_steps}


class AdaptiveSpeculationScheduler(_AdaptiveSpeculationMixin, Scheduler):
    """vLLM's Scheduler with TLT's adaptive draft length; becomes :class:`AdaptiveSpeculationAsyncScheduler` when
    the engine schedules asynchronously (vLLM's default wherever the executor supports it)."""

    def __new__(cls, vllm_config, *args: Any, **kwargs: Any):
        if cls is AdaptiveSpeculationScheduler and vllm_config.scheduler_config.async_scheduling:
            return AdaptiveSpeculationAsyncScheduler(vllm_config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tlt_init()


class AdaptiveSpeculationAsyncScheduler(_AdaptiveSpeculationMixin, AsyncScheduler):
    """:class:`AdaptiveSpeculationScheduler` for vLLM's async scheduling."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tlt_init()


__all__ = ["AdaptiveSpeculationAsyncScheduler", "AdaptiveSpeculationScheduler", "CONFIG_KEY",
           "SampledSpeculationGuardAsyncScheduler", "SampledSpeculationGuardScheduler", "engine_scheduler"]
