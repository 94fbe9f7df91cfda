"""The direct transfer (``memory/wire.py``, ``node/stream.py``; #12, issue 23 #6) and how a restore
uses the private buffer it fills: bytes exact; a fresh token per offer, consumed on use; a stale or
forged token gets nothing; a stream cut short never returned; an offer nobody fetches released; a
connection that never sends its request freed within seconds; a bounded pool of serving threads;
a send that goes on for as long as it makes progress (no cap on the whole), a reader that stops
reading released; TLS with mutual authentication when Ray runs with TLS (a CA made here). Then the
optimizer state kept as views of the buffer (no second copy), the parameters' bytes given back once
loaded. The end-to-end use (a replacement node restoring from the surviving node's memory) is
tests/test_multinode.py::test_node_loss_restores_from_a_peer_copy_bitwise."""

from __future__ import annotations

import datetime
import mmap
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

from cf_ray._engine.format.sections import Section, parse_index
from cf_ray._engine.memory import slots as shm
from cf_ray._engine.memory import wire
from cf_ray._engine.node import stream
from cf_ray._engine.protocol.messages import StreamDesc

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
    if data.nbytes:
        os.pwrite(fd, data.tobytes(), shm.HEADER_BYTES)
    return fd


def test_a_slot_is_streamed_whole_and_each_offer_once_with_a_token_of_its_own(server):
    data = np.random.default_rng(0).integers(0, 256, size=3 * wire.CHUNK_BYTES // 2 + 12345, dtype=np.uint8)
    fd = _slot_file(data)
    released = [threading.Event(), threading.Event()]
    try:
        first, _ = server.offer(data.nbytes, released[0].set, fd=fd, offset=shm.HEADER_BYTES)
        second, _ = server.offer(data.nbytes, released[1].set, fd=fd, offset=shm.HEADER_BYTES)
        assert first.token != second.token and len(first.token) == 16  # random, per offer
        got = wire.fetch(first, 10)
        assert np.array_equal(got, data) and got.flags.writeable
        assert released[0].wait(5) and not released[1].is_set()
        with pytest.raises(LookupError, match="no longer offers"):
            wire.fetch(first, 10)  # consumed: never served twice
        assert np.array_equal(wire.fetch(second, 10), data)
        empty, _ = server.offer(0, lambda: None, fd=fd, offset=shm.HEADER_BYTES)
        assert wire.fetch(empty, 10).nbytes == 0
    finally:
        os.close(fd)


def test_a_forged_or_stale_token_gets_nothing_and_leaves_the_offer(server):
    fd = _slot_file(np.arange(1000, dtype=np.uint8))
    try:
        desc, _ = server.offer(1000, lambda: None, fd=fd, offset=shm.HEADER_BYTES)
        for token in (bytes(16), desc.token[:-1] + bytes([desc.token[-1] ^ 1])):
            with pytest.raises(LookupError):
                wire.fetch(StreamDesc(host=desc.host, port=desc.port, token=token, nbytes=desc.nbytes), 10)
        assert server.pending() == 1  # guessing did not consume it
        assert np.array_equal(wire.fetch(desc, 10), np.arange(1000, dtype=np.uint8))
    finally:
        os.close(fd)


def test_a_withdrawn_offer_is_released_at_once_and_gets_nothing(server):
    fd = _slot_file(np.zeros(10, dtype=np.uint8))
    released = threading.Event()
    try:
        desc, _ = server.offer(10, released.set, fd=fd, offset=shm.HEADER_BYTES)
        assert server.withdraw(desc.token) and released.is_set()
        assert not server.withdraw(desc.token)
        with pytest.raises(LookupError):
            wire.fetch(desc, 10)
    finally:
        os.close(fd)


def test_a_stream_cut_short_is_never_returned(server):
    data = np.ones(1 << 20, dtype=np.uint8)
    fd = _slot_file(data)
    try:
        # The offer says more bytes than the file has: the holder's send ends early.
        desc, watch = server.offer(2 * data.nbytes, lambda: None, fd=fd, offset=shm.HEADER_BYTES)
        with pytest.raises(ConnectionError, match="ended after"):
            wire.fetch(desc, 10)
        assert watch.state == "failed"
    finally:
        os.close(fd)


def test_an_offer_nobody_fetches_is_released(server, monkeypatch):
    monkeypatch.setattr(stream, "TICKET_TTL_S", 0.2)
    fd = _slot_file(np.zeros(10, dtype=np.uint8))
    released = threading.Event()
    try:
        desc, _ = server.offer(10, released.set, fd=fd, offset=shm.HEADER_BYTES)
        assert released.wait(5), "an unfetched offer must not hold its slot for ever"
        with pytest.raises(LookupError):
            wire.fetch(desc, 10)
    finally:
        os.close(fd)


def test_a_connection_that_sends_no_request_is_dropped_and_holds_no_serving_thread(monkeypatch):
    """Each connection has REQUEST_TIMEOUT_S from its accept to present its request, and one that
    has not yet holds no serving thread: with SERVE_THREADS connections idle, a reader is served at
    once (it waited behind them until they timed out); the idle ones are closed in time, and no
    thread is made per connection."""
    monkeypatch.setattr(wire, "REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(stream, "SERVE_THREADS", 2)
    before = threading.active_count()
    srv = stream.SectionServer("127.0.0.1")
    fd = _slot_file(np.arange(100, dtype=np.uint8))
    try:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(2)]
        desc, _ = srv.offer(100, lambda: None, fd=fd, offset=shm.HEADER_BYTES)
        t0 = time.monotonic()
        got = wire.fetch(desc, 10)
        assert time.monotonic() - t0 < 0.4
        assert np.array_equal(got, np.arange(100, dtype=np.uint8))
        t0 = time.monotonic()
        for c in idle:
            assert c.recv(1) == b""  # the server closed them
            c.close()
        assert time.monotonic() - t0 < 5
        assert srv.dropped == 2
        assert (
            threading.active_count() - before <= 2 + 2
        )  # the pool's threads and the listener, no thread per connection
    finally:
        os.close(fd)
        srv.close()


def test_a_peer_holding_connections_open_without_a_request_never_keeps_a_reader_out(monkeypatch):
    """Another address opens far more connections than a holder serves and queues (72) and sends
    nothing: past PEER_WAITING of them each is closed at once, the others after REQUEST_TIMEOUT_S,
    and meanwhile a reader of another node (another address) is served at once, every time (it was
    refused, or waited behind them, and went to storage)."""
    import selectors

    monkeypatch.setattr(wire, "REQUEST_TIMEOUT_S", 3.0)
    srv = stream.SectionServer("0.0.0.0")
    data = np.random.default_rng(3).integers(0, 256, size=1 << 20, dtype=np.uint8)
    fd = _slot_file(data)
    idle = []
    try:
        for _ in range(100):  # from 127.0.0.2: the loopback answers every 127/8 address
            c = socket.socket()
            c.settimeout(10)
            c.bind(("127.0.0.2", 0))
            c.connect(("127.0.0.1", srv.port))
            idle.append(c)
        time.sleep(0.5)
        with selectors.DefaultSelector() as sel:
            for c in idle:
                sel.register(c, selectors.EVENT_READ)
            closed = [key.fileobj for key, _ in sel.select(0)]
        assert len(closed) == len(idle) - stream.PEER_WAITING
        assert all(c.recv(1) == b"" for c in closed)  # type: ignore[union-attr]
        for _ in range(3):  # a reader of another node, meanwhile
            desc, _ = srv.offer(data.nbytes, lambda: None, fd=fd, offset=shm.HEADER_BYTES)
            desc = type(desc)(host="127.0.0.1", port=desc.port, token=desc.token, nbytes=desc.nbytes, tls=desc.tls)
            t0 = time.monotonic()
            assert np.array_equal(wire.fetch(desc, 10), data)
            assert time.monotonic() - t0 < 1.0
        for c in idle:  # the rest, once their time to send a request is over
            if c not in closed:
                assert c.recv(1) == b""
        assert srv.dropped == len(idle)
    finally:
        for c in idle:
            c.close()
        os.close(fd)
        srv.close()


def _throttled_fetch(desc: StreamDesc, dest: memoryview, rate: float) -> None:
    """A reader that takes ``rate`` bytes/s (small receive buffer, sleeps between reads)."""
    raw = socket.create_connection((desc.host, desc.port), timeout=10)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    with raw:
        raw.sendall(wire.REQUEST.pack(wire.MAGIC, desc.token))
        (n,) = wire.COUNT.unpack(wire.recv_exactly(raw, wire.COUNT.size))
        assert n == desc.nbytes
        got, t0 = 0, time.monotonic()
        while got < n:
            k = raw.recv_into(dest[got:], min(1 << 16, n - got))
            assert k, f"the stream ended after {got} of {n}"
            got += k
            ahead = got / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)


def test_a_slow_reader_that_keeps_reading_gets_the_whole_section(server, monkeypatch):
    """Sending takes four times the stall timeout in all, but every chunk makes progress: the whole
    section arrives (no cap on a whole send). ``CF_RAY_TEST_STREAM_BYTES`` raises the size (2 GiB
    once, by hand: ``CF_RAY_TEST_STREAM_BYTES=2147483648``)."""
    nbytes = int(os.environ.get("CF_RAY_TEST_STREAM_BYTES", 24 << 20))
    rate = float(os.environ.get("CF_RAY_TEST_STREAM_RATE", nbytes / 2.0))  # bytes/s: 2 s by default
    monkeypatch.setattr(wire, "STALL_TIMEOUT_S", 0.5)
    data = np.random.default_rng(1).integers(0, 256, size=min(nbytes, 64 << 20), dtype=np.uint8)
    fd = os.memfd_create("big-slot")
    try:
        os.ftruncate(fd, shm.HEADER_BYTES + nbytes)
        for off in range(0, nbytes, data.nbytes):  # the pattern repeated
            os.pwrite(fd, data[: min(data.nbytes, nbytes - off)].tobytes(), shm.HEADER_BYTES + off)
        released = threading.Event()
        desc, watch = server.offer(nbytes, released.set, fd=fd, offset=shm.HEADER_BYTES)
        dest = shm.private_buffer(nbytes)
        t0 = time.monotonic()
        _throttled_fetch(desc, dest.data, rate)
        seconds = time.monotonic() - t0
        assert released.wait(5) and watch.state == "served" and watch.sent == nbytes
        assert seconds > 4 * wire.STALL_TIMEOUT_S, seconds
        for off in range(0, nbytes, data.nbytes):
            n = min(data.nbytes, nbytes - off)
            assert np.array_equal(dest[off : off + n], data[:n])
        print(f"streamed {nbytes / 2**20:.0f} MiB to a reader taking {rate / 2**20:.1f} MiB/s in {seconds:.1f} s")
    finally:
        os.close(fd)


def test_a_reader_that_stops_reading_does_not_hold_the_slot(server, monkeypatch):
    """The holder's send gives up after STALL_TIMEOUT_S without progress and releases the slot's
    lock (a hung reader must not stop the worker's next snapshots for ever)."""
    monkeypatch.setattr(wire, "STALL_TIMEOUT_S", 0.5)
    nbytes = 256 << 20
    fd = _slot_file(np.zeros(1, dtype=np.uint8))
    os.ftruncate(fd, shm.HEADER_BYTES + nbytes)
    released = threading.Event()
    try:
        desc, _ = server.offer(nbytes, released.set, fd=fd, offset=shm.HEADER_BYTES)
        with socket.create_connection((desc.host, desc.port), timeout=10) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
            conn.sendall(wire.REQUEST.pack(wire.MAGIC, desc.token))
            assert released.wait(20), "the send to a reader that reads nothing must give up"
    finally:
        os.close(fd)


def test_a_reader_whose_holder_stalls_gives_up(monkeypatch):
    """The reader's side: no byte for STALL_TIMEOUT_S is a ConnectionError, never a hang."""
    monkeypatch.setattr(wire, "STALL_TIMEOUT_S", 0.5)
    lsock = socket.create_server(("127.0.0.1", 0))

    def holder():
        conn, _ = lsock.accept()
        wire.recv_exactly(conn, wire.REQUEST.size)
        conn.sendall(wire.COUNT.pack(1000) + b"x" * 10)  # then nothing more
        time.sleep(3)
        conn.close()

    threading.Thread(target=holder, daemon=True).start()
    desc = StreamDesc(host="127.0.0.1", port=lsock.getsockname()[1], token=bytes(16), nbytes=1000)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="stalled"):
        wire.fetch(desc, 10)
    assert time.monotonic() - t0 < 2.5
    lsock.close()


# -- TLS ------------------------------------------------------------------------------------------


def _ca_and_certs(tmp_path) -> dict[str, str]:
    """A self-signed CA and two certificates it signs (one per node), as an operator makes for Ray's TLS;
    and a third certificate signed by another CA (an intruder)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def make(cn, issuer_key=None, issuer=None, ca=False):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(issuer or name(cn))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        return key, b.sign(issuer_key or key, hashes.SHA256())

    files = {}

    def save(tag, key, cert):
        files[f"{tag}_key"] = str(tmp_path / f"{tag}.key")
        files[f"{tag}_cert"] = str(tmp_path / f"{tag}.crt")
        with open(files[f"{tag}_key"], "wb") as f:
            f.write(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )
        with open(files[f"{tag}_cert"], "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))

    ca_key, ca = make("cf_ray test CA", ca=True)
    save("ca", ca_key, ca)
    for tag in ("node_a", "node_b"):
        save(tag, *make(tag, ca_key, ca.subject))
    other_key, other = make("another CA", ca=True)
    save("intruder", *make("intruder", other_key, other.subject))
    return files


def _ray_tls(monkeypatch, files, node: str) -> None:
    monkeypatch.setenv("RAY_USE_TLS", "1")
    monkeypatch.setenv("RAY_TLS_SERVER_CERT", files[f"{node}_cert"])
    monkeypatch.setenv("RAY_TLS_SERVER_KEY", files[f"{node}_key"])
    monkeypatch.setenv("RAY_TLS_CA_CERT", files["ca_cert"])


def test_under_ray_tls_the_transfer_is_tls_with_mutual_authentication(tmp_path, monkeypatch):
    """With Ray's TLS variables set, the holder's server speaks TLS with Ray's certificate and the
    reader presents its own: the bytes arrive exact; a plaintext reader gets nothing (no plaintext
    transfer); a reader whose certificate another CA signed is refused; and the offer survives both."""
    files = _ca_and_certs(tmp_path)
    _ray_tls(monkeypatch, files, "node_a")
    assert wire.tls_enabled()
    lazy = stream.LazyServer(lambda: "127.0.0.1", "holder-a")
    srv = lazy.get()
    assert srv is not None
    data = np.random.default_rng(2).integers(0, 256, size=3 * wire.CHUNK_BYTES // 2 + 777, dtype=np.uint8)
    fd = _slot_file(data)
    try:
        desc, _ = srv.offer(data.nbytes, lambda: None, fd=fd, offset=shm.HEADER_BYTES)
        assert desc.tls
        # A plaintext reader: the handshake it never makes fails; it learns nothing.
        with socket.create_connection((desc.host, desc.port), timeout=10) as raw:
            raw.sendall(wire.REQUEST.pack(wire.MAGIC, desc.token))
            try:
                answer = raw.recv(64)
            except ConnectionResetError:
                answer = b""
            assert wire.COUNT.pack(data.nbytes) not in answer and not answer.startswith(wire.COUNT.pack(wire.NONE))
        # A reader with a certificate of another CA: refused in the handshake.
        _ray_tls(monkeypatch, {**files, "ca_cert": files["ca_cert"]}, "intruder")
        with pytest.raises(OSError):
            wire.fetch(desc, 10)
        # The other node, with a certificate of the cluster's CA: the section, exact.
        _ray_tls(monkeypatch, files, "node_b")
        assert np.array_equal(wire.fetch(desc, 10), data)
    finally:
        os.close(fd)
        srv.close()


def test_under_ray_tls_without_its_files_the_server_does_not_start(monkeypatch, caplog):
    monkeypatch.setenv("RAY_USE_TLS", "1")
    monkeypatch.setenv("RAY_TLS_SERVER_CERT", "/nonexistent.crt")
    lazy = stream.LazyServer(lambda: "127.0.0.1", "holder-x")
    assert lazy.get() is None and lazy.get() is None  # never a plaintext server
    assert "RAY_TLS_SERVER_CERT" in caplog.text


# -- the reader's private buffer ----------------------------------------------------------------------


def test_a_private_section_is_kept_as_views_and_the_parameters_bytes_are_given_back():
    """A section streamed from another node is this process's own memory: the optimizer state is
    kept as views of it (no second copy), and the bytes only the module read (it copied them into its
    parameters) are released once loaded. The same section not private: copies, nothing released."""
    from cf_ray._engine.worker.restore import checks as restore_checks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    tree = {"objects": {"model": model.state_dict(), "optimizer": opt.state_dict()}}
    arena, index = arena_of(tree)
    enc, entries = parse_index(index, "test")

    fresh_model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    fresh_opt = torch.optim.Adam(fresh_model.parameters())
    objs = {"model": fresh_model, "optimizer": fresh_opt}

    buf = shm.private_buffer(arena.nbytes)
    buf[:] = arena
    releasable: list = []
    states = restore_checks.materialize_objects(
        Section(enc, entries, buf, private=True), ("objects",), objs, releasable
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

    # Not private (a mapped slot's buffer): the optimizer state is copied, nothing released.
    ro = arena.copy()
    ro.flags.writeable = False
    releasable = []
    states = restore_checks.materialize_objects(Section(enc, entries, ro), ("objects",), objs, releasable)
    exp_avg = states["optimizer"]["state"][0]["exp_avg"]
    assert not (ro.ctypes.data <= exp_avg.data_ptr() < ro.ctypes.data + ro.nbytes) and releasable == []
    exp_avg.add_(1)  # writable, its own memory
    assert torch.equal(torch.from_numpy(arena), torch.from_numpy(ro))


def test_populated_buffers_are_writable_and_zero_sized_ones_work():
    buf = shm.private_buffer(8 << 20)
    assert buf.flags.writeable and buf.nbytes == 8 << 20 and not buf.any()
    assert shm.private_buffer(0).nbytes == 0
    assert shm.release(np.zeros(10, dtype=np.uint8), 0, 10) == 0  # not a private buffer: nothing


def _high_fd(sock: socket.socket, at: int) -> socket.socket:
    """``sock`` moved to descriptor number ``at`` (a busy holder has that many open)."""
    os.dup2(sock.fileno(), at)
    sock.close()
    return socket.socket(fileno=at)


def test_waiting_to_send_works_on_a_descriptor_above_1024():
    """A busy holder's connections get descriptors past 1024, which ``select`` cannot wait on: the
    wait for a reader to take more bytes returns when it can, and gives up after the stall time."""
    a, b = socket.socketpair()
    a = _high_fd(a, 1500)
    try:
        a.setblocking(False)
        wire.wait_writable(a, 1.0)  # an empty buffer: at once
        with pytest.raises(BlockingIOError):
            while True:  # fill what the reader does not take
                a.send(b"x" * 65536)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="took nothing"):
            wire.wait_writable(a, 0.3)
        assert 0.25 < time.monotonic() - t0 < 5
        threading.Timer(0.2, lambda: b.recv(1 << 20)).start()  # the reader takes some
        wire.wait_writable(a, 10)
    finally:
        a.close()
        b.close()


def test_a_section_streams_whole_from_a_holder_whose_descriptors_are_above_1024():
    """The same through the server: its listening socket and every connection it accepts are past
    descriptor 1024, and a reader that takes the bytes slowly makes the send wait for room."""
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        srv = stream.SectionServer("127.0.0.1")
        nbytes = 4 << 20
        data = np.random.default_rng(2).integers(0, 256, size=nbytes, dtype=np.uint8)
        fd = _slot_file(data)
        try:
            released = threading.Event()
            desc, watch = srv.offer(nbytes, released.set, fd=fd, offset=shm.HEADER_BYTES)
            dest = shm.private_buffer(nbytes)
            _throttled_fetch(desc, dest.data, nbytes / 0.5)
            assert released.wait(5) and watch.state == "served", watch.state
            assert np.array_equal(dest, data)
        finally:
            os.close(fd)
            srv.close()
    finally:
        for h in held:
            os.close(h)
