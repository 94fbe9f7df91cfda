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
