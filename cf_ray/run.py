"""The driver-side handle of a run: its profile, checkpoints, summary and preemption notices.

A run is named as in Ray Train, by ``RunConfig(storage_path, name)``; :class:`Run` takes the same
pair (or the run directory, ``<storage_path>/<name>``, through :meth:`Run.from_path`). While the
run's controller actor is alive (the job is running, or finished less than
``CF_RAY_CONTROLLER_LINGER_S`` ago), a :class:`Run` asks it; afterwards it reads what the run left
on storage (the committed checkpoints and the saved profile table). User code never calls the
controller's actor methods itself: they are internal and change between versions.

Example::

    import cf_ray

    result = trainer.fit()                    # RunConfig(storage_path="/mnt/runs", name="my-run")
    run = cf_ray.Run("/mnt/runs", "my-run")
    run.profile()                             # one row per checkpoint (pandas)
    run.summary()["committed_steps"]
    [c.step for c in run.checkpoints()]

No torch and no pandas at import: they load in the methods that need them.
"""

from __future__ import annotations

import os
import posixpath
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray.errors import CfRayError, ConfigError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow.fs as pafs

    from cf_ray.load import CheckpointInfo

#: The folder of a run's cf_ray files under ``<storage_path>/<name>`` (as ``cf_ray.report.RUN_SUBDIR``).
_RUN_SUBDIR = "cf_ray"


class RunUnavailableError(CfRayError):
    """The run's live controller is needed but cannot be reached: the job is not running (or this
    process is not connected to its Ray cluster), or the controller did not answer in time."""


class Run:
    """A run of a ``TorchTrainer`` job that uses cf_ray, seen from the driver or any process.

    Reads come from the run's live controller when it is alive and from storage afterwards, so
    the same code works during the run, right after ``trainer.fit()`` and in a later session.
    Every call to the controller waits at most ``CF_RAY_ACTOR_TIMEOUT_S`` seconds.

    Args:
        storage_path: the run's storage, as given to ``RunConfig(storage_path=...)`` (or to
            ``CheckpointConfig(storage_path=...)`` when that was set): a local path, ``s3://...``,
            ``gs://...``, or a path on ``storage_filesystem``.
        name: the run's name (``RunConfig(name=...)``, or ``CheckpointConfig(run_name=...)``).
        storage_filesystem: the ``pyarrow.fs`` filesystem given with it, if any.

    Raises:
        ConfigError: ``name`` is not a plain directory name.

    Example::

        run = cf_ray.Run("/mnt/runs", "my-run")
        if run.alive:                             # the job is running: ask it to checkpoint now
            run.notify_preemption(deadline_s=30, detail="node drain")
        df = run.profile()
        df[["step", "kind", "interval", "stall_s", "persist_s", "committed"]]
    """

    def __init__(self, storage_path: str, name: str, *, storage_filesystem: pafs.FileSystem | None = None):
        name = str(name).strip("/")
        if not name or "/" in name or name in (".", ".."):
            raise ConfigError(
                f"run name {name!r} must be a plain directory name (RunConfig(name=...)); for a "
                "run directory <storage_path>/<name>, use cf_ray.Run.from_path(...)"
            )
        self.storage_path = str(storage_path)
        """Where the run's directory is (``RunConfig(storage_path=...)``)."""
        self.name = name
        """The run's name (``RunConfig(name=...)``)."""
        self.storage_filesystem = storage_filesystem
        """The ``pyarrow.fs`` filesystem of ``storage_path``, or ``None`` (inferred from it)."""

    @classmethod
    def from_path(cls, path: str, *, storage_filesystem: pafs.FileSystem | None = None) -> Run:
        """The run whose directory is ``path``: ``<storage_path>/<name>`` (or its ``cf_ray`` folder).

        Args:
            path: a local path (relative paths are taken from the current directory) or a URI
                (``s3://bucket/runs/my-run``); a path on ``storage_filesystem`` when one is given.
            storage_filesystem: the ``pyarrow.fs`` filesystem of ``path``, if any.

        Raises:
            ConfigError: ``path`` has no parent to be the storage path (e.g. ``s3://bucket``).

        Example::

            run = cf_ray.Run.from_path("cf_ray_runs/my-run")   # == cf_ray.Run(".../cf_ray_runs", "my-run")
        """
        raw = str(path)
        if storage_filesystem is None and "://" not in raw:
            raw = os.path.abspath(os.path.expanduser(raw))
        raw = raw.rstrip("/")
        if posixpath.basename(raw) == _RUN_SUBDIR:
            raw = posixpath.dirname(raw)
        storage_path, _, name = raw.rpartition("/")
        if not name or not storage_path or storage_path.endswith(":/"):
            raise ConfigError(
                f"{path!r} is not a run directory <storage_path>/<name>; give the directory that "
                "RunConfig(storage_path, name) created, or use cf_ray.Run(storage_path, name)"
            )
        return cls(storage_path, name, storage_filesystem=storage_filesystem)

    def __repr__(self) -> str:
        return f"Run(storage_path={self.storage_path!r}, name={self.name!r})"

    # -- the controller ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether the run's controller actor exists (in the Ray cluster this process is connected to).

        ``False`` when this process is not connected to Ray: ``ray.init(address="auto")`` first to
        reach a job of a running cluster from another process.
        """
        return self._controller() is not None

    def _controller(self):
        if not ray.is_initialized():
            return None
        from cf_ray._engine.driver.controller import get_controller, run_key
        from cf_ray._engine.storage.backends import open_storage

        # The key as the run's Checkpointer derives it: from the URI of the run's cf_ray folder and its name.
        storage = open_storage(self.storage_path, self.storage_filesystem).child(f"{self.name}/{_RUN_SUBDIR}")
        return get_controller(run_key(storage.uri(), self.name))

    def _ask(self, method: str, *, what: str) -> tuple[bool, Any]:
        """``(True, answer)`` from the live controller, or ``(False, None)`` when there is none.

        Raises:
            RunUnavailableError: the controller exists but did not answer within the timeout.
        """
        ctl = self._controller()
        if ctl is None:
            return False, None
        timeout_s = _env.get_float(_env.ACTOR_TIMEOUT_S)
        try:
            return True, ray.get(getattr(ctl, method).remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RunUnavailableError(
                f"the controller of {self!r} did not answer {what} within {timeout_s:.0f} s: it is busy or its node "
                f"is unreachable; retry, or raise {_env.ACTOR_TIMEOUT_S}"
            ) from None
        except ray.exceptions.RayActorError:
            return False, None  # it exited between the look-up and the call: the run is over

    def _need_live(self, method: str, *, what: str) -> Any:
        found, answer = self._ask(method, what=what)
        if not found:
            raise RunUnavailableError(
                f"no controller of {self!r} is alive"
                f"{'' if ray.is_initialized() else ' (this process is not connected to Ray)'}, and only it knows "
                f"{what}: ask during the run or within {_env.LINGER_S} seconds after it, from the driver or "
                "from another process of the cluster connected with ray.init(address='auto')"
            )
        return answer

    # -- reads ---------------------------------------------------------------------------------------
    def profile(self) -> pd.DataFrame:
        """The profile table: one row per checkpoint (columns: ``cf_ray.report.profile_frame``).

        From the live controller while the run is alive (every checkpoint so far), else the table
        the run saved to ``<storage_path>/<name>/cf_ray/profile.parquet`` when it finished.

        Raises:
            FileNotFoundError: the run is not alive and saved no profile (check the path and name).
            RunUnavailableError: the live controller did not answer in time.

        Example::

            df = cf_ray.Run("/mnt/runs", "my-run").profile()
            df[df["committed"]][["step", "interval", "stall_s", "persist_s"]]
        """
        from cf_ray import report

        found, rows = self._ask("profile_rows", what="the profile")
        if found:
            return report.profile_frame(rows)
        return report.read_run_profile(self.storage_path, self.name, self.storage_filesystem)

    def profile_rows(self) -> list[dict]:
        """The profile as plain dicts, one per checkpoint (missing values are ``None``).

        Raises:
            FileNotFoundError: the run is not alive and saved no profile.
            RunUnavailableError: the live controller did not answer in time.

        Example::

            rows = cf_ray.Run("/mnt/runs", "my-run").profile_rows()
            jit = [r for r in rows if r["kind"] == "preempt"]
        """
        found, rows = self._ask("profile_rows", what="the profile")
        if found:
            return rows
        from cf_ray import report

        return _records(report.read_run_profile(self.storage_path, self.name, self.storage_filesystem))

    def iterations(self) -> pd.DataFrame:
        """The iteration-time samples (columns: ``cf_ray.report.iterations_frame``), live or saved.

        Raises:
            FileNotFoundError: the run is not alive and saved no profile.
            RunUnavailableError: the live controller did not answer in time.

        Example::

            from cf_ray import report

            run = cf_ray.Run("/mnt/runs", "my-run")
            report.plot_profile(run.profile(), run.iterations(), budget_pct=5)
        """
        from cf_ray import report

        found, rows = self._ask("iteration_rows", what="the iteration times")
        if found:
            return report.iterations_frame(rows)
        return report.read_run_iterations(self.storage_path, self.name, self.storage_filesystem)

    def explain(self) -> Any:
        """Why the checkpoint interval is what it is: the policy's own account (``Adaptive``).

        Raises:
            RunUnavailableError: the run is not alive (the policy lives in its controller), or
                the controller did not answer in time.

        Example::

            print(cf_ray.Run("/mnt/runs", "my-run").explain())
        """
        return self._need_live("explain", what="the policy's explanation")

    def events(self) -> list[dict]:
        """Restores, fallbacks, re-profiles, failure counts and interval changes recorded by the
        controller, oldest first.

        From the live controller while the run is alive, else what the run saved at its end
        (``<storage_path>/<name>/cf_ray/events.json``, beside the profile table).

        Raises:
            RunUnavailableError: the run is not alive and saved no events (it is running in a
                cluster this process is not connected to, or its controller never reached its end), or the
                controller did not answer in time.
            CorruptCheckpointError: the saved events are not readable.

        Example::

            restores = [e for e in cf_ray.Run("/mnt/runs", "my-run").events() if e["event"] == "restore"]
        """
        found, events = self._ask("events", what="the run's events")
        if found:
            return events
        from cf_ray._engine.observe.profile_files import EVENTS_FILE, load_events
        from cf_ray._engine.storage.backends import open_storage

        storage = open_storage(self.storage_path, self.storage_filesystem).child(f"{self.name}/{_RUN_SUBDIR}")
        saved = load_events(storage)
        if saved is None:
            raise RunUnavailableError(
                f"no controller of {self!r} is alive"
                f"{'' if ray.is_initialized() else ' (this process is not connected to Ray)'}, and the run saved no "
                f"events at {storage.uri(EVENTS_FILE)} (a run saves them when it ends): for a run still going in "
                "another process's cluster, connect to it with ray.init(address='auto'); check the path and name"
            )
        return saved

    def summary(self) -> dict:
        """What the run has committed and what failed.

        Live, the controller's summary: ``generation``, ``committed_steps``, ``interval``,
        ``schedules``, ``failures`` (of every attempt), ``events``, ``pending``, ``restore_fallbacks``
        (``{source: {cause: n}}``), ``distrusted`` (``[generation, step]`` of snapshots never
        offered again) and ``goodput`` (:meth:`goodput`). After the run, from storage:
        ``committed_steps`` (the committed resumable checkpoints), ``failures`` (profile rows that
        were not committed: ``step``, ``generation``, ``error``), ``generation`` and ``interval``
        (of the last profile row; ``None`` without a saved profile). ``source`` says which
        (``"controller"`` or ``"storage"``).

        Raises:
            RunUnavailableError: the live controller did not answer in time.

        Example::

            s = cf_ray.Run("/mnt/runs", "my-run").summary()
            print(s["committed_steps"][-1], len(s["failures"]))
        """
        found, live = self._ask("summary", what="its summary")
        if found:
            return dict(live, source="controller")
        committed = [c.step for c in self.checkpoints() if posixpath.basename(c.path.rstrip("/")).startswith("step_")]
        out = {"source": "storage", "committed_steps": committed, "failures": [], "generation": None, "interval": None}
        try:
            rows = self.profile_rows()
        except FileNotFoundError:
            return out
        out["failures"] = [
            {"step": r.get("step"), "generation": r.get("generation"), "error": r.get("error")}
            for r in rows
            if r.get("where") == "failed"
        ]
        if rows:
            out["generation"] = max((r["generation"] for r in rows if r.get("generation") is not None), default=None)
            out["interval"] = rows[-1].get("interval")
        return out

    def goodput(self) -> dict | None:
        """Where the run's wall time went: productive training and the badput by category
        (checkpoint save, checkpoint restore, wasted progress, recovery, start-up, other), as
        ``{"wall_s", "productive_s", "effective_training_ratio", "badput_s": {category: s},
        "shares", "restarts"}``; ``cf_ray.report.badput_frame`` makes it a table,
        ``cf_ray.report.plot_badput`` a plot.

        Live from the controller, else what the run saved at its end (``goodput.json``); ``None`` when
        it saved none (its controller never reached its end).

        Raises:
            RunUnavailableError: the live controller did not answer in time.

        Example::

            from cf_ray import report

            report.badput_frame(cf_ray.Run("/mnt/runs", "my-run").goodput())
        """
        found, live = self._ask("summary", what="its summary")
        if found and live.get("goodput") is not None:
            return live["goodput"]
        from cf_ray import report

        return report.read_run_goodput(self.storage_path, self.name, self.storage_filesystem)

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every committed checkpoint of the run (resumable ones and the final model), oldest first.

        Read from storage (what is committed there is what a restore or :func:`cf_ray.load_state`
        can use), whether or not the run is alive.

        Example::

            for c in cf_ray.Run("/mnt/runs", "my-run").checkpoints():
                print(c.step, c.kind, c.path)
        """
        from cf_ray.load import list_checkpoints

        return list_checkpoints(posixpath.join(self.storage_path.rstrip("/"), self.name), self.storage_filesystem)

    # -- actions -------------------------------------------------------------------------------------
    def notify_preemption(
        self, deadline_s: float | None = None, deadline_unix: float | None = None, detail: str = ""
    ) -> Any:
        """Tell every rank of the running job that it is about to be preempted (or resized).

        Every rank hears of it at its next controller poll, takes a just-in-time checkpoint with
        the others and holds until the deadline (see :mod:`cf_ray.preemption`).

        Args:
            deadline_s: seconds from now until the workers are expected to be gone.
            deadline_unix: the same as a UNIX time (wins over ``deadline_s``).
            detail: free text kept with the notice (in the profile's row of the checkpoint).

        Returns:
            The request as the controller recorded it.

        Raises:
            RunUnavailableError: the job is not running (or this process is not connected to its
                Ray cluster), or the controller did not answer in time.

        Example::

            cf_ray.Run("/mnt/runs", "my-run").notify_preemption(deadline_s=30, detail="spot reclaim")
        """
        from cf_ray.preemption import notify_preemption

        if self._controller() is None:
            raise RunUnavailableError(
                f"no running cf_ray job {self!r}"
                f"{'' if ray.is_initialized() else ' (this process is not connected to Ray)'}: give the same "
                "storage_path and name as the job's RunConfig, and connect to its cluster with "
                "ray.init(address='auto')"
            )
        try:
            return notify_preemption(
                self.storage_path,
                self.name,
                deadline_s=deadline_s,
                deadline_unix=deadline_unix,
                detail=detail,
                storage_filesystem=self.storage_filesystem,
            )
        except ray.exceptions.GetTimeoutError:
            raise RunUnavailableError(
                f"the controller of {self!r} did not take the notice within {_env.get_float(_env.ACTOR_TIMEOUT_S):.0f}"
                f" s: retry, or raise {_env.ACTOR_TIMEOUT_S}"
            ) from None
        except ray.exceptions.RayActorError:
            raise RunUnavailableError(f"the controller of {self!r} exited: the job is no longer running") from None


def _records(df: pd.DataFrame) -> list[dict]:
    """Rows of a frame as dicts of plain Python values; missing values (NaN, ``pd.NA``) become ``None``."""
    import pandas

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple, dict, set, str, bytes)):
            return v
        if v is None or pandas.isna(v):
            return None
        return v.item() if hasattr(v, "item") else v

    return [{k: plain(v) for k, v in row.items()} for row in df.to_dict("records")]


__all__ = ["Run", "RunUnavailableError"]
