"""Samples -> estimates: what :class:`~cf_ray.policy.adaptive.Adaptive` learns from the timing
samples of every rank (controller side only).

:class:`Estimator` takes in :class:`~cf_ray.policy.base.Sample` objects, keeps per rank the
iteration times with and without a checkpoint in flight and per checkpoint what every rank
measured of it, and turns them into an :class:`Estimate` (seconds per iteration ``t``, the cost
``C`` and the background time ``B`` of one checkpoint, with their standard errors and the changes
of level detected) that the decision ladder (:mod:`cf_ray.policy._rules`) reads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from cf_ray.policy._bookkeeping import _Ckpt, _Rank, _RankCkpt
from cf_ray.policy._cadence import Cadence
from cf_ray.policy._estimate import (
    Estimate,
    _bg_from_waits,
    _max_or_none,
    _median,
    _nonneg,
    _pos,
    _robust_mean,
    _weighted_median,
)
from cf_ray.policy.base import Sample

_DETAIL = frozenset({"copy", "persist", "nbytes", "rate", "drift", "cpu", "queued"})
"""The keys of :meth:`Estimator._summary` that go into :class:`EstimateDetail`."""


COST_SCATTER_PRIOR = 0.5
"""What the cost of one checkpoint scatters by from one checkpoint to the next, as a fraction of it,
before a level has values enough to say (the slowdown is read from iteration times with a few per
cent of noise each; one run of the 302 MB DDP job read 0.02-0.39 s at one interval)."""
COST_SCATTER_WEIGHT = 2
"""How many values :data:`COST_SCATTER_PRIOR` counts as: after a dozen checkpoints the level's own
scatter decides."""


class Estimator:
    """Everything :meth:`Adaptive.plan` learns from the samples; lives on the controller only."""

    def __init__(self, *, window: int, warmup_steps: int, drift_ratio: float):
        self.window = window  # Adaptive.window
        self.warmup_steps = warmup_steps  # Adaptive.warmup_steps
        self.drift_ratio = drift_ratio  # Adaptive.drift_ratio
        self.prior: dict | None = None  # a saved profile (Adaptive.load_state_dict) standing in for measurements
        self.last_obj: Sample | None = None  # the newest sample taken in (identity, see _new_samples)
        self.ranks: dict[int, _Rank] = {}
        self.recs: dict[int, _Ckpt] = {}  # by checkpoint step, in step order, bounded
        self.rev = 0  # bumped whenever a record changes
        self.summary_rev = -1
        self.summary: dict | None = None
        self.clock = 0  # samples taken in
        self.ckpt_clock = 0  # checkpoints seen
        self.max_step = 0
        self.persist_seen = False
        self.cadence = Cadence()  # the cost measured from the cadence, probe windows, the job's overhead

    def ingest(self, samples: Sequence[Sample], current: int, profiling: bool) -> None:
        """Take in the samples not taken in yet (see :meth:`_new_samples`).

        ``current`` is the interval in force (it helps attribute checkpoint values that come
        without ``ckpt_step``); ``profiling``: no interval has been decided yet, so the
        checkpoints first heard of now were taken at the short profiling interval.
        """
        self.cadence.interval(current)
        # Checkpoints less than two samples apart are set aside like the profiling ones: a sample
        # then covers several, and the slowdown it shows cannot be told apart between them.
        coarse = current < 2 * self.cadence.span()
        for s in self._new_samples(samples):
            self._ingest(s, current, profiling, coarse)

    def record(self, step: int) -> _Ckpt | None:
        """What every rank measured of the checkpoint at ``step`` (recent checkpoints only)."""
        return self.recs.get(step)

    def _new_samples(self, samples: Sequence[Sample]) -> Sequence[Sample]:
        """The samples after the newest one already taken in (found by identity, scanning back)."""
        n = len(samples)
        if n == 0:
            return ()
        last = self.last_obj
        start = 0
        if last is not None:
            for i in range(n - 1, -1, -1):
                if samples[i] is last:
                    start = i + 1
                    break
        self.last_obj = samples[n - 1]
        if start == 0:
            return samples
        return [samples[i] for i in range(start, n)]

    # -- ingestion ------------------------------------------------------------------------------
    def _ingest(self, s: Sample, current: int, profiling: bool, coarse: bool) -> None:
        if not (
            isinstance(s, Sample)
            and isinstance(s.rank, numbers.Integral)
            and isinstance(s.step, numbers.Integral)
            and (s.ckpt_step is None or isinstance(s.ckpt_step, numbers.Integral))
        ):
            return  # not a sample: ignored rather than fatal to the controller
        self.clock += 1
        r = self.ranks.get(s.rank)
        if r is None:
            r = self.ranks[s.rank] = _Rank(self.warmup_steps)
        r.seen = self.clock
        iters = int(s.iters) if isinstance(s.iters, numbers.Integral) and s.iters > 0 else 0
        if iters and s.step < r.last_step:
            self._rollback(s.rank, r, s.step - iters)
        if (
            any(
                v is not None
                for v in (s.stall_s, s.wait_s, s.copy_s, s.persist_s, s.nbytes, s.copy_cpu_s, s.persist_cpu_s)
            )
            or s.ckpt_step is not None
        ):
            self._ingest_ckpt(s.rank, r, s, current, profiling, coarse)
        if iters and (idle := _nonneg(s.idle_cpus)) is not None:
            r.idle.append(idle)
            self.rev += 1  # the CPU taken from training depends on it
        if iters and _pos(s.iter_s) is not None:
            r.last_step = max(r.last_step, s.step)
            self.max_step = max(self.max_step, s.step)
            first = s.step - iters + 1
            if first <= r.warm_until:
                if s.step > r.warm_until:
                    # Its mean includes warm-up iterations, so it is no measurement; but it is the
                    # only iteration time there is until the next sample, a poll later, and the
                    # first checkpoint's stall needs one to be weighed against the budget at once.
                    r.rough = s.iter_s
                return
            self._ingest_iters(s.rank, r, s, first, iters)

    def _rollback(self, rank: int, r: _Rank, restored: int) -> None:
        """The rank restarted from ``restored``: forget its part of the abandoned checkpoints."""
        for step in [c for c in self.recs if c > restored]:
            rec = self.recs[step]
            rec.drop_rank(rank)
            if rec.empty():
                del self.recs[step]
        if r.cur is not None and r.cur.step > restored:
            r.cur = None
        r.last_step = restored
        r.warm_until = restored + self.warmup_steps
        self.cadence.rollback(rank)
        self.rev += 1

    def _ingest_ckpt(self, rank: int, r: _Rank, s: Sample, current: int, profiling: bool, coarse: bool) -> None:
        c = s.ckpt_step
        approx = False
        cur = r.cur
        if c is None:
            # The engine did not say which checkpoint the values describe. Guess: the same one
            # until they change half an interval later, or a whole interval has passed.
            values = (s.stall_s, s.copy_s, s.nbytes)
            persist_only = all(v is None for v in values)
            gap = s.step - cur.step if cur is not None else 0
            if cur is not None and (
                persist_only or (cur.approx and gap < current and (values == cur.values or gap < max(2, current // 2)))
            ):
                c = cur.step
            else:
                c, approx = max(s.step - max(s.iters, 1), 0), True
        if cur is None or c > cur.step or (approx and c != cur.step):
            if cur is not None:
                self._close_segment(rank, cur)
            cur = r.cur = _RankCkpt(c, approx, cur.step if cur is not None else None)
        rec = self.recs.get(c)
        if rec is None:
            if c < cur.step:
                # A rank reports only its newest checkpoint with each sample, so at short
                # intervals most checkpoints are never heard of until their persist time comes
                # from the controller — and at an interval shorter than the persist, the ones the
                # holder wrote are the only evidence of how long a persist takes. Keep those
                # (in step order); drop anything else older than the newest checkpoint, and, once
                # as many are kept as the window needs, whatever is older than every one of them
                # (a run's first persist time counts even when its first sample named a later one).
                full = len(self.recs) >= 2 * self.window + 4
                if s.persist_s is None or (full and c < next(iter(self.recs))):
                    return
                self.ckpt_clock += 1
                self.rev += 1
                self.recs[c] = _Ckpt(c, self.ckpt_clock, profiling, coarse)
                self.recs = dict(sorted(self.recs.items()))
                rec = self.recs[c]
            else:
                self.ckpt_clock += 1
                self.rev += 1
                rec = self.recs[c] = _Ckpt(c, self.ckpt_clock, profiling, coarse)
            while len(self.recs) > 2 * self.window + 4:
                del self.recs[next(iter(self.recs))]
        if rec.put(
            rank,
            _nonneg(s.stall_s),
            _nonneg(s.wait_s),
            _nonneg(s.copy_s),
            _nonneg(s.persist_s),
            s.nbytes,
            _nonneg(s.copy_cpu_s),
            _nonneg(s.persist_cpu_s),
        ):
            self.rev += 1
        if s.persist_s is not None:
            self.persist_seen = True
        if cur.step == c and s.stall_s is not None:
            cur.values = (s.stall_s, s.copy_s, s.nbytes)

    def _ingest_iters(self, rank: int, r: _Rank, s: Sample, first: int, iters: int) -> None:
        cur = r.cur
        base = r.base()
        overlapped = cur is not None and not cur.closed and self._overlapped(rank, r, s, first)
        stall = _nonneg(s.stall_s) or 0.0
        step_s = _nonneg(s.step_s) or 0.0
        queue = _nonneg(s.queue_s)
        self.cadence.add(rank, s.step, first, s.iter_s, iters, clean=not overlapped, stall=stall, step_s=step_s)
        if overlapped:
            assert cur is not None
            if base is not None:
                cur.excess += (s.iter_s - base) * iters
                cur.base_open = cur.base_open or base
                cur.before = cur.before or _weighted_median(list(r.clean)[-3:])
            if queue is not None and (level := r.queue_level()) is not None:
                cur.queued += (queue - level) * iters
                cur.queued_iters += iters
            cur.over_s += s.iter_s * iters
            cur.over_iters += iters
            cur.over_sq += iters * iters
            r.dirty.append((s.iter_s, iters))
        else:
            if cur is not None and not cur.closed:
                if cur.base_open and abs(s.iter_s / cur.base_open - 1.0) > 0.25:
                    # The iteration time itself moved meanwhile: the difference is not the
                    # checkpoint's doing, so this checkpoint's slowdown is not measured (and it
                    # does not count as a checkpoint whose slowdown is known: ``settled``).
                    cur.unmeasured = True
                elif cur.before and cur.over_iters:
                    # Against the clean iterations on both sides of the overlap: the run's
                    # median would make a trend (a start-up still slowing the first ones) read
                    # as a slowdown, or as none.
                    cur.excess = cur.over_s - cur.over_iters * 0.5 * (cur.before + s.iter_s)
                self._close_excess(rank, cur, r.scatter())
            r.clean.append((s.iter_s, iters))
            if queue is not None:
                r.queue.append((queue, iters))
            r.invalidate()
        if cur is not None:
            per_iter = base if base is not None else s.iter_s
            before = min(max(cur.step - first + 1, 0), iters)  # iterations before the checkpoint
            cur.seg_base += per_iter * (iters - before)
            prev = self.recs.get(cur.prev_step) if cur.prev_step is not None else None
            if before and prev is not None and rank in prev.base_s:
                prev.base_s[rank] += per_iter * before
                self.rev += 1

    def _overlapped(self, rank: int, r: _Rank, s: Sample, first: int) -> bool:
        if s.overlapped is not None:
            return bool(s.overlapped)
        cur = r.cur
        assert cur is not None  # called only while this rank has a checkpoint open
        rec = self.recs.get(cur.step)
        copy = rec.copy.get(rank) if rec else None
        persist = rec.persist.get(rank) if rec else None
        if persist is None and self.persist_seen:
            return True  # persists are reported in this run and this one has not finished yet
        base = r.base()
        if base is None:
            base = self._t_iter()[0]
        # The slowest rank's copy and persist: the collectives pass its slowdown on to every rank.
        bg = max((copy or 0.0) + (persist or 0.0), (rec.bg(False) or 0.0) if rec else 0.0)
        steps = math.ceil(bg / base) if base else 1
        return first <= cur.step + max(steps, 1)

    def _close_excess(self, rank: int, cur: _RankCkpt, scatter: float | None = None) -> None:
        cur.closed = True
        rec = self.recs.get(cur.step)
        if rec is not None and not cur.unmeasured:
            rec.excess[rank] = cur.excess  # unclipped: noise averages out over checkpoints
            rec.over_iters[rank] = cur.over_iters
            if cur.queued_iters:
                rec.taken.queued[rank] = cur.queued
            if scatter is not None:
                # Each overlapped sample's scatter, and the baseline's (a third of one sample's
                # variance per iteration: the mean of the samples before and the one after).
                rec.noise[rank] = scatter * math.sqrt(cur.over_sq + cur.over_iters**2 / 3.0)
            self.rev += 1

    def _close_segment(self, rank: int, cur: _RankCkpt) -> None:
        if not cur.closed:
            self._close_excess(rank, cur)
        rec = self.recs.get(cur.step)
        if rec is not None and cur.seg_base > 0:
            rec.base_s[rank] = cur.seg_base
            self.rev += 1

    # -- estimates ------------------------------------------------------------------------------
    def _t_iter(self) -> tuple[float | None, int | None, bool]:
        """Seconds per iteration of the slowest active rank, that rank, and whether every active
        rank's value comes from iterations with nothing in flight."""
        horizon = 64 * max(len(self.ranks), 1) + 256  # ranks silent this long are gone
        best, who, clean = None, None, True
        for rank, r in self.ranks.items():
            if self.clock - r.seen > horizon:
                continue
            b = r.base()
            if b is None:
                b = r.dirty_base() or r.rough
                if b is None:
                    continue
                clean = False
            if best is None or b > best:
                best, who = b, rank
        return best, who, clean and best is not None

    def estimate(self) -> Estimate | None:
        """The estimates a decision is based on (the saved profile stands in for what is not
        measured yet), or ``None`` while there is not enough to go on."""
        t, slowest, t_clean = self._t_iter()
        prior = self.prior
        if t is None and prior:
            t = prior["iter_s"]
        summary = self._summary()
        if t is None or (summary is None and not prior):
            return None
        est = Estimate(t=t, slowest=slowest, t_clean=t_clean, sample_iters=self.cadence.span())
        if summary is None:
            assert prior  # no summary and no prior returned above
            est.cost, est.stall, est.bg, est.source = (
                prior["cost_s"],
                prior["stall_s"],
                prior["background_s"],
                "saved profile",
            )
            est.detail.nbytes = prior.get("bytes")
            return est
        for name, value in summary.items():
            if name in _DETAIL:
                setattr(est.detail, name, value)
            elif name != "wait_gaps":
                setattr(est, name, value)
        if est.bg is None:
            est.bg = prior["background_s"] if prior else 0.0
        lower = _bg_from_waits(summary["wait_gaps"], t)
        if lower is not None and lower > est.bg:
            est.bg, est.bg_from_waits = lower, True
        self._with_cadence(est)
        d = est.detail
        if d.cpu is not None and est.stall + d.cpu > est.cost:
            est.cost, est.cost_source = est.stall + d.cpu, "CPU taken from training"
        if d.queued is not None and est.stall + d.queued > est.cost:
            est.cost, est.cost_source = est.stall + d.queued, "training's wait for a CPU"
        return est

    def active(self) -> set[int]:
        """The ranks heard from recently (a rank silent this long is gone)."""
        horizon = 64 * max(len(self.ranks), 1) + 256
        return {rank for rank, r in self.ranks.items() if self.clock - r.seen <= horizon}

    def _with_cadence(self, est: Estimate) -> None:
        """The cost measured from the cadence replaces the per-checkpoint one where that cannot
        see the slowdown (a blind interval: most iterations overlap a checkpoint), or where it is
        clearly more (by two standard errors); and the job's overhead (see :mod:`cf_ray.policy._cadence`)."""
        active, d = self.active(), est.detail
        m = d.cadence = self.cadence.measure(est.t, est.bg, active)
        if m is not None:
            cost = est.stall + min(max(m.slowdown, 0.0), est.bg or math.inf)
            if m.blind or cost - 2.0 * m.se > est.cost:
                est.cost, est.cost_se, est.cost_source = cost, m.se, "cadence"
        d.measured_pct = pct = self.cadence.job_overhead_pct(active, est.t, est.bg)
        if pct is not None:
            for step in reversed(self.recs):
                if step in self.cadence.rows:
                    break
                self.cadence.row(step, pct)

    def _summary(self) -> dict | None:
        """The per-checkpoint part of the estimates; recomputed only when a record changed."""
        if self.summary_rev == self.rev:
            return self.summary
        self.summary_rev = self.rev
        every = list(self.recs.values())
        recs = every
        tuned = [rec for rec in every if not (rec.profiling or rec.coarse)]
        # Checkpoints at the short profiling interval may have waited or overlapped: set aside while
        # two others say what a checkpoint costs, and while those are recent (one of the last three):
        # a level frozen on old checkpoints (the interval now sets every new one aside) would hold
        # the estimates, and the interval, where they were when it was set.
        if sum(1 for rec in tuned if rec.measured()) >= 2 and tuned[-1] in every[-3:]:
            recs = tuned
        # A checkpoint set aside for its slowdown only (less than two samples after the one before)
        # still says how long its copy and persist took: without it, an interval that storage made
        # wide (a persist filling it) would be held by the slow persists for as long as it lasts.
        timed = [rec for rec in every if not rec.profiling]
        if sum(1 for rec in timed if rec.persist or rec.copy) < 2:
            timed = recs
        stalls = [(rec.step, v) for rec in recs if (v := rec.own_stall_max()) is not None]
        if not stalls:
            self.summary = None
            return None
        # cost() is None exactly when a record has no stall.
        settled = [(rec.step, c) for rec in recs if rec.measured() and (c := rec.cost()) is not None]
        costs = settled if settled else [(rec.step, c) for rec in recs if (c := rec.cost()) is not None]
        bgs = [(rec.step, v) for rec in timed if (v := rec.bg(self.persist_seen)) is not None]
        drift: dict[str, Any] = {}
        out: dict[str, Any] = {"drift": drift, "n": len(costs)}
        # Each measured cost's noise (its slowest-reading rank's), for the level's standard error.
        noise = {rec.step: max(rec.noise.values()) for rec in recs if rec.noise and rec.measured()}
        out["cost"], out["cost_se"], out["n_level"] = _level(
            "cost_s", costs, drift, self.window, self.drift_ratio, [noise.get(step) for step, _ in costs]
        )
        out["stall"] = _level("stall_s", stalls, {}, self.window, self.drift_ratio)[0]
        out["bg"], out["bg_se"], n_bg = (
            _level("background_s", bgs, drift, self.window, self.drift_ratio) if bgs else (None, 0.0, 0)
        )
        out["n_level"] = min(out["n_level"], n_bg) if bgs else out["n_level"]
        copies = [v for rec in timed if (v := _max_or_none(rec.copy)) is not None]
        persists = [v for rec in timed if (v := _max_or_none(rec.persist)) is not None]
        out["copy"] = _median(copies[-self.window :]) if copies else None
        out["persist"] = _median(persists[-self.window :]) if persists else None
        out["has_persist"] = bool(persists)
        out["cpu"], out["queued"] = _taken_levels(self, recs, timed)
        out["settled"] = bool(settled)
        with_bytes = [rec for rec in timed if rec.nbytes]
        out["nbytes"] = sum(with_bytes[-1].nbytes.values()) if with_bytes else None
        rates = [
            sum(rec.nbytes.values()) / max(rec.persist.values())
            for rec in timed
            if rec.nbytes and rec.persist and max(rec.persist.values()) > 0
        ]
        out["rate"] = _median(rates[-self.window :]) if rates else None
        out["wait_gaps"] = [
            (rec.step - prev.step, max(rec.wait.values()), prev.bg(self.persist_seen))
            for prev, rec in zip(timed[-4:], timed[-3:])
            if rec.wait and max(rec.wait.values()) > 0 and rec.step > prev.step
        ]
        self.summary = out
        return out


def _taken_levels(est: Estimator, recs: list[_Ckpt], timed: list[_Ckpt]) -> tuple[float | None, float | None]:
    """The floors of the cost that need no iteration with nothing in flight (median of recent
    checkpoints): what the background work's CPU took from training where it found no idle core
    (``Sample.idle_cpus``), and the training threads' extra wait for a CPU while it ran
    (``Sample.queue_s``), which also counts what the CPU figures do not (other processes' work on its
    behalf, the kernel's). The wait only where a checkpoint's own iterations can be told apart (not
    coarse: a sample covering several checkpoints would give one of them all their wait)."""
    idle = {rank: r.idle_level() for rank, r in est.ranks.items()}
    taken = [v for rec in timed if (v := rec.cpu_taken(idle)) is not None]
    queued = [v for rec in recs if not rec.coarse and (v := rec.queue_taken()) is not None]
    return (
        _median(taken[-est.window :]) if taken else None,
        _median(queued[-est.window :]) if queued else None,
    )


def _level(
    name: str,
    series: list[tuple[int, float]],
    drift: dict,
    window: int,
    drift_ratio: float,
    noise: list[float | None] | None = None,
) -> tuple[float, float, int]:
    """Robust mean of the last ``window`` values since the last change of level, its standard
    error (from their median absolute deviation; for ``cost_s`` pooled with a prior scatter no less
    than the values' own ``noise``, each value's standard error where known), and how many values
    it is based on.

    A change of level is two newest values (three for a fall of ``cost_s``) all off the median
    of the values before them (at least two) by more than ``drift_ratio`` — or by more than four
    times that series' own typical scatter (median absolute deviation of the logarithms), so
    noisy storage does not look like drift — in the same direction.
    """
    noises: list[float | None] = list(noise or [None] * len(series))[-2 * window - 2 :]
    series = series[-2 * window - 2 :]  # a change of level older than this is in the mean anyway
    vals = [max(v, 1e-9) for _, v in series]
    logs = [math.log(v) for v in vals]
    start, base_thr = 0, math.log(drift_ratio)
    for i in range(3, len(vals)):
        ref = logs[max(start, i - 1 - window) : i - 1]
        if len(ref) < 2:
            continue
        m = _median(ref)
        mad = _median([abs(x - m) for x in ref])
        thr = max(base_thr, 4.0 * mad)
        # Two newest values; a fall of the cost (it shortens the interval against the budget)
        # needs three, so one or two odd checkpoints do not move it.
        fall = 3 if name == "cost_s" else 2
        if logs[i - 1] - m > thr and logs[i] - m > thr:
            n = 2
        elif all(x - m < -thr for x in logs[i + 1 - fall : i + 1]) and i + 1 - fall >= start + 2:
            n = fall
        else:
            continue
        drift[name] = {"at_step": series[i + 1 - n][0], "from": math.exp(m), "to": _median(vals[i + 1 - n : i + 1])}
        start = i + 1 - n
    recent = vals[max(start, len(vals) - window) :]
    mean, n = _robust_mean(recent), len(recent)
    # The scatter as the median absolute deviation (x 1.4826: the standard deviation for normal
    # noise): one value that straddles a change of level (a persist that was half slow) would
    # otherwise inflate the standard error for ``window`` checkpoints, and with it the
    # pessimistic estimate that shortening waits for, long after the mean has dropped it.
    m = _median(recent)
    sd = 1.4826 * _median([abs(v - m) for v in recent]) if n >= 2 else 0.0
    if name == "cost_s":
        # One, two or three costs say little of their own scatter (one says none; two that
        # happen to agree say almost none): pooled with COST_SCATTER_PRIOR, worth
        # COST_SCATTER_WEIGHT values, so that a decision on the first checkpoints of a level
        # weighs them as uncertain as they are.
        # Where each value's own noise is known (the iteration times' scatter over the iterations
        # it was read from), the prior is no less: two readings of about none from noisy
        # iterations say little, and a prior in proportion to them said +/- 0.0008 s.
        known = [v for v in noises[len(vals) - n :] if v is not None]
        prior = max(COST_SCATTER_PRIOR * mean, math.sqrt(sum(v * v for v in known) / len(known)) if known else 0.0)
        sd = math.sqrt((COST_SCATTER_WEIGHT * prior**2 + (n - 1) * sd**2) / (COST_SCATTER_WEIGHT + n - 1))
    return mean, sd / math.sqrt(n) if n else 0.0, n
