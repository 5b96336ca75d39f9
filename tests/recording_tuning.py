"""A :class:`~megamoe.planner.tuning.Tuning` that records what the ops ask it for (tests pass it as ``tuning=``)."""

from __future__ import annotations

import dataclasses

from megamoe.planner.tuning import Tuning


@dataclasses.dataclass(frozen=True)
class RecordingTuning(Tuning):
    """The planner's tiles, each request recorded in ``asked`` as (kind, rows_per_expert)."""

    asked: list = dataclasses.field(default_factory=list)

    def tile(self, kind, device, rows_per_expert=None, **fmt):
        self.asked.append((kind, rows_per_expert))
        return super().tile(kind, device, rows_per_expert, **fmt)
