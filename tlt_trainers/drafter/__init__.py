"""EAGLE-style drafters that read the policy's hidden states: EAGLE-1 and EAGLE-3."""

from .base import Drafter
from .config import EagleDrafterConfig
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter

__all__ = ["Drafter", "EagleDrafter", "Eagle3Drafter", "EagleDrafterConfig"]
