"""The worker-loop utility: what a user calls inside ``train_loop_per_worker``.

.. code-block:: python

    ckpt = cf_ray.Checkpointer({"model": model, "optimizer": optimizer}, data={"sampler": sampler})
    resume = ckpt.restore()
    for epoch in range(resume.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            ckpt.step(optimizer)          # in place of optimizer.step()
            optimizer.zero_grad()
        ckpt.end_epoch()
    ckpt.finish()

Per step, on the training thread, cf_ray does: the weight-update guard (wait for an in-flight
background copy, usually already done), the optimizer step, one asynchronous exchange with the
other ranks (``_control.py``), the policy's decision, and a non-blocking poll of the controller.
Nothing in a step waits for storage or for the controller.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import random
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import ray
import torch

from cf_ray._engine import env as _env
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format import manifest as mf
from cf_ray._engine.worker.control import ControlPlane
from cf_ray._engine.driver.controller import (ControllerSettings, controller_name, get_or_create_controller, run_key)
from cf_ray.errors import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError, ElasticResumeError,
                           PersistError)
from cf_ray._engine.node.holder import get_or_create_holder
from cf_ray.config import CheckpointConfig, PreemptionConfig
from cf_ray.preemption import PreemptionWatcher
from cf_ray.policy import SaveContext
from cf_ray._engine.worker.snapshot import SnapshotJob, Snapshotter, StagedSection
from cf_ray._engine.storage.fs import FsStorage, Storage

logger = logging.getLogger("cf_ray")

@dataclass(frozen=True, slots=True)
class Resume:
    """Where a run resumes: returned by :meth:`Checkpointer.restore`."""

    source: str
    """``fresh`` (nothing to restore), ``memory`` (a holder's snapshot) or ``storage``."""
    step: int
    """Optimizer steps already taken; the next ``step()`` makes it ``step + 1``."""
    epoch: int
    """The epoch to continue (mid-epoch when the data objects say so)."""
    generation: int
    """This attempt's generation (1 for the first start of a run)."""
    path: str | None = None
    """The checkpoint's location when restored from storage."""
    saved_world_size: int | None = None
    """Number of ranks that saved the checkpoint."""
    data: dict = field(default_factory=dict)
    """This rank's restored data-object states by name."""
    seconds: float = 0.0
    """Time spent restoring on this rank."""

    @property
    def fresh(self) -> bool:
        return self.source == "fresh"


@dataclass(frozen=True, slots=True)
class FinishSummary:
    """What :meth:`Checkpointer.finish` reports."""

    final_path: str | None
    committed_steps: list[int]
    failures: list[dict]


class Checkpointer:
    """Two-phase, frequent checkpoints of a ``train_loop_per_worker``; one per rank.

    Args:
        state: objects with ``state_dict``/``load_state_dict`` that are replicated across ranks
            (model, optimizers, LR schedulers, AMP grad scaler, user objects), by name.
        data: per-rank objects (samplers, data iterators) by name; their state is saved per rank
            and, when the number of ranks changes, re-split (see ``cf_ray.data``).
        config: how and when to checkpoint.

    Raises:
        ConfigError: no tracked objects, an object without ``state_dict``, or unwritable storage.
    """

    def __init__(self, state: Mapping[str, Any], *, data: Mapping[str, Any] | None = None,
                 config: CheckpointConfig | None = None):
        self.config = config or CheckpointConfig()
        # DDP wrappers are tracked through the module they wrap (same parameters), so a checkpoint's
        # keys do not depend on the wrapper: Ray's prepare_model() does not wrap with one worker, and
        # an elastic run must load a 2-worker checkpoint into 1 worker and back.
        self.state = {n: _unwrap_ddp(o) for n, o in _check_tracked(state, "state").items()}
        self.data = _check_tracked(data or {}, "data", allow_empty=True)
        self.rank, self.world_size, run_name, storage, ray_storage = _context(self.config)
        self.storage: FsStorage = storage
        self._ray_storage = ray_storage
        storage.check_writable()
        tiers = []
        if self.config.upload_path:
            tier = FsStorage.from_uri(self.config.upload_path, self.config.upload_filesystem).child(
                f"{_safe_name(run_name)}/cf_ray")
            tier.check_writable()
            tiers.append(tier)
        self.tiers = tiers
        self.key = run_key(storage.uri(), run_name)
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        settings = ControllerSettings(policy=self.config.policy, keep_last=self.config.keep_last, tiers=tiers,
                                      upload_milestones_only=self.config.upload == "milestones")
        self.controller = get_or_create_controller(self.key, storage, settings)
        self.holder = get_or_create_holder(self.key, storage, controller_name(self.key), _env.namespace())
        self._control = ControlPlane(self.rank, self.world_size)
        self._snap = Snapshotter(self.rank, self._hand_off)
        self.step_count = 0
        self.epoch = 0
        self.last_save_step = 0
        self.generation = 0
        self.resume: Resume | None = None
        self._schedules: dict[int, int | None] = {0: self.config.policy.initial_interval()}
        self._adopted = 0
        self._interval = self._schedules[0]
        self._received = 0
        self._known_committed = 0
        self._registered = 0
        self._last_register = time.monotonic()
        self._local_request = 0
        self._request_kind = None
        self._stop_requested = False
        self._poll_ref = None
        self._last_poll = 0.0
        self._seen_failures = -1
        self._failures: list[dict] = []
        self._reported_failures = 0
        self._samples: list[dict] = []
        self._ckpt_stats: collections.deque = collections.deque(maxlen=64)
        self._iter_sum = 0.0
        self._iter_n = 0
        self._last_step_end: float | None = None
        self._pending_guard_step: int | None = None
        self._last_ckpt: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._took = False
        self.checkpoints_taken = 0
        self.stall_s_total = 0.0
        self._prepared = False
        self._prepare_overlap = False  # the last iteration overlapped the buffers' fault-in
        self.metrics: dict[str, Any] = {}
        """User metrics sent with each registration of a checkpoint with Ray Train."""
        self._seen_requests = -1
        self.preemption: PreemptionWatcher | None = None
        """This rank's preemption watcher (its ``notices`` and ``outcomes``), ``None`` when disabled."""
        if self.config.preemption:
            pcfg = self.config.preemption if isinstance(self.config.preemption, PreemptionConfig) \
                else PreemptionConfig()
            self.preemption = PreemptionWatcher(pcfg, self.rank, lambda: self._want(2))
            self.preemption.install()

    # -- the training loop ------------------------------------------------------------------------
    def step(self, *optimizers, scaler=None) -> bool:
        """Call in place of ``optimizer.step()`` (once per update, after gradient accumulation).

        Waits for an in-flight snapshot copy (the weight-update guard), steps every optimizer
        (through ``scaler`` when AMP's ``GradScaler`` is given, then ``scaler.update()``), and takes
        a checkpoint if this is a checkpoint step.

        Returns:
            True when a checkpoint was started at this step.
        """
        if not optimizers:
            raise ConfigError("Checkpointer.step() needs the optimizer(s) to step, e.g. ckpt.step(optimizer)")
        with self.update():
            for opt in optimizers:
                if scaler is not None:
                    scaler.step(opt)
                else:
                    opt.step()
            if scaler is not None:
                scaler.update()
        return self._took

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """Guard a custom weight update: ``with ckpt.update(): my_update()``; counts as one step."""
        t0 = time.perf_counter()
        guard = self._snap.wait_copy()
        if guard and self._pending_guard_step is not None:
            self._ckpt_stats.append({"step": self._pending_guard_step, "guard_s": guard})
            if self._last_ckpt.get("ckpt_step") == self._pending_guard_step:
                self._last_ckpt["stall_s"] += guard  # the guard for a snapshot's own copy is its cost
        self.stall_s_total += guard
        self._pending_guard_step = None
        yield
        self._after_update(time.perf_counter() - t0, guard)

    def end_epoch(self) -> bool:
        """Mark the end of an epoch; takes the checkpoint that ``EpochEnd`` asks for."""
        self.epoch += 1
        ctx = SaveContext(step=self.step_count, epoch=self.epoch, last_save_step=self.last_save_step,
                          interval=self._interval, epoch_end=True)
        if self.config.policy.should_save(self.step_count, ctx):
            self._snapshot("epoch")
            return True
        return False

    def save(self, *, milestone: bool = False) -> None:
        """Checkpoint now. Every rank must call it at the same step (like ``ray.train.report``)."""
        self._snapshot("manual", milestone=milestone)

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the snapshot in flight (if any) is held by this node's holder actor."""
        return self._snap.wait_done(timeout)

    def request_checkpoint(self, *, preemption: bool = False, deadline_s: float | None = None,
                           deadline_unix: float | None = None, detail: str = "") -> None:
        """Ask for a checkpoint at the next step all ranks reach; safe to call from any thread and
        from one rank only (a signal handler, a metadata-endpoint poller).

        Args:
            preemption: this is a preemption notice: the checkpoint is persisted before anything
                else, and this rank waits for it and holds until the deadline (``cf_ray.preemption``).
            deadline_s: seconds from now until this worker is expected to be gone (preemption only).
            deadline_unix: the same as a UNIX time (wins over ``deadline_s``).
            detail: free text kept with the notice.
        """
        if preemption and self.preemption is not None:
            self.preemption.notify("user", deadline_s=deadline_s, deadline_unix=deadline_unix, detail=detail)
            return
        self._want(2 if preemption else 1)

    def _want(self, level: int) -> None:
        if level > self._local_request:
            self._local_request = level

    def _after_update(self, dt: float, guard: float) -> None:
        self._took = False
        now = time.perf_counter()
        preparing = self._snap.preparing()
        if self._last_step_end is not None and not (preparing or self._prepare_overlap):
            # Iterations that overlapped the fault-in of the snapshot buffers are not timed: they
            # would inflate the baseline that the policy measures each checkpoint's slowdown against.
            self._iter_sum += max(now - self._last_step_end - guard, 0.0)
            self._iter_n += 1
        self._prepare_overlap = preparing
        self.step_count += 1
        if self.preemption is not None:
            self.preemption.poll(self.step_count)
        agreement = self._control.exchange(
            schedule_version=self._received, save_request=self._local_request,
            committed_step=self._known_committed,
            register=self.rank == 0 and self._register_due(), stop=self._stop_requested)
        kind = None
        if agreement is not None:
            if agreement.schedule_version > self._adopted and agreement.schedule_version in self._schedules:
                self._adopted = agreement.schedule_version
                self._interval = self._schedules[self._adopted]
            if agreement.save_request:
                kind = "preempt" if agreement.save_request >= 2 else "manual"
                if self._local_request <= agreement.save_request:
                    self._local_request = 0
            if agreement.register and agreement.committed_step > self._registered:
                self._register(agreement.committed_step)
        ctx = SaveContext(step=self.step_count, epoch=self.epoch, last_save_step=self.last_save_step,
                          interval=self._interval)
        milestone = bool(self.config.milestone_every and self.step_count % self.config.milestone_every == 0)
        if kind is None and (milestone or self.config.policy.should_save(self.step_count, ctx)):
            kind = "scheduled"
        if kind is not None:
            self._snapshot(kind, milestone=milestone, priority=kind == "preempt")
            self._took = True
            if kind == "preempt" and self.preemption is not None:
                # Wait until it is committed (bounded by the deadline), then hold or pass SIGTERM on.
                self.preemption.after_checkpoint(self.step_count, self._wait_quiet,
                                                 lambda s: self._known_committed >= s)
        elif not self._prepared:
            # After the first optimizer step the state has its layout (Adam creates its state
            # there): fault in the snapshot buffers now, in the background, not at the first
            # checkpoint's copy (snapshot.py).
            self._prepared = True
            self._prepare_overlap = self._snap.prepare(self._sections())
        self._poll()
        self._last_step_end = time.perf_counter()

    # -- phase 1 ----------------------------------------------------------------------------------------
    def _sections(self) -> dict[str, Any]:
        """This rank's snapshot: section name -> state tree (references; copied by the snapshotter)."""
        rank_tree = {
            "objects": {name: obj.state_dict() for name, obj in self.data.items()},
            "rng": _rng_state(),
            "counters": {"step": self.step_count, "epoch": self.epoch},
        }
        sections: dict[str, Any] = {}
        replicated = {name: obj.state_dict() for name, obj in self.state.items()} \
            if (self.rank == 0 or not self.config.replicated) else None
        if self.config.replicated:
            if self.rank == 0:
                sections[mf.SHARED] = {"objects": replicated}
        else:
            rank_tree["state"] = replicated
        sections[mf.rank_section(self.rank)] = rank_tree
        return sections

    def _snapshot(self, kind: str, *, milestone: bool = False, priority: bool = False) -> None:
        t0 = time.perf_counter()
        sections = self._sections()
        meta = {"rank": self.rank, "world_size": self.world_size, "replicated": self.config.replicated,
                "epoch": self.epoch, "kind": kind, "milestone": milestone, "priority": priority,
                "interval": self._interval}
        if kind == "preempt" and self.preemption is not None:
            meta.update(self.preemption.snapshot_meta())  # the deadline, for the profile row
        guarded = self._guarded_ptrs()
        sync_s = self._snap.begin(self.step_count, sections, lambda t: t.data_ptr() in guarded, meta)
        self.last_save_step = self.step_count
        self.checkpoints_taken += 1
        stall = time.perf_counter() - t0
        self.stall_s_total += stall
        self._pending_guard_step = self.step_count
        self._ckpt_stats.append({"step": self.step_count, "sync_s": sync_s, "stall_s": stall})
        wait = self._snap.last_begin.get("wait_s", 0.0)
        self._last_ckpt = {"ckpt_step": self.step_count, "stall_s": stall, "wait_s": wait if wait > 1e-4 else None,
                           "nbytes": int(self._snap.last_begin.get("nbytes", 0))}

    def _guarded_ptrs(self) -> set[int]:
        """Storage pointers of tensors that change only in the optimizer step (copied in the background)."""
        ptrs = set()
        for obj in self.state.values():
            if isinstance(obj, torch.nn.Module):
                ptrs.update(p.data_ptr() for p in obj.parameters())
            elif isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    ptrs.update(p.data_ptr() for p in group["params"])
                for st in obj.state.values():
                    ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _hand_off(self, job: SnapshotJob, sections: dict[str, StagedSection]) -> None:
        """Background thread: give the bytes to this node's holder (which persists them)."""
        meta = dict(job.meta, copy_s=job.timings.get("copy_s"), sync_s=job.timings.get("sync_s"))
        payload = {name: (s.arena, s.index) for name, s in sections.items()}
        ref = self.holder.stage.remote(self.generation, job.step, payload, meta)
        ray.get(ref, timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
        self._ckpt_stats.append({"step": job.step, "copy_s": job.timings.get("copy_s", 0.0),
                                 "handoff_s": job.timings.get("handoff_s", 0.0),
                                 "nbytes": int(job.timings.get("nbytes", 0))})

    # -- the controller, without blocking -------------------------------------------------------
    def _poll(self, force: bool = False) -> None:
        if self._poll_ref is not None:
            ready, _ = ray.wait([self._poll_ref], timeout=0)
            if not ready:
                return
            try:
                self._on_reply(ray.get(self._poll_ref))
            except Exception as e:  # noqa: BLE001 - a lost controller must not stop training
                logger.warning("cf_ray: rank %d: controller poll failed: %r", self.rank, e)
            self._poll_ref = None
        now = time.monotonic()
        if force or now - self._last_poll >= _env.get_float(_env.POLL_INTERVAL_S):
            samples = []
            if self._iter_n:
                samples.append({"rank": self.rank, "step": self.step_count, "iter_s": self._iter_sum / self._iter_n,
                                "iters": self._iter_n, **self._last_ckpt_sample()})
                self._iter_sum, self._iter_n = 0.0, 0
            stats = []
            while self._ckpt_stats:
                stats.append(self._ckpt_stats.popleft())
            payload = {"samples": samples, "ckpt_stats": stats, "adopted_version": self._received,
                       "seen_failures": self._seen_failures, "seen_requests": self._seen_requests}
            self._poll_ref = self.controller.sync.remote(self.rank, self.generation, payload)
            self._last_poll = now

    def _last_ckpt_sample(self) -> dict:
        """What this rank knows of its last checkpoint, in the policy's ``Sample`` fields."""
        if not self._last_ckpt:
            return {}
        out = dict(self._last_ckpt)
        done = self._snap.last_timings
        if done.get("step") == out["ckpt_step"]:
            out["copy_s"] = done.get("copy_s")
        return out

    def _on_reply(self, reply: dict) -> None:
        for s in reply["schedules"]:
            self._schedules[s["version"]] = s["interval"]
            self._received = max(self._received, s["version"])
        self._known_committed = max(self._known_committed, reply["committed_step"])
        for f in reply["failures"]:
            self._seen_failures = max(self._seen_failures, f["seq"])
            if f.get("generation") == self.generation:
                self._failures.append(f)
                logger.warning("cf_ray: rank %d: checkpoint of step %d failed (%s): %s; the previous committed "
                               "checkpoint stays the latest", self.rank, f["step"], f["section"], f["error"])
        for r in reply.get("requests", ()):  # cf_ray.preemption.notify_preemption() from the driver
            self._seen_requests = max(self._seen_requests, r["seq"])
            if self.preemption is not None:  # every rank keeps the deadline; rank 0 asks (ranks poll apart)
                self.preemption.notify("driver", deadline_unix=r.get("deadline_unix"), detail=r.get("detail", ""),
                                       request=self.rank == 0)
            elif self.rank == 0:
                self._want(2)

    # -- Ray Train registration -------------------------------------------------------------------
    def _register_due(self) -> bool:
        return (self.config.register_with_ray and self._ray_storage is not None
                and self._known_committed > self._registered
                and time.monotonic() - self._last_register >= _env.get_float(_env.REGISTER_INTERVAL_S))

    def _register(self, step: int) -> None:
        self._registered = step
        self._last_register = time.monotonic()
        if self._ray_storage is None:
            return
        from ray.train import Checkpoint, CheckpointUploadMode

        # Ray Train remembers every registered checkpoint and, when a run with the same name starts
        # again, refuses to start if one of them is gone. keep-last deletes checkpoints, so what is
        # registered is a small pointer directory that cf_ray never deletes (Ray's own
        # CheckpointConfig(num_to_keep=...) may), naming the checkpoint it stands for.
        pointer = None
        if self.rank == 0:
            try:
                pointer = mf.write_pointer(self.storage, step)
            except Exception as e:  # noqa: BLE001 - registration is bookkeeping; never fail training for it
                logger.warning("cf_ray: could not register step %d with Ray Train: %s", step, e)
        ckpt = Checkpoint(path=self.storage.fs_path(pointer), filesystem=self.storage.fs) if pointer else None
        metrics = dict(self.metrics, cf_ray_step=step, cf_ray_epoch=self.epoch)
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)

    # -- restore ------------------------------------------------------------------------------------------
    def restore(self) -> Resume:
        """Load the newest consistent state (memory, else storage) into every tracked object.

        All ranks must call it, once, before training. On a fresh run it changes nothing.

        Returns:
            Where to resume: :class:`Resume` (``epoch``, ``step``, ``source``, data states).
        """
        t0 = time.perf_counter()
        plan = None
        if self.rank == 0:
            plan = ray.get(self.controller.prepare_restore.remote(self.world_size),
                           timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
        plan = self._control.broadcast(plan)
        self.generation = plan["generation"]
        for s in plan["schedules"]:
            self._schedules[s["version"]] = s["interval"]
        self._received = self._adopted = max(self._schedules)
        self._interval = self._schedules[self._adopted]
        candidates: list[tuple[str, Any]] = []
        newest_storage = max([plan["storage"][0] if plan["storage"] else -1]
                             + [t[0] for t in plan.get("tiers", ()) if t])
        mem = plan["memory"]
        if mem and self.config.restore_from in ("auto", "memory") and (
                self.config.restore_from == "memory" or mem["step"] >= newest_storage):
            candidates.append(("memory", mem))
        if self.config.restore_from in ("auto", "storage"):
            # Newest step first; for the same step, the primary storage before the upload tiers
            # (fastest first), so a checkpoint lost or damaged on the primary is taken from a tier.
            found = [(s, 0, self.storage) for s in plan["storage"]]
            for i, steps in enumerate(plan.get("tiers", ())):
                found.extend((s, i + 1, self.tiers[i]) for s in steps)
            candidates.extend(("storage", (st, mf.step_dir(s))) for s, _, st in sorted(found, key=lambda x: (-x[0], x[1])))
            if not found:
                # A new run started from another run's checkpoint.
                other = self._other_run_checkpoint()
                if other is not None:
                    candidates.append(("storage", other))
        resume = None
        for source, cand in candidates:
            loaded, error = self._fetch(source, cand)
            if self._control.all_true(loaded is not None):
                resume = self._apply(source, cand, loaded)
                break
            where = f"step {cand['step']} in memory" if source == "memory" else cand[0].uri(cand[1])
            logger.warning("cf_ray: rank %d: cannot restore %s (%s); falling back", self.rank, where,
                           error or "another rank could not")
            if self.rank == 0:
                self.controller.record_event.remote({"event": "restore_fallback", "source": source,
                                                     "where": where, "error": str(error)})
        if resume is None:
            resume = Resume(source="fresh", step=0, epoch=0, generation=self.generation)
        resume = dataclasses.replace(resume, seconds=time.perf_counter() - t0)
        self.resume = resume
        self.last_save_step = resume.step
        self._registered = self._known_committed = newest_storage if newest_storage > 0 else 0
        if self.rank == 0:
            self.controller.restored.remote({"source": resume.source, "step": resume.step, "epoch": resume.epoch,
                                             "seconds": resume.seconds, "world_size": self.world_size,
                                             "saved_world_size": resume.saved_world_size})
        logger.info("cf_ray: rank %d resumes at step %d epoch %d from %s", self.rank, resume.step, resume.epoch,
                    resume.source)
        return resume

    def _other_run_checkpoint(self) -> tuple[Storage, str] | None:
        """``CheckpointConfig.resume_from``, else the checkpoint Ray Train hands this run, if any."""
        source = self.config.resume_from
        if source is None and self._ray_storage is not None:
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

    def _fetch(self, source: str, cand) -> tuple[dict | None, str | None]:
        """Read and verify everything this rank needs, without touching any tracked object."""
        try:
            if source == "memory":
                needed = self._sections_needed(int(cand["world_size"]), bool(cand["replicated"]))
                return {sec: self._fetch_memory(cand, sec) for sec in needed}, None
            storage, directory = cand
            manifest = mf.read_manifest(storage, directory)
            if manifest.kind == "final":
                raise CorruptCheckpointError(f"{storage.uri(directory)} holds only final model weights; load it "
                                             "with cf_ray.load_into(...) instead of resuming from it")
            needed = self._sections_needed(manifest.world_size, manifest.replicated)
            out = {sec: mf.load_section(storage, directory, manifest, sec) for sec in needed}
            out["__manifest__"] = manifest
            return out, None
        except (CorruptCheckpointError, CheckpointNotFoundError, ElasticResumeError, LookupError, OSError,
                ValueError, ray.exceptions.RayError) as e:
            return None, f"{type(e).__name__}: {e}"

    def _fetch_memory(self, cand: dict, section: str) -> mf.Section:
        holder_name = cand["sections"].get(section)
        if holder_name is None:
            raise LookupError(f"no holder has section {section}")
        holder = ray.get_actor(holder_name, namespace=_env.namespace())
        got = ray.get(holder.get_section.remote(cand["generation"], cand["step"], section),
                      timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
        if got is None:
            raise LookupError(f"holder {holder_name} no longer has section {section} of step {cand['step']}")
        ref, index = got
        arena = ray.get(ref, timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
        tree, entries = mf.parse_index(index, f"memory:{section}")
        return mf.Section(tree, entries, arena)

    def _apply(self, source: str, cand, loaded: dict) -> Resume:
        manifest = loaded.pop("__manifest__", None)
        if source == "memory":
            saved_world, replicated = int(cand["world_size"]), bool(cand["replicated"])
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
            _set_rng_state(mine["rng"])
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
                _set_rng_state(mine["rng"])
            data_states = {name: obj.state_dict() for name, obj in self.data.items()}
        self.step_count = int(mine["counters"]["step"])
        self.epoch = int(mine["counters"]["epoch"])
        return Resume(source=source, step=self.step_count, epoch=self.epoch, generation=self.generation, path=path,
                      saved_world_size=saved_world, data=data_states)

    # -- what happened ------------------------------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        """One dict per checkpoint of the run so far (all ranks aggregated by the controller)."""
        return ray.get(self.controller.profile_rows.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))

    def profile(self):
        """The profile table as a pandas DataFrame (see ``cf_ray.report.profile_frame``)."""
        from cf_ray.report import profile_frame

        return profile_frame(self.profile_rows())

    def explain(self) -> Any:
        """Why the checkpoint interval is what it is: the policy's own account (adaptive mode)."""
        return ray.get(self.controller.explain.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))

    def events(self) -> list[dict]:
        """Restores, fallbacks, interval changes and uploads recorded by the controller."""
        return ray.get(self.controller.events.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))

    # -- the end -----------------------------------------------------------------------------------------
    def _wait_quiet(self, timeout: float) -> None:
        """``wait()`` for the preemption watcher: failures stay unreported for the user's next ``wait()``."""
        reported = self._reported_failures
        try:
            self.wait(timeout)
        finally:
            self._reported_failures = reported

    def wait(self, timeout: float | None = None) -> list[dict]:
        """Block until every checkpoint started so far is committed or has failed.

        Returns:
            The failures of this attempt not yet reported (each reported once).

        Raises:
            PersistError: when ``raise_on_persist_error`` and a save failed.
        """
        limit = timeout if timeout is not None else _env.get_float(_env.ACTOR_TIMEOUT_S)
        deadline = time.monotonic() + limit
        self._snap.wait_done(limit)
        for step, err in self._snap.take_errors():
            self._failures.append({"step": step, "section": mf.rank_section(self.rank), "rank": self.rank,
                                   "error": f"{type(err).__name__}: {err}", "generation": self.generation})
        warn_at = time.monotonic() + _env.get_float(_env.WARN_INTERVAL_S)
        while time.monotonic() < deadline:
            pending = ray.get(self.controller.pending_steps.remote(self.generation),
                              timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
            if not pending:
                break
            if time.monotonic() > warn_at:
                logger.warning("cf_ray: rank %d still waiting for steps %s to become durable; raise "
                               "CF_RAY_ACTOR_TIMEOUT_S to wait longer", self.rank, pending)
                warn_at = time.monotonic() + _env.get_float(_env.WARN_INTERVAL_S)
            time.sleep(0.05)
        self._poll_blocking()
        new = self._failures[self._reported_failures:]
        self._reported_failures = len(self._failures)
        if new and self.config.raise_on_persist_error:
            raise PersistError("; ".join(f"step {f['step']} ({f['section']}): {f['error']}" for f in new))
        return new

    def _poll_blocking(self) -> None:
        if self._poll_ref is not None:
            try:
                self._on_reply(ray.get(self._poll_ref, timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)))
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: rank %d: controller poll failed: %r", self.rank, e)
            self._poll_ref = None
        self._poll(force=True)
        if self._poll_ref is not None:
            self._on_reply(ray.get(self._poll_ref, timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)))
            self._poll_ref = None

    def finish(self) -> FinishSummary:
        """End of training: wait for in-flight checkpoints, write the consolidated model, register it
        with Ray Train as the run's result, and release cf_ray's actors. Call on every rank."""
        if self._closed:
            raise RuntimeError("Checkpointer.finish() was already called")
        failures = self.wait()
        self._control.drain()
        final_path = None
        module = self.state.get(self.config.final_model) if self.config.final_model else None
        if isinstance(module, torch.nn.Module):
            final_dir = mf.step_dir(self.step_count, kind="final")
            ok = True
            if self.rank == 0:
                try:
                    write_final_model(self.storage, final_dir, module, step=self.step_count, epoch=self.epoch)
                except Exception as e:  # noqa: BLE001 - never fail the job for a failed save
                    ok = False
                    logger.warning("cf_ray: writing the final model failed: %r", e)
                    failures = failures + [{"step": self.step_count, "section": "final", "rank": 0, "error": repr(e)}]
            ok = self._control.broadcast(ok)
            if ok:
                final_path = self.storage.uri(final_dir)
                if self.config.register_with_ray and self._ray_storage is not None:
                    from ray.train import Checkpoint, CheckpointUploadMode

                    ckpt = Checkpoint(path=self.storage.fs_path(final_dir), filesystem=self.storage.fs)
                    ray.train.report(dict(self.metrics, cf_ray_step=self.step_count, cf_ray_final=True),
                                     checkpoint=ckpt if self.rank == 0 else None,
                                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        if self.rank == 0 and self.tiers:
            # Uploads to the second destination finish before fit() returns.
            deadline = time.monotonic() + _env.get_float(_env.ACTOR_TIMEOUT_S)
            while time.monotonic() < deadline and not ray.get(self.controller.maintenance_idle.remote()):
                time.sleep(0.1)
        self._control.broadcast(None)  # every rank leaves together, after the uploads
        summary = ray.get(self.controller.summary.remote(), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S))
        self.controller.finish.remote(self.rank, self.world_size)
        self._snap.close(timeout=5)
        if self.preemption is not None:
            self.preemption.close()
        self._closed = True
        return FinishSummary(final_path=final_path, committed_steps=summary["committed_steps"],
                             failures=self._failures or failures)


# -- helpers ------------------------------------------------------------------------------------------

def _unwrap_ddp(obj):
    while isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        obj = obj.module
    return obj


def _check_tracked(objs, what: str, allow_empty: bool = False) -> dict:
    if not isinstance(objs, Mapping):
        raise ConfigError(f"Checkpointer({what}=...) must be a mapping of name -> object with state_dict(), "
                          f"got {type(objs).__name__}; e.g. {{'model': model, 'optimizer': optimizer}}")
    if not objs and not allow_empty:
        raise ConfigError("Checkpointer needs at least one tracked object, e.g. "
                          "Checkpointer({'model': model, 'optimizer': optimizer})")
    for name, obj in objs.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"tracked object name {name!r} must be a non-empty string without '/'")
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise ConfigError(f"tracked object {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict(); "
                              "track the object that owns the state (a module, an optimizer, a sampler) or wrap it")
    return dict(objs)


def _safe_name(name: str) -> str:
    mf_name = str(name)
    if not mf_name or "/" in mf_name or mf_name in (".", ".."):
        raise ConfigError(f"run name {name!r} must be a plain directory name")
    return mf_name


def _context(config: CheckpointConfig):
    """(rank, world_size, run name, storage, Ray's StorageContext or None)."""
    ray_ctx = None
    try:
        import ray.train

        ray_ctx = ray.train.get_context()
        rank, world = ray_ctx.get_world_rank(), ray_ctx.get_world_size()
    except Exception:  # noqa: BLE001 - not inside a Ray Train worker
        ray_ctx = None
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
    ray_storage = None
    if ray_ctx is not None:
        try:
            ray_storage = ray_ctx.get_storage()
        except Exception:  # noqa: BLE001
            ray_storage = None
    run_name = config.run_name or (ray_ctx.get_experiment_name() if ray_ctx is not None else None)
    if run_name is None:
        raise ConfigError("outside Ray Train, CheckpointConfig(run_name=...) is required")
    run_name = _safe_name(run_name)
    if config.storage_path is not None:
        storage = FsStorage.from_uri(config.storage_path, config.storage_filesystem).child(f"{run_name}/cf_ray")
        if ray_storage is not None and not (storage.fs_path().startswith(ray_storage.experiment_fs_path + "/")
                                            and storage.fs.equals(ray_storage.storage_filesystem)):
            if config.register_with_ray:
                warnings.warn("CheckpointConfig.storage_path is outside Ray Train's run directory, so checkpoints "
                              "are not registered with Ray Train (register_with_ray is ignored)", stacklevel=3)
            ray_storage = None
    elif ray_storage is not None:
        storage = FsStorage(ray_storage.storage_filesystem, f"{ray_storage.experiment_fs_path}/cf_ray")
    else:
        raise ConfigError("outside Ray Train, CheckpointConfig(storage_path=...) is required")
    return rank, world, run_name, storage, ray_storage


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].clone().contiguous())
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.clone(), i)


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


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
            sub, lambda i, e, c=not in_place: _codec.view(section.buf, e, copy=c, readonly_ok=not c),
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


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_final_model(storage: Storage, directory: str, module: torch.nn.Module, *, step: int, epoch: int) -> None:
    """Write ``module``'s weights as ``model.safetensors`` + a manifest, one tensor at a time.

    Each tensor is brought to the host and written in turn, so rank 0 never holds a second full
    copy of the model (Caffe2's "download group" at the end of training, without its memory cost).
    """
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):  # DDP / compile wrappers
        module = module.module
    sd = module.state_dict()
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "cf_ray_step": str(step), "cf_ray_epoch": str(epoch)}}
    offset = 0
    items = []
    for name, t in sd.items():
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"final model tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        items.append(t)
        offset += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)

    def chunks():
        yield len(hbytes).to_bytes(8, "little")
        yield hbytes
        for t in items:
            host = t.detach().to("cpu").contiguous()
            if host.numel():
                yield host.view(torch.uint8).reshape(-1).numpy() if host.dtype != torch.bool else host.numpy().view(np.uint8)

    info = storage.write_file(f"{directory}/model.safetensors", chunks())
    m = mf.Manifest(step=step, epoch=epoch, world_size=1, generation=0, replicated=True, kind="final", milestone=True,
                    sections={"model": {"data": "model.safetensors"}}, files={"model.safetensors": info},
                    created_unix=time.time())
    storage.write_file(f"{directory}/{mf.MANIFEST}", [m.to_bytes()])
