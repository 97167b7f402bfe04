"""The rollout's drafter and its trainer, built the same way by the TRL trainer and the veRL rollout server."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..drafter.base import Drafter
from ..drafter.eagle import EagleDrafter
from ..drafter.eagle3 import Eagle3Drafter
from ..drafter.registry import kind_named, kind_of
from ..drafter.trainer import DrafterTrainer
from ..modeling.target import compute_dtype, text_config
from ..shipped import shipped_drafter_for

DRAFT_VOCAB_THRESHOLD, DEFAULT_DRAFT_VOCAB = 8192, 4096


def draft_vocab_size(requested: int | None, vocab: int) -> int | None:
    """The drafter's output vocabulary: ``None`` picks 4096 tokens for vocabularies over 8192 (a small head drafts
    faster and learns the frequent tokens first), 0 or a size >= ``vocab`` the full vocabulary (returned as None)."""
    size = requested
    if size is None:
        size = DEFAULT_DRAFT_VOCAB if vocab > DRAFT_VOCAB_THRESHOLD else 0
    return size if 0 < size < vocab else None


EAGLE3_MIN_LAYERS = 6


ENGINES = ("tlt", "vllm", "vllm-eagle1")


def drafter_class(policy: nn.Module, architecture: str, engine: str = "tlt") -> type[Drafter]:
    """The class of a fresh drafter: ``architecture`` 'eagle3' / 'eagle' / 'block', or 'auto' (EAGLE-3 where the
    policy has at least 6 Llama-style layers and ``engine`` serves it; EAGLE-1 elsewhere).

    ``engine``: 'tlt' (TLT's own engine) and 'vllm' (a colocated vLLM engine, ``VLLMDrafterSync``) serve both;
    'vllm-eagle1' (TRL's vLLM server mode, veRL's vLLM rollout) serves EAGLE-1 only.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: choose one of {ENGINES}.")
    if architecture != "auto":
        kind = kind_named(architecture)
        if engine == "vllm-eagle1" and not (kind.vllm is not None and kind.vllm.eagle1_compatible):
            raise ValueError(f"drafter_architecture={architecture!r} with this vLLM rollout (TRL's server mode or "
                             "veRL's vLLM rollout): it serves and reloads EAGLE-1 drafters; set "
                             "drafter_architecture='eagle' (or 'auto'), or use TLT's engine or TRL's colocated vLLM "
                             "engine (which serves EAGLE-3 and block drafters).")
        if engine == "vllm" and kind.vllm is None:
            raise ValueError(f"drafter_architecture={architecture!r}: vLLM serves no drafter of this kind (its "
                             "DrafterKind has no vllm method); use TLT's engine.")
        return kind.drafter_class
    if engine == "vllm-eagle1":
        return EagleDrafter
    layers = getattr(text_config(policy), "num_hidden_layers", 0) or 0
    deep = layers >= EAGLE3_MIN_LAYERS and getattr(policy.get_decoder(), "layers", None) is not None
    return Eagle3Drafter if deep else EagleDrafter


def starting_drafter(policy: nn.Module, settings: Any, engine: str = "tlt") -> str | None:
    """Where the rollout's drafter is loaded from: ``settings.drafter_name_or_path``, else the drafter shipped for
    ``policy`` of ``settings.drafter_architecture`` ('auto': the default shipped one; never for an ``engine`` that
    serves EAGLE-1 only), else None (a fresh one). 'fresh' forces None."""
    name = settings.drafter_name_or_path
    if name == "fresh":
        return None
    if name is not None:
        return name
    if engine == "vllm-eagle1":
        return None
    shipped = shipped_drafter_for(policy, getattr(settings, "drafter_architecture", "auto"))
    return None if shipped is None else str(shipped)


def rollout_drafter(policy: nn.Module, settings: Any, seed: int, rank: int = 0,
                    drafter: Drafter | None = None, engine: str = "tlt") -> tuple[Drafter, DrafterTrainer, bool]:
    """(drafter, its trainer, whether its draft vocabulary is ready) for a rollout engine over ``policy``.

    The drafter is ``drafter`` if given, else loaded from :func:`starting_drafter` (``drafter_name_or_path`` or the
    drafter shipped for this policy), else fresh from the policy (``settings.drafter_architecture`` for ``engine``
    'tlt' or 'vllm': see :func:`drafter_class`), seeded with ``seed`` so that every rank and replica starts from the
    same one (without touching the caller's RNG stream). A fresh drafter with a reduced vocabulary is not ready: its
    vocabulary is picked from the most frequent tokens of the first rollouts
    (``DrafterTrainer.rebuild_draft_vocab``), and so is a loaded one when ``settings.drafter_rebuild_draft_vocab``.
    ``settings`` has TLTGRPOConfig's drafter fields (``drafter_lr``,
    ``drafter_micro_batch_size``, ...); the trainer's data order is seeded with ``seed + rank``.
    """
    head = policy.get_output_embeddings().weight
    source = starting_drafter(policy, settings, engine) if drafter is None else None
    fresh = drafter is None and source is None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if drafter is not None:
            drafter = drafter.to(device=head.device, dtype=compute_dtype(policy)).bind(policy)
        elif source is not None:
            drafter = Drafter.from_pretrained(source, target=policy)
        else:
            kind = drafter_class(policy, getattr(settings, "drafter_architecture", "auto"), engine)
            requested = settings.draft_vocab_size
            if engine != "tlt" and kind is EagleDrafter and requested is None:
                requested = 0  # vLLM's EAGLE-1 drafter scores the full vocabulary: train the drafter it will serve
            drafter = kind.from_target(policy, draft_vocab_size=draft_vocab_size(requested, head.shape[0]))
    serving = kind_of(drafter).vllm
    if engine == "vllm-eagle1" and not (serving is not None and serving.eagle1_compatible):
        raise ValueError(f"This vLLM rollout (TRL's server mode or veRL's vLLM rollout) serves EAGLE-1 drafters, but "
                         f"the drafter is a {type(drafter).__name__}: start from an EagleDrafter (drafter_name_or_path "
                         "of one, or 'fresh'), or use TRL's colocated vLLM engine, which serves EAGLE-3.")
    drafter.eval()
    trainer = DrafterTrainer(drafter, policy, lr=settings.drafter_lr,
                             micro_batch_size=settings.drafter_micro_batch_size,
                             unroll_steps=settings.drafter_unroll_steps, buffer_bytes=settings.drafter_buffer_bytes,
                             precision=settings.drafter_precision, attention=settings.drafter_attention,
                             seed=seed + rank)
    rebuild = fresh or (source is not None and getattr(settings, "drafter_rebuild_draft_vocab", False))
    return drafter, trainer, not (rebuild and drafter.config.uses_draft_vocab)
