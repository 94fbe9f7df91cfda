"""The typed messages between workers, holders and the controller: frozen, picklable, versioned,
and their Enums are the very strings (and ints) that storage and the profile table hold."""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest

from cf_ray._engine.driver.facade import Controller
from cf_ray._engine.format.blocks import BLOCK_BYTES
from cf_ray._engine.format.catalog import list_committed
from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import MANIFEST, SHARED, rank_section, section_rank, step_dir
from cf_ray._engine.format.sections import write_section
from cf_ray._engine.protocol import messages as msgs
from cf_ray._engine.protocol.messages import (
    PROTOCOL_VERSION,
    CheckpointKind,
    CheckpointRequest,
    Distrusted,
    Failure,
    HolderState,
    IntegrityFailure,
    MemorySnapshot,
    Message,
    PartDurable,
    PartFailed,
    PartReplicated,
    PartStaged,
    PartSuperseded,
    ProtocolError,
    ReplicaHeld,
    ReplicaOffer,
    RequestLevel,
    Restored,
    RestorePlan,
    RestoreSource,
    Schedule,
    SectionAt,
    SectionState,
    Settled,
    SlotDesc,
    SnapshotMeta,
    Stage,
    StagedSlot,
    StageReply,
    StreamDesc,
    SyncReply,
    SyncRequest,
)
from cf_ray.errors import CfRayError

META = SnapshotMeta(
    rank=0,
    world_size=2,
    replicated=True,
    epoch=1,
    kind=CheckpointKind.SCHEDULED,
    interval=5,
    deadline_unix=123.0,
    notice_unix=100.0,
    notice_source="user",
)
MEMORY = MemorySnapshot(
    generation=2, step=10, sections={SHARED: "cf_ray.holder.k.n1"}, world_size=2, epoch=1, replicated=True
)
SLOT = SlotDesc(path="/proc/1/fd/7", name="cf_ray.k.rank_00000.0", ino=12, dev=1, nonce=2**63 + 5, nbytes=4096, seq=3)
STREAM = StreamDesc(host="10.0.0.2", port=4242, token=bytes(range(16)), nbytes=4096, tls=True)
EXAMPLES: list[Message] = [
    META,
    SLOT,
    STREAM,
    SectionAt(where=SLOT, index=b"{}", crc32=7),
    StagedSlot(section=rank_section(0), slot=SLOT, index=b"{}", crc32=7),
    Stage(generation=2, step=10, meta=META, sections=(StagedSlot(section="s", slot=SLOT, index=b"{}", crc32=7),)),
    StageReply(recorded=False, unknown=(SHARED,)),
    ReplicaOffer(
        generation=2,
        step=10,
        section=SHARED,
        index=b"{}",
        crc32=7,
        meta=META,
        origin="h1",
        origin_node="n1",
        stream=STREAM,
    ),  # fmt: skip
    ReplicaHeld(holder="h2", node_id="n2", nbytes=4096, seconds=0.01),
    PartStaged(
        generation=2,
        step=10,
        section=SHARED,
        holder="cf_ray.holder.k.n1",
        nbytes=64,
        meta=META,
        holder_put_s=0.01,
        node_id="n1",
    ),
    PartDurable(
        generation=2, step=10, section=rank_section(1), files={"a.bin": {"size": 64, "crc32": 7}}, persist_s=0.5
    ),
    PartFailed(generation=2, step=10, section=rank_section(0), error="OSError: disk full"),
    PartSuperseded(generation=2, step=10, section=rank_section(0)),
    PartReplicated(
        generation=2,
        step=10,
        section=rank_section(0),
        holder="h2",
        node_id="n2",
        origin="h1",
        nbytes=64,
        seconds=0.5,
    ),
    Schedule(schedule_version=3, interval=None),
    Failure(seq=0, step=10, section=rank_section(0), rank=0, error="OSError: disk full", generation=2),
    CheckpointRequest(seq=1, deadline_unix=200.0, detail="resize", time_unix=100.0, generation=2),
    SyncRequest(
        rank=1,
        generation=2,
        samples=({"rank": 1, "step": 9, "iter_s": 0.1, "iters": 4},),
        ckpt_stats=({"step": 10, "stall_s": 0.01},),
        adopted_version=0,
        seen_failures=-1,
        seen_requests=0,
    ),
    SyncReply(
        schedules=(Schedule(schedule_version=1, interval=4),),
        committed_step=8,
        failures=(Failure(seq=0, step=9, section="manifest", rank=0, error="x", generation=2),),
        requests=(CheckpointRequest(seq=1, deadline_unix=None),),
    ),
    MEMORY,
    RestorePlan(
        generation=3,
        memory=MEMORY,
        storage=(8, 4),
        tiers=((8,), ()),
        schedules=(Schedule(schedule_version=0, interval=5),),
    ),
    Restored(
        source=RestoreSource.MEMORY, step=10, epoch=1, seconds=0.2, world_size=2, saved_world_size=2, extra={"note": 1}
    ),
    IntegrityFailure(
        rank=1,
        generation=2,
        step=10,
        section=SHARED,
        holder="cf_ray.holder.k.n1",
        how="in_place",
        blocks=(3,),
        block_bytes=BLOCK_BYTES,
        error="block 3 fails its CRC-32",
    ),
    Settled(
        generation=2,
        committed=(5,),
        failed={6: "rank_00001: OSError: disk full"},
        superseded=(7,),
        abandoned=(8,),
        pending=(10,),
        unknown=(11,),
        safe=(10,),
        newest_committed=5,
        resynced=False,
    ),
    Distrusted(generation=2, step=10, memory=True, quarantined=True),
    HolderState(
        holder="cf_ray.holder.k.n1",
        node_id="n1",
        generation=2,
        staged=(PartStaged(generation=2, step=10, section=SHARED, holder="cf_ray.holder.k.n1", nbytes=64, meta=META),),
        outcomes=(
            PartDurable(
                generation=2,
                step=10,
                section=SHARED,
                files={"a.bin": {"size": 64, "crc32": 7}},
                persist_s=0.5,
                holder="cf_ray.holder.k.n1",
            ),
        ),
    ),
]


def _concrete_messages() -> set[type]:
    out, todo = set(), [Message]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if getattr(msgs, sub.__name__, None) is sub:  # not the pre-``slots`` copy dataclass leaves behind
                out.add(sub)
                todo.append(sub)
    return out


def test_every_message_has_an_example():
    assert {type(m) for m in EXAMPLES} == _concrete_messages()
    assert {cls.__name__ for cls in _concrete_messages()} <= set(msgs.__all__)


@pytest.mark.parametrize("m", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_are_frozen(m):
    name = dataclasses.fields(m)[-1].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(m, name, getattr(m, name))
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError, TypeError)):  # TypeError: CPython 3.11 slots
        m.something_else = 1
    assert m.version == PROTOCOL_VERSION


@pytest.mark.parametrize("m", EXAMPLES, ids=lambda m: type(m).__name__)
def test_messages_survive_pickle_and_rays_serialisation(m):
    from ray import cloudpickle

    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps(m))
        assert type(back) is type(m)
        assert back == m


def test_a_message_of_another_version_is_refused():
    assert issubclass(ProtocolError, CfRayError)
    with pytest.raises(ProtocolError, match="protocol version"):
        PartFailed(generation=1, step=2, section="rank_0000", error="x", version=PROTOCOL_VERSION + 1)

    # What the receiver gets from a process of another version: checked when it is unpickled, even
    # when the message has fields this version does not know.
    class _FromAnotherVersion:
        def __reduce__(self):
            return msgs._rebuild, (
                PartFailed,
                {
                    "version": PROTOCOL_VERSION + 1,
                    "generation": 1,
                    "step": 2,
                    "section": "rank_0000",
                    "error": "x",
                    "retries": 3,
                },
            )

    with pytest.raises(ProtocolError):
        pickle.loads(pickle.dumps(_FromAnotherVersion()))
    stale = PartSuperseded(generation=1, step=2, section="rank_0000")
    object.__setattr__(stale, "version", PROTOCOL_VERSION - 1)
    with pytest.raises(ProtocolError):
        pickle.loads(pickle.dumps(stale))


def test_enum_values_are_the_stored_strings():
    assert [s.value for s in SectionState] == ["pending", "committed", "failed", "superseded", "abandoned"]
    assert [k.value for k in CheckpointKind] == ["scheduled", "epoch", "manual", "preempt", "final"]
    assert [s.value for s in RestoreSource] == ["fresh", "memory", "storage"]
    assert [(r.name, int(r)) for r in RequestLevel] == [("NONE", 0), ("MANUAL", 1), ("PREEMPT", 2)]
    for e in (*SectionState, *CheckpointKind, *RestoreSource):
        assert e == e.value and json.dumps(e) == json.dumps(e.value)


# -- what reaches storage and the profile table through the controller ---------------------------------

WORLD = 2
SECTIONS = [SHARED, rank_section(0), rank_section(1)]


def _stage_and_write(ctl: Controller, step: int, kind: CheckpointKind, sections=SECTIONS, **meta) -> None:
    for sec in sections:
        files = write_section(ctl.storage, step_dir(step), ctl.generation, sec, np.arange(8, dtype=np.uint8), b"{}")
        ctl.part_staged(
            PartStaged(
                generation=ctl.generation,
                step=step,
                section=sec,
                holder="h",
                nbytes=8,
                meta=SnapshotMeta(
                    rank=section_rank(sec), world_size=WORLD, replicated=True, epoch=0, kind=kind, **meta
                ),
            )
        )
        ctl.part_durable(
            PartDurable(
                generation=ctl.generation,
                step=step,
                section=sec,
                files={k: v.to_json() for k, v in files.items()},
                persist_s=0.01,
            )
        )


def test_enum_members_reach_storage_and_the_profile_table_as_plain_strings(controller):
    ctl = controller()
    ctl.prepare_restore(WORLD)
    _stage_and_write(ctl, 3, CheckpointKind.EPOCH)
    _stage_and_write(ctl, 4, CheckpointKind.PREEMPT, sections=SECTIONS[:2], deadline_unix=1e12)
    ctl.part_failed(PartFailed(generation=ctl.generation, step=4, section=SECTIONS[2], error="OSError: gone"))
    assert [c.step for c in list_committed(ctl.storage)] == [3]
    m = read_manifest(ctl.storage, step_dir(3))
    assert type(m.kind) is str and m.kind == "epoch"
    raw = json.loads(bytes(ctl.storage.read_file(f"{step_dir(3)}/{MANIFEST}")))
    assert raw["kind"] == "epoch"
    rows = {r["step"]: r for r in ctl.profile_rows()}
    assert type(rows[3]["kind"]) is str and rows[3]["kind"] == "epoch" and rows[3]["committed"] is True
    assert type(rows[4]["kind"]) is str and rows[4]["kind"] == "preempt"
    assert rows[4]["where"] == SectionState.FAILED.value == "failed" and rows[4]["made_deadline"] is False

    reply = ctl.sync(SyncRequest(rank=0, generation=ctl.generation))
    assert isinstance(reply, SyncReply) and reply.committed_step == 3
    assert [(f.step, f.section) for f in reply.failures] == [(4, SECTIONS[2])]
    assert ctl.summary()["failures"] == [
        {"seq": 0, "step": 4, "section": SECTIONS[2], "rank": 1, "error": "OSError: gone", "generation": ctl.generation}
    ]

    req = ctl.request_checkpoint(2e12, "resize")
    assert isinstance(req, CheckpointRequest) and req.detail == "resize" and req.generation == ctl.generation
    assert ctl.sync(SyncRequest(rank=1, generation=ctl.generation, seen_requests=0)).requests == (req,)
    plan = ctl.prepare_restore(WORLD)
    assert isinstance(plan, RestorePlan) and plan.storage == (3,)
    assert plan.memory is not None and plan.memory.step == 3 and plan.memory.sections == dict.fromkeys(SECTIONS, "h")
    ctl.restored(Restored(source=RestoreSource.MEMORY, step=3, epoch=0, world_size=WORLD))
    restore = [e for e in ctl.events() if e["event"] == "restore"][-1]
    assert type(restore["source"]) is str and restore["source"] == "memory"
    notice = [e for e in ctl.events() if e["event"] == "notice"][-1]
    assert notice["detail"] == "resize" and notice["deadline_unix"] == 2e12 and "time" in notice
