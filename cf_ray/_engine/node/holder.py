"""Phase 2 and the node's memory: the per-node holder actor, a thin facade over its parts.

One holder per (run, node), named ``cf_ray.holder.<run key>.<node id>``, ``num_cpus=0``, detached,
pinned to its node. The workers of its node copy their snapshots into its slots (shared memory it
owns, so a snapshot outlives the worker that took it) and hand them over with ``stage``; the holder
persists them, copies them to holders of other nodes, and serves them to restores. Its parts, each
with one job and one lock:

* :class:`~.slot_store.SlotStore` — the slots of this node's sections, the copies kept for other
  nodes, what pins them (a pending write, the protected copied step) and when they are freed;
* :class:`~.writer.Writer` — the write queue (coalescing per checkpoint) and the writer thread;
* :class:`~.replicator.Replicator` — peer copies: offers to peers, and the pull of a peer's offer;
* :class:`~.record.Record` — what was staged and what became of it (``resync``, ``lookup``);
* :class:`~.stream.SectionServer` — direct transfers to readers on other nodes (started on first use);
* :class:`~.sender.Sender` — every message to the controller, delivered in order, acknowledged.

The hand-off (:meth:`Holder.stage`) returns once the holder has recorded the snapshot; the sender
delivers ``part_staged`` to the controller on its own, so a restarting controller never stalls
training. A holder that dies before it was delivered leaves a step the controller never
heard of, which ``settled()`` never calls settled: ``wait()``/``finish()`` report it.

Ray calls: workers and the controller call the default group (:data:`CALLS` threads); other holders'
``hold_replica`` runs in its own ``peer`` group (:data:`PEER_CALLS` threads), so a slow peer never
queues a worker's ``stage`` behind it.

Liveness: a holder that dies is restarted by Ray (``max_restarts=-1``) or made again by
the next ``get_or_create_holder`` on its node, empty; storage is the truth. The controller asks it to
finish what it is writing (:meth:`Holder.drain`) before it kills it. Lifetime (``protocol/cluster.py``):
a holder records the run it belongs to; :func:`get_or_create_holder` never reuses one whose run's
driver is gone: it is drained and killed, and a new, empty one is made.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, cast

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.memory.slots import HEADER_BYTES
from cf_ray._engine.node.record import LOOKUP_DONE, LOOKUP_HELD, LOOKUP_UNKNOWN, Record
from cf_ray._engine.node.replicator import ActorPeer, Peer, Replicator, copy_said, find_peers
from cf_ray._engine.node.sender import Sender
from cf_ray._engine.node.slot_store import Held, SlotStore
from cf_ray._engine.node.stream import LazyServer
from cf_ray._engine.node.writer import Writer
from cf_ray._engine.protocol import spares
from cf_ray._engine.protocol.actors import resolve_live
from cf_ray._engine.protocol.cluster import Owner, current_owner, owner_gone
from cf_ray._engine.protocol.messages import (
    HolderState,
    Message,
    PartDurable,
    PartFailed,
    PartStaged,
    PartSuperseded,
    ReplicaHeld,
    ReplicaOffer,
    SectionAt,
    SlotDesc,
    SnapshotMeta,
    Stage,
    StageReply,
)
from cf_ray._engine.protocol.naming import holder_name
from cf_ray._engine.storage.base import Storage

logger = logging.getLogger("cf_ray")

#: Threads of the default concurrency group (workers' and the controller's calls).
CALLS = 16
#: Threads of the ``peer`` concurrency group (other holders' ``hold_replica``).
PEER_CALLS = 4
#: Seconds the first copy of a run waits for a holder of another node to appear (their workers make
#: them as they start, maybe a moment after this one's first snapshot).
FIRST_PEER_WAIT_S = 5.0

__all__ = [
    "LOOKUP_DONE",
    "LOOKUP_HELD",
    "LOOKUP_UNKNOWN",
    "Holder",
    "HolderActor",
    "get_or_create_holder",
    "resolve_holder",
]


class Holder:
    """The holder's logic (the Ray actor class is :data:`HolderActor`); in process for tests.

    Args:
        storage: where sections are written.
        controller_name, namespace: the run's controller (where the sender delivers).
        owner: the run this holder belongs to.
        sender: what delivers messages to the controller (a :class:`~.sender.Sender` by default).
        name, node: this holder's actor name and node (the running actor's by default).
        peers: ``(meta, section) -> [Peer]`` (the run's holders of other nodes by default).
        host: the address its section server listens on (its node's by default).
    """

    def __init__(
        self,
        storage: Storage,
        controller_name: str,
        namespace: str,
        owner: Owner | None = None,
        *,
        sender: Any = None,
        name: str | None = None,
        node: str | None = None,
        peers: Callable[[SnapshotMeta, str], list[Peer]] | None = None,
        host: str | None = None,
    ):
        self.storage = storage
        self.namespace = namespace
        self._owner = owner
        self._name = _actor_name() if name is None else name
        self._node = _node_id() if node is None else node
        self._sender = sender if sender is not None else Sender(controller_name, namespace)
        self._record = Record()
        parts = self._name.split(".")
        self._store = SlotStore(parts[2] if len(parts) > 3 and parts[1] == "holder" else "run")
        self._server = LazyServer(lambda: host or ray.util.get_node_ip_address(), self._name)
        self._writer = Writer(storage, self._store, self._name, self._written)
        self._replicator = Replicator(
            self._store, self._name, self._node, self._server.get, peers or self._actor_peers, self._sender.send
        )
        self._no_peer_logged = False
        self._first_lookup = True

    # -- called by workers ---------------------------------------------------------------------
    def arena(self, section: str, nbytes: int) -> tuple[SlotDesc, ...]:
        """The slots of ``section`` for snapshots of ``nbytes`` (``SlotStore.arena``): what a worker
        of this node opens and maps (checking each is the slot described)."""
        return self._store.arena(section, nbytes)

    def stage(self, msg: Stage) -> StageReply:
        """Record a snapshot whose sections a worker copied into this holder's slots, queue it for
        writing and copying; returns at once (the controller hears of it through the sender)."""
        unknown = tuple(s.section for s in msg.sections if not self._store.known(s.slot))
        if unknown:  # slots of this holder's previous life (Ray restarted it)
            return StageReply(recorded=False, unknown=unknown)
        meta = msg.meta
        entries = [
            Held(msg.generation, msg.step, s.section, s.slot, bytes(s.index), s.crc32, meta) for s in msg.sections
        ]
        for e in entries:
            self._store.add_own(e)
        staged = [
            PartStaged(
                generation=e.generation,
                step=e.step,
                section=e.section,
                holder=self._name,
                nbytes=e.nbytes,
                meta=meta,
                node_id=self._node,
            )
            for e in entries
        ]
        out: list[tuple[str, Message]] = [("part_staged", m) for m in staged]
        if meta.persist:
            for m in staged:
                self._record.staged(m)
            for m in self._writer.enqueue(entries):
                self._record.outcome(m)
                out.append(("part_superseded", m))
        else:
            self._record.generation = max(self._record.generation, msg.generation)
        if meta.replicas != 0:
            # A copy not started when a newer snapshot came is skipped: never delays the newest.
            out += [("part_replicated", m) for m in self._replicator.enqueue(entries)]
        # In one call to the controller; a snapshot held in memory only may wait for the next ones
        # (the sender's module doc).
        self._sender.send_all(out, lazy=not meta.persist)
        return StageReply(recorded=True)

    def get_section(self, generation: int, step: int, section: str, node_id: str = "") -> SectionAt | None:
        """Where this holder has a section of a step (its own, or a copy for another node), ``None``
        if not. For a reader on this node (``node_id``) the slot itself, which it maps and reads in
        place; for a reader on another node a one-use offer of a direct transfer, sent straight from
        the slot (the slot's shared lock held until it is sent or the offer expires)."""
        held = self._store.find(generation, step, section)
        if held is None:
            return None
        lk = self._store.take(held, wait_s=1.0)
        if lk is None:
            return None  # filled again by a newer snapshot since
        if node_id and node_id == self._node:
            lk.close()  # the reader takes its own lock
            return SectionAt(where=held.slot, index=held.index, crc32=held.crc32)
        server = self._server.get()
        if server is None:
            lk.close()
            return None
        desc, _ = server.offer(held.nbytes, lk.close, fd=lk.fd, offset=HEADER_BYTES)
        return SectionAt(where=desc, index=held.index, crc32=held.crc32)

    def withdraw_offer(self, token: bytes) -> bool:
        """A reader could not fetch an offered section: release it now, not when its offer expires."""
        server = self._server.started()
        return server is not None and server.withdraw(token)

    def held_bytes(self) -> dict:
        """Host memory this holder holds for snapshots — ``slots`` (resident pages of this node's
        sections' slots), ``copies`` (of the copies kept for other nodes) — and ``copied``, the bytes
        it copied on the host so far (received copies, writes through the page cache)."""
        out = self._store.held_bytes()
        out["copied"] = self._writer.copied_bytes + self._replicator.copied_bytes
        return out

    # -- called by the holders of other nodes -----------------------------------------------------
    @ray.method(concurrency_group="peer")  # pyright: ignore[reportCallIssue, reportArgumentType, reportUntypedFunctionDecorator]
    def hold_replica(self, offer: ReplicaOffer) -> ReplicaHeld:
        """Keep a copy of a section of holder ``offer.origin``: pulled over the direct transfer into a
        slot of this holder's, checked, sealed; returns once that is done (``Replicator.receive``)."""
        return self._replicator.receive(offer, wait_s=_env.get_float(_env.ACTOR_TIMEOUT_S))

    # -- called by the controller ----------------------------------------------------------------
    def resync(self) -> HolderState:
        """Everything in the record: each section given to this holder (of the steps not known
        settled) and what became of it, and the copies it keeps for other nodes, for a controller
        that starts again. The controller's handlers are idempotent: what it knew is harmless."""
        staged, outcomes = self._record.said()
        said = [copy_said(h, self._name, self._node) for h in self._store.copies()]
        return HolderState(
            holder=self._name,
            node_id=self._node,
            generation=self._record.generation,
            staged=staged,
            outcomes=outcomes,
            replicas=tuple(r for r, _ in said),
            replica_origins=tuple(o for _, o in said),
        )

    def lookup(self, keys: list[tuple[int, int, str]]) -> list[tuple[str, PartStaged | None, Message | None]]:
        """What became of each ``(generation, step, section)``: ``("done", staged, outcome)`` when it
        was written, failed or superseded; ``("held", staged, None)`` while it waits or is being
        written; ``("unknown", None, None)`` when this holder does not have it (it was restarted
        empty, or never had it): the controller then fails it instead of waiting for ever."""
        return self._record.lookup(keys, self._writer.pending())

    def forget(self, keys: list[tuple[int, int]], committed: tuple[int, int] | None = None) -> None:
        """These steps settled: drop their record. ``committed``: the ``(generation, step)`` of a
        checkpoint now on storage: what no memory restore can take any more is freed
        (``SlotStore.committed``)."""
        self._record.forget(keys)
        if committed is not None:
            self._store.committed(int(committed[0]), int(committed[1]), self._writer.pending())

    def drain(self, timeout_s: float) -> dict:
        """Finish what is queued and being written, and deliver its messages, for at most
        ``timeout_s`` (the controller's shutdown, before it kills this holder). Returns
        ``{"drained": bool, "waiting": [[generation, step], ...], "writing": [generation, step, section]
        | None, "unsent": n}``."""
        deadline = time.monotonic() + timeout_s
        got = self._writer.drain(timeout_s)
        sent = self._sender.wait_idle(max(0.0, deadline - time.monotonic()))
        unsent = self._sender.pending()
        self._end_spares()
        return {"drained": not got["waiting"] and got["writing"] is None and sent, **got, "unsent": unsent}

    def _end_spares(self) -> None:
        """The run is over on this node (a drain comes before the kill): the spare worker processes
        its ranks asked for here and nobody took are ended, claimed or not (``protocol/spares.py``,
        waiting a few seconds for one the raylet has not started yet); a rank ends its own at
        ``finish()``, but one whose rank died, or that appeared after the rank's ``finish()``, or on a
        node where the last attempt ran no rank, has nobody else to end it."""
        parts = self._name.split(".")
        if len(parts) > 3 and parts[1] == "holder":
            ended = spares.end_run(os.environ.get("RAY_RAYLET_PID", ""), parts[2])
            if ended:
                logger.info(
                    "cf_ray: %s ended %d spare worker process(es) the run left on its node", self._name, len(ended)
                )

    def flush(self, timeout_s: float) -> bool:
        """Deliver the messages queued for the controller (``part_staged`` of a snapshot just handed
        off, ...), waiting at most ``timeout_s``: a restore plan asks for it first, so that a snapshot
        the hand-off already returned for is one the plan knows of. True when nothing is left."""
        return self._sender.wait_idle(timeout_s)

    def ping(self) -> str:
        """This holder's name (a cheap liveness check)."""
        return self._name

    def owner(self) -> Owner | None:
        """The run this holder belongs to (``None``: unknown)."""
        return self._owner

    # -- internals ---------------------------------------------------------------------------------
    def _written(self, outcome: PartDurable | PartFailed | PartSuperseded) -> None:
        self._record.outcome(outcome)
        method = {PartDurable: "part_durable", PartFailed: "part_failed", PartSuperseded: "part_superseded"}
        self._sender.send(method[type(outcome)], outcome)

    def _peers(self, wanted: int, label: str, section: str) -> list[tuple[str, Any]]:
        """The holders that copies of ``section`` go to: ``[(node id, handle)]`` (``find_peers``)."""
        found = find_peers(self._node, self._name, self.namespace, wanted, label, section)
        if self._first_lookup:
            # The run's first snapshot: the holders of the other nodes are made by their workers as they
            # start, maybe a moment after this one; wait for one (on the replication thread only).
            self._first_lookup = False
            deadline = time.monotonic() + FIRST_PEER_WAIT_S
            while not found and wanted != 0 and time.monotonic() < deadline:
                time.sleep(0.25)
                found = find_peers(self._node, self._name, self.namespace, wanted, label, section)
        if not found and wanted != 0:
            if not self._no_peer_logged:
                self._no_peer_logged = True
                logger.warning(
                    "cf_ray: no holder of this run on another%s node to copy snapshots to; they stay on "
                    "this node only (its loss means restoring from storage)",
                    f" {label!r} domain's" if label else "",
                )
        elif found:
            self._no_peer_logged = False
        return found

    def _actor_peers(self, meta: SnapshotMeta, section: str) -> list[Peer]:
        return [ActorPeer(nid, h) for nid, h in self._peers(meta.replicas, meta.replica_label, section)]


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
HolderActor = ray.remote(  # pyright: ignore[reportCallIssue] - see ControllerActor
    num_cpus=0, max_concurrency=CALLS, max_restarts=-1, concurrency_groups={"peer": PEER_CALLS}
)(Holder)


def get_or_create_holder(run_key: str, storage: Storage, controller_name: str, namespace: str):
    """The holder of this node for this run (created on first use, pinned to this node; made again
    when the previous one died for good — Ray restarts one that crashed). One left by a run whose
    driver is gone is drained and killed first, never reused."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    name = holder_name(run_key, node_id)
    owner = current_owner()
    kept = _retire_if_dead_run(name, namespace, owner)
    if kept is not None:  # it answered: no second lookup (nor Ray's export of the class) needed
        return kept
    return HolderActor.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(storage, controller_name, namespace, owner)


def _retire_if_dead_run(name: str, namespace: str, owner: Owner) -> Any:
    """Drain and kill holder ``name`` when it belongs to another run whose driver is gone. Returns
    its handle when it answered and is kept (this run's, or its run's driver is alive), else ``None``."""
    from cf_ray._engine import env as _env

    try:
        h = ray.get_actor(name, namespace=namespace)
        theirs = cast("Owner | None", ray.get(h.owner.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)))
    except (ValueError, AttributeError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None  # none, gone, busy or from before owners were recorded: left as it is
    if owner.same_run(theirs) or owner_gone(theirs) is None:
        return h
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
                return None
        except ValueError:
            return None
        time.sleep(0.1)
    return None


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
