"""How often this run fails and what a failure costs: the hazard side of
:class:`~cf_ray.policy.adaptive.Adaptive` (controller side only, no Ray).

:class:`HazardModel` takes in :class:`RunEvent` objects — the run's start, each restart (a
failure), each first resumed iteration (a recovery), each preemption notice, and clock ticks — and
turns them into a :class:`HazardEstimate`: the failure rate, the mean time between failures, the
recovery time, and the share of restarts that had to come back from storage.

**The update rule** (a Gamma-Poisson model). Failures are taken to come as a Poisson process in
the time the run is *up* (training or checkpointing; not the recoveries). The rate ``λ`` has a Gamma
prior ``Gamma(a0, b0)``, worth ``a0`` pseudo-failures over ``b0`` seconds:

* with ``Adaptive(mtbf_s=M, mtbf_weight=w)``: ``a0 = w``, ``b0 = w * M`` (the user's MTBF, as strong
  as ``w`` observed failures);
* without: ``a0 = b0 = 0`` (no prior): there is no estimate until the run's first failure, and the
  policy checkpoints as the overhead budget allows, as before the failure rate was used.

After ``n`` failures over ``T`` seconds up, the posterior is ``Gamma(a0 + n, b0 + T)``; the estimate
is its mean, ``λ = (a0 + n) / (b0 + T)`` (without a prior: ``n / T``, the maximum-likelihood rate),
and the MTBF ``1 / λ``. Each failure moves the estimate up at once; each second without one moves
it down.

**What counts as a failure.** A restart of the run (a restore after its first) is one. A preemption
notice (Ray's drain, SIGTERM, a user's or the driver's notice) is one too, at the time of the notice,
even when its just-in-time checkpoint saves the work: the pool is being reclaimed, and its next
reclaim may come without a usable notice. The notice and the restart it causes are the same
failure: one per attempt (generation), whichever is seen first.

**Recovery** (failure to the first resumed iteration) is measured per restore source: memory and
storage restores differ by an order of magnitude. The expected recovery is the median of this run's
recent recoveries of each source, weighted by the share of restarts from each (with half a
pseudo-restart of each, so that one restart does not make the other kind impossible); before the
first measured one, :data:`DEFAULT_RECOVERY_S`.

The interval that maximises goodput given these (:func:`goodput_work_s`, :func:`expected_goodput`)
is in this module too; :mod:`cf_ray.policy._rules` applies it. So is how many snapshots there are
per persisted one (:func:`persist_cadence`): Daly's rule again, against the failures that lose memory.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cf_ray.policy.base import MAX_PERSIST_EVERY

if TYPE_CHECKING:
    from cf_ray.policy._estimate import Estimate
    from cf_ray.policy.adaptive import Adaptive

DEFAULT_RECOVERY_S = 60.0
"""The recovery time (failure to the first resumed iteration) assumed before this run has measured
one: Ray Train's restart of the worker group plus a restore. A generous guess on purpose: a cluster
that replaces a node takes longer than a restart in place, and the run's own recoveries replace it."""

_RECENT = 16
"""Recoveries kept per restore source (the newest)."""

_NOTICED_KEPT = 64
"""Generations with a notice remembered (a restart of one of them is that notice's failure)."""


class RunEventKind(str, enum.Enum):
    """What a :class:`RunEvent` reports."""

    START = "start"
    """The run's first attempt started (its restore, or its first iteration)."""
    FAILURE = "failure"
    """An attempt ended in a failure: the next attempt restored (``time_unix``: the failure's best
    estimate, the failed attempt's newest sign of life)."""
    RESUMED = "resumed"
    """The first iteration after a restart ended: the recovery is over (``recovery_s``)."""
    NOTICE = "notice"
    """A preemption notice reached the run (Ray's drain, SIGTERM, the user's, the driver's)."""
    TICK = "tick"
    """The clock moved (the run is up: exposure accrues)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEvent:
    """One thing the controller saw of the run's failures, for :meth:`Adaptive.observe`."""

    kind: RunEventKind
    """What happened."""
    time_unix: float
    """When (seconds since the epoch)."""
    generation: int | None = None
    """The attempt it belongs to: the new attempt of a ``FAILURE`` (the one that restored), the
    attempt a ``NOTICE`` reached."""
    source: str | None = None
    """``FAILURE``/``RESUMED``: where the new attempt restored from (``memory``, ``storage``, ``fresh``)."""
    recovery_s: float | None = None
    """``RESUMED``: seconds from the failure to the first resumed iteration."""
    lost_s: float | None = None
    """``FAILURE``: training time lost (redone)."""
    pool: str | None = None
    """``NOTICE``: where it came from (``ray``, ``sigterm``, ``user``, ``driver``), for the record."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HazardEstimate:
    """What :class:`HazardModel` estimates (see the module docstring for the rule)."""

    rate_per_s: float
    """Failures per second up (the posterior mean; ``inf`` when nothing is known yet: no prior and
    no failure, or no time up)."""
    failures: int
    """Failures counted (restarts and notices, one per attempt)."""
    notices: int
    """Of which were preemption notices."""
    exposure_s: float
    """Seconds the run has been up."""
    prior_a: float
    """The prior's pseudo-failures."""
    prior_b: float
    """The prior's pseudo-seconds."""
    recovery_s: float
    """Expected recovery (failure to first resumed iteration), over the mix of restore sources."""
    recovery_by_source: dict[str, float | None] = field(default_factory=dict)
    """Median recent recovery per restore source (``None``: not measured in this run)."""
    storage_share: float = 0.5
    """Share of restarts that did not restore from memory."""
    measured_recoveries: int = 0
    """Recoveries measured in this run."""

    @property
    def mtbf_s(self) -> float:
        """Mean seconds up between failures (``1 / rate``)."""
        return math.inf if self.rate_per_s <= 0 else 1.0 / self.rate_per_s

    @property
    def known(self) -> bool:
        """Whether there is a finite rate estimate (a prior, or any exposure)."""
        return math.isfinite(self.rate_per_s)

    def as_dict(self) -> dict:
        """JSON-able (``explain()["hazard"]``)."""
        mtbf = self.mtbf_s
        return {
            "mtbf_s": mtbf if math.isfinite(mtbf) else None,
            "failures_per_hour": 3600.0 * self.rate_per_s if self.known else None,
            "failures": self.failures,
            "notices": self.notices,
            "exposure_s": self.exposure_s,
            "prior": {"failures": self.prior_a, "seconds": self.prior_b},
            "recovery_s": self.recovery_s,
            "recovery_by_source": dict(self.recovery_by_source),
            "storage_share": self.storage_share,
            "measured_recoveries": self.measured_recoveries,
        }


class HazardModel:
    """Failure rate and recovery time from :class:`RunEvent` objects (see the module docstring).

    Args:
        mtbf_s: the prior's mean time between failures (``None``: no prior, no estimate before a failure).
        weight: how many observed failures the prior is worth (with ``mtbf_s``).
    """

    def __init__(self, mtbf_s: float | None = None, weight: float = 1.0):
        if mtbf_s is None:
            self.a0, self.b0 = 0.0, 0.0
        else:
            self.a0, self.b0 = float(weight), float(weight) * float(mtbf_s)
        self.failures = 0
        self.notices = 0
        self.exposure_s = 0.0
        self._up_since: float | None = None  # when the exposure clock last advanced while up
        self._started = False
        self._generation: int | None = None  # the attempt in progress
        self._noticed: deque[int] = deque(maxlen=_NOTICED_KEPT)  # attempts whose notice was counted
        self._recoveries: dict[str, deque[float]] = {}
        self._restarts: dict[str, int] = {}

    # -- events ---------------------------------------------------------------------------------
    def observe(self, ev: RunEvent) -> None:
        """Take in one event (events with a bad time are ignored: a report must not break the policy)."""
        t = ev.time_unix
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            return
        kind = RunEventKind(ev.kind)
        if kind is RunEventKind.TICK:
            self._advance(t)
        elif kind is RunEventKind.START:
            if not self._started:
                self._started = True
                self._up_since = t
            self._generation = ev.generation if ev.generation is not None else self._generation
        elif kind is RunEventKind.FAILURE:
            self._failure(ev, t)
        elif kind is RunEventKind.RESUMED:
            self._resumed(ev, t)
        elif kind is RunEventKind.NOTICE:
            self._notice(ev, t)

    def _advance(self, t: float) -> None:
        if not self._started:  # the first sign of life starts the clock
            self._started = True
            self._up_since = t
            return
        if self._up_since is not None and t > self._up_since:
            self.exposure_s += t - self._up_since
            self._up_since = t

    def _failure(self, ev: RunEvent, t: float) -> None:
        if not self._started:
            self._started = True
        elif self._up_since is not None:
            self.exposure_s += max(0.0, t - self._up_since)
        self._up_since = None  # down until the first resumed iteration
        failed = self._generation
        if failed is None or failed not in self._noticed:  # a noticed attempt's failure was counted
            self.failures += 1
        src = str(ev.source or "unknown")
        self._restarts[src] = self._restarts.get(src, 0) + 1
        self._generation = ev.generation

    def _resumed(self, ev: RunEvent, t: float) -> None:
        if self._up_since is None:
            self._up_since = t
        r = ev.recovery_s
        if isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r >= 0:
            self._recoveries.setdefault(str(ev.source or "unknown"), deque(maxlen=_RECENT)).append(float(r))

    def _notice(self, ev: RunEvent, t: float) -> None:
        self._advance(t)
        gen = ev.generation if ev.generation is not None else self._generation
        if gen is not None and gen in self._noticed:
            return  # this attempt's notice is counted already (several ranks, several sources)
        if gen is not None:
            self._noticed.append(gen)
        self.failures += 1
        self.notices += 1

    # -- estimates ------------------------------------------------------------------------------
    def estimate(self) -> HazardEstimate:
        a, b = self.a0 + self.failures, self.b0 + self.exposure_s
        rate = a / b if a > 0 and b > 0 else math.inf  # inf: nothing known yet
        by_source = {src: _median(list(v)) if v else None for src, v in self._recoveries.items()}
        mem = by_source.get("memory")
        other = [v for s, v in by_source.items() if s != "memory" and v is not None]
        slow = max(other) if other else None
        restarts = sum(self._restarts.values())
        storage_share = (restarts - self._restarts.get("memory", 0) + 0.5) / (restarts + 1.0)
        if mem is None and slow is None:
            recovery = DEFAULT_RECOVERY_S
        else:
            mem_v = mem if mem is not None else slow
            slow_v = slow if slow is not None else mem
            assert mem_v is not None and slow_v is not None
            recovery = (1.0 - storage_share) * mem_v + storage_share * slow_v
        return HazardEstimate(
            rate_per_s=rate,
            failures=self.failures,
            notices=self.notices,
            exposure_s=self.exposure_s,
            prior_a=self.a0,
            prior_b=self.b0,
            recovery_s=recovery,
            recovery_by_source=by_source,
            storage_share=storage_share,
            measured_recoveries=sum(len(v) for v in self._recoveries.values()),
        )

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What to keep with the run (JSON-able); the prior is configuration and is not saved."""
        return {
            "failures": self.failures,
            "notices": self.notices,
            "exposure_s": self.exposure_s,
            "recoveries": {k: list(v) for k, v in self._recoveries.items()},
            "restarts": dict(self._restarts),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from what :meth:`state_dict` returned (a restarted controller, a new ``fit()``)."""
        self.failures = max(int(state.get("failures", 0)), 0)
        self.notices = max(int(state.get("notices", 0)), 0)
        self.exposure_s = max(float(state.get("exposure_s", 0.0)), 0.0)
        self._recoveries = {
            str(k): deque((float(x) for x in v if isinstance(x, (int, float)) and x >= 0), maxlen=_RECENT)
            for k, v in (state.get("recoveries") or {}).items()
        }
        self._restarts = {str(k): max(int(v), 0) for k, v in (state.get("restarts") or {}).items()}


# -- the interval that maximises goodput ------------------------------------------------------------


def expected_goodput(work_s: float, cost_s: float, mtbf_s: float, recovery_s: float = 0.0, lag_s: float = 0.0) -> float:
    """The expected share of wall time spent on training that survives, when ``work_s`` seconds of
    training separate two checkpoints that each cost ``cost_s`` seconds of training time.

    Daly's model (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", FGCS 2006): failures are a Poisson process of mean ``mtbf_s``; a segment of
    ``w = work_s + cost_s`` seconds must run without a failure to count, each failure costs the
    segment's progress and ``recovery_s`` (failures may strike during the recovery too). A segment
    then takes ``M e^(R/M) (e^(w/M) - 1)`` seconds on average. cf_ray's checkpoints are restorable
    ``lag_s`` after they are taken (the background copy, and the persist for a storage restore):
    a segment must also survive that long, a factor ``e^(-lag/M)``.
    """
    w = work_s + cost_s
    if work_s <= 0 or w <= 0:
        return 0.0
    if not math.isfinite(mtbf_s) or mtbf_s <= 0:
        return work_s / w if math.isinf(mtbf_s) else 0.0
    m = mtbf_s
    x = w / m
    if x > 700:
        return 0.0
    return work_s / (m * math.expm1(x)) * math.exp(-(max(recovery_s, 0.0) + max(lag_s, 0.0)) / m)


def goodput_work_s(cost_s: float, mtbf_s: float) -> float:
    """The ``work_s`` that maximises :func:`expected_goodput` (``inf`` when failures never come).

    Neither the recovery nor the lag moves the optimum (every failure pays them whatever the
    interval); ``d/dw`` of ``work / expm1((work + cost) / M)`` is zero where
    ``1 - e^(-(u + c)) = u`` with ``u = work / M`` and ``c = cost / M``, solved here by bisection
    (``u`` in ``(0, 1)``). For ``cost << M`` this is Young's ``sqrt(2 cost M)``.
    """
    if not math.isfinite(mtbf_s):
        return math.inf
    if mtbf_s <= 0:
        return 0.0
    c = max(cost_s, 0.0) / mtbf_s
    if c == 0.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if -math.expm1(-(mid + c)) - mid > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi) * mtbf_s


def young_daly_work_s(cost_s: float, mtbf_s: float, recovery_s: float) -> float:
    """The closed form, for comparison: Young/Daly with the recovery time (NVIDIA's form, the
    checkpoint period ``Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2)``), as training seconds between two
    checkpoints (``Tc - Ts``)."""
    if not math.isfinite(mtbf_s):
        return math.inf
    ts = max(cost_s, 0.0)
    return math.sqrt(2.0 * (mtbf_s + max(recovery_s, 0.0)) * ts + ts * ts)


def best_steps(iter_s: float, cost_s: float, mtbf_s: float) -> int | None:
    """The interval in steps that maximises :func:`expected_goodput` (``None``: no finite optimum,
    i.e. no failure expected, or no iteration time)."""
    if not (iter_s > 0) or not math.isfinite(mtbf_s):
        return None
    work = goodput_work_s(cost_s, mtbf_s)
    if not math.isfinite(work):
        return None
    lo = max(int(work // iter_s), 1)
    return max((lo, lo + 1), key=lambda k: expected_goodput(k * iter_s, cost_s, mtbf_s))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def persist_cadence(cfg: Adaptive, est: Estimate | None, interval: int | None, current: int) -> tuple[int, dict]:
    """How many scheduled snapshots per persisted one (``Adaptive.persist_every``), and why.

    A snapshot held in memory only is restored after any failure that leaves its holder alive (a
    worker's crash or SIGKILL, Ray Train restarting the group); only a failure that loses the
    holder's memory (its node, or the holder itself: ``storage_share`` of this run's restarts, with
    half a pseudo-restart of each kind) goes back to storage. So the storage recovery point is an
    interval of its own, set by Daly's rule (:func:`goodput_work_s`) against the rate of those
    failures only, ``λ × storage_share``, with the checkpoint's measured cost ``C`` (all of it: an
    upper bound of what its persist part costs), capped by ``max_lost_s``. ``persist_every`` is that
    interval over the checkpoint interval, rounded down, in ``[1, MAX_PERSIST_EVERY]``; 1 (every
    snapshot persisted, as CheckFreq does) while the failure rate is unknown. It rises only when the
    ratio clears the next integer by a quarter (no flapping); it falls at once.
    """
    h = est.hazard if est is not None else None
    if est is None or h is None or not h.known or not interval or est.t <= 0:
        return 1, {"persist_every": 1, "reason": "every snapshot persisted until the run's failure rate is known"}
    interval_s = interval * est.t
    rate = h.rate_per_s * h.storage_share
    target = goodput_work_s(est.cost, 1.0 / rate) if rate > 0 else math.inf
    binding = "goodput"
    if cfg.max_lost_s is not None and cfg.max_lost_s * (1 - cfg.headroom) < target:
        target, binding = cfg.max_lost_s * (1 - cfg.headroom), "max_lost_s"
    ratio = target / interval_s if interval_s > 0 else 1.0
    n = max(1, min(int(ratio) if math.isfinite(ratio) else MAX_PERSIST_EVERY, MAX_PERSIST_EVERY))
    n = min(n, max(1, cfg.max_interval // interval))
    if n > current and ratio < current + 1.25:
        n = current  # not clearly above the next integer: keep
    return n, {
        "persist_every": n,
        "binding": binding,
        "storage_failure_rate_per_hour": 3600.0 * rate,
        "storage_interval_s": target,
        "persisted_recovery_point_s": n * interval_s,
        "reason": (
            f"one snapshot in {n} persisted: failures that lose memory come every "
            f"{(1.0 / rate if rate > 0 else math.inf):.0f} s up ({h.storage_share:.0%} of restarts), so storage "
            f"is worth refreshing every {target:.1f} s ({binding})"
        ),
    }


__all__ = [
    "DEFAULT_RECOVERY_S",
    "HazardEstimate",
    "HazardModel",
    "RunEvent",
    "RunEventKind",
    "best_steps",
    "expected_goodput",
    "goodput_work_s",
    "persist_cadence",
    "young_daly_work_s",
]
