"""What lets the controller die and come back without losing durability (issue #16).

* :class:`HolderLink`: the controller's calls to the run's holders, found by name on every alive
  node (``naming.holder_name``): ``resync`` (what a holder holds and has done lately, when the
  controller starts or first hears of a holder), ``lookup`` (the controller's watch: what became
  of sections pending too long), ``owner`` (which run it belongs to, :mod:`cf_ray._engine.protocol.cluster`), ``forget`` (steps that settled: the holder stops keeping their
  record), ``drain`` and kill (the controller's shutdown).
* :class:`ControlState`: the controller's own small state on storage, ``control_state.json`` — the
  newest generation handed out and the step each recent attempt restored — so that a controller
  that starts again never hands out a generation twice and never commits a step of a timeline that
  a later attempt replays.

No torch here; Ray only in :class:`HolderLink`.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import ray
import ray.exceptions

from cf_ray._engine.protocol import cluster
from cf_ray._engine.protocol.cluster import Owner
from cf_ray._engine.protocol.messages import HolderState
from cf_ray._engine.protocol.naming import holder_name
from cf_ray._engine.storage.fs import Storage

logger = logging.getLogger("cf_ray")

CONTROL_STATE = "control_state.json"
"""Where the controller's generation and recent restores are saved, relative to the run's storage."""

#: Ray errors that mean "that actor is gone, or not reachable now".
# ActorUnschedulableError: a holder pinned to a node that was removed (Ray would restart it, but its
# node is gone): as gone as a dead one; without it the watch failed on every pass and the lost node's
# sections stayed pending.
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

    def drain_all(self, names: list[str], timeout_s: float) -> dict[str, dict | None]:
        """Ask every holder to finish what it is writing and sending, in parallel; wait at most
        ``timeout_s`` (plus a margin). Returns name -> the holder's answer (``None``: gone or no answer)."""
        refs = {}
        for name in names:
            h = self._handle(name, fresh=True)
            if h is not None:
                try:
                    refs[name] = h.drain.remote(timeout_s)
                except Exception:  # noqa: BLE001
                    continue
        out: dict[str, dict | None] = {}
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=timeout_s + 30)
            except Exception as e:  # noqa: BLE001 - a holder that cannot answer is killed anyway
                logger.warning("cf_ray: holder %s did not answer the drain: %r", name, e)
                out[name] = None
        return out

    def kill(self, name: str) -> None:
        h = self._handle(name, fresh=True)
        if h is not None:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


class ControlState:
    """``control_state.json``: the newest generation and the recent restores (generation -> the
    step it restored). Written after the controller's lock is released; writes are ordered (an
    older state never overwrites a newer one).

    Args:
        storage: the run's storage.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self._lock = threading.Lock()
        self._written = -1

    def load(self) -> tuple[int, dict[int, int]]:
        """``(generation, restores)``; ``(0, {})`` when there is none or it is unreadable."""
        try:
            if not self.storage.exists(CONTROL_STATE):
                return 0, {}
            d = json.loads(bytes(self.storage.read_file(CONTROL_STATE)))
            return int(d.get("generation", 0)), {int(g): int(s) for g, s in (d.get("restores") or {}).items()}
        except Exception as e:  # noqa: BLE001 - a damaged file: start from the manifests and the holders
            logger.warning("cf_ray: ignoring %s: %s", self.storage.uri(CONTROL_STATE), e)
            return 0, {}

    def write(self, seq: int, generation: int, restores: dict[int, int]) -> None:
        """Write state number ``seq`` (taken under the controller's lock) unless a newer one was
        written. Never raises."""
        body = json.dumps({"generation": generation, "restores": {str(g): s for g, s in restores.items()}})
        with self._lock:
            if seq <= self._written:
                return
            try:
                self.storage.write_file(CONTROL_STATE, [body.encode()])
                self._written = seq
            except Exception as e:  # noqa: BLE001
                logger.warning(
                    "cf_ray: could not save the controller's state to %s: %s", self.storage.uri(CONTROL_STATE), e
                )


__all__ = ["CONTROL_STATE", "ControlState", "HolderBusy", "HolderLink", "in_ray_actor", "was_reconstructed"]
