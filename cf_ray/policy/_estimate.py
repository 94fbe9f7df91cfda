"""The estimates one decision of :class:`~cf_ray.policy.adaptive.Adaptive` is based on
(:class:`Estimate`, made by :class:`~cf_ray.policy._estimator.Estimator`, read by the decision
ladder in :mod:`cf_ray.policy._rules`), the numeric helpers both use, and the background time that
guard waits imply (:func:`_bg_from_waits`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cf_ray.policy._cadence import CadenceCost
    from cf_ray.policy._hazard import HazardEstimate


@dataclass(kw_only=True, slots=True)
class EstimateDetail:
    """What the estimates are made of beyond what the rules read (for :meth:`Adaptive.explain`)."""

    copy: float | None = None
    """Copy seconds (median of recent checkpoints)."""
    persist: float | None = None
    """Persist seconds (median of recent checkpoints)."""
    nbytes: int | None = None
    """Bytes of the newest checkpoint, all ranks."""
    rate: float | None = None
    """Persist throughput, bytes per second."""
    cpu: float | None = None
    """Training time per checkpoint its background work's CPU took where training left no core
    idle (median of recent checkpoints; :meth:`~cf_ray.policy._bookkeeping._Ckpt.cpu_taken`)."""
    queued: float | None = None
    """Training time per checkpoint the training threads waited for a CPU while its copy or persist
    ran, above their wait with nothing in flight (median of recent checkpoints;
    :meth:`~cf_ray.policy._bookkeeping._Ckpt.queue_taken`)."""
    measured_pct: float | None = None
    """The job's time lost to checkpoints over its training time, in percent (recent samples)."""
    cadence: CadenceCost | None = None
    """The cost measured from the cadence (:mod:`cf_ray.policy._cadence`), ``None`` before one."""
    drift: dict = field(default_factory=dict)
    """Changes of level detected in the per-checkpoint series."""


@dataclass(kw_only=True, slots=True)
class Estimate:
    """The estimates one decision is based on."""

    t: float
    """Seconds per iteration (slowest rank)."""
    slowest: int | None = None
    """The rank whose iteration time governs."""
    cost: float = 0.0
    """Training time one checkpoint costs (stall + slowdown)."""
    cost_se: float = 0.0
    """Standard error of ``cost``."""
    stall: float = 0.0
    """Training-thread stall per checkpoint (max over ranks)."""
    bg: float = 0.0
    """Copy + persist seconds per checkpoint (max over ranks)."""
    bg_se: float = 0.0
    """Standard error of ``bg``."""
    t_clean: bool = True
    """Whether ``t`` comes from iterations with nothing in flight."""
    settled: bool = False
    """Whether some checkpoint's slowdown is measured (its overlap is over), so ``cost`` holds it."""
    bg_from_waits: bool = False
    """Whether ``bg`` is the lower bound that guard waits imply."""
    n: int = 0
    """Checkpoints measured (recent history)."""
    sample_iters: float = 1.0
    """Iterations per sample (the median of the recent ones)."""
    n_level: int = 0
    """Checkpoints the current cost and persist estimates are based on (since the last drift)."""
    has_persist: bool = False
    """Whether any persist time was measured."""
    source: str = "measured"
    """``measured`` or ``saved profile``."""
    cost_source: str = "per checkpoint"
    """Where ``cost`` comes from: ``per checkpoint`` (the iterations around each checkpoint) or
    ``cadence`` (:mod:`cf_ray.policy._cadence`), or ``CPU taken from training`` (more than either:
    :attr:`EstimateDetail.cpu`)."""
    detail: EstimateDetail = field(default_factory=EstimateDetail)
    """Copy and persist times, bytes, throughput, measured overhead and drift (reported only)."""
    hazard: HazardEstimate | None = None
    """How often the run fails and what a recovery takes (set by :meth:`Adaptive.plan`)."""


# -- numeric helpers ----------------------------------------------------------------------------


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)


def _pos(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 else None


def _nonneg(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 else None


def _max_or_none(d: dict) -> float | None:
    return max(d.values()) if d else None


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _robust_mean(xs: Sequence[float]) -> float:
    """Mean without the lowest and the highest value (the median for fewer than four values)."""
    if len(xs) < 4:
        return _median(xs)
    s = sorted(xs)[1:-1]
    return sum(s) / len(s)


def _weighted_median(pairs) -> float:
    items = sorted(pairs)
    total = sum(w for _, w in items)
    acc = 0.0
    for v, w in items:
        acc += w
        if acc * 2 >= total:
            return v
    return items[-1][0]


WAIT_EVIDENCE_S = 0.002
"""A guard wait shorter than this (or than a twentieth of an iteration) says nothing of the previous
persist: the wait's own cost is a fraction of a millisecond on every checkpoint, and taken as
evidence it made the interval its own lower bound (each wider interval, a wider bound)."""


def _bg_from_waits(wait_gaps: list, t: float) -> float | None:
    """The copy+persist time that guard waits imply, or ``None``: a wait means the previous
    copy+persist outlasted the interval, so it took at least the time between the two checkpoints
    plus the wait (a slower disk is caught at once, before or without persist times). Not a wait
    shorter than what waiting itself costs, nor one after a checkpoint whose copy+persist is known to
    have taken under a quarter of the gap: that one did not outlast the interval."""
    floor = max(WAIT_EVIDENCE_S, 0.05 * t)
    lower = [
        gap * t + w for gap, w, prev_bg in wait_gaps if w >= floor and (prev_bg is None or 4.0 * prev_bg >= gap * t)
    ]
    return max(lower) if lower else None
