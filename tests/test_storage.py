"""Storage and the commit protocol, on local disk and on a real S3 server (moto, loopback)."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch

import cf_ray
from cf_ray._engine.format.blocks import block_crcs, with_blocks
from cf_ray._engine.format.catalog import list_committed, to_delete
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import MANIFEST, SHARED, section_files, step_dir
from cf_ray._engine.format.sections import load_section, verify_all, write_section_slot
from cf_ray._engine.storage.base import FileInfo, Storage, chunked, safe_relpath
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.errors import ConfigError, CorruptCheckpointError, UnsafePathError

from storage_helpers import arena_of, write_checkpoint


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return FsStorage.from_uri(str(tmp_path / "run" / "cf_ray"))
    fs, bucket = request.getfixturevalue("s3_bucket")
    return FsStorage(fs, f"{bucket}/run/cf_ray")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))


def _weights_equal(a: dict, b: torch.nn.Module) -> bool:
    return all(torch.equal(a[k], v) for k, v in b.state_dict().items())


class MemStorage(Storage):
    """A backend of the six abstract methods only, in memory: every other ability is the base
    class's default."""

    def __init__(self, files: dict | None = None):
        self.files: dict[str, bytes] = {} if files is None else files

    def write_file(self, path, chunks):
        data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
        self.files[safe_relpath(path)] = data
        return FileInfo(len(data), zlib.crc32(data))

    def read_file(self, path):
        return np.frombuffer(self.files[safe_relpath(path)], dtype=np.uint8).copy()

    def list_dir(self, path):
        prefix = f"{safe_relpath(path)}/" if path else ""
        return sorted({k[len(prefix) :].split("/")[0] for k in self.files if k.startswith(prefix)})

    def exists(self, path):
        rel = safe_relpath(path)
        return rel in self.files or any(k.startswith(f"{rel}/") for k in self.files)

    def delete_dir(self, path):
        rel = safe_relpath(path)
        for k in [k for k in self.files if k.startswith(f"{rel}/")]:
            del self.files[k]

    def uri(self, path=""):
        return f"mem://{path}"

    @classmethod
    def from_uri(cls, uri, filesystem=None):
        return cls(filesystem)


def test_fs_storage_and_a_faulty_storage_satisfy_the_contract(storage):
    class Faulty(Storage):
        """Fails every write: what a test double for a broken bucket looks like."""

        def write_file(self, path, chunks):
            raise OSError("disk on fire")

        def uri(self, path=""):
            return f"faulty://{path}"

        read_file = list_dir = exists = delete_dir = FsStorage.read_file

    assert isinstance(storage, Storage) and storage.ranged_reads
    assert isinstance(Faulty(), Storage) and not Faulty.ranged_reads
    with pytest.raises(OSError):
        Faulty().write_file("x", [b""])
    with pytest.raises(ConfigError, match="not writable"):
        Faulty().check_writable()


def test_a_backend_of_six_methods_has_every_ability_by_default():
    mem = MemStorage()
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    crc = zlib.crc32(data)
    info, copied = mem.write_buffer("a/data.bin", memoryview(data), crc)
    assert info == FileInfo(data.nbytes, crc) and copied == data.nbytes
    info, _ = mem.write_buffer("a/other.bin", memoryview(data), crc ^ 1)
    assert info.crc32 == crc  # the CRC-32 of what was written, for the caller to compare with its own
    assert np.array_equal(mem.read_range("a/data.bin", 99_000, 5_000), data[99_000:])
    assert mem.read_range("a/data.bin", 5, 0).nbytes == 0
    assert b"".join(bytes(c) for c in mem.read_chunks("a/data.bin", 4096)) == data.tobytes()
    assert mem.file_size("a/data.bin") == data.nbytes and mem.file_size("a/none") is None
    assert not mem.is_symlink("a/data.bin")
    with pytest.raises(UnsafePathError):
        mem.is_symlink("../x")
    assert mem.pyarrow_location("a") is None
    mem.check_writable()
    assert mem.list_dir("") == ["a"]  # the probe is gone
    # A child storage: every path under its prefix, every ability the parent's.
    run = mem.child("run/cf_ray")
    run.write_file("x/y.bin", [b"abc"])
    assert mem.files["run/cf_ray/x/y.bin"] == b"abc" and run.list_dir("x") == ["y.bin"]
    assert run.uri("x") == "mem://run/cf_ray/x" and run.child("x").read_file("y.bin").tobytes() == b"abc"
    assert not run.ranged_reads and run.file_size("x/y.bin") == 3
    with pytest.raises(UnsafePathError):
        run.delete_dir("")
    back = pickle.loads(pickle.dumps(run))  # what an actor is handed
    assert back.uri() == run.uri() and back.read_file("x/y.bin").tobytes() == b"abc"
    assert mem.child("run").child("cf_ray") == run


def test_a_checkpoint_on_a_backend_of_six_methods_is_written_listed_and_read_back():
    """The format asks a backend for nothing beyond the contract: a section written from a slot
    buffer, committed, listed and read back (ranged reads asked for: whole files instead)."""
    mem = MemStorage()
    model = _model(3)
    write_checkpoint(mem, 10, model)
    assert [c.step for c in list_committed(mem)] == [10]
    m = read_manifest(mem, step_dir(10))
    sec = load_section(mem, step_dir(10), m, SHARED, ranged=True)
    assert isinstance(sec.buf, np.ndarray)  # no RangedData without ranged reads
    verify_all(mem, step_dir(10), m)
    arena, index = arena_of({"objects": {"model": model.state_dict()}})
    crc = zlib.crc32(arena)
    files, copied = write_section_slot(
        mem, step_dir(20), 1, SHARED, memoryview(arena), with_blocks(index, block_crcs(arena)), crc
    )
    assert copied == arena.nbytes and files[section_files(1, SHARED)[0]] == FileInfo(arena.nbytes, crc)
    with pytest.raises(CorruptCheckpointError, match="changed in memory"):
        write_section_slot(mem, step_dir(30), 1, SHARED, memoryview(arena), index, crc ^ 1)


def test_every_location_is_opened_by_the_backend_its_scheme_names(tmp_path, monkeypatch):
    from cf_ray._engine.storage import backends

    local = backends.open_storage(str(tmp_path / "run"))
    assert isinstance(local, FsStorage) and local.root == str(tmp_path / "run")
    assert backends.open_storage(f"file://{tmp_path}/run") == local
    with pytest.raises(ConfigError, match="no storage backend for nope://"):
        backends.open_storage("nope://bucket/x")
    # A new backend: its class and one line in the table.
    monkeypatch.setitem(backends.BACKENDS, "mem", f"{__name__}:MemStorage")
    files: dict = {}
    mem = backends.open_storage("mem://anything", files)
    assert isinstance(mem, MemStorage)
    mem.child("run/cf_ray").write_file("f", [b"x"])
    assert files == {"run/cf_ray/f": b"x"}


@pytest.mark.parametrize("nbytes", [3_000_001, 100_001], ids=["checksummed-on-a-thread", "checksummed-inline"])
def test_write_read_roundtrip_with_checksum(storage, nbytes):
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    info = storage.write_file("a/b/data.bin", [data[:1000], data[1000:]])
    assert info == FileInfo(data.nbytes, zlib.crc32(data))
    assert np.array_equal(storage.read_file("a/b/data.bin"), data)
    assert storage.list_dir("a/b") == ["data.bin"]  # no temporary files left behind
    storage.delete_dir("a")
    assert not storage.exists("a/b/data.bin")


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\b", "s3://b/x"])
def test_paths_that_leave_the_root_are_refused(bad):
    with pytest.raises(UnsafePathError):
        safe_relpath(bad)


def test_symlink_out_of_the_root_is_refused(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path / "root"))
    storage.write_file("ok.txt", [b"x"])
    (tmp_path / "secret.txt").write_text("secret")
    os.symlink(tmp_path / "secret.txt", tmp_path / "root" / "link.txt")
    os.symlink(tmp_path, tmp_path / "root" / "dirlink")
    with pytest.raises(UnsafePathError):
        storage.read_file("link.txt")
    with pytest.raises(UnsafePathError):
        storage.read_file("dirlink/secret.txt")


def test_commit_makes_a_checkpoint_visible_and_loadable(storage):
    model = _model(1)
    write_checkpoint(storage, 10, model)
    assert [c.step for c in list_committed(storage)] == [10]
    got = cf_ray.load_state(
        storage.uri() if storage.fs.type_name == "local" else storage.root,
        objects=["model"],
        filesystem=None if storage.fs.type_name == "local" else storage.fs,
    )
    assert _weights_equal(got["model"], model)


def test_flipped_byte_and_truncated_file_are_detected_before_parsing(storage):
    write_checkpoint(storage, 10, _model(1))
    m20 = write_checkpoint(storage, 20, _model(2))
    m30 = write_checkpoint(storage, 30, _model(3))
    # Flip one byte of step 30's data, truncate step 20's index.
    d30, d20 = step_dir(30), step_dir(20)
    name30 = m30.sections[SHARED]["data"]
    buf = storage.read_file(f"{d30}/{name30}")
    buf[len(buf) // 2] ^= 0x01
    storage.write_file(f"{d30}/{name30}", [buf])
    name20 = m20.sections[SHARED]["index"]
    idx = storage.read_file(f"{d20}/{name20}")
    storage.write_file(f"{d20}/{name20}", [idx[: len(idx) // 2]])
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load_section(storage, d30, m30, SHARED)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_section(storage, d20, m20, SHARED)
    with pytest.raises(CorruptCheckpointError):
        verify_all(storage, d30, m30)


_WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    from cf_ray._engine.storage.fs import FsStorage
    from cf_ray._engine.format.layout import SHARED, step_dir
    from cf_ray._engine.format.sections import write_section
    from storage_helpers import arena_of
    storage = FsStorage.from_uri({root!r})
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    arena, index = arena_of({{"objects": {{"model": model.state_dict()}}}})
    write_section(storage, step_dir(20), 1, SHARED, arena, index)
    os.kill(os.getpid(), signal.SIGKILL)  # dies between the data files and the manifest
""")


def test_writer_killed_between_data_and_manifest_leaves_only_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "run" / "cf_ray")
    storage = FsStorage.from_uri(root)
    first = _model(1)
    write_checkpoint(storage, 10, first)
    proc = subprocess.run([sys.executable, "-c", _WRITER.format(tests=os.path.dirname(__file__), root=root)])
    assert proc.returncode == -9
    assert storage.list_dir(step_dir(20))  # the half-written data is there ...
    assert [c.step for c in list_committed(storage)] == [10]  # ... and invisible to readers
    assert _weights_equal(cf_ray.load_state(root, objects=["model"])["model"], first)
    # The next save of that step succeeds and is the one readers load.
    second = _model(2)
    write_checkpoint(storage, 20, second)
    assert [c.step for c in list_committed(storage)] == [10, 20]
    assert _weights_equal(cf_ray.load_state(root, objects=["model"])["model"], second)


def test_a_pickle_payload_is_never_executed(tmp_path):
    root = tmp_path / "run" / "cf_ray"
    storage = FsStorage.from_uri(str(root))
    m = write_checkpoint(storage, 10, _model(1))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Exploit())
    directory = step_dir(10)
    # An attacker who can write the files can also rewrite the manifest's sizes and checksums.
    for name in (m.sections[SHARED]["index"], m.sections[SHARED]["data"]):
        m.files[name] = storage.write_file(f"{directory}/{name}", [payload])
    storage.write_file(f"{directory}/{MANIFEST}", [m.to_bytes()])
    with pytest.raises(CorruptCheckpointError):
        cf_ray.load_state(str(root))
    # A torch.save file handed to cf_ray is not a checkpoint either.
    (tmp_path / "model.pt").write_bytes(payload)
    with pytest.raises(cf_ray.CheckpointNotFoundError):
        cf_ray.load_state(str(tmp_path))
    assert not marker.exists()


def test_manifest_naming_files_outside_the_checkpoint_is_refused(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path / "run" / "cf_ray"))
    m = write_checkpoint(storage, 10, _model(1))
    raw = m.to_bytes().decode().replace(m.sections[SHARED]["data"], "../../../../etc/passwd")
    storage.write_file(f"{step_dir(10)}/{MANIFEST}", [raw.encode()])
    with pytest.raises(UnsafePathError):
        read_manifest(storage, step_dir(10))


def test_load_chosen_entries_from_a_chosen_checkpoint(tmp_path):
    root = str(tmp_path / "run" / "cf_ray")
    storage = FsStorage.from_uri(root)
    models = {step: _model(step) for step in (5, 10, 15)}
    for step, model in models.items():
        write_checkpoint(storage, step, model)
    got = cf_ray.load_state(root, step=10, objects=["model"], keys=["0.weight"])
    assert list(got["model"]) == ["0.weight"]
    assert torch.equal(got["model"]["0.weight"], models[10].state_dict()["0.weight"])
    target = _model(99)
    assert cf_ray.load_into(root, {"model": target}, step=5)
    assert _weights_equal(target.state_dict(), models[5])
    assert cf_ray.load_into(root, {"model": target}, step=7) is False  # Caffe2's contract: False, not a crash
    with pytest.raises(cf_ray.CheckpointNotFoundError):
        cf_ray.load_state(root, step=7)
    assert [c.step for c in cf_ray.list_checkpoints(root)] == [5, 10, 15]


def test_keep_last_and_milestones_under_many_saves():
    rng = random.Random(0)
    committed: list[tuple[int, bool]] = []
    for step in range(1, 500):
        committed.append((step, rng.random() < 0.05))
        doomed = set(to_delete(committed, keep_last=3))
        committed = [(s, m) for s, m in committed if s not in doomed]
        assert max(s for s, _ in committed) == step  # the newest committed one always exists
        ordinary = [s for s, m in committed if not m]
        assert len(ordinary) <= 3 and ordinary == sorted(ordinary)[-3:]
    milestones = [s for s, m in committed if m]
    assert milestones and all(s in dict(committed) for s in milestones)


def test_large_local_writes_go_direct_and_stay_exact(tmp_path, monkeypatch):
    """Files of one chunk or more are written with O_DIRECT from an aligned bounce buffer (where the
    file system takes it); whatever the chunking of the stream, the bytes and the CRC are exact."""
    from cf_ray._engine.storage import direct_io as dio
    from cf_ray._engine.storage.base import chunked

    chunk = 64 * 1024
    from cf_ray._engine import env as _env

    monkeypatch.setattr(_env, "WRITE_CHUNK_BYTES", chunk)
    s = FsStorage.from_uri(str(tmp_path / "root"))
    rng = np.random.default_rng(0)
    for n in (0, 1, 4096, chunk - 1, chunk, chunk + 1, 3 * chunk + 4097):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        info = s.write_file(f"d/f{n}", chunked(data, 7777))
        assert (info.size, info.crc32) == (n, zlib.crc32(data))
        assert np.array_equal(s.read_file(f"d/f{n}"), data)
    fd = os.open(tmp_path / "raw", os.O_WRONLY | os.O_CREAT)
    w = dio.DirectWriter(fd)
    data = rng.integers(0, 256, 2 * chunk + 10, dtype=np.uint8)
    w.write(memoryview(data))
    assert w.direct or os.fstat(fd).st_dev in dio._direct_refused  # used, or refused by this file system
    w.close()
    assert not w.direct  # the tail went through the page cache
    os.close(fd)
    assert (tmp_path / "raw").read_bytes() == data.tobytes()


def test_a_range_read_returns_exactly_those_bytes(storage):
    payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    storage.write_file("d/f.bin", chunked(payload))
    for offset, n in ((0, 10), (1 << 20, 5000), ((3 << 20) - 7, 7), ((3 << 20) - 7, 100), (5, 0)):
        got = storage.read_range("d/f.bin", offset, n)
        assert np.array_equal(got, payload[offset : offset + n])  # shorter at the end of the file


def test_a_write_whose_checksum_thread_dies_fails_and_never_hangs(monkeypatch):
    """The O_DIRECT writer hands chunks to a CRC-32 thread through a bounded queue; when
    that thread fails, the write fails with its error (no file with a made-up checksum) instead of
    waiting for ever on the full queue."""
    import threading

    from cf_ray._engine.storage import direct_io

    calls = []

    def failing_crc(mv, crc=0):
        calls.append(mv.nbytes)
        if len(calls) == 2:
            raise MemoryError("the checksum thread's allocation failed")
        return 0

    monkeypatch.setattr(direct_io, "_crc32", failing_crc)
    # Many more than the queue holds, and more bytes than a write checksummed inline (2 MiB).
    chunks = [memoryview(bytes(32 * 1024))] * 64
    written = []
    outcome: dict = {}

    def write():
        try:
            direct_io.write_with_crc(chunks, written.append)
        except BaseException as e:  # noqa: BLE001 - what the test looks at
            outcome["error"] = e

    t = threading.Thread(target=write, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "the write hung on its dead checksum thread"
    assert isinstance(outcome.get("error"), OSError) and "CRC-32" in str(outcome["error"]), outcome
    assert isinstance(outcome["error"].__cause__, MemoryError)
    assert len(written) < len(chunks)  # it stopped writing


def test_directories_made_for_a_file_are_made_durable(tmp_path, monkeypatch):
    """A new file's directory is fsynced after its rename, and so is the parent of every
    directory made on the way (a new directory's entry lives in its parent)."""
    real_fsync = os.fsync
    synced: list[str] = []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    storage = FsStorage.from_uri(str(tmp_path / "root"))
    storage.write_file("checkpoints/step_1/data.bin", [b"abc"])
    root = str(tmp_path)
    dirs = {p for p in synced if os.path.isdir(p)}
    assert {root, f"{root}/root", f"{root}/root/checkpoints", f"{root}/root/checkpoints/step_1"} <= dirs, synced
    synced.clear()
    storage.write_file("checkpoints/step_1/more.bin", [b"d"])  # nothing new made: its directory only
    assert {p for p in synced if os.path.isdir(p)} == {f"{root}/root/checkpoints/step_1"}, synced
