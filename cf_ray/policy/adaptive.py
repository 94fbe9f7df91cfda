"""When to checkpoint: small, pure policy objects (no Ray inside), in the manner of Orbax's
save-decision policies.

A policy has two sides:

* ``should_save(step, ctx)`` runs on every rank after each optimizer step. It must be a pure
  function of its arguments, because every rank evaluates it independently and all ranks must
  agree: ``ctx`` holds only values that every rank has agreed on (the step, the epoch boundary, the
  last checkpoint step and the interval the controller published and the ranks adopted together).
* ``plan(samples, current)`` runs in the driver-side controller for adaptive policies: it turns
  timing samples from every rank into the interval to use next. Fixed policies return ``None``.
* ``initial_interval()`` is the interval every rank uses before the controller publishes one. It
  depends on the policy's configuration only (never on loaded state), so every rank computes the
  same value from its own copy of the policy.

:class:`Adaptive` also offers optional methods for the controller: :meth:`Adaptive.explain`,
:meth:`Adaptive.checkpoint_stats`, :meth:`Adaptive.state_dict` and :meth:`Adaptive.load_state_dict`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from cf_ray.errors import ConfigError


class PolicyWarning(UserWarning):
    """Two constraints of :class:`Adaptive` cannot both be met; the message says which one won."""


@dataclass(frozen=True, slots=True)
class SaveContext:
    """What every rank knows identically when it decides whether ``step`` is a checkpoint step."""

    step: int
    """Optimizer steps taken so far in the run (after this one)."""
    epoch: int
    """The current epoch."""
    last_save_step: int
    """The step of the last checkpoint taken (or restored from); 0 on a fresh run."""
    interval: int | None = None
    """The interval published by the controller and adopted by all ranks (adaptive mode)."""
    epoch_end: bool = False
    """True when called from ``Checkpointer.end_epoch()``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One compact timing message for :meth:`FrequencyPolicy.plan`.

    Workers send one every poll (iteration timing plus what they know of their last checkpoint).
    The controller may add samples of its own for what a worker cannot see, e.g. when a holder
    reports a section durable: ``Sample(rank=r, step=c, ckpt_step=c, persist_s=t)``. A sample with
    ``iters == 0`` carries checkpoint information only. Repeating the same checkpoint values in
    every sample is fine: :class:`Adaptive` records each checkpoint once per rank and keeps the
    newest value of each field.
    """

    rank: int
    """The rank the measurements belong to."""
    step: int
    """The rank's step count when the sample was taken (the last step its iterations cover)."""
    iter_s: float = 0.0
    """Mean seconds per iteration since the previous sample, checkpoint stalls excluded (all of
    ``stall_s``: a stall counted here as well would be counted twice)."""
    iters: int = 0
    """Number of iterations the mean covers (0: no iteration information in this sample)."""
    stall_s: float | None = None
    """Training-thread stall of checkpoint ``ckpt_step``: the synchronous part plus the guard
    waits for its own background copy (before the next optimizer step)."""
    wait_s: float | None = None
    """The part of ``stall_s`` spent waiting, before this snapshot could start, for the *previous*
    checkpoint's copy/persist still in flight (one in flight per rank). It is left out of the cost,
    because the interval keeps one persist in flight, and it proves the persist outlasted the
    interval. Not the guard for this snapshot's own copy: that is cost. ``None``: no such wait."""
    copy_s: float | None = None
    """Background copy of that snapshot into host buffers (overlapped with training)."""
    persist_s: float | None = None
    """Phase 2 (write + checksum) of this rank's sections of that checkpoint; ``None`` while it is
    still running. For a failed persist, report the time until it failed, or leave ``None``."""
    nbytes: int | None = None
    """Bytes of this rank's snapshot."""
    ckpt_step: int | None = None
    """The step of the checkpoint that ``stall_s``/``copy_s``/``persist_s``/``nbytes`` describe.
    Strongly recommended: without it the policy guesses which checkpoint the values belong to and
    cannot attribute the slowdown of the iterations that run while a persist is in flight."""
    overlapped: bool | None = None
    """Whether a snapshot copy or persist of this rank was in flight during these iterations;
    ``None`` lets the policy infer it from ``ckpt_step`` and the copy and persist times."""


@runtime_checkable
class FrequencyPolicy(Protocol):
    """Decides checkpoint steps. See the module docstring for which side calls what."""

    def should_save(self, step: int, ctx: SaveContext) -> bool: ...

    def plan(self, samples: Sequence[Sample], current: int | None) -> int | None: ...

    def initial_interval(self) -> int | None: ...


@dataclass(kw_only=True, slots=True)
class FixedInterval:
    """Checkpoint every ``every`` optimizer steps (CheckFreq's MANUAL mode)."""

    every: int
    """Steps between checkpoints; a checkpoint is taken when ``step % every == 0``."""

    def __post_init__(self):
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ConfigError(f"FixedInterval.every={self.every!r} must be an int >= 1; "
                              "use EpochEnd() to checkpoint only at epoch boundaries")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return not ctx.epoch_end and step > 0 and step % self.every == 0

    def plan(self, samples, current):
        return None

    def initial_interval(self) -> int | None:
        return None  # not controller-driven

    def explain(self) -> dict:
        """Why the interval is what it is (see :meth:`Adaptive.explain`)."""
        return {"policy": "FixedInterval", "interval": self.every, "binding": "manual",
                "reason": f"a fixed interval of {self.every} steps was configured"}


@dataclass(kw_only=True, slots=True)
class EpochEnd:
    """Checkpoint only at epoch boundaries (CheckFreq's baseline), every ``every`` epochs."""

    every: int = 1
    """Epochs between checkpoints; a checkpoint is taken when ``epoch % every == 0``."""

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"EpochEnd.every={self.every!r} must be an int >= 1")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return ctx.epoch_end and ctx.epoch % self.every == 0

    def plan(self, samples, current):
        return None

    def initial_interval(self) -> int | None:
        return None

    def explain(self) -> dict:
        """Why the interval is what it is (see :meth:`Adaptive.explain`)."""
        return {"policy": "EpochEnd", "interval": None, "binding": "epoch",
                "reason": f"checkpoints at the end of every {self.every} epoch(s)"}


@dataclass(kw_only=True, slots=True)
class AnyOf:
    """Checkpoint when any of ``policies`` says so; an adaptive member's plan is used.

    The optional methods (``explain``, ``checkpoint_stats``, ``state_dict``,
    ``load_state_dict``) are forwarded to the members that have them.
    """

    policies: tuple = field(default_factory=tuple)
    """The member policies; the first one whose ``plan`` returns an interval drives the schedule."""

    def __post_init__(self):
        self.policies = tuple(self.policies)
        if not self.policies:
            raise ConfigError("AnyOf(policies=...) needs at least one policy")
        for p in self.policies:
            if not isinstance(p, FrequencyPolicy):
                raise ConfigError(f"AnyOf: {p!r} is not a FrequencyPolicy")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return any(p.should_save(step, ctx) for p in self.policies)

    def plan(self, samples, current):
        for p in self.policies:
            k = p.plan(samples, current)
            if k is not None:
                return k
        return None

    def initial_interval(self) -> int | None:
        for p in self.policies:
            k = p.initial_interval()
            if k is not None:
                return k
        return None

    def explain(self) -> dict:
        """The members' explanations, in order (see :meth:`Adaptive.explain`)."""
        parts = [p.explain() if hasattr(p, "explain") else {"policy": type(p).__name__} for p in self.policies]
        driver = next((e for e in parts if e.get("interval") is not None and e.get("policy") == "Adaptive"), None)
        out = dict(driver) if driver else {"interval": None}
        out.update(policy="AnyOf", members=parts)
        return out

    def checkpoint_stats(self, step: int) -> dict | None:
        """The first member's :meth:`Adaptive.checkpoint_stats` that knows ``step``."""
        for p in self.policies:
            if hasattr(p, "checkpoint_stats"):
                stats = p.checkpoint_stats(step)
                if stats is not None:
                    return stats
        return None

    def state_dict(self) -> dict:
        """The members' state, by position (``None`` for members without state)."""
        return {"members": [p.state_dict() if hasattr(p, "state_dict") else None for p in self.policies]}

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` returned into a freshly built ``AnyOf`` of the same members."""
        members = state.get("members") if isinstance(state, dict) else None
        if not isinstance(members, list) or len(members) != len(self.policies):
            raise ConfigError(f"AnyOf.load_state_dict: expected {len(self.policies)} member states, got {members!r}")
        for p, s in zip(self.policies, members):
            if s is not None and hasattr(p, "load_state_dict"):
                p.load_state_dict(s)


# ------------------------------------------------------------------------------------------------
# Adaptive
# ------------------------------------------------------------------------------------------------

_STATE_VERSION = 1


@dataclass(kw_only=True, slots=True)
class Adaptive:
    """Automatic checkpoint interval under an overhead budget, decided by the controller.

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
    since the last *drift*, with a standard error. A drift is the two newest values of a series
    both off the median of the ones before by more than ``drift_ratio`` (or four times the
    series' own scatter, so noisy storage is not mistaken for drift) in the same direction; the
    older values are then dropped, so a change of level (interference, a slower disk, a larger
    state) is followed within two checkpoints. ``t`` follows drift continuously (16 samples).

    **The interval** is the shortest ``k`` that meets, in this order of precedence:

    1. ``min_interval <= k <= max_interval`` (always);
    2. one persist in flight: ``k * t >= B * (1 + headroom)``, so never below CheckFreq's
       ``ceil((t_full - t_stall) / t)``;
    3. ``k * t <= max_lost_s * (1 - headroom)`` when a bound on lost work is set;
    4. the budget: ``C / (k * t) <= budget_pct * (1 - headroom)`` (``k * t`` is the useful
       training time between two checkpoints).

    When a rule gives way to a stronger one, :meth:`explain` says so in ``conflicts`` and a
    :class:`PolicyWarning` is issued once per kind of conflict.

    **Hysteresis.** Once tuned, the interval is *widened* when the current one breaks a rule by
    more than the noise (``(C - se) / (k * t) > budget_pct``, or ``k * t < B - se``): at once for
    a clear overrun, at the next checkpoint for a marginal one. It is *shortened* at once when it
    exceeds ``max_lost_s``; otherwise only to the interval that pessimistic estimates (``C`` and
    ``B`` plus two standard errors, at least three checkpoints since the last drift) allow, when
    that is at most ``shrink_ratio * current`` at two checkpoints in a row. The gap between the
    limits and the aims (``headroom``) is the dead band.

    **Profiling** is the first checkpoint, at ``first_checkpoint_step``: once its stall and persist
    time are known (or a second checkpoint has been seen without a persist time) a *provisional*
    interval is published; until the slowdown of the iterations that overlap the checkpoint has been
    measured (its copy and persist are over and a later iteration has been timed), its copy and
    persist count as lost training time — what they cost when every core trains — so the
    provisional interval errs wide, never short. A slowdown measured while the iteration time itself
    moved by more than 25 % (the first iterations of a job are slower: allocator, caches) is not a
    measurement. It is tuned as soon as that slowdown and iterations
    with nothing in flight have been timed (or after three checkpoints), and hysteresis applies
    from then on. A profile kept
    with the run (:meth:`state_dict` / :meth:`load_state_dict`) makes :meth:`plan` return the
    previous interval (re-derived for this configuration) on its first call; it is replaced by new
    measurements once they are in, at once if they differ by more than ``drift_ratio``.

    **Optional methods for the controller:** :meth:`explain` (a JSON-able dict of why the interval
    is what it is, as of the last :meth:`plan`), :meth:`checkpoint_stats` (what one checkpoint
    cost, for the profile table), :meth:`state_dict` (keep with the run) and
    :meth:`load_state_dict` (into a freshly built policy, before the first :meth:`plan`).

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
    """A change by this factor of the two newest per-checkpoint measurements is a drift: the
    estimate restarts from them instead of waiting for ``window`` checkpoints."""
    warmup_steps: int = 2
    """Iterations ignored for timing at the start of a run and after a restore (compilation,
    cache warm-up)."""

    _st: "_State" = field(init=False, repr=False, compare=False)
    """What :meth:`plan` has learnt (controller side only; not configuration)."""

    def __post_init__(self):
        b = self.budget_pct
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not 0 < b < 100:
            raise ConfigError(f"Adaptive.budget_pct={b!r} must be a number > 0 and < 100 (percent of training "
                              "time spent checkpointing); 5 is a good default, use FixedInterval for a fixed cadence")
        for name in ("min_interval", "max_interval", "first_checkpoint_step", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"Adaptive.{name}={v!r} must be an int >= 1")
        if self.min_interval > self.max_interval:
            raise ConfigError(f"Adaptive.min_interval={self.min_interval} is above max_interval={self.max_interval}; "
                              "lower min_interval or raise max_interval")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"Adaptive.warmup_steps={self.warmup_steps!r} must be an int >= 0")
        m = self.max_lost_s
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0):
            raise ConfigError(f"Adaptive.max_lost_s={m!r} must be a number of seconds > 0, or None for no bound "
                              "on the work lost by a failure")
        if not (isinstance(self.headroom, (int, float)) and 0 <= self.headroom < 1):
            raise ConfigError(f"Adaptive.headroom={self.headroom!r} must be >= 0 and < 1 (e.g. 0.1)")
        if not (isinstance(self.shrink_ratio, (int, float)) and 0 < self.shrink_ratio < 1):
            raise ConfigError(f"Adaptive.shrink_ratio={self.shrink_ratio!r} must be > 0 and < 1 (e.g. 0.75)")
        if not (isinstance(self.drift_ratio, (int, float)) and self.drift_ratio > 1):
            raise ConfigError(f"Adaptive.drift_ratio={self.drift_ratio!r} must be > 1 (e.g. 1.6)")
        self._st = _State()

    # -- worker side: pure ----------------------------------------------------------------------
    def should_save(self, step: int, ctx: SaveContext) -> bool:
        if ctx.epoch_end:
            return False
        interval = ctx.interval if ctx.interval is not None else self.initial_interval()
        return step - ctx.last_save_step >= interval

    def initial_interval(self) -> int | None:
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
        st = self._st
        if current is None:
            current = self.initial_interval()
        for s in _new_samples(st, samples):
            self._ingest(s, current)
        st.current = current
        decision, info = self._decide(current)
        st.info = info
        if decision is not None and decision != current:
            st.last_change = {"from": current, "to": decision, "reason": info.get("reason"),
                              "ckpt": st.ckpt_clock, "at_step": st.max_step}
            st.changed_at = st.ckpt_clock
            st.shrink_since = st.widen_since = None
            info.update(interval=decision, previous=current)
            info["lost_work_s"] = decision * info["iter_s"] if info.get("iter_s") else None
            info["predicted_overhead_pct"] = 100.0 * info["cost_s"] / (decision * info["iter_s"]) \
                if info.get("iter_s") and info.get("cost_s") is not None else None
            st.current = decision
            return decision
        return None

    def explain(self) -> dict:
        """Why the interval is what it is, as of the last :meth:`plan` (JSON-able).

        Keys: ``phase`` (``profiling``/``provisional``/``tuned``/``restored``), ``interval`` (in force),
        ``target`` (what the rules ask for now), ``binding`` (the rule that set the target:
        ``budget``, ``persist_in_flight``, ``max_lost_s``, ``min_interval``, ``max_interval``,
        ``profiling``), ``reason`` (one sentence), ``conflicts`` (rules that gave way),
        ``budget_pct``, ``predicted_overhead_pct`` (at the interval in force),
        ``measured_overhead_pct`` (recent checkpoints), ``lost_work_s``, the estimates
        (``iter_s``, ``slowest_rank``, ``stall_s``, ``slowdown_s``, ``cost_s``, ``copy_s``,
        ``persist_s``, ``background_s``, ``bytes``, ``persist_bytes_per_s``), ``checkfreq_interval``
        (CheckFreq's formula on the same measurements), ``drift`` and ``last_change``.
        """
        st = self._st
        out = dict(st.info) if st.info else {"phase": "profiling", "interval": st.current,
                                             "reason": "no measurements yet"}
        out["policy"] = "Adaptive"
        out["last_change"] = dict(st.last_change) if st.last_change else None
        return out

    def checkpoint_stats(self, step: int) -> dict | None:
        """What was measured for the checkpoint at ``step`` (recent checkpoints only), or ``None``.

        Returns a dict with ``stall_s`` (max over ranks), ``wait_s`` (the part of a stall spent
        waiting for the previous snapshot, max over ranks), ``slowdown_s`` (extra iteration time
        while its copy/persist ran), ``cost_s`` (max over ranks of stall + slowdown, waits
        excluded), ``copy_s``, ``persist_s``, ``background_s`` (copy + persist), ``bytes`` (sum
        over ranks) and ``overhead_pct`` (cost over the baseline iteration time until the next
        checkpoint; ``None`` until that is known).
        """
        rec = self._st.recs.get(step)
        if rec is None:
            return None
        cost = rec.cost()
        own = rec.own_stall_max()
        return {"stall_s": rec.stall_max(), "wait_s": _max_or_none(rec.wait),
                "slowdown_s": None if cost is None or own is None else max(cost - own, 0.0),
                "cost_s": cost, "copy_s": _max_or_none(rec.copy), "persist_s": _max_or_none(rec.persist),
                "background_s": rec.bg(False), "bytes": sum(rec.nbytes.values()) if rec.nbytes else None,
                "overhead_pct": rec.overhead_pct()}

    def state_dict(self) -> dict:
        """The profile to keep with the run (JSON-able): the estimates and the interval in force.

        Load it with :meth:`load_state_dict` into a freshly built policy of a restarted job.
        """
        st = self._st
        est = self._estimate()
        out = {"version": _STATE_VERSION, "interval": st.current}
        if est is not None:
            out.update(iter_s=est.t, stall_s=est.stall, cost_s=est.cost, background_s=est.bg, bytes=est.nbytes)
        elif st.prior:
            out.update({k: st.prior.get(k) for k in ("iter_s", "stall_s", "cost_s", "background_s", "bytes")})
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
            raise ConfigError(f"Adaptive.load_state_dict: not a version-{_STATE_VERSION} policy profile: {state!r}; "
                              "delete the saved policy state to profile again")
        t, cost = _pos(state.get("iter_s")), _nonneg(state.get("cost_s"))
        if t is None or cost is None:
            self._st.prior = None  # nothing measured in the saved run: profile as usual
            return
        self._st.prior = {"iter_s": t, "cost_s": cost, "stall_s": _nonneg(state.get("stall_s")) or cost,
                          "background_s": _nonneg(state.get("background_s")) or 0.0,
                          "bytes": state.get("bytes"), "interval": state.get("interval")}

    # -- ingestion ------------------------------------------------------------------------------
    def _ingest(self, s: Sample, current: int) -> None:
        if not (isinstance(s, Sample) and isinstance(s.rank, numbers.Integral) and isinstance(s.step, numbers.Integral)
                and (s.ckpt_step is None or isinstance(s.ckpt_step, numbers.Integral))):
            return  # not a sample: ignored rather than fatal to the controller
        st = self._st
        st.clock += 1
        r = st.ranks.get(s.rank)
        if r is None:
            r = st.ranks[s.rank] = _Rank(self.warmup_steps)
        r.seen = st.clock
        iters = int(s.iters) if isinstance(s.iters, numbers.Integral) and s.iters > 0 else 0
        if iters and s.step < r.last_step:
            self._rollback(s.rank, r, s.step - iters)
        if any(v is not None for v in (s.stall_s, s.wait_s, s.copy_s, s.persist_s, s.nbytes)) \
                or s.ckpt_step is not None:
            self._ingest_ckpt(s.rank, r, s, current)
        if iters and _pos(s.iter_s) is not None:
            r.last_step = max(r.last_step, s.step)
            st.max_step = max(st.max_step, s.step)
            first = s.step - iters + 1
            if first <= r.warm_until:
                return
            self._ingest_iters(s.rank, r, s, first, iters)

    def _rollback(self, rank: int, r: "_Rank", restored: int) -> None:
        """The rank restarted from ``restored``: forget its part of the abandoned checkpoints."""
        st = self._st
        for step in [c for c in st.recs if c > restored]:
            rec = st.recs[step]
            rec.drop_rank(rank)
            if rec.empty():
                del st.recs[step]
        if r.cur is not None and r.cur.step > restored:
            r.cur = None
        r.last_step = restored
        r.warm_until = restored + self.warmup_steps
        st.rev += 1

    def _ingest_ckpt(self, rank: int, r: "_Rank", s: Sample, current: int) -> None:
        st = self._st
        c = s.ckpt_step
        approx = False
        cur = r.cur
        if c is None:
            # The engine did not say which checkpoint the values describe. Guess: the same one
            # until they change half an interval later, or a whole interval has passed.
            values = (s.stall_s, s.copy_s, s.nbytes)
            persist_only = all(v is None for v in values)
            gap = s.step - cur.step if cur is not None else 0
            if cur is not None and (persist_only or (cur.approx and gap < current and (
                    values == cur.values or gap < max(2, current // 2)))):
                c = cur.step
            else:
                c, approx = max(s.step - max(s.iters, 1), 0), True
        if cur is None or c > cur.step or (approx and c != cur.step):
            if cur is not None:
                self._close_segment(rank, cur)
            cur = r.cur = _RankCkpt(c, approx, cur.step if cur is not None else None)
        rec = st.recs.get(c)
        if rec is None:
            if c < cur.step:
                # A rank reports only its newest checkpoint with each sample, so at short
                # intervals most checkpoints are never heard of until their persist time comes
                # from the controller — and at an interval shorter than the persist, the ones the
                # holder wrote are the only evidence of how long a persist takes. Keep those
                # (in step order); drop anything else older than the newest checkpoint, and
                # whatever is older than every checkpoint still kept.
                if s.persist_s is None or (st.recs and c < next(iter(st.recs))):
                    return
                st.ckpt_clock += 1
                st.rev += 1
                st.recs[c] = _Ckpt(c, st.ckpt_clock, not st.decided)
                st.recs = dict(sorted(st.recs.items()))
                rec = st.recs[c]
            else:
                st.ckpt_clock += 1
                st.rev += 1
                rec = st.recs[c] = _Ckpt(c, st.ckpt_clock, not st.decided)
            while len(st.recs) > 2 * self.window + 4:
                del st.recs[next(iter(st.recs))]
        if rec.put(rank, _nonneg(s.stall_s), _nonneg(s.wait_s), _nonneg(s.copy_s), _nonneg(s.persist_s), s.nbytes):
            st.rev += 1
        if s.persist_s is not None:
            st.persist_seen = True
        if cur.step == c and s.stall_s is not None:
            cur.values = (s.stall_s, s.copy_s, s.nbytes)

    def _ingest_iters(self, rank: int, r: "_Rank", s: Sample, first: int, iters: int) -> None:
        cur = r.cur
        base = r.base()
        if cur is not None and not cur.closed and self._overlapped(rank, r, s, first):
            if base is not None:
                cur.excess += (s.iter_s - base) * iters
                cur.base_open = cur.base_open or base
            r.dirty.append((s.iter_s, iters))
        else:
            if cur is not None and not cur.closed:
                if cur.base_open and abs(s.iter_s / cur.base_open - 1.0) > 0.25:
                    # The iteration time itself moved meanwhile: the difference is not the
                    # checkpoint's doing, so this checkpoint's slowdown is not measured (and it
                    # does not count as a checkpoint whose slowdown is known: ``settled``).
                    cur.unmeasured = True
                self._close_excess(rank, cur)
            r.clean.append((s.iter_s, iters))
            r.invalidate()
        if cur is not None:
            per_iter = base if base is not None else s.iter_s
            before = min(max(cur.step - first + 1, 0), iters)  # iterations before the checkpoint
            cur.seg_base += per_iter * (iters - before)
            prev = self._st.recs.get(cur.prev_step) if cur.prev_step is not None else None
            if before and prev is not None and rank in prev.base_s:
                prev.base_s[rank] += per_iter * before
                self._st.rev += 1

    def _overlapped(self, rank: int, r: "_Rank", s: Sample, first: int) -> bool:
        if s.overlapped is not None:
            return bool(s.overlapped)
        cur = r.cur
        rec = self._st.recs.get(cur.step)
        copy = rec.copy.get(rank) if rec else None
        persist = rec.persist.get(rank) if rec else None
        if persist is None and self._st.persist_seen:
            return True  # persists are reported in this run and this one has not finished yet
        base = r.base()
        if base is None:
            base = self._t_iter()[0]
        bg = (copy or 0.0) + (persist or 0.0)
        steps = math.ceil(bg / base) if base else 1
        return first <= cur.step + max(steps, 1)

    def _close_excess(self, rank: int, cur: "_RankCkpt") -> None:
        cur.closed = True
        rec = self._st.recs.get(cur.step)
        if rec is not None and not cur.unmeasured:
            rec.excess[rank] = cur.excess  # unclipped: noise averages out over checkpoints
            self._st.rev += 1

    def _close_segment(self, rank: int, cur: "_RankCkpt") -> None:
        if not cur.closed:
            self._close_excess(rank, cur)
        rec = self._st.recs.get(cur.step)
        if rec is not None and cur.seg_base > 0:
            rec.base_s[rank] = cur.seg_base
            self._st.rev += 1

    # -- estimates ------------------------------------------------------------------------------
    def _t_iter(self) -> tuple[float | None, int | None, bool]:
        """Seconds per iteration of the slowest active rank, that rank, and whether every active
        rank's value comes from iterations with nothing in flight."""
        st = self._st
        horizon = 64 * max(len(st.ranks), 1) + 256  # ranks silent this long are gone
        best, who, clean = None, None, True
        for rank, r in st.ranks.items():
            if st.clock - r.seen > horizon:
                continue
            b = r.base()
            if b is None:
                b = r.dirty_base()
                if b is None:
                    continue
                clean = False
            if best is None or b > best:
                best, who = b, rank
        return best, who, clean and best is not None

    def _estimate(self) -> "_Est | None":
        st = self._st
        t, slowest, t_clean = self._t_iter()
        prior = st.prior
        if t is None and prior:
            t = prior["iter_s"]
        summary = self._summary()
        if t is None or (summary is None and not prior):
            return None
        est = _Est(t=t, slowest=slowest, t_clean=t_clean)
        if summary is None:
            est.cost, est.stall, est.bg, est.source = prior["cost_s"], prior["stall_s"], prior["background_s"], \
                "saved profile"
            est.nbytes = prior.get("bytes")
            return est
        for name, value in summary.items():
            if name != "wait_gaps":
                setattr(est, name, value)
        if est.bg is None:
            est.bg = prior["background_s"] if prior else 0.0
        # A guard wait means the previous copy+persist outlasted the interval: it took at least the
        # time between the two checkpoints plus the wait. This catches a slower disk at once, even
        # before (or without) persist times.
        lower = [gap * t + w for gap, w in summary["wait_gaps"]]
        if lower and max(lower) > est.bg:
            est.bg = max(lower)
            est.bg_from_waits = True
        return est

    def _summary(self) -> dict | None:
        """The per-checkpoint part of the estimates; recomputed only when a record changed."""
        st = self._st
        if st.summary_rev == st.rev:
            return st.summary
        st.summary_rev = st.rev
        recs = list(st.recs.values())
        tuned = [rec for rec in recs if not rec.profiling]
        if sum(1 for rec in tuned if rec.stall and rec.excess) >= 2:
            recs = tuned  # checkpoints at the short profiling interval may have waited or overlapped
        stalls = [(rec.step, v) for rec in recs if (v := rec.own_stall_max()) is not None]
        if not stalls:
            st.summary = None
            return None
        settled = [(rec.step, rec.cost()) for rec in recs if rec.excess and rec.stall]
        costs = settled if settled else [(rec.step, rec.cost()) for rec in recs if rec.stall]
        bgs = [(rec.step, v) for rec in recs if (v := rec.bg(st.persist_seen)) is not None]
        drift: dict[str, Any] = {}
        out: dict[str, Any] = {"drift": drift, "n": len(costs)}
        out["cost"], out["cost_se"], out["n_level"] = self._level("cost_s", costs, drift)
        out["stall"] = self._level("stall_s", stalls, {})[0]
        out["bg"], out["bg_se"], n_bg = self._level("background_s", bgs, drift) if bgs else (None, 0.0, 0)
        out["n_level"] = min(out["n_level"], n_bg) if bgs else out["n_level"]
        copies = [v for rec in recs if (v := _max_or_none(rec.copy)) is not None]
        persists = [v for rec in recs if (v := _max_or_none(rec.persist)) is not None]
        out["copy"] = _median(copies[-self.window:]) if copies else None
        out["persist"] = _median(persists[-self.window:]) if persists else None
        out["has_persist"] = bool(persists)
        out["settled"] = bool(settled)
        with_bytes = [rec for rec in recs if rec.nbytes]
        out["nbytes"] = sum(with_bytes[-1].nbytes.values()) if with_bytes else None
        rates = [sum(rec.nbytes.values()) / max(rec.persist.values()) for rec in recs
                 if rec.nbytes and rec.persist and max(rec.persist.values()) > 0]
        out["rate"] = _median(rates[-self.window:]) if rates else None
        out["wait_gaps"] = [(rec.step - prev.step, max(rec.wait.values())) for prev, rec in zip(recs[-4:], recs[-3:])
                            if rec.wait and max(rec.wait.values()) > 0 and rec.step > prev.step]
        measured = [(rec.cost(), sum(rec.base_s.values()) / len(rec.base_s)) for rec in recs[-self.window:]
                    if rec.base_s and rec.stall]
        den = sum(b for _, b in measured)
        out["measured_pct"] = 100.0 * sum(c for c, _ in measured) / den if den > 0 else None
        st.summary = out
        return out

    def _level(self, name: str, series: list[tuple[int, float]], drift: dict) -> tuple[float, float, int]:
        """Robust mean of the last ``window`` values since the last change of level, its standard
        error (from their median absolute deviation), and how many values it is based on.

        A change of level is two newest values both off the median of the values before them (at
        least two) by more than ``drift_ratio`` — or by more than four times that series' own
        typical scatter (median absolute deviation of the logarithms), so noisy storage does not
        look like drift — in the same direction.
        """
        series = series[-2 * self.window - 2:]  # a change of level older than this is in the mean anyway
        vals = [max(v, 1e-9) for _, v in series]
        logs = [math.log(v) for v in vals]
        start, base_thr = 0, math.log(self.drift_ratio)
        for i in range(3, len(vals)):
            ref = logs[max(start, i - 1 - self.window):i - 1]
            if len(ref) < 2:
                continue
            m = _median(ref)
            mad = _median([abs(x - m) for x in ref])
            thr = max(base_thr, 4.0 * mad)
            a, b = logs[i - 1] - m, logs[i] - m
            if (a > thr and b > thr) or (a < -thr and b < -thr):
                drift[name] = {"at_step": series[i - 1][0], "from": math.exp(m), "to": _median(vals[i - 1:i + 1])}
                start = i - 1
        recent = vals[max(start, len(vals) - self.window):]
        mean = _robust_mean(recent)
        if len(recent) < 2:
            return mean, 0.0, len(recent)
        # The scatter as the median absolute deviation (x 1.4826: the standard deviation for normal
        # noise): one value that straddles a change of level (a persist that was half slow) would
        # otherwise inflate the standard error for ``window`` checkpoints, and with it the
        # pessimistic estimate that shortening waits for, long after the mean has dropped it.
        m = _median(recent)
        sd = 1.4826 * _median([abs(v - m) for v in recent])
        return mean, sd / math.sqrt(len(recent)), len(recent)

    # -- the decision ---------------------------------------------------------------------------
    def _target(self, est: "_Est", cost: float | None = None,
                bg: float | None = None) -> tuple[int, str, list[tuple[str, str]]]:
        t = est.t
        cost = max(est.cost if cost is None else cost, 0.0)
        bg = max(est.bg if bg is None else bg, 0.0)
        budget = self.budget_pct / 100.0
        aim = budget * (1.0 - self.headroom)
        k_budget = max(_ceil(cost / (aim * t)), 1)
        k_flight = max(_ceil(bg * (1.0 + self.headroom) / t), 1)
        k_flight_strict = max(_ceil(bg / t), 1)
        conflicts: list[tuple[str, str]] = []
        k, binding = (k_budget, "budget") if k_budget >= k_flight else (k_flight, "persist_in_flight")
        if self.max_lost_s is not None:
            k_lost = math.floor(self.max_lost_s * (1.0 - self.headroom) / t + 1e-9)
            if k_lost < 1 and t <= self.max_lost_s:
                k_lost = 1
            if k > k_lost:
                if k_lost < 1:
                    k, binding = max(k_flight_strict, 1), "max_lost_s" if k_flight_strict <= 1 else "persist_in_flight"
                    conflicts.append(("lost_below_iter", (
                        f"max_lost_s={self.max_lost_s:g} is shorter than one iteration ({t:.3g} s): checkpointing "
                        f"every {k} step(s); raise max_lost_s above the iteration time")))
                elif k_flight_strict > k_lost:
                    k, binding = k_flight_strict, "persist_in_flight"
                    conflicts.append(("lost_vs_persist", (
                        f"max_lost_s={self.max_lost_s:g} cannot be met: one checkpoint takes {bg:.3g} s to copy and "
                        f"persist ({k_flight_strict} steps of {t:.3g} s) and checkpoints cannot be taken faster than "
                        "storage persists them; the persist time wins (use faster storage or raise max_lost_s)")))
                else:
                    k, binding = k_lost, "max_lost_s"
                    if cost / (k * t) > budget:
                        conflicts.append(("lost_vs_budget", (
                            f"max_lost_s={self.max_lost_s:g} wins over budget_pct={self.budget_pct:g}: checkpointing "
                            f"every {k} steps costs about {100 * cost / (k * t):.3g}% of training time; raise "
                            "max_lost_s or budget_pct to stay within the budget")))
        if k < self.min_interval:
            if binding == "max_lost_s":
                conflicts.append(("min_vs_lost", (
                    f"min_interval={self.min_interval} wins over max_lost_s={self.max_lost_s:g}: up to "
                    f"{self.min_interval * t:.3g} s of work can be lost")))
            k, binding = self.min_interval, "min_interval"
        if k > self.max_interval:
            k, binding = self.max_interval, "max_interval"
            if k < k_flight_strict:
                conflicts.append(("max_vs_persist", (
                    f"max_interval={self.max_interval} wins over the persist time: one checkpoint takes "
                    f"{bg:.3g} s ({k_flight_strict} steps) to persist, so training will wait for storage")))
            elif cost / (k * t) > budget:
                conflicts.append(("max_vs_budget", (
                    f"max_interval={self.max_interval} wins over budget_pct={self.budget_pct:g}: overhead about "
                    f"{100 * cost / (k * t):.3g}%")))
        return k, binding, conflicts

    def _decide(self, current: int) -> tuple[int | None, dict]:
        st = self._st
        est = self._estimate()
        if est is None:
            return None, {"phase": "profiling", "interval": current, "target": None, "binding": "profiling",
                          "reason": f"profiling: waiting for the first checkpoint (step {self.initial_interval()}) "
                                    "and iteration times", "budget_pct": self.budget_pct}
        k, binding, conflicts = self._target(est)
        budget = self.budget_pct / 100.0
        t = est.t
        info = self._info(est, k, binding, conflicts, current)
        ready = est.source == "measured" and (est.has_persist or est.n >= 2)
        # Tuned once the iteration time is clean and some checkpoint's slowdown is measured (its
        # overlap is over) — or after three checkpoints (a persist may overlap every iteration).
        if ready and ((est.t_clean and est.settled) or est.n >= 3):
            phase = "tuned"
        elif st.prior:
            phase = "restored"
        else:
            phase = "provisional" if ready else "profiling"
        info["phase"] = phase
        if phase == "profiling":
            info["reason"] = "profiling: waiting for the persist time of the first checkpoint"
            return None, info
        if phase == "provisional":
            # Every iteration timed so far overlapped a checkpoint: decide once now, and again as
            # soon as iterations with nothing in flight have been timed (one interval later).
            if st.decided:
                info["reason"] = f"keeping {current}: waiting for iterations timed with nothing in flight"
                return None, info
            st.decided = True
            if not est.settled:
                # How much the copy and persist slow the iterations that overlap them is not known
                # yet. Until it is, count them as lost training time (what they cost when every
                # core trains): the first interval then errs wide, not short (a few checkpoints
                # that each cost a whole persist); the measured cost replaces it as soon as the
                # first checkpoint's overlap is over.
                k, binding, conflicts = self._target(est, max(est.cost, est.bg), est.bg)
                info = dict(self._info(est, k, binding, conflicts, current), phase=phase)
            info["reason"] = f"first checkpoint profiled: interval {k} ({binding} binds), provisional"
            return (k if k != current else None), info

        for key, msg in conflicts:
            if key not in st.warned:
                st.warned.add(key)
                warnings.warn(f"cf_ray Adaptive policy: {msg}", PolicyWarning, stacklevel=3)

        if phase == "restored":
            if st.decided:
                info["reason"] = f"keeping {current} from the saved profile until new checkpoints are measured"
                return None, info
            st.decided = True
            info["reason"] = f"interval {k} from the saved profile ({binding} binds)"
            return (k if k != current else None), info
        if not st.measured_decided:
            st.measured_decided = st.decided = True
            why = "profiled" if not st.prior else self._prior_check(est)
            info["reason"] = f"{why}: interval {k} ({binding} binds)"
            if not why.startswith("saved profile confirmed"):
                return (k if k != current else None), info
            # A confirmed saved profile: keep the interval unless the rules below say otherwise.

        lost_s = self.max_lost_s
        if current < self.min_interval or current > self.max_interval:
            info["reason"] = f"interval {current} is outside [min_interval, max_interval]"
            return k, info
        if lost_s is not None and current * t > lost_s and k < current:
            info["reason"] = f"{current} steps of {t:.3g} s exceed max_lost_s={lost_s:g}: shortening to {k}"
            return k, info
        if k > current and current * t < est.bg - est.bg_se:
            info["reason"] = (f"persist in flight: {est.bg:.3g} s of copy+persist do not fit in {current} steps of "
                              f"{t:.3g} s: widening to {k}")
            return k, info
        over = max(est.cost - est.cost_se, 0.0) / (current * t)  # noise alone does not widen
        if k > current and over > budget:
            # A clear overrun widens at once; a marginal one must still be there at the next checkpoint.
            if over > budget * (1.0 + 2.0 * self.headroom) or (
                    st.widen_since is not None and st.ckpt_clock > st.widen_since):
                info["reason"] = (f"over budget: {100 * over:.3g}% > {self.budget_pct:g}% at "
                                  f"{current} steps: widening to {k}")
                return k, info
            if st.widen_since is None:
                st.widen_since = st.ckpt_clock
            info["reason"] = (f"keeping {current}: {100 * over:.3g}% is over the budget, confirming at the next "
                              "checkpoint")
            return None, info
        st.widen_since = None
        # Shorten only to what the rules give for pessimistic estimates (mean + 2 standard errors,
        # at least three checkpoints since the last drift), only when that is clearly shorter, and
        # only when it is still so at the next checkpoint.
        k_safe = self._target(est, est.cost + 2.0 * est.cost_se, est.bg + 2.0 * est.bg_se)[0]
        if k_safe <= math.floor(current * self.shrink_ratio) and est.n_level >= 3:
            if st.shrink_since is None:
                st.shrink_since = st.ckpt_clock
            elif st.ckpt_clock > st.shrink_since and st.ckpt_clock > st.changed_at:
                info["reason"] = (f"headroom: {k_safe} steps meet every rule (predicted overhead "
                                  f"{100 * est.cost / (k_safe * t):.3g}%): shortening from {current}")
                return k_safe, info
            info["reason"] = f"keeping {current}: shorter interval {k_safe} possible, confirming at the next checkpoint"
            return None, info
        st.shrink_since = None
        info["reason"] = f"keeping {current}: within every rule ({binding} sets the target {k})"
        return None, info

    def _prior_check(self, est: "_Est") -> str:
        p = self._st.prior
        changed = []
        for key, now in (("iter_s", est.t), ("cost_s", est.cost), ("background_s", est.bg)):
            was = p.get(key) or 0.0
            lo, hi = min(was, now), max(was, now)
            if hi > 0 and (lo <= 0 or hi / lo > self.drift_ratio) and hi > 1e-3:
                changed.append(f"{key} {was:.3g} -> {now:.3g}")
        if changed:
            return "conditions changed since the saved profile (" + ", ".join(changed) + ")"
        return "saved profile confirmed by new measurements"

    def _info(self, est: "_Est", k: int, binding: str, conflicts, current: int) -> dict:
        t = est.t
        cf = max(_ceil(((est.copy or 0.0) + (est.persist or 0.0)) / t), 1)
        return {
            "interval": current, "target": k, "binding": binding, "conflicts": [m for _, m in conflicts],
            "budget_pct": self.budget_pct,
            "predicted_overhead_pct": 100.0 * est.cost / (current * t) if current else None,
            "measured_overhead_pct": est.measured_pct,
            "lost_work_s": current * t if current else None, "max_lost_s": self.max_lost_s,
            "iter_s": t, "slowest_rank": est.slowest, "stall_s": est.stall,
            "slowdown_s": max(est.cost - est.stall, 0.0), "cost_s": est.cost, "copy_s": est.copy,
            "persist_s": est.persist, "background_s": est.bg, "bytes": est.nbytes,
            "persist_bytes_per_s": est.rate, "background_from_waits": est.bg_from_waits,
            "checkfreq_interval": cf, "source": est.source,
            "drift": dict(est.drift),
        }


# -- internal state of Adaptive ------------------------------------------------------------------

class _State:
    """Everything :meth:`Adaptive.plan` learns; lives on the controller only."""

    def __init__(self):
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
        self.decided = False
        self.measured_decided = False
        self.changed_at = -1
        self.shrink_since: int | None = None
        self.widen_since: int | None = None
        self.current: int | None = None
        self.prior: dict | None = None
        self.warned: set[str] = set()
        self.info: dict = {}
        self.last_change: dict | None = None


class _Rank:
    __slots__ = ("clean", "dirty", "_base", "last_step", "warm_until", "seen", "cur")

    def __init__(self, warmup: int):
        self.clean: deque = deque(maxlen=16)  # (iter_s, iters) with nothing in flight
        self.dirty: deque = deque(maxlen=16)  # (iter_s, iters) overlapping a copy/persist
        self._base: float | None = None
        self.last_step = 0
        self.warm_until = warmup
        self.seen = 0
        self.cur: _RankCkpt | None = None

    def base(self) -> float | None:
        if self._base is None and self.clean:
            self._base = _weighted_median(self.clean)
        return self._base

    def dirty_base(self) -> float | None:
        return _weighted_median(self.dirty) if self.dirty else None

    def invalidate(self) -> None:
        self._base = None


class _RankCkpt:
    """One rank's view of its latest checkpoint while the iterations after it come in."""

    __slots__ = ("step", "approx", "prev_step", "excess", "base_open", "closed", "unmeasured", "seg_base", "values")

    def __init__(self, step: int, approx: bool, prev_step: int | None):
        self.step = step
        self.approx = approx
        self.prev_step = prev_step  # the rank's previous checkpoint, whose segment ends here
        self.excess = 0.0  # sum of (iter_s - baseline) over overlapped iterations
        self.base_open: float | None = None  # the baseline they were compared with
        self.closed = False  # the overlap is over; excess is final
        self.unmeasured = False  # the iteration time moved during the overlap: excess is not known
        self.seg_base = 0.0  # baseline time of the iterations until the next checkpoint
        self.values: tuple = ()


class _Ckpt:
    """All ranks' measurements of one checkpoint."""

    __slots__ = ("step", "seq", "profiling", "stall", "wait", "copy", "persist", "nbytes", "excess", "base_s")

    def __init__(self, step: int, seq: int, profiling: bool):
        self.step, self.seq = step, seq
        self.profiling = profiling  # taken at the profiling interval, before the first decision
        self.stall: dict[int, float] = {}
        self.wait: dict[int, float] = {}
        self.copy: dict[int, float] = {}
        self.persist: dict[int, float] = {}
        self.nbytes: dict[int, int] = {}
        self.excess: dict[int, float] = {}
        self.base_s: dict[int, float] = {}

    def put(self, rank, stall, wait, copy, persist, nbytes) -> bool:
        """Record the newest known values of ``rank``; whether anything changed."""
        changed = False
        for d, v in ((self.stall, stall), (self.wait, wait), (self.copy, copy), (self.persist, persist)):
            if v is not None and d.get(rank) != v:
                d[rank] = v
                changed = True
        if isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool) and nbytes >= 0 \
                and self.nbytes.get(rank) != int(nbytes):
            self.nbytes[rank] = int(nbytes)
            changed = True
        return changed

    def drop_rank(self, rank: int) -> None:
        for d in (self.stall, self.wait, self.copy, self.persist, self.nbytes, self.excess, self.base_s):
            d.pop(rank, None)

    def empty(self) -> bool:
        return not (self.stall or self.copy or self.persist or self.nbytes)

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
        total = max(v + self.excess.get(r, 0.0) for r, v in self.stall.items())
        waits = max(self.wait.values()) if self.wait else 0.0
        return max(total - waits, self.own_stall_max(), 0.0)

    def bg(self, persist_expected: bool) -> float | None:
        """Copy + persist seconds of the slowest rank (``None`` while a persist is expected but
        not yet known)."""
        if self.persist:
            return max(self.copy.get(r, 0.0) + p for r, p in self.persist.items())
        if persist_expected:
            return None
        return max(self.copy.values()) if self.copy else None

    def overhead_pct(self) -> float | None:
        cost = self.cost()
        if cost is None or not self.base_s:
            return None
        base = sum(self.base_s.values()) / len(self.base_s)
        return 100.0 * cost / base if base > 0 else None


@dataclass(kw_only=True, slots=True)
class _Est:
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
    copy: float | None = None
    """Copy seconds (median of recent checkpoints)."""
    persist: float | None = None
    """Persist seconds (median of recent checkpoints)."""
    nbytes: int | None = None
    """Bytes of the newest checkpoint, all ranks."""
    rate: float | None = None
    """Persist throughput, bytes per second."""
    measured_pct: float | None = None
    """Overhead measured over recent checkpoints."""
    n: int = 0
    """Checkpoints measured (recent history)."""
    n_level: int = 0
    """Checkpoints the current cost and persist estimates are based on (since the last drift)."""
    has_persist: bool = False
    """Whether any persist time was measured."""
    source: str = "measured"
    """``measured`` or ``saved profile``."""
    drift: dict = field(default_factory=dict)
    """Changes of level detected in the per-checkpoint series."""


def _new_samples(st: _State, samples: Sequence[Sample]) -> Sequence[Sample]:
    """The samples after the newest one already taken in (found by identity, scanning back)."""
    n = len(samples)
    if n == 0:
        return ()
    last = st.last_obj
    start = 0
    if last is not None:
        for i in range(n - 1, -1, -1):
            if samples[i] is last:
                start = i + 1
                break
    st.last_obj = samples[n - 1]
    if start == 0:
        return samples
    return [samples[i] for i in range(start, n)]


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
