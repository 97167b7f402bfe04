"""The exact next-token distribution that Hugging Face ``generate`` samples from.

Speculative decoding is lossless only if the verifier's target distribution is the one plain
decoding would have used: the same logits processors, in the same order, in float32. We reuse
transformers' own warper classes and mirror ``RepetitionPenaltyLogitsProcessor`` with a
presence mask, because verification needs the penalty at several positions of one row at once.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def _above(limit):
    return lambda value: value is not None and value > limit


def _set(value) -> bool:
    return value is not None


def _nonempty(value) -> bool:
    return value is not None and len(value) > 0


def _open_unit(value) -> bool:
    return value is not None and 0.0 < value < 1.0


# generate() settings that change what is sampled and that the engine does not reproduce: for each, when
# ``GenerationMixin._get_logits_processor`` (or the decoding mode) makes it take effect, and the value that
# switches it off. None means "not set" in every transformers release we support.
_UNSUPPORTED_GENERATION_KEYS = {
    "num_beams": (_above(1), 1),
    "num_return_sequences": (_above(1), 1),
    "no_repeat_ngram_size": (_above(0), 0),
    "bad_words_ids": (_nonempty, None),
    "min_length": (_above(0), 0),
    "min_new_tokens": (_above(0), None),
    "forced_bos_token_id": (_set, None),
    "forced_eos_token_id": (_set, None),
    "suppress_tokens": (_nonempty, None),
    "begin_suppress_tokens": (_nonempty, None),
    "sequence_bias": (_nonempty, None),
    "encoder_repetition_penalty": (lambda v: v is not None and v != 1.0, 1.0),
    "exponential_decay_length_penalty": (_set, None),
    "guidance_scale": (lambda v: v is not None and v != 1, None),
    "watermarking_config": (_set, None),
    "top_h": (_set, None),
    "typical_p": (lambda v: v is not None and v < 1.0, 1.0),
    "epsilon_cutoff": (_open_unit, 0.0),
    "eta_cutoff": (_open_unit, 0.0),
    "renormalize_logits": (lambda v: v is True, False),
    "remove_invalid_values": (lambda v: v is True, False),
    # Decoding modes and stopping rules that change what generate() returns without a logits processor.
    "stop_strings": (_nonempty, None),
    "max_time": (_set, None),
    "penalty_alpha": (_above(0), None),
    "dola_layers": (_set, None),
    "prompt_lookup_num_tokens": (_set, None),
    "assistant_early_exit": (_set, None),
    "num_beam_groups": (_above(1), 1),
    "token_healing": (lambda v: v is True, False),
}


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings accepted by the engine; each has the meaning it has in ``model.generate``."""

    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature} must be > 0 when do_sample=True; use do_sample=False for greedy."
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be a non-negative int (0 disables top-k).")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1.0 disables nucleus sampling).")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1] or None.")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 disables it).")

    @property
    def uses_presence(self) -> bool:
        return self.repetition_penalty != 1.0

    def warpers(self) -> LogitsProcessorList:
        """The sampling-only processors, built exactly as ``GenerationMixin._get_logits_processor`` does."""
        warpers = LogitsProcessorList()
        if not self.do_sample:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        if self.min_p is not None:
            warpers.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        return warpers

    def structure(self) -> tuple:
        """What of these settings shapes the ops that sample (which warpers run, top-k's width), not their values:
        the part a CUDA graph of a step must be keyed by when the values come from :class:`SamplingScalars`."""
        if not self.do_sample:
            return (False, self.uses_presence)
        return (True, self.top_k, self.top_p < 1.0, self.min_p is not None, self.uses_presence)


class _ScalarTemperature(TemperatureLogitsWarper):
    """``TemperatureLogitsWarper`` dividing by a device scalar: bit for bit what ``scores / temperature`` gives with
    a Python float. On CPU that is a true division; CUDA's kernel, given a host scalar, multiplies by its float32
    reciprocal instead (``div_true_kernel_cuda``), which a 0-dim device tensor would not, so on CUDA this multiplies
    by the reciprocal computed as that kernel does."""

    def __init__(self, scalars: SamplingScalars):
        self.scalars = scalars

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        if scores.device.type == "cuda":
            return scores * self.scalars.inverse_temperature
        return scores / self.scalars.temperature


class _ScalarTopP(TopPLogitsWarper):
    """``TopPLogitsWarper`` whose cut ``1 - top_p`` is a device scalar (float32 of the float64 difference, what the
    comparison with a Python float uses); the same ops as transformers' ``__call__`` otherwise."""

    def __init__(self, scalars: SamplingScalars):
        super().__init__(top_p=0.5, min_tokens_to_keep=1)  # the value is read from ``scalars`` at each call
        self.scalars = scalars

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_indices_to_remove = cumulative_probs <= self.scalars.top_p_cut
        sorted_indices_to_remove[..., -self.min_tokens_to_keep :] = 0
        indices_to_remove = sorted_indices_to_remove.scatter(1, sorted_indices, sorted_indices_to_remove)
        return scores.masked_fill(indices_to_remove, self.filter_value)


class _ScalarMinP(MinPLogitsWarper):
    """transformers' ``MinPLogitsWarper`` itself, its ``min_p`` a float32 device scalar (``min_p * top_probs`` with
    a Python float multiplies by its float32 value too)."""

    def __init__(self, scalars: SamplingScalars):
        super().__init__(min_p=0.5, min_tokens_to_keep=1)  # replaced by the device scalar
        self.min_p = scalars.min_p


class SamplingScalars:
    """The sampling values a CUDA graph of a step reads from device memory instead of baking them in: temperature
    (and its float32 reciprocal), top-p's cut and min-p. A graph session keeps one; each ``generate()`` call
    ``fill``s it before its steps (outside any graph), so a call with another temperature, top-p or min-p replays
    the graphs an earlier call captured. Whether top-p and min-p run (and top-k's width, a shape) stays in the
    graph's key (:meth:`SamplingParams.structure`); the temperature always runs when sampling (at 1.0 it changes
    no bit: x / 1 and x * 1 are x), so T=1 and T=0.7 share graphs."""

    def __init__(self, device: torch.device | str):
        self.values = torch.ones(4, dtype=torch.float32, device=device)
        self.temperature, self.inverse_temperature, self.top_p_cut, self.min_p = self.values.unbind(0)
        self._filled: tuple | None = None

    def fill(self, params: SamplingParams) -> None:
        """Write ``params``' values (one host-to-device copy, skipped when they did not change)."""
        filled = (params.temperature, params.top_p, params.min_p)
        if filled == self._filled:
            return
        temperature = torch.tensor(float(params.temperature), dtype=torch.float32)
        host = torch.stack([temperature, torch.ones((), dtype=torch.float32) / temperature,  # float32 1 / float32 T
                            torch.tensor(1 - params.top_p, dtype=torch.float32),
                            torch.tensor(0.0 if params.min_p is None else params.min_p, dtype=torch.float32)])
        self.values.copy_(host)
        self._filled = filled

    def warpers(self, params: SamplingParams) -> LogitsProcessorList:
        """``params.warpers()`` with the values read from these scalars (which ``fill(params)`` wrote): the same
        scores bit for bit. The temperature warper runs at 1.0 too (dividing by 1 is exact), so that its presence
        does not depend on a value."""
        warpers = LogitsProcessorList()
        if not params.do_sample:
            return warpers
        warpers.append(_ScalarTemperature(self))
        if params.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
        if params.top_p < 1.0:
            warpers.append(_ScalarTopP(self))
        if params.min_p is not None:
            warpers.append(_ScalarMinP(self))
        return warpers


def unsupported_generation_setting(generation_config) -> tuple[str, object, object] | None:
    """The first setting of ``generation_config`` that makes ``generate`` do something the engine does not
    reproduce, as (name, value, the value that switches it off); None if there is none."""
    if generation_config is None:
        return None
    for key, (takes_effect, neutral) in _UNSUPPORTED_GENERATION_KEYS.items():
        value = getattr(generation_config, key, None)
        if takes_effect(value):
            return key, value, neutral
    return None


def check_generation_config(generation_config) -> None:
    """Refuse a model whose generation_config would make ``generate`` apply processors we do not mirror."""
    unsupported = unsupported_generation_setting(generation_config)
    if unsupported is not None:
        key, value, neutral = unsupported
        raise ValueError(
            f"The model's generation_config sets {key}={value!r}, which SpeculativeGenerator does not "
            f"reproduce; set model.generation_config.{key} = {neutral!r} (and pass it to model.generate "
            "too) so both sample from the same distribution."
        )


def effective_generation_config(config: GenerationConfig | None, model) -> GenerationConfig:
    """The settings ``model.generate(generation_config=config)`` really uses, by transformers' own merge rules:
    what ``config`` sets, then the model's ``generation_config``, then transformers' global defaults (top_k 50)."""
    config = GenerationConfig() if config is None else copy.deepcopy(config)
    model_config = getattr(model, "generation_config", None)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:  # transformers >= 5: unset (None) values come from the model, then global defaults
        if model_config is not None:
            config.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
        config.update(**defaults(), defaults_only=True)
    elif model_config is not None:  # transformers 4.x: values left at the global default take the model's value
        reference = GenerationConfig()
        for key, value in model_config.__dict__.items():
            if key.startswith("_") or key == "transformers_version":
                continue
            default = getattr(reference, key, None)
            if getattr(config, key, None) == default and value != default:
                setattr(config, key, value)
    return config


SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# The value that switches each setting off, where a config leaves it None (min_p: None already means off).
NEUTRAL_SAMPLING = {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}


def resolve_sampling(model, **settings) -> SamplingParams:
    """The sampling law of ``model.generate(**settings)``: each setting passed as None (unset) takes the value
    ``generate`` would use, from the model's ``generation_config`` and then transformers' defaults. So an engine
    call and a ``generate`` call with the same arguments sample the same law (``do_sample=True`` alone means
    top-k 50 unless the model's config says otherwise, as in ``generate``)."""
    unknown = set(settings) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"resolve_sampling: unknown settings {sorted(unknown)}; known: {SAMPLING_FIELDS}.")
    resolved = effective_generation_config(None, model)
    values = {}
    for name in SAMPLING_FIELDS:
        value = settings.get(name)
        values[name] = getattr(resolved, name, None) if value is None else value
    for name, value in NEUTRAL_SAMPLING.items():
        if values[name] is None:
            values[name] = value
    # generate() ignores the warpers when greedy; so does the engine (SamplingParams.warpers).
    return SamplingParams(**values)  # validates explicit values as given (a float top_k is refused, not rounded)


def apply_repetition_penalty(scores: torch.Tensor, presence: torch.Tensor, penalty: float) -> torch.Tensor:
    """``RepetitionPenaltyLogitsProcessor`` on a [N, V] presence mask instead of [N, L] token ids."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(presence, penalized, scores)


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    presence: torch.Tensor | None = None,
    warpers: LogitsProcessorList | None = None,
) -> torch.Tensor:
    """Scores [..., V] exactly as generate() hands them to softmax/argmax (float32, -inf where filtered).

    ``presence`` [..., V] marks the tokens seen so far in each row (prompt, padding and generated tokens,
    as ``input_ids`` holds them in generate) and is needed only for repetition_penalty.
    """
    shape = logits.shape
    scores = logits.reshape(-1, shape[-1]).to(torch.float32)
    if params.uses_presence:
        if presence is None:
            raise ValueError("repetition_penalty needs the presence mask of each row's tokens.")
        scores = apply_repetition_penalty(scores, presence.reshape(-1, shape[-1]), params.repetition_penalty)
    warpers = params.warpers() if warpers is None else warpers
    for warper in warpers:
        # Warpers ignore input_ids; generate passes them only for the interface.
        scores = warper(None, scores)
    return scores.reshape(shape)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` [N, V] (unnormalised is fine) by inverse CDF.

    The uniforms come from ``generator`` on its own device, so a CPU generator drives a CUDA run
    reproducibly.
    """
    return inverse_cdf(probs, uniform((probs.shape[0],), probs.device, generator))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token of each row of ``probs`` [N, V] (unnormalised) at which the CDF first exceeds ``u`` [N] in [0, 1)."""
    cdf = probs.to(torch.float32).cumsum(-1)
    total = cdf[:, -1:]
    index = torch.searchsorted(cdf, u.to(cdf.device, torch.float32)[:, None] * total, right=True)
    return index.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


class UniformStream:
    """A step's uniforms drawn in one go (``refill``), handed out column by column to the sampling functions that
    would draw them one call at a time: what a CUDA graph of a whole step reads, so that the graph owns no random
    generator (one launch fills the buffer before each replay). Every uniform is used once: the same law as
    drawing each from the generator."""

    def __init__(self, rows: int, columns: int, device: torch.device | str, buffer: torch.Tensor | None = None):
        self.buffer = torch.zeros(rows, columns, device=device) if buffer is None else buffer
        self.cursor = 0

    def first_rows(self, rows: int) -> UniformStream:
        """A stream over this one's first ``rows`` rows (the same memory: a smaller batch bucket's graphs)."""
        return UniformStream(rows, self.buffer.shape[1], self.buffer.device, buffer=self.buffer[:rows])

    def refill(self, generator: torch.Generator | None, reset_only: bool = False) -> None:
        """New uniforms for the next step, from ``generator`` (on its own device); with ``reset_only`` the same
        ones again (a step run twice: a graph's capture check)."""
        self.cursor = 0
        if reset_only:
            return
        gen_device = generator.device if generator is not None else self.buffer.device
        if gen_device == self.buffer.device:
            torch.rand(self.buffer.shape, generator=generator, device=gen_device, out=self.buffer)
        else:
            self.buffer.copy_(torch.rand(self.buffer.shape, generator=generator, device=gen_device),
                              non_blocking=True)
        self.cursor = 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Uniforms of ``shape`` ([B], [B, k], or [B * k]: k draws per row, row-major; B the buffer's rows): the
        next unused columns."""
        rows = self.buffer.shape[0]
        if len(shape) > 2 or shape[0] % rows or (len(shape) == 2 and shape[0] != rows):
            raise ValueError(f"UniformStream of {tuple(self.buffer.shape)} cannot give uniforms of shape {shape}.")
        width = shape[1] if len(shape) == 2 else shape[0] // rows
        if self.cursor + width > self.buffer.shape[1]:
            raise RuntimeError(f"UniformStream: a step asked for more than its {self.buffer.shape[1]} uniforms a row.")
        out = self.buffer[:, self.cursor : self.cursor + width]
        self.cursor += width
        return out if len(shape) == 2 else out.reshape(-1)


def uniform(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | UniformStream | None
            ) -> torch.Tensor:
    if isinstance(generator, UniformStream):
        return generator.take(shape)
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)
