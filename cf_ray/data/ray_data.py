"""Ray Data: a resumable iterator over ``ray.train.get_dataset_shard(...)`` batches.

How it stays exactly once
-------------------------
Ray Train gives each worker a ``DataIterator`` (a ``streaming_split`` of the dataset, re-created
after every restart); every ``iter_batches`` call over it is one epoch. The iterator records the
rows this rank's loop has consumed in the current epoch; after a restart it iterates the new shard
again and drops that many rows before yielding, so the loop continues at the first unconsumed row.
That is exactly once if and only if a shard yields the same rows in the same order in every
execution, which holds when:

* order is preserved: ``ExecutionOptions(preserve_order=True)`` (use :func:`ordered_data_config`
  for ``TorchTrainer(dataset_config=...)``, or set
  ``DataContext.get_current().execution_options.preserve_order = True`` on the driver). Without
  it, Ray hands blocks to whichever worker asks first and to nodes by locality, and the split
  changes from run to run;
* every transformation is deterministic per row and per block: reads of fixed files,
  ``map``/``map_batches``/``filter``/``flat_map`` with deterministic functions (tasks or actor
  pools: ``preserve_order`` keeps their output in input order), ``select_columns``,
  ``repartition(shuffle=False)``, sorts on a unique key, ``random_shuffle(seed=...)`` and
  ``randomize_block_order(seed=...)`` with a fixed seed and the same input blocks, and a local
  shuffle through this class's ``local_shuffle_buffer_size`` (seeded with ``seed + epoch``, so
  each epoch has its own order and a resumed epoch the same one);
* and the world size is unchanged (Ray re-splits the data itself for another world size).

Unsafe: ``random_shuffle()``, ``randomize_block_order()`` or ``random_sample()`` without a seed,
``iter_batches(local_shuffle_buffer_size=...)`` called without a seed, and user functions whose
output depends on unseeded random numbers, time, or the worker that runs them.
``streaming_split(equal=True)`` (Ray Train's default) is deterministic but drops up to
``world_size - 1`` rows per epoch so that shards are equal; those rows are never seen, in any run.

Give ``id_column`` to have the order checked: the state then carries an order-independent digest
of the ids consumed, and a resume whose skipped rows do not have the same digest raises
:class:`~cf_ray.data.protocols.DataOrderError` instead of silently repeating or skipping rows.

Elastic resume: at an epoch boundary (every old rank at the start, or every old rank at the end of
the same epoch) a resume on another world size is accepted; in the middle of an epoch it raises
:class:`~cf_ray.errors.ElasticResumeError`, because the rows the old ranks consumed cannot be told
apart in Ray's new split. When mid-epoch elasticity matters, let cf_ray split the dataset:
``TorchTrainer(dataset_config=cf_ray.data.elastic_data_config())`` (this class then builds a
:class:`cf_ray.data.ray_elastic.ElasticRayDataIterator`; see that module for what it costs).

Compared with Ray's own Data checkpointing (Ray 2.60)
-----------------------------------------------------
Ray 2.60 has no class named ``DatasetCheckpointConfig``; its Data checkpointing is
``ray.data.checkpoint.CheckpointConfig`` (``PublicAPI(stability="beta")``, its
``CheckpointBackend`` is alpha), set as ``DataContext.checkpoint_config``. It requires a unique
``id_column``; when a plan ends in a ``Write`` (or a ``StreamingSplit``) and starts with a read, an
actor-pool filter after the read drops rows whose ids are in the checkpoint; the ids are written,
per block, by the ``Write`` operator after the block is written, and the checkpoint is deleted when
the job succeeds. It is built for one-pass batch inference ("skip rows already written"), and for
training it falls short:

* nothing records what a training loop consumed: with a ``StreamingSplit`` Ray only filters, so
  the ids would have to be written by us, and they would not be tied to the model checkpoint they
  belong to (ids written after the last committed model checkpoint are skipped on resume: lost
  data);
* it has no notion of epochs: an id once written is filtered out of every later epoch;
* the path must be shared storage (object store or network file system) and the filter reserves an
  actor pool (1 GiB per actor by default); loading the checkpoint reads every saved id.

Where it is better: it filters *before* the split, so consumed rows are neither read into the
training workers nor counted in ``equal=True`` balancing, and it does not need a deterministic
order. For a single-pass job over a nondeterministic pipeline that is the right tool; cf_ray does
not wrap it, because its ids are not committed atomically with the model state. This iterator
keeps the position in the same committed state as the weights (two ints and an optional digest),
works across epochs and needs no shared path, at the cost of re-reading (and dropping) the consumed
rows of the interrupted epoch on resume and of requiring a deterministic order.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from cf_ray._engine.data.checks import (
    FORMAT_KEY,
    check_elastic_states,
    check_format,
    check_int,
    check_same,
    id_digest,
    resolve_world,
)
from cf_ray.data.protocols import DataOrderError
from cf_ray.errors import ConfigError, ElasticResumeError

_MASK = (1 << 64) - 1


def ordered_data_config(**kwargs: Any):
    """A ``ray.train.DataConfig`` whose shards keep a deterministic order (``preserve_order``).

    Args:
        **kwargs: passed to ``ray.train.DataConfig`` (e.g. ``datasets_to_split``).

    Returns:
        The config, for ``TorchTrainer(dataset_config=...)``.
    """
    from ray.train import DataConfig

    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return DataConfig(execution_options=options, **kwargs)


class ResumableRayDataIterator:
    """Batches of a Ray Data shard, resumable at batch level across restarts.

    Example::

        shard = ray.train.get_dataset_shard("train")
        it = ResumableRayDataIterator(shard, batch_size=256, id_column="id")
        ckpt = cf_ray.Checkpointer(..., data={"train": it})
        resume = ckpt.restore()
        for epoch in range(resume.epoch, epochs):
            it.set_epoch(epoch)
            for batch in it:              # a dict of numpy arrays (batch_format="numpy")
                ...

    Args:
        shard: the ``ray.data.DataIterator`` of this rank (``ray.train.get_dataset_shard``), or a
            ``ray.data.Dataset`` read whole by this rank.
        batch_size: rows per batch; must be the same when resuming.
        rank: this worker's rank (recorded in the state); defaults to torch.distributed's, else 0.
        world_size: number of workers; defaults to torch.distributed's, else 1.
        id_column: a column with a unique id per row; if given, a resume checks that it skips the
            same rows as were consumed (see the module docstring).
        seed: seeds the local shuffle (``seed + epoch``) when ``local_shuffle_buffer_size`` is set.
        local_shuffle_buffer_size: rows of Ray's local shuffle buffer; None for no local shuffle.
        torch_batches: yield ``iter_torch_batches`` output (dict of tensors) instead of
            ``iter_batches`` output.
        **iter_kwargs: other arguments of ``iter_batches`` / ``iter_torch_batches``
            (``batch_format``, ``prefetch_batches``, ``drop_last``, ``collate_fn``, ``device``,
            ...). Default ``batch_format`` is ``"numpy"``.

    Raises:
        ConfigError: an argument is invalid.
    """

    FORMAT = "cf_ray.ResumableRayDataIterator/1"

    def __new__(cls, shard: Any = None, *args: Any, **kwargs: Any) -> Any:
        """A shard of :func:`cf_ray.data.elastic_data_config` gets the elastic iterator
        (:class:`cf_ray.data.ray_elastic.ElasticRayDataIterator`, same arguments); any other shard
        this class."""
        # An ElasticShard was unpickled (or built) only if its module is loaded: no import otherwise.
        stream = sys.modules.get("cf_ray._engine.data.block_stream")
        if cls is ResumableRayDataIterator and stream is not None and isinstance(shard, stream.ElasticShard):
            from cf_ray.data.ray_elastic import ElasticRayDataIterator

            return ElasticRayDataIterator(shard, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        shard: Any,
        *,
        batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        id_column: str | None = None,
        seed: int = 0,
        local_shuffle_buffer_size: int | None = None,
        torch_batches: bool = False,
        **iter_kwargs: Any,
    ) -> None:
        if not hasattr(shard, "iter_batches"):
            raise ConfigError(
                f"shard={type(shard).__name__} is neither a ray.data.DataIterator "
                "nor a Dataset; pass ray.train.get_dataset_shard(name)"
            )
        check_int("batch_size", batch_size, minimum=1)
        check_int("seed", seed, minimum=0)
        if local_shuffle_buffer_size is not None:
            check_int("local_shuffle_buffer_size", local_shuffle_buffer_size, minimum=1)
        if id_column is not None and (not isinstance(id_column, str) or not id_column):
            raise ConfigError(f"id_column={id_column!r} must be a column name or None")
        for key in ("batch_size", "local_shuffle_seed"):
            if key in iter_kwargs:
                raise ConfigError(f"{key}= is set by ResumableRayDataIterator; use batch_size= and seed=")
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.shard = shard
        self.batch_size = batch_size
        self.id_column = id_column
        self.seed = seed
        self.local_shuffle_buffer_size = local_shuffle_buffer_size
        self.torch_batches = torch_batches
        if not torch_batches:
            iter_kwargs.setdefault("batch_format", "numpy")
        self.iter_kwargs = iter_kwargs
        self.epoch = 0
        self._rows = 0
        self._complete = False
        self._digest = 0
        self._resumed = False

    @property
    def consumed(self) -> int:
        """Rows of the current epoch consumed by the loop on this rank."""
        return self._rows

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass; the current epoch keeps its (restored) position.

        Args:
            epoch: the epoch number (an int >= 0).
        """
        check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch, self._rows, self._complete, self._digest = epoch, 0, False, 0
            self._resumed = False

    def __iter__(self) -> Iterator[Any]:
        if self._complete and self._resumed:
            self._resumed = False
            return  # the restored epoch was finished: nothing to replay
        if self._complete:  # a new pass over a finished epoch repeats it, as torch does
            self._rows, self._complete, self._digest = 0, False, 0
        skip, want = self._rows, self._digest
        self._resumed = False
        self._rows, self._digest = 0, 0
        kwargs = dict(self.iter_kwargs, batch_size=self.batch_size)
        if self.local_shuffle_buffer_size is not None:
            kwargs.update(
                local_shuffle_buffer_size=self.local_shuffle_buffer_size, local_shuffle_seed=self.seed + self.epoch
            )
        method = self.shard.iter_torch_batches if self.torch_batches else self.shard.iter_batches
        for batch in method(**kwargs):
            n = _num_rows(batch)
            if self._rows < skip:
                # Re-read and drop what the loop consumed before the restart.
                self._count(batch, n)
                if self._rows > skip:
                    raise DataOrderError(
                        f"ResumableRayDataIterator: the restored position ({skip} rows) is not at a "
                        f"batch boundary of this run ({self._rows} rows after this batch); keep "
                        "batch_size and drop_last as in the run that saved the checkpoint"
                    )
                if self._rows == skip:
                    self._check_digest(want, skip)
                continue
            self._count(batch, n)
            yield batch
        if self._rows < skip:
            raise DataOrderError(
                f"ResumableRayDataIterator: the shard of rank {self.rank} ended after {self._rows} "
                f"rows but the checkpoint had consumed {skip}; the data or its split changed. "
                "Use the same dataset, world size and ordered_data_config()"
            )
        self._complete = True

    def _count(self, batch: Any, n: int) -> None:
        self._rows += n
        if self.id_column is not None:
            self._digest = (self._digest + id_digest(batch, self.id_column)) & _MASK

    def _check_digest(self, want: int, rows: int) -> None:
        if self.id_column is not None and self._digest != want:
            raise DataOrderError(
                f"ResumableRayDataIterator: the first {rows} rows of epoch {self.epoch} on rank "
                f"{self.rank} are not the rows consumed before the restart (ids differ), so the "
                "order is not deterministic and resuming would repeat or skip rows. Use "
                "TorchTrainer(dataset_config=cf_ray.data.ordered_data_config()) and only "
                "deterministic transformations (see cf_ray.data.ray_data)"
            )

    def state_dict(self) -> dict[str, Any]:
        """Return ``{epoch, rows consumed, complete, id digest, settings}`` (JSON-able)."""
        return {
            FORMAT_KEY: self.FORMAT,
            **self._settings(),
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "consumed": self._rows,
            "complete": self._complete,
            # Hex string: JSON readers elsewhere lose precision on 64-bit integers.
            "ids_digest": f"{self._digest:016x}" if self.id_column is not None else None,
        }

    def _settings(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "id_column": self.id_column,
            "seed": self.seed,
            "local_shuffle_buffer_size": self.local_shuffle_buffer_size,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` on the same world size.

        Raises:
            ConfigError: the state was saved with other settings or is malformed.
            ElasticResumeError: the state was saved with another world size.
        """
        owner = type(self).__name__
        check_format(state_dict, self.FORMAT, owner)
        check_same(
            owner,
            state_dict,
            self._settings(),
            {
                "batch_size": "Use the batch_size of the run that saved the checkpoint, so the "
                "consumed rows end on a batch boundary"
            },
        )
        if state_dict.get("world_size") != self.world_size:
            raise ElasticResumeError(
                f"{owner}: the state was saved with world_size={state_dict.get('world_size')}, this "
                f"run has {self.world_size}; call load_elastic_state() with every old rank's state"
            )
        if state_dict.get("rank") != self.rank:
            raise ConfigError(
                f"{owner}: the state belongs to rank {state_dict.get('rank')}, this is "
                f"rank {self.rank}; load each rank's own state"
            )
        try:
            epoch = check_int("epoch", state_dict["epoch"], minimum=0)
            rows = check_int("consumed", state_dict["consumed"], minimum=0)
            complete = state_dict["complete"]
            digest = state_dict["ids_digest"]
            digest = int(digest, 16) if digest is not None else 0
            if not isinstance(complete, bool):
                raise TypeError("complete must be a bool")
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise ConfigError(f"{owner}: malformed state ({e}); pass a dict saved by {owner}.state_dict()") from None
        self.epoch, self._rows, self._complete, self._digest = epoch, rows, complete, digest
        self._resumed = True

    def load_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Resume on another world size; possible only at an epoch boundary.

        Raises:
            ElasticResumeError: the old ranks were in the middle of an epoch.
        """
        owner = type(self).__name__
        if (rank, world_size) != (self.rank, self.world_size):
            raise ConfigError(
                f"{owner} was built for rank {self.rank} of {self.world_size} but "
                f"load_elastic_state() was called for rank {rank} of {world_size}"
            )
        old_world = check_elastic_states(owner, states, self.FORMAT, [*self._settings(), "epoch"])
        if old_world == world_size:
            self.load_state_dict(states[rank])
            return
        check_same(owner, states[0], self._settings(), {})
        epoch = check_int("epoch", states[0]["epoch"], minimum=0)
        if all(s.get("complete") is True for s in states):
            self.epoch, self._rows, self._complete, self._digest = epoch, 0, True, 0
        elif all(s.get("consumed") == 0 and s.get("complete") is False for s in states):
            self.epoch, self._rows, self._complete, self._digest = epoch, 0, False, 0
        else:
            consumed = [s.get("consumed") for s in states]
            raise ElasticResumeError(
                f"{owner}: cannot resume epoch {epoch} on {world_size} workers from the middle of "
                f"the epoch (old ranks had consumed {consumed} rows): Ray Data re-splits the "
                "dataset when the number of workers changes, so the consumed rows cannot be told "
                f"apart. Resume with {old_world} workers, or checkpoint at epoch ends only "
                "(cf_ray.EpochEnd), or let cf_ray split the dataset, which re-splits mid-epoch: "
                "TorchTrainer(dataset_config=cf_ray.data.elastic_data_config())"
            )
        self._resumed = True


def _num_rows(batch: Any) -> int:
    if hasattr(batch, "num_rows"):  # pyarrow.Table
        return int(batch.num_rows)
    if isinstance(batch, Mapping):
        for value in batch.values():
            return len(value)
        return 0
    return len(batch)  # pandas.DataFrame
