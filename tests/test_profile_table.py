"""``cf-ray profile``: a table that fits a terminal, ``--all``, ``--csv``, ``--json``; the ``interval``
column filled for a fixed policy (the controller's own rows)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from cf_ray import cli, report
from cf_ray._engine.format.layout import SHARED, rank_section, section_rank
from cf_ray._engine.protocol.messages import CheckpointKind, PartStaged, SnapshotMeta
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.policy import FixedInterval

NOTICE = 1_796_000_000.25  # 2026-11-30T...Z


def _rows(uri: str) -> list[dict]:
    """Rows as a run's controller writes them: the guide's columns and the others a real run has."""
    base = {"epoch": 0, "generation": 1, "interval": 5, "copy_s": 0.0021, "bytes": 2_345_678, "overhead_pct": 1.25}
    return [
        dict(base, step=5, kind="scheduled", stall_s=0.0123, persist_s=0.5, committed=True,
             where=f"{uri}/checkpoints/step_000000000005", error=None, sync_s=0.001),
        dict(base, step=10, kind="preempt", stall_s=0.02, persist_s=None, committed=False, where="failed",
             error="rank_00001: PersistError: disk full " + "x" * 80, notice_unix=NOTICE, made_deadline=False),
        dict(base, step=15, kind="scheduled", stall_s=None, persist_s=None, committed=False, where="memory-only",
             error=None, generation=2, overhead_pct=None),
    ]  # fmt: skip


@pytest.fixture
def run(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r/cf_ray")
    report.save_profile(storage, _rows(storage.uri()), [])
    return tmp_path / "runs" / "r"


def _profile(capsys, run, *flags) -> str:
    rc = cli.main(["profile", str(run), *flags])
    out = capsys.readouterr()
    assert rc == 0 and not out.err, out.err
    return out.out


def test_the_default_table_has_the_guides_columns_and_fits_a_terminal(run, capsys):
    out = _profile(capsys, run)
    lines = out.splitlines()
    assert lines[0].split() == ["step", "kind", "generation", "interval", "stall_ms", "committed", "error"]
    assert max(len(line) for line in lines) <= 100, out  # was ~400 columns with every column
    five, ten, fifteen = (line.split() for line in lines[1:])
    assert five[:6] == ["5", "scheduled", "1", "5", "12.3", "yes"]  # milliseconds
    assert fifteen[:6] == ["15", "scheduled", "2", "5", "-", "no"] and fifteen[6] == "-"  # missing: one spelling
    assert "disk full" in lines[2] and lines[2].endswith("...")  # a failure shown, shortened
    for spelling in ("NaN", "<NA>", "None", "nan"):
        assert spelling not in out


def test_all_the_columns_with_ms_and_iso_dates(run, capsys):
    out = _profile(capsys, run, "--all")
    header = out.splitlines()[0].split()
    assert header[:8] == ["step", "epoch", "kind", "generation", "stall_ms", "copy_ms", "persist_ms", "bytes"]
    assert {"sync_ms", "notice_utc", "made_deadline", "where"} <= set(header)
    assert not any(h.endswith("_s") or h.endswith("_unix") for h in header)
    assert "2026-11-30T" in out and "Z" in out and "2.3 MB" in out
    five = out.splitlines()[1]
    assert "/checkpoints/step_000000000005" in five and ".../" in five, "a long URI keeps its end: the checkpoint"
    for spelling in ("NaN", "<NA>", "None", "nan"):
        assert spelling not in out


def test_csv_and_json_keep_values_whole_and_missing_ones_empty_or_null(run, capsys):
    rows = list(csv.DictReader(io.StringIO(_profile(capsys, run, "--all", "--csv"))))
    assert [r["step"] for r in rows] == ["5", "10", "15"]
    assert float(rows[0]["stall_ms"]) == pytest.approx(12.3) and rows[2]["stall_ms"] == ""
    assert rows[1]["error"].endswith("x" * 80) and rows[0]["bytes"] == "2345678"
    assert rows[1]["notice_utc"].startswith("2026-11-30T") and rows[0]["committed"] == "true"
    assert list(rows[0])[:6] == ["step", "epoch", "kind", "generation", "stall_ms", "copy_ms"]
    records = json.loads(_profile(capsys, run, "--json"))
    assert list(records[0]) == ["step", "kind", "generation", "interval", "stall_ms", "committed", "error"]
    assert records[0]["stall_ms"] == pytest.approx(12.3) and records[2]["stall_ms"] is None
    assert records[0]["committed"] is True and records[0]["error"] is None and records[1]["error"].endswith("x" * 80)


def test_csv_and_json_are_exclusive(run, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["profile", str(run), "--csv", "--json"])
    assert e.value.code == 2


def test_a_fixed_policys_rows_say_its_interval(controller):
    """``FixedInterval`` decides on the ranks and publishes no interval: the controller's rows said
    ``interval=None`` (an empty column in the demo's profile); they say its ``every``."""
    ctl = controller(policy=FixedInterval(every=4))
    sections = [SHARED, rank_section(0)]
    for sec in sections:
        meta = SnapshotMeta(
            rank=section_rank(sec), world_size=1, replicated=True, epoch=0, kind=CheckpointKind.SCHEDULED
        )
        ctl.part_staged(PartStaged(generation=ctl.generation, step=4, section=sec, holder="h", nbytes=8, meta=meta))
    row = next(r for r in ctl.profile_rows() if r["step"] == 4)
    assert row["interval"] == 4
