"""The soak's view of a run's processes and memory, taken from outside them (no hook in cf_ray):

* who is where: Ray's actor table (``ray._private.state.actors``: pid, node, class and name of every
  live actor, from the GCS, no dashboard needed) gives the training workers (``RayTrainWorker``), the
  run's holders (``cf_ray.holder.<run>-...``) and its controller; a worker's rank is the
  ``ids_rank<r>_gen<g>.jsonl`` file the demo's loop keeps open (``/proc/<pid>/fd``);
* a holder's slots: its file descriptors that name a ``cf_ray`` memfd (``/proc/<pid>/fd``), each
  slot's header (what it holds) read through that path, its resident bytes, whether it is sealed;
* the faults: signals by pid, one bit flipped in a slot through ``/proc/<holder pid>/fd/<n>`` or in a
  file on disk.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import signal
from dataclasses import dataclass

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
    "flip_file",
    "flip_slot",
    "rank_of",
    "run_actors",
    "signal_pid",
    "slot_state_name",
    "slots_of",
]
