"""Exceptions of cf_ray. Every one derives from :class:`CfRayError` and pickles cleanly, so it can
cross a Ray actor boundary unchanged."""

from __future__ import annotations


class CfRayError(Exception):
    """Base class of every cf_ray exception."""

    def __reduce__(self):  # keep the message when pickled across processes
        return (type(self), self.args)


class ConfigError(CfRayError, ValueError):
    """A configuration value is invalid; the message names the field and what to do instead."""


class CheckpointNotFoundError(CfRayError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CorruptCheckpointError(CfRayError):
    """A checkpoint file does not match its manifest (size or checksum) or cannot be parsed."""


class UnsafePathError(CfRayError, ValueError):
    """A path in a manifest or a request would leave the run's root (``..``, absolute, a link)."""


class PersistError(CfRayError):
    """Writing a checkpoint to storage failed. Training goes on; the previous checkpoint stays."""


class ElasticResumeError(CfRayError):
    """The saved state cannot be re-split over the new number of workers."""


class DurabilityLostError(CfRayError):
    """Nothing has committed for much longer than the checkpoint schedule implies (or the controller
    cannot be reached), and ``CheckpointConfig(on_durability_lost="raise")`` asks to fail the attempt.
    The message says since when, why as far as this rank knows, and what to change."""


class RestoreError(CfRayError):
    """Restoring failed on some rank; every rank raises it, naming the rank and the cause."""


class CheckpointMismatchError(ConfigError):
    """The script and the checkpoint track different objects: the script tracks one that the
    checkpoint does not hold, or the checkpoint holds one that the script no longer tracks, or an
    object's saved layout (keys, shapes) does not fit the tracked one. The message names it and the
    opt-out (``CheckpointConfig(allow_mismatch={"missing"})`` / ``{"unexpected"}``)."""
