"""The run's shared vocabulary, under the worker, node and driver rooms alike (no torch).

* :mod:`.messages`: the typed, versioned messages between worker, holder and controller, and the Enums.
* :mod:`.naming`: the run key and the actors' names.
* :mod:`.spares`: a node's spare worker processes as files (the claims a rank makes, the holder ends).
* :mod:`.actors`: getting a live handle of a named cf_ray actor.
* :mod:`.cluster`: every query of the Ray cluster (alive and draining nodes, the head node) and who a
  run's actors belong to (owner, liveness of a job, an actor, a ``fit()``).

Nothing here imports from ``worker``, ``node`` or ``driver``: they stand side by side on this room.
"""
