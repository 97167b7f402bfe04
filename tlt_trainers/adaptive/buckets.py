"""Batch-size buckets: the unit in which the deciders learn costs and keep their choices."""

from __future__ import annotations

import math


def selector_bucket(batch_size: int) -> int:
    """Power-of-two buckets (1, 2, 3-4, 5-8, ...): costs within one differ little."""
    return 1 << max(0, math.ceil(math.log2(max(batch_size, 1))))
