"""Says why the test process died when it dies without a word.

A pytest process that is Ray's driver ends at once, with exit status 1 and no Python traceback, no
summary and no ``atexit`` handler, when its node's raylet goes away: Ray's core worker in the driver
terminates the process ("The connection to the plasma store is failed. Terminate the process.").
The raylet goes away when the GCS marks the node dead (its health checks went unanswered: a starved
machine), when the kernel's OOM killer picks it, or when it crashes; Ray's log monitor prints why to
the driver's stderr, which pytest was capturing for the running test and never shows. CI then ends
red with nothing to read.

``conftest.py`` starts this module as a process of its own, in its own session, with pytest's real
stdout and stderr (taken before capture). pytest writes to the pipe on our stdin, a line each: ``test
<node id>`` as each test starts, ``session <dir>`` for the Ray session the driver is connected to,
and ``done`` once it is through. The watch ends quietly after ``done``. If the pytest process ends
before writing it (the pipe closes, or the process is gone: a pidfd), it prints which test was running
and the lines of the Ray session's logs that say why, then exits.
"""

from __future__ import annotations

import glob
import os
import selectors
import sys
import tempfile

#: Lines of the session's logs that say why the node or the driver went away.
_SIGNS = (
    "marked dead",
    "marked as dead",
    "Raylet is terminated",
    "Terminate the process",
    "IPC connection failed",
    "Failed to connect to GCS",
    "GCS consider this node to be dead",
    "OOM",
    "out of memory",
)


def _evidence(session: str, limit: int = 12) -> list[str]:
    """The last lines of the session's raylet, GCS and driver logs that carry one of ``_SIGNS``."""
    found: list[str] = []
    logs = os.path.join(session, "logs")
    patterns = ("raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err", "python-core-driver-*.log")
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(logs, pattern))):
            try:
                with open(path, errors="replace") as f:
                    hits = [line.rstrip()[:400] for line in f if any(s in line for s in _SIGNS)]
            except OSError:
                continue
            found += [f"  {os.path.basename(path)}: {line}" for line in hits[-limit:]]
    return found


def report(pid: int, test: str | None, sessions: list[str]) -> str:
    """What to print when pytest (``pid``) ended during ``test`` without saying so."""
    lines = [
        "",
        "=" * 100,
        f"cf_ray tests: the pytest process (pid {pid}) ended without finishing its run, "
        f"during {test or 'collection or set-up (no test had started)'}.",
        "No traceback or summary follows: the process was ended from outside Python. Ray's driver ends so when",
        "its node's raylet is gone (marked dead by the GCS after unanswered health checks on a starved machine,",
        "killed by the OOM killer, or crashed). What the Ray session's logs say:",
    ]
    root = os.path.join(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir(), "ray")
    for log in sorted(glob.glob(os.path.join(root, "session_*", "logs", f"python-core-driver-*_{pid}.log"))):
        session = os.path.dirname(os.path.dirname(log))  # a Ray this process started in a test's body
        if session not in sessions:
            sessions = [*sessions, session]
    for session in sessions[-2:]:
        evidence = _evidence(session)
        lines.append(f" {session}:")
        lines += evidence or ["  (no line of its raylet, GCS or driver logs says why)"]
    if not sessions:
        lines.append(" (the process had not connected to a Ray session)")
    lines.append("=" * 100)
    return "\n".join(lines) + "\n"


def watch(pid: int, pipe, out) -> bool:
    """Read pytest's lines from ``pipe`` until ``done`` (returns True) or pytest's end (prints the
    report to ``out``, returns False)."""
    state: dict = {"test": None, "sessions": [], "done": False, "buf": b""}
    fd = pipe.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ, "pipe")
    try:
        # Readable once the process has ended: a fork of pytest holding the pipe open cannot hide its end.
        sel.register(os.pidfd_open(pid), selectors.EVENT_READ, "pid")
    except (AttributeError, OSError):
        pass
    ended = False
    while not ended and not state["done"]:
        for key, _ in sel.select():
            if key.data == "pid":
                ended = True
            elif not _take(state, os.read(fd, 65536)):
                ended = True
    if not state["done"]:  # what pytest wrote just before it ended
        os.set_blocking(fd, False)
        try:
            while _take(state, os.read(fd, 65536)) and not state["done"]:
                pass
        except BlockingIOError:
            pass
    if state["done"]:
        return True
    out.write(report(pid, state["test"], state["sessions"]))
    out.flush()
    return False


def _take(state: dict, chunk: bytes) -> bool:
    """Parse pytest's lines in ``chunk`` into ``state``; False at the end of the pipe."""
    if not chunk:
        return False
    *lines, state["buf"] = (state["buf"] + chunk).split(b"\n")
    for raw in lines:
        kind, _, value = raw.decode(errors="replace").partition(" ")
        if kind == "done":
            state["done"] = True
        elif kind == "test":
            state["test"] = value
        elif kind == "session" and value not in state["sessions"]:
            state["sessions"].append(value)
    return True


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.stdin.buffer, sys.stderr)
