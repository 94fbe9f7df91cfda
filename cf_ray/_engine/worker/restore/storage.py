"""Reading a restore candidate from storage: transient errors tried again, every file verified
before it is parsed (``format/sections.py``'s ``read_verified``: size and CRC-32, and on a mismatch the blocks that
differ), and the checkpoint of another run that a new run starts from (``resume_from``, or the one
Ray Train hands it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import ray.train

from cf_ray._engine.format import sections
from cf_ray._engine.format.catalog import resumable_checkpoint
from cf_ray._engine.format.commit import Manifest
from cf_ray._engine.format.sections import Section
from cf_ray._engine.storage.base import Storage
from cf_ray.errors import CfRayError, ConfigError

logger = logging.getLogger("cf_ray")

#: Tries of one read on a transient error (an ``OSError`` that is not "not found"), with backoff.
READ_TRIES = 3
#: Seconds before the second try (doubled for the next).
READ_BACKOFF_S = 0.2


def describe(e: BaseException) -> str:
    """``Type: message``, as restores report errors."""
    return f"{type(e).__name__}: {e}"


def read(fn, *args):
    """``fn(*args)``, tried again (``READ_TRIES`` in all, with backoff) on a transient I/O error."""
    delay = READ_BACKOFF_S
    for attempt in range(READ_TRIES):
        try:
            return fn(*args)
        except (CfRayError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
            raise  # not transient
        except OSError as e:
            if attempt == READ_TRIES - 1:
                raise
            logger.warning("cf_ray: reading a checkpoint failed (%s); trying again in %.1f s", describe(e), delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


def load_section(storage: Storage, directory: str, manifest: Manifest, section: str, ranged: bool) -> Section:
    """One section of a committed checkpoint (``ranged``: read by block, as it is used)."""
    if ranged:
        return sections.load_section(storage, directory, manifest, section, ranged=True)
    return sections.load_section(storage, directory, manifest, section)


def source_name(source: Any) -> str:
    """A resume source as a user wrote it: a path, or a ``ray.train.Checkpoint``'s path."""
    return str(getattr(source, "path", source))


def other_run_checkpoint(resume_from: Any, ray_storage: Any) -> tuple[Storage, str] | None:
    """``CheckpointConfig.resume_from``, else the checkpoint Ray Train hands this run (when the run's
    checkpoints live in Ray Train's storage, ``ray_storage``), if any. A final model is followed to
    the full checkpoint its manifest names.

    Raises:
        ConfigError: ``resume_from`` holds no cf_ray checkpoint to resume from (naming it).
    """
    source = resume_from
    if source is not None:
        try:
            return resumable_checkpoint(source)
        except Exception as e:  # noqa: BLE001 - whatever it is, the user's setting is wrong
            raise ConfigError(
                f"CheckpointConfig.resume_from={source_name(source)!r} holds no cf_ray checkpoint to "
                f"resume from ({describe(e)}); pass a run directory, a checkpoint directory or a "
                "ray.train.Checkpoint of a cf_ray run (e.g. result.checkpoint)"
            ) from None
    if ray_storage is None:
        return None
    try:
        source = ray.train.get_checkpoint()
    except Exception:  # noqa: BLE001
        source = None
    if source is None:
        return None
    try:
        return resumable_checkpoint(source)
    except Exception as e:  # noqa: BLE001 - not a cf_ray checkpoint: Ray Train's own, for instance
        logger.warning("cf_ray: %s is not a committed cf_ray checkpoint (%s); starting fresh", source_name(source), e)
        return None


__all__ = ["READ_BACKOFF_S", "READ_TRIES", "describe", "load_section", "other_run_checkpoint", "read", "source_name"]
