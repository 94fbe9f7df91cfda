"""The soak's view of a run's processes and memory, taken from outside them (no hook in cf_ray):

* who is where: Ray's actor table (``ray._private.state.actors``: pid, node, class and name of every
  live actor, from the GCS, no dashboard needed) gives the training workers (``RayTrainWorker``), the
  run's holders (``cf_ray.holder.<run>-...``) and its controller; a worker's rank is the
  ``ids_rank<r>_gen<g>.jsonl`` file the demo's loop keeps open (``/proc/<pid>/fd``);
* a holder's slots: its file descriptors that name a ``cf_ray`` memfd (``/proc/<pid>/fd``), each
  slot's header (what it holds) read through that path, its resident bytes, whether it is sealed;
* the faults: signals by pid, one bit flipped in a slot through ``/proc/<holder pid>/fd/<n>`` or in a
  file on disk;
* the spare worker processes cf_ray's ranks make ready for the next attempt (``link/ray_train_spare.py``):
  the claim files of a node and job (``<tmp>/cf_ray-spares/<raylet pid>-<job id>/<pid>.json``: pid,
  start ticks, ``for_pid`` the rank's worker, rank), and Ray's idle workers (``ray::IDLE``) of a raylet
  and job that no claim names (a spare being made, or left by a rank that died before claiming it).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import mmap
import os
import re
import signal
from dataclasses import dataclass

from cf_ray._engine.protocol import spares

_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x0008)
_SECTION = re.compile(r"(shared|rank_\d{5})")
_IDS = re.compile(r"ids_rank(\d+)_gen(\d+)\.jsonl$")


@dataclass(frozen=True, slots=True)
class Actor:
    pid: int
    node: str
    cls: str
    name: str


def alive_actors() -> list[Actor]:
    from ray._private import state

    got = state.actors(actor_state_name="ALIVE")
    return [
        Actor(
            int(a.get("Pid") or 0), str(a["Address"]["NodeID"]), str(a.get("ActorClassName")), str(a.get("Name") or "")
        )
        for a in got.values()
        if a.get("Pid")
    ]


def run_actors(run: str, actors: list[Actor] | None = None) -> dict[str, list[Actor]]:
    """``{"workers": ..., "holders": ..., "controller": ...}`` of run ``run`` (one run at a time: every
    live training worker is the run's)."""
    actors = alive_actors() if actors is None else actors
    return {
        "workers": [a for a in actors if a.cls == "RayTrainWorker"],
        "holders": [a for a in actors if a.name.startswith(f"cf_ray.holder.{run}-")],
        "controller": [a for a in actors if a.name.startswith(f"cf_ray.controller.{run}-")],
    }


def rank_of(pid: int, out_dir: str) -> tuple[int, int] | None:
    """``(rank, generation)`` of a training worker: the ids file of ``out_dir`` it has open."""
    best = None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith(out_dir):
            m = _IDS.search(link)
            if m:
                got = (int(m.group(1)), int(m.group(2)))
                best = got if best is None or got[1] > best[1] else best
    return best


@dataclass(frozen=True, slots=True)
class Slot:
    """One of a holder's slot files, as seen from outside."""

    holder_pid: int
    path: str
    """``/proc/<holder pid>/fd/<n>``."""
    name: str
    """The memfd's name."""
    section: str
    copy: bool
    """A copy of another node's section (not a slot this node's workers fill)."""
    size: int
    resident: int
    state: int
    generation: int
    step: int
    sealed: bool

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def _read_header():
    """cf_ray's own header reader (``memory/slots.py`` since issue 24, ``node/shm.py`` before)."""
    try:
        from cf_ray._engine.memory import slots as m  # pyright: ignore[reportMissingImports]
    except ImportError:
        from cf_ray._engine.node import shm as m
    return m.read_header, m.HEADER_BYTES, m.READY, m.FILLING


def slots_of(holder_pid: int) -> list[Slot]:
    """Every slot file holder ``holder_pid`` has open, with its header: once per file (a holder may
    have a slot open under several fds: its own, and a lock it keeps on it)."""
    read_header, header_bytes, _, _ = _read_header()
    out = []
    seen: set[tuple[int, int]] = set()
    try:
        fds = os.listdir(f"/proc/{holder_pid}/fd")
    except OSError:
        return []
    for fd in fds:
        path = f"/proc/{holder_pid}/fd/{fd}"
        try:
            link = os.readlink(path)
        except OSError:
            continue
        if not link.startswith("/memfd:cf_ray"):
            continue
        name = link.removeprefix("/memfd:").removesuffix(" (deleted)")
        m = _SECTION.search(name)
        try:
            f = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(f)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            head = os.pread(f, min(header_bytes, mmap.PAGESIZE), 0)
            try:
                seals = fcntl.fcntl(f, _F_GET_SEALS)
            except OSError:
                seals = 0
        finally:
            os.close(f)
        h = read_header(head) if len(head) >= 64 else None
        out.append(
            Slot(
                holder_pid=holder_pid,
                path=path,
                name=name,
                section=m.group(1) if m else "?",
                copy=".from." in name,
                size=st.st_size,
                resident=st.st_blocks * 512,
                state=h.state if h else -1,
                generation=h.generation if h else -1,
                step=h.step if h else -1,
                sealed=bool(seals & _F_SEAL_WRITE),
            )
        )
    return out


def slot_state_name(state: int) -> str:
    _, _, ready, filling = _read_header()
    return {ready: "READY", filling: "FILLING", 0: "EMPTY"}.get(state, str(state))


def flip_slot(slot: Slot, where: float) -> dict:
    """Flip one bit (``0x08``) of the byte at ``where`` (a fraction) of the slot's data, through the
    holder's fd of it: what a stray write or a bad DIMM does. Returns what was done (or why not)."""
    _, header_bytes, _, _ = _read_header()
    data = max(0, slot.size - header_bytes)
    off = min(max(data - 1, 0), int(where * data))
    rec = {"slot": slot.name, "holder_pid": slot.holder_pid, "step": slot.step, "generation": slot.generation}
    rec.update(offset=off, block=off // (1 << 18))
    try:
        f = os.open(slot.path, os.O_RDWR)
    except OSError as e:
        return dict(rec, done=False, error=f"open: {os.strerror(e.errno or 0)}")
    try:
        byte = os.pread(f, 1, header_bytes + off)
        os.pwrite(f, bytes([byte[0] ^ 0x08]), header_bytes + off)
        return dict(rec, done=True, before=byte[0], after=byte[0] ^ 0x08)
    except OSError as e:
        why = "sealed (F_SEAL_WRITE)" if e.errno == errno.EPERM else os.strerror(e.errno or 0)
        return dict(rec, done=False, error=why)
    finally:
        os.close(f)


def flip_file(path: str, where: float) -> dict:
    """Flip one bit (``0x08``) of the byte at ``where`` (a fraction) of a file on disk."""
    size = os.path.getsize(path)
    off = min(max(size - 1, 0), int(where * size))
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x08]))
        f.flush()
        os.fsync(f.fileno())
    return {"file": path, "offset": off, "block": off // (1 << 18), "size": size, "done": True}


# -- the spare worker processes -----------------------------------------------------------------------
_IDLE_TITLE = b"ray::IDLE"
SPARES = "cf_ray-spares"


environ_of = spares.environ  # the environment a process started with: the engine's own reader


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot); ``None`` when it is gone (or dead, a
    zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def is_idle_worker(pid: int) -> bool:
    """Process ``pid`` is an idle Ray worker (its title ``ray::IDLE``: no actor, no task)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(_IDLE_TITLE)
    except OSError:
        return False


def ray_ids(pid: int) -> tuple[str, str] | None:
    """``(raylet pid, job id)`` of a Ray worker process, from its environment."""
    env = environ_of(pid)
    raylet, job = env.get("RAY_RAYLET_PID"), env.get("RAY_JOB_ID")
    return (raylet, job) if raylet and job else None


def spares_dir(worker_pid: int) -> str | None:
    """Where cf_ray claims the spares of training worker ``worker_pid``'s node and job (its temp dir,
    raylet and job, from its own environment); ``None`` when it is gone."""
    env = environ_of(worker_pid)
    ids = ray_ids(worker_pid)
    if ids is None:
        return None
    tmp = env.get("TMPDIR") or env.get("TEMP") or env.get("TMP") or "/tmp"
    return os.path.join(tmp, SPARES, f"{ids[0]}-{ids[1]}")


def spare_claims(directory: str) -> list[dict]:
    """Every claim file of ``directory``, each with ``alive`` (its process is the one claimed: same
    pid and start) and ``idle`` (alive and still ``ray::IDLE``) and ``file``."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        pid = int(rec.get("pid", 0))
        alive = pid > 0 and start_ticks(pid) == rec.get("start_ticks")
        out.append(dict(rec, file=path, alive=alive, idle=alive and is_idle_worker(pid)))
    return out


def spares_of(worker_pid: int, directory: str | None = None) -> list[dict]:
    """The spares training worker ``worker_pid`` claimed (:func:`spare_claims` with its ``for_pid``)."""
    directory = directory or spares_dir(worker_pid)
    return [c for c in spare_claims(directory) if c.get("for_pid") == worker_pid] if directory else []


def unclaimed_idle(raylet: str, job: str, directory: str | None, since_ticks: int = 0) -> list[int]:
    """Idle Ray workers of ``raylet`` and ``job`` started at or after ``since_ticks`` that no claim of
    ``directory`` names: a spare the raylet is starting or started for a rank that has not claimed it
    (or never will: it died first)."""
    claimed = {int(c.get("pid", 0)) for c in spare_claims(directory)} if directory else set()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in claimed:
            continue
        pid = int(name)
        ticks = start_ticks(pid)
        if ticks is None or ticks < since_ticks or not is_idle_worker(pid):
            continue
        if ray_ids(pid) == (raylet, job):
            out.append(pid)
    return sorted(out)


def job_spares(job: str, tmp: str, raylets: set[str] | None = None) -> list[dict]:
    """Every claim left for ``job`` on the nodes of ``raylets`` (raylet pids; ``None``: any node of
    this machine): :func:`spare_claims` of each ``<tmp>/cf_ray-spares/<raylet>-<job>`` (a job id
    repeats across Ray clusters: the raylet tells them apart)."""
    dirs = sorted(glob.glob(os.path.join(tmp, SPARES, f"*-{job}")))
    mine = [d for d in dirs if raylets is None or os.path.basename(d).rsplit("-", 1)[0] in raylets]
    return [c for d in mine for c in spare_claims(d)]


def idle_workers_of_job(job: str, since_ticks: int = 0, raylets: set[str] | None = None) -> list[int]:
    """Idle Ray workers of ``job`` started at or after ``since_ticks``, of the raylets ``raylets``
    (``None``: any raylet of this machine)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        ticks = start_ticks(pid)
        if ticks is None or ticks < since_ticks or not is_idle_worker(pid):
            continue
        env = environ_of(pid)
        if env.get("RAY_JOB_ID") == job and (raylets is None or env.get("RAY_RAYLET_PID") in raylets):
            out.append(pid)
    return sorted(out)


def now_ticks() -> int:
    """Clock ticks since boot now (the unit of :func:`start_ticks`)."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def signal_pid(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


__all__ = [
    "Actor",
    "Slot",
    "alive_actors",
    "environ_of",
    "idle_workers_of_job",
    "is_idle_worker",
    "job_spares",
    "now_ticks",
    "ray_ids",
    "spare_claims",
    "spares_dir",
    "spares_of",
    "start_ticks",
    "unclaimed_idle",
    "flip_file",
    "flip_slot",
    "rank_of",
    "run_actors",
    "signal_pid",
    "slot_state_name",
    "slots_of",
]
