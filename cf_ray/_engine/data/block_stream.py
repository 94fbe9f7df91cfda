"""The ordered block stream behind :func:`cf_ray.data.elastic_data_config`.

Ray Train calls ``DataConfig.configure`` once per worker group (every start, restart and resize).
:class:`ElasticDataConfig` then creates one :class:`BlockStream` actor per split dataset and gives
every rank an :class:`ElasticShard` (the actor's handle, the rank, the world size, the split's
settings) instead of a ``streaming_split`` iterator. The actor is owned by Ray Train's dataset
manager of that group, so it ends with the group.

The actor executes the dataset once per epoch, with ``preserve_order=True``, and publishes its
output as an ordered list of *entries* ``(block ref, first row, end row)`` (a Ray Data bundle's block
slices, in output order). Every rank reads the same list and computes from the row counts alone
which rows are its own (``cf_ray/data/_row_plan.py``); it fetches only the blocks holding them.
The actor decides nothing: it runs the pipeline, keeps each entry until every rank has read past
it (a rank that holds a block ref keeps the block alive on its own), and pulls from the pipeline
only while the ranks ask (``ahead_rows`` beyond the furthest request), so Ray Data's own
backpressure holds the rest.

Protocol, per rank and pass over an epoch (``key = (epoch, pass number)``, the same on every rank):
``entries(key, rank, start, ahead_rows, wait_s)`` returns the entries from index ``start`` (waiting
up to ``wait_s`` for at least one) and whether the epoch's stream has ended; ``start`` is also the
rank's acknowledgement of everything before it. ``done(key, rank)`` says the rank's pass is over
(its last batch, or its loop left it): when every rank has said so, the pass stops pulling from
the pipeline and lets go of its blocks. A pass is dropped too once every rank asked for a later one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, cast

from ray.train import DataConfig

#: (block ref, first row, end row) of one block slice, in stream order.
Entry = tuple[Any, int, int]


@dataclass(frozen=True, slots=True)
class ElasticShard:
    """What ``ray.train.get_dataset_shard(name)`` returns under :class:`ElasticDataConfig`: give it
    to ``cf_ray.data.ResumableRayDataIterator``."""

    stream: Any
    """The group's :class:`BlockStream` actor handle."""
    name: str
    rank: int
    world_size: int
    chunk_rows: int | None
    """Rows per chunk of the split (None: the iterator's batch size)."""
    equal: bool
    """Drop the remainder so every rank reads as many rows (Ray Train's default)."""

    def iter_batches(self, **_kwargs: Any) -> Any:
        """Not a ``DataIterator``: read it through ``cf_ray.data.ResumableRayDataIterator``."""
        raise TypeError(
            f"get_dataset_shard({self.name!r}) is a cf_ray ElasticShard (TorchTrainer(dataset_config="
            "cf_ray.data.elastic_data_config())); iterate it with cf_ray.data.ResumableRayDataIterator"
        )


class ElasticDataConfig(DataConfig):
    """A Ray Train ``DataConfig`` whose split datasets are split by cf_ray (see the module docstring).

    Build it with :func:`cf_ray.data.elastic_data_config`.
    """

    def __init__(
        self,
        *,
        chunk_rows: int | None = None,
        equal: bool = True,
        datasets_to_split: Any = "all",
        execution_options: Any = None,
    ) -> None:
        super().__init__(datasets_to_split=datasets_to_split, execution_options=execution_options)
        self.chunk_rows = chunk_rows
        self.equal = equal

    def configure(
        self,
        datasets: dict[str, Any],
        world_size: int,
        worker_handles: Any,
        worker_node_ids: Any,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        """Per rank, an :class:`ElasticShard` of every split dataset (Ray's iterator for the others)."""
        import ray

        split = set(datasets) if self._datasets_to_split == "all" else set(self._datasets_to_split)
        others = {n: d for n, d in datasets.items() if n not in split}
        output: list[dict[str, Any]] = (
            super().configure(others, world_size, worker_handles, worker_node_ids, **kwargs)
            if others
            else [{} for _ in range(world_size)]
        )
        for name, ds in datasets.items():
            if name not in split:
                continue
            if ds.name is None:
                ds.set_name(name)
            ds = ds.copy(ds)
            resolve = getattr(self, "_resolve_execution_options", None)
            options: Any = resolve(name) if callable(resolve) else self.default_ingest_options()
            options.preserve_order = True  # the order is the split: it must be the same in every run
            ds.context.execution_options = options
            stream = (
                ray.remote(BlockStream)
                .options(num_cpus=0, max_concurrency=max(8, 2 * world_size + 2), name=None)
                .remote(ds, world_size)
            )
            for rank in range(world_size):
                output[rank][name] = ElasticShard(stream, name, rank, world_size, self.chunk_rows, self.equal)
        return output


class _Pass:
    """One execution of the dataset (one pass over an epoch) and what the ranks have read of it."""

    def __init__(self, dataset: Any, world_size: int) -> None:
        self.cond = threading.Condition()
        self.entries: list[Entry | None] = []  # None: every rank has read past it
        self.released = 0  # entries before this index are None
        self.ended = False
        self.error: str | None = None
        self.starts = [0] * world_size  # next index each rank will ask for
        self.rows_after: list[int] = [0]  # cumulative rows: rows_after[i] = rows of entries[:i]
        self.ahead = 0  # rows to produce beyond the furthest request
        self.stopped = False
        self._it = dataset.iter_internal_ref_bundles()
        threading.Thread(target=self._produce, name="cf_ray-block-stream", daemon=True).start()

    def _produce(self) -> None:
        import ray
        from ray.data.block import BlockAccessor

        try:
            for bundle in self._it:
                for entry, block_slice in zip(bundle.blocks, bundle.slices):
                    if block_slice is not None:
                        lo, hi = block_slice.start_offset, block_slice.end_offset
                    else:
                        rows = entry.metadata.num_rows
                        if rows is None:  # rare: a block whose metadata has no row count
                            rows = BlockAccessor.for_block(ray.get(entry.ref)).num_rows()
                        lo, hi = 0, rows
                    if hi > lo:
                        with self.cond:
                            self.entries.append((entry.ref, lo, hi))
                            self.rows_after.append(self.rows_after[-1] + hi - lo)
                            self.cond.notify_all()
                with self.cond:
                    # Pull only while the ranks ask: Ray Data's backpressure keeps the rest.
                    self.cond.wait_for(
                        lambda: (
                            self.stopped
                            or self.rows_after[-1] - self.rows_after[min(max(self.starts), len(self.entries))]
                            < self.ahead
                        )
                    )
                    if self.stopped:
                        break
        except Exception as e:  # noqa: BLE001 - a failed pipeline is reported to every rank
            with self.cond:
                self.error = f"{type(e).__name__}: {e}"
        finally:
            with self.cond:
                self.ended = True
                self.cond.notify_all()
            close = getattr(self._it, "close", None)
            if callable(close):  # ends the pipeline's execution when the pass is dropped early
                try:
                    close()
                except Exception:  # noqa: BLE001 - the pass is over either way
                    pass

    def read(self, rank: int, start: int, ahead_rows: int, wait_s: float) -> tuple[list[Entry], bool]:
        with self.cond:
            if start < self.starts[rank]:
                raise RuntimeError(f"rank {rank} asked for entry {start} after reading to {self.starts[rank]}")
            self.starts[rank] = start
            self.ahead = max(self.ahead, ahead_rows)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.ended or len(self.entries) > start, timeout=wait_s)
            if self.error is not None:
                raise RuntimeError(f"the dataset's pipeline failed: {self.error}")
            if start < self.released:
                raise RuntimeError(f"rank {rank} asked for entries from {start}, already released")
            out = self.entries[start:]
            for i in range(self.released, min(self.starts)):  # every rank has read past these
                self.entries[i] = None
            self.released = max(self.released, min(self.starts))
            return cast("list[Entry]", out), self.ended

    def stop(self) -> None:
        """Stop pulling from the pipeline and let go of every block (the pass is over)."""
        with self.cond:
            self.stopped = True
            self.entries = [None] * len(self.entries)
            self.released = len(self.entries)
            self.cond.notify_all()


class BlockStream:
    """The actor: one :class:`_Pass` per ``(epoch, pass)`` key, dropped once every rank asked for a
    later key (see the module docstring)."""

    def __init__(self, dataset: Any, world_size: int) -> None:
        self._dataset = dataset
        self._world = world_size
        self._lock = threading.Lock()
        self._passes: dict[tuple[int, int], _Pass] = {}
        self._latest = [(-1, -1)] * world_size
        self._done: dict[tuple[int, int], set[int]] = {}

    def ping(self) -> bool:
        return True

    def done(self, key: tuple[int, int], rank: int) -> None:
        """``rank`` has ended pass ``key`` (its last batch, or its loop left): once every rank has,
        the pass stops and lets go of its blocks."""
        key = (int(key[0]), int(key[1]))
        with self._lock:
            self._done.setdefault(key, set()).add(rank)
            if len(self._done[key]) == self._world and key in self._passes:
                self._passes.pop(key).stop()

    def entries(
        self, key: tuple[int, int], rank: int, start: int, ahead_rows: int, wait_s: float
    ) -> tuple[list[Entry], bool]:
        """Entries of pass ``key`` from index ``start`` and whether the stream ended there."""
        key = (int(key[0]), int(key[1]))
        with self._lock:
            self._latest[rank] = max(self._latest[rank], key)
            oldest = min(self._latest)
            for k in [k for k in self._passes if k < oldest]:
                self._passes.pop(k).stop()
            run = self._passes.get(key)
            if run is None:
                if key < oldest or key in self._done:
                    raise RuntimeError(f"pass {key} was already released; every rank has moved on")
                run = self._passes[key] = _Pass(self._dataset, self._world)
        return run.read(rank, start, ahead_rows, wait_s)
