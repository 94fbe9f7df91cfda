"""Snapshot slots (#14) without Ray: the worker copies once into the holder's shared memory, the
checksums are taken as the copy lands, the holder writes straight from the slot, and the slot's
header and locks keep readers from ever taking one fill for another."""

from __future__ import annotations

import mmap
import os
import threading
import time
import zlib

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch
from test_snapshot import _clone, _equal_trees, _job

from cf_ray._engine.format.blocks import BLOCK_BYTES, block_crcs, verify_blocks
from cf_ray._engine.format.layout import section_files
from cf_ray._engine.format.sections import Section, parse_index, parse_index_blocks, write_section_slot
from cf_ray._engine.memory import crc
from cf_ray._engine.memory import slots as shm
from cf_ray._engine.node.slot_store import SlotStore
from cf_ray._engine.storage.fs import FsStorage
from cf_ray._engine.worker.cpu_budget import CpuBudget
from cf_ray._engine.worker.snapshot import copy_engine
from cf_ray._engine.worker.snapshot.snapshotter import Snapshotter

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs Linux memfd_create")


class _Holder:
    """What the holder does with a slot hand-off, in process: its slot store makes the slots, and it
    keeps the descriptors only."""

    def __init__(self):
        self.store = SlotStore("test")
        self.arena = self.store.arena
        self.staged: dict[int, dict] = {}

    def __call__(self, job, sections):
        self.staged[job.step] = {n: (s.slot, s.index, s.crc32) for n, s in sections.items()}

    def read(self, step: int, name: str = "s", generation: int = 0):
        desc, index, _ = self.staged[step][name]
        lk = shm.ReadLock.take(desc, generation, step)
        return lk, index


def test_a_snapshot_lands_once_in_the_holders_slot_with_its_checksums(tmp_path):
    model, opt, train_step, sections, guarded = _job()
    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)
    train_step()
    expected = _clone(sections()["s"])
    snap.begin(1, sections(), guarded, {})
    train_step(snap)  # training goes on while the background thread copies
    assert snap.wait_done(timeout=30)
    assert snap.take_errors() == []
    timings = snap.last_timings
    state_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    # The state was copied once (model + Adam's state + small entries), and never read again to checksum.
    assert state_bytes < timings["copied_bytes"] < 4 * state_bytes
    assert timings.get("crc_read_bytes", 0) == 0

    desc, index, crc = holder.staged[1]["s"]
    lk, _ = holder.read(1)
    assert lk is not None
    data = np.frombuffer(lk.data, dtype=np.uint8)
    # The block checksums in the index and the file's CRC are those of the bytes in the slot.
    _tree, _entries, blocks = parse_index_blocks(index, "test")
    assert blocks is not None and list(blocks.crc32) == block_crcs(data)
    assert crc == zlib.crc32(data)
    tree, entries = parse_index(index, "test")
    assert _equal_trees(Section(tree, entries, data).materialize(copy=True), expected)

    # The holder's write: straight from the slot, read back verified.
    storage = FsStorage(pafs.LocalFileSystem(), str(tmp_path))
    files, _copied = write_section_slot(storage, "step_1", 0, "s", lk.data, index, crc)
    lk.close()
    data_name, _ = section_files(0, "s")
    assert files[data_name].crc32 == crc and files[data_name].size == desc.nbytes
    with open(os.path.join(str(tmp_path), "step_1", data_name), "rb") as f:
        assert zlib.crc32(f.read()) == crc
    snap.close()
    snap.release_buffers()


def test_each_snapshot_says_where_its_background_time_went():
    """The per-checkpoint budget (#25): the copy, its block CRCs (folded into the copy's windows, but
    timed apart), the fingerprints, the index and the hand-off, once per snapshot, in wall and CPU time."""
    _model, _opt, train_step, sections, guarded = _job()
    holder, budget = _Holder(), CpuBudget()
    snap = Snapshotter(0, holder, arena_source=holder.arena, budget=budget)
    train_step()
    for step in (1, 2):
        snap.begin(step, sections(), guarded, {})
        train_step(snap)
        assert snap.wait_done(timeout=30) and snap.take_errors() == []
    parts = budget.totals()
    for part in ("copy", "crc", "fingerprint", "index", "handoff"):
        assert parts[part]["calls"] == 2, (part, parts)
        assert parts[part]["wall_s"] >= 0 and parts[part]["cpu_s"] >= 0, (part, parts)
    # The CRCs are a part of the copy's windows: what the copy reports is the rest.
    assert parts["crc"]["cpu_s"] > 0 and parts["copy"]["cpu_s"] > 0
    assert snap.last_timings["crc_s"] > 0 and snap.last_timings["crc_s"] <= snap.last_timings["copy_s"]
    snap.close()
    snap.release_buffers()


def test_the_next_snapshot_fills_the_other_slot_and_a_coalesced_one_is_never_read_as_its_step():
    model, opt, train_step, sections, guarded = _job()
    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)
    train_step()
    expected = {}
    for step in (1, 2, 3):
        expected[step] = _clone(sections()["s"])
        snap.begin(step, sections(), guarded, {})
        train_step(snap)
        assert snap.wait_done(timeout=30)
    paths = [holder.staged[s]["s"][0].path for s in (1, 2, 3)]
    assert paths[0] != paths[1] and paths[2] == paths[0]  # two slots, alternately
    # Step 1's slot now holds step 3: step 1 can no longer be read, steps 2 and 3 can, each as itself.
    assert holder.read(1)[0] is None
    for step in (2, 3):
        lk, index = holder.read(step)
        tree, entries = parse_index(index, "test")
        got = Section(tree, entries, np.frombuffer(lk.data, dtype=np.uint8)).materialize(copy=True)
        lk.close()
        assert _equal_trees(got, expected[step]), step
    snap.close()
    snap.release_buffers()


def test_the_holder_reads_each_new_fill_of_a_slot_through_one_kept_mapping_and_unmaps_a_freed_one():
    """The holder persists a section's slot at every checkpoint: it maps each slot once (not once per
    write: building and tearing down a 300 MB mapping cost more CPU than the write), reads every new
    fill through it, never an overwritten fill, and a freed slot's memory is unmapped once its last
    reader is done."""
    from slot_helpers import fill_slot

    from cf_ray._engine.node.slot_store import Held
    from cf_ray._engine.protocol.messages import CheckpointKind, SnapshotMeta

    meta = SnapshotMeta(rank=0, world_size=1, replicated=True, epoch=0, kind=CheckpointKind.SCHEDULED)

    def mapped(name: str) -> int:
        with open("/proc/self/maps") as f:
            return sum(f"memfd:{name}" in line for line in f)

    store = SlotStore("kept")
    rng = np.random.default_rng(0)
    nbytes = 3 * 4096 + 100
    descs = store.arena("s", nbytes)
    held, data = {}, {}
    for step in (1, 2, 3):  # step 3 fills step 1's slot again
        data[step] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        desc = fill_slot(descs, 0, step, data[step])
        held[step] = Held(0, step, "s", desc, b"", 0, meta)
        store.add_own(held[step])
    assert held[3].slot.name == held[1].slot.name
    assert store.take(held[1]) is None  # overwritten: never read as step 1
    locks = {step: store.take(held[step]) for step in (2, 3)}
    again = store.take(held[3])
    assert again is not None and all(lk is not None for lk in locks.values())
    for step, lk in locks.items():
        assert bytes(lk.data) == data[step].tobytes(), step
    assert mapped(held[3].slot.name) == 1  # the slot's one mapping, borrowed by both locks
    # A kept mapping unmapped meanwhile (its slot freed as the lock was taken) is never read: the lock
    # maps the slot itself.
    gone = mmap.mmap(-1, 4096)
    gone.close()
    lk = shm.ReadLock.take(held[2].slot, 0, 2, mapping=gone)
    assert lk is not None and bytes(lk.data) == data[2].tobytes()
    lk.close()
    again.close()
    store.close()  # frees the slots while step 3's reader is still reading
    assert bytes(locks[3].data) == data[3].tobytes()
    for lk in locks.values():
        lk.close()
    del locks, again, lk
    assert mapped(held[3].slot.name) == 0 and mapped(held[2].slot.name) == 0


def test_held_slots_are_never_filled_the_spare_takes_over_and_all_held_makes_the_snapshot_wait():
    """Both slots held by the holder (one being written, one pinned: a milestone, the protected copied
    step): the next snapshot goes to the spare at once, its pages taken only then; all three held: it
    waits for the first released, and says so."""
    model, opt, train_step, sections, guarded = _job()
    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)
    train_step()

    def take(step):
        expected = _clone(sections()["s"])
        snap.begin(step, sections(), guarded, {})
        train_step(snap)
        assert snap.wait_done(timeout=30) and snap.take_errors() == []
        return expected

    for step in (1, 2):
        take(step)
    spare_pages = holder.store.held_bytes()["slots"]
    # The holder persists step 1 (shared lock) and keeps step 2 pinned.
    locks = [holder.read(1)[0], holder.read(2)[0]]
    assert all(lk is not None for lk in locks)
    expected = {3: take(3)}
    assert snap.last_timings["slot_wait_s"] < 0.2
    paths = {s: holder.staged[s]["s"][0].path for s in (1, 2, 3)}
    assert len(set(paths.values())) == 3  # the spare, never a held one
    assert holder.store.held_bytes()["slots"] > spare_pages  # its pages taken now, not before
    locks.append(holder.read(3)[0])

    def release_later():
        time.sleep(0.3)
        locks[0].close()

    threading.Thread(target=release_later).start()
    expected[4] = take(4)
    assert snap.last_timings["slot_wait_s"] >= 0.2  # it waited for the write of step 1, and says so
    assert holder.staged[4]["s"][0].path == paths[1]
    for step in (3, 4):
        lk, index = holder.read(step)
        tree, entries = parse_index(index, "test")
        got = Section(tree, entries, np.frombuffer(lk.data, dtype=np.uint8)).materialize(copy=True)
        lk.close()
        assert _equal_trees(got, expected[step]), step
    for lk in locks[1:]:
        lk.close()
    snap.close()
    snap.release_buffers()


def test_faulting_in_a_sections_slots_takes_every_page_now_and_keeps_what_they_hold():
    """The snapshotter faults the holder's slots in ahead of the first checkpoint (``prepare``), so
    that its copy does not take the page faults behind the weight-update guard. (Until 2026-11-29 the
    fault-in was a numpy self-assignment, which numpy skips: no page was taken.)"""
    from cf_ray._engine.worker.snapshot.slot_arena import SlotArena

    n = 8 << 20
    store = SlotStore("test")
    arena = SlotArena(store.arena("s", n), n, pin=False)
    try:
        arena.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # say a restored snapshot
        assert store.held_bytes()["slots"] < n
        arena.fault_in()
        assert store.held_bytes()["slots"] >= 2 * n  # both regular slots; the spare stays empty
        assert arena.tensor[:4].tolist() == [1, 2, 3, 4]
    finally:
        arena.close()
        store.close()


def test_a_worker_that_dies_mid_fill_leaves_a_slot_that_reads_as_empty(tmp_path):
    slot = shm.Slot(shm.memfd_name("run", "s", 0), 1 << 16)
    w = shm.WriterSlot(slot.desc, 1 << 16)
    assert w.try_fill()
    desc = w.seal(0, 5)
    assert w.try_fill()  # the next fill began (header: filling) ...
    w.data()[:4] = b"half"
    w.close()  # ... and the process is gone: its lock went with it
    assert shm.ReadLock.take(desc, 0, 5) is None  # never read as step 5
    assert shm.WriterSlot(slot.desc, 1 << 16).header().state == shm.FILLING
    slot.close()


@pytest.mark.parametrize("form", ["isal", "python"])
def test_crc32_combine_is_zlibs(form, monkeypatch):
    if form == "python":
        monkeypatch.setattr(crc, "_combine_c", None)  # where isal is not installed
    else:
        assert crc._combine_c is not None  # isal is a dependency: the C form is the one used
    data = os.urandom(3 * BLOCK_BYTES + 1234)
    blocks = block_crcs(np.frombuffer(data, dtype=np.uint8))
    assert crc.combine_blocks(blocks, BLOCK_BYTES, len(data)) == zlib.crc32(data)
    assert crc.combine_blocks([], BLOCK_BYTES, 0) == zlib.crc32(b"")
    a, b = data[:1000], data[1000:]
    assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)
    assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)


def test_a_slot_filled_by_dma_is_checksummed_on_several_threads_block_for_block():
    # Not a DMA (no GPU here): the same read of a slot, split over threads, in the block layout
    # the index carries; a flipped byte changes exactly its own block's CRC.
    n = 5 * copy_engine.CRC_TASK_BLOCKS * BLOCK_BYTES + 12345
    buf = np.frombuffer(os.urandom(n), dtype=np.uint8).copy()
    one = block_crcs(buf)
    crcs, cpu = copy_engine.dma_block_crcs(buf, threads=4)
    assert crcs == one and cpu > 0.0  # the threads' CPU is reported (the caller's thread only waits)
    assert copy_engine.dma_block_crcs(buf, threads=1) == (one, 0.0)
    buf[3 * BLOCK_BYTES + 7] ^= 1
    flipped, _ = copy_engine.dma_block_crcs(buf, threads=4)
    assert [k for k, (a, b) in enumerate(zip(one, flipped)) if a != b] == [3]


def test_the_checksum_threads_share_the_cores_with_the_nodes_other_ranks(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("CF_RAY_CRC_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert copy_engine.crc_threads() == max(1, min(copy_engine.MAX_CRC_THREADS, cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))
    assert copy_engine.crc_threads() == 1
    monkeypatch.setenv("CF_RAY_CRC_THREADS", "3")
    assert copy_engine.crc_threads() == 3
    monkeypatch.setenv("CF_RAY_CRC_THREADS", "0")  # the default
    assert copy_engine.crc_threads() == 1
    monkeypatch.setenv("CF_RAY_CRC_THREADS", "many")
    with pytest.raises(ValueError, match="CF_RAY_CRC_THREADS='many': set it to a whole number"):
        copy_engine.crc_threads()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_by_dma_into_the_pinned_slot_on_their_devices_stream():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(64, 256, device="cuda")
    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)

    def train_step():
        model(x).square().mean().backward()
        snap.wait_copy()
        opt.step()
        opt.zero_grad()

    def guarded(t):
        ptrs = {p.data_ptr() for p in model.parameters()}
        ptrs |= {v.data_ptr() for st in opt.state.values() for v in st.values() if v.dim() > 0}
        return t.data_ptr() in ptrs

    train_step()
    sections = {"s": {"model": model.state_dict(), "opt": opt.state_dict()}}
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    snap.begin(1, sections, guarded, {})
    assert snap.arenas.of("s").tensor.is_pinned()  # the holder's memory, registered with CUDA
    train_step()  # weights change only after the guard: the DMA saw the step-1 weights
    assert snap.wait_done(timeout=60) and snap.take_errors() == []
    lk, index = holder.read(1)
    tree, entries = parse_index(index, "test")
    got = Section(tree, entries, np.frombuffer(lk.data, dtype=np.uint8)).materialize(copy=True)
    _t, _e, blocks = parse_index_blocks(index, "test")
    assert blocks is not None and list(blocks.crc32) == block_crcs(np.frombuffer(lk.data, dtype=np.uint8))
    lk.close()
    assert all(torch.equal(got["model"][k], v) for k, v in expected.items())
    snap.close()
    snap.release_buffers()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_into_the_spare_slot_register_it_on_first_use():
    """Both regular slots held by the holder: the snapshot goes to the spare, which is registered with
    CUDA (its pages pinned) only then, and the DMA lands exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(64, 256, device="cuda")
    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)

    def train_step():
        model(x).square().mean().backward()
        snap.wait_copy()
        opt.step()
        opt.zero_grad()

    def guarded(t):
        ptrs = {p.data_ptr() for p in model.parameters()}
        ptrs |= {v.data_ptr() for st in opt.state.values() for v in st.values() if v.dim() > 0}
        return t.data_ptr() in ptrs

    def sections():
        return {"s": {"model": model.state_dict(), "opt": opt.state_dict()}}

    train_step()
    for step in (1, 2):
        snap.begin(step, sections(), guarded, {})
        train_step()
        assert snap.wait_done(timeout=60) and snap.take_errors() == []
    arena = snap.arenas.of("s")
    assert sorted(arena._registered) == [0, 1]  # the spare not yet
    locks = [holder.read(1)[0], holder.read(2)[0]]
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    snap.begin(3, sections(), guarded, {})
    assert arena.current == 2 and sorted(arena._registered) == [0, 1, 2] and arena.tensor.is_pinned()
    train_step()
    assert snap.wait_done(timeout=60) and snap.take_errors() == []
    lk, index = holder.read(3)
    tree, entries = parse_index(index, "test")
    got = Section(tree, entries, np.frombuffer(lk.data, dtype=np.uint8)).materialize(copy=True)
    _t, _e, blocks = parse_index_blocks(index, "test")
    assert blocks is not None and list(blocks.crc32) == block_crcs(np.frombuffer(lk.data, dtype=np.uint8))
    lk.close()
    for lock in locks:
        lock.close()
    assert all(torch.equal(got["model"][k], v) for k, v in expected.items())
    snap.close()
    snap.release_buffers()


def test_a_hand_off_that_does_not_return_holds_the_next_snapshot_a_bounded_time_saying_so(monkeypatch, caplog):
    """Issue 23 #2: at most one snapshot is in flight, so the next one waited for the previous
    hand-off with no bound: a holder that stops answering (Ray restarting it, a call stuck in Ray)
    held the training thread at its next checkpoint, silently. It waits at most env.SLOT_WAIT_S,
    says so while it waits, then skips that snapshot; once the hand-off returns, the next snapshot
    is taken as usual."""
    import logging
    import threading
    import time

    from cf_ray._engine import env
    from cf_ray._engine.worker.snapshot.snapshotter import SnapshotSkipped

    caplog.set_level(logging.WARNING, logger="cf_ray")
    monkeypatch.setattr(env, "SLOT_WAIT_S", 2.0)
    model, opt, train_step, sections, guarded = _job()
    holder = _Holder()
    answer = threading.Event()

    def stuck_hand_off(job, staged):
        if job.step == 1:
            assert answer.wait(60)
        holder(job, staged)

    snap = Snapshotter(0, stuck_hand_off, arena_source=holder.arena)
    try:
        train_step(snap)
        snap.begin(1, sections(), guarded, {})  # its hand-off does not return
        train_step(snap)
        t0 = time.monotonic()
        with pytest.raises(SnapshotSkipped, match="hand-off to this node's holder has not returned in 2 s"):
            snap.begin(2, sections(), guarded, {})
        assert 2.0 <= time.monotonic() - t0 < 10
        assert "has waited 1 s for the previous snapshot's hand-off" in caplog.text  # said while it waited
    finally:
        answer.set()
    assert snap.wait_done(timeout=30)
    snap.begin(3, sections(), guarded, {})
    assert snap.wait_done(timeout=30) and snap.take_errors() == [] and sorted(holder.staged) == [1, 3]
    snap.close()


def test_a_snapshot_that_finds_every_slot_held_waits_a_bounded_time_saying_so_then_is_skipped(monkeypatch, caplog):
    """Every slot of the section is held by the holder (one being written, one pinned until written:
    a milestone on a storage that hangs, and the spare): the training thread waits at most
    env.SLOT_WAIT_S, says so while it waits, lets the watchdog speak (``on_slot_wait``), and then
    skips the snapshot."""
    import logging
    import threading
    import time

    from cf_ray._engine.worker.snapshot.snapshotter import SnapshotSkipped

    caplog.set_level(logging.WARNING, logger="cf_ray")
    from cf_ray._engine import env

    monkeypatch.setattr(env, "SLOT_WAIT_S", 2.0)
    model, opt, train_step, sections, guarded = _job()
    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)
    held = []
    for step in (1, 2, 3):  # one fill in each slot, each held: written, pinned, and the spare
        train_step(snap)
        snap.begin(step, sections(), guarded, {})
        assert snap.wait_done(timeout=30)
        held.append(holder.read(step)[0])
    calls: list[float] = []
    snap.on_slot_wait = lambda waited: calls.append(waited) is None and False
    outcome: dict = {}

    def take():
        t0 = time.monotonic()
        try:
            snap.begin(4, sections(), guarded, {})
        except SnapshotSkipped as e:
            outcome["skipped"] = str(e)
        outcome["seconds"] = time.monotonic() - t0

    try:
        train_step(snap)
        t = threading.Thread(target=take, daemon=True)
        t.start()
        t.join(timeout=20)
        assert not t.is_alive(), "the training thread waits for a free slot without a bound"
        assert "no free snapshot slot of section s within 2 s" in outcome["skipped"]
        assert "step 1 (ready), step 2 (ready), step 3 (ready)" in outcome["skipped"]
        assert 2.0 <= outcome["seconds"] < 10
        assert len(calls) >= 4 and max(calls) < 2.5  # the watchdog was fed while it waited
        assert "has waited 1 s for a free slot of section s" in caplog.text  # said while it waited
        # The watchdog ends the wait early (durability lost with on_durability_lost="raise").
        snap.on_slot_wait = lambda waited: True
        t0 = time.monotonic()
        with pytest.raises(SnapshotSkipped):
            snap.begin(4, sections(), guarded, {})
        assert time.monotonic() - t0 < 1.5
    finally:
        for lk in held:
            lk.close()
    # The slots are free again: the next snapshot takes one at once.
    snap.begin(5, sections(), guarded, {})
    assert snap.wait_done(timeout=30) and snap.take_errors() == [] and 5 in holder.staged
    snap.close()


def test_the_waits_of_a_snapshot_for_the_slots_of_all_its_sections_share_one_bound(monkeypatch):
    """Rank 0 of a replicated model has three sections. Each has every slot held (a storage that
    stalls), and the holder frees them one section after the other, each just within the bound: the
    snapshot is skipped once the bound has passed in all (not taken after three times the bound, as
    when each section had a bound of its own), and the slot it took is given back."""
    from cf_ray._engine import env
    from cf_ray._engine.worker.snapshot.snapshotter import SnapshotSkipped

    monkeypatch.setattr(env, "SLOT_WAIT_S", 2.0)
    model, opt, train_step, sections, guarded = _job()
    names = ("shared", "rank_00000", "rank_00001")

    def three():
        return {n: sections()["s"] for n in names}

    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)
    held: dict[str, list] = {n: [] for n in names}
    for step in (1, 2, 3):  # one fill in each slot of each section, each held
        train_step(snap)
        snap.begin(step, three(), guarded, {})
        assert snap.wait_done(timeout=30)
        for n in names:
            held[n].append(holder.read(step, n)[0])

    def free(name):
        for lk in held.pop(name):
            lk.close()

    timers = [threading.Timer(1.5 * (k + 1), free, (n,)) for k, n in enumerate(names)]
    train_step(snap)
    t0 = time.monotonic()
    try:
        for t in timers:
            t.start()
        with pytest.raises(SnapshotSkipped, match="no free snapshot slot of section rank_00000"):
            snap.begin(4, three(), guarded, {})
        seconds = time.monotonic() - t0
        assert 2.0 <= seconds < 3.0, seconds
    finally:
        for t in timers:
            t.join()
    assert not held
    snap.begin(5, three(), guarded, {})  # every slot free again, shared's among them
    assert snap.wait_done(timeout=30) and snap.take_errors() == [] and sorted(holder.staged[5]) == sorted(names)
    snap.close()


def test_a_holder_slow_to_give_a_new_layouts_slots_holds_the_snapshot_only_within_the_bound(ray_cluster, monkeypatch):
    """A section whose layout is new asks this node's holder for its slots on the training thread;
    a holder that does not answer (stuck in Ray, restarting) holds it no longer than the snapshot's
    bound (it held it for ``CF_RAY_ACTOR_TIMEOUT_S``, twice when the holder was found gone, and then
    raised out of the training loop): the snapshot is skipped, training goes on."""
    import ray

    from cf_ray._engine import env
    from cf_ray._engine.worker.snapshot.handoff import HolderHandOff
    from cf_ray._engine.worker.snapshot.snapshotter import SnapshotSkipped
    from cf_ray._engine.worker.timing import Timing

    @ray.remote(num_cpus=0)
    class SlowHolder:
        def arena(self, section, nbytes):
            time.sleep(30)

    monkeypatch.setattr(env, "SLOT_WAIT_S", 1.5)
    monkeypatch.setenv(env.ACTOR_TIMEOUT_S, "8")
    holder = SlowHolder.remote()
    ray.get(holder.__ray_ready__.remote(), timeout=60)
    link = HolderHandOff(0, holder, Timing())
    model, opt, train_step, sections, guarded = _job()
    snap = Snapshotter(0, link.hand_off, arena_source=link.slots)
    try:
        train_step(snap)
        t0 = time.monotonic()
        with pytest.raises(SnapshotSkipped, match="did not give the slots of section s"):
            snap.begin(1, sections(), guarded, {})
        assert time.monotonic() - t0 < 4
        assert snap.arenas.sections() == []  # nothing half made: the next snapshot asks again
    finally:
        snap.close()
        ray.kill(holder)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_unguarded_device_tensors_land_before_their_blocks_are_checksummed_and_handed_off():
    """A device with only unguarded tensors (a buffer): their non_blocking copies into the slot are
    waited for before the background thread checksums the slot and hands it off (#23, item 9)."""
    holder = _Holder()
    snap = Snapshotter(0, holder, arena_source=holder.arena)
    buf = torch.randn(64 << 20, device="cuda")  # 256 MB, not guarded: copied at begin(), non_blocking
    expected = buf.cpu().numpy().view(np.uint8).copy()
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):  # the device is busy: the copy queued behind this lands late
        a = torch.tanh(a @ a)
    snap.begin(1, {"s": {"buf": buf}}, lambda t: False, {})
    assert snap.wait_done(timeout=120) and snap.take_errors() == []
    _, index, crc = holder.staged[1]["s"]
    lk, _ = holder.read(1)
    try:
        data = np.frombuffer(lk.data, dtype=np.uint8)
        _tree, entries, blocks = parse_index_blocks(index, "test")
        verify_blocks(data, blocks, "the slot")  # the checksums are those of the landed bytes
        assert zlib.crc32(data) == crc
        (e,) = entries
        assert np.array_equal(data[e.offset : e.offset + e.nbytes], expected)
    finally:
        lk.close()
        snap.close()
