"""The holder's side of the direct transfer (``memory/wire.py`` has the protocol and the reader): a
listening socket on the node's address, a bounded pool of serving threads, and one-use offers.

An offer (:meth:`SectionServer.offer`) reserves a section for one reader: a fresh random token
(``secrets.token_bytes``) names it, and the Ray call that made it hands the token to that reader
alone. It is served once (the token is consumed when the request names it), or dropped unserved
after :data:`TICKET_TTL_S`; while it lives, the shared lock its ``release`` gives back keeps the slot
from being filled again. Who asks for an unknown, used or expired token gets "none" and nothing else.

Threads: one accepts; at most :data:`SERVE_THREADS` serve, each one connection at a time; at most
:data:`QUEUED_CONNECTIONS` more wait for a thread (past that a connection is closed at once). A
connection has :data:`~cf_ray._engine.memory.wire.REQUEST_TIMEOUT_S` to present its request (and
finish its TLS handshake). The bytes go in chunks (``sendfile`` from the slot's file; from a mapping
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
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cf_ray._engine.memory import wire
from cf_ray._engine.protocol.messages import StreamDesc
from cf_ray.errors import CfRayError

logger = logging.getLogger("cf_ray")

#: Seconds an offered section stays reserved for its reader (the slot's lock held) before it is dropped.
TICKET_TTL_S = 60.0
#: Connections served at once.
SERVE_THREADS = 8
#: Connections waiting for a serving thread at most; more are closed at once.
QUEUED_CONNECTIONS = 64


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
        while not self._closed:
            self._drop_expired()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._queued.acquire(blocking=False):
                conn.close()  # too many waiting: the reader sees the connection close and gives up
                continue
            try:
                self._pool.submit(self._serve, conn)
            except RuntimeError:  # the pool is shut down
                self._queued.release()
                conn.close()
                return

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        try:
            conn.settimeout(wire.REQUEST_TIMEOUT_S)
            deadline = time.monotonic() + wire.REQUEST_TIMEOUT_S
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)  # the handshake, under the timeout
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            magic, token = wire.REQUEST.unpack(wire.recv_exactly(conn, wire.REQUEST.size))
            if magic == wire.MAGIC:
                with self._lock:
                    offer = self._offers.pop(token, None)  # consumed: never served twice
            if offer is None:
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
