"""Exact sampling: the distribution ``model.generate`` samples from, and lossless verification of drafts
(chain rejection sampling, draft trees). Pure functions of tensors; torch and transformers' logits processors only.
"""

from .chain import ChainVerdict, verify_greedy, verify_sampled, verify_sampled_with_uniforms
from .distribution import SamplingParams, process_logits, sample_categorical
from .tree import DraftTree, TreeVerdict, verify_tree

__all__ = [
    "ChainVerdict",
    "DraftTree",
    "SamplingParams",
    "TreeVerdict",
    "process_logits",
    "sample_categorical",
    "verify_greedy",
    "verify_sampled",
    "verify_sampled_with_uniforms",
    "verify_tree",
]
