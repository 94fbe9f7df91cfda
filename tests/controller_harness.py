"""The controller in process, without Ray (issue #24): as Ray Train's own v2 tests build their
controller with no cluster, these tests build :class:`~cf_ray._engine.driver.facade.Controller` — the
very class the actor runs — on a real storage (local disk), with the holders and the cluster's facts
as stand-ins that answer what a real holder and Ray's GCS would, and drive it with the messages a
holder sends, in the order a test chooses (sections written for real, so commits write and readers
verify real files).

Use the ``controller`` fixture (``tests/conftest.py``) or :func:`make_controller`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pyarrow.fs as pafs

from cf_ray._engine.driver.facade import Controller
from cf_ray._engine.driver.settings import ControllerSettings
from cf_ray._engine.format.layout import SHARED, section_rank, step_dir
from cf_ray._engine.format.sections import write_section
from cf_ray._engine.protocol.messages import (
    CheckpointKind,
    HolderState,
    PartDurable,
    PartReplicated,
    PartStaged,
    SnapshotMeta,
)
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.policy import FixedInterval


class Holders:
    """The run's holders as the controller reaches them (``HolderLink``'s methods), in process.

    ``holders`` maps a holder's name to a callable answering ``lookup`` for one key
    ``(generation, step, section)`` with ``(status, PartStaged | None, outcome | None)`` — status
    ``"held"``, ``"done"`` or ``"unknown"`` — or to ``None``: that holder is gone (its node lost, its
    actor dead). ``states`` maps a name to what its ``resync`` says. Every call is recorded.
    """

    def __init__(self):
        self.holders: dict[str, Callable | None] = {}
        self.states: dict[str, HolderState] = {}
        self.calls: list[tuple] = []
        self.forgotten: list[tuple] = []
        self.committed_told: list[tuple] = []

    def names_on_alive_nodes(self):
        return list(self.holders)

    def exists(self, name):
        return self.holders.get(name) is not None

    def owner(self, name, timeout_s):
        return None

    def resync(self, name, timeout_s):
        self.calls.append(("resync", name))
        return self.states.get(name)

    def lookup(self, name, keys, timeout_s):
        self.calls.append(("lookup", name, tuple(keys)))
        answer = self.holders.get(name)
        return None if answer is None else [answer(k) for k in keys]

    def forget(self, name, keys, committed=None):
        self.forgotten.append((name, tuple(keys)))
        self.committed_told.append((name, committed))

    def flush_all(self, names, timeout_s):
        """Every message of an in-process holder is delivered as it is sent: nothing is ever late."""
        self.calls.append(("flush", tuple(names)))
        return []

    def drain_all(self, names, timeout_s):
        self.calls.append(("drain", tuple(names)))
        return {n: {"drained": True} for n in names}

    def kill(self, name):
        self.calls.append(("kill", name))


class Cluster:
    """The cluster's facts a test sets: ``alive`` (``None``: every node) and ``draining``."""

    def __init__(self, alive: set[str] | None = None, draining: set[str] | None = None):
        self.alive = alive
        self.draining = set(draining or ())

    def alive_node_ids(self) -> set[str] | None:
        return None if self.alive is None else set(self.alive)

    def draining_nodes(self) -> set[str]:
        return set(self.draining)


def settings(**kw) -> ControllerSettings:
    base = dict(policy=FixedInterval(every=1), keep_last=None, tiers=[], upload_milestones_only=False)
    return ControllerSettings(**{**base, **kw})


def make_controller(
    root, key: str = "test", *, holders: Holders | None = None, cluster: Cluster | None = None, **kw
) -> Controller:
    """A controller of run ``key`` on local storage at ``root``; ``kw`` are :class:`ControllerSettings`
    fields (``keep_last=None``, ``FixedInterval(every=1)`` unless given)."""
    storage = root if isinstance(root, FsStorage) else FsStorage(pafs.LocalFileSystem(), str(root))
    extra = {} if holders is None else {"holders": holders}
    return Controller(key, storage, settings(**kw), cluster=cluster, **extra)


def wait_idle(ctl: Controller, timeout_s: float = 60) -> None:
    """Until the controller's maintenance thread (keep-last, uploads, re-reads) has nothing to do."""
    deadline = time.monotonic() + timeout_s
    while not ctl._maintenance.idle():
        assert time.monotonic() < deadline, "the controller's maintenance did not finish"
        time.sleep(0.01)


def meta(rank: int = 0, world_size: int = 1, *, replicated: bool = False, **kw) -> SnapshotMeta:
    return SnapshotMeta(
        rank=rank, world_size=world_size, replicated=replicated, epoch=0, **{"kind": CheckpointKind.SCHEDULED, **kw}
    )


def staged(gen: int, step: int, section: str, holder: str = "h", node: str = "", m: SnapshotMeta | None = None):
    """What a holder sends once it holds ``section`` of ``step``."""
    m = m if m is not None else meta(section_rank(section))
    return PartStaged(generation=gen, step=step, section=section, holder=holder, nbytes=8, meta=m, node_id=node)


def durable(storage, gen: int, step: int, section: str, holder: str = "h", size: int = 8) -> PartDurable:
    """Phase 2 of one section for real (its files on storage) and the message that says so."""
    files = write_section(storage, step_dir(step), gen, section, np.arange(size, dtype=np.uint8) % 251, b"{}")
    return PartDurable(
        generation=gen,
        step=step,
        section=section,
        files={k: v.to_json() for k, v in files.items()},
        persist_s=0.01,
        holder=holder,
    )


def replicated(gen: int, step: int, section: str, *, peer: str, node: str, origin: str, **kw) -> PartReplicated:
    """What a holder sends once a peer holds its copy of ``section``."""
    return PartReplicated(
        generation=gen, step=step, section=section, holder=peer, node_id=node, origin=origin, nbytes=32, **kw
    )


def commit(ctl: Controller, gen: int, step: int, sections: list[str], holder: str = "h", node: str = "") -> None:
    """Every section of ``step`` staged and written, as its holders would; waits for the clean-up."""
    world = sum(1 for s in sections if s != SHARED)
    for sec in sections:
        m = meta(section_rank(sec), world, replicated=SHARED in sections)
        ctl.part_staged(staged(gen, step, sec, holder, node, m))
        ctl.part_durable(durable(ctl.storage, gen, step, sec, holder))
    wait_idle(ctl)


__all__ = [
    "Cluster",
    "Holders",
    "commit",
    "durable",
    "make_controller",
    "meta",
    "replicated",
    "settings",
    "staged",
    "wait_idle",
]
