"""Phase 2: the per-node holder actor keeps the newest snapshot of every section in the Ray object
store (owned by the holder, so it outlives the worker that took it) and a writer thread streams it
to storage, then tells the controller that the section is durable.

One holder per (run, node), named ``cf_ray.holder.<run key>.<node id>``, ``num_cpus=0``, detached,
pinned to its node. The writer runs in the holder's process, not in the training process, so a
persist never takes the training process's GIL, and a persist that has started finishes even when
the worker that staged it dies.

Bounded memory: per section the holder keeps the two newest staged entries (the newest may be
incomplete across ranks when a worker dies in the middle of a snapshot; the one before is then the
newest complete one), so ``2 x`` the section size, plus transiently the argument of a ``stage``
call.

Peer replicas (#12): with ``SnapshotMeta.replicas`` set, a replication thread copies the newest
staged entry of each section to holders of this run on other nodes (``hold_replica``: the peer
pulls the object through Ray's object transfer and owns its copy), in its own thread beside the
writer, so it never delays training or the persist: a copy not started when a newer snapshot
comes is skipped. A holder keeps the two newest copies per (origin holder, section) it was given, and
``get_section`` serves them like its own.

Coalescing is per *checkpoint*, not per section: the writer finishes every section of the step it
has started, then takes the oldest step waiting; a newer snapshot supersedes the whole of an older
one that has not started (every one of its sections), never a part of it. So when storage is
slower than the interval, intermediate snapshots are skipped and the ones written are complete
and commit; with per-section replacement each section could end up belonging to a different step,
and nothing would commit until storage caught up. Milestones and preemption checkpoints are never
superseded (priority ones are written first).

Failure: an exception while writing is reported to the controller (``part_failed``) with the rank,
step and error; the thread goes on with the next entry; nothing is committed for that step, so the
previous committed checkpoint stays the latest.

Liveness (issue #16): the messages to the controller go through a :class:`~.sender.Sender` (one
thread, a bounded FIFO, each message acknowledged; the controller looked up again by name and the
message sent again when the controller is dead or restarting). The holder keeps a bounded record
(the newest :data:`MAX_RECORD_STEPS` steps not known settled) of every section it was given and what
became of it — staged, then durable (files, persist time), failed or superseded — which a
controller that starts again asks for (:meth:`Holder.resync`), and which the controller's watch
asks about sections pending too long (:meth:`Holder.lookup`: a section this holder does not know,
after it died and Ray restarted it empty, fails instead of staying pending). The controller tells
the holder when a step settled (:meth:`Holder.forget`). A holder that dies is restarted by Ray
(``max_restarts=-1``) or made again by the next ``get_or_create_holder`` on its node; what it held is
gone, storage is the truth. At the end of a run the controller asks it to finish what it is writing
(:meth:`Holder.drain`) before it kills it.

Lifetime (issue #16, ``protocol/cluster.py``): a holder records the run it belongs to (the driver's
Ray job and Ray Train run); the controller's reaper ends it with the run. :func:`get_or_create_holder`
never reuses a holder whose run's driver is gone: it is drained and killed, and a new, empty one is
made (the dead run's snapshots are never restored by a new run).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import ray
import ray.exceptions

from cf_ray._engine.format import manifest as mf
from cf_ray._engine.node import shm as _shm
from cf_ray._engine.node import stream as _stream
from cf_ray._engine.node.sender import Sender
from cf_ray._engine.protocol import cluster
from cf_ray._engine.protocol.actors import resolve_live
from cf_ray._engine.protocol.cluster import Owner, current_owner, owner_gone
from cf_ray._engine.protocol.messages import (
    HolderState,
    Message,
    PartDurable,
    PartFailed,
    PartReplicated,
    PartStaged,
    PartSuperseded,
    SnapshotMeta,
)
from cf_ray._engine.protocol.naming import holder_name
from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")

#: Steps (generation, step) whose sections the holder keeps a record of, newest; a step leaves the
#: record when the controller says it settled (:meth:`Holder.forget`) or when newer ones push it out.
MAX_RECORD_STEPS = 64

#: Seconds :meth:`Holder.stage` waits for the controller to acknowledge ``part_staged`` before it
#: returns anyway (the message stays queued): once ``stage`` returned, the controller knows the
#: snapshot, so a holder that dies before writing it makes it fail instead of staying unknown.
STAGE_ACK_WAIT_S = 5.0

#: What :meth:`Holder.lookup` says of one section.
LOOKUP_DONE, LOOKUP_HELD, LOOKUP_UNKNOWN = "done", "held", "unknown"


@dataclass(slots=True)
class _Entry:
    """One section of one snapshot, held by this holder."""

    generation: int
    step: int
    section: str
    ref: Any
    """Where the bytes are: one of this holder's shared-memory slots (a :class:`~.shm.SlotDesc`:
    the worker copied them there), or an ObjectRef of a uint8 array owned by this holder (a snapshot
    staged by value, or a peer's copy)."""
    index: bytes
    """The section's encoded tensor index (``manifest.encode_index``; with the block checksums when
    the bytes are in a slot)."""
    size_bytes: int
    """Size of the arena."""
    meta: SnapshotMeta
    """What the rank that staged it said of the snapshot."""
    crc32: int | None = None
    """CRC-32 of the bytes, when the worker computed it (slots)."""
    shared: Any = None
    """An object-store copy of a slot's bytes, made once for readers on other nodes."""
    origin: str = ""
    """For a peer's copy: the holder that has the section itself, its node, and how long the copy took."""
    origin_node: str = ""
    copy_s: float = 0.0


class Holder:
    """The holder's logic (the Ray actor class is :data:`HolderActor`)."""

    def __init__(self, storage: Storage, controller_name: str, namespace: str, owner: Owner | None = None):
        self.storage = storage
        self._owner = owner
        self.controller_name = controller_name
        self.namespace = namespace
        self._name = _actor_name()
        self._node = _node_id()
        self._lock = threading.Condition()
        self._latest: dict[str, list[_Entry]] = {}  # section -> the two newest entries, oldest first
        # (generation, step) -> section -> entry, staged and not started; at most one ordinary
        # step (newer ones supersede it) besides milestones and priority checkpoints.
        self._waiting: dict[tuple[int, int], dict[str, _Entry]] = {}
        self._current: tuple[int, int] | None = None  # the step being written
        self._current_left: dict[str, _Entry] = {}  # its sections not yet started
        # Steps whose writing has started (newest last, bounded): never superseded, and finished
        # first when a section of theirs arrives late (another rank's stage call came after the
        # writer had moved on), so that nothing half-written is left behind.
        self._started: list[tuple[int, int]] = []
        self._writing: _Entry | None = None
        # (generation, step) -> section -> [PartStaged, outcome or None]: what the controller may ask
        # again (resync, lookup); the newest MAX_RECORD_STEPS steps not known settled.
        self._record: collections.OrderedDict[tuple[int, int], dict[str, list]] = collections.OrderedDict()
        self._generation = 0  # the newest generation staged here
        self._sender = Sender(controller_name, namespace)
        # Peer replicas (#12): the newest staged entry of each section waiting to be copied to a
        # holder of another node (an older one not started is skipped), and the copies this holder
        # keeps for holders of other nodes, the two newest per (origin holder, section).
        self._to_replicate: dict[str, _Entry] = {}
        self._replicas: dict[tuple[str, str], list[_Entry]] = {}
        # Snapshot slots (#14): two shared-memory slots per section that the workers of this node
        # copy into; shared locks this holder keeps on the slots of milestones and preemption
        # checkpoints until they are written; bytes this holder copied on the host (benchmark).
        self._pairs: dict[str, _shm.SlotPair] = {}
        self._pins: dict[tuple[int, int, str], _shm.ReadLock] = {}
        self._copied_bytes = 0
        self._no_peer_logged = False
        # Direct transfers to readers on other nodes (#12, ``stream.py``), started on first use.
        self._server: _stream.SectionServer | None = None
        self._server_failed = False
        self._thread = threading.Thread(target=self._writer, name="cf_ray-persist", daemon=True)
        self._thread.start()
        self._replicator_thread = threading.Thread(target=self._replicator, name="cf_ray-replicate", daemon=True)
        self._replicator_thread.start()

    # -- called by workers -------------------------------------------------------------------
    def arena(self, section: str, nbytes: int) -> list[str] | None:
        """The two shared-memory slots of ``section`` for snapshots of ``nbytes`` (made on first use,
        made again when the size changed): paths a worker of this node opens and maps. ``None`` when
        this platform has no anonymous shared memory (the worker then hands snapshots over by value)."""
        if not _shm.available():
            return None
        with self._lock:
            pair = self._pairs.get(section)
            if pair is None or pair.nbytes != nbytes:
                if pair is not None:
                    pair.close()  # its entries can no longer be read: readers find the slot gone
                pair = self._pairs[section] = _shm.SlotPair(section, nbytes)
            return list(pair.paths)

    def held_bytes(self) -> dict:
        """Host memory this holder holds for snapshots: ``slots`` (resident pages of the slots),
        ``objects`` (object-store copies: by-value snapshots, peers' copies, copies for other nodes),
        and ``copied`` (bytes it copied on the host so far: puts and page-cache writes)."""
        with self._lock:
            slots = sum(p.resident_bytes() for p in self._pairs.values())
            entries = [e for kept in (*self._latest.values(), *self._replicas.values()) for e in kept]
            objects = sum(e.size_bytes for e in entries if not isinstance(e.ref, _shm.SlotDesc))
            objects += sum(e.size_bytes for e in entries if e.shared is not None)
            return {"slots": slots, "objects": objects, "copied": self._copied_bytes}

    def _slot_known(self, desc: _shm.SlotDesc) -> bool:
        return any(desc.path in p.paths for p in self._pairs.values())

    def stage(self, generation: int, step: int, sections: dict[str, tuple], meta: SnapshotMeta) -> dict:
        """Take ownership of a snapshot's sections and queue them for persisting. Returns
        ``{"put_s": seconds to own the bytes, "acked": whether the controller acknowledged it}``
        once the controller has acknowledged ``part_staged`` (at most :data:`STAGE_ACK_WAIT_S`)."""
        t0 = time.perf_counter()
        entries = []
        unknown = []
        for name, staged_section in sections.items():
            desc = staged_section[0]
            if isinstance(desc, _shm.SlotDesc):
                # In one of this holder's slots already: nothing to copy. (slot, index, crc32)
                index, crc = staged_section[1], staged_section[2]
                if not self._slot_known(desc):
                    unknown.append(name)  # a slot of this holder's previous life (Ray restarted it)
                    continue
                entries.append(_Entry(generation, step, name, desc, bytes(index), desc.nbytes, meta, crc32=crc))
                continue
            arena, index = cast(np.ndarray, staged_section[0]), staged_section[1]
            # The argument lives in an object owned by the calling worker; re-put it so that this
            # holder owns the bytes and they survive the worker.
            ref = ray.put(arena)
            self._copied_bytes += int(arena.nbytes)
            entries.append(_Entry(generation, step, name, ref, bytes(index), int(arena.nbytes), meta))
        if unknown:
            return {"put_s": 0.0, "acked": False, "unknown_slots": unknown}
        if meta.persist and (meta.milestone or meta.priority):
            for e in entries:  # never superseded: its slot is not filled again before it is written
                self._pin(e)
        put_s = time.perf_counter() - t0
        superseded = []
        key = (generation, step)
        staged = [
            PartStaged(
                generation=e.generation,
                step=e.step,
                section=e.section,
                holder=self._name,
                nbytes=e.size_bytes,
                meta=meta,
                holder_put_s=put_s,
                node_id=self._node,
                holder_copied_bytes=0 if isinstance(e.ref, _shm.SlotDesc) else e.size_bytes,
            )
            for e in entries
        ]
        with self._lock:
            self._generation = max(self._generation, generation)
            for e in entries:
                kept = self._latest.setdefault(e.section, [])
                kept.append(e)
                del kept[:-2]
            skipped = []
            if meta.replicas != 0:
                for e in entries:
                    old = self._to_replicate.get(e.section)
                    if old is not None and (old.generation, old.step) < (e.generation, e.step):
                        skipped.append(old)
                    self._to_replicate[e.section] = e
            if meta.persist:
                for msg in staged:
                    self._record_staged(msg)
                if key == self._current:  # a late section of the step being written
                    self._current_left.update({e.section: e for e in entries})
                    for e in entries:
                        self._pin(e)
                else:
                    self._waiting.setdefault(key, {}).update({e.section: e for e in entries})
                    for older in [k for k in self._waiting if k < key]:
                        if older in self._started or any(
                            e.meta.milestone or e.meta.priority for e in self._waiting[older].values()
                        ):
                            continue  # never skipped
                        for e in self._waiting.pop(older).values():
                            msg = PartSuperseded(
                                generation=e.generation, step=e.step, section=e.section, holder=self._name
                            )
                            self._record_outcome(msg)
                            superseded.append(msg)
            self._lock.notify_all()
        acks = [self._sender.send("part_staged", msg) for msg in staged]
        for msg in superseded:
            self._sender.send("part_superseded", msg)
        for old in skipped:  # its copy had not started when a newer snapshot came: never delays the newest
            self._sender.send(
                "part_replicated",
                PartReplicated(
                    generation=old.generation,
                    step=old.step,
                    section=old.section,
                    holder="",
                    node_id="",
                    origin=self._name,
                    skipped=True,
                ),
            )
        deadline = time.monotonic() + STAGE_ACK_WAIT_S
        acked = all(a.wait(max(0.0, deadline - time.monotonic())) for a in acks)
        return {"put_s": put_s, "acked": acked}

    def get_section(
        self, generation: int, step: int, section: str, node_id: str = "", stream: bool = True
    ) -> list | None:
        """``[where, index bytes]`` if held (its own, or a peer's replica), else ``None``. ``where`` is
        a :class:`~.shm.SlotDesc` when the bytes are in a slot and the reader is on this node
        (``node_id``): it maps the slot and reads it in place. For a reader on another node it is a
        :class:`~.stream.StreamDesc` (``stream``, unless ``CF_RAY_PEER_STREAM=0``): the reader
        fetches the bytes over a direct connection to this holder, sent straight from the slot or
        from this node's object store; otherwise an ObjectRef (a slot's bytes are put into the
        object store once for readers on other nodes)."""
        with self._lock:
            waiting = [e for secs in self._waiting.values() for e in secs.values()]
            copies = [e for kept in self._replicas.values() for e in kept]
            found = None
            for e in (*self._latest.get(section, ()), self._writing, *self._current_left.values(), *waiting, *copies):
                if e is not None and e.section == section and e.generation == generation and e.step == step:
                    found = e
                    break
        if found is None:
            return None
        local = bool(node_id) and node_id == self._node
        server = self._stream_server() if stream and not local else None
        if not isinstance(found.ref, _shm.SlotDesc):
            if server is None:
                return [found.ref, found.index]
            arena = cast(np.ndarray, ray.get(found.ref))  # this node's object store: no copy
            desc = server.offer(found.size_bytes, lambda: None, buffer=arena.data)
            return [desc, found.index]
        lk = _shm.ReadLock.take(found.ref.path, generation, step, found.ref.seq, wait_s=1.0)
        if lk is None:
            return None  # filled again by a newer snapshot since
        if server is not None:
            # The lock is held until the reader has the bytes (or the offer expires).
            return [server.offer(found.size_bytes, lk.close, fd=lk.fd, offset=_shm.HEADER_BYTES), found.index]
        try:
            if local:
                return [found.ref, found.index]
            if found.shared is None:
                found.shared = ray.put(np.frombuffer(lk.data, dtype=np.uint8))
                self._copied_bytes += found.size_bytes
            return [found.shared, found.index]
        finally:
            lk.close()

    def withdraw_offer(self, ticket: int) -> bool:
        """A reader could not fetch an offered section (``get_section``): release it now, not after
        its time-out (an offered slot stays locked until then)."""
        return self._server is not None and self._server.withdraw(ticket)

    def _stream_server(self) -> _stream.SectionServer | None:
        """This holder's :class:`~.stream.SectionServer` (started on first use); ``None`` when
        ``CF_RAY_PEER_STREAM=0`` or it cannot listen (readers then get objects)."""
        from cf_ray._engine import env as _env

        if not _env.get_int(_env.PEER_STREAM):
            return None
        with self._lock:
            if self._server is None and not self._server_failed:
                try:
                    self._server = _stream.SectionServer(ray.util.get_node_ip_address())
                except OSError as e:
                    self._server_failed = True
                    logger.warning(
                        "cf_ray: holder %s cannot listen for direct section transfers (%s); "
                        "readers on other nodes get its sections through the object store",
                        self._name,
                        e,
                    )
            return self._server

    # -- called by the holders of other nodes -------------------------------------------------------------
    def hold_replica(
        self,
        generation: int,
        step: int,
        section: str,
        refs: list,
        index: bytes,
        meta: SnapshotMeta,
        origin: str,
        origin_node: str = "",
    ) -> dict:
        """Keep a copy of a section held by holder ``origin`` of another node. ``refs[0]`` is the
        origin's object (in a list, so that Ray hands this method the reference, not the value): it
        is pulled to this node by Ray's object transfer and put again, owned by this holder, so the
        copy outlives the origin's node. Returns ``{"holder", "node_id", "put_s"}``."""
        t0 = time.perf_counter()
        from cf_ray._engine import env as _env

        if delay_s := _env.replica_pull_delay_s(step):  # tests only: a copy in flight
            time.sleep(delay_s)
        arena = cast(np.ndarray, ray.get(refs[0]))
        ref = ray.put(arena)
        nbytes = int(arena.nbytes)
        self._copied_bytes += nbytes
        del arena  # the pulled copy is released; this holder's own object stays
        seconds = time.perf_counter() - t0
        entry = _Entry(
            generation,
            step,
            section,
            ref,
            bytes(index),
            nbytes,
            meta,
            origin=origin,
            origin_node=origin_node,
            copy_s=seconds,
        )
        with self._lock:
            kept = self._replicas.setdefault((origin, section), [])
            kept.append(entry)
            kept.sort(key=lambda e: (e.generation, e.step))
            del kept[:-2]
        return {"holder": self._name, "node_id": self._node, "put_s": seconds}

    # -- called by the controller ----------------------------------------------------------------
    def resync(self) -> HolderState:
        """Everything in the record: each section given to this holder (of the steps not known
        settled) and what became of it, for a controller that starts again (or that first hears
        of this holder). The controller's handlers are idempotent: what it knew already is harmless."""
        with self._lock:
            staged = tuple(v[0] for secs in self._record.values() for v in secs.values())
            outcomes = tuple(v[1] for secs in self._record.values() for v in secs.values() if v[1] is not None)
            said = [self._copy_said(e) for kept in self._replicas.values() for e in kept]
            return HolderState(
                holder=self._name,
                node_id=self._node,
                generation=self._generation,
                staged=staged,
                outcomes=outcomes,
                replicas=tuple(r for r, _ in said),
                replica_origins=tuple(o for _, o in said),
            )

    def _copy_said(self, e: _Entry) -> tuple[PartReplicated, PartStaged]:
        """What was said of a copy this holder keeps: by it (``part_replicated``) and, of the
        section, by the origin (``part_staged``)."""
        gen, step, sec, n = e.generation, e.step, e.section, e.size_bytes
        return (
            PartReplicated(
                generation=gen, step=step, section=sec, nbytes=n, holder=self._name, node_id=self._node,
                origin=e.origin, seconds=e.copy_s,
            ),
            PartStaged(generation=gen, step=step, section=sec, nbytes=n, holder=e.origin, meta=e.meta, node_id=e.origin_node),
        )  # fmt: skip

    def lookup(self, keys: list[tuple[int, int, str]]) -> list[tuple[str, PartStaged | None, Message | None]]:
        """What became of each ``(generation, step, section)``: ``("done", staged, outcome)`` when
        it was written, failed or superseded; ``("held", staged, None)`` while it waits or is being
        written; ``("unknown", None, None)`` when this holder does not have it (it was restarted
        empty, or never had it): the controller then fails it instead of waiting for ever."""
        out = []
        with self._lock:
            live = {
                (e.generation, e.step, e.section)
                for e in (
                    *(e for secs in self._waiting.values() for e in secs.values()),
                    *self._current_left.values(),
                    self._writing,
                )
                if e is not None
            }
            for gen, step, sec in keys:
                rec = self._record.get((gen, step), {}).get(sec)
                if rec is not None and rec[1] is not None:
                    out.append((LOOKUP_DONE, rec[0], rec[1]))
                elif rec is not None or (gen, step, sec) in live:
                    out.append((LOOKUP_HELD, rec[0] if rec is not None else None, None))
                else:
                    out.append((LOOKUP_UNKNOWN, None, None))
        return out

    def forget(self, keys: list[tuple[int, int]], committed: tuple[int, int] | None = None) -> None:
        """These steps settled (committed, failed, superseded, abandoned): drop their record.
        ``committed``: the ``(generation, step)`` of a checkpoint now on storage; the copies kept for
        other nodes of an older step or generation can no longer be restored (a restore from memory
        takes a step at least as new as storage) and are dropped, those of a lost node's holder too."""
        with self._lock:
            for gen, step in keys:
                self._record.pop((int(gen), int(step)), None)
            if committed is not None:
                gen, step = int(committed[0]), int(committed[1])
                for key in list(self._replicas):
                    kept = [e for e in self._replicas[key] if e.generation >= gen and e.step >= step]
                    if kept:
                        self._replicas[key] = kept
                    else:
                        del self._replicas[key]

    def drain(self, timeout_s: float) -> dict:
        """Finish what is queued and being written, and deliver its messages, for at most
        ``timeout_s`` (the controller's shutdown, before it kills this holder). Returns
        ``{"drained": bool, "waiting": [[generation, step], ...], "writing": [generation, step, section]
        | None, "unsent": n}``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._waiting or self._current_left or self._writing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(timeout=min(left, 0.5))
            waiting = sorted(
                [list(k) for k in self._waiting]
                + ([list(self._current)] if self._current_left and self._current is not None else [])
            )
            writing = (
                None if self._writing is None else [self._writing.generation, self._writing.step, self._writing.section]
            )
        sent = self._sender.wait_idle(max(0.0, deadline - time.monotonic()))
        unsent = self._sender.pending()
        return {
            "drained": not waiting and writing is None and sent,
            "waiting": waiting,
            "writing": writing,
            "unsent": unsent,
        }

    def ping(self) -> str:
        """This holder's name (a cheap liveness check)."""
        return self._name

    def owner(self) -> Owner | None:
        """The run this holder belongs to (``None``: unknown)."""
        return self._owner

    # -- the record --------------------------------------------------------------------------------
    def _record_staged(self, msg: PartStaged) -> None:
        key = (msg.generation, msg.step)
        secs = self._record.get(key)
        if secs is None:
            secs = self._record[key] = {}
            while len(self._record) > MAX_RECORD_STEPS:
                self._record.popitem(last=False)
        secs[msg.section] = [msg, None]

    def _record_outcome(self, msg: PartDurable | PartFailed | PartSuperseded) -> None:
        rec = self._record.get((msg.generation, msg.step), {}).get(msg.section)
        if rec is not None:
            rec[1] = msg

    # -- writer thread -------------------------------------------------------------------------
    def _next(self) -> _Entry:
        """The next section to write (blocks until there is one)."""
        with self._lock:
            while not self._waiting and not self._current_left:
                self._lock.wait(timeout=1.0)
            if not self._current_left:
                # Finish started steps first, then priority (preemption), then the oldest step, so
                # commits happen in step order.
                self._current = min(
                    self._waiting,
                    key=lambda k: (
                        k not in self._started,
                        not any(e.meta.priority for e in self._waiting[k].values()),
                        k,
                    ),
                )
                self._current_left = self._waiting.pop(self._current)
                # A step whose writing starts is never superseded, not even in part: its other
                # sections' slots are not filled again before they are written (without this, with
                # storage slower than two snapshots, every started step lost a section and nothing
                # committed).
                for e in self._current_left.values():
                    self._pin(e)
                if self._current not in self._started:
                    self._started.append(self._current)
                    del self._started[:-16]
            section = min(self._current_left)
            self._writing = self._current_left.pop(section)
            return self._writing

    def _writer(self) -> None:
        while True:
            entry = self._next()
            t0 = time.perf_counter()
            outcome: PartDurable | PartFailed
            try:
                directory = mf.step_dir(entry.step)
                copied = crc_read = 0
                if isinstance(entry.ref, _shm.SlotDesc):
                    written = self._write_slot(entry, directory)
                    files, copied = written if written is not None else (None, 0)
                    if files is None:
                        gone = PartSuperseded(
                            generation=entry.generation, step=entry.step, section=entry.section, holder=self._name
                        )
                        with self._lock:
                            self._record_outcome(gone)
                            self._writing = None
                            self._lock.notify_all()
                        self._sender.send("part_superseded", gone)
                        continue
                else:
                    arena = cast(np.ndarray, ray.get(entry.ref))
                    files = mf.write_section(
                        self.storage, directory, entry.generation, entry.section, arena, entry.index
                    )
                    # Through the bounce buffer (or the page cache); checksummed whole and by block.
                    copied, crc_read = int(arena.nbytes), 2 * int(arena.nbytes)
                    self._copied_bytes += copied
                    del arena
                outcome = PartDurable(
                    generation=entry.generation,
                    step=entry.step,
                    section=entry.section,
                    files={k: v.to_json() for k, v in files.items()},
                    persist_s=time.perf_counter() - t0,
                    holder=self._name,
                    copied_bytes=copied,
                    crc_read_bytes=crc_read,
                )
            except Exception as e:  # noqa: BLE001 - never kill the thread; the controller reports it
                logger.warning("cf_ray: persisting %s of step %d failed: %r", entry.section, entry.step, e)
                outcome = PartFailed(
                    generation=entry.generation,
                    step=entry.step,
                    section=entry.section,
                    error=f"{type(e).__name__}: {e}",
                    holder=self._name,
                )
            with self._lock:
                # The outcome is in the record before the entry stops being "being written": a
                # lookup in between never finds the section unknown.
                self._record_outcome(outcome)
                self._writing = None
                self._lock.notify_all()
            self._sender.send("part_durable" if isinstance(outcome, PartDurable) else "part_failed", outcome)

    def _pin(self, e: _Entry) -> None:
        """Hold ``e``'s slot (if it is in one) with a shared lock until the writer takes it."""
        key = (e.generation, e.step, e.section)
        if isinstance(e.ref, _shm.SlotDesc) and key not in self._pins:
            lk = _shm.ReadLock.take(e.ref.path, e.generation, e.step, e.ref.seq)
            if lk is not None:
                self._pins[key] = lk

    def _write_slot(self, entry: _Entry, directory: str) -> tuple[dict, int] | None:
        """Write a section straight from its slot (shared lock; ``None`` when the slot was filled
        again by a newer snapshot before this write started: the step was coalesced away)."""
        assert isinstance(entry.ref, _shm.SlotDesc)
        key = (entry.generation, entry.step, entry.section)
        with self._lock:
            lk = self._pins.pop(key, None)
        if lk is None:
            lk = _shm.ReadLock.take(entry.ref.path, entry.generation, entry.step, entry.ref.seq)
        if lk is None:
            logger.info(
                "cf_ray: %s of step %d was overwritten by a newer snapshot before its write started; skipped",
                entry.section,
                entry.step,
            )
            return None
        try:
            assert entry.crc32 is not None
            files, copied = mf.write_section_slot(
                self.storage, directory, entry.generation, entry.section, lk.data, entry.index, entry.crc32
            )
            self._copied_bytes += copied
            return files, copied
        finally:
            lk.close()

    # -- replication thread (#12) -----------------------------------------------------------------------
    def _replicator(self) -> None:
        while True:
            with self._lock:
                while not self._to_replicate:
                    self._lock.wait(timeout=1.0)
                section = min(self._to_replicate, key=lambda k: (self._to_replicate[k].step, k))
                entry = self._to_replicate.pop(section)
            try:
                self._replicate(entry)
            except Exception:  # noqa: BLE001 - the thread never dies; a copy is an optimisation
                logger.warning("cf_ray: replicating %s of step %d failed", entry.section, entry.step, exc_info=True)

    def _replicate(self, entry: _Entry) -> None:
        peers = self._peers(entry.meta.replicas, entry.meta.replica_label, entry.section)
        if not peers:
            return
        ref = entry.ref
        if isinstance(ref, _shm.SlotDesc):
            # The peer pulls an object: the slot's bytes are put into the object store once.
            lk = _shm.ReadLock.take(ref.path, entry.generation, entry.step, ref.seq)
            if lk is None:
                return  # filled again since: a newer snapshot is on its way
            try:
                ref = ray.put(np.frombuffer(lk.data, dtype=np.uint8))
                self._copied_bytes += entry.size_bytes
            finally:
                lk.close()
        for node_id, peer in peers:
            t0 = time.perf_counter()
            msg: PartReplicated
            try:
                got: dict = ray.get(
                    peer.hold_replica.remote(
                        entry.generation,
                        entry.step,
                        entry.section,
                        [ref],
                        entry.index,
                        entry.meta,
                        self._name,
                        origin_node=self._node,
                    ),
                    timeout=max(30.0, entry.size_bytes / 50e6),
                )
                msg = PartReplicated(
                    generation=entry.generation,
                    step=entry.step,
                    section=entry.section,
                    holder=got["holder"],
                    node_id=got["node_id"],
                    origin=self._name,
                    nbytes=entry.size_bytes,
                    seconds=time.perf_counter() - t0,
                )
            except Exception as e:  # noqa: BLE001 - the peer died, or its node is gone: reported
                msg = PartReplicated(
                    generation=entry.generation,
                    step=entry.step,
                    section=entry.section,
                    holder="",
                    node_id=node_id,
                    origin=self._name,
                    error=f"{type(e).__name__}: {e}",
                )
            self._sender.send("part_replicated", msg)

    def _peers(self, wanted: int, label: str, section: str) -> list[tuple[str, Any]]:
        """Up to ``wanted`` holders of this run on other alive, not draining nodes (``-1``: one when
        the cluster has more than one node), in another failure domain when ``label`` names one:
        ``[(node id, handle)]``. Spread over the candidates by section."""
        nodes = cluster.alive_nodes()
        if wanted < 0:
            wanted = 1 if len(nodes) > 1 else 0
        if wanted == 0:
            return []
        draining = cluster.draining_nodes()
        mine = next((n for n in nodes if n["NodeID"] == self._node), None)
        domain = ((mine or {}).get("Labels") or {}).get(label) if label else None
        prefix = self._name.rsplit(".", 1)[0]
        found: list[tuple[str, Any]] = []
        for n in nodes:
            nid = n["NodeID"]
            if nid == self._node or nid in draining:
                continue
            if label and ((n.get("Labels") or {}).get(label) == domain or domain is None):
                continue  # the same failure domain (or this node's is unknown: none is known to differ)
            try:
                found.append((nid, ray.get_actor(f"{prefix}.{nid}", namespace=self.namespace)))
            except ValueError:
                continue  # no worker of this run on that node: no holder there
        if not found:
            if not self._no_peer_logged:
                self._no_peer_logged = True
                logger.warning(
                    "cf_ray: no holder of this run on another%s node to copy snapshots to; they stay on "
                    "this node only (its loss means restoring from storage)",
                    f" {label!r} domain's" if label else "",
                )
            return []
        self._no_peer_logged = False
        start = sum(section.encode()) % len(found)
        return (found[start:] + found[:start])[:wanted]


def _actor_name() -> str:
    try:
        return (ray.get_runtime_context().get_actor_name() or "") if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        return ""


def _node_id() -> str:
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001
        return ""


# max_restarts=-1: a holder that crashes (OOM) is started again on its node by Ray, empty; the
# workers' handles keep working and their next snapshot goes to it.
HolderActor = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=-1)(Holder)  # pyright: ignore[reportCallIssue] - see ControllerActor


def get_or_create_holder(run_key: str, storage: Storage, controller_name: str, namespace: str):
    """The holder of this node for this run (created on first use, pinned to this node; made again
    when the previous one died for good — Ray restarts one that crashed). One left by a run whose
    driver is gone is drained and killed first, never reused."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    name = holder_name(run_key, node_id)
    owner = current_owner()
    _retire_if_dead_run(name, namespace, owner)
    return HolderActor.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(storage, controller_name, namespace, owner)


def _retire_if_dead_run(name: str, namespace: str, owner: Owner) -> None:
    """Drain and kill holder ``name`` when it belongs to another run whose driver is gone."""
    from cf_ray._engine import env as _env

    try:
        h = ray.get_actor(name, namespace=namespace)
        theirs = cast("Owner | None", ray.get(h.owner.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)))
    except (ValueError, AttributeError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return  # none, gone, busy or from before owners were recorded: left as it is
    if owner.same_run(theirs) or owner_gone(theirs) is None:
        return
    logger.warning(
        "cf_ray: holder %s belongs to a run whose driver is gone (job %s); draining and killing it, "
        "its snapshots are not used",
        name,
        theirs.job_id if theirs else "?",
    )
    timeout_s = _env.get_float(_env.DRAIN_TIMEOUT_S)
    try:
        ray.get(h.drain.remote(timeout_s), timeout=timeout_s + 30)
    except Exception:  # noqa: BLE001 - killed anyway
        pass
    try:
        ray.kill(h, no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    old, deadline = h._actor_id, time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if ray.get_actor(name, namespace=namespace)._actor_id != old:
                return
        except ValueError:
            return
        time.sleep(0.1)


def resolve_holder(
    run_key: str, storage: Storage, controller_name: str, namespace: str, timeout_s: float | None = None
):
    """A live handle of this node's holder: :func:`get_or_create_holder`, then a ``ping`` that
    must answer; a dead one (killed, its name not yet released) is looked up again with backoff
    until one answers, for at most ``timeout_s`` (``CF_RAY_ACTOR_TIMEOUT_S``). Safe to call from
    several ranks of a node at once (Ray's ``get_if_exists`` makes one holder).

    Raises:
        TimeoutError: no live holder within the timeout (the last error is chained).
    """
    return resolve_live(
        lambda: get_or_create_holder(run_key, storage, controller_name, namespace),
        f"cf_ray holder for run {run_key} on this node",
        timeout_s,
    )


__all__ = ["Holder", "HolderActor", "get_or_create_holder", "resolve_holder"]
