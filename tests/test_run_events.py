"""A finished run's events stay readable, as its profile does: the controller saves them beside the
profile at the run's end, and ``cf_ray.Run(...).events()`` reads them once it is gone."""

from __future__ import annotations

import json

import pytest

import cf_ray
from cf_ray._engine.storage.fs import FsStorage


def test_a_finished_runs_events_are_read_from_storage_like_its_profile(tmp_path, controller):
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r1/cf_ray")
    ctl = controller(storage, key="r1")
    ctl.record_event({"event": "interval", "interval": 12, "previous": 5, "time": 1.0})
    ctl.record_event({"event": "failure_rate", "why": "restart", "failures": 1, "exposure_s": 6.5, "time": 2.0})
    live = ctl.events()
    ctl.save_profile()  # what the controller does at the run's end (finish(), shutdown())

    run = cf_ray.Run(str(tmp_path / "runs"), "r1")
    assert not run.alive  # no Ray here: what the run saved
    assert run.events() == live and [e["event"] for e in live][-2:] == ["interval", "failure_rate"]
    assert len(run.profile()) == 0  # saved by the same call


def test_unreadable_saved_events_are_an_error_that_names_the_file(tmp_path, controller):
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r1/cf_ray")
    controller(storage, key="r1").save_profile()
    path = tmp_path / "runs" / "r1" / "cf_ray" / "events.json"
    assert json.loads(path.read_text()) == []
    path.write_text('{"not": "a list"}')
    with pytest.raises(cf_ray.CorruptCheckpointError, match="events.json"):
        cf_ray.Run(str(tmp_path / "runs"), "r1").events()
