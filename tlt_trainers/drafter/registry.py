"""Drafter kinds as records: everything the package knows about one kind of drafter, registered in one place.

A kind is its :class:`~tlt_trainers.drafter.base.Drafter` subclass (which also checks its config), the name the
settings choose it by, the proposers it drafts with and the strategies those propose, its training loss, its
export per layout, how a vLLM engine serves it and which drafters ship for it. The engine, the trainers, export,
vLLM and the shipped drafters ask the registry; none of them names a kind. The built-in kinds (EAGLE-1, EAGLE-3,
block) are registered by :mod:`tlt_trainers.kinds`; a new kind is one :func:`register` call::

    from tlt_trainers.drafter.registry import DrafterKind, register

    register(DrafterKind(name="mine", drafter_class=MyDrafter, exports={"vllm": export_mine}))

This module sits at the bottom of ``drafter/``: the records carry callables, so it imports no kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import os

    import torch
    from torch import nn

    from .base import Drafter

# (drafter, out_dir, verifier_name_or_path, **kwargs) -> the folder written
Exporter = Callable[..., Path]
# (drafter, sampling, clock) -> (proposers keyed by Strategy.proposer, the one that catches the drafter up)
ProposerFactory = Callable[..., tuple[dict[str, Any], Any]]
# (trainer, micro-batch) -> (loss, metrics)
TrainingLoss = Callable[..., tuple["torch.Tensor", dict]]


@dataclass(frozen=True)
class VLLMServing:
    """How a vLLM engine serves a kind: its ``speculative_config`` method, the folder it starts from, and the
    weights it reloads in place.

    ``export(drafter, directory, policy, num_speculative_tokens, full_vocab_head)`` writes the folder vLLM loads;
    ``weights(drafter, directory, dtype, full_vocab_head)`` returns the state dict in vLLM's names (and may update
    side files in ``directory`` that vLLM's loader reads); ``max_drafts(drafter)`` bounds
    ``num_speculative_tokens`` (None: no bound of the kind's own).
    """

    method: str
    export: Callable[..., Any]
    weights: Callable[..., dict[str, torch.Tensor]]
    max_drafts: Callable[[Drafter], int] | None = None
    # Serves through every vLLM rollout, including those that reload EAGLE-1 only (TRL's server mode, veRL).
    eagle1_compatible: bool = False


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter.

    ``name``: what ``drafter_architecture`` chooses it by ('eagle3'). ``drafter_class``: the class, whose name is
    the ``architecture`` in the kind's config.json. ``proposers``: the factory of the engine's proposers for it;
    ``strategy_kinds`` the strategy kinds those propose ('chain' and 'tree' for a drafter of one token per pass,
    'block' for one of a block per pass). ``training_loss``: the loss :class:`~.trainer.DrafterTrainer` trains it
    with. ``exports``: layout -> exporter (:meth:`Drafter.export`). ``vllm``: how vLLM serves it (None: not served
    there). ``shipped``: folders of the drafters that ship for this kind (each with the fingerprint of the policy it
was trained for: :mod:`tlt_trainers.shipped`). ``auto_rank``: order
    in which ``drafter_architecture='auto'`` prefers shipped drafters (lowest first; None: never chosen by 'auto').
    ``model_card_tags``: the Hub tags of its model card.
    """

    name: str
    drafter_class: type[Drafter]
    proposers: ProposerFactory
    strategy_kinds: tuple[str, ...]
    training_loss: TrainingLoss
    exports: Mapping[str, Exporter] = field(default_factory=dict)
    vllm: VLLMServing | None = None
    shipped: tuple[Path, ...] = ()
    auto_rank: int | None = None
    model_card_tags: tuple[str, ...] = ()
    description: str = ""

    @property
    def architecture(self) -> str:
        return self.drafter_class.__name__

    @property
    def drafts_blocks(self) -> bool:
        return "block" in self.strategy_kinds

    def export(self, drafter: Drafter, out_dir: str | os.PathLike, layout: str, verifier_name_or_path=None,
               **export_kwargs) -> Path:
        exporter = self.exports.get(layout)
        if exporter is None:
            suggested = "vllm" if "vllm" in self.exports else next(iter(self.exports), None)
            fix = f"pass layout={suggested!r}" if suggested else "it has no export layout"
            raise ValueError(f"layout={layout!r}: a {self.architecture} exports to {sorted(self.exports)}: {fix} "
                             "('tlt' is save_pretrained).")
        return exporter(drafter, out_dir, verifier_name_or_path, **export_kwargs)


_KINDS: dict[str, DrafterKind] = {}  # architecture -> kind


def register(kind: DrafterKind, replace: bool = False) -> DrafterKind:
    """Make ``kind`` known to the engine, the trainers, export and loading; returns it.

    Registering another kind under a name or class already taken raises unless ``replace``."""
    taken = _KINDS.get(kind.architecture) or next((k for k in _KINDS.values() if k.name == kind.name), None)
    if taken is not None and taken is not kind and not replace:
        raise ValueError(f"A drafter kind named {kind.name!r} / {kind.architecture} is already registered; pass "
                         "replace=True to replace it.")
    if taken is not None:
        _KINDS.pop(taken.architecture, None)
    _KINDS[kind.architecture] = kind
    return kind


def unregister(kind: DrafterKind) -> None:
    """Forget ``kind`` (a test's own kind, once it is done)."""
    if _KINDS.get(kind.architecture) is kind:
        del _KINDS[kind.architecture]


def registered() -> Mapping[str, DrafterKind]:
    """architecture -> kind, for every registered kind."""
    return MappingProxyType(_KINDS)


def is_registered(architecture: str) -> bool:
    return architecture in _KINDS


def kind_of(drafter: Drafter | nn.Module | type | str) -> DrafterKind:
    """The kind of a drafter, a drafter class (a subclass of a registered class is of its kind), or the
    ``architecture`` a config names."""
    if isinstance(drafter, str):
        names = [drafter]
    else:
        names = [cls.__name__ for cls in (drafter if isinstance(drafter, type) else type(drafter)).__mro__]
    for name in names:
        kind = _KINDS.get(name)
        if kind is not None:
            return kind
    raise ValueError(f"{names[0]!r} is not a registered drafter kind (known: {sorted(_KINDS)}); register it with "
                     "tlt_trainers.drafter.registry.register(DrafterKind(...)).")


def kind_named(name: str) -> DrafterKind:
    """The kind that ``drafter_architecture=name`` chooses."""
    for kind in _KINDS.values():
        if kind.name == name:
            return kind
    raise ValueError(f"drafter_architecture={name!r}: choose 'auto' or one of {kind_names()}.")


def kind_names() -> tuple[str, ...]:
    return tuple(kind.name for kind in _KINDS.values())


# Reads a folder in another tool's layout (the EAGLE authors', SpecForge / SGLang, speculators) as a drafter of a
# registered kind. :mod:`.layouts` sets it when imported (``import tlt_trainers`` does), so that
# ``Drafter.from_pretrained`` reaches the converters without the contract importing them.
_other_layout_reader: Callable[[Path, nn.Module], Drafter] | None = None


def set_other_layout_reader(reader: Callable[[Path, nn.Module], Drafter]) -> None:
    global _other_layout_reader
    _other_layout_reader = reader


def read_other_layout(directory: Path, target: nn.Module) -> Drafter:
    """The drafter a folder in another tool's layout describes, converted and checked against ``target``."""
    if _other_layout_reader is None:
        raise RuntimeError("No reader of other tools' drafter layouts is set: import tlt_trainers.drafter.layouts.")
    return _other_layout_reader(directory, target)
