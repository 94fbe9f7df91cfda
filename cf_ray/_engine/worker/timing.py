"""What this rank measures for the policy and the profile table: the time of an iteration without
checkpointing, what each checkpoint cost the training thread (its stall, the weight-update guard)
and the background thread (copy, hand-off), and a summary of the last checkpoint.

Samples travel to the controller with the next poll (:mod:`cf_ray._engine.worker.link.controller`).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from cf_ray._engine.worker.cpu_budget import CpuBudget


def _cpu_jiffies() -> tuple[int, int] | None:
    """(idle and iowait jiffies, all jiffies) of this machine, from the first line of
    ``/proc/stat`` (a read of one line, whatever the machine's core count); ``None`` where there is
    none (not Linux)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])


def _online_cores() -> int:
    """Online cores of this machine (the ``cpuN`` lines of ``/proc/stat``), read once per rank."""
    try:
        with open("/proc/stat", "rb") as f:
            return max(sum(1 for line in f if line.startswith(b"cpu")) - 1, 1)
    except OSError:
        return 1


def _local_ranks() -> int:
    """Ranks of the job on this node (1 outside Ray Train)."""
    try:
        import ray.train

        return max(int(ray.train.get_context().get_local_world_size()), 1)
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        return 1


class IdleCpus:
    """Cores of this machine left idle between two calls, per rank of the job on its node (the
    policy's ``Sample.idle_cpus``): below one, a rank's background copy finds no idle core and
    takes its CPU from training."""

    def __init__(self) -> None:
        self._last = _cpu_jiffies()
        self._cores = _online_cores()
        self._ranks: int | None = None

    def per_rank(self) -> float | None:
        now, last = _cpu_jiffies(), self._last
        self._last = now
        if now is None or last is None or now[1] <= last[1]:
            return None
        if self._ranks is None:
            self._ranks = _local_ranks()
        return (now[0] - last[0]) / (now[1] - last[1]) * self._cores / self._ranks


class RunQueueWait:
    """Seconds the calling thread has waited for a CPU, runnable but not running (Linux's
    ``schedstat`` of the thread, its second field): the policy's ``Sample.queue_s``. Where the
    machine's cores are all busy, what a checkpoint's background threads (and the holder's writer,
    and anything else) take from training shows here first, as the training thread's wait for a
    core. Measures the thread that called :meth:`bind`."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._last: float | None = None

    def bind(self) -> None:
        """Measure the calling thread from now on."""
        import threading

        self._path, self._last = f"/proc/self/task/{threading.get_native_id()}/schedstat", None

    def unbound(self) -> bool:
        return self._path is None

    def since_last(self) -> float | None:
        """Seconds waited since the last call; ``None`` before :meth:`bind`, on the first call after
        it, and without the file (not Linux, or a kernel without scheduler statistics)."""
        if self._path is None:
            return None
        try:
            with open(self._path, "rb") as f:
                now = int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None
        last, self._last = self._last, now
        return None if last is None or now < last else now - last


class Contention:
    """What the machine leaves the training thread, reported with each sample: idle cores per rank
    (:class:`IdleCpus`) and the training thread's wait for a CPU per iteration (:class:`RunQueueWait`)."""

    def __init__(self) -> None:
        self.idle = IdleCpus()
        self.queued = RunQueueWait()
        self._iters = 0  # iterations since the wait was last read, timed or not

    def iteration(self) -> None:
        """An iteration ended (the training thread: the one whose wait is measured)."""
        if self._iters == 0 and self.queued.unbound():
            self.queued.bind()
        self._iters += 1

    def fields(self, timed: bool) -> dict[str, float]:
        """The ``Sample`` fields ``idle_cpus`` and ``queue_s`` since the last call; none but the
        reset when ``timed`` is false (no iteration timed since)."""
        queued, iters = self.queued.since_last(), self._iters
        self._iters = 0
        if not timed:
            return {}
        idle = self.idle.per_rank()
        out = {"idle_cpus": idle} if idle is not None else {}
        if queued is not None and iters:
            out["queue_s"] = queued / iters
        return out


class Timing:
    """One rank's measurements between two polls of the controller.

    Call order (training thread unless said otherwise): :meth:`guarded` after the weight-update
    guard; :meth:`end_iteration` right after the optimizer step; :meth:`snapshot_taken` when a
    checkpoint starts; :meth:`handed_off` (background thread) once its bytes are in the holder;
    :meth:`step_end` at the end of a step; :meth:`drain` when a poll goes out.
    """

    def __init__(self):
        self.checkpoints_taken = 0
        """Checkpoints started by this rank."""
        self.stall_s_total = 0.0
        """Seconds the training thread spent on checkpoints (starting them and the guard)."""
        self.prepare_overlap = False
        """The last iteration overlapped the fault-in of the snapshot buffers (snapshot/snapshotter.py)."""
        self._ckpt_stats: collections.deque = collections.deque(maxlen=64)
        self._iter_sum_s = 0.0
        self._iter_n = 0
        self._last_step_end: float | None = None
        self._pending_guard_step: int | None = None
        self._last_ckpt: dict[str, Any] = {}
        self._iter_end: float | None = None  # when the last iteration was timed (end_iteration)
        self._step_stall_s = 0.0  # the stall of the checkpoint this step started
        self._step_sum_s = 0.0  # the checkpointer's per-step work since the last drain ...
        self._step_n = 0  # ... over this many steps
        self.contention = Contention()
        """Idle cores and the training thread's wait for a CPU, read at each :meth:`drain`."""
        self.budget = CpuBudget()
        """Wall and thread-CPU seconds per part of the checkpoint path (``cpu_budget.py``)."""

    # -- the training thread ------------------------------------------------------------------------
    def guarded(self, guard_s: float) -> None:
        """The weight-update guard waited ``guard_s`` (0 when the copy was already done)."""
        if guard_s and self._pending_guard_step is not None:
            self._ckpt_stats.append({"step": self._pending_guard_step, "guard_s": guard_s})
            if self._last_ckpt.get("ckpt_step") == self._pending_guard_step:
                self._last_ckpt["stall_s"] += guard_s  # the guard for a snapshot's own copy is its cost
        self.stall_s_total += guard_s
        self._pending_guard_step = None

    def end_iteration(self, guard_s: float, preparing: bool) -> None:
        """After the optimizer step: time the iteration since the last one ended."""
        now = time.perf_counter()
        if self._last_step_end is not None and not (preparing or self.prepare_overlap):
            # Iterations that overlapped the fault-in of the snapshot buffers are not timed: they
            # would inflate the baseline that the policy measures each checkpoint's slowdown against.
            self._iter_sum_s += max(now - self._last_step_end - guard_s, 0.0)
            self._iter_n += 1
        self.prepare_overlap = preparing
        self.contention.iteration()
        self._iter_end, self._step_stall_s = now, 0.0

    def snapshot_taken(self, step: int, sync_s: float, stall_s: float, last_begin: dict[str, float]) -> None:
        """A checkpoint of ``step`` started: ``sync_s`` in the snapshotter, ``stall_s`` in all."""
        self.checkpoints_taken += 1
        self.stall_s_total += stall_s
        self._step_stall_s += stall_s
        self._pending_guard_step = step
        self._ckpt_stats.append({"step": step, "sync_s": sync_s, "stall_s": stall_s})
        wait = last_begin.get("wait_s", 0.0)
        self._last_ckpt = {
            "ckpt_step": step,
            "stall_s": stall_s,
            "wait_s": wait if wait > 1e-4 else None,
            "nbytes": int(last_begin.get("nbytes", 0)),
        }

    def step_end(self) -> None:
        """The checkpointer's work after the update is done: what it took, beyond the stall of a
        checkpoint started in it, is the per-step work the job pays (``step_s`` of the samples)."""
        now = self._last_step_end = time.perf_counter()
        if self._iter_end is not None:
            self._step_sum_s += max(now - self._iter_end - self._step_stall_s, 0.0)
            self._step_n += 1
            self._iter_end = None

    # -- the background thread ------------------------------------------------------------------------
    def handed_off(self, step: int, timings: dict[str, float]) -> None:
        """The snapshot of ``step`` is held by the holder; ``timings`` are the snapshotter's."""
        self._ckpt_stats.append(
            {
                "step": step,
                "copy_s": timings.get("copy_s", 0.0),
                "handoff_s": timings.get("handoff_s", 0.0),
                "nbytes": int(timings.get("nbytes", 0)),
            }
        )

    # -- out to the controller -------------------------------------------------------------------------
    def drain(self, rank: int, step: int, copy_timings: dict[str, float]) -> tuple[list[dict], list[dict]]:
        """(samples in the policy's ``Sample`` fields, per-checkpoint stats) since the last drain.

        Args:
            rank, step: this rank and its step count.
            copy_timings: the snapshotter's timings of its last finished job (``last_timings``).
        """
        samples = []
        contention = self.contention.fields(bool(self._iter_n))
        if self._iter_n:
            samples.append(
                {
                    "rank": rank,
                    "step": step,
                    "iter_s": self._iter_sum_s / self._iter_n,
                    "iters": self._iter_n,
                    **({"step_s": self._step_sum_s / self._step_n} if self._step_n else {}),
                    **contention,
                    **self._last_ckpt_sample(copy_timings),
                }
            )
            self._iter_sum_s, self._iter_n = 0.0, 0
            self._step_sum_s, self._step_n = 0.0, 0
        stats = []
        while self._ckpt_stats:
            stats.append(self._ckpt_stats.popleft())
        return samples, stats

    def _last_ckpt_sample(self, copy_timings: dict[str, float]) -> dict:
        """What this rank knows of its last checkpoint, in the policy's ``Sample`` fields."""
        if not self._last_ckpt:
            return {}
        out = dict(self._last_ckpt)
        if copy_timings.get("step") == out["ckpt_step"]:
            out["copy_s"] = copy_timings.get("copy_s")
            out["copy_cpu_s"] = copy_timings.get("cpu_s")
        return out
