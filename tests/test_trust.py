"""Trust (#23), worker side: every byte a restore uses is verified before use, whatever path it came
by; a snapshot that failed is never tried again; a saved state or the first steps after a restore that
go non-finite roll the run back past that snapshot, once.

The parts alone need no Ray (the restore with a one-rank control plane and a stand-in controller, a
section streamed over ``node/stream.py``'s real server); the ``slow`` tests run a Checkpointer with
Ray actors in this process (its holder's slots, its controller), a close() and a new Checkpointer
standing for a restarted worker. The end-to-end run (TorchTrainer, a bit flipped in a holder's slot,
a worker SIGKILLed) is in tests/test_faults_e2e.py.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import test_restore as tr
import torch

import cf_ray
from cf_ray._engine.format.blocks import BLOCK_BYTES, BlockMismatchError, Blocks, block_crcs, with_blocks
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import SHARED, rank_section, section_files, step_dir
from cf_ray._engine.format.sections import Section, load_section, parse_index, parse_index_blocks, write_section
from cf_ray._engine.memory import slots as shm
from cf_ray._engine.memory import wire
from cf_ray._engine.node import stream
from cf_ray._engine.protocol.messages import RestoreSource, SlotDesc
from cf_ray._engine.worker.restore import checks as restore_checks
from cf_ray._engine.worker.restore import integrity
from cf_ray._engine.worker.restore.trust_gate import (
    NonFiniteAfterRestore,
    Reason,
    RunTrust,
    Suspect,
    TrustGate,
)
from cf_ray.errors import CorruptCheckpointError, RestoreError
from cf_ray.load import quarantined_checkpoints

from storage_helpers import arena_of

# -- the bytes, whatever path they came by ---------------------------------------------------------------


def _section_bytes(seed: int = 0) -> tuple[np.ndarray, bytes, Blocks]:
    """A section's data (a 1 MiB weight and more) and its index with the CRC-32 of every block."""
    torch.manual_seed(seed)
    buf, index = arena_of({"objects": {"w": torch.randn(512, 512), "b": torch.randn(300_000)}})
    index = with_blocks(index, block_crcs(buf))
    return buf, index, Blocks(BLOCK_BYTES, tuple(block_crcs(buf)))


@pytest.mark.skipif(not shm.available(), reason="needs memfd_create (Linux)")
def test_a_flipped_bit_in_a_streamed_section_is_refused_naming_its_block():
    buf, index, _ = _section_bytes()
    tree, entries, blocks = parse_index_blocks(index, "test")
    w = next(e for e in entries if e.name.endswith("w"))
    flipped = buf.copy()
    at = w.offset + w.nbytes // 2 + 3  # the middle of the 1 MiB weight: no fingerprint window there
    flipped[at] ^= 0x10
    srv = stream.SectionServer("127.0.0.1")
    fds = []
    try:
        for data in (buf, flipped):  # each as a slot file: a header page, then the bytes
            fd = os.memfd_create("test-slot")
            os.ftruncate(fd, shm.HEADER_BYTES + data.nbytes)
            os.pwrite(fd, data.tobytes(), shm.HEADER_BYTES)
            fds.append(fd)
        good = wire.fetch(srv.offer(buf.nbytes, lambda: None, fd=fds[0], offset=shm.HEADER_BYTES)[0], 10)
        bad = wire.fetch(srv.offer(flipped.nbytes, lambda: None, fd=fds[1], offset=shm.HEADER_BYTES)[0], 10)
    finally:
        srv.close()
        for fd in fds:
            os.close(fd)
    integrity.verify_section(Section(tree, entries, good, private=True, blocks=blocks), "the good copy")
    with pytest.raises(BlockMismatchError, match=rf"from holder h \(direct\): block {at // BLOCK_BYTES} ") as e:
        integrity.verify_section(
            Section(tree, entries, bad, private=True, blocks=blocks),
            "section shared of step 10 from holder h (direct)",
        )
    assert e.value.blocks == [at // BLOCK_BYTES] and e.value.block_bytes == BLOCK_BYTES
    # Fail closed: bytes from memory without block checksums are not used.
    with pytest.raises(CorruptCheckpointError, match="no block checksums"):
        integrity.verify_section(Section(tree, entries, good), "an index of before the blocks")


def test_a_damaged_file_on_storage_names_its_block(tmp_path):
    state, data = tr._objects(seed=1)
    _, storage, _ = tr._restorer(tmp_path, state, data)
    tr._write(storage, 5, tr._trees(state, data, 5))
    m = read_manifest(storage, step_dir(5))
    name = m.sections[SHARED]["data"]
    path = str(tmp_path / "run" / "cf_ray" / step_dir(5) / name)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 1
    open(path, "wb").write(bytes(raw))
    with pytest.raises(BlockMismatchError, match="fails its checksum") as e:
        load_section(storage, step_dir(5), m, SHARED)
    assert e.value.blocks == [(len(raw) // 2) // BLOCK_BYTES]


# -- a saved state that is not finite, bytes that change under the load ----------------------------------------


def _blown_up(seed: int, value: float):
    state, data = tr._objects(seed=seed)
    with torch.no_grad():
        state["model"][0].weight[1, 2] = value  # a step that put inf in one weight (the loop repaired it later)
    return state, data


def test_a_non_finite_saved_state_is_refused_and_the_restore_goes_back_in_place(tmp_path):
    state, data = tr._objects(seed=2)
    restorer, storage, link = tr._restorer(tmp_path, state, data)
    old, old_data = tr._objects(seed=3)
    tr._write(storage, 5, tr._trees(old, old_data, 5))
    tr._write(storage, 10, tr._trees(*_blown_up(4, float("inf")), 10))
    out = restorer.load(tr._plan(10, 5))
    assert (out.source, out.step) == (RestoreSource.STORAGE, 5)  # in place: no restart, no error
    assert torch.equal(state["model"][0].weight, old["model"][0].weight)
    assert restorer.record.fallbacks.rolled_back_from == 10
    (skipped,) = restorer.record.fallbacks.items
    assert skipped["distrust"] == "non_finite" and "'model' holds infinity in 0.weight" in skipped["error"]
    fallback = next(e for e in link.events if e["event"] == "restore_fallback")
    assert fallback["non_finite"] and fallback["step"] == 10 and fallback["generation"] == 1
    # The controller never offers it again and quarantines its checkpoint, with the reason.
    ((generation, step, reason),) = link.distrusted
    assert (generation, step) == (1, 10) and reason.startswith("non_finite: rank 0: NonFiniteStateError")
    # A huge but finite weight is not refused here (the first steps' loss is what catches that).
    restore_checks_state = {"model": _blown_up(4, 1e30)[0]["model"].state_dict()}
    integrity.check_finite(restore_checks_state, {"model": state["model"]})


def test_bytes_that_change_under_the_load_fall_back_instead_of_blaming_load_state_dict(tmp_path, monkeypatch):
    state, data = tr._objects(seed=2)
    restorer, storage, link = tr._restorer(tmp_path, state, data)
    old, old_data = tr._objects(seed=3)
    tr._write(storage, 5, tr._trees(old, old_data, 5))
    tr._write(storage, 10, tr._trees(*tr._objects(seed=4), 10))
    real_apply, calls = restore_checks.apply, []

    def apply_while_memory_changes(prep, *args):
        calls.append(prep.step)
        if prep.step == 10:  # a stray write into the mapped snapshot while it is being loaded
            sec = restorer._sections[SHARED]
            assert isinstance(sec.buf, np.ndarray)
            sec.buf[sec.entries[0].offset] ^= 0xFF
        return real_apply(prep, *args)

    monkeypatch.setattr(restore_checks, "apply", apply_while_memory_changes)
    out = restorer.load(tr._plan(10, 5))
    assert calls == [10, 5] and out.step == 5  # the next candidate overwrote what was loaded
    assert torch.equal(state["model"][0].weight, old["model"][0].weight)
    (skipped,) = restorer.record.fallbacks.items
    assert (
        "changed while they were loaded" in skipped["error"] and "not the objects' load_state_dict" in skipped["error"]
    )


# -- distrusted snapshots are never tried again -------------------------------------------------------------------


def test_a_refused_memory_snapshot_is_reported_for_the_controller_to_never_offer_it_again(tmp_path, monkeypatch):
    """A memory candidate whose bytes fail: rank 0's restore_fallback event names its generation and
    step with ``verification`` (the controller takes it out of every later plan); the checkpoint of
    the same step on storage is intact and is the next candidate. A non-finite state is the same on
    every tier: the storage copy of that snapshot is not read again by the same restore."""
    from cf_ray._engine.worker.restore.memory import MemoryReader

    state, data = tr._objects(seed=2)
    restorer, storage, link = tr._restorer(tmp_path, state, data)
    saved, saved_data = tr._objects(seed=4)
    tr._write(storage, 5, tr._trees(*tr._objects(seed=3), 5), generation=1)
    tr._write(storage, 10, tr._trees(saved, saved_data, 10), generation=1)
    flipped = BlockMismatchError("section shared of step 10 from h (in_place): block 0 ...", blocks=[0])

    def damaged(self, cand, section):
        raise CorruptCheckpointError(f"no intact copy of section {section} of step 10: h: {flipped}")

    monkeypatch.setattr(MemoryReader, "section", damaged)
    plan = tr._plan(10, 5)
    plan = type(plan)(generation=3, memory=_memory(10, generation=1), storage=plan.storage)
    out = restorer.load(plan)
    assert (out.source, out.step) == (RestoreSource.STORAGE, 10)  # the intact copy of the same step
    fallback = next(e for e in link.events if e["event"] == "restore_fallback")
    assert (fallback["source"], fallback["step"], fallback["generation"], fallback["verification"]) == (
        "memory",
        10,
        1,
        True,
    )
    assert link.distrusted == []  # the event is enough for a memory snapshot (no quarantine: storage is fine)
    # What this restore refused itself covers the other copies of the same state, not another generation's.
    trust = RunTrust().adding(Suspect(10, 1, RestoreSource.MEMORY, Reason.NON_FINITE, "inf"))
    assert trust.why_not(RestoreSource.STORAGE, 1, 10) and not trust.why_not(RestoreSource.STORAGE, 2, 10)
    flip = RunTrust().adding(Suspect(10, 1, RestoreSource.MEMORY, Reason.INTEGRITY, "block 0"))
    assert flip.why_not(RestoreSource.MEMORY, 1, 10) and not flip.why_not(RestoreSource.STORAGE, 1, 10)
    # A rollback is read back from the controller's events: the next attempt knows it is one.
    events = [
        {"event": "rolled_back", "step": 17, "attempt": 4, "restored_step": 15},
        {"event": "distrusted", "generation": 4, "step": 15},
    ]
    assert RunTrust.from_events(events).rollback_into(5).restored_step == 15
    assert RunTrust.from_events(events).rollback_into(6) is None


def _memory(step: int, generation: int):
    from cf_ray._engine.protocol.messages import MemorySnapshot

    return MemorySnapshot(
        generation=generation,
        step=step,
        sections={SHARED: "h", rank_section(0): "h"},
        world_size=1,
        epoch=0,
        replicated=True,
    )


def test_the_trust_gate_reads_the_loss_only_in_the_first_steps_after_a_restore():
    gate = TrustGate(rank=0, steps=3)

    class Loud:
        reads = 0

        def detach(self):
            Loud.reads += 1
            return torch.tensor(float("nan"))

    gate.start(restored_step=None, restored_generation=-1, source=RestoreSource.FRESH, attempt=1, rolled_back_from=None)
    gate.loss(1, Loud())
    assert gate.posted == 0 and Loud.reads == 0  # a fresh run: nothing is read
    gate.start(restored_step=10, restored_generation=1, source=RestoreSource.MEMORY, attempt=2, rolled_back_from=None)
    gate.loss(11, torch.tensor(0.5))
    gate.loss(14, Loud())
    assert gate.posted == 0 and Loud.reads == 0  # past the window
    gate.loss(12, float("inf"))
    assert gate.posted == 12
    gate.taken(15)
    suspects = gate.suspects("loss inf")
    assert [(s.step, s.generation, s.reason) for s in suspects] == [
        (10, 1, Reason.NON_FINITE),
        (15, 2, Reason.NON_FINITE),
    ]
    err = gate.error(12)
    assert isinstance(err, NonFiniteAfterRestore) and isinstance(err, RestoreError)
    assert "(inf) at step 12, 2 step(s) after restoring step 10" in str(err) and "older than step 10" in str(err)
    gate.start(restored_step=5, restored_generation=1, source=RestoreSource.STORAGE, attempt=3, rolled_back_from=10)
    gate.loss(6, float("nan"))
    assert "both step 10 and step 5" in str(gate.error(7)) and "stops here" in str(gate.error(7))


# -- with Ray: a Checkpointer, its holder's slots and its controller in this process ------------------------------


def _config(tmp_path, name, **kw):
    return cf_ray.CheckpointConfig(
        storage_path=str(tmp_path),
        run_name=name,
        register_with_ray=False,
        final_model=None,
        preemption=False,
        **{"policy": cf_ray.FixedInterval(every=5), **kw},
    )


def _flip_in_slot(ck, step: int, section: str, entry_name: str, where: str) -> int:
    """Flip one bit of ``entry_name`` in the holder's slot of ``step`` (through the memfd, as a stray
    write or a bad DIMM would); returns the byte's offset in the section."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    at = ray.get(ck.holder.get_section.remote(ck.generation, step, section, node), timeout=60)
    desc = at.where
    assert isinstance(desc, SlotDesc), desc  # in place: this node's holder's slot
    _, entries = parse_index(at.index, "test")
    e = next(e for e in entries if e.name.endswith(entry_name))
    at = e.offset + (e.nbytes // 2 + 5 if where == "middle" else 1)
    fd = os.open(desc.path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, shm.HEADER_BYTES + at)
        os.pwrite(fd, bytes([byte[0] ^ 0x08]), shm.HEADER_BYTES + at)
    finally:
        os.close(fd)
    return at


@pytest.mark.slow
def test_a_bit_flipped_in_a_held_slot_is_refused_and_the_intact_copy_on_storage_restores_bitwise(
    ray_cluster, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="cf_ray")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Linear(512, 512))  # a 1 MiB weight
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ck = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=_config(tmp_path, "flip"))
    ck.restore()
    for _ in range(5):
        model(torch.randn(2, 16)).sum().backward()
        ck.step(opt)
        opt.zero_grad()
    ck.wait()  # step 5 is held in memory and committed, intact, on storage
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    at = _flip_in_slot(ck, 5, SHARED, "1.weight", "middle")  # no fingerprint window samples it
    ck.close()  # the worker dies; a new one restores

    for attempt in (1, 2):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Linear(512, 512))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        ck = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=_config(tmp_path, "flip"))
        resume = ck.restore()
        assert (resume.source, resume.step) == ("storage", 5), resume
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        if attempt == 1:
            (copy,) = resume.refused_copies
            assert (copy["section"], copy["how"], copy["blocks"]) == (SHARED, "in_place", [at // BLOCK_BYTES])
            assert resume.fallbacks[0]["distrust"] == "integrity"
            assert f"refused section shared of step 5 from {copy['holder']} (in_place): section shared" in caplog.text
        else:  # a later attempt is not offered the snapshot that failed (the holder still has it)
            assert resume.refused_copies == [] and resume.fallbacks == []
        ck.close()
    events = [e["event"] for e in ck.events()]
    assert events.count("integrity_failure") == 1 and events.count("distrusted") == 1


def _spiky_loop(ck, model, opt, upto: int, *, spike_at: int, blow: float, memo: dict) -> None:
    """A loop with its own guard: at ``spike_at`` an update blows a weight up; the next step's loss is
    not finite and the loop puts back the weights it kept in memory (``memo``, not checkpointed). So
    the snapshot of ``spike_at`` holds a transient state, which only this run could repair."""
    while (ck.step_count if ck is not None else memo.setdefault("step", 0)) < upto:
        step = (ck.step_count if ck is not None else memo["step"]) + 1
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        finite = bool(torch.isfinite(loss))
        if finite:
            loss.backward()
        with ck.update(loss=loss) if ck is not None else _Nothing():
            if finite:
                memo["good"] = [p.detach().clone() for p in model.parameters()]
                opt.step()
                if step == spike_at:
                    with torch.no_grad():
                        model.weight[0, 0] = blow
            elif memo.get("good") is not None:
                with torch.no_grad():
                    for p, good in zip(model.parameters(), memo["good"]):
                        p.copy_(good)
        opt.zero_grad()
        if ck is None:
            memo["step"] = step


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("blow", [1e30, float("inf")], ids=["huge_loss_goes_inf", "inf_in_the_state"])
def test_a_restore_that_goes_non_finite_rolls_back_once_and_ends_bitwise(ray_cluster, tmp_path, blow):
    """Step 15's snapshot holds a weight blown up by an update that the loop repaired at step 16 from
    weights it kept in memory. A worker that dies at 17 and restores 15 cannot repair it: with a huge
    weight the first step's loss is infinite (the trust gate: every rank raises, the next attempt goes
    back to step 10 from storage); with inf in the state the restore itself refuses it and goes back
    to step 10 in place. Either way the run ends bitwise equal to an uninterrupted one."""
    ref_model, ref_opt = _linear()
    _spiky_loop(None, ref_model, ref_opt, 22, spike_at=15, blow=blow, memo={})

    name = "spiky" if blow == 1e30 else "spiky_inf"
    model, opt = _linear()
    ck = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=_config(tmp_path, name))
    ck.restore()
    memo: dict = {}
    _spiky_loop(ck, model, opt, 12, spike_at=15, blow=blow, memo=memo)
    # Step 10 committed before 15 is taken: on a loaded machine the writer, still on step 5, would
    # otherwise let 15 supersede 10 (never written), and the rollback would rightly go back to 5.
    ck.wait()
    _spiky_loop(ck, model, opt, 17, spike_at=15, blow=blow, memo=memo)
    ck.wait()  # 10 and 15 committed; 15 is held in memory too
    ck.close()  # the worker dies at 17

    model, opt = _linear()
    ck = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=_config(tmp_path, name))
    resume = ck.restore()
    if blow == 1e30:
        assert (resume.source, resume.step) == ("memory", 15)
        with pytest.raises(NonFiniteAfterRestore, match="went non-finite.*at step 16, 1 step.*restoring step 15"):
            _spiky_loop(ck, model, opt, 22, spike_at=15, blow=blow, memo={})
        ck.close()  # Ray Train starts the next attempt
        model, opt = _linear()
        ck = cf_ray.Checkpointer({"model": model, "optimizer": opt}, config=_config(tmp_path, name))
        resume = ck.restore()
    # Back to step 10, older than the suspect: from the holder's memory when it still holds it (the
    # controller offers it: step 15 is distrusted everywhere), else from storage.
    assert (resume.step, resume.rolled_back_from) == (10, 15) and resume.source in ("memory", "storage"), resume
    _spiky_loop(ck, model, opt, 22, spike_at=15, blow=blow, memo={})
    events = ck.events()
    summary = ck.finish()
    assert torch.equal(model.weight, ref_model.weight) and torch.equal(model.bias, ref_model.bias)
    (rollback,) = summary.rollbacks
    assert rollback["suspect_step"] == 15 and not rollback["stopped"]
    (distrusted,) = [e for e in events if e["event"] == "distrusted"]
    assert (distrusted["step"], distrusted["generation"]) == (15, 1) and distrusted["reason"].startswith("non_finite")
    # The suspect checkpoint was quarantined, with the reason; the replay's step 15 (a later
    # generation) is a checkpoint of its own, which replaced it on storage and is not quarantined.
    (quarantined,) = [e for e in events if e["event"] == "quarantined"]
    assert (quarantined["step"], quarantined["generation"]) == (15, 1) and quarantined["error"].startswith("non_finite")
    assert 15 not in quarantined_checkpoints(str(tmp_path / name))
    assert 15 in [c.step for c in cf_ray.list_checkpoints(str(tmp_path / name))]


def test_bytes_changed_in_memory_after_their_checksums_are_never_written(tmp_path):
    """The holder's write checks the bytes against the block checksums the worker took as it copied
    them: the index is written with them, and bytes that changed since are refused."""
    from cf_ray._engine.storage.fs import FsStorage

    buf, index, blocks = _section_bytes()
    storage = FsStorage.from_uri(str(tmp_path))
    files = write_section(storage, "step_1", 1, "s", buf, index)
    written = storage.read_file(f"step_1/{section_files(1, 's')[1]}")
    assert parse_index_blocks(written, "written")[2] == blocks and files
    changed = buf.copy()
    changed[-1] ^= 1
    with pytest.raises(BlockMismatchError, match="changed in memory after they were checksummed"):
        write_section(storage, "step_2", 1, "s", changed, index)
