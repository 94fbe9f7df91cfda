"""The spare worker processes of a node, as files: where a rank claims the idle Ray worker it made
ready for the next attempt, and how a claimed spare that is still idle is ended. Shared by the
worker that makes and takes them (``worker/link/ray_train_spare.py``) and the node's holder, which
ends those of its run left on its node when the run ends: a rank ends its own at ``finish()``, but a
spare on a node where the run's last attempt ran no rank has nobody else to end it.

A claim is ``<tmp>/cf_ray-spares/<raylet pid>-<job id>/<pid>.json`` (a job id alone repeats across
Ray clusters on one machine): ``pid``, ``start_ticks`` (the process's start: a pid used again is
never taken for the spare), ``for_pid`` and ``rank`` (the worker that made it), ``run`` (the run's key).

A request is ``<pid of the asking worker>-<since_ticks>.request`` in the same directory, written
before the raylet is asked for the process and removed once it is claimed: ``run``, ``rank``,
``for_pid``, ``since_ticks`` (the process is started after it) and ``env_vars`` (the run's, which the
process has). The raylet starts the process whatever happens to the worker that asked, so a request
left (its worker died, or the run ended before the process was found) tells the holder to look for
that process itself: every spare a run asked for is ended when the run ends, claimed or not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path

#: The folder of the node's temp dir that holds the claims.
logger = logging.getLogger("cf_ray")

ROOT = "cf_ray-spares"
_IDLE_TITLE = b"ray::IDLE"
#: The suffix of a request file (a claim is ``<pid>.json``).
REQUEST = ".request"
#: Seconds after its request a spare may still appear (the raylet's start of a Python process under
#: load): the holder waits at most until then for one that has not appeared yet.
APPEAR_S = 30.0


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


def request(directory: Path, record: dict) -> Path:
    """Write the request ``record`` (``for_pid``, ``since_ticks``, ``run``, ``rank``, ``env_vars``)
    before the raylet is asked for the process; its path, to :func:`withdraw` once it is claimed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{int(record['for_pid'])}-{int(record['since_ticks'])}{REQUEST}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def withdraw(path: Path | None) -> None:
    """The request of ``path`` is answered (its spare claimed) or moot: removed."""
    if path is not None:
        path.unlink(missing_ok=True)


def idle_workers(
    job: str,
    raylet: str,
    env_vars: dict[str, str] | None,
    since_ticks: int,
    skip: frozenset[int] | set[int] = frozenset(),
) -> list[tuple[int, int]]:
    """``(start ticks, pid)`` of every idle worker of ``job`` and ``raylet`` with ``env_vars``,
    started at or after ``since_ticks`` and not in ``skip``, oldest first: the one scan of
    ``/proc`` that both a rank claiming its spare and a holder ending the unclaimed ones use."""
    found: list[tuple[int, int]] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        ticks = start_ticks(int(name))
        if ticks is None or ticks < since_ticks:
            continue
        if idle_spare(int(name), job, raylet, env_vars or {}):
            found.append((ticks, int(name)))
    return sorted(found)


def _unclaimed(directory: Path, job: str, raylet: str, req: dict, taken: set[int]) -> int | None:
    """The first idle worker of ``job`` and ``raylet`` with the request's environment variables,
    started after its ``since_ticks``, that no claim names and this pass did not take."""
    claimed = {int(p.stem) for p in directory.glob("*.json") if p.stem.isdigit()}
    found = idle_workers(job, raylet, req.get("env_vars"), int(req["since_ticks"]), taken | claimed)
    return found[0][1] if found else None


def _end_claims(directory: Path, job: str, raylet: str, run: str) -> list[int]:
    """End the spares claimed for ``run`` in ``directory`` that are still idle; their claims go,
    whether their process is gone or not. Returns the pids ended."""
    ended = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            if record.get("run") == run and end(directory, record, job, raylet):
                ended.append(int(record["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ended


def end_run(raylet: str, run: str, wait_s: float = 10.0) -> list[int]:
    """End every spare run ``run`` asked for on the node of ``raylet`` that is still idle, claimed or
    not: each claim of the run (removed, its process ended when idle, gone or not), and for each
    request of the run left, the idle worker of the job with the run's environment the raylet started
    for it and nobody claimed, waited for at most ``wait_s`` while it may still appear
    (:data:`APPEAR_S` after its request); the requests are removed, and each directory left empty.
    Returns the pids ended. Never raises."""
    ended: list[int] = []
    if not raylet:
        return ended
    deadline = time.monotonic() + wait_s
    for directory in sorted((Path(tempfile.gettempdir()) / ROOT).glob(f"{raylet}-*")):
        job = directory.name.split("-", 1)[1]
        ended += _end_claims(directory, job, raylet, run)
        taken: set[int] = set(ended)
        for path in sorted(directory.glob(f"*{REQUEST}")):
            try:
                req = json.loads(path.read_text())
                if req.get("run") != run:
                    continue
                appear_by = time.monotonic() + max(0.0, float(req.get("unix", 0)) + APPEAR_S - time.time())
                if _unclaimed(directory, job, raylet, req, taken) is None and time.monotonic() < min(
                    deadline, appear_by
                ):
                    logger.info(
                        "cf_ray: waiting at most %.1f s for the spare rank %s of run %s asked for, to end it",
                        min(deadline, appear_by) - time.monotonic(),
                        req.get("rank"),
                        run,
                    )
                while True:
                    pid = _unclaimed(directory, job, raylet, req, taken)
                    if pid is not None or time.monotonic() >= min(deadline, appear_by):
                        break
                    time.sleep(0.2)
                if pid is not None:
                    taken.add(pid)
                    rec = {"pid": pid, "start_ticks": start_ticks(pid)}
                    if end(directory, rec, job, raylet, req.get("env_vars") or {}):
                        ended.append(pid)
                path.unlink(missing_ok=True)
            except (OSError, ValueError, KeyError, TypeError):
                continue
        ended += _end_claims(directory, job, raylet, run)  # claimed by a rank while this waited
        with contextlib.suppress(OSError):
            directory.rmdir()  # the node's last claims of the job: no directory left
    return ended


__all__ = [
    "APPEAR_S",
    "REQUEST",
    "ROOT",
    "end",
    "end_run",
    "environ",
    "idle_spare",
    "idle_workers",
    "request",
    "spares_dir",
    "start_ticks",
    "withdraw",
]
