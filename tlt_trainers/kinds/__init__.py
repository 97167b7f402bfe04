"""The drafter kinds this package ships, one record each, registered on import (``import tlt_trainers`` does it).

* :mod:`.eagle` - EAGLE-1: one layer over the policy's last hidden state, the policy's LM head.
* :mod:`.eagle3` - EAGLE-3: low, middle and high layers fused, its own head (the default where the policy is deep).
* :mod:`.block` - a block drafter (DFlash): a block of masked slots drafted in one pass.

A new kind is one :func:`~tlt_trainers.drafter.registry.register` call with a
:class:`~tlt_trainers.drafter.registry.DrafterKind` record, anywhere; nothing under ``tlt_trainers`` changes.
"""

from ..drafter import layouts  # noqa: F401  (sets the reader of other tools' layouts that from_pretrained uses)
from . import block, eagle, eagle3

BUILT_IN = (eagle.KIND, eagle3.KIND, block.KIND)

__all__ = ["BUILT_IN"]
