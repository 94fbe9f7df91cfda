"""Restore at the start of an attempt: the controller's plan, the candidates it names (a holder's
snapshot in memory, committed checkpoints on storage and the upload tiers, another run's
checkpoint), each one read, verified and *validated* on every rank before any tracked object is
touched (``restore_checks.py``), then applied and checked against the fingerprints the snapshot
recorded.

One decision, shared: every phase (the plan, the candidates, each candidate's read and validation,
the load) ends with an exchange of every rank's outcome (a small all-gather on cf_ray's own group),
so an error on any rank reaches every rank within seconds, never as a hang in a collective:

* reading failed (damage, a file or a holder gone, an I/O error that three tries with backoff did
  not get past) or validation refused the candidate: every rank falls back to the next one (rank
  0 records a ``restore_fallback`` event, with ``corrupt: true`` when the cause was damage; the
  the step of a damaged checkpoint of this run's own storage, which the controller then quarantines);
* the script and the checkpoint disagree on what is tracked (:class:`~cf_ray.errors.CheckpointMismatchError`),
  a bad ``resume_from`` (:class:`~cf_ray.errors.ConfigError`), no plan, or a load that failed after
  validation (objects may be partly overwritten): every rank raises, naming the rank and the cause
  (:class:`~cf_ray.errors.RestoreError` unless the cause has a type of its own);
* no candidate left: a fresh start when every refusal was damage or a missing file; a
  :class:`~cf_ray.errors.RestoreError` when one was refused for another reason (a checkpoint
  exists that this script cannot use: never silently a fresh run).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import ray
import ray.exceptions
import ray.train

from cf_ray._engine import env as _env
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.memory import wire as _wire
from cf_ray._engine.protocol.messages import (
    MemorySnapshot,
    Restored,
    RestorePlan,
    RestoreSource,
    SectionAt,
    SlotDesc,
    StreamDesc,
)
from cf_ray._engine.storage.base import Storage
from cf_ray._engine.worker import restore_checks as _checks
from cf_ray._engine.worker import sharded as _sharded
from cf_ray._engine.worker.context import WorkerContext
from cf_ray._engine.worker.control import ControlPlane
from cf_ray._engine.worker.controller_link import ControllerLink
from cf_ray._engine.worker.rng import rng_state, set_rng_state  # noqa: F401 - re-exported (older imports)
from cf_ray.config import CheckpointConfig
from cf_ray.errors import CfRayError, CheckpointMismatchError, ConfigError, CorruptCheckpointError, RestoreError

logger = logging.getLogger("cf_ray")

#: Tries of one read on a transient error (an ``OSError`` that is not "not found"), with backoff.
READ_TRIES = 3
#: Seconds before the second try (doubled for the next).
READ_BACKOFF_S = 0.2


@dataclass(frozen=True, slots=True)
class Outcome:
    """What this rank restored (the Checkpointer turns it into a ``Resume``)."""

    source: RestoreSource
    """Where from; ``FRESH`` when nothing was restored."""
    step: int = 0
    """The restored step count."""
    epoch: int = 0
    """The restored epoch."""
    path: str | None = None
    """The checkpoint's location when restored from storage."""
    saved_world_size: int | None = None
    """Number of ranks that saved it."""
    data: dict = field(default_factory=dict)
    """This rank's restored data-object states by name."""


class _Verdict(enum.IntEnum):
    OK = 0
    SKIP = 1
    """This candidate cannot be used: every rank goes on with the next one."""
    FAIL = 2
    """Every rank raises."""


@dataclass(frozen=True, slots=True)
class _Status:
    """One rank's outcome of a phase, as exchanged with every rank."""

    verdict: _Verdict
    rank: int
    error: str = ""
    """``Type: message`` of what went wrong."""
    error_type: type | None = None
    """For ``FAIL``: the cf_ray error type every rank raises (``None``: RestoreError)."""
    damage: bool = False
    """For ``SKIP``: the cause was damage or a missing file, not a refusal of the content."""
    corrupt: bool = False
    """For ``SKIP``: the cause was a :class:`CorruptCheckpointError` (the event says so; the controller quarantines it)."""


@dataclass(frozen=True, slots=True)
class _PlanFailed:
    """What rank 0 broadcasts instead of a plan when it could not get one."""

    error: str


def newest_committed(plan: RestorePlan) -> int:
    """The newest committed step on the primary storage or an upload tier (0 when none)."""
    newest = _newest_stored(plan)
    return newest if newest > 0 else 0


def _newest_stored(plan: RestorePlan) -> int:
    return max([plan.storage[0] if plan.storage else -1] + [t[0] for t in plan.tiers if t])


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class Restorer:
    """Restore of one rank. Every rank calls :meth:`plan`, then :meth:`load`, then :meth:`report`.

    Args:
        ctx: this rank's context (storage, tiers, whether Ray Train hands it a checkpoint).
        config: ``restore_from``, ``resume_from``, ``allow_mismatch``.
        link: this rank's line to the controller (re-resolved when the controller is gone).
        control: the agreement (the plan is broadcast, every phase's outcome shared).
        state, data: the tracked objects to load into.
        sharded: the tracked objects whose state is sharded (FSDP2/DTensor; ``sharded.py``).
    """

    def __init__(
        self,
        ctx: WorkerContext,
        config: CheckpointConfig,
        link: ControllerLink,
        control: ControlPlane,
        state: dict[str, Any],
        data: dict[str, Any],
        sharded: _sharded.ShardedState | None = None,
    ):
        self.ctx = ctx
        self.restore_from = config.restore_from
        self.resume_from = config.resume_from
        self.allow_missing = "missing" in config.allow_mismatch
        self.allow_unexpected = "unexpected" in config.allow_mismatch
        self.link = link
        self.control = control
        self.state = state
        self.data = data
        self.sharded = sharded
        self.verified: list[str] = []
        """The objects checked against their fingerprints by the last :meth:`load`."""
        self.phases: dict[str, float] = {}
        """Seconds this rank spent in each phase of the restore (``plan``, ``read``, ``validate``,
        ``apply``, ``verify``; ``read`` and ``validate`` summed over the candidates tried)."""

        self.read_bytes: dict[str, int] = {}
        """Bytes this rank read in the last restore, by how: ``in_place`` (a slot of a holder of its
        node, mapped), ``direct`` (streamed from a holder of another node), ``storage``."""

    def _count(self, how: str, nbytes: int) -> None:
        self.read_bytes[how] = self.read_bytes.get(how, 0) + int(nbytes)

    def _timed(self, phase: str, t0: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t0

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    # -- the plan --------------------------------------------------------------------------------------
    def plan(self) -> RestorePlan:
        """Rank 0 asks the controller for a new generation and a plan; every rank gets the same.

        Raises:
            RestoreError: rank 0 could not get one (on every rank).
        """
        t0 = time.perf_counter()
        self.phases, self.read_bytes = {}, {}
        plan: Any = None
        if self.rank == 0:
            try:
                plan = self.link.call("prepare_restore", self.world_size)
            except Exception as e:  # noqa: BLE001 - shared with every rank below, never a hang
                plan = _PlanFailed(_describe(e))
        plan = self.control.broadcast(plan)
        self._timed("plan", t0)
        if isinstance(plan, _PlanFailed):
            raise RestoreError(
                f"cf_ray: rank 0 could not get a restore plan from the controller ({plan.error}); every rank stops here"
            )
        return cast(RestorePlan, plan)

    def _candidates(self, plan: RestorePlan) -> list[tuple[RestoreSource, Any]]:
        """Newest first: the memory snapshot (when not older than storage), then storage steps."""
        candidates: list[tuple[RestoreSource, Any]] = []
        newest_storage = _newest_stored(plan)
        mem = plan.memory
        if (
            mem
            and self.restore_from in ("auto", "memory")
            and (self.restore_from == "memory" or mem.step >= newest_storage)
        ):
            candidates.append((RestoreSource.MEMORY, mem))
        if self.restore_from in ("auto", "storage"):
            # Newest step first; for the same step, the primary storage before the upload tiers
            # (fastest first), so a checkpoint lost or damaged on the primary is taken from a tier.
            found = [(s, 0, self.ctx.storage) for s in plan.storage]
            for i, steps in enumerate(plan.tiers):
                found.extend((s, i + 1, self.ctx.tiers[i]) for s in steps)
            candidates.extend(
                (RestoreSource.STORAGE, (st, mf.step_dir(s))) for s, _, st in sorted(found, key=lambda x: (-x[0], x[1]))
            )
            if not found:
                # A new run started from another run's checkpoint.
                other = self._other_run_checkpoint()
                if other is not None:
                    candidates.append((RestoreSource.STORAGE, other))
        return candidates

    # -- fetch, validate, apply: every phase's outcome shared ------------------------------------------
    def load(self, plan: RestorePlan) -> Outcome:
        """The newest candidate every rank could read and validate, loaded into the tracked objects.

        Raises:
            CheckpointMismatchError, ConfigError, RestoreError: on every rank (see the module doc).
        """
        candidates: list[tuple[RestoreSource, Any]] = []
        try:
            candidates = self._candidates(plan)
            status = _Status(_Verdict.OK, self.rank)
        except Exception as e:  # noqa: BLE001 - shared below
            status = self._fail(e)
        self._decide(self._agree(status), "")
        refused: list[tuple[str, _Status]] = []
        for source, cand in candidates:
            where = f"step {cand.step} in memory" if source is RestoreSource.MEMORY else cand[0].uri(cand[1])
            prepared, status = self._prepare(source, cand)
            statuses = self._agree(status)
            self._decide(statuses, where)
            skipped = next((s for s in statuses if s.verdict is _Verdict.SKIP), None)
            if skipped is not None:
                refused.append((where, skipped))
                self._fall_back(source, where, status, skipped, cand)
                continue
            assert prepared is not None  # this rank's own verdict was OK
            return self._apply(source, cand, where, prepared)
        config_like = [(w, s) for w, s in refused if not s.damage]
        if config_like:
            reasons = "; ".join(f"{w}: rank {s.rank}: {s.error}" for w, s in config_like)
            raise RestoreError(
                f"cf_ray: no checkpoint could be restored, and {len(config_like)} could not be used by "
                f"this script ({reasons}). Starting fresh would throw the run's progress away; fix the "
                "cause, or set CheckpointConfig(restore_from='none') to start fresh on purpose"
            )
        return Outcome(source=RestoreSource.FRESH)

    def _prepare(self, source: RestoreSource, cand) -> tuple[_checks.Prepared | None, _Status]:
        """Read and validate one candidate on this rank (nothing tracked is touched)."""
        t0 = time.perf_counter()
        try:
            loaded, saved_world, replicated = self._fetch(source, cand)
        except Exception as e:  # noqa: BLE001 - reading failed: fall back
            damage = isinstance(
                e, (CorruptCheckpointError, FileNotFoundError, LookupError, OSError, ray.exceptions.RayError)
            )
            return None, _Status(
                _Verdict.SKIP, self.rank, _describe(e), damage=damage, corrupt=isinstance(e, CorruptCheckpointError)
            )
        finally:
            self._timed("read", t0)
        t0 = time.perf_counter()
        try:
            prepared = _checks.validate(
                loaded,
                saved_world=saved_world,
                replicated=replicated,
                rank=self.rank,
                world_size=self.world_size,
                state=self.state,
                data=self.data,
                allow_missing=self.allow_missing,
                allow_unexpected=self.allow_unexpected,
                sharded=self.sharded,
            )
        except CheckpointMismatchError as e:
            return None, self._fail(e)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be applied is skipped like a corrupt one
            corrupt = isinstance(e, CorruptCheckpointError)
            return None, _Status(_Verdict.SKIP, self.rank, _describe(e), damage=corrupt, corrupt=corrupt)
        finally:
            self._timed("validate", t0)
        return prepared, _Status(_Verdict.OK, self.rank)

    def _apply(self, source: RestoreSource, cand, where: str, prepared: _checks.Prepared) -> Outcome:
        data_states: dict = {}
        try:
            t0 = time.perf_counter()
            data_states = _checks.apply(prepared, self.state, self.data, self.rank, self.world_size)
            self._timed("apply", t0)
            t0 = time.perf_counter()
            self.verified = _checks.verify(prepared, self.state, self.data)
            self._timed("verify", t0)
            status = _Status(_Verdict.OK, self.rank)
        except Exception as e:  # noqa: BLE001 - objects may be partly overwritten: every rank stops
            status = _Status(
                _Verdict.FAIL, self.rank, _describe(e), error_type=type(e) if isinstance(e, RestoreError) else None
            )
        self._decide(self._agree(status), where)
        if self.rank == 0:
            fresh = f"; kept as built: {', '.join(prepared.fresh)}" if prepared.fresh else ""
            logger.warning(
                "cf_ray: restored step %d (epoch %d) from %s (%s); %d objects verified against their fingerprints%s%s",
                prepared.step,
                prepared.epoch,
                source.value,
                where,
                len(self.verified),
                f" ({', '.join(self.verified)})" if self.verified else " (the checkpoint has none)",
                fresh,
            )
        path = None if source is RestoreSource.MEMORY else cand[0].uri(cand[1])
        return Outcome(
            source=source,
            step=prepared.step,
            epoch=prepared.epoch,
            path=path,
            saved_world_size=prepared.saved_world,
            data=data_states,
        )

    # -- the shared decision ----------------------------------------------------------------------------
    def _fail(self, e: BaseException) -> _Status:
        keep = isinstance(e, CfRayError) and type(e) is not CfRayError
        return _Status(_Verdict.FAIL, self.rank, _describe(e), error_type=type(e) if keep else None)

    def _agree(self, status: _Status) -> list[_Status]:
        """Every rank's outcome of this phase (an all-gather; every rank reaches it, whatever happened)."""
        return cast(list, self.control.all_gather(status))

    def _decide(self, statuses: list[_Status], where: str) -> None:
        """Raise on every rank when some rank failed; the error names that rank and its cause."""
        failed = next((s for s in statuses if s.verdict is _Verdict.FAIL), None)
        if failed is None:
            return
        at = f" restoring {where}" if where else ""
        msg = failed.error.split(": ", 1)[1] if ": " in failed.error else failed.error
        text = (
            f"{msg} (rank {failed.rank}{at}; raised on every rank)"
            if failed.error_type is not None
            else f"cf_ray: restore failed on rank {failed.rank}{at}: {failed.error}; every rank stops here"
        )
        cls = failed.error_type if failed.error_type is not None else RestoreError
        try:
            err = cls(text)
        except Exception:  # noqa: BLE001 - a type that takes other arguments
            err = RestoreError(text)
        raise err

    def _fall_back(self, source: RestoreSource, where: str, mine: _Status, first: _Status, cand: Any) -> None:
        why = mine.error if mine.verdict is _Verdict.SKIP else f"rank {first.rank}: {first.error}"
        logger.warning("cf_ray: rank %d: cannot restore %s (%s); falling back", self.rank, where, why)
        if self.rank == 0:
            event = {
                "event": "restore_fallback",
                "source": source.value,
                "where": where,
                "error": first.error,
                "rank": first.rank,
                "corrupt": first.corrupt,
            }
            if source is RestoreSource.STORAGE and cand[0] is self.ctx.storage:
                # A committed checkpoint of this run's own storage: the controller quarantines it
                # when it is corrupt, so that it no longer counts toward keep-last.
                step = mf.parse_step_dir(cand[1])
                if step is not None:
                    event["step"] = step
            self.link.record_event(event)

    def report(self, outcome: Outcome, seconds: float) -> None:
        """Tell the controller where the attempt resumed from (rank 0) and log it."""
        if self.rank == 0:
            self.link.controller.restored.remote(
                Restored(
                    source=outcome.source,
                    step=outcome.step,
                    epoch=outcome.epoch,
                    seconds=seconds,
                    world_size=self.world_size,
                    saved_world_size=outcome.saved_world_size,
                )
            )
        logger.info(
            "cf_ray: rank %d resumes at step %d epoch %d from %s",
            self.rank,
            outcome.step,
            outcome.epoch,
            outcome.source.value,
        )

    def _other_run_checkpoint(self) -> tuple[Storage, str] | None:
        """``CheckpointConfig.resume_from``, else the checkpoint Ray Train hands this run, if any.
        A final model is followed to the full checkpoint its manifest names.

        Raises:
            ConfigError: ``resume_from`` holds no cf_ray checkpoint to resume from (naming it).
        """
        from cf_ray.load import resumable_checkpoint

        source = self.resume_from
        if source is not None:
            try:
                return resumable_checkpoint(source)
            except Exception as e:  # noqa: BLE001 - whatever it is, the user's setting is wrong
                raise ConfigError(
                    f"CheckpointConfig.resume_from={_source_name(source)!r} holds no cf_ray checkpoint to "
                    f"resume from ({_describe(e)}); pass a run directory, a checkpoint directory or a "
                    "ray.train.Checkpoint of a cf_ray run (e.g. result.checkpoint)"
                ) from None
        if self.ctx.ray_storage is None:
            return None
        try:
            source = ray.train.get_checkpoint()
        except Exception:  # noqa: BLE001
            source = None
        if source is None:
            return None
        try:
            return resumable_checkpoint(source)
        except Exception as e:  # noqa: BLE001 - not a cf_ray checkpoint: Ray Train's own, for instance
            logger.warning(
                "cf_ray: %s is not a committed cf_ray checkpoint (%s); starting fresh", _source_name(source), e
            )
            return None

    def _sections_needed(self, saved_world: int, replicated: bool) -> list[str]:
        needed = [mf.SHARED] if replicated else []
        if saved_world == self.world_size:
            needed.append(mf.rank_section(self.rank))
        else:
            needed.extend(mf.rank_section(r) for r in range(max(saved_world, 0)))
        return needed

    def _fetch(self, source: RestoreSource, cand) -> tuple[dict[str, mf.Section], Any, bool]:
        """Read and verify everything this rank needs: (sections, saved world size, replicated)."""
        if source is RestoreSource.MEMORY:
            saved_world, replicated = cand.world_size, bool(cand.replicated)
            needed = self._sections_needed(int(saved_world), replicated)
            out = {sec: _read(self._fetch_memory, cand, sec) for sec in needed}
            for sec in self._also_needed(out, int(saved_world), replicated):
                out[sec] = _read(self._fetch_memory, cand, sec)
            return out, saved_world, replicated
        storage, directory = cand
        manifest = _read(mf.read_manifest, storage, directory)
        if manifest.kind == "final":
            raise CorruptCheckpointError(
                f"{storage.uri(directory)} holds only final model weights; load it "
                "with cf_ray.load_into(...) instead of resuming from it"
            )
        needed = self._sections_needed(manifest.world_size, manifest.replicated)
        # At another number of ranks every old rank section is needed, but of its shards only the parts
        # that overlap this rank's new ones: those sections are read by range (block by block verified).
        ranged = manifest.world_size != self.world_size and not manifest.replicated
        out = {sec: _read(_load_section, storage, directory, manifest, sec, ranged) for sec in needed}
        for sec in self._also_needed(out, manifest.world_size, manifest.replicated):
            out[sec] = _read(_load_section, storage, directory, manifest, sec, True)
        for sec in out.values():
            if isinstance(sec.buf, np.ndarray):  # a section read by range counts nothing here
                self._count("storage", sec.buf.nbytes)
        return out, manifest.world_size, manifest.replicated

    def _also_needed(self, loaded: dict[str, mf.Section], saved_world: int, replicated: bool) -> list[str]:
        """The other ranks' sections, when this rank's says that objects tracked unsharded here were
        saved sharded (FSDP2 state into DDP: every old rank's shards make the whole tensors)."""
        if replicated or saved_world != self.world_size:
            return []
        own = loaded.get(mf.rank_section(self.rank))
        saved = own.tree.get(_sharded.KEY) if own is not None and isinstance(own.tree, dict) else None
        live = self.sharded.names if self.sharded is not None else set()
        if not isinstance(saved, dict) or not any(n in self.state and n not in live for n in saved):
            return []
        return [mf.rank_section(r) for r in range(saved_world) if r != self.rank]

    @staticmethod
    def _node_id() -> str:
        try:
            return ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - outside Ray: every memory read is then a stream
            return ""

    def _map_slot(self, desc: SlotDesc, cand: MemorySnapshot, section: str) -> np.ndarray:
        """A section in a snapshot slot of a holder of this node, mapped read-only and read in place
        (the restore loads from it: no copy out of the slot first). The mapping stays as long as
        the arrays that view it."""
        lk = _slots.ReadLock.take(desc, cand.generation, cand.step, wait_s=1.0, populate=True)
        if lk is None:
            raise LookupError(f"the slot of section {section} of step {cand.step} was filled again since")
        arr = np.frombuffer(lk.data, dtype=np.uint8)
        # No snapshot is taken while this attempt restores, so nothing fills the slot meanwhile; the
        # shared lock is released now (a reader never blocks the next snapshot); the mapping stays
        # as long as the array that views it.
        _slots.unlock(lk.fd)
        os.close(lk.fd)
        return arr

    def _fetch_memory(self, cand: MemorySnapshot, section: str) -> mf.Section:
        """A section from the memory of its holder, else of a holder of another node with a copy
        (a peer replica: the section's own node may be lost): in place from a slot of a holder of
        this node, over a direct transfer from a holder of another node (``memory/wire.py``)."""
        first = cand.sections.get(section)
        if first is None:
            raise LookupError(f"no holder has section {section}")
        errors = []
        for holder_name in (first, *cand.replicas.get(section, ())):
            try:
                holder = ray.get_actor(holder_name, namespace=_env.namespace())
                at = self._ask(holder, holder_name, cand, section)
                if isinstance(at.where, StreamDesc):
                    try:
                        arena = _wire.fetch(at.where, _env.get_float(_env.ACTOR_TIMEOUT_S))
                    except (OSError, LookupError):
                        holder.withdraw_offer.remote(at.where.token)  # its slot is released now
                        raise
                    how = "direct"
                else:
                    arena, how = self._map_slot(at.where, cand, section), "in_place"
            except (ValueError, LookupError, OSError, ray.exceptions.RayError) as e:
                errors.append(f"{holder_name}: {_describe(e)}")
                continue
            if holder_name != first:
                logger.warning(
                    "cf_ray: rank %d: %s of step %d from a peer's copy (%s)", self.rank, section, cand.step, holder_name
                )
            self._count(how, arena.nbytes)
            return self._memory_section(at, arena, section)
        raise LookupError(f"no copy of section {section} of step {cand.step} could be read: {'; '.join(errors)}")

    @staticmethod
    def _memory_section(at: SectionAt, arena: np.ndarray, section: str) -> mf.Section:
        """The section from the bytes a holder gave and its index (which carries the CRC-32 of every
        block: ``at.index``; of the whole: ``at.crc32``). A streamed buffer is this process's own."""
        tree, entries = mf.parse_index(at.index, f"memory:{section}")
        return mf.Section(tree, entries, arena, private=isinstance(at.where, StreamDesc))

    def _ask(self, holder, holder_name: str, cand: MemorySnapshot, section: str) -> SectionAt:
        """Where ``holder`` has ``section`` of the candidate's step."""
        got = ray.get(
            holder.get_section.remote(cand.generation, cand.step, section, self._node_id()),
            timeout=_env.get_float(_env.ACTOR_TIMEOUT_S),
        )
        if got is None:
            raise LookupError(f"holder {holder_name} no longer has section {section} of step {cand.step}")
        return cast(SectionAt, got)


def _read(fn, *args):
    """``fn(*args)``, tried again (``READ_TRIES`` in all, with backoff) on a transient I/O error."""
    delay = READ_BACKOFF_S
    for attempt in range(READ_TRIES):
        try:
            return fn(*args)
        except (CfRayError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
            raise  # not transient
        except OSError as e:
            if attempt == READ_TRIES - 1:
                raise
            logger.warning("cf_ray: reading a checkpoint failed (%s); trying again in %.1f s", _describe(e), delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def _load_section(storage: Storage, directory: str, manifest: mf.Manifest, section: str, ranged: bool) -> mf.Section:
    if ranged:
        return mf.load_section(storage, directory, manifest, section, ranged=True)
    return mf.load_section(storage, directory, manifest, section)


def _source_name(source: Any) -> str:
    """A resume source as a user wrote it: a path, or a ``ray.train.Checkpoint``'s path."""
    return str(getattr(source, "path", source))
