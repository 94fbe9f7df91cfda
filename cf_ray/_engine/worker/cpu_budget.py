"""Where a rank's checkpointing time goes: wall and thread-CPU seconds per part of the per-step path
(training thread) and of each snapshot (its background thread), for the benchmark and the profile.

Parts, training thread (every step): ``capture_late`` (the last snapshot's schedulers and the like),
``guard`` (the weight-update guard's wait for the copy), ``timing`` (iteration and stall
bookkeeping), ``preemption`` (the watcher's poll), ``agreement`` (the exchange with the other ranks),
``register`` (Ray Train registration on agreement), ``policy`` (the scheduler's decision), ``begin``
(a snapshot's start: ``state_dict()`` calls, flattening, slot, the small tensors), ``prepare`` (the
first step's fault-in request), ``poll`` (the controller link), ``watchdog``. Background thread
(per snapshot): ``copy`` (the guarded tensors into the slot), ``crc`` (the block CRC-32s, folded
into the copy's windows), ``fingerprint``, ``index`` (encoding the index, sealing the slot, the
late capture's checksums), ``handoff`` (telling the holder, waiting for its answer).

Cheap on purpose: two clock reads (``perf_counter`` and ``thread_time``) per part, one lock-free
update (each part is written by one thread only).
"""

from __future__ import annotations

import time

#: A mark: (wall seconds, this thread's CPU seconds).
Mark = tuple[float, float]


def mark() -> Mark:
    return time.perf_counter(), time.thread_time()


class CpuBudget:
    """Totals per part: ``[calls, wall_s, cpu_s]``. Each part is written by one thread only."""

    def __init__(self) -> None:
        self._parts: dict[str, list[float]] = {}

    def lap(self, part: str, since: Mark, calls: int = 1) -> Mark:
        """Add the time since ``since`` to ``part`` (``calls=0``: a second piece of the same call);
        returns a new mark (the start of the next part)."""
        now = mark()
        acc = self._parts.get(part)
        if acc is None:
            acc = self._parts[part] = [0.0, 0.0, 0.0]
        acc[0] += calls
        acc[1] += now[0] - since[0]
        acc[2] += now[1] - since[1]
        return now

    def add(self, part: str, wall_s: float, cpu_s: float, calls: int = 1) -> None:
        acc = self._parts.get(part)
        if acc is None:
            acc = self._parts[part] = [0.0, 0.0, 0.0]
        acc[0] += calls
        acc[1] += wall_s
        acc[2] += cpu_s

    def totals(self) -> dict[str, dict[str, float]]:
        """``{part: {"calls", "wall_s", "cpu_s"}}`` so far (a copy)."""
        return {k: {"calls": int(v[0]), "wall_s": v[1], "cpu_s": v[2]} for k, v in list(self._parts.items())}
