"""The holder's side of the direct transfer (``memory/wire.py`` has the protocol and the reader): a
listening socket on the node's address, a bounded pool of serving threads, and one-use offers.

An offer (:meth:`SectionServer.offer`) reserves a section for one reader: a fresh random token
(``secrets.token_bytes``) names it, and the Ray call that made it hands the token to that reader
alone. It is served once (the token is consumed when the request names it), or dropped unserved
after :data:`TICKET_TTL_S`; while it lives, the shared lock its ``release`` gives back keeps the slot
from being filled again. Who asks for an unknown, used or expired token gets "none" and nothing else.

Threads: one accepts connections and reads their requests, all of them at once without blocking
(``selectors``); at most :data:`SERVE_THREADS` serve, each one connection at a time; at most
:data:`QUEUED_CONNECTIONS` more that presented a request wait for a thread (past that a connection
is closed at once). A connection has :data:`~cf_ray._engine.memory.wire.REQUEST_TIMEOUT_S` from
its accept to present its request (and finish its TLS handshake), else it is closed; one that has
not yet is a *waiting* connection, of which a peer address may have :data:`PEER_WAITING` and all
together :data:`WAITING_CONNECTIONS` (more are closed at once). So connections that never send a
token hold no serving thread and no queue place, and a peer that opens many holds only its own
share: a real reader from another node is served as they come. The bytes go in chunks (``sendfile`` from the slot's file; from a mapping
of it under TLS), each of which must make progress within ``STALL_TIMEOUT_S``: no cap on the whole
send, so a section of any size completes on a slow link, and a reader that stops reading releases
the slot.

No Ray and no torch here.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cf_ray._engine import env as _env
from cf_ray._engine.memory import wire
from cf_ray._engine.protocol.messages import StreamDesc
from cf_ray.errors import CfRayError

logger = logging.getLogger("cf_ray")

#: Seconds an offered section stays reserved for its reader (the slot's lock held) before it is dropped.
TICKET_TTL_S = 60.0
#: Connections served at once.
SERVE_THREADS = 8
#: Connections waiting for a serving thread at most (each presented a request); more are closed at once.
QUEUED_CONNECTIONS = 64
#: Connections of one peer address that have not presented their request yet, at most; more are
#: closed at once (a reader sends its request as soon as it connects: a legitimate one waits
#: milliseconds).
PEER_WAITING = 16
#: Connections that have not presented their request yet, all peers together, at most.
WAITING_CONNECTIONS = 256


@dataclass(slots=True)
class _Waiting:
    """A connection accepted that has not presented its request yet."""

    conn: socket.socket
    peer: str
    deadline: float
    got: bytearray = field(default_factory=bytearray)
    handshaken: bool = True


@dataclass(slots=True)
class Offer:
    """A section offered to one reader: ``nbytes`` at ``offset`` of file ``fd``, and what to call once
    it is served or dropped (releases the slot's lock). ``sent`` and ``progress_at`` say how far the
    send got (a caller waiting on the reader watches them)."""

    nbytes: int
    release: Callable[[], None]
    fd: int
    offset: int
    expires: float
    sent: int = 0
    progress_at: float = field(default_factory=time.monotonic)
    state: str = "offered"
    """``offered``, ``sending``, then ``served`` or ``failed`` (or ``dropped``)."""


class SectionServer:
    """Serves offered sections to readers on other nodes (module doc).

    Args:
        host: the node's address to listen on (an ephemeral port).
        tls: a server-side TLS context (``wire.server_context()``), or ``None`` for plain TCP
            (the holder passes one whenever Ray runs with TLS).
    """

    def __init__(self, host: str, tls: ssl.SSLContext | None = None):
        self.host = host
        self._tls = tls
        self._sock = socket.create_server((host, 0), backlog=64)
        self._sock.settimeout(0.5)  # the accept loop also drops expired offers
        self.port = self._sock.getsockname()[1]
        self._offers: dict[bytes, Offer] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=SERVE_THREADS, thread_name_prefix="cf_ray-stream-send")
        self._queued = threading.BoundedSemaphore(SERVE_THREADS + QUEUED_CONNECTIONS)
        self._closed = False
        self._waiting: dict[int, _Waiting] = {}  # fd -> a connection yet to present its request
        self._per_peer: dict[str, int] = {}  # peer address -> its waiting connections
        self.dropped = 0
        """Connections closed without being served: over a bound, or no request in time."""
        self._next_drop_log = 0.0
        threading.Thread(target=self._accept, name="cf_ray-stream", daemon=True).start()

    def offer(self, nbytes: int, release: Callable[[], None], *, fd: int, offset: int) -> tuple[StreamDesc, Offer]:
        """Reserve ``nbytes`` at ``offset`` of file ``fd`` for one reader; ``release`` is called once it
        is served or dropped. Returns what the reader needs and the offer (to watch its progress)."""
        token = secrets.token_bytes(wire.TOKEN_BYTES)
        offer = Offer(nbytes, release, fd, offset, time.monotonic() + TICKET_TTL_S)
        with self._lock:
            self._offers[token] = offer
        desc = StreamDesc(host=self.host, port=self.port, token=token, nbytes=nbytes, tls=self._tls is not None)
        return desc, offer

    def withdraw(self, token: bytes) -> bool:
        """Drop an offer not fetched yet (its reader gave up): its slot's lock is released now."""
        with self._lock:
            offer = self._offers.pop(token, None)
        if offer is not None:
            offer.state = "dropped"
            offer.release()
        return offer is not None

    def pending(self) -> int:
        """Offers not fetched yet."""
        with self._lock:
            return len(self._offers)

    def _drop_expired(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [t for t, o in self._offers.items() if o.expires <= now]
            offers = [self._offers.pop(t) for t in expired]
        for offer in offers:
            logger.warning(
                "cf_ray: an offered section (%d bytes) was not fetched in %.0f s; released", offer.nbytes, TICKET_TTL_S
            )
            offer.state = "dropped"
            offer.release()

    def _accept(self) -> None:
        """The listener's loop: accept, read requests as they come, drop what overstays (module doc)."""
        sel = selectors.DefaultSelector()
        self._sock.setblocking(False)
        sel.register(self._sock, selectors.EVENT_READ)
        try:
            while not self._closed:
                self._drop_expired()
                try:
                    events = sel.select(0.25)
                except (OSError, ValueError):
                    return  # closed
                for key, _ in events:
                    if key.fileobj is self._sock:
                        self._take(sel)
                    else:
                        self._read_request(sel, key.data)
                now = time.monotonic()
                for w in [w for w in self._waiting.values() if w.deadline <= now]:
                    self._drop(sel, w, f"it sent no request within {wire.REQUEST_TIMEOUT_S:.0f} s")
        finally:
            for w in list(self._waiting.values()):
                self._forget(sel, w)
                w.conn.close()
            sel.close()

    def _take(self, sel: selectors.BaseSelector) -> None:
        """Accept the connections that are there; each waits for its request, within the bounds."""
        while True:
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # closed
            peer = str(addr[0])
            if self._per_peer.get(peer, 0) >= PEER_WAITING or len(self._waiting) >= WAITING_CONNECTIONS:
                self._dropped(peer, f"over {PEER_WAITING} connections of one peer waiting to send a request")
                conn.close()
                continue
            conn.setblocking(False)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            w = _Waiting(conn, peer, time.monotonic() + wire.REQUEST_TIMEOUT_S, handshaken=self._tls is None)
            self._waiting[conn.fileno()] = w
            self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            sel.register(conn, selectors.EVENT_READ, w)

    def _read_request(self, sel: selectors.BaseSelector, w: _Waiting) -> None:
        """What of ``w``'s TLS handshake and request has arrived; a whole request goes to a serving
        thread (the offer it names taken, unless no thread or queue place is free)."""
        try:
            if not w.handshaken:
                w.conn.do_handshake()  # pyright: ignore[reportAttributeAccessIssue] - an SSLSocket
                w.handshaken = True
            while len(w.got) < wire.REQUEST.size:
                chunk = w.conn.recv(wire.REQUEST.size - len(w.got))
                if not chunk:
                    raise ConnectionError(f"it closed after {len(w.got)} bytes of its request")
                w.got += chunk
        except ssl.SSLWantWriteError:
            sel.modify(w.conn, selectors.EVENT_WRITE, w)
            return
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            sel.modify(w.conn, selectors.EVENT_READ, w)
            return
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError: a failed handshake
            self._drop(sel, w, f"{type(e).__name__}: {e}")
            return
        self._forget(sel, w)
        if not self._queued.acquire(blocking=False):
            self._dropped(w.peer, "every serving thread and queue place is taken")
            w.conn.close()  # too many waiting for a thread: the reader sees the close; its offer stays
            return
        magic, token = wire.REQUEST.unpack(bytes(w.got))
        offer = None
        if magic == wire.MAGIC:
            with self._lock:
                offer = self._offers.pop(token, None)  # consumed: never served twice
        try:
            self._pool.submit(self._serve, w.conn, offer)
        except RuntimeError:  # the pool is shut down
            self._queued.release()
            w.conn.close()
            if offer is not None:
                offer.state = "dropped"
                offer.release()

    def _forget(self, sel: selectors.BaseSelector, w: _Waiting) -> None:
        if self._waiting.pop(w.conn.fileno(), None) is None:
            return
        left = self._per_peer.get(w.peer, 1) - 1
        if left > 0:
            self._per_peer[w.peer] = left
        else:
            self._per_peer.pop(w.peer, None)
        try:
            sel.unregister(w.conn)
        except (KeyError, ValueError):
            pass

    def _drop(self, sel: selectors.BaseSelector, w: _Waiting, why: str) -> None:
        self._forget(sel, w)
        self._dropped(w.peer, why)  # counted before the peer can see the close
        w.conn.close()

    def _dropped(self, peer: str, why: str) -> None:
        """Count a connection closed unserved; say so at most every ``env.WARN_INTERVAL_S``."""
        self.dropped += 1
        now = time.monotonic()
        if now >= self._next_drop_log:
            self._next_drop_log = now + _env.WARN_INTERVAL_S
            logger.warning(
                "cf_ray: the section server at %s:%d closed a connection from %s unserved: %s (%d so far; "
                "a cf_ray reader sends its request at once, so something else may be connecting to it)",
                self.host,
                self.port,
                peer,
                why,
                self.dropped,
            )

    def _serve(self, conn: socket.socket, offer: Offer | None) -> None:
        """A serving thread: answer a presented request (``offer``: the one its token named)."""
        try:
            conn.setblocking(True)
            if offer is None:
                conn.settimeout(wire.REQUEST_TIMEOUT_S)
                conn.sendall(wire.COUNT.pack(wire.NONE))
                return
            offer.state = "sending"
            conn.settimeout(wire.STALL_TIMEOUT_S)
            conn.sendall(wire.COUNT.pack(offer.nbytes))
            self._send(conn, offer)
            offer.state = "served"
        except (OSError, ValueError) as e:
            if offer is not None:
                offer.state = "failed"
            logger.warning("cf_ray: streaming a section to a reader failed (%s: %s)", type(e).__name__, e)
        finally:
            if offer is not None:
                offer.release()
            conn.close()
            self._queued.release()

    def _send(self, conn: socket.socket, offer: Offer) -> None:
        """Send the offer's bytes chunk by chunk, each within ``STALL_TIMEOUT_S`` (module doc)."""
        stall = wire.STALL_TIMEOUT_S
        if isinstance(conn, ssl.SSLSocket):
            view_map = _map_range(offer.fd, offer.offset, offer.nbytes) if offer.nbytes else None
            try:
                view = memoryview(view_map)[_lead(offer.offset) :] if view_map is not None else memoryview(b"")
                conn.settimeout(stall)  # per send() call of one chunk
                while offer.sent < offer.nbytes:
                    n = conn.send(view[offer.sent : offer.sent + min(wire.CHUNK_BYTES, offer.nbytes - offer.sent)])
                    offer.sent += n
                    offer.progress_at = time.monotonic()
                view.release()
            finally:
                if view_map is not None:
                    view_map.close()
            return
        conn.setblocking(False)
        out = conn.fileno()
        while offer.sent < offer.nbytes:
            try:
                n = os.sendfile(
                    out, offer.fd, offer.offset + offer.sent, min(wire.CHUNK_BYTES, offer.nbytes - offer.sent)
                )
            except BlockingIOError:
                wire.wait_writable(conn, stall)
                continue
            if n == 0:
                raise OSError(f"the slot ended after {offer.sent} of {offer.nbytes} bytes")
            offer.sent += n
            offer.progress_at = time.monotonic()

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            offers, self._offers = list(self._offers.values()), {}
        for offer in offers:
            offer.state = "dropped"
            offer.release()
        self._pool.shutdown(wait=False, cancel_futures=True)


class LazyServer:
    """A holder's :class:`SectionServer`, started on first use on ``host()`` (with TLS when Ray runs
    with TLS); ``None`` once it could not start (logged once)."""

    def __init__(self, host: Callable[[], str], holder: str):
        self._host = host
        self._holder = holder
        self._lock = threading.Lock()
        self._server: SectionServer | None = None
        self._failed = False

    def get(self) -> SectionServer | None:
        with self._lock:
            if self._server is None and not self._failed:
                try:
                    tls = wire.server_context() if wire.tls_enabled() else None
                    self._server = SectionServer(self._host(), tls)
                except (OSError, ValueError, CfRayError) as e:
                    self._failed = True
                    logger.warning(
                        "cf_ray: holder %s cannot serve direct transfers (%s); its sections reach no other node "
                        "(no peer copies of them, restores there read storage)",
                        self._holder,
                        e,
                    )
            return self._server

    def started(self) -> SectionServer | None:
        """The server if it is running (never starts it)."""
        return self._server


def _lead(offset: int) -> int:
    return offset % mmap.ALLOCATIONGRANULARITY


def _map_range(fd: int, offset: int, nbytes: int) -> mmap.mmap:
    """``nbytes`` at ``offset`` of file ``fd``, mapped read-only (from the page below ``offset``)."""
    base = offset - _lead(offset)
    return mmap.mmap(fd, _lead(offset) + nbytes, prot=mmap.PROT_READ, offset=base)


__all__ = ["LazyServer", "Offer", "SectionServer"]
