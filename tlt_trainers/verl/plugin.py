"""veRL plugin entry point (``verl.plugins`` in our package metadata): ``import verl`` in any process, the
trainer's Ray workers included, registers the ``tlt`` rollout backend."""

from .replica import register

register()
