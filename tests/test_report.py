"""The profile table: frames, Parquet through a Storage, reading a run's profile, the plot, and
Ray metrics (a no-op outside Ray, working inside an actor)."""

from __future__ import annotations

import io
import math
import pickle
import sys

import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import pytest

from cf_ray import report
from cf_ray._engine.storage.fs import FsStorage
from cf_ray.errors import CorruptCheckpointError, UnsafePathError
from cf_ray.policy import Sample

FIXED = [
    "step",
    "epoch",
    "kind",
    "generation",
    "stall_s",
    "copy_s",
    "persist_s",
    "bytes",
    "interval",
    "overhead_pct",
    "committed",
    "where",
    "error",
    "durability_lost",
]


def _rows():
    return [
        {
            "step": 10,
            "epoch": 0,
            "kind": "scheduled",
            "generation": 1,
            "stall_s": {0: 0.1, 1: 0.25},
            "copy_s": [0.2, 0.3],
            "persist_s": 1.5,
            "bytes": {0: 100, 1: 150},
            "interval": 10,
            "overhead_pct": 4.5,
            "committed": True,
            "where": "/runs/r/cf_ray/step_10",
            "error": None,
            "sync_s": 0.05,
        },
        {
            "step": 20,
            "kind": "epoch",
            "generation": 1,
            "stall_s": 0.3,
            "committed": False,
            "where": "memory-only",
            "milestone": True,
        },
        {
            "step": 30,
            "epoch": 1,
            "kind": "manual",
            "generation": 2,
            "committed": False,
            "where": "failed",
            "error": "PersistError: disk full",
            "persist_s": float("nan"),
            "detail": {"rank": 1},
        },
    ]


def _iters():
    return [
        {"time": 1.0 + i, "rank": r, "step": 5 * i, "iter_s": 0.05 + 0.01 * r, "iters": 5}
        for i in range(1, 8)
        for r in range(2)
    ]


def test_profile_frame_has_fixed_columns_and_tolerates_missing_keys():
    df = report.profile_frame(_rows())
    assert list(df.columns) == FIXED + ["sync_s", "milestone", "detail"]
    assert df["step"].tolist() == [10, 20, 30] and str(df["step"].dtype) == "Int64"
    assert df.loc[0, "stall_s"] == 0.25 and df.loc[0, "copy_s"] == 0.3 and df.loc[0, "bytes"] == 250  # max / sum
    assert df["epoch"].isna().tolist() == [False, True, False]
    assert df["committed"].tolist() == [True, False, False] and str(df["committed"].dtype) == "boolean"
    assert df.loc[0, "error"] is None and df.loc[2, "error"] == "PersistError: disk full"
    assert math.isnan(df.loc[2, "persist_s"]) and math.isnan(df.loc[1, "copy_s"])
    assert df["milestone"].tolist()[1] is True or df["milestone"].tolist()[1] == True  # noqa: E712
    empty = report.profile_frame([])
    assert list(empty.columns) == FIXED and len(empty) == 0
    assert report.profile_frame(df).equals(df)  # idempotent
    it = report.iterations_frame([Sample(rank=1, step=5, iter_s=0.1, iters=5)])
    assert (
        it.loc[0, "rank"] == 1 and it.loc[0, "iter_s"] == 0.1 and list(it.columns)[:5] == list(report.ITERATION_COLUMNS)
    )


def test_save_and_load_round_trip(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path / "root"))
    infos = report.save_profile(storage, _rows(), _iters())
    assert set(infos) == {"profile.parquet", "iterations.parquet"}
    assert (tmp_path / "root" / "profile.parquet").stat().st_size == infos["profile.parquet"].size
    profile, iterations = report.load_profile(storage)
    expected = report.profile_frame(_rows())
    expected["detail"] = pd.Series([None, None, '{"rank": 1}'], dtype=object)  # structures come back as JSON
    pd.testing.assert_frame_equal(profile, expected)
    pd.testing.assert_frame_equal(iterations, report.iterations_frame(_iters()))
    # No iteration rows, nothing at all: still readable tables with the fixed columns.
    report.save_profile(storage, [], None)
    profile, iterations = report.load_profile(storage)
    assert list(profile.columns) == FIXED and len(profile) == 0 and len(iterations) == 0


def test_mixed_type_extras_are_saved(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path))
    report.save_profile(storage, [{"step": 1, "note": 3}, {"step": 2, "note": "text"}, {"step": 3, "note": [1, 2]}])
    profile, _ = report.load_profile(storage)
    assert profile["note"].tolist() == ["3", '"text"', "[1, 2]"]


def test_read_run_profile_finds_the_run(tmp_path):
    run_root = FsStorage.from_uri(str(tmp_path / "my-run" / "cf_ray"))  # what the engine writes to
    report.save_profile(run_root, _rows(), _iters())
    df = report.read_run_profile(str(tmp_path), "my-run")
    assert df["step"].tolist() == [10, 20, 30]
    df2 = report.read_run_profile(str(tmp_path), "my-run", filesystem=pafs.LocalFileSystem())
    pd.testing.assert_frame_equal(df, df2)
    assert len(report.read_run_iterations(str(tmp_path), "my-run")) == len(_iters())
    with pytest.raises(FileNotFoundError, match="other-run/cf_ray/profile.parquet"):
        report.read_run_profile(str(tmp_path), "other-run")
    with pytest.raises(UnsafePathError):
        report.read_run_profile(str(tmp_path), "../elsewhere")


def test_read_run_profile_on_s3(s3_bucket):
    fs, bucket = s3_bucket
    report.save_profile(FsStorage(fs, f"{bucket}/runs/r1/cf_ray"), _rows(), _iters())
    df = report.read_run_profile(f"{bucket}/runs", "r1", filesystem=fs)
    assert df["where"].tolist() == ["/runs/r/cf_ray/step_10", "memory-only", "failed"]


def test_a_damaged_profile_is_reported(tmp_path):
    storage = FsStorage.from_uri(str(tmp_path))
    storage.write_file("profile.parquet", [b"not parquet at all"])
    with pytest.raises(CorruptCheckpointError, match="profile.parquet"):
        report.load_profile(storage)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_plot_profile_renders(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = report.profile_frame(_rows())
    fig = report.plot_profile(df, report.iterations_frame(_iters()), budget_pct=5.0)
    data = _png(fig)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    ax = fig.axes[0]
    assert ax.get_xlabel() == "step" and len(fig.axes) == 2  # overhead on a twin axis
    assert len(ax.lines) >= 1 + 3  # the iteration time and one vertical line per checkpoint
    (legend,) = fig.legends  # below the axes (the figure's own legend)
    labels = [t.get_text() for t in legend.get_texts()]
    assert any("committed" in t for t in labels) and any("failed" in t for t in labels)
    plt.close(fig)
    fig, ax = plt.subplots()
    assert report.plot_profile(report.profile_frame([]), ax=ax) is fig  # nothing yet: still a figure
    assert _png(fig)[:4] == b"\x89PNG"
    assert any("not enough data yet" in t.get_text() for t in ax.texts)
    plt.close(fig)


def _agg():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _restarts():
    return report.restarts_frame(
        [
            {"generation": 2, "source": "memory", "restored_step": 100, "restore_s": 0.4, "lost_steps": 30,
             "lost_s": 3.0, "recovery_s": 6.2},
            {"generation": 3, "source": "storage", "restored_step": 240, "restore_s": 1.3, "lost_steps": 20,
             "lost_s": 2.0, "recovery_s": 9.8},
        ]
    )  # fmt: skip


def _long_run():
    """A run of 300 steps in three attempts (restored at 100 and 240), a checkpoint every 20."""
    iters = [
        {"step": s, "rank": r, "iter_s": 0.1 + 0.001 * (s % 7), "iters": 1}
        for a, b in ((1, 130), (100, 260), (240, 300))
        for s in range(a, b + 1)
        for r in (0, 1)
    ]
    rows = [
        {"step": s, "kind": "scheduled", "committed": True, "where": "x", "overhead_pct": 3.0}
        for s in range(20, 301, 20)
    ]
    return report.profile_frame(rows), report.iterations_frame(iters)


def _assert_legend_hides_nothing(fig):
    """The legend's box overlaps no axes' data area and no text of the figure (titles, axis labels,
    tick labels, the plots' own labels)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert box.width > 0 and box.height > 0
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers the data"
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        texts += [t for t in ax.get_xticklabels() + ax.get_yticklabels() if t.get_text()]
        for t in texts:
            if t.get_visible() and t.get_text():
                assert not box.overlaps(t.get_window_extent(renderer)), f"the legend covers {t.get_text()!r}"
    fw, fh = fig.get_size_inches() * fig.dpi
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fw and box.y1 <= fh, "the legend is cut off"


def test_plot_profile_shades_and_names_each_restart_with_the_legend_outside(tmp_path):
    plt = _agg()
    profile, iterations = _long_run()
    fig = report.plot_profile(profile, iterations, budget_pct=5.0, restarts_df=_restarts())
    fig.savefig(tmp_path / "profile.png")
    ax = fig.axes[0]
    spans = [p for p in ax.patches if p.get_label() == "_restart"]
    assert [round(p.get_x()) for p in spans] == [100, 240] and [round(p.get_width()) for p in spans] == [30, 20]
    assert {t.get_text().strip() for t in ax.texts} >= {"1", "2"}  # numbered at the generation boundary
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "restart 1: gen 2 from step 100 (memory), 6.2 s to recover" in labels
    assert "restart 2: gen 3 from step 240 (storage), 9.8 s to recover" in labels
    _assert_legend_hides_nothing(fig)
    plt.close(fig)


def test_plot_profile_of_a_short_run_draws_what_there_is_or_says_what_is_missing():
    plt = _agg()
    one = report.profile_frame([{"step": 2, "committed": True, "where": "x", "overhead_pct": 3.0}])
    fig = report.plot_profile(one, report.iterations_frame([{"step": 1, "rank": 0, "iter_s": 0.1}]))
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_label().startswith("iteration time")]
    assert line.get_marker() not in (None, "None", "", " ")  # one point, still drawn
    _assert_legend_hides_nothing(fig)
    plt.close(fig)
    fig = report.plot_profile(one)  # checkpoints, no iteration time yet
    assert [t.get_text() for t in fig.axes[0].texts] == ["no iteration time recorded yet"]
    plt.close(fig)
    fig = report.plot_profile(report.profile_frame([]), report.iterations_frame([]))
    assert [t.get_text() for t in fig.axes[0].texts] == [
        "not enough data yet: no iteration time, checkpoint or restart recorded"
    ]
    assert fig.legends == [] and fig.axes[0].get_xticks().size == 0
    plt.close(fig)


def test_plot_badput_shades_each_restart_under_its_run_and_says_when_there_is_no_data(tmp_path):
    plt = _agg()
    split = {
        "wall_s": 60.0,
        "productive_s": 30.0,
        "badput_s": {"checkpoint_save": 2.0, "checkpoint_restore": 2.0, "wasted_progress": 5.0, "recovery": 14.0,
                     "startup": 5.0, "other": 2.0},
    }  # fmt: skip
    fig = report.plot_badput({"a": split, "b": split}, restarts={"a": _restarts()})
    fig.savefig(tmp_path / "badput.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "a: restarts", "b"]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert [round(p.get_width(), 1) for p in hatched] == [round(100 * 9.2 / 60, 1), round(100 * 11.8 / 60, 1)]
    assert all(round(p.get_y() + p.get_height() / 2) == 1 for p in hatched)  # on the row under run a
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "restart 1: gen 2 from step 100 (memory): 9.2 s (work lost + recovery)" in labels
    assert "productive" in labels and len(labels) == 7 + 2
    _assert_legend_hides_nothing(fig)
    plt.close(fig)
    fig = report.plot_badput({"wall_s": 0.0, "badput_s": {}})  # a run that has not measured anything yet
    assert [t.get_text() for t in fig.axes[0].texts] == ["no wall time measured yet"]
    plt.close(fig)


def test_plot_profile_without_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.lines", None)
    with pytest.raises(ImportError, match=r"pip install cf-ray\[plot\]"):
        report.plot_profile(report.profile_frame(_rows()))


def test_checkpoint_metrics_is_a_no_op_outside_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    m = report.CheckpointMetrics(run="r")
    m.record(_rows()[0])
    m.record({})
    assert m.enabled is None and m.recorded == 0
    m2 = pickle.loads(pickle.dumps(m))
    assert isinstance(m2, report.CheckpointMetrics) and m2._tags == {"run": "r"}


def test_checkpoint_metrics_inside_a_ray_actor(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Recorder:
        def run(self, rows):
            from cf_ray.report import CheckpointMetrics

            m = CheckpointMetrics(run="metrics-test", tags={"job": "unit"})
            for row in rows:
                m.record(row)
            return m.enabled, m.recorded

    rows = _rows() + [{"step": 40, "interval": np.int64(12), "overhead_pct": np.float64(3.5), "committed": True}]
    actor = Recorder.remote()
    assert ray.get(actor.run.remote(rows), timeout=120) == (True, len(rows))
    ray.kill(actor)
