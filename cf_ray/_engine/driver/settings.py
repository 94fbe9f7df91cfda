"""What the controller needs from the user's ``CheckpointConfig`` (picklable, no live objects)."""

from __future__ import annotations

from dataclasses import dataclass

from cf_ray._engine.protocol.cluster import Owner
from cf_ray.policy import FrequencyPolicy


@dataclass(kw_only=True, slots=True)
class ControllerSettings:
    """What the controller needs from the user's CheckpointConfig (picklable, no live objects)."""

    policy: FrequencyPolicy
    """The checkpoint-frequency policy (the controller's copy plans the schedule)."""
    keep_last: int | None
    """How many committed checkpoints to keep (milestones aside); ``None``: all."""
    tiers: list  # list[Storage]
    """Upload destinations, fastest first."""
    upload_milestones_only: bool
    """Copy only milestones to the upload tiers."""
    recreated: bool = False
    """This controller replaces one that died while workers ran (set by :func:`resolve_controller`):
    it numbers schedule versions, failures and requests above anything the earlier one handed out,
    and continues its profile."""
    owner: Owner | None = None
    """The run this controller belongs to: its driver's job and Ray Train run (set by
    :func:`get_or_create_controller`; ``None``: unknown, no reaper)."""
    replaces_dead_run: bool = False
    """An earlier controller of this run key belonged to a driver that is gone: it was shut down,
    and this one starts from storage only (never from that run's holders) and says so."""
    release_after_fit_s: float = 120.0
    """How long the actors outlive a ``fit()`` that ended without ``finish()`` while its driver lives
    (``CheckpointConfig.release_after_fit_s``)."""


__all__ = ["ControllerSettings"]
