"""What one member's training slice did, in a form every transport can carry (a row of floats)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_NAN = float("nan")


@dataclass(frozen=True)
class SliceReport:
    """One member's (a rank's, a replica's) drafter training in one slice of an update.

    ``steps``: micro-steps made; ``loss`` and ``top1``: their means (nan without steps); ``seconds``: time spent
    training; ``costs_timed``: batch sizes whose engine passes the member timed first (idle slices only);
    ``total_steps``: the member's step counter after the slice.
    """

    steps: int = 0
    loss: float = _NAN
    top1: float = _NAN
    seconds: float = 0.0
    costs_timed: int = 0
    total_steps: int = 0

    @classmethod
    def from_metrics(cls, metrics: Mapping, total_steps: int = 0, costs_timed: int | None = None) -> SliceReport:
        """From :meth:`DrafterTrainer.train`'s metrics (``{}``: the member did not train). ``total_steps`` and
        ``costs_timed`` apply where the metrics do not say (a list of batch sizes counts as its length)."""
        timed = metrics.get("costs_timed", ())
        return cls(steps=int(metrics.get("steps", 0)), loss=float(metrics.get("loss", _NAN)),
                   top1=float(metrics.get("top1", _NAN)), seconds=float(metrics.get("seconds", 0.0)),
                   costs_timed=len(timed) if costs_timed is None else int(costs_timed),
                   total_steps=int(metrics.get("total_steps", total_steps)))

    def as_row(self) -> list[float]:
        """The fields as floats, in :data:`REPORT_FIELDS` order (one row of a gathered table)."""
        return [float(getattr(self, name)) for name in REPORT_FIELDS]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> SliceReport:
        """Inverse of :meth:`as_row`."""
        values = dict(zip(REPORT_FIELDS, (float(v) for v in row), strict=True))
        return cls(**{name: (int(value) if _COUNTS[name] else value) for name, value in values.items()})


REPORT_FIELDS = tuple(field.name for field in dataclasses.fields(SliceReport))
_COUNTS = {field.name: field.type in ("int", int) for field in dataclasses.fields(SliceReport)}


def finite_mean(values: Sequence[float]) -> float:
    """The mean of the finite values (nan when there is none)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else _NAN
