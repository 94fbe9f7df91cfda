"""The worker's side of its node holder's slots (``memory/slots.py``): the arena a section's
snapshots are copied into.

The holder gives each section three slots (``SlotStore.arena``): the worker fills the one of the first
two that holds the older fill (or none), never one a reader holds; when the holder holds both (one
being written, one pinned: a milestone waiting for its write, the protected copied step), the third,
the spare. When all are held, :meth:`SlotArena.acquire` waits, and says how long. Each slot is
checked to be the one the holder described before it is mapped (``WriterSlot``).

Pinned on CUDA machines (``cudaHostRegister`` of each mapping — the spare's only once it is used:
registering takes every page), so device-to-host copies are DMA into the holder's memory.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.protocol.messages import SlotDesc

#: Slots the worker alternates between before it takes the spare.
_REGULAR = 2
_PAGE = 4096
#: ``madvise`` advice that maps every page of a range writable, keeping its bytes (Linux 5.14;
#: Python's ``mmap`` names it only from 3.13).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Seconds between two calls of a slot wait's ``on_wait`` (the watchdog, the log line).
WAIT_TICK_S = 0.25


class SlotsBusy(Exception):
    """Every slot of a section stayed held for the whole wait (or the wait was given up)."""

    def __init__(self, waited_s: float, held: str):
        super().__init__(f"every slot stayed held for {waited_s:.1f} s ({held})")
        self.waited_s = waited_s
        self.held = held


class SlotArena:
    """The slots of one section, mapped (module doc).

    Args:
        descs: the holder's slots of the section (``holder.arena``).
        nbytes: the section's size.
        pin: register the mappings with CUDA.

    Raises:
        SlotGone: a slot is not the one described (the holder is gone, or restarted).
    """

    def __init__(self, descs: tuple[SlotDesc, ...] | list[SlotDesc], nbytes: int, pin: bool):
        self.nbytes = nbytes
        self.slots: list[_slots.WriterSlot] = []
        try:
            for d in descs:
                self.slots.append(_slots.WriterSlot(d, nbytes))
        except BaseException:
            for s in self.slots:
                s.close()
            raise
        self._tensors = [
            torch.frombuffer(s.map, dtype=torch.uint8, count=max(nbytes, 1), offset=_slots.HEADER_BYTES)
            for s in self.slots
        ]
        self._pin = pin
        self._registered: dict[int, int] = {}  # slot -> registered address
        for k in range(min(_REGULAR, len(self.slots))):
            self._register(k)
        self.current = 0
        self.tensor = self._tensors[0]
        self._views: dict[tuple, torch.Tensor] = {}  # (slot, entry's place and form) -> its view (dst)

    def acquire(self, limit_s: float | None = None, on_wait: Callable[[float], bool] | None = None) -> float:
        """Take a slot for the next snapshot; returns the seconds waited for one.

        While every slot is held, ``on_wait(seconds waited)`` is called about every
        :data:`WAIT_TICK_S` (True: give up now); after ``limit_s`` it gives up. Giving up raises
        :class:`SlotsBusy`: the wait is bounded, and says so while it lasts."""
        t0 = time.perf_counter()
        tick = t0 + WAIT_TICK_S
        regular = sorted(range(min(_REGULAR, len(self.slots))), key=self._age)
        order = regular + list(range(len(regular), len(self.slots)))
        while True:
            for k in order:
                if self.slots[k].try_fill():
                    self._register(k)  # the spare: registered (its pages taken) only once it is used
                    self.current, self.tensor = k, self._tensors[k]
                    return time.perf_counter() - t0
            now = time.perf_counter()
            if limit_s is not None and now - t0 >= limit_s:
                raise SlotsBusy(now - t0, self.held())
            if on_wait is not None and now >= tick:
                tick = now + WAIT_TICK_S
                if on_wait(now - t0):
                    raise SlotsBusy(now - t0, self.held())
            time.sleep(0.002)

    def held(self) -> str:
        """What the slots hold, for people (``step 8 (ready), step 9 (ready), empty``)."""
        out = []
        for slot in self.slots:
            h = slot.header()
            state = {_slots.READY: "ready", _slots.FILLING: "being filled"}.get(h.state, "empty")
            out.append(f"step {h.step} ({state})" if h.state != _slots.EMPTY else "empty")
        return ", ".join(out)

    def _register(self, k: int) -> None:
        if self._pin and k not in self._registered:
            ptr, size = self.slots[k].address(), len(self.slots[k].map)
            if _cudart().cudaHostRegister(ptr, size, 0) == 0:
                self._registered[k] = ptr

    def _age(self, k: int) -> tuple:
        h = self.slots[k].header()
        return (0, 0, 0) if h.state != _slots.READY else (1, h.generation, h.step)

    def seal(self, generation: int, step: int) -> SlotDesc:
        return self.slots[self.current].seal(generation, step)

    def release(self) -> None:
        """Give up the slot being filled (the snapshot failed): it reads as empty."""
        self.slots[self.current].empty()

    def numpy(self) -> np.ndarray:
        return self.tensor.numpy()[: self.nbytes]

    def dst(self, entry: _codec.TensorEntry) -> torch.Tensor:
        """Where ``entry``'s bytes go in the slot being filled, as a tensor of its dtype and shape (made
        once per slot and entry: three tensor ops per entry at every snapshot would be a large part of
        the training thread's share of a checkpoint every iteration)."""
        key = (self.current, entry.offset, entry.nbytes, entry.dtype, entry.shape, entry.kind)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._view(entry)
        return view

    def _view(self, entry: _codec.TensorEntry) -> torch.Tensor:
        raw = self.tensor[entry.offset : entry.offset + entry.nbytes]
        if entry.kind == "numpy":
            return raw
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=_codec.torch_dtype(entry.dtype))
        return raw.view(_codec.torch_dtype(entry.dtype)).view(entry.shape)

    def fault_in(self) -> None:
        """Map every page of the two regular slots now, writable, keeping what they hold (a restored
        snapshot may be there); the spare's pages are taken only if it is ever used.
        ``MADV_POPULATE_WRITE`` (Linux 5.14), else a write of the byte each page holds (a copy of
        it: ``a[::page] = a[::page]`` is a self-assignment numpy skips, and the first checkpoints of
        every attempt would take the page faults in their copy, behind the weight-update guard)."""
        for slot, t in zip(self.slots[:_REGULAR], self._tensors):
            try:
                slot.map.madvise(_MADV_POPULATE_WRITE)
            except (OSError, ValueError):  # an older kernel
                a = t.numpy()
                a[::_PAGE] = a[::_PAGE].copy()

    def close(self) -> None:
        for ptr in self._registered.values():
            _cudart().cudaHostUnregister(ptr)
        self._registered.clear()
        self._views.clear()
        self._tensors.clear()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        for s in self.slots:
            s.close()


def _cudart() -> Any:
    """CUDA's runtime API through torch (``cudaHostRegister`` pins memory torch did not allocate)."""
    rt = torch.cuda.cudart()
    if rt is None:
        raise RuntimeError("CUDA runtime not available")
    return rt


__all__ = ["WAIT_TICK_S", "SlotArena", "SlotsBusy"]
