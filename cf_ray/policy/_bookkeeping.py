"""Per-rank and per-checkpoint bookkeeping of :class:`~cf_ray.policy._estimator.Estimator`: what
each rank timed of its iterations (:class:`_Rank`), of its newest checkpoint while the iterations
after it come in (:class:`_RankCkpt`), and what every rank measured of one checkpoint
(:class:`_Ckpt`)."""

from __future__ import annotations

import math
from collections import deque

from cf_ray.policy._estimate import _median, _weighted_median


class _Rank:
    __slots__ = ("clean", "dirty", "_base", "rough", "last_step", "warm_until", "seen", "cur", "idle", "queue")

    def __init__(self, warmup: int):
        self.clean: deque = deque(maxlen=16)  # (iter_s, iters) with nothing in flight
        self.dirty: deque = deque(maxlen=16)  # (iter_s, iters) overlapping a copy/persist
        self._base: float | None = None
        self.rough: float | None = None  # a mean over warm-up iterations too: until anything better
        self.last_step = 0
        self.warm_until = warmup
        self.seen = 0
        self.cur: _RankCkpt | None = None
        self.idle: deque = deque(maxlen=16)  # idle cores per rank of its node, recent samples
        self.queue: deque = deque(maxlen=16)  # (queue_s, iters) with nothing in flight

    def base(self) -> float | None:
        if self._base is None and self.clean:
            self._base = _weighted_median(self.clean)
        return self._base

    def scatter(self) -> float | None:
        """How much one clean sample's mean iteration time scatters (x 1.4826 its median absolute
        deviation), or ``None`` before three."""
        if len(self.clean) < 3:
            return None
        values = [v for v, _ in self.clean]
        m = _median(values)
        return 1.4826 * _median([abs(v - m) for v in values])

    def idle_level(self) -> float | None:
        """Idle cores per rank of its node (the median of recent samples), ``None`` if not reported."""
        return _median(self.idle) if self.idle else None

    def queue_level(self) -> float | None:
        """The training thread's wait for a CPU per iteration with nothing in flight (the weighted
        median of recent samples), ``None`` if not reported."""
        return _weighted_median(self.queue) if self.queue else None

    def dirty_base(self) -> float | None:
        return _weighted_median(self.dirty) if self.dirty else None

    def invalidate(self) -> None:
        self._base = None


class _RankCkpt:
    """One rank's view of its latest checkpoint while the iterations after it come in."""

    __slots__ = (
        "step",
        "approx",
        "prev_step",
        "excess",
        "over_iters",
        "over_s",
        "over_sq",
        "before",
        "base_open",
        "closed",
        "unmeasured",
        "seg_base",
        "values",
        "queued",
        "queued_iters",
    )

    def __init__(self, step: int, approx: bool, prev_step: int | None):
        self.step = step
        self.approx = approx
        self.prev_step = prev_step  # the rank's previous checkpoint, whose segment ends here
        self.excess = 0.0  # sum of (iter_s - baseline) over overlapped iterations
        self.over_iters = 0  # how many iterations overlapped
        self.over_s = 0.0  # and their time
        self.over_sq = 0  # the sum of the squares of the overlapped samples' iteration counts
        self.before: float | None = None  # the clean iteration time just before them
        self.base_open: float | None = None  # the baseline they were compared with
        self.closed = False  # the overlap is over; excess is final
        self.unmeasured = False  # the iteration time moved during the overlap: excess is not known
        self.seg_base = 0.0  # baseline time of the iterations until the next checkpoint
        self.values: tuple = ()
        self.queued = 0.0  # sum of (queue_s - its level with nothing in flight) over overlapped iterations
        self.queued_iters = 0  # how many of them reported queue_s


class _Taken:
    """Per rank, what a checkpoint's background work took from training that needs no iteration
    with nothing in flight to tell: the CPU of its copy and of the holder's write of its sections,
    and the training thread's extra wait for a CPU while they ran."""

    __slots__ = ("copy_cpu", "persist_cpu", "queued")

    def __init__(self):
        self.copy_cpu: dict[int, float] = {}  # CPU seconds of the rank's background copy
        self.persist_cpu: dict[int, float] = {}  # CPU seconds of the holder's write of its sections
        self.queued: dict[int, float] = {}  # the training thread's extra wait for a CPU while they ran

    def dicts(self) -> tuple[dict[int, float], ...]:
        return self.copy_cpu, self.persist_cpu, self.queued


class _Ckpt:
    """All ranks' measurements of one checkpoint."""

    __slots__ = (
        "step",
        "seq",
        "profiling",
        "coarse",
        "stall",
        "wait",
        "copy",
        "persist",
        "taken",
        "nbytes",
        "excess",
        "noise",
        "over_iters",
        "base_s",
    )

    def __init__(self, step: int, seq: int, profiling: bool, coarse: bool):
        self.step, self.seq = step, seq
        self.profiling = profiling  # taken at the profiling interval, before the first decision
        self.coarse = coarse  # less than two samples after the one before: its slowdown is not its own
        self.stall: dict[int, float] = {}
        self.wait: dict[int, float] = {}
        self.copy: dict[int, float] = {}
        self.persist: dict[int, float] = {}
        self.taken = _Taken()
        self.nbytes: dict[int, int] = {}
        self.excess: dict[int, float] = {}
        self.over_iters: dict[int, int] = {}
        self.noise: dict[int, float] = {}  # the standard error of each rank's excess
        self.base_s: dict[int, float] = {}

    def put(self, rank, stall, wait, copy, persist, nbytes, copy_cpu=None, persist_cpu=None) -> bool:
        """Record the newest known values of ``rank``; whether anything changed."""
        changed = False
        for d, v in (
            (self.stall, stall),
            (self.wait, wait),
            (self.copy, copy),
            (self.persist, persist),
            (self.taken.copy_cpu, copy_cpu),
            (self.taken.persist_cpu, persist_cpu),
        ):
            if v is not None and d.get(rank) != v:
                d[rank] = v
                changed = True
        if (
            isinstance(nbytes, (int, float))
            and not isinstance(nbytes, bool)
            and nbytes >= 0
            and self.nbytes.get(rank) != int(nbytes)
        ):
            self.nbytes[rank] = int(nbytes)
            changed = True
        return changed

    def drop_rank(self, rank: int) -> None:
        for d in (
            self.stall,
            self.wait,
            self.copy,
            self.persist,
            self.nbytes,
            self.excess,
            self.noise,
            self.over_iters,
            self.base_s,
            *self.taken.dicts(),
        ):
            d.pop(rank, None)

    def empty(self) -> bool:
        return not (self.stall or self.copy or self.persist or self.nbytes)

    def measured(self) -> bool:
        """Whether every rank that stalled for it timed its overlap (the slowest may be the one missing)."""
        return bool(self.stall) and all(r in self.excess for r in self.stall)

    def stall_max(self) -> float | None:
        """The largest stall of a rank, guard waits included."""
        return max(self.stall.values()) if self.stall else None

    def own_stall_max(self) -> float | None:
        """The largest stall of a rank without its guard wait."""
        if not self.stall:
            return None
        return max(max(v - min(self.wait.get(r, 0.0), v), 0.0) for r, v in self.stall.items())

    def cost(self) -> float | None:
        """Training time the checkpoint cost: the slowest rank's stall plus slowdown, without
        guard waits (the largest one also reaches the other ranks, through the collectives)."""
        if not self.stall:
            return None
        # A copy and persist cannot take more from the iterations they overlap than they last: an
        # excess beyond that is the iteration time moving under them (a busy machine), not their doing.
        total = max(v + min(self.excess.get(r, 0.0), self._bg_of(r)) for r, v in self.stall.items())
        waits = max(self.wait.values()) if self.wait else 0.0
        own = self.own_stall_max()
        assert own is not None  # self.stall is not empty
        return max(total - waits, own, 0.0)

    def cpu_taken(self, idle: dict[int, float | None]) -> float | None:
        """The training time its background work's CPU took where training left no core idle: per
        rank, the CPU of its copy and of the holder's write of its sections, times the share of a core
        its node lacked (one minus its idle cores per rank, from 0 to 1); the largest rank's (the
        collectives make every rank wait for the slowest). ``None``: no CPU or idle figure."""
        out = None
        cpu = self.taken
        for r in cpu.copy_cpu.keys() | cpu.persist_cpu.keys():
            free = idle.get(r)
            if free is not None:
                taken = min(max(1.0 - free, 0.0), 1.0) * (cpu.copy_cpu.get(r, 0.0) + cpu.persist_cpu.get(r, 0.0))
                out = taken if out is None else max(out, taken)
        return out

    def queue_taken(self) -> float | None:
        """The training time its background work took as the training threads' wait for a CPU: per
        rank, the wait in the iterations it overlapped above the rank's level with nothing in flight
        (from 0 to as long as its copy and persist lasted); the largest rank's. ``None``: no rank
        reported its wait."""
        queued = self.taken.queued
        if not queued:
            return None
        return max(min(max(v, 0.0), self._bg_of(r)) for r, v in queued.items())

    def _bg_of(self, rank: int) -> float:
        """Copy + persist seconds of ``rank`` (unbounded while its persist is not known)."""
        p = self.persist.get(rank)
        return math.inf if p is None else self.copy.get(rank, 0.0) + p

    def bg(self, persist_expected: bool) -> float | None:
        """Copy + persist seconds of the slowest rank (``None`` while a persist is expected but
        not yet known)."""
        if self.persist:
            return max(self.copy.get(r, 0.0) + p for r, p in self.persist.items())
        if persist_expected:
            return None
        return max(self.copy.values()) if self.copy else None
