"""The public surface is pinned: adding, removing or moving a public name is a deliberate diff here.

Also :class:`cf_ray.Run`, the driver-side handle of a run, against a run directory on disk (the
controller gone) and against a live controller actor (no TorchTrainer).
"""

from __future__ import annotations

import importlib
import time

import pytest
import torch

import cf_ray
import cf_ray.data
import cf_ray.policy
import cf_ray.preemption
from cf_ray import report
from cf_ray._engine.storage.fs import FsStorage

from storage_helpers import write_checkpoint

CF_RAY = [
    "Adaptive",
    "AnyOf",
    "CfRayError",
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpointError",
    "DurabilityLostError",
    "ElasticResumeError",
    "EpochEnd",
    "FinishSummary",
    "FixedInterval",
    "PersistError",
    "PreemptionConfig",
    "RestoreError",
    "Resume",
    "Run",
    "RunUnavailableError",
    "UnsafePathError",
    "list_checkpoints",
    "load_into",
    "load_state",
    "notify_preemption",
]
POLICY = [
    "Adaptive",
    "AnyOf",
    "EpochEnd",
    "FixedInterval",
    "FrequencyPolicy",
    "PolicyWarning",
    "RunEvent",
    "RunEventKind",
    "Sample",
    "SaveContext",
]
DATA = [
    "DALIExternalSource",
    "DataOrderError",
    "ElasticStateful",
    "ResumableDALIIterator",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "ResumableParquetReader",
    "ResumableRayDataIterator",
    "ResumableSampler",
    "ShardedDataset",
    "Stateful",
    "StatefulDataLoaderSource",
    "elastic_data_config",
    "ordered_data_config",
]


@pytest.mark.parametrize(
    "module, expected",
    [(cf_ray, CF_RAY), (cf_ray.policy, POLICY), (cf_ray.data, DATA)],
    ids=["cf_ray", "cf_ray.policy", "cf_ray.data"],
)
def test_the_public_surface_is_exactly_this(module, expected):
    assert sorted(module.__all__) == expected
    assert len(module.__all__) == len(set(module.__all__)), "a name listed twice"


def test_the_front_door_stays_small_and_every_lazy_name_is_public():
    # 26 since #16 added the errors a user catches (DurabilityLostError, RestoreError,
    # CheckpointMismatchError); growing it further is a deliberate decision, not a drift.
    assert len(cf_ray.__all__) <= 26
    assert set(cf_ray._LAZY) == set(cf_ray.__all__)


def test_every_error_of_cf_ray_errors_is_at_the_front_door():
    import inspect

    from cf_ray import errors

    defined = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.CfRayError)}
    assert defined <= set(cf_ray.__all__), sorted(defined - set(cf_ray.__all__))
    for name in ("DurabilityLostError", "RestoreError", "CheckpointMismatchError"):
        assert issubclass(getattr(cf_ray, name), cf_ray.CfRayError)
    assert issubclass(cf_ray.CheckpointMismatchError, cf_ray.ConfigError)  # except ConfigError still catches it


@pytest.mark.parametrize(
    "module",
    [cf_ray, cf_ray.policy, cf_ray.data, cf_ray.preemption],
    ids=["cf_ray", "cf_ray.policy", "cf_ray.data", "cf_ray.preemption"],
)
def test_every_public_name_is_the_object_of_its_defining_module(module):
    for name in module.__all__:
        obj = getattr(module, name)
        defining = importlib.import_module(obj.__module__)
        assert getattr(defining, name) is obj, f"{module.__name__}.{name} is not {obj.__module__}.{name}"
        exec(f"from {module.__name__} import {name}", {})  # noqa: S102 - the import statement users write


def test_preemption_exports_no_internals():
    public = cf_ray.preemption.__all__
    assert not [n for n in public if n.endswith("Watcher") or n.startswith("_")], public
    assert {"CheckpointBeforeResize", "notify_preemption"} <= set(public)
    assert cf_ray.preemption.notify_preemption is cf_ray.notify_preemption


# -- Run ----------------------------------------------------------------------------------------------------


def _rows():
    return [
        {
            "step": 5,
            "epoch": 0,
            "kind": "scheduled",
            "generation": 1,
            "stall_s": 0.01,
            "persist_s": 0.2,
            "bytes": 1000,
            "interval": 5,
            "committed": True,
            "where": "/x/step_000000000005",
            "error": None,
        },
        {
            "step": 10,
            "epoch": 0,
            "kind": "scheduled",
            "generation": 1,
            "stall_s": 0.02,
            "interval": 5,
            "committed": True,
            "where": "/x/step_000000000010",
            "error": None,
        },
        {
            "step": 15,
            "epoch": 0,
            "kind": "preempt",
            "generation": 2,
            "interval": 7,
            "committed": False,
            "where": "failed",
            "error": "rank_00001: PersistError: disk full",
        },
    ]


@pytest.fixture
def run_on_disk(tmp_path):
    """``<tmp>/runs/r1``: two committed checkpoints, one uncommitted, and a saved profile."""
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r1/cf_ray")
    model = torch.nn.Linear(3, 2)
    for step in (5, 10):
        write_checkpoint(storage, step, model)
    write_checkpoint(storage, 15, model, generation=2, commit=False)
    report.save_profile(storage, _rows(), [{"time": 1.0, "rank": 0, "step": 5, "iter_s": 0.1, "iters": 5}])
    return tmp_path / "runs", storage


def test_run_reads_a_finished_run_from_storage(run_on_disk):
    root, _ = run_on_disk
    run = cf_ray.Run(str(root), "r1")
    assert run.alive is False
    assert [(c.step, c.world_size) for c in run.checkpoints()] == [(5, 1), (10, 1)]
    df = run.profile()
    pd_testing = pytest.importorskip("pandas.testing")
    pd_testing.assert_frame_equal(df, report.read_run_profile(str(root), "r1"))
    assert list(df["step"]) == [5, 10, 15]
    rows = run.profile_rows()
    assert [r["step"] for r in rows] == [5, 10, 15] and rows[1]["persist_s"] is None and rows[0]["bytes"] == 1000
    assert type(rows[0]["step"]) is int and rows[2]["committed"] is False
    assert len(run.iterations()) == 1
    summary = run.summary()
    assert summary["source"] == "storage" and summary["committed_steps"] == [5, 10]
    assert summary["failures"] == [{"step": 15, "generation": 2, "error": "rank_00001: PersistError: disk full"}]
    assert summary["generation"] == 2 and summary["interval"] == 7
    for call in (run.events, run.explain, lambda: run.notify_preemption(deadline_s=5)):
        with pytest.raises(cf_ray.RunUnavailableError, match="ray.init"):
            call()
    assert issubclass(cf_ray.RunUnavailableError, cf_ray.CfRayError)


def test_run_from_path_takes_the_run_directory_or_its_cf_ray_folder(run_on_disk, monkeypatch):
    root, _ = run_on_disk
    for path in (root / "r1", f"{root}/r1/", root / "r1" / "cf_ray"):
        run = cf_ray.Run.from_path(str(path))
        assert (run.storage_path, run.name) == (str(root), "r1")
    monkeypatch.chdir(root)
    assert cf_ray.Run.from_path("r1").storage_path == str(root)
    s3 = cf_ray.Run.from_path("s3://bucket/runs/r1")
    assert (s3.storage_path, s3.name) == ("s3://bucket/runs", "r1")
    with pytest.raises(cf_ray.ConfigError, match="run directory"):
        cf_ray.Run.from_path("s3://bucket")
    with pytest.raises(cf_ray.ConfigError, match="plain directory name"):
        cf_ray.Run(str(root), "a/b")


def test_run_without_a_profile_says_where_it_looked(tmp_path):
    write_checkpoint(FsStorage.from_uri(str(tmp_path)).child("r2/cf_ray"), 3, torch.nn.Linear(2, 2))
    run = cf_ray.Run(str(tmp_path), "r2")
    with pytest.raises(FileNotFoundError, match="profile"):
        run.profile()
    assert run.summary() == {
        "source": "storage",
        "committed_steps": [3],
        "failures": [],
        "generation": None,
        "interval": None,
    }


def test_run_asks_the_live_controller_and_falls_back_to_storage_when_it_is_gone(run_on_disk, ray_cluster):
    from cf_ray._engine.driver.controller import ControllerSettings, get_or_create_controller, run_key

    ray = ray_cluster
    root, storage = run_on_disk
    settings = ControllerSettings(
        policy=cf_ray.FixedInterval(every=5), keep_last=None, tiers=[], upload_milestones_only=False
    )
    # The key as a Checkpointer of CheckpointConfig(storage_path=root, run_name="r1") derives it.
    ctl = get_or_create_controller(run_key(storage.uri(), "r1"), storage, settings)
    try:
        run = cf_ray.Run.from_path(str(root / "r1"))
        assert run.alive
        summary = run.summary()
        assert summary["source"] == "controller" and summary["committed_steps"] == [5, 10]
        assert run.profile_rows() == []  # nothing checkpointed by this (new) controller yet
        assert len(run.profile()) == 0
        assert isinstance(run.events(), list)
        run.explain()
        run.notify_preemption(deadline_s=30, detail="test")
    finally:
        ray.kill(ctl, no_restart=True)
    deadline = time.time() + 30
    while run.alive and time.time() < deadline:
        time.sleep(0.1)
    assert not run.alive
    assert [r["step"] for r in run.profile_rows()] == [5, 10, 15]  # the saved table again


def test_cli_profile_and_ls_take_the_run_directory(run_on_disk, capsys):
    from cf_ray import cli

    root, _ = run_on_disk
    assert cli.main(["profile", str(root / "r1")]) == 0
    one = capsys.readouterr().out
    assert "preempt" in one and "disk full" in one
    assert cli.main(["ls", str(root / "r1")]) == 0
    assert "step_000000000010" in capsys.readouterr().out


def test_the_run_handle_loads_no_torch_or_pandas():
    import subprocess
    import sys

    code = (
        "import sys, cf_ray; cf_ray.Run('/nowhere', 'r').alive; "
        "print(sorted(m for m in ('torch', 'pandas', 'pyarrow.parquet') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- what cf_ray was tested with --------------------------------------------------------------------------------


def _pins() -> dict[str, str]:
    import pathlib
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    pins = {}
    for dep in project["dependencies"]:
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?(.*)$", dep)
        pins[m.group(1)] = m.group(3).replace(" ", "")
    return pins


def test_the_pins_say_what_was_tested():
    from cf_ray import _version

    pins = _pins()
    assert pins["ray"] == _version.RAY_SUPPORTED == ">=2.60,<2.61"  # the import check and the pin agree
    assert pins["pyarrow"] == ">=14.0.1"  # 14.0.0 runs code from crafted Parquet/IPC files (CVE-2023-47248)
    assert pins["torch"] == ">=2.13"  # what CI installs (the Makefile's TORCH)


def test_an_untested_ray_is_refused_at_import_naming_the_supported_range(monkeypatch):
    from cf_ray import _version

    monkeypatch.delenv(_version.ALLOW_UNTESTED_RAY, raising=False)
    _version.check_ray_version()  # the installed one
    for ok in ("2.60.0", "2.60.7", "2.60.0rc1"):
        _version.check_ray_version(ok)
    for untested in ("2.59.9", "2.61.0", "3.0.0.dev0", "nightly"):
        with pytest.raises(ImportError, match=r"Ray >=2\.60,<2\.61.*CF_RAY_ALLOW_UNTESTED_RAY=1") as e:
            _version.check_ray_version(untested)
        assert untested in str(e.value)
    monkeypatch.setenv(_version.ALLOW_UNTESTED_RAY, "1")
    _version.check_ray_version("2.61.0")


def test_importing_cf_ray_with_an_untested_ray_fails_clearly():
    import subprocess
    import sys

    code = (
        "import importlib.metadata as m; real = m.version; "
        "m.version = lambda n: '2.99.0' if n == 'ray' else real(n); import cf_ray"
    )
    import os

    env = {k: v for k, v in os.environ.items() if k != "CF_RAY_ALLOW_UNTESTED_RAY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "ImportError: cf_ray" in out.stderr and "Ray 2.99.0 is installed" in out.stderr
    assert "ray[train]>=2.60,<2.61" in out.stderr
    ok = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(env, CF_RAY_ALLOW_UNTESTED_RAY="1")
    )
    assert ok.returncode == 0, ok.stderr


def test_deprecations_are_shown_and_fail_only_in_cf_ray_code():
    import warnings

    with pytest.raises(DeprecationWarning):  # cf_ray's own, or its call of a deprecated Ray/torch API
        warnings.warn_explicit("old", DeprecationWarning, "cf_ray/_engine/x.py", 1, module="cf_ray._engine.x")
    with pytest.warns(DeprecationWarning):  # Ray's and torch's drift: shown in the test output, not an error
        warnings.warn_explicit("old", DeprecationWarning, "ray/train/x.py", 1, module="ray.train.x")
    with pytest.warns(DeprecationWarning):
        warnings.warn_explicit("old", DeprecationWarning, "cf_ray_plugin/x.py", 1, module="cf_ray_plugin.x")
