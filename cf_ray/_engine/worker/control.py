"""Agreement between ranks without a blocking call per step.

Every decision that must be identical on all ranks (adopt schedule version v, take a checkpoint
now because of a preemption notice or a manual request, register committed step C with Ray Train,
fail the attempt because durability is lost and ``on_durability_lost="raise"``, roll back because
the first steps after a restore gave a non-finite loss)
travels in a tiny int64 vector. At each step every rank launches an *asynchronous* all-reduce
(MIN) of its local vector on a dedicated gloo group and collects the result of the previous step's
all-reduce, which is long finished by then because the ranks move in lockstep anyway (DDP
all-reduces gradients every step). All ranks therefore act on the same reduced vector at the same
step, one step after the inputs were posted. Fields where the *maximum* wins are negated.

With one rank, or without ``torch.distributed``, the local vector is the agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cf_ray._engine.protocol.messages import RequestLevel

# Field positions in the vector.
SCHEDULE_VERSION = 0  # MIN: the newest schedule version every rank has received
SAVE_REQUEST = 1  # MAX (negated): a RequestLevel (0 none, 1 manual request, 2 preemption notice)
COMMITTED_STEP = 2  # MIN: the newest committed step every rank knows of
REGISTER = 3  # MAX (negated): rank 0 asks to register with Ray Train
DURABILITY_LOST = 4  # MAX (negated): a rank lost durability and the attempt is to fail
NON_FINITE = 5  # MAX (negated): the step at which a rank's loss went non-finite after a restore (0: none)
_N = 6
_NEGATED = (SAVE_REQUEST, REGISTER, DURABILITY_LOST, NON_FINITE)


@dataclass(frozen=True, slots=True)
class Agreement:
    """What every rank acts on at the same step."""

    schedule_version: int
    """The newest schedule version every rank has received (the one to adopt)."""
    save_request: RequestLevel
    """The strongest out-of-schedule checkpoint request any rank posted."""
    committed_step: int
    """The newest committed step every rank knows of."""
    register: bool
    """Rank 0 asks every rank to register ``committed_step`` with Ray Train."""
    durability_lost: bool = False
    """Some rank lost durability with ``on_durability_lost="raise"``: every rank fails the attempt."""
    non_finite: int = 0
    """The newest step at which some rank's loss went non-finite in the first steps after a restore
    (``worker/restore/trust_gate.py``; 0: none): every rank rolls back."""


class ControlPlane:
    """Posts this rank's vector each step and returns the agreement of the previous one."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self._group: dist.ProcessGroup | None = None
        self._work = None
        self._buf: torch.Tensor | None = None
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "cf_ray needs torch.distributed initialised when world_size > 1 "
                    "(TorchTrainer does this before train_loop_per_worker runs)"
                )
            # A gloo group of our own: works beside NCCL and keeps our collectives out of DDP's way.
            group = dist.new_group(backend="gloo")
            # Every rank is a member of this group, so never the NON_GROUP_MEMBER sentinel (an int).
            assert not isinstance(group, int)
            self._group = group

    def exchange(
        self,
        *,
        schedule_version: int,
        save_request: RequestLevel,
        committed_step: int,
        register: bool,
        durability_lost: bool = False,
        non_finite: int = 0,
    ) -> Agreement | None:
        local = [0] * _N
        local[SCHEDULE_VERSION] = schedule_version
        local[SAVE_REQUEST] = int(save_request)
        local[COMMITTED_STEP] = committed_step
        local[REGISTER] = int(register)
        local[DURABILITY_LOST] = int(durability_lost)
        local[NON_FINITE] = int(non_finite)
        if self._group is None:
            return _agreement(local)
        previous = None
        if self._work is not None:
            self._work.wait()
            assert self._buf is not None  # posted together with self._work
            previous = _agreement(self._decode(self._buf))
        buf = torch.tensor([(-v if i in _NEGATED else v) for i, v in enumerate(local)], dtype=torch.int64)
        self._buf = buf
        self._work = dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        return previous

    def all_true(self, flag: bool) -> bool:
        """A blocking agreement (restore only): True when every rank says True."""
        if self._group is None:
            return flag
        self.drain()
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return bool(t.item())

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (restore only; small plain data made by rank 0)."""
        if self._group is None:
            return obj
        self.drain()
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def all_gather(self, obj) -> list:
        if self._group is None:
            return [obj]
        self.drain()
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def drain(self) -> None:
        """Wait for the in-flight exchange and forget it (used before blocking collectives)."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def close(self) -> None:
        """Forget the in-flight exchange without waiting for it (the other ranks may be gone)."""
        self._work = None
        self._buf = None

    def _decode(self, buf: torch.Tensor) -> list[int]:
        vals = buf.tolist()
        return [(-v if i in _NEGATED else v) for i, v in enumerate(vals)]


def _agreement(v: list[int]) -> Agreement:
    return Agreement(
        schedule_version=v[SCHEDULE_VERSION],
        save_request=RequestLevel(v[SAVE_REQUEST]),
        committed_step=v[COMMITTED_STEP],
        register=bool(v[REGISTER]),
        durability_lost=bool(v[DURABILITY_LOST]),
        non_finite=v[NON_FINITE],
    )
