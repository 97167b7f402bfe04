"""veRL plugin entry point (``verl.plugins`` in our package metadata): ``import verl`` in any process, the
trainer's Ray workers included, registers the ``tlt`` rollout backend and the ``cpu`` platform.

veRL swallows plugin errors (debug log only), which would later surface as "Unknown rollout mode: tlt";
a failure here is therefore reported as a warning with its cause.
"""

import traceback
import warnings

try:
    from . import cpu_platform
    from .replica import register

    register()
    cpu_platform.install()
except Exception:  # noqa: BLE001 (report anything: veRL would hide it)
    warnings.warn(f"tlt-trainers could not register its veRL plugin:\n{traceback.format_exc()}", stacklevel=1)
    raise
