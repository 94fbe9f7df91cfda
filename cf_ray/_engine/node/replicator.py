"""Peer copies: a holder's sections copied into holders of other nodes, so that the
snapshot outlives the loss of its node.

Origin side: with ``SnapshotMeta.replicas`` set, the newest staged entry of each section waits for
this thread (an older one not started is skipped: ``part_replicated(skipped=True)``, unless its step
is the one being copied: below), which picks
peers — holders of this run on other alive, not draining nodes (another failure domain when
``replica_label`` names one), spread over them by section — and, for each, offers the section on
this holder's :class:`~.stream.SectionServer` (a one-use token; the slot's shared lock held until it
is sent) and asks the peer to pull it (``hold_replica`` with a :class:`ReplicaOffer`). Then
``part_replicated`` with the peer, its node, bytes and seconds, or the error.

Peer side (:meth:`Replicator.receive`): the bytes go from the origin's slot (``sendfile``) straight
into a slot file of the peer's own (``SlotStore.new_copy``), each block checked against the index's
CRC-32 as it lands; the slot is then marked complete and sealed, and only then does the call return.
So the controller, which counts a copy only from ``part_replicated``, never counts a copy that is not
complete in a peer's memory. The peer says so itself too (:func:`copy_said`, sent as a one-copy
``HolderState`` through its own line to the controller): the origin's ``part_replicated`` waits in
the origin's queue, and an origin whose node goes right after a copy ended would take the only word
of that copy with it — the survivor's is what a restore plan relies on. A copy in flight when the
origin's node goes fails (the stream breaks) and is never reported (the origin is gone), and a step
half-copied at a node loss is passed over for the newest step every section of which has a copy.
One pass over the bytes on each host, by the kernel (Ray's object transfer would make three: the
origin's ``put``, the transfer, the peer's ``put``).

**A step once begun is copied whole.** Only a step every section of which has a copy can be
restored from memory after a node loss, so the thread finishes the step it started before it takes
a newer one: a newer snapshot skips the sections of a step not begun, never the remaining sections
of the step being copied (with copies slower than the interval, newest-wins per section would skip
a step's second section while its first is in flight, and with every copy that slow no step would
ever be copied whole). A remaining section whose slot the worker filled again since
is dropped (``take`` finds a newer fill), and the thread moves on. A preemption checkpoint
(``SnapshotMeta.priority``) goes first all the same: its deadline does not wait for an older step.

Time limits: the peer's pull stalls out after ``STALL_TIMEOUT_S`` without progress (no cap on the
whole transfer); the origin gives up on a peer that does not fetch its offer in ``TICKET_TTL_S`` or
whose transfer makes no progress for ``STALL_TIMEOUT_S``, and the offer's lock is released then, so
a slow or hung peer never keeps the worker's slot for long (the worker has a spare slot meanwhile).

One lock (a ``Condition``) over the queue; no Ray here but in :class:`ActorPeer` and :func:`find_peers`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from cf_ray._engine.format.blocks import BLOCK_BYTES
from cf_ray._engine.format.sections import index_blocks
from cf_ray._engine.memory import wire
from cf_ray._engine.memory.crc import BlockCheck
from cf_ray._engine.memory.slots import HEADER_BYTES
from cf_ray._engine.node.slot_store import Held, SlotStore
from cf_ray._engine.node.stream import Offer, SectionServer
from cf_ray._engine.protocol.messages import (
    HolderState,
    Message,
    PartReplicated,
    PartStaged,
    ReplicaHeld,
    ReplicaOffer,
    SnapshotMeta,
)

logger = logging.getLogger("cf_ray")


class Peer(Protocol):
    """A holder of another node, as the replicator asks it to keep a copy."""

    node_id: str

    def hold(self, offer: ReplicaOffer, watch: Offer) -> ReplicaHeld:
        """Have the peer pull ``offer`` (``watch``: its progress on this side); raises on failure."""
        ...


class Replicator:
    """The origin's queue and thread, and the peer's :meth:`receive`.

    Args:
        store: this holder's slots and copies.
        holder, node: this holder's name and node.
        server: returns this holder's section server (started on first use), or ``None``.
        peers: ``(meta, section) -> [Peer]``: where a section's copies go.
        send: ``(method, message)``: to the controller.
    """

    def __init__(
        self,
        store: SlotStore,
        holder: str,
        node: str,
        server: Callable[[], SectionServer | None],
        peers: Callable[[SnapshotMeta, str], list[Peer]],
        send: Callable[[str, Message], Any],
    ):
        self._store = store
        self._holder = holder
        self._node = node
        self._server = server
        self._peers = peers
        self._send = send
        self._cond = threading.Condition()
        self._queue: dict[str, Held] = {}  # section -> the newest entry waiting to be copied
        self._current: tuple[int, int] | None = None  # the step being copied (generation, step)
        self._finishing: dict[str, Held] = {}  # its sections still to copy, though newer ones wait
        self._failing: set[str] = set()  # peers' nodes whose last copy failed (said once, until one works)
        self.copied_bytes = 0
        """Bytes received into this holder's copies (one pass on the host, by the kernel)."""
        self._thread = threading.Thread(target=self._run, name="cf_ray-replicate", daemon=True)
        self._thread.start()

    def enqueue(self, entries: list[Held]) -> list[PartReplicated]:
        """Queue sections for copying; returns those of older snapshots it skips (not started)."""
        skipped = []
        with self._cond:
            for e in entries:
                old = self._queue.get(e.section)
                if old is not None and old.when < e.when and old.when == self._current:
                    self._finishing[old.section] = old  # the step being copied is finished first
                elif old is not None and old.when < e.when:
                    skipped.append(
                        PartReplicated(
                            generation=old.generation,
                            step=old.step,
                            section=old.section,
                            holder="",
                            node_id="",
                            origin=self._holder,
                            skipped=True,
                        )
                    )
                self._queue[e.section] = e
            self._cond.notify_all()
        return skipped

    # -- peer side --------------------------------------------------------------------------------
    def receive(self, offer: ReplicaOffer, wait_s: float) -> ReplicaHeld:
        """Pull ``offer`` into a new slot of this holder's; returns once the copy is complete, checked
        and sealed (module doc). Raises on a failed, stalled, short or corrupt transfer (nothing kept)."""
        t0 = time.perf_counter()
        nbytes = offer.stream.nbytes
        slot = self._store.new_copy(offer.origin, offer.origin_node, offer.section, nbytes)
        try:
            view = slot.fill()
            blocks = index_blocks(offer.index, f"copy of {offer.section}")
            check = BlockCheck(
                view,
                blocks.size if blocks is not None else BLOCK_BYTES,
                list(blocks.crc32) if blocks is not None else None,
                offer.crc32,
            )
            wire.fetch_into(offer.stream, view, wait_s=wait_s, landed=check.landed)
            check.finish()
            del check
            view.release()
            desc = slot.seal(offer.generation, offer.step)
        except BaseException:
            slot.close()
            raise
        seconds = time.perf_counter() - t0
        held = Held(
            offer.generation,
            offer.step,
            offer.section,
            desc,
            offer.index,
            offer.crc32,
            offer.meta,
            origin=offer.origin,
            origin_node=offer.origin_node,
            copy_s=seconds,
        )
        self._store.add_copy(held, slot)
        self.copied_bytes += nbytes
        said, origin = copy_said(held, self._holder, self._node)
        self._send(
            "apply_holder_state",
            HolderState(holder=self._holder, node_id=self._node, replicas=(said,), replica_origins=(origin,)),
        )
        return ReplicaHeld(holder=self._holder, node_id=self._node, nbytes=nbytes, seconds=seconds)

    # -- origin side ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._finishing:
                    self._cond.wait(timeout=1.0)
                entry = self._next()
            try:
                self._replicate(entry)
            except Exception:  # noqa: BLE001 - the thread never dies; a copy is an optimisation
                logger.warning("cf_ray: replicating %s of step %d failed", entry.section, entry.step, exc_info=True)

    def _next(self) -> Held:
        """The next section to copy (under the lock): a priority snapshot's (a preemption checkpoint's:
        its deadline will not wait), then the step being copied, then the oldest step waiting (its
        other sections next, by name)."""
        urgent = [k for k, e in self._queue.items() if e.meta.priority]
        if self._finishing and not urgent:
            return self._finishing.pop(min(self._finishing))
        pool = urgent or list(self._queue)
        section = min(pool, key=lambda k: (self._queue[k].when, k))
        entry = self._queue.pop(section)
        self._current = entry.when
        return entry

    def _replicate(self, entry: Held) -> None:
        peers = self._peers(entry.meta, entry.section)
        if not peers:
            return
        server = self._server()
        for peer in peers:
            t0 = time.perf_counter()
            lk = self._store.take(entry)
            if lk is None:
                return  # filled again since: a newer snapshot is on its way
            if server is None:
                lk.close()
                msg = self._failed(entry, peer.node_id, "this holder cannot listen for direct transfers")
                self._send("part_replicated", msg)
                return
            desc, watch = server.offer(entry.nbytes, lk.close, fd=lk.fd, offset=HEADER_BYTES)
            offer = ReplicaOffer(
                generation=entry.generation,
                step=entry.step,
                section=entry.section,
                index=entry.index,
                crc32=entry.crc32,
                meta=entry.meta,
                origin=self._holder,
                origin_node=self._node,
                stream=desc,
            )
            try:
                got = peer.hold(offer, watch)
                msg = PartReplicated(
                    generation=entry.generation,
                    step=entry.step,
                    section=entry.section,
                    holder=got.holder,
                    node_id=got.node_id,
                    origin=self._holder,
                    nbytes=entry.nbytes,
                    seconds=time.perf_counter() - t0,
                )
                self._store.note_copied(entry)
                self._failing.discard(peer.node_id)
            except Exception as e:  # noqa: BLE001 - the peer died, its node is gone, the transfer failed: reported
                server.withdraw(desc.token)  # its slot's lock is released now
                cause = getattr(e, "cause", None)  # a RayTaskError's own: what the peer raised
                err = cause if isinstance(cause, BaseException) else e
                msg = self._failed(entry, peer.node_id, f"{type(err).__name__}: {err}")
                if peer.node_id not in self._failing:  # said once per peer, until a copy to it works
                    self._failing.add(peer.node_id)
                    logger.warning(
                        "cf_ray: copying %s of step %d to the holder on node %s failed (%s); until a copy "
                        "there works, a restore after losing this node takes an older copy or storage",
                        entry.section,
                        entry.step,
                        peer.node_id[:12],
                        msg.error[:500],
                    )
            self._send("part_replicated", msg)

    def _failed(self, entry: Held, node_id: str, error: str) -> PartReplicated:
        return PartReplicated(
            generation=entry.generation,
            step=entry.step,
            section=entry.section,
            holder="",
            node_id=node_id,
            origin=self._holder,
            error=error,
        )


class ActorPeer:
    """A peer holder actor: ``hold_replica`` in its ``peer`` concurrency group, watched for progress."""

    def __init__(self, node_id: str, handle: Any):
        self.node_id = node_id
        self.handle = handle

    def hold(self, offer: ReplicaOffer, watch: Offer) -> ReplicaHeld:
        import ray

        from cf_ray._engine import env as _env
        from cf_ray._engine.node import stream as _stream

        ref = self.handle.hold_replica.remote(offer)
        done_at: float | None = None
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                return ray.get(ref)
            now = time.monotonic()
            if watch.state == "dropped" or (watch.state == "offered" and now > watch.expires):
                raise TimeoutError(f"the peer did not fetch the section within {_stream.TICKET_TTL_S:.0f} s")
            if watch.state == "sending" and now - watch.progress_at > wire.STALL_TIMEOUT_S:
                raise TimeoutError(f"the transfer to the peer made no progress for {wire.STALL_TIMEOUT_S:.0f} s")
            if watch.state in ("served", "failed"):  # the peer's answer (or its error) is on its way
                done_at = done_at or now
                if now - done_at > _env.get_float(_env.ACTOR_TIMEOUT_S):
                    raise TimeoutError("the peer did not answer after the transfer")


def copy_said(h: Held, holder: str, node: str) -> tuple[PartReplicated, PartStaged]:
    """What is said of a copy a holder keeps: by it (``part_replicated``) and, of the section, by
    its origin (``part_staged``) — as the copy is received, and again in ``Holder.resync``."""
    gen, step, sec, n = h.generation, h.step, h.section, h.nbytes
    return (
        PartReplicated(
            generation=gen, step=step, section=sec, nbytes=n, holder=holder, node_id=node, origin=h.origin,
            seconds=h.copy_s,
        ),
        PartStaged(generation=gen, step=step, section=sec, nbytes=n, holder=h.origin, meta=h.meta, node_id=h.origin_node),
    )  # fmt: skip


#: Seconds the cluster's list of alive nodes is reused by :func:`find_peers` (a GCS call at every
#: snapshot would be a large part of the holder's Python at a checkpoint every iteration; nodes come
#: and go far less often: a new one is used, and a lost one no longer offered, within this).
NODES_TTL_S = 1.0
_nodes: tuple[float, list[dict]] = (float("-inf"), [])


def _alive_nodes() -> list[dict]:
    global _nodes
    now = time.monotonic()
    if now - _nodes[0] >= NODES_TTL_S:
        from cf_ray._engine.protocol import cluster

        _nodes = (now, cluster.alive_nodes())
    return _nodes[1]


def find_peers(node: str, holder: str, namespace: str, wanted: int, label: str, section: str) -> list[tuple[str, Any]]:
    """Up to ``wanted`` holders of this run on other alive, not draining nodes (``-1``: one when the
    cluster has more than one node), in another failure domain when ``label`` names one:
    ``[(node id, handle)]``, spread over the candidates by section."""
    import ray

    from cf_ray._engine.protocol import cluster

    nodes = _alive_nodes()
    if wanted < 0:
        wanted = 1 if len(nodes) > 1 else 0
    if wanted == 0:
        return []
    draining = cluster.draining_nodes()
    mine = next((n for n in nodes if n["NodeID"] == node), None)
    domain = ((mine or {}).get("Labels") or {}).get(label) if label else None
    prefix = holder.rsplit(".", 1)[0]
    found: list[tuple[str, Any]] = []
    for n in nodes:
        nid = n["NodeID"]
        if nid == node or nid in draining:
            continue
        if label and ((n.get("Labels") or {}).get(label) == domain or domain is None):
            continue  # the same failure domain (or this node's is unknown: none is known to differ)
        try:
            found.append((nid, ray.get_actor(f"{prefix}.{nid}", namespace=namespace)))
        except ValueError:
            continue  # no worker of this run on that node: no holder there
    start = sum(section.encode()) % len(found) if found else 0
    return (found[start:] + found[:start])[:wanted]


__all__ = ["ActorPeer", "Peer", "Replicator", "copy_said", "find_peers"]
