"""What the soak watches while a run trains, from outside it: how far each attempt got, which
checkpoints are committed (and when each was first seen), where each rank runs, what each holder
holds, and the log lines the run's processes write.

:class:`Monitor` is one thread polling every :data:`POLL_S` (the memory every :data:`MEMORY_S`);
:class:`LogTail` reads what Ray's worker log files gained since a mark.
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.soak import procs

POLL_S = 0.05
MEMORY_S = 0.5
_IDS = re.compile(r"ids_rank(\d+)_gen(\d+)\.jsonl$")
#: The log lines kept: cf_ray's own (``cf_ray: ...``, its errors) and the soak's injected errors.
_WANTED = re.compile(r"cf_ray[:.]|soak fault")
#: Not kept: a warning of the demo's configuration that every attempt prints.
_NOISE = re.compile(r"UserWarning: CheckpointConfig.storage_path is outside")
_STEP_DIR = re.compile(r"/step_(\d+)/MANIFEST\.json$")


@dataclass
class RunPaths:
    """Where one run of the soak writes (the demo's layout)."""

    name: str
    root: str
    control: str

    @property
    def out(self) -> str:
        return os.path.join(self.root, "out", self.name)

    @property
    def ckpt_root(self) -> str:
        """The run's cf_ray root on local disk (under the soak's filesystem too)."""
        return os.path.join(self.root, "ckpt", self.name, "cf_ray")


@dataclass
class Placement:
    t: float
    workers: dict[int, tuple[int, str, int]]
    """rank -> (pid, node, generation)."""
    holders: dict[str, tuple[int, str]]
    """node -> (pid, actor name)."""
    controller: tuple[int, str] | None
    """(pid, node)."""


@dataclass
class MemorySample:
    t: float
    node: str
    holder_pid: int
    generation: int
    ranks_on_node: list[int]
    ranks_placed: int
    """Ranks of the newest attempt placed anywhere (fewer than the world size: a restart under way)."""
    memfd_resident: int
    sections: dict[str, dict[str, int]]
    """section -> {"own": slot files, "copies": copies, "slot_size": largest slot file}."""
    reported: dict[str, Any] | None = None
    """The holder's own ``held_bytes()`` (None: it did not answer within 2 s)."""
    final: bool = False
    """Taken after the run ended (:meth:`Monitor.final_memory`)."""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _State:
    steps: dict[int, dict[int, int]] = field(default_factory=dict)
    """generation -> rank -> newest step logged."""
    gen_start: dict[int, float] = field(default_factory=dict)
    committed_seen: dict[int, float] = field(default_factory=dict)
    committed_now: set[int] = field(default_factory=set)
    placements: list[Placement] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    progress: list[tuple[float, int, int]] = field(default_factory=list)
    """(when, generation, newest step) each time the newest attempt's newest step changed."""
    log_marks: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    """(when, :meth:`LogTail.mark`), every :data:`MEMORY_S`."""


class Monitor(threading.Thread):
    def __init__(self, run: RunPaths, *, memory: bool = True, world: int = 2, logs: LogTail | None = None):
        super().__init__(name="soak-monitor", daemon=True)
        self.run_paths = run
        self.logs = logs
        self.world = world
        self._full: Placement | None = None
        """The newest placement with every rank of the newest attempt."""
        self._memory = memory
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self.s = _State()
        self._offsets: dict[str, int] = {}
        self._next_memory = 0.0
        self._errors: list[str] = []

    # -- the thread -----------------------------------------------------------------------------
    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a poll that fails (a process going) is retried
                if len(self._errors) < 20:
                    self._errors.append(repr(e))
            self._halt.wait(POLL_S)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
        self.poll()

    def poll(self) -> None:
        self._poll_steps()
        self._poll_committed()
        now = time.time()
        if now >= self._next_memory:
            self._next_memory = now + MEMORY_S
            if self.logs is not None:
                mark = self.logs.mark()
                with self._lock:
                    self.s.log_marks.append((now, mark))
            self._poll_placement(now)

    def _poll_steps(self) -> None:
        for path in glob.glob(os.path.join(self.run_paths.out, "ids_rank*_gen*.jsonl")):
            m = _IDS.search(path)
            if not m:
                continue
            rank, gen = int(m.group(1)), int(m.group(2))
            off = self._offsets.get(path, 0)
            try:
                with open(path) as f:
                    f.seek(off)
                    chunk = f.read()
            except OSError:
                continue
            lines = chunk.split("\n")
            done = "\n".join(lines[:-1])  # a last line without its newline is still being written
            self._offsets[path] = off + len(done) + (1 if len(lines) > 1 else 0)
            with self._lock:
                self.s.gen_start.setdefault(gen, time.time())
                per = self.s.steps.setdefault(gen, {})
                for line in lines[:-1]:
                    try:
                        per[rank] = max(per.get(rank, 0), json.loads(line)["step"])
                    except (ValueError, KeyError):
                        pass
        with self._lock:
            gen = max(self.s.steps, default=0)
            now = (gen, max(self.s.steps.get(gen, {}).values(), default=0))
            if not self.s.progress or self.s.progress[-1][1:] != now:
                self.s.progress.append((time.time(), *now))

    def _poll_committed(self) -> None:
        found = {
            int(m.group(1))
            for p in glob.glob(os.path.join(self.run_paths.ckpt_root, "checkpoints", "step_*", "MANIFEST.json"))
            if (m := _STEP_DIR.search(p))
        }
        now = time.time()
        with self._lock:
            for s in found:
                self.s.committed_seen.setdefault(s, now)
            self.s.committed_now = found

    def _poll_placement(self, now: float, memory: bool = True) -> Placement:
        acts = procs.run_actors(self.run_paths.name)
        workers = {}
        for a in acts["workers"]:
            got = procs.rank_of(a.pid, self.run_paths.out)
            if got is not None and (got[0] not in workers or workers[got[0]][2] < got[1]):
                workers[got[0]] = (a.pid, a.node, got[1])
        holders = {a.node: (a.pid, a.name) for a in acts["holders"]}
        ctl = acts["controller"][0] if acts["controller"] else None
        place = Placement(now, workers, holders, (ctl.pid, ctl.node) if ctl else None)
        gen = self.newest_generation()
        with self._lock:
            self.s.placements.append(place)
            if sum(1 for _, _, g in workers.values() if g == gen) >= self.world:
                self._full = place
        if memory and self._memory:
            self._sample_memory(place, acts["holders"])
        return place

    def final_memory(self) -> None:
        """One more sample once the run has ended (its workers gone, its holders not yet): the ranks
        on each node are those of the last moment every rank of the newest attempt was placed."""
        if self._memory and self._full is not None:
            holders = procs.run_actors(self.run_paths.name)["holders"]
            self._sample_memory(self._full, holders, final=True)

    def _sample_memory(self, place: Placement, holders: list[procs.Actor], final: bool = False) -> None:
        import ray

        gen = self.newest_generation()
        asked = {}
        for a in holders:
            try:
                asked[a.pid] = ray.get_actor(a.name, namespace="cf_ray").held_bytes.remote()
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        for a in holders:
            slots = procs.slots_of(a.pid)
            sections: dict[str, dict[str, int]] = {}
            for sl in slots:
                d = sections.setdefault(sl.section, {"own": 0, "copies": 0, "slot_size": 0})
                d["copies" if sl.copy else "own"] += 1
                d["slot_size"] = max(d["slot_size"], sl.size)
            reported = None
            if a.pid in asked:
                try:
                    reported = ray.get(asked[a.pid], timeout=2.0)
                except Exception:  # noqa: BLE001 - a holder busy or gone: no figure this time
                    reported = None
            sample = MemorySample(
                t=place.t,
                node=a.node,
                holder_pid=a.pid,
                generation=gen,
                ranks_on_node=sorted(r for r, (_, node, g) in place.workers.items() if node == a.node and g == gen),
                ranks_placed=sum(1 for _, _, g in place.workers.values() if g == gen),
                memfd_resident=sum(sl.resident for sl in slots),
                sections=sections,
                reported=reported,
                final=final,
            )
            with self._lock:
                self.s.memory.append(sample)

    # -- what the injector asks ------------------------------------------------------------------
    def newest_generation(self) -> int:
        with self._lock:
            return max(self.s.steps, default=0)

    def newest_step(self, generation: int | None = None) -> int:
        with self._lock:
            gen = max(self.s.steps, default=0) if generation is None else generation
            return max(self.s.steps.get(gen, {}).values(), default=0)

    def committed(self) -> list[int]:
        with self._lock:
            return sorted(self.s.committed_now)

    def placement(self) -> Placement:
        """Where the run's processes are now (asked of Ray's actor table)."""
        return self._poll_placement(time.time(), memory=False)

    def stalls(self, min_s: float) -> list[dict]:
        """Every time the newest attempt went ``min_s`` or longer without a step (not counting the way
        to a restart, which ends in another attempt's step, nor the end of the run), with the lines
        cf_ray wrote while it stood still (between the log marks around it, up to a second before the
        next step: a line written as the wait ended does not count)."""
        with self._lock:
            progress, marks = list(self.s.progress), list(self.s.log_marks)
        out = []
        for (t1, g1, _), (t2, g2, _) in zip(progress, progress[1:]):
            if g1 != g2 or t2 - t1 < min_s:
                continue
            # Said *while* it stood still: a line written as the wait ended (within the last second) is
            # not counted.
            before = [m for t, m in marks if t <= t1]
            during = [m for t, m in marks if t1 < t <= t2 - 1.0]
            lines = self.logs.between(before[-1], during[-1]) if self.logs and before and during else None
            out.append({"from": t1, "seconds": round(t2 - t1, 1), "generation": g1, "lines": lines})
        return out

    def snapshot(self) -> dict:
        """Everything recorded, for the schedule's JSON and the checks."""
        with self._lock:
            return {
                "steps": {g: dict(r) for g, r in self.s.steps.items()},
                "gen_start": dict(self.s.gen_start),
                "committed_seen": dict(self.s.committed_seen),
                "committed_end": sorted(self.s.committed_now),
                "placements": [
                    {"t": p.t, "workers": p.workers, "holders": p.holders, "controller": p.controller}
                    for p in self.s.placements
                ],
                "memory": [m.as_dict() for m in self.s.memory],
                "errors": list(self._errors),
            }


def wait_for(cond, timeout_s: float, *, alive=None, every_s: float = 0.02) -> bool:
    """Poll ``cond()`` until true (True) or ``timeout_s`` passed or ``alive()`` turned false (False)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return True
        if alive is not None and not alive():
            return bool(cond())
        time.sleep(every_s)
    return bool(cond())


class LogTail:
    """The lines Ray's worker log files (``<session>/logs/worker-*.out|err``) gained since a mark,
    those that cf_ray or the soak wrote (``cf_ray: ...``, ``cf_ray.errors...``, ``soak fault ...``)."""

    def __init__(self, logs_dir: str):
        self.logs_dir = logs_dir

    def mark(self) -> dict[str, int]:
        out = {}
        for p in glob.glob(os.path.join(self.logs_dir, "worker-*")):
            try:
                out[p] = os.path.getsize(p)
            except OSError:
                pass
        return out

    def since(self, mark: dict[str, int], limit: int = 400) -> list[str]:
        return self.between(mark, None, limit)

    def between(self, mark: dict[str, int], end: dict[str, int] | None, limit: int = 400) -> list[str]:
        """The lines written after ``mark`` (and before ``end``, when given)."""
        lines: list[str] = []
        for p in sorted(glob.glob(os.path.join(self.logs_dir, "worker-*"))):
            start = mark.get(p, 0)
            stop = None if end is None else end.get(p, start)
            if stop is not None and stop <= start:
                continue
            try:
                with open(p, errors="replace") as f:
                    f.seek(start)
                    chunk = f.read() if stop is None else f.read(stop - start)
            except OSError:
                continue
            for line in chunk.splitlines():
                if len(lines) < limit and _WANTED.search(line) and not _NOISE.search(line):
                    lines.append(line[:600])
        return lines


__all__ = ["LogTail", "MemorySample", "Monitor", "Placement", "RunPaths", "wait_for"]
