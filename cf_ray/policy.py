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
    """Mean seconds per iteration since the previous sample, checkpoint stalls excluded."""
    iters: int = 0
    """Number of iterations the mean covers (0: no iteration information in this sample)."""
    stall_s: float | None = None
    """Training-thread stall of checkpoint ``ckpt_step`` (guard wait + synchronous part)."""
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

    **What it measures** (from the :class:`Sample` stream of every rank, the slowest rank governs):

    * ``t`` — time per iteration: per rank the weighted median of its recent samples taken while
      no copy or persist was in flight, then the maximum over ranks;
    * ``C`` — cost of one checkpoint in training time: per rank, its stall plus the *slowdown* of
      the iterations that overlapped the checkpoint's copy and persist (sum of ``iter_s - t_rank``
      over them; this also catches waiting in a collective for a slower rank's stall), then the
      maximum over ranks;
    * ``B`` — background time of one checkpoint: ``copy_s + persist_s``, maximum over ranks.

    Each per-checkpoint series is summarised by the median of the last ``window`` checkpoints since
    the last *drift*: when the two newest values of ``C`` or ``B`` both differ from the median of
    the ones before by more than ``drift_ratio`` in the same direction, the older values are
    dropped, so a change of level (interference, a slower disk, a larger state) is followed after
    two checkpoints instead of ``window``. The iteration time follows drift continuously.

    **The interval** is the shortest ``k`` that meets, in this order of precedence:

    1. ``min_interval <= k <= max_interval`` (always);
    2. one persist in flight: ``k * t >= B * (1 + headroom)`` — never below CheckFreq's
       ``ceil((t_full - t_stall) / t)``;
    3. ``k * t <= max_lost_s * (1 - headroom)`` when a bound on lost work is set;
    4. the budget: ``C / (k * t) <= budget_pct * (1 - headroom)``.

    When a rule must give way to a stronger one, :meth:`explain` says so in ``conflicts`` and a
    :class:`PolicyWarning` is issued once per kind of conflict.

    **Hysteresis.** Once tuned, the interval is *widened* as soon as the current one breaks a
    limit itself (predicted overhead above ``budget_pct``, ``k * t`` below ``B``); it is
    *shortened* when it exceeds ``max_lost_s`` (at once) or when the target has stayed at or below
    ``shrink_ratio * current`` across a new checkpoint (so noise does not make it oscillate). The
    gap between the limit (``budget_pct``) and the aim (``budget_pct * (1 - headroom)``) is the
    dead band.

    **Profiling** is the first checkpoint, at ``first_checkpoint_step``: as soon as its stall and
    persist time are known (or two checkpoints have been seen without a persist time) the interval
    is tuned. A profile kept with the run (:meth:`state_dict`) lets a restarted job start from the
    previous interval at once: :meth:`plan` returns it on its first call, and it is re-tuned as
    soon as new measurements disagree by more than ``drift_ratio``.

    **Optional methods for the controller:** :meth:`explain` (a JSON-able dict of why the interval
    is what it is; after every :meth:`plan`), :meth:`checkpoint_stats` (measured cost and overhead
    of one checkpoint, for the profile table), :meth:`state_dict` (save with the run's profile) and
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
    window: int = 10
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
            current: the interval in force (``None``: :meth:`initial_interval`).

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
            info["decision"] = decision
            return decision
        return None

    def explain(self) -> dict:
        """Why the interval is what it is, as of the last :meth:`plan` (JSON-able).

        Keys: ``phase`` (``profiling``/``tuned``/``restored``), ``interval`` (in force),
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

        Returns a dict with ``stall_s`` (max over ranks), ``slowdown_s`` (extra iteration time while
        its copy/persist ran), ``cost_s`` (max over ranks of stall + slowdown), ``copy_s``,
        ``persist_s``, ``background_s``, ``bytes`` (sum over ranks) and ``overhead_pct`` (cost over
        the baseline iteration time until the next checkpoint; ``None`` until that is known).
        """
        rec = self._st.recs.get(step)
        if rec is None:
            return None
        cost = rec.cost()
        stall = rec.stall_max()
        return {"stall_s": stall, "slowdown_s": None if cost is None or stall is None else max(cost - stall, 0.0),
                "cost_s": cost, "copy_s": _max_or_none(rec.copy), "persist_s": _max_or_none(rec.persist),
                "background_s": rec.bg(), "bytes": sum(rec.nbytes.values()) if rec.nbytes else None,
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
        st = self._st
        st.clock += 1
        r = st.ranks.get(s.rank)
        if r is None:
            r = st.ranks[s.rank] = _Rank(self.warmup_steps)
        r.seen = st.clock
        iters = s.iters if isinstance(s.iters, int) and s.iters > 0 else 0
        if iters and s.step < r.last_step:
            self._rollback(s.rank, r, s.step - iters)
        if any(v is not None for v in (s.stall_s, s.copy_s, s.persist_s, s.nbytes)) or s.ckpt_step is not None:
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

    def _ingest_ckpt(self, rank: int, r: "_Rank", s: Sample, current: int) -> None:
        st = self._st
        c = s.ckpt_step
        approx = False
        cur = r.cur
        if c is None:  # the engine did not say which checkpoint: guess
            values = (s.stall_s, s.copy_s, s.nbytes)
            persist_only = all(v is None for v in values)
            if cur is not None and (persist_only or (cur.approx and (
                    values == cur.values or s.step - cur.step < max(2, current // 2)))):
                c = cur.step
            else:
                c, approx = max(s.step - max(s.iters, 1), 0), True
        if cur is None or c > cur.step or (approx and c != cur.step):
            if cur is not None:
                self._close_segment(rank, cur)
            cur = r.cur = _RankCkpt(c, approx)
        rec = st.recs.get(c)
        if rec is None:
            if c < cur.step:
                return  # late news of a checkpoint already forgotten
            st.ckpt_clock += 1
            rec = st.recs[c] = _Ckpt(c, st.ckpt_clock)
            while len(st.recs) > max(4 * self.window, 16):
                del st.recs[next(iter(st.recs))]
        rec.put(rank, _nonneg(s.stall_s), _nonneg(s.copy_s), _nonneg(s.persist_s), s.nbytes)
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
            r.dirty.append((s.iter_s, iters))
        else:
            if cur is not None and not cur.closed:
                self._close_excess(rank, cur)
            r.clean.append((s.iter_s, iters))
            r.invalidate()
        if cur is not None:
            cur.seg_base += (base if base is not None else s.iter_s) * iters

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
        if rec is not None:
            rec.set_excess(rank, cur.excess)  # unclipped: noise averages out over checkpoints

    def _close_segment(self, rank: int, cur: "_RankCkpt") -> None:
        if not cur.closed:
            self._close_excess(rank, cur)
        rec = self._st.recs.get(cur.step)
        if rec is not None and cur.seg_base > 0:
            rec.base_s[rank] = cur.seg_base

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
        recs = list(st.recs.values())
        stalls = [(rec.step, v) for rec in recs if (v := rec.stall_max()) is not None]
        settled = [(rec.step, rec.cost()) for rec in recs if rec.excess and rec.stall]
        costs = settled if settled else [(rec.step, rec.cost()) for rec in recs if rec.stall]
        bgs = [(rec.step, v) for rec in recs if (v := rec.bg()) is not None]
        prior = st.prior
        if t is None and prior:
            t = prior["iter_s"]
        if t is None or (not stalls and not prior):
            return None
        est = _Est(t=t, slowest=slowest, t_clean=t_clean)
        drift: dict[str, Any] = {}
        if costs:
            est.cost, est.cost_se = self._level("cost_s", costs, drift)
            est.stall = self._level("stall_s", stalls, {})[0]
        else:
            est.cost, est.stall, est.source = prior["cost_s"], prior["stall_s"], "saved profile"
        if bgs:
            est.bg, est.bg_se = self._level("background_s", bgs, drift)
        else:
            est.bg = prior["background_s"] if prior else 0.0
        copies = [v for rec in recs if (v := _max_or_none(rec.copy)) is not None]
        persists = [v for rec in recs if (v := _max_or_none(rec.persist)) is not None]
        est.copy = _median(copies[-self.window:]) if copies else None
        est.persist = _median(persists[-self.window:]) if persists else None
        with_bytes = [rec for rec in recs if rec.nbytes]
        est.nbytes = sum(with_bytes[-1].nbytes.values()) if with_bytes else (prior or {}).get("bytes")
        rates = [sum(rec.nbytes.values()) / max(rec.persist.values()) for rec in recs
                 if rec.nbytes and rec.persist and max(rec.persist.values()) > 0]
        est.rate = _median(rates[-self.window:]) if rates else None
        measured = [(rec.cost(), sum(rec.base_s.values()) / len(rec.base_s)) for rec in recs[-self.window:]
                    if rec.base_s and rec.stall]
        if measured:
            den = sum(b for _, b in measured)
            est.measured_pct = 100.0 * sum(c for c, _ in measured) / den if den > 0 else None
        est.n = len(costs)
        est.has_persist = bool(persists)
        est.drift = drift
        return est

    def _level(self, name: str, series: list[tuple[int, float]], drift: dict) -> tuple[float, float]:
        """Robust mean of the last ``window`` values since the last change of level, and its
        standard error.

        A change of level is two newest values both off the median of the values before them (at
        least two) by more than ``drift_ratio`` — or by more than four times that series' own
        typical scatter (median absolute deviation of the logarithms), so noisy storage does not
        look like drift — in the same direction.
        """
        vals = [max(v, 1e-9) for _, v in series]
        logs = [math.log(v) for v in vals]
        start, base_thr = 0, math.log(self.drift_ratio)
        for i in range(3, len(vals)):
            ref = logs[start:i - 1]
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
            return mean, 0.0
        sd = math.sqrt(sum((v - mean) ** 2 for v in recent) / (len(recent) - 1))
        return mean, sd / math.sqrt(len(recent))

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
            if k > k_lost:
                if k_flight_strict * t > self.max_lost_s:
                    k, binding = max(k_flight_strict, k_lost, 1), "persist_in_flight"
                    conflicts.append(("lost_vs_persist", (
                        f"max_lost_s={self.max_lost_s:g} cannot be met: one checkpoint takes {bg:.3g} s to copy and "
                        f"persist ({k_flight_strict} steps of {t:.3g} s) and checkpoints cannot be taken faster than "
                        "storage persists them; the persist time wins (use faster storage or raise max_lost_s)")))
                elif k_lost < 1:
                    k, binding = 1, "max_lost_s"
                    conflicts.append(("lost_below_iter", (
                        f"max_lost_s={self.max_lost_s:g} is shorter than one iteration ({t:.3g} s): "
                        "checkpointing every step")))
                else:
                    k, binding = max(k_lost, k_flight_strict), "max_lost_s"
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
        measured_ready = est.source == "measured" and est.t_clean and (est.has_persist or est.n >= 2)
        if measured_ready:
            phase = "tuned"
        else:
            phase = "restored" if st.prior else "profiling"
        info["phase"] = phase
        if phase == "profiling":
            info["reason"] = "profiling: first stall measured, waiting for its persist time"
            return None, info

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
        # Shorten only to what the rules give for pessimistic estimates (mean + 2 standard errors),
        # and only when that is clearly shorter, twice in a row at different checkpoints.
        k_safe = self._target(est, est.cost + 2.0 * est.cost_se, est.bg + 2.0 * est.bg_se)[0]
        if k_safe <= math.floor(current * self.shrink_ratio):
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
            "persist_bytes_per_s": est.rate, "checkfreq_interval": cf, "source": est.source,
            "drift": est.drift,
        }


# -- internal state of Adaptive ------------------------------------------------------------------

class _State:
    """Everything :meth:`Adaptive.plan` learns; lives on the controller only."""

    def __init__(self):
        self.last_obj: Sample | None = None  # the newest sample taken in (identity, see _new_samples)
        self.ranks: dict[int, _Rank] = {}
        self.recs: dict[int, _Ckpt] = {}  # by checkpoint step, in arrival order, bounded
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

    __slots__ = ("step", "approx", "excess", "closed", "seg_base", "values")

    def __init__(self, step: int, approx: bool):
        self.step = step
        self.approx = approx
        self.excess = 0.0  # sum of (iter_s - baseline) over overlapped iterations
        self.closed = False  # the overlap is over; excess is final
        self.seg_base = 0.0  # baseline time of the iterations until the next checkpoint
        self.values: tuple = ()


class _Ckpt:
    """All ranks' measurements of one checkpoint."""

    __slots__ = ("step", "seq", "stall", "copy", "persist", "nbytes", "excess", "base_s")

    def __init__(self, step: int, seq: int):
        self.step, self.seq = step, seq
        self.stall: dict[int, float] = {}
        self.copy: dict[int, float] = {}
        self.persist: dict[int, float] = {}
        self.nbytes: dict[int, int] = {}
        self.excess: dict[int, float] = {}
        self.base_s: dict[int, float] = {}

    def put(self, rank, stall, copy, persist, nbytes) -> None:
        if stall is not None:
            self.stall[rank] = stall
        if copy is not None:
            self.copy[rank] = copy
        if persist is not None:
            self.persist[rank] = persist
        if isinstance(nbytes, (int, float)) and not isinstance(nbytes, bool) and nbytes >= 0:
            self.nbytes[rank] = int(nbytes)

    def set_excess(self, rank: int, excess: float) -> None:
        self.excess[rank] = excess

    def drop_rank(self, rank: int) -> None:
        for d in (self.stall, self.copy, self.persist, self.nbytes, self.excess, self.base_s):
            d.pop(rank, None)

    def empty(self) -> bool:
        return not (self.stall or self.copy or self.persist or self.nbytes)

    def stall_max(self) -> float | None:
        return max(self.stall.values()) if self.stall else None

    def cost(self) -> float | None:
        if not self.stall:
            return None
        return max(max(v + self.excess.get(r, 0.0) for r, v in self.stall.items()), 0.0)

    def bg(self) -> float | None:
        if self.persist:
            return max(self.copy.get(r, 0.0) + p for r, p in self.persist.items())
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
    """Checkpoints the cost estimate is based on."""
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
