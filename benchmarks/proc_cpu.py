"""CPU seconds by process kind on this machine while a fit runs (issue #45).

A fit's iterations can be slower than its round's fit without cf_ray all through, not only around a
checkpoint: whatever else takes CPU from the cores that train (cf_ray's controller and holder
actors, the spare worker processes, Ray's own daemons) slows every iteration alike, and no
comparison inside the run can see that. :class:`ProcCPU` samples ``/proc`` once a second in a
thread and returns, per kind, the CPU seconds that the processes this driver started (its local
Ray: GCS, raylet, the raylet's workers) used during the fit: a process by its role
(:func:`benchmarks.thread_cpu.role_of`: ``ray::Controller``, ``ray::Holder``,
``ray::RayTrainWorker``, ``ray::IDLE`` for a worker process running nothing, a spare among them;
any other by its program's name). ``thread_cpu`` splits the same by thread over a whole
benchmark; this one is per fit, for the budgets benchmark. A process
that ends between two samples loses at most its last second; one that starts during the fit counts
from zero. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import threading
from collections import Counter

from benchmarks.thread_cpu import TICK, role_of


def _sample(root: int) -> dict[int, tuple[str, float]]:
    """The processes descended from ``root`` (this driver: the Ray it started, its raylet's workers),
    not another job's Ray on the same machine."""
    found: dict[int, tuple[int, str, float]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # ended
        fields = stat[stat.rfind(b")") + 2 :].split()
        found[pid] = (
            int(fields[1]),
            role_of(cmd) if cmd else "?",
            (int(fields[11]) + int(fields[12])) / TICK,
        )  # ppid, utime + stime
    out = {}
    for pid, (_, kind, cpu) in found.items():
        p, hops = pid, 0
        while p in found and p != root and hops < 64:
            p, hops = found[p][0], hops + 1
        if p == root and pid != root:
            out[pid] = (kind, cpu)
    return out


class ProcCPU:
    """``start()`` before the fit, ``stop()`` after: ``{kind: CPU seconds}`` over that time."""

    def __init__(self, period_s: float = 1.0, root: int | None = None):
        self.period_s, self.root = period_s, root if root is not None else os.getpid()
        self._first: dict[int, tuple[str, float]] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ProcCPU:
        self._first = _sample(self.root)
        self._last = dict(self._first)
        self._thread = threading.Thread(target=self._run, name="proc-cpu", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._merge(_sample(self.root))

    def _merge(self, snap: dict[int, tuple[str, float]]) -> None:
        last = self._last  # the sampling thread's alone until stop() has joined it
        for pid, (kind, cpu) in snap.items():
            seen = last.get(pid)
            if seen is not None and cpu < seen[1]:
                self._first[pid] = (kind, 0.0)  # a reused pid: a new process
            if seen is not None and kind == "?":
                kind = seen[0]  # an ending process's cmdline reads empty: keep the title it had
            last[pid] = (kind, cpu)  # the latest title (an idle worker becomes an actor's)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._merge(_sample(self.root))
        used: Counter[str] = Counter()
        for pid, (kind, cpu) in self._last.items():
            before = self._first.get(pid, (kind, 0.0))[1]
            if cpu - before > 0:
                used[kind] += cpu - before
        return {k: round(v, 2) for k, v in used.most_common()}
