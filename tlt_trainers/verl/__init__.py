"""veRL adapter: TLTPPOTrainer, the ``tlt`` rollout backend, its config and entry point (needs ``[verl]``).

    python -m tlt_trainers.verl.main_ppo data.train_files=... actor_rollout_ref.model.path=... tlt.speculation=adaptive
"""

import verl  # noqa: F401  (first: importing verl loads our plugin, which imports the modules below)

from . import cpu_platform  # noqa: F401, I001  (registers the cpu platform before anything asks for the device)
from .replica import TLTReplica, TLTServerAdapter, register
from .settings import TLTSection
from .trainer import TLTPPOTrainer, check_tlt_config

register()

__all__ = ["TLTPPOTrainer", "TLTReplica", "TLTServerAdapter", "TLTSection", "check_tlt_config", "register"]
