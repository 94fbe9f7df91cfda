"""Full garbage collections kept out of the training loop (``CheckpointConfig.freeze_gc``).

CPython runs a full (generation 2) collection once the objects promoted since the last one reach a
quarter of those that survived it. A training process that imported torch, Ray and cf_ray holds
hundreds of thousands of objects, and a full collection of them takes a few hundred milliseconds,
holding the GIL: the training thread stops for that long. cf_ray's setup (its imports, the restore,
its actors' handles) and its objects of each checkpoint push the count over that threshold a few
seconds into the loop, so without the freeze such a pause lands inside the training loop.

So at the end of :meth:`~cf_ray.Checkpointer.restore` (before the loop) one full collection runs,
then ``gc.freeze()`` moves every object alive then (modules, the model, the optimizer, Ray's state)
out of the collector's reach: a later full collection scans only what was made since, a few
milliseconds. Frozen objects are still freed by reference counting; only a reference cycle among
them that becomes garbage later stays until :meth:`GcFreeze.release` (``finish()``/``close()``),
which unfreezes them, unless something else had frozen objects before (then it leaves the freeze as
it found it). Nothing is done when the collector is disabled.
"""

from __future__ import annotations

import gc


class GcFreeze:
    """One rank's freeze of the heap from its restore to its ``finish()``/``close()``.

    Args:
        enabled: ``CheckpointConfig.freeze_gc``.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._ours = False

    def freeze(self) -> None:
        """Collect once, then freeze what is alive (once; not when disabled or the collector is off)."""
        if not self.enabled or self._ours or not gc.isenabled():
            return
        first = gc.get_freeze_count() == 0
        gc.collect()
        gc.freeze()
        self._ours = first

    def release(self) -> None:
        """Unfreeze what :meth:`freeze` froze (when nothing else had frozen objects before it)."""
        if self._ours:
            self._ours = False
            gc.unfreeze()
