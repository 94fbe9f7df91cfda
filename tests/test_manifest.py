"""The manifest checks itself (a checksum of its own content and a strict schema that binds every
file to its section and generation), listings skip one bad entry instead of failing, and damaged
files raise CorruptCheckpointError, never a bare KeyError or UnicodeDecodeError (#16 item 9). No Ray."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import time

import numpy as np
import pytest
import torch

import cf_ray
from cf_ray._engine.format import layout
from cf_ray._engine.format.blocks import BLOCK_BYTES, RangedData, read_region
from cf_ray._engine.format.catalog import list_committed, list_uncommitted
from cf_ray._engine.format.commit import (
    Manifest,
    _canonical,
    _checksum_of,
    commit,
    read_manifest,
    read_pointer,
    write_pointer,
)
from cf_ray._engine.format.layout import MANIFEST, POINTER, SHARED, VERSION, step_dir
from cf_ray._engine.format.sections import load_section, parse_index
from cf_ray._engine.storage.base import FileInfo
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePathError

from storage_helpers import write_checkpoint


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3))


@pytest.fixture
def storage(tmp_path) -> FsStorage:
    return FsStorage.from_uri(str(tmp_path / "run" / "cf_ray"))


def _raw_manifest(storage, step: int) -> bytes:
    return bytes(storage.read_file(f"{step_dir(step)}/{MANIFEST}"))


def _as_dict(m: Manifest) -> dict:
    return json.loads(m.to_bytes())


def _signed(d: dict) -> bytes:
    """``d`` with a valid checksum of its (possibly invalid) content: a writer's mistake, not damage."""
    d = {k: v for k, v in d.items() if k != "checksum"}
    d["checksum"] = _checksum_of(d)
    return _canonical(d).encode()


def _flip(raw: bytes, bit: int) -> bytes:
    b = bytearray(raw)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


# -- the manifest's own checksum ------------------------------------------------------------------


def test_every_single_bit_flip_of_a_manifest_is_detected(storage):
    write_checkpoint(storage, 10, _model(1), world_size=2)
    raw = _raw_manifest(storage, 10)
    original = Manifest.from_bytes(raw, "test")
    assert b"\n" not in raw and b": " not in raw  # compact: no insignificant whitespace to flip
    t0 = time.perf_counter()
    silently_different, identical = [], 0
    for bit in range(len(raw) * 8):
        try:
            got = Manifest.from_bytes(_flip(raw, bit), "test")
        except CorruptCheckpointError as e:
            assert "test" in str(e)  # names the checkpoint's location
            continue
        if got == original:
            identical += 1
        else:
            silently_different.append(bit)
    assert silently_different == [], [(b // 8, raw[b // 8 : b // 8 + 1]) for b in silently_different]
    assert identical == 0
    assert time.perf_counter() - t0 < 10


def test_a_rank_00000_to_rank_00001_flip_is_refused_and_load_state_does_not_return_rank_1s_data(storage):
    write_checkpoint(storage, 10, _model(1), world_size=2)
    root = storage.root
    assert cf_ray.load_state(root, objects=["data"], rank=0)["data"] == {"rank": 0, "position": 10}
    assert cf_ray.load_state(root, objects=["data"], rank=1)["data"] == {"rank": 1, "position": 1010}
    raw = _raw_manifest(storage, 10)
    at = raw.index(b'"data":"g0001.rank_00000.bin"') + len(b'"data":"g0001.rank_0000')
    damaged = _flip(raw, at * 8)  # '0' (0x30) -> '1' (0x31)
    assert b'"data":"g0001.rank_00001.bin"' in damaged[at - 30 : at + 10]
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        Manifest.from_bytes(damaged, "test")
    storage.write_file(f"{step_dir(10)}/{MANIFEST}", [damaged])
    with pytest.raises(CorruptCheckpointError, match=r"MANIFEST\.json.*checksum"):
        cf_ray.load_state(root, objects=["data"], rank=0)


def test_a_version_1_manifest_without_a_checksum_still_reads(storage):
    m = write_checkpoint(storage, 10, _model(1))
    d = _as_dict(m)
    del d["checksum"]
    d["version"] = 1
    v1 = json.dumps(d, indent=1, sort_keys=True).encode()  # exactly what the version-1 writer wrote
    got = Manifest.from_bytes(v1, "test")
    assert got.sections == m.sections and got.files == m.files and got.step == 10 and got.world_size == 1
    storage.write_file(f"{step_dir(10)}/{MANIFEST}", [v1])
    assert [c.step for c in cf_ray.list_checkpoints(storage.root)] == [10]
    assert set(cf_ray.load_state(storage.root, objects=["model"])["model"]) == {"0.weight", "0.bias"}
    # A version-1 manifest that carries a checksum field, or a version-2 one without it, is refused:
    # one cannot pass a damaged version-2 manifest off as an unchecked version-1 one.
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        Manifest.from_bytes(json.dumps(dict(d, checksum=_checksum_of(d))).encode(), "test")
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        Manifest.from_bytes(json.dumps(dict(d, version=2)).encode(), "test")
    assert VERSION == layout.VERSION == 2


def test_the_final_models_manifest_shape_is_accepted(tmp_path):
    try:
        from cf_ray._engine.format.safetensors import write_final_model
    except ImportError:  # pragma: no cover - before the move of write_final_model
        from cf_ray.checkpointer import write_final_model
    storage = FsStorage.from_uri(str(tmp_path / "run" / "cf_ray"))
    model = _model(3)
    directory = step_dir(40, kind="final")
    write_final_model(storage, directory, model, step=40, epoch=2)
    m = read_manifest(storage, directory)
    assert (m.kind, m.world_size, m.sections) == ("final", 1, {"model": {"data": "model.safetensors"}})
    assert [c.step for c in list_committed(storage, kinds=("final",))] == [40]
    got = cf_ray.load_state(storage.uri(directory))["model"]
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    # Any other shape for "final" is refused.
    d = _as_dict(m)
    for bad in (
        {"sections": {"model": {"data": "model.safetensors", "index": "x.json"}}},
        {"sections": {"shared": {"data": "model.safetensors"}}},
        {"world_size": 2},
        {"files": {}},
    ):
        with pytest.raises(CorruptCheckpointError):
            Manifest.from_bytes(_signed({**d, **bad}), "test")


# -- the strict schema ---------------------------------------------------------------------------------


def _mutations(d: dict) -> dict[str, dict]:
    """Manifests with a valid checksum and one schema violation each: field -> manifest."""
    rank0, rank1, shared = (d["sections"][s] for s in ("rank_00000", "rank_00001", "shared"))
    first = next(iter(d["files"]))
    files_without_first = {k: v for k, v in d["files"].items() if k != first}
    return {
        "world_size": {**d, "world_size": 0},
        "world_size ": {**d, "world_size": 3},
        "world_size  ": {**d, "world_size": True},
        "step": {**d, "step": -1},
        "step ": {**d, "step": "10"},
        "step  ": {**d, "step": 10.0},
        "epoch": {**d, "epoch": None},
        "generation": {**d, "generation": -1},
        "generation ": {**d, "generation": 2},  # file names are of generation 1
        "kind": {**d, "kind": "nightly"},
        "replicated": {**d, "replicated": 1},
        "replicated ": {**d, "replicated": False},  # then there may be no shared section
        "milestone": {**d, "milestone": "no"},
        "created_unix": {**d, "created_unix": -5},
        "created_unix ": {**d, "created_unix": "yesterday"},
        "extra": {**d, "extra": []},
        "format": {**d, "format": "torch"},
        "version": {**d, "version": 0},
        "version ": {**d, "version": 99},
        "version  ": {**d, "version": "2"},
        "missing field": {k: v for k, v in d.items() if k != "epoch"},
        "unknown field": {**d, "owner": "someone"},
        "sections": {**d, "sections": {**d["sections"], "rank_00001": rank0, "rank_00000": rank1}},  # swapped
        "sections ": {**d, "sections": {**d["sections"], "shared": rank0, "rank_00000": shared}},
        "sections  ": {**d, "sections": {k: v for k, v in d["sections"].items() if k != "rank_00001"}},
        "sections   ": {**d, "sections": {**d["sections"], "rank_00002": rank1}},
        "sections    ": {**d, "sections": {**d["sections"], "model": rank1}},
        "sections     ": {**d, "sections": {**d["sections"], "rank_00000": {"data": rank0["data"]}}},
        "sections      ": {**d, "sections": []},
        "files": {**d, "files": files_without_first},
        "files ": {**d, "files": {**d["files"], "g0001.extra.bin": {"size": 1, "crc32": 0}}},
        "files  ": {**d, "files": {**d["files"], first: {"size": -1, "crc32": 0}}},
        "files   ": {**d, "files": {**d["files"], first: {"size": 1, "crc32": 2**32}}},
        "files    ": {**d, "files": {**d["files"], first: {"size": 1, "crc32": -1}}},
        "files     ": {**d, "files": {**d["files"], first: {"size": True, "crc32": 0}}},
        "files      ": {**d, "files": {**d["files"], first: {"size": 1}}},
        "files       ": {**d, "files": {**d["files"], first: [1, 2]}},
    }


def test_schema_violations_raise_corrupt_checkpoint_error_naming_the_field_and_the_location(storage):
    d = _as_dict(write_checkpoint(storage, 10, _model(1), world_size=2))
    Manifest.from_bytes(_signed(d), "somewhere/MANIFEST.json")  # the unmodified one is fine
    with pytest.raises(CorruptCheckpointError, match="canonical"):  # every byte counts, whitespace included
        Manifest.from_bytes(json.dumps(json.loads(_signed(d)), indent=1).encode(), "somewhere/MANIFEST.json")
    for label, bad in _mutations(d).items():
        field = label.strip()
        with pytest.raises(CorruptCheckpointError) as info:
            Manifest.from_bytes(_signed(bad), "somewhere/MANIFEST.json")
        msg = str(info.value)
        assert "somewhere/MANIFEST.json" in msg, (label, msg)
        if field not in ("missing field", "unknown field", "version"):
            assert field in msg, (label, msg)


def test_swapped_section_file_names_are_refused_even_with_a_valid_checksum(storage):
    m = write_checkpoint(storage, 10, _model(1), world_size=2)
    swapped = dict(m.sections)
    swapped["rank_00000"], swapped["rank_00001"] = m.sections["rank_00001"], m.sections["rank_00000"]
    bad = Manifest(
        step=m.step,
        epoch=m.epoch,
        world_size=2,
        generation=m.generation,
        replicated=True,
        kind=m.kind,
        sections=swapped,
        files=m.files,
    )
    with pytest.raises(CorruptCheckpointError, match="sections.rank_0000"):
        Manifest.from_bytes(bad.to_bytes(), "test")
    zero = Manifest(
        step=1,
        epoch=0,
        world_size=0,
        generation=1,
        replicated=True,
        sections={"shared": m.sections["shared"]},
        files={},
    )
    with pytest.raises(CorruptCheckpointError, match="world_size"):
        Manifest.from_bytes(zero.to_bytes(), "test")


def test_garbage_never_raises_a_bare_error():
    cases = [
        b"",
        b"\xff\xfe\x00",
        b"[]",
        b"null",
        b"{",
        b"{}",
        b'{"format":"cf_ray"}',
        b'{"format":"cf_ray","version":2}',
        b'{"format":"cf_ray","version":2,"checksum":5}',
        b"[" * 100_000,
        b'{"format":"cf_ray","version":1,"a":1,"a":2}',
        b'{"format":"cf_ray","version":1e400}',
        b'{"format":"cf_ray","version":' + b"9" * 5000 + b"}",
        np.frombuffer(b"{}", dtype=np.uint8),
    ]
    for raw in cases:
        with pytest.raises(CorruptCheckpointError):
            Manifest.from_bytes(raw, "test")


def test_an_unsafe_file_name_is_both_unsafe_and_corrupt(storage):
    m = write_checkpoint(storage, 10, _model(1))
    raw = m.to_bytes().decode().replace(m.sections[SHARED]["data"], "../../../../etc/passwd")
    with pytest.raises(UnsafePathError) as info:
        Manifest.from_bytes(raw.encode(), "test")
    assert isinstance(info.value, CorruptCheckpointError)
    assert pickle.loads(pickle.dumps(info.value)).args == info.value.args  # crosses an actor boundary


def test_a_manifest_in_another_checkpoints_directory_is_refused(storage):
    write_checkpoint(storage, 10, _model(1))
    write_checkpoint(storage, 20, _model(2))
    storage.write_file(f"{step_dir(20)}/{MANIFEST}", [_raw_manifest(storage, 10)])
    with pytest.raises(CorruptCheckpointError, match="step_000000000020"):
        read_manifest(storage, step_dir(20))
    with pytest.raises(CheckpointNotFoundError):
        read_manifest(storage, step_dir(30))


def test_a_full_checkpoint_of_kind_final_is_resumable_in_its_step_directory_and_nowhere_else(storage):
    """``finish()``'s full checkpoint of the final state is of kind ``final``, like the final model: a
    manifest is a final model by its one ``model`` section, never by its kind. A full checkpoint of
    kind ``final`` reads, loads and resumes from ``step_<n>/``; in ``final_<n>/`` it is refused, and
    so is a final model's manifest in ``step_<n>/`` (each reader would misread the other's files)."""
    from cf_ray._engine.format.safetensors import write_final_model
    from cf_ray.load import resumable_checkpoint

    model = _model(1)
    d = _as_dict(write_checkpoint(storage, 10, model))
    storage.write_file(f"{step_dir(10)}/{MANIFEST}", [_signed({**d, "kind": "final"})])
    m = read_manifest(storage, step_dir(10))
    assert (m.kind, m.final_model, sorted(m.sections)) == ("final", False, ["rank_00000", "shared"])
    assert resumable_checkpoint(storage.uri(step_dir(10)))[1] == step_dir(10)
    got = cf_ray.load_state(storage.uri(step_dir(10)))["model"]
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    assert [(c.step, c.kind) for c in cf_ray.list_checkpoints(storage.uri())] == [(10, "final")]
    storage.write_file(f"{step_dir(10, 'final')}/{MANIFEST}", [_raw_manifest(storage, 10)])
    with pytest.raises(CorruptCheckpointError, match="a full checkpoint of kind 'final', but lies in final_0"):
        read_manifest(storage, step_dir(10, "final"))
    write_final_model(storage, step_dir(20, "final"), model, step=20, epoch=0)
    assert read_manifest(storage, step_dir(20, "final")).final_model
    storage.write_file(f"{step_dir(20)}/{MANIFEST}", [bytes(storage.read_file(f"{step_dir(20, 'final')}/{MANIFEST}"))])
    with pytest.raises(CorruptCheckpointError, match="a final model of kind 'final', but lies in step_0"):
        read_manifest(storage, step_dir(20))


def test_kinds_are_the_checkpoint_kinds_of_the_messages():
    from cf_ray._engine.protocol.messages import CheckpointKind

    assert set(layout.KINDS) == {k.value for k in CheckpointKind}


# -- listings skip one bad entry ----------------------------------------------------------------------


def _skipped_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cf_ray" and "skipped" in r.getMessage()]


def test_a_symlinked_entry_under_checkpoints_is_skipped_with_one_warning(tmp_path, caplog):
    root = tmp_path / "run" / "cf_ray"
    storage = FsStorage.from_uri(str(root))
    model = _model(1)
    write_checkpoint(storage, 10, model)
    # A link out of the root that looks like a committed checkpoint, one to a checkpoint inside the
    # root, and a real directory whose manifest is a link.
    outside = FsStorage.from_uri(str(tmp_path / "elsewhere"))
    write_checkpoint(outside, 30, _model(9))
    os.symlink(tmp_path / "elsewhere" / "checkpoints" / "step_000000000030", root / "checkpoints" / "step_000000000030")
    os.symlink(root / "checkpoints" / "step_000000000010", root / "checkpoints" / "step_000000000040")
    os.makedirs(root / "checkpoints" / "step_000000000050")
    os.symlink(
        root / "checkpoints" / "step_000000000010" / MANIFEST,
        root / "checkpoints" / "step_000000000050" / MANIFEST,
    )
    with caplog.at_level(logging.WARNING, logger="cf_ray"):
        assert [c.step for c in list_committed(storage)] == [10]
        assert list_uncommitted(storage) == []  # never deleted through a link either
        assert [c.step for c in list_committed(storage)] == [10]
    warnings = _skipped_warnings(caplog)
    assert len(warnings) == 3, warnings  # one per entry, not one per listing
    for name in ("step_000000000030", "step_000000000040", "step_000000000050"):
        assert sum(name in w for w in warnings) == 1
    # The public readers work around it.
    assert [c.step for c in cf_ray.list_checkpoints(str(root))] == [10]
    got = cf_ray.load_state(str(root), objects=["model"])["model"]
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    # Reading one of them directly is refused, as unsafe and as corrupt.
    for step in (30, 40, 50):
        with pytest.raises(UnsafePathError) as info:
            read_manifest(storage, step_dir(step))
        assert isinstance(info.value, CorruptCheckpointError)


def test_an_entry_that_cannot_be_examined_is_skipped(storage, caplog):
    write_checkpoint(storage, 10, _model(1))
    write_checkpoint(storage, 20, _model(2))

    class Flaky:
        """The real storage, except that one entry cannot be examined."""

        def __getattr__(self, name):
            return getattr(storage, name)

        def exists(self, path):
            if "step_000000000020" in path:
                raise PermissionError(13, "Permission denied", path)
            return storage.exists(path)

    with caplog.at_level(logging.WARNING, logger="cf_ray"):
        assert [c.step for c in list_committed(Flaky())] == [10]
    assert any("step_000000000020" in w and "PermissionError" in w for w in _skipped_warnings(caplog))


# -- other damaged files ---------------------------------------------------------------------------------


def test_every_single_bit_flip_of_a_pointer_is_detected(storage):
    directory = write_pointer(storage, 120)
    raw = bytes(storage.read_file(f"{directory}/{POINTER}"))
    assert read_pointer(raw) == step_dir(120)
    for bit in range(len(raw) * 8):
        try:
            target = read_pointer(_flip(raw, bit))
        except CorruptCheckpointError:
            continue
        assert target == step_dir(120), (bit, _flip(raw, bit))


def test_a_damaged_pointer_raises_corrupt_checkpoint_error():
    good = {"format": "cf_ray-pointer", "version": 1, "checkpoint": "checkpoints/step_000000000120", "step": 120}
    for raw in (
        b"\xff\xfe",
        b"not json",
        b"[1]",
        b"null",
        b"[" * 100_000,
        json.dumps({**good, "checkpoint": 5}).encode(),
        json.dumps({k: v for k, v in good.items() if k != "checkpoint"}).encode(),
        json.dumps({**good, "step": 121}).encode(),
        json.dumps({**good, "step": "120"}).encode(),
        json.dumps({**good, "version": 7}).encode(),
    ):
        with pytest.raises(CorruptCheckpointError):
            read_pointer(raw)
    with pytest.raises(UnsafePathError):
        read_pointer(json.dumps({**good, "checkpoint": "checkpoints/../../etc"}).encode())
    assert read_pointer(json.dumps(good).encode()) == "checkpoints/step_000000000120"


def test_a_damaged_index_raises_corrupt_checkpoint_error():
    entry = {"name": "x", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8, "kind": "torch"}
    for raw in (
        b"\xff\xfe",
        b"{",
        b"[]",
        b"null",
        b'{"tree":{}}',
        b'{"entries":5,"tree":{}}',
        b'{"entries":[]}',
        b'{"entries":[1],"tree":{}}',
        b"[" * 100_000,
        json.dumps({"entries": [{**entry, "shape": [-1, -2]}], "tree": {}}).encode(),
        json.dumps({"entries": [{**entry, "shape": "ab"}], "tree": {}}).encode(),
    ):
        with pytest.raises(CorruptCheckpointError, match="index here"):
            parse_index(raw, "here")
    good = json.dumps({"entries": [entry], "tree": {"t": {"__cf_tensor__": 0}}}).encode()
    tree, entries = parse_index(good, "here")
    assert entries[0].shape == (2,)


def test_a_damaged_data_file_of_a_section_is_refused_before_parsing(storage):
    m = write_checkpoint(storage, 10, _model(1))
    name = m.sections[SHARED]["index"]
    path = f"{step_dir(10)}/{name}"
    os.unlink(storage.fs_path(path))
    os.mkdir(storage.fs_path(path))  # a directory where a file should be
    with pytest.raises(CorruptCheckpointError):
        load_section(storage, step_dir(10), m, SHARED)
    os.rmdir(storage.fs_path(path))
    os.symlink(storage.fs_path(f"{step_dir(10)}/{m.sections[SHARED]['data']}"), storage.fs_path(path))
    with pytest.raises(UnsafePathError) as info:
        load_section(storage, step_dir(10), m, SHARED)
    assert isinstance(info.value, CorruptCheckpointError)
    with pytest.raises(CorruptCheckpointError, match="no section"):
        load_section(storage, step_dir(10), m, "model")
    assert m.files[name] == FileInfo(m.files[name].size, m.files[name].crc32)


def test_extra_with_int_keys_and_non_ascii_text_round_trips():
    m = Manifest(
        step=3,
        epoch=1,
        world_size=1,
        generation=2,
        replicated=False,
        kind="manual",
        sections={"rank_00000": {"data": "g0002.rank_00000.bin", "index": "g0002.rank_00000.json"}},
        files={"g0002.rank_00000.bin": FileInfo(0, 0), "g0002.rank_00000.json": FileInfo(10, 2**32 - 1)},
        created_unix=1.5,
        extra={10: "b", 9: "c", "note": "épreuve ✓", "nan": float("nan")},
    )
    got = Manifest.from_bytes(m.to_bytes(), "test")
    assert got.extra["10"] == "b" and got.extra["9"] == "c" and got.extra["note"] == "épreuve ✓"
    assert (got.sections, got.files, got.created_unix, got.kind) == (m.sections, m.files, 1.5, "manual")


def test_a_ranged_read_checks_every_block_it_touches_and_reads_only_those(storage):
    """A restore at another number of ranks reads sections by range: a damaged block is refused when a
    read touches it (never used), a read that does not touch it is served, and only whole blocks
    around the range are read."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))  # ~2 MiB: 8 blocks
    m = write_checkpoint(storage, 10, model)
    sec = load_section(storage, step_dir(10), m, SHARED, ranged=True)
    assert isinstance(sec.buf, RangedData) and sec.buf.bytes_read == 0
    by_name = {e.name: e for e in sec.entries}
    first = next(e for n, e in by_name.items() if n.endswith("0.weight"))
    last = next(e for n, e in by_name.items() if n.endswith("1.weight"))
    rows = read_region(sec.buf, first, [10, 0], [20, 512])  # 20 rows of 2 KiB: one or two blocks
    assert torch.equal(rows, model[0].weight.detach()[10:30])
    assert sec.buf.bytes_read <= 2 * BLOCK_BYTES
    # Damage one byte inside the second weight: reading it fails, the first weight still reads.
    data_path = storage.fs_path(f"{step_dir(10)}/{m.sections[SHARED]['data']}")
    with open(data_path, "r+b") as f:
        f.seek(last.offset + last.nbytes // 2)
        byte = f.read(1)
        f.seek(last.offset + last.nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    sec = load_section(storage, step_dir(10), m, SHARED, ranged=True)
    assert torch.equal(read_region(sec.buf, first, [0, 0], [512, 512]), model[0].weight.detach())
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        read_region(sec.buf, last, [0, 0], [512, 512])
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):  # a whole read sees it too
        load_section(storage, step_dir(10), m, SHARED)


def test_a_section_without_block_checksums_is_read_whole_and_verified_whole(storage):
    """Checkpoints written before block checksums existed: a ranged load reads the file whole (and
    verifies its CRC-32), so they restore at another number of ranks as before."""
    m = write_checkpoint(storage, 10, _model(1))
    names = m.sections[SHARED]
    index_path = f"{step_dir(10)}/{names['index']}"
    raw = json.loads(bytes(storage.read_file(index_path)))
    assert raw["blocks"]["bytes"] == BLOCK_BYTES and len(raw["blocks"]["crc32"]) >= 1
    del raw["blocks"]
    info = storage.write_file(index_path, [json.dumps(raw).encode()])
    m = dataclasses.replace(m, files={**m.files, names["index"]: info})
    commit(storage, step_dir(10), m)
    sec = load_section(storage, step_dir(10), m, SHARED, ranged=True)
    assert isinstance(sec.buf, np.ndarray) and sec.buf.nbytes == m.files[names["data"]].size
    got = cf_ray.load_state(storage.uri(), objects=["model"])["model"]
    assert all(torch.equal(got[k], v) for k, v in _model(1).state_dict().items())
