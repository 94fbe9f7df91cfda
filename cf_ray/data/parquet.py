"""Parquet files read through pyarrow, resumable at row level.

The rows of all files form one *stream* per epoch: the row groups in file order (or, with
``shuffle``, in an order drawn from ``(seed, epoch)``, each row group's rows permuted too). Rank
``r`` of ``W`` reads the ``r``-th contiguous ``1/W`` of the stream, so it touches only the row
groups of its range. The position is a row count, so a resumed reader seeks to the row group
holding its next row, reads it and every later one, and never the row groups it had consumed.

An elastic resume splits the rows no old rank had consumed (a few intervals of the stream) into
contiguous parts for the new ranks: the state stays a handful of ints however large the data.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import posixpath
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cf_ray._engine.data.checks import check_int
from cf_ray._engine.data.cursor import EpochCursor
from cf_ray.errors import ConfigError

_FORMATS = ("pyarrow", "numpy", "pandas")

Interval = list[int]  # [start, stop) in stream rows; a list, not a tuple, to stay JSON-shaped


class _Layout(NamedTuple):
    """One epoch's order of the row groups (units) and the first stream row of each, in that order."""

    epoch: int
    order: np.ndarray
    starts: list[int]


class ResumableParquetReader(EpochCursor):
    """Batches of rows from Parquet files, per rank, resumable at row level and elastic.

    Example::

        reader = ResumableParquetReader(["s3://bucket/a.parquet", "s3://bucket/b.parquet"],
                                        batch_size=1024, columns=["id", "x"], shuffle=True)
        ckpt = cf_ray.Checkpointer(..., data={"reader": reader})
        for epoch in range(resume.epoch, epochs):
            reader.set_epoch(epoch)
            for table in reader:          # a pyarrow.Table of up to batch_size rows
                ...

    Args:
        paths: a file, a directory (its ``*.parquet`` files, sorted), or a list of files. The
            order of the files is part of the data's identity; keep it across restarts.
        batch_size: rows per batch (the last batch of a rank's epoch may be smaller). It may
            change between runs: the position is kept in rows.
        columns: columns to read (default: all).
        rank: this worker's rank; defaults to torch.distributed's, else 0.
        world_size: number of workers; defaults to torch.distributed's, else 1.
        shuffle: each epoch, visit the row groups in an order drawn from ``(seed, epoch)`` and
            permute the rows inside each row group. Rows of different row groups are not mixed
            (that would need every row group in memory).
        seed: seed of the shuffle; the same on every rank.
        drop_last: drop the tail rows of the stream so every rank gets the same number of rows
            (as ``DistributedSampler(drop_last=True)``); otherwise counts differ by at most one
            and every row is read exactly once per epoch.
        batch_format: ``"pyarrow"`` (a ``pyarrow.Table``), ``"numpy"`` (a dict of arrays) or
            ``"pandas"``.
        filesystem: a ``pyarrow.fs.FileSystem``; by default inferred from the paths.

    Raises:
        ConfigError: an argument is invalid or a path holds no Parquet file.
    """

    FORMAT = "cf_ray.ResumableParquetReader/1"

    def __init__(
        self,
        paths: str | Sequence[str],
        *,
        batch_size: int,
        columns: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        batch_format: str = "pyarrow",
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        super().__init__(rank=rank, world_size=world_size)
        check_int("batch_size", batch_size, minimum=1)
        check_int("seed", seed, minimum=0)
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be True or False")
        if batch_format not in _FORMATS:
            raise ConfigError(f"batch_format={batch_format!r} must be one of {_FORMATS}")
        self.batch_size = batch_size
        self.columns = list(columns) if columns is not None else None
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.batch_format = batch_format
        self._fs, self.paths = _resolve(paths, filesystem)
        # Only footers are read here: row counts per row group, the unit of reading.
        self._units: list[tuple[int, int, int]] = []  # (file index, row group, rows)
        per_file = []
        for f, path in enumerate(self.paths):
            with self._fs.open_input_file(path) as fh:
                meta = pq.ParquetFile(fh).metadata
            rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            per_file.append([posixpath.basename(path), rows])
            self._units += [(f, g, n) for g, n in enumerate(rows) if n > 0]
        self.num_rows = sum(n for _, _, n in self._units)
        # Names and row counts identify the data: the same files under another mount still match.
        self._digest = hashlib.sha256(json.dumps(per_file).encode()).hexdigest()[:16]
        self._layout: _Layout | None = None
        """The epoch's order of the units and their first rows (made by :meth:`_set_layout`)."""
        self._open: tuple[int, Any, pq.ParquetFile] | None = None  # (file, handle, reader)
        self._cached: tuple[tuple[int, int], pa.Table] | None = None

    # EpochCursor hooks

    def _settings(self) -> dict[str, Any]:
        return {
            "files": self._digest,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def _setting_hints(self) -> dict[str, str]:
        hint = (
            "Pass the same Parquet files, in the same order, as the run that saved the "
            "checkpoint (files are identified by name and row-group sizes)"
        )
        return {"files": hint, "num_rows": hint}

    def _plan_len(self, plan: list[Interval]) -> int:
        return sum(b - a for a, b in plan)

    def _lists(
        self,
        epoch: int,  # noqa: ARG002 (hook signature; the epoch's order is in _set_layout)
        history: list[dict[str, Any]],
        world_size: int,
    ) -> list[list[Interval]]:
        w0 = history[0]["world_size"] if history else world_size
        n = self.num_rows
        if self.drop_last:
            per = n // w0
            lists = [[[r * per, (r + 1) * per]] for r in range(w0)]
        else:
            lists = [[[r * n // w0, (r + 1) * n // w0]] for r in range(w0)]
        for i, seg in enumerate(history):
            nxt = history[i + 1]["world_size"] if i + 1 < len(history) else world_size
            rest = [iv for plan, c in zip(lists, seg["consumed"]) for iv in _skip(plan, c)]
            total = self._plan_len(rest)
            lists = [_take(rest, r * total // nxt, (r + 1) * total // nxt) for r in range(nxt)]
        return lists

    # reading

    def __len__(self) -> int:
        """Batches in a full pass over this rank's current epoch."""
        return math.ceil(self._plan_len(self._plan()) / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        start = self._begin_pass()
        layout = self._set_layout(self.epoch)
        pending: list[pa.Table] = []
        pending_rows = 0
        for a, b in _skip(self._plan(), start):
            s = a
            while s < b:
                u = bisect.bisect_right(layout.starts, s) - 1
                take = min(b, layout.starts[u + 1]) - s
                pending.append(self._read_unit(int(layout.order[u])).slice(s - layout.starts[u], take))
                pending_rows += take
                s += take
                while pending_rows >= self.batch_size:
                    table = pa.concat_tables(pending)
                    pending = [table.slice(self.batch_size)]
                    pending_rows -= self.batch_size
                    yield self._emit(table.slice(0, self.batch_size))
        if pending_rows:
            yield self._emit(pa.concat_tables(pending))
        self._cached = None  # free the last row group and the file between epochs
        self._close()

    def _close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def _emit(self, table: pa.Table) -> Any:
        # Count before handing the batch out: a state taken after its step includes it.
        self._advance(table.num_rows)
        if self.batch_format == "numpy":
            return {name: col.to_numpy() for name, col in zip(table.column_names, table.columns)}
        if self.batch_format == "pandas":
            return table.to_pandas()
        return table.combine_chunks()

    def _set_layout(self, epoch: int) -> _Layout:
        if self._layout is not None and self._layout.epoch == epoch:
            return self._layout
        n_units = len(self._units)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(n_units)
        else:
            order = np.arange(n_units)
        starts = [0]
        for u in order:
            starts.append(starts[-1] + self._units[u][2])
        self._layout = _Layout(epoch, order, starts)
        self._cached = None
        return self._layout

    def _read_unit(self, unit: int) -> pa.Table:
        f, g, n = self._units[unit]
        if self._cached is not None and self._cached[0] == (f, g):
            return self._cached[1]
        if self._open is None or self._open[0] != f:
            self._close()
            handle = self._fs.open_input_file(self.paths[f])
            self._open = (f, handle, pq.ParquetFile(handle))
        table = self._open[2].read_row_group(g, columns=self.columns)
        if table.num_rows != n:
            raise ConfigError(
                f"{self.paths[f]} row group {g} has {table.num_rows} rows, its footer "
                f"said {n}: the file changed while the reader was open"
            )
        if self.shuffle:
            assert self._layout is not None, "__iter__ sets the layout before it reads a unit"
            perm = np.random.default_rng([self.seed, self._layout.epoch, unit]).permutation(n)
            table = table.take(pa.array(perm))
        self._cached = ((f, g), table)
        return table


def _resolve(paths: str | Sequence[str], filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, list[str]]:
    if isinstance(paths, str):
        paths = [paths]
    paths = list(paths)
    if not paths or not all(isinstance(p, str) for p in paths):
        raise ConfigError(f"paths={paths!r} must be a path or a non-empty list of paths")
    if filesystem is None:
        filesystem, first = (
            pafs.FileSystem.from_uri(paths[0]) if "://" in paths[0] else (pafs.LocalFileSystem(), paths[0])
        )
        paths = [first] + [pafs.FileSystem.from_uri(p)[1] if "://" in p else p for p in paths[1:]]
    assert filesystem is not None  # both branches above give one
    out: list[str] = []
    for p in paths:
        info = filesystem.get_file_info(p)
        if info.type == pafs.FileType.Directory:
            found = filesystem.get_file_info(pafs.FileSelector(p, recursive=False))
            out += sorted(i.path for i in found if i.is_file and i.path.endswith(".parquet"))
        elif info.type == pafs.FileType.File:
            out.append(p)
        else:
            raise ConfigError(f"paths: {p!r} does not exist on {type(filesystem).__name__}")
    if not out:
        raise ConfigError(f"paths={paths!r} holds no .parquet file")
    return filesystem, out


def _skip(plan: list[Interval], n: int) -> list[Interval]:
    """``plan`` without its first ``n`` rows."""
    out = []
    for a, b in plan:
        if n >= b - a:
            n -= b - a
            continue
        out.append([a + n, b])
        n = 0
    return out


def _take(plan: list[Interval], lo: int, hi: int) -> list[Interval]:
    """Rows ``lo .. hi`` (positions within ``plan``) as intervals."""
    out, pos = [], 0
    for a, b in plan:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append([a + s - pos, a + e - pos])
        pos += b - a
    return out
