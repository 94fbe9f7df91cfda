"""The facts about the Ray cluster the controller's decisions depend on — which nodes are alive (a
memory restore never counts a copy on a lost node; a step lost with its node is reported), and
which are draining (a just-in-time checkpoint's sections there need a copy elsewhere) — behind one
small interface, so that the decisions run in process with facts a test sets.

Inside the actor the facts are Ray's (:mod:`cf_ray._engine.protocol.cluster`: GCS calls, asked
before the controller's lock is taken); in process there are none (every node counts as alive,
none as draining) unless a test passes its own :class:`ClusterView`.
"""

from __future__ import annotations

from typing import Protocol

from cf_ray._engine.driver.recovery import in_ray_actor
from cf_ray._engine.protocol import cluster


class ClusterView(Protocol):
    """What the controller asks of the cluster."""

    def alive_node_ids(self) -> set[str] | None:
        """The ids of the alive nodes; ``None`` when it cannot say (every node then counts as alive)."""
        ...

    def draining_nodes(self) -> set[str]:
        """The nodes being drained; empty when none is, or when it cannot say."""
        ...


class RayCluster:
    """The facts as Ray's GCS has them."""

    def alive_node_ids(self) -> set[str] | None:
        return cluster.alive_node_ids()

    def draining_nodes(self) -> set[str]:
        try:
            return set(cluster.draining_nodes())
        except Exception:  # noqa: BLE001 - cannot say: then any node may be the one to go
            return set()


class NoCluster:
    """No facts (in process): every node alive, none draining."""

    def alive_node_ids(self) -> set[str] | None:
        return None

    def draining_nodes(self) -> set[str]:
        return set()


def default_cluster() -> ClusterView:
    """Ray's facts inside a Ray actor, none in process."""
    return RayCluster() if in_ray_actor() else NoCluster()


__all__ = ["ClusterView", "NoCluster", "RayCluster", "default_cluster"]
