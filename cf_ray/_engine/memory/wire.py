"""The direct transfer between nodes: its wire format, its TLS settings and its reader.

A holder offers a section it holds to one reader on another node (a restore there, or a peer holder
pulling a copy into a slot of its own) over one TCP connection: the holder's
:class:`~cf_ray._engine.node.stream.SectionServer` sends it straight from the slot (``sendfile``),
and the reader receives it into memory it owns. The bytes are copied once on each host, by the
kernel, where Ray's object transfer would copy them three times (the origin's ``put``, the transfer
into the reader node's store, the reader's own copy).

Protocol, one request per connection: the reader sends :data:`MAGIC` and the offer's token (16
random bytes, made for that offer alone and consumed when it is served); the holder answers the byte
count (8 bytes; :data:`NONE` when the token is unknown, used or expired) and the bytes, then closes.
Only a process that may call the holder (a Ray call) learns a token.

Time limits: the request must arrive within :data:`REQUEST_TIMEOUT_S` of the connection (TLS
handshake included); after that every chunk — each ``recv`` of the reader, each ``sendfile``/``send``
of the holder — must make progress within :data:`STALL_TIMEOUT_S`, but the whole transfer has no cap:
a multi-GB section on a slow link completes, a peer that stops reading is given up.

TLS: when Ray runs with TLS (``RAY_USE_TLS=1``), the transfer does too, with Ray's own certificates
(``RAY_TLS_SERVER_CERT``, ``RAY_TLS_SERVER_KEY``, ``RAY_TLS_CA_CERT``) and mutual authentication: each
side presents its certificate and checks the other's against Ray's CA (host names are not checked:
Ray's certificates name nodes by whatever their operator chose; a certificate signed by the cluster's
CA is what admits a node, as for Ray's own gRPC). No plaintext transfer then; ``sendfile`` cannot
encrypt, so the holder sends from its mapping of the slot instead.

No Ray and no torch here.
"""

from __future__ import annotations

import os
import selectors
import socket
import ssl
import struct
import time
from collections.abc import Callable

import numpy as np

from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.protocol.messages import StreamDesc
from cf_ray.errors import CfRayError

#: Seconds a connection has to present its request (and finish its TLS handshake).
REQUEST_TIMEOUT_S = 5.0
#: Seconds one chunk of a transfer (a send or a receive) may make no progress before it is given up.
STALL_TIMEOUT_S = 30.0
#: Bytes per chunk: per ``recv_into`` of the reader, per ``sendfile``/``send`` of the holder.
CHUNK_BYTES = 8 * 1024 * 1024
#: What a request starts with (the protocol's version is in it).
MAGIC = b"CFR3"
TOKEN_BYTES = 16
#: The count that says "no such offer".
NONE = 2**64 - 1
REQUEST = struct.Struct(f"<4s{TOKEN_BYTES}s")
COUNT = struct.Struct("<Q")


def tls_enabled() -> bool:
    """Whether Ray runs with TLS (``RAY_USE_TLS``, read as Ray reads it)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def _tls_files() -> tuple[str, str, str]:
    names = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
    files = tuple(os.environ.get(n, "") for n in names)
    missing = [n for n, f in zip(names, files) if not f or not os.path.isfile(f)]
    if missing:
        raise CfRayError(
            f"Ray runs with TLS (RAY_USE_TLS=1) but {', '.join(missing)} do not name readable files; cf_ray's "
            "direct transfers use Ray's certificates: set them as for Ray itself"
        )
    return files  # pyright: ignore[reportReturnType] - three names, three files


def server_context() -> ssl.SSLContext:
    """The holder's side: Ray's certificate, and a client certificate signed by Ray's CA required."""
    cert, key, ca = _tls_files()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context() -> ssl.SSLContext:
    """The reader's side: Ray's certificate presented, the holder's checked against Ray's CA."""
    cert, key, ca = _tls_files()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # see the module doc
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    return ctx


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise ConnectionError(f"the connection closed after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def fetch_into(
    desc: StreamDesc,
    dest: memoryview,
    *,
    wait_s: float,
    stall_s: float | None = None,
    landed: Callable[[int], None] | None = None,
) -> None:
    """Receive the offered section into ``dest`` (``desc.nbytes`` bytes, writable).

    Args:
        wait_s: how long to wait for the connection and for the holder's answer (it may be serving
            others first).
        stall_s: per chunk, how long a receive may make no progress (:data:`STALL_TIMEOUT_S`).
        landed: called with the number of bytes in so far after each chunk (e.g. to check blocks as
            they land); an exception it raises ends the transfer.

    Raises:
        LookupError: the holder no longer offers it (served already, expired, or a wrong token).
        ConnectionError, OSError: the connection failed, stalled or ended early; what is in ``dest``
            then is partial and must not be used.
    """
    stall = STALL_TIMEOUT_S if stall_s is None else stall_s
    if dest.nbytes != desc.nbytes:
        raise ValueError(f"a buffer of {dest.nbytes} bytes for an offer of {desc.nbytes}")
    raw = socket.create_connection((desc.host, desc.port), timeout=wait_s)
    conn: socket.socket = client_context().wrap_socket(raw) if desc.tls else raw
    with conn:
        conn.sendall(REQUEST.pack(MAGIC, desc.token))
        (n,) = COUNT.unpack(recv_exactly(conn, COUNT.size))
        if n == NONE:
            raise LookupError(f"the holder at {desc.host}:{desc.port} no longer offers this section")
        if n != desc.nbytes:
            raise ConnectionError(f"the holder announced {n} bytes, the offer {desc.nbytes}")
        conn.settimeout(stall)  # per recv: the whole transfer has no cap
        got = 0
        while got < n:
            try:
                k = conn.recv_into(dest[got:], min(CHUNK_BYTES, n - got))
            except TimeoutError:
                raise ConnectionError(
                    f"the holder's stream stalled for {stall:.0f} s after {got} of {n} bytes"
                ) from None
            if k == 0:
                raise ConnectionError(f"the holder's stream ended after {got} of {n} bytes")
            got += k
            if landed is not None:
                landed(got)


def fetch(desc: StreamDesc, wait_s: float) -> np.ndarray:
    """The offered section's bytes, in a private, writable buffer (:func:`~.slots.private_buffer`)."""
    buf = _slots.private_buffer(desc.nbytes)
    fetch_into(desc, buf.data.cast("B") if desc.nbytes else memoryview(bytearray(0)), wait_s=wait_s)
    return buf


def wait_writable(conn: socket.socket, stall_s: float) -> None:
    """Block until ``conn`` can take more bytes, at most ``stall_s``. Waits through
    ``selectors`` (epoll or poll), not ``select``, which refuses a descriptor numbered 1024 or more: a busy holder's
    connections get there."""
    deadline = time.monotonic() + stall_s
    with selectors.DefaultSelector() as sel:
        sel.register(conn, selectors.EVENT_WRITE)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the reader took nothing for {stall_s:.0f} s")
            if sel.select(left):
                return


__all__ = [
    "CHUNK_BYTES",
    "COUNT",
    "MAGIC",
    "NONE",
    "REQUEST",
    "REQUEST_TIMEOUT_S",
    "STALL_TIMEOUT_S",
    "client_context",
    "fetch",
    "fetch_into",
    "recv_exactly",
    "server_context",
    "tls_enabled",
]
