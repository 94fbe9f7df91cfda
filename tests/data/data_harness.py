"""A simulated training loop, shaped like cf_ray's engine, to test resumable data sources.

The loop is the one of the engine's contract::

    for epoch in range(resume_epoch, epochs):
        source.set_epoch(epoch)
        for batch in source:          # "step": the engine may call source.state_dict() here
            ...
        # "end": ckpt.end_epoch() may call source.state_dict() here

Every state taken goes through JSON, as it would through a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Make = Callable[[], Any]
IdsOf = Callable[[Any], list]


@dataclass
class Event:
    kind: str  # "step" (after a batch was trained) or "end" (after end_epoch)
    epoch: int  # the epoch the engine would resume at if it saved here
    ids: list  # ids of the batch ("step"), [] for "end"


def roundtrip(state: dict) -> dict:
    """The state as it comes back from a checkpoint: JSON only."""
    return json.loads(json.dumps(state))


def loop(source: Any, ids_of: IdsOf, start_epoch: int, epochs: int) -> Iterator[Event]:
    """The engine-shaped loop over ``source``; yields after every step and every epoch end."""
    for epoch in range(start_epoch, epochs):
        source.set_epoch(epoch)
        for batch in source:
            yield Event("step", epoch, ids_of(batch))
        yield Event("end", epoch + 1, [])


def reference(make: Make, ids_of: IdsOf, epochs: int) -> list[Event]:
    return list(loop(make(), ids_of, 0, epochs))


def run_segments(
    make: Make,
    ids_of: IdsOf,
    epochs: int,
    stops: list[int],
    end_resume_same_epoch: bool = False,
    rt: Callable[[dict], dict] = roundtrip,
) -> list[list]:
    """Run ``stops[0]`` events, save, rebuild and load, run ``stops[1]`` more, ... then to the end.

    Returns the ids of every step trained, in order, across all segments. With
    ``end_resume_same_epoch``, a state saved at an epoch end resumes at that same epoch (an engine
    that reports the finished epoch) instead of the next one.
    """
    trained: list[list] = []
    state, epoch = None, 0
    for stop in [*stops, None]:
        source = make()
        if state is not None:
            source.load_state_dict(state)
        events = loop(source, ids_of, epoch, epochs)
        n = 0
        for ev in events:
            if ev.kind == "step":
                trained.append(ev.ids)
            n += 1
            if stop is not None and n == stop:
                state = rt(source.state_dict())
                epoch = ev.epoch - 1 if (ev.kind == "end" and end_resume_same_epoch) else ev.epoch
                events.close()  # the "crash": nothing after the save reaches the loop
                break
    return trained


def check_every_interrupt_point(
    make: Make,
    ids_of: IdsOf,
    epochs: int = 2,
    *,
    single: bool = True,
    end_same_epoch: bool = True,
    rt: Callable[[dict], dict] = roundtrip,
) -> int:
    """Resume from every checkpoint point (each step and each epoch end, both ways an engine may
    report the epoch) and from chains of several interrupts; compare with an uninterrupted run.
    ``single=False`` runs the chains only (for sources that are slow to rebuild);
    ``end_same_epoch=False`` skips resuming an epoch-end state at the finished epoch (a source
    whose rule is "a finished pass starts the next one", as torchdata's); ``rt`` as in
    :func:`run_segments`.

    Returns the number of events of the reference run.
    """
    ref = reference(make, ids_of, epochs)
    expected = [ev.ids for ev in ref if ev.kind == "step"]
    assert expected, "the reference run trained nothing"
    for i in range(1, len(ref) + 1 if single else 1):
        got = run_segments(make, ids_of, epochs, [i], rt=rt)
        assert got == expected, f"resume after event {i} ({ref[i - 1].kind}) differs"
        if ref[i - 1].kind == "end" and end_same_epoch:
            got = run_segments(make, ids_of, epochs, [i], end_resume_same_epoch=True, rt=rt)
            assert got == expected, f"resume at the finished epoch after event {i} differs"
    per_epoch = len(ref) // epochs
    chains = [
        [1, 1, 1],  # several interrupts in one epoch, one step apart
        [2, 1],
        [per_epoch - 1, 1, 1],  # last step of epoch 0, then its end, then epoch 1
        [per_epoch, 1],  # right after the boundary, then first step
        [1, per_epoch - 1, 2],  # across the boundary
    ]
    for stops in chains:
        if sum(stops) < len(ref):
            got = run_segments(make, ids_of, epochs, stops, rt=rt)
            assert got == expected, f"chain {stops} differs"
    return len(ref)
