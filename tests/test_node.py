"""The holder's parts in process (issue 24, issue 23, issue 28): real slots, real sockets, real
storage, no actors. Two holders stand for two nodes (``LocalPeer`` calls the other's
``hold_replica`` directly), and a worker's hand-off is what ``slot_helpers`` does (copy into a slot of
the holder, block CRCs, ``stage``). What the holder says to the controller is recorded."""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pyarrow.fs as pafs
import pytest
from durability_fs import FlagHandler
from slot_helpers import staged_slot

from cf_ray._engine.format.blocks import BLOCK_BYTES
from cf_ray._engine.memory import slots
from cf_ray._engine.node.holder import Holder
from cf_ray._engine.protocol.messages import CheckpointKind, PartReplicated, SlotDesc, SnapshotMeta, Stage
from cf_ray._engine.storage.fs import FsStorage
from cf_ray._engine.worker.snapshot.snapshotter import replica_due

pytestmark = pytest.mark.skipif(not slots.available(), reason="needs memfd_create (Linux)")

INDEX = b'{"entries":[],"tree":null}'


class Recorder:
    """The holder's line to the controller, recorded (the controller is not the point here)."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []
        self._cond = threading.Condition()

    def send(self, method, msg):
        self.send_all([(method, msg)])

    def send_all(self, messages, *, lazy=False):
        with self._cond:
            self.sent.extend(messages)
            self._cond.notify_all()

    def of(self, method: str) -> list:
        with self._cond:
            return [m for k, m in self.sent if k == method]

    def wait_for(self, method: str, pred, timeout_s: float = 30.0, count: int = 1):
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                got = [m for k, m in self.sent if k == method and pred(m)]
                if len(got) >= count:
                    return got
                left = deadline - time.monotonic()
                assert left > 0, f"no {method} matching within {timeout_s} s: {self.sent}"
                self._cond.wait(left)

    def wait_idle(self, timeout_s):
        return True

    def pending(self):
        return 0


class LocalPeer:
    """Another in-process holder, as the replicator asks it to keep a copy."""

    def __init__(self, holder: Holder):
        self.holder = holder
        self.node_id = holder._node

    def hold(self, offer, watch):
        return self.holder.hold_replica(offer)


def _holder(storage, node: str, peers=None) -> Holder:
    return Holder(
        storage,
        "cf_ray.controller.none",
        "ns",
        sender=Recorder(),
        name=f"cf_ray.holder.node-test.{node}",
        node=node,
        peers=peers or (lambda meta, section: []),
        host="127.0.0.1",
    )


def _pair(storage_a, storage_b) -> tuple[Holder, Holder]:
    """Holders of nodes A and B, each copying to the other."""
    holders: dict[str, Holder] = {}
    for node in ("A", "B"):
        other = "B" if node == "A" else "A"
        holders[node] = _holder(
            storage_a if node == "A" else storage_b,
            node,
            peers=lambda meta, section, o=other: [LocalPeer(holders[o])] if meta.replicas else [],
        )
    return holders["A"], holders["B"]


def _meta(rank: int, *, replicas: int = 0, world: int = 2, **kw) -> SnapshotMeta:
    return SnapshotMeta(
        rank=rank, world_size=world, replicated=True, epoch=0, kind=CheckpointKind.SCHEDULED, replicas=replicas, **kw
    )


def _data(step: int, section: str, nbytes: int) -> np.ndarray:
    seed = step * 1000 + sum(section.encode())
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _stage(holder: Holder, gen: int, step: int, sections: dict[str, np.ndarray], meta: SnapshotMeta):
    staged = tuple(
        staged_slot(holder.arena(name, arr.nbytes), gen, step, name, arr, INDEX) for name, arr in sections.items()
    )
    return holder.stage(Stage(generation=gen, step=step, meta=meta, sections=staged))


def _readable(holder: Holder, gen: int, step: int, section: str) -> np.ndarray | None:
    """The bytes of that section as a reader of the holder's node gets them (``None``: not held)."""
    at = holder.get_section(gen, step, section, holder._node)
    if at is None:
        return None
    lk = slots.ReadLock.take(at.where, gen, step)
    if lk is None:
        return None
    out = np.frombuffer(lk.data, dtype=np.uint8).copy()
    lk.close()
    return out


def _stray_write(slot_path: str, offset: int) -> None:
    """A stray write through a slot's memfd: one byte of its data, at ``offset``, set to 0xff."""
    fd = os.open(slot_path, os.O_RDWR)
    os.pwrite(fd, b"\xff", slots.HEADER_BYTES + offset)
    os.close(fd)


def _local(tmp_path, name: str) -> FsStorage:
    return FsStorage(pafs.LocalFileSystem(), str(tmp_path / name))


# -- issue 24: one byte path between nodes -----------------------------------------------------------


def test_a_copy_moves_once_over_the_stream_into_a_sealed_slot_of_the_peers_own(tmp_path):
    """The peer pulls the origin's slot over the direct transfer into a slot of its own: the origin
    copies nothing on the host (``sendfile``), the peer one pass (what it received), where the object
    store's path made three (the origin's put, Ray's pull, the peer's put). The copy is complete and
    checked when ``part_replicated`` is sent, read in place on the peer's node, and sealed: no process
    can write it."""
    a, b = _pair(_local(tmp_path, "a"), _local(tmp_path, "b"))
    nbytes = 3 * BLOCK_BYTES + 1234
    data = _data(10, "rank_00000", nbytes)
    _stage(a, 1, 10, {"rank_00000": data}, _meta(0, replicas=1, persist=False))
    (msg,) = a._sender.wait_for("part_replicated", lambda m: True)
    assert isinstance(msg, PartReplicated) and not msg.error, msg
    assert (msg.holder, msg.node_id, msg.origin, msg.nbytes) == (b._name, "B", a._name, nbytes)
    assert a.held_bytes()["copied"] == 0 and b.held_bytes()["copied"] == nbytes  # one pass, on the peer
    assert b.held_bytes()["copies"] >= nbytes
    assert np.array_equal(_readable(b, 1, 10, "rank_00000"), data)
    (copy,) = b.resync().replicas
    assert (copy.holder, copy.origin, copy.step) == (b._name, a._name, 10)
    desc = b.get_section(1, 10, "rank_00000", "B").where
    assert isinstance(desc, SlotDesc)
    fd = os.open(desc.path, os.O_RDWR)  # another process of the node, opening the copy to write
    try:
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", slots.HEADER_BYTES)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, slots.slot_size(nbytes))  # a writable shared mapping
    finally:
        os.close(fd)
    assert np.array_equal(_readable(b, 1, 10, "rank_00000"), data)


def test_the_peer_itself_tells_the_controller_of_each_copy_it_received(tmp_path):
    """Issue 28: the origin's ``part_replicated`` waits in the origin's queue to the controller; an
    origin whose node goes right after a copy ended would take the only word of that copy with it,
    and the restore would go back to storage although the survivor holds the step. The peer says it
    too, through its own line, as soon as the copy is sealed: which copy, where, and the section as
    its origin staged it (what a controller that never heard from the origin needs)."""
    a, b = _pair(_local(tmp_path, "a"), _local(tmp_path, "b"))
    nbytes = 2 * BLOCK_BYTES + 7
    meta = _meta(0, replicas=1, persist=False)
    _stage(a, 1, 10, {"rank_00000": _data(10, "rank_00000", nbytes), "shared": _data(10, "shared", 99)}, meta)
    said = b._sender.wait_for("apply_holder_state", lambda m: True, count=2)
    copies = sorted(
        (s.replicas[0].section, s.replicas[0].holder, s.replicas[0].node_id, s.replicas[0].origin) for s in said
    )
    assert copies == [("rank_00000", b._name, "B", a._name), ("shared", b._name, "B", a._name)], said
    for s in said:
        (origin,) = s.replica_origins
        (copy,) = s.replicas
        assert (origin.holder, origin.node_id, origin.step, origin.section) == (a._name, "A", 10, copy.section)
        assert origin.nbytes == copy.nbytes and origin.meta == meta and s.holder == b._name
    assert [m for m in a._sender.of("apply_holder_state")] == []  # the origin says it the usual way


def test_a_copy_whose_bytes_changed_in_the_origins_memory_is_never_kept(tmp_path, caplog):
    """A stray write into the origin's slot after the worker checksummed it: the peer checks every
    block as it lands, refuses the copy (the error names the block), and keeps nothing."""
    a, b = _pair(_local(tmp_path, "a"), _local(tmp_path, "b"))
    nbytes = 4 * BLOCK_BYTES
    descs = a.arena("rank_00000", nbytes)
    staged = staged_slot(descs, 1, 10, "rank_00000", _data(10, "rank_00000", nbytes), INDEX)
    _stray_write(staged.slot.path, 2 * BLOCK_BYTES + 17)
    a.stage(Stage(generation=1, step=10, meta=_meta(0, replicas=1, persist=False), sections=(staged,)))
    (msg,) = a._sender.wait_for("part_replicated", lambda m: True)
    assert "block 2" in msg.error and not msg.holder, msg
    assert b.resync().replicas == () and b.held_bytes()["copies"] == 0
    # Never silent (found by the fault soak: a bit flipped on the wire was only a profile column).
    (said,) = [r.getMessage() for r in caplog.records if "copying rank_00000 of step 10" in r.getMessage()]
    assert "block 2" in said and "failed" in said, said


def test_a_section_whose_bytes_changed_in_the_holders_memory_is_never_committed(tmp_path):
    """Found by the fault soak (issue 23): a bit flipped in a holder's slot after the worker
    checksummed it was written under the worker's CRC, the step committed, and the next restore
    found the file damaged and quarantined a committed checkpoint. The writer checks the slot's
    bytes against the block CRCs (after writing them): the section fails, naming the block, and
    nothing of it is reported durable; the next snapshot is written as usual."""
    a = _holder(_local(tmp_path, "a"), "A")
    nbytes = 4 * BLOCK_BYTES
    descs = a.arena("rank_00000", nbytes)
    staged = staged_slot(descs, 1, 10, "rank_00000", _data(10, "rank_00000", nbytes), INDEX)
    _stray_write(staged.slot.path, 2 * BLOCK_BYTES + 17)  # after the checksums
    a.stage(Stage(generation=1, step=10, meta=_meta(0), sections=(staged,)))
    (failed,) = a._sender.wait_for("part_failed", lambda m: m.step == 10)
    assert "changed in the holder's memory" in failed.error and "block 2" in failed.error, failed
    _stage(a, 1, 15, {"rank_00000": _data(15, "rank_00000", nbytes)}, _meta(0))
    (durable,) = a._sender.wait_for("part_durable", lambda m: True)
    assert durable.step == 15 and durable.crc_read_bytes == nbytes, durable


def test_a_slot_is_opened_only_when_it_is_the_one_its_holder_described(tmp_path):
    """The fd's memfd name, the file's inode/device and the header's nonce are all checked: a
    descriptor whose fd number now names another file (its holder is gone and the number reused),
    another slot, or a forged nonce is refused before a byte is written or read."""
    a = _holder(_local(tmp_path, "a"), "A")
    d0, d1, _spare = a.arena("rank_00000", 4096)
    w = slots.WriterSlot(d0, 4096)  # the real one
    w.close()
    assert d0.name.startswith("cf_ray.node-test.rank_00000.") and os.readlink(d0.path) == f"/memfd:{d0.name} (deleted)"
    for bad in (
        SlotDesc(**{**_fields(d0), "name": d1.name}),  # another slot's name
        SlotDesc(**{**_fields(d0), "ino": d1.ino}),  # another file
        SlotDesc(**{**_fields(d0), "nonce": d0.nonce ^ 1}),  # a forged header
    ):
        with pytest.raises(slots.SlotGone):
            slots.WriterSlot(bad, 4096)
        with pytest.raises(slots.SlotGone):
            slots.ReadLock.take(bad, 0, 0)
    # The holder's fd closed, its number taken by another memfd of the same name pattern.
    fd = int(d0.path.rsplit("/", 1)[1])
    a._store.close()
    other = os.memfd_create(d0.name)
    try:
        if other == fd:
            with pytest.raises(slots.SlotGone, match="another file|now names"):
                slots.WriterSlot(d0, 4096)
        else:
            with pytest.raises(slots.SlotGone):
                slots.WriterSlot(d0, 4096)
    finally:
        os.close(other)


def _fields(d: SlotDesc) -> dict:
    return {k: getattr(d, k) for k in ("path", "name", "ino", "dev", "nonce", "nbytes", "seq")}


def test_without_memfd_cf_ray_says_it_needs_linux(monkeypatch):
    from cf_ray.errors import CfRayError

    monkeypatch.delattr(os, "memfd_create")
    assert not slots.available()
    with pytest.raises(CfRayError, match="needs Linux"):
        slots.require()


# -- issue 28: the newest copied step survives the loss of a node --------------------------------------


def _complete_on(holder: Holder, sections: list[str], steps: list[int], gen: int = 1) -> int | None:
    """The newest of ``steps`` every section of which ``holder`` can serve (its own or a copy)."""
    for step in sorted(steps, reverse=True):
        if all(_readable(holder, gen, step, sec) is not None for sec in sections):
            return step
    return None


@pytest.mark.parametrize(("every", "last"), [(2, 25), (4, 45)])
def test_after_a_node_loss_the_newest_copied_step_survives_whole_on_the_other_node(tmp_path, every, last):
    """Issue 28: checkpoints every 5 steps, ``replica_every`` n, storage that stops answering from
    step 15 on (writes of 15, then later steps, held), ranks 0 and 1 on nodes A and B (A: ``shared``
    and ``rank_00000``). Node A is then lost. Before the fix the survivor's own slot of the newest
    copied step (20) was filled again by a step that was not copied (25): the writer pinned one slot
    (step 15) and the worker alternated in the other; the restore went to storage. Now the newest
    copied step complete on B is protected (pinned; the worker takes the spare), and B alone can
    serve every section of it, byte for byte."""
    flag = tmp_path / "hang"
    storage = FsStorage(pafs.PyFileSystem(FlagHandler(str(flag), "hang")), str(tmp_path / "ckpts"))
    a, b = _pair(storage, storage)
    nbytes = BLOCK_BYTES + 100
    own = {"A": ["shared", "rank_00000"], "B": ["rank_00001"]}
    copied = []
    try:
        for step in range(5, last + 1, 5):
            if step == 15:
                flag.touch()  # storage stops answering: step 15's write hangs, with its slots pinned
            due = replica_due(step, every, 5)
            for node, holder in (("A", a), ("B", b)):
                rank = 0 if node == "A" else 1
                meta = _meta(rank, replicas=1 if due else 0, interval=5)
                _stage(holder, 1, step, {s: _data(step, s, nbytes) for s in own[node]}, meta)
            if due:
                copied.append(step)
                for holder, n in ((a, 2), (b, 1)):
                    got = holder._sender.wait_for("part_replicated", lambda m, s=step: m.step == s, count=n)
                    assert len(got) == n and not any(m.error for m in got), got
            else:
                time.sleep(0.05)
        # Node A is lost: what B alone has.
        everything = own["A"] + own["B"]
        newest = _complete_on(b, everything, list(range(5, last + 1, 5)))
        assert newest == max(copied), (newest, copied)
        for sec in everything:
            assert np.array_equal(_readable(b, 1, newest, sec), _data(newest, sec, nbytes)), sec
        assert b._store.protected() == (1, newest)
    finally:
        if flag.exists():
            flag.unlink()


@pytest.mark.parametrize("priority", [False, True], ids=["scheduled", "preemption"])
def test_a_step_whose_copying_began_is_copied_whole_before_a_newer_one(tmp_path, priority):
    """Issue 28: copies slower than the interval. The first section of step 5 is in flight to the
    peer when step 10 is staged. Newest-wins per section used to skip step 5's other section, so no
    step had every section copied (with every copy that slow, none ever would) and a node loss went
    back to storage. The step begun is finished first, then the newer one is copied — unless the
    newer one is a preemption checkpoint, whose deadline does not wait: it goes first, then step 5's
    remaining section."""
    holders: dict[str, Holder] = {}
    began, gate = threading.Event(), threading.Event()

    class SlowFirstCopy(LocalPeer):
        def hold(self, offer, watch):
            if offer.step == 5 and not began.is_set():
                began.set()
                assert gate.wait(30)
            return super().hold(offer, watch)

    a = holders["A"] = _holder(
        _local(tmp_path, "a"), "A", peers=lambda meta, section: [SlowFirstCopy(holders["B"])] if meta.replicas else []
    )
    b = holders["B"] = _holder(_local(tmp_path, "b"), "B")
    nbytes = BLOCK_BYTES + 100
    sections = ["rank_00000", "shared"]
    _stage(a, 1, 5, {s: _data(5, s, nbytes) for s in sections}, _meta(0, replicas=1, persist=False))
    assert began.wait(30)
    newer = _meta(0, replicas=1, persist=False, priority=priority)
    _stage(a, 1, 10, {s: _data(10, s, nbytes) for s in sections}, newer)  # while step 5 is in flight
    gate.set()
    got = a._sender.wait_for("part_replicated", lambda m: not m.skipped, count=4)
    order = [(5, "rank_00000"), (5, "shared"), (10, "rank_00000"), (10, "shared")]
    if priority:
        order = [(5, "rank_00000"), (10, "rank_00000"), (10, "shared"), (5, "shared")]
    assert [(m.step, m.section, m.error) for m in got] == [(st, sec, "") for st, sec in order], got
    assert a._sender.of("part_replicated") == got  # nothing skipped
    for step in (5, 10):
        for sec in sections:
            assert np.array_equal(_readable(b, 1, step, sec), _data(step, sec, nbytes)), (step, sec)


# -- issue 23 #5: bounded memory per node ---------------------------------------------------------------


def test_a_holder_holds_the_slots_of_the_ranks_on_its_node_only_after_two_one_two(tmp_path):
    """Generation 1: ranks 0 and 1 on this node, and a copy of another node's section; generation 2
    (one rank left, an elastic shrink): rank 0 only; generation 3 (grown again, ranks re-placed): rank
    1 only. After each generation's first commit the holder holds the slots of the sections its
    node's ranks stage now, nothing of those that moved away, and no copy older than the commit."""
    a, b = _pair(_local(tmp_path, "a"), _local(tmp_path, "b"))
    nbytes = 1 << 20
    # Two slots per section, and the spare's header page (its data pages are never taken here).
    slot_bytes = slots.slot_size(nbytes) + slots.HEADER_BYTES // 2

    def held(h):
        return h.held_bytes()

    def stage_gen(gen, step, sections):
        _stage(a, gen, step, {s: _data(step, s, nbytes) for s in sections}, _meta(0, replicas=0, world=len(sections)))
        a._writer.drain(30)

    def commit(gen, step):
        a.forget([], committed=(gen, step))

    # A copy of node B's section kept on A (generation 1).
    _stage(b, 1, 10, {"rank_00002": _data(10, "rank_00002", nbytes)}, _meta(2, replicas=1, persist=False))
    b._sender.wait_for("part_replicated", lambda m: m.step == 10 and not m.error)
    for step in (5, 10):
        stage_gen(1, step, ["rank_00000", "rank_00001"])
    commit(1, 10)
    h = held(a)
    assert h["sections"] == 2 and h["copies"] > 0
    assert h["slots"] <= 2 * 2 * slot_bytes
    for step in (15, 20):
        stage_gen(2, step, ["rank_00000"])
    commit(2, 20)
    h = held(a)
    assert h["sections"] == 1 and h["copied_sections"] == 0 and h["copies"] == 0, h
    assert h["slots"] <= 2 * slot_bytes, h
    for step in (25, 30):
        stage_gen(3, step, ["rank_00001"])
    commit(3, 30)
    h = held(a)
    assert h["sections"] == 1 and h["slots"] <= 2 * slot_bytes, h
    assert _readable(a, 3, 30, "rank_00001") is not None and _readable(a, 2, 20, "rank_00000") is None


def test_a_pending_write_keeps_its_slots_after_a_commit(tmp_path):
    """A section whose write has not finished is not freed by a newer commit (it may still commit)."""
    flag = tmp_path / "hang"
    flag.touch()
    storage = FsStorage(pafs.PyFileSystem(FlagHandler(str(flag), "hang")), str(tmp_path / "ckpts"))
    a = _holder(storage, "A")
    try:
        _stage(a, 1, 5, {"rank_00001": _data(5, "rank_00001", 4096)}, _meta(1, world=2))
        a.forget([], committed=(2, 10))  # a newer generation committed, rank 1 not on this node now
        assert a.held_bytes()["sections"] == 1 and _readable(a, 1, 5, "rank_00001") is not None
    finally:
        flag.unlink()
    a._writer.drain(30)
    a.forget([], committed=(2, 10))
    assert a.held_bytes()["sections"] == 0


def test_a_late_commit_of_an_older_generation_frees_nothing_of_the_newer_ones_snapshots(tmp_path):
    """Generation 2 resumed at step 2 and holds its step 4; then generation 1's step 8, written
    before that attempt ended, commits late. Generation 2's step 4 is newer than it, (generation,
    step) in order: it stays restorable from memory, and the worker's next hand-off into the slots
    it was given is recorded (freed, they were unknown to the holder, and the worker re-staged
    saying the holder was restarted)."""
    a = _holder(_local(tmp_path, "a"), "A")
    nbytes = 1 << 16
    descs = a.arena("rank_00000", nbytes)  # what the worker maps and keeps
    reply = _stage(a, 2, 4, {"rank_00000": _data(4, "rank_00000", nbytes)}, _meta(0, world=1))
    assert reply.recorded
    a._writer.drain(30)
    a.forget([], committed=(1, 8))  # generation 1's late commit
    assert a.held_bytes()["sections"] == 1
    assert np.array_equal(_readable(a, 2, 4, "rank_00000"), _data(4, "rank_00000", nbytes))
    arr = _data(6, "rank_00000", nbytes)
    staged = staged_slot(descs, 2, 6, "rank_00000", arr, INDEX)
    reply = a.stage(Stage(generation=2, step=6, meta=_meta(0, world=1), sections=(staged,)))
    assert reply.recorded and not reply.unknown, reply
    a._writer.drain(30)


# -- issue 23 #3: the hand-off does not wait for the controller ------------------------------------------


def test_a_hand_off_while_the_controller_is_unreachable_returns_at_once(tmp_path, ray_cluster):
    """The holder's sender delivers ``part_staged`` on its own (re-resolving a controller that is gone):
    ``stage`` returns once the holder has recorded the snapshot. (Until issue 23 it waited up to 5 s for
    the controller's acknowledgement, on every hand-off while a controller restarted.) What that wait
    protected still holds: a step the controller never heard of is not settled
    (``test_control_plane.py::test_settled_says_which_steps_nothing_more_will_happen_to``)."""
    a = Holder(
        _local(tmp_path, "a"), "cf_ray.controller.nobody-here", "cf_ray-test", name="h", node="A", host="127.0.0.1"
    )
    t0 = time.monotonic()
    reply = _stage(a, 1, 5, {"rank_00000": _data(5, "rank_00000", 4096)}, _meta(0, world=1))
    assert reply.recorded and time.monotonic() - t0 < 1.0
    assert a._sender.pending() >= 1  # part_staged still being delivered
    (staged,), _ = a._record.said()
    assert staged.step == 5


def test_a_peers_slow_calls_never_queue_a_workers_stage(tmp_path, ray_cluster):
    """Issue 23 #9: peers' ``hold_replica`` calls run in their own concurrency group. Here more of them
    than the group has threads hang on an origin that never sends a byte, and a worker's ``arena`` and
    ``stage`` still answer at once."""
    import socket

    import ray

    from cf_ray._engine.memory import wire
    from cf_ray._engine.node.holder import CALLS, HolderActor
    from cf_ray._engine.protocol.messages import ReplicaOffer, StreamDesc

    lsock = socket.create_server(("127.0.0.1", 0), backlog=64)
    conns = []

    def silent_origin():
        while True:
            try:
                conn, _ = lsock.accept()
            except OSError:
                return
            conns.append(conn)  # reads nothing, sends nothing

    threading.Thread(target=silent_origin, daemon=True).start()
    h = HolderActor.remote(_local(tmp_path, "a"), "cf_ray.controller.none", "cf_ray-test", None)
    try:
        assert ray.get(h.ping.remote(), timeout=60) is not None
        stream = StreamDesc(host="127.0.0.1", port=lsock.getsockname()[1], token=bytes(wire.TOKEN_BYTES), nbytes=4096)
        offer = ReplicaOffer(
            generation=1, step=5, section="rank_00009", index=INDEX, crc32=0, meta=_meta(9), origin="o",
            origin_node="X", stream=stream,
        )  # fmt: skip
        slow = [h.hold_replica.remote(offer) for _ in range(CALLS + 4)]  # more than every thread of the actor
        time.sleep(1.0)
        assert ray.wait(slow, timeout=0)[0] == []  # every peer call is stuck
        t0 = time.monotonic()
        descs = ray.get(h.arena.remote("rank_00000", 4096), timeout=30)
        data = _data(5, "rank_00000", 4096)
        reply = ray.get(
            h.stage.remote(
                Stage(
                    generation=1,
                    step=5,
                    meta=_meta(0, world=1),
                    sections=(staged_slot(descs, 1, 5, "rank_00000", data, INDEX),),
                )
            ),
            timeout=30,
        )
        assert reply.recorded and time.monotonic() - t0 < 5.0
    finally:
        ray.kill(h, no_restart=True)
        lsock.close()
        for c in conns:
            c.close()
