"""Every TLT setting, declared once.

Three dataclasses hold them, each field with its ``help`` and each class with its checks in ``__post_init__``:

* :class:`~tlt_trainers.config.TLTConfig`: how the rollout engine speculates;
* :class:`DrafterSettings`: the drafter a trainer starts from and how it is trained during RL;
* :class:`RolloutServerSettings`: veRL's rollout servers (the trainer's own settings hold these in TRL).

Everything else is derived from them: ``TLTGRPOConfig`` (TRL), the ``tlt:`` section of veRL's config
(``TLTSection`` and the YAML), the ``tlt`` command's drafter flags and ``docs/settings.md``, so a setting has
one name, one default and one check everywhere. ``python -m tlt_trainers.settings`` rewrites the generated files
(the YAML's ``tlt:`` block and ``docs/settings.md``, :mod:`.generated`); ``--check`` only reports whether they are up
to date. Declarations live in :mod:`.declared`, what is derived at run time in :mod:`.derive`.

This module imports neither trl nor verl.
"""

from .declared import (
    ROLLOUT_DTYPES,
    TRAINER_SETTINGS,
    TRL_ONLY,
    VERL_SETTINGS,
    DrafterSettings,
    RolloutServerSettings,
    TLTSettings,
)
from .derive import (
    add_setting_arguments,
    check_settings,
    parameters_doc,
    setting_fields,
    setting_types,
    source_values,
    with_settings,
)

__all__ = ["ROLLOUT_DTYPES", "TRAINER_SETTINGS", "TRL_ONLY", "VERL_SETTINGS", "DrafterSettings",
           "RolloutServerSettings", "TLTSettings", "add_setting_arguments", "check_settings", "parameters_doc",
           "setting_fields", "setting_types", "source_values", "with_settings"]
