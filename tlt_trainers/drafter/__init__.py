"""Drafters that read the policy's hidden states: EAGLE-1 and EAGLE-3 (a token per pass) and block drafters
(DFlash: a block per pass)."""

from .base import AutoregressiveDrafter, Drafter
from .block import BlockDrafter
from .config import EagleDrafterConfig
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter

__all__ = ["Drafter", "AutoregressiveDrafter", "EagleDrafter", "Eagle3Drafter", "BlockDrafter", "EagleDrafterConfig"]
