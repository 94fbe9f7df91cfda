"""cf_ray's background work at idle CPU priority: the controller, and what a holder writes and copies.

Training and cf_ray share a node's cores. Nothing the controller does, and nothing a holder's writer
or copier does, has to happen within a training step: so they run under Linux's ``SCHED_IDLE``
policy, and a core runs them when no training thread wants it. A thread at ``SCHED_IDLE`` is never
starved: when no core is idle it still gets a small share (a weight of 3 against the 36 of a Ray
worker at Ray's nice 15), and a ``SCHED_OTHER`` thread that wakes takes the core from it at once
instead of waiting for the end of its slice. Measured with every core training (issue 25,
docs/benchmarks/single-node.md): the holder's check pass, the controller's calls and the two actors'
idle ticks (Ray wakes every actor 100 times a second) had been taken from training.

What stays at Ray's priority: the holder's main thread, which answers a worker's hand-off (at k = 1 a
snapshot thread waits for it), and the worker processes. The holder's writer and copier go back to
the normal policy for a preemption checkpoint (:class:`ThreadPriority`), whose deadline will not
wait; leaving ``SCHED_IDLE`` needs the kernel's
leave (``CAP_SYS_NICE``, or ``RLIMIT_NICE`` of at least 20 minus the thread's nice value), and where
it refuses, the write goes on at idle priority and says so once.

``CF_RAY_IDLE_PRIORITY=0`` keeps every thread at the priority Ray gave it (``env.IDLE_PRIORITY``).
What a thread waited for a core is not persist time: :func:`cpu_wait_s` lets the writer report the
write's own time (``PartDurable.persist_s``), which the persist cadence and the policy weigh.
"""

from __future__ import annotations

import logging
import os

from cf_ray._engine import env as _env

logger = logging.getLogger("cf_ray")

_IDLE = getattr(os, "SCHED_IDLE", None)


def enabled() -> bool:
    """Whether cf_ray's background runs at idle priority (``CF_RAY_IDLE_PRIORITY``, on by default;
    Linux only)."""
    return _IDLE is not None and _env.get_int(_env.IDLE_PRIORITY) != 0


def _set(tid: int, idle: bool) -> bool:
    policy = _IDLE if idle else os.SCHED_OTHER
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except OSError:  # refused (EPERM: leaving SCHED_IDLE), or the thread has ended (ESRCH)
        return False


def lower_process() -> int:
    """Every thread of this process to ``SCHED_IDLE`` (the controller's actor, at its start); the
    threads made later inherit it from the thread that makes them. Returns how many were set."""
    if not enabled():
        return 0
    return sum(_set(int(tid), True) for tid in os.listdir("/proc/self/task"))


class ThreadPriority:
    """The calling thread's policy, for a thread of background work that sometimes has a deadline.

    Args:
        what: the thread, as the warning names it ("the holder's writer").
    """

    def __init__(self, what: str):
        self._what = what
        self._idle = False
        self._refused = False

    def background(self) -> None:
        """Idle priority for the work that follows (a no-op when it is off)."""
        if not self._idle and enabled():
            self._idle = _set(0, True)

    def urgent(self) -> None:
        """Back to the normal policy for work with a deadline; where the kernel refuses, the work
        goes on at idle priority, said once."""
        if not self._idle:
            return
        if _set(0, False):
            self._idle = False
        elif not self._refused:
            self._refused = True
            logger.warning(
                "cf_ray: %s could not leave idle CPU priority for a preemption checkpoint (the kernel "
                "needs CAP_SYS_NICE or a higher RLIMIT_NICE): it is written at idle priority, slower while "
                "training fills every core; set CF_RAY_IDLE_PRIORITY=0 to keep cf_ray's background at Ray's priority",
                self._what,
            )

    def set_for(self, urgent: bool) -> None:
        """:meth:`urgent` or :meth:`background`."""
        if urgent:
            self.urgent()
        else:
            self.background()


def cpu_wait_s() -> float:
    """Seconds the calling thread has waited, runnable, for a core since it started (the kernel's
    ``schedstat``); 0.0 where the kernel does not keep it."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


__all__ = ["ThreadPriority", "cpu_wait_s", "enabled", "lower_process"]
