"""A rank's doorbell: how the controller has a rank poll at once, without waiting for the poll
interval (``worker/link/controller.py``), when a checkpoint request comes from outside the workers
(``cf_ray.preemption.notify_preemption``) or it published a new schedule version.

Inside a Ray actor (a Ray Train worker) a rank's polls carry its bell's address, ``(actor handle,
token)``, until the controller has it for the attempt; the controller rings it with
``actor.__ray_call__``, which runs on the actor's main thread beside the training thread, and sets
an Event that the training thread reads at its next step. The bell carries no data: what it
announces comes in the poll's reply.

No torch here: the controller imports :func:`ring_all`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from typing import Any

import ray

logger = logging.getLogger("cf_ray")

# Bells of this process by token: the function the controller runs on the actor's main thread finds
# the bell here (what ``__ray_call__`` carries is pickled, so it cannot carry the Event itself).
_BELLS: weakref.WeakValueDictionary[int, threading.Event] = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


class Doorbell:
    """A rank's doorbell: the controller rings it to have the next step poll at once.

    Args:
        actor: the handle of the Ray actor this rank runs in (:meth:`here` finds it).
    """

    def __init__(self, actor):
        self._event = threading.Event()
        self._token = next(_TOKENS)
        _BELLS[self._token] = self._event
        self.address = (actor, self._token)
        """What the controller rings it by: ``(actor handle, token)``; see :func:`ring_all`."""

    @classmethod
    def here(cls) -> Doorbell | None:
        """A bell for this process, or ``None`` outside a Ray actor (the driver, a plain process)."""
        actor = current_actor()
        return None if actor is None else cls(actor)

    def take(self) -> bool:
        """Whether it rang since the last take (and clears it)."""
        if not self._event.is_set():
            return False
        self._event.clear()
        return True


def ring_all(addresses: list[tuple[Any, int]], timeout_s: float = 10.0) -> int:
    """From the controller: ring the bells at ``addresses`` (:attr:`Doorbell.address`) and wait for
    them, at most ``timeout_s`` in all. Returns how many rang. One that does not (its worker is gone,
    or its attempt over) is logged at debug level only: the request reaches a live rank at its next
    poll."""
    deadline = time.monotonic() + timeout_s
    refs = []
    for actor, token in addresses:
        try:
            refs.append(actor.__ray_call__.remote(_ring, token))
        except Exception as e:  # noqa: BLE001 - a dead handle: the poll still delivers
            logger.debug("cf_ray: could not ring a doorbell: %r", e)
    rang = 0
    for ref in refs:
        try:
            rang += bool(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except Exception as e:  # noqa: BLE001 - as above
            logger.debug("cf_ray: a doorbell did not ring: %r", e)
    return rang


def current_actor():
    """The handle of the Ray actor this process runs, or ``None`` (the driver, a task, no Ray). Never
    starts Ray: asking a process without Ray for its runtime context would start a local one."""
    if not ray.is_initialized():
        return None
    try:
        ctx = ray.get_runtime_context()
        if ctx.get_actor_id() is None:
            return None
        return ctx.current_actor
    except Exception:  # noqa: BLE001
        return None


def _ring(_actor_self, token: int) -> bool:
    event = _BELLS.get(token)
    if event is None:
        return False
    event.set()
    return True
