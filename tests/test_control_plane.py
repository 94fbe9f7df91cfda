"""The control plane never silently stops protecting the run (issue #16): the controller and the
holders survive each other's death, every holder message is idempotent, the controller stays
bounded however many checkpoints a run takes, and uploads stream, retry and are accounted for.

Most tests drive the controller in process (no actor; holders are names, reached through a fake
link); the last ones use real actors on the shared local Ray cluster, without TorchTrainer.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import os
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
import pyarrow.fs as pafs
import pytest
from slot_helpers import stage_bytes

from cf_ray._engine import env as _env
from cf_ray._engine.driver.checkpoints import pending as pending_mod
from cf_ray._engine.driver.recovery import CONTROL_STATE
from cf_ray._engine.format.catalog import list_committed
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import MANIFEST, rank_section, section_files, step_dir
from cf_ray._engine.format.sections import verify_all, write_section
from cf_ray._engine.protocol.messages import (
    CheckpointKind,
    HolderState,
    PartDurable,
    PartFailed,
    PartStaged,
    PartSuperseded,
    Restored,
    RestoreSource,
    SectionState,
    Settled,
    SnapshotMeta,
    SyncRequest,
)
from cf_ray._engine.storage.fs import FsStorage

from controller_harness import Holders, wait_idle
from controller_harness import settings as _settings
from faulty_fs import FaultyHandler

SEC = rank_section(0)
META = SnapshotMeta(rank=0, world_size=1, replicated=False, epoch=0, kind=CheckpointKind.SCHEDULED, interval=1)


def _storage(root) -> FsStorage:
    return FsStorage(pafs.LocalFileSystem(), str(root))


_wait_idle = wait_idle


def _staged(gen: int, step: int, holder: str = "h", meta: SnapshotMeta = META, section: str = SEC) -> PartStaged:
    return PartStaged(generation=gen, step=step, section=section, holder=holder, nbytes=8, meta=meta)


def _write(storage, gen: int, step: int, section: str = SEC, holder: str = "h", size: int = 8) -> PartDurable:
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


def _fake_files(gen: int, section: str = SEC) -> dict:
    data, index = section_files(gen, section)
    return {data: {"size": 8, "crc32": 0}, index: {"size": 2, "crc32": 0}}


# -- bounded: 10,000 commits ----------------------------------------------------------------------


def _fast_root(tmp_path):
    """tmpfs when there is one: the test measures the controller, not the disk (10,000 fsync'd
    manifests take 20-280 s on this CI's shared disk, 2 ms each on tmpfs, where the writes are as real)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return tempfile.mkdtemp(dir="/dev/shm", prefix="cf_ray_flat_")
    return str(tmp_path)


@pytest.mark.parametrize("trace", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["blocks", "tracemalloc"])
def test_the_controller_stays_flat_through_10000_commits(controller, tmp_path, trace):
    """Memory and time per commit do not grow with the number of checkpoints: the first 2,000
    commits against the last 2,000 of 10,000 (a sync with the rank's timings at each, keep_last=2,
    every manifest written to a real FsStorage, the profile rows beyond the window written as
    Parquet parts). Memory is counted in live Python allocations (``sys.getallocatedblocks``, no
    overhead); the ``slow`` variant cross-checks in bytes with tracemalloc (about 4x slower), over
    the first 2,000 against the last 2,000 of 5,000 commits to keep the suite's time."""
    import shutil
    import tracemalloc

    import pandas  # noqa: F401 - the profile parts need it; imported before the measurement

    root = _fast_root(tmp_path)
    try:
        ctl = controller(_storage(root), "flat", keep_last=2)
        gen = ctl.prepare_restore(1).generation
        ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
        files = _fake_files(gen)
        n, block = (5_000, 2_000) if trace else (10_000, 2_000)
        times = np.zeros(n)
        mem = {}
        if trace:
            tracemalloc.start()

        def measure():
            _wait_idle(ctl)
            gc.collect()
            return tracemalloc.get_traced_memory()[0] if trace else sys.getallocatedblocks()

        t_all = time.perf_counter()
        for step in range(1, n + 1):
            t0 = time.perf_counter()
            ctl.part_staged(_staged(gen, step))
            ctl.part_durable(
                PartDurable(generation=gen, step=step, section=SEC, files=files, persist_s=0.01, holder="h")
            )
            ctl.sync(
                SyncRequest(
                    rank=0,
                    generation=gen,
                    adopted_version=0,
                    ckpt_stats=({"step": step, "stall_s": 0.001, "copy_s": 0.002},),
                )
            )
            times[step - 1] = time.perf_counter() - t0
            if step in (block, n):
                mem[step] = measure()
        elapsed = time.perf_counter() - t_all
        if trace:
            tracemalloc.stop()

        first, last = np.median(times[:block]), np.median(times[-block:])
        print(
            f"{n:,} commits in {elapsed:.1f} s; median per commit {first * 1e3:.2f} ms (first {block:,}), "
            f"{last * 1e3:.2f} ms (last {block:,}); memory {mem[block]} -> {mem[n]} "
            f"({'bytes' if trace else 'blocks'})"
        )
        assert last <= 3 * first + 0.5e-3, f"time per commit grew: {first * 1e3:.2f} ms -> {last * 1e3:.2f} ms"
        growth = mem[n] - mem[block]
        # A leak of one small object per commit would be 8,000 blocks (or >= 250 KB over 3,000
        # commits: 83 bytes each, less than the smallest dict or tuple with a float in it) here.
        assert growth < (250_000 if trace else 3_000), f"memory grew by {growth} over {n - block:,} commits"
        assert len(ctl._ledger.book._rows) <= 1000 and ctl._ledger.book.unwritten_batches() == 0
        assert len(ctl._ledger.commits.table.entries) <= pending_mod.MAX_PENDING + 1
        assert len(ctl._ledger.commits.table.settled) <= pending_mod.MAX_SETTLED
        assert len(ctl._ledger.commits.committed) <= 2
        assert [c.step for c in list_committed(ctl.storage)] == [n - 1, n]
        rows = ctl.profile_rows()  # the parts on storage and the rows in memory
        assert [r["step"] for r in rows] == list(range(1, n + 1))
        assert all(r["committed"] is True and r["stall_s"] == pytest.approx(0.001) for r in rows)
    finally:
        shutil.rmtree(root, ignore_errors=True) if root.startswith("/dev/shm") else None


# -- idempotent messages --------------------------------------------------------------------------


def _count_manifest_writes(monkeypatch, storage) -> list[str]:
    writes: list[str] = []
    real = storage.write_file

    def write_file(path, chunks):
        if path.endswith(MANIFEST):
            writes.append(path)
        return real(path, chunks)

    monkeypatch.setattr(storage, "write_file", write_file)
    return writes


def test_every_holder_message_is_idempotent(controller, tmp_path, monkeypatch):
    """A holder re-sends what it is not sure arrived: twice, late, after the step left the pending
    table. Each step commits once; nothing is counted twice."""
    storage = _storage(tmp_path)
    ctl = controller(storage, "idem")
    writes = _count_manifest_writes(monkeypatch, storage)
    gen = ctl.prepare_restore(1).generation
    msgs = [_staged(gen, 3), _write(storage, gen, 3)]
    for m in msgs + msgs[::-1] + msgs:
        (ctl.part_staged if isinstance(m, PartStaged) else ctl.part_durable)(m)
    assert writes == [f"{step_dir(3)}/{MANIFEST}"]
    assert ctl.part_durable(msgs[1]) == SectionState.COMMITTED  # the acknowledgement says where it stands
    assert len(ctl._ledger.schedule.samples) == 1  # the persist time went to the policy once
    # A failure that comes after the commit changes nothing.
    ctl.part_failed(PartFailed(generation=gen, step=3, section=SEC, error="OSError: stale"))
    assert ctl.summary()["failures"] == [] and ctl.settled(gen, [3]).committed == (3,)
    # Push step 3 out of the pending table, then send everything again.
    for step in range(10, 10 + pending_mod.MAX_PENDING + 5):
        ctl.part_staged(_staged(gen, step))
        ctl.part_durable(PartDurable(generation=gen, step=step, section=SEC, files=_fake_files(gen), persist_s=0.01))
    assert (gen, 3) not in ctl._ledger.commits.table.entries
    n = len(writes)
    for m in msgs:
        (ctl.part_staged if isinstance(m, PartStaged) else ctl.part_durable)(m)
    assert len(writes) == n and (gen, 3) not in ctl._ledger.commits.table.entries
    rows = [r for r in ctl.profile_rows() if r["step"] == 3]
    assert len(rows) == 1 and rows[0]["committed"] is True
    # The same failure twice is one failure.
    ctl.part_staged(_staged(gen, 200))
    for _ in range(2):
        ctl.part_failed(PartFailed(generation=gen, step=200, section=SEC, error="OSError: disk full"))
    assert [f["step"] for f in ctl.summary()["failures"]] == [200]


def test_a_resynced_step_whose_files_are_gone_is_not_committed_again(controller, tmp_path):
    """After a restart a holder re-sends a step that was committed and then deleted by keep-last:
    its manifest must not come back (the files are gone); a resynced step whose files are there commits."""
    storage = _storage(tmp_path)
    ctl = controller(storage, "gone", holders=Holders())
    gen = 1
    durable = _write(storage, gen, 4)
    storage.delete_dir(step_dir(4))  # what keep-last did before the controller died
    ok = _write(storage, gen, 5)
    ctl.apply_holder_state(
        HolderState(holder="h", generation=gen, staged=(_staged(gen, 4), _staged(gen, 5)), outcomes=(durable, ok))
    )
    assert [c.step for c in list_committed(storage)] == [5]
    assert dataclasses.replace(ctl.settled(gen, [4, 5]), resynced=True) == Settled(
        generation=gen, committed=(5,), abandoned=(4,), newest_committed=5, resynced=True
    )
    assert ctl.generation >= gen


def test_settled_says_which_steps_nothing_more_will_happen_to(controller, tmp_path):
    storage = _storage(tmp_path)
    ctl = controller(storage, "settled")
    gen = ctl.prepare_restore(1).generation
    ctl.part_staged(_staged(gen, 1))
    ctl.part_durable(_write(storage, gen, 1))
    ctl.part_staged(_staged(gen, 2))
    ctl.part_failed(PartFailed(generation=gen, step=2, section=SEC, error="OSError: disk full"))
    ctl.part_staged(_staged(gen, 3))
    ctl.part_superseded(PartSuperseded(generation=gen, step=3, section=SEC))
    ctl.part_staged(_staged(gen, 4))  # staged, not durable yet
    ctl.part_durable(_write(storage, gen, 5))  # durable, its part_staged not here yet: not settled
    out = ctl.settled(gen, [1, 2, 3, 4, 5, 6])
    assert out == Settled(
        generation=gen,
        committed=(1,),
        failed={2: f"{SEC}: OSError: disk full"},
        superseded=(3,),
        abandoned=(),
        pending=(4, 5),
        unknown=(6,),
        safe=(),
        newest_committed=1,
        resynced=True,
    )
    assert [s for s in range(1, 7) if out.is_settled(s)] == [1, 2, 3]
    # The next attempt restores at step 1: the old attempt's steps past it are abandoned, even when
    # their messages come late.
    gen2 = ctl.prepare_restore(1).generation
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=1, epoch=0))
    ctl.part_staged(_staged(gen, 6))
    ctl.part_durable(_write(storage, gen, 6))
    out = ctl.settled(gen, [4, 5, 6])
    assert out.abandoned == (4, 5, 6) and [c.step for c in list_committed(storage)] == [1]
    assert ctl.settled(gen2, [1]).unknown == (1,)  # a step of another generation


# -- a controller that starts again ---------------------------------------------------------------


def _fresh_start_committing(ctl, storage, step: int) -> int:
    """A first attempt that started fresh and committed ``step``; returns its generation."""
    gen = ctl.prepare_restore(1).generation
    ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
    ctl.part_staged(_staged(gen, step))
    ctl.part_durable(_write(storage, gen, step))
    return gen


def test_a_controller_that_starts_again_rebuilds_from_storage_and_the_holders(controller, tmp_path):
    storage = _storage(tmp_path)
    link = Holders()
    ctl = controller(storage, "again", holders=link)
    _fresh_start_committing(ctl, storage, 2)
    gen = ctl.prepare_restore(1).generation  # a second attempt, restored at step 2
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=2, epoch=0))
    ctl.part_staged(_staged(gen, 4))
    ctl.part_staged(_staged(gen - 1, 9))  # a straggler of the first attempt: abandoned
    ctl.part_failed(PartFailed(generation=gen, step=5, section=SEC, error="x"))
    seen_failures = ctl.summary()["failures"][-1]["seq"]
    # The holder keeps its record of step 4 (staged); the controller dies and starts again.
    link.holders["h"] = lambda key: ("held", None, None)
    link.states["h"] = HolderState(holder="h", generation=gen, staged=(_staged(gen, 4),))
    again = controller(storage, "again", recreated=True, holders=link)
    again._roster.resynced.wait(10)
    assert again.ping() == {"generation": gen, "resynced": True}
    assert again.summary()["committed_steps"] == [2]
    assert again.settled(gen, [4]).pending == (4,)
    assert again.settled(gen - 1, [9]).abandoned == (9,)  # the restore was saved (control_state.json)
    assert storage.exists(CONTROL_STATE)
    again.part_durable(_write(storage, gen, 4))  # the holder's message, sent again to the new controller
    assert again.settled(gen, [4]).committed == (4,)
    # Numbers continue above what the workers had from the dead controller.
    reply = again.sync(SyncRequest(rank=0, generation=gen, adopted_version=7, seen_failures=seen_failures))
    assert reply.schedules and all(s.schedule_version > 7 for s in reply.schedules)
    assert reply.schedules[-1].interval == again.summary()["interval"]
    again.part_staged(_staged(gen, 6))
    again.part_failed(PartFailed(generation=gen, step=6, section=SEC, error="OSError: gone"))
    reply = again.sync(
        SyncRequest(
            rank=0, generation=gen, adopted_version=reply.schedules[-1].schedule_version, seen_failures=seen_failures
        )
    )
    assert [f.step for f in reply.failures] == [6] and reply.failures[0].seq > seen_failures
    assert again.prepare_restore(1).generation == gen + 1


def test_a_controller_started_again_lists_the_profile_rows_its_predecessor_held(controller, tmp_path, monkeypatch):
    """The profile rows a controller held in memory when its process died are listed by the one Ray
    starts in its place (the soak's seed 70: a storage stall shown only in rows that the restart
    lost), from the window it saved after its commits; rows the new one writes win over them."""
    from cf_ray._engine import env

    monkeypatch.setattr(env, "WINDOW_SAVE_INTERVAL_S", 0.0)
    storage = _storage(tmp_path)
    link = Holders()
    first = controller(storage, "rows", holders=link)
    gen = first.prepare_restore(1).generation
    first.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
    for step in (2, 4):
        first.part_staged(_staged(gen, step))
        first.part_durable(_write(storage, gen, step))
    first.part_staged(_staged(gen, 6))  # in flight when it dies
    wait_idle(first)
    before = {r["step"]: r for r in first.profile_rows()}
    assert sorted(before) == [2, 4, 6] and before[4]["committed"]
    again = controller(storage, "rows", recreated=True, holders=link)
    again._roster.resynced.wait(10)
    rows = {r["step"]: r for r in again.profile_rows()}
    assert sorted(rows) == [2, 4, 6]
    assert rows[2]["committed"] and rows[4]["committed"] and not rows[6]["committed"]
    assert rows[4]["persist_s"] == before[4]["persist_s"]
    again.part_staged(_staged(gen, 6))  # the holder's messages, sent again: step 6 commits
    again.part_durable(_write(storage, gen, 6))
    assert {r["step"]: r for r in again.profile_rows()}[6]["committed"]


def test_a_controller_started_again_lists_the_events_its_predecessor_held(controller, tmp_path, monkeypatch):
    """The events window (restores, restore fallbacks and their counts) outlives the controller's
    process: the soak's seed 63 ended with ``events == []`` in its result after a controller restart.
    An event alone (no commit after it) is saved too, and the one Ray starts in its place adds its
    own after them."""
    from cf_ray._engine import env

    monkeypatch.setattr(env, "WINDOW_SAVE_INTERVAL_S", 0.0)
    storage = _storage(tmp_path)
    link = Holders()
    first = controller(storage, "events", holders=link)
    _fresh_start_committing(first, storage, 2)
    first.prepare_restore(1)  # a second attempt
    fallback = {"event": "restore_fallback", "source": "memory", "step": 2, "verification": True, "time": 1.0}
    first.record_event(fallback)  # no commit after it: the event alone makes the window be saved
    wait_idle(first)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "restore_fallback" not in _window_text(storage):
        time.sleep(0.05)
    kinds = [e["event"] for e in first.events()]
    again = controller(storage, "events", recreated=True, holders=link)
    again._roster.resynced.wait(10)
    assert [e["event"] for e in again.events()] == kinds and "restore_fallback" in kinds
    assert again.summary()["restore_fallbacks"] == {"memory": {"verification": 1}}
    again.restored(Restored(source=RestoreSource.STORAGE, step=2, epoch=0))
    assert [e["event"] for e in again.events()][: len(kinds)] == kinds
    assert again.events()[-1]["event"] == "restore" and len(again.events()) > len(kinds)


def _window_text(storage) -> str:
    from cf_ray._engine.observe.profile_files import PROFILE_PARTS, WINDOW

    for lineage in storage.list_dir(PROFILE_PARTS):
        path = f"{PROFILE_PARTS}/{lineage}/{WINDOW}"
        if storage.exists(path):
            return bytes(storage.read_file(path)).decode()
    return ""


@pytest.mark.parametrize("holders_hold", ["something", "nothing"])
def test_a_controller_started_again_says_so_once_whatever_its_holders_hold(controller, tmp_path, caplog, holders_hold):
    """Ray started the controller again after its process died: one warning, also when the holders
    held nothing any more by the time it came back (the soak's seed 75 said nothing then). A first
    start says nothing, even with a holder of the run already there (made by a worker first)."""
    import logging

    storage = _storage(tmp_path)
    link = Holders()
    link.holders["h"] = lambda key: ("held", None, None)
    caplog.set_level(logging.WARNING, logger="cf_ray")
    first = controller(storage, "said", holders=link)
    first._roster.resynced.wait(10)
    gen = first.prepare_restore(1).generation
    assert "started again" not in caplog.text
    if holders_hold == "something":
        link.states["h"] = HolderState(holder="h", generation=gen, staged=(_staged(gen, 4),))
    again = controller(storage, "said", recreated=True, holders=link)
    again._roster.resynced.wait(10)
    said = [r for r in caplog.records if "started again (the previous one's process died)" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


def test_a_worker_that_adopted_a_version_the_controller_never_published_gets_one_above_it(controller, tmp_path):
    ctl = controller(_storage(tmp_path), "versions")
    assert [s.schedule_version for s in ctl.sync(SyncRequest(rank=0, generation=1)).schedules] == [0]
    reply = ctl.sync(SyncRequest(rank=0, generation=1, adopted_version=5))
    assert [(s.schedule_version, s.interval) for s in reply.schedules] == [(6, ctl.summary()["interval"])]
    assert ctl.sync(SyncRequest(rank=1, generation=1, adopted_version=6)).schedules == ()


def test_the_controller_keeps_each_ranks_doorbell_for_its_attempt_and_hands_them_out_with_a_request(
    controller, tmp_path
):
    ctl = controller(_storage(tmp_path), "bells")
    gen = ctl.prepare_restore(2).generation
    bell0, bell1 = (object(), 1), (object(), 2)
    assert ctl.sync(SyncRequest(rank=0, generation=gen, bell=bell0)).bell_known
    assert not ctl.sync(SyncRequest(rank=1, generation=gen)).bell_known  # it sends its bell until it is known
    assert not ctl.sync(SyncRequest(rank=1, generation=gen - 1, bell=bell1)).bell_known  # an older attempt's
    ledger = ctl._ledger

    def rung_with_a_request():
        ledger.request(None, "")
        return ledger.take_rings()

    assert rung_with_a_request() == [bell0]
    assert ctl.sync(SyncRequest(rank=1, generation=gen, bell=bell1)).bell_known
    assert ctl.sync(SyncRequest(rank=0, generation=gen)).bell_known
    assert rung_with_a_request() == [bell0, bell1]
    ctl.finish(0, 2)  # a finished rank's bell is dropped (its handle would keep its actor alive)
    assert rung_with_a_request() == [bell1]
    gen2 = ctl.prepare_restore(2).generation  # a new attempt: new workers, new bells
    assert not ctl.sync(SyncRequest(rank=0, generation=gen2)).bell_known
    assert rung_with_a_request() == []


def test_a_new_schedule_version_rings_every_ranks_doorbell_once(controller, tmp_path):
    """A version published from a poll's samples (or a persist time) is rung to every rank, so each
    fetches it at its next step instead of its next poll (a poll a second)."""
    from cf_ray import FixedInterval

    class SevenOnceSampled(FixedInterval):
        def plan(self, samples, current):
            return 7 if samples else current

    ctl = controller(_storage(tmp_path), "ring-schedule", policy=SevenOnceSampled(every=2))
    ledger = ctl._ledger
    gen = ctl.prepare_restore(2).generation
    bells = [(object(), 1), (object(), 2)]
    for rank, bell in enumerate(bells):
        assert ledger.sync(SyncRequest(rank=rank, generation=gen, bell=bell)).bell_known
    assert ledger.take_rings() == []  # nothing new published
    sample = {"rank": 1, "step": 3, "iter_s": 0.1}
    reply = ledger.sync(SyncRequest(rank=1, generation=gen, samples=(sample,)))
    assert reply.schedules[-1].interval == 7
    assert ledger.take_rings() == bells
    assert ledger.take_rings() == []  # rung once
    ledger.sync(SyncRequest(rank=0, generation=gen, samples=(dict(sample, step=4),)))
    assert ledger.take_rings() == []  # 7 again: no new version


# -- the watch ------------------------------------------------------------------------------------


def test_the_watch_recovers_lost_messages_and_fails_what_a_dead_holder_had(controller, tmp_path):
    storage = _storage(tmp_path)
    link = Holders()
    ctl = controller(storage, "watch", holders=link)
    ctl._roster.resynced.wait(10)
    gen = ctl.prepare_restore(1).generation
    for step, holder in ((1, "alive"), (2, "dead"), (3, "restarted"), (5, "alive")):
        ctl.part_staged(_staged(gen, step, holder=holder))
    ctl.part_failed(PartFailed(generation=gen, step=5, section=SEC, error="OSError: disk full", holder="alive"))
    lost_durable = _write(storage, gen, 1, holder="alive")  # its part_durable never arrived
    link.holders = {
        "alive": lambda key: ("done", _staged(gen, 1, holder="alive"), lost_durable),
        "dead": None,
        "restarted": lambda key: ("unknown", None, None),
    }
    ctl.watch_once(min_age_s=0)
    out = ctl.settled(gen, [1, 2, 3])
    assert out.committed == (1,) and sorted(out.failed) == [2, 3]
    assert "lost: holder dead" in out.failed[2]
    # Later steps commit; the failed steps' directories are cleaned up.
    ctl.part_staged(_staged(gen, 4, holder="restarted"))
    ctl.part_durable(_write(storage, gen, 4, holder="restarted"))
    _wait_idle(ctl)
    assert [c.step for c in list_committed(storage)] == [1, 4]
    assert ("restarted", ((gen, 4),)) in link.forgotten  # the holder is told the step settled
    # ... and every holder of the run that it committed (their peers' copies older than it go).
    assert {n for n, c in link.committed_told if c == (gen, 4)} >= {"alive", "restarted"}
    # A holder's death usually ends its attempt: when the next one restores before those steps,
    # they are abandoned (not durable when their attempt ended); a real failure stays a failure.
    ctl.prepare_restore(1)
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=1, epoch=0))
    out = ctl.settled(gen, [2, 3, 5])
    assert out.abandoned == (2, 3) and list(out.failed) == [5]


def test_a_step_whose_section_no_holder_ever_had_is_abandoned_once_its_attempt_is_over(controller, tmp_path):
    storage = _storage(tmp_path)
    link = Holders()
    ctl = controller(storage, "orphan", holders=link)
    gen = ctl.prepare_restore(2).generation
    meta = SnapshotMeta(rank=0, world_size=2, replicated=False, epoch=0, kind=CheckpointKind.SCHEDULED)
    ctl.part_staged(_staged(gen, 7, meta=meta))  # rank 1 died before its hand-off
    link.holders = {"h": lambda key: ("held", None, None) if key[2] == SEC else ("unknown", None, None)}
    ctl.watch_once(min_age_s=0)
    assert ctl.settled(gen, [7]).pending == (7,)  # this attempt may still hand it off
    ctl.prepare_restore(2)
    ctl.watch_once(min_age_s=0)
    assert ctl.settled(gen, [7]).abandoned == (7,)


# -- no storage I/O under the lock ----------------------------------------------------------------


def test_no_storage_write_happens_under_the_controllers_lock(controller, tmp_path, monkeypatch):
    storage = _storage(tmp_path)
    monkeypatch.setattr(_env, "PROFILE_WINDOW_ROWS", 8)
    tier = _storage(tmp_path / "tier")
    ctl = controller(storage, "nolock", keep_last=1, tiers=[tier])
    under_lock: list[str] = []
    for s in (storage, tier):
        real = s.write_file

        def write_file(path, chunks, real=real):
            if ctl._ledger.lock._is_owned():
                under_lock.append(path)
            return real(path, chunks)

        monkeypatch.setattr(s, "write_file", write_file)
    gen = ctl.prepare_restore(1).generation
    ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
    for step in range(1, 20):
        ctl.part_staged(_staged(gen, step))
        ctl.part_durable(_write(storage, gen, step))
    _wait_idle(ctl)
    ctl.save_profile()
    assert under_lock == []
    assert storage.list_dir("profile")  # the parts were written (outside the lock too)


# -- uploads --------------------------------------------------------------------------------------


class _FlakyHandler(FaultyHandler):
    """Local disk that refuses the first ``fail`` output streams with a transient OSError, and
    whose writes can be held (``gate``). In-process only (not pickled)."""

    def __init__(self, fail: int = 0):
        super().__init__(fail=r"$^")  # FaultyHandler's own path faults: none
        self.failures_left = fail
        self.gate = threading.Event()
        self.gate.set()

    def get_type_name(self):
        return "flaky"

    def equals(self, other):
        return other is self

    def open_output_stream(self, path, metadata):
        self.gate.wait(60)
        if self.failures_left > 0:
            self.failures_left -= 1
            raise ConnectionError(f"injected transient fault writing {path}")
        return self.fs.open_output_stream(path, metadata=metadata)


class _ChunkRecorder:
    """A tier that records the chunks it is given (and whether they came as a stream)."""

    def __init__(self, inner):
        self.inner = inner
        self.chunk_sizes: list[int] = []
        self.streamed: dict[str, bool] = {}

    def write_file(self, path, chunks):
        self.streamed[path.rsplit("/", 1)[-1]] = not isinstance(chunks, (list, tuple))

        def record():
            for c in chunks:
                self.chunk_sizes.append(memoryview(c).nbytes)
                yield c

        return self.inner.write_file(path, record())

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_uploads_stream_in_chunks_and_retry_transient_errors(controller, tmp_path, monkeypatch):
    monkeypatch.setattr(_env, "WRITE_CHUNK_BYTES", 4096)
    monkeypatch.setattr(_env, "UPLOAD_BACKOFF_S", 0.01)
    storage = _storage(tmp_path / "primary")
    flaky = _FlakyHandler(fail=2)
    tier = _ChunkRecorder(FsStorage(pafs.PyFileSystem(flaky), str(tmp_path / "tier")))
    ctl = controller(storage, "upload", tiers=[tier])
    gen = ctl.prepare_restore(1).generation
    ctl.part_staged(_staged(gen, 3))
    ctl.part_durable(_write(storage, gen, 3, size=100_000))
    _wait_idle(ctl)
    assert ctl.uploads_pending() == []
    assert [c.step for c in list_committed(tier.inner)] == [3]
    m = read_manifest(tier.inner, step_dir(3))
    verify_all(tier.inner, step_dir(3), m)
    assert all(tier.streamed[name] for name in m.files)
    assert max(tier.chunk_sizes) <= 4096 and len(tier.chunk_sizes) >= 25
    assert [e["event"] for e in ctl.events() if e["event"].startswith("upload")] == ["upload"]


def test_the_upload_queue_is_bounded_and_drops_the_oldest_ordinary_upload(controller, tmp_path, monkeypatch):
    monkeypatch.setattr(_env, "UPLOAD_QUEUE", 2)
    storage = _storage(tmp_path / "primary")
    flaky = _FlakyHandler()
    flaky.gate.clear()  # the tier hangs: uploads pile up
    tier = FsStorage(pafs.PyFileSystem(flaky), str(tmp_path / "tier"))
    ctl = controller(storage, "queue", tiers=[tier])
    gen = ctl.prepare_restore(1).generation
    for step in range(1, 7):
        meta = SnapshotMeta(
            rank=0, world_size=1, replicated=False, epoch=0, kind=CheckpointKind.SCHEDULED, milestone=step == 2
        )
        ctl.part_staged(_staged(gen, step, meta=meta))
        ctl.part_durable(_write(storage, gen, step))
        deadline = time.monotonic() + 10
        while step == 1 and ctl.uploads_pending() != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
    pending = ctl.uploads_pending()
    assert pending[0] == 1 and pending[1:] == [2, 6]  # 1 is running; the milestone 2 is kept
    dropped = [e["step"] for e in ctl.events() if e["event"] == "upload_dropped"]
    assert dropped == [3, 4, 5]
    flaky.gate.set()
    _wait_idle(ctl)
    assert ctl.uploads_pending() == []
    assert [c.step for c in list_committed(tier)] == [1, 2, 6]


# -- the profile beyond the window ------------------------------------------------------------------


def test_profile_rows_beyond_the_window_go_to_parquet_parts_and_the_saved_table_has_them_all(
    controller, tmp_path, monkeypatch
):
    from cf_ray import report

    monkeypatch.setattr(_env, "PROFILE_WINDOW_ROWS", 8)
    storage = FsStorage.from_uri(str(tmp_path)).child("run/cf_ray")
    ctl = controller(storage, "parts")
    gen = ctl.prepare_restore(1).generation
    for step in range(1, 31):
        ctl.part_staged(_staged(gen, step))
        ctl.part_durable(PartDurable(generation=gen, step=step, section=SEC, files=_fake_files(gen), persist_s=0.5))
        ctl.sync(SyncRequest(rank=0, generation=gen, ckpt_stats=({"step": step, "stall_s": 0.01 * step},)))
    _wait_idle(ctl)
    assert len(ctl._ledger.book._rows) <= 8
    assert len(storage.list_dir(f"profile/{ctl._ledger.book.parts.lineage}")) >= 3
    rows = ctl.profile_rows()
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["committed"] is True and r["persist_s"] == 0.5 for r in rows)
    assert rows[4]["stall_s"] == pytest.approx(0.05) and type(rows[4]["step"]) is int
    # A rank's late timings of a row that just left memory are merged with its part.
    ctl.sync(SyncRequest(rank=0, generation=gen, ckpt_stats=({"step": 20, "copy_s": 0.7},)))
    late = [r for r in ctl.profile_rows() if r["step"] == 20]
    assert len(late) == 1 and late[0]["copy_s"] == 0.7 and late[0]["committed"] is True
    ctl.save_profile()
    df = report.read_run_profile(str(tmp_path), "run")
    assert list(df["step"]) == list(range(1, 31))
    # A controller Ray restarts (or a worker recreates) continues the table; a new run's starts afresh.
    assert [r["step"] for r in controller(storage, "parts", recreated=True).profile_rows()][:3] == [1, 2, 3]
    fresh = controller(storage, "parts")
    assert fresh.profile_rows() == []
    _wait_idle(fresh)
    assert storage.list_dir("profile") == [fresh._ledger.book.parts.lineage] or storage.list_dir("profile") == []


# -- the end of a run -------------------------------------------------------------------------------


def test_shutdown_drains_the_holders_before_it_kills_them(controller, tmp_path):
    link = Holders()
    link.holders = {"a": lambda key: ("held", None, None)}
    ctl = controller(_storage(tmp_path), "end", holders=link)
    ctl._roster.resynced.wait(10)
    ctl.part_staged(_staged(1, 1, holder="b"))
    ctl.shutdown()
    kinds = [c[0] for c in link.calls if c[0] in ("drain", "kill")]
    assert kinds == ["drain", "kill", "kill"] and link.calls[[c[0] for c in link.calls].index("drain")][1] == ("a", "b")
    assert _storage(tmp_path).exists("profile.parquet")


# -- real actors ------------------------------------------------------------------------------------


def _actor_run(tmp_path, handler=None):
    from cf_ray._engine import env as _env
    from cf_ray._engine.driver.controller import get_or_create_controller
    from cf_ray._engine.protocol.naming import controller_name

    key = f"cp-{uuid.uuid4().hex[:8]}"
    fs = pafs.PyFileSystem(handler) if handler is not None else pafs.LocalFileSystem()
    storage = FsStorage(fs, str(tmp_path / "run"))
    settings = _settings()
    ctl = get_or_create_controller(key, storage, settings)
    return key, storage, settings, ctl, controller_name(key), _env.namespace()


def _cleanup(ray, *handles):
    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # noqa: BLE001
            pass


def _wait_for(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _stage(ray, holder, gen, step):
    arena = np.arange(4096, dtype=np.uint8)
    return stage_bytes(ray, holder, gen, step, {SEC: (arena, b'{"entries":[],"tree":null}')}, META)


def test_a_holder_killed_mid_write_never_commits_that_step_and_later_steps_commit(ray_cluster, tmp_path):
    """The holder dies while it writes step 5 (storage stalls on it): no manifest of step 5 ever
    appears, the controller's watch fails it (nobody waits for ever), and a new holder on the node
    (what the worker side makes after the failed hand-off) commits step 6."""
    from cf_ray._engine.node.holder import resolve_holder
    from cf_ray._engine.protocol.messages import Restored as _Restored

    from faulty_fs import SlowHandler

    ray = ray_cluster
    key, storage, settings, ctl, cname, ns = _actor_run(tmp_path, SlowHandler(slow_from=5, slow_to=6, delay_s=120))
    holders = []
    try:
        gen = ray.get(ctl.prepare_restore.remote(1), timeout=120).generation
        ray.get(ctl.restored.remote(_Restored(source=RestoreSource.FRESH, step=0, epoch=0)), timeout=60)
        holder = resolve_holder(key, storage, cname, ns)
        holders.append(holder)
        assert ray.get(holder.ping.remote(), timeout=30).startswith(f"cf_ray.holder.{key}.")  # its messages carry it
        _stage(ray, holder, gen, 5)
        _wait_for(
            lambda: ray.get(holder.drain.remote(0), timeout=30)["writing"] == [gen, 5, SEC],
            60,
            "the holder to write step 5",
        )
        # The hand-off returned before the controller heard of step 5 (the holder's sender delivers
        # it): the holder dies once it has. (Dying before, it leaves a step the controller never heard
        # of, which is never settled: test_settled_says_which_steps_nothing_more_will_happen_to.)
        _wait_for(lambda: 5 in ray.get(ctl.settled.remote(gen, [5]), timeout=30).pending, 60, "step 5 known")
        ray.kill(holder, no_restart=True)
        new = _wait_for(lambda: _try(lambda: resolve_holder(key, storage, cname, ns, timeout_s=10)), 60, "a new holder")
        holders.append(new)
        _stage(ray, new, gen, 6)
        out = _wait_for(
            lambda: (lambda o: o if 5 in o.failed and 6 in o.committed else None)(
                ray.get(ctl.settled.remote(gen, [5, 6]), timeout=30)
            ),
            90,
            "step 5 to fail and step 6 to commit",
        )
        assert "lost" in out.failed[5]
        assert [c.step for c in list_committed(storage)] == [6]
        time.sleep(1)
        assert [c.step for c in list_committed(storage)] == [6]
    finally:
        _cleanup(ray, ctl, *holders)


def test_messages_of_snapshots_held_in_memory_only_wait_for_company_and_a_flush_sends_them(
    ray_cluster, tmp_path, monkeypatch
):
    """A holder's ``part_staged`` of a snapshot held in memory only is lazy: it waits (up to LAZY_S)
    for later messages, so that at a checkpoint every iteration the controller gets one call per LAZY_S
    instead of one per snapshot. A flush (what a restore plan asks of every holder first) sends it at
    once, and so does a message that is not lazy (it takes the lazy ones along, in order)."""
    from cf_ray._engine.node import sender as _sender

    monkeypatch.setattr(_sender, "LAZY_S", 5.0)
    ray = ray_cluster
    _, _, _, ctl, cname, ns = _actor_run(tmp_path)
    try:
        gen = ray.get(ctl.prepare_restore.remote(1), timeout=120).generation
        ray.get(ctl.restored.remote(Restored(source=RestoreSource.FRESH, step=0, epoch=0)), timeout=60)
        held = dataclasses.replace(META, persist=False)
        s = _sender.Sender(cname, ns)
        s.send_all([("part_staged", _staged(gen, 3, meta=held))], lazy=True)
        time.sleep(1.0)
        assert (s.pending(), s.sent) == (1, 0)  # waiting for company
        assert ray.get(ctl.settled.remote(gen, [3]), timeout=30).unknown == (3,)
        s.send_all([("part_staged", _staged(gen, 4, meta=held))], lazy=True)
        t0 = time.monotonic()
        assert s.wait_idle(30) and s.sent == 2 and time.monotonic() - t0 < 4.0  # the flush sent them at once
        assert ray.get(ctl.settled.remote(gen, [3, 4]), timeout=30).superseded == (3, 4)  # held: settled at once
        s.send_all([("part_staged", _staged(gen, 5, meta=held))], lazy=True)
        s.send("part_staged", _staged(gen, 6))  # a snapshot to persist: due at once
        _wait_for(lambda: s.sent == 4, 4.0, "the lazy message to go with the eager one")
        out = ray.get(ctl.settled.remote(gen, [5, 6]), timeout=30)
        assert out.superseded == (5,) and out.pending == (6,)
    finally:
        _cleanup(ray, ctl)


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def test_a_controller_restarted_mid_write_rebuilds_from_the_holder_and_commits(ray_cluster, tmp_path):
    """The controller's process dies while the holder writes step 5; Ray starts it again, it asks
    the holder what it holds, and the holder's part_durable (re-sent to the new process) commits
    step 5. The workers' schedule versions continue above what they had."""
    from cf_ray._engine.node.holder import resolve_holder
    from cf_ray._engine.protocol.messages import Restored as _Restored

    from faulty_fs import SlowHandler

    ray = ray_cluster
    key, storage, settings, ctl, cname, ns = _actor_run(tmp_path, SlowHandler(slow_from=5, slow_to=6, delay_s=6))
    holder = None
    try:
        gen = ray.get(ctl.prepare_restore.remote(1), timeout=120).generation
        ray.get(ctl.restored.remote(_Restored(source=RestoreSource.FRESH, step=0, epoch=0)), timeout=60)
        holder = resolve_holder(key, storage, cname, ns)
        _stage(ray, holder, gen, 5)
        _wait_for(
            lambda: ray.get(holder.drain.remote(0), timeout=30)["writing"] == [gen, 5, SEC],
            60,
            "the holder to write step 5",
        )
        ray.kill(ctl, no_restart=False)  # the process dies; max_restarts=-1: Ray starts it again
        _wait_for(
            lambda: _try(lambda: ray.get(ctl.settled.remote(gen, [5]), timeout=30).committed == (5,)),
            120,
            "step 5 to commit through the restarted controller",
        )
        assert [c.step for c in list_committed(storage)] == [5]
        # Never silent (found by the fault soak): the restarted controller says so, once.
        logs = ray._private.worker._global_node.get_logs_dir_path()

        def said() -> int:
            return sum(
                open(f, errors="replace").read().count(f"controller of {key} started again")
                for f in glob.glob(os.path.join(logs, "worker-*"))
            )

        _wait_for(lambda: said() >= 1, 30, "the restarted controller to say it started again")
        assert said() == 1
        assert ray.get(ctl.ping.remote(), timeout=30)["generation"] >= gen
        reply = ray.get(ctl.sync.remote(SyncRequest(rank=0, generation=gen, adopted_version=3)), timeout=30)
        assert reply.schedules and all(s.schedule_version > 3 for s in reply.schedules)
        _stage(ray, holder, gen, 6)
        _wait_for(lambda: ray.get(ctl.settled.remote(gen, [6]), timeout=30).committed == (6,), 60, "step 6 to commit")
    finally:
        _cleanup(ray, ctl, *([holder] if holder is not None else []))


def test_resolve_controller_makes_a_killed_controller_again(controller, ray_cluster, tmp_path):
    from cf_ray._engine.driver.controller import resolve_controller

    ray = ray_cluster
    key, storage, settings, ctl, cname, ns = _actor_run(tmp_path)
    new = None
    try:
        gen = ray.get(ctl.prepare_restore.remote(1), timeout=120).generation
        ray.kill(ctl, no_restart=True)  # gone for good
        new = resolve_controller(key, storage, settings, timeout_s=120)
        assert ray.get(new.ping.remote(), timeout=60)["generation"] >= gen  # control_state.json
        reply = ray.get(new.sync.remote(SyncRequest(rank=0, generation=gen, adopted_version=2)), timeout=30)
        assert all(s.schedule_version > 2 for s in reply.schedules)
    finally:
        _cleanup(ray, ctl, *([new] if new is not None else []))


# -- a step lost with its node is reported (#28 #2) --------------------------------------------------


def _link_of(ctl, rank: int, generation: int, committed: int):
    """A rank's line to this in-process controller, at the start of attempt ``generation``."""
    import cf_ray
    from cf_ray._engine.worker.link.controller import ControllerLink
    from cf_ray._engine.worker.scheduler import Scheduler
    from cf_ray._engine.worker.timing import Timing

    link = ControllerLink(ctl, rank, Timing(), Scheduler(cf_ray.CheckpointConfig()), lambda r: None)
    link.start_attempt(generation, committed)
    return link


@pytest.mark.parametrize("order", ["watch_first", "restore_first", "then_the_controller_starts_again"])
def test_a_step_lost_with_its_node_is_reported_to_the_next_attempt_once(controller, tmp_path, order):
    """Rank 0's node is removed while step 15 is still unwritten (its holder gone with it); the next
    attempt resumes at 10. The step never committed, and the user hears of it at the end of the run:
    every rank of the new attempt reports it once in ``wait()`` and in ``FinishSummary.failures``
    (marked ``earlier_attempt``), never as one of its own steps and never raised by
    ``raise_on_persist_error`` (each new attempt would raise it again). Both orders: the watch finds
    the holder gone before the restore, or the restore comes first (the step is abandoned with its
    node, and reported as lost with it). And the controller may die before the ranks heard of it:
    the one Ray starts again reports it (the soak's seed 17 lost it so; it is saved with the
    controller's state, ``control_state.json``)."""
    from controller_harness import Cluster

    holders = Holders()
    cluster = Cluster()
    ctl = controller(_storage(tmp_path), "lost", holders=holders, cluster=cluster)
    ctl._roster.resynced.wait(10)
    gen = ctl.prepare_restore(2).generation
    ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0))
    two = SnapshotMeta(rank=0, world_size=2, replicated=False, epoch=0, kind=CheckpointKind.SCHEDULED)
    for step in (10, 15):
        for rank, (holder, node) in enumerate((("hA", "A"), ("hB", "B"))):
            sec = rank_section(rank)
            m = dataclasses.replace(two, rank=rank)
            ctl.part_staged(
                PartStaged(generation=gen, step=step, section=sec, holder=holder, nbytes=8, meta=m, node_id=node)
            )
            if step == 10 or rank == 1:
                ctl.part_durable(_write(ctl.storage, gen, step, section=sec, holder=holder))
    assert ctl.settled(gen, [10, 15]).committed == (10,) and ctl.settled(gen, [15]).pending == (15,)
    holders.holders = {"hA": None, "hB": lambda key: ("done", None, None)}  # node A is gone, hA with it
    cluster.alive = {"B"}
    if order != "restore_first":
        ctl.watch_once(min_age_s=0)
    gen2 = ctl.prepare_restore(2).generation
    ctl.restored(Restored(source=RestoreSource.STORAGE, step=10, epoch=0))
    if order == "restore_first":
        ctl.watch_once(min_age_s=0)
    assert ctl.settled(gen, [15]).committed == ()
    if order == "then_the_controller_starts_again":
        _wait_for(ctl._maintenance.idle, 10, "the controller's state saved")
        ctl = controller(ctl.storage, "lost", recreated=True, holders=holders, cluster=cluster)
        ctl._roster.resynced.wait(10)
    lost = [f for f in ctl.summary()["failures"] if f["step"] == 15]
    assert len(lost) == 1 and lost[0]["generation"] == gen and "lost" in lost[0]["error"]
    assert lost[0]["section"] == rank_section(0)

    for rank in (0, 1):
        link = _link_of(ctl, rank, gen2, committed=10)
        link._on_reply(ctl.sync(SyncRequest(rank=rank, generation=gen2)))
        reported = link.new_failures(raise_on_error=True)  # reported, not raised
        assert [(f["step"], f["generation"], f.get("earlier_attempt")) for f in reported] == [(15, gen, True)]
        assert link.new_failures(raise_on_error=True) == []  # once
        assert link.failures == reported  # what FinishSummary.failures holds
        # This attempt's own step 15 is another checkpoint: not settled by the earlier one's failure.
        link.track(15)
        assert link._unsettled_locally([15]) == [15]
