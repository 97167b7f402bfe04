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

import torch
from torch import nn

from ..modeling.target import text_config

HERE = Path(__file__).resolve().parent
FINGERPRINT = "policy_fingerprint.json"
CHECKSUM_ROWS = 256
CHECKSUM_TOLERANCE = 1e-3  # relative: a policy loaded in bfloat16 rounds its weights, a different model is far off


def policy_fingerprint(policy: nn.Module) -> dict:
    """What identifies a policy: model type, shapes, and the sum of |w| over its first embedding rows."""
    config = text_config(policy)
    embed = policy.get_input_embeddings().weight
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": int(config.hidden_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "vocab_size": int(embed.shape[0]),
        "embedding_checksum": float(embed.detach()[:CHECKSUM_ROWS].to(torch.float64).abs().sum()),
    }


def _matches(saved: dict, ours: dict) -> bool:
    shapes = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    if any(saved.get(key) != ours[key] for key in shapes):
        return False
    reference = float(saved["embedding_checksum"])
    return abs(ours["embedding_checksum"] - reference) <= CHECKSUM_TOLERANCE * abs(reference)


def shipped_drafters() -> list[Path]:
    """Folders of the drafters shipped with this installation."""
    return sorted(path.parent for path in HERE.glob(f"*/{FINGERPRINT}"))


ARCHITECTURE_CLASSES = {"eagle3": "Eagle3Drafter", "eagle": "EagleDrafter", "block": "BlockDrafter"}
# What 'auto' starts from where several drafters ship for one policy: the first of these that does (a block drafter
# ships opt-in until it beats EAGLE-3 on bench_drafters at batch 1 and 4, greedy and T=1).
AUTO_ORDER = ("Eagle3Drafter", "EagleDrafter", "BlockDrafter")


def _architecture(folder: Path) -> str | None:
    config = folder / "config.json"
    return json.loads(config.read_text()).get("architecture") if config.is_file() else None


def shipped_drafter_for(policy: nn.Module, architecture: str = "auto") -> Path | None:
    """The shipped drafter trained for ``policy``, or None.

    ``architecture``: 'auto' (the default one: see ``AUTO_ORDER``), or 'eagle3' / 'eagle' / 'block' (that kind only,
    as ``drafter_architecture`` names them).
    """
    if architecture != "auto" and architecture not in ARCHITECTURE_CLASSES:
        raise ValueError(f"architecture={architecture!r}: choose 'auto' or one of {sorted(ARCHITECTURE_CLASSES)}.")
    ours, found = None, {}
    for folder in shipped_drafters():
        if ours is None:
            ours = policy_fingerprint(policy)
        if _matches(json.loads((folder / FINGERPRINT).read_text()), ours):
            found.setdefault(_architecture(folder), folder)
    wanted = AUTO_ORDER if architecture == "auto" else (ARCHITECTURE_CLASSES[architecture],)
    return next((found[name] for name in wanted if name in found), None)
