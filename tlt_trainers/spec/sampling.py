"""The exact next-token distribution that Hugging Face ``generate`` samples from.

Speculative decoding is lossless only if the verifier's target distribution is the one plain
decoding would have used: the same logits processors, in the same order, in float32. We reuse
transformers' own warper classes and mirror ``RepetitionPenaltyLogitsProcessor`` with a
presence mask, because verification needs the penalty at several positions of one row at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# generate() keys that change what is sampled and that the engine does not reproduce.
_UNSUPPORTED_GENERATION_KEYS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "encoder_repetition_penalty": 1.0,
    "exponential_decay_length_penalty": None,
    "guidance_scale": None,
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "renormalize_logits": False,
    "remove_invalid_values": False,
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


def check_generation_config(generation_config) -> None:
    """Refuse a model whose generation_config would make ``generate`` apply processors we do not mirror."""
    if generation_config is None:
        return
    for key, neutral in _UNSUPPORTED_GENERATION_KEYS.items():
        value = getattr(generation_config, key, neutral)
        if value is not None and value != neutral and not (neutral is None and value in ([], 0)):
            raise ValueError(
                f"The model's generation_config sets {key}={value!r}, which SpeculativeGenerator does not "
                f"reproduce; set model.generation_config.{key} = {neutral!r} (and pass it to model.generate "
                "too) so both sample from the same distribution."
            )


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
    cdf = probs.to(torch.float32).cumsum(-1)
    total = cdf[:, -1:]
    gen_device = generator.device if generator is not None else cdf.device
    u = torch.rand((probs.shape[0], 1), generator=generator, device=gen_device).to(cdf.device)
    index = torch.searchsorted(cdf, u * total, right=True)
    return index.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def uniform(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device).to(device)
