"""Fault schedules: what the soak injects into one training run, drawn from a seed (no Ray, no torch).

A schedule is a seed, a short list of :class:`Fault` s ordered by the step at which each is
injected, and whether the run's checkpoint storage goes through the soak's faulty filesystem
(``storage.py``: only when a fault needs it, so that the other schedules run cf_ray's local-disk
path). The same seed and settings always draw the same schedule.

Kinds (``KINDS``) and the points each can be injected at:

* ``worker_kill``: a training worker SIGKILLed at a step, in the middle of copying a snapshot into
  its holder's slot (``mid_copy``), while its holder writes that rank's section (``mid_persist``), or
  in the middle of the restore that follows a first kill (``mid_restore``: two kills).
* ``holder_kill``: the holder of a rank's node SIGKILLed at a step, or while it writes (``mid_persist``).
* ``controller_kill``: the run's controller SIGKILLed at a step, or while it writes a manifest
  (``mid_commit``).
* ``node_loss``: the node of a rank removed (its raylet, worker and holder gone).
* ``storage_error``: every checkpoint write fails for a few seconds (an outage).
* ``storage_hang``: every checkpoint write blocks for a few seconds, sometimes longer (a stall).
* ``slot_flip``: one bit flipped in a holder's slot of the snapshot a restore will take, then a
  worker SIGKILLed (the restore must refuse those bytes).
* ``file_flip``: one bit flipped in a committed checkpoint's data file, the run's holders and a
  worker SIGKILLed (the restore reads storage and must refuse that checkpoint).
* ``stream_flip``: one bit flipped in the next direct transfer between nodes, then a rank's node
  removed (its section comes from the other node over that transfer).
* ``spare_kill``: the spare worker process a rank made ready for the next attempt (cf_ray's
  ``link/ray_train_spare.py``) SIGKILLed, then that rank's worker (``then_kill``: the restart must
  start a new process and say why it took no spare); or a restarted rank SIGKILLed right after its
  restore, while its spare is being made (``while_made``: two kills).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

#: Every fault kind and the points it is injected at (the first is the plain "at a step").
KINDS: dict[str, tuple[str, ...]] = {
    "worker_kill": ("step", "mid_copy", "mid_persist", "mid_restore"),
    "holder_kill": ("step", "mid_persist"),
    "controller_kill": ("step", "mid_commit"),
    "node_loss": ("step",),
    "storage_error": ("outage",),
    "storage_hang": ("stall",),
    "slot_flip": ("then_kill",),
    "file_flip": ("then_kill",),
    "stream_flip": ("then_node_loss",),
    "spare_kill": ("then_kill", "while_made"),
}

#: How often each kind is drawn (relative).
WEIGHTS: dict[str, float] = {
    "worker_kill": 3.0,
    "holder_kill": 1.5,
    "controller_kill": 1.5,
    "node_loss": 1.0,
    "storage_error": 1.0,
    "storage_hang": 1.0,
    "slot_flip": 1.0,
    "file_flip": 1.0,
    "stream_flip": 1.0,
    "spare_kill": 1.5,
}

#: Faults per schedule and how often each count is drawn.
COUNTS = ((1, 0.4), (2, 0.35), (3, 0.25))

#: Kinds that read a snapshot on one path on purpose: at most one of them per schedule.
_FLIPS = frozenset({"slot_flip", "file_flip", "stream_flip"})
#: Kinds that take a node away: at most one per schedule (each costs a raylet start).
_NODE = frozenset({"node_loss", "stream_flip"})
#: (kind, point) pairs that need the soak's storage filesystem.
_NEEDS_FS = frozenset(
    {
        ("storage_error", "outage"),
        ("storage_hang", "stall"),
        ("worker_kill", "mid_persist"),
        ("holder_kill", "mid_persist"),
        ("controller_kill", "mid_commit"),
    }
)
#: Points that kill twice (a first kill, then the restarted rank).
_TWO_KILLS = frozenset({"mid_restore", "while_made"})
#: Steps between two faults' injection points (each needs a few steps to show its effect).
MIN_GAP = 3


@dataclass(slots=True)
class Fault:
    """One fault of a schedule: what, where, when, and (filled by the injector) what happened."""

    id: str
    """``F<seed>.<k>``: unique in the soak; a storage error's message carries it."""
    kind: str
    point: str
    step: int
    """Injected once the newest attempt of the run has logged this step."""
    rank: int = 1
    """The rank whose worker, node or holder it hits (a rank's section, for flips)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Per kind: ``seconds`` (storage outage or stall), ``section`` (flips)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(slots=True)
class Schedule:
    seed: int
    faults: list[Fault]

    @property
    def soak_fs(self) -> bool:
        """Whether the run's checkpoint storage goes through the soak's filesystem."""
        return any((f.kind, f.point) in _NEEDS_FS for f in self.faults)

    @property
    def kills(self) -> int:
        """Worker restarts the schedule can cause (for ``FailureConfig(max_failures)``)."""
        return sum(2 if f.point in _TWO_KILLS else 1 for f in self.faults)

    def as_dict(self) -> dict:
        return {"seed": self.seed, "soak_fs": self.soak_fs, "faults": [f.as_dict() for f in self.faults]}


def draw(seed: int, total_steps: int, *, kinds: tuple[str, ...] | None = None) -> Schedule:
    """The schedule of ``seed`` for a run of ``total_steps`` steps.

    Args:
        kinds: draw only these kinds (``None``: all of :data:`KINDS`).

    Raises:
        ValueError: an unknown kind, or a run too short for a fault.
    """
    pool = tuple(kinds or KINDS)
    unknown = [k for k in pool if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {unknown}: use some of {', '.join(KINDS)}")
    first, last = 3, total_steps - 4
    if last < first:
        raise ValueError(f"a run of {total_steps} steps is too short for the soak: use at least {first + 4}")
    rng = random.Random(seed)
    n = rng.choices([c for c, _ in COUNTS], weights=[w for _, w in COUNTS])[0]
    faults: list[Fault] = []
    step = rng.randint(first, max(first, int(first + 0.5 * (last - first))))
    for k in range(n):
        if step > last:
            break
        taken = {f.kind for f in faults}
        allowed = [
            kind for kind in pool if not (kind in _FLIPS and taken & _FLIPS) and not (kind in _NODE and taken & _NODE)
        ]
        if not allowed:
            break
        kind = rng.choices(allowed, weights=[WEIGHTS[c] for c in allowed])[0]
        point = rng.choice(KINDS[kind])
        faults.append(
            Fault(
                id=f"F{seed}.{k}", kind=kind, point=point, step=step, rank=rng.randint(0, 1), params=_params(rng, kind)
            )
        )
        step += MIN_GAP + rng.randint(0, 4)
    return Schedule(seed=seed, faults=faults)


def _params(rng: random.Random, kind: str) -> dict[str, Any]:
    if kind == "storage_error":
        return {"seconds": round(rng.uniform(1.5, 6.0), 1)}
    if kind == "storage_hang":
        # Mostly a few seconds; one in six long enough for the durability watchdog to speak.
        long = rng.random() < 1 / 6
        return {"seconds": round(rng.uniform(20.0, 35.0) if long else rng.uniform(2.0, 12.0), 1)}
    if kind in ("slot_flip", "file_flip"):
        return {"section": "shared" if rng.random() < 0.7 else "rank", "where": round(rng.uniform(0.25, 0.75), 3)}
    if kind == "stream_flip":
        return {"where": round(rng.uniform(0.25, 0.75), 3)}
    return {}


__all__ = ["KINDS", "WEIGHTS", "Fault", "Schedule", "draw"]
