"""The contract between cf_ray's checkpoint engine and the data sources (the helpers the sources
share are in :mod:`cf_ray._engine.data.cursor` and :mod:`cf_ray._engine.data.checks`).

Call order, on every rank (objects given to ``Checkpointer(data=...)`` are per rank)::

    obj = Source(..., rank=r, world_size=w)      # freshly built on every (re)start
    # restore(), same number of workers as the checkpoint:
    obj.load_state_dict(state_of_rank_r)
    # restore(), another number of workers (elastic):
    obj.load_elastic_state(states_of_every_old_rank, r, w)
    for epoch in range(resume.epoch, EPOCHS):
        obj.set_epoch(epoch)                     # keeps a position loaded for this same epoch
        for batch in ...:                        # the source counts what the loop consumed
            ...; ckpt.step(opt)                  # may call obj.state_dict() right here
        ckpt.end_epoch()                         # may call obj.state_dict(): epoch complete

A state is a small JSON-able dict (str keys; lists, ints, floats, str, bool, None) that describes
exactly what the training loop has consumed, never what a prefetcher has read ahead.

Epoch boundary rules, shared by every source so that the engine can treat them alike:

* ``set_epoch(e)`` with ``e`` equal to the current epoch does nothing: it must not reset a
  mid-epoch position that ``load_state_dict`` has just restored.
* ``set_epoch(e)`` with another ``e`` starts epoch ``e`` at position 0.
* A state taken after the last batch of epoch ``e`` (by ``end_epoch()`` or by the last ``step()``)
  says "epoch ``e`` complete". After loading it, ``set_epoch(e + 1)`` starts the next epoch, and a
  pass over epoch ``e`` (``set_epoch(e)`` then iterate) yields nothing, so epoch ``e`` is never
  replayed whichever epoch the engine resumes at.
* Iterating again over a finished epoch without loading a state repeats that epoch, as a torch
  ``DistributedSampler`` does when ``set_epoch`` is not called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from cf_ray.errors import ConfigError


@runtime_checkable
class Stateful(Protocol):
    """Something whose position can be saved and restored.

    ``state_dict()`` is called by the engine on the training thread right after an optimizer step
    (or at ``end_epoch()``) and must describe exactly what the loop has consumed so far.
    ``load_state_dict()`` is called once, on a freshly built object, before iteration starts.
    """

    def state_dict(self) -> dict[str, Any]:
        """Return the position as a small JSON-able dict."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by ``state_dict()`` of an object built the same way."""
        ...


@runtime_checkable
class ElasticStateful(Stateful, Protocol):
    """A :class:`Stateful` that can resume on another number of workers.

    When a run resumes with a different world size, the engine calls ``load_elastic_state`` on
    every new rank (instead of ``load_state_dict``) with the states of *all* old ranks. The
    implementation splits what the old ranks had not consumed in the current epoch over the new
    ranks, so the epoch still sees every item exactly once; the next epochs follow the new world
    size. Ranks may have consumed different amounts (the last batch of an epoch may differ), so an
    implementation must not assume equal consumption.
    """

    def load_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Restore from the states of every old rank (index = old rank) as new ``rank`` of
        ``world_size``.

        Raises:
            ElasticResumeError: the states cannot be re-split without duplicating or skipping.
        """
        ...


class DataOrderError(ConfigError):
    """A source's order on resume differs from the order of the run that saved the state, so
    exactly-once cannot be guaranteed (for example a Ray Data pipeline that is not
    deterministic). The message says what to change."""
