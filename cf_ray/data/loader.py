"""A ``DataLoader`` whose saved position is what the loop consumed, not what workers prefetched.

With ``num_workers > 0`` the main process draws indices ahead of the loop (``prefetch_factor``
batches per worker), so a sampler's own count runs ahead of training. :class:`ResumableDataLoader`
records the size of every index batch it hands to the workers and, since batches come back in
order, adds a batch's size to the sampler's position only when the loop receives that batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sized
from typing import Any, cast

from torch.utils.data import DataLoader, Dataset, IterableDataset

from cf_ray._engine.data.cursor import SamplerHeldPosition
from cf_ray.data.sampler import ResumableDistributedSampler, ResumableSampler
from cf_ray.errors import ConfigError


class ResumableDataLoader(SamplerHeldPosition, DataLoader):
    """A ``torch.utils.data.DataLoader`` over a :class:`ResumableSampler` that keeps the sampler's
    position equal to the batches the loop has received, with any ``num_workers``,
    ``prefetch_factor`` and ``persistent_workers``.

    The loader and its sampler report the same state, so either can be given to
    ``cf_ray.Checkpointer(data=...)``.

    Example::

        sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=0, pad=False)
        loader = ResumableDataLoader(dataset, batch_size=64, sampler=sampler, num_workers=4,
                                     persistent_workers=True)
        for epoch in range(start_epoch, epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                ...

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch.
        sampler: the resumable sampler; by default a :class:`ResumableDistributedSampler` over
            ``dataset`` with ``shuffle`` and ``seed``, on torch.distributed's rank and world size.
        shuffle: only when ``sampler`` is None: shuffle every epoch (default True).
        seed: only when ``sampler`` is None: the permutation seed (default 0).
        drop_last: drop the last incomplete batch of each epoch (as in ``DataLoader``).
        **kwargs: any other ``DataLoader`` argument (``num_workers``, ``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``persistent_workers``, ...), except
            ``batch_sampler`` and ``in_order=False``.

    Raises:
        ConfigError: an argument cannot keep the position exact (see the messages).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        *,
        sampler: ResumableSampler | None = None,
        shuffle: bool | None = None,
        seed: int | None = None,
        drop_last: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(
                f"batch_size={batch_size!r} must be an int >= 1 (ResumableDataLoader "
                "counts consumption in batches of the sampler's indices)"
            )
        if isinstance(dataset, IterableDataset):
            raise ConfigError(
                "ResumableDataLoader needs a map-style dataset, got an IterableDataset;"
                " use ResumableParquetReader or ResumableRayDataIterator for streams"
            )
        if "batch_sampler" in kwargs:
            raise ConfigError(
                "ResumableDataLoader does not take batch_sampler=; pass a ResumableSampler as sampler= and batch_size="
            )
        if kwargs.get("in_order", True) is not True:
            raise ConfigError(
                f"in_order={kwargs['in_order']!r}: ResumableDataLoader needs batches "
                "in sampler order to know which ones the loop consumed; remove it"
            )
        if sampler is None:
            # A map-style Dataset has a len() (torch does not declare it); the sampler raises
            # ConfigError when it has none.
            sampler = ResumableDistributedSampler(
                cast(Sized, dataset), shuffle=True if shuffle is None else shuffle, seed=seed or 0
            )
        elif shuffle is not None or seed is not None:
            raise ConfigError(
                "shuffle= and seed= belong to the sampler when sampler= is given; "
                "set them on the ResumableSampler instead"
            )
        if not isinstance(sampler, ResumableSampler):
            raise ConfigError(
                f"sampler={type(sampler).__name__} is not a ResumableSampler; use "
                "ResumableDistributedSampler (or ShardedDataset.sampler)"
            )
        sampler._attach_consumer(f"ResumableDataLoader@{id(self):#x}")
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)
        self._recorder = _RecordingBatchSampler(self.batch_sampler)
        # DataLoader forbids reassigning batch_sampler after __init__ (to protect its iterators,
        # none of which exists yet); the recorder is a transparent wrapper, so bypass the guard.
        object.__setattr__(self, "batch_sampler", self._recorder)

    def __iter__(self) -> Iterator[Any]:
        inner = super().__iter__()  # creates this pass's index iterator (and its size queue)
        return self._pass(inner, self._recorder.sizes)

    def _pass(self, inner: Iterator[Any], sizes: deque) -> Iterator[Any]:
        sampler = cast(ResumableSampler, self.sampler)  # checked in __init__
        for batch in inner:
            # Batches arrive in the order their indices were drawn (in_order=True), so the size
            # at the head of the queue is this batch's.
            sampler._advance(sizes.popleft())
            yield batch
        sampler._finish_pass()  # a tail dropped by drop_last counts as consumed

    # Stateful / ElasticStateful: the sampler holds the position (SamplerHeldPosition).


class _RecordingBatchSampler:
    """Wraps a batch sampler and queues the size of every batch it produces (main process)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: deque[int] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        # A fresh queue per pass, created eagerly: batches prefetched by an abandoned pass must
        # not be counted by the next one.
        self.sizes = deque()
        return self._gen(self.sizes)

    def _gen(self, sizes: deque) -> Iterator[list[int]]:
        for batch in self.inner:
            sizes.append(len(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, sampler of the inner one
        if name == "inner":  # not set yet (e.g. while unpickling): avoid endless recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
