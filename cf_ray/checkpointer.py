"""The worker-loop utility: what a user calls inside ``train_loop_per_worker``.

.. code-block:: python

    with cf_ray.Checkpointer({"model": model, "optimizer": optimizer}, data={"sampler": sampler}) as ckpt:
        resume = ckpt.restore()
        for epoch in range(resume.epoch, epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss_fn(model(x), y).backward()
                ckpt.step(optimizer)          # in place of optimizer.step()
                optimizer.zero_grad()
            ckpt.end_epoch()
    # a normal exit calls ckpt.finish(); an exception calls ckpt.close() and goes on

Per step, on the training thread, cf_ray does: the weight-update guard (wait for an in-flight
background copy, usually already done), the optimizer step, one asynchronous exchange with the
other ranks (``cf_ray/_engine/worker/control.py``), the policy's decision, a non-blocking poll
of the controller, and the durability watchdog's judgement (``watchdog.py``). Nothing in a step
waits for storage or for the controller.

A failed save never fails the job, and is never silent: each failure is logged and reported by
``wait()``/``finish()``; when nothing commits for much longer than the schedule implies, every rank
says so once per episode (``CheckpointConfig(on_durability_lost="raise")`` fails the attempt instead).

:class:`Checkpointer` is a facade: each step of that sequence is one part under
``cf_ray/_engine/worker/`` (context, control, scheduler, timing, durability, preemption_watcher,
``snapshot/``, ``restore/`` with its trust gate, ``link/``'s controller link and Ray Train glue; what
it returns is in results), the run's actors come from ``cf_ray/_engine/wiring.py``, and
``step_path.py`` builds the parts of a step and runs the sequence over them.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from cf_ray._engine.format.layout import step_dir
from cf_ray._engine.protocol.messages import CheckpointKind, CheckpointRequest, RequestLevel, RestoreSource
from cf_ray._engine.storage.base import Storage
from cf_ray._engine.wiring import step_path
from cf_ray._engine.worker.context import WorkerContext, check_tracked, unwrap_ddp
from cf_ray._engine.worker.gc_freeze import GcFreeze
from cf_ray._engine.worker.preemption_watcher import PreemptionWatcher
from cf_ray._engine.worker.restore.restorer import Outcome, Restorer, newest_committed
from cf_ray._engine.worker.restore.sharded import ShardedState
from cf_ray._engine.worker.restore.trust_gate import rollbacks
from cf_ray._engine.worker.results import FinishSummary, Resume
from cf_ray.config import CheckpointConfig
from cf_ray.errors import ConfigError

logger = logging.getLogger("cf_ray")


class _Lifecycle(enum.Enum):
    OPEN = "open"
    """Training: steps, saves, restore."""
    FINISHED = "finished"
    """:meth:`Checkpointer.finish` ran to its end (and closed)."""
    CLOSED = "closed"
    """:meth:`Checkpointer.close` released everything without finishing."""


class Checkpointer:
    """Two-phase, frequent checkpoints of a ``train_loop_per_worker``; one per rank.

    Use it as a context manager (``with cf_ray.Checkpointer(...) as ckpt:``) to have it finished
    on a normal exit and closed on an exception, or call :meth:`finish` (or :meth:`close`) yourself.

    Args:
        state: objects with ``state_dict``/``load_state_dict`` that are replicated across ranks
            (model, optimizers, LR schedulers, AMP grad scaler, user objects), by name.
        data: per-rank objects (samplers, data iterators) by name; their state is saved per rank
            and, when the number of ranks changes, re-split (see ``cf_ray.data``).
        config: how and when to checkpoint.

    Raises:
        ConfigError: no tracked objects, an object without ``state_dict``, or unwritable storage.

    A tracked object that is neither a module nor an optimizer (an LR scheduler, AMP's grad scaler,
    a user object) is saved as it is at the start of the next Checkpointer call after a checkpoint
    (``step()``, ``end_epoch()``, ...), so a scheduler stepped right after ``ckpt.step(optimizer)``
    resumes bitwise; the model, the optimizer, the RNG states and the data positions are saved as
    they are at the checkpoint's step (``cf_ray/_engine/worker/snapshot/late_capture.py``).
    """

    def __init__(
        self, state: Mapping[str, Any], *, data: Mapping[str, Any] | None = None, config: CheckpointConfig | None = None
    ):
        self.config = config or CheckpointConfig()
        # DDP wrappers are tracked through the module they wrap (same parameters), so a checkpoint's
        # keys do not depend on the wrapper: Ray's prepare_model() does not wrap with one worker, and
        # an elastic run must load a 2-worker checkpoint into 1 worker and back.
        self.state = {n: unwrap_ddp(o) for n, o in check_tracked(state, "state").items()}
        self.data = check_tracked(data or {}, "data", allow_empty=True)
        # FSDP2 / DTensor state: each rank saves its own shards (per-rank sections), whatever
        # `replicated` says; taken and loaded with torch.distributed.checkpoint.state_dict.
        sharded = ShardedState.of(self.state)
        ctx = self._ctx = WorkerContext.resolve(self.config)
        if "torchdata.stateful_dataloader" in sys.modules:  # a StatefulDataLoader is registered as it is
            from cf_ray.data.stateful_loader import adapt_sources

            self.data = adapt_sources(self.data, ctx.rank, ctx.world_size)
        if sharded is not None and ctx.rank == 0:
            logger.info(
                "cf_ray: %s hold sharded (FSDP2/DTensor) state: every rank saves its own shards%s",
                sorted(sharded.names),
                " (replicated=True is ignored for this run)" if self.config.replicated else "",
            )
        # The parts of a step (step_path.py); the ones this facade calls itself are named here too.
        self._steps = step_path(ctx, self.config, self.state, self.data, sharded, self._heard_from_driver)
        self._phase1, self._link, self._durability = self._steps.phase1, self._steps.link, self._steps.durability
        self._phase1.on_slot_wait = self._during_slot_wait
        self._restorer = Restorer(
            ctx, self.config, self._link, self._steps.control, self.state, self.data, sharded=sharded
        )
        self.step_count = 0
        self.epoch = 0
        self.resume: Resume | None = None
        self._lifecycle = _Lifecycle.OPEN
        self._gc = GcFreeze(self.config.freeze_gc)
        self.preemption: PreemptionWatcher | None = PreemptionWatcher.started(
            self.config.preemption, ctx.rank, lambda: self._steps.scheduler.want(RequestLevel.PREEMPT)
        )
        """This rank's preemption watcher (its ``notices`` and ``outcomes``), ``None`` when disabled."""

    # -- the training step: guard, update, agree, decide, snapshot, report --------------------------------
    def step(self, *optimizers, scaler=None, loss=None) -> bool:
        """Call in place of ``optimizer.step()`` (once per update, after gradient accumulation).

        Waits for an in-flight snapshot copy (the weight-update guard), steps every optimizer
        (through ``scaler`` when AMP's ``GradScaler`` is given, then ``scaler.update()``), and takes
        a checkpoint if this is a checkpoint step.

        Args:
            loss: this step's loss (a tensor or a number), for the trust gate: during the first
                ``env.TRUST_STEPS`` (3) steps after a restore it is read, and a non-finite one
                rolls the run back past the restored checkpoint (once); at other steps it is not
                read (no device synchronisation).

        Returns:
            True when a checkpoint was started at this step.

        Raises:
            DurabilityLostError: ``on_durability_lost="raise"`` and some rank lost durability.
            RestoreError: the loss went non-finite in the first steps after a restore, on some rank:
                the attempt ends so that the next one restores an older checkpoint.
        """
        if not optimizers:
            raise ConfigError("Checkpointer.step() needs the optimizer(s) to step, e.g. ckpt.step(optimizer)")
        taken = self.checkpoints_taken
        with self.update(loss=loss):
            for opt in optimizers:
                if scaler is not None:
                    scaler.step(opt)
                else:
                    opt.step()
            if scaler is not None:
                scaler.update()
        return self.checkpoints_taken > taken

    @contextlib.contextmanager
    def update(self, loss=None) -> Iterator[None]:
        """Guard a custom weight update: ``with ckpt.update(): my_update()``; counts as one step
        (``loss``: as for :meth:`step`)."""
        guard_s = self._steps.before_update(self.step_count, loss)  # the trust gate's loss, the guard
        yield  # update
        self._after_update(guard_s)

    def _after_update(self, guard_s: float) -> None:
        t = self._steps.end_iteration(guard_s)
        self.step_count += 1
        self._steps.after_step(self.step_count, self.epoch, t, self.preemption, self._wait_quiet)

    def _snapshot(self, kind: CheckpointKind, *, milestone: bool = False) -> None:
        self._steps.snapshot(kind, self.step_count, self.epoch, self.preemption, milestone=milestone)

    def _during_slot_wait(self, waited_s: float) -> bool:
        """While the training thread waits for a free snapshot slot (``step_path.py``): True ends the wait."""
        del waited_s
        return self._steps.during_slot_wait(self.step_count)

    def end_epoch(self) -> bool:
        """Mark the end of an epoch; takes the checkpoint that ``EpochEnd`` asks for.

        A checkpoint of the epoch's last step whose late objects (schedulers, ...) are taken here holds
        them as they are at the epoch's end (a per-epoch scheduler stepped before ``end_epoch()``
        included), so it resumes at the next epoch: the resumed loop does not step them again."""
        last = self._steps.scheduler.last_save_step == self.step_count  # a checkpoint of this very step
        self._phase1.capture_late(next_epoch=self.epoch + 1 if last else None)
        self.epoch += 1
        if self._steps.scheduler.epoch_end_due(self.step_count, self.epoch):
            self._snapshot(CheckpointKind.EPOCH)
            return True
        return False

    def save(self, *, milestone: bool = False) -> None:
        """Checkpoint now. Every rank must call it at the same step (like ``ray.train.report``)."""
        self._phase1.capture_late()
        self._snapshot(CheckpointKind.MANUAL, milestone=milestone)

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the snapshot in flight (if any) is held by this node's holder actor."""
        self._phase1.capture_late()
        return self._phase1.wait_done(timeout)

    def request_checkpoint(
        self,
        *,
        preemption: bool = False,
        deadline_s: float | None = None,
        deadline_unix: float | None = None,
        detail: str = "",
    ) -> None:
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
        self._steps.scheduler.want(RequestLevel.PREEMPT if preemption else RequestLevel.MANUAL)

    def _heard_from_driver(self, req: CheckpointRequest) -> None:
        """A checkpoint request from ``cf_ray.preemption.notify_preemption`` (via a controller poll)."""
        if self.preemption is not None:  # every rank keeps the deadline; rank 0 asks (ranks poll apart)
            self.preemption.notify("driver", deadline_unix=req.deadline_unix, detail=req.detail, request=self.rank == 0)
        elif self.rank == 0:
            self._steps.scheduler.want(RequestLevel.PREEMPT)

    # -- restore ------------------------------------------------------------------------------------------
    def restore(self) -> Resume:
        """Load the newest consistent state (memory, else storage) into every tracked object.

        All ranks must call it, once, before training. On a fresh run it changes nothing.

        Every candidate (memory, then storage, newest first) is read and validated on every rank
        before anything is loaded; one that any rank cannot read or use is skipped on every rank.
        Once loaded, every tracked object is checked against the checkpoint's fingerprint of it.

        Returns:
            Where to resume: :class:`Resume` (``epoch``, ``step``, ``source``, data states).

        Raises:
            CheckpointMismatchError: the script tracks an object the checkpoint does not hold, or the
                other way round (``CheckpointConfig.allow_mismatch`` allows it).
            ConfigError: ``resume_from`` holds no cf_ray checkpoint (naming it).
            RestoreError: a rank failed to load a validated checkpoint, an object was not restored,
                or no checkpoint could be used; raised on every rank, naming the rank and the cause.
        """
        t0 = time.perf_counter()
        plan = self._restorer.plan()
        self._steps.start_attempt(plan.generation, newest_committed(plan), plan.schedules)
        outcome = self._restorer.load(plan)
        rollback = self._restorer.trust.rollback_into(self.generation)  # the attempt before asked for it
        self._steps.trust.start(
            restored_step=outcome.step,
            restored_generation=outcome.generation,
            source=outcome.source,
            attempt=self.generation,
            rolled_back_from=self._restorer.record.fallbacks.rolled_back_from
            or (rollback.restored_step if rollback else None),
        )
        self.resume = self._resumed(outcome, seconds=time.perf_counter() - t0)
        self._restorer.report(outcome, self.resume.seconds)
        self._gc.freeze()  # the loop's full collections then skip what is alive now (gc_freeze.py)
        return self.resume

    def _resumed(self, outcome: Outcome, seconds: float) -> Resume:
        if outcome.source is not RestoreSource.FRESH:
            self.step_count, self.epoch = outcome.step, outcome.epoch
        self._steps.scheduler.saved(outcome.step)
        rolled_back_from = self._steps.trust.rolled_back_from
        return self._restorer.resume_of(
            outcome, generation=self.generation, seconds=seconds, rolled_back_from=rolled_back_from
        )

    # -- what happened ------------------------------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        """One dict per checkpoint of the run so far (all ranks aggregated by the controller)."""
        return self._link.profile_rows()

    def profile(self):
        """The profile table as a pandas DataFrame (see ``cf_ray.report.profile_frame``)."""
        from cf_ray.report import profile_frame

        return profile_frame(self.profile_rows())

    def explain(self) -> Any:
        """Why the checkpoint interval is what it is: the policy's own account (adaptive mode)."""
        return self._link.explain()

    def events(self) -> list[dict]:
        """Restores, fallbacks, interval changes and uploads recorded by the controller."""
        return self._link.events()

    # -- the end -----------------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> list[dict]:
        """Block until every checkpoint this rank took in this attempt is committed or has failed
        (superseded and abandoned ones count as settled), or ``timeout`` seconds passed
        (``CF_RAY_ACTOR_TIMEOUT_S`` by default): each one left then is reported as a failure of
        its own (section ``timeout``, ``"not durable after N s"``) and a warning.

        Returns:
            The failures not yet reported (each once; a failed step's sections together): this
            attempt's, and those of earlier attempts that never committed (``earlier_attempt: True``;
            a step lost with its node, see :class:`FinishSummary`).

        Raises:
            PersistError: when ``raise_on_persist_error`` and a save of this attempt failed (or timed out).
        """
        self._phase1.capture_late()
        return self._steps.wait(self.step_count, timeout, report_timeout=True)

    def _wait_quiet(self, timeout: float) -> None:
        """``wait()`` for the preemption watcher: failures stay unreported for the user's next ``wait()``,
        what is not durable yet is not reported as timed out, and a just-in-time checkpoint safe in
        the tier the controller chose for it (a peer's memory) ends the wait."""
        self._phase1.capture_late()
        with self._link.failures_kept_unreported():
            self._steps.wait(self.step_count, timeout, report_timeout=False, safe_ok=True)

    def finish(self) -> FinishSummary:
        """End of training: checkpoint the final state (unless the last checkpoint is of this step and is persisted: one
        the schedule held in memory only, or one that failed, is taken again, persisted; one that fails is taken again
        while the wait lasts), wait for every checkpoint taken, write the consolidated model, register it with Ray Train
        as the run's result, and release cf_ray's actors and threads (:meth:`close`). Call on every rank.

        The checkpoint of the final state is of kind ``final`` (a milestone only by ``milestone_every``).
        The final model names the newest committed full checkpoint (the final one when it committed in
        time) as the resume point, never deleted by keep-last: ``resume_from=result.checkpoint``
        continues the run (model, optimizer, schedulers, RNG, data positions). The wait for
        durability is bounded by ``CheckpointConfig.finish_timeout_s``, by default derived from the
        persist times of this run (``DurabilityTimeout.factor`` x the slowest, at least its
        ``floor_s``); when it passes before the final checkpoint commits, a warning says so (and how
        long it waited) and :class:`FinishSummary` has ``final_durable=False`` and the ``resume_step``
        the final model names."""
        if self._lifecycle is not _Lifecycle.OPEN:
            raise RuntimeError(
                "Checkpointer.finish() was already called"
                if self._lifecycle is _Lifecycle.FINISHED
                else "Checkpointer.finish() after close()"
            )
        self._phase1.capture_late()
        limit = self._durability.finish_limit_s()
        failures, waited = self._steps.finish(
            self.step_count, self.epoch, limit, self.preemption, self._phase1.capture_late
        )
        self._steps.control.drain()
        committed = self._link.known_committed
        if self.rank == 0:  # who writes the model: what it names is never deleted by keep-last
            committed = self._link.keep_resume_point(committed)
        committed = int(self._steps.control.broadcast(committed))
        resume = step_dir(committed) if committed > 0 else None
        durable = committed >= self.step_count
        if self.rank == 0 and not durable:
            self._durability.not_durable_at_finish(self.step_count, committed, limit, waited)
        final_path, final_failures = self._steps.ray_train.final_model(
            self.step_count, self.epoch, self._steps.control, resume=resume
        )
        if self.rank == 0 and self._ctx.tiers:
            self._link.wait_maintenance(self.step_count)  # uploads to the tiers finish before fit() returns
        self._steps.control.broadcast(None)  # every rank leaves together, after the uploads
        summary = self._link.finish(self.rank, self.world_size)
        self._restorer.spare.end()  # no restart follows: this rank's spare process ends
        self.close()
        self._lifecycle = _Lifecycle.FINISHED
        failures = _final_tries(
            self._link.failures or failures + final_failures, self.step_count, self.generation, durable
        )
        return FinishSummary(
            final_path=final_path,
            committed_steps=summary["committed_steps"],
            failures=failures,
            final_step=self.step_count,
            final_durable=durable,
            resume_step=committed if committed > 0 else None,
            rollbacks=rollbacks(summary.get("events", ())),
        )

    def close(self) -> None:
        """Release what this rank holds: the SIGTERM handler, the snapshot thread and its buffers, the
        agreement's exchange in flight. Does not wait for checkpoints to become durable (that is
        :meth:`wait`/:meth:`finish`); later calls do nothing."""
        if self._lifecycle is not _Lifecycle.OPEN:
            return
        self._phase1.close(timeout=5)  # its snapshot in flight takes the late objects' state first
        if self.preemption is not None:
            self.preemption.close()
        self._steps.control.close()
        self._gc.release()
        self._lifecycle = _Lifecycle.CLOSED

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """A normal exit finishes (unless done already); an exception closes, and is re-raised."""
        if exc_type is None and self._lifecycle is _Lifecycle.OPEN:
            self.finish()
        else:
            self.close()
        return False

    # -- where this rank is, and what it did --------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def storage(self) -> Storage:
        """The run's cf_ray root on the primary storage."""
        return self._ctx.storage

    @property
    def generation(self) -> int:
        """This attempt's generation (0 until :meth:`restore`)."""
        return self._link.generation

    @property
    def controller(self):
        """The run's controller actor."""
        return self._link.controller

    @property
    def holder(self):
        """This node's holder actor."""
        return self._phase1.holder

    @property
    def metrics(self) -> dict[str, Any]:
        """User metrics sent with each registration of a checkpoint with Ray Train."""
        return self._steps.ray_train.metrics

    @property
    def checkpoints_taken(self) -> int:
        return self._steps.timing.checkpoints_taken

    @property
    def stall_s_total(self) -> float:
        """Seconds the training thread spent on checkpoints."""
        return self._steps.timing.stall_s_total

    @property
    def cpu_budget(self) -> dict[str, dict[str, float]]:
        """Where this rank's checkpointing time went so far, per part of the per-step path (training
        thread) and of each snapshot (its background thread): ``{part: {"calls", "wall_s", "cpu_s"}}``
        (``cf_ray/_engine/worker/cpu_budget.py`` names the parts). A diagnostic, read by the benchmark."""
        return self._steps.timing.budget.totals()

    @property
    def last_save_step(self) -> int:
        return self._steps.scheduler.last_save_step


def _final_tries(failures: list[dict], step: int, generation: int, durable: bool) -> list[dict]:
    """``failures`` with those of this attempt's final ``step``: none when it committed (``finish()``
    made good what its snapshots before failed: a memory-only one a rank skipped, a try), else each
    section's newest (that of its last try), so that one failure is listed once."""

    def final(f: dict) -> bool:
        return f.get("step") == step and not f.get("earlier_attempt") and f.get("generation") == generation

    newest = {f.get("section"): i for i, f in enumerate(failures) if final(f)}
    return [f for i, f in enumerate(failures) if not final(f) or (not durable and newest[f.get("section")] == i)]
