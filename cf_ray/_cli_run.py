"""How every ``cf-ray`` command finds the run it reads, and how it says what went wrong.

One place decides what a bad ``RUN`` is (nothing there, a file, a storage path that holds several
runs, a directory that is no run, storage that cannot be reached) and what each failure's exit
status is, so that every command answers the same case the same way: one line on stderr that says
what to give instead, no traceback, and

- ``0``: done;
- ``1``: damage found (``verify``), or a checkpoint file failed its check while it was read;
- ``2``: bad input: no such run, a file, several runs, storage that cannot be reached, a path or
  URI that cannot be read, no committed checkpoint (at ``--step``), no such object, a format that
  cannot hold what was asked for, nothing saved to show.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING

from cf_ray.errors import CfRayError, CorruptCheckpointError

if TYPE_CHECKING:
    from cf_ray._engine.storage.fs import FsStorage

#: Exit status of a command that found damage, or read a checkpoint file that failed its check.
DAMAGED = 1
#: Exit status of a command given bad input (what to give instead is said on stderr).
BAD_INPUT = 2
#: What a cf_ray folder holds: a directory holding one of them is one, whatever its name.
_ROOT_FILES = ("checkpoints", "profile.parquet")
#: How many run names a "holds several runs" message lists before "...".
_RUNS_NAMED = 8


class CliError(Exception):
    """A failure said in one line on stderr, with the command's exit status."""

    def __init__(self, message: str, code: int = BAD_INPUT):
        super().__init__(message)
        self.code = code


def locate(source: str) -> tuple[FsStorage, str | None]:
    """The run ``source`` names: (storage at its cf_ray folder, a checkpoint directory under it or
    ``None``), as :func:`cf_ray.load.open_run` takes it, after checking that there is one.

    Raises:
        CliError: nothing at ``source``, a file, a storage path holding runs (named), a directory
            that is no cf_ray run, storage that cannot be reached, a path or URI that cannot be read.
    """
    import pyarrow.fs as pafs

    from cf_ray._engine.format.catalog import open_run
    from cf_ray._engine.storage.backends import open_storage
    from cf_ray._engine.storage.fs import FsStorage

    try:
        given = open_storage(source)
    except (ValueError, TypeError) as e:  # no such scheme, no bucket (ConfigError, pyarrow.ArrowInvalid)
        raise CliError(f"{source!r} is not a path or URI cf-ray can read ({_first_line(e)})") from None
    where = given.uri()
    if not isinstance(given, FsStorage):  # cf-ray lists with pyarrow and hands its file system to cf_ray.load
        raise CliError(f"cf-ray reads runs on pyarrow file systems; {where} is not on one")
    kind = _stat(given, given.root, where)
    if kind == pafs.FileType.NotFound:
        raise CliError(f"no run at {where}: nothing is there; give the run's directory <storage_path>/<name>")
    if kind != pafs.FileType.Directory:
        raise CliError(
            f"{where} is a file, not a run: give the run's directory <storage_path>/<name> "
            "(or its cf_ray folder, or one checkpoint's directory)"
        )
    try:
        storage, directory = open_run(source)
    except OSError as e:
        raise CliError(f"cannot read {where}: {_first_line(e)}") from None
    if not isinstance(storage, FsStorage):
        raise CliError(f"cf-ray reads runs on pyarrow file systems; {where} is not on one")
    if directory is None and posixpath.basename(storage.root) != "cf_ray":
        inner = storage.child("cf_ray")
        if _stat(inner, inner.root, where) == pafs.FileType.Directory:
            return inner, None  # a run that has committed nothing yet (its profile, its quarantine)
        if any(_stat(storage, posixpath.join(storage.root, n), where) != pafs.FileType.NotFound for n in _ROOT_FILES):
            return storage, None  # a cf_ray folder of another name: CheckpointConfig(storage_path=...) itself
        runs = _runs_under(given, where)
        if runs:
            named = ", ".join(runs[:_RUNS_NAMED]) + (", ..." if len(runs) > _RUNS_NAMED else "")
            raise CliError(
                f"{where} holds {len(runs)} run{'s' if len(runs) != 1 else ''} ({named}), it is not one: "
                f"give one run's directory, e.g. {posixpath.join(where, runs[0])}"
            )
        raise CliError(
            f"{where} is not a cf_ray run (it has no cf_ray folder): give the directory "
            "<storage_path>/<name> that RunConfig(storage_path, name) made for a run that used cf_ray"
        )
    return storage, directory


def _stat(storage: FsStorage, path: str, where: str):
    try:
        return storage.fs.get_file_info(path).type
    except OSError as e:  # an unreachable endpoint, a bucket that is not there, no credentials
        raise CliError(f"cannot reach {where}: {_first_line(e)}") from None


def _runs_under(storage: FsStorage, where: str) -> list[str]:
    """The names of the runs directly under ``storage`` (directories holding a ``cf_ray`` folder)."""
    import pyarrow.fs as pafs

    try:
        entries = storage.fs.get_file_info(pafs.FileSelector(storage.root, allow_not_found=True))
        dirs = [e for e in entries if e.type == pafs.FileType.Directory]
        inner = storage.fs.get_file_info([posixpath.join(e.path, "cf_ray") for e in dirs])
    except OSError as e:
        raise CliError(f"cannot read {where}: {_first_line(e)}") from None
    return sorted(
        posixpath.basename(d.path.rstrip("/")) for d, i in zip(dirs, inner) if i.type == pafs.FileType.Directory
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def failure(e: BaseException) -> tuple[str, int] | None:
    """What a command's failure says in one line, and its exit status; ``None`` for an exception that
    is a bug (shown with its traceback)."""
    if isinstance(e, CliError):
        return _first_line(e), e.code
    if isinstance(e, CorruptCheckpointError):
        return f"damaged: {_first_line(e)}", DAMAGED
    if isinstance(e, CfRayError | OSError):
        # No such checkpoint or object, a format that cannot hold it, a run that saved no profile yet
        # (FileNotFoundError), storage that stopped answering part-way, a directory that cannot be written.
        return _first_line(e), BAD_INPUT
    return None
