"""The spare worker processes of a node, as files: where a rank claims the idle Ray worker it made
ready for the next attempt, and how a claimed spare that is still idle is ended. Shared by the
worker that makes and takes them (``worker/link/ray_train_spare.py``) and the node's holder, which
ends those of its run left on its node when the run ends: a rank ends its own at ``finish()``, but a
spare on a node where the run's last attempt ran no rank has nobody else to end it.

A claim is ``<tmp>/cf_ray-spares/<raylet pid>-<job id>/<pid>.json`` (a job id alone repeats across
Ray clusters on one machine): ``pid``, ``start_ticks`` (the process's start: a pid used again is
never taken for the spare), ``for_pid`` and ``rank`` (the worker that made it), ``run`` (the run's key).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from pathlib import Path

#: The folder of the node's temp dir that holds the claims.
ROOT = "cf_ray-spares"
_IDLE_TITLE = b"ray::IDLE"


def spares_dir(raylet: str, job: str) -> Path:
    """Where the spares of ``job`` on the node of ``raylet`` (its pid) are claimed."""
    return Path(tempfile.gettempdir()) / ROOT / f"{raylet}-{job}"


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with (empty when it is gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def idle_spare(pid: int, job: str, raylet: str, env_vars: dict[str, str] | None = None) -> bool:
    """``pid`` is an idle Ray worker of ``raylet``, of ``job``, with the environment variables ``env_vars``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(_IDLE_TITLE):
                return False
    except OSError:
        return False
    env = environ(pid)
    if env.get("RAY_RAYLET_PID") != raylet or env.get("RAY_JOB_ID") != job:
        return False
    return all(env.get(k) == v for k, v in (env_vars or {}).items())


def end(directory: Path, record: dict, job: str, raylet: str, env_vars: dict[str, str] | None = None) -> bool:
    """End the claimed spare of ``record`` if it is still idle (never a process that took an actor or
    a task since, nor another that got its pid), and remove its claim. True when it was signalled."""
    pid = int(record["pid"])
    ended = False
    with contextlib.suppress(OSError):
        if start_ticks(pid) == record.get("start_ticks") and idle_spare(pid, job, raylet, env_vars):
            os.kill(pid, signal.SIGTERM)
            ended = True
    (directory / f"{pid}.json").unlink(missing_ok=True)
    return ended


def end_run(raylet: str, run: str) -> list[int]:
    """End every spare claimed for run ``run`` on the node of ``raylet`` that is still idle, remove
    those claims, and each directory left empty. Returns the pids ended. Never raises."""
    ended: list[int] = []
    if not raylet:
        return ended
    for directory in sorted((Path(tempfile.gettempdir()) / ROOT).glob(f"{raylet}-*")):
        job = directory.name.split("-", 1)[1]
        for path in sorted(directory.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                if record.get("run") == run and end(directory, record, job, raylet):
                    ended.append(int(record["pid"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        with contextlib.suppress(OSError):
            directory.rmdir()  # the node's last claims of the job: no directory left
    return ended


__all__ = ["ROOT", "end", "end_run", "environ", "idle_spare", "spares_dir", "start_ticks"]
