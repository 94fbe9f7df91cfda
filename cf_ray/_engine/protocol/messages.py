"""What crosses an actor boundary: worker -> holder -> controller, and back.

Every message is a frozen dataclass carrying ``version`` (:data:`PROTOCOL_VERSION`); a receiver
built from other code refuses a message of another version with :class:`ProtocolError` instead of
misreading it (a cluster where the driver and the workers run different cf_ray versions).
States, checkpoint kinds, restore sources and request levels are Enums whose values are the
strings (and ints) stored on storage and in the profile table, so nothing on disk changes.

No torch here: this module is imported by the controller and the holders.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

from cf_ray.errors import CfRayError

#: Bumped whenever a message below changes shape (a field added, removed or retyped), so that a
#: process of another cf_ray version refuses the message (:class:`ProtocolError`) instead of
#: misreading it.
PROTOCOL_VERSION = 5


class ProtocolError(CfRayError):
    """A message from a process running another version of cf_ray."""


class SectionState(str, enum.Enum):
    """Where a checkpoint (all its sections) stands in the controller."""

    PENDING = "pending"
    """Some section is not durable yet."""
    COMMITTED = "committed"
    """Every section is durable and the manifest is written."""
    FAILED = "failed"
    """A section or the manifest could not be written; the previous checkpoint stays the latest."""
    SUPERSEDED = "superseded"
    """A newer snapshot replaced it before it was persisted (storage slower than the interval)."""
    ABANDONED = "abandoned"
    """Past the step a later attempt restored: a timeline that attempt replays; never committed."""


class CheckpointKind(str, enum.Enum):
    """Why a checkpoint was taken (the manifest's and the profile's ``kind``)."""

    SCHEDULED = "scheduled"
    EPOCH = "epoch"
    MANUAL = "manual"
    PREEMPT = "preempt"
    FINAL = "final"


class RestoreSource(str, enum.Enum):
    """Where an attempt resumed from (``Resume.source``)."""

    FRESH = "fresh"
    MEMORY = "memory"
    STORAGE = "storage"


class RequestLevel(enum.IntEnum):
    """A rank's request for an out-of-schedule checkpoint (the agreement's ``save_request``)."""

    NONE = 0
    MANUAL = 1
    PREEMPT = 2


def _check_version(cls: type, version: Any) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{cls.__name__} of protocol version {version}, this process speaks {PROTOCOL_VERSION}: "
            "the driver, the workers and cf_ray's actors must run the same cf_ray version"
        )


def _rebuild(cls: type, values: dict[str, Any]) -> Message:
    """Unpickle a message through its constructor; the version is checked first (a message of
    another version may have other fields)."""
    _check_version(cls, values.get("version"))
    return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    version: int = PROTOCOL_VERSION
    """The protocol version of the process that made the message."""

    def __post_init__(self) -> None:
        _check_version(type(self), self.version)

    def __reduce__(self):
        # Pickle (Ray's serialisation of actor arguments and results) would restore the slots
        # without __post_init__; rebuilding through the constructor makes the *receiver* check
        # the version of what it is sent.
        return _rebuild, (type(self), {f.name: getattr(self, f.name) for f in fields(self)})


# -- where a section's bytes are: a slot on this node, a stream from another -----------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SlotDesc(Message):
    """One snapshot slot of a holder (``memory/slots.py``): an anonymous shared-memory file the holder
    created and keeps open, which a process of its node opens through ``path``
    (``/proc/<holder pid>/fd/<n>``). ``name``, ``ino``/``dev`` and ``nonce`` say which file it is:
    whoever opens ``path`` checks all three before writing or reading a byte (the holder may be gone
    and its fd number reused). ``seq`` is ``0`` for an empty slot as the holder hands it out; a filled
    one, as the worker hands it back, names its fill."""

    path: str
    name: str
    """The memfd's name (``cf_ray.<run key>.<section>.<n>``); ``readlink(path)`` shows it."""
    ino: int
    dev: int
    """The file's inode and device, as the holder's own fd has them."""
    nonce: int
    """Random, per slot file, also written in the slot's header."""
    nbytes: int
    """Bytes of data the slot holds (after its header page)."""
    seq: int = 0
    """The fill's number (a slot's header names the fill it holds); 0: not a fill."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamDesc(Message):
    """A section offered to one reader on another node over a direct connection (``memory/wire.py``):
    connect to ``host:port``, send ``token`` (random, good for this one offer, consumed on use), get
    ``nbytes``. ``tls``: the connection is TLS with Ray's certificates (``RAY_USE_TLS``)."""

    host: str
    port: int
    token: bytes
    nbytes: int
    tls: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class SectionAt(Message):
    """Where a holder has a section (its answer to ``get_section``): ``where`` is the slot (the
    reader is on the holder's node: it maps it and reads in place) or a stream offer (another node),
    and ``index`` is the section's encoded index with the CRC-32 of every block of its data."""

    where: SlotDesc | StreamDesc
    index: bytes
    crc32: int


# -- worker -> holder -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotMeta(Message):
    """What a rank says of its snapshot when it hands it to its node's holder."""

    rank: int
    world_size: int
    replicated: bool
    epoch: int
    kind: CheckpointKind
    milestone: bool = False
    priority: bool = False
    """A preemption checkpoint: persisted before anything else, never superseded."""
    interval: int | None = None
    persist: bool = True
    """False: held in memory only (never written)."""
    copy_s: float | None = None
    sync_s: float | None = None
    copied_bytes: int = 0
    """Bytes the rank copied on the host for this snapshot (the state once, with slots)."""
    crc_read_bytes: int = 0
    """Bytes it read again to checksum them (0 when the checksums were taken as the copy landed)."""
    slot_wait_s: float | None = None
    """Seconds it waited for a free snapshot slot (both held by the holder)."""
    deadline_unix: float | None = None
    notice_unix: float | None = None
    notice_source: str | None = None
    replicas: int = 0
    """Copies to place on holders of other nodes (``-1``: one when the cluster has several nodes)."""
    replica_label: str = ""
    """The node label whose values are failure domains (``""``: any other node)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedSlot(Message):
    """One section of a snapshot as the worker hands it over: the slot it copied it into, its index
    with the block CRC-32s (``format/blocks.py``'s ``with_blocks``) and the CRC-32 of the whole data."""

    section: str
    slot: SlotDesc
    index: bytes
    crc32: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage(Message):
    """The hand-off (``holder.stage``): a snapshot's sections are in the holder's slots; no bytes travel."""

    generation: int
    step: int
    meta: SnapshotMeta
    sections: tuple[StagedSlot, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReply(Message):
    """The holder's answer to :class:`Stage`, once it has recorded the snapshot (it does not wait for
    the controller: its sender delivers ``part_staged``)."""

    recorded: bool
    unknown: tuple[str, ...] = ()
    """Sections whose slots this holder does not know (it was started again since): nothing of the
    snapshot was recorded; the worker stages it again into the slots of the holder now on its node."""


# -- holder -> holder ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaOffer(Message):
    """A holder asks a holder of another node to keep a copy of one of its sections (``hold_replica``):
    the peer pulls the bytes over ``stream`` from the origin's server into a slot of its own."""

    generation: int
    step: int
    section: str
    index: bytes
    crc32: int
    meta: SnapshotMeta
    origin: str
    """The origin holder's name, and its node."""
    origin_node: str
    stream: StreamDesc


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaHeld(Message):
    """The peer's answer: it holds a complete copy, every block checked against the index, in a slot
    of its own (what the origin then reports with ``part_replicated``)."""

    holder: str
    node_id: str
    nbytes: int
    seconds: float


# -- holder -> controller ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PartStaged(Message):
    """A section of a snapshot is held in a holder's memory (and queued for persisting)."""

    generation: int
    step: int
    section: str
    holder: str
    nbytes: int
    meta: SnapshotMeta
    holder_put_s: float = 0.0
    node_id: str = ""
    holder_copied_bytes: int = 0
    """Bytes the holder copied to take the section (0: it takes the worker's slots as they are)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartReplicated(Message):
    """A copy of a staged section is held by a holder of another node (a peer replica), or could
    not be made (``error``) or was skipped for a newer snapshot (``skipped``)."""

    generation: int
    step: int
    section: str
    holder: str
    """The holder that has the copy (or was to have it); ``""`` when no peer could be chosen."""
    node_id: str
    """That holder's node."""
    origin: str
    """The holder that has the section itself."""
    nbytes: int = 0
    seconds: float = 0.0
    """From the start of the copy to the peer owning it."""
    error: str = ""
    skipped: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class PartDurable(Message):
    """A section's files are written; ``files`` maps file name -> ``{"size", "crc32"}``."""

    generation: int
    step: int
    section: str
    files: dict[str, dict[str, int]]
    persist_s: float
    holder: str = ""
    """The holder that wrote it (the controller asks it again when it has to)."""
    persist_cpu_s: float | None = None
    """CPU seconds the holder's writer thread spent on it (the policy's ``Sample.persist_cpu_s``)."""
    copied_bytes: int = 0
    """Bytes the write copied on the host (a bounce buffer, the page cache; 0 with O_DIRECT from a slot)."""
    crc_read_bytes: int = 0
    """Bytes the write read again to checksum them (0 when the worker's checksums came with a slot)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartFailed(Message):
    """A section could not be written: nothing is committed for its step."""

    generation: int
    step: int
    section: str
    error: str
    holder: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartSuperseded(Message):
    """A section will never be written: a newer snapshot replaced it before its writing started."""

    generation: int
    step: int
    section: str
    holder: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class HolderState(Message):
    """What a holder holds and has done lately (``Holder.resync()``): how a controller that started
    again, or that lost a message, learns it. Every message in it may already have been delivered:
    the controller's handlers are idempotent."""

    holder: str
    node_id: str = ""
    generation: int = 0
    """The newest generation this holder has seen (a restarted controller's is at least this)."""
    staged: tuple[PartStaged, ...] = ()
    """Every section held in memory or written recently and not known settled, oldest first."""
    outcomes: tuple[Message, ...] = ()
    """The outcome of each section of ``staged`` that has one: ``PartDurable``, ``PartFailed`` or
    ``PartSuperseded``."""
    replicas: tuple[PartReplicated, ...] = ()
    """The copies this holder keeps of sections of holders of other nodes, as ``part_replicated``
    said them (a restarted controller learns where the copies are)."""
    replica_origins: tuple[PartStaged, ...] = ()
    """For each of ``replicas``, the section as its origin staged it: a controller that starts again
    after the origin's node was lost learns of the section from here (its origin cannot say)."""


# -- worker <-> controller -------------------------------------------------------------------------


#: The controller methods a holder's sender calls, each with one of the messages above; the sender
#: hands several queued ones over in one call (``Controller.deliver``), applied in order.
HOLDER_MESSAGES = frozenset(
    {"part_staged", "part_replicated", "part_durable", "part_failed", "part_superseded", "apply_holder_state"}
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule(Message):
    """One version of the checkpoint interval; ranks adopt versions together."""

    schedule_version: int
    interval: int | None
    persist_every: int = 1
    """One scheduled snapshot in this many is persisted (written to storage and committed); the
    others are held in memory only (``SnapshotMeta.persist=False``). Manual, preemption, epoch-end
    and milestone snapshots are always persisted."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure(Message):
    """A checkpoint that did not commit, as the workers learn of it."""

    seq: int
    step: int
    section: str
    rank: int
    error: str
    generation: int

    def as_dict(self) -> dict:
        """As users see it (``FinishSummary.failures``, ``Checkpointer.wait()``, the controller's summary)."""
        return {
            "seq": self.seq,
            "step": self.step,
            "section": self.section,
            "rank": self.rank,
            "error": self.error,
            "generation": self.generation,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointRequest(Message):
    """A notice from outside the workers (``cf_ray.notify_preemption``) for every rank."""

    seq: int
    deadline_unix: float | None
    detail: str = ""
    time_unix: float = 0.0
    generation: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncRequest(Message):
    """A worker's non-blocking poll: its timing samples in (``policy.Sample`` fields as dicts)."""

    rank: int
    generation: int
    samples: tuple[dict, ...] = ()
    ckpt_stats: tuple[dict, ...] = ()
    adopted_version: int = -1
    seen_failures: int = -1
    seen_requests: int = -1
    bell: tuple[Any, int] | None = None
    """The rank's doorbell, ``(actor handle, token)``, until the controller has it for this attempt
    (``worker/link/controller.py``); ``None``: known already, or the rank runs outside a Ray actor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncReply(Message):
    """The controller's answer to a poll: what the rank has not seen yet."""

    schedules: tuple[Schedule, ...]
    committed_step: int
    failures: tuple[Failure, ...] = ()
    requests: tuple[CheckpointRequest, ...] = ()
    bell_known: bool = False
    """Whether the controller has the rank's doorbell for the rank's attempt (it rings it with each
    checkpoint request)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemorySnapshot(Message):
    """The newest snapshot every section of which some holder still has."""

    generation: int
    step: int
    sections: dict[str, str]
    """section -> name of the holder actor that has it."""
    world_size: int
    epoch: int
    replicated: bool
    replicas: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """section -> holders of other nodes with a copy (tried after ``sections``' holder)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RestorePlan(Message):
    """The controller's answer to rank 0 at the start of an attempt."""

    generation: int
    memory: MemorySnapshot | None
    storage: tuple[int, ...]
    """Committed steps on the primary storage, newest first."""
    tiers: tuple[tuple[int, ...], ...] = ()
    """Committed steps on each upload tier, newest first."""
    schedules: tuple[Schedule, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class IntegrityFailure(Message):
    """One copy of a section that a restore refused because its bytes failed their block checksums
    (worker -> controller, as an ``integrity_failure`` event: :meth:`event`). The restore went on
    with the next copy, or the next candidate; nothing of these bytes was used."""

    rank: int
    """The rank that read it."""
    generation: int
    """The snapshot's generation."""
    step: int
    section: str
    holder: str
    """Where the bytes came from: a holder's actor name, or the storage URI of the file."""
    how: str
    """How they came: ``in_place``, ``direct``, ``storage``."""
    blocks: tuple[int, ...] = ()
    """The blocks that failed (indices, at most ``format/blocks.py``'s ``BLOCKS_NAMED``); empty: not a block check."""
    block_bytes: int = 0
    error: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Settled(Message):
    """The controller's answer to ``settled(generation, steps)``: which of those steps of one
    generation are settled — nothing more will happen to them — and how. A step is settled when it
    is in ``committed``, ``failed``, ``superseded`` or ``abandoned``."""

    generation: int
    committed: tuple[int, ...] = ()
    """The manifest is written (or on storage)."""
    failed: dict[int, str] = field(default_factory=dict)
    """step -> ``"section: error"``: a section or the manifest could not be written."""
    superseded: tuple[int, ...] = ()
    """Replaced by a newer snapshot before it was written (or held in memory only)."""
    abandoned: tuple[int, ...] = ()
    """Past a later attempt's restore point, or its files were gone when a restarted controller
    re-learnt it."""
    pending: tuple[int, ...] = ()
    """Known, some section not durable yet (not settled)."""
    unknown: tuple[int, ...] = ()
    """Never heard of (not settled: its ``part_staged`` may not have arrived yet, or the controller
    restarted)."""
    safe: tuple[int, ...] = ()
    """Just-in-time checkpoints still pending on storage but safe in a peer's memory: every
    section of a draining node has a copy on another node."""
    newest_committed: int | None = None
    """The newest committed step of any generation."""
    resynced: bool = True
    """False while a controller that just started is still asking the holders what they hold."""

    def is_settled(self, step: int) -> bool:
        return step in self.committed or step in self.failed or step in self.superseded or step in self.abandoned


@dataclass(frozen=True, kw_only=True, slots=True)
class Distrusted(Message):
    """The controller's answer to ``distrust(generation, step, reason)``: what it took out of use."""

    generation: int
    step: int
    memory: bool
    """The in-memory snapshot is never offered to a restore plan again (always true)."""
    quarantined: bool
    """It was committed, and the checkpoint on storage is quarantined (kept for inspection, listed in
    ``quarantine.json`` with the reason, never restored from nor counted by keep-last)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Restored(Message):
    """Rank 0 reports where the attempt resumed from."""

    source: RestoreSource
    step: int
    epoch: int
    seconds: float = 0.0
    world_size: int = 1
    saved_world_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


__all__ = [
    "HOLDER_MESSAGES",
    "PROTOCOL_VERSION",
    "CheckpointKind",
    "ReplicaHeld",
    "ReplicaOffer",
    "SectionAt",
    "SlotDesc",
    "Stage",
    "StageReply",
    "StagedSlot",
    "StreamDesc",
    "CheckpointRequest",
    "Distrusted",
    "Failure",
    "HolderState",
    "IntegrityFailure",
    "MemorySnapshot",
    "PartReplicated",
    "Message",
    "PartDurable",
    "PartFailed",
    "PartStaged",
    "PartSuperseded",
    "ProtocolError",
    "RequestLevel",
    "RestorePlan",
    "RestoreSource",
    "Restored",
    "Schedule",
    "SectionState",
    "Settled",
    "SnapshotMeta",
    "SyncReply",
    "SyncRequest",
]
