"""The holder's line to the controller: every message is delivered or its loss is seen.

One thread sends the holder's messages (``part_staged``, ``part_durable``, ``part_failed``,
``part_superseded``, ...: ``messages.HOLDER_MESSAGES``) in order from a bounded FIFO and waits for
each to be acknowledged (the controller's method returned). What is queued when the thread is free
goes in one call, ``Controller.deliver`` (at most :data:`BATCH` messages): a snapshot's sections are
staged together, because at a checkpoint every iteration a Ray call per message would be most of
the holder's and the controller's CPU per checkpoint. A *lazy* message (``part_staged`` of a snapshot
held in memory only) waits up to :data:`LAZY_S` for company: such a snapshot is of use only while
this holder lives, and a restore plan first has the holders deliver what they queued
(``Holder.flush``, which sends lazy messages at once), so the controller needs it no sooner.

When the controller is dead, restarting or unreachable (``RayActorError``, ``ActorDiedError``,
``ActorUnavailableError``, ``GetTimeoutError``, or no actor of that name), the cached handle is
dropped, the controller is looked up again by name with exponential backoff, and the messages are
sent again: for at most ``CF_RAY_ACTOR_TIMEOUT_S`` per call, after which they are given up with a
warning. The controller's handlers are idempotent, so a
message that did arrive before its acknowledgement was lost does no harm when it comes again.

Nothing given up is lost for good: the holder keeps a record of what it holds and what became of
it, which a controller that starts again asks for (``Holder.resync``) and which the controller's
watch asks about sections pending too long (``Holder.lookup``). The queue holds at most
``env.SEND_QUEUE`` messages; past that the oldest is dropped with a warning (the same recovery
applies), so a long-unreachable controller never grows the holder's memory.

No torch here.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import ray
import ray.exceptions

from cf_ray._engine import env as _env

logger = logging.getLogger("cf_ray")

#: What a failed call to the controller can raise when the controller is gone or unreachable.
_RETRY = tuple(
    e
    for e in (
        ray.exceptions.RayActorError,
        getattr(ray.exceptions, "ActorUnavailableError", None),
        ray.exceptions.GetTimeoutError,
        ValueError,
    )
    if e is not None
)
#: Seconds one call may take before it is sent again (the controller answers in milliseconds).
CALL_TIMEOUT_S = 30.0
#: At most this many queued messages go in one call.
BATCH = 64
#: Seconds a lazy message may wait for others before it is sent (one call per this many seconds of
#: snapshots held in memory only, instead of one per snapshot).
LAZY_S = 0.2


class Sender:
    """Delivers messages to the named controller, in order, what is queued in one call at a time.

    Args:
        controller_name: the controller actor's name.
        namespace: its namespace.
    """

    def __init__(self, controller_name: str, namespace: str):
        self.controller_name = controller_name
        self.namespace = namespace
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, Any, float]] = collections.deque()  # (method, msg, due)
        self._eager = 0  # messages queued that are due at once
        self._flushing = 0  # wait_idle calls waiting: everything queued is due at once
        self._busy = 0  # messages being delivered
        self._handle = None
        self.sent = 0
        """Messages acknowledged."""
        self.given_up = 0
        """Messages not delivered within the timeout, or dropped from a full queue."""
        self._thread = threading.Thread(target=self._run, name="cf_ray-sender", daemon=True)
        self._thread.start()

    def send(self, method: str, msg: Any) -> None:
        """Queue ``controller.<method>(msg)``; returns at once."""
        self.send_all([(method, msg)])

    def send_all(self, messages: list[tuple[str, Any]], *, lazy: bool = False) -> None:
        """Queue ``[(method, msg)]`` together (so they go in one call when the thread is free);
        ``lazy``: they may wait up to :data:`LAZY_S` for later messages (module doc)."""
        limit = max(1, _env.SEND_QUEUE)
        due = time.monotonic() + LAZY_S if lazy else 0.0
        with self._cond:
            for method, msg in messages:
                if len(self._queue) >= limit:
                    dropped = self._queue.popleft()
                    self._eager -= dropped[2] == 0.0
                    self.given_up += 1
                    logger.warning(
                        "cf_ray: the holder's queue to the controller is full (%d, %s); dropping the oldest "
                        "message (%s); the controller recovers it from the holder's record",
                        limit,
                        "env.SEND_QUEUE",
                        dropped[0],
                    )
                self._queue.append((method, msg, due))
                self._eager += not lazy
            self._cond.notify_all()

    def pending(self) -> int:
        """Messages queued or being delivered."""
        with self._cond:
            return len(self._queue) + self._busy

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued message is delivered or given up. Returns whether it is so."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._queue or self._busy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(timeout=min(left, 0.5))
                return True
            finally:
                self._flushing -= 1

    def forget_handle(self) -> None:
        """Look the controller up again before the next message (it was replaced)."""
        self._handle = None

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due():
                    self._cond.wait(self._queue[0][2] - time.monotonic() if self._queue else None)
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                self._eager -= sum(due == 0.0 for _, _, due in batch)
                self._busy = len(batch)
            try:
                self._deliver(tuple((method, msg) for method, msg, _ in batch))
            except Exception:  # noqa: BLE001 - never kill the thread
                logger.exception("cf_ray: sending %s to the controller failed", ", ".join(m for m, _, _ in batch))
            finally:
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()

    def _due(self) -> bool:
        """Whether what is queued goes now (under the lock): an eager message or a flush is waiting,
        or the oldest lazy one has waited :data:`LAZY_S`."""
        if not self._queue:
            return False
        return bool(self._eager or self._flushing) or self._queue[0][2] <= time.monotonic()

    def _resolve(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.controller_name, namespace=self.namespace)
        return self._handle

    def _deliver(self, batch: tuple[tuple[str, Any], ...]) -> None:
        """Send ``batch`` until acknowledged or given up. A message the controller refuses (its
        handler raised: a resend would too) is logged and counted as given up."""
        deadline = time.monotonic() + _env.get_float(_env.ACTOR_TIMEOUT_S)
        delay = 0.05
        first = f"{batch[0][0]} (step {getattr(batch[0][1], 'step', '?')})" + (
            f" and {len(batch) - 1} more" if len(batch) > 1 else ""
        )
        while True:
            try:
                handle = self._resolve()
                refused = ray.get(
                    handle.deliver.remote(batch),
                    timeout=min(CALL_TIMEOUT_S, max(1.0, deadline - time.monotonic())),
                )
                for line in refused:
                    logger.warning("cf_ray: the controller refused %s", line)
                self.given_up += len(refused)
                self.sent += len(batch) - len(refused)
                return
            except ray.exceptions.RayTaskError as e:  # deliver itself raised: a resend would too
                self.given_up += len(batch)
                logger.warning("cf_ray: the controller refused %s: %r", first, e)
                return
            except _RETRY as e:
                self._handle = None
                if time.monotonic() + delay > deadline:
                    self.given_up += len(batch)
                    logger.warning(
                        "cf_ray: could not deliver %s to the controller %s within %s=%.0f s "
                        "(%s); the controller recovers it from the holder's record when it is back",
                        first,
                        self.controller_name,
                        _env.ACTOR_TIMEOUT_S,
                        _env.get_float(_env.ACTOR_TIMEOUT_S),
                        type(e).__name__,
                    )
                    return
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except Exception as e:  # noqa: BLE001 - e.g. the message cannot be serialised: a resend would fail too
                self.given_up += len(batch)
                logger.warning("cf_ray: could not send %s: %r", first, e)
                return


__all__ = ["Sender"]
