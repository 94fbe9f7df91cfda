"""The adaptive frequency policy: :class:`Adaptive`, the checkpoint interval that maximises
goodput given how often the run fails, under an overhead budget and a bound on lost work.

The user-facing configuration, the worker side (:meth:`Adaptive.should_save`,
:meth:`Adaptive.initial_interval`: pure, configuration only) and the controller side
(:meth:`Adaptive.plan`, :meth:`Adaptive.observe` and the other methods
:class:`~cf_ray.policy.base.FrequencyPolicy` declares). What the samples teach
lives in :mod:`cf_ray.policy._estimator` (samples -> estimates); what the run's failures teach in
:mod:`cf_ray.policy._hazard` (events -> failure rate, recovery time); the decision ladder that turns
both into the interval lives in :mod:`cf_ray.policy._rules`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cf_ray.errors import ConfigError
from cf_ray.policy import _rules
from cf_ray.policy._estimate import _max_or_none, _nonneg, _pos
from cf_ray.policy._estimator import Estimator
from cf_ray.policy._hazard import HazardModel, RunEvent, persist_cadence
from cf_ray.policy.base import FrequencyPolicy, Sample, SaveContext

_STATE_VERSION = 2
"""The format of :meth:`Adaptive.state_dict` (the estimates, the interval and the failure history); a
profile of another version is refused, and the run profiles again."""


@dataclass(kw_only=True, slots=True)
class Adaptive(FrequencyPolicy):
    """The checkpoint interval that maximises goodput, under an overhead budget, decided by the controller.

    The worker side checkpoints when ``step - last_save_step >= interval`` where ``interval`` is
    the value the controller last published and every rank adopted (before that:
    :meth:`initial_interval`, so the first checkpoint is taken at ``first_checkpoint_step``).

    **What it measures** (from the :class:`Sample` stream of every rank; the slowest rank governs):

    * ``t`` — seconds per iteration: per rank the weighted median of its recent samples taken
      while none of its copies or persists was in flight, then the maximum over ranks;
    * ``C`` — training time one checkpoint costs: per rank, its stall plus the *slowdown* of the
      iterations that overlapped the checkpoint's copy and persist (the sum of ``iter_s - t_rank``
      over them, which also catches waiting in a collective for a slower rank's stall), maximum
      over ranks; guard waits (``Sample.wait_s``) are left out, the persist rule removes them;
    * ``B`` — background seconds of one checkpoint: ``copy_s + persist_s``, maximum over ranks. A
      guard wait ``w`` after ``g`` steps proves ``B >= g * t + w``; that bound is used at once.

    ``C`` and ``B`` are the mean (lowest and highest dropped) of the last ``window`` checkpoints
    since the last *drift*, with a standard error (for ``C`` pooled with a prior scatter of half
    the cost worth two checkpoints: one checkpoint's cost is not exact). A drift is the newest
    values of a series all off the median of the ones before by more than ``drift_ratio`` (or four
    times the series' own scatter, so noisy storage is not mistaken for drift) in the same
    direction: two values, three for a fall of ``C`` (it shortens the interval against the budget);
    the older values are then dropped, so a change of level (interference, a slower disk, a larger
    state) is followed within two or three checkpoints, and one or two odd checkpoints move nothing
    (``t`` follows drift continuously, 16 samples).

    **At short intervals** a rank's sample (a second of iterations) covers several checkpoints and no iteration
    is free of one, so the slowdown above cannot be attributed: ``C`` is then measured from the cadence instead
    (:mod:`cf_ray.policy._cadence`), the mean iteration time under the interval in force against the iteration
    time with nothing in flight, timed in *probe windows* the controller publishes (a longer interval for a few
    samples' time) when no such iteration is recent. It replaces the per-checkpoint ``C`` when higher by two
    standard errors; the CPU background work takes where no core is idle and training's extra wait for a CPU are
    floors (``cpu_taken_s``, ``queued_s``); a cost no comparison measured (``"unseen"``) never shortens it.
    The run's start-up (its first seconds are slower: the spare workers, the controller and the
    holder start beside training) is no reference: a rank's iterations with nothing in flight timed
    before the first tuned decision are set aside once it times one after it, a probe window comes
    one window after that decision when none has been, and the interval is not shortened on a
    cadence comparison that is still the start-up's or older than a probe window before the
    interval in force (``explain()["cadence"]["referenced"]``; a probe window comes first).

    **What it learns of the run's failures** (from :meth:`observe`, fed by the controller: the
    run's start, its restarts, their recoveries, preemption notices, the clock): the failure rate
    ``λ`` — a Gamma-Poisson posterior, prior ``Gamma(mtbf_weight, mtbf_weight * mtbf_s)`` (none
    without ``mtbf_s``: no estimate before the run's first failure), updated with the failures
    counted over the seconds the run was up — and the recovery time ``R`` of this run's restarts,
    memory and storage restores apart (:mod:`cf_ray.policy._hazard` has the rule).

    **The interval** is, in this order of precedence:

    1. ``min_interval <= k <= max_interval`` (always);
    2. one persist in flight: ``k * t >= B * (1 + headroom)``, so never below CheckFreq's
       ``ceil((t_full - t_stall) / t)``;
    3. ``k * t <= max_lost_s * (1 - headroom)`` when a bound on lost work is set (a cap);
    4. the budget: ``C / (k * t) <= budget_pct * (1 - headroom)`` (``k * t`` is the useful
       training time between two checkpoints; a cap on the overhead: a floor on ``k``);
    5. within those, the ``k`` that maximises the expected goodput given ``C``, ``λ`` and ``R``
       (Daly's model, :func:`cf_ray.policy._hazard.expected_goodput`); while ``λ`` is unknown
       (no prior and no failure yet), the shortest ``k`` the rules above allow, as CheckFreq does.

    So with frequent failures the budget caps how often it checkpoints, with rare ones the interval
    grows as far as goodput says (``max_lost_s`` caps it). :meth:`explain` says which rule set the
    interval (``binding``) and what each would have chosen (``candidates``). When a rule gives way
    to a stronger one, :meth:`explain` says so in ``conflicts`` and a :class:`PolicyWarning` is
    issued once per kind of conflict.

    **Hysteresis.** Once tuned, the interval is *widened* when the current one breaks a rule by
    more than the noise (``(C - se) / (k * t) > budget_pct``, or ``k * t < B - se``; while the
    slowdown is not measured, the copy and persist count whole there too, as where the interval is
    set): at once for a clear overrun, at the next checkpoint for a marginal one. It is *shortened*
    at once when it exceeds ``max_lost_s``; it moves at once to the goodput interval when that is
    off the current one by the ``shrink_ratio`` either way (a failure is an event, not noise);
    otherwise it is shortened only to the interval that pessimistic estimates (``C`` plus one
    standard error, ``B`` plus two, at least three checkpoints since the last drift) allow, when
    that is at most ``shrink_ratio * current`` at two checkpoints in a row. The first tuned
    decision shortens the provisional interval 4x at most (unmeasured, after a slow first persist:
    to twice the interval the cadence measures at); the next checkpoint goes to the pessimistic
    interval, unconfirmed, without ``shrink_ratio``. ``headroom`` is the dead band.

    **Profiling** is the first checkpoint, at ``first_checkpoint_step``: once its stall and persist
    time are known (or a second checkpoint has been seen without a persist time), with the first
    iteration time there is (a sample whose mean includes warm-up iterations stands in until a clean
    one comes), a *provisional* interval is published at once: the first interval is a guess that a
    short run lives under. Until the slowdown of the iterations that overlap the checkpoint has been
    measured, its copy and persist count as lost training time — what they cost when every core
    trains — and the provisional interval only widens the first one, never shortens it: it errs
    wide, never short. A slowdown measured while the iteration time itself moved by more than 25 %
    (the first iterations of a job are slower: allocator, caches) is not a measurement. It is tuned
    as soon as that slowdown and iterations with nothing in flight have been timed (or after three
    checkpoints), and hysteresis applies from then on. A profile kept
    with the run (:meth:`state_dict` / :meth:`load_state_dict`) makes :meth:`plan` return the
    previous interval (re-derived for this configuration) on its first call; it is replaced by new
    measurements once they are in, at once if they differ by more than ``drift_ratio``. The
    profile keeps the failure history too.

    **The controller's methods** (declared by :class:`FrequencyPolicy`): :meth:`observe` (the
    run's failures), :meth:`hazard` and :meth:`adopt_failures` (the failure rate), :meth:`explain`
    (a JSON-able dict of why the interval is what it is, as of the last :meth:`plan`),
    :meth:`checkpoint_stats` (what one checkpoint cost, for the profile table),
    :meth:`persist_cadence`, :meth:`state_dict` (keep with the run) and :meth:`load_state_dict`
    (into a freshly built policy, before the first :meth:`plan`).

    The object is mutable on the controller (``plan`` updates it); the copies on the workers only
    ever run :meth:`should_save` and :meth:`initial_interval`, which depend on configuration only.
    """

    budget_pct: float = 5.0
    """Percent of training time that checkpointing may cost (checkpoint cost / time between two
    checkpoints). Must be > 0 and < 100."""
    min_interval: int = 1
    """Never checkpoint more often than every ``min_interval`` steps (wins over every other rule)."""
    max_interval: int = 10_000
    """Never checkpoint less often than every ``max_interval`` steps (wins over every other rule)."""
    first_checkpoint_step: int = 5
    """The first checkpoint is taken here, before any profile exists, so that it can be timed
    (raised to ``min_interval`` / lowered to ``max_interval`` if outside them)."""
    max_lost_s: float | None = None
    """Optional bound on the training time lost by a failure, in seconds: forces
    ``interval * t_iter <= max_lost_s`` even when that costs more than the budget (a warning says
    so). It cannot force checkpoints faster than storage persists them."""
    window: int = 16
    """How many recent checkpoints are combined into the cost and persist estimates (mean without
    the lowest and the highest value)."""
    headroom: float = 0.1
    """Safety margin: aim at ``budget_pct * (1 - headroom)`` and at ``max_lost_s * (1 - headroom)``,
    and keep ``headroom`` spare above the persist time. Also the hysteresis dead band."""
    shrink_ratio: float = 0.75
    """Shorten the interval only when the new one is at most this fraction of the current one."""
    drift_ratio: float = 1.6
    """A change by this factor of the two newest per-checkpoint measurements (three for a fall of the cost) is
    a drift: the estimate restarts from them instead of waiting for ``window`` checkpoints."""
    warmup_steps: int = 2
    """Iterations ignored for timing at the start of a run and after a restore (compilation,
    cache warm-up)."""
    mtbf_s: float | None = None
    """Prior mean time between failures of the run, in seconds up (e.g. ``3600`` on spot nodes
    reclaimed about hourly). ``None``: no prior; until this run fails, the overhead budget alone sets
    the interval, and from its first failure on, the failures it had over the time it was up (see
    the class docstring). Observed failures outweigh a prior as they accumulate."""
    mtbf_weight: float = 1.0
    """How many observed failures the ``mtbf_s`` prior is worth: after that many, the run's own
    failures weigh as much as the prior."""

    _est: Estimator = field(init=False, repr=False, compare=False)
    """What :meth:`plan` has learnt from the samples (controller side only; not configuration)."""
    _rule_state: _rules.RuleState = field(init=False, repr=False, compare=False)
    """What the decision ladder remembers: the interval in force, hysteresis, warnings, the last
    explanation (controller side only; not configuration)."""
    _hazard: HazardModel = field(init=False, repr=False, compare=False)
    """What :meth:`observe` has learnt of the run's failures (controller side only)."""

    def __post_init__(self):
        b = self.budget_pct
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not 0 < b < 100:
            raise ConfigError(
                f"Adaptive.budget_pct={b!r} must be a number > 0 and < 100 (percent of training "
                "time spent checkpointing); 5 is a good default, use FixedInterval for a fixed cadence"
            )
        for name in ("min_interval", "max_interval", "first_checkpoint_step", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"Adaptive.{name}={v!r} must be an int >= 1")
        if self.min_interval > self.max_interval:
            raise ConfigError(
                f"Adaptive.min_interval={self.min_interval} is above max_interval={self.max_interval}; "
                "lower min_interval or raise max_interval"
            )
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"Adaptive.warmup_steps={self.warmup_steps!r} must be an int >= 0")
        m = self.max_lost_s
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0):
            raise ConfigError(
                f"Adaptive.max_lost_s={m!r} must be a number of seconds > 0, or None for no bound "
                "on the work lost by a failure"
            )
        if not (isinstance(self.headroom, (int, float)) and 0 <= self.headroom < 1):
            raise ConfigError(f"Adaptive.headroom={self.headroom!r} must be >= 0 and < 1 (e.g. 0.1)")
        if not (isinstance(self.shrink_ratio, (int, float)) and 0 < self.shrink_ratio < 1):
            raise ConfigError(f"Adaptive.shrink_ratio={self.shrink_ratio!r} must be > 0 and < 1 (e.g. 0.75)")
        if not (isinstance(self.drift_ratio, (int, float)) and self.drift_ratio > 1):
            raise ConfigError(f"Adaptive.drift_ratio={self.drift_ratio!r} must be > 1 (e.g. 1.6)")
        mtbf, w = self.mtbf_s, self.mtbf_weight
        if mtbf is not None and (
            isinstance(mtbf, bool) or not isinstance(mtbf, (int, float)) or not math.isfinite(mtbf) or mtbf <= 0
        ):
            raise ConfigError(
                f"Adaptive.mtbf_s={mtbf!r} must be a number of seconds > 0 (the mean time between the run's "
                "failures you expect), or None to let the run's own failures tell"
            )
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(
                f"Adaptive.mtbf_weight={w!r} must be a number > 0 (how many observed failures the mtbf_s "
                "prior is worth; 1 is a good default)"
            )
        self._est = Estimator(window=self.window, warmup_steps=self.warmup_steps, drift_ratio=self.drift_ratio)
        self._rule_state = _rules.RuleState()
        self._hazard = HazardModel(self.mtbf_s, self.mtbf_weight)

    # -- worker side: pure ----------------------------------------------------------------------
    def should_save(self, step: int, ctx: SaveContext) -> bool:
        if ctx.epoch_end:
            return False
        interval = ctx.interval if ctx.interval is not None else self.initial_interval()
        return step - ctx.last_save_step >= interval

    def initial_interval(self) -> int:
        """The interval before the controller publishes one: ``first_checkpoint_step``.

        It depends on configuration only, so every rank computes the same value; a loaded profile
        reaches the ranks through :meth:`plan` instead.
        """
        return min(max(self.first_checkpoint_step, self.min_interval), self.max_interval)

    # -- controller side ------------------------------------------------------------------------
    def plan(self, samples: Sequence[Sample], current: int | None) -> int | None:
        """Take in new samples and return the interval to publish, or ``None`` to keep ``current``.

        Args:
            samples: new samples, or the whole (bounded) history of them: samples already taken in
                are recognised by identity and skipped, so a call costs O(new samples + window).
            current: the interval last published (``None``: :meth:`initial_interval`).

        Returns:
            A new interval (an int different from ``current``) or ``None``.
        """
        estimator, rules = self._est, self._rule_state
        if current is None:
            current = self.initial_interval()
        estimator.ingest(samples, current, profiling=not rules.decided)
        est = estimator.estimate()
        if est is not None:
            est.hazard = self._hazard.estimate()
        base = _probe_base(self, current)
        rules.current = base
        first_measured = not rules.measured_decided
        decision, info = _rules.decide(self, rules, est, estimator.prior, estimator.ckpt_clock, base)
        if first_measured and rules.measured_decided:
            estimator.cadence.started()
        rules.info = info
        k = decision if decision is not None else base
        probe = _probe(self, est, base, k)
        if probe is not None:
            return None if probe == current else probe
        rules.persist_every, rules.persist_info = persist_cadence(self, est, k, rules.persist_every)
        if decision is not None and decision != base:
            rules.published(decision, base, info, estimator.ckpt_clock, estimator.max_step)
        return k if k != current else None

    def persist_cadence(self) -> int:
        """One scheduled snapshot in how many is persisted, as of the last :meth:`plan` (the others
        are held in memory only: restorable after a failure that leaves their holder alive, never
        written); see :func:`cf_ray.policy._hazard.persist_cadence` for the rule. 1 until the run's
        failure rate is known."""
        return self._rule_state.persist_every

    def persist_every(self) -> int:
        """:meth:`persist_cadence`, under the name ``FixedInterval``'s field and
        ``explain()["persist"]`` use."""
        return self._rule_state.persist_every

    def observe(self, event: RunEvent) -> None:
        """Take in what the controller saw of the run's failures: its start, each restart, each
        first resumed iteration, each preemption notice, and the clock (see
        :mod:`cf_ray.policy._hazard`). The next :meth:`plan` decides with it.

        Args:
            event: a :class:`~cf_ray.policy.RunEvent`; a malformed one is ignored.
        """
        try:
            self._hazard.observe(event)
        except (TypeError, ValueError, AttributeError):  # a report must never break the policy
            return

    def hazard(self) -> dict:
        """The failure-rate estimate as of now (JSON-able; ``explain()["hazard"]`` is as of the last
        :meth:`plan`): ``mtbf_s``, ``failures_per_hour``, ``failures``, ``notices``, ``exposure_s``,
        ``prior``, ``recovery_s``, ``recovery_by_source``, ``storage_share``."""
        return self._hazard.estimate().as_dict()

    def adopt_failures(self, other: FrequencyPolicy) -> None:
        """Continue ``other``'s failure history (a fresh copy of the policy after a resize: the
        costs are measured again, the failure rate is the run's)."""
        if isinstance(other, Adaptive):
            self._hazard.load_state_dict(other._hazard.state_dict())

    def explain(self) -> dict:
        """Why the interval is what it is, as of the last :meth:`plan` (JSON-able).

        Keys: ``phase`` (``profiling``/``provisional``/``tuned``/``restored``), ``interval`` (in force),
        ``target`` (what the rules ask for now), ``binding`` (the rule that set the target:
        ``goodput``, ``budget``, ``persist_in_flight``, ``max_lost_s``, ``min_interval``,
        ``max_interval``, ``profiling``), ``candidates`` (what ``goodput``, ``budget``,
        ``max_lost_s`` and ``persist_in_flight`` would each have chosen alone; ``None``: no
        opinion), ``hazard`` (the failure rate, MTBF, failures, exposure, prior and recovery times,
        the goodput the interval is expected to give and Young/Daly's closed form for comparison),
        ``reason`` (one sentence), ``conflicts`` (rules that gave way),
        ``budget_pct``, ``predicted_overhead_pct`` (at the interval in force),
        ``measured_overhead_pct`` (the job's time lost to checkpoints over its training time,
        :mod:`cf_ray.policy._cadence`), ``lost_work_s``, ``cost_source`` and ``cadence`` (the cost
        measured from the cadence, and whether it or the per-checkpoint one is used), ``probe`` (while
        a probe window is open), the estimates
        (``iter_s``, ``slowest_rank``, ``stall_s``, ``slowdown_s``, ``cost_s``, ``copy_s``,
        ``persist_s``, ``background_s``, ``bytes``, ``persist_bytes_per_s``), ``checkfreq_interval``
        (CheckFreq's formula on the same measurements), ``drift``, ``last_change`` and ``persist``
        (:meth:`persist_every` and why: ``binding``, ``storage_interval_s``,
        ``persisted_recovery_point_s``, ``storage_failure_rate_per_hour``, ``reason``), and
        ``records``: the recent checkpoints as the estimates read them, each with its cost and per
        rank its stall, wait, copy, persist, the excess of the iterations its copy and persist
        overlapped over the clean ones on both sides of them and how many those were (a cost far from what the job
        paid can be traced to the samples that made it).
        """
        st = self._rule_state
        out = (
            dict(st.info)
            if st.info
            else {"phase": _rules.Phase.PROFILING.value, "interval": st.current, "reason": "no measurements yet"}
        )
        out["policy"] = "Adaptive"
        out["last_change"] = dict(st.last_change) if st.last_change else None
        out["persist"] = dict(st.persist_info) if st.persist_info else {"persist_every": st.persist_every}
        out["records"] = _records(self._est)
        return out

    def checkpoint_stats(self, step: int) -> dict | None:
        """What was measured for the checkpoint at ``step`` (recent checkpoints only), or ``None``.

        Returns a dict with ``stall_s`` (max over ranks), ``wait_s`` (the part of a stall spent
        waiting for the previous snapshot, max over ranks), ``slowdown_s`` (extra iteration time
        while its copy/persist ran), ``cost_s`` (max over ranks of stall + slowdown, waits
        excluded), ``copy_s``, ``persist_s``, ``background_s`` (copy + persist), ``bytes`` (sum
        over ranks) and ``overhead_pct`` (the job's time lost to checkpoints over its training
        time as of this checkpoint: ``explain()["measured_overhead_pct"]`` then; ``None`` before
        it is known).
        """
        rec = self._est.record(step)
        pct = self._est.cadence.rows.get(step)
        if rec is None:
            return None if pct is None else {"overhead_pct": pct}
        cost = rec.cost()
        own = rec.own_stall_max()
        return {
            "stall_s": rec.stall_max(),
            "wait_s": _max_or_none(rec.wait),
            "slowdown_s": None if cost is None or own is None else max(cost - own, 0.0),
            "cost_s": cost,
            "copy_s": _max_or_none(rec.copy),
            "persist_s": _max_or_none(rec.persist),
            "background_s": rec.bg(False),
            "bytes": sum(rec.nbytes.values()) if rec.nbytes else None,
            "overhead_pct": pct,
        }

    def state_dict(self) -> dict:
        """The profile to keep with the run (JSON-able): the estimates and the interval in force.

        Load it with :meth:`load_state_dict` into a freshly built policy of a restarted job.
        """
        prior = self._est.prior
        est = self._est.estimate()
        out = {"version": _STATE_VERSION, "interval": self._rule_state.current, "hazard": self._hazard.state_dict()}
        if est is not None:
            out.update(iter_s=est.t, stall_s=est.stall, cost_s=est.cost, background_s=est.bg, bytes=est.detail.nbytes)
        elif prior:
            out.update({k: prior.get(k) for k in ("iter_s", "stall_s", "cost_s", "background_s", "bytes")})
        return out

    def load_state_dict(self, state: dict) -> None:
        """Start from a profile saved by :meth:`state_dict` instead of profiling from scratch.

        Call it on the controller's policy before the first :meth:`plan`; the next :meth:`plan`
        then returns the interval that profile gives under *this* policy's configuration (which may
        differ from the saved run's), and later measurements replace the profile.

        Raises:
            ConfigError: ``state`` is not a profile of a version this cf_ray can read.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ConfigError(
                f"Adaptive.load_state_dict: not a version-{_STATE_VERSION} policy profile: {state!r}; "
                "delete the saved policy state to profile again"
            )
        hazard = state.get("hazard")
        if isinstance(hazard, dict):
            try:
                self._hazard.load_state_dict(hazard)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"Adaptive.load_state_dict: unreadable failure history {hazard!r}: {e}") from e
        t, cost = _pos(state.get("iter_s")), _nonneg(state.get("cost_s"))
        if t is None or cost is None:
            self._est.prior = None  # nothing measured in the saved run: profile as usual
            return
        self._est.prior = {
            "iter_s": t,
            "cost_s": cost,
            "stall_s": _nonneg(state.get("stall_s")) or cost,
            "background_s": _nonneg(state.get("background_s")) or 0.0,
            "bytes": state.get("bytes"),
            "interval": state.get("interval"),
        }


def _probe_base(cfg: Adaptive, current: int) -> int:
    """The interval the rules start from: the one in force before an open probe window (the one a
    window that is over now returns to), else ``current``."""
    cad = cfg._est.cadence
    if cad.probe is None:
        return current
    if cad.probe_done(cfg._est.active()):
        return cad.end_probe()
    return cad.probe["back_to"]


def _probe(cfg: Adaptive, est, base: int, k: int) -> int | None:
    """The probe windows of :mod:`cf_ray.policy._cadence`: the interval to hold (an open window,
    or one that starts now), or ``None`` to publish what the rules said (``k``, from ``base``).

    A window stays open while the rules keep, shorten or widen the interval below the window's
    (then it returns to that one); a rule that widens it beyond the window's (a slower disk)
    closes it at once. One starts only when the rules
    keep the interval, after the first measured decision, when a rank has no recent iteration
    timed with nothing in flight.
    """
    cad, rules = cfg._est.cadence, cfg._rule_state
    if cad.probe is not None:
        if k >= cad.probe["k"]:
            cad.end_probe()
            return None
        if k > base:  # a wider interval, still shorter than the window: the window stays, then k
            cad.probe["back_to"] = base = k
        rules.info["reason"] = (
            f"probe: no checkpoint for {cad.probe['k']} steps to time iterations with nothing in flight "
            f"(since step {cad.probe['from_step']}), then back to {base}"
        )
        rules.info["probe"] = dict(cad.probe)
        return cad.probe["k"]
    if est is None or not rules.measured_decided or k != base:
        return None
    why = cad.needs_probe(est.t, est.bg, cfg._est.active())
    if why is None:
        return None
    if rules.info.get("binding") == "persist_in_flight":
        return None  # the persist sets the interval and fills it by design: no window free of one to make
    k_probe = max(cad.probe_steps(est.t, est.bg), base)
    if cfg.max_lost_s is not None:
        k_probe = min(k_probe, max(math.floor(cfg.max_lost_s * (1.0 - cfg.headroom) / est.t), base))
    k_probe = min(k_probe, cfg.max_interval)
    if k_probe <= base:
        return None  # the interval in force already leaves room for clean iterations
    cad.start_probe(k_probe, base)
    info = rules.info
    info["probe"] = dict(cad.probe or {})
    info["reason"] = (
        f"probe: {why}, so the "
        f"slowdown a checkpoint causes cannot be told: no checkpoint for {k_probe} steps, then back to {base}"
    )
    return k_probe


def _records(est: Estimator) -> list[dict]:
    """The recent checkpoints as the estimates read them (JSON-able, in step order): per checkpoint
    its ``cost_s`` (``None`` without a stall), whether it was taken while ``profiling`` or is
    ``coarse`` (set aside for its slowdown), and per rank the stall, guard wait, copy, persist,
    ``excess_s`` (the overlapped iterations' time over the clean ones around them; absent while the
    overlap is open, or where the iteration time moved under it), ``noise_s`` (its standard error,
    from the scatter of the rank's clean samples), ``overlapped_iters`` (how many iterations that
    is over), ``base_s`` (the baseline time of its iterations until the next checkpoint) and the CPU
    of its copy and of the holder's write (``copy_cpu_s``, ``persist_cpu_s``); ``cpu_taken_s``: what
    that CPU took from training where it found no idle core; per rank ``queued_s``, the training
    thread's wait for a CPU in the overlapped iterations above its wait with nothing in flight, and
    per checkpoint the largest of those (within its copy and persist time)."""
    out = []
    idle = {rank: r.idle_level() for rank, r in est.ranks.items()}
    for rec in est.recs.values():
        fields = (
            ("stall_s", rec.stall),
            ("wait_s", rec.wait),
            ("copy_s", rec.copy),
            ("persist_s", rec.persist),
            ("copy_cpu_s", rec.taken.copy_cpu),
            ("persist_cpu_s", rec.taken.persist_cpu),
            ("excess_s", rec.excess),
            ("noise_s", rec.noise),
            ("overlapped_iters", rec.over_iters),
            ("base_s", rec.base_s),
            ("queued_s", rec.taken.queued),
        )
        ranks = sorted(set().union(*(d for _, d in fields)))
        per_rank = [{"rank": r} | {key: d[r] for key, d in fields if r in d} for r in ranks]
        out.append(
            {
                "step": rec.step,
                "cost_s": rec.cost(),
                "cpu_taken_s": rec.cpu_taken(idle),
                "queued_s": rec.queue_taken(),
                "profiling": rec.profiling,
                "coarse": rec.coarse,
                "ranks": per_rank,
            }
        )
    return out
