"""Direct section transfer between nodes (``node/stream.py``, #12) and how a restore uses the
private buffer it fills: bytes exact, an offer served once, a stream cut short never returned, an
offer nobody fetches released; the optimizer state kept as views of the buffer (no second copy), the
parameters' bytes given back once loaded. The end-to-end use (a replacement node restoring from the
surviving node's memory) is tests/test_multinode.py::test_node_loss_restores_from_a_peer_copy_bitwise."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest
import torch

from cf_ray._engine.format import manifest as mf
from cf_ray._engine.node import shm, stream

from storage_helpers import arena_of

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd_create (Linux)")


@pytest.fixture
def server():
    srv = stream.SectionServer("127.0.0.1")
    yield srv
    srv.close()


def _slot_file(data: np.ndarray) -> int:
    """A file laid out as a slot: a header page, then ``data``."""
    fd = os.memfd_create("test-slot")
    os.ftruncate(fd, shm.HEADER_BYTES + data.nbytes)
    os.pwrite(fd, data.tobytes(), shm.HEADER_BYTES)
    return fd


def test_a_slot_is_streamed_whole_and_each_offer_once(server):
    data = np.random.default_rng(0).integers(0, 256, size=3 * stream.CHUNK_BYTES // 2 + 12345, dtype=np.uint8)
    fd = _slot_file(data)
    released = threading.Event()
    try:
        desc = server.offer(data.nbytes, released.set, fd=fd, offset=shm.HEADER_BYTES)
        got = stream.fetch(desc, 10)
        assert np.array_equal(got, data) and got.flags.writeable
        assert released.wait(5), "the slot's lock is released once the section is sent"
        with pytest.raises(LookupError, match="no longer offers"):
            stream.fetch(desc, 10)
    finally:
        os.close(fd)


def test_a_buffer_is_streamed_and_a_wrong_token_gets_nothing(server):
    data = np.arange(100_000, dtype=np.int64).view(np.uint8)
    desc = server.offer(data.nbytes, lambda: None, buffer=data.data)
    forged = stream.StreamDesc(desc.host, desc.port, bytes(16), desc.ticket, desc.nbytes)
    with pytest.raises(LookupError):
        stream.fetch(forged, 10)
    assert np.array_equal(stream.fetch(desc, 10), data)
    empty = server.offer(0, lambda: None, buffer=memoryview(b""))
    assert stream.fetch(empty, 10).nbytes == 0


def test_a_withdrawn_offer_is_released_at_once_and_gets_nothing(server):
    released = threading.Event()
    desc = server.offer(10, released.set, buffer=memoryview(b"0123456789"))
    assert server.withdraw(desc.ticket) and released.is_set()
    assert not server.withdraw(desc.ticket)
    with pytest.raises(LookupError):
        stream.fetch(desc, 10)


def test_a_stream_cut_short_is_never_returned(server):
    data = np.ones(1 << 20, dtype=np.uint8)
    fd = _slot_file(data)
    try:
        # The offer says more bytes than the file has: the holder's send ends early.
        desc = server.offer(2 * data.nbytes, lambda: None, fd=fd, offset=shm.HEADER_BYTES)
        with pytest.raises(ConnectionError, match="ended after"):
            stream.fetch(desc, 10)
    finally:
        os.close(fd)


def test_an_offer_nobody_fetches_is_released(server, monkeypatch):
    monkeypatch.setattr(stream, "TICKET_TTL_S", 0.2)
    released = threading.Event()
    desc = server.offer(10, released.set, buffer=memoryview(b"0123456789"))
    assert released.wait(5), "an unfetched offer must not hold its slot for ever"
    with pytest.raises(LookupError):
        stream.fetch(desc, 10)


def test_a_reader_that_stops_reading_does_not_hold_the_slot(server, monkeypatch):
    """The holder's send gives up after STALL_TIMEOUT_S without progress and releases the slot's
    lock (a hung reader must not stop the worker's next snapshots for ever)."""
    import socket

    monkeypatch.setattr(stream, "STALL_TIMEOUT_S", 0.5)
    data = np.zeros(256 << 20, dtype=np.uint8)
    fd = _slot_file(np.zeros(1, dtype=np.uint8))
    os.ftruncate(fd, shm.HEADER_BYTES + data.nbytes)
    released = threading.Event()
    try:
        desc = server.offer(data.nbytes, released.set, fd=fd, offset=shm.HEADER_BYTES)
        with socket.create_connection((desc.host, desc.port), timeout=10) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            conn.sendall(stream._REQ.pack(desc.token, desc.ticket))
            assert released.wait(20), "the send to a reader that reads nothing must give up"
    finally:
        os.close(fd)


def test_a_private_section_is_kept_as_views_and_the_parameters_bytes_are_given_back():
    """A section streamed from another node is this process's own memory: the optimizer state is
    kept as views of it (no second copy), and the bytes only the module read (it copied them into its
    parameters) are released once loaded. The same section not private: copies, nothing released."""
    from cf_ray._engine.worker import restore_checks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    tree = {"objects": {"model": model.state_dict(), "optimizer": opt.state_dict()}}
    arena, index = arena_of(tree)
    enc, entries = mf.parse_index(index, "test")

    fresh_model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    fresh_opt = torch.optim.Adam(fresh_model.parameters())
    objs = {"model": fresh_model, "optimizer": fresh_opt}

    buf = shm.private_buffer(arena.nbytes)
    buf[:] = arena
    releasable: list = []
    states = restore_checks.materialize_objects(
        mf.Section(enc, entries, buf, private=True), ("objects",), objs, releasable
    )
    exp_avg = states["optimizer"]["state"][0]["exp_avg"]
    lo, hi = buf.ctypes.data, buf.ctypes.data + buf.nbytes
    assert lo <= exp_avg.data_ptr() < hi, "the optimizer state is a view of the private buffer"
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert sum(b - a for _, a, b in releasable) == model_bytes
    fresh_model.load_state_dict(states["model"])
    fresh_opt.load_state_dict(states["optimizer"])
    released = sum(shm.release(b, a, e) for b, a, e in releasable)
    assert released >= model_bytes - 4 * mmap.PAGESIZE, released
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    # Not private (an object-store or a mapped slot's buffer): the optimizer state is copied, nothing released.
    ro = arena.copy()
    ro.flags.writeable = False
    releasable = []
    states = restore_checks.materialize_objects(mf.Section(enc, entries, ro), ("objects",), objs, releasable)
    exp_avg = states["optimizer"]["state"][0]["exp_avg"]
    assert not (ro.ctypes.data <= exp_avg.data_ptr() < ro.ctypes.data + ro.nbytes) and releasable == []
    exp_avg.add_(1)  # writable, its own memory
    assert torch.equal(torch.from_numpy(arena), torch.from_numpy(ro))


def test_populated_buffers_are_writable_and_zero_sized_ones_work():
    buf = shm.private_buffer(8 << 20)
    assert buf.flags.writeable and buf.nbytes == 8 << 20 and not buf.any()
    assert shm.private_buffer(0).nbytes == 0
    assert shm.release(np.zeros(10, dtype=np.uint8), 0, 10) == 0  # not a private buffer: nothing
