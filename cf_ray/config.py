"""Configuration a user builds: :class:`CheckpointConfig` and :class:`PreemptionConfig`.

Importable without torch (the driver builds them; the workers receive them). Every field is
checked when the object is built; a bad value raises :class:`~cf_ray.ConfigError` naming the field
and what to use instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from cf_ray.errors import ConfigError
from cf_ray.policy import FixedInterval, FrequencyPolicy
from cf_ray.policy.base import SUBCLASS_HINT

_RAY_SIGNAL = ("auto", "api", "off")


@dataclass(kw_only=True, slots=True)
class PreemptionConfig:
    """How a :class:`~cf_ray.Checkpointer` reacts to preemption notices
    (``CheckpointConfig(preemption=PreemptionConfig(...))``; ``preemption=True`` is the default)."""

    ray_signal: str = "auto"
    """Ray Train's preemption signal: ``auto`` reads the worker's copy after every step (no
    barrier) and falls back to ``ray.train.get_preemption_info()`` every ``ray_poll_every`` steps
    where that copy is not reachable; ``api`` always uses the public call; ``off`` ignores it."""
    ray_poll_every: int = 10
    """Steps between two calls of ``ray.train.get_preemption_info()`` (a barrier) when it is used."""
    sigterm: bool = True
    """Treat SIGTERM to a worker process as a preemption notice (deferred, see the module doc)."""
    sigterm_deadline_s: float = 30.0
    """Deadline assumed for a SIGTERM, in seconds after it arrived (Kubernetes' default grace)."""
    sigterm_exit: bool = True
    """After the checkpoint of a SIGTERM is durable, let the previous SIGTERM handler run (the
    process ends as it would have without cf_ray). False: hold like any other notice."""
    hold: bool = True
    """A rank that knows the deadline waits until the just-in-time checkpoint is committed, then
    holds until the deadline instead of taking steps that the kill would throw away."""
    hold_extra_s: float = 1.0
    """Keep holding this long past the deadline: the kill rarely comes on the dot, and a step taken
    just before it would be lost."""
    max_wait_s: float = 120.0
    """Upper bound of that wait for a notice without a deadline."""

    def __post_init__(self):
        if self.ray_signal not in _RAY_SIGNAL:
            raise ConfigError(f"PreemptionConfig.ray_signal={self.ray_signal!r} must be one of {_RAY_SIGNAL}")
        if isinstance(self.ray_poll_every, bool) or not isinstance(self.ray_poll_every, int) or self.ray_poll_every < 1:
            raise ConfigError(
                f"PreemptionConfig.ray_poll_every={self.ray_poll_every!r} must be an int >= 1 "
                "(steps between two calls of ray.train.get_preemption_info())"
            )
        for name in ("sigterm_deadline_s", "hold_extra_s", "max_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"PreemptionConfig.{name}={v!r} must be a number of seconds >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class Replication:
    """Peer copies of in-memory snapshots (``CheckpointConfig(replication=Replication(...))``): each
    node's holder places copies of its snapshots on holders of other nodes, so that a lost node's
    snapshot is restored from a peer's memory instead of from storage. Replication runs in the
    holder's background and never delays training or the persist; a snapshot whose copying has not
    begun when a newer one arrives is skipped (counted in the profile), and one whose copying has
    begun is copied whole first (only a step copied whole can be restored after a node loss)."""

    copies: int | None = None
    """Copies of each snapshot, 0 to 8. ``None``: 1 when the cluster has more than one node, else 0."""
    label: str | None = None
    """A node label naming failure domains (a spot pool or zone, e.g. ``"pool"`` when nodes are
    started with ``--labels pool=spot-a``): a copy goes to a node whose value differs from the
    snapshot's own node's, never to the same domain. ``None``: any other node. Draining nodes are
    never chosen."""
    every: int = 1
    """Copy one snapshot in ``every`` (``1``: every one). On nodes where training uses every core the
    copies compete with it; with ``n`` the copies, and their cost, are about ``1/n``, and the newest
    copy after a node loss is up to ``n`` intervals older. A snapshot is copied when its step lies in
    the first interval of a block of ``n`` intervals (``step % (n * interval) < interval``): the same
    steps on every node, so the copied steps are complete. Preemption checkpoints, milestones and
    checkpoints without an interval (manual, epoch boundaries) are always copied."""

    def __post_init__(self):
        if self.copies is not None and (
            not isinstance(self.copies, int) or isinstance(self.copies, bool) or not 0 <= self.copies <= 8
        ):
            raise ConfigError(f"Replication.copies={self.copies!r} must be None (automatic) or an int from 0 to 8")
        if self.label is not None and (not isinstance(self.label, str) or not self.label):
            raise ConfigError(f"Replication.label={self.label!r} must be None or a node label name")
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(
                f"Replication.every={every!r} must be an int >= 1 (copy one snapshot in that many; 1: every one)"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class DurabilityTimeout:
    """When a rank's checkpoints count as no longer becoming durable
    (``CheckpointConfig(durability_timeout=...)``; ``on_durability_lost`` says what happens then). The
    time is counted from the oldest checkpoint taken since the last commit."""

    seconds: float | None = None
    """A fixed limit in seconds. ``None``: automatic, ``factor`` x (the interval in seconds + the
    observed persist time), at least ``floor_s``."""
    factor: float = 3.0
    """The automatic limit's multiple of the expected time to a commit (interval + persist)."""
    floor_s: float = 60.0
    """The automatic limit is never below this many seconds (short intervals would otherwise alarm
    on every hiccup of the storage)."""

    def __post_init__(self):
        if self.seconds is not None and not _positive(self.seconds):
            raise ConfigError(
                f"DurabilityTimeout.seconds={self.seconds!r} must be a number of seconds > 0, or None (automatic)"
            )
        if not _positive(self.factor) or self.factor < 1:
            raise ConfigError(f"DurabilityTimeout.factor={self.factor!r} must be a number >= 1")
        if not _positive(self.floor_s):
            raise ConfigError(f"DurabilityTimeout.floor_s={self.floor_s!r} must be a number of seconds > 0")


_MISMATCH = ("missing", "unexpected")


_RESTORE_FROM = ("auto", "memory", "storage", "none")
_UPLOAD = ("all", "milestones")
_ON_DURABILITY_LOST = ("warn", "raise")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """How a :class:`Checkpointer` checkpoints. Every field is checked when it is built."""

    policy: FrequencyPolicy = field(default_factory=lambda: FixedInterval(every=50))
    """When to checkpoint: ``FixedInterval(every=k)``, ``EpochEnd()``, ``Adaptive(...)``, ``AnyOf(...)``."""
    storage_path: str | None = None
    """Where checkpoints go. ``None``: the run's ``RunConfig(storage_path=...)`` (required outside Ray Train)."""
    storage_filesystem: pafs.FileSystem | None = None
    """A ``pyarrow.fs`` filesystem for ``storage_path``; ``None``: inferred from the URI or Ray's."""
    run_name: str | None = None
    """The run's name. ``None``: Ray Train's experiment name (required outside Ray Train)."""
    upload_path: str | None = None
    """An optional second destination (e.g. ``s3://bucket/archive``): committed checkpoints are copied
    there in the background with their own manifest."""
    upload_filesystem: pafs.FileSystem | None = None
    """A ``pyarrow.fs`` filesystem for ``upload_path``."""
    upload: str = "all"
    """What goes to ``upload_path``: ``"all"`` committed checkpoints or only ``"milestones"``."""
    keep_last: int | None = 3
    """Committed checkpoints to keep (milestones and the final model are never deleted); ``None`` keeps all.
    A checkpoint registered with Ray Train (``register_with_ray``) counts toward it but is kept while
    Ray lists it, so that each of ``result.best_checkpoints`` loads: Ray's
    ``RunConfig(checkpoint_config=ray.train.CheckpointConfig(num_to_keep=...))`` bounds that list."""
    milestone_every: int | None = None
    """Every this many steps, the checkpoint is a milestone, never deleted by keep-last."""
    replicated: bool = True
    """True for DDP: model and optimizer state are identical on all ranks and rank 0 writes them once.
    False when each rank has its own model/optimizer state (every rank writes all of it)."""
    resume_from: Any = None
    """Start a *new* run from another run's checkpoint: a ``ray.train.Checkpoint`` (e.g. an earlier
    ``result.checkpoint`` or one of ``result.best_checkpoints``), a checkpoint directory or a run
    directory (path or URI). Used only while this run has no checkpoint of its own. This is Ray
    Train v2's replacement for ``TorchTrainer(resume_from_checkpoint=...)``, which v2 refuses."""
    restore_from: str = "auto"
    """``auto``: newest in-memory snapshot if it is at least as new as storage, else storage;
    ``memory``/``storage``: only that source; ``none``: never restore."""
    register_with_ray: bool = True
    """Register committed checkpoints with Ray Train (``result.checkpoint``, ``get_checkpoint()``)."""
    final_model: str | None = "model"
    """Name of the tracked module whose weights ``finish()`` writes as a consolidated safetensors
    checkpoint (the run's result); ``None`` disables it."""
    raise_on_persist_error: bool = False
    """Raise :class:`PersistError` from ``wait()``/``finish()`` when a save failed (default: warn once)."""
    preemption: bool | PreemptionConfig = True
    """React to preemption notices (Ray Train's signal, SIGTERM, ``request_checkpoint(preemption=True)``)
    with a just-in-time checkpoint; a :class:`cf_ray.preemption.PreemptionConfig` tunes how."""
    on_durability_lost: str = "warn"
    """What a rank does when nothing has committed for much longer than the schedule implies (see
    ``durability_timeout``), or the controller cannot be reached: ``"warn"`` says so loudly, once
    per episode, and trains on; ``"raise"`` fails the attempt with :class:`~cf_ray.errors.DurabilityLostError`
    from ``step()`` on every rank (Ray Train's ``FailureConfig`` then decides whether to restart)."""
    durability_timeout: DurabilityTimeout | float | None = None
    """When durability counts as lost: a :class:`DurabilityTimeout` (a fixed number of seconds, or the
    automatic limit's factor and floor), or a number of seconds (``DurabilityTimeout(seconds=n)``).
    ``None``: automatic, ``DurabilityTimeout()``. Always a :class:`DurabilityTimeout` once built."""
    finish_timeout_s: float | None = None
    """How long :meth:`~cf_ray.Checkpointer.finish` waits for the final checkpoint (and every other
    one taken) to become durable. ``None``: derived from this run's persist times, as the automatic
    durability limit is (``durability_timeout.factor`` x the slowest persist seen, at least
    ``durability_timeout.floor_s``). When it passes, ``finish()`` says so (a warning,
    ``FinishSummary.final_durable``) and the final model names the newest committed step, never
    silently an older one."""
    allow_mismatch: frozenset[str] | tuple[str, ...] | str = frozenset()
    """Which disagreements between the script and the checkpoint a restore tolerates: ``"missing"``
    (the script tracks an object, ``state`` or ``data``, that the checkpoint does not hold, e.g. a
    scheduler added in a new version of the script: it keeps its fresh state and a warning names it)
    and ``"unexpected"`` (the checkpoint holds an object the script no longer tracks: ignored with a
    warning naming it). Empty (the default): either raises :class:`~cf_ray.errors.CheckpointMismatchError`
    naming the object. Always a ``frozenset`` once built."""
    replication: Replication = field(default_factory=lambda: Replication())
    """Copies of each in-memory snapshot on holders of other nodes (:class:`Replication`): how many,
    into which failure domains, and for one snapshot in how many."""
    freeze_gc: bool = True
    """At the end of :meth:`~cf_ray.Checkpointer.restore`, run one full garbage collection and freeze
    what is alive (``gc.freeze()``: modules, model, optimizer), so that a full collection in the loop
    scans only newer objects instead of stopping training to scan everything alive (hundreds of
    milliseconds with torch and Ray loaded); undone at ``finish()`` and ``close()``. ``False``
    leaves the garbage collector alone."""
    release_after_fit_s: float = 120.0
    """How long the run's actors — and the snapshots they hold in memory — outlive a ``fit()`` that
    ended without ``finish()`` (Ctrl-C, ``FailureConfig(max_failures)`` exhausted, an error) while
    the driver lives on (a notebook, a script that calls ``fit()`` again). A ``fit()`` of the same run
    started within that time resumes from memory; after it the actors end (what they were writing
    is drained first) and storage is the truth. ``0``: end them as soon as the ``fit()`` is seen to
    be over. A dead driver ends them at once; ``finish()`` after ``CF_RAY_CONTROLLER_LINGER_S``."""

    def __post_init__(self):
        if not isinstance(self.preemption, (bool, PreemptionConfig)):
            raise ConfigError(
                f"CheckpointConfig.preemption={self.preemption!r} must be True, False or a "
                "cf_ray.preemption.PreemptionConfig"
            )
        if isinstance(self.policy, type):  # the class for the instance: say so, not "not a policy"
            raise ConfigError(
                f"CheckpointConfig.policy={self.policy.__name__} is a class; pass an instance, "
                f"e.g. policy={self.policy.__name__}()"
            )
        if not isinstance(self.policy, FrequencyPolicy):
            raise ConfigError(
                f"CheckpointConfig.policy={self.policy!r} is not a FrequencyPolicy; use "
                "cf_ray.FixedInterval(every=k), cf_ray.EpochEnd() or cf_ray.Adaptive(), or for a policy of your "
                f"own {SUBCLASS_HINT}"
            )
        if self.keep_last is not None and (not isinstance(self.keep_last, int) or self.keep_last < 1):
            raise ConfigError(f"CheckpointConfig.keep_last={self.keep_last!r} must be an int >= 1 or None (keep all)")
        if self.milestone_every is not None and (not isinstance(self.milestone_every, int) or self.milestone_every < 1):
            raise ConfigError(f"CheckpointConfig.milestone_every={self.milestone_every!r} must be an int >= 1 or None")
        if self.restore_from not in _RESTORE_FROM:
            raise ConfigError(f"CheckpointConfig.restore_from={self.restore_from!r} must be one of {_RESTORE_FROM}")
        if self.upload not in _UPLOAD:
            raise ConfigError(f"CheckpointConfig.upload={self.upload!r} must be one of {_UPLOAD}")
        if self.on_durability_lost not in _ON_DURABILITY_LOST:
            raise ConfigError(
                f"CheckpointConfig.on_durability_lost={self.on_durability_lost!r} must be one of {_ON_DURABILITY_LOST}"
            )
        self.durability_timeout = _durability_timeout(self.durability_timeout)
        if self.finish_timeout_s is not None and not _positive(self.finish_timeout_s):
            raise ConfigError(
                f"CheckpointConfig.finish_timeout_s={self.finish_timeout_s!r} must be a number of seconds > 0, "
                "or None (derived from the run's persist times)"
            )
        self.allow_mismatch = _allow_mismatch(self.allow_mismatch)
        if not isinstance(self.replication, Replication):
            raise ConfigError(
                f"CheckpointConfig.replication={self.replication!r} must be a cf_ray.Replication(copies=..., "
                "label=..., every=...)"
            )
        if not isinstance(self.freeze_gc, bool):
            raise ConfigError(f"CheckpointConfig.freeze_gc={self.freeze_gc!r} must be True or False")
        if not (
            _positive(self.release_after_fit_s)
            or (self.release_after_fit_s == 0 and not isinstance(self.release_after_fit_s, bool))
        ):
            raise ConfigError(
                f"CheckpointConfig.release_after_fit_s={self.release_after_fit_s!r} must be a number of seconds >= 0"
            )
        if self.upload == "milestones" and self.upload_path and self.milestone_every is None:
            warnings.warn(
                "CheckpointConfig.upload='milestones' without milestone_every: only checkpoints saved "
                "with save(milestone=True) will be uploaded",
                stacklevel=3,
            )


def _positive(v: Any) -> bool:
    """A finite int or float > 0 (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")


def _durability_timeout(v: Any) -> DurabilityTimeout:
    if v is None:
        return DurabilityTimeout()
    if isinstance(v, DurabilityTimeout):
        return v
    if _positive(v):
        return DurabilityTimeout(seconds=float(v))
    raise ConfigError(
        f"CheckpointConfig.durability_timeout={v!r} must be a number of seconds > 0, a "
        "cf_ray.config.DurabilityTimeout(seconds=..., factor=..., floor_s=...), or None (automatic)"
    )


def _allow_mismatch(v: Any) -> frozenset[str]:
    items = (v,) if isinstance(v, str) else v
    try:
        out = frozenset(items)
    except TypeError:
        out = None
    if out is None or not out <= set(_MISMATCH):
        raise ConfigError(
            f"CheckpointConfig.allow_mismatch={v!r} must be a collection of {_MISMATCH} (e.g. "
            "allow_mismatch={'missing'}), or empty to refuse both"
        )
    return out


__all__ = ["CheckpointConfig", "DurabilityTimeout", "PreemptionConfig", "Replication"]
