"""Verdicts that hold on a noisy machine: each overhead with its spread across rounds, the baseline
at the time a segment ran, and a target judged met, missed or within noise from an interval.

* **Baseline at a time.** Every round opens with a no-checkpoint segment and the run ends with one,
  so the baseline is known at several times; a segment's baseline is interpolated linearly in time
  between the two around it (drift between them hits every variant alike).
* **Noise floor.** Each baseline segment that has one on either side is predicted from those two;
  the root mean square of the misses is what one segment's mean is good for (``noise_pct``).
* **Interval.** Per variant, the overheads of its rounds: with two or more, the mean and a 95 %
  Student-t interval (and min-max); with one, the value plus or minus the noise floor (or half the
  baseline's drift when there are too few baseline segments to estimate it).
* **Verdict.** For "value <= bound": ``met`` when the whole interval is below the bound, ``missed``
  when it is wholly above, else ``within noise``. Comparisons between two variants are judged on
  their per-round (paired) differences.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

MET, MISSED, NOISE, NA = "met", "missed", "within noise", "n/a"

# Two-sided 95 % quantiles of Student's t, by degrees of freedom (1..30); 1.96 beyond.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else 1.96


def baseline_at(t: float, points: Sequence[tuple[float, float]]) -> float:
    """The baseline at time ``t`` from ``(time, mean)`` points: linear between the two around ``t``,
    the nearest one outside their range."""
    pts = sorted(points)
    if not pts:
        return float("nan")
    if t <= pts[0][0]:
        return pts[0][1]
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return pts[-1][1]


def noise_pct(points: Sequence[tuple[float, float]]) -> float | None:
    """RMS (in %) of each interior baseline segment's miss when predicted from its two neighbours."""
    pts = sorted(points)
    misses = []
    for (t0, v0), (t, v), (t1, v1) in zip(pts, pts[1:], pts[2:]):
        pred = baseline_at(t, [(t0, v0), (t1, v1)])
        misses.append(100.0 * (v / pred - 1.0))
    if not misses:
        return None
    return math.sqrt(statistics.fmean(m * m for m in misses))


def drift_pct(means: Sequence[float]) -> float | None:
    """Spread of the baseline segments' means: (max - min) / mean, in %."""
    if len(means) < 2:
        return None
    return 100.0 * (max(means) - min(means)) / statistics.fmean(means)


def interval(values: Sequence[float], fallback_half: float | None = None) -> dict:
    """``{"mean", "lo", "hi", "min", "max", "n", "method"}`` of per-round values (see module doc)."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": None, "lo": None, "hi": None, "min": None, "max": None, "method": "none"}
    mean = statistics.fmean(xs)
    out = {"n": len(xs), "mean": mean, "min": min(xs), "max": max(xs)}
    if len(xs) >= 2:
        half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
        out.update(lo=mean - half, hi=mean + half, method="t95")
    elif fallback_half is not None:
        out.update(lo=mean - fallback_half, hi=mean + fallback_half, method="one round: +/- baseline noise")
    else:
        out.update(lo=None, hi=None, method="one round: no interval")
    return out


def judge(iv: dict, bound: float, *, sense: str = "le") -> str:
    """``met``/``missed``/``within noise`` for "value <= bound" (``sense="le"``) or "value >= bound"
    (``"ge"``) from an interval; ``n/a`` when there is no value."""
    lo, hi = iv.get("lo"), iv.get("hi")
    if iv.get("mean") is None:
        return NA
    if lo is None or hi is None:  # no interval at all: the value alone cannot tell noise
        return NOISE
    if sense == "le":
        return MET if hi <= bound else (MISSED if lo > bound else NOISE)
    return MET if lo >= bound else (MISSED if hi < bound else NOISE)


def paired(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Per-round differences ``a - b`` (rounds where both ran)."""
    return [x - y for x, y in zip(a, b) if x is not None and y is not None]
