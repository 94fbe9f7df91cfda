"""What one rank heard from the controller in its replies, and what it reports of it: failed
checkpoints (this attempt's, and an earlier attempt's that never committed), each reported once by
``wait()``/``finish()``, and checkpoint requests from outside the workers
(``cf_ray.preemption.notify_preemption``), each handed on once. The sequence numbers seen go back
with the next poll, so the controller sends each only once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from cf_ray._engine.format import manifest as mf
from cf_ray._engine.protocol.messages import CheckpointRequest, SyncReply
from cf_ray.errors import PersistError

logger = logging.getLogger("cf_ray")


def failed_steps(failures: list[dict]) -> set[int]:
    """The steps of this attempt's failures (an earlier attempt's step of the same number is another checkpoint)."""
    return {f["step"] for f in failures if not f.get("earlier_attempt")}


class ControllerNews:
    """Failures and requests this rank heard of, and which failures it reported.

    Args:
        rank: this rank.
        on_request: called with each checkpoint request from the driver, on the training thread.
    """

    def __init__(self, rank: int, on_request: Callable[[CheckpointRequest], None]):
        self.rank = rank
        self.failures: list[dict] = []
        """Failed checkpoints of this attempt, oldest first (``step``, ``section``, ``rank``, ``error``,
        ``generation``), and those of earlier attempts of the run as the controller tells of them
        (marked ``earlier_attempt: True``)."""
        self.seen_failures = -1
        """The newest failure's sequence number heard of (sent with each poll)."""
        self.seen_requests = -1
        """The newest request's sequence number heard of (sent with each poll)."""
        self._on_request = on_request
        self._reported = 0

    def take(self, reply: SyncReply, generation: int) -> None:
        """The failures and requests of a reply (``generation``: this attempt's)."""
        for f in reply.failures:
            self.seen_failures = max(self.seen_failures, f.seq)
            if f.generation == generation:
                self.failures.append(f.as_dict())
                logger.warning(
                    "cf_ray: rank %d: checkpoint of step %d failed (%s): %s; the previous committed "
                    "checkpoint stays the latest",
                    self.rank,
                    f.step,
                    f.section,
                    f.error,
                )
            elif 0 < f.generation < generation:
                # An earlier attempt's checkpoint that never committed (a step lost with its node, a
                # failed write its ranks did not live to report): reported once by wait() and in
                # FinishSummary.failures, marked, never counted as one of this attempt's steps.
                self.failures.append({**f.as_dict(), "earlier_attempt": True})
                if self.rank == 0:
                    logger.warning(
                        "cf_ray: checkpoint of step %d of an earlier attempt (generation %d) was never "
                        "committed (%s): %s",
                        f.step,
                        f.generation,
                        f.section,
                        f.error,
                    )
        for r in reply.requests:  # cf_ray.preemption.notify_preemption() from the driver
            self.seen_requests = max(self.seen_requests, r.seq)
            self._on_request(r)

    def add(self, step: int, section: str, error: str, generation: int) -> None:
        """A failure this rank found itself."""
        self.failures.append(
            {"step": step, "section": section, "rank": self.rank, "error": error, "generation": generation}
        )

    def add_local(self, errors: list[tuple[int, BaseException]], generation: int) -> None:
        """Snapshots of this rank that never reached its holder (``Snapshotter.take_errors``)."""
        for step, err in errors:
            self.add(step, mf.rank_section(self.rank), f"{type(err).__name__}: {err}", generation)

    def new(self, raise_on_error: bool) -> list[dict]:
        """The failures not yet reported (each is reported once), an earlier attempt's included.

        Raises:
            PersistError: when ``raise_on_error`` and one of this attempt's is among them (an earlier
                attempt's is reported, never raised: every new attempt would raise it again).
        """
        new = self.failures[self._reported :]
        self._reported = len(self.failures)
        own = [f for f in new if not f.get("earlier_attempt")]
        if own and raise_on_error:
            raise PersistError("; ".join(f"step {f['step']} ({f['section']}): {f['error']}" for f in own))
        return new

    @contextlib.contextmanager
    def kept_unreported(self) -> Iterator[None]:
        """Failures reported inside stay unreported for the user's next ``wait()``."""
        reported = self._reported
        try:
            yield
        finally:
            self._reported = reported
