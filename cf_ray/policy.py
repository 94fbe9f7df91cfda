"""When to checkpoint: small, pure policy objects (no Ray inside), in the manner of Orbax's
save-decision policies.

A policy has two sides:

* ``should_save(step, ctx)`` runs on every rank after each optimizer step. It must be a pure
  function of its arguments, because every rank evaluates it independently and all ranks must
  agree: ``ctx`` holds only values that every rank has agreed on (the step, the epoch boundary, the
  last checkpoint step and the interval the controller published and the ranks adopted together).
* ``plan(samples)`` runs in the driver-side controller for adaptive policies: it turns timing
  samples from every rank into the interval to use next. Fixed policies return ``None``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

from cf_ray.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SaveContext:
    """What every rank knows identically when it decides whether ``step`` is a checkpoint step."""

    step: int
    """Optimizer steps taken so far in the run (after this one)."""
    epoch: int
    """The current epoch."""
    last_save_step: int
    """The step of the last checkpoint taken (or restored from); 0 on a fresh run."""
    interval: int | None = None
    """The interval published by the controller and adopted by all ranks (adaptive mode)."""
    epoch_end: bool = False
    """True when called from ``Checkpointer.end_epoch()``."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One compact timing sample that a rank sends to the controller."""

    rank: int
    step: int
    iter_s: float = 0.0
    """Mean seconds per iteration since the previous sample, stalls excluded."""
    iters: int = 0
    """Number of iterations the mean covers."""
    stall_s: float | None = None
    """Training-thread stall of the last checkpoint (guard wait + synchronous part)."""
    copy_s: float | None = None
    """Background copy of the last snapshot into host buffers."""
    persist_s: float | None = None
    """Phase 2 (write + checksum) of the last checkpoint of this rank's sections."""
    nbytes: int | None = None
    """Bytes of this rank's last snapshot."""


@runtime_checkable
class FrequencyPolicy(Protocol):
    """Decides checkpoint steps. See the module docstring for which side calls what."""

    def should_save(self, step: int, ctx: SaveContext) -> bool: ...

    def plan(self, samples: Sequence[Sample], current: int | None) -> int | None: ...

    def initial_interval(self) -> int | None: ...


@dataclass(kw_only=True, slots=True)
class FixedInterval:
    """Checkpoint every ``every`` optimizer steps (CheckFreq's MANUAL mode)."""

    every: int
    """Steps between checkpoints; a checkpoint is taken when ``step % every == 0``."""

    def __post_init__(self):
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ConfigError(f"FixedInterval.every={self.every!r} must be an int >= 1; "
                              "use EpochEnd() to checkpoint only at epoch boundaries")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return not ctx.epoch_end and step > 0 and step % self.every == 0

    def plan(self, samples, current):
        return None

    def initial_interval(self) -> int | None:
        return None  # not controller-driven


@dataclass(kw_only=True, slots=True)
class EpochEnd:
    """Checkpoint only at epoch boundaries (CheckFreq's baseline), every ``every`` epochs."""

    every: int = 1

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"EpochEnd.every={self.every!r} must be an int >= 1")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return ctx.epoch_end and ctx.epoch % self.every == 0

    def plan(self, samples, current):
        return None

    def initial_interval(self) -> int | None:
        return None


@dataclass(kw_only=True, slots=True)
class AnyOf:
    """Checkpoint when any of ``policies`` says so; an adaptive member's plan is used."""

    policies: tuple = field(default_factory=tuple)

    def __post_init__(self):
        self.policies = tuple(self.policies)
        if not self.policies:
            raise ConfigError("AnyOf(policies=...) needs at least one policy")
        for p in self.policies:
            if not isinstance(p, FrequencyPolicy):
                raise ConfigError(f"AnyOf: {p!r} is not a FrequencyPolicy")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        return any(p.should_save(step, ctx) for p in self.policies)

    def plan(self, samples, current):
        for p in self.policies:
            k = p.plan(samples, current)
            if k is not None:
                return k
        return None

    def initial_interval(self) -> int | None:
        for p in self.policies:
            k = p.initial_interval()
            if k is not None:
                return k
        return None


@dataclass(kw_only=True, slots=True)
class Adaptive:
    """CheckFreq-style automatic interval under an overhead budget, decided by the controller.

    The worker side checkpoints when ``step - last_save_step >= interval`` where ``interval`` is
    the value the controller last published and every rank adopted.
    """

    budget_pct: float = 5.0
    """Percent of training time that checkpointing may cost (stall per checkpoint / interval)."""
    min_interval: int = 1
    """Never checkpoint more often than this."""
    max_interval: int = 10_000
    """Never checkpoint less often than this."""
    first_checkpoint_step: int = 5
    """The first checkpoint is taken here, before any profile exists, so that it can be timed."""

    def __post_init__(self):
        if not (0 < self.budget_pct < 100):
            raise ConfigError(f"Adaptive.budget_pct={self.budget_pct!r} must be > 0 and < 100 (percent)")
        if self.min_interval < 1:
            raise ConfigError(f"Adaptive.min_interval={self.min_interval!r} must be >= 1")
        if self.min_interval > self.max_interval:
            raise ConfigError(f"Adaptive.min_interval={self.min_interval} is above max_interval={self.max_interval}; "
                              "lower min_interval or raise max_interval")
        if self.first_checkpoint_step < 1:
            raise ConfigError(f"Adaptive.first_checkpoint_step={self.first_checkpoint_step!r} must be >= 1")

    def should_save(self, step: int, ctx: SaveContext) -> bool:
        if ctx.epoch_end:
            return False
        interval = ctx.interval if ctx.interval is not None else self.first_checkpoint_step
        return step - ctx.last_save_step >= interval

    def initial_interval(self) -> int | None:
        return self.first_checkpoint_step

    def plan(self, samples: Sequence[Sample], current: int | None) -> int | None:
        iters = [s.iter_s for s in samples if s.iters > 0 and s.iter_s > 0]
        stalls = [s.stall_s for s in samples if s.stall_s is not None]
        persists = [s.persist_s for s in samples if s.persist_s is not None]
        if not iters or not stalls:
            return None
        t_i = max(_median(iters[-8:]), 1e-6)  # the slowest rank governs, via max over per-rank means below
        t_s = max(stalls[-4:])
        t_p = max(persists[-4:]) if persists else 0.0
        k_persist = math.ceil(t_p / t_i) if t_p else 1  # one persist in flight at a time
        k_budget = math.ceil(t_s / (t_i * self.budget_pct / 100.0))
        k = max(k_persist, k_budget, self.min_interval)
        return min(k, self.max_interval)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
