"""ResumableParquetReader: row-level resume on real Parquet files, reading only the row groups
it still needs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from cf_ray.data import ResumableParquetReader
from cf_ray.errors import ConfigError

from data_harness import check_every_interrupt_point, roundtrip


def _ids(table):
    return table["id"].to_pylist()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three files, 29 rows, row groups of 4 rows (ids 0..28, x = 10 * id)."""
    root = tmp_path_factory.mktemp("pq")
    paths, lo = [], 0
    for f, n in enumerate([9, 13, 7]):
        ids = list(range(lo, lo + n))
        pq.write_table(
            pa.table({"id": ids, "x": [10 * i for i in ids], "s": [str(i) for i in ids]}),
            str(root / f"part-{f}.parquet"),
            row_group_size=4,
        )
        paths.append(str(root / f"part-{f}.parquet"))
        lo += n
    return paths


def test_reads_every_row_once_per_epoch_split_over_ranks(files):
    for world in (1, 2, 3):
        seen = []
        sizes = []
        for r in range(world):
            reader = ResumableParquetReader(files, batch_size=5, rank=r, world_size=world)
            rows = sum((_ids(t) for t in reader), [])
            sizes.append(len(rows))
            seen += rows
        assert Counter(seen) == Counter(range(29))
        assert max(sizes) - min(sizes) <= 1


def test_unshuffled_order_and_batch_formats(files):
    reader = ResumableParquetReader(files, batch_size=5, columns=["id", "x"])
    tables = list(reader)
    assert [t.num_rows for t in tables] == [5, 5, 5, 5, 5, 4]  # batches span files
    assert sum((_ids(t) for t in tables), []) == list(range(29))
    assert tables[0].column_names == ["id", "x"]
    np_batch = next(iter(ResumableParquetReader(files, batch_size=3, batch_format="numpy")))
    assert np_batch["x"].tolist() == [0, 10, 20]
    pd_batch = next(iter(ResumableParquetReader(files, batch_size=3, batch_format="pandas")))
    assert pd_batch["id"].tolist() == [0, 1, 2]


def test_shuffle_is_a_pure_function_of_seed_and_epoch(files):
    def order(seed, epoch):
        reader = ResumableParquetReader(files, batch_size=7, shuffle=True, seed=seed)
        reader.set_epoch(epoch)
        return sum((_ids(t) for t in reader), [])

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)
    assert sorted(order(1, 1)) == list(range(29))


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_at_every_interrupt_point(files, world, rank, shuffle):
    def make():
        return ResumableParquetReader(files, batch_size=4, rank=rank, world_size=world, shuffle=shuffle, seed=3)

    check_every_interrupt_point(make, _ids, epochs=2)


def test_batch_size_may_change_on_resume(files):
    reader = ResumableParquetReader(files, batch_size=4)
    it = iter(reader)
    first = _ids(next(it)) + _ids(next(it))
    state = roundtrip(reader.state_dict())
    assert state["consumed"] == 8
    other = ResumableParquetReader(files, batch_size=6)
    other.load_state_dict(state)
    assert first + sum((_ids(t) for t in other), []) == list(range(29))


class _SpyHandler(pafs.FileSystemHandler):
    """A local file system that records every byte range read (a real read, observed)."""

    def __init__(self):
        self.local = pafs.LocalFileSystem()
        self.reads: list[tuple[str, int, int]] = []

    def open_input_file(self, path):
        spy = self

        class File:
            def __init__(self):
                self.f = open(path, "rb")
                self.closed = False

            def read(self, n=-1):
                pos = self.f.tell()
                data = self.f.read(n)
                spy.reads.append((path, pos, len(data)))
                return data

            def seek(self, *a):
                return self.f.seek(*a)

            def tell(self):
                return self.f.tell()

            def close(self):
                self.closed = True
                self.f.close()

            def readable(self):
                return True

            def seekable(self):
                return True

        return pa.PythonFile(File(), mode="r")

    # The rest delegates to the local file system.
    def get_type_name(self):
        return "spy"

    def equals(self, other):
        return self is other

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def normalize_path(self, path):
        return path

    def open_input_stream(self, path):
        return self.open_input_file(path)

    def create_dir(self, *a):
        raise NotImplementedError

    delete_dir = delete_dir_contents = delete_root_dir_contents = delete_file = move = copy_file = (
        open_output_stream
    ) = open_append_stream = create_dir


def _row_group_ranges(path):
    meta = pq.ParquetFile(path).metadata
    out = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        starts = [
            min(c for c in (rg.column(i).dictionary_page_offset, rg.column(i).data_page_offset) if c is not None)
            for i in range(rg.num_columns)
        ]
        end = max(s + rg.column(i).total_compressed_size for i, s in enumerate(starts))
        out.append((min(starts), end))
    return out


def test_resume_reads_only_the_row_groups_it_needs(tmp_path):
    # Row groups larger than pyarrow's footer read-ahead (64 KiB), so that reads can be told apart.
    rng = np.random.default_rng(0)
    path = str(tmp_path / "big.parquet")
    pq.write_table(
        pa.table({"id": list(range(12)), "blob": [rng.bytes(40_000) for _ in range(12)]}),
        path,
        row_group_size=3,
        compression="none",
    )
    ranges = _row_group_ranges(path)
    assert len(ranges) == 4 and all(hi - lo > 100_000 for lo, hi in ranges)

    reader = ResumableParquetReader(path, batch_size=2, columns=["id", "blob"])
    it = iter(reader)
    for _ in range(4):  # rows 0..7: row groups 0 and 1 done, row group 2 (rows 6..8) started
        next(it)
    state = roundtrip(reader.state_dict())

    handler = _SpyHandler()
    resumed = ResumableParquetReader(path, batch_size=2, columns=["id", "blob"], filesystem=pafs.PyFileSystem(handler))
    resumed.load_state_dict(state)
    handler.reads.clear()  # the constructor read the footer only
    assert sum((_ids(t) for t in resumed), []) == list(range(8, 12))

    def touched(lo, hi):
        return any(pos < hi and pos + n > lo for _, pos, n in handler.reads)

    assert [touched(lo, hi) for lo, hi in ranges] == [False, False, True, True]


def test_another_dataset_or_seed_is_refused(files, tmp_path):
    reader = ResumableParquetReader(files, batch_size=4, shuffle=True, seed=1)
    next(iter(reader))
    state = roundtrip(reader.state_dict())
    with pytest.raises(ConfigError, match="seed=1 but this ResumableParquetReader has seed=2"):
        ResumableParquetReader(files, batch_size=4, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="same Parquet files, in the same order"):
        ResumableParquetReader(files[::-1], batch_size=4, shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="does not exist"):
        ResumableParquetReader(str(tmp_path / "missing.parquet"), batch_size=4)
    with pytest.raises(ConfigError, match="batch_size=0"):
        ResumableParquetReader(files, batch_size=0)
    with pytest.raises(ConfigError, match="batch_format"):
        ResumableParquetReader(files, batch_size=1, batch_format="arrow")
