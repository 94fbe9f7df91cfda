"""The controller's schedule: the policy, its samples and the numbered versions of the interval.

The ranks adopt schedule versions together (see ``worker/control.py``): a version, once
published, never changes; a new interval is a new version. A controller that starts again while
workers run (Ray restarted it, or a worker recreated it) numbers its versions from a time-based
base (``version_base``), above anything its predecessor published, so that no two controllers ever
publish the same number with different intervals; and a poll from a rank that has received a
version at or above this controller's next one makes it publish its interval above that version
(:meth:`ScheduleBook.continue_above`), so the ranks adopt the new controller's schedule. Only the
newest :data:`MAX_VERSIONS` versions are kept (ranks adopt the newest they all have). The policy's learnt state is saved
next to the run (``policy_state.json``) with the profile, so a controller that restarts does not
have to profile the interval again from scratch.

The policy also learns the run's failures: the profile book, which sees the restores, the resumed
iterations and the preemption notices, passes them to the schedule's :class:`FailureFeed`, which
turns them into the policy's :class:`~cf_ray.policy.RunEvent` objects (the book imports nothing of
the driver: it sees the schedule through its ``ScheduleView`` protocol).

Not thread-safe on its own: the controller calls it under its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time
from typing import Any

from cf_ray._engine.observe.goodput import Restart
from cf_ray._engine.protocol.events import FailureRateEvent, IntervalEvent, NoticeEvent, ReprofileEvent, RestoreEvent
from cf_ray._engine.protocol.messages import CheckpointKind, Schedule, SnapshotMeta
from cf_ray._engine.storage.base import Storage
from cf_ray.policy import FrequencyPolicy, RunEvent, RunEventKind, Sample
from cf_ray.policy._hazard import HazardModel
from cf_ray.policy.base import persist_every_of

logger = logging.getLogger("cf_ray")

POLICY_STATE = "policy_state.json"
"""Where the policy's state is saved, relative to the run's storage."""

#: Schedule versions kept (the newest); older ones are never needed again.
MAX_VERSIONS = 64


class ScheduleBook:
    """The policy, the samples it plans from, and the published schedule versions.

    Args:
        policy: the user's frequency policy (a copy of it lives here; the workers have theirs).
        storage: the run's storage, for the saved policy state.
        version_base: the number of the first version (0 for a run's first controller).
    """

    def __init__(self, policy: FrequencyPolicy, storage: Storage, *, version_base: int = 0):
        self.policy = policy
        """The policy in force (a fresh copy after a resize)."""
        self.storage = storage
        self.samples: collections.deque[Sample] = collections.deque(maxlen=256)
        """The newest timing samples, the policy's input."""
        self._hazard = HazardModel()
        """The run's failure rate as the controller reports it when the policy keeps none
        (``FixedInterval``, ``EpochEnd``): the same rule, without a prior."""
        self.failures = FailureFeed(self)
        """The run's failures, as the profile book sees them, passed on to :meth:`observe`."""
        self._base = int(version_base)
        self._schedules: list[Schedule] = [
            Schedule(
                schedule_version=self._base,
                interval=self.policy.initial_interval(),
                persist_every=persist_every_of(self.policy),
            )
        ]
        self.load_state()

    # -- versions ---------------------------------------------------------------------------------
    @property
    def current_interval(self) -> int | None:
        """The interval of the newest version."""
        return self._schedules[-1].interval

    @property
    def interval_in_force(self) -> int | None:
        """The interval checkpoints are taken at: the newest version's, or the fixed ``every`` of a
        policy that publishes none (``FixedInterval`` decides on the ranks); ``None`` for
        ``EpochEnd``. What the profile's ``interval`` column says."""
        current = self.current_interval
        return self.policy.step_interval() if current is None else current

    def all(self) -> tuple[Schedule, ...]:
        return tuple(self._schedules)

    def since(self, adopted_version: int) -> tuple[Schedule, ...]:
        """The versions newer than ``adopted_version`` (what a rank has not seen yet)."""
        return tuple(s for s in self._schedules if s.schedule_version > adopted_version)

    def as_dicts(self) -> list[dict]:
        """The versions as ``{"version", "interval"}`` dicts (the controller's summary)."""
        return [
            {"version": s.schedule_version, "interval": s.interval, "persist_every": s.persist_every}
            for s in self._schedules
        ]

    @property
    def next_version(self) -> int:
        """The number the next published version gets."""
        return self._schedules[-1].schedule_version + 1

    @property
    def current_persist_every(self) -> int:
        """The persist cadence of the newest version (one scheduled snapshot in this many is written)."""
        return self._schedules[-1].persist_every

    def _publish(self, interval: int | None, version: int | None = None, persist_every: int | None = None) -> None:
        self._schedules.append(
            Schedule(
                schedule_version=self.next_version if version is None else version,
                interval=interval,
                persist_every=self.current_persist_every if persist_every is None else int(persist_every),
            )
        )
        del self._schedules[:-MAX_VERSIONS]

    def continue_above(self, adopted_version: int) -> IntervalEvent | None:
        """A rank has received ``adopted_version``, which this controller never published (it
        started again after the one that did): publish the current interval above it. Returns the
        ``interval`` event to record, or ``None`` when nothing was published."""
        if adopted_version < self.next_version:
            return None
        current = self.current_interval
        self._publish(current, version=int(adopted_version) + 1)
        return IntervalEvent(
            interval=current,
            previous=None,
            time=time.time(),
            why="published again above the version the workers had from an earlier controller",
        )

    # -- planning -----------------------------------------------------------------------------------
    def add_sample(self, sample: Sample) -> None:
        self.samples.append(sample)

    def observe(self, event: RunEvent) -> None:
        """Pass one of the run's failure events to the policy (a report that never fails the caller)."""
        self._hazard.observe(event)
        try:
            self.policy.observe(event)
        except Exception:  # noqa: BLE001 - a policy bug must not stop checkpointing
            logger.exception("cf_ray: policy.observe failed")

    def hazard(self) -> dict:
        """The failure-rate estimate of the policy, else (``None``, or it failed) the controller's
        own (:class:`~cf_ray.policy._hazard.HazardModel` without a prior)."""
        try:
            own = self.policy.hazard()
        except Exception:  # noqa: BLE001 - a report, never a failure
            own = None
        return own if own is not None else self._hazard.estimate().as_dict()

    def checkpoint_stats(self, step: int) -> dict | None:
        """What the policy measured of the checkpoint of ``step`` (its ``overhead_pct`` is the
        profile row's), or ``None``: what the profile book asks of the schedule."""
        return checkpoint_stats(self.policy, step)

    def replan(self) -> IntervalEvent | None:
        """Ask the policy; a new interval is published as a new version. Returns the ``interval``
        event to record, or ``None`` when nothing changed. The policy first learns the time (the run
        is up while its workers poll: its exposure to failures)."""
        current, persist = self.current_interval, self.current_persist_every
        self.observe(RunEvent(kind=RunEventKind.TICK, time_unix=time.time()))
        try:
            k = self.policy.plan(list(self.samples), current)
        except Exception:  # noqa: BLE001 - a policy bug must not stop checkpointing
            logger.exception("cf_ray: policy.plan failed; keeping interval %s", current)
            return None
        n = persist_every_of(self.policy)
        if (k is not None and k != current) or n != persist:
            interval = int(k) if k is not None else current
            self._publish(interval, persist_every=n)
            return IntervalEvent(
                interval=interval,
                previous=current,
                persist_every=n,
                previous_persist_every=persist,
                time=time.time(),
                why=explain(self.policy),
            )
        return None

    def reprofile_if_resized(self, previous_world_size: int | None, world_size: int) -> ReprofileEvent | None:
        """A new number of workers: measure again (fresh samples, a fresh copy of the policy).
        Returns the ``reprofile`` event to record, or ``None`` when the size did not change."""
        if previous_world_size is None or world_size == previous_world_size:
            return None
        self.samples.clear()
        try:
            old = self.policy
            self.policy = dataclasses.replace(self.policy) if dataclasses.is_dataclass(self.policy) else self.policy
            if self.policy is not old:
                self.policy.adopt_failures(old)  # the failure rate is the run's
        except Exception:  # noqa: BLE001 - keep the old one rather than fail a restore
            logger.warning("cf_ray: could not reset the policy for the new world size", exc_info=True)
        first = self.policy.initial_interval()
        n = persist_every_of(self.policy)  # Adaptive's: 1, every snapshot persisted until measured again
        if first != self.current_interval or self.current_persist_every != n:
            self._publish(first, persist_every=n)
        return ReprofileEvent(
            world_size=world_size, previous_world_size=previous_world_size, interval=first, time=time.time()
        )

    # -- the policy's state on storage ------------------------------------------------------------------
    def save_state(self) -> None:
        self.write_state(self.state_bytes())

    def state_bytes(self) -> bytes | None:
        """The policy's state as saved (under the controller's lock: the policy is not thread-safe),
        or ``None`` for a policy without state (its ``state_dict()`` is ``None``)."""
        try:
            state = self.policy.state_dict()
            return None if state is None else json.dumps(state).encode()
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not save the policy state: %s", e)
            return None

    def write_state(self, raw: bytes | None) -> None:
        """Write what :meth:`state_bytes` returned (storage I/O: never under the controller's lock)."""
        if raw is None:
            return
        try:
            self.storage.write_file(POLICY_STATE, [raw])
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not save the policy state: %s", e)

    def load_state(self) -> None:
        try:
            if not self.storage.exists(POLICY_STATE):
                return
            self.policy.load_state_dict(json.loads(bytes(self.storage.read_file(POLICY_STATE))))
            first = self.policy.initial_interval()
            self._schedules = [
                Schedule(schedule_version=self._base, interval=first, persist_every=persist_every_of(self.policy))
            ]
        except Exception as e:  # noqa: BLE001 - a stale or damaged profile means: profile again
            logger.warning("cf_ray: ignoring the saved policy state: %s", e)


def explain(policy: FrequencyPolicy) -> Any:
    """The policy's ``explain()``, or ``None`` (a report, never a failure)."""
    try:
        return policy.explain()
    except Exception:  # noqa: BLE001
        return None


def checkpoint_stats(policy: FrequencyPolicy, step: int) -> dict | None:
    """The policy's ``checkpoint_stats(step)``, or ``None`` (a report, never a failure)."""
    try:
        return policy.checkpoint_stats(step)
    except Exception:  # noqa: BLE001 - a report, never a failure
        return None


class FailureFeed:
    """The run's failures, as the profile book sees them, turned into :class:`~cf_ray.policy.RunEvent`
    objects for the policy (:meth:`ScheduleBook.observe`), which estimates the failure rate from them:
    the run's start, its restarts, their recoveries and the preemption notices. Records a
    ``failure_rate`` event (and its Ray metric) per failure counted. Never raises: a report.

    Args:
        schedule: where the policy lives.
    """

    def __init__(self, schedule: ScheduleBook):
        self.schedule = schedule
        self._generation: int | None = None
        self._failures = 0  # as of the last failure_rate event
        self._log: Any = None  # the profile book's EventLog and MetricsExport (attach)
        self._export: Any = None

    def attach(self, log: Any, export: Any) -> None:
        """Where the ``failure_rate`` events go (an ``EventLog``) and their metric (a ``MetricsExport``)."""
        self._log, self._export = log, export

    def restore(self, event: RestoreEvent, restart: Restart | None) -> None:
        """An attempt restored (the controller's ``restore`` event): the run's start, or a restart."""
        try:
            gen = int(event.generation or 0)
            now = float(event.time or time.time())
            self._generation = gen
            if restart is None:
                self.schedule.observe(RunEvent(kind=RunEventKind.START, time_unix=now, generation=gen))
                return
            failed = restart.failure_unix if restart.failure_unix is not None else now
            self.schedule.observe(
                RunEvent(
                    kind=RunEventKind.FAILURE,
                    time_unix=failed,
                    generation=gen,
                    source=restart.source,
                    lost_s=restart.lost_s,
                )
            )
            self._rate_event("restart", now)
        except Exception:  # noqa: BLE001 - a report, never a reason to fail
            logger.debug("cf_ray: failure-rate bookkeeping failed", exc_info=True)

    def resumed(self, restart: Restart) -> None:
        """The first iteration after a restart ended."""
        if restart.resumed_unix is None:
            return
        self.schedule.observe(
            RunEvent(
                kind=RunEventKind.RESUMED,
                time_unix=restart.resumed_unix,
                source=restart.source,
                recovery_s=restart.recovery_s,
            )
        )

    def notice(self, event: NoticeEvent) -> None:
        """The driver's preemption notice (the controller's ``notice`` event)."""
        self._notice(event.time or time.time(), event.generation, "driver")

    def staged(self, generation: int, meta: SnapshotMeta) -> None:
        """A section of a checkpoint was staged: a ``preempt`` one carries the notice it answers."""
        if meta.notice_unix is not None and CheckpointKind(meta.kind) is CheckpointKind.PREEMPT:
            self._notice(meta.notice_unix, generation, meta.notice_source)

    def _notice(self, time_unix: float, generation: int | None, source: str | None) -> None:
        try:
            gen = generation if generation is not None else self._generation
            self.schedule.observe(RunEvent(kind=RunEventKind.NOTICE, time_unix=time_unix, generation=gen, pool=source))
            self._rate_event("notice", time_unix)
        except Exception:  # noqa: BLE001 - a report, never a reason to fail
            logger.debug("cf_ray: failure-rate bookkeeping failed", exc_info=True)

    def _rate_event(self, why: str, now: float) -> None:
        """Record the failure-rate estimate, once per failure counted."""
        hazard = self.schedule.hazard()
        if hazard.get("failures", 0) == self._failures:
            return
        self._failures = hazard.get("failures", 0)
        if self._log is not None:
            self._log.add(FailureRateEvent.make(**{**hazard, "why": why, "time": now}))
        if self._export is not None:
            self._export.mtbf(hazard.get("mtbf_s"))
