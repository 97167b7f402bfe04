"""Drafters that ship with the package, and how a policy is matched to one.

A shipped drafter is the default starting point for the policy it was trained for: ``rollout_drafter`` (the TRL and
veRL trainers), the examples and the reproduction load it when ``drafter_name_or_path`` is left unset. The policy is
recognised by what it is, not by how it was named: its shapes and a checksum of its input embedding, so the embedded
SmolLM2 (``smollm2-135m``), a local folder and the Hub id ``HuggingFaceTB/SmolLM2-135M-Instruct`` all match, while
a fine-tuned or other model of the same shapes does not.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from ..drafter.registry import kind_named, registered
from ..modeling.target import policy_fingerprint

HERE = Path(__file__).resolve().parent
FINGERPRINT = "policy_fingerprint.json"
CHECKSUM_TOLERANCE = 1e-3  # relative: a policy loaded in bfloat16 rounds its weights, a different model is far off


def _matches(saved: dict, ours: dict) -> bool:
    shapes = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    if any(saved.get(key) != ours[key] for key in shapes):
        return False
    reference = float(saved["embedding_checksum"])
    return abs(ours["embedding_checksum"] - reference) <= CHECKSUM_TOLERANCE * abs(reference)


def shipped_drafters() -> list[Path]:
    """Folders of the drafters shipped with this installation: those on this package's shelf and those the
    registered kinds' records list (a kind registered from outside the package ships its own)."""
    folders = {path.parent for path in HERE.glob(f"*/{FINGERPRINT}")}
    folders |= {Path(folder) for kind in registered().values() for folder in kind.shipped}
    return sorted(folder for folder in folders if (folder / FINGERPRINT).is_file())


def _architecture(folder: Path) -> str | None:
    config = folder / "config.json"
    return json.loads(config.read_text()).get("architecture") if config.is_file() else None


def shipped_drafter_for(policy: nn.Module, architecture: str = "auto") -> Path | None:
    """The shipped drafter trained for ``policy``, or None.

    ``architecture``: 'auto' (the kinds' ``auto_rank`` order: EAGLE-3 first; a block drafter ships opt-in until it
    beats EAGLE-3 on bench_drafters at batch 1 and 4, greedy and T=1), or a kind's name as ``drafter_architecture``
    gives it ('eagle3', 'eagle', 'block': that kind only).
    """
    if architecture == "auto":
        ranked = sorted((kind for kind in registered().values() if kind.auto_rank is not None),
                        key=lambda kind: kind.auto_rank)
        wanted = tuple(kind.architecture for kind in ranked)
    else:
        wanted = (kind_named(architecture).architecture,)
    ours, found = None, {}
    for folder in shipped_drafters():
        if ours is None:
            ours = policy_fingerprint(policy)
        if _matches(json.loads((folder / FINGERPRINT).read_text()), ours):
            found.setdefault(_architecture(folder), folder)
    return next((found[name] for name in wanted if name in found), None)
