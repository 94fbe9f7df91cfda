"""What Ray Train learns of cf_ray's checkpoints: committed steps registered as they come (rank 0
asks, every rank reports at the same step), and the consolidated model as the run's result.

Registration is bookkeeping: it never fails training, and it happens only when checkpoints live in
Ray Train's run directory (``WorkerContext.ray_storage``) and ``register_with_ray`` is set.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.train
import torch

from cf_ray._engine import env as _env
from cf_ray._engine.format.commit import write_pointer
from cf_ray._engine.format.layout import step_dir
from cf_ray._engine.format.safetensors import write_final_model, write_sharded_final_model
from cf_ray._engine.worker.context import WorkerContext
from cf_ray._engine.worker.control import Agreement, ControlPlane

logger = logging.getLogger("cf_ray")


class RayTrainLink:
    """One rank's reports to Ray Train.

    Call order (training thread): :meth:`start_attempt` at restore; :meth:`due` before each
    exchange (rank 0); :meth:`on_agreement` with each agreement; :meth:`final_model` at the end.

    Args:
        ctx: this rank's context (storage, and Ray Train's storage when registering is possible).
        register_with_ray: ``CheckpointConfig.register_with_ray``.
        final_module: the tracked module written as the final model (``None``: none).
        final_sharded: for a sharded (FSDP2) final model instead: a function returning its state dict
            (DTensors), written by every rank together, one tensor at a time.
        keep_registered: asks the controller to spare a committed step from keep-last while Ray Train
            lists it (``ControllerLink.keep_registered``); returns the step kept (the newest committed
            one when the step asked for is gone), or ``None``: nothing is registered.
    """

    def __init__(
        self,
        ctx: WorkerContext,
        register_with_ray: bool,
        final_module: torch.nn.Module | None,
        final_sharded: Callable[[], dict[str, Any]] | None = None,
        keep_registered: Callable[[int], int | None] | None = None,
    ):
        self.rank = ctx.rank
        self.storage = ctx.storage
        self.ray_storage = ctx.ray_storage
        self.register_with_ray = register_with_ray
        self.final_module = final_module
        self.final_sharded = final_sharded
        self.keep_registered = keep_registered or (lambda step: step)
        self.metrics: dict[str, Any] = {}
        """User metrics sent with each registration of a checkpoint with Ray Train."""
        self._registered = 0
        self._last_register = time.monotonic()

    @classmethod
    def for_run(
        cls,
        ctx: WorkerContext,
        config: Any,
        state: dict[str, Any],
        sharded: Any,
        keep_registered: Callable[[int], int | None] | None = None,
    ) -> RayTrainLink:
        """The link for ``CheckpointConfig`` (``register_with_ray``, ``final_model``): a sharded final
        model is gathered by every rank one tensor at a time and written by rank 0."""
        name = config.final_model
        module = state.get(name) if name else None
        if sharded is not None and name in sharded.modules:
            return cls(
                ctx, config.register_with_ray, None, functools.partial(sharded.state_dict, name), keep_registered
            )
        return cls(ctx, config.register_with_ray, module, keep_registered=keep_registered)

    def start_attempt(self, committed_step: int) -> None:
        """At restore: what was committed before this attempt counts as registered."""
        self._registered = committed_step

    # -- checkpoints as they commit -------------------------------------------------------------------
    def due(self, known_committed: int) -> bool:
        """Whether rank 0 should ask every rank to register ``known_committed`` now."""
        return (
            self.register_with_ray
            and self.ray_storage is not None
            and known_committed > self._registered
            and time.monotonic() - self._last_register >= _env.get_float(_env.REGISTER_INTERVAL_S)
        )

    def on_agreement(self, agreement: Agreement | None, epoch: int) -> None:
        """Register the agreed committed step when the ranks agreed to."""
        if agreement is not None and agreement.register and agreement.committed_step > self._registered:
            self._register(agreement.committed_step, epoch)

    def _register(self, step: int, epoch: int) -> None:
        self._registered = step
        self._last_register = time.monotonic()
        if self.ray_storage is None:
            return
        from ray.train import Checkpoint, CheckpointUploadMode

        # Ray Train remembers every registered checkpoint and, when a run with the same name starts
        # again, refuses to start if one of them is gone. keep-last deletes checkpoints, so what is
        # registered is a small pointer directory that cf_ray never deletes (Ray's own
        # CheckpointConfig(num_to_keep=...) may), naming the checkpoint it stands for. What Ray lists
        # must load: the controller spares the step from keep-last first, while the pointer is there
        # (a step keep-last took out already is replaced by the newest committed one, which keep-last
        # never deletes; every rank still reports, as Ray Train's report is collective).
        pointer, registered = None, step
        kept = self.keep_registered(step) if self.rank == 0 else None
        if kept is not None:
            try:
                pointer, registered = write_pointer(self.storage, kept), kept
            except Exception as e:  # noqa: BLE001 - registration is bookkeeping; never fail training for it
                logger.warning("cf_ray: could not register step %d with Ray Train: %s", kept, e)
        where = self.storage.pyarrow_location(pointer) if pointer else None  # what Ray Train can read
        ckpt = Checkpoint(path=where[1], filesystem=where[0]) if where else None
        metrics = dict(self.metrics, cf_ray_step=registered, cf_ray_epoch=epoch)
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)

    # -- the end of training --------------------------------------------------------------------------
    def final_model(
        self, step: int, epoch: int, control: ControlPlane, resume: str | None = None
    ) -> tuple[str | None, list[dict]]:
        """Rank 0 writes the consolidated model (a sharded one with every rank gathering one tensor at
        a time); every rank registers it as the run's result.

        Args:
            resume: the newest committed full checkpoint (``checkpoints/step_<n>``), named in the
                final model's manifest so that ``resume_from=result.checkpoint`` continues the run.

        Returns:
            (its location or ``None``, the failure to report when writing it failed on rank 0).
        """
        if self.final_sharded is not None:
            return self._final_sharded(step, epoch, control, resume)
        if not isinstance(self.final_module, torch.nn.Module):
            return None, []
        final_dir = step_dir(step, kind="final")
        ok, failures = True, []
        if self.rank == 0:
            try:
                write_final_model(self.storage, final_dir, self.final_module, step=step, epoch=epoch, resume=resume)
            except Exception as e:  # noqa: BLE001 - never fail the job for a failed save
                ok = False
                logger.warning("cf_ray: writing the final model failed: %r", e)
                failures = [{"step": step, "section": "final", "rank": 0, "error": repr(e)}]
        ok = control.broadcast(ok)
        return self._register_final(ok, failures, step, final_dir)

    def _final_sharded(
        self, step: int, epoch: int, control: ControlPlane, resume: str | None
    ) -> tuple[str | None, list[dict]]:
        assert self.final_sharded is not None
        final_dir = step_dir(step, kind="final")
        ok, failures = True, []
        control.drain()  # the agreement's exchange in flight, before the collectives of the gathering
        try:
            write_sharded_final_model(
                self.storage, final_dir, self.final_sharded(), rank=self.rank, step=step, epoch=epoch, resume=resume
            )
        except Exception as e:  # noqa: BLE001 - never fail the job for a failed save
            ok = False
            logger.warning("cf_ray: writing the final model failed on rank %d: %r", self.rank, e)
            failures = [{"step": step, "section": "final", "rank": self.rank, "error": repr(e)}]
        ok = control.all_true(ok)
        return self._register_final(ok, failures, step, final_dir)

    def _register_final(
        self, ok: bool, failures: list[dict], step: int, final_dir: str
    ) -> tuple[str | None, list[dict]]:
        if not ok:
            return None, failures
        if self.register_with_ray and self.ray_storage is not None:
            from ray.train import Checkpoint, CheckpointUploadMode

            where = self.storage.pyarrow_location(final_dir)
            ckpt = Checkpoint(path=where[1], filesystem=where[0]) if where else None
            ray.train.report(
                dict(self.metrics, cf_ray_step=step, cf_ray_final=True),
                checkpoint=ckpt if self.rank == 0 else None,
                checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
            )
        return self.storage.uri(final_dir), failures
