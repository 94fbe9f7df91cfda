"""What lets the controller die and come back without losing durability.

* :class:`HolderLink`: the controller's calls to the run's holders, found by name on every alive
  node (``naming.holder_name``): ``resync`` (what a holder holds and has done lately, when the
  controller starts or first hears of a holder), ``lookup`` (the controller's watch, :mod:`.watch`:
  what became of sections pending too long), ``owner`` (which run it belongs to,
  :mod:`cf_ray._engine.protocol.cluster`), ``forget`` (steps that settled: the holder stops keeping
  their record), ``drain`` and kill (the controller's shutdown).
* :class:`Roster`: the holders this controller knows of, and the resync — at start it asks the
  run's holder on every alive node what it holds and has done lately (the controller's restore plans
  wait for that, ``env.RESYNC_TIMEOUT_S``), and it asks a holder first heard of later, once, in the
  background; a holder left by a run whose driver is gone is drained and killed instead. It tells
  holders which of their steps settled. One lock of its own (the set of names), never held while it
  calls a holder.
* :class:`ControlState`: the controller's own small state on storage, ``control_state.json`` — the
  newest generation handed out, the step each recent attempt restored, the in-memory snapshots
  never to offer again (:mod:`.checkpoints.quarantine`) and the newest checkpoints that did not
  commit (the failures the ranks report, :mod:`cf_ray._engine.observe.events`) — so that a
  controller that starts again never hands out a generation twice, never commits a step of a
  timeline that a later attempt replays, and never restores a snapshot that failed verification,
  nor forgets a step lost before it started.

No torch here; Ray only in :class:`HolderLink`.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from cf_ray._engine import env as _env
from cf_ray._engine.protocol import cluster
from cf_ray._engine.protocol.cluster import Owner, owner_gone
from cf_ray._engine.protocol.messages import Failure, HolderState, SectionState
from cf_ray._engine.protocol.naming import holder_name
from cf_ray._engine.storage.base import Storage

logger = logging.getLogger("cf_ray")

CONTROL_STATE = "control_state.json"
"""Where the controller's generation and recent restores are saved, relative to the run's storage."""

#: Ray errors that mean "that actor is gone, or not reachable now".
# ActorUnschedulableError: a holder pinned to a node that was removed (Ray would restart it, but its
# node is gone): as gone as a dead one; without it the watch would fail on every pass and the lost
# node's sections would stay pending.
_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError, ValueError)


class HolderBusy(Exception):
    """A holder did not answer in time (alive, but busy): ask again later."""


def in_ray_actor() -> bool:
    """Whether this code runs inside a Ray actor (the controller's actor, not an in-process test)."""
    try:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001
        return False


def was_reconstructed() -> bool:
    """Whether Ray restarted this actor after it died (its constructor runs again)."""
    import warnings

    try:
        with warnings.catch_warnings():  # Ray 2.60's property reads its own deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(in_ray_actor() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001
        return False


class HolderLink:
    """The controller's calls to the holders of one run.

    Args:
        key: the run key (the holders' names derive from it).
        namespace: the namespace of cf_ray's actors.
    """

    def __init__(self, key: str, namespace: str):
        self.key = key
        self.namespace = namespace
        self._handles: dict[str, Any] = {}  # name -> handle (a look-up by name is a GCS round trip)
        self._lock = threading.Lock()

    def names_on_alive_nodes(self) -> list[str]:
        """The name this run's holder has (or would have) on every alive node."""
        try:
            return [holder_name(self.key, n["NodeID"]) for n in cluster.alive_nodes()]
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: cannot list the cluster's nodes: %s", e)
            return []

    def _handle(self, name: str, *, fresh: bool = False):
        with self._lock:
            h = None if fresh else self._handles.get(name)
        if h is None:
            try:
                h = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return None
            with self._lock:
                self._handles[name] = h
        return h

    def _drop(self, name: str) -> None:
        with self._lock:
            self._handles.pop(name, None)

    def _call(self, name: str, method: str, *args, timeout_s: float) -> Any:
        """``None`` when the holder does not exist or died; :class:`HolderBusy` on a timeout. A
        cached handle that fails is looked up again once (a holder made again under the same name)."""
        for fresh in (False, True):
            h = self._handle(name, fresh=fresh)
            if h is None:
                return None
            try:
                return ray.get(getattr(h, method).remote(*args), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise HolderBusy(name) from None
            except _GONE:
                self._drop(name)
        return None

    def owner(self, name: str, timeout_s: float) -> Owner | None:
        """The run holder ``name`` belongs to (``None``: gone, busy, or made before owners were recorded)."""
        try:
            return self._call(name, "owner", timeout_s=timeout_s)
        except (HolderBusy, AttributeError):
            return None

    def exists(self, name: str) -> bool:
        return self._handle(name, fresh=True) is not None

    def resync(self, name: str, timeout_s: float) -> HolderState | None:
        return self._call(name, "resync", timeout_s=timeout_s)

    def lookup(self, name: str, keys: list[tuple[int, int, str]], timeout_s: float) -> list | None:
        return self._call(name, "lookup", keys, timeout_s=timeout_s)

    def forget(self, name: str, keys: list[tuple[int, int]], committed: tuple[int, int] | None = None) -> None:
        """Fire-and-forget: a lost one only leaves the holder a record it drops later anyway."""
        h = self._handle(name)
        if h is not None:
            try:
                h.forget.remote(keys, committed)
            except Exception:  # noqa: BLE001
                pass

    def _ask_all(self, names: list[str], method: str, timeout_s: float, *, fresh: bool) -> dict[str, Any]:
        """Call ``method(timeout_s)`` on every holder in ``names`` at once; name -> its object ref
        (a holder that does not exist or cannot be asked is left out)."""
        refs = {}
        for name in names:
            h = self._handle(name, fresh=fresh)
            if h is not None:
                try:
                    refs[name] = getattr(h, method).remote(timeout_s)
                except Exception:  # noqa: BLE001 - a holder that cannot be asked is gone
                    continue
        return refs

    def drain_all(self, names: list[str], timeout_s: float) -> dict[str, dict | None]:
        """Ask every holder to finish what it is writing and sending, in parallel; wait at most
        ``timeout_s`` (plus a margin). Returns name -> the holder's answer (``None``: gone or no answer)."""
        out: dict[str, dict | None] = {}
        for name, ref in self._ask_all(names, "drain", timeout_s, fresh=True).items():
            try:
                out[name] = ray.get(ref, timeout=timeout_s + 30)
            except Exception as e:  # noqa: BLE001 - a holder that cannot answer is killed anyway
                logger.warning("cf_ray: holder %s did not answer the drain: %r", name, e)
                out[name] = None
        return out

    def flush_all(self, names: list[str], timeout_s: float) -> list[str]:
        """Have every holder deliver its queued messages to this controller, in parallel, for at most
        ``timeout_s``. Returns the names of those that could not in time (gone ones are not named)."""
        late = []
        for name, ref in self._ask_all(names, "flush", timeout_s, fresh=False).items():
            try:
                if not ray.get(ref, timeout=timeout_s + 5):
                    late.append(name)
            except _GONE:
                self._drop(name)
            except Exception:  # noqa: BLE001 - busy or timed out: named, the plan goes on
                late.append(name)
        return late

    def kill(self, name: str) -> None:
        h = self._handle(name, fresh=True)
        if h is not None:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


class Roster:
    """The holders of one run this controller knows of, and what they hold.

    Args:
        key: the run key (for logs).
        link: how to reach the holders (``None``: in process, no holders to ask).
        apply: applies a holder's :class:`HolderState` to the controller's bookkeeping.
        owner: the run this controller belongs to (a holder of another, dead run is retired).
    """

    def __init__(
        self,
        key: str,
        link: HolderLink | None,
        *,
        apply: Callable[[HolderState], None],
        owner: Callable[[], Owner | None],
        restarted: bool = False,
    ):
        self.key = key
        self.link = link
        self._apply = apply
        self._owner = owner
        self._restarted = restarted  # Ray started this controller again after its process died
        self._lock = threading.Lock()
        self._names: set[str] = set()
        self._resyncing: set[str] = set()
        self.resynced = threading.Event()
        """Set once the holders alive at the start were asked what they hold."""

    def start(self) -> None:
        """Ask the holders alive now what they hold, in the background (at once done in process)."""
        if self.link is None:
            self.resynced.set()
            return
        threading.Thread(target=self._rebuild, name="cf_ray-resync", daemon=True).start()

    def note(self, name: str) -> bool:
        """Remember a holder; True when it is new to this controller."""
        with self._lock:
            if not name or name in self._names:
                return False
            self._names.add(name)
            return True

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._names)

    def drop(self, names: set[str]) -> None:
        """These holders are gone."""
        with self._lock:
            self._names -= names

    def flush(self, timeout_s: float) -> None:
        """Have the holders deliver what they queued for this controller (a restore plan then knows
        every snapshot whose hand-off returned); a holder that cannot in time is logged, not waited for."""
        if self.link is None:
            return
        late = self.link.flush_all(self.names(), timeout_s)
        if late:
            logger.warning(
                "cf_ray: holder(s) %s did not deliver their queued messages within %.0f s; the restore plan "
                "may not offer their newest snapshots",
                ", ".join(late),
                timeout_s,
            )

    def resync_if_new(self, name: str, new: bool) -> None:
        """A holder first heard of after this controller started: ask it what it holds (once, in
        the background: never from an RPC thread that holds the controller's lock)."""
        if not new or self.link is None or not self.resynced.is_set():
            return  # the start-up resync asks every holder anyway
        with self._lock:
            if name in self._resyncing:
                return
            self._resyncing.add(name)
        threading.Thread(target=self.resync_one, args=(name,), name="cf_ray-resync", daemon=True).start()

    def resync_one(self, name: str) -> bool:
        """Ask holder ``name`` what it holds and did; True when it said anything of this run (a
        section staged, an outcome, a copy)."""
        link = self.link
        if link is None:
            return False
        try:
            state = link.resync(name, timeout_s=_env.get_float(_env.ACTOR_TIMEOUT_S))
            if state is not None:
                self._apply(state)
            return state is not None and bool(state.staged or state.outcomes or state.replicas)
        except HolderBusy:
            logger.warning("cf_ray: holder %s did not answer a resync in time", name)
            return False
        except Exception:  # noqa: BLE001
            logger.exception("cf_ray: resync of holder %s failed", name)
            return False
        finally:
            with self._lock:
                self._resyncing.discard(name)

    def _rebuild(self) -> None:
        """At start: ask the run's holder on every alive node what it holds and has done lately."""
        link = self.link
        try:
            names = link.names_on_alive_nodes() if link is not None else []
            found = [n for n in names if link is not None and link.exists(n) and self._of_this_run(n)]
            knew = [name for name in found if self.resync_one(name)]
            if knew or self._restarted:
                # Ray says it started this actor again, or a holder has handled snapshots of this run
                # already (a fresh run's holders, made by its workers as it starts, hold nothing
                # yet): the previous controller's process died. Said once, holders or not: a
                # controller killed mid-commit whose holders hold nothing by the time it comes back
                # died all the same.
                logger.warning(
                    "cf_ray: the controller of %s started again (the previous one's process died): "
                    "re-learnt the state of %d holder(s) and the committed checkpoints on storage; a "
                    "commit in flight when it died is made again from the holders",
                    self.key,
                    len(knew),
                )
        except Exception:  # noqa: BLE001
            logger.exception("cf_ray: could not resync the holders")
        finally:
            self.resynced.set()

    def _of_this_run(self, name: str) -> bool:
        """Whether holder ``name`` belongs to this run. One left by a run whose driver is gone is
        drained and killed: its snapshots are that run's, never this one's (storage is the truth)."""
        mine = self._owner()
        if self.link is None or mine is None:
            return True
        theirs = self.link.owner(name, timeout_s=_env.get_float(_env.ACTOR_TIMEOUT_S))
        if mine.same_run(theirs):
            return True
        if owner_gone(theirs) is not None:
            logger.warning(
                "cf_ray: holder %s belongs to a run whose driver is gone (job %s); draining and "
                "killing it, its snapshots are not used",
                name,
                theirs.job_id if theirs else "?",
            )
            self.link.drain_all([name], _env.get_float(_env.DRAIN_TIMEOUT_S))
            self.link.kill(name)
        return False

    def tell(self, settled: list[tuple[int, int, SectionState, tuple[str, ...]]]) -> None:
        """The steps that settled: their holders drop their record (fire-and-forget). When one
        committed, every holder of the run hears of it too: the peers' copies older than it can no
        longer be restored (storage has newer), those of a lost node's holder included."""
        if self.link is None or not settled:
            return
        by_holder: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        for gen, step, _state, holders in settled:
            for h in holders:
                by_holder[h].append((gen, step))
        committed = max(((g, s) for g, s, state, _ in settled if state == SectionState.COMMITTED), default=None)
        if committed is not None:
            for h in self.names():
                by_holder.setdefault(h, [])
        for h, keys in by_holder.items():
            self.link.forget(h, keys, committed)

    def drain(self, timeout_s: float) -> list[str]:
        """The end of the run: ask every holder (known, or on an alive node) to finish what it is
        writing, in parallel, at most ``timeout_s`` (logged when one does not). Returns their names."""
        link = self.link
        if link is None:
            return []
        known = set(self.names())
        names = sorted(known | {n for n in link.names_on_alive_nodes() if n not in known and link.exists(n)})
        for name, answer in link.drain_all(names, timeout_s).items():
            if answer is not None and not answer.get("drained"):
                logger.warning(
                    "cf_ray: holder %s had not finished within %s=%.0f s when the run ended "
                    "(writing %s, waiting %s, %s messages unsent); what it did not write is lost, "
                    "the committed checkpoints stand",
                    name,
                    _env.DRAIN_TIMEOUT_S,
                    timeout_s,
                    answer.get("writing"),
                    answer.get("waiting"),
                    answer.get("unsent"),
                )
        return names

    def kill(self, names: list[str]) -> None:
        for name in names:
            if self.link is not None:
                self.link.kill(name)


class ControlState:
    """``control_state.json``: the newest generation, the recent restores (generation -> the step it
    restored), the distrusted in-memory snapshots (``[generation, step]``) and the newest failures
    (:meth:`cf_ray._engine.observe.events.EventLog.saved_failures`). Written after the
    controller's lock is released; writes are ordered (an older state never overwrites a newer one).

    Args:
        storage: the run's storage.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self._lock = threading.Lock()
        self._written = -1
        self._failing = False  # the last write failed (said once until one works)

    def load(self) -> tuple[int, dict[int, int], list[tuple[int, int]], list[Failure]]:
        """``(generation, restores, distrusted, failures)``; ``(0, {}, [], [])`` when there is none or
        it is unreadable (a file written before failures were saved has none)."""
        try:
            if not self.storage.exists(CONTROL_STATE):
                return 0, {}, [], []
            d = json.loads(bytes(self.storage.read_file(CONTROL_STATE)))
            restores = {int(g): int(s) for g, s in (d.get("restores") or {}).items()}
            distrusted = [(int(g), int(s)) for g, s in (d.get("distrusted") or [])]
            failures = [
                Failure(
                    seq=int(f["seq"]),
                    step=int(f["step"]),
                    section=str(f["section"]),
                    rank=int(f["rank"]),
                    error=str(f["error"]),
                    generation=int(f["generation"]),
                )
                for f in (d.get("failures") or [])
            ]
            return int(d.get("generation", 0)), restores, distrusted, failures
        except Exception as e:  # noqa: BLE001 - a damaged file: start from the manifests and the holders
            logger.warning("cf_ray: ignoring %s: %s", self.storage.uri(CONTROL_STATE), e)
            return 0, {}, [], []

    def write(
        self,
        seq: int,
        generation: int,
        restores: dict[int, int],
        distrusted: list[tuple[int, int]] | None = None,
        failures: list[dict] | None = None,
    ) -> None:
        """Write state number ``seq`` (taken under the controller's lock) unless a newer one was
        written. Never raises."""
        body = json.dumps(
            {
                "generation": generation,
                "restores": {str(g): s for g, s in restores.items()},
                "distrusted": [list(k) for k in distrusted or []],
                "failures": failures or [],
            }
        )
        with self._lock:
            if seq <= self._written:
                return
            try:
                self.storage.write_file(CONTROL_STATE, [body.encode()])
                self._written = seq
                if self._failing:
                    logger.warning(
                        "cf_ray: the controller's state is saved again (%s)", self.storage.uri(CONTROL_STATE)
                    )
                self._failing = False
            except Exception as e:  # noqa: BLE001
                if not self._failing:  # once per outage: a failure of storage fails many writes
                    logger.warning(
                        "cf_ray: could not save the controller's state to %s: %s", self.storage.uri(CONTROL_STATE), e
                    )
                self._failing = True


__all__ = [
    "CONTROL_STATE",
    "ControlState",
    "HolderBusy",
    "HolderLink",
    "Roster",
    "in_ray_actor",
    "was_reconstructed",
]
