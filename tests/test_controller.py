"""The controller's bookkeeping, driven in-process (no actor): a checkpoint commits once every
section is durable, whatever order the holders' messages run in.

The controller actor is threaded (``max_concurrency``), so Ray does not keep the order in which a
holder sent ``part_staged`` and ``part_durable``: a small section can be durable before the call
saying which sections the step has (this left steps half-committed, and ``Checkpointer.wait``
waiting, in a clean-clone CI run at interval 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pyarrow.fs as pafs
import pytest
import torch
from slot_helpers import staged_slot

from cf_ray._engine.driver import jit_tier
from cf_ray._engine.driver.controller import Controller, ControllerSettings
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.memory import slots
from cf_ray._engine.protocol.messages import (
    CheckpointKind,
    PartDurable,
    PartFailed,
    PartReplicated,
    PartStaged,
    PartSuperseded,
    ReplicaOffer,
    Restored,
    RestoreSource,
    SnapshotMeta,
)
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.policy import FixedInterval

from storage_helpers import arena_of

WORLD = 2
SECTIONS = [mf.SHARED, mf.rank_section(0), mf.rank_section(1)]


def _controller(root) -> Controller:
    storage = FsStorage(pafs.LocalFileSystem(), str(root))
    return Controller(
        "test",
        storage,
        ControllerSettings(policy=FixedInterval(every=1), keep_last=None, tiers=[], upload_milestones_only=False),
    )


def _write(ctl: Controller, step: int, section: str) -> tuple[dict, torch.Tensor]:
    """Phase 2 of one section, as a holder does it: the files and what part_durable carries."""
    value = torch.arange(8, dtype=torch.float32) + 100 * step + SECTIONS.index(section)
    arena, index = arena_of({"w": value})
    files = mf.write_section(ctl.storage, mf.step_dir(step), ctl.generation, section, arena, index)
    return {k: v.to_json() for k, v in files.items()}, value


def _staged(ctl: Controller, step: int, sec: str, **meta) -> PartStaged:
    """What the holder sends when a section of ``step`` is held: a scheduled checkpoint of WORLD ranks."""
    meta = {"world_size": WORLD, "replicated": True, "epoch": 0, "kind": CheckpointKind.SCHEDULED, **meta}
    return PartStaged(
        generation=ctl.generation,
        step=step,
        section=sec,
        holder="holder",
        nbytes=32,
        meta=SnapshotMeta(**meta, rank=mf.section_rank(sec)),
    )


def _messages() -> list[tuple[str, str]]:
    return [(kind, sec) for sec in SECTIONS for kind in ("staged", "durable")]


# Every order in which all three part_durable calls run before any part_staged, and a sample of
# the rest (all 720 would take a minute of fsyncs).
_ALL = list(itertools.permutations(range(6)))
_DURABLE_FIRST = [o for o in _ALL if all(o.index(i) < o.index(j) for i in (1, 3, 5) for j in (0, 2, 4))]
ORDERS = _DURABLE_FIRST[:12] + random.Random(0).sample([o for o in _ALL if o not in _DURABLE_FIRST], 12)


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "".join(map(str, o)))
def test_commits_whatever_order_the_holder_messages_run_in(tmp_path, order):
    ctl = _controller(tmp_path)
    step = 7
    written = {sec: _write(ctl, step, sec) for sec in SECTIONS}
    msgs = _messages()
    for i in order:
        kind, sec = msgs[i]
        if kind == "staged":
            ctl.part_staged(_staged(ctl, step, sec))
        else:
            ctl.part_durable(
                PartDurable(generation=ctl.generation, step=step, section=sec, files=written[sec][0], persist_s=0.01)
            )
    assert ctl.pending_steps(ctl.generation) == []
    assert [c.step for c in mf.list_committed(ctl.storage)] == [step]
    m = mf.read_manifest(ctl.storage, mf.step_dir(step))
    for sec in SECTIONS:
        section = mf.load_section(ctl.storage, mf.step_dir(step), m, sec)
        got = _codec.view(section.buf, section.entries[0], copy=True)
        assert torch.equal(got, written[sec][1])


def test_a_step_missing_a_section_stays_pending_and_uncommitted(tmp_path):
    ctl = _controller(tmp_path)
    for sec in SECTIONS[:2]:
        files, _ = _write(ctl, 3, sec)
        ctl.part_staged(_staged(ctl, 3, sec))
        ctl.part_durable(PartDurable(generation=ctl.generation, step=3, section=sec, files=files, persist_s=0.01))
    assert ctl.pending_steps(ctl.generation) == [3]
    assert mf.list_committed(ctl.storage) == []


def test_a_superseded_step_is_not_waited_for_nor_committed(tmp_path):
    ctl = _controller(tmp_path)
    files, _ = _write(ctl, 4, SECTIONS[0])
    ctl.part_durable(PartDurable(generation=ctl.generation, step=4, section=SECTIONS[0], files=files, persist_s=0.01))
    ctl.part_superseded(PartSuperseded(generation=ctl.generation, step=4, section=SECTIONS[1]))
    for sec in SECTIONS:
        ctl.part_staged(_staged(ctl, 4, sec))
    for sec in SECTIONS[1:]:
        ctl.part_durable(
            PartDurable(generation=ctl.generation, step=4, section=sec, files=_write(ctl, 4, sec)[0], persist_s=0.01)
        )
    assert ctl.pending_steps(ctl.generation) == []
    assert mf.list_committed(ctl.storage) == []


def _retaining_controller(root, keep_last: int) -> Controller:
    storage = FsStorage(pafs.LocalFileSystem(), str(root))
    return Controller(
        "test",
        storage,
        ControllerSettings(policy=FixedInterval(every=1), keep_last=keep_last, tiers=[], upload_milestones_only=False),
    )


def _wait_maintenance(ctl: Controller) -> None:
    import time

    deadline = time.monotonic() + 30
    while not ctl.maintenance_idle():
        assert time.monotonic() < deadline, "the controller's clean-up did not finish"
        time.sleep(0.01)


def test_a_checkpoint_committed_during_the_clean_up_of_older_directories_is_kept(tmp_path, monkeypatch):
    """Out-of-order commits: step 11 commits first (rank 1's section of the milestone step 10 came
    late to its holder), so the clean-up after it finds step 10 without a manifest, older than the
    newest. If step 10's last section turns durable between that listing and the check of what is
    still in flight, step 10 is committed: it must not be deleted (a CI run lost its milestone so)."""
    ctl = _retaining_controller(tmp_path, keep_last=2)
    last = {}  # step -> (files, value) of its last section, held back
    for step, milestone in ((10, True), (11, False)):
        for sec in SECTIONS:
            files, value = _write(ctl, step, sec)
            ctl.part_staged(_staged(ctl, step, sec, milestone=milestone))
            if sec == SECTIONS[-1]:
                last[step] = (files, value)
            else:
                ctl.part_durable(
                    PartDurable(generation=ctl.generation, step=step, section=sec, files=files, persist_s=0.01)
                )
    assert ctl.pending_steps(ctl.generation) == [10, 11]

    real_list = mf.list_uncommitted
    late = {"files": last[10][0]}

    def listing_then_the_late_section(storage):
        out = real_list(storage)
        files = late.pop("files", None)
        if files is not None:  # the holder's message runs now, on another thread
            ctl.part_durable(
                PartDurable(generation=ctl.generation, step=10, section=SECTIONS[-1], files=files, persist_s=0.01)
            )
        return out

    monkeypatch.setattr(mf, "list_uncommitted", listing_then_the_late_section)
    ctl.part_durable(
        PartDurable(generation=ctl.generation, step=11, section=SECTIONS[-1], files=last[11][0], persist_s=0.01)
    )  # 11 commits before 10
    _wait_maintenance(ctl)
    assert "files" not in late, "the interleaving under test did not happen"
    assert [c.step for c in mf.list_committed(ctl.storage)] == [10, 11]
    m = mf.read_manifest(ctl.storage, mf.step_dir(10))
    assert m.milestone
    section = mf.load_section(ctl.storage, mf.step_dir(10), m, SECTIONS[-1])  # verifies every checksum it reads
    assert torch.equal(_codec.view(section.buf, section.entries[0], copy=True), last[10][1])


def _commit(ctl: Controller, step: int) -> None:
    for sec in SECTIONS:
        files, _ = _write(ctl, step, sec)
        ctl.part_staged(_staged(ctl, step, sec))
        ctl.part_durable(PartDurable(generation=ctl.generation, step=step, section=sec, files=files, persist_s=0.01))
    _wait_maintenance(ctl)


def test_clean_up_deletes_a_leftover_directory_only_once_it_is_known_dead(tmp_path):
    """A directory without a manifest, older than the newest commit: a crashed writer's leftover,
    or a holder's write whose part_staged has not reached the threaded controller yet. The first
    clean-up that sees it unknown keeps it; one that still finds it unknown later deletes it; a
    failed step's directory goes at once; one that became known and committed stays."""
    ctl = _retaining_controller(tmp_path, keep_last=None)
    _write(ctl, 3, SECTIONS[0])  # nobody ever says anything of step 3
    _write(ctl, 4, SECTIONS[0])  # step 4 is announced late, then commits
    _write(ctl, 5, SECTIONS[0])
    ctl.part_failed(PartFailed(generation=ctl.generation, step=5, section=SECTIONS[1], error="IOError: disk full"))
    _commit(ctl, 6)
    uncommitted = {s for _, s in mf.list_uncommitted(ctl.storage)}
    assert uncommitted == {3, 4}
    _commit(ctl, 4)
    _commit(ctl, 7)
    assert mf.list_uncommitted(ctl.storage) == []
    assert [c.step for c in mf.list_committed(ctl.storage)] == [4, 6, 7]


def test_keep_last_deletes_nothing_a_restore_plan_names_until_the_restore_is_done(tmp_path):
    """keep_last=1: while a new attempt restores from the checkpoint its plan names, a late commit of
    the previous attempt (a holder finishing its write) must not delete that checkpoint under it."""
    ctl = _retaining_controller(tmp_path, keep_last=1)
    _commit(ctl, 4)
    plan = ctl.prepare_restore(WORLD)
    assert plan.storage == (4,)
    _commit(ctl, 6)  # the previous attempt's holder commits late
    assert [c.step for c in mf.list_committed(ctl.storage)] == [4, 6]
    m = mf.read_manifest(ctl.storage, mf.step_dir(4))
    mf.verify_all(ctl.storage, mf.step_dir(4), m)  # the restore reads it whole
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=4, epoch=0))
    _wait_maintenance(ctl)
    assert [c.step for c in mf.list_committed(ctl.storage)] == [6]  # deferred, not forgotten


def test_a_checkpoint_a_restore_found_corrupt_is_quarantined_and_never_counts_toward_keep_last(tmp_path):
    """keep_last=2 with the newest checkpoint corrupt: without quarantine, the next two commits would
    push out the good step 6 while the corrupt step 8 still counted as one of the two kept."""
    ctl = _retaining_controller(tmp_path, keep_last=2)
    for step in (4, 6, 8):
        _commit(ctl, step)
    assert ctl.prepare_restore(WORLD).storage == (8, 6)
    # Rank 0's restore found step 8 damaged on this run's own storage and fell back to step 6.
    ctl.record_event(
        {
            "event": "restore_fallback",
            "source": "storage",
            "step": 8,
            "corrupt": True,
            "where": ctl.storage.uri(mf.step_dir(8)),
            "error": "CorruptCheckpointError: crc mismatch",
        }
    )
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=6, epoch=0))
    _wait_maintenance(ctl)
    _commit(ctl, 9)
    steps = [c.step for c in mf.list_committed(ctl.storage)]
    assert 6 in steps and 9 in steps, steps  # the good one is kept: 8 does not count
    assert 8 in steps  # quarantined, not deleted: kept for inspection
    assert ctl.summary()["committed_steps"] == [6, 9]
    assert any(e.get("event") == "quarantined" and e.get("step") == 8 for e in ctl.events())
    # A controller that starts again (a new driver) never names it either.
    again = _retaining_controller(tmp_path, keep_last=2)
    assert again.prepare_restore(WORLD).storage == (9, 6)
    # A fallback that is not damage (a refusal of the content) quarantines nothing.
    again.record_event({"event": "restore_fallback", "source": "storage", "step": 9, "corrupt": False})
    assert again.summary()["committed_steps"] == [6, 9]
    # What users read of the run says the same: not listed, not loaded by default, refused by step.
    from cf_ray import cli
    from cf_ray.errors import CorruptCheckpointError
    from cf_ray.load import list_checkpoints, load_state, quarantined_checkpoints

    root = ctl.storage.root
    assert [c.step for c in list_checkpoints(root)] == [6, 9]
    assert quarantined_checkpoints(root) == {8: "CorruptCheckpointError: crc mismatch"}
    with pytest.raises(CorruptCheckpointError, match="step 8 .* quarantined"):
        load_state(root, step=8)
    assert cli.main(["ls", root]) == 0


def test_a_memory_restore_takes_a_peers_copy_of_a_lost_nodes_section(tmp_path):
    """Peer replicas (#12): a snapshot whose section's holder is on a lost node is still restorable
    from memory when a holder of a surviving node has a copy; without a copy the newest snapshot
    whose every section survives is chosen; a copy that failed or was skipped counts for nothing."""
    ctl = _controller(tmp_path)
    meta = {"world_size": 2, "replicated": False, "epoch": 0, "kind": CheckpointKind.SCHEDULED}

    def stage(step, sec, holder, node):
        m = SnapshotMeta(**meta, rank=mf.section_rank(sec))
        ctl.part_staged(
            PartStaged(generation=1, step=step, section=sec, holder=holder, nbytes=32, meta=m, node_id=node)
        )

    def replica(step, sec, holder, node, origin, **kw):
        ctl.part_replicated(
            PartReplicated(
                generation=1, step=step, section=sec, holder=holder, node_id=node, origin=origin, nbytes=32, **kw
            )
        )

    ctl.generation = 1
    r0, r1 = mf.rank_section(0), mf.rank_section(1)
    for step in (5, 10):
        stage(step, r0, "hA", "A")
        stage(step, r1, "hB", "B")
    replica(5, r1, "hA", "A", "hB", seconds=0.01)  # step 5's rank 1 section has a copy on node A
    replica(10, r1, "hA", "A", "hB", error="RayActorError: the peer died")  # step 10's copy failed
    replica(10, r0, "", "", "hA", skipped=True)
    books = ctl._commits
    assert books.newest_in_memory({"A", "B"}).step == 10  # every node alive: the newest
    lost_b = books.newest_in_memory({"A"})
    assert lost_b.step == 5 and lost_b.sections == {r0: "hA", r1: "hA"} and lost_b.replicas == {}
    assert books.newest_in_memory({"B"}) is None  # node A lost: step 5's rank 0 section has no copy
    replica(10, r1, "hA", "A", "hB", seconds=0.02)  # the copy is made after all
    again = books.newest_in_memory({"A", "B"})
    assert again.step == 10 and again.sections == {r0: "hA", r1: "hB"} and again.replicas == {r1: ("hA",)}
    rows = {r["step"]: r for r in ctl.profile_rows()}
    assert rows[10]["replica_bytes"] == 32 and rows[10]["replicas_skipped"] == 1
    assert "the peer died" in rows[10]["replica_error"]


def test_a_restarted_controller_learns_the_peers_copies_from_their_holders(tmp_path):
    """A controller that starts again learns what each holder holds from its ``resync``; the copies
    a holder keeps for other nodes are in it too (#12: a restarted controller used to forget them,
    so a node lost before the next copy meant storage). Here node B is lost with the controller:
    only hA (node A) answers, with rank 0's section and its copy of rank 1's, and with rank 1's
    section as B's holder staged it. The new controller finds step 10 restorable from A's memory
    alone, and counts no copy twice. And a holder drops the copies a commit made stale (those of a
    lost node's holder included: they used to stay until the run ended)."""
    import numpy as np

    from cf_ray._engine.node.holder import Holder

    meta = {"world_size": 2, "replicated": False, "epoch": 0, "kind": CheckpointKind.SCHEDULED}
    r0, r1 = mf.rank_section(0), mf.rank_section(1)

    def holder_of(node):  # the holders of nodes A and B, here in the test's process
        return Holder(
            FsStorage(pafs.LocalFileSystem(), str(tmp_path / node)),
            "cf_ray.controller.gone",
            "cf_ray-test",
            name=f"h{node}",
            node=node,
            host="127.0.0.1",
        )

    holder, origin = holder_of("A"), holder_of("B")

    def copy(step):  # B offers its section of ``step``; A pulls it, as B's replicator has A do
        arena = np.arange(32, dtype=np.uint8)
        staged = staged_slot(origin.arena(r1, 32), 1, step, r1, arena, b'{"entries":[],"tree":null}')
        lk = slots.ReadLock.take(staged.slot, 1, step)
        desc, _ = origin._server.get().offer(32, lk.close, fd=lk.fd, offset=slots.HEADER_BYTES)
        offer = ReplicaOffer(
            generation=1, step=step, section=r1, index=staged.index, crc32=staged.crc32,
            meta=SnapshotMeta(**meta, rank=1), origin="hB", origin_node="B", stream=desc,
        )  # fmt: skip
        return holder.hold_replica(offer)

    got = copy(10)
    assert got.holder == "hA"
    state = holder.resync()
    assert [(m.holder, m.origin, m.section, m.step) for m in state.replicas] == [("hA", "hB", r1, 10)]
    assert [(m.holder, m.node_id, m.section) for m in state.replica_origins] == [("hB", "B", r1)]
    own = PartStaged(
        generation=1, step=10, section=r0, holder="hA", nbytes=32, meta=SnapshotMeta(**meta, rank=0), node_id="A"
    )
    state = dataclasses.replace(state, generation=1, staged=(own,))

    # Copies that can no longer be restored go: a commit of step 12 (generation 1) drops the copy of step 10.
    copy(12)
    holder.forget([], committed=(1, 12))
    assert [m.step for m in holder.resync().replicas] == [12]
    holder.forget([], committed=(2, 12))  # a newer generation committed: the old one's copies are stale
    assert holder.resync().replicas == ()

    ctl = _controller(tmp_path)  # the controller that started again
    assert ctl._commits.newest_in_memory({"A"}) is None
    ctl.apply_holder_state(state)
    snap = ctl._commits.newest_in_memory({"A"})
    assert snap is not None and snap.step == 10 and snap.sections == {r0: "hA", r1: "hA"}, snap
    ctl.apply_holder_state(state)  # said again: nothing changes, nothing counted
    assert ctl._commits.newest_in_memory({"A"}) == snap
    assert not any(r.get("replica_bytes") for r in ctl.profile_rows())
    assert not ctl._commits.bandwidths._peer  # no bandwidth learnt from a resync


def test_replica_every_copies_the_same_steps_on_every_node():
    """``CheckpointConfig.replica_every``: one snapshot in n is copied, the same steps on every rank
    (decided by the step and the interval alone, so the copied steps are complete), also when the
    interval changes; preemption checkpoints, milestones and snapshots without an interval always."""
    from cf_ray._engine.worker.snapshot import replica_due

    steps = range(5, 205, 5)
    assert all(replica_due(s, 1, 5) for s in steps)
    assert [s for s in steps if replica_due(s, 4, 5)] == list(range(20, 205, 20))
    # An interval that changes (Adaptive): still about one in n.
    sched = [(s, 3 + (s // 40) % 4) for s in range(3, 400, 3)]
    due = [s for s, k in sched if replica_due(s, 4, k)]
    assert len(sched) / 8 < len(due) < len(sched) / 2, due
    assert replica_due(7, 4, 5, always=True) and replica_due(7, 4, None)


# -- the tier of a just-in-time checkpoint (#12) ---------------------------------------------------------

MB = 1_000_000


def _jit_controller(tmp_path, draining: set[str]) -> Controller:
    ctl = _controller(tmp_path)
    ctl.generation = 1
    ctl._commits.draining = lambda: set(draining)  # what Ray's GCS says inside the actor
    return ctl


def _stage2(ctl: Controller, step: int, nbytes: int, *, replicas: int = 1, **meta) -> None:
    """Rank 0's section staged in holder hA on node A, rank 1's in hB on node B (replicated=False)."""
    for rank, (holder, node) in enumerate((("hA", "A"), ("hB", "B"))):
        m = SnapshotMeta(
            world_size=2,
            replicated=False,
            epoch=0,
            rank=rank,
            replicas=replicas,
            **{"kind": CheckpointKind.SCHEDULED, **meta},
        )
        ctl.part_staged(
            PartStaged(
                generation=1,
                step=step,
                section=mf.rank_section(rank),
                holder=holder,
                nbytes=nbytes,
                meta=m,
                node_id=node,
            )
        )


def _durable2(ctl: Controller, step: int, persist_s: float) -> None:
    for rank, holder in enumerate(("hA", "hB")):
        sec = mf.rank_section(rank)
        files, _ = _write(ctl, step, sec)
        ctl.part_durable(
            PartDurable(generation=1, step=step, section=sec, files=files, persist_s=persist_s, holder=holder)
        )


def _copied(ctl: Controller, step: int, rank: int, nbytes: int, seconds: float) -> None:
    """A copy of rank ``rank``'s section made by its holder in the other node's holder."""
    origin, peer, node = (("hA", "hB", "B"), ("hB", "hA", "A"))[rank]
    ctl.part_replicated(
        PartReplicated(
            generation=1,
            step=step,
            section=mf.rank_section(rank),
            holder=peer,
            node_id=node,
            origin=origin,
            nbytes=nbytes,
            seconds=seconds,
        )
    )


def _measured_run(ctl: Controller) -> None:
    """Step 5: 10 MB per rank, 2 s per holder on storage (5 MB/s) and 50 ms per peer copy (200 MB/s)."""
    _stage2(ctl, 5, 10 * MB)
    _copied(ctl, 5, 0, 10 * MB, 0.05)
    _copied(ctl, 5, 1, 10 * MB, 0.05)
    _durable2(ctl, 5, 2.0)
    _wait_maintenance(ctl)
    assert ctl.summary()["committed_steps"] == [5]


def test_a_jit_checkpoint_whose_deadline_fits_only_a_peer_copy_is_safe_once_copied(tmp_path):
    """Storage measured at 2 s per checkpoint, peer copies at 50 ms; node B drains with 2.5 s left.
    Storage does not fit (2 s x 1.5 margin), a peer copy does: the controller chooses the peer tier.
    The checkpoint is safe — the preempted rank's wait ends, it is the memory restore point when B is
    lost — as soon as B's section has a copy on A; rank 0's section (node A, not draining) needs
    nothing more from rank 0 or its holder. Storage goes on and commits later; the row keeps the
    prediction, both actual times and made_deadline from the peer copy."""
    ctl = _jit_controller(tmp_path, {"B"})
    _measured_run(ctl)
    deadline = time.time() + 2.5
    _stage2(ctl, 7, 10 * MB, kind=CheckpointKind.PREEMPT, priority=True, deadline_unix=deadline)
    row = {r["step"]: r for r in ctl.profile_rows()}[7]
    assert row["jit_tier"] == "peer", row
    assert row["predicted_storage_s"] == pytest.approx(2.0 + ctl._commits.bandwidths.commit_s(), rel=0.05)
    assert row["predicted_peer_s"] == pytest.approx(0.05, rel=0.05)  # only B's section needs a copy
    assert row["jit_defaults"] is None and 2.0 < row["jit_left_s"] <= 2.5
    assert ctl.settled(1, [7])["pending"] == [7] and ctl.settled(1, [7])["safe"] == []
    assert ctl._commits.newest_in_memory({"A"}).step == 5  # B lost now: step 7's rank 1 section is gone

    _copied(ctl, 7, 1, 10 * MB, 0.04)  # B's holder copies its section to A: nothing else happens
    report = ctl.settled(1, [7])
    assert report["pending"] == [7] and report["safe"] == [7]  # not committed, yet safe
    snap = ctl._commits.newest_in_memory({"A"})
    assert snap.step == 7 and snap.sections == {mf.rank_section(0): "hA", mf.rank_section(1): "hA"}
    row = {r["step"]: r for r in ctl.profile_rows()}[7]
    assert row["safe_tier"] == "peer" and row["made_deadline"] is True and row["actual_peer_s"] < 2.5
    assert not row["committed"] and "actual_storage_s" not in row

    _durable2(ctl, 7, 2.0)  # storage finishes in the background
    _wait_maintenance(ctl)
    row = {r["step"]: r for r in ctl.profile_rows()}[7]
    assert row["committed"] and row["actual_storage_s"] >= 0 and row["made_deadline"] is True
    assert row["safe_tier"] == "peer"  # safe first in the tier it chose
    (event,) = [e for e in ctl.events() if e["event"] == "jit_tier"]
    assert event["step"] == 7 and event["jit_tier"] == "peer"


def test_a_jit_checkpoint_chooses_storage_when_it_fits_and_none_when_nothing_does(tmp_path):
    """The same measurements: with 10 s left storage fits and is chosen (a peer copy then does not
    make it count as safe: only the commit does); with 0.02 s left and replication off nothing fits:
    the tier is none, the checkpoint is never safe, and when its section fails (the node went mid-write)
    nothing of it is committed and the previous checkpoint stays the newest."""
    ctl = _jit_controller(tmp_path, {"B"})
    _measured_run(ctl)
    _stage2(ctl, 6, 10 * MB, kind=CheckpointKind.PREEMPT, priority=True, deadline_unix=time.time() + 10)
    _copied(ctl, 6, 1, 10 * MB, 0.04)
    rows = {r["step"]: r for r in ctl.profile_rows()}
    assert rows[6]["jit_tier"] == "storage" and ctl.settled(1, [6])["safe"] == []
    assert rows[6]["actual_peer_s"] >= 0 and "made_deadline" not in rows[6]
    _durable2(ctl, 6, 0.5)
    _wait_maintenance(ctl)
    row = {r["step"]: r for r in ctl.profile_rows()}[6]
    assert row["committed"] and row["safe_tier"] == "storage" and row["made_deadline"] is True

    _stage2(ctl, 8, 10 * MB, replicas=0, kind=CheckpointKind.PREEMPT, priority=True, deadline_unix=time.time() + 0.02)
    row = {r["step"]: r for r in ctl.profile_rows()}[8]
    assert row["jit_tier"] == "none" and row["predicted_peer_s"] is None, row
    files, _ = _write(ctl, 8, mf.rank_section(0))
    ctl.part_durable(
        PartDurable(generation=1, step=8, section=mf.rank_section(0), files=files, persist_s=0.1, holder="hA")
    )
    ctl.part_failed(
        PartFailed(generation=1, step=8, section=mf.rank_section(1), error="lost: holder hB died", holder="hB")
    )
    _wait_maintenance(ctl)
    row = {r["step"]: r for r in ctl.profile_rows()}[8]
    assert row["made_deadline"] is False and not row["committed"] and "safe_tier" not in row
    assert ctl.summary()["committed_steps"] == [5, 6]
    assert not ctl.storage.exists(f"{mf.step_dir(8)}/{mf.MANIFEST}")


def test_the_jit_tier_prediction_without_measurements_and_without_a_known_draining_node():
    """The pure prediction: before anything is measured, the documented conservative defaults are
    used and named; when no node is known to drain (a SIGTERM, a driver's notice) every section needs
    a copy on another node; with no other node holding a holder of the run there is no peer tier; a
    drain of a node without a section of the run leaves nothing to copy."""
    bw = jit_tier.Bandwidths()
    secs = {"rank_00000": ("hA", "A", 40 * MB), "rank_00001": ("hB", "B", 40 * MB)}
    p = jit_tier.plan(
        now_unix=0.0, deadline_unix=30.0, sections=secs, draining=(), peer_nodes={"A", "B"}, bandwidths=bw
    )
    assert p.predicted_storage_s == pytest.approx(40 * MB / jit_tier.DEFAULT_STORAGE_BPS + jit_tier.DEFAULT_COMMIT_S)
    assert p.predicted_peer_s == pytest.approx(40 * MB / jit_tier.DEFAULT_PEER_BPS + jit_tier.DEFAULT_PEER_CALL_S)
    assert p.defaults == ("storage", "peer") and p.needs_copy == set(secs) and p.tier is jit_tier.JitTier.STORAGE
    p = jit_tier.plan(
        now_unix=0.0, deadline_unix=3.0, sections=secs, draining={"B"}, peer_nodes={"A", "B"}, bandwidths=bw
    )
    assert p.tier is jit_tier.JitTier.PEER and p.needs_copy == {"rank_00001"}
    assert not p.peer_safe({"rank_00001": "B"}, {"rank_00001": {"hB2": "B"}})  # a copy on its own node
    assert p.peer_safe({"rank_00001": "B"}, {"rank_00001": {"hA": "A"}})
    p = jit_tier.plan(now_unix=0.0, deadline_unix=3.0, sections=secs, draining={"B"}, peer_nodes={"B"}, bandwidths=bw)
    assert p.predicted_peer_s is None and p.tier is jit_tier.JitTier.NONE  # no usable node to copy to
    p = jit_tier.plan(now_unix=0.0, deadline_unix=3.0, sections=secs, draining={"C"}, peer_nodes=None, bandwidths=bw)
    assert p.predicted_peer_s == 0.0 and p.tier is jit_tier.JitTier.PEER and p.peer_safe({}, {})
    bw.add_storage("hA", 40 * MB, 0.4)  # 100 MB/s measured on hA; hB predicted from it
    p = jit_tier.plan(now_unix=0.0, deadline_unix=3.0, sections=secs, draining={"B"}, peer_nodes={"A"}, bandwidths=bw)
    assert p.tier is jit_tier.JitTier.STORAGE and p.predicted_storage_s == pytest.approx(
        0.4 + jit_tier.DEFAULT_COMMIT_S
    )
    assert p.defaults == ("peer",)
