"""The durability watchdog of one rank: notices when nothing has committed for much longer than
the schedule implies, or when the controller cannot be reached, from what this rank knows itself
(the checkpoints it took, the newest committed step in the controller's replies, its iteration
time), and turns that into *episodes*: one alarm when an episode starts, one all-clear when it ends.

The limit: ``durability_timeout_s`` when set, else ``durability_factor`` x (the interval in seconds
+ the observed persist time), at least ``durability_floor_s``. It is counted from the oldest
checkpoint taken since the newest commit this rank knows of (no checkpoint taken: nothing is
expected, nothing is lost), and judged on the newest *information*: a reply is as fresh as the
moment its request was sent, so a long pause of the training loop between two steps (an
evaluation) is never mistaken for a storage that stopped.

The controller cannot be reached when a poll has been in flight for longer than the limit, or when
:data:`UNREACHABLE_AFTER_FAILURES` polls in a row failed.

An episode ends when a commit newer than its start is seen (the step at which it started, or
later): storage works again. Its alarm is logged once, never per step.

No Ray and no torch here: the Checkpointer feeds it and acts on what it returns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Polls in a row that failed after which the controller counts as unreachable.
UNREACHABLE_AFTER_FAILURES = 3
#: Checkpoints taken since the newest commit that the watchdog remembers (besides the oldest).
_KEEP = 64


class LostReason(str, enum.Enum):
    """Why an episode started (the value goes into the ``durability_lost`` event)."""

    NO_COMMIT = "no_commit"
    """Checkpoints were taken but none committed within the limit."""
    CONTROLLER_UNREACHABLE = "controller_unreachable"
    """The controller did not answer (polls failed, or one never returned) within the limit."""


@dataclass(frozen=True, slots=True)
class DurabilitySettings:
    """The watchdog's tunables (from :class:`~cf_ray.CheckpointConfig`)."""

    timeout_s: float | None = None
    """A fixed limit in seconds; ``None``: automatic (factor x expected, at least the floor)."""
    factor: float = 3.0
    """The automatic limit's multiple of the expected time to a commit."""
    floor_s: float = 60.0
    """The automatic limit's minimum."""


@dataclass(frozen=True, slots=True)
class Knowledge:
    """What this rank knows at the end of a step (the watchdog's input)."""

    now: float
    """``time.monotonic()`` now."""
    step: int
    """This rank's step count."""
    committed_step: int
    """The newest committed step this rank knows of."""
    info_time: float | None
    """When the request of the newest reply this rank has read was sent (monotonic); ``None``: none yet."""
    in_flight_s: float = 0.0
    """Seconds the poll in flight has been waiting for its reply (0: none in flight)."""
    poll_failures: int = 0
    """Polls in a row that failed."""
    interval_steps: int | None = None
    """The adopted schedule's interval in steps (``None``: not a fixed interval)."""


@dataclass(frozen=True, slots=True)
class Episode:
    """A stretch of time during which this rank's checkpoints were not becoming durable."""

    reason: LostReason
    start_step: int
    """The step at which the alarm was raised; a commit of this step or a newer one ends it."""
    started_at: float
    """Monotonic time of the alarm."""
    committed_step: int
    """The newest committed step known at the alarm (0: none)."""
    since_step: int | None
    """The oldest checkpoint taken since that commit (``None``: none was taken)."""
    waited_s: float
    """Seconds without a commit (or without an answer from the controller) at the alarm."""
    limit_s: float
    """The limit that was passed."""
    expected_s: float
    """The expected time to a commit (interval + persist) the automatic limit came from."""
    taken_since: int
    """Checkpoints this rank took since the newest commit it knows of."""

    def describe(self) -> str:
        """One sentence: what happened (for logs and :class:`~cf_ray.errors.DurabilityLostError`)."""
        if self.reason is LostReason.CONTROLLER_UNREACHABLE:
            what = f"the controller has not answered for {self.waited_s:.0f} s"
        else:
            what = (
                f"no checkpoint has committed since step {self.committed_step} "
                f"({self.taken_since} taken since, the oldest at step {self.since_step}, "
                f"{self.waited_s:.0f} s ago)"
            )
        return f"{what}; the limit is {self.limit_s:.0f} s"


@dataclass(frozen=True, slots=True)
class Change:
    """What :meth:`DurabilityWatchdog.observe` reports: an episode started or ended."""

    started: bool
    """True: ``episode`` just started (alarm); False: it just ended (all clear)."""
    episode: Episode
    committed_step: int
    """The newest committed step known now."""
    lost_s: float = 0.0
    """For an end: seconds since the alarm."""


class DurabilityWatchdog:
    """One rank's view of whether its checkpoints become durable.

    Call order (training thread): :meth:`start_attempt` at restore; :meth:`taken` when a
    checkpoint starts; :meth:`observe` at the end of every step (after the controller poll).
    """

    def __init__(self, settings: DurabilitySettings):
        self.settings = settings
        self.episode: Episode | None = None
        """The episode in progress, ``None`` when durability is fine."""
        self.episodes = 0
        """Episodes started so far."""
        self._committed = 0
        # (step, monotonic time taken) of the checkpoints taken since the newest commit, oldest first;
        # during a long outage only the oldest and the newest _KEEP are kept (and counted in _taken_since).
        self._pending: list[tuple[int, float]] = []
        self._taken_since = 0
        self._persist_s: float | None = None  # EMA of taken -> seen committed
        self.slowest_persist_s: float | None = None
        """The longest time from a checkpoint taken to its commit seen, on this run (``None``: none seen)."""
        self._iter_s: float | None = None  # EMA of seconds per step
        self._gap_steps: float | None = None  # EMA of steps between two checkpoints taken
        self._last: tuple[int, float] | None = None  # (step, now) of the previous observe
        self._last_taken: int | None = None

    # -- inputs ------------------------------------------------------------------------------------
    def start_attempt(self, committed_step: int, now: float) -> None:
        """At restore: the newest step committed before this attempt; nothing is pending."""
        self._committed = max(committed_step, 0)
        self._pending.clear()
        self._taken_since = 0
        self._last = None
        self._last_taken = None
        del now  # the first observe() starts the clock

    def taken(self, step: int, now: float) -> None:
        """A checkpoint of ``step`` was started at ``now``."""
        if self._last_taken is not None and step > self._last_taken:
            self._gap_steps = _ema(self._gap_steps, float(step - self._last_taken))
        self._last_taken = step
        if step > self._committed and (not self._pending or self._pending[-1][0] < step):
            self._pending.append((step, now))
            self._taken_since += 1
            if len(self._pending) > _KEEP + 1:
                del self._pending[1:-_KEEP]

    # -- the judgement -----------------------------------------------------------------------------
    def limit_s(self, interval_steps: int | None = None) -> tuple[float, float]:
        """(the limit in seconds, the expected time to a commit it was derived from)."""
        expected = self.expected_s(interval_steps)
        if self.settings.timeout_s is not None:
            return float(self.settings.timeout_s), expected
        return max(self.settings.floor_s, self.settings.factor * expected), expected

    def finish_limit_s(self) -> float:
        """How long the end of a run waits for its checkpoints to commit, from what this run measured:
        ``factor`` x the slowest persist seen, at least ``floor_s``."""
        return max(self.settings.floor_s, self.settings.factor * (self.slowest_persist_s or self._persist_s or 0.0))

    def expected_s(self, interval_steps: int | None = None) -> float:
        """The interval in seconds (steps x seconds per step) plus the observed persist time."""
        steps = float(interval_steps) if interval_steps else (self._gap_steps or 0.0)
        return steps * (self._iter_s or 0.0) + (self._persist_s or 0.0)

    def observe(self, k: Knowledge) -> Change | None:
        """Update from the end of a step; returns the start or the end of an episode, else ``None``."""
        self._time_steps(k.step, k.now)
        if k.committed_step > self._committed:
            self._on_commit(k.committed_step, k.info_time if k.info_time is not None else k.now)
        if self.episode is not None:
            if self._committed >= self.episode.start_step:
                ended, self.episode = self.episode, None
                return Change(
                    started=False, episode=ended, committed_step=self._committed, lost_s=k.now - ended.started_at
                )
            return None
        limit, expected = self.limit_s(k.interval_steps)
        reason, waited = None, 0.0
        if k.poll_failures >= UNREACHABLE_AFTER_FAILURES or k.in_flight_s > limit:
            reason, waited = LostReason.CONTROLLER_UNREACHABLE, k.in_flight_s
        elif self._pending and k.info_time is not None and k.info_time - self._pending[0][1] > limit:
            reason, waited = LostReason.NO_COMMIT, k.now - self._pending[0][1]
        if reason is None:
            return None
        self.episode = Episode(
            reason=reason,
            start_step=k.step,
            started_at=k.now,
            committed_step=self._committed,
            since_step=self._pending[0][0] if self._pending else None,
            waited_s=waited,
            limit_s=limit,
            expected_s=expected,
            taken_since=self._taken_since,
        )
        self.episodes += 1
        return Change(started=True, episode=self.episode, committed_step=self._committed)

    @property
    def lost(self) -> bool:
        """Whether an episode is in progress."""
        return self.episode is not None

    @property
    def iter_s(self) -> float | None:
        """The smoothed seconds per step (``None`` before two steps)."""
        return self._iter_s

    # -- internals ---------------------------------------------------------------------------------
    def _time_steps(self, step: int, now: float) -> None:
        if self._last is not None and step > self._last[0]:
            self._iter_s = _ema(self._iter_s, (now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)

    def _on_commit(self, committed: int, seen_at: float) -> None:
        done = [(s, t) for s, t in self._pending if s <= committed]
        if done:
            newest_done = done[-1]
            if newest_done[0] == committed:  # its own commit: a persist time (with the poll delay)
                persist = max(seen_at - newest_done[1], 0.0)
                self._persist_s = _ema(self._persist_s, persist)
                self.slowest_persist_s = max(persist, self.slowest_persist_s or 0.0)
        self._pending = [(s, t) for s, t in self._pending if s > committed]
        self._taken_since = len(self._pending)
        self._committed = committed


def _ema(old: float | None, new: float, alpha: float = 0.2) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


__all__ = [
    "Change",
    "DurabilitySettings",
    "DurabilityWatchdog",
    "Episode",
    "Knowledge",
    "LostReason",
    "UNREACHABLE_AFTER_FAILURES",
]
