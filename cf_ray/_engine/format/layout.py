"""Names and paths of the on-storage layout of a run's checkpoints (no I/O here).

Layout under a run's root (``<storage_path>/<run name>/cf_ray`` by default)::

    checkpoints/step_000000000120/MANIFEST.json          <- written last: the commit
    checkpoints/step_000000000120/g0001.shared.bin       <- replicated state (written once, rank 0)
    checkpoints/step_000000000120/g0001.shared.json      <- its tensor table + JSON tree
    checkpoints/step_000000000120/g0001.rank_00001.bin   <- per-rank state (RNG, data position)
    checkpoints/final_000000000400/model.safetensors     <- the consolidated model at the end
    latest                                               <- name of the newest committed dir (a hint)
    registered/step_000000000120/cf_ray_checkpoint.json  <- a pointer registered with Ray Train
    profile.parquet, iterations.parquet                  <- the profile table

File names carry the *generation* (one per start of the worker group) so that a straggling writer
of an earlier generation can never overwrite a file that a newer manifest refers to. The manifest
and how it is read are in :mod:`cf_ray._engine.format.commit`.
"""

from __future__ import annotations

import re

FORMAT = "cf_ray"
#: The manifest's format version. Version 2 carries a checksum of its own content (``checksum``) and
#: is written as compact JSON; version 1 (no self-checksum) is read too, its files verified by size
#: and CRC-32 like any other's.
VERSION = 2
MANIFEST = "MANIFEST.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
REGISTERED = "registered"
POINTER = "cf_ray_checkpoint.json"
SHARED = "shared"
#: The keys of a section's state tree, as snapshots write them and restores read them: the
#: replicated tracked objects (``shared``) or a rank's data objects (``rank_NNNNN``) by name ...
OBJECTS = "objects"
#: ... a rank's own tracked state (``replicated=False``, sharded state) by name ...
STATE = "state"
#: ... its RNG states ...
RNG = "rng"
#: ... and its counters (``step``, ``epoch``, ``rank``, ``world_size``).
COUNTERS = "counters"
#: The final model's one section and file (``final_<step>/``): what ``write_final_model`` writes.
FINAL_SECTION = "model"
FINAL_MODEL_FILE = "model.safetensors"
#: Key in a final model's manifest ``extra``: the run's full checkpoint (``checkpoints/step_<n>``)
#: at the end of training, which ``resume_from=result.checkpoint`` follows.
RESUME_KEY = "resume"
#: Every ``kind`` a manifest may carry: the values of ``messages.CheckpointKind`` (the format does
#: not import the driver's messages; tests/test_manifest.py checks that the two agree).
KINDS = ("scheduled", "epoch", "manual", "preempt", "final")
#: Per-rank sections are ``rank_00000`` .. ``rank_99999``.
MAX_WORLD_SIZE = 100_000

#: A checkpoint directory's name: its kind (``step`` or ``final``) and its step, twelve digits.
DIR_RE = re.compile(r"^(step|final)_(\d{12})$")
#: A file name a manifest may list: plain, never a path (no ``/``, no leading dot).
FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")
#: A section's name: ``shared`` or ``rank_<5 digits>``.
SECTION_RE = re.compile(r"^(shared|rank_\d{5})$")


def rank_section(rank: int) -> str:
    return f"rank_{rank:05d}"


def section_rank(section: str) -> int:
    """The rank a section belongs to (the inverse of :func:`rank_section`; the shared one is rank 0's)."""
    return int(section.split("_")[1]) if section.startswith("rank_") else 0


def step_dir(step: int, kind: str = "step") -> str:
    return f"{CHECKPOINTS}/{kind}_{step:012d}"


def pointer_dir(step: int) -> str:
    """The directory registered with Ray Train for ``checkpoints/step_<step>``: it holds only a
    pointer (:data:`POINTER`) to that checkpoint; cf_ray never deletes it (Ray Train may)."""
    return f"{REGISTERED}/step_{step:012d}"


def parse_step_dir(directory: str) -> int | None:
    """The step of ``checkpoints/step_NNNNNNNNNNNN`` (the inverse of :func:`step_dir`), else ``None``."""
    m = DIR_RE.match(directory.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(2)) if m and m.group(1) == "step" else None


def section_files(generation: int, section: str) -> tuple[str, str]:
    """(data file, index file) names of one section."""
    return f"g{generation:04d}.{section}.bin", f"g{generation:04d}.{section}.json"
