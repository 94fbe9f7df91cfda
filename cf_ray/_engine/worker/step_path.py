"""One rank's per-step path, under the :class:`~cf_ray.Checkpointer` facade: the parts a step goes
through, built and wired, and the sequence over them. The run's actors are handed in
(:class:`RunActors`, found or made by the wiring module beside ``worker/``): nothing in ``worker/``
looks up or makes an actor of ``driver/`` or ``node/``, so it imports neither.

Per step, on the training thread: the weight-update guard (wait for an in-flight background copy,
usually already done), the user's update, one asynchronous exchange with the other ranks
(``control.py``), the policy's decision (``scheduler.py``), the snapshot (``snapshot/``'s phase 1),
a non-blocking poll of the controller (``link/controller.py``), and the durability watchdog's
judgement (``durability.py``). Nothing in a step waits for storage or for the controller. Where each
part's time goes is counted in ``cpu_budget.py``'s parts. At the ends: the start of an attempt (after
the restore plan), and the waits for this rank's checkpoints to settle.

The step count and the epoch are the Checkpointer's (public); every method here is given them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.messages import CheckpointKind, CheckpointRequest
from cf_ray._engine.worker.context import WorkerContext
from cf_ray._engine.worker.control import Agreement, ControlPlane
from cf_ray._engine.worker.cpu_budget import Mark
from cf_ray._engine.worker.cpu_budget import mark as cpu_mark
from cf_ray._engine.worker.durability import Durability
from cf_ray._engine.worker.link.controller import ControllerLink
from cf_ray._engine.worker.link.ray_train import RayTrainLink
from cf_ray._engine.worker.preemption_watcher import PreemptionWatcher
from cf_ray._engine.worker.restore.sharded import ShardedState
from cf_ray._engine.worker.restore.trust_gate import TrustGate
from cf_ray._engine.worker.scheduler import Scheduler
from cf_ray._engine.worker.snapshot.snapshotter import Phase1
from cf_ray._engine.worker.timing import Timing
from cf_ray.config import CheckpointConfig

#: How many times ``finish()`` takes the final checkpoint when the try before failed (within its wait).
FINAL_TRIES = 3


@dataclass(frozen=True, slots=True)
class RunActors:
    """The run's actors as the step path is handed them (the wiring module finds or makes them): the
    step path never looks an actor up itself, so ``worker/`` imports neither ``driver/`` nor ``node/``."""

    controller: Any
    """The run's controller actor."""
    holder: Any
    """This node's holder actor."""
    resolve_controller: Callable[[], Any]
    """A live handle of the run's controller, made again when it is gone (may block)."""
    resolve_holder: Callable[[], Any]
    """This node's holder, made again when it is gone."""


class StepPath:
    """The parts of one rank's step and the sequence over them.

    Args:
        ctx: this rank's context.
        config: the run's settings.
        state, data: the tracked objects (replicated; per rank).
        sharded: the tracked objects whose state is sharded (FSDP2/DTensor), or ``None``.
        on_request: called with each checkpoint request from the driver (through the controller's replies).
        actors: the run's controller and this node's holder, and how to make each again.
    """

    def __init__(
        self,
        ctx: WorkerContext,
        config: CheckpointConfig,
        state: dict[str, Any],
        data: dict[str, Any],
        sharded: ShardedState | None,
        on_request: Callable[[CheckpointRequest], None],
        actors: RunActors,
    ):
        self.config = config
        self.rank = ctx.rank
        self.control = ControlPlane(ctx.rank, ctx.world_size)
        self.timing = Timing()
        self.scheduler = Scheduler(config)
        self.phase1 = Phase1(
            ctx.rank,
            ctx.world_size,
            config.replicated and sharded is None,
            state,
            data,
            actors.holder,
            self.timing,
            resolve_holder=actors.resolve_holder,
            sharded=sharded,
            replicas=-1 if config.replication.copies is None else config.replication.copies,
            replica_label=config.replication.label or "",
            replica_every=int(config.replication.every),
        )
        self.link = ControllerLink(
            actors.controller, ctx.rank, self.timing, self.scheduler, on_request, resolve=actors.resolve_controller
        )
        self.durability = Durability(config, ctx.rank, self.link, ctx.storage.uri())
        self.trust = TrustGate(ctx.rank)  # the first steps after a restore (trust_gate.py)
        self.ray_train = RayTrainLink.for_run(ctx, config, state, sharded, self.link.keep_registered)

    def before_update(self, step: int, loss: Any) -> float:
        """Before the user's update at ``step`` (this rank's step count): the trust gate's loss, the
        last snapshot's late objects, the weight-update guard. Returns the seconds the guard waited."""
        budget, t = self.timing.budget, cpu_mark()  # where each part's time goes (cpu_budget.py)
        self.trust.loss(step + 1, loss)  # read only in the first steps after a restore
        self.phase1.capture_late()  # the last snapshot's schedulers, ...
        t = budget.lap("capture_late", t)
        guard_s = self.phase1.wait_copy()  # guard
        t = budget.lap("guard", t)
        self.timing.guarded(guard_s)
        budget.lap("timing", t)
        return guard_s

    def end_iteration(self, guard_s: float) -> Mark:
        """The update is done: the iteration's time. Returns the mark :meth:`after_step` counts from."""
        t = cpu_mark()
        self.timing.end_iteration(guard_s, preparing=self.phase1.preparing())
        return t

    def after_step(
        self,
        step: int,
        epoch: int,
        t: Mark,
        preemption: PreemptionWatcher | None,
        wait_quiet: Callable[[float], None],
    ) -> None:
        """After the step count went to ``step``: agree, decide, snapshot, report, watch.

        Raises:
            DurabilityLostError: ``on_durability_lost="raise"`` and some rank lost durability.
            RestoreError: the loss went non-finite in the first steps after a restore, on some rank.
        """
        budget = self.timing.budget
        t = budget.lap("timing", t, calls=0)
        if preemption is not None:
            preemption.poll(step)
            t = budget.lap("preemption", t)
        agreement = self._agree()  # agree
        t = budget.lap("agreement", t)
        if agreement is not None and agreement.durability_lost:
            self.durability.raise_lost(step)
        if agreement is not None and agreement.non_finite:
            self.trust.roll_back(self.link, agreement.non_finite)  # raises on every rank
        self.ray_train.on_agreement(agreement, epoch)
        t = budget.lap("register", t)
        kind, milestone = self.scheduler.decide(step, epoch, agreement)  # decide
        t = budget.lap("policy", t)
        if kind is not None:
            self.snapshot(kind, step, epoch, preemption, milestone=milestone)  # snapshot
            t = budget.lap("begin", t)
            if kind is CheckpointKind.PREEMPT and preemption is not None:
                # Wait until it is committed (bounded by the deadline), then hold or pass SIGTERM on.
                preemption.after_checkpoint(step, wait_quiet, self.link.safe)
                t = budget.lap("preemption", t, calls=0)
        elif self.phase1.prepare_once(step, epoch):
            self.timing.prepare_overlap = True
            t = budget.lap("prepare", t)
        self.link.poll(step, self.phase1.last_timings)  # report
        t = budget.lap("poll", t)
        self.watch(step)  # durability
        t = budget.lap("watchdog", t)
        self.timing.step_end()
        budget.lap("timing", t, calls=0)

    def _agree(self) -> Agreement | None:
        """Post this rank's inputs; the agreement of the previous step (``control.py``)."""
        committed = self.link.known_committed
        return self.control.exchange(
            schedule_version=self.scheduler.received,
            save_request=self.scheduler.local_request,
            committed_step=committed,
            register=self.rank == 0 and self.ray_train.due(committed),
            durability_lost=self.durability.raising,
            non_finite=self.trust.posted,
        )

    def snapshot(
        self,
        kind: CheckpointKind,
        step: int,
        epoch: int,
        preemption: PreemptionWatcher | None,
        *,
        milestone: bool = False,
    ) -> None:
        """Take a checkpoint of ``step`` (phase 1), and keep what it means for the waits and the gates."""
        t0 = time.perf_counter()
        notice = preemption.snapshot_meta() if kind is CheckpointKind.PREEMPT and preemption is not None else {}
        persist = self.scheduler.persist_due(kind, milestone)  # agreed: the same on every rank
        sync_s = self.phase1.take(
            step,
            epoch,
            kind,
            milestone=milestone,
            interval=self.scheduler.interval,
            notice=notice,
            replica_interval=self.scheduler.interval or self.config.policy.step_interval(),
            persist=persist,
        )
        self.scheduler.saved(step)
        if sync_s is None or self.phase1.skipped is not None:  # no free slot in time (snapshot/arenas.py)
            if self.phase1.skipped is not None:
                self.link.report_skipped(step, *self.phase1.skipped)
            return
        self.link.track(step)
        if persist:  # a snapshot held in memory only is never expected to commit
            self.durability.taken(step)
        self.trust.taken(step)
        self.timing.snapshot_taken(step, sync_s, time.perf_counter() - t0, self.phase1.last_begin)

    # -- durability ---------------------------------------------------------------------------------------
    def start_attempt(self, generation: int, committed: int, schedules: Any) -> None:
        """At restore: this attempt's generation, every schedule version so far, and the newest step
        already committed."""
        self.link.start_attempt(generation, committed)
        self.durability.start_attempt(committed)
        self.phase1.generation = generation
        self.scheduler.start_attempt(schedules)
        self.ray_train.start_attempt(committed)

    def finish(
        self,
        step: int,
        epoch: int,
        limit: float,
        preemption: PreemptionWatcher | None,
        capture_late: Callable[[], object],
    ) -> tuple[list[dict], float]:
        """``finish()``'s checkpoint of the final ``step`` and the wait for it, at most ``limit`` seconds.

        The final state is taken again, persisted, unless the last checkpoint is of ``step`` and is
        persisted; before each such snapshot every rank tells the controller (``reopen_final``) so that
        no answer about ``step`` comes from the snapshot before it (held in memory only, skipped,
        failed). When the controller says it failed, every rank takes it again (rank 0's answer,
        broadcast), at most :data:`FINAL_TRIES` times while the wait lasts. Every rank calls it.

        Returns:
            The failures not yet reported, and the seconds it waited.
        """
        t0 = time.monotonic()
        deadline = t0 + limit
        scheduler = self.scheduler
        again = step > 0 and (scheduler.last_save_step != step or not scheduler.last_persisted)  # agreed
        tries = 0
        while True:
            if again:
                tries += 1
                self.phase1.wait_done(max(0.0, deadline - time.monotonic()))
                self.link.add_local_failures(self.phase1.take_errors())  # the snapshots before this one
                self.link.reopen_final(step, tries)
                milestone = bool(scheduler.milestone_every and step % scheduler.milestone_every == 0)
                self.snapshot(CheckpointKind.FINAL, step, epoch, preemption, milestone=milestone)  # every rank
                capture_late()  # nothing runs between this checkpoint and the end
            self._settle(step, deadline, report_timeout=True, hint="CheckpointConfig(finish_timeout_s=...)")
            failed = self.rank == 0 and step > 0 and tries < FINAL_TRIES and time.monotonic() < deadline
            again = bool(self.control.broadcast(failed and self.link.final_failed(step)))
            if not again:
                return self.link.new_failures(self.config.raise_on_persist_error), time.monotonic() - t0

    def wait(
        self,
        step: int,
        timeout: float | None,
        *,
        report_timeout: bool,
        safe_ok: bool = False,
        hint: str = "wait(timeout=...) or CF_RAY_ACTOR_TIMEOUT_S",
    ) -> list[dict]:
        """The waits at the ends (``Checkpointer.wait``/``finish``, the preemption watcher's): until every
        checkpoint this rank took is settled or ``timeout`` passed (``ControllerLink.wait_durable``).
        Returns the failures not yet reported."""
        limit = timeout if timeout is not None else _env.get_float(_env.ACTOR_TIMEOUT_S)
        self._settle(step, time.monotonic() + limit, report_timeout=report_timeout, safe_ok=safe_ok, hint=hint)
        return self.link.new_failures(self.config.raise_on_persist_error)

    def _settle(self, step: int, deadline: float, *, report_timeout: bool, hint: str, safe_ok: bool = False) -> None:
        """Until every checkpoint this rank took is settled or ``deadline`` (``time.monotonic()``) passed."""
        self.phase1.wait_done(max(0.0, deadline - time.monotonic()))
        self.link.add_local_failures(self.phase1.take_errors())
        self.link.wait_durable(
            deadline,
            step,
            self.phase1.last_timings,
            report_timeout=report_timeout,
            safe_ok=safe_ok,
            hint=hint,
        )

    def watch(self, step: int) -> None:
        """Feed the durability watchdog what this rank knows (``worker/durability.py`` says what it finds)."""
        self.durability.observe(step, self.scheduler.interval)
        self.phase1.late_wait_s = self.durability.late_wait_s()

    def during_slot_wait(self, step: int) -> bool:
        """While the training thread waits for a free snapshot slot: the controller's news and the
        watchdog, so that a storage that hangs is said now; True ends the wait (the attempt is to fail)."""
        self.link.poll(step, self.phase1.last_timings)
        self.durability.observe(step, self.scheduler.interval)
        return self.durability.raising
