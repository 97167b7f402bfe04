"""EAGLE-style drafters that read the policy's hidden states."""

from .config import EagleDrafterConfig
from .eagle import EagleDrafter

__all__ = ["EagleDrafter", "EagleDrafterConfig"]
