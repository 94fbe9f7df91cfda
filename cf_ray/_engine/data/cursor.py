"""The position machinery the data sources of :mod:`cf_ray.data` share: :class:`EpochCursor` (a
per-rank plan of each epoch and a position in it, with the epoch rules of :mod:`cf_ray.data.protocols`)
and :class:`SamplerHeldPosition` (for sources whose position lives in their sampler).

It lives in the engine, not in :mod:`cf_ray.data`, because a restore validates a data object's saved
state on a throw-away copy of it (``worker/restore/checks.py``) and must recognise these classes
without importing the public package."""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from cf_ray._engine.data.checks import (
    FORMAT_KEY,
    check_elastic_states,
    check_format,
    check_history,
    check_int,
    check_same,
    resolve_world,
)
from cf_ray.errors import ConfigError, ElasticResumeError


class EpochCursor:
    """Shared machinery of the sources whose epoch is a known list: a per-rank *plan* for each
    epoch and a position in it, with the epoch rules of :mod:`cf_ray.data.protocols`.

    The plan of an epoch is a pure function of the subclass's settings, the epoch, the world size
    and the *elastic history*: the world sizes and per-rank consumption at which this epoch was
    re-split by earlier elastic resumes. A state is therefore a handful of ints::

        {"format": ..., <settings>, "epoch": 3, "world_size": 2, "rank": 0, "consumed": 120,
         "epoch_len": 502, "history": [{"world_size": 3, "consumed": [40, 40, 39]}]}

    Subclasses set ``FORMAT`` and implement :meth:`_settings`, :meth:`_lists` and
    :meth:`_plan_len`.

    Attributes:
        rank: this worker's rank.
        world_size: number of workers.
        epoch: the current epoch (see :meth:`set_epoch`).
    """

    FORMAT: ClassVar[str] = ""

    def __init__(self, *, rank: int | None, world_size: int | None) -> None:
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.epoch = 0
        self._position = 0
        self._history: list[dict[str, Any]] = []
        # True from a load until the first pass: a pass over a finished epoch then yields nothing
        # (instead of repeating it), so an epoch-end checkpoint never replays its epoch.
        self._resumed = False
        # Set by a loader or an iterator that counts what the loop received, because the index
        # iterator itself is drained ahead by prefetching.
        self._consumer: str | None = None
        self._plan_key: Any = None
        self._plan_cache: Any = None

    # ----------------------------------------------------------------- subclass hooks

    def _settings(self) -> dict[str, Any]:
        """Settings saved in the state that must be equal when it is loaded."""
        raise NotImplementedError

    def _setting_hints(self) -> dict[str, str]:
        """Setting name -> what the user should change when it differs (for error messages)."""
        return {}

    def _lists(self, epoch: int, history: list[dict[str, Any]], world_size: int) -> list[Any]:
        """The plan of every rank for ``epoch`` on ``world_size`` ranks after ``history``."""
        raise NotImplementedError

    def _plan_len(self, plan: Any) -> int:
        """Number of items in a plan."""
        return len(plan)

    def _plan_changed(self) -> None:
        """Called after a load set a new plan."""

    def _on_epoch_changed(self) -> None:
        """Called after :meth:`set_epoch` moved to another epoch."""

    # ----------------------------------------------------------------- public API

    @property
    def consumed(self) -> int:
        """Items of the current epoch's plan that the loop has consumed on this rank."""
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that the next pass iterates.

        Calling it with the current epoch does nothing, so a position restored by
        :meth:`load_state_dict` is kept; another epoch starts at its beginning on the current
        world size.

        Args:
            epoch: the epoch number (an int >= 0).
        """
        check_int("epoch", epoch, minimum=0)
        if epoch == self.epoch:
            return
        if self._resumed and 0 < self._position < self._plan_len(self._plan()):
            # Abandoning a restored mid-epoch position may be deliberate, but it skips data.
            warnings.warn(
                f"{type(self).__name__}.set_epoch({epoch}) abandons the restored "
                f"position {self._position} of epoch {self.epoch}; the rest of epoch "
                f"{self.epoch} is skipped",
                stacklevel=2,
            )
        self.epoch = epoch
        self._position = 0
        self._history = []
        self._resumed = False
        self._on_epoch_changed()

    def state_dict(self) -> dict[str, Any]:
        """Return the position: settings, epoch, world size, rank, consumed count, history.

        Returns:
            A small JSON-able dict.
        """
        return {
            FORMAT_KEY: self.FORMAT,
            **self._settings(),
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "consumed": self._position,
            "epoch_len": self._plan_len(self._plan()),
            "history": copy.deepcopy(self._history),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` with the same world size.

        Args:
            state_dict: the state this rank saved.

        Raises:
            ConfigError: the state was saved with other settings (dataset length, seed, ...) or
                for another rank, or is malformed.
            ElasticResumeError: the state was saved with another world size; use
                :meth:`load_elastic_state` (cf_ray's ``Checkpointer`` does).
        """
        owner = type(self).__name__
        check_format(state_dict, self.FORMAT, owner)
        check_same(owner, state_dict, self._settings(), self._setting_hints())
        if state_dict.get("world_size") != self.world_size:
            raise ElasticResumeError(
                f"{owner}: the state was saved by a run with world_size="
                f"{state_dict.get('world_size')} but this one has world_size={self.world_size}; "
                "call load_elastic_state() with the states of every old rank (cf_ray's "
                "Checkpointer does this on restore)"
            )
        if state_dict.get("rank") != self.rank:
            raise ConfigError(
                f"{owner}: the state belongs to rank {state_dict.get('rank')} but this "
                f"is rank {self.rank}; load each rank's own state"
            )
        epoch, history, consumed = self._parse_position(state_dict)
        plan = self._lists(epoch, history, self.world_size)[self.rank]
        self._check_consumed(state_dict, consumed, self._plan_len(plan))
        self._set_position(epoch, history, consumed)

    def load_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Resume on ``world_size`` workers from the states of every old rank.

        The items of the current epoch that no old rank had consumed are split over the new
        ranks, so the epoch still sees every item exactly once; later epochs follow the new world
        size. Old ranks may have consumed different amounts.

        Args:
            states: the state of every old rank, index = old rank.
            rank: this worker's new rank.
            world_size: the new number of workers.

        Raises:
            ConfigError: settings differ from the saved ones, or ``rank``/``world_size`` differ
                from this object's.
            ElasticResumeError: the states are not one consistent checkpoint of every old rank.
        """
        owner = type(self).__name__
        if (rank, world_size) != (self.rank, self.world_size):
            raise ConfigError(
                f"{owner} was built for rank {self.rank} of {self.world_size} but "
                f"load_elastic_state() was called for rank {rank} of {world_size}; "
                "build it with the new rank= and world_size="
            )
        settings = self._settings()
        old_world = check_elastic_states(owner, states, self.FORMAT, [*settings, "epoch", "history"])
        check_same(owner, states[0], settings, self._setting_hints())
        if old_world == world_size:
            self.load_state_dict(states[rank])
            return
        epoch, history, _ = self._parse_position(states[0])
        consumed = [self._parse_position(s)[2] for s in states]
        old_lists = self._lists(epoch, history, old_world)
        for s, c, plan in zip(states, consumed, old_lists):
            self._check_consumed(s, c, self._plan_len(plan))
        if not history and not any(consumed):
            new_history = []  # nothing consumed yet: this epoch simply runs on the new world size
        else:
            new_history = [*history, {"world_size": old_world, "consumed": consumed}]
        self._set_position(epoch, new_history, 0)

    # ----------------------------------------------------------------- consumers (internal)

    def _attach_consumer(self, name: str) -> None:
        """Let ``name`` (a loader or iterator) count consumption instead of this object."""
        if self._consumer is not None and self._consumer != name:
            raise ConfigError(
                f"{type(self).__name__} is already driven by {self._consumer}; "
                f"build one per loader (got a second one: {name})"
            )
        self._consumer = name

    def _begin_pass(self) -> int:
        """Start a pass over the current epoch; return the plan position it starts at."""
        if self._position >= self._plan_len(self._plan()) and not self._resumed:
            self._position = 0  # a new pass over a finished epoch repeats it, as torch does
        self._resumed = False
        return self._position

    def _advance(self, n: int) -> None:
        """Record that the loop received ``n`` more items of the plan."""
        total = self._plan_len(self._plan())
        if self._position + n > total:
            raise RuntimeError(
                f"{type(self).__name__}: consumed {self._position}+{n} items, more than the {total} of this epoch"
            )
        self._position += n

    def _finish_pass(self) -> None:
        """Record that the loop reached the end of the epoch (dropped tails included)."""
        self._position = self._plan_len(self._plan())

    # ----------------------------------------------------------------- plan

    def _plan(self) -> Any:
        key = (self.epoch, self.world_size, json.dumps(self._history))
        if key != self._plan_key:
            self._plan_cache = self._lists(self.epoch, self._history, self.world_size)[self.rank]
            self._plan_key = key
        return self._plan_cache

    def _parse_position(self, state: Mapping[str, Any]) -> tuple[int, list[dict[str, Any]], int]:
        owner = type(self).__name__
        try:
            epoch = check_int("epoch", state["epoch"], minimum=0)
            consumed = check_int("consumed", state["consumed"], minimum=0)
            history = check_history(state["history"])
        except (KeyError, TypeError, ConfigError) as e:
            raise ConfigError(f"{owner}: malformed state ({e}); pass a dict saved by {owner}.state_dict()") from None
        for i, seg in enumerate(history):
            w_next = history[i + 1]["world_size"] if i + 1 < len(history) else state.get("world_size")
            if seg["world_size"] == w_next:
                raise ConfigError(f"{owner}: malformed state: history entry {i} does not change the world size")
        return epoch, history, consumed

    def _check_consumed(self, state: Mapping[str, Any], consumed: int, plan_len: int) -> None:
        if state.get("epoch_len") != plan_len or consumed > plan_len:
            raise ConfigError(
                f"{type(self).__name__}: the state of rank {state.get('rank')} says "
                f"{consumed}/{state.get('epoch_len')} items of epoch {state.get('epoch')} but this "
                f"object computes {plan_len} for that epoch; the state does not match these "
                "settings (was it saved by another version or for other data?)"
            )

    def _set_position(self, epoch: int, history: list[dict[str, Any]], consumed: int) -> None:
        self.epoch = epoch
        self._history = history
        self._position = consumed
        self._resumed = True
        self._plan_changed()


class SamplerHeldPosition:
    """Mixin for sources whose position lives in ``self.sampler`` (a ``cf_ray.data.ResumableSampler``,
    an :class:`EpochCursor`):
    the ``Stateful``/``ElasticStateful`` methods forward to it, so registering the source or its
    sampler with the Checkpointer saves the same state."""

    sampler: EpochCursor
    """The sampler that holds the position; the class using the mixin sets it."""

    def set_epoch(self, epoch: int) -> None:
        """Forward to the sampler's ``set_epoch``."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: what the loop has consumed so far."""
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Forward to the sampler's ``load_state_dict``."""
        self.sampler.load_state_dict(state_dict)

    def load_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Forward to the sampler's ``load_elastic_state``."""
        self.sampler.load_elastic_state(states, rank, world_size)
