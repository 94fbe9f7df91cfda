"""The profile of a run, as users see it: one row per checkpoint (pandas), kept as Parquet next to
the checkpoints, plotted in one call, and exported as Ray metrics.

The controller owns the rows: it builds them as plain dicts (see :func:`profile_frame` for the
columns), writes them with :func:`save_profile` through the run's storage, and feeds each
finished row to a :class:`CheckpointMetrics`. Users read them back after the run with
:func:`read_run_profile` and draw them with :func:`plot_profile`::

    from cf_ray import report

    df = report.read_run_profile("/mnt/runs", "my-run")
    report.plot_profile(
        df,
        report.read_run_iterations("/mnt/runs", "my-run"),
        budget_pct=5,
        restarts_df=report.read_run_restarts("/mnt/runs", "my-run"),
    )

The tables, their files and plots are the engine's observation room (``cf_ray._engine.observe``);
this module is their public face: the names users import, and finding a run's files from its
``storage_path`` and name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cf_ray._engine.observe.metrics import CheckpointMetrics, GoodputMetrics
from cf_ray._engine.observe.profile_files import (
    GOODPUT_FILE,
    ITERATIONS_FILE,
    PROFILE_FILE,
    RESTARTS_FILE,
    load_goodput,
    load_profile,
    load_restarts,
    save_profile,
)
from cf_ray._engine.observe.profile_frames import ITERATION_COLUMNS as ITERATION_COLUMNS
from cf_ray._engine.observe.profile_frames import PROFILE_COLUMNS as PROFILE_COLUMNS
from cf_ray._engine.observe.profile_frames import RESTART_COLUMNS as RESTART_COLUMNS
from cf_ray._engine.observe.profile_frames import (
    badput_frame,
    iterations_frame,
    profile_frame,
    restarts_frame,
)
from cf_ray._engine.observe.profile_plot import plot_badput, plot_profile
from cf_ray._engine.storage.backends import open_storage
from cf_ray._engine.storage.base import Storage

if TYPE_CHECKING:
    import pandas as pd

#: The folder of a run's cf_ray files under ``<storage_path>/<run_name>``.
RUN_SUBDIR = "cf_ray"


def read_run_profile(storage_path: str, run_name: str, filesystem=None) -> pd.DataFrame:
    """The profile table of a run: ``<storage_path>/<run_name>/cf_ray/profile.parquet``, with the
    rows of the controller's parts that it lacks (a run whose controller died, see :func:`load_profile`).

    Args:
        storage_path: what the run was given as ``storage_path`` (a local path, ``s3://...``,
            ``gs://...``; a path on ``filesystem`` when one is given).
        run_name: the run's name (a path under ``storage_path``; no ``..``).
        filesystem: an optional ``pyarrow.fs.FileSystem`` (as for ``RunConfig(storage_filesystem=)``).

    Raises:
        FileNotFoundError: no profile there.
    """
    return load_profile(_run_storage(storage_path, run_name, filesystem))[0]


def read_run_iterations(storage_path: str, run_name: str, filesystem=None) -> pd.DataFrame:
    """The iteration-time table of a run (see :func:`read_run_profile` for the arguments)."""
    return load_profile(_run_storage(storage_path, run_name, filesystem))[1]


def read_run_restarts(storage_path: str, run_name: str, filesystem=None) -> pd.DataFrame:
    """The restarts table of a run (goodput: work lost, recovery time, restore source and time per
    restart; see :func:`restarts_frame`), written at the run's end. Arguments as :func:`read_run_profile`."""
    return load_restarts(_run_storage(storage_path, run_name, filesystem))


def read_run_goodput(storage_path: str, run_name: str, filesystem=None) -> dict | None:
    """Where a run's wall time went (productive and badput seconds by category, see
    :func:`badput_frame`), as saved at its end; ``None`` when it saved none. Arguments as
    :func:`read_run_profile`."""
    return load_goodput(_run_storage(storage_path, run_name, filesystem))


def _run_storage(storage_path: str, run_name: str, filesystem) -> Storage:
    return open_storage(storage_path, filesystem).child(f"{run_name.strip('/')}/{RUN_SUBDIR}")


__all__ = [
    "CheckpointMetrics",
    "GOODPUT_FILE",
    "GoodputMetrics",
    "ITERATIONS_FILE",
    "PROFILE_FILE",
    "RESTARTS_FILE",
    "iterations_frame",
    "badput_frame",
    "load_goodput",
    "load_profile",
    "load_restarts",
    "plot_badput",
    "plot_profile",
    "profile_frame",
    "read_run_goodput",
    "read_run_iterations",
    "read_run_profile",
    "read_run_restarts",
    "restarts_frame",
    "save_profile",
]
