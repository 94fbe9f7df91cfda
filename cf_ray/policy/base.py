"""When to checkpoint: small, pure policy objects (no Ray inside), in the manner of Orbax's
save-decision policies.

Every policy subclasses :class:`FrequencyPolicy`, which declares each method the engine calls and
its default, so the engine calls them plainly and a policy overrides only what it does. A policy
has two sides:

* the ranks' side, ``should_save(step, ctx)`` (required) after each optimizer step, and
  ``initial_interval()`` and ``step_interval()``: pure functions of the configuration and of
  ``ctx``, because every rank evaluates them on its own copy and all ranks must agree;
* the controller's side, ``plan(samples, current)`` and the optional methods (failures, state,
  reports): only the controller's copy learns, so it alone may hold state.

This module holds the base class and the fixed policies; :class:`~cf_ray.policy.adaptive.Adaptive`
is in :mod:`cf_ray.policy.adaptive`.
"""

from __future__ import annotations

import logging
import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cf_ray.errors import ConfigError

if TYPE_CHECKING:
    from cf_ray.policy._hazard import RunEvent


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
    step_s: float | None = None
    """Mean seconds per iteration the training thread spent in the checkpointer's own per-step work
    (agreeing with the other ranks, deciding, reporting) outside ``iter_s`` and ``stall_s``: time the
    job pays for checkpointing at every step, counted in its overhead. ``None``: not measured."""
    overlapped: bool | None = None
    """Whether a snapshot copy or persist of this rank was in flight during these iterations;
    ``None`` lets the policy infer it from ``ckpt_step`` and the copy and persist times."""
    copy_cpu_s: float | None = None
    """CPU seconds the background work of checkpoint ``ckpt_step`` took on this rank outside the
    training thread (its copy, checksums, index and hand-off). ``None``: not measured."""
    persist_cpu_s: float | None = None
    """CPU seconds the holder's write of this rank's sections of checkpoint ``ckpt_step`` took (the
    controller sends it with ``persist_s``). ``None``: not measured."""
    idle_cpus: float | None = None
    """Cores of this rank's machine left idle over these iterations, per rank of the job on its
    node. Below one, a rank's background thread finds no idle core, so the CPU above is taken from
    training and :class:`~cf_ray.policy.Adaptive` counts it as cost. ``None``: not known."""
    queue_s: float | None = None
    """Mean seconds per iteration the training thread waited for a CPU (runnable, not running) over
    these iterations. What it waits more in the iterations a checkpoint's copy or persist overlaps
    than in those with nothing in flight is training time that checkpoint's background work took,
    and :class:`~cf_ray.policy.Adaptive` counts it as cost. ``None``: not measured."""


class FrequencyPolicy(ABC):
    """Decides checkpoint steps: subclass it and override :meth:`should_save`; every other method
    the engine calls is declared here with its default, which is what a policy that does not
    override it gets.

    Contract: the ranks call :meth:`should_save`, :meth:`initial_interval` and
    :meth:`step_interval` on their own copies, so those depend on the configuration and their
    arguments only (all ranks must decide alike). The controller calls the rest on its copy, under
    its lock, never from two threads at once; a method that raises there is logged and its default
    used (a policy bug must not stop checkpointing). The engine accepts only subclasses
    (``CheckpointConfig`` refuses another object and says to subclass), so the defaults below are
    the one place that says what a method left out means.
    """

    __slots__ = ()

    # -- the ranks' side: pure --------------------------------------------------------------------
    @abstractmethod
    def should_save(self, step: int, ctx: SaveContext) -> bool:
        """Whether ``step`` is a checkpoint step, from ``ctx`` (what every rank agreed on) and the
        configuration only."""

    def initial_interval(self) -> int | None:
        """The interval the ranks use before the controller publishes one (``SaveContext.interval``
        until then). Configuration only, never loaded state. Default ``None``: not controller-driven."""
        return None

    def step_interval(self) -> int | None:
        """Steps between scheduled checkpoints when the policy fixes them itself on the ranks
        (``FixedInterval.every``), for what counts in intervals (peer replicas, the profile's
        ``interval``) while the controller publishes none. Default ``None``: no fixed step interval."""
        return None

    # -- the controller's side --------------------------------------------------------------------
    def plan(self, samples: Sequence[Sample], current: int | None) -> int | None:  # noqa: ARG002 (the default ignores it)
        """The interval to publish next from the timing samples of every rank, or ``None`` to keep
        ``current``. Default ``None``: the policy does not learn an interval."""
        return None

    def persist_cadence(self) -> int:
        """One scheduled checkpoint in how many is persisted (written to storage and committed);
        the others are held in memory only. Asked after every :meth:`plan`; a change becomes a new
        schedule version. Default 1: every checkpoint is persisted."""
        return 1

    def observe(self, event: RunEvent) -> None:  # noqa: ARG002 (the default ignores it)
        """One of the run's failure events (start, restart, resumption, preemption notice, the
        clock), before the next :meth:`plan`. Default: ignored."""
        return None

    def hazard(self) -> dict | None:
        """The failure-rate estimate as a JSON-able dict (:meth:`Adaptive.hazard` has the keys), or
        ``None`` to let the controller report its own. Default ``None``."""
        return None

    def adopt_failures(self, other: FrequencyPolicy) -> None:  # noqa: ARG002 (the default ignores it)
        """Continue ``other``'s failure history: called on a fresh copy after the number of workers
        changed (costs are measured again; the failure rate is the run's). Default: nothing kept."""
        return None

    def explain(self) -> dict | None:
        """Why the interval is what it is, as a JSON-able dict (``Checkpointer.explain()``, the
        ``why`` of each ``interval`` event), or ``None``. Default ``None``."""
        return None

    def checkpoint_stats(self, step: int) -> dict | None:  # noqa: ARG002 (the default ignores it)
        """What the checkpoint at ``step`` cost, for the profile table, or ``None``. Default ``None``."""
        return None

    def state_dict(self) -> dict | None:
        """The learnt state to keep with the run (JSON-able), or ``None`` for none. Default ``None``."""
        return None

    def load_state_dict(self, state: dict) -> None:  # noqa: ARG002 (the default ignores it)
        """Start from what :meth:`state_dict` saved, on a freshly built policy, before the first
        :meth:`plan`; raise on a state it cannot read (it is then ignored). Default: ignored."""
        return None


MAX_PERSIST_EVERY = 16
"""At most this many scheduled snapshots per persisted one, whenever a policy chooses it from
measurement (:class:`FixedInterval`'s default, :class:`~cf_ray.policy.Adaptive`)."""

#: Persist times :class:`FixedInterval` keeps (the newest checkpoints').
_PERSISTS_KEPT = 8

PERSIST_SHARE = 0.1
"""The share of the run's time :class:`FixedInterval`'s measured cadence lets the holder spend writing
snapshots to storage."""


@dataclass(slots=True)
class FixedInterval(FrequencyPolicy):
    """Checkpoint every ``every`` optimizer steps (CheckFreq's MANUAL mode): ``FixedInterval(10)`` or
    ``FixedInterval(every=10)``."""

    every: int
    """Steps between checkpoints; a checkpoint is taken when ``step % every == 0``."""
    persist_every: int | None = None
    """Persist one checkpoint in this many (written to storage and committed); the others are
    held in memory only: restored after a failure that leaves the node's holder alive (a worker
    crash, a SIGKILL, Ray Train restarting the group), never written. Storage's recovery point is
    then ``every * persist_every`` steps. ``1``: every checkpoint is persisted. Manual, preemption,
    epoch-end and milestone checkpoints, the first of each attempt and ``finish()``'s are always
    persisted.

    ``None`` (the default): chosen from measurement by the controller (:func:`measured_cadence`).
    Every checkpoint is persisted until two persists and the iteration time are measured; then one
    in ``N``, the fewest that keep the holder's writing within :data:`PERSIST_SHARE` (10 %) of the
    run's time: ``N = ceil(persist_s / (0.1 * every * iter_s))``, at most :data:`MAX_PERSIST_EVERY`.
    Storage's recovery point is then about ten persists' time; with checkpoints as far apart as ten
    persists, every one is persisted."""
    measured: int = field(default=1, init=False, repr=False, compare=False)
    """The cadence :meth:`plan` chose from measurement (``persist_every=None``)."""
    persists: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The newest checkpoints' persist times (step -> the slowest rank's seconds) :meth:`plan` has
    seen: kept here, as they leave the controller's sample window when checkpoints are rare."""

    def __post_init__(self):
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ConfigError(
                f"FixedInterval.every={self.every!r} must be an int >= 1; "
                "use EpochEnd() to checkpoint only at epoch boundaries"
            )
        n = self.persist_every
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(
                f"FixedInterval.persist_every={n!r} must be None or an int >= 1 (None: chosen from measurement; "
                "1: persist every checkpoint; N: persist one in N and hold the others in memory only)"
            )

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return not ctx.epoch_end and step > 0 and step % self.every == 0

    def plan(self, samples: Sequence[Sample], current: int | None) -> int | None:  # noqa: ARG002 (protocol signature)
        """The interval stays ``every`` (``None``); with ``persist_every=None`` the persist cadence
        follows the samples (:func:`measured_cadence`)."""
        if self.persist_every is None:
            for x in samples:
                if x.persist_s is not None and x.ckpt_step is not None:
                    self.persists[x.ckpt_step] = max(x.persist_s, self.persists.get(x.ckpt_step, 0.0))
            for step in sorted(self.persists)[:-_PERSISTS_KEPT]:
                del self.persists[step]
            iters = [x.iter_s for x in samples if x.iters > 0 and x.iter_s > 0][-16:]
            self.measured = measured_cadence(list(self.persists.values()), iters, self.every, self.measured)
        return None

    def step_interval(self) -> int:
        return self.every

    def persist_cadence(self) -> int:
        """``persist_every``, or with ``None`` the cadence :meth:`plan` measured."""
        return self.measured if self.persist_every is None else self.persist_every

    def explain(self) -> dict:
        """Why the interval is what it is (see :meth:`Adaptive.explain`)."""
        if self.persist_every is None:
            persist = {
                "persist_every": self.measured,
                "binding": "measured",
                "reason": f"one snapshot in {self.measured} persisted: the fewest that keep writing within "
                f"{PERSIST_SHARE:.0%} of the run's time",
            }
        else:
            persist = {"persist_every": self.persist_every, "binding": "manual"}
        return {
            "policy": "FixedInterval",
            "interval": self.every,
            "binding": "manual",
            "reason": f"a fixed interval of {self.every} steps was configured",
            "persist": persist,
        }


def measured_cadence(persist_s: Sequence[float], iter_s: Sequence[float], every: int, current: int) -> int:
    """One scheduled snapshot in how many to persist so that writing takes at most
    :data:`PERSIST_SHARE` of the run's time: ``ceil(persist_s / (PERSIST_SHARE * every * iter_s))``
    in ``[1, MAX_PERSIST_EVERY]``, from the medians of the newest checkpoints' persist times (the
    slowest rank's: its holder writes the sections in turn) and of the newest iteration times.
    ``current`` until two of each are measured. It rises only when the ratio clears ``current`` by
    a quarter and falls only when it is half a step below ``current - 1`` (no flapping: each change
    is a new schedule version the ranks agree on)."""
    if len(persist_s) < 2 or len(iter_s) < 2:
        return current
    ratio = statistics.median(persist_s) / (PERSIST_SHARE * every * statistics.median(iter_s))
    n = max(1, min(math.ceil(ratio), MAX_PERSIST_EVERY))
    if (n > current and ratio < current + 0.25) or (n < current and ratio > current - 1.5):
        return current
    return n


@dataclass(kw_only=True, slots=True)
class EpochEnd(FrequencyPolicy):
    """Checkpoint only at epoch boundaries (CheckFreq's baseline), every ``every`` epochs."""

    every: int = 1
    """Epochs between checkpoints; a checkpoint is taken when ``epoch % every == 0``."""

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"EpochEnd.every={self.every!r} must be an int >= 1")

    def should_save(self, step: int, ctx: SaveContext) -> bool:  # noqa: ARG002 (protocol signature)
        return ctx.epoch_end and ctx.epoch % self.every == 0

    def explain(self) -> dict:
        """Why the interval is what it is (see :meth:`Adaptive.explain`)."""
        return {
            "policy": "EpochEnd",
            "interval": None,
            "binding": "epoch",
            "reason": f"checkpoints at the end of every {self.every} epoch(s)",
        }


@dataclass(kw_only=True, slots=True)
class AnyOf(FrequencyPolicy):
    """Checkpoint when any of ``policies`` says so; an adaptive member's plan is used.

    The controller's methods go to every member (``observe``, ``adopt_failures``,
    ``load_state_dict``) or to the first that answers (``plan``, ``initial_interval``,
    ``step_interval``, ``hazard``, ``checkpoint_stats``); ``persist_cadence`` is the smallest of
    the members' (the most often any of them asks for storage).
    """

    policies: tuple = field(default_factory=tuple)
    """The member policies; the first one whose ``plan`` returns an interval drives the schedule."""

    def __post_init__(self):
        self.policies = tuple(self.policies)
        if not self.policies:
            raise ConfigError("AnyOf(policies=...) needs at least one policy")
        for p in self.policies:
            if not isinstance(p, FrequencyPolicy):
                raise ConfigError(f"AnyOf: {p!r} is not a FrequencyPolicy; {SUBCLASS_HINT}")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return any(p.should_save(step, ctx) for p in self.policies)

    def plan(self, samples: Sequence[Sample], current: int | None) -> int | None:
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

    def step_interval(self) -> int | None:
        return _first(p.step_interval() for p in self.policies)

    def persist_cadence(self) -> int:
        return min(persist_every_of(p) for p in self.policies)

    def explain(self) -> dict:
        """The members' explanations, in order (see :meth:`Adaptive.explain`)."""
        parts = [p.explain() or {"policy": type(p).__name__} for p in self.policies]
        driver = next((e for e in parts if e.get("interval") is not None and e.get("policy") == "Adaptive"), None)
        out: dict[str, Any] = dict(driver) if driver else {"interval": None}
        out.update(policy="AnyOf", members=parts)
        return out

    def observe(self, event: RunEvent) -> None:
        for p in self.policies:
            p.observe(event)

    def hazard(self) -> dict | None:
        return _first(p.hazard() for p in self.policies)

    def adopt_failures(self, other: FrequencyPolicy) -> None:
        if isinstance(other, AnyOf) and len(other.policies) == len(self.policies):
            for p, q in zip(self.policies, other.policies):
                p.adopt_failures(q)

    def checkpoint_stats(self, step: int) -> dict | None:
        return _first(p.checkpoint_stats(step) for p in self.policies)

    def state_dict(self) -> dict:
        """The members' state, by position (``None`` for members without state)."""
        return {"members": [p.state_dict() for p in self.policies]}

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` returned into a freshly built ``AnyOf`` of the same members."""
        members = state.get("members") if isinstance(state, dict) else None
        if not isinstance(members, list) or len(members) != len(self.policies):
            raise ConfigError(f"AnyOf.load_state_dict: expected {len(self.policies)} member states, got {members!r}")
        for p, s in zip(self.policies, members):
            if s is not None:
                p.load_state_dict(s)


SUBCLASS_HINT = (
    "subclass cf_ray.policy.FrequencyPolicy and override should_save (plan, initial_interval and the "
    "controller's optional methods have defaults there)"
)
"""What a refused policy object is told to change."""


def _first(answers: Iterable[Any]) -> Any:
    """The first answer that is not ``None`` (members are asked in order, lazily)."""
    return next((a for a in answers if a is not None), None)


def persist_every_of(policy: FrequencyPolicy) -> int:
    """``policy.persist_cadence()``, checked: 1 when it raises or answers something else than an
    int >= 1 (a policy bug must not keep checkpoints from storage; logged once per policy type)."""
    try:
        n = policy.persist_cadence()
    except Exception:  # noqa: BLE001
        _warn_once(policy, "failed", exc_info=True)
        return 1
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        return n
    _warn_once(policy, f"returned {n!r}, not an int >= 1")
    return 1


_WARNED: set[tuple[str, str]] = set()


def _warn_once(policy: Any, what: str, exc_info: bool = False) -> None:
    key = (type(policy).__name__, what.split(" ", 1)[0])
    if key not in _WARNED:
        _WARNED.add(key)
        logging.getLogger("cf_ray").warning(
            "cf_ray: %s.persist_cadence() %s; every checkpoint is persisted", key[0], what, exc_info=exc_info
        )
