"""How long a run's controller lives: its owner, the ranks that finished, and the reaper.

The controller records its :class:`~cf_ray._engine.protocol.cluster.Owner` — the driver's Ray job
and the Ray Train run (``fit()``) — and the reaper thread (:meth:`Lifetime.reaper`) ends the run's
actors (holders drained first) when the run is over without ``finish()`` (:meth:`Lifetime.run_over`):

* the driver's job is dead: at once;
* the ``fit()`` ended without ``finish()`` while the driver lives on (a notebook after Ctrl-C, a
  script that calls ``fit()`` again): after ``CheckpointConfig.release_after_fit_s`` unless a
  ``fit()`` of the same run attached meanwhile (:meth:`Lifetime.attach`).

A run whose ranks all called ``finish()`` ends after ``CF_RAY_CONTROLLER_LINGER_S`` instead
(:meth:`Lifetime.finish`). When a check cannot tell (GCS unreachable), nothing is ended on a guess.
One lock of its own; the cluster queries (:mod:`cf_ray._engine.protocol.cluster`) are made without it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.cluster import Owner, fit_over, owner_gone, run_name_of

logger = logging.getLogger("cf_ray")


class Lifetime:
    """The owner, the finished ranks, and when the run is over.

    Args:
        key: the run key (for logs).
        owner: the run this controller belongs to (``None``: unknown, no reaper).
        release_after_fit_s: ``CheckpointConfig.release_after_fit_s``.
        replaced_dead_run: this controller replaced one of a run whose driver was gone.
    """

    def __init__(self, key: str, owner: Owner | None, *, release_after_fit_s: float, replaced_dead_run: bool):
        self.key = key
        self.release_after_fit_s = release_after_fit_s
        self.replaced_dead_run = replaced_dead_run
        self._lock = threading.Lock()
        self._owner = owner
        self._train_handle = None
        """The ``TrainController`` of the owner's ``fit()`` (set by :meth:`attach`)."""
        self._fit_over_since: float | None = None
        """Monotonic time the reaper first saw the owner's ``fit()`` over (``None``: not over)."""
        self._finished: set[int] = set()
        self._world_size: int | None = None

    @property
    def owner(self) -> Owner | None:
        with self._lock:
            return self._owner

    def attach(self, owner: Owner, train_handle=None) -> None:
        """A ``fit()`` of this run's driver uses this controller (the first, or a later one: the
        notebook's re-run cell, the next segment of an elastic schedule): it is the run's ``fit()``
        from now on, and the reaper's clock for the previous one stops. ``train_handle``: that
        ``fit()``'s ``TrainController``, asked by the reaper whether the ``fit()`` is over."""
        with self._lock:
            if self._owner is not None and owner.train_run and owner.same_run(self._owner):
                if owner.train_run != self._owner.train_run:
                    self._owner = dataclasses.replace(self._owner, train_run=owner.train_run)
                if train_handle is not None:
                    self._train_handle = train_handle
                self._fit_over_since = None

    def info(self) -> dict:
        """``{"owner_job": str, "train_run": str | None, "replaced_dead_run": bool}``."""
        owner = self.owner
        return {
            "owner_job": owner.job_id if owner is not None else "",
            "train_run": owner.train_run if owner is not None else None,
            "replaced_dead_run": self.replaced_dead_run,
        }

    # -- the ranks --------------------------------------------------------------------------------------
    def new_attempt(self, world_size: int) -> None:
        """An attempt of ``world_size`` ranks starts: none of them has finished."""
        with self._lock:
            self._finished.clear()
            self._world_size = world_size

    def finish(self, rank: int, world_size: int) -> bool:
        """Rank ``rank`` called ``finish()``; returns whether every rank has."""
        with self._lock:
            self._finished.add(rank)
            return len(self._finished) >= world_size

    def all_finished(self) -> bool:
        with self._lock:
            return bool(self._finished) and len(self._finished) >= (self._world_size or 1)

    def linger_then(self, shutdown: Callable[[], None]) -> None:
        """After every rank finished: wait ``CF_RAY_CONTROLLER_LINGER_S`` (the driver may still read
        the controller), then shut down if no new attempt started meanwhile."""
        time.sleep(_env.get_float(_env.LINGER_S))
        if self.all_finished():
            shutdown()

    # -- the reaper ------------------------------------------------------------------------------------
    def reaper(self, stopping: threading.Event, shutdown: Callable[[], None]) -> None:
        """End the run's actors when the run is over without ``finish()`` (a thread's body)."""
        while not stopping.wait(max(0.1, _env.get_float(_env.REAPER_INTERVAL_S))):
            try:
                why = self.run_over()
                if why is None:
                    continue
                logger.warning(
                    "cf_ray: run %s is over (%s) and its ranks did not all call finish(): draining "
                    "the holders, saving the profile and ending the run's actors; storage is the truth",
                    run_name_of(self.key),
                    "its driver's Ray job ended"
                    if why == "job"
                    else f"its fit() ended and no fit() of the run came back within "
                    f"release_after_fit_s={self.release_after_fit_s:g} s",
                )
                shutdown()
                return
            except Exception:  # noqa: BLE001 - the reaper never dies
                logger.exception("cf_ray: the controller's reaper failed")

    def run_over(self, now: float | None = None) -> str | None:
        """Why the run is over (``"job"``: its driver's Ray job ended; ``"fit"``: its ``fit()`` ended
        without ``finish()`` at least ``release_after_fit_s`` ago and no later ``fit()`` attached), or
        ``None``. A run whose ranks all called ``finish()`` is left to the linger."""
        if owner_gone(self.owner) == "job":
            return "job"
        with self._lock:
            owner, handle = self._owner, self._train_handle
        if self.all_finished() or owner is None or not owner.train_run:
            return None
        if not fit_over(handle, owner.train_run):  # running, or cannot tell: never on a guess
            with self._lock:
                self._fit_over_since = None
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            if owner != self._owner:  # a new fit() attached meanwhile
                return None
            if self._fit_over_since is None:
                self._fit_over_since = now
                logger.info(
                    "cf_ray: the fit() of run %s ended without finish(); its actors and in-memory "
                    "snapshots wait %g s for the next fit() of the run",
                    run_name_of(self.key),
                    self.release_after_fit_s,
                )
            return "fit" if now - self._fit_over_since >= self.release_after_fit_s else None


__all__ = ["Lifetime"]
