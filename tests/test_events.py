"""The run's events are one typed family (``protocol/events.py``): every kind round-trips through the
plain form users read and storage keeps, a plain form of no known kind (or missing a field) is
refused, and a controller records typed events whose plain form reads back equal, live, on storage
and in a controller started again."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

import cf_ray
from cf_ray._engine.protocol import events as ev
from cf_ray._engine.protocol.events import KINDS, Event, EventError
from cf_ray._engine.protocol.messages import (
    PROTOCOL_VERSION,
    IntegrityFailure,
    ProtocolError,
    Restored,
    RestoreSource,
)
from cf_ray._engine.storage.fs import FsStorage

#: One event of every kind, every field set (the values as the emitters give them).
SAMPLES: list[Event] = [
    ev.RestoreEvent(
        source="memory",
        step=10,
        epoch=1,
        seconds=0.25,
        world_size=2,
        saved_world_size=None,
        fallbacks=[{"where": "step 12 in memory", "rank": 0, "error": "gone", "distrust": ""}],
        rolled_back_from=12,
        process_start_unix=100.0,
        restore_begin_unix=101.0,
        code_start_unix=100.5,
        health_check_s=2.0,
        generation=3,
        time=102.0,
        extra={"a_newer_writers_key": [1, 2]},
    ),
    ev.NoticeEvent(seq=1, deadline_unix=None, detail="spot", generation=2, time=5.0),
    ev.IntervalEvent(interval=12, previous=5, persist_every=2, previous_persist_every=1, why={"k": 12}, time=6.0),
    ev.ReprofileEvent(world_size=4, previous_world_size=2, interval=5, time=7.0),
    ev.FailureRateEvent(why="restart", time=8.0, extra={"failures": 1, "mtbf_s": 3600.0}),
    ev.JitSafeEvent(step=9, generation=2, tier="peer", deadline_unix=10.0, made_deadline=True, time=9.5),
    ev.VerifiedEvent(step=8, intact=None, error="is missing", reread="unreachable", time=11.0),
    ev.QuarantinedEvent(step=8, generation=1, error="crc mismatch", time=12.0),
    ev.QuarantineLiftedEvent(step=8, generation=2, was="crc mismatch", time=13.0),
    ev.DistrustedEvent(generation=1, step=8, reason="non_finite: inf", source="memory", time=14.0),
    ev.UploadEvent(step=8, tier="file:///up/step_8", seconds=0.5, time=15.0),
    ev.UploadDroppedEvent(step=9, reason="upload queue full", time=16.0),
    ev.UploadFailedEvent(step=9, tier="file:///up", error="denied", time=17.0),
    ev.RestoreFallbackEvent(
        source="memory",
        where="step 10 in memory",
        error="block 3",
        rank=1,
        corrupt=False,
        step=10,
        generation=2,
        verification=True,
        non_finite=True,
        time=18.0,
    ),
    ev.IntegrityFailureEvent(
        rank=1, generation=2, step=10, section="rank_0001", holder="h", how="direct", blocks=(3, 4), block_bytes=64
    ),
    ev.FinalNotDurableEvent(step=20, resume_step=15, waited_s=30.0, limit_s=30.0, generation=1),
    ev.DurabilityLostEvent(
        step=20,
        rank=0,
        committed_step=10,
        generation=1,
        action="warn",
        failures=("step 15 (rank_0000): denied",),
        reason="no_commit",
        since_step=11,
        waited_s=60.0,
        limit_s=60.0,
    ),
    ev.DurabilityRestoredEvent(step=25, rank=0, committed_step=25, lost_s=70.0, reason="no_commit", generation=1),
    ev.RolledBackEvent(step=17, restored_step=15, rolled_back_from=None, attempt=4, detail="loss went inf"),
    ev.TrustExhaustedEvent(step=13, restored_step=10, rolled_back_from=15, attempt=5, detail="loss went nan"),
]


def test_every_kind_round_trips_through_its_plain_form():
    assert sorted(type(e).KIND for e in SAMPLES) == sorted(KINDS)  # one sample per kind
    for event in SAMPLES:
        plain = event.to_dict()
        assert plain["event"] == event.kind and "version" not in plain and "extra" not in plain
        assert Event.from_dict(plain) == event, event.kind
        assert Event.from_dict(plain).to_dict() == plain
        assert pickle.loads(pickle.dumps(event)) == event  # as Ray carries a worker's event
        with pytest.raises(dataclasses.FrozenInstanceError):
            event.time = 0.0  # pyright: ignore[reportAttributeAccessIssue] - frozen, as every message
    restore = SAMPLES[0].to_dict()
    assert restore["a_newer_writers_key"] == [1, 2] and restore["saved_world_size"] is None
    assert SAMPLES[4].to_dict() == {
        "event": "failure_rate",
        "time": 8.0,
        "why": "restart",
        "failures": 1,
        "mtbf_s": 3600.0,
    }


def test_the_plain_form_is_the_one_stored_before_the_events_were_typed():
    """Fields an emitter adds only sometimes stay out while unset; the others are written, ``None``
    included, so what readers of ``events()`` and ``events.json`` get does not change."""
    again = ev.IntervalEvent(interval=5, previous=None, why="published again", time=1.0)
    assert again.to_dict() == {
        "event": "interval",
        "time": 1.0,
        "interval": 5,
        "previous": None,
        "why": "published again",
    }
    storage = ev.RestoreFallbackEvent(source="storage", where="s3://b/step_8", error="crc", rank=0, corrupt=True)
    assert storage.to_dict() == {
        "event": "restore_fallback",
        "source": "storage",
        "where": "s3://b/step_8",
        "error": "crc",
        "rank": 0,
        "corrupt": True,
    }
    verified = ev.VerifiedEvent(step=8, intact=True, error="is missing", time=2.0)
    assert verified.to_dict() == {"event": "verified", "time": 2.0, "step": 8, "intact": True, "error": "is missing"}
    assert ev.IntegrityFailureEvent(
        rank=0, generation=1, step=2, section="s", holder="h", how="storage", blocks=(1,)
    ).to_dict() == {
        "event": "integrity_failure",
        "rank": 0,
        "generation": 1,
        "step": 2,
        "section": "s",
        "holder": "h",
        "how": "storage",
        "blocks": [1],
        "block_bytes": 0,
        "error": "",
    }
    # A refused copy's message and its event say the same.
    refused = IntegrityFailure(rank=0, generation=1, step=2, section="s", holder="h", how="storage", blocks=(1,))
    assert ev.IntegrityFailureEvent.of(refused).to_dict()["blocks"] == [1]
    assert ev.IntegrityFailureEvent.of(refused) == Event.from_dict(ev.IntegrityFailureEvent.of(refused).to_dict())
    # A worker's event has no time until the controller stamps it; one with a time keeps it.
    assert "time" not in storage.to_dict() and storage.stamped(5.0).time == 5.0
    assert verified.stamped(9.0).time == 2.0


@pytest.mark.parametrize(
    "plain, says",
    [
        ({"event": "restart", "step": 1}, "unknown event kind 'restart'"),
        ({"event": "__class__"}, "unknown event kind"),
        ({"event": "cf_ray.cli:main"}, "unknown event kind"),
        ({"step": 1}, "unknown event kind None"),
        ({"event": "notice", "detail": "x"}, "a 'notice' event without seq"),
        ({"event": "jit_safe", "step": 1}, "without generation, tier"),
        (["event", "restore"], "is a mapping"),
    ],
)
def test_a_plain_form_of_no_known_kind_or_missing_a_field_is_refused(plain, says):
    with pytest.raises(EventError, match=says):
        Event.from_dict(plain)
    assert issubclass(EventError, ProtocolError)


def test_an_event_of_another_protocol_version_is_refused():
    event = ev.UploadEvent(step=1)
    assert event.version == PROTOCOL_VERSION
    stale = ev.UploadEvent(step=1)
    object.__setattr__(stale, "version", PROTOCOL_VERSION - 1)
    with pytest.raises(ProtocolError):
        pickle.loads(pickle.dumps(stale))


def test_a_controller_records_typed_events_that_read_back_equal(tmp_path, controller):
    """Live (``events()``), on storage once the run ends (``Run.events()``) and in a controller whose
    predecessor's window it lists again: the same events, typed in the controller's window."""
    storage = FsStorage.from_uri(str(tmp_path / "runs")).child("r1/cf_ray")
    ctl = controller(storage, key="r1")
    ctl.restored(Restored(source=RestoreSource.FRESH, step=0, epoch=0, extra={"health_check_s": 1.5}))
    ctl.record_event(  # a worker's, typed, as the link sends it
        ev.DurabilityLostEvent(step=7, rank=0, committed_step=5, generation=1, action="warn", reason="another_rank")
    )
    ctl.record_event({"event": "restore_fallback", "source": "memory", "step": 3, "generation": 1, "time": 4.0})
    with pytest.raises(EventError, match="unknown event kind"):
        ctl.record_event({"event": "nonsense"})
    window = list(ctl._ledger.book.events)
    assert all(isinstance(e, Event) for e in window)
    restore, lost, fallback = (window[-3], window[-2], window[-1])
    assert isinstance(restore, ev.RestoreEvent) and restore.health_check_s == 1.5 and restore.source == "fresh"
    assert isinstance(lost, ev.DurabilityLostEvent) and lost.time is not None  # stamped by the controller
    assert isinstance(fallback, ev.RestoreFallbackEvent) and fallback.time == 4.0
    assert ctl.summary()["restore_fallbacks"] == {"memory": {"refused": 1}}

    live = ctl.events()
    assert [Event.from_dict(e) for e in live] == window
    assert ctl.summary()["events"] == live
    ctl.save_profile()
    assert cf_ray.Run(str(tmp_path / "runs"), "r1").events() == live

    # What a controller started again lists from its predecessor's window: the same typed events.
    from cf_ray._engine.observe.events import EventLog

    log = EventLog(window=100)
    log.restore_events([*live, {"event": "a kind of a newer cf_ray"}])
    assert list(log.events) == window and log.plain_events() == live
    assert log.fallback_counts() == {"memory": {"refused": 1}}
