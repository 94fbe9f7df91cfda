"""Ray Data, exactly once across a change of world size in the middle of an epoch.

Ray's own split (``streaming_split``) decides at run time which worker gets which block, so after a
restart on another number of workers nobody can tell which rows the old workers had consumed. With
``TorchTrainer(dataset_config=cf_ray.data.elastic_data_config())`` cf_ray splits the dataset itself,
from what is deterministic: the *order of the rows* the pipeline produces (``preserve_order=True``).

* One actor per worker group (``cf_ray/_engine/data/block_stream.py``) runs the pipeline once per
  epoch and publishes its blocks, in order, with their row counts.
* Every rank computes the same split from the row counts alone (``cf_ray/data/_row_plan.py``):
  chunks of ``chunk_rows`` rows dealt round-robin, the last round shared evenly, and fetches only
  the blocks that hold its rows.
* A rank's position is the number of rows of its plan the loop consumed. After a restart on another
  number of workers, the rows no old rank consumed are split over the new ranks, in order; several
  restarts within an epoch stack. Every row of the epoch is read once (``equal=True``, the default,
  drops at the end of the epoch fewer rows than there are ranks, so that every rank has as many
  batches, as Ray Train's own split does; ``equal=False`` reads every row and lets ranks differ by
  one row).

**Deterministic pipelines** (the condition for exactly once): the rows, and their order, must be the
same in every execution; block boundaries may differ. That holds for reads of fixed files or
``ray.data.range``/``from_items``, ``map``/``map_batches``/``flat_map``/``filter`` with functions
that depend only on their input, ``select_columns``/``rename_columns``/``drop_columns``,
``repartition(shuffle=False)``, ``limit``, and ``sort`` on a unique key. It does *not* hold for
``random_shuffle``, ``randomize_block_order`` and ``random_sample`` without a seed (with one, their
output still depends on the input blocks: at best they repeat when the read's block count is fixed
with ``override_num_blocks``), functions that use unseeded randomness, time or the worker they run
on, or sources that change between runs. Give
``id_column`` to have each resume check that the rows before the resume point are the rows consumed
(it reads the last consumed batch of each old rank again): a non-deterministic pipeline then raises
:class:`~cf_ray.data.DataOrderError` instead of silently repeating or skipping rows.

What it costs, against plain Ray Data iteration (``benchmarks/ray_data_split.py`` prints both):
one actor call per batch of blocks, the batches assembled by cf_ray (slices of Arrow blocks
concatenated, then formatted), no prefetching thread, and ``chunk_rows`` decides locality: a rank
fetches every block that holds one of its chunks, so with chunks smaller than blocks each block is
read by several ranks (zero-copy from the node's object store; across nodes a transfer each). On
resume the pipeline runs again from the start of the epoch (as with Ray's split) but the consumed
rows' blocks are neither fetched nor batched. Where it stops: no ``local_shuffle_buffer_size``
(shuffle in the pipeline, deterministically, e.g. by a seeded key column and ``sort``), no
``collate_fn``/``device``/``dtypes`` for torch batches (``torch_batches=True`` gives a dict of CPU
tensors), and the rows must be the same rows in the same order in every run.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cf_ray._engine.data.checks import (
    FORMAT_KEY,
    check_elastic_states,
    check_format,
    check_history,
    check_int,
    check_same,
    id_digest,
    resolve_world,
)
from cf_ray.data._row_plan import PlanOrderError, RowPlan
from cf_ray.data.protocols import DataOrderError
from cf_ray.errors import ConfigError, ElasticResumeError

if TYPE_CHECKING:  # importing them imports ray.train (seconds): only when an elastic split is used
    from cf_ray._engine.data.block_stream import ElasticDataConfig, ElasticShard

_FORMATS = ("numpy", "pandas", "pyarrow")
_WAIT_S = 1.0


def elastic_data_config(
    *, chunk_rows: int | None = None, equal: bool = True, datasets_to_split: Any = "all", execution_options: Any = None
) -> ElasticDataConfig:
    """A ``ray.train.DataConfig`` under which cf_ray splits the datasets itself, so that a restart on
    another number of workers mid-epoch reads every row once (see :mod:`cf_ray.data.ray_elastic`).

    Args:
        chunk_rows: rows per chunk of the split; None: the iterator's ``batch_size``. Larger chunks
            (about a block's rows) mean fewer blocks read by several ranks; the last round of an
            epoch is shared to the row. Must stay the same across the resumes of a run.
        equal: every rank reads as many rows (the remainder, fewer rows than ranks, is dropped at
            the end of the epoch); False reads every row, ranks differing by at most one row.
        datasets_to_split: as ``ray.train.DataConfig``; the other datasets get Ray's own iterator.
        execution_options: as ``ray.train.DataConfig``; ``preserve_order`` is always set.

    Returns:
        The config, for ``TorchTrainer(dataset_config=...)``.

    Raises:
        ConfigError: ``chunk_rows`` is not an int >= 1 or ``equal`` not a bool.
    """
    if chunk_rows is not None:
        check_int("chunk_rows", chunk_rows, minimum=1)
    if not isinstance(equal, bool):
        raise ConfigError(f"equal={equal!r} must be True or False")
    from cf_ray._engine.data.block_stream import ElasticDataConfig

    return ElasticDataConfig(
        chunk_rows=chunk_rows, equal=equal, datasets_to_split=datasets_to_split, execution_options=execution_options
    )


@dataclass(frozen=True, slots=True)
class _Batching:
    """How an :class:`ElasticRayDataIterator` cuts its rows into batches (fixed at construction)."""

    chunk_rows: int
    """Rows dealt to a rank at a time (the shard's, else one batch)."""
    equal: bool
    """Every rank gets the same number of rows (a few at the end of an epoch are dropped)."""
    drop_last: bool
    batch_format: str
    torch_batches: bool


class ElasticRayDataIterator:
    """Batches of an :class:`ElasticShard`, resumable at any world size. Built by
    ``cf_ray.data.ResumableRayDataIterator(shard, ...)`` when ``shard`` comes from
    :func:`elastic_data_config`; takes the same arguments (see the module docstring for what it
    does not support).

    Raises:
        ConfigError: an argument is invalid or not supported here.
    """

    FORMAT = "cf_ray.ElasticRayDataIterator/1"

    def __init__(
        self,
        shard: ElasticShard,
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
        check_int("batch_size", batch_size, minimum=1)
        check_int("seed", seed, minimum=0)  # accepted for the same signature; nothing here is random
        if local_shuffle_buffer_size is not None:
            raise ConfigError(
                "local_shuffle_buffer_size is not supported with elastic_data_config(): a local shuffle "
                "reorders rows across batches, so a position is no longer a prefix of the rank's rows. "
                "Shuffle deterministically in the pipeline instead (a seeded key column and sort)"
            )
        if id_column is not None and (not isinstance(id_column, str) or not id_column):
            raise ConfigError(f"id_column={id_column!r} must be a column name or None")
        fmt = iter_kwargs.pop("batch_format", "numpy")
        drop_last = iter_kwargs.pop("drop_last", False)
        iter_kwargs.pop("prefetch_batches", None)  # cf_ray reads its blocks itself
        if iter_kwargs or fmt not in _FORMATS or not isinstance(drop_last, bool):
            raise ConfigError(
                f"with elastic_data_config() the batches take batch_format in {_FORMATS}, drop_last and "
                f"torch_batches=True (a dict of CPU tensors) only; got batch_format={fmt!r}, "
                f"drop_last={drop_last!r}, {sorted(iter_kwargs)}"
            )
        self.rank, self.world_size = resolve_world(
            shard.rank if rank is None else rank, shard.world_size if world_size is None else world_size
        )
        if (self.rank, self.world_size) != (shard.rank, shard.world_size):
            raise ConfigError(
                f"rank={self.rank}, world_size={self.world_size} differ from the shard's "
                f"({shard.rank} of {shard.world_size}); leave them out"
            )
        self.shard = shard
        self.batch_size = batch_size
        self.id_column = id_column
        self.batching = _Batching(
            chunk_rows=shard.chunk_rows or batch_size,
            equal=shard.equal,
            drop_last=drop_last,
            batch_format=fmt,
            torch_batches=torch_batches,
        )
        self.epoch = 0
        self._rows = 0
        self._complete = False
        self._resumed = False
        self._history: list[dict[str, Any]] = []
        self._last: dict[str, Any] | None = None  # the last consumed batch: global rows, id digest
        self._verify: list[dict[str, Any]] = []  # checks of old ranks' last batches, run at the next pass
        self._passes: dict[int, int] = {}

    @property
    def consumed(self) -> int:
        """Rows of this rank's plan of the current epoch that the loop has consumed."""
        return self._rows

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next pass; the current epoch keeps its (restored) position."""
        check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch, self._rows, self._complete, self._resumed = epoch, 0, False, False
            self._history, self._last, self._verify = [], None, []

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        if self._complete and self._resumed:
            self._resumed = False
            return  # the restored epoch was finished: nothing to replay
        if self._complete:  # a new pass over a finished epoch repeats it, on this world size
            self._rows, self._complete, self._history, self._last = 0, False, [], None
        self._resumed = False
        npass = self._passes[self.epoch] = self._passes.get(self.epoch, -1) + 1
        reader = _Reader(self.shard, (self.epoch, npass), 2 * self.world_size * self.batching.chunk_rows)
        history = [(h["world_size"], h["consumed"]) for h in self._history]
        plan = RowPlan(
            chunk=self.batching.chunk_rows,
            equal=self.batching.equal,
            history=history,
            world=self.world_size,
            rank=self.rank,
        )
        try:
            yield from self._pass(reader, plan)
        finally:  # the last batch, or the loop left: the actor lets go of the pass once every rank has
            try:
                self.shard.stream.done.remote(reader.key, self.rank)
            except Exception:  # noqa: BLE001 - Ray shutting down, or the group's actor gone: nothing to release
                pass

    def _pass(self, reader: _Reader, plan: RowPlan) -> Iterator[Any]:
        k = self._rows
        parts: list[Any] = []
        runs: list[list[int]] = []
        have = 0
        try:
            for check in self._verify:
                self._check_rows(reader, check)  # may read ahead; releases nothing
            self._verify = []
            while True:
                want = min(self.batch_size - have, plan.stretch(k))
                n = plan.length(reader.avail, reader.ended)
                if n is not None:
                    want = min(want, n - k)
                    if want <= 0:
                        break
                got = plan.rows(k, k + want, reader.avail, reader.ended)
                if got is None:
                    reader.more()
                    continue
                parts += reader.take(got)
                runs += [[a, b] for a, b in got]
                have, k = have + want, k + want
                if have == self.batch_size:
                    yield self._emit(parts, runs, k)
                    parts, runs, have = [], [], 0
        except PlanOrderError as e:
            raise DataOrderError(
                f"ResumableRayDataIterator (rank {self.rank}): {e}. The dataset produced fewer rows than the "
                "checkpoint had consumed: the data or the pipeline changed. Use the same, deterministic "
                "pipeline (see cf_ray.data.ray_elastic)"
            ) from None
        if have and not self.batching.drop_last:
            yield self._emit(parts, runs, k)
        self._complete = True

    def _emit(self, parts: list[Any], runs: list[list[int]], k: int) -> Any:
        import pyarrow as pa

        table = parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")
        self._rows = k  # counted as the loop receives it: a state taken after its step includes it
        self._last = {"rows": runs, "digest": _digest(table, self.id_column)}
        return _format(table, self.batching.batch_format, self.batching.torch_batches)

    def _check_rows(self, reader: _Reader, check: Mapping[str, Any]) -> None:
        runs = [(int(a), int(b)) for a, b in check["rows"]]
        while not reader.ended and reader.avail < runs[-1][1]:
            reader.more()
        if reader.avail < runs[-1][1]:
            raise PlanOrderError(f"the stream ended after {reader.avail} rows")  # said as DataOrderError below
        if _digest(_concat(reader.take(runs, release=False)), self.id_column) != check["digest"]:
            raise DataOrderError(
                f"ResumableRayDataIterator (rank {self.rank}): the rows at positions {runs[:3]}... of epoch "
                f"{self.epoch} are not the rows the old rank {check['rank']} consumed there (ids differ), so the "
                "pipeline is not deterministic and resuming would repeat or skip rows. Use only deterministic "
                "transformations (see cf_ray.data.ray_elastic)"
            )

    # ------------------------------------------------------------------ state

    def _settings(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "chunk_rows": self.batching.chunk_rows,
            "equal": self.batching.equal,
            "id_column": self.id_column,
            "drop_last": self.batching.drop_last,
        }

    def state_dict(self) -> dict[str, Any]:
        """Return the position: settings, epoch, world size, rank, rows consumed, the epoch's
        earlier world sizes and their consumption, the last batch's rows and id digest."""
        return {
            FORMAT_KEY: self.FORMAT,
            **self._settings(),
            "epoch": self.epoch,
            "world_size": self.world_size,
            "rank": self.rank,
            "consumed": self._rows,
            "complete": self._complete,
            "history": [dict(h, consumed=list(h["consumed"])) for h in self._history],
            "last": None if self._last is None else dict(self._last, rank=self.rank),
        }

    def validate_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Every check :meth:`load_state_dict` makes, changing nothing."""
        self._parse(state_dict)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` with the same world size.

        Raises:
            ConfigError: other settings, another rank, or a malformed state.
            ElasticResumeError: another world size (use :meth:`load_elastic_state`).
        """
        epoch, rows, complete, history, last = self._parse(state_dict)
        self._set(epoch, rows, complete, history, [last] if last is not None and self.id_column else [])
        self._last = last

    def validate_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Every check :meth:`load_elastic_state` makes, changing nothing."""
        self._elastic(states, rank, world_size)

    def load_elastic_state(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> None:
        """Resume on another world size: the rows of the epoch that no old rank consumed are split
        over the new ranks (a mid-epoch restart included).

        Raises:
            ConfigError: settings differ, or the states are malformed.
            ElasticResumeError: the states are not one consistent checkpoint of every old rank.
        """
        got = self._elastic(states, rank, world_size)
        if got is None:
            self.load_state_dict(states[rank])
        else:
            self._set(*got)
            self._last = None

    def _elastic(self, states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> tuple | None:
        owner = "ResumableRayDataIterator"
        if (rank, world_size) != (self.rank, self.world_size):
            raise ConfigError(
                f"{owner} was built for rank {self.rank} of {self.world_size} but load_elastic_state() was "
                f"called for rank {rank} of {world_size}"
            )
        old_world = check_elastic_states(owner, states, self.FORMAT, [*self._settings(), "epoch", "history"])
        if old_world == world_size:
            self._parse(states[rank])
            return None
        parsed = [self._parse(s, elastic=True) for s in states]
        epoch, history = parsed[0][0], parsed[0][3]
        if all(p[2] for p in parsed):
            return epoch, 0, True, [], []
        consumed = [p[1] for p in parsed]
        if not history and not any(consumed):
            return epoch, 0, False, [], []
        checks = [p[4] for r, p in enumerate(parsed) if p[4] is not None and self.id_column and r % world_size == rank]
        return epoch, 0, False, [*history, {"world_size": old_world, "consumed": consumed}], checks

    def _parse(self, state: Mapping[str, Any], *, elastic: bool = False) -> tuple:
        owner = "ResumableRayDataIterator"
        check_format(state, self.FORMAT, owner)
        check_same(
            owner,
            state,
            self._settings(),
            {
                "batch_size": "Use the batch_size of the run that saved the checkpoint",
                "chunk_rows": "Use the chunk_rows (elastic_data_config) and batch_size of the run that saved it",
            },
        )
        if not elastic and state.get("world_size") != self.world_size:
            raise ElasticResumeError(
                f"{owner}: the state was saved with world_size={state.get('world_size')}, this run has "
                f"{self.world_size}; call load_elastic_state() with every old rank's state"
            )
        if not elastic and state.get("rank") != self.rank:
            raise ConfigError(f"{owner}: the state belongs to rank {state.get('rank')}, this is rank {self.rank}")
        try:
            epoch = check_int("epoch", state["epoch"], minimum=0)
            rows = check_int("consumed", state["consumed"], minimum=0)
            complete = state["complete"]
            if not isinstance(complete, bool):
                raise TypeError("complete must be a bool")
            history = check_history(state["history"])
            last = state["last"]
            if last is not None:
                runs = [
                    [check_int("last.rows", a, minimum=0), check_int("last.rows", b, minimum=0)]
                    for a, b in last["rows"]
                ]
                if not runs or any(a >= b for a, b in runs) or not isinstance(last["digest"], (str, type(None))):
                    raise ValueError("malformed last batch")
                last = {"rows": runs, "digest": last["digest"], "rank": check_int("last.rank", last["rank"], minimum=0)}
        except (KeyError, TypeError, ValueError, ConfigError) as e:
            raise ConfigError(f"{owner}: malformed state ({e}); pass a dict saved by its state_dict()") from None
        return epoch, rows, complete, history, last

    def _set(self, epoch: int, rows: int, complete: bool, history: list, checks: list) -> None:
        self.epoch, self._rows, self._complete, self._history = epoch, rows, complete, history
        self._verify = list(checks)
        self._resumed = True


class _Reader:
    """This rank's view of one pass's block stream: the entries read so far (refs released once the
    rank is past them) and the blocks it fetched for its current rows."""

    def __init__(self, shard: ElasticShard, key: tuple[int, int], ahead_rows: int) -> None:
        self.shard, self.key, self.ahead = shard, key, ahead_rows
        self.refs: list[Any] = []
        self.lo: list[int] = []  # first row of each entry in its block
        self.starts: list[int] = [0]  # global position of each entry's first row (+ the end)
        self.ended = False
        self._released = 0
        self._cache: dict[int, Any] = {}

    @property
    def avail(self) -> int:
        return self.starts[-1]

    def more(self) -> None:
        import ray

        got, ended = ray.get(
            self.shard.stream.entries.remote(self.key, self.shard.rank, len(self.refs), self.ahead, _WAIT_S)
        )
        for ref, lo, hi in got:
            self.refs.append(ref)
            self.lo.append(lo)
            self.starts.append(self.starts[-1] + hi - lo)
        self.ended = ended

    def take(self, runs: Sequence[tuple[int, int]], *, release: bool = True) -> list[Any]:
        """Arrow tables of the global rows ``runs`` (known rows only); with ``release``, the blocks
        before them are let go (a rank's rows only move forward)."""
        import ray
        from ray.data.block import BlockAccessor

        out = []
        first = bisect.bisect_right(self.starts, runs[0][0]) - 1
        if release:
            for i in range(self._released, first):
                self.refs[i] = None
                self._cache.pop(i, None)
            self._released = max(self._released, first)
        for a, b in runs:
            i = bisect.bisect_right(self.starts, a) - 1
            while a < b:
                s, e = self.starts[i], self.starts[i + 1]
                n = min(b, e) - a
                if i not in self._cache:
                    self._cache[i] = BlockAccessor.for_block(ray.get(self.refs[i]))
                acc = self._cache[i]
                lo = self.lo[i] + (a - s)
                out.append(BlockAccessor.for_block(acc.slice(lo, lo + n, copy=False)).to_arrow())
                a += n
                i += 1
        return out


def _concat(parts: list[Any]) -> Any:
    import pyarrow as pa

    return parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")


def _digest(table: Any, column: str | None) -> str | None:
    if column is None:
        return None
    if column not in table.column_names:
        raise ConfigError(f"id_column={column!r} is not a column of the dataset (it has {table.column_names})")
    return f"{id_digest({column: table.column(column).to_numpy()}, column):016x}"


def _format(table: Any, fmt: str, torch_batches: bool) -> Any:
    if torch_batches:
        import torch

        arrays = _format(table, "numpy", False).items()  # Arrow's views are read-only: torch gets a copy of those
        return {k: torch.as_tensor(v if v.flags.writeable else np.array(v)) for k, v in arrays}
    if fmt == "pyarrow":
        return table
    if fmt == "pandas":
        return table.to_pandas()
    from ray.data.block import BlockAccessor

    return BlockAccessor.for_block(table).to_batch_format("numpy")
