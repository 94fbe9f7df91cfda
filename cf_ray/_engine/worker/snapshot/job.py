"""What a snapshot in flight is, as the parts of phase 1 share it: the snapshotter's thread and queue
(``snapshotter.py``), the copy engine (``copy_engine.py``), the late capture (``late_capture.py``)
and the hand-off to the holder (``handoff.py``). Records with no behaviour of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cf_ray._engine.format import codec as _codec
from cf_ray._engine.protocol.messages import SlotDesc


@dataclass(slots=True)
class StagedSection:
    """One section of a snapshot as handed to the holder: the holder's slot it was copied into, its
    index with the block checksums (a restore from memory checks the bytes against them, and the
    holder's write too), the data's CRC-32, and the bytes as this worker maps them."""

    arena: np.ndarray
    index: bytes
    slot: SlotDesc
    crc32: int


#: A part of a snapshot taken again at the next Checkpointer call: (its path in the section's tree,
#: e.g. ``("objects", "scheduler")`` or ``("objects", "optimizer", "param_groups")``, and what
#: returns its state now, e.g. ``scheduler.state_dict``).
LateObject = tuple[tuple[str, ...], Callable[[], Any]]


@dataclass(slots=True)
class LateSlot:
    """Where a late object's state lies in a snapshot: its subtree and its entries in the arena."""

    section: str
    path: tuple[str, ...]
    state_fn: Callable[[], Any]
    first: int
    """Index of its first tensor entry in the section's table (its entries are contiguous)."""
    layout: tuple
    """(name, dtype, shape, kind) of each of its entries: a new state must have the same."""


@dataclass(slots=True)
class Deferred:
    """A guarded tensor copied by the background thread: its section, where it goes, what it is."""

    section: str
    offset: int
    nbytes: int
    dst: torch.Tensor
    src: torch.Tensor


@dataclass(slots=True)
class SnapshotJob:
    """A snapshot in flight: what to copy, and what the hand-off needs."""

    step: int
    meta: Any
    """What the hand-off passes on (a :class:`SnapshotMeta` from the Checkpointer)."""
    flats: dict[str, _codec.Flat]
    arenas: dict[str, np.ndarray]
    generation: int = 0
    """The attempt's generation (a slot's header names it with the step)."""
    deferred: list[Deferred] = field(default_factory=list)
    cuda_events: dict[int, Any] = field(default_factory=dict)
    """Device index -> the event its side stream waits for (recorded after the optimizer step and
    after the unguarded tensors' copies of that device were queued)."""
    cuda_sections: set[str] = field(default_factory=set)
    """Sections that device tensors were copied into by DMA (checksummed once those copies are done)."""
    timings: dict[str, float] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    """Section -> its :class:`SlotArena` (where a late capture writes)."""
    late: list[LateSlot] = field(default_factory=list)
    late_ready: threading.Event = field(default_factory=threading.Event)
    """Set once the late objects were captured (or there are none)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    sealed: bool = False
    """The background thread stopped waiting for the late capture (what is there is handed off)."""
