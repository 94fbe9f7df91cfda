"""What one rank's restore did, for ``Resume`` and the restart's event: the seconds of each phase,
the bytes read by how, the copies of sections refused, the candidates skipped, the objects verified.
One object per rank, cleared at the start of each restore (``Restorer.plan``).
"""

from __future__ import annotations

import time

from cf_ray._engine.worker.restore.decision import Fallbacks
from cf_ray._engine.worker.restore.integrity import Refusals


class RestoreRecord:
    """The bookkeeping of this rank's last restore.

    Args:
        refusals: the copies of sections whose bytes failed a check (``integrity.py``).
        fallbacks: the candidates every rank skipped (``decision.py``).
    """

    def __init__(self, refusals: Refusals, fallbacks: Fallbacks):
        self.phases: dict[str, float] = {}
        """Seconds this rank spent in each phase of the restore (``plan``, ``read``, ``validate``,
        ``apply``, ``verify``; ``read`` and ``validate`` summed over the candidates tried)."""
        self.read_bytes: dict[str, int] = {}
        """Bytes this rank read in the last restore, by how: ``in_place`` (a slot of a holder of its
        node, mapped), ``direct`` (streamed from a holder of another node), ``storage``."""
        self.refusals = refusals
        """The copies of sections this rank refused in the last restore (their bytes failed a check)."""
        self.fallbacks = fallbacks
        """The candidates every rank skipped in the last restore, and a rollback past a non-finite state."""
        self.verified: list[str] = []
        """The objects checked against their fingerprints by the last ``Restorer.load``."""

    def clear(self) -> None:
        """A new restore starts (what ``verified`` says stays until a load verifies again)."""
        self.phases, self.read_bytes = {}, {}
        self.refusals.items.clear()
        self.fallbacks.clear()

    def count(self, how: str, nbytes: int) -> None:
        self.read_bytes[how] = self.read_bytes.get(how, 0) + int(nbytes)

    def timed(self, phase: str, t0: float) -> None:
        """``phase`` took from ``t0`` (``time.perf_counter()``) until now (added to what it took before)."""
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0
