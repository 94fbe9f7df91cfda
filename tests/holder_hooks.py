"""Changes a test makes inside a running holder actor's process (``holder.__ray_call__.remote(fn,
...)``): no test hook is read on a production path. Light to import (no torch): the holder process
imports this module to run them."""

from __future__ import annotations

import time


def delay_pulls(holder, step: int, seconds: float) -> None:
    """The holder's pulls of copies of ``step`` wait ``seconds`` before they start (a copy in flight)."""
    receive = holder._replicator.receive

    def delayed(offer, wait_s):
        if offer.step == step:
            time.sleep(seconds)
        return receive(offer, wait_s)

    holder._replicator.receive = delayed


def delay_persisted_staging(holder, step: int, seconds: float) -> None:
    """The holder's sender delivers the ``part_staged`` of a persisted snapshot of ``step`` (and what
    comes with it) ``seconds`` late: the hand-off returns at once, the controller hears of it later."""
    deliver = holder._sender._deliver

    def delayed(batch):
        if any(m == "part_staged" and msg.step == step and msg.meta.persist for m, msg in batch):
            time.sleep(seconds)
        return deliver(batch)

    holder._sender._deliver = delayed
