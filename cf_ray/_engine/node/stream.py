"""Direct section transfer between nodes (#12): a holder streams a section it holds to a reader on
another node over one TCP connection, straight from its slot (``sendfile`` from the shared-memory
file: no copy into the object store first, no chunked object transfer), into memory the reader owns.

Why not Ray's object transfer: a restore on a replacement node is dominated by moving the section's
bytes, and through the object store they are copied three times on the host (the holder's ``put``
of the slot, the transfer into the reader node's store, the restore's private copies of the
optimizer state); here they are copied once, by the kernel, into a private buffer whose tensors the
restore keeps (``manifest.Section.private``). Ray's object transfer stays the fallback: a reader
that cannot connect (a firewall, ``CF_RAY_PEER_STREAM=0``) asks the holder for an object instead.

Protocol, one request per connection: the reader sends the offer's 16-byte token and its 8-byte
ticket; the holder answers the byte count (8 bytes, ``2**64 - 1`` when the ticket is unknown or
expired) and the bytes, then closes. A ticket is made by :meth:`SectionServer.offer` (called from
the holder's ``get_section``, a Ray method: only a process that may call the holder learns the token
and a ticket), served once, and dropped unserved after :data:`TICKET_TTL_S`; while it lives, the
holder's shared lock on the slot keeps the slot from being filled again. A reader that gets fewer
bytes than announced raises ``ConnectionError``: a half-sent section is never used.

No Ray and no torch here: the holder imports it (it never imports torch), and so does the restore.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from cf_ray._engine.node import shm as _shm

logger = logging.getLogger("cf_ray")

#: Seconds an offered section stays reserved for its reader (the slot's lock held) before it is dropped.
TICKET_TTL_S = 60.0
#: Seconds a send or a receive may make no progress before the transfer is given up.
STALL_TIMEOUT_S = 30.0
#: Bytes per ``recv_into`` call.
CHUNK_BYTES = 64 * 1024 * 1024
_NONE = 2**64 - 1
_REQ = struct.Struct("<16sQ")
_LEN = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class StreamDesc:
    """Where and how a reader fetches one offered section (what ``get_section`` hands back)."""

    host: str
    port: int
    token: bytes
    ticket: int
    nbytes: int


@dataclass(slots=True)
class _Offer:
    """A section offered to one reader: its bytes as a file (``fd``, ``offset``) or a buffer, and
    what to call once it is served or dropped (releases the slot's lock)."""

    nbytes: int
    release: Callable[[], None]
    fd: int = -1
    offset: int = 0
    buffer: memoryview | None = None
    timer: threading.Timer | None = None


class SectionServer:
    """The holder's side: a listening socket on the node's address and a thread per connection."""

    def __init__(self, host: str):
        self.host = host
        self._sock = socket.create_server((host, 0), backlog=64)
        self.port = self._sock.getsockname()[1]
        self._token = secrets.token_bytes(16)
        self._tickets: dict[int, _Offer] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="cf_ray-stream", daemon=True).start()

    def offer(
        self,
        nbytes: int,
        release: Callable[[], None],
        *,
        fd: int = -1,
        offset: int = 0,
        buffer: memoryview | None = None,
    ) -> StreamDesc:
        """Reserve a section for one reader: ``nbytes`` at ``offset`` of file ``fd`` (``sendfile``),
        or ``buffer``; ``release`` is called once it is served or dropped."""
        offer = _Offer(nbytes, release, fd=fd, offset=offset, buffer=buffer)
        with self._lock:
            ticket = next(self._ids)
            self._tickets[ticket] = offer
        offer.timer = threading.Timer(TICKET_TTL_S, self._drop, (ticket,))
        offer.timer.daemon = True
        offer.timer.start()
        return StreamDesc(self.host, self.port, self._token, ticket, nbytes)

    def _take(self, ticket: int) -> _Offer | None:
        with self._lock:
            offer = self._tickets.pop(ticket, None)
        if offer is not None and offer.timer is not None:
            offer.timer.cancel()
        return offer

    def withdraw(self, ticket: int) -> bool:
        """Drop an offer not fetched yet (its reader gave up): its slot's lock is released now."""
        offer = self._take(ticket)
        if offer is not None:
            offer.release()
        return offer is not None

    def _drop(self, ticket: int) -> None:
        offer = self._take(ticket)
        if offer is not None:
            logger.warning(
                "cf_ray: an offered section (%d bytes) was not fetched in %.0f s; released", offer.nbytes, TICKET_TTL_S
            )
            offer.release()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="cf_ray-stream-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        offer = None
        try:
            conn.settimeout(STALL_TIMEOUT_S)
            token, ticket = _REQ.unpack(_recv_exactly(conn, _REQ.size))
            if secrets.compare_digest(token, self._token):
                offer = self._take(ticket)
            if offer is None:
                conn.sendall(_LEN.pack(_NONE))
                return
            # The timeout stays: a reader that stops reading must not hold the slot's lock for ever
            # (each send that makes no progress for STALL_TIMEOUT_S raises).
            conn.settimeout(STALL_TIMEOUT_S)
            conn.sendall(_LEN.pack(offer.nbytes))
            if offer.buffer is not None:
                conn.sendall(offer.buffer)
            elif offer.nbytes:
                sent = conn.sendfile(cast(Any, _Fd(offer.fd)), offer.offset, offer.nbytes)
                if sent != offer.nbytes:
                    raise OSError(f"the slot ended after {sent} of {offer.nbytes} bytes")
        except OSError as e:
            logger.warning("cf_ray: streaming a section to a reader failed (%s: %s)", type(e).__name__, e)
        finally:
            if offer is not None:
                offer.release()
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        with self._lock:
            offers, self._tickets = list(self._tickets.values()), {}
        for offer in offers:
            if offer.timer is not None:
                offer.timer.cancel()
            offer.release()


class _Fd:
    """A file descriptor as ``socket.sendfile`` takes a file (it only asks for ``fileno``)."""

    def __init__(self, fd: int):
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise ConnectionError(f"the connection closed after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def fetch(desc: StreamDesc, timeout_s: float) -> np.ndarray:
    """The offered section's bytes, in a private writable buffer.

    Raises:
        LookupError: the holder no longer offers it (served already, or dropped).
        ConnectionError, OSError: the connection failed or ended early (nothing partial is returned).
    """
    buf = _shm.private_buffer(desc.nbytes)
    view = buf.data
    with socket.create_connection((desc.host, desc.port), timeout=timeout_s) as conn:
        conn.sendall(_REQ.pack(desc.token, desc.ticket))
        (n,) = _LEN.unpack(_recv_exactly(conn, _LEN.size))
        if n == _NONE:
            raise LookupError(f"the holder at {desc.host}:{desc.port} no longer offers ticket {desc.ticket}")
        if n != desc.nbytes:
            raise ConnectionError(f"the holder announced {n} bytes, the offer {desc.nbytes}")
        got = 0
        while got < n:
            k = conn.recv_into(view[got:], min(CHUNK_BYTES, n - got))
            if k == 0:
                raise ConnectionError(f"the holder's stream ended after {got} of {n} bytes")
            got += k
    return buf
