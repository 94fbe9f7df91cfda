"""Input checks shared by the data sources: ints, world size, the checks a saved state must pass
before a source loads it (format tag, settings, one consistent state per old rank), and the digest
of the ids read, by which a resumed Ray Data pipeline is checked to yield the same rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from cf_ray.errors import ConfigError, ElasticResumeError

#: Key of the format tag in every state; the value is ``"<kind>/<version>"``.
FORMAT_KEY = "format"


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Return ``(rank, world_size)``: the given values, else torch.distributed's, else ``(0, 1)``.

    Raises:
        ConfigError: a value is not an int, or ``rank`` is outside ``[0, world_size)``.
    """
    if rank is None or world_size is None:
        import torch.distributed as dist

        dist_on = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if dist_on else 1
        if rank is None:
            rank = dist.get_rank() if dist_on else 0
    check_int("world_size", world_size, minimum=1)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ConfigError(
            f"rank={rank} must be smaller than world_size={world_size}; pass the "
            "rank of this worker (ray.train.get_context().get_world_rank())"
        )
    return rank, world_size


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise ConfigError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def check_format(state: Mapping[str, Any], fmt: str, owner: str) -> None:
    """Raise ConfigError unless ``state`` is a mapping saved by a source of format ``fmt``."""
    if not isinstance(state, Mapping):
        raise ConfigError(
            f"{owner}.load_state_dict() expects a dict saved by {owner}.state_dict(), got {type(state).__name__}"
        )
    got = state.get(FORMAT_KEY)
    if got != fmt:
        raise ConfigError(
            f"{owner} cannot load a state of format {got!r} (expected {fmt!r}); "
            f"register the same kind of data source in the resumed run as in the run "
            "that saved the checkpoint"
        )


def check_same(owner: str, state: Mapping[str, Any], expected: Mapping[str, Any], hints: Mapping[str, str]) -> None:
    """Raise ConfigError if a saved setting differs from this object's.

    Args:
        owner: class name used in the message.
        state: the saved state.
        expected: setting name -> this object's value.
        hints: setting name -> what to change, appended to the message.
    """
    for key, value in expected.items():
        saved = state.get(key)
        if saved != value:
            hint = hints.get(key, f"Build {owner} with {key}={saved!r}")
            raise ConfigError(
                f"{owner}: the checkpoint was saved with {key}={saved!r} but this {owner} has "
                f"{key}={value!r}; resuming would not give the saved order, so items would be "
                f"repeated or skipped. {hint}, or start a fresh run"
            )


def check_history(history: Any) -> list[dict[str, Any]]:
    """A saved ``history`` (each earlier world size of the epoch, with what each of its ranks
    consumed), checked and copied: ``[{"world_size": w, "consumed": [c_0, ..., c_w-1]}, ...]``.

    Raises:
        ConfigError: an entry's counts are not ints ``>= 0``, or not one per rank.
        KeyError, TypeError: an entry is not such a mapping (the caller names the state malformed).
    """
    checked = []
    for seg in history:
        w = check_int("history.world_size", seg["world_size"], minimum=1)
        cons = [check_int("history.consumed", c, minimum=0) for c in seg["consumed"]]
        if len(cons) != w:
            raise ConfigError(f"history entry {seg!r} has {len(cons)} counts for {w} ranks")
        checked.append({"world_size": w, "consumed": cons})
    return checked


def check_elastic_states(owner: str, states: Sequence[Mapping[str, Any]], fmt: str, same_keys: Sequence[str]) -> int:
    """Check that ``states`` are the states of every rank of one old run; return its world size.

    Raises:
        ConfigError: a state is of another format.
        ElasticResumeError: the list is not one state per old rank in rank order, or the old
            ranks disagree on a setting or on the epoch.
    """
    if not isinstance(states, Sequence) or isinstance(states, (str, bytes)) or not states:
        raise ElasticResumeError(
            f"{owner}.load_elastic_state() needs the list of every old "
            f"rank's state (index = old rank), got {states!r:.80}"
        )
    for s in states:
        check_format(s, fmt, owner)
    old_world = states[0].get("world_size")
    if old_world != len(states):
        raise ElasticResumeError(
            f"{owner}: the saved states say world_size={old_world} but {len(states)} states were "
            "given; pass the state of every old rank, in rank order"
        )
    for i, s in enumerate(states):
        if s.get("rank") != i or s.get("world_size") != old_world:
            raise ElasticResumeError(
                f"{owner}: state #{i} belongs to rank {s.get('rank')} of "
                f"{s.get('world_size')}; pass states in old-rank order"
            )
        for key in same_keys:
            if s.get(key) != states[0].get(key):
                raise ElasticResumeError(
                    f"{owner}: old ranks 0 and {i} disagree on {key!r} ({states[0].get(key)!r} vs "
                    f"{s.get(key)!r}); they do not come from the same checkpoint step"
                )
    return len(states)  # == old_world, checked above


def id_digest(batch: Any, column: str) -> int:
    """Sum of 64-bit hashes of the ids in ``batch``: independent of order and of batching, so both
    Ray Data iterators (``cf_ray/data/ray_data.py``, ``ray_elastic.py``) compare the rows a resumed
    pipeline yields with those the state recorded, whatever the blocks and batches."""
    import numpy as np
    import pandas.util

    # pandas.util resolves hash_array lazily, so type checkers see only an object.
    hash_array = cast("Callable[[Any], Any]", pandas.util.hash_array)

    try:
        ids = batch[column]
    except (KeyError, TypeError):
        raise ConfigError(f"id_column={column!r} is not a column of the batches") from None
    if hasattr(ids, "to_numpy"):
        ids = ids.to_numpy()
    elif hasattr(ids, "numpy"):  # torch tensor
        ids = ids.detach().cpu().numpy()
    hashes = hash_array(np.asarray(ids).ravel())  # fixed key: stable across processes
    return int(hashes.sum(dtype=np.uint64))
