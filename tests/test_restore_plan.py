"""What a restore plan offers (issue 23, #1 and #9, controller side), in process: never a snapshot
whose step was abandoned or failed, never one whose bytes failed a restore's verification, never one
the run distrusted; and what the controller takes out of use is kept for inspection, said once, and
counted."""

from __future__ import annotations

import json

from cf_ray._engine.driver.recovery import CONTROL_STATE
from cf_ray._engine.format.catalog import list_committed
from cf_ray._engine.format.layout import rank_section
from cf_ray._engine.protocol.messages import CheckpointKind, PartFailed, PartSuperseded, Restored, RestoreSource

from controller_harness import commit, durable, meta, replicated, staged, wait_idle

R0, R1 = rank_section(0), rank_section(1)


def _stage_both(ctl, gen: int, step: int) -> None:
    """Both ranks' sections of ``step`` held by their holders (nothing written yet)."""
    for rank, (holder, node) in enumerate((("hA", "A"), ("hB", "B"))):
        ctl.part_staged(staged(gen, step, rank_section(rank), holder, node, meta(rank, 2)))


def test_a_plan_never_names_a_snapshot_whose_step_failed_or_was_abandoned(controller):
    """Settled entries stay in the pending table for a while (late messages are answered from it);
    before #23 #9 the plan took the newest complete one whatever its state. A failed step (a section
    could not be written) and a step abandoned by a later attempt's restore are skipped; the newest
    pending or committed one is offered."""
    ctl = controller()
    gen = ctl.prepare_restore(2).generation
    _stage_both(ctl, gen, 5)
    _stage_both(ctl, gen, 10)
    ctl.part_failed(PartFailed(generation=gen, step=10, section=R1, error="OSError: disk full", holder="hB"))
    plan = ctl.prepare_restore(2)
    assert plan.memory is not None and plan.memory.step == 5, plan.memory  # step 10 failed
    ctl.restored(Restored(source=RestoreSource.MEMORY, step=5, epoch=0))
    gen2 = plan.generation
    _stage_both(ctl, gen2, 8)  # the second attempt gets to step 8, then fails
    plan = ctl.prepare_restore(2)
    assert plan.memory is not None and (plan.memory.generation, plan.memory.step) == (gen2, 8)
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=0, epoch=0))  # it restored older, on purpose
    # Steps 5 (gen 1) and 8 (gen 2) are past the third attempt's restore point: abandoned, never offered.
    assert ctl.settled(gen2, [8]).abandoned == (8,) and ctl.settled(gen, [5]).abandoned == (5,)
    assert ctl.prepare_restore(2).memory is None


def test_a_step_that_failed_only_because_its_node_was_lost_is_offered_from_the_peer_copies(controller):
    """Node B is lost while its holder still had to write rank 1's section of step 10: the watch fails
    that section as lost. A peer copy of it on node A makes step 10 a memory restore (what the
    copies are for), read from the copy; without one, the newest step whose every section
    survives is offered instead."""
    ctl = controller()
    gen = ctl.prepare_restore(2).generation
    ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
    for step in (5, 10):
        _stage_both(ctl, gen, step)
        ctl.part_replicated(replicated(gen, step, R1, peer="hA", node="A", origin="hB", seconds=0.01))
    _stage_both(ctl, gen, 15)  # not copied yet when B goes
    books = ctl._ledger.commits
    with ctl._ledger.lock:
        for step in (10, 15):
            books.failed(gen, step, R1, "lost: holder hB is gone", holder="hB", lost=True)
    snap = books.newest_in_memory({"A"})
    assert snap is not None and snap.step == 10 and snap.sections == {R0: "hA", R1: "hA"}, snap
    # A failure of the write itself (not a lost holder) is never offered.
    _stage_both(ctl, gen, 20)
    ctl.part_replicated(replicated(gen, 20, R1, peer="hA", node="A", origin="hB", seconds=0.01))
    ctl.part_failed(PartFailed(generation=gen, step=20, section=R1, error="OSError: disk full", holder="hB"))
    assert books.newest_in_memory({"A", "B"}).step == 10
    # A step a newer one superseded in the write queue is still in memory: offered (the newest copied
    # step, which storage may never get while it is slow).
    _stage_both(ctl, gen, 25)
    ctl.part_replicated(replicated(gen, 25, R1, peer="hA", node="A", origin="hB", seconds=0.01))
    for sec, holder in ((R0, "hA"), (R1, "hB")):
        ctl.part_superseded(PartSuperseded(generation=gen, step=25, section=sec, holder=holder))
    assert books.newest_in_memory({"A", "B"}).step == 25


def test_a_memory_snapshot_that_failed_verification_is_never_offered_again(controller, tmp_path):
    """Rank 0's restore found a block of step 10's section in memory failing its CRC (the worker's
    ``restore_fallback`` event, with the snapshot's generation and step) and fell back to storage.
    No later plan offers that snapshot — not even from a controller that starts again — and the
    run's summary, its restarts table and its metrics count it."""
    ctl = controller()
    gen = ctl.prepare_restore(2).generation
    ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
    commit(ctl, gen, 5, [R0, R1], "hA", "A")
    _stage_both(ctl, gen, 10)
    plan = ctl.prepare_restore(2)
    assert plan.memory is not None and plan.memory.step == 10
    ctl.record_event(
        {
            "event": "restore_fallback",
            "source": "memory",
            "where": "step 10 in memory",
            "generation": gen,
            "step": 10,
            "section": R1,
            "block": 3,
            "from": "hB",
            "verification": True,
            "error": "CorruptCheckpointError: block 3 of rank_00001 fails its CRC",
        }
    )
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=5, epoch=0))
    assert ctl.prepare_restore(2).memory.step == 5  # never step 10 of generation 1 again
    (event,) = [e for e in ctl.events() if e.get("event") == "distrusted"]
    assert (event["generation"], event["step"], event["source"]) == (gen, 10, "memory")
    assert "fails its CRC" in event["reason"]
    summary = ctl.summary()
    assert summary["restore_fallbacks"] == {"memory": {"verification": 1}}
    assert summary["distrusted"] == [[gen, 10]]
    assert summary["committed_steps"] == [5]  # a memory snapshot's failure quarantines nothing on storage
    (restart,) = [r for r in ctl._ledger.book.restart_rows() if r["restored_step"] == 5]
    assert restart["fallbacks"] == 1 and restart["memory_failed"] == 1
    # A controller that starts again (Ray restarted it) never offers it either.
    assert json.loads(ctl.storage.read_file(CONTROL_STATE).tobytes())["distrusted"] == [[gen, 10]]
    again = controller(recreated=True)
    again.apply_holder_state(_held_again(gen))
    assert again.prepare_restore(2).memory is None


def _held_again(gen: int):
    """What holders hA and hB say in a resync: both sections of step 10 still held."""
    from cf_ray._engine.protocol.messages import HolderState

    return HolderState(
        holder="hA",
        generation=gen,
        staged=(
            staged(gen, 10, R0, "hA", "A", meta(0, 2)),
            staged(gen, 10, R1, "hB", "B", meta(1, 2)),
        ),
    )


def test_distrust_takes_a_suspect_snapshot_out_of_every_plan_and_quarantines_its_checkpoint(controller):
    """Trust-gated recovery's call (the run went non-finite after restoring step 10): the snapshot is
    never offered from memory again and, committed, its checkpoint is quarantined with the reason —
    kept on storage for inspection, listed in quarantine.json, out of the plans and of keep-last. A
    snapshot that was never committed is only taken out of memory."""
    from cf_ray.load import list_checkpoints, quarantined_checkpoints

    ctl = controller(keep_last=2)
    gen = ctl.prepare_restore(2).generation
    ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
    for step in (5, 10):
        commit(ctl, gen, step, [R0, R1], "hA", "A")
    _stage_both(ctl, gen, 15)
    plan = ctl.prepare_restore(2)
    assert plan.memory.step == 15 and plan.storage == (10, 5)
    out = ctl.distrust(gen, 10, "non-finite loss 2 steps after restoring step 10")
    assert out.memory and out.quarantined and (out.generation, out.step) == (gen, 10)
    out = ctl.distrust(gen, 15, "non-finite loss after restoring step 15")
    assert out.memory and not out.quarantined  # not committed: nothing on storage to quarantine
    plan = ctl.prepare_restore(2)
    assert plan.memory.step == 5 and plan.storage == (5,)  # neither 15 nor 10, from memory or storage
    root = ctl.storage.root
    assert quarantined_checkpoints(root) == {10: "non-finite loss 2 steps after restoring step 10"}
    assert [c.step for c in list_committed(ctl.storage)] == [5, 10]  # kept for inspection
    assert [c.step for c in list_checkpoints(root)] == [5]
    # Another generation's step 10 is another snapshot: distrusting it leaves this checkpoint alone.
    assert not ctl.distrust(gen + 7, 5, "another attempt's step 5").quarantined
    assert ctl.summary()["committed_steps"] == [5]
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=5, epoch=0))  # the rollback
    commit(ctl, plan.generation, 20, [R0, R1], "hA", "A")
    commit(ctl, plan.generation, 25, [R0, R1], "hA", "A")
    wait_idle(ctl)
    assert [c.step for c in list_checkpoints(root)] == [20, 25]  # keep-last=2: 10 never counted
    assert 10 in [c.step for c in list_committed(ctl.storage)]  # ... and never deleted


def test_a_preemption_checkpoint_staged_before_distrust_keeps_its_own_kind(controller):
    """The row of a distrusted snapshot keeps what it was (the profile is a record, not a verdict)."""
    ctl = controller()
    gen = ctl.prepare_restore(1).generation
    m = meta(0, 1, kind=CheckpointKind.PREEMPT, deadline_unix=1e12)
    ctl.part_staged(staged(gen, 3, R0, "h", "", m))
    ctl.part_durable(durable(ctl.storage, gen, 3, R0))
    wait_idle(ctl)
    ctl.distrust(gen, 3, "suspect")
    (row,) = [r for r in ctl.profile_rows() if r["step"] == 3]
    assert row["kind"] == "preempt" and row["committed"] is True
    assert [e["event"] for e in ctl.events() if e["event"] in ("distrusted", "quarantined")] == [
        "distrusted",
        "quarantined",
    ]
