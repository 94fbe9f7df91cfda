"""What the Checkpointer hands back to the training loop: :class:`Resume` from ``restore()`` and
:class:`FinishSummary` from ``finish()`` (both public as ``cf_ray.Resume`` and ``cf_ray.FinishSummary``)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    phases: dict = field(default_factory=dict)
    """Of ``seconds``, those of each phase on this rank: ``plan`` (the controller's plan), ``read``
    (fetching and checking the bytes of every candidate tried), ``validate``, ``apply`` (loading
    into the tracked objects), ``verify`` (the fingerprints); the rest is the ranks' agreement."""
    read_bytes: dict = field(default_factory=dict)
    """Bytes this rank read, by how: ``in_place`` (its node's holder's memory, mapped), ``direct``
    (streamed from a holder of another node: a lost node's sections, a peer's copy), ``storage``."""
    fallbacks: list = field(default_factory=list)
    """The newer candidates every rank skipped, and why (``where``, ``rank``, ``error``, ``distrust``:
    ``"integrity"`` when its bytes failed their checks, ``"non_finite"`` when its state did)."""
    refused_copies: list = field(default_factory=list)
    """The copies of sections this rank refused because their bytes failed their block checksums
    (``section``, ``holder``, ``how``, ``blocks``, ``error``); the restore used other bytes."""
    rolled_back_from: int | None = None
    """A newer step this restore went back past because it went non-finite (its saved state, or the
    loss of the first steps after an earlier restore of it); ``None``: none."""

    @property
    def fresh(self) -> bool:
        return self.source == "fresh"


@dataclass(frozen=True, slots=True)
class FinishSummary:
    """What :meth:`Checkpointer.finish` reports."""

    final_path: str | None
    """Where the consolidated model was written (``None``: not written)."""
    committed_steps: list[int]
    """Every committed checkpoint of the run, oldest first."""
    failures: list[dict]
    """Checkpoints that did not commit (``step``, ``section``, ``rank``, ``error``, ``generation``):
    this attempt's, and those of earlier attempts of the same run that the controller knows of (a
    step lost with its node, a write that failed after its ranks were gone), marked
    ``earlier_attempt: True``. The controller keeps the newest 1,000; the profile table
    (``committed``, ``where``, ``error``) and the restarts table (``lost_steps``) have them all.
    When the final checkpoint committed, what failed of the final step before it (a memory-only
    snapshot a rank skipped, a try of it that failed) is not listed: ``finish()`` made it good."""
    final_step: int = 0
    """The step training ended at (the final checkpoint's)."""
    final_durable: bool = True
    """Whether the final checkpoint was committed before ``finish()`` returned; when not (its wait,
    ``CheckpointConfig.finish_timeout_s``, passed) a warning said so, and the final model names
    ``resume_step`` for ``resume_from``."""
    resume_step: int | None = None
    """The committed step the final model names for ``CheckpointConfig(resume_from=result.checkpoint)``
    (never deleted by keep-last)."""
    rollbacks: list[dict] = field(default_factory=list)
    """The run's rollbacks past a snapshot that went non-finite (``suspect_step``, ``reason``, ...)."""


__all__ = ["FinishSummary", "Resume"]
