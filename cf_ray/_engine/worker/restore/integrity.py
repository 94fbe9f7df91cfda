"""What a restore checks of the bytes it is about to use, whatever path they came by.

Every byte a restore uses is verified before use, at the granularity the section's index already
has: the CRC-32 of every 256 KiB block (``format/blocks.py``'s ``BLOCK_BYTES``), computed by the
worker as its copy landed in the holder's slot. The check is the same for every path: a slot mapped
in place, a section streamed from another node, a peer's copy (:func:`verify_section`, on the bytes
and the index, whichever way they came); a file read from storage is checked against the manifest's
CRC-32 before it is parsed, and a failure there names the blocks too (``format/sections.py``'s
``read_verified``); a ranged read checks every block it touches (``format/blocks.py``'s
``RangedData``). Bytes without block checksums are refused (fail closed).

A failure is not an error of the run: the copy is refused, logged once by the rank that read it
(which block of which section, from where and how), reported to the controller as an
:class:`~cf_ray._engine.protocol.messages.IntegrityFailure` event, and the restore takes the next
copy (a peer's), then the next candidate (storage). The snapshot is then distrusted
(``trust_gate.py``): never offered to a restore again.

After loading, each object is compared with the fingerprint the snapshot recorded of it
(``snapshot/fingerprint.py``). A mismatch there means the object was not restored as saved: either
its bytes changed under the load (memory mapped in place, written by someone else) or its
``load_state_dict()`` does not load everything. :func:`recheck` tells the two apart by checking the
blocks again: damaged bytes make the restore fall back like any refused copy; intact bytes mean the
load is at fault, and the restore raises.

The saved state itself is checked once for non-finite values (:func:`check_finite`: the parameters
of every tracked module and every optimizer's state tensors, one ``aminmax`` per tensor, before
anything is loaded): a snapshot of a transient state (a step that put ``inf`` in a weight, which the
loop repaired from memory it does not checkpoint) is refused like damage and the restore goes back to
an older candidate, in place, without a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from cf_ray._engine.format.blocks import BLOCKS_NAMED, bad_blocks, verify_blocks
from cf_ray._engine.format.sections import Section
from cf_ray._engine.protocol.events import IntegrityFailureEvent
from cf_ray._engine.protocol.messages import IntegrityFailure
from cf_ray.errors import CorruptCheckpointError

logger = logging.getLogger("cf_ray")


class NonFiniteStateError(CorruptCheckpointError):
    """A snapshot's saved parameters or optimizer state hold NaN or infinity."""


def verify_section(section: Section, where: str) -> None:
    """Check every byte of a section that came from memory against its block checksums.

    Raises:
        BlockMismatchError: some blocks differ (named in the message and ``.blocks``).
        CorruptCheckpointError: the section has no block checksums (refused: fail closed).
    """
    if isinstance(section.buf, np.ndarray):
        verify_blocks(section.buf, section.blocks, where)
    # A RangedData checks every block it reads, as it reads it.


def recheck(sections: dict[str, Section]) -> str:
    """After a fingerprint mismatch: the blocks of the sections loaded that differ now from their
    checksums (``""``: every block still intact, so the bytes did not change under the load)."""
    bad = []
    for name, sec in sorted(sections.items()):
        if isinstance(sec.buf, np.ndarray) and sec.blocks is not None:
            blocks = bad_blocks(sec.buf, sec.blocks)
            if blocks:
                bad.append(f"section {name}: blocks {blocks[:BLOCKS_NAMED]}")
    return "; ".join(bad)


class Refusals:
    """The copies of sections this rank refused in one restore: each logged once, and reported to
    the controller as an ``integrity_failure`` event (``record_event``)."""

    def __init__(self, rank: int, record_event: Callable[[IntegrityFailureEvent], None]):
        self.rank = rank
        self._record_event = record_event
        self.items: list[IntegrityFailure] = []

    def refuse(
        self, error: BaseException, *, generation: int, step: int, section: str, holder: str, how: str, next_: str
    ) -> IntegrityFailure:
        """One copy refused because its bytes failed a check; ``next_`` says what the restore tries now."""
        failure = IntegrityFailure(
            rank=self.rank,
            generation=generation,
            step=step,
            section=section,
            holder=holder,
            how=how,
            blocks=tuple(getattr(error, "blocks", ())[:BLOCKS_NAMED]),
            block_bytes=int(getattr(error, "block_bytes", 0)),
            error=str(error)[:1000],
        )
        self.items.append(failure)
        logger.warning(
            "cf_ray: rank %d: refused section %s of step %d from %s (%s): %s; nothing of it is used, %s",
            self.rank,
            section,
            step,
            holder,
            how,
            error,
            next_,
        )
        self._record_event(IntegrityFailureEvent.of(failure))
        return failure


# -- non-finite saved state ---------------------------------------------------------------------------------


def check_finite(saved: dict[str, Any], live: dict[str, Any]) -> int:
    """Check the saved parameters of every tracked module and every tracked optimizer's state for
    NaN and infinity, before anything is loaded. Module buffers are not checked (an attention
    mask may hold ``-inf`` on purpose), nor is what is neither a module nor an optimizer.

    Args:
        saved: tracked name -> its saved state (``checks.Prepared.state``).
        live: the tracked objects (which names are modules, optimizers, and a module's parameters).

    Returns:
        The bytes checked.

    Raises:
        NonFiniteStateError: naming the object and the tensor.
    """
    checked = 0
    for name, obj in live.items():
        state = saved.get(name)
        if not isinstance(state, dict):
            continue
        for key, t in _checked_tensors(obj, state):
            if t.numel() == 0:
                continue  # an empty shard (FSDP2 on a rank with no rows of a tensor): nothing to check
            lo, hi = torch.aminmax(t.detach().reshape(-1))
            checked += t.numel() * t.element_size()
            if not (torch.isfinite(lo) and torch.isfinite(hi)):
                what = "NaN" if bool(torch.isnan(lo) or torch.isnan(hi)) else "infinity"
                raise NonFiniteStateError(
                    f"the saved state of {name!r} holds {what} in {key}: the snapshot was taken of a state "
                    "that cannot be trained from (it is refused like a damaged one)"
                )
    return checked


def _checked_tensors(obj: Any, state: dict) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.nn.Module):
        params = {n for n, _ in obj.named_parameters()}
        for key, t in state.items():
            if key in params and _floating(t):
                yield key, _local(t)
    elif isinstance(obj, torch.optim.Optimizer):
        per_param = state.get("state")
        if isinstance(per_param, dict):
            for pid, st in per_param.items():
                if isinstance(st, dict):
                    for k, t in st.items():
                        if _floating(t):
                            yield f"state[{pid!r}][{k!r}]", _local(t)


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if callable(to_local) else t  # pyright: ignore[reportReturnType] - a DTensor's shard is a Tensor


__all__ = ["NonFiniteStateError", "Refusals", "check_finite", "recheck", "verify_section"]
