"""EAGLE-style drafters that read the policy's hidden states."""

from .base import Drafter
from .config import EagleDrafterConfig
from .eagle import EagleDrafter

__all__ = ["Drafter", "EagleDrafter", "EagleDrafterConfig"]
