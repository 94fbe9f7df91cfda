"""The controller's bookkeeping, driven in process (no actor, no Ray: ``tests/controller_harness.py``):
a checkpoint commits once every section is durable, whatever order the holders' messages run in.

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

import pytest
import torch
from slot_helpers import staged_slot

from cf_ray._engine.driver import jit
from cf_ray._engine.driver.checkpoints import retention
from cf_ray._engine.driver.facade import Controller
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.catalog import QUARANTINE, Quarantined, list_committed, list_uncommitted, write_quarantine
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import MANIFEST, SHARED, rank_section, section_rank, step_dir
from cf_ray._engine.format.sections import load_section, verify_all, write_section
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

from controller_harness import Cluster, Holders, wait_idle
from storage_helpers import arena_of

WORLD = 2
SECTIONS = [SHARED, rank_section(0), rank_section(1)]


def _write(ctl: Controller, step: int, section: str) -> tuple[dict, torch.Tensor]:
    """Phase 2 of one section, as a holder does it: the files and what part_durable carries."""
    value = torch.arange(8, dtype=torch.float32) + 100 * step + SECTIONS.index(section)
    arena, index = arena_of({"w": value})
    files = write_section(ctl.storage, step_dir(step), ctl.generation, section, arena, index)
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
        meta=SnapshotMeta(**meta, rank=section_rank(sec)),
    )


def _messages() -> list[tuple[str, str]]:
    return [(kind, sec) for sec in SECTIONS for kind in ("staged", "durable")]


# Every order in which all three part_durable calls run before any part_staged, and a sample of
# the rest (all 720 would take a minute of fsyncs).
_ALL = list(itertools.permutations(range(6)))
_DURABLE_FIRST = [o for o in _ALL if all(o.index(i) < o.index(j) for i in (1, 3, 5) for j in (0, 2, 4))]
ORDERS = _DURABLE_FIRST[:12] + random.Random(0).sample([o for o in _ALL if o not in _DURABLE_FIRST], 12)


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "".join(map(str, o)))
def test_commits_whatever_order_the_holder_messages_run_in(controller, order):
    ctl = controller()
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
    assert ctl._ledger.pending_steps(ctl.generation) == []
    assert [c.step for c in list_committed(ctl.storage)] == [step]
    m = read_manifest(ctl.storage, step_dir(step))
    for sec in SECTIONS:
        section = load_section(ctl.storage, step_dir(step), m, sec)
        got = _codec.view(section.buf, section.entries[0], copy=True)
        assert torch.equal(got, written[sec][1])


def test_one_call_of_a_holders_queued_messages_applies_each_in_order_and_a_refused_one_drops_none(controller):
    """The holder's sender hands what it queued over in one ``deliver`` call (a Ray call per message was
    most of the holder's and the controller's CPU at a checkpoint every iteration): every message is
    applied as if it came alone, in order, and one the controller refuses is named without losing
    the ones after it."""
    ctl = controller()
    step = 9
    batch: list = []
    for sec in SECTIONS:
        files, _ = _write(ctl, step, sec)
        batch.append(("part_staged", _staged(ctl, step, sec)))
        if sec == SECTIONS[1]:
            batch.append(("commit_everything", None))  # not a holder's message
            batch.append(("part_durable", None))  # its handler raises
        batch.append(
            (
                "part_durable",
                PartDurable(generation=ctl.generation, step=step, section=sec, files=files, persist_s=0.01),
            )
        )
    refused = ctl.deliver(tuple(batch))
    assert len(refused) == 2 and refused[0].startswith("commit_everything") and refused[1].startswith("part_durable")
    assert ctl._ledger.pending_steps(ctl.generation) == []
    assert [c.step for c in list_committed(ctl.storage)] == [step]


def test_a_step_missing_a_section_stays_pending_and_uncommitted(controller):
    ctl = controller()
    for sec in SECTIONS[:2]:
        files, _ = _write(ctl, 3, sec)
        ctl.part_staged(_staged(ctl, 3, sec))
        ctl.part_durable(PartDurable(generation=ctl.generation, step=3, section=sec, files=files, persist_s=0.01))
    assert ctl._ledger.pending_steps(ctl.generation) == [3]
    assert list_committed(ctl.storage) == []


def test_a_superseded_step_is_not_waited_for_nor_committed(controller):
    ctl = controller()
    files, _ = _write(ctl, 4, SECTIONS[0])
    ctl.part_durable(PartDurable(generation=ctl.generation, step=4, section=SECTIONS[0], files=files, persist_s=0.01))
    ctl.part_superseded(PartSuperseded(generation=ctl.generation, step=4, section=SECTIONS[1]))
    for sec in SECTIONS:
        ctl.part_staged(_staged(ctl, 4, sec))
    for sec in SECTIONS[1:]:
        ctl.part_durable(
            PartDurable(generation=ctl.generation, step=4, section=sec, files=_write(ctl, 4, sec)[0], persist_s=0.01)
        )
    assert ctl._ledger.pending_steps(ctl.generation) == []
    assert list_committed(ctl.storage) == []


def test_a_memory_only_step_settles_at_once_stays_restorable_and_is_committed_when_finish_persists_it(controller):
    """The schedule's ``persist_every``: a snapshot held in memory only is settled (not waited for,
    no error in the profile), still the memory restore's candidate, and a persisted snapshot of the
    same step (what ``finish()`` takes) opens it again and commits it. Its holder, which keeps no
    record of a memory-only snapshot, is not told that it settled (a call per checkpoint at k=1);
    it is told of the commit."""
    link = Holders()
    ctl = controller(holders=link)
    for sec in SECTIONS:
        ctl.part_staged(_staged(ctl, 6, sec, persist=False))
    assert ctl._ledger.pending_steps(ctl.generation) == []
    assert ctl.settled(ctl.generation, [6]).superseded == (6,)
    assert link.forgotten == []
    row = next(r for r in ctl.profile_rows() if r["step"] == 6)
    assert row["where"] == "memory-only" and not row.get("error")
    plan = ctl.prepare_restore(WORLD)
    assert plan.memory is not None and plan.memory.step == 6
    assert plan.storage == ()
    ctl.prepare_restore(WORLD)  # a later attempt of the same run: the finish below is of its own generation
    for sec in SECTIONS:
        ctl.part_staged(_staged(ctl, 6, sec, persist=False))
    for sec in SECTIONS:  # finish(): the same step again, persisted
        ctl.part_staged(_staged(ctl, 6, sec, kind=CheckpointKind.MANUAL, milestone=True))
    assert ctl._ledger.pending_steps(ctl.generation) == [6]
    for sec in SECTIONS:
        files, _ = _write(ctl, 6, sec)
        ctl.part_durable(PartDurable(generation=ctl.generation, step=6, section=sec, files=files, persist_s=0.01))
    wait_idle(ctl)
    assert [c.step for c in list_committed(ctl.storage)] == [6]
    assert ctl.settled(ctl.generation, [6]).committed == (6,)
    assert link.forgotten == [("holder", ((ctl.generation, 6),))]


def _persist(ctl: Controller, step: int, sections=SECTIONS, **meta) -> None:
    """``finish()``'s persisted snapshot of ``step``: staged and written, section by section."""
    for sec in sections:
        ctl.part_staged(_staged(ctl, step, sec, **{"kind": CheckpointKind.FINAL, **meta}))
        files, _ = _write(ctl, step, sec)
        ctl.part_durable(PartDurable(generation=ctl.generation, step=step, section=sec, files=files, persist_s=0.01))
    wait_idle(ctl)


def test_a_held_final_step_finish_takes_again_is_pending_from_the_moment_a_rank_says_so(controller):
    """The loop's last checkpoint was held in memory only, settled as superseded. ``finish()`` takes it
    again, persisted, under the same key: every rank first tells the controller, so that ``settled``
    answers *pending* before the holders' staging of the new snapshot arrives (a rank's first poll
    used to find it superseded and end finish()'s wait at once, the final checkpoint not durable),
    and a held snapshot's staging delivered late changes nothing; it commits once written."""
    ctl = controller()
    for sec in SECTIONS:
        ctl.part_staged(_staged(ctl, 6, sec, persist=False))
    assert ctl.settled(ctl.generation, [6]).superseded == (6,)
    assert ctl.reopen_final(ctl.generation, 6, 0, 1)
    assert ctl.settled(ctl.generation, [6]).pending == (6,)  # before any holder said a word of it
    assert ctl.reopen_final(ctl.generation, 6, 1, 1)  # the other rank: the same try, nothing lost
    ctl.part_staged(_staged(ctl, 6, SHARED, persist=False))  # a held staging, delivered late
    assert ctl.settled(ctl.generation, [6]).pending == (6,)
    _persist(ctl, 6)
    assert ctl.settled(ctl.generation, [6]).committed == (6,)
    assert [c.step for c in list_committed(ctl.storage)] == [6]
    assert not ctl.reopen_final(ctl.generation, 6, 0, 2)  # committed: nothing to open


def test_a_final_step_whose_held_snapshot_one_rank_skipped_commits_when_finish_persists_it(controller):
    """Rank 1 had no free slot for the held snapshot of the last step (its skip fails the step).
    ``finish()``'s persisted snapshot of that step, every section of which becomes durable, commits
    (it never could: only a superseded step opened again), and a skip that rank 1 reported before it
    said it takes the step again, delivered after rank 0 said so, is the old snapshot's, not this one's."""
    ctl = controller()
    for sec in (SHARED, rank_section(0)):
        ctl.part_staged(_staged(ctl, 6, sec, persist=False))
    ctl.part_failed(PartFailed(generation=ctl.generation, step=6, section=rank_section(1), error="no slot"))
    assert 6 in ctl.settled(ctl.generation, [6]).failed
    assert ctl.reopen_final(ctl.generation, 6, 0, 1)
    ctl.part_failed(PartFailed(generation=ctl.generation, step=6, section=rank_section(1), error="no slot"))
    assert ctl.settled(ctl.generation, [6]).pending == (6,)
    assert ctl.reopen_final(ctl.generation, 6, 1, 1)
    _persist(ctl, 6)
    assert ctl.settled(ctl.generation, [6]).committed == (6,)


def test_a_failed_final_persist_is_taken_again_and_commits(controller):
    """``finish()``'s persisted snapshot of the final step fails to write; its next try (every rank
    says so first) opens the step again, and commits."""
    ctl = controller()
    for rank in (0, 1):
        ctl.reopen_final(ctl.generation, 8, rank, 1)
    for sec in SECTIONS:
        ctl.part_staged(_staged(ctl, 8, sec, kind=CheckpointKind.MANUAL))
    ctl.part_failed(PartFailed(generation=ctl.generation, step=8, section=SHARED, error="EIO", holder="holder"))
    for sec in SECTIONS[1:]:
        ctl.part_failed(PartFailed(generation=ctl.generation, step=8, section=sec, error="EIO", holder="holder"))
    assert 8 in ctl.settled(ctl.generation, [8]).failed
    for rank in (0, 1):
        assert ctl.reopen_final(ctl.generation, 8, rank, 2)
    assert ctl.settled(ctl.generation, [8]).pending == (8,)
    _persist(ctl, 8)
    assert ctl.settled(ctl.generation, [8]).committed == (8,)


def test_keep_last_never_deletes_the_resume_point_a_final_model_names(controller, tmp_path):
    """The final checkpoint was not durable in time: the final model names step 4, an ordinary
    checkpoint. With ``keep_last=1`` the final step's late commit used to delete step 4, and
    ``resume_from=result.checkpoint`` then raised ``CheckpointNotFoundError``. The resume point is
    kept, also by a controller that starts again (it reads what the final models name)."""
    from cf_ray._engine.format.safetensors import write_final_model
    from cf_ray.load import resumable_checkpoint

    ctl = controller(keep_last=1)
    for step in (2, 4):
        _persist(ctl, step, kind=CheckpointKind.SCHEDULED)
    assert ctl.keep_resume_point(4) == 4
    final = step_dir(6, kind="final")
    write_final_model(ctl.storage, final, torch.nn.Linear(2, 1), step=6, epoch=0, resume=step_dir(4))
    _persist(ctl, 6)  # the final checkpoint commits after finish() returned
    _persist(ctl, 8, kind=CheckpointKind.SCHEDULED)
    assert [c.step for c in list_committed(ctl.storage)] == [4, 8]
    assert resumable_checkpoint(ctl.storage.uri(final))[1] == step_dir(4)
    ctl._maintenance.stop()
    again = controller(keep_last=1)  # a controller that starts again: from storage
    _persist(again, 10, kind=CheckpointKind.SCHEDULED)
    assert [c.step for c in list_committed(again.storage)] == [4, 10]
    assert resumable_checkpoint(again.storage.uri(final))[1] == step_dir(4)


def test_the_final_step_is_listed_once_as_the_final_model_and_no_milestone_the_user_did_not_set(controller, tmp_path):
    """``keep_last=2`` and no ``milestone_every``: the run's end used to be listed twice, ``(60, final,
    milestone)`` and ``(60, manual, milestone)``. ``finish()``'s full checkpoint is of kind ``final``
    (its manifest and its profile row; a ``manual`` checkpoint is one the user asked for), listed once,
    as the final model (which resumes the run through it), and nothing is a milestone; keep-last still
    never deletes it (it is the resume point)."""
    import cf_ray
    from cf_ray._engine.format.safetensors import write_final_model
    from cf_ray.load import resumable_checkpoint

    ctl = controller(keep_last=2)
    for step in (20, 40):
        _persist(ctl, step, kind=CheckpointKind.SCHEDULED)
    _persist(ctl, 60)  # finish()'s checkpoint, not a milestone
    assert read_manifest(ctl.storage, step_dir(60)).kind == "final"
    assert {r["step"]: r["kind"] for r in ctl.profile_rows()}[60] == "final"
    assert [(c.step, c.kind, c.milestone) for c in cf_ray.list_checkpoints(str(tmp_path))][-1] == (60, "final", False)
    assert ctl.keep_resume_point(60) == 60
    final = step_dir(60, kind="final")
    write_final_model(ctl.storage, final, torch.nn.Linear(2, 1), step=60, epoch=2, resume=step_dir(60))
    listed = [(c.step, c.kind, c.milestone, c.path.rsplit("/", 1)[1]) for c in cf_ray.list_checkpoints(str(tmp_path))]
    assert listed == [
        (40, "scheduled", False, "step_000000000040"),
        (60, "final", False, "final_000000000060"),
    ]
    _persist(ctl, 80, kind=CheckpointKind.SCHEDULED)  # a later run in the same place
    _persist(ctl, 100, kind=CheckpointKind.SCHEDULED)
    _persist(ctl, 120, kind=CheckpointKind.SCHEDULED)
    assert [c.step for c in list_committed(ctl.storage)] == [60, 100, 120]
    assert resumable_checkpoint(ctl.storage.uri(final))[1] == step_dir(60)


def test_keep_last_spares_what_ray_train_lists_until_ray_drops_its_pointer(controller, tmp_path, caplog):
    """``keep_last=1`` with registration: a step rank 0 registers with Ray Train (a pointer directory
    Ray lists in ``result.best_checkpoints``) used to be deleted by keep-last like any other, and the
    pointer Ray handed back then named a checkpoint that was gone. Keep-last spares it (it still
    counts toward ``keep_last``) while its pointer is there, also in a controller that starts again;
    once Ray's ``num_to_keep`` deletes the pointer, keep-last deletes the step. A step keep-last took
    out already is replaced by the newest committed one (what Ray lists always loads)."""
    import logging

    from cf_ray._engine.format.commit import write_pointer
    from cf_ray._engine.format.layout import pointer_dir
    from cf_ray.load import resumable_checkpoint

    caplog.set_level(logging.WARNING, logger="cf_ray")
    ctl = controller(keep_last=1)
    _persist(ctl, 2, kind=CheckpointKind.SCHEDULED)
    assert ctl.keep_registered(2) == 2  # rank 0 asks first, then writes the pointer and reports it
    listed = ctl.storage.uri(write_pointer(ctl.storage, 2))
    for step in (4, 6, 8):
        _persist(ctl, step, kind=CheckpointKind.SCHEDULED)
    assert [c.step for c in list_committed(ctl.storage)] == [2, 8]
    run, directory = resumable_checkpoint(listed)  # what Ray lists loads
    assert directory == step_dir(2) and verify_all(run, directory, read_manifest(run, directory)) is None
    assert "keeps step 2 beyond keep_last=1: it is registered with Ray Train" in caplog.text
    assert ctl.keep_registered(4) == 8  # gone: the newest committed step is kept and registered instead
    assert ctl.keep_registered(8) == 8
    write_pointer(ctl.storage, 8)
    ctl.storage.delete_dir(pointer_dir(2))  # Ray's num_to_keep=1 drops the older one
    _persist(ctl, 10, kind=CheckpointKind.SCHEDULED)
    assert [c.step for c in list_committed(ctl.storage)] == [8, 10]
    ctl._maintenance.stop()
    again = controller(keep_last=1)  # a controller that starts again: Ray's list read from storage
    _persist(again, 12, kind=CheckpointKind.SCHEDULED)
    assert [c.step for c in list_committed(again.storage)] == [8, 12]


def test_one_steps_section_failures_are_answered_together(controller):
    """A step fails on its first section's failure, but ``settled`` answers it as pending while the
    holder still writes its other sections (at most ``SETTLING_S``): a rank's ``wait()`` then
    reports the failures of all of them in one call, never one step's failures across two."""
    ctl = controller()
    for sec in SECTIONS:
        ctl.part_staged(_staged(ctl, 6, sec))
    ctl.part_failed(PartFailed(generation=ctl.generation, step=6, section=SHARED, error="EIO", holder="holder"))
    assert ctl.settled(ctl.generation, [6]).pending == (6,)
    ctl.part_failed(
        PartFailed(generation=ctl.generation, step=6, section=rank_section(0), error="EIO", holder="holder")
    )
    assert ctl.settled(ctl.generation, [6]).pending == (6,)
    files, _ = _write(ctl, 6, rank_section(1))
    ctl.part_durable(
        PartDurable(generation=ctl.generation, step=6, section=rank_section(1), files=files, persist_s=0.01)
    )
    settled = ctl.settled(ctl.generation, [6])
    assert 6 in settled.failed and settled.pending == ()
    assert {f["section"] for f in ctl.summary()["failures"] if f["step"] == 6} == {SHARED, rank_section(0)}


_wait_maintenance = wait_idle


def test_a_checkpoint_committed_during_the_clean_up_of_older_directories_is_kept(controller, monkeypatch):
    """Out-of-order commits: step 11 commits first (rank 1's section of the milestone step 10 came
    late to its holder), so the clean-up after it finds step 10 without a manifest, older than the
    newest. If step 10's last section turns durable between that listing and the check of what is
    still in flight, step 10 is committed: it must not be deleted (a CI run lost its milestone so)."""
    ctl = controller(keep_last=2)
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
    assert ctl._ledger.pending_steps(ctl.generation) == [10, 11]

    real_list = list_uncommitted
    late = {"files": last[10][0]}

    def listing_then_the_late_section(storage):
        out = real_list(storage)
        files = late.pop("files", None)
        if files is not None:  # the holder's message runs now, on another thread
            ctl.part_durable(
                PartDurable(generation=ctl.generation, step=10, section=SECTIONS[-1], files=files, persist_s=0.01)
            )
        return out

    monkeypatch.setattr(retention, "list_uncommitted", listing_then_the_late_section)
    ctl.part_durable(
        PartDurable(generation=ctl.generation, step=11, section=SECTIONS[-1], files=last[11][0], persist_s=0.01)
    )  # 11 commits before 10
    _wait_maintenance(ctl)
    assert "files" not in late, "the interleaving under test did not happen"
    assert [c.step for c in list_committed(ctl.storage)] == [10, 11]
    m = read_manifest(ctl.storage, step_dir(10))
    assert m.milestone
    section = load_section(ctl.storage, step_dir(10), m, SECTIONS[-1])  # verifies every checksum it reads
    assert torch.equal(_codec.view(section.buf, section.entries[0], copy=True), last[10][1])


def _commit(ctl: Controller, step: int) -> None:
    for sec in SECTIONS:
        files, _ = _write(ctl, step, sec)
        ctl.part_staged(_staged(ctl, step, sec))
        ctl.part_durable(PartDurable(generation=ctl.generation, step=step, section=sec, files=files, persist_s=0.01))
    _wait_maintenance(ctl)


def test_clean_up_deletes_a_leftover_directory_only_once_it_is_known_dead(controller):
    """A directory without a manifest, older than the newest commit: a crashed writer's leftover,
    or a holder's write whose part_staged has not reached the threaded controller yet. The first
    clean-up that sees it unknown keeps it; one that still finds it unknown later deletes it; a
    failed step's directory goes at once; one that became known and committed stays."""
    ctl = controller(keep_last=None)
    _write(ctl, 3, SECTIONS[0])  # nobody ever says anything of step 3
    _write(ctl, 4, SECTIONS[0])  # step 4 is announced late, then commits
    _write(ctl, 5, SECTIONS[0])
    ctl.part_failed(PartFailed(generation=ctl.generation, step=5, section=SECTIONS[1], error="IOError: disk full"))
    _commit(ctl, 6)
    uncommitted = {s for _, s in list_uncommitted(ctl.storage)}
    assert uncommitted == {3, 4}
    _commit(ctl, 4)
    _commit(ctl, 7)
    assert list_uncommitted(ctl.storage) == []
    assert [c.step for c in list_committed(ctl.storage)] == [4, 6, 7]


def test_keep_last_deletes_nothing_a_restore_plan_names_until_the_restore_is_done(controller):
    """keep_last=1: while a new attempt restores from the checkpoint its plan names, a late commit of
    the previous attempt (a holder finishing its write) must not delete that checkpoint under it."""
    ctl = controller(keep_last=1)
    _commit(ctl, 4)
    plan = ctl.prepare_restore(WORLD)
    assert plan.storage == (4,)
    _commit(ctl, 6)  # the previous attempt's holder commits late
    assert [c.step for c in list_committed(ctl.storage)] == [4, 6]
    m = read_manifest(ctl.storage, step_dir(4))
    verify_all(ctl.storage, step_dir(4), m)  # the restore reads it whole
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=4, epoch=0))
    _wait_maintenance(ctl)
    assert [c.step for c in list_committed(ctl.storage)] == [6]  # deferred, not forgotten


def _damage(ctl: Controller, step: int) -> None:
    """Flip one byte in the middle of the data file of rank 1's section of ``step`` on storage."""
    m = read_manifest(ctl.storage, step_dir(step))
    data = m.sections[rank_section(1)]["data"]
    path = f"{ctl.storage.fs_path(step_dir(step))}/{data}"
    with open(path, "r+b") as f:
        f.seek(8)
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_checkpoint_the_controller_rereads_damaged_is_quarantined_and_never_counts_toward_keep_last(controller):
    """keep_last=2 with the newest checkpoint damaged on storage: a rank's restore reports it, the
    controller re-reads it (sizes and CRCs, on its maintenance thread) and finds it damaged, so it is
    quarantined. Without quarantine, the next two commits would push out the good step 6 while the
    corrupt step 8 still counted as one of the two kept."""
    ctl = controller(keep_last=2)
    for step in (4, 6, 8):
        _commit(ctl, step)
    assert ctl.prepare_restore(WORLD).storage == (8, 6)
    _damage(ctl, 8)
    # Rank 0's restore found step 8 damaged on this run's own storage and fell back to step 6.
    ctl.record_event(
        {
            "event": "restore_fallback",
            "source": "storage",
            "step": 8,
            "corrupt": True,
            "where": ctl.storage.uri(step_dir(8)),
            "error": "CorruptCheckpointError: crc mismatch",
        }
    )
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=6, epoch=0))
    _wait_maintenance(ctl)
    (event,) = [e for e in ctl.events() if e.get("event") == "quarantined"]
    assert event["step"] == 8 and "fails its checksum" in event["error"]  # the controller's own finding
    _commit(ctl, 9)
    steps = [c.step for c in list_committed(ctl.storage)]
    assert 6 in steps and 9 in steps, steps  # the good one is kept: 8 does not count
    assert 8 in steps  # quarantined, not deleted: kept for inspection
    assert ctl.summary()["committed_steps"] == [6, 9]
    assert ctl.summary()["restore_fallbacks"] == {"storage": {"verification": 1}}
    # A controller that starts again (a new driver) never names it either.
    again = controller(keep_last=2)
    assert again.prepare_restore(WORLD).storage == (9, 6)
    # A fallback that is not damage (a refusal of the content) makes nothing re-read, nothing quarantined.
    again.record_event({"event": "restore_fallback", "source": "storage", "step": 9, "corrupt": False})
    _wait_maintenance(again)
    assert again.summary()["committed_steps"] == [6, 9]
    # What users read of the run says the same: not listed, not loaded by default, refused by step.
    from cf_ray import cli
    from cf_ray.errors import CorruptCheckpointError
    from cf_ray.load import list_checkpoints, load_state, quarantined_checkpoints

    root = ctl.storage.root
    assert [c.step for c in list_checkpoints(root)] == [6, 9]
    (why,) = quarantined_checkpoints(root).values()
    assert list(quarantined_checkpoints(root)) == [8] and "fails its checksum" in why
    with pytest.raises(CorruptCheckpointError, match="step 8 .* quarantined"):
        load_state(root, step=8)
    assert cli.main(["ls", root]) == 0


@pytest.mark.parametrize("controller_starts_again", [False, True], ids=["same_controller", "controller_starts_again"])
def test_a_step_committed_again_after_its_quarantine_is_listed_again(controller, controller_starts_again):
    """Found by the fault soak: step 8's checkpoint was quarantined (damaged on storage), the next
    attempt resumed from step 6 and committed step 8 again, intact. ``quarantine.json`` still named
    step 8, so every later listing (a new controller, ``cf-ray ls``, ``load_state``) hid the new
    checkpoint: a milestone among them was gone for good. A commit of a quarantined step lifts its
    quarantine, says so (a log line, an event), and the step is listed and restorable again — also
    when the controller that quarantined it died in between (``quarantine.json`` says which
    quarantines were for damaged bytes)."""
    from cf_ray.load import list_checkpoints, quarantined_checkpoints

    ctl = controller(keep_last=None)
    for step in (6, 8):
        _commit(ctl, step)
    ctl.prepare_restore(WORLD)
    _damage(ctl, 8)
    ctl.record_event({"event": "restore_fallback", "source": "storage", "step": 8, "corrupt": True, "error": "crc"})
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=6, epoch=0))
    _wait_maintenance(ctl)
    root = ctl.storage.root
    assert list(quarantined_checkpoints(root)) == [8]
    if controller_starts_again:
        ctl = controller(keep_last=None)
        assert ctl.summary()["committed_steps"] == [6]
    ctl.prepare_restore(WORLD)  # the next attempt replays step 8 and commits it again
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=6, epoch=0))
    _commit(ctl, 8)
    _wait_maintenance(ctl)
    assert quarantined_checkpoints(root) == {}
    (lifted,) = [e for e in ctl.events() if e.get("event") == "quarantine_lifted"]
    assert lifted["step"] == 8 and "fails its checksum" in lifted["was"]
    assert [c.step for c in list_checkpoints(root)] == [6, 8]
    assert controller(keep_last=None).prepare_restore(WORLD).storage == (8, 6)  # a new controller
    m = read_manifest(ctl.storage, step_dir(8))
    verify_all(ctl.storage, step_dir(8), m)  # the new checkpoint, whole and intact
    assert m.generation == ctl.generation


def test_a_suspect_step_committed_again_by_the_next_generation_is_the_good_checkpoint_everywhere(
    controller, capsys, tmp_path
):
    """A trust-gate rollback quarantines step 8 of generation 1 (its state went non-finite after a
    restore); the next attempt (generation 2) replays and commits step 8 again. That checkpoint is
    not the one quarantined: a controller that starts again restores it and keep-last counts and
    deletes it; ``resumable_checkpoint``, ``resume_from=<run dir>``, ``list_checkpoints``,
    and ``cf-ray ls`` all see it, and none still calls step 8 quarantined. The
    quarantine stays on generation 1's checkpoint alone (were step 8 not committed again, it would
    still be hidden)."""
    from cf_ray import cli
    from cf_ray._engine.worker.restore.storage import other_run_checkpoint
    from cf_ray.load import list_checkpoints, quarantined_checkpoints, resumable_checkpoint

    run = tmp_path / "run" / "cf_ray"  # as Ray Train lays a run out: cf-ray ls is given tmp_path/run

    ctl = controller(run, keep_last=None)
    for step in (6, 8):
        _commit(ctl, step)
    suspect = ctl.generation
    ctl.prepare_restore(WORLD)
    assert ctl.distrust(suspect, 8, "non_finite: rank 0: loss inf").quarantined
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=6, epoch=0))
    _wait_maintenance(ctl)
    root = ctl.storage.root
    assert list(quarantined_checkpoints(root)) == [8]  # generation 1's step 8: hidden
    assert controller(run, keep_last=None).summary()["committed_steps"] == [6]
    _commit(ctl, 8)  # the replay commits step 8 again, generation 2
    _wait_maintenance(ctl)
    assert ctl.summary()["committed_steps"] == [6, 8]
    assert read_manifest(ctl.storage, step_dir(8)).generation == ctl.generation != suspect
    # Every reader, a controller started again among them.
    again = controller(run, keep_last=None)
    assert again.summary()["committed_steps"] == [6, 8]
    assert again.prepare_restore(WORLD).storage == (8, 6)
    assert resumable_checkpoint(root)[1] == step_dir(8)
    found = other_run_checkpoint(root, None)
    assert found is not None and found[1] == step_dir(8)
    assert [c.step for c in list_checkpoints(root)] == [6, 8]
    assert quarantined_checkpoints(root) == {}
    capsys.readouterr()
    assert cli.main(["ls", str(tmp_path / "run")]) == 0
    listed = capsys.readouterr().out
    assert "step_000000000008" in listed and "quarantined" not in listed, listed
    # The same when the controller died before it took the entry out of quarantine.json: the entry
    # names generation 1's checkpoint, which is no longer the one on storage.
    write_quarantine(ctl.storage, {8: Quarantined("non_finite", suspect, damaged=False)})
    assert controller(run, keep_last=None).prepare_restore(WORLD).storage == (8, 6)
    assert resumable_checkpoint(root)[1] == step_dir(8) and quarantined_checkpoints(root) == {}
    # Keep-last counts it and deletes it in turn.
    kept = controller(run, keep_last=1)
    kept.prepare_restore(WORLD)
    kept.restored(Restored(source=RestoreSource.STORAGE, step=8, epoch=0))
    for step in (10, 12):
        _commit(kept, step)
    _wait_maintenance(kept)
    assert kept.summary()["committed_steps"] == [12]
    assert [c.step for c in list_committed(kept.storage)] == [12]


def test_memory_only_snapshots_of_an_abandoned_timeline_are_never_a_restore_candidate_again(controller):
    """Generation 1 commits step 4 and holds steps 6 and 8 in memory only (``persist_every``);
    generation 2 resumes at step 4 (from storage), so 6 and 8 belong to a timeline it replays:
    abandoned, their holders told. Generation 2 commits step 6 again and dies; generation 3 restores
    generation 2's step 6, not generation 1's step 8 — which would jump past the attempt that
    replaced it, into the abandoned timeline. A controller that starts again says the same."""
    link = Holders()
    ctl = controller(holders=link)
    _commit(ctl, 4)
    for step in (6, 8):
        for sec in SECTIONS:
            ctl.part_staged(_staged(ctl, step, sec, persist=False))
    old = ctl.generation
    assert ctl.settled(old, [6, 8]).superseded == (6, 8)
    plan = ctl.prepare_restore(WORLD)
    assert plan.memory is not None and (plan.memory.generation, plan.memory.step) == (old, 8)
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=4, epoch=0))  # the memory restore was not taken
    assert ctl.settled(old, [6, 8]).abandoned == (6, 8)
    assert ("holder", ((old, 6), (old, 8))) in link.forgotten  # their slots freed
    _commit(ctl, 6)
    replaced = ctl.generation
    plan = ctl.prepare_restore(WORLD)
    assert plan.memory is not None and (plan.memory.generation, plan.memory.step) == (replaced, 6), plan.memory
    assert plan.storage == (6, 4)


def test_one_ranks_read_error_never_quarantines_a_checkpoint_that_reads_back_intact(controller, monkeypatch):
    """Issue 23 #7: a rank's restore could not read step 8 (a file missing for a moment: a flaky
    mount, an object store's listing lag) and reported it as corrupt. The controller re-reads it,
    finds every file there with its size and CRC, and leaves it: not quarantined, still restorable,
    still counted by keep-last; it says so (a log line, a ``verified`` event). A storage that cannot
    be read at all during the re-read proves nothing either: left as well."""
    from cf_ray._engine.driver.checkpoints import quarantine

    ctl = controller(keep_last=2)
    for step in (6, 8):
        _commit(ctl, step)
    ctl.prepare_restore(WORLD)
    event = {
        "event": "restore_fallback",
        "source": "storage",
        "step": 8,
        "corrupt": True,
        "error": "CorruptCheckpointError: .../step_000000000008/rank_00001.g1.data is missing",
    }
    ctl.record_event(event)
    _wait_maintenance(ctl)
    assert ctl.summary()["committed_steps"] == [6, 8]
    assert not ctl.storage.exists(QUARANTINE)
    (verified,) = [e for e in ctl.events() if e.get("event") == "verified"]
    assert verified["step"] == 8 and verified["intact"] is True and "is missing" in verified["error"]
    assert ctl.prepare_restore(WORLD).storage == (8, 6)

    def unreachable(*a, **k):
        raise ConnectionError("storage unreachable")

    monkeypatch.setattr(ctl.storage, "read_range", unreachable)
    ctl.record_event(event)
    _wait_maintenance(ctl)
    assert ctl.summary()["committed_steps"] == [6, 8]
    assert [e.get("intact") for e in ctl.events() if e.get("event") == "verified"] == [True, None]
    monkeypatch.undo()
    # Only the controller's own re-read decides: damage found there quarantines it.
    _damage(ctl, 8)
    assert quarantine.damage_of(ctl.storage, 8) is not None
    ctl.record_event(event)
    _wait_maintenance(ctl)
    assert ctl.summary()["committed_steps"] == [6]


def test_a_memory_restore_takes_a_peers_copy_of_a_lost_nodes_section(controller):
    """Peer replicas (#12): a snapshot whose section's holder is on a lost node is still restorable
    from memory when a holder of a surviving node has a copy; without a copy the newest snapshot
    whose every section survives is chosen; a copy that failed or was skipped counts for nothing."""
    ctl = controller()
    meta = {"world_size": 2, "replicated": False, "epoch": 0, "kind": CheckpointKind.SCHEDULED}

    def stage(step, sec, holder, node):
        m = SnapshotMeta(**meta, rank=section_rank(sec))
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
    r0, r1 = rank_section(0), rank_section(1)
    for step in (5, 10):
        stage(step, r0, "hA", "A")
        stage(step, r1, "hB", "B")
    replica(5, r1, "hA", "A", "hB", seconds=0.01)  # step 5's rank 1 section has a copy on node A
    replica(10, r1, "hA", "A", "hB", error="RayActorError: the peer died")  # step 10's copy failed
    replica(10, r0, "", "", "hA", skipped=True)
    books = ctl._ledger.commits
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


def test_a_restarted_controller_learns_the_peers_copies_from_their_holders(controller, tmp_path):
    """A controller that starts again learns what each holder holds from its ``resync``; the copies
    a holder keeps for other nodes are in it too (#12: a restarted controller used to forget them,
    so a node lost before the next copy meant storage). Here node B is lost with the controller:
    only hA (node A) answers, with rank 0's section and its copy of rank 1's, and with rank 1's
    section as B's holder staged it. The new controller finds step 10 restorable from A's memory
    alone, and counts no copy twice. And a holder drops the copies a commit made stale (those of a
    lost node's holder included: they used to stay until the run ended)."""
    import numpy as np
    import pyarrow.fs as pafs

    from cf_ray._engine.node.holder import Holder

    meta = {"world_size": 2, "replicated": False, "epoch": 0, "kind": CheckpointKind.SCHEDULED}
    r0, r1 = rank_section(0), rank_section(1)

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

    ctl = controller()  # the controller that started again
    books = ctl._ledger.commits
    assert books.newest_in_memory({"A"}) is None
    ctl.apply_holder_state(state)
    snap = books.newest_in_memory({"A"})
    assert snap is not None and snap.step == 10 and snap.sections == {r0: "hA", r1: "hA"}, snap
    ctl.apply_holder_state(state)  # said again: nothing changes, nothing counted
    assert books.newest_in_memory({"A"}) == snap
    assert not any(r.get("replica_bytes") for r in ctl.profile_rows())


def test_replica_every_copies_the_same_steps_on_every_node():
    """``Replication.every``: one snapshot in n is copied, the same steps on every rank (decided by
    the step and the interval alone, so the copied steps are complete), also when the interval
    changes; preemption checkpoints, milestones and snapshots without an interval always."""
    from cf_ray._engine.worker.snapshot.snapshotter import replica_due

    steps = range(5, 205, 5)
    assert all(replica_due(s, 1, 5) for s in steps)
    assert [s for s in steps if replica_due(s, 4, 5)] == list(range(20, 205, 20))
    # An interval that changes (Adaptive): still about one in n.
    sched = [(s, 3 + (s // 40) % 4) for s in range(3, 400, 3)]
    due = [s for s, k in sched if replica_due(s, 4, k)]
    assert len(sched) / 8 < len(due) < len(sched) / 2, due
    assert replica_due(7, 4, 5, always=True) and replica_due(7, 4, None)


# -- when a just-in-time checkpoint is safe (#12, #24: derived, not predicted) -----------------------------

MB = 1_000_000


def _jit_controller(controller, draining: set[str]) -> Controller:
    ctl = controller(cluster=Cluster(draining=draining))  # what Ray's GCS says inside the actor
    ctl.generation = 1
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
                section=rank_section(rank),
                holder=holder,
                nbytes=nbytes,
                meta=m,
                node_id=node,
            )
        )


def _durable2(ctl: Controller, step: int, persist_s: float) -> None:
    for rank, holder in enumerate(("hA", "hB")):
        sec = rank_section(rank)
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
            section=rank_section(rank),
            holder=peer,
            node_id=node,
            origin=origin,
            nbytes=nbytes,
            seconds=seconds,
        )
    )


def _committed_run(ctl: Controller) -> None:
    """Step 5 staged, copied and committed."""
    _stage2(ctl, 5, 10 * MB)
    _copied(ctl, 5, 0, 10 * MB, 0.05)
    _copied(ctl, 5, 1, 10 * MB, 0.05)
    _durable2(ctl, 5, 2.0)
    _wait_maintenance(ctl)
    assert ctl.summary()["committed_steps"] == [5]


def test_a_jit_checkpoint_is_safe_once_the_draining_nodes_sections_have_a_copy_elsewhere(controller):
    """Node B drains with 2.5 s left. The just-in-time checkpoint is safe — the preempted rank's wait
    ends, it is the memory restore point when B is lost — as soon as B's section has a copy on A;
    rank 0's section (node A, not draining) needs nothing more from rank 0 or its holder. No
    prediction decides it: what happened does. Storage goes on and commits later; the row keeps both
    actual times and made_deadline from the peer copy, the first safe tier."""
    ctl = _jit_controller(controller, {"B"})
    _committed_run(ctl)
    deadline = time.time() + 2.5
    _stage2(ctl, 7, 10 * MB, kind=CheckpointKind.PREEMPT, priority=True, deadline_unix=deadline)
    row = {r["step"]: r for r in ctl.profile_rows()}[7]
    assert row["jit_needs_copy"] == 1 and 2.0 < row["jit_left_s"] <= 2.5, row  # only B's section
    assert "jit_tier" not in row and "predicted_storage_s" not in row  # nothing predicted any more
    assert ctl.settled(1, [7]).pending == (7,) and ctl.settled(1, [7]).safe == ()
    assert ctl._ledger.commits.newest_in_memory({"A"}).step == 5  # B lost now: step 7's rank 1 section is gone

    _copied(ctl, 7, 1, 10 * MB, 0.04)  # B's holder copies its section to A: nothing else happens
    report = ctl.settled(1, [7])
    assert report.pending == (7,) and report.safe == (7,)  # not committed, yet safe
    snap = ctl._ledger.commits.newest_in_memory({"A"})
    assert snap.step == 7 and snap.sections == {rank_section(0): "hA", rank_section(1): "hA"}
    row = {r["step"]: r for r in ctl.profile_rows()}[7]
    assert row["safe_tier"] == "peer" and row["made_deadline"] is True and row["actual_peer_s"] < 2.5
    assert not row["committed"] and "actual_storage_s" not in row

    _durable2(ctl, 7, 2.0)  # storage finishes in the background
    _wait_maintenance(ctl)
    row = {r["step"]: r for r in ctl.profile_rows()}[7]
    assert row["committed"] and row["actual_storage_s"] >= 0 and row["made_deadline"] is True
    assert row["safe_tier"] == "peer"  # safe first in a peer's memory
    (event,) = [e for e in ctl.events() if e["event"] == "jit_safe"]
    assert event["step"] == 7 and event["tier"] == "peer" and event["made_deadline"] is True


def test_a_jit_checkpoint_committed_first_is_safe_in_storage_and_one_that_is_neither_never_is(controller):
    """Committed before any copy: safe in storage (a later copy changes nothing: the first wins).
    With replication off and 0.02 s left, nothing happens in time: the checkpoint is never safe, and
    when its section fails (the node went mid-write) nothing of it is committed and the previous
    checkpoint stays the newest."""
    ctl = _jit_controller(controller, {"B"})
    _committed_run(ctl)
    _stage2(ctl, 6, 10 * MB, kind=CheckpointKind.PREEMPT, priority=True, deadline_unix=time.time() + 10)
    _durable2(ctl, 6, 0.5)
    _wait_maintenance(ctl)
    _copied(ctl, 6, 1, 10 * MB, 0.04)
    row = {r["step"]: r for r in ctl.profile_rows()}[6]
    assert row["committed"] and row["safe_tier"] == "storage" and row["made_deadline"] is True
    assert row["actual_storage_s"] >= 0 and ctl.settled(1, [6]).committed == (6,)

    _stage2(ctl, 8, 10 * MB, replicas=0, kind=CheckpointKind.PREEMPT, priority=True, deadline_unix=time.time() + 0.02)
    assert ctl.settled(1, [8]).safe == ()
    files, _ = _write(ctl, 8, rank_section(0))
    ctl.part_durable(
        PartDurable(generation=1, step=8, section=rank_section(0), files=files, persist_s=0.1, holder="hA")
    )
    ctl.part_failed(
        PartFailed(generation=1, step=8, section=rank_section(1), error="lost: holder hB died", holder="hB")
    )
    _wait_maintenance(ctl)
    row = {r["step"]: r for r in ctl.profile_rows()}[8]
    assert row["made_deadline"] is False and not row["committed"] and "safe_tier" not in row
    assert ctl.summary()["committed_steps"] == [5, 6]
    assert not ctl.storage.exists(f"{step_dir(8)}/{MANIFEST}")


def test_a_jit_checkpoint_safe_in_a_peer_before_its_deadline_stays_met_when_its_write_fails(tmp_path):
    """The decision is the driver's (``jit``), the row the profile book's: the first safe time
    decides ``made_deadline``; a failure or an abandoned attempt afterwards does not undo it, one
    before any safe time makes it missed; one ``jit_safe`` event per checkpoint made safe."""
    from cf_ray._engine.driver.schedule import ScheduleBook
    from cf_ray._engine.observe.profile_book import ProfileBook
    from cf_ray._engine.storage.fs import FsStorage
    from cf_ray.policy import FixedInterval

    storage = FsStorage.from_uri(str(tmp_path))
    book = ProfileBook("run", storage, ScheduleBook(FixedInterval(every=5), storage))
    meta = SnapshotMeta(
        rank=0, world_size=1, replicated=False, epoch=0, kind=CheckpointKind.PREEMPT, deadline_unix=100.0,
        notice_unix=90.0, notice_source="driver",
    )  # fmt: skip
    for step in (7, 9):
        book.note_staged(1, step, meta)
    w = jit.watch(now_unix=95.0, deadline_unix=100.0, nodes={rank_section(0): "A"}, draining={"A"})
    jit.staged(book, 1, 7, w)
    w.peer_safe_unix = 97.0
    jit.peer_safe(book, 1, 7, w)
    book.note_failed(1, 7, rank_section(0), "OSError: disk full")
    jit.failed(book, 1, 7)
    jit.abandoned(book, 1, 7)
    row = book.find_row(1, 7)
    assert row is not None and (row["safe_tier"], row["made_deadline"], row["actual_peer_s"]) == ("peer", True, 2.0)
    assert row["jit_left_s"] == 5.0 and row["jit_needs_copy"] == 1 and row["where"] == "abandoned"
    book.note_failed(1, 9, rank_section(0), "OSError: disk full")  # never safe
    jit.failed(book, 1, 9)
    row = book.find_row(1, 9)
    assert row is not None and row["made_deadline"] is False and "safe_tier" not in row
    events = [e.to_dict() for e in book.events]
    assert [(e["step"], e["tier"]) for e in events if e["event"] == "jit_safe"] == [(7, "peer")]


def test_which_sections_of_a_jit_checkpoint_need_a_copy():
    """The pure rule: when no node is known to drain (a SIGTERM, a driver's notice) every section
    needs a copy on another node; with a draining node only its sections do, and a copy on its own
    node does not count; a drain of a node without a section of the run leaves nothing to copy."""
    nodes = {"rank_00000": "A", "rank_00001": "B"}
    w = jit.watch(now_unix=0.0, deadline_unix=30.0, nodes=nodes, draining=())
    assert w.needs_copy == set(nodes) and w.left_s == 30.0
    assert not w.peer_safe(nodes, {"rank_00001": {"hA": "A"}})  # rank 0's section has no copy yet
    assert w.peer_safe(nodes, {"rank_00000": {"hB": "B"}, "rank_00001": {"hA": "A"}})
    w = jit.watch(now_unix=0.0, deadline_unix=3.0, nodes=nodes, draining={"B"})
    assert w.needs_copy == {"rank_00001"}
    assert not w.peer_safe(nodes, {"rank_00001": {"hB2": "B"}})  # a copy on its own node
    assert w.peer_safe(nodes, {"rank_00001": {"hA": "A"}})
    w = jit.watch(now_unix=0.0, deadline_unix=3.0, nodes=nodes, draining={"C"})
    assert w.needs_copy == set() and w.peer_safe({}, {})
