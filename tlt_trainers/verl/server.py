"""The engine behind one ``tlt`` rollout replica: veRL's token-in/token-out server API over SpeculativeGenerator.

veRL's agent loops send one request per sample (``generate(prompt_ids, sampling_params)``); our engine is
batched, so requests that arrive within ``tlt.batch_wait_ms`` of each other (a GRPO step sends them all at
once) are decoded as one batch, grouped by sampling law. Each request is sampled with vLLM's meaning of its
sampling_params (:func:`parse_sampling_params`): what the engine cannot reproduce exactly is refused, never
dropped. Completions, their log-probs and stop reasons are what veRL's vLLM server returns (:meth:`_run_batch`,
:meth:`_logprobs`). The server also owns this replica's drafter
and its trainer: verify passes feed the drafter's buffer, and :meth:`train_drafter` trains while the
replica is idle, yielding to the next request within one micro-step.

Only this module touches the model, always under one lock: a batch, a training slice and a weight load
never overlap.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..drafter.base import Drafter
from ..drafter.trainer import DrafterTrainer, learns_law_by_forward
from ..kinds.setup import rollout_drafter
from ..online import train_slice
from ..rollout.generator import IDLE_COST_TIMING_SHARE, SpeculativeGenerator
from ..rollout.memory import give_back
from ..rollout.stats import RolloutCounters
from ..sampling.distribution import SamplingParams, process_logits
from ..vllm.sync import _torch_dtype
from .settings import TLTSection

logger = logging.getLogger(__name__)


# vLLM's SamplingParams: temperature 0 is greedy, and 0 < temperature < 0.01 is raised to 0.01.
_GREEDY_BELOW = 1e-5
_MIN_TEMPERATURE = 1e-2

# What this server does with each key of veRL's sampling_params (vLLM's SamplingParams fields, as veRL's vLLM server
# receives them). A default veRL config sends temperature, top_p, top_k, repetition_penalty and logprobs (the agent
# loop), stop_token_ids (the tool agent loop) and max_tokens (the fully-async client, the generation server).
# rollout.logprobs_mode values the server returns (vLLM's *_logits modes return logits, not log-probs: refused).
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
HONOURED_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "max_new_tokens",
                     "stop_token_ids", "ignore_eos", "logprobs")

# Keys that change only vLLM's text output, streaming or bookkeeping, never the token ids and log-probs veRL reads:
# accepted with any value, and why.
IGNORED_SETTINGS = {
    "detokenize": "the server returns token ids, never text",
    "skip_special_tokens": "detokenization only",
    "spaces_between_special_tokens": "detokenization only",
    "include_stop_str_in_output": "the text of stop strings only (stop strings are refused)",
    "output_kind": "streaming granularity: the server answers once, with the whole completion",
    "stream_interval": "streaming only",
    "skip_clone": "vLLM's internal copy of the params",
    "skip_reading_prefix_cache": "prefix caching changes no sample (and the server has none)",
    "flat_logprobs": "the container vLLM returns log-probs in; the server returns one float per token",
    "output_text_buffer_length": "text buffering for stop strings",
    "watermarking": "applies the engine's configured watermark; the tlt backend configures none",
}


def _unset(value) -> bool:
    return value is None


def _empty(value) -> bool:
    return value is None or len(value) == 0


# Settings the engine does not reproduce: accepted at vLLM's default (each test says which values are the default),
# refused with any other value. name: (is the default, vLLM's default, what the setting would need).
DEFAULT_ONLY_SETTINGS = {
    "n": (lambda v: v is None or v == 1, 1, "one completion per request (veRL sends rollout.n requests per prompt)"),
    "best_of": (lambda v: v is None or v == 1, None, "one completion per request"),
    "presence_penalty": (lambda v: v is None or v == 0, 0.0,
                         "a presence penalty, which its sampling and verification do not implement"),
    "frequency_penalty": (lambda v: v is None or v == 0, 0.0,
                          "a frequency penalty, which its sampling and verification do not implement"),
    "seed": (lambda v: v is None or v == -1, None,
             "per-request seeds: every request of a batch draws from the replica's generator (seeded by "
             "tlt.seed + replica rank); turn off rollout.full_determinism"),
    "stop": (_empty, [], "stop strings, which need detokenization; stop on token ids with stop_token_ids"),
    "min_tokens": (lambda v: v is None or v == 0, 0, "masking EOS before min_tokens"),
    "logit_bias": (_empty, None, "logit biases"),
    "allowed_token_ids": (_unset, None, "a restricted vocabulary"),
    "bad_words": (_empty, [], "banned words"),
    "logits_processors": (_empty, None, "custom logits processors"),
    "structured_outputs": (_unset, None, "structured outputs"),
    "guided_decoding": (_unset, None, "guided decoding"),
    "prompt_logprobs": (_unset, None, "prompt log-probs"),
    "prompt_logprob_token_ids": (_unset, None, "prompt log-probs"),
    "prompt_logprob_start": (_unset, None, "prompt log-probs"),
    "logprob_token_ids": (_unset, None, "log-probs of chosen tokens (it returns the sampled token's only)"),
    "truncate_prompt_tokens": (_unset, None, "prompt truncation"),
    "thinking_token_budget": (_unset, None, "a thinking budget"),
    "repetition_detection": (_unset, None, "repetition detection"),
    "extra_args": (_empty, None, "extra arguments for custom processors"),
    "routed_experts_prompt_start": (lambda v: v is None or v == 0, 0, "MoE routing replay"),
    "trace_decode_token_ids": (_unset, None, "decode tracing"),
}


@dataclass(frozen=True)
class RequestSampling:
    """One request's sampling settings, validated, with vLLM's meaning (see :func:`parse_sampling_params`).

    ``law`` is the next-token distribution (the engine's settings, with ``model.generate``'s meaning); requests with
    the same law share a batch. ``stop_token_ids`` are the request's own stop tokens (EOS is added by the server
    unless ``ignore_eos``); ``max_tokens`` is already capped at the server's response_length.
    """

    law: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: bool = False


def _number(params: dict, key: str, default, kind=float):
    value = params.get(key)
    if value is None:
        return default
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"sampling_params[{key!r}]={value!r} is not a number.") from None
    if kind is int and number != value:
        raise ValueError(f"sampling_params[{key!r}]={value!r} must be an integer.")
    if not math.isfinite(number):
        raise ValueError(f"sampling_params[{key!r}]={value!r} must be finite.")
    return number


def parse_sampling_params(params: dict, response_length: int, default_max_tokens: int | None = None) -> RequestSampling:
    """veRL's sampling_params for one request (vLLM's SamplingParams fields), checked and converted.

    Honoured as vLLM (with veRL's vLLM server around it) does: temperature (0 = greedy, (0, 0.01) raised to 0.01),
    top_p, top_k (0 or -1 = off), min_p, repetition_penalty (on the prompt's and the completion's tokens), max_tokens
    (or sglang's max_new_tokens; default and cap: the server's response_length; below 1: 1, as veRL clamps it),
    stop_token_ids (the completion ends with the first one, kept), ignore_eos (EOS tokens do not end the
    completion) and logprobs (truthy: the sampled tokens' log-probs, as veRL's vLLM server returns them whatever
    the number). :data:`IGNORED_SETTINGS` change no token and are accepted as they are; :data:`DEFAULT_ONLY_SETTINGS`
    are accepted at vLLM's default only; any other key or value is refused with a ValueError that names it.
    """
    for key, value in params.items():
        if key in HONOURED_SETTINGS or key in IGNORED_SETTINGS:
            continue
        if key in DEFAULT_ONLY_SETTINGS:
            is_default, default, needs = DEFAULT_ONLY_SETTINGS[key]
            if not is_default(value):
                raise ValueError(f"sampling_params[{key!r}]={value!r}: the tlt rollout backend does not do {needs}. "
                                 f"Leave it at vLLM's default ({default!r}), or use "
                                 "actor_rollout_ref.rollout.name=vllm.")
            continue
        raise ValueError(f"sampling_params[{key!r}]: a setting the tlt rollout backend does not know. It honours "
                         f"{list(HONOURED_SETTINGS)}, ignores {sorted(IGNORED_SETTINGS)} (they change no token) and "
                         f"accepts {sorted(DEFAULT_ONLY_SETTINGS)} at vLLM's defaults only; for other settings use "
                         "actor_rollout_ref.rollout.name=vllm.")

    temperature = _number(params, "temperature", 1.0)
    if temperature < 0:
        raise ValueError(f"sampling_params['temperature']={temperature} must be >= 0 (0 is greedy).")
    if 0 < temperature < _MIN_TEMPERATURE:
        temperature = _MIN_TEMPERATURE
    top_p = _number(params, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"sampling_params['top_p']={top_p} must be in (0, 1] (1 is off).")
    top_k = _number(params, "top_k", 0, int)
    if top_k < -1:
        raise ValueError(f"sampling_params['top_k']={top_k} must be 0 or -1 (off), or at least 1.")
    min_p = _number(params, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"sampling_params['min_p']={min_p} must be in [0, 1] (0 is off).")
    repetition_penalty = _number(params, "repetition_penalty", 1.0)
    if not repetition_penalty > 0:
        raise ValueError(f"sampling_params['repetition_penalty']={repetition_penalty} must be > 0 (1 is off).")
    greedy = temperature < _GREEDY_BELOW
    if greedy:  # vLLM ignores these when greedy
        top_p, top_k, min_p = 1.0, 0, 0.0
    if min_p > 0 and top_p < 1.0:
        # vLLM filters min_p before top-p, the engine (as transformers' generate) after it: not the same law.
        # With top-k alone the two orders keep the same tokens (both filters keep the highest logits).
        raise ValueError(f"sampling_params min_p={min_p} with top_p={top_p}: vLLM applies min_p before top-p and "
                         "the tlt rollout backend after it, which samples a different distribution. Use one of the "
                         "two, or actor_rollout_ref.rollout.name=vllm.")
    law = SamplingParams(do_sample=not greedy, temperature=1.0 if greedy else temperature, top_k=max(top_k, 0),
                         top_p=top_p, min_p=min_p if min_p > 0 else None, repetition_penalty=repetition_penalty)

    limit_key = "max_tokens" if params.get("max_tokens") is not None else "max_new_tokens"
    default = response_length if default_max_tokens is None else default_max_tokens
    max_tokens = _number(params, limit_key, default, int)
    max_tokens = max(1, min(max_tokens, response_length))  # veRL's vLLM server clamps below at 1
    stop_token_ids = params.get("stop_token_ids") or ()
    if isinstance(stop_token_ids, int):
        stop_token_ids = (stop_token_ids,)
    try:
        stop_token_ids = frozenset(int(t) for t in stop_token_ids)
    except (TypeError, ValueError):
        raise ValueError(f"sampling_params['stop_token_ids']={params['stop_token_ids']!r} must be a list of "
                         "token ids.") from None
    return RequestSampling(law, max_tokens, stop_token_ids, bool(params.get("ignore_eos") or False),
                           bool(params.get("logprobs") or False))


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: RequestSampling
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)


def left_pad(prompts: list[list[int]], pad_id: int, own_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask. ``own_token``: pad each row with its own first token instead of ``pad_id``, so the
    row's tokens (padding included, which the repetition penalty counts as generate does) are its prompt's only."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if own_token:
            ids[row, : width - len(prompt)] = prompt[0]
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def cut_completion(tokens: list[int], stop_ids: frozenset[int] | set[int], max_tokens: int) -> tuple[list[int], str]:
    """A request's completion from the engine's row (which may run past the request's own stops and limit) and the
    stop reason: "completed" when it ends on a stop token (vLLM's finish_reason "stop", EOS included, also on the
    last allowed token), "length" when it reached ``max_tokens`` (vLLM's "length")."""
    for i, token in enumerate(tokens[:max_tokens]):
        if token in stop_ids:
            return tokens[: i + 1], "completed"
    if len(tokens) < max_tokens:
        raise RuntimeError(f"The engine ended a row after {len(tokens)} tokens on no stop token of the request "
                           f"(limit {max_tokens}).")
    return tokens[:max_tokens], "length"


class TLTRolloutServer:
    """Speculative rollouts for one replica (a Ray actor created by :class:`~.replica.TLTReplica`)."""

    def __init__(self, model_path: str, settings: dict | TLTSection, response_length: int, max_num_seqs: int = 1024,
                 replica_rank: int = 0, tokenizer_path: str | None = None, trust_remote_code: bool = False,
                 prompt_length: int | None = None, logprobs_mode: str = "processed_logprobs"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.settings = TLTSection.from_mapping(settings)
        self.replica_rank = replica_rank
        self.response_length = int(response_length)
        # veRL's rollout.prompt_length: a request without max_tokens gets what is left of prompt + response length
        # (as veRL's vLLM server computes it, for multi-turn prompts that grow), capped at response_length.
        self.prompt_length = None if prompt_length is None else int(prompt_length)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"actor_rollout_ref.rollout.logprobs_mode={logprobs_mode!r}: the tlt rollout backend "
                             f"returns {' or '.join(LOGPROBS_MODES)} (log-probs of the sampled tokens); set one of "
                             "them, or use actor_rollout_ref.rollout.name=vllm.")
        self.logprobs_mode = logprobs_mode
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
        # As vLLM: the tokenizer's EOS and the generation config's EOS tokens all end a completion.
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        self.eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in self.eos_ids:
            self.eos_ids.append(tokenizer.eos_token_id)
        if not self.eos_ids:
            raise ValueError(f"{model_path} defines no EOS token (generation_config or tokenizer); the tlt rollout "
                             "needs one to end completions.")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

        self.drafter, self.trainer = self._make_drafter()
        # An EAGLE-3 drafter learns the policy's next-token law, which one forward over each batch's rollouts gives
        # (the engine's sink hands features and the sampled tokens only): drafter_targets
        self._learns_law = self.trainer is not None and learns_law_by_forward(self.drafter,
                                                                               self.settings.drafter_targets)
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
        """veRL's server API: one request in, its completion's token ids out (the stop token included, as vLLM
        returns them). ``sampling_params`` as :func:`parse_sampling_params` reads them: a setting the server cannot
        honour raises a ValueError here, before the request is queued."""
        if image_data or video_data or kwargs.get("audio_data"):
            raise ValueError("The tlt rollout serves text-only causal LMs; multimodal requests need "
                             "actor_rollout_ref.rollout.name=vllm or sglang.")
        if not prompt_ids:
            raise ValueError(f"Request {request_id}: empty prompt.")
        budget = None
        if self.prompt_length is not None:
            budget = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        sampling = parse_sampling_params(dict(sampling_params or {}), self.response_length, budget)
        self._interrupt.set()
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(map(int, prompt_ids)), sampling, future))
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
            groups: dict[SamplingParams, list[_Request]] = {}
            for request in batch:
                groups.setdefault(request.sampling.law, []).append(request)
            async with self._lock:
                for law, requests in groups.items():
                    start = time.perf_counter()
                    try:
                        outputs = await asyncio.to_thread(self._run_batch, law,
                                                          [(r.prompt_ids, r.sampling) for r in requests])
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

    def _run_batch(self, law: SamplingParams, requests: list[tuple[list[int], RequestSampling]]) -> list:
        """One engine batch for requests with the same law; each request's own stop tokens and length limit cut its
        row afterwards.

        The engine stops a row on the stop tokens all requests share and runs to the longest limit; a request whose
        own stop token or limit comes first takes its row's prefix up to it. That prefix has the law a run with the
        request's own settings samples (a token's distribution depends on the tokens before it only).
        """
        from verl.workers.rollout.replica import TokenOutput

        prompts = [prompt for prompt, _ in requests]
        stops = [self._stop_ids(sampling) for _, sampling in requests]
        common = frozenset.intersection(*stops)
        # Repetition penalty: pad each row with its own prompt token, so it penalizes the prompt's tokens only (as
        # vLLM does), never a pad token the prompt does not have.
        ids, mask = left_pad(prompts, self.pad_id, own_token=law.uses_presence)
        ids, mask = ids.to(self.device), mask.to(self.device)
        sink = self.trainer.add_features if self.trainer is not None and not self._learns_law else None
        with torch.no_grad():
            result = self.engine.generate(ids, attention_mask=mask,
                                          max_new_tokens=max(sampling.max_tokens for _, sampling in requests),
                                          do_sample=law.do_sample, temperature=law.temperature, top_k=law.top_k,
                                          top_p=law.top_p, min_p=law.min_p, repetition_penalty=law.repetition_penalty,
                                          eos_token_id=sorted(common), pad_token_id=self.pad_id,
                                          generator=self.generator, feature_sink=sink)
        if self._learns_law:
            self.trainer.add_token_rows(result.token_rows(mask))
        self.counters.add(result.stats)
        self.rows_served += len(prompts)
        outputs = []
        rows = result.sequences[:, ids.shape[1]:].tolist()
        for (prompt, sampling), stop_ids, row in zip(requests, stops, rows, strict=True):
            completion, stop_reason = cut_completion(row, stop_ids, sampling.max_tokens)
            logprobs = self._logprobs(prompt, completion, law) if sampling.logprobs else None
            outputs.append(TokenOutput(token_ids=completion, log_probs=logprobs, stop_reason=stop_reason,
                                       extra_fields={"tlt_replica": self.replica_rank}))
        return outputs

    def _stop_ids(self, sampling: RequestSampling) -> frozenset[int]:
        """The tokens that end this request's completion: its stop_token_ids, and EOS unless ignore_eos (vLLM)."""
        return sampling.stop_token_ids if sampling.ignore_eos else sampling.stop_token_ids | frozenset(self.eos_ids)

    @torch.no_grad()
    def _logprobs(self, prompt: list[int], completion: list[int], law: SamplingParams,
                  chunk: int = 256) -> list[float]:
        """Log-probabilities of the sampled tokens under the distribution each was drawn from: log_softmax of the
        scores after the repetition penalty (prompt and earlier completion tokens), temperature, top-k, top-p and
        min-p, the engine's own processing (:func:`process_logits`). Greedy requests: after the penalty only.

        That is what veRL's vLLM rollout returns: veRL starts vLLM with ``logprobs_mode=processed_logprobs``
        (``rollout.logprobs_mode``'s default; vLLM's own default, ``raw_logprobs``, would be the model's
        unprocessed log-softmax) and keeps the sampled token's entry. They come from one extra policy forward over
        prompt and completion, so they differ from the sampling pass's by float rounding only.

        With ``rollout.logprobs_mode=raw_logprobs`` (vLLM's own default): the log-softmax of the model's logits,
        before any processing.
        """
        if not completion:
            return []
        full = torch.tensor(prompt + completion, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=full[None]).logits[0, len(prompt) - 1: -1]  # [T, V]: the scores of each token
        sampled = full[len(prompt):]
        if self.logprobs_mode == "raw_logprobs":
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, sampled[:, None])[:, 0]
            return logp.tolist()
        steps, vocab = logits.shape
        prompt_seen = first_generated = None
        if law.uses_presence:
            prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            prompt_seen[full[: len(prompt)]] = True
            # The step at which each token first appears in the completion (steps: never); the penalty of step t
            # covers the completion tokens before t.
            first_generated = torch.full((vocab,), steps, dtype=torch.long, device=self.device)
            first_generated.scatter_reduce_(0, sampled, torch.arange(steps, device=self.device), reduce="amin")
        out = []
        for begin in range(0, steps, chunk):
            end = min(begin + chunk, steps)
            presence = None
            if law.uses_presence:
                step = torch.arange(begin, end, device=self.device)[:, None]
                presence = prompt_seen[None] | (first_generated[None] < step)
            scores = process_logits(logits[begin:end], law, presence)
            logp = torch.log_softmax(scores, dim=-1).gather(-1, sampled[begin:end, None])[:, 0]
            out.extend(logp.float().tolist())
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
        """One training slice (:func:`~tlt_trainers.online.train_slice`), stopped by a new request. In idle time the
        engine first times the passes it has not timed yet (free here), within the slice's ``max_seconds``."""
        start = time.perf_counter()
        costs_timed = []
        if not at_least_one:
            costs_timed = self.engine.measure_costs(IDLE_COST_TIMING_SHARE * max_seconds, self._interrupt.is_set)
        metrics = train_slice(self.trainer, max_seconds - (time.perf_counter() - start),
                              max_steps=self.settings.drafter_max_steps_per_update, at_least_one=at_least_one,
                              interrupted=self._interrupt.is_set, rebuild_draft_vocab=not self._draft_vocab_ready)
        if metrics:  # the slice ran, so the draft vocabulary has been chosen
            self._draft_vocab_ready = True
        self.steps_since_sync += metrics.get("steps", 0)
        return {**metrics, "costs_timed": costs_timed}

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

    # ------------------------------------------------------------------ memory kept between batches
    async def release_engine_memory(self) -> dict:
        """Give back what the engine keeps between batches (its graph session: the policy's and the drafter's KV
        caches, the features buffer, the graphs' static tensors and, on CUDA, their memory pools), unless
        ``tlt.keep_engine_memory``; after the batch in progress, if one is. On CUDA the freed blocks go back to the
        device (``torch.cuda.empty_cache``): this server is a process of its own, and the trainer's workers beside
        it on the device can use only what its allocator returns. The next batch allocates and captures again.
        Returns what was freed (:class:`~tlt_trainers.rollout.memory.Release` as a dict; empty when kept)."""
        if self.settings.keep_engine_memory:
            return {}
        async with self._lock:
            release = give_back(self.engine, empty_cache=True)
        return dataclasses.asdict(release)

    async def engine_memory(self) -> int:
        """Bytes the engine keeps between batches now (:meth:`SpeculativeGenerator.held_bytes`)."""
        return self.engine.held_bytes()

    # ------------------------------------------------------------------ RolloutReplica's control calls
    async def wake_up(self):
        """Nothing to restore: the weights never leave this server (the actor's ``update_weights`` copies new ones
        into them), and the engine allocates its cache and captures its graphs again at the next batch."""

    async def sleep(self):
        """veRL calls it after each rollout, before the training step: gives back what the engine keeps between
        batches (:meth:`release_engine_memory`) unless ``tlt.keep_engine_memory``. The weights stay resident."""
        await self.release_engine_memory()

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
        """Nothing to clear: the engine keeps no prefix cache, and each batch starts with empty rows (a kept cache's
        rows are reset when the next batch takes it). Its memory is given back by :meth:`sleep` and
        :meth:`release_kv_cache`."""

    async def release_kv_cache(self):
        """veRL calls it before a weight sync: gives back what the engine keeps between batches, as :meth:`sleep`
        does (unless ``tlt.keep_engine_memory``); the weights stay where the sync writes them."""
        await self.release_engine_memory()

    async def resume_kv_cache(self):
        """Nothing to restore: the next batch allocates the engine's cache again (see :meth:`wake_up`)."""

    async def start_profile(self, **kwargs):
        """Profiling is not wired for the tlt rollout; the trainer's timing metrics cover it."""

    async def stop_profile(self):
        """See :meth:`start_profile`."""
