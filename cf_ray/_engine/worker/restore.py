"""Restore at the start of an attempt: the controller's plan, the candidates it names (a holder's
snapshot in memory, committed checkpoints on storage and the upload tiers, another run's
checkpoint), fetched and verified on every rank before any tracked object is touched, then
applied; a candidate any rank cannot read is skipped on every rank (the next one is tried).
Also the RNG states a snapshot carries (this rank's Python, NumPy, torch and CUDA generators).
"""

from __future__ import annotations

import logging
import random
import warnings
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import ray
import torch

from cf_ray._engine import env as _env
from cf_ray._engine.driver.messages import MemorySnapshot, Restored, RestorePlan, RestoreSource
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.storage.base import Storage
from cf_ray._engine.worker.context import WorkerContext
from cf_ray._engine.worker.control import ControlPlane
from cf_ray.config import CheckpointConfig
from cf_ray.errors import CheckpointNotFoundError, CorruptCheckpointError, ElasticResumeError

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


def newest_committed(plan: RestorePlan) -> int:
    """The newest committed step on the primary storage or an upload tier (0 when none)."""
    newest = _newest_stored(plan)
    return newest if newest > 0 else 0


def _newest_stored(plan: RestorePlan) -> int:
    return max([plan.storage[0] if plan.storage else -1] + [t[0] for t in plan.tiers if t])


class Restorer:
    """Restore of one rank. Every rank calls :meth:`plan`, then :meth:`load`, then :meth:`report`.

    Args:
        ctx: this rank's context (storage, tiers, whether Ray Train hands it a checkpoint).
        config: ``restore_from`` and ``resume_from``.
        controller: the run's controller actor.
        control: the agreement (the plan is broadcast, every candidate agreed on).
        state, data: the tracked objects to load into.
    """

    def __init__(self, ctx: WorkerContext, config: CheckpointConfig, controller, control: ControlPlane,
                 state: dict[str, Any], data: dict[str, Any]):
        self.ctx = ctx
        self.restore_from = config.restore_from
        self.resume_from = config.resume_from
        self.controller = controller
        self.control = control
        self.state = state
        self.data = data

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    # -- the plan --------------------------------------------------------------------------------------
    def plan(self) -> RestorePlan:
        """Rank 0 asks the controller for a new generation and a plan; every rank gets the same."""
        plan = None
        if self.rank == 0:
            plan = ray.get(self.controller.prepare_restore.remote(self.world_size),
                           timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
        return cast(RestorePlan, self.control.broadcast(plan))

    def _candidates(self, plan: RestorePlan) -> list[tuple[RestoreSource, Any]]:
        """Newest first: the memory snapshot (when not older than storage), then storage steps."""
        candidates: list[tuple[RestoreSource, Any]] = []
        newest_storage = _newest_stored(plan)
        mem = plan.memory
        if mem and self.restore_from in ("auto", "memory") and (
                self.restore_from == "memory" or mem.step >= newest_storage):
            candidates.append((RestoreSource.MEMORY, mem))
        if self.restore_from in ("auto", "storage"):
            # Newest step first; for the same step, the primary storage before the upload tiers
            # (fastest first), so a checkpoint lost or damaged on the primary is taken from a tier.
            found = [(s, 0, self.ctx.storage) for s in plan.storage]
            for i, steps in enumerate(plan.tiers):
                found.extend((s, i + 1, self.ctx.tiers[i]) for s in steps)
            candidates.extend((RestoreSource.STORAGE, (st, mf.step_dir(s)))
                              for s, _, st in sorted(found, key=lambda x: (-x[0], x[1])))
            if not found:
                # A new run started from another run's checkpoint.
                other = self._other_run_checkpoint()
                if other is not None:
                    candidates.append((RestoreSource.STORAGE, other))
        return candidates

    # -- fetch and apply -------------------------------------------------------------------------------
    def load(self, plan: RestorePlan) -> Outcome:
        """The newest candidate every rank could read, loaded into the tracked objects."""
        for source, cand in self._candidates(plan):
            loaded, error = self._fetch(source, cand)
            if self.control.all_true(loaded is not None):
                assert loaded is not None  # this rank's own flag was in the agreement
                return self._apply(source, cand, loaded)
            where = f"step {cand.step} in memory" if source is RestoreSource.MEMORY else cand[0].uri(cand[1])
            logger.warning("cf_ray: rank %d: cannot restore %s (%s); falling back", self.rank, where,
                           error or "another rank could not")
            if self.rank == 0:
                self.controller.record_event.remote({"event": "restore_fallback", "source": source.value,
                                                     "where": where, "error": str(error)})
        return Outcome(source=RestoreSource.FRESH)

    def report(self, outcome: Outcome, seconds: float) -> None:
        """Tell the controller where the attempt resumed from (rank 0) and log it."""
        if self.rank == 0:
            self.controller.restored.remote(Restored(
                source=outcome.source, step=outcome.step, epoch=outcome.epoch, seconds=seconds,
                world_size=self.world_size, saved_world_size=outcome.saved_world_size))
        logger.info("cf_ray: rank %d resumes at step %d epoch %d from %s", self.rank, outcome.step, outcome.epoch,
                    outcome.source.value)

    def _other_run_checkpoint(self) -> tuple[Storage, str] | None:
        """``CheckpointConfig.resume_from``, else the checkpoint Ray Train hands this run, if any."""
        source = self.resume_from
        if source is None and self.ctx.ray_storage is not None:
            try:
                source = ray.train.get_checkpoint()
            except Exception:  # noqa: BLE001
                source = None
        if source is None:
            return None
        from cf_ray.load import open_run

        try:
            run, directory = open_run(source)
            if directory is None:
                committed = mf.list_committed(run)
                directory = committed[-1].path if committed else None
        except Exception as e:  # noqa: BLE001 - not a cf_ray checkpoint
            logger.warning("cf_ray: cannot resume from %s: %s", source, e)
            return None
        if directory is None or not run.exists(f"{directory}/{mf.MANIFEST}"):
            logger.warning("cf_ray: %s is not a committed cf_ray checkpoint; starting fresh", source)
            return None
        return run, directory

    def _sections_needed(self, saved_world: int, replicated: bool) -> list[str]:
        needed = [mf.SHARED] if replicated else []
        if saved_world == self.world_size:
            needed.append(mf.rank_section(self.rank))
        else:
            needed.extend(mf.rank_section(r) for r in range(saved_world))
        return needed

    def _fetch(self, source: RestoreSource, cand) -> tuple[dict | None, str | None]:
        """Read and verify everything this rank needs, without touching any tracked object."""
        try:
            if source is RestoreSource.MEMORY:
                needed = self._sections_needed(int(cand.world_size), bool(cand.replicated))
                return {sec: self._fetch_memory(cand, sec) for sec in needed}, None
            storage, directory = cand
            manifest = mf.read_manifest(storage, directory)
            if manifest.kind == "final":
                raise CorruptCheckpointError(f"{storage.uri(directory)} holds only final model weights; load it "
                                             "with cf_ray.load_into(...) instead of resuming from it")
            needed = self._sections_needed(manifest.world_size, manifest.replicated)
            out: dict[str, Any] = {sec: mf.load_section(storage, directory, manifest, sec) for sec in needed}
            out["__manifest__"] = manifest
            return out, None
        except (CorruptCheckpointError, CheckpointNotFoundError, ElasticResumeError, LookupError, OSError,
                ValueError, ray.exceptions.RayError) as e:
            return None, f"{type(e).__name__}: {e}"

    def _fetch_memory(self, cand: MemorySnapshot, section: str) -> mf.Section:
        holder_name = cand.sections.get(section)
        if holder_name is None:
            raise LookupError(f"no holder has section {section}")
        holder = ray.get_actor(holder_name, namespace=_env.namespace())
        got = ray.get(holder.get_section.remote(cand.generation, cand.step, section),
                      timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
        if got is None:
            raise LookupError(f"holder {holder_name} no longer has section {section} of step {cand.step}")
        ref, index = got
        arena = cast(np.ndarray, ray.get(ref, timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)))
        tree, entries = mf.parse_index(index, f"memory:{section}")
        return mf.Section(tree, entries, arena)

    def _apply(self, source: RestoreSource, cand, loaded: dict) -> Outcome:
        manifest = loaded.pop("__manifest__", None)
        if source is RestoreSource.MEMORY:
            saved_world, replicated = int(cand.world_size), bool(cand.replicated)
            path = None
        else:
            saved_world, replicated = manifest.world_size, manifest.replicated
            path = cand[0].uri(cand[1])
        if saved_world != self.world_size and not replicated:
            raise ElasticResumeError(
                f"the checkpoint was saved by {saved_world} ranks with replicated=False (per-rank model state); "
                f"it cannot be loaded by {self.world_size} ranks. Resume with {saved_world} workers.")
        rank_trees = {sec: s.materialize(copy=False) for sec, s in loaded.items() if sec.startswith("rank_")}
        if replicated:
            section, where = loaded[mf.SHARED], ("objects",)
        else:
            section, where = loaded[mf.rank_section(self.rank)], ("state",)
        _load_objects(self.state, _materialize_objects(section, where, self.state), "state")
        if saved_world == self.world_size:
            mine = rank_trees[mf.rank_section(self.rank)]
            _load_objects(self.data, mine["objects"], "data")
            set_rng_state(mine["rng"])
            data_states = mine["objects"]
        else:
            old = [rank_trees[mf.rank_section(r)] for r in range(saved_world)]
            mine = old[self.rank] if self.rank < saved_world else old[0]
            for name, obj in self.data.items():
                states = [o["objects"].get(name) for o in old]
                if not hasattr(obj, "load_elastic_state"):
                    raise ElasticResumeError(
                        f"data object {name!r} ({type(obj).__name__}) was saved by {saved_world} ranks and cannot be "
                        f"re-split over {self.world_size}: it has no load_elastic_state(states, rank, world_size). "
                        "Use a cf_ray.data source or resume with the same number of workers.")
                obj.load_elastic_state(states, self.rank, self.world_size)
            if self.rank < saved_world:
                set_rng_state(mine["rng"])
            data_states = {name: obj.state_dict() for name, obj in self.data.items()}
        return Outcome(source=source, step=int(mine["counters"]["step"]), epoch=int(mine["counters"]["epoch"]),
                       path=path, saved_world_size=saved_world, data=data_states)


# -- RNG states -----------------------------------------------------------------------------------------

def rng_state() -> dict:
    """This process's RNG states (Python, NumPy, torch, and CUDA when initialised)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned (as a snapshot stores it)."""
    random.setstate(_tuplify(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].clone().contiguous())
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.clone(), i)


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


# -- tracked objects ------------------------------------------------------------------------------------

def _materialize_objects(section: mf.Section, path: tuple[str, ...], objs: dict) -> dict:
    """The saved states of tracked objects, with as few copies as is safe.

    ``nn.Module.load_state_dict`` copies into the module's own parameters, so a module gets views
    straight into the snapshot's buffer (read-only when it is an object-store buffer: restore from
    memory then costs a single copy). Everything else (optimizers keep the tensors they are given)
    gets private, writable copies.
    """
    tree = section.tree
    for p in path:
        tree = tree[p]
    out = {}
    for name, sub in tree.items():
        in_place = isinstance(objs.get(name), torch.nn.Module)
        out[name] = _codec.unflatten(
            sub, lambda _i, e, c=not in_place: _codec.view(section.buf, e, copy=c, readonly_ok=not c),
            section.entries)
    return out


def _load_objects(objs: dict, states: dict, what: str) -> None:
    missing = [n for n in objs if n not in states]
    if missing:
        raise CorruptCheckpointError(
            f"the checkpoint has no {what} for {missing} (it has {sorted(states)}); track the same names as the run "
            "that saved it")
    extra = [n for n in states if n not in objs]
    if extra:
        logger.warning("cf_ray: the checkpoint also has %s %s, which this Checkpointer does not track; ignored", what,
                       extra)
    for name, obj in objs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj.load_state_dict(states[name])
