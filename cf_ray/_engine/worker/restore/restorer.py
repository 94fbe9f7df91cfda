"""Restore at the start of an attempt: the controller's plan, the candidates it names (a holder's
snapshot in memory, committed checkpoints on storage and the upload tiers, another run's
checkpoint), each one read (``memory.py``, ``storage.py``), verified and *validated* on every rank
before any tracked object is touched (``checks.py``), then applied and checked against the
fingerprints the snapshot recorded; what it did is kept in ``record.py`` (all in ``restore/``).

Verified before use (``integrity.py``): every byte that came from memory against its block's CRC-32
(a copy that fails is refused, the next copy tried, then the next candidate), every file from
storage against the manifest's CRC-32, and the saved parameters and optimizer state for NaN and
infinity. A snapshot that failed is never offered again (the controller's plans leave it out; this
restore skips the other copies of what it refused itself: ``trust_gate.RunTrust``).

One decision, shared (``decision.py``): every phase (the plan, the candidates, each
candidate's read and validation, the load) ends with an exchange of every rank's outcome (a small
all-gather on cf_ray's own group), so an error on any rank reaches every rank within seconds, never
as a hang in a collective:

* reading failed (damage, a file or a holder gone, an I/O error that three tries with backoff did
  not get past) or validation refused the candidate: every rank falls back to the next one (rank
  0 records a ``restore_fallback`` event, with ``corrupt: true`` when the cause was damage, and the
  step of a damaged checkpoint of this run's own storage, which the controller then quarantines; a
  snapshot whose bytes or state failed a check is distrusted);
* a loaded object differs from its fingerprint and the snapshot's blocks no longer match (its
  memory changed under the load): every rank falls back too, and the next candidate overwrites what
  was loaded (with none left, every rank raises: the objects are partly overwritten);
* the script and the checkpoint disagree on what is tracked (:class:`~cf_ray.errors.CheckpointMismatchError`),
  a bad ``resume_from`` (:class:`~cf_ray.errors.ConfigError`), no plan, or a load that failed after
  validation (objects may be partly overwritten; an object not restored while the bytes are intact:
  its ``load_state_dict()``): every rank raises, naming the rank and the cause
  (:class:`~cf_ray.errors.RestoreError` unless the cause has a type of its own);
* no candidate left: a fresh start when every refusal was damage or a missing file; a
  :class:`~cf_ray.errors.RestoreError` when one was refused for another reason (a checkpoint
  exists that this script cannot use: never silently a fresh run).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import ray
import ray.exceptions

from cf_ray._engine.format.commit import read_manifest
from cf_ray._engine.format.layout import SHARED, rank_section, step_dir
from cf_ray._engine.format.sections import Section
from cf_ray._engine.protocol.events import IntegrityFailureEvent
from cf_ray._engine.protocol.messages import Restored, RestorePlan, RestoreSource
from cf_ray._engine.worker.context import WorkerContext
from cf_ray._engine.worker.control import ControlPlane
from cf_ray._engine.worker.link import ray_train_fast, ray_train_spare
from cf_ray._engine.worker.link.controller import ControllerLink
from cf_ray._engine.worker.restore import checks as _checks
from cf_ray._engine.worker.restore import integrity as _integrity
from cf_ray._engine.worker.restore import sharded as _sharded
from cf_ray._engine.worker.restore.decision import (
    Fallbacks,
    PlanFailed,
    Status,
    Verdict,
    decide,
    fail_status,
)
from cf_ray._engine.worker.restore.memory import MemoryReader
from cf_ray._engine.worker.restore.record import RestoreRecord
from cf_ray._engine.worker.restore.storage import (
    describe,
    load_section,
    other_run_checkpoint,
    read,
)
from cf_ray._engine.worker.restore.trust_gate import Reason, RunTrust, stopped_error
from cf_ray._engine.worker.results import Resume
from cf_ray.config import CheckpointConfig
from cf_ray.errors import CheckpointMismatchError, CorruptCheckpointError, RestoreError

logger = logging.getLogger("cf_ray")


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
    generation: int = -1
    """The generation that took the restored snapshot (-1: fresh, or another run's checkpoint)."""


@dataclass(frozen=True, slots=True)
class Options:
    """What a restore takes from the user's configuration, as it was when the Checkpointer was built."""

    restore_from: str
    resume_from: Any
    allow_missing: bool
    allow_unexpected: bool

    @staticmethod
    def of(config: CheckpointConfig) -> Options:
        return Options(
            restore_from=config.restore_from,
            resume_from=config.resume_from,
            allow_missing="missing" in config.allow_mismatch,
            allow_unexpected="unexpected" in config.allow_mismatch,
        )


def newest_committed(plan: RestorePlan) -> int:
    """The newest committed step on the primary storage or an upload tier (0 when none)."""
    newest = _newest_stored(plan)
    return newest if newest > 0 else 0


def _newest_stored(plan: RestorePlan) -> int:
    return max([plan.storage[0] if plan.storage else -1] + [t[0] for t in plan.tiers if t])


#: When cf_ray's worker code was loaded in this process: the training function's imports. A restart's
#: recovery splits here instead when rank 0's process is older than the failure (a process Ray had
#: started before it was needed, or ``/proc``'s start time, whole seconds of boot time, read early).
LOADED_UNIX = time.time()


def process_start_unix() -> float | None:
    """When this process started (wall clock), from ``/proc`` (``None`` where there is none): a
    restart's recovery splits at the new rank 0's process start."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


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
        self.options = Options.of(config)
        self.link = link
        self.control = control
        self.state = state
        self.data = data
        self.sharded = sharded
        self.trust = RunTrust()
        """What the run's restores must not use (the controller's events, read by rank 0 at :meth:`plan`)."""
        self.record = RestoreRecord(
            _integrity.Refusals(ctx.rank, link.record_event),
            Fallbacks(ctx.rank, link, lambda st: st is ctx.storage or st in ctx.tiers, ctx.storage),
        )
        """What the last restore did: phases timed, bytes read, copies refused, candidates skipped, objects verified."""
        self.memory = MemoryReader(ctx.rank, self.record)
        self._sections: dict[str, Section] = {}  # the candidate being applied (rechecked on a mismatch)
        self._generation = -1  # the generation that took the candidate being read
        self.spare = ray_train_spare.Spare(ctx.rank, ctx.key)
        """This rank's spare worker process for the next attempt (made once this attempt restored)."""

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
        self.record.clear()
        plan: Any = None
        if self.rank == 0:
            try:
                plan = (self.link.call("prepare_restore", self.world_size), self._read_trust())
            except Exception as e:  # noqa: BLE001 - shared with every rank below, never a hang
                plan = PlanFailed(describe(e))
        plan = self.control.broadcast(plan)
        self.record.timed("plan", t0)
        if isinstance(plan, PlanFailed):
            raise RestoreError(
                f"cf_ray: rank 0 could not get a restore plan from the controller ({plan.error}); every rank stops here"
            )
        plan, self.trust = plan
        if self.trust.exhausted is not None:
            raise stopped_error(self.trust.exhausted)
        return cast(RestorePlan, plan)

    def _read_trust(self) -> RunTrust:
        """What the trust gate recorded of this run (a rollback, a stopped run), from the controller's
        events (rank 0)."""
        try:
            return RunTrust.from_events(cast(list, self.link.call("events")))
        except Exception as e:  # noqa: BLE001 - the plan stands; every candidate is verified anyway
            logger.warning("cf_ray: could not read the run's events (%s)", describe(e))
            return RunTrust()

    def _candidates(self, plan: RestorePlan) -> list[tuple[RestoreSource, Any]]:
        """Newest first: the memory snapshot (when not older than storage), then storage steps."""
        candidates: list[tuple[RestoreSource, Any]] = []
        newest_storage = _newest_stored(plan)
        mem = plan.memory
        if (
            mem
            and self.options.restore_from in ("auto", "memory")
            and (self.options.restore_from == "memory" or mem.step >= newest_storage)
        ):
            candidates.append((RestoreSource.MEMORY, mem))
        if self.options.restore_from in ("auto", "storage"):
            # Newest step first; for the same step, the primary storage before the upload tiers
            # (fastest first), so a checkpoint lost or damaged on the primary is taken from a tier.
            found = [(s, 0, self.ctx.storage) for s in plan.storage]
            for i, steps in enumerate(plan.tiers):
                found.extend((s, i + 1, self.ctx.tiers[i]) for s in steps)
            candidates.extend(
                (RestoreSource.STORAGE, (st, step_dir(s))) for s, _, st in sorted(found, key=lambda x: (-x[0], x[1]))
            )
            if not found:
                # A new run started from another run's checkpoint.
                other = other_run_checkpoint(self.options.resume_from, self.ctx.ray_storage)
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
            status = Status(Verdict.OK, self.rank)
        except Exception as e:  # noqa: BLE001 - shared below
            status = fail_status(self.rank, e)
        decide(self._agree(status), "")
        refused: list[tuple[str, Status]] = []
        touched = ""  # a candidate refused after it was loaded in part (its bytes changed under the load)
        for source, cand in candidates:
            where = f"step {cand.step} in memory" if source is RestoreSource.MEMORY else cand[0].uri(cand[1])
            prepared, status = self._prepare(source, cand)
            statuses = self._agree(status)
            decide(statuses, where)
            if all(s.verdict is Verdict.OK for s in statuses):
                assert prepared is not None  # this rank's own verdict was OK
                prepared.epoch = statuses[0].epoch  # every rank resumes in rank 0's epoch
                outcome, status, statuses = self._apply(source, cand, where, prepared)
                if outcome is not None:
                    return outcome
                touched = where
            skipped = next(s for s in statuses if s.verdict is Verdict.SKIP)
            refused.append((where, skipped))
            suspect = self.record.fallbacks.add(source, where, status, statuses, cand, self._generation)
            if suspect is not None:  # its other copies are not tried either (the same bytes, or state)
                self.trust = self.trust.adding(suspect)
        if touched:
            raise RestoreError(
                f"cf_ray: the snapshot {touched} was damaged while it was loaded, and no other checkpoint could be "
                "restored: the tracked objects are partly overwritten, so training cannot start fresh from them; "
                "every rank stops here"
            )
        config_like = [(w, s) for w, s in refused if not s.damage]
        if config_like:
            reasons = "; ".join(f"{w}: rank {s.rank}: {s.error}" for w, s in config_like)
            raise RestoreError(
                f"cf_ray: no checkpoint could be restored, and {len(config_like)} could not be used by "
                f"this script ({reasons}). Starting fresh would throw the run's progress away; fix the "
                "cause, or set CheckpointConfig(restore_from='none') to start fresh on purpose"
            )
        return Outcome(source=RestoreSource.FRESH)

    def _prepare(self, source: RestoreSource, cand) -> tuple[_checks.Prepared | None, Status]:
        """Read, verify and validate one candidate on this rank (nothing tracked is touched)."""
        t0 = time.perf_counter()
        memory = source is RestoreSource.MEMORY
        self._generation = cand.generation if memory else -1
        try:
            loaded, saved_world, replicated = self._fetch(source, cand)
        except Exception as e:  # noqa: BLE001 - reading failed: fall back
            damage = isinstance(
                e, (CorruptCheckpointError, FileNotFoundError, LookupError, OSError, ray.exceptions.RayError)
            )
            corrupt = isinstance(e, CorruptCheckpointError)
            distrust = Reason.INTEGRITY.value if corrupt and memory else ""
            return None, Status(Verdict.SKIP, self.rank, describe(e), damage=damage, corrupt=corrupt, distrust=distrust)
        finally:
            self.record.timed("read", t0)
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
                allow_missing=self.options.allow_missing,
                allow_unexpected=self.options.allow_unexpected,
                sharded=self.sharded,
            )
            _integrity.check_finite(prepared.state, self.state)  # a transient state cannot be trained from
        except CheckpointMismatchError as e:
            return None, fail_status(self.rank, e)
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot be applied is skipped like a corrupt one
            corrupt = isinstance(e, CorruptCheckpointError)
            distrust = (
                Reason.NON_FINITE.value
                if isinstance(e, _integrity.NonFiniteStateError)
                else Reason.INTEGRITY.value
                if corrupt and memory
                else ""
            )
            return None, Status(
                Verdict.SKIP, self.rank, describe(e), damage=corrupt, corrupt=corrupt, distrust=distrust
            )
        finally:
            self.record.timed("validate", t0)
        self._sections = loaded
        return prepared, Status(Verdict.OK, self.rank, epoch=prepared.epoch)

    def _apply(
        self, source: RestoreSource, cand, where: str, prepared: _checks.Prepared
    ) -> tuple[Outcome | None, Status, list[Status]]:
        """Load a validated candidate; ``(None, ...)`` when a rank found its bytes changed under the
        load (every rank then falls back: the next candidate overwrites what was loaded)."""
        data_states: dict = {}
        try:
            t0 = time.perf_counter()
            data_states = _checks.apply(prepared, self.state, self.data, self.rank, self.world_size)
            self.record.timed("apply", t0)
            t0 = time.perf_counter()
            self.record.verified = _checks.verify(prepared, self.state, self.data)
            self.record.timed("verify", t0)
            status = Status(Verdict.OK, self.rank)
        except Exception as e:  # noqa: BLE001 - objects may be partly overwritten: every rank stops
            # Not restored as saved: the bytes changed under the load (damage), or the load is incomplete.
            damage = _integrity.recheck(self._sections) if isinstance(e, RestoreError) else ""
            if damage:
                status = Status(
                    Verdict.SKIP,
                    self.rank,
                    f"CorruptCheckpointError: the snapshot's bytes changed while they were loaded ({damage}): "
                    "the snapshot is damaged (not the objects' load_state_dict())",
                    damage=True,
                    corrupt=True,
                    distrust=Reason.INTEGRITY.value if source is RestoreSource.MEMORY else "",
                )
            else:
                status = Status(
                    Verdict.FAIL, self.rank, describe(e), error_type=type(e) if isinstance(e, RestoreError) else None
                )
        finally:
            self._sections = {}
        statuses = self._agree(status)
        decide(statuses, where)
        if any(s.verdict is Verdict.SKIP for s in statuses):
            return None, status, statuses
        if self.rank == 0:
            fresh = f"; kept as built: {', '.join(prepared.fresh)}" if prepared.fresh else ""
            logger.warning(
                "cf_ray: restored step %d (epoch %d) from %s (%s); %d objects verified against their fingerprints%s%s",
                prepared.step,
                prepared.epoch,
                source.value,
                where,
                len(self.record.verified),
                f" ({', '.join(self.record.verified)})" if self.record.verified else " (the checkpoint has none)",
                fresh,
            )
        path = None if source is RestoreSource.MEMORY else cand[0].uri(cand[1])
        outcome = Outcome(
            source=source,
            step=prepared.step,
            epoch=prepared.epoch,
            path=path,
            saved_world_size=prepared.saved_world,
            data=data_states,
            generation=self._generation,
        )
        return outcome, status, statuses

    def resume_of(self, outcome: Outcome, *, generation: int, seconds: float, rolled_back_from: int | None) -> Resume:
        """What ``Checkpointer.restore()`` returns for ``outcome``: where, and what this restore read,
        skipped and refused on the way."""
        return Resume(
            source=outcome.source.value,
            step=outcome.step,
            epoch=outcome.epoch,
            generation=generation,
            path=outcome.path,
            saved_world_size=outcome.saved_world_size,
            data=outcome.data,
            seconds=seconds,
            phases=dict(self.record.phases),
            read_bytes=dict(self.record.read_bytes),
            fallbacks=list(self.record.fallbacks.items),
            refused_copies=[IntegrityFailureEvent.of(f).to_dict() for f in self.record.refusals.items],
            rolled_back_from=rolled_back_from,
        )

    def _agree(self, status: Status) -> list[Status]:
        """Every rank's outcome of this phase (an all-gather; every rank reaches it, whatever happened)."""
        return cast(list, self.control.all_gather(status))

    def report(self, outcome: Outcome, seconds: float) -> None:
        """Tell the controller where the attempt resumed from (rank 0) and log it; then this rank's
        spare process for the next attempt is made (``link/ray_train_spare.py``)."""
        spare = ray_train_spare.arrival(restart=self.link.generation > 1)  # this process: a spare?
        if self.rank == 0:
            extra = self.record.fallbacks.extra()  # the candidates skipped, and why (the restart's event)
            # Where the restart's recovery went before the restore (Restart.rebuild_s, setup_s).
            extra.update(process_start_unix=process_start_unix(), restore_begin_unix=time.time() - seconds)
            extra.update(code_start_unix=LOADED_UNIX)
            extra.update(health_check_s=ray_train_fast.health_check_s())  # how soon Ray Train saw a failure
            if spare:
                extra.update(spare=spare)  # whether the restart's new process was a spare, or why not
            self.link.controller.restored.remote(
                Restored(
                    source=outcome.source,
                    step=outcome.step,
                    epoch=outcome.epoch,
                    seconds=seconds,
                    world_size=self.world_size,
                    saved_world_size=outcome.saved_world_size,
                    extra=extra,
                )
            )
        logger.info(
            "cf_ray: rank %d resumes at step %d epoch %d from %s",
            self.rank,
            outcome.step,
            outcome.epoch,
            outcome.source.value,
        )
        self.spare.start()

    def _sections_needed(self, saved_world: int, replicated: bool) -> list[str]:
        needed = [SHARED] if replicated else []
        if saved_world == self.world_size:
            needed.append(rank_section(self.rank))
        else:
            needed.extend(rank_section(r) for r in range(max(saved_world, 0)))
        return needed

    def _fetch(self, source: RestoreSource, cand) -> tuple[dict[str, Section], Any, bool]:
        """Read and verify everything this rank needs: (sections, saved world size, replicated)."""
        if source is RestoreSource.MEMORY:
            saved_world, replicated = cand.world_size, bool(cand.replicated)
            needed = self._sections_needed(int(saved_world), replicated)
            out = {sec: read(self.memory.section, cand, sec) for sec in needed}
            for sec in self._also_needed(out, int(saved_world), replicated):
                out[sec] = read(self.memory.section, cand, sec)
            return out, saved_world, replicated
        storage, directory = cand
        manifest = read(read_manifest, storage, directory)
        self._generation = manifest.generation
        why = self.trust.why_not(RestoreSource.STORAGE, manifest.generation, manifest.step)
        if why is not None and (storage is self.ctx.storage or storage in self.ctx.tiers):
            raise LookupError(f"step {manifest.step} holds the state this restore refused already ({why})")
        if manifest.final_model:
            raise CorruptCheckpointError(
                f"{storage.uri(directory)} holds only final model weights; load it "
                "with cf_ray.load_into(...) instead of resuming from it"
            )
        needed = self._sections_needed(manifest.world_size, manifest.replicated)
        # At another number of ranks every old rank section is needed, but of its shards only the parts
        # that overlap this rank's new ones: those sections are read by range (block by block verified).
        ranged = manifest.world_size != self.world_size and not manifest.replicated
        out = {sec: read(load_section, storage, directory, manifest, sec, ranged) for sec in needed}
        for sec in self._also_needed(out, manifest.world_size, manifest.replicated):
            out[sec] = read(load_section, storage, directory, manifest, sec, True)
        for sec in out.values():
            if isinstance(sec.buf, np.ndarray):  # a section read by range counts nothing here
                self.record.count("storage", sec.buf.nbytes)
        return out, manifest.world_size, manifest.replicated

    def _also_needed(self, loaded: dict[str, Section], saved_world: int, replicated: bool) -> list[str]:
        """The other ranks' sections, when this rank's says that objects tracked unsharded here were
        saved sharded (FSDP2 state into DDP: every old rank's shards make the whole tensors)."""
        if replicated or saved_world != self.world_size:
            return []
        own = loaded.get(rank_section(self.rank))
        saved = own.tree.get(_sharded.KEY) if own is not None and isinstance(own.tree, dict) else None
        live = self.sharded.names if self.sharded is not None else set()
        if not isinstance(saved, dict) or not any(n in self.state and n not in live for n in saved):
            return []
        return [rank_section(r) for r in range(saved_world) if r != self.rank]
