"""How a run's actors are named: one controller per run, one holder per (run, node).

Every worker derives the same names from the run's storage location and name, so the first worker
of a run creates the actors and the others (and workers restarted by Ray Train) find them.
No torch and no Ray here.
"""

from __future__ import annotations

import hashlib


def run_key(storage_uri: str, run_name: str) -> str:
    """A short stable key for a run (actor names may not contain every character of a URI)."""
    digest = hashlib.sha1(f"{storage_uri}|{run_name}".encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_name)[:40]
    return f"{safe}-{digest}"


def controller_name(key: str) -> str:
    """The name of a run's controller actor (``key``: :func:`run_key`)."""
    return f"cf_ray.controller.{key}"


def holder_name(key: str, node_id: str) -> str:
    """The name of a run's holder actor on one node (``key``: :func:`run_key`)."""
    return f"cf_ray.holder.{key}.{node_id}"


__all__ = ["controller_name", "holder_name", "run_key"]
