"""What a holder was given and what became of it: the record a controller that starts
again asks for (``resync``), and that its watch asks about sections pending too long (``lookup``).

Per section of the newest :data:`MAX_RECORD_STEPS` steps not known settled: its ``part_staged`` and,
once there is one, its outcome — ``part_durable``, ``part_failed`` or ``part_superseded``. A step
leaves the record when the controller says it settled (``forget``) or when newer ones push it out.
One lock, no thread, no Ray.
"""

from __future__ import annotations

import collections
import threading

from cf_ray._engine.protocol.messages import Message, PartDurable, PartFailed, PartStaged, PartSuperseded

#: Steps (generation, step) whose sections the holder keeps a record of, newest.
MAX_RECORD_STEPS = 64

#: What :meth:`Record.lookup` says of one section.
LOOKUP_DONE, LOOKUP_HELD, LOOKUP_UNKNOWN = "done", "held", "unknown"


class Record:
    def __init__(self):
        self._lock = threading.Lock()
        # (generation, step) -> section -> [PartStaged, outcome or None]
        self._steps: collections.OrderedDict[tuple[int, int], dict[str, list]] = collections.OrderedDict()
        self.generation = 0
        """The newest generation staged here (a restarted controller's is at least this)."""

    def staged(self, msg: PartStaged) -> None:
        with self._lock:
            self.generation = max(self.generation, msg.generation)
            key = (msg.generation, msg.step)
            secs = self._steps.get(key)
            if secs is None:
                secs = self._steps[key] = {}
                while len(self._steps) > MAX_RECORD_STEPS:
                    self._steps.popitem(last=False)
            secs[msg.section] = [msg, None]

    def outcome(self, msg: PartDurable | PartFailed | PartSuperseded) -> None:
        with self._lock:
            rec = self._steps.get((msg.generation, msg.step), {}).get(msg.section)
            if rec is not None:
                rec[1] = msg

    def said(self) -> tuple[tuple[PartStaged, ...], tuple[Message, ...]]:
        """Every recorded ``part_staged``, and every outcome, oldest first."""
        with self._lock:
            staged = tuple(v[0] for secs in self._steps.values() for v in secs.values())
            outcomes = tuple(v[1] for secs in self._steps.values() for v in secs.values() if v[1] is not None)
            return staged, outcomes

    def lookup(
        self, keys: list[tuple[int, int, str]], live: set[tuple[int, int, str]]
    ) -> list[tuple[str, PartStaged | None, Message | None]]:
        """What became of each ``(generation, step, section)``; ``live``: those waiting for the writer
        or being written (module doc of ``holder.py``)."""
        out = []
        with self._lock:
            for gen, step, sec in keys:
                rec = self._steps.get((gen, step), {}).get(sec)
                if rec is not None and rec[1] is not None:
                    out.append((LOOKUP_DONE, rec[0], rec[1]))
                elif rec is not None or (gen, step, sec) in live:
                    out.append((LOOKUP_HELD, rec[0] if rec is not None else None, None))
                else:
                    out.append((LOOKUP_UNKNOWN, None, None))
        return out

    def forget(self, keys: list[tuple[int, int]]) -> None:
        with self._lock:
            for gen, step in keys:
                self._steps.pop((int(gen), int(step)), None)


__all__ = ["LOOKUP_DONE", "LOOKUP_HELD", "LOOKUP_UNKNOWN", "MAX_RECORD_STEPS", "Record"]
