"""Everything a restore checks before it touches a tracked object, and the loading itself.

:func:`validate` turns the sections a rank read (and verified against their checksums) into a
:class:`Prepared` restore, or raises: the checkpoint's world size and its rank sections (each one
that rank's, every old rank at the same step), the RNG states (parsed by throw-away generators),
the tracked objects (the same names as the script's; modules: the same keys, shapes and dtypes;
optimizers: the same parameter groups; sharded FSDP2/DTensor objects: per tensor the global shape,
dtype and this rank's shard, ``sharded.py``, resharded first when the number of ranks changed), and
the data objects' states (each source's own checks,
run on a copy where cf_ray knows how: its samplers, loaders and readers). :func:`apply` then loads
what was validated, and :func:`verify` checks each loaded object against the fingerprint the
snapshot recorded (``snapshot/fingerprint.py``).

What :func:`validate` raises says what kind of refusal it is: :class:`~cf_ray.errors.CorruptCheckpointError`
(damage: the restore falls back to an older candidate), :class:`~cf_ray.errors.CheckpointMismatchError`
(the script and the checkpoint disagree on what is tracked: no candidate can do better, every rank
raises it), anything else (a data source or the elastic re-split refuses the state: the restore
falls back, and raises when no candidate is left).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cf_ray._engine.data.cursor import EpochCursor, SamplerHeldPosition
from cf_ray._engine.format import codec as _codec
from cf_ray._engine.format.layout import COUNTERS, OBJECTS, RNG, SHARED, STATE, rank_section
from cf_ray._engine.format.sections import Section
from cf_ray._engine.memory import slots as _slots
from cf_ray._engine.worker.restore import sharded as _sharded
from cf_ray._engine.worker.snapshot import fingerprint as _fp
from cf_ray._engine.worker.snapshot.rng import check_rng_state, set_rng_state
from cf_ray.errors import CheckpointMismatchError, CorruptCheckpointError, ElasticResumeError, RestoreError

logger = logging.getLogger("cf_ray")


@dataclass(slots=True)
class Prepared:
    """A validated restore of one rank: everything :func:`apply` loads, already decoded."""

    saved_world: int
    """Number of ranks that saved the checkpoint."""
    replicated: bool
    step: int
    epoch: int
    state: dict[str, Any]
    """Tracked ``state`` object -> its saved state (only the objects the checkpoint holds)."""
    data: dict[str, Any]
    """Same world size: data object -> its saved state; else data object -> every old rank's state."""
    rng: dict | None
    """This rank's RNG states, ``None`` when it has none (a new rank of a grown group)."""
    fingerprints: dict[str, dict[str, str]] = field(default_factory=dict)
    """``{"state": {name: fp}, "data": {name: fp}}`` of the objects to verify after loading."""
    fresh: list[str] = field(default_factory=list)
    """Tracked objects the checkpoint does not hold (``allow_mismatch`` with ``"missing"``): left as they are."""
    elastic: bool = False
    """Saved by another number of ranks: the data objects are re-split (``load_elastic_state``)."""
    sharded: _sharded.ShardedState | None = None
    """The sharded objects (FSDP2/DTensor): their states in ``state`` are loaded through it."""
    state_fns: dict[str, Callable[[], Any]] = field(default_factory=dict)
    """Tracked name -> what returns its state for the fingerprint check (default: ``state_dict``)."""
    releasable: list[tuple[np.ndarray, int, int]] = field(default_factory=list)
    """``(buffer, start, end)``: bytes of a private section buffer that only modules read (they copy
    them into their parameters): given back to the system once loaded (:func:`apply`)."""


def validate(
    loaded: dict[str, Section],
    *,
    saved_world: Any,
    replicated: bool,
    rank: int,
    world_size: int,
    state: dict[str, Any],
    data: dict[str, Any],
    allow_missing: bool = False,
    allow_unexpected: bool = False,
    sharded: _sharded.ShardedState | None = None,
) -> Prepared:
    """Check a candidate without touching any tracked object; see the module doc for what raises what.

    Args:
        loaded: section name -> the section as read (``shared`` and the rank sections needed).
        saved_world, replicated: the checkpoint's world size and replication (manifest or memory snapshot).
        rank, world_size: this rank and the number of ranks now.
        state, data: the tracked objects (not modified).
        allow_missing, allow_unexpected: ``"missing"`` / ``"unexpected"`` in ``CheckpointConfig.allow_mismatch``.
        sharded: the tracked objects whose state is sharded (``sharded.py``; ``None``: none).
    """
    if not isinstance(saved_world, int) or isinstance(saved_world, bool) or saved_world < 1:
        raise CorruptCheckpointError(f"the checkpoint says it was saved by world_size={saved_world!r} ranks")
    saved_sharded = _saved_sharded_names(loaded)
    live_sharded = sharded.names if sharded is not None else set()
    # Sharded state saved by another number of ranks: re-split (the rest of the per-rank state from old rank 0).
    reshard = saved_world != world_size and not replicated and bool(saved_sharded)
    if saved_world != world_size and not replicated and not reshard:
        raise ElasticResumeError(
            f"the checkpoint was saved by {saved_world} ranks with replicated=False (per-rank model state); "
            f"it cannot be loaded by {world_size} ranks. Resume with {saved_world} workers."
        )
    same_world = saved_world == world_size
    wanted = [rank] if same_world else list(range(saved_world))
    trees = {r: _rank_tree(loaded, r, saved_world) for r in wanted}
    steps = {int(t[COUNTERS]["step"]) for t in trees.values()}
    if len(steps) != 1:
        raise CorruptCheckpointError(f"the ranks' sections disagree on the step: {sorted(steps)}")
    mine = trees[rank] if rank in trees else trees[0]
    # -- the tracked state (model, optimizer, schedulers, ...) ----------------------------------------
    if replicated:
        section, where, fp_tree = _section(loaded, SHARED), (OBJECTS,), _section(loaded, SHARED).tree
    elif reshard:
        section, where, fp_tree = _section(loaded, rank_section(0)), (STATE,), trees[0]
    else:
        section, where, fp_tree = _section(loaded, rank_section(rank)), (STATE,), mine
    saved_state = _encoded_at(section, where)
    fresh_state = check_names(state, saved_state, "state", allow_missing, allow_unexpected)
    # Saved sharded (FSDP2), unsharded here (DDP, a plain module): gathered whole from every old rank.
    gather = sorted(n for n in saved_sharded if n in state and n in saved_state and n not in live_sharded)
    releasable: list[tuple[np.ndarray, int, int]] = []
    states = materialize_objects(
        section,
        where,
        {n: o for n, o in state.items() if n in saved_state and n not in live_sharded and n not in gather},
        releasable,
    )
    for name in gather:
        described = saved_sharded[name]
        owner = described.get("module")
        states[name] = _sharded.gather_whole(
            described.get("kind", ""),
            name,
            _every_rank(loaded, name, saved_world),
            state[name],
            state.get(owner) if isinstance(owner, str) else None,
        )
    for name, obj in state.items():
        if name in states:
            check_layout(name, obj, states[name])
    converted = set(gather)
    if sharded is not None:
        for name in sorted(live_sharded & set(saved_state)):
            if reshard and name in saved_sharded:
                saved = sharded.reshard(name, _every_rank(loaded, name, saved_world))
                converted.add(name)
            elif name in saved_sharded:
                # A module's shards are copied by load_state_dict: views; the optimizer keeps its own copies.
                saved = sharded.decode(
                    saved_state[name], section.entries, section.buf, copy=not isinstance(state[name], torch.nn.Module)
                )
                if sharded.wrapper_changed(name, saved_sharded[name]):
                    converted.add(name)
            else:  # saved unsharded (DDP): this rank's shard of each whole tensor
                whole = sharded.decode(saved_state[name], section.entries, section.buf, copy=True, whole=True)
                saved = sharded.from_whole(name, whole)
                converted.add(name)
            sharded.check(name, saved)
            states[name] = sharded.to_live(name, saved)
    # -- RNG --------------------------------------------------------------------------------------------
    rng = mine[RNG] if (same_world or rank < saved_world) else None
    if rng is not None:
        check_rng_state(rng, f"rank {rank if same_world else min(rank, saved_world - 1)}")
    # -- the data objects -----------------------------------------------------------------------------
    data_states: dict[str, Any] = {}
    fresh_data = check_names(data, mine[OBJECTS], "data", allow_missing, allow_unexpected)
    for name, obj in data.items():
        if name in fresh_data:
            continue
        if same_world:
            data_states[name] = mine[OBJECTS][name]
            dry_run(obj, "load_state_dict", data_states[name])
        else:
            olds = [trees[r][OBJECTS].get(name) for r in range(saved_world)]
            if any(s is None for s in olds):
                raise CorruptCheckpointError(f"data object {name!r} is missing from some old rank's section")
            if not hasattr(obj, "load_elastic_state"):
                raise ElasticResumeError(
                    f"data object {name!r} ({type(obj).__name__}) was saved by {saved_world} ranks and cannot be "
                    f"re-split over {world_size}: it has no load_elastic_state(states, rank, world_size). "
                    "Use a cf_ray.data source or resume with the same number of workers."
                )
            data_states[name] = olds
            dry_run(obj, "load_elastic_state", olds, rank, world_size)
    fps = _fingerprints(fp_tree, OBJECTS if replicated else STATE)
    prep = Prepared(
        saved_world=saved_world,
        replicated=replicated,
        step=int(mine[COUNTERS]["step"]),
        epoch=int(mine[COUNTERS]["epoch"]),
        state=states,
        data=data_states,
        rng=rng,
        fingerprints={
            # Resharded, gathered or split objects differ from what any one old rank held: checked by the
            # load (DCP's set_*_state_dict, load_state_dict), not by fingerprints.
            "state": {n: f for n, f in fps.items() if n in states and n not in converted},
            "data": {n: f for n, f in _fingerprints(mine, OBJECTS).items() if n in data_states} if same_world else {},
        },
        fresh=fresh_state + fresh_data,
        elastic=not same_world,
        sharded=sharded,
        state_fns=sharded.state_fns() if sharded is not None else {},
        releasable=releasable,
    )
    return prep


def apply(prep: Prepared, state: dict[str, Any], data: dict[str, Any], rank: int, world_size: int) -> dict:
    """Load a validated restore into the tracked objects. Returns this rank's data states by name."""
    sharded_names = prep.sharded.names if prep.sharded is not None else set()
    load_objects({n: o for n, o in state.items() if n not in sharded_names}, prep.state)
    if prep.sharded is not None:
        prep.sharded.load({n: s for n, s in prep.state.items() if n in sharded_names})
    if not prep.elastic:
        load_objects(data, prep.data)
        data_states = dict(prep.data)
    else:
        for name, olds in prep.data.items():
            data[name].load_elastic_state(olds, rank, world_size)
        data_states = {name: obj.state_dict() for name, obj in data.items()}
    if prep.rng is not None:
        set_rng_state(prep.rng)
    for buf, start, end in prep.releasable:
        _slots.release(buf, start, end)
    prep.releasable.clear()
    if prep.fresh:
        logger.warning(
            "cf_ray: rank %d: %s not in the checkpoint: kept as built (allow_mismatch={'missing'})",
            rank,
            ", ".join(repr(n) for n in prep.fresh),
        )
    return data_states


def verify(prep: Prepared, state: dict[str, Any], data: dict[str, Any]) -> list[str]:
    """Check every loaded object against its fingerprint; returns the names verified.

    Raises:
        RestoreError: an object whose state after ``load_state_dict`` differs from the checkpoint's
            (it was not restored, or only in part).
    """
    verified = []
    for kind, objs in (("state", state), ("data", data)):
        for name, expected in prep.fingerprints.get(kind, {}).items():
            fn = prep.state_fns.get(name) if kind == "state" else None
            got = _fp.object_fingerprint(fn() if fn is not None else objs[name].state_dict())
            if got != expected:
                raise RestoreError(
                    f"tracked object {name!r} ({type(objs[name]).__name__}) was not restored: its state after "
                    "load_state_dict() differs from the checkpoint's (keys, shapes or values). Check that its "
                    "load_state_dict() loads everything its state_dict() returns"
                )
            verified.append(name)
    return verified


# -- the checks ------------------------------------------------------------------------------------------


def check_names(objs: dict[str, Any], saved: Any, what: str, allow_missing: bool, allow_unexpected: bool) -> list[str]:
    """The tracked names the checkpoint lacks (allowed); raises for a mismatch that is not allowed."""
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(f"the checkpoint's {what} objects are not a mapping")
    missing = [n for n in objs if n not in saved]
    unexpected = sorted(n for n in saved if n not in objs)
    if missing and not allow_missing:
        raise CheckpointMismatchError(
            f"this script tracks {what} object(s) {missing} that the checkpoint does not hold (it holds "
            f"{sorted(saved)}): a new object, or a renamed one? Track the same names as the run that saved it, "
            "or pass CheckpointConfig(allow_mismatch={'missing'}) to start them fresh"
        )
    if unexpected and not allow_unexpected:
        raise CheckpointMismatchError(
            f"the checkpoint holds {what} object(s) {unexpected} that this script does not track (it tracks "
            f"{sorted(objs)}): an object removed or renamed? Track them, or pass "
            "CheckpointConfig(allow_mismatch={'unexpected'}) to ignore them"
        )
    if unexpected:
        logger.warning(
            "cf_ray: the checkpoint also has %s %s, which this Checkpointer does not track; ignored "
            "(allow_mismatch={'unexpected'})",
            what,
            unexpected,
        )
    return missing


def check_layout(name: str, obj: Any, saved: Any) -> None:
    """A saved state fits the tracked object: a module's keys, shapes and dtypes, an optimizer's groups."""
    if isinstance(obj, torch.nn.Module):
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(f"the saved state of module {name!r} is not a mapping")
        live = obj.state_dict()
        _sharded.check_module_keys(name, live, saved)
        for k, t in live.items():
            s = saved[k]
            if isinstance(t, torch.Tensor) and (
                not isinstance(s, torch.Tensor) or s.shape != t.shape or s.dtype != t.dtype
            ):
                got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise CheckpointMismatchError(
                    f"module {name!r}: {k} is {tuple(t.shape)} {t.dtype} in the model and "
                    f"{got} in the checkpoint: the model changed since it was saved"
                )
    elif isinstance(obj, torch.optim.Optimizer):
        groups, opt_state = _sharded.check_optimizer_groups(name, saved, obj.param_groups)
        ids = {p for g in groups for p in g["params"]}
        if not set(opt_state) <= ids:
            raise CorruptCheckpointError(f"optimizer {name!r}: state for parameters the groups do not list")


def _saved_sharded_names(loaded: dict[str, Section]) -> dict[str, dict]:
    """The objects the checkpoint saved sharded (FSDP2/DTensor), as its rank sections describe them
    (``{"model": {"kind": "module"}, "optimizer": {"kind": "optimizer", "module": "model"}}``)."""
    sec = next((sec for name, sec in sorted(loaded.items()) if name != SHARED), None)  # every rank's says it
    saved = sec.tree.get(_sharded.KEY) if sec is not None and isinstance(sec.tree, dict) else None
    return {k: v for k, v in saved.items() if isinstance(v, dict)} if isinstance(saved, dict) else {}


def _every_rank(loaded: dict[str, Section], name: str, saved_world: int) -> list[Any]:
    """The saved state of sharded object ``name`` in each old rank's section, decoded without a copy:
    its shards are views of the section buffers, which ``gather_whole`` and ``reshard`` assemble into
    new tensors."""
    per_rank = []
    for r in range(saved_world):
        sec = _section(loaded, rank_section(r))
        per_rank.append(_sharded.decode(_held(loaded, r, name), sec.entries, sec.buf, copy=False))
    return per_rank


def _held(loaded: dict[str, Section], r: int, name: str) -> Any:
    """The encoded state of tracked object ``name`` in old rank ``r``'s section."""
    held = _encoded_at(_section(loaded, rank_section(r)), (STATE,))
    if name not in held:
        raise CorruptCheckpointError(f"{name!r} is missing from section {rank_section(r)}")
    return held[name]


def dry_run(obj: Any, method: str, *args) -> None:
    """Run a data object's own checks of a state without changing it: its ``validate_state_dict`` /
    ``validate_elastic_state`` when it has one, else, for cf_ray's sources, ``load_*`` on a copy
    that does not move; objects cf_ray cannot copy safely are checked when they are loaded."""
    validator = getattr(obj, method.replace("load_", "validate_"), None)
    if callable(validator):
        validator(*args)
        return
    probe = _probe(obj)
    if probe is not None:
        getattr(probe, method)(*args)


def _probe(obj: Any) -> Any:
    if isinstance(obj, EpochCursor):
        probe = copy.copy(obj)
        probe._set_position = lambda *_a, **_k: None  # every check runs; nothing is set
        return probe
    if isinstance(obj, SamplerHeldPosition):
        return _probe(obj.sampler)
    return None


# -- reading the trees -------------------------------------------------------------------------------------


def _section(loaded: dict[str, Section], name: str) -> Section:
    sec = loaded.get(name)
    if sec is None:
        raise CorruptCheckpointError(f"the checkpoint has no section {name!r}")
    return sec


def _rank_tree(loaded: dict[str, Section], r: int, saved_world: int) -> dict:
    name = rank_section(r)
    try:
        sec = _section(loaded, name)
        if isinstance(sec.tree, dict) and isinstance(sec.tree.get(STATE), dict):
            # The tracked state stays encoded here (its names are what is looked at); it is decoded
            # object by object where it is loaded, so that a section read by range is read only there.
            # The rest (data states, RNG: small) is copied: the data objects keep what they are given
            # and may change it in place, which a view of a holder's slot, mapped read-only and
            # filled again later, would refuse or change under them.
            rest = {k: v for k, v in sec.tree.items() if k != STATE}
            tree = Section(rest, sec.entries, sec.buf).materialize(copy=True)
            tree[STATE] = sec.tree[STATE]
        else:
            tree = sec.materialize(copy=True)
        if not isinstance(tree, dict) or not isinstance(tree.get(OBJECTS), dict) or RNG not in tree:
            raise TypeError("expected objects, rng and counters")
        counters = tree[COUNTERS]
        step, epoch = counters["step"], counters["epoch"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, epoch)):
            raise TypeError(f"bad counters {counters!r}")
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"section {name} is malformed: {e}") from None
    # The rank and world size the section says it holds: a section that is not that rank's (its files
    # swapped) is refused here.
    if counters.get("rank", r) != r or counters.get("world_size", saved_world) != saved_world:
        raise CorruptCheckpointError(
            f"section {name} holds the state of rank {counters.get('rank')} of "
            f"{counters.get('world_size')}, not of rank {r} of {saved_world}"
        )
    return tree


def _encoded_at(section: Section, path: tuple[str, ...]) -> dict:
    tree = section.tree
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            raise CorruptCheckpointError(f"the checkpoint's section has no {'.'.join(path)!r}")
        tree = tree[p]
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(f"the checkpoint's {'.'.join(path)!r} is not a mapping")
    return tree


def _fingerprints(tree: Any, path: str) -> dict[str, str]:
    fps = tree.get(_fp.KEY) if isinstance(tree, dict) else None
    got = fps.get(path) if isinstance(fps, dict) else None
    return {k: v for k, v in got.items() if isinstance(v, str)} if isinstance(got, dict) else {}


def materialize_objects(section: Section, path: tuple[str, ...], objs: dict, releasable: list | None = None) -> dict:
    """The saved states of tracked objects, with as few copies as is safe.

    ``nn.Module.load_state_dict`` copies into the module's own parameters, so a module gets views
    straight into the snapshot's buffer (read-only when it is a mapped slot: restore from memory then
    costs a single copy). Everything else (optimizers keep the tensors they are given)
    gets private, writable copies, unless the buffer itself is private (``Section.private``: a
    section streamed from another node), whose views are kept as they are; then the ranges only
    modules read are appended to ``releasable`` (``(buffer, start, end)``), for :func:`apply` to give
    back once they are loaded.
    """
    tree = _encoded_at(section, path)
    out = {}
    read_by_modules: dict[int, tuple[int, int]] = {}  # entry index -> its bytes
    kept: set[int] = set()  # entries something other than a module keeps a view of
    for name, sub in tree.items():
        if name not in objs:
            continue
        # A private buffer (``Section.private``) is given away whole: no copy for anything; what
        # only modules read is ``releasable`` once loaded.
        module = isinstance(objs.get(name), torch.nn.Module)
        if section.private or module:

            def view(i: int, e: _codec.TensorEntry, module: bool = module) -> Any:
                if module:
                    read_by_modules[i] = (e.offset, e.offset + e.nbytes)
                else:
                    kept.add(i)
                return _codec.view(section.buf, e, copy=False, readonly_ok=True)

            out[name] = _codec.unflatten(sub, view, section.entries)
        else:
            out[name] = _codec.unflatten(sub, _Copier(section, sub), section.entries)
    if section.private and releasable is not None and isinstance(section.buf, np.ndarray):
        releasable.extend((section.buf, a, b) for i, (a, b) in read_by_modules.items() if i not in kept)
    return out


class _Copier:
    """The copies of one object's tensors, made into one private buffer whose pages are made present
    at once (``memory/slots.py``'s ``private_buffer``): a copy into fresh memory, page fault by page
    fault, costs a multiple of the copy itself."""

    _ALIGN = 64

    def __init__(self, section: Section, sub: Any):
        self.section = section
        sizes: list[int] = []
        if isinstance(section.buf, np.ndarray):  # not a section read by range: those reads copy already
            _codec.unflatten(sub, lambda _i, e: sizes.append(e.nbytes), section.entries)
        self.dest = _slots.private_buffer(sum(self._round(n) for n in sizes))
        self.pos = 0

    @classmethod
    def _round(cls, n: int) -> int:
        return -(-n // cls._ALIGN) * cls._ALIGN

    def __call__(self, _i: int, e: _codec.TensorEntry) -> Any:
        buf = self.section.buf
        if (
            e.nbytes == 0
            or not isinstance(buf, np.ndarray)
            or e.offset + e.nbytes > buf.nbytes  # view() raises the error
            or self.pos + e.nbytes > self.dest.nbytes
        ):
            return _codec.view(buf, e, copy=True)
        at = self.pos
        self.dest[at : at + e.nbytes] = buf[e.offset : e.offset + e.nbytes]
        self.pos += self._round(e.nbytes)
        return _codec.view(self.dest, dataclasses.replace(e, offset=at), copy=False)


def load_objects(objs: dict, states: dict) -> None:
    """``load_state_dict`` of every object that has a state in ``states``."""
    for name, obj in objs.items():
        if name not in states:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj.load_state_dict(states[name])


__all__ = [
    "Prepared",
    "apply",
    "check_layout",
    "check_names",
    "dry_run",
    "load_objects",
    "materialize_objects",
    "validate",
    "verify",
]
