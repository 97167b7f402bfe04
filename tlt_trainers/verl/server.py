"""The engine behind one ``tlt`` rollout replica: veRL's token-in/token-out server API over SpeculativeGenerator.

veRL's agent loops send one request per sample (``generate(prompt_ids, sampling_params)``); our engine is
batched, so requests that arrive within ``tlt.batch_wait_ms`` of each other (a GRPO step sends them all at
once) are decoded as one batch, grouped by sampling settings. The server also owns this replica's drafter
and its trainer: verify passes feed the drafter's buffer, and :meth:`train_drafter` trains while the
replica is idle, yielding to the next request within one micro-step.

Only this module touches the model, always under one lock: a batch, a training slice and a weight load
never overlap.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..drafter.base import Drafter
from ..drafter.setup import rollout_drafter
from ..drafter.trainer import DrafterTrainer
from ..rollout.generator import SpeculativeGenerator
from ..rollout.stats import RolloutCounters
from ..sampling.distribution import SamplingParams, process_logits
from ..vllm.sync import _torch_dtype
from .settings import TLTSection

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt_ids: list[int]
    params: dict
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)


def sampling_key(params: dict) -> tuple:
    """veRL's sampling params (vLLM conventions: top_k -1 = off, temperature 0 = greedy) as a hashable key."""
    temperature = float(params.get("temperature", 1.0) or 0.0)
    top_k = int(params.get("top_k", -1) or -1)
    return (temperature, float(params.get("top_p", 1.0) or 1.0), 0 if top_k < 0 else top_k,
            float(params.get("repetition_penalty", 1.0) or 1.0), bool(params.get("logprobs", False)))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


class TLTRolloutServer:
    """Speculative rollouts for one replica (a Ray actor created by :class:`~.replica.TLTReplica`)."""

    def __init__(self, model_path: str, settings: dict | TLTSection, response_length: int, max_num_seqs: int = 1024,
                 replica_rank: int = 0, tokenizer_path: str | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings = TLTSection.from_mapping(settings)
        self.replica_rank = replica_rank
        self.response_length = int(response_length)
        self.max_num_seqs = int(max_num_seqs)
        device = self.settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = self.settings.dtype
        if dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            dtype = _torch_dtype(dtype)  # one of ROLLOUT_DTYPES (checked by the settings)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                          trust_remote_code=trust_remote_code).to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, trust_remote_code=trust_remote_code)
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        if not self.eos_ids:
            raise ValueError(f"{model_path} defines no EOS token (generation_config or tokenizer); the tlt rollout "
                             "needs one to end completions.")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

        self.drafter, self.trainer = self._make_drafter()
        self.engine = SpeculativeGenerator(self.model, self.drafter, self.settings.tlt_config())
        self.generator = torch.Generator(device=self.device).manual_seed(self.settings.seed + replica_rank)

        self._pending: list[_Request] = []
        self._serving: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._interrupt = threading.Event()  # set by a new request: a training slice stops at its next micro-step
        self._reset_counters()
        self.steps_since_sync = 0

    def _make_drafter(self) -> tuple[Drafter | None, DrafterTrainer | None]:
        if self.settings.speculation == "never":
            return None, None
        drafter, trainer, self._draft_vocab_ready = rollout_drafter(self.model, self.settings, self.settings.seed,
                                                                    self.replica_rank)
        return drafter, trainer

    def _reset_counters(self) -> None:
        self.counters = RolloutCounters()
        self.rows_served = 0
        self.busy_seconds = 0.0
        self.first_request: float | None = None
        self.last_finish: float | None = None

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str | None = None,
                       image_data: Any = None, video_data: Any = None, **kwargs):
        """veRL's server API: one request in, its completion's token ids out (EOS included, as vLLM returns them)."""
        if image_data or video_data or kwargs.get("audio_data"):
            raise ValueError("The tlt rollout serves text-only causal LMs; multimodal requests need "
                             "actor_rollout_ref.rollout.name=vllm or sglang.")
        if not prompt_ids:
            raise ValueError(f"Request {request_id}: empty prompt.")
        self._interrupt.set()
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(map(int, prompt_ids)), dict(sampling_params), future))
        if self.first_request is None:
            self.first_request = time.perf_counter()
        if self._serving is None or self._serving.done():
            self._serving = asyncio.create_task(self._serve())
        return await future

    async def _serve(self) -> None:
        wait = self.settings.batch_wait_ms / 1000
        while self._pending:
            seen = -1
            while seen != len(self._pending) and len(self._pending) < self.max_num_seqs:
                seen = len(self._pending)  # gather until no request arrived for one window (or the batch is full)
                await asyncio.sleep(wait)
            batch, self._pending = self._pending[: self.max_num_seqs], self._pending[self.max_num_seqs:]
            groups: dict[tuple, list[_Request]] = {}
            for request in batch:
                groups.setdefault(sampling_key(request.params), []).append(request)
            async with self._lock:
                for key, requests in groups.items():
                    start = time.perf_counter()
                    try:
                        outputs = await asyncio.to_thread(self._run_batch, key, [r.prompt_ids for r in requests])
                    except Exception as err:  # every waiting agent loop gets the error, the server lives on
                        logger.exception("tlt rollout batch failed")
                        for request in requests:
                            if not request.future.done():
                                request.future.set_exception(err)
                        continue
                    finally:
                        self.busy_seconds += time.perf_counter() - start
                    for request, output in zip(requests, outputs, strict=True):
                        if not request.future.done():
                            request.future.set_result(output)
                self.last_finish = time.perf_counter()

    def _run_batch(self, key: tuple, prompts: list[list[int]]) -> list:
        from verl.workers.rollout.replica import TokenOutput

        temperature, top_p, top_k, repetition_penalty, want_logprobs = key
        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        sampling = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0,
                        top_k=top_k, top_p=top_p if temperature > 0 else 1.0, repetition_penalty=repetition_penalty)
        sink = self.trainer.add_features if self.trainer is not None else None
        with torch.no_grad():
            result = self.engine.generate(ids, attention_mask=mask, max_new_tokens=self.response_length,
                                          eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                                          generator=self.generator, feature_sink=sink, **sampling)
        self.counters.add(result.stats)
        self.rows_served += len(prompts)
        completions = []
        for row in result.sequences[:, ids.shape[1]:].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in self.eos_ids), len(row))
            completions.append(row[:end])
        logprobs = self._logprobs(ids, mask, completions, sampling) if want_logprobs else [None] * len(prompts)
        return [TokenOutput(token_ids=c, log_probs=lp, stop_reason="completed",
                            extra_fields={"tlt_replica": self.replica_rank})
                for c, lp in zip(completions, logprobs, strict=True)]

    @torch.no_grad()
    def _logprobs(self, ids, mask, completions, sampling) -> list[list[float]]:
        """Log-probabilities of the sampled tokens under the distribution they were sampled from
        (vLLM's ``processed_logprobs``: after temperature, top-k and top-p)."""
        params = SamplingParams(**{k: sampling[k] for k in ("do_sample", "temperature", "top_k", "top_p")})
        out = []
        for row, completion in enumerate(completions):
            if not completion:
                out.append([])
                continue
            prompt = ids[row][mask[row].bool()]
            full = torch.cat([prompt, torch.tensor(completion, device=self.device)])[None]
            logits = self.model(input_ids=full).logits[0, prompt.shape[0] - 1: -1]
            scores = process_logits(logits, params)
            logp = torch.log_softmax(scores, dim=-1).gather(-1, full[0, prompt.shape[0]:, None])[:, 0]
            out.append(logp.float().tolist())
        return out

    # ------------------------------------------------------------------ drafter
    async def train_drafter(self, max_seconds: float, at_least_one: bool = False) -> dict:
        """Train the drafter on this replica's buffer for up to ``max_seconds``; a new request stops it at the next
        micro-step (idle time only). ``at_least_one``: finish one micro-step even if the budget is 0."""
        if self.trainer is None or len(self.trainer.buffer) == 0 or max_seconds <= 0 and not at_least_one:
            return {}
        self._interrupt.clear()
        async with self._lock:
            if self._pending:  # a request came in while we waited for the lock
                return {}
            return await asyncio.to_thread(self._train, max_seconds, at_least_one)

    def _train(self, max_seconds: float, at_least_one: bool) -> dict:
        trainer, settings = self.trainer, self.settings
        first, deadline = trainer.step, time.perf_counter() + max_seconds

        def should_stop() -> bool:
            if at_least_one and trainer.step == first:
                return False
            return self._interrupt.is_set() or time.perf_counter() >= deadline

        if not self._draft_vocab_ready:
            trainer.rebuild_draft_vocab()
            self._draft_vocab_ready = True
        with torch.enable_grad():
            metrics = trainer.train(max_steps=settings.drafter_max_steps_per_update, max_seconds=None,
                                    should_stop=should_stop)
        self.drafter.eval()
        self.steps_since_sync += metrics.get("steps", 0)
        return metrics

    async def stop_training(self) -> None:
        """End a running training slice at its next micro-step (the rollout is over)."""
        self._interrupt.set()

    async def drafter_state(self) -> dict | None:
        """The drafter's weights (CPU tensors) and the steps trained since the last sync; None without a drafter."""
        if self.drafter is None:
            return None
        async with self._lock:
            return {"state": {k: v.detach().cpu() for k, v in self.drafter.state_dict().items()},
                    "steps": self.steps_since_sync, "total_steps": self.trainer.step,
                    "draft_vocab_ready": self._draft_vocab_ready}

    async def load_drafter_state(self, payload: dict) -> None:
        if self.drafter is None or payload is None:
            return
        async with self._lock:
            self.drafter.load_state_dict(payload["state"])
            self.trainer.step = max(self.trainer.step, int(payload.get("total_steps", 0)))
            self._draft_vocab_ready = self._draft_vocab_ready or bool(payload.get("draft_vocab_ready", False))
            self.steps_since_sync = 0

    async def save_drafter(self, directory: str) -> bool:
        """Drafter weights and its trainer's state (optimizer, step) into ``directory``."""
        if self.drafter is None:
            return False
        async with self._lock:
            self.drafter.save_pretrained(directory)
            self.trainer.save_checkpoint(directory)
        return True

    async def load_drafter(self, directory: str) -> bool:
        if self.drafter is None:
            return False
        async with self._lock:
            loaded = Drafter.from_pretrained(directory, target=self.model)
            self.drafter.load_state_dict(loaded.state_dict())
            self.trainer.load_checkpoint(directory)
            self._draft_vocab_ready = True
        return True

    # ------------------------------------------------------------------ weights and statistics
    async def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        """Load the actor's new weights (HF parameter names). Returns the number of tensors loaded."""
        async with self._lock:
            return await asyncio.to_thread(self._load_weights, named_tensors)

    def _load_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        own = self.model.state_dict()
        unknown = [name for name in named_tensors if name not in own]
        if unknown:
            raise ValueError(f"update_weights: {len(unknown)} tensor(s) the rollout model does not have, e.g. "
                             f"{unknown[:3]}; the actor and the rollout model must be the same architecture.")
        with torch.no_grad():
            for name, tensor in named_tensors.items():
                own[name].copy_(tensor.to(own[name].device, own[name].dtype))
        return len(named_tensors)

    async def rollout_stats(self, reset: bool = True) -> dict:
        """Counters of the requests served since the last reset (the trainer's tlt/* metrics)."""
        values = dict(self.counters.values)
        values.update(rows=self.rows_served, busy_seconds=self.busy_seconds,
                      acceptance_length=self.counters.acceptance_length,
                      history_bytes=history.nbytes() if (history := self.engine.rollout_history) is not None else 0,
                      buffer_sequences=len(self.trainer.buffer) if self.trainer is not None else 0,
                      drafter_total_steps=self.trainer.step if self.trainer is not None else 0)
        if reset:
            self._reset_counters()
        return values

    async def is_idle(self) -> bool:
        """Served requests in this rollout and has none queued or running: its share is done."""
        return self.last_finish is not None and not self._pending and not self._lock.locked()

    async def ready(self) -> bool:
        return True

    # ------------------------------------------------------------------ RolloutReplica's control calls
    async def wake_up(self):
        """Weights stay resident in this server (no memory handoff with the trainer), so nothing to do."""

    async def sleep(self):
        """See :meth:`wake_up`."""

    async def abort_all_requests(self, reject_request: bool = False):
        """Requests not yet in a batch end now, marked 'aborted'; a running batch completes."""
        from verl.workers.rollout.replica import TokenOutput

        pending, self._pending = self._pending, []
        for request in pending:
            if not request.future.done():
                request.future.set_result(TokenOutput(token_ids=[], stop_reason="aborted"))

    async def resume_generation(self):
        """Nothing is held back after an abort."""

    async def clear_kv_cache(self):
        """The engine allocates its KV cache per batch."""

    async def release_kv_cache(self):
        """See :meth:`clear_kv_cache`."""

    async def resume_kv_cache(self):
        """See :meth:`clear_kv_cache`."""

    async def start_profile(self, **kwargs):
        """Profiling is not wired for the tlt rollout; the trainer's timing metrics cover it."""

    async def stop_profile(self):
        """See :meth:`start_profile`."""
