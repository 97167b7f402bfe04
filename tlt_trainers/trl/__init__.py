"""TRL adapter: ``TLTGRPOTrainer`` (a drop-in for ``trl.GRPOTrainer``) and ``TLTGRPOConfig``.

Needs ``pip install tlt-trainers[trl]``; ``import tlt_trainers`` itself never imports trl.
"""

from .config import TLTGRPOConfig, resolve_tlt_settings
from .trainer import DRAFTER_DIR, TLTGRPOTrainer

__all__ = ["TLTGRPOConfig", "TLTGRPOTrainer", "DRAFTER_DIR", "resolve_tlt_settings"]
