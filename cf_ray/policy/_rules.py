"""The decision ladder of :class:`~cf_ray.policy.adaptive.Adaptive`: estimates -> the interval.

:func:`candidates` says what each rule would choose alone (goodput, budget, max_lost_s, persist in
flight); :func:`target` combines them into the interval the rules ask for (and the rule that binds);
:func:`decide` walks the ladder that says whether to publish it now: profiling, provisional,
restored, the first measured decision, and once tuned the hysteresis (outside the bounds, too much
lost work, persist in flight, over budget, the failure rate moved, room to shorten). The first rung
that applies decides; :class:`RuleState` is what the ladder remembers between plans.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from cf_ray.policy._estimate import Estimate, _ceil
from cf_ray.policy._hazard import best_steps, expected_goodput, young_daly_work_s
from cf_ray.policy.base import PolicyWarning

if TYPE_CHECKING:
    from cf_ray.policy.adaptive import Adaptive

TOO_SHORT_CKPTS = 50
"""Checkpoints for which an interval found too short stays out of reach of the rung that shortens:
the estimates that allow it again are the ones that just allowed it wrongly, and going back and
forth costs the widening each time."""

SLOWDOWN_UNSEEN_CKPTS = 6
"""Checkpoints after which the cost measured is taken as it is even when no checkpoint's slowdown
could be told apart (the engine does not say which checkpoint a sample follows, say): the interval
then rests on the stall, the probe windows and the cadence, which correct it either way."""

FIRST_SHORTEN = 0.25
"""The first decision on a measured slowdown (one or two checkpoints' worth: on the 302 MB job one read as
none cut 48 steps to 2) shortens to no less than this fraction; ``_room_to_shorten`` goes further."""

FELL_RATIO = 4.0
"""A fall of the copy and persist's level by this factor (the storage was slow and is fast again)
shortens on two checkpoints of the new level, without waiting to confirm (:meth:`_Ladder._room_to_shorten`)."""

Verdict = tuple["int | None", dict]
"""What a decision returns: the interval to publish (``None``: keep the current one) and the
explanation (:meth:`Adaptive.explain`)."""

_WARN_STACKLEVEL = 5
"""Points a :class:`PolicyWarning` at the caller of :meth:`Adaptive.plan`: ``warnings.warn`` in
``_Ladder._warn_conflicts`` <- ``_Ladder.run`` <- :func:`decide` <- ``Adaptive.plan`` <- caller."""


class Phase(str, Enum):
    """Where the policy is in its life (``explain()["phase"]``)."""

    PROFILING = "profiling"
    """No interval decided yet: waiting for the first checkpoint's measurements."""
    PROVISIONAL = "provisional"
    """An interval from the first checkpoint, before its slowdown or clean iterations are measured."""
    TUNED = "tuned"
    """Decided from measurements; hysteresis applies."""
    RESTORED = "restored"
    """Decided from a saved profile until new checkpoints are measured."""


@dataclass(slots=True)
class RuleState:
    """What the decision ladder remembers between :meth:`Adaptive.plan` calls (controller only)."""

    decided: bool = False
    """An interval was decided (provisional, restored or measured)."""
    measured_decided: bool = False
    """An interval was decided from measurements (the first tuned decision is behind us)."""
    changed_at: int = -1
    """The checkpoint count (``Estimator.ckpt_clock``) when the interval last changed."""
    since: dict[str, int] = field(default_factory=dict)
    """The checkpoint count when a move waiting to be confirmed at a later checkpoint was first
    asked for: ``shrink`` (a clearly shorter interval possible), ``widen`` (a marginal overrun of
    the budget), ``cost`` (a rise of the cost alone asking for a wider goodput interval)."""
    slowdown_seen: str = ""
    """What some decision's measured slowdown rested on (:func:`slowdown_evidence`; the strongest
    seen); it stays so until the estimates change level, so that a rule of evidence tied to the
    interval does not flip with the interval it sets."""
    slowdown_drift: dict = field(default_factory=dict)
    """The changes of level known when ``slowdown_seen`` was set."""
    too_short: tuple[int, int, dict] | None = None
    """The interval last found too short (over the budget, or its persist did not fit), the
    checkpoint count then, and the changes of level known then: the rung that shortens does not go
    back to it for :data:`TOO_SHORT_CKPTS` checkpoints, nor until a new change of level."""
    warned: set[str] = field(default_factory=set)
    """The kinds of conflict already warned about (one :class:`PolicyWarning` per kind)."""
    current: int | None = None
    """The interval in force, as of the last plan."""
    info: dict = field(default_factory=dict)
    """The explanation of the last plan."""
    last_change: dict | None = None
    """The last change of the interval: from, to, reason, checkpoint count and step."""
    binding: str | None = None
    """The rule that set the interval in force (``explain()["binding"]`` when it was published)."""
    persist_every: int = 1
    """One scheduled snapshot in this many is persisted (:func:`persist_cadence`)."""
    persist_info: dict = field(default_factory=dict)
    """Why (``explain()["persist"]``)."""
    mtbf_s: float | None = None
    """The failure rate's MTBF when the interval last changed (what the failure-rate rung compares)."""

    def published(self, decision: int, current: int, info: dict, ckpt_clock: int, at_step: int) -> None:
        """Record that ``decision`` replaces ``current`` (and say so in ``info``)."""
        self.last_change = {
            "from": current,
            "to": decision,
            "reason": info.get("reason"),
            "ckpt": ckpt_clock,
            "at_step": at_step,
            "first_limited": bool(info.get("first_limited")),  # held back by FIRST_SHORTEN
        }
        self.changed_at = ckpt_clock
        self.mtbf_s = (info.get("hazard") or {}).get("mtbf_s")
        self.since.clear()
        self.binding = info.get("binding")
        info.update(interval=decision, previous=current)
        info["lost_work_s"] = decision * info["iter_s"] if info.get("iter_s") else None
        info["predicted_overhead_pct"] = (
            100.0 * info["cost_s"] / (decision * info["iter_s"])
            if info.get("iter_s") and info.get("cost_s") is not None
            else None
        )
        self.current = decision


def candidates(cfg: Adaptive, est: Estimate, cost: float | None = None, bg: float | None = None) -> dict:
    """What each rule would choose on its own (``explain()["candidates"]``): ``goodput`` (the
    interval that maximises the expected goodput; ``None`` while the failure rate is unknown),
    ``budget`` (the shortest within the overhead budget), ``max_lost_s`` (the longest within the
    bound on lost work; ``None`` without one) and ``persist_in_flight`` (the shortest that keeps one
    persist in flight)."""
    t = est.t
    cost = max(est.cost if cost is None else cost, 0.0)
    bg = max(est.bg if bg is None else bg, 0.0)
    aim = cfg.budget_pct / 100.0 * (1.0 - cfg.headroom)
    k_lost = None
    if cfg.max_lost_s is not None:
        k_lost = math.floor(cfg.max_lost_s * (1.0 - cfg.headroom) / t + 1e-9)
        if k_lost < 1 and t <= cfg.max_lost_s:
            k_lost = 1
    hz = est.hazard
    return {
        "goodput": best_steps(t, cost, hz.mtbf_s) if hz is not None and hz.known else None,
        "budget": max(_ceil(cost / (aim * t)), 1),
        "max_lost_s": k_lost,
        "persist_in_flight": max(_ceil(bg * (1.0 + cfg.headroom) / t), 1),
    }


def target(
    cfg: Adaptive, est: Estimate, cost: float | None = None, bg: float | None = None
) -> tuple[int, str, list[tuple[str, str]]]:
    """The interval the rules ask for, in their order of precedence (the goodput interval, no
    shorter than the budget and the persist in flight allow, no longer than ``max_lost_s``), the rule
    that binds, and the ``(kind, message)`` of every rule that gave way (see :class:`Adaptive`)."""
    t = est.t
    cost = max(est.cost if cost is None else cost, 0.0)
    bg = max(est.bg if bg is None else bg, 0.0)
    budget = cfg.budget_pct / 100.0
    cand = candidates(cfg, est, cost, bg)
    k_budget, k_flight = cand["budget"], cand["persist_in_flight"]
    k_flight_strict = max(_ceil(bg / t), 1)
    conflicts: list[tuple[str, str]] = []
    k, binding = (k_budget, "budget") if k_budget >= k_flight else (k_flight, "persist_in_flight")
    if cand["goodput"] is not None and cand["goodput"] > k:
        k, binding = cand["goodput"], "goodput"
    k_lost = cand["max_lost_s"]
    if cfg.max_lost_s is not None and k_lost is not None:
        if k > k_lost:
            if k_lost < 1:
                k, binding = max(k_flight_strict, 1), "max_lost_s" if k_flight_strict <= 1 else "persist_in_flight"
                conflicts.append(
                    (
                        "lost_below_iter",
                        (
                            f"max_lost_s={cfg.max_lost_s:g} is shorter than one iteration ({t:.3g} s): checkpointing "
                            f"every {k} step(s); raise max_lost_s above the iteration time"
                        ),
                    )
                )
            elif k_flight_strict > k_lost:
                k, binding = k_flight_strict, "persist_in_flight"
                conflicts.append(
                    (
                        "lost_vs_persist",
                        (
                            f"max_lost_s={cfg.max_lost_s:g} cannot be met: one checkpoint takes {bg:.3g} s to copy and "
                            f"persist ({k_flight_strict} steps of {t:.3g} s) and checkpoints cannot be taken faster than "
                            "storage persists them; the persist time wins (use faster storage or raise max_lost_s)"
                        ),
                    )
                )
            else:
                k, binding = k_lost, "max_lost_s"
                if cost / (k * t) > budget:
                    conflicts.append(
                        (
                            "lost_vs_budget",
                            (
                                f"max_lost_s={cfg.max_lost_s:g} wins over budget_pct={cfg.budget_pct:g}: checkpointing "
                                f"every {k} steps costs about {100 * cost / (k * t):.3g}% of training time; raise "
                                "max_lost_s or budget_pct to stay within the budget"
                            ),
                        )
                    )
    if k < cfg.min_interval:
        if binding == "max_lost_s":
            conflicts.append(
                (
                    "min_vs_lost",
                    (
                        f"min_interval={cfg.min_interval} wins over max_lost_s={cfg.max_lost_s:g}: up to "
                        f"{cfg.min_interval * t:.3g} s of work can be lost"
                    ),
                )
            )
        k, binding = cfg.min_interval, "min_interval"
    if k > cfg.max_interval:
        k, binding = cfg.max_interval, "max_interval"
        if k < k_flight_strict:
            conflicts.append(
                (
                    "max_vs_persist",
                    (
                        f"max_interval={cfg.max_interval} wins over the persist time: one checkpoint takes "
                        f"{bg:.3g} s ({k_flight_strict} steps) to persist, so training will wait for storage"
                    ),
                )
            )
        elif cost / (k * t) > budget:
            conflicts.append(
                (
                    "max_vs_budget",
                    (
                        f"max_interval={cfg.max_interval} wins over budget_pct={cfg.budget_pct:g}: overhead about "
                        f"{100 * cost / (k * t):.3g}%"
                    ),
                )
            )
    return k, binding, conflicts


def prior_check(cfg: Adaptive, prior: dict, est: Estimate) -> str:
    """Whether new measurements confirm the saved profile ``prior`` (within ``drift_ratio``)."""
    changed = []
    for key, now in (("iter_s", est.t), ("cost_s", est.cost), ("background_s", est.bg)):
        was = prior.get(key) or 0.0
        lo, hi = min(was, now), max(was, now)
        if hi > 0 and (lo <= 0 or hi / lo > cfg.drift_ratio) and hi > 1e-3:
            changed.append(f"{key} {was:.3g} -> {now:.3g}")
    if changed:
        return "conditions changed since the saved profile (" + ", ".join(changed) + ")"
    return "saved profile confirmed by new measurements"


def hazard_info(est: Estimate, cost: float, current: int | None, k: int) -> dict | None:
    """``explain()["hazard"]``: the failure rate and recovery, the goodput the interval in force and
    the target are expected to give, and Young/Daly's closed form for comparison (``None``: no
    hazard estimate)."""
    hz = est.hazard
    if hz is None:
        return None
    out = hz.as_dict()
    t, d = est.t, est.detail
    copy = d.copy or 0.0
    # A checkpoint is restorable from memory once copied, from storage once persisted too.
    lag = (1.0 - hz.storage_share) * copy + hz.storage_share * max(est.bg, copy)
    mtbf = hz.mtbf_s

    def goodput(steps: int | None) -> float | None:
        if not steps or not hz.known:
            return None
        return expected_goodput(steps * t, cost, mtbf, hz.recovery_s, lag)

    yd = young_daly_work_s(cost, mtbf, hz.recovery_s) if hz.known else math.inf
    out.update(
        lag_s=lag,
        predicted_goodput=goodput(current),
        predicted_goodput_target=goodput(k),
        young_daly_interval=max(round(yd / t), 1) if math.isfinite(yd) else None,
    )
    return out


def info(
    cfg: Adaptive,
    est: Estimate,
    k: int,
    binding: str,
    conflicts,
    current: int,
    cost: float | None = None,
    bg: float | None = None,
) -> dict:
    """The explanation of a decision (see :meth:`Adaptive.explain`), before its ``phase``/``reason``
    (``cost``/``bg``: the values the decision used when not the estimates')."""
    t = est.t
    d = est.detail
    cf = max(_ceil(((d.copy or 0.0) + (d.persist or 0.0)) / t), 1)
    return {
        "interval": current,
        "target": k,
        "binding": binding,
        "candidates": candidates(cfg, est, cost, bg),
        "hazard": hazard_info(est, est.cost if cost is None else cost, current, k),
        "conflicts": [m for _, m in conflicts],
        "budget_pct": cfg.budget_pct,
        "predicted_overhead_pct": 100.0 * est.cost / (current * t) if current else None,
        "measured_overhead_pct": d.measured_pct,
        "cost_se_s": est.cost_se,
        "cost_source": est.cost_source,
        "cadence": d.cadence.as_dict() if d.cadence is not None else None,
        "lost_work_s": current * t if current else None,
        "max_lost_s": cfg.max_lost_s,
        "iter_s": t,
        "slowest_rank": est.slowest,
        "stall_s": est.stall,
        "slowdown_s": max(est.cost - est.stall, 0.0),
        "cost_s": est.cost,
        "copy_s": d.copy,
        "persist_s": d.persist,
        "cpu_taken_s": d.cpu,
        "queued_s": d.queued,
        "background_s": est.bg,
        "bytes": d.nbytes,
        "persist_bytes_per_s": d.rate,
        "background_from_waits": est.bg_from_waits,
        "checkfreq_interval": cf,
        "source": est.source,
        "drift": dict(d.drift),
    }


def slowdown_measured(est: Estimate) -> bool:
    """Whether the cost to decide on holds what a checkpoint's copy and persist take from the
    iterations they overlap (:func:`decision_cost`): :func:`slowdown_evidence` names some."""
    return slowdown_evidence(est) is not None


def slowdown_evidence(est: Estimate) -> str | None:
    """What says what a checkpoint's copy and persist take from the iterations they overlap:
    ``"profile"`` (a saved profile), ``"cadence"`` (the iterations under the interval in force
    against those with nothing in flight), ``"records"`` (where a sample is no longer than about two
    overlaps, a checkpoint's overlap against iterations timed with nothing in flight; against
    iterations that overlap checkpoints too it is none), ``"unseen"`` (:data:`SLOWDOWN_UNSEEN_CKPTS`
    checkpoints and none told apart, with no iteration timed with nothing in flight to compare
    with: the cost is then what needs no comparison, a floor at best); ``None``: nothing yet.

    A longer sample holds a slowdown of a few iterations' worth in the noise of its other
    iterations: the per-checkpoint attribution then reads about none, and only the cadence measures
    it (or, when no iteration was ever timed with nothing in flight, the figures there are after
    :data:`SLOWDOWN_UNSEEN_CKPTS` checkpoints: the probe windows then make clean ones, and the
    cadence corrects it). An ``"unseen"`` cost decides, but never shortens (``_room_to_shorten``).
    """
    if est.source != "measured":
        return "profile"
    m = est.detail.cadence
    # The cadence measures it once its standard error is under half the copy and persist time (a
    # figure it cannot tell from none, on a busy machine, is no measure).
    cadence = m is not None and m.se < 0.5 * est.bg
    if est.cost_source == "cadence":
        return "cadence" if cadence else None
    unseen = est.n >= SLOWDOWN_UNSEEN_CKPTS
    if est.sample_iters * est.t > 2.0 * est.bg:
        # The per-checkpoint records read about none there, even with checkpoints many samples
        # apart (a real job's 0.0035 s against the cadence's 0.026 s). Without a single iteration
        # timed with nothing in flight there is nothing for the cadence to compare with until a
        # probe window makes some: what there is counts after a while.
        if cadence:
            return "cadence"
        return "unseen" if unseen and not est.t_clean else None
    if est.settled and est.t_clean:
        return "records"
    if unseen:
        return "records" if est.t_clean else "unseen"
    return None


def decision_cost(est: Estimate, measured: bool, aim: float = 0.0) -> float:
    """The training time one checkpoint costs, as the rules weigh it: the estimate once its slowdown
    is ``measured`` (with long samples, no less than the cadence measures); until then the copy and
    persist count as lost time, as in the provisional decision, so the interval errs wide and
    shortens only on a measured cost.

    Not wider than the cadence can still measure at, though (``aim``: the budget's fraction of an
    iteration the rules aim at): a persist that mostly waits for slow storage would otherwise weigh as
    its whole time, set an interval with no checkpoint left in the run to measure it by, and keep it.
    The unmeasured cost is capped at what asks for :func:`unmeasured_cap` steps."""
    if not measured:
        cap = aim * est.t * unmeasured_cap(est) if aim > 0 else math.inf
        return max(est.cost, min(est.bg, cap))
    m = est.detail.cadence
    if m is not None and est.sample_iters * est.t > 2.0 * est.bg:
        return max(est.cost, est.stall + min(max(m.slowdown, 0.0), est.bg or math.inf))
    return est.cost


def unmeasured_cap(est: Estimate) -> int:
    """The widest interval an unmeasured slowdown may ask for: twice the steps one copy and persist
    take, and at least two samples' span. At it half the iterations between checkpoints are free of
    one, so the cadence (with the probe windows) measures the slowdown within a few checkpoints, and
    a change of the persist's level is seen within a few more; the interval follows what they find."""
    flight = max(_ceil(est.bg / est.t), 1) if est.t > 0 else 1
    return max(2 * flight, 2 * math.ceil(est.sample_iters))


def phase_of(est: Estimate, prior: dict | None) -> Phase:
    """Which phase the estimates put the policy in."""
    ready = est.source == "measured" and (est.has_persist or est.n >= 2)
    # Tuned once the iteration time is clean and some checkpoint's slowdown is measured (its
    # overlap is over) — or after three checkpoints (a persist may overlap every iteration).
    if ready and ((est.t_clean and est.settled) or est.n >= 3):
        return Phase.TUNED
    if prior:
        return Phase.RESTORED
    return Phase.PROVISIONAL if ready else Phase.PROFILING


def decide(
    cfg: Adaptive, state: RuleState, est: Estimate | None, prior: dict | None, ckpt_clock: int, current: int
) -> Verdict:
    """The interval to publish (``None``: keep ``current``) and why, from the estimates ``est``.

    ``prior`` is the saved profile (if any), ``ckpt_clock`` the number of checkpoints seen so far
    (the clock of the hysteresis). Updates ``state``.
    """
    if est is None:
        return None, {
            "phase": Phase.PROFILING.value,
            "interval": current,
            "target": None,
            "binding": "profiling",
            "reason": f"profiling: waiting for the first checkpoint (step {cfg.initial_interval()}) "
            "and iteration times",
            "budget_pct": cfg.budget_pct,
        }
    return _Ladder(cfg, state, est, prior, ckpt_clock, current).run()


class _Ladder:
    """One decision: the rungs in order; the first that returns a :data:`Verdict` decides."""

    __slots__ = (
        "cfg",
        "st",
        "est",
        "prior",
        "ckpt_clock",
        "current",
        "cost",
        "k",
        "binding",
        "conflicts",
        "info",
        "phase",
    )

    def __init__(self, cfg: Adaptive, st: RuleState, est: Estimate, prior: dict | None, ckpt_clock: int, current: int):
        self.cfg, self.st, self.est, self.prior = cfg, st, est, prior
        self.ckpt_clock, self.current = ckpt_clock, current
        evidence = slowdown_evidence(est)
        if st.slowdown_seen and est.detail.drift != st.slowdown_drift:
            st.slowdown_seen = ""  # a new level: its slowdown is measured afresh
        if evidence and (st.slowdown_seen in ("", "unseen")):
            st.slowdown_seen, st.slowdown_drift = evidence, dict(est.detail.drift)
        measured = bool(st.slowdown_seen)
        self.cost = decision_cost(est, measured, cfg.budget_pct / 100.0 * (1.0 - cfg.headroom))
        self.k, self.binding, self.conflicts = target(cfg, est, self.cost)
        self.info = info(cfg, est, self.k, self.binding, self.conflicts, current, self.cost)
        self.info["slowdown_measured"] = measured
        self.info["slowdown_evidence"] = st.slowdown_seen or None
        self.phase = phase_of(est, prior)
        self.info["phase"] = self.phase.value

    def run(self) -> Verdict:
        for rung in (
            self._profiling,
            self._provisional,
            self._warn_conflicts,
            self._restored,
            self._first_measured,
            self._outside_bounds,
            self._too_much_lost_work,
            self._persist_does_not_fit,
            self._over_budget,
            self._failure_rate_moved,
            self._room_to_shorten,
        ):
            verdict = rung()
            if verdict is not None:
                return self._with_numbers(verdict)
        return self._with_numbers(self._keep())

    def _with_numbers(self, verdict: Verdict) -> Verdict:
        """The reason, with the measurements it rests on (``explain()`` says why with the numbers)."""
        est, info_ = self.est, verdict[1]
        measured = est.detail.measured_pct
        info_["reason"] = (
            f"{info_.get('reason', '')}; a checkpoint costs {est.cost:.3g} s (+/- {est.cost_se:.2g}, "
            f"{est.cost_source}), an iteration {est.t:.3g} s"
            + (
                f"; its slowdown not measured yet, the copy and persist ({est.bg:.3g} s) count as lost time"
                + (
                    f" up to {self.cost:.3g} s (what {unmeasured_cap(est)} steps allow: the cadence measures there)"
                    if self.cost < est.bg
                    else ""
                )
                if not self.info["slowdown_measured"]
                else f"; weighed at {self.cost:.3g} s, as the cadence measures it"
                if self.cost != est.cost
                else ""
            )
            + (f", the job's overhead so far {measured:.3g}%" if measured is not None else "")
        )
        return verdict

    def _publish(self, k: int) -> int | None:
        return k if k != self.current else None

    # -- before tuning ----------------------------------------------------------------------------
    def _profiling(self) -> Verdict | None:
        if self.phase is not Phase.PROFILING:
            return None
        self.info["reason"] = "profiling: waiting for the persist time of the first checkpoint"
        return None, self.info

    def _provisional(self) -> Verdict | None:
        """Once the first checkpoint is profiled: widen at once, and once, to what the budget and
        the persist in flight ask for; never shorten before the tuned decision.

        Reason: the first interval is a guess that a short run lives under, and every checkpoint
        taken at it costs what the first one did, so a cost that breaks the budget widens it at the
        first poll that carries it. How much the copy and persist slow the iterations that overlap
        them is not known yet (a slowdown read from samples that each span several checkpoints is
        none), so they count as lost training time (what they cost when every core trains): the
        interval errs wide. Shortening waits for the tuned decision, made on a measured cost.
        """
        if self.phase is not Phase.PROVISIONAL:
            return None
        st, est = self.st, self.est
        if st.decided:
            self.info["reason"] = f"keeping {self.current}: waiting for iterations timed with nothing in flight"
            return None, self.info
        cost = max(est.cost, est.bg)
        k, binding, conflicts = target(self.cfg, est, cost, est.bg)
        info_ = dict(info(self.cfg, est, k, binding, conflicts, self.current, cost), phase=self.phase.value)
        if k > self.current:
            st.decided = True  # once: the next decision is the tuned one
            info_["reason"] = f"first checkpoint profiled: interval {k} ({binding} binds), provisional"
            return k, info_
        info_["reason"] = (
            f"first checkpoint profiled: keeping {self.current} ({binding} allows {k}) until the cost of a "
            "checkpoint is measured"
        )
        return None, info_

    def _warn_conflicts(self) -> None:
        """Not a rung (never decides): from here on, warn once per kind of rule that gave way."""
        for key, msg in self.conflicts:
            if key not in self.st.warned:
                self.st.warned.add(key)
                warnings.warn(f"cf_ray Adaptive policy: {msg}", PolicyWarning, stacklevel=_WARN_STACKLEVEL)

    def _restored(self) -> Verdict | None:
        if self.phase is not Phase.RESTORED:
            return None
        if self.st.decided:
            self.info["reason"] = f"keeping {self.current} from the saved profile until new checkpoints are measured"
            return None, self.info
        self.st.decided = True
        self.info["reason"] = f"interval {self.k} from the saved profile ({self.binding} binds)"
        return self._publish(self.k), self.info

    def _first_measured(self) -> Verdict | None:
        st = self.st
        if st.measured_decided:
            return None
        st.measured_decided = st.decided = True
        why = "profiled" if not self.prior else prior_check(self.cfg, self.prior, self.est)
        floor, why_floor = math.ceil(self.current * FIRST_SHORTEN), f"at most {1 / FIRST_SHORTEN:g}x shorter at once"
        # Unmeasured, it shortens to where the cadence measures (``decision_cost``); a slow first
        # persist's wide provisional interval is left for no more than twice that.
        if not self.info["slowdown_measured"] and (twice := 2 * unmeasured_cap(self.est)) < floor:
            floor, why_floor = twice, "twice the interval the slowdown is measured at"
        k = max(self.k, min(self.current, floor))
        self.info["first_limited"] = k != self.k
        limited = f"; {k} at first: {why_floor}" if k != self.k else ""
        self.info["reason"] = f"{why}: interval {self.k} ({self.binding} binds{limited})"
        if not why.startswith("saved profile confirmed"):
            return self._publish(k), self.info
        # A confirmed saved profile: keep the interval unless the rules below say otherwise.
        return None

    # -- tuned: hysteresis ----------------------------------------------------------------------
    def _outside_bounds(self) -> Verdict | None:
        current = self.current
        if current < self.cfg.min_interval or current > self.cfg.max_interval:
            self.info["reason"] = f"interval {current} is outside [min_interval, max_interval]"
            return self.k, self.info
        return None

    def _too_much_lost_work(self) -> Verdict | None:
        lost_s, t, k, current = self.cfg.max_lost_s, self.est.t, self.k, self.current
        if lost_s is not None and current * t > lost_s and k < current:
            self.info["reason"] = f"{current} steps of {t:.3g} s exceed max_lost_s={lost_s:g}: shortening to {k}"
            return k, self.info
        return None

    def _persist_does_not_fit(self) -> Verdict | None:
        est, t, k, current = self.est, self.est.t, self.k, self.current
        if k > current and current * t < est.bg - est.bg_se:
            self.info["reason"] = (
                f"persist in flight: {est.bg:.3g} s of copy+persist do not fit in {current} steps "
                f"of {t:.3g} s: widening to {k}"
            )
            self._too_short()
            return k, self.info
        return None

    def _too_short(self) -> None:
        self.st.too_short = (self.current, self.ckpt_clock, dict(self.est.detail.drift))

    def _over_budget(self) -> Verdict | None:
        st, est, t, k, current = self.st, self.est, self.est.t, self.k, self.current
        budget = self.cfg.budget_pct / 100.0
        # Noise alone does not widen; an unmeasured slowdown counts whole (decision_cost): it errs wide.
        over = max(est.cost - est.cost_se if self.info["slowdown_measured"] else self.cost, 0.0) / (current * t)
        if k > current and over > budget:
            # A clear overrun widens at once; a marginal one must still be there at the next checkpoint.
            if over > budget * (1.0 + 2.0 * self.cfg.headroom) or (
                "widen" in st.since and self.ckpt_clock > st.since["widen"]
            ):
                self.info["reason"] = (
                    f"over budget: {100 * over:.3g}% > {self.cfg.budget_pct:g}% at {current} steps: widening to {k}"
                )
                self._too_short()
                return k, self.info
            st.since.setdefault("widen", self.ckpt_clock)
            self.info["reason"] = (
                f"keeping {current}: {100 * over:.3g}% is over the budget, confirming at the next checkpoint"
            )
            return None, self.info
        st.since.pop("widen", None)
        return None

    def _failure_rate_moved(self) -> Verdict | None:
        """The goodput interval moved (a failure, a notice, time up without one) by the
        ``shrink_ratio`` either way from an interval it set or to one it sets: move at once (the
        failure rate changes by events, not by noise; a small move buys little goodput)."""
        st, k, current = self.st, self.k, self.current
        goodput = self.info["candidates"]["goodput"]
        if goodput is None or not (self.binding == "goodput" or st.binding == "goodput"):
            return None
        ratio = self.cfg.shrink_ratio
        if k > math.floor(current * ratio) and k < math.ceil(current / ratio):
            st.since.pop("cost", None)
            return None
        hz = self.est.hazard
        assert hz is not None  # a goodput candidate needs a hazard estimate
        then = best_steps(self.est.t, max(self.cost, 0.0), st.mtbf_s) if st.mtbf_s is not None else None
        if k < current and then is not None:
            # Shorten at once only for the failure rate: at today's cost, did the goodput interval
            # move by the ratio between the failure rate then and now? A move of the cost alone
            # goes through the pessimistic estimates of ``_room_to_shorten``.
            if goodput > math.floor(then * ratio):
                return None
        if k > current and then is not None and goodput < math.ceil(then / ratio):
            # Widen at once only for the failure rate too: a rise of the cost alone (the estimates
            # of a restarted group, one slow checkpoint) must still be there at the next checkpoint,
            # or it would undo the shortening that failures just made.
            if self.ckpt_clock <= st.since.setdefault("cost", self.ckpt_clock):
                self.info["reason"] = (
                    f"keeping {current}: the cost asks for {k} (goodput binds), confirming at the next checkpoint"
                )
                return None, self.info
            st.since.pop("cost", None)
            self.info["reason"] = (
                f"cost: {self.est.cost:.3g} s per checkpoint: widening from {current} to {k} (goodput binds)"
            )
            return k, self.info
        st.since.pop("cost", None)
        self.info["reason"] = (
            f"failure rate: one failure every {hz.mtbf_s:.3g} s up ({hz.failures} in {hz.exposure_s:.3g} s): "
            f"{'shortening' if k < current else 'widening'} from {current} to {k} ({self.binding} binds)"
        )
        return k, self.info

    def _room_to_shorten(self) -> Verdict | None:
        st, est, t, current = self.st, self.est, self.est.t, self.current
        # Shorten only to what the rules give for pessimistic estimates (the cost + 1 standard error,
        # the persist + 2: a persist short of its time makes training wait; at least three
        # checkpoints since the last drift), when clearly shorter and still so at the next checkpoint.
        k_safe = target(self.cfg, est, cost := self.cost + est.cost_se, est.bg + 2.0 * est.bg_se)[0]
        if st.too_short is not None:
            short, at, drift = st.too_short
            if self.ckpt_clock - at > TOO_SHORT_CKPTS or est.detail.drift != drift:
                st.too_short = None
            else:
                k_safe = max(k_safe, short + 1)
        # A fall of the copy and persist's level by a factor of FELL_RATIO or more, seen at two
        # checkpoints, is timed directly (not inferred from iteration times): shortening then waits
        # for neither a third checkpoint nor the next one, or an interval that slow storage widened
        # would take four of its own wide intervals to come back.
        fell = est.detail.drift.get("background_s")
        quick = fell is not None and fell["to"] * FELL_RATIO <= fell["from"]
        fall = f" (the copy and persist fell from {fell['from']:.3g} s to {fell['to']:.3g} s)" if fell and quick else ""
        # Held by FIRST_SHORTEN: the next checkpoint decides, to any shorter interval (no dead band).
        held = bool((st.last_change or {}).get("first_limited")) and self.ckpt_clock > st.changed_at
        m = est.detail.cadence
        if m is not None and not m.referenced and k_safe < current:  # an old comparison: a probe first
            st.since.pop("shrink", None)
            self.info["reason"] = f"keeping {current}: the cadence has no recent iterations with nothing in flight"
            return None, self.info
        if st.slowdown_seen == "unseen" and k_safe < current:  # a floor is no evidence of room
            st.since.pop("shrink", None)
            self.info["reason"] = (
                f"keeping {current}: {k_safe} steps would rest on a floor of the cost ({est.cost_source}), "
                "no checkpoint's slowdown measured against iterations with nothing in flight"
            )
            return None, self.info
        limit = current - 1 if held else math.floor(current * self.cfg.shrink_ratio)
        if k_safe <= limit and est.n_level >= (2 if quick or held else 3):
            since = st.since.setdefault("shrink", self.ckpt_clock)
            if quick or held or (self.ckpt_clock > since and self.ckpt_clock > st.changed_at):
                self.info["reason"] = (
                    f"headroom: {k_safe} steps meet every rule (predicted overhead "
                    f"{100 * cost / (k_safe * t):.3g}%): shortening from {current}{fall}"
                )
                return k_safe, self.info
            self.info["reason"] = (
                f"keeping {current}: shorter interval {k_safe} possible, confirming at the next checkpoint"
            )
            return None, self.info
        st.since.pop("shrink", None)
        return None

    def _keep(self) -> Verdict:
        self.info["reason"] = f"keeping {self.current}: within every rule ({self.binding} sets the target {self.k})"
        return None, self.info
