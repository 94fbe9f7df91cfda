"""NVIDIA DALI: a resumable external-source reader and a wrapper over ``DALIGenericIterator``.

CheckFreq's ``CFIterator`` needed a patched DALI to skip what had been consumed. Here the data
enters the pipeline through ``fn.external_source``, fed by :class:`DALIExternalSource`, which takes
its indices from a :class:`~cf_ray.data.ResumableSampler`; :class:`ResumableDALIIterator` counts
the batches the loop received (DALI runs ``prefetch_queue_depth`` batches ahead) and advances the
sampler by exactly those. A resumed run builds the pipeline, loads the state and the source starts
at the first unconsumed index. Every sampler feature carries over: shuffling, sharding,
``drop_last``/``pad``, and elastic resume on another world size.

DALI's own checkpointing (``enable_checkpointing=True``, ``DALIGenericIterator.checkpoints()``)
is not used: its state is an opaque serialized protobuf per pipeline, it can be restored only into
a pipeline with the same shard layout (no elastic resume) and it counts DALI's own epochs, not the
training loop's. With an external source there is nothing for it to add.

Only the DALI iterator needs the ``dali`` extra (``nvidia-dali-cuda120``); it is imported when the
iterator first runs. On a machine without a GPU build a CPU pipeline with ``device_id=None``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from cf_ray._engine.data.checks import check_int
from cf_ray.data.sampler import ResumableSampler
from cf_ray.errors import ConfigError

#: Arguments of DALIGenericIterator that ResumableDALIIterator sets itself.
_OWNED = ("size", "reader_name", "auto_reset", "last_batch_policy", "last_batch_padded", "prepare_first_batch")


class DALIExternalSource:
    """A batch source for ``fn.external_source(source=..., batch=True)`` driven by a sampler.

    Each call returns the next batch of the sampler's current epoch: ``read_fn(index)`` for each
    index. When ``read_fn`` returns a tuple, use ``num_outputs=len(tuple)`` in the pipeline.

    Example::

        source = DALIExternalSource(sampler, read_fn=lambda i: (images[i], labels[i]),
                                    batch_size=64)

        @pipeline_def(batch_size=64, num_threads=2, device_id=None)
        def pipe():
            image, label = fn.external_source(source=source, batch=True, num_outputs=2)
            return fn.crop(image, crop=(24, 24)), label

    Args:
        sampler: the resumable sampler giving this rank's indices.
        read_fn: ``read_fn(index) -> numpy array`` or a tuple of arrays (one per output).
        batch_size: samples per batch; at most the pipeline's ``batch_size``.

    Raises:
        ConfigError: an argument is invalid.
    """

    def __init__(self, sampler: ResumableSampler, read_fn: Callable[[int], Any], *, batch_size: int) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise ConfigError(
                f"sampler={type(sampler).__name__} is not a ResumableSampler; use "
                "ResumableDistributedSampler (or ShardedDataset.sampler)"
            )
        if not callable(read_fn):
            raise ConfigError(f"read_fn={read_fn!r} must be a callable: index -> array(s)")
        check_int("batch_size", batch_size, minimum=1)
        self.sampler = sampler
        self.read_fn = read_fn
        self.batch_size = batch_size
        self._plan = np.empty(0, dtype=np.int64)
        self._cursor = 0
        self._stop = False
        self.sizes: deque[int] = deque()

    def _start(self, position: int) -> None:
        """Begin a pass at ``position`` of the sampler's current plan."""
        self._plan = self.sampler._plan()
        self._cursor = position
        self._stop = False
        self.sizes = deque()

    def __call__(self) -> Any:
        if self._stop or self._cursor >= len(self._plan):
            raise StopIteration  # ends DALI's epoch
        ids = self._plan[self._cursor : self._cursor + self.batch_size]
        self._cursor += len(ids)
        samples = [self.read_fn(int(i)) for i in ids]
        # Recorded when DALI asks, popped when the loop receives: DALI keeps batch order.
        self.sizes.append(len(ids))
        if isinstance(samples[0], tuple):
            return tuple(list(col) for col in zip(*samples))
        return samples


class ResumableDALIIterator:
    """A ``DALIGenericIterator`` whose position is what the loop consumed.

    The DALI iterator is created on the first pass, after any ``load_state_dict``, so nothing is
    prefetched from a stale position. Iterating yields what ``DALIGenericIterator`` yields (a list
    with one dict per pipeline). The iterator and its sampler report the same state, so either can
    be given to ``cf_ray.Checkpointer(data=...)``.

    Example::

        it = ResumableDALIIterator(pipe(), source, output_map=["image", "label"])
        for epoch in range(resume.epoch, epochs):
            it.set_epoch(epoch)
            for out in it:
                images, labels = out[0]["image"], out[0]["label"]

    Args:
        pipeline: the (unbuilt) DALI pipeline that reads from ``source``.
        source: the :class:`DALIExternalSource` used in the pipeline.
        output_map: names of the pipeline outputs, as for ``DALIGenericIterator``.
        **kwargs: other ``DALIGenericIterator`` arguments (``dynamic_shape``, ...) except
            ``size``, ``reader_name``, ``auto_reset``, ``last_batch_policy``,
            ``last_batch_padded`` and ``prepare_first_batch``, which this class sets.

    Raises:
        ConfigError: an argument is invalid.
    """

    def __init__(self, pipeline: Any, source: DALIExternalSource, output_map: Sequence[str], **kwargs: Any) -> None:
        if not isinstance(source, DALIExternalSource):
            raise ConfigError(f"source={type(source).__name__} must be a DALIExternalSource")
        taken = [k for k in kwargs if k in _OWNED]
        if taken:
            raise ConfigError(
                f"ResumableDALIIterator sets {taken} itself (the source ends each "
                "epoch and the iterator resets on the next pass); remove them"
            )
        max_batch = getattr(pipeline, "max_batch_size", None)
        if isinstance(max_batch, int) and source.batch_size > max_batch:
            raise ConfigError(
                f"source batch_size={source.batch_size} exceeds the pipeline's batch_size={max_batch}; make them equal"
            )
        self.pipeline = pipeline
        self.source = source
        self.sampler = source.sampler
        self.output_map = list(output_map)
        self.kwargs = kwargs
        self.sampler._attach_consumer(f"ResumableDALIIterator@{id(self):#x}")
        self._dali: Any = None
        self._running = False  # DALI is inside an epoch (a pass was abandoned if set at __iter__)

    def __iter__(self) -> Iterator[Any]:
        start = self.sampler._begin_pass()
        if self._running:
            self._drain()
        if start >= len(self.sampler._plan()):
            return  # the restored epoch was finished (or is empty): nothing to run
        self.source._start(start)
        if self._dali is None:
            from nvidia.dali.plugin.base_iterator import LastBatchPolicy
            from nvidia.dali.plugin.pytorch import DALIGenericIterator

            self._dali = DALIGenericIterator(
                [self.pipeline],
                self.output_map,
                auto_reset=False,
                prepare_first_batch=False,
                last_batch_policy=LastBatchPolicy.PARTIAL,
                **self.kwargs,
            )
        else:
            # Reset here, not at the end of the previous epoch: DALI starts prefetching on reset,
            # and the source must already point at the epoch set by set_epoch().
            self._dali.reset()
        self._running = True
        for out in self._dali:
            self.sampler._advance(self.source.sizes.popleft())
            yield out
        self._running = False
        self.sampler._finish_pass()

    def _drain(self) -> None:
        # A pass was abandoned mid-epoch. DALI cannot reset inside an epoch, so end the epoch at
        # the source and discard what DALI had prefetched (it was never given to the loop).
        self.source._stop = True
        for _ in self._dali:
            pass
        self._running = False

    # Stateful / ElasticStateful: the sampler holds the position.

    def set_epoch(self, epoch: int) -> None:
        """Forward to the sampler's :meth:`~ResumableSampler.set_epoch`."""
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: what the loop has received so far."""
        return self.sampler.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Forward to the sampler's :meth:`~ResumableSampler.load_state_dict`.

        Raises:
            RuntimeError: the pipeline already ran; load into a freshly built iterator.
        """
        self._check_fresh()
        self.sampler.load_state_dict(state_dict)

    def load_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Forward to the sampler's :meth:`~ResumableSampler.load_elastic_state`."""
        self._check_fresh()
        self.sampler.load_elastic_state(states, rank, world_size)

    def _check_fresh(self) -> None:
        if self._running:
            raise RuntimeError(
                "ResumableDALIIterator: load a state before iterating, or after a "
                "pass has finished; the pipeline has prefetched batches of the "
                "current position"
            )
