"""Where a run's CPU goes, thread by thread: the CPU each thread of the machine's Ray processes used
over a window, in ms per second, summed by process role and thread name.

    python -m benchmarks.thread_cpu --seconds 120 --while-present ray::Holder

samples ``/proc/<pid>/task/<tid>/stat`` once a second and counts only the seconds in which a process
whose command line contains ``--while-present`` runs (there: the fits that use cf_ray, whose holder
lives as long as its fit), so that it can run beside a whole ``cf-ray bench --user-loop`` and report
one fit kind. A role is the first word of a process's command line up to its first dot (Ray names its
workers ``ray::<Class>`` and ``ray::<Class>.<method>`` while a method runs); a thread is its kernel
name (``comm``: Ray's own threads are named, Python's take their process's name), ``(main)`` for
the process's first thread. The figures for docs/benchmarks/single-node.md (2026-11-29) came from it.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from collections.abc import Callable
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _cmdline(pid_dir: Path) -> str:
    try:
        return (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def role_of(cmdline: str) -> str:
    """``ray::RayTrainWorker.train_fn`` -> ``ray::RayTrainWorker``; ``/x/bin/raylet --a`` -> ``raylet``."""
    first = cmdline.split(" ", 1)[0]
    if first.startswith("ray::"):
        return "ray::" + first[5:].split(".", 1)[0]
    return os.path.basename(first)


def threads(proc: Path, wanted: Callable[[str], bool]) -> tuple[dict[tuple[int, int], tuple[str, str, int]], set[str]]:
    """``{(pid, tid): (role, thread name, CPU ticks)}`` of the processes whose command line
    ``wanted`` accepts, and the command lines of every process."""
    out: dict[tuple[int, int], tuple[str, str, int]] = {}
    seen: set[str] = set()
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        cmd = _cmdline(pid_dir)
        seen.add(cmd)
        if not cmd or not wanted(cmd):
            continue
        role = role_of(cmd)
        try:
            tasks = list((pid_dir / "task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                stat = (t / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            name = f"{comm} (main)" if t.name == pid_dir.name else comm
            out[(int(pid_dir.name), int(t.name))] = (role, name, int(fields[11]) + int(fields[12]))
    return out, seen


def sample(
    seconds: float,
    *,
    while_present: str | None = None,
    wanted: Callable[[str], bool] = lambda cmd: "ray" in cmd or "python" in cmd,
    interval_s: float = 1.0,
    proc: Path = Path("/proc"),
) -> tuple[dict[tuple[str, str], float], float]:
    """Sample for ``seconds``; returns ``({(role, thread): ms of CPU per second}, seconds counted)``."""
    used: collections.Counter = collections.Counter()
    counted = 0.0
    prev, _ = threads(proc, wanted)
    t_prev = time.monotonic()
    end = t_prev + seconds
    while time.monotonic() < end:
        time.sleep(interval_s)
        cur, cmds = threads(proc, wanted)
        now = time.monotonic()
        if while_present is None or any(while_present in c for c in cmds):
            counted += now - t_prev
            for key, (role, name, ticks) in cur.items():
                if key in prev:
                    used[(role, name)] += ticks - prev[key][2]
        prev, t_prev = cur, now
    if not counted:
        return {}, 0.0
    return {k: 1e3 * v / TICK / counted for k, v in used.items() if v}, counted


def render(ms_per_s: dict[tuple[str, str], float], counted: float, top: int = 40) -> str:
    lines = [f"CPU by thread over {counted:.0f} s, ms per second (1000 = one core busy)", ""]
    lines += ["| process | thread | ms/s |", "|---|---|---|"]
    for (role, name), v in sorted(ms_per_s.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {role} | {name} | {v:.1f} |")
    lines.append(f"| all | | {sum(ms_per_s.values()):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to sample")
    ap.add_argument(
        "--while-present",
        default=None,
        help="count only the seconds in which a process whose command line contains this runs",
    )
    ap.add_argument("--top", type=int, default=40, help="rows to print")
    args = ap.parse_args(argv)
    used, counted = sample(args.seconds, while_present=args.while_present)
    print(render(used, counted, args.top))


if __name__ == "__main__":
    main()
