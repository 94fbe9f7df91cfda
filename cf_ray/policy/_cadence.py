"""What a checkpoint costs, measured from the cadence: the mean iteration time under the interval in
force against the iteration time with nothing in flight, timed in probe windows when the interval
leaves no iteration free of a checkpoint (controller side only).

Why not from the iterations around each checkpoint alone (:class:`~cf_ray.policy._estimator.Estimator`
does that too): a rank's sample covers every iteration since its last poll (a second of them) and
names only its newest checkpoint. At an interval shorter than a sample, each sample covers several
checkpoints' copies and persists, there is no iteration free of one to compare with, and the
slowdown a checkpoint causes is invisible: the cost looks like the stall alone, and the interval
that cost suggests is the one that hides it. The cadence measure does not need to attribute
iterations to checkpoints:

* ``t_all`` — the mean time of every iteration timed under interval ``k`` (stalls excluded, as the
  samples give it), from the second interval after ``k`` was published on (the first may still
  carry the previous interval's copy or persist);
* ``t_clean`` — for each of those samples, the weighted median of the rank's samples with nothing
  in flight nearest to it in steps (before or after: a probe's), so that a change of the iteration
  time itself is not taken for a checkpoint's doing;
* the slowdown one checkpoint causes: ``k * mean(iter_s - t_clean)``, with a standard error from
  the scatter of both (``k`` times the standard error of the difference).

**The start-up, and an old comparison.** The run's first seconds are slower (the spare workers',
the controller's and the holder's start-up beside training: up to a quarter), and the first
iterations timed with nothing in flight are theirs; against them a checkpoint's slowdown reads as
none (a 20 % budget went to every step on such a figure). A rank's clean samples from before the
rules' first decision on measured figures are set aside once it times a clean one after it
(:meth:`Cadence.started`). A figure whose comparison is the start-up's, or more than a probe window
older than the samples under the interval in force, is not ``referenced``: the rules do not
shorten the interval on it, and a probe window comes first.

**Probe windows.** When a rank has no sample with nothing in flight newer than ``stale_steps``, none
since the start-up a window ago, or the figure is not referenced, the policy publishes a longer
interval for one window (``probe_steps``: the background time of a checkpoint plus three samples'
span, in iterations) so that the ranks time iterations with nothing in flight, then returns to
the interval the rules give. A probe is a schedule version like any
other: every rank adopts it together. It costs no training time (no checkpoint in it); it costs
exposure: a failure in it loses up to ``probe_steps`` of work instead of ``k``. Probes are at
least ``PROBE_SPACING`` windows apart (so at most a tenth of the run is in one).

**The job's overhead** (``measured_overhead_pct``, the profile table's ``overhead_pct``, the
``cf_ray_checkpoint_overhead_pct`` metric): the job's time lost to checkpoints over its training
time, over its recent samples (:data:`JOB_SAMPLES` per rank): ``sum((iter_s - t_clean) * iters) +
stall * checkpoints + step_s * iters`` over ``t_clean * iters`` of the slowest rank, every
checkpoint's stall (guard waits included: the training thread waited) counted at the interval in
force, and the checkpointer's per-step work (``Sample.step_s``: agreeing, deciding, reporting) at
every step.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import deque
from dataclasses import dataclass

from cf_ray.policy._estimate import _median, _weighted_median

PROBE_SPACING = 9
"""Probe windows are at least this many probe windows apart."""
PROBE_SAMPLES = 3
"""A probe window spans the background time of a checkpoint and this many samples' span."""
JOB_SAMPLES = 1024
"""The job's overhead is measured over this many recent samples per rank."""
JOB_BASE_ITERS = 3
"""A sample with nothing in flight is compared with as the job's clean iteration time only when it
covers at least this many iterations: one or two (a poll right after another, the warm-up's end)
are noise that the mean of the clean time before and after would weigh as much as a probe window."""
_REGIME_SAMPLES = 3
"""A cadence measurement needs at least this many samples of every rank at the interval in force."""


@dataclass(frozen=True, slots=True)
class CadenceCost:
    """The slowdown of one checkpoint measured from the cadence at interval ``k``."""

    k: int
    """The interval it was measured at."""
    slowdown: float
    """Seconds of training time one checkpoint's copy and persist cost (``k * (t_all - t_clean)``)."""
    se: float
    """Its standard error."""
    t_all: float
    """Mean seconds per iteration under ``k`` (the governing rank)."""
    t_clean: float
    """Seconds per iteration with nothing in flight (the same rank)."""
    blind: bool
    """Fewer than half the iterations under ``k`` were free of a checkpoint: the per-checkpoint
    attribution cannot see the slowdown."""
    samples: int
    """Samples of the governing rank it is based on."""
    at_step: int
    """The newest step it covers."""
    referenced: bool = True
    """Every rank it compares timed iterations with nothing in flight after the run's start-up
    (:meth:`Cadence.referenced`) and at most a probe window before the interval in force: an older
    comparison is no reason to shorten the interval (a probe window comes first)."""

    def as_dict(self) -> dict:
        return {
            "interval": self.k,
            "slowdown_s": self.slowdown,
            "slowdown_se_s": self.se,
            "iter_s_under_interval": self.t_all,
            "iter_s_nothing_in_flight": self.t_clean,
            "blind": self.blind,
            "samples": self.samples,
            "at_step": self.at_step,
            "referenced": self.referenced,
        }


class _RankCadence:
    __slots__ = ("clean", "clean_steps", "regime", "job", "span", "job_sums", "pending", "past_start")

    def __init__(self):
        self.clean: deque = deque(maxlen=256)  # (last step, iter_s, iters) with nothing in flight, in step order
        self.clean_steps: deque = deque(maxlen=256)  # their steps (for bisect)
        self.regime: list = []  # (step, iter_s, iters, clean, clean iter_s before) under the interval in force
        self.job: deque = deque()  # (lost s, training s, checkpoints) per sample, newest JOB_SAMPLES
        self.job_sums = [0.0, 0.0, 0.0]  # their sums
        self.pending = [0.0, 0, 0.0]  # sum of iter_s * iters, iters, stalls since the newest clean sample
        self.span: deque = deque(maxlen=8)  # iterations per sample
        self.past_start = False  # its start-up's clean samples were set aside (Cadence.add)

    def t_clean(self, newer_than: int) -> tuple[float, float, int] | None:
        """Weighted median of the clean samples newer than ``newer_than``, its standard error and count."""
        items = []
        for step, v, n in reversed(self.clean):
            if step <= newer_than or len(items) >= 16:
                break
            items.append((v, n))
        if not items:
            return None
        return _weighted_median(items), _se(items), len(items)

    def add_job(self, iter_s: float, iters: int, stalls: float, clean: bool) -> None:
        """One sample into the job's overhead (call before adding a clean one to :attr:`clean`).

        A sample with a checkpoint in flight waits for the next clean one: the samples in between are
        then compared with the mean of the clean iteration time before them and after them, so
        that a change of the iteration time itself (the machine's load) is not counted as a cost or
        a gain. ``stalls``: the seconds its checkpoints stalled the training thread.
        """
        pend = self.pending
        if not clean:
            pend[0] += iter_s * iters
            pend[1] += iters
            pend[2] += stalls
            return
        if pend[1]:
            before = self.base_before()
            base = iter_s if before is None else 0.5 * (before + iter_s)
            self._job_entry(pend[0] - base * pend[1], base * pend[1], pend[2])
            pend[:] = [0.0, 0, 0.0]
        self._job_entry(0.0, iter_s * iters, stalls)

    def job_totals(self) -> tuple[float, float, float]:
        """(lost, training, stall) seconds of the recent samples, those waiting for a clean sample
        compared with the newest clean ones."""
        lost, train, stalls = self.job_sums
        pend, base = self.pending, self.base_before()
        if pend[1] and base is not None:
            lost, train, stalls = lost + pend[0] - base * pend[1], train + base * pend[1], stalls + pend[2]
        return lost, train, stalls

    def _job_entry(self, lost: float, train: float, stalls: float) -> None:
        sums = self.job_sums
        self.job.append((lost, train, stalls))
        sums[0], sums[1], sums[2] = sums[0] + lost, sums[1] + train, sums[2] + stalls
        while len(self.job) > JOB_SAMPLES:
            old = self.job.popleft()
            sums[0], sums[1], sums[2] = sums[0] - old[0], sums[1] - old[1], sums[2] - old[2]

    def base_before(self) -> float | None:
        """The iteration time with nothing in flight as of now: the weighted mean of the newest
        four clean samples."""
        if not self.clean:
            return None
        near = list(itertools.islice(reversed(self.clean), 4))
        return sum(v * n for _, v, n in near) / sum(n for _, _, n in near)

    def resolved_base(self, e: list) -> float:
        """The clean iteration time a regime sample is compared with (:meth:`base_at`), kept once a
        clean sample after it is known."""
        if e[4] is not None:
            return e[4]
        base = self.base_at(e[0])
        if base is None:
            return e[1]
        if self.clean[-1][0] > e[0]:
            e[4] = base
        return base

    def base_at(self, step: int) -> float | None:
        """The iteration time with nothing in flight near ``step``: the weighted mean of the clean
        samples next to it (two before, two after)."""
        if not self.clean:
            return None
        i = bisect.bisect_left(self.clean_steps, step)
        near = list(itertools.islice(self.clean, max(i - 2, 0), i + 2))
        return sum(v * n for _, v, n in near) / sum(n for _, _, n in near)  # a mean, as t_all is


class Cadence:
    """The cadence measure, the probe windows and the job's overhead (see the module docstring)."""

    def __init__(self):
        self.ranks: dict[int, _RankCadence] = {}
        self.k: int | None = None  # the interval the regime's samples are under
        self.start_up_end: int | None = None  # the step of the rules' first decision on measured figures
        self.regime_from = 0  # samples whose first iteration is at or after this count
        self.measured: CadenceCost | None = None  # the newest measurement
        self.probe: dict | None = None  # the probe window in force: from_step, k, back_to, ...
        self.last_probe_step: int | None = None
        self.max_step = 0
        self.rows: dict[int, float] = {}  # checkpoint step -> the job's overhead as of it (bounded)
        self.stale = False  # the clean iteration time no longer compares: the next probe is due now
        self.probe_scale = 1  # doubled after a probe that timed no clean samples on some rank

    # -- input ------------------------------------------------------------------------------------
    def interval(self, k: int) -> None:
        """The interval in force (published) is ``k``; a new one starts a new regime."""
        if k != self.k:
            self.k = k
            self.regime_from = self.max_step + max(k, 2) + 2
            for r in self.ranks.values():
                r.regime.clear()

    def started(self) -> None:
        """The rules took their first decision on measured figures: the run's start-up is over
        (see :meth:`add`)."""
        self.start_up_end = self.max_step

    def add(
        self,
        rank: int,
        step: int,
        first: int,
        iter_s: float,
        iters: int,
        clean: bool,
        stall: float,
        step_s: float = 0.0,
    ) -> None:
        """A rank's sample of ``iters`` iterations ending at ``step`` (warm-up excluded); ``stall``:
        the training thread's stall of its newest checkpoint, guard waits included; ``step_s``: the
        checkpointer's per-step work per iteration (lost at every step, interval or not)."""
        r = self.ranks.get(rank)
        if r is None:
            r = self.ranks[rank] = _RankCadence()
        self.max_step = max(self.max_step, step)
        r.span.append(iters)
        base = clean and iters >= JOB_BASE_ITERS
        if base and not r.past_start and self.start_up_end is not None and step > self.start_up_end:
            # The rank's first clean sample after the start-up: the clean samples before it ran beside
            # the run's start-up (the spare workers', the controller's and the holder's first
            # seconds), up to a quarter slower than the job later runs with nothing in flight. Not
            # compared with from now on, by the cost nor by the job's overhead.
            r.clean.clear()
            r.clean_steps.clear()
            r.past_start = True
        r.add_job(iter_s, iters, stall * iters / (self.k or 1) + step_s * iters, base)
        if clean:
            if r.clean and step < r.clean[-1][0]:  # a restart: the steps go back
                r.clean.clear()
                r.clean_steps.clear()
            r.clean.append((step, iter_s, iters))
            r.clean_steps.append(step)
        if first >= self.regime_from and self.probe is None:
            # Compared, at measuring time, with the clean samples on both sides of it (a probe's after it).
            r.regime.append([step, iter_s, iters, clean, None])
            del r.regime[:-256]

    def rollback(self, rank: int) -> None:
        """The rank restarted: its regime samples are no longer under one cadence."""
        r = self.ranks.get(rank)
        if r is not None:
            r.regime.clear()

    # -- the cost -----------------------------------------------------------------------------------
    def referenced(self, rank: int) -> bool:
        """Whether ``rank`` timed iterations with nothing in flight (at least :data:`JOB_BASE_ITERS`
        in a sample) after the run's start-up (:meth:`started`): between checkpoints at a long
        interval, in a probe window at a short one. Before, it has only the start-up's to compare
        with (see :meth:`add`), against which a checkpoint's slowdown reads as about none."""
        r = self.ranks.get(rank)
        return r is not None and r.past_start

    def stale_steps(self, t: float, bg: float) -> int:
        """Clean samples older than this many steps are too old to compare with."""
        return PROBE_SPACING * self.probe_steps(t, bg)

    def span(self) -> float:
        """Iterations per sample (the median of the recent ones; 1 before any)."""
        spans = [n for r in self.ranks.values() for n in r.span]
        return _median(spans) if spans else 1.0

    def probe_steps(self, t: float, bg: float) -> int:
        """Steps of one probe window: a checkpoint's background time and ``PROBE_SAMPLES`` samples."""
        steps = max(math.ceil(bg / t) + PROBE_SAMPLES * math.ceil(self.span()) + 2, 4) if t > 0 else 4
        return steps * self.probe_scale

    def measure(self, t: float, bg: float, active: set[int]) -> CadenceCost | None:
        """The slowdown of one checkpoint at the interval in force, from the governing rank (the
        largest slowdown), or ``None`` while too few samples or no recent clean ones; the newest
        measurement is kept (:attr:`measured`) until a newer one replaces it."""
        k = self.k
        if k is None or self.probe is not None:
            return self.measured
        newer_than = self.max_step - self.stale_steps(t, bg)
        best: CadenceCost | None = None
        referenced, window = True, self.probe_steps(t, bg)
        for rank in active:
            r = self.ranks.get(rank)
            if r is None:
                continue
            regime = r.regime
            iters = sum(n for _, _, n, _, _ in regime)
            base = r.t_clean(newer_than)
            if base is None or len(regime) < _REGIME_SAMPLES or iters < 3 * k:
                continue
            se_c = base[1]
            referenced = referenced and r.past_start and r.clean[-1][0] >= regime[0][0] - window
            diffs = [(v - r.resolved_base(e), n) for e in regime for _, v, n, _, _ in (e,)]
            t_all = sum(v * n for _, v, n, _, _ in regime) / iters
            d = sum(x * n for x, n in diffs) / iters
            clean_iters = sum(n for _, _, n, c, _ in regime if c)
            m = CadenceCost(
                k=k,
                slowdown=k * d,
                se=k * math.hypot(_se(diffs), se_c),
                t_all=t_all,
                t_clean=t_all - d,
                blind=clean_iters < 0.5 * iters,
                samples=len(regime),
                at_step=self.max_step,
            )
            if best is None or m.slowdown > best.slowdown:
                best = m
        if best is not None and not referenced:
            best = dataclasses.replace(best, referenced=False)
        if best is not None and best.slowdown + 2.0 * best.se < 0:
            # Faster with checkpoints than without: the iteration time itself moved since the clean
            # samples were timed (the machine's load), so they no longer compare. Not a measurement;
            # a probe is due.
            self.stale = True
        elif best is not None:
            self.measured = best
        return self.measured

    def needs_probe(self, t: float, bg: float, active: set[int]) -> str | None:
        """Why a probe is due, or ``None``: the last probe is far enough back, and a rank has no
        clean sample recent enough to compare with, none since the start-up a window ago
        (:meth:`referenced`), or the newest figure is not referenced."""
        if self.probe is not None or not active:
            return None
        window = self.probe_steps(t, bg)
        since_probe = math.inf if self.last_probe_step is None else self.max_step - self.last_probe_step
        if self.stale and since_probe >= 2 * window:
            return "the iteration time moved since iterations were last timed with nothing in flight"
        end = self.start_up_end
        if since_probe >= 2 * window:
            if end is not None and self.max_step - end >= window and not all(self.referenced(r) for r in active):
                return f"no iteration timed with nothing in flight since the run's start-up (step {end})"
            if self.measured is not None and not self.measured.referenced:
                return "the iterations timed with nothing in flight are older than the interval in force"
        stale = self.stale_steps(t, bg)
        if since_probe < stale:
            return None
        newer_than = self.max_step - stale
        if any((r := self.ranks.get(rank)) is None or r.t_clean(newer_than) is None for rank in active):
            return f"no iteration timed with nothing in flight for {stale} steps"
        return None

    def start_probe(self, k_probe: int, back_to: int) -> None:
        self.probe = {"from_step": self.max_step, "k": k_probe, "back_to": back_to}
        self.last_probe_step = self.max_step

    def probe_done(self, active: set[int]) -> bool:
        """Every active rank timed two clean samples in the window, or it lasted three windows."""
        p = self.probe
        assert p is not None
        p["timed"] = all(
            (r := self.ranks.get(rank)) is not None and sum(1 for s, _, _ in r.clean if s > p["from_step"]) >= 2
            for rank in active
        )
        return p["timed"] or self.max_step - p["from_step"] > 3 * p["k"]

    def end_probe(self) -> int:
        """The probe window is over: the interval to return to. One that ended before every rank
        timed clean samples in it leaves the baseline stale: the next one, twice as long, is due
        after two windows (at most eight times the first's length)."""
        p = self.probe
        assert p is not None
        self.probe = None
        self.last_probe_step = self.max_step
        if p.get("timed"):
            self.stale, self.probe_scale = False, 1
        else:
            self.stale, self.probe_scale = True, min(2 * self.probe_scale, 8)
        return p["back_to"]

    # -- the job's overhead ---------------------------------------------------------------------------
    def row(self, step: int, pct: float) -> None:
        """Remember the job's overhead as of the checkpoint at ``step`` (the profile table's row)."""
        self.rows[step] = pct
        while len(self.rows) > JOB_SAMPLES:
            del self.rows[next(iter(self.rows))]

    def job_overhead_pct(self, active: set[int], t: float, bg: float) -> float | None:
        """The job's time lost to checkpoints over its training time, in percent (the slowest rank:
        the one with the longest iterations with nothing in flight), or ``None`` before it is known."""
        newer_than = self.max_step - self.stale_steps(t, bg)
        best = None
        for rank in active:
            r = self.ranks.get(rank)
            base = r.t_clean(newer_than) or r.t_clean(-1) if r is not None else None
            if r is None or base is None:
                continue
            lost, train, stalls = r.job_totals()
            if train > 0 and (best is None or base[0] > best[0]):
                # The stalls are lost for certain; the slowdown is never counted below zero (the
                # iteration time moved between the clean samples: not a gain from checkpointing).
                best = (base[0], 100.0 * (max(lost, 0.0) + stalls) / train)
        return best[1] if best is not None else None


def _se(pairs) -> float:
    """Standard error of the weighted mean of ``(value, weight)`` samples (0 for fewer than two)."""
    n = len(pairs)
    if n < 2:
        return 0.0
    w = sum(x for _, x in pairs)
    mean = sum(v * x for v, x in pairs) / w
    var = sum(x * (v - mean) ** 2 for v, x in pairs) / w
    return math.sqrt(var / (n - 1))
