"""Pure functions of speculative decoding: the target distribution and chain rejection sampling."""

from .rejection import ChainVerdict, verify_greedy, verify_sampled, verify_sampled_with_uniforms
from .sampling import SamplingParams, process_logits, sample_categorical

__all__ = [
    "ChainVerdict",
    "SamplingParams",
    "process_logits",
    "sample_categorical",
    "verify_greedy",
    "verify_sampled",
    "verify_sampled_with_uniforms",
]
