"""A real pyarrow filesystem that fails on purpose: local disk underneath, faults injected per path.

Used through ``pyarrow.fs.PyFileSystem(FaultyHandler(...))`` so the whole engine (holder writer,
controller commit) runs for real against it. Importable by Ray workers (tests/ and the repository's
root are on PYTHONPATH). The delegation to local disk is :class:`benchmarks.local_disk.LocalDiskHandler`,
which the soak's storage shares.
"""

from __future__ import annotations

import re

from benchmarks.local_disk import LocalDiskHandler


class FaultyHandler(LocalDiskHandler):
    """Delegates to the local filesystem; ``open_output_stream`` raises for paths matching ``fail``
    whose checkpoint step is at least ``from_step``."""

    def __init__(self, fail: str = r"checkpoints/(step|final)_(\d+)", from_step: int = 0):
        super().__init__()
        self.fail = fail
        self.from_step = from_step

    def __reduce__(self):
        return (FaultyHandler, (self.fail, self.from_step))

    def _check(self, path: str) -> None:
        m = re.search(self.fail, path)
        if m and int(m.group(2)) >= self.from_step:
            raise OSError(f"injected fault: storage refuses to write {path}")

    def get_type_name(self):
        return "faulty"


class SlowHandler(FaultyHandler):
    """Delegates to the local filesystem; writing a checkpoint data file (``*.bin``) of a step in
    ``[slow_from, slow_to)`` takes ``delay_s`` longer: a storage that slows down for a while
    (another job's I/O, a throttled bucket), by step so that tests do not depend on timing. With
    ``generation``, only that attempt's files (``g0001.*``) are slow, not the replay of those steps
    by a later attempt."""

    def __init__(self, slow_from: int, slow_to: int, delay_s: float, generation: int | None = None):
        super().__init__(fail=r"$^", from_step=0)
        self.slow_from, self.slow_to, self.delay_s, self.generation = slow_from, slow_to, delay_s, generation

    def __reduce__(self):
        return (SlowHandler, (self.slow_from, self.slow_to, self.delay_s, self.generation))

    def get_type_name(self):
        return "slow"

    def equals(self, other):
        return isinstance(other, SlowHandler) and (
            other.slow_from,
            other.slow_to,
            other.delay_s,
            other.generation,
        ) == (self.slow_from, self.slow_to, self.delay_s, self.generation)

    def open_output_stream(self, path, metadata):
        import time

        m = re.search(r"checkpoints/step_(\d+)/g(\d+)\.[^/]*\.bin$", path)
        if m and self.slow_from <= int(m.group(1)) < self.slow_to and self.generation in (None, int(m.group(2))):
            time.sleep(self.delay_s)
        return self.fs.open_output_stream(path, metadata=metadata)


class SlowAttemptHandler(FaultyHandler):
    """Delegates to the local filesystem; writing a checkpoint data file (``*.bin``) of generation
    ``generation`` (one attempt of the worker group) takes ``delay_s`` longer while the file ``slow``
    exists (cut short when it goes): storage that is slow during the first attempt, so that its
    measured persist time is slow too, and fast once the test removes the file (what the first
    attempt left to write does not hold up the rest of the run). While the file ``stall`` exists,
    such a write also waits for it to go: storage that stalls during a drain, so that a section
    being written when its node is removed is never finished."""

    def __init__(self, generation: int, delay_s: float, slow: str, stall: str | None = None):
        super().__init__(fail=r"$^", from_step=0)
        self.generation, self.delay_s, self.slow, self.stall = generation, delay_s, slow, stall

    def __reduce__(self):
        return (SlowAttemptHandler, (self.generation, self.delay_s, self.slow, self.stall))

    def get_type_name(self):
        return "slow-attempt"

    def equals(self, other):
        return isinstance(other, SlowAttemptHandler) and other.__reduce__() == self.__reduce__()

    def open_output_stream(self, path, metadata):
        import os
        import time

        if re.search(rf"checkpoints/step_\d+/g{self.generation:04d}\.[^/]*\.bin$", path):
            until = time.monotonic() + self.delay_s
            while time.monotonic() < until and os.path.exists(self.slow):
                time.sleep(0.02)
            while self.stall and os.path.exists(self.stall):
                time.sleep(0.02)
        return self.fs.open_output_stream(path, metadata=metadata)
