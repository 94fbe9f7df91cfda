"""torchdata's ``StatefulDataLoader`` as a cf_ray data source, as it is.

Give the loader itself to the Checkpointer::

    loader = StatefulDataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset), num_workers=2)
    ckpt = cf_ray.Checkpointer({...}, data={"loader": loader})

and cf_ray wraps it in a :class:`StatefulDataLoaderSource` (one per rank). The loader's own
``state_dict()`` is the position: torchdata records what the loop received (with worker processes
too: its snapshots follow the batches handed to the loop, not the prefetched ones), and
``load_state_dict()`` resumes the next pass at the next batch. So, within one number of workers,
every sample is trained exactly once per epoch after a crash, as torchdata promises and the tests
check. The epoch rule is torchdata's: a state taken at ``ckpt.step()`` resumes inside the epoch
(after the last batch of an epoch it yields nothing more of it), a state taken by ``end_epoch()``
(the loader's iterator had ended) starts a new pass, the next epoch's.

What cf_ray adds:

* **What it accepts.** A state is stored as cf_ray stores everything (JSON plus raw tensor bytes,
  no pickle), and is given back to torchdata only if it holds nothing but JSON values (dicts,
  lists, numbers, strings, booleans, None), tensors and numeric arrays (a ``torch.Generator``'s
  state is a uint8 tensor). ``bytes`` are refused when the state is taken, with the path of the
  value: they are how a dataset's ``state_dict()`` usually carries a pickled object, and a
  checkpoint's bytes handed to a dataset that unpickles them would run code from a file. Return
  plain values from the dataset's ``state_dict()`` instead. (A dataset that hides a pickle in a
  tensor defeats this check; cf_ray cannot see that.)
* **Checks before anything is loaded.** The state must come from a loader with the same
  ``num_workers`` and ``batch_size`` (torchdata fast-forwards by batches and per worker), for this
  rank, and have the shape torchdata's loader of that kind writes; otherwise a ``ConfigError``
  says what to change, instead of an assertion inside torchdata at the first batch.
* **Another number of workers** (an elastic restart): a ``StatefulDataLoader``'s position is a
  count of batches of its own sampler's order, and that order (a ``DistributedSampler`` over the old
  world size) cannot be re-split by cf_ray without replacing the sampler. So it is accepted at an
  epoch boundary only (every old rank before its first batch of the epoch, or every old rank's
  iterator ended: the checkpoint ``end_epoch()`` takes), where the new loaders start their epoch
  fresh on the new world size; in the middle of an epoch it raises
  :class:`~cf_ray.errors.ElasticResumeError`, which names the old world size. Use
  :class:`cf_ray.data.ResumableDataLoader` (same ``DataLoader`` arguments) where a mid-epoch change
  of world size must continue exactly once.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from cf_ray._engine.data.checks import FORMAT_KEY, check_elastic_states, check_format, check_same, resolve_world
from cf_ray.errors import ConfigError, ElasticResumeError

_MODULE = "torchdata.stateful_dataloader"


def is_stateful_dataloader(obj: Any) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader`` (without importing torchdata)."""
    mod = sys.modules.get(_MODULE)
    cls = getattr(mod, "StatefulDataLoader", None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


def adapt_sources(data: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """``data`` with every ``StatefulDataLoader`` wrapped in a :class:`StatefulDataLoaderSource`."""
    return {
        name: StatefulDataLoaderSource(obj, rank=rank, world_size=world_size) if is_stateful_dataloader(obj) else obj
        for name, obj in data.items()
    }


class StatefulDataLoaderSource:
    """A torchdata ``StatefulDataLoader`` registered with cf_ray (the Checkpointer wraps one given
    in ``data=`` itself; build one to register it explicitly).

    Args:
        loader: the ``torchdata.stateful_dataloader.StatefulDataLoader`` the loop iterates.
        rank: this worker's rank; defaults to torch.distributed's, else 0.
        world_size: number of workers; defaults to torch.distributed's, else 1.

    Raises:
        ConfigError: ``loader`` is not a ``StatefulDataLoader``.
    """

    FORMAT = "cf_ray.StatefulDataLoader/1"

    def __init__(self, loader: Any, *, rank: int | None = None, world_size: int | None = None) -> None:
        if not is_stateful_dataloader(loader):
            raise ConfigError(
                f"loader={type(loader).__name__} is not a torchdata StatefulDataLoader; pass "
                "torchdata.stateful_dataloader.StatefulDataLoader(...) (or use cf_ray.data.ResumableDataLoader)"
            )
        self.loader = loader
        self.rank, self.world_size = resolve_world(rank, world_size)
        # The state loaded and not yet handed to an iterator: what state_dict() says until the loop
        # iterates again (asking the loader would start its workers and fast-forward early).
        self._pending: dict[str, Any] | None = None

    def _settings(self) -> dict[str, Any]:
        return {"num_workers": int(self.loader.num_workers), "batch_size": self.loader.batch_size}

    def state_dict(self) -> dict[str, Any]:
        """The loader's ``state_dict()`` (checked: only JSON values, tensors and numeric arrays),
        with this rank, the world size and the loader's settings.

        Raises:
            ConfigError: the loader's state holds a value cf_ray would not give back (bytes, an
                object), named by its path.
        """
        if self._pending is not None and getattr(self.loader, "_iterator", None) is None:
            return self._pending
        self._pending = None
        inner = self.loader.state_dict()
        check_tree(inner, "state_dict()")
        return {
            FORMAT_KEY: self.FORMAT,
            **self._settings(),
            "world_size": self.world_size,
            "rank": self.rank,
            "loader": inner,
        }

    def validate_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Every check :meth:`load_state_dict` makes, changing nothing.

        Raises:
            ConfigError: another kind of source, other settings, another rank, or a state whose
                shape or values are not what this loader writes.
            ElasticResumeError: the state was saved with another world size.
        """
        owner = type(self).__name__
        check_format(state_dict, self.FORMAT, owner)
        check_same(
            owner,
            state_dict,
            self._settings(),
            {
                "num_workers": "Build the StatefulDataLoader with the num_workers of the run that saved the "
                "checkpoint (torchdata restores each worker's state)",
                "batch_size": "Build the StatefulDataLoader with the batch_size of the run that saved the "
                "checkpoint (torchdata fast-forwards by batches)",
            },
        )
        if state_dict.get("world_size") != self.world_size:
            raise ElasticResumeError(
                f"{owner}: the state was saved with world_size={state_dict.get('world_size')}, this run has "
                f"{self.world_size}; call load_elastic_state() with every old rank's state"
            )
        if state_dict.get("rank") != self.rank:
            raise ConfigError(f"{owner}: the state belongs to rank {state_dict.get('rank')}, this is rank {self.rank}")
        inner = state_dict.get("loader")
        check_tree(inner, "the checkpoint's state")
        _progress(inner, int(self.loader.num_workers), owner)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Check the state (:meth:`validate_state_dict`), then give it to the loader; its next pass
        resumes there."""
        self.validate_state_dict(state_dict)
        self.loader.load_state_dict(dict(state_dict["loader"]))
        self._pending = dict(state_dict)

    def validate_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Every check :meth:`load_elastic_state` makes, changing nothing."""
        self._elastic_plan(states, rank, world_size)

    def load_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Resume on another number of workers: at an epoch boundary only.

        Raises:
            ElasticResumeError: the old ranks were in the middle of an epoch (the message says
                what to change).
        """
        same = self._elastic_plan(states, rank, world_size)
        if same is not None:
            self.load_state_dict(same)
        # Else every old rank was at an epoch boundary: the loader starts its next pass fresh.

    def _elastic_plan(
        self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int
    ) -> Mapping[str, Any] | None:
        owner = type(self).__name__
        if (rank, world_size) != (self.rank, self.world_size):
            raise ConfigError(
                f"{owner} was built for rank {self.rank} of {self.world_size} but load_elastic_state() was "
                f"called for rank {rank} of {world_size}"
            )
        old_world = check_elastic_states(owner, states, self.FORMAT, list(self._settings()))
        if old_world == world_size:
            self.validate_state_dict(states[rank])
            return states[rank]
        check_same(owner, states[0], self._settings(), {})
        progress = []
        for s in states:
            check_tree(s.get("loader"), "the checkpoint's state")
            progress.append(_progress(s["loader"], int(self.loader.num_workers), owner))
        if all(finished for _, finished in progress) or all(n == 0 and not f for n, f in progress):
            return None
        raise ElasticResumeError(
            f"{owner}: cannot resume a torchdata StatefulDataLoader on {world_size} workers from the middle "
            f"of an epoch saved by {old_world} (old ranks had yielded {[n for n, _ in progress]} batches): its "
            "position counts batches of an order split for the old number of workers. Resume with "
            f"num_workers={old_world}, or checkpoint only at epoch ends (cf_ray.EpochEnd), or load the data with "
            "cf_ray.data.ResumableDataLoader and ResumableDistributedSampler, which re-split the rest of the epoch"
        )


def _progress(inner: Any, num_workers: int, owner: str) -> tuple[int, bool]:
    """``(batches yielded in this pass, iterator finished)`` of a torchdata state, checked against
    the shape torchdata writes for ``num_workers``."""
    try:
        if num_workers == 0:
            n, finished = inner["_num_yielded"], inner["_iterator_finished"]
        else:
            snap = inner["_snapshot"]
            workers = snap["_worker_snapshots"]
            if sorted(workers) != sorted(f"worker_{i}" for i in range(num_workers)):
                raise ValueError(f"worker snapshots {sorted(workers)} for num_workers={num_workers}")
            n = snap["_snapshot_step"] + inner["_steps_since_snapshot"]
            finished = inner["_iterator_finished"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0 or not isinstance(finished, bool):
            raise ValueError(f"batches yielded {n!r}, finished {finished!r}")
    except (KeyError, TypeError, ValueError) as e:
        kind = "single-process (num_workers=0)" if num_workers == 0 else f"num_workers={num_workers}"
        raise ConfigError(
            f"{owner}: the saved state is not a {kind} StatefulDataLoader state ({type(e).__name__}: {e}); "
            "build the loader as in the run that saved the checkpoint"
        ) from None
    return n, finished


def check_tree(value: Any, path: str) -> None:
    """Raise ConfigError unless ``value`` holds only JSON values, tensors and numeric arrays.

    Raises:
        ConfigError: naming the path of the first value that is not (bytes included: see the
            module docstring).
    """
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise ConfigError(f"StatefulDataLoader state: key {k!r} at {path} must be a str or an int")
            check_tree(v, f"{path}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_tree(v, f"{path}[{i}]")
        return
    if isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.dtype.kind in "biufc"):
        return
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise ConfigError(
            f"StatefulDataLoader state: {path} is {type(value).__name__} ({len(value)} bytes). cf_ray does not "
            "hand bytes from a checkpoint back to a dataset, because they usually carry a pickled object and "
            "unpickling them would run code from a file. Return plain values (ints, lists, dicts, tensors) from "
            "the dataset's or sampler's state_dict()"
        )
    raise ConfigError(
        f"StatefulDataLoader state: {path} is a {type(value).__name__}; cf_ray stores only JSON values, tensors "
        "and numeric arrays. Return plain values from the dataset's or sampler's state_dict()"
    )
