"""A rank's preemption watcher: the three sources of a notice (Ray Train's signal, SIGTERM, the
user), and what happens after the just-in-time checkpoint (wait for it, hold, pass SIGTERM on).

How the sources are watched, and why, is told in :mod:`cf_ray.preemption` (the public module: the
driver-side :func:`~cf_ray.preemption.notify_preemption` and
:class:`~cf_ray.preemption.CheckpointBeforeResize`). This module is the worker's side of it, owned
by the :class:`~cf_ray.Checkpointer` (``ckpt.preemption``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import ray.train

from cf_ray._engine import env as _env
from cf_ray._engine.protocol.doorbell import current_actor
from cf_ray.config import PreemptionConfig
from cf_ray.errors import CfRayError

logger = logging.getLogger("cf_ray")

#: Ray Train's own fallback when a drain reports no deadline (``DEFAULT_PREEMPTION_DEADLINE_S``).
_RAY_DEFAULT_DEADLINE_S = 120.0


@dataclass(frozen=True, slots=True)
class PreemptionNotice:
    """One notice as a rank received it."""

    source: str
    """``ray`` (Ray Train's signal), ``sigterm``, ``user`` (``request_checkpoint``) or ``driver``
    (:func:`cf_ray.preemption.notify_preemption`)."""
    received_unix: float
    """When this rank received it (``time.time()``)."""
    deadline_unix: float | None
    """When the worker is expected to be gone; ``None`` when unknown."""
    rank: int
    """The rank that received it."""
    detail: str = ""
    """Free text: Ray's preempted ranks and nodes, the user's reason."""
    requested: bool = True
    """Whether this rank asked for the checkpoint. A notice that reaches every rank (Ray's, the
    driver's) is acted on by rank 0 only, so that ranks hearing of it a step apart do not ask for
    two checkpoints; the others keep it for its deadline."""

    def seconds_left(self, now: float | None = None) -> float | None:
        if self.deadline_unix is None:
            return None
        return self.deadline_unix - (time.time() if now is None else now)


@dataclass(slots=True)
class PreemptionOutcome:
    """What became of a rank's notice once its just-in-time checkpoint was taken."""

    notice: PreemptionNotice
    step: int
    """The step of the just-in-time checkpoint."""
    durable: bool
    """Safe when this rank stopped waiting for it: committed, or in a peer's memory on a node
    that is not going, whichever came first (the profile row's ``safe_tier`` says which)."""
    durable_before_deadline: bool | None
    """Safe before the deadline (``None``: no deadline)."""
    waited_s: float
    held_s: float = 0.0


# SIGTERM hooks of this process by token: the function run on the main thread through the actor finds
# the live object here (what ``__ray_call__`` carries is pickled, so it cannot carry the object).
_REGISTRY: dict[int, _SigtermHook] = {}
_REGISTRY_LOCK = threading.RLock()  # re-entrant: the signal handler takes it on the main thread


class PreemptionWatcher:
    """One per rank, owned by the :class:`~cf_ray.Checkpointer`. Thread-safe ``notify``.

    Call order (training thread unless said otherwise): ``install()`` once; ``poll(step)`` after
    every optimizer step, before the exchange; ``notify(...)`` from any thread or a signal
    handler; ``snapshot_meta()`` when a ``preempt`` checkpoint is taken; ``after_checkpoint(...)``
    right after it; ``close()`` at the end.

    Args:
        config: the :class:`PreemptionConfig`.
        rank: this rank.
        request: called (from any thread) when a notice arrives; asks for a ``preempt`` checkpoint.
    """

    def __init__(self, config: PreemptionConfig, rank: int, request: Callable[[], None]):
        self.config = config
        self.rank = rank
        self._request = request
        self._lock = threading.RLock()  # re-entrant: a signal handler may run while the main thread holds it
        self.notices: list[PreemptionNotice] = []
        """Every notice this rank received, oldest first."""
        self.outcomes: list[PreemptionOutcome] = []
        """What became of them (one per just-in-time checkpoint that this rank had a notice for)."""
        self.jit_steps: list[int] = []
        """Steps of every just-in-time checkpoint this rank took (the same on every rank)."""
        self._active: PreemptionNotice | None = None
        self._ray_mode = "off"
        self._ray_seen: set = set()
        self._ray_first_seen: dict = {}
        self._sigterm = _SigtermHook(rank, self._on_sigterm)
        self._sigterm_heard = False
        self._closed = False

    # -- set-up ------------------------------------------------------------------------------------
    @classmethod
    def started(cls, setting: Any, rank: int, request: Callable[[], None]) -> PreemptionWatcher | None:
        """The watcher ``CheckpointConfig.preemption`` asks for (``True`` or a :class:`PreemptionConfig`),
        installed; ``None`` when it is off."""
        if not setting:
            return None
        watcher = cls(setting if isinstance(setting, PreemptionConfig) else PreemptionConfig(), rank, request)
        watcher.install()
        return watcher

    def install(self) -> None:
        """Find Ray's signal and install the SIGTERM handler (see :mod:`cf_ray.preemption` for how)."""
        if self.config.ray_signal != "off":
            self._ray_mode = _ray_mode(self.config.ray_signal)
        if self.config.sigterm:
            self._sigterm.install()
        logger.debug(
            "cf_ray: rank %d watches preemption: ray=%s sigterm=%s", self.rank, self._ray_mode, self._sigterm.mode
        )

    @property
    def sources(self) -> dict[str, str]:
        """How each source is watched on this rank: ``ray`` (``mailbox``, ``api``, ``off``) and
        ``sigterm`` (``actor``, ``main``, ``off``); ``user`` always works."""
        return {"ray": self._ray_mode, "sigterm": self._sigterm.mode, "user": "on"}

    def _on_sigterm(self) -> None:
        """A SIGTERM is a preemption notice, unless the process is being stopped for another reason
        or there is nothing to save yet; then it is passed on at once, as if cf_ray were not there."""
        with self._lock:
            if self._sigterm_heard:
                return
            self._sigterm_heard = True
            why = self._sigterm.not_a_preemption()
            if why is None:
                now = time.time()
                self.notify(
                    "sigterm",
                    deadline_unix=now + self.config.sigterm_deadline_s,
                    detail="SIGTERM to the worker process",
                )
                return
        logger.info("cf_ray: rank %d: SIGTERM %s; not a preemption: passed on, no checkpoint", self.rank, why)
        self._sigterm.redeliver()

    # -- notices -------------------------------------------------------------------------------------
    def notify(
        self,
        source: str,
        *,
        deadline_unix: float | None = None,
        deadline_s: float | None = None,
        detail: str = "",
        request: bool = True,
    ) -> PreemptionNotice:
        """Record a notice and (``request``) ask for a just-in-time checkpoint. Any thread; several
        sources may report the same event (the earliest deadline wins)."""
        now = time.time()
        if deadline_unix is None and deadline_s is not None:
            deadline_unix = now + float(deadline_s)
        notice = PreemptionNotice(
            source=source,
            received_unix=now,
            deadline_unix=deadline_unix,
            rank=self.rank,
            detail=detail,
            requested=request,
        )
        with self._lock:
            self.notices.append(notice)
            act = self._active
            if act is None or (
                notice.deadline_unix is not None
                and (act.deadline_unix is None or notice.deadline_unix < act.deadline_unix)
            ):
                self._active = notice
        left = notice.seconds_left(now)
        logger.warning(
            "cf_ray: rank %d: preemption notice from %s%s%s%s",
            self.rank,
            source,
            f", deadline in {left:.1f} s" if left is not None else ", no deadline",
            f" ({detail})" if detail else "",
            "; checkpointing at the next step" if request else "; rank 0 asks for the checkpoint",
        )
        if request:
            self._request()
        return notice

    @property
    def active(self) -> PreemptionNotice | None:
        """The notice the next just-in-time checkpoint answers, if any."""
        return self._active

    def poll(self, step: int) -> None:
        """After every optimizer step, on the training thread: look at Ray Train's signal."""
        self._sigterm.stepped = True
        act = self._active
        if (
            act is not None
            and not act.requested
            and act.deadline_unix is not None
            and time.time() > act.deadline_unix + 1.0
        ):
            self._active = None  # heard of after its checkpoint, and long past: forget it
        if self._ray_mode == "mailbox":
            info = _read_mailbox()
        elif self._ray_mode == "api" and step % self.config.ray_poll_every == 0:
            try:
                info = ray.train.get_preemption_info()
            except Exception as e:  # noqa: BLE001
                logger.warning(
                    "cf_ray: rank %d: ray.train.get_preemption_info() failed (%r); not polled again", self.rank, e
                )
                self._ray_mode = "off"
                return
        else:
            return
        if info is None:
            return
        key = (info.deadline_ms, tuple(sorted((n, tuple(r)) for n, r in info.preempted_node_to_ranks.items())))
        if key in self._ray_seen:
            return
        self._ray_seen.add(key)
        if info.deadline_ms:
            deadline = info.deadline_ms / 1000.0
        else:  # Ray restarts the group this long after it saw the drain
            deadline = self._ray_first_seen.setdefault("t", time.time()) + _ray_default_deadline_s()
        ranks = info.preempted_ranks
        # Every rank gets Ray's signal; from the mailbox they may see it a step apart, so only rank 0
        # asks (the public call returns the same value on every rank at the same step).
        self.notify(
            "ray",
            deadline_unix=deadline,
            request=self._ray_mode == "api" or self.rank == 0,
            detail=f"Ray Train: preempted ranks {ranks}, nodes {[n[:8] for n in info.preempted_node_ids]}"
            f"{' (this rank)' if self.rank in ranks else ''}",
        )

    def snapshot_meta(self) -> dict:
        """What the ``preempt`` checkpoint's metadata records of this rank's notice (may be empty)."""
        n = self._active
        if n is None:
            return {}
        return {"deadline_unix": n.deadline_unix, "notice_unix": n.received_unix, "notice_source": n.source}

    # -- after the checkpoint -----------------------------------------------------------------------------
    def after_checkpoint(self, step: int, wait: Callable[[float], Any], committed: Callable[[int], bool]) -> None:
        """Right after this rank started the ``preempt`` checkpoint of ``step``: wait for it to be
        committed (bounded by the deadline), then hold or let SIGTERM take its course.

        Args:
            step: the checkpoint's step.
            wait: ``Checkpointer.wait``: blocks up to the given seconds until nothing is pending.
            committed: whether ``step`` is safe, as this rank knows it: committed (or a newer one), or
                held in a peer's memory on a node that is not going (the controller's ``safe``).
        """
        self.jit_steps.append(step)
        with self._lock:
            notice, self._active = self._active, None
        if notice is None:
            return
        t0 = time.time()
        left = notice.seconds_left(t0)
        budget = self.config.max_wait_s if left is None else max(left, 0.5)
        try:
            wait(budget)
        except CfRayError as e:  # raise_on_persist_error: report it, the outcome says not durable
            logger.warning("cf_ray: rank %d: the just-in-time checkpoint of step %d failed: %s", self.rank, step, e)
        durable = committed(step)
        now = time.time()
        made = None if notice.deadline_unix is None else (durable and now <= notice.deadline_unix)
        outcome = PreemptionOutcome(
            notice=notice, step=step, durable=durable, durable_before_deadline=made, waited_s=now - t0
        )
        self.outcomes.append(outcome)
        left = notice.seconds_left(now)
        logger.warning(
            "cf_ray: rank %d: just-in-time checkpoint of step %d %s%s",
            self.rank,
            step,
            "safe (committed, or in a peer's memory)" if durable else "NOT safe yet",
            ""
            if left is None
            else f", {left:.1f} s before the deadline"
            if left >= 0
            else f", {-left:.1f} s after the deadline",
        )
        if notice.source == "sigterm" and self.config.sigterm_exit and self._sigterm.mode != "off":
            self._sigterm.redeliver()
            # The process is ending; a step taken now would be lost. Hold until it does (or the deadline).
            assert notice.deadline_unix is not None  # a SIGTERM notice always carries one (see _on_sigterm)
            self._sleep_until(notice.deadline_unix + self.config.hold_extra_s, outcome)
            return
        if self.config.hold and notice.deadline_unix is not None:
            self._sleep_until(notice.deadline_unix + self.config.hold_extra_s, outcome)

    def _sleep_until(self, until: float | None, outcome: PreemptionOutcome) -> None:
        t0 = time.time()
        if until is None or until <= t0:
            return
        logger.warning(
            "cf_ray: rank %d: holding %.1f s until the deadline (a step taken now would be lost)", self.rank, until - t0
        )
        while not self._closed and time.time() < until:
            time.sleep(min(0.1, max(until - time.time(), 0.0)))
        outcome.held_s = time.time() - t0
        logger.warning("cf_ray: rank %d: still alive after the deadline; training goes on", self.rank)

    # -- the end --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Put the SIGTERM handling back as it was. Call once, from the training thread (later calls do
        nothing)."""
        if self._closed:
            return
        self._closed = True
        self._sigterm.close()


class _SigtermHook:
    """SIGTERM to this process, deferred: a handler on the main thread (directly, or through the
    worker actor with a wakeup pipe read by a thread of ours), put back as it was at the end.

    Args:
        rank: this rank (log lines).
        on_signal: called (from the main thread or the pipe's reader) when SIGTERM arrives.
    """

    def __init__(self, rank: int, on_signal: Callable[[], None]):
        self.rank = rank
        self._on_signal = on_signal
        self._token = id(self)
        self.mode = "off"  # off, main (plain handler), actor (via the worker actor's main thread)
        self._actor = None
        self._prev_handler: Any = None
        self._prev_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None
        self._installed_on_main = False
        self.stepped = False
        """A training step ended since the watcher started (before it, a rank holds nothing that its
        restore did not load: a SIGTERM then has no work to save)."""
        self.stopping = False
        """Ray Train called the worker's shutdown hook: the group is going away (see
        :class:`_GroupShutdownHook`)."""

    def not_a_preemption(self) -> str | None:
        """What a SIGTERM now is when it is not a preemption notice (``None`` when it may be one)."""
        if self.stopping:
            return (
                "after Ray Train began stopping the worker group (a worker failed or raised, the run "
                "ended, or the group restarts)"
            )
        if not self.stepped:
            return "before the first training step (restore() did not return): no work since the restore to save"
        return None

    def install(self) -> None:
        with _REGISTRY_LOCK:
            _REGISTRY[self._token] = self
        if threading.current_thread() is threading.main_thread():
            self._install_on_main()
            self.mode = "main"
            return
        actor = current_actor()
        if actor is None:
            logger.warning(
                "cf_ray: rank %d: SIGTERM is not watched (not the main thread and not inside a "
                "Ray actor); Ray Train's preemption signal and request_checkpoint() still are",
                self.rank,
            )
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._actor = actor
        try:
            ok = ray.get(
                actor.__ray_call__.remote(_main_install, self._token), timeout=_env.get_float(_env.ACTOR_TIMEOUT_S)
            )
        except Exception as e:  # noqa: BLE001 - never fail training for the watcher
            ok = False
            logger.warning("cf_ray: rank %d: could not install the SIGTERM handler: %r", self.rank, e)
        if not ok:
            logger.warning(
                "cf_ray: rank %d: SIGTERM is not watched (the worker actor does not run calls on its main thread)",
                self.rank,
            )
        if ok:
            self.mode = "actor"
            self._reader = threading.Thread(target=self._read_wakeups, name="cf_ray-sigterm", daemon=True)
            self._reader.start()
        else:
            self._close_pipe()

    def _install_on_main(self) -> None:
        """On the main thread: our handler for SIGTERM, and the wakeup pipe when there is one."""
        self._prev_handler = signal.signal(signal.SIGTERM, _python_sigterm)
        if self._pipe is not None:
            self._prev_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        self._installed_on_main = True

    def _uninstall_on_main(self) -> Any:
        """On the main thread: put back what was there. Returns the previous SIGTERM handler."""
        prev = self._prev_handler
        if not self._installed_on_main:
            return prev
        self._installed_on_main = False
        try:
            if signal.getsignal(signal.SIGTERM) is _python_sigterm:
                signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
            if self._pipe is not None:
                current = signal.set_wakeup_fd(self._prev_wakeup)
                if current not in (-1, self._pipe[1]):  # someone else's: leave it in place
                    signal.set_wakeup_fd(current)
        except (ValueError, OSError) as e:
            logger.warning("cf_ray: rank %d: could not restore the SIGTERM handler: %r", self.rank, e)
        return prev

    def _read_wakeups(self) -> None:
        assert self._pipe is not None  # the reader thread is started only once the pipe exists
        r = self._pipe[0]
        while True:
            try:
                data = os.read(r, 512)
            except OSError:
                return
            if not data:
                return
            if self._prev_wakeup >= 0:  # keep whoever had the wakeup fd before us informed
                try:
                    os.write(self._prev_wakeup, data)
                except OSError:
                    pass
            if signal.SIGTERM in data:
                self._on_signal()

    def redeliver(self) -> None:
        """Let SIGTERM do what it would have done without cf_ray (on the main thread)."""
        if self.mode == "main":
            _main_redeliver(None, self._token)
        elif self.mode == "actor":
            assert self._actor is not None  # mode "actor" is set only once the actor is known
            self._actor.__ray_call__.remote(_main_redeliver, self._token)

    def close(self) -> None:
        if self.mode == "main":
            self._uninstall_on_main()
        elif self.mode == "actor" and self._installed_on_main:
            assert self._actor is not None  # mode "actor" is set only once the actor is known
            try:
                ray.get(self._actor.__ray_call__.remote(_main_uninstall, self._token), timeout=10)
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: rank %d: could not restore the SIGTERM handler: %r", self.rank, e)
        self._close_pipe()
        with _REGISTRY_LOCK:
            _REGISTRY.pop(self._token, None)

    def _close_pipe(self) -> None:
        if self._pipe is None or self._installed_on_main:
            return  # still the wakeup fd: leave it open rather than let Python write to a reused fd
        r, w = self._pipe
        self._pipe = None
        for fd in (w, r):
            try:
                os.close(fd)
            except OSError:
                pass


# -- run on the main thread (directly, or as a task of the worker actor) ----------------------------


def _python_sigterm(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    with _REGISTRY_LOCK:
        hooks = list(_REGISTRY.values())
    for hook in hooks:
        hook._on_signal()


def _main_install(actor_self, token: int) -> bool:
    w = _REGISTRY.get(token)
    if w is None or threading.current_thread() is not threading.main_thread():
        return False
    w._install_on_main()
    callbacks = getattr(actor_self, "_callbacks", None)  # Ray Train v2's worker actor (Ray 2.60's layout)
    if isinstance(callbacks, list) and _GroupShutdownHook is not None:
        callbacks.append(_GroupShutdownHook(token))
    return True


def _main_uninstall(actor_self, token: int) -> None:
    w = _REGISTRY.get(token)
    if w is not None:
        w._uninstall_on_main()
    callbacks = getattr(actor_self, "_callbacks", None)
    if isinstance(callbacks, list):
        callbacks[:] = [c for c in callbacks if getattr(c, "token", None) != token]


def _group_shutdown_hook_class() -> type | None:
    """:class:`_GroupShutdownHook`, or ``None`` where Ray Train v2's worker callbacks do not exist."""
    try:
        from ray.train.v2._internal.execution.callback import WorkerCallback
    except Exception:  # noqa: BLE001 - another Ray version: a group shutdown then reads as a SIGTERM
        return None

    class GroupShutdown(WorkerCallback):
        """Ray Train v2 stops a worker group (a worker failed or raised, the run ended, a restart or a
        resize) by calling every worker actor's ``shutdown()``, which runs each worker callback's
        ``before_worker_shutdown``, then ``ray.kill``; the worker process gets a SIGTERM on the way.
        This hook, added to the worker actor's callbacks, marks the rank's SIGTERM hook first, so
        that SIGTERM is passed on instead of being taken for a preemption notice."""

        def __init__(self, token: int) -> None:
            self.token = token

        def before_worker_shutdown(self) -> None:
            hook = _REGISTRY.get(self.token)
            if hook is not None:
                hook.stopping = True
                logger.debug("cf_ray: rank %d: Ray Train stops the worker group", hook.rank)

    return GroupShutdown


_GroupShutdownHook = _group_shutdown_hook_class()


def _main_redeliver(_actor_self, token: int) -> None:
    """Let SIGTERM do what it would have done without cf_ray."""
    w = _REGISTRY.get(token)
    if w is None:
        return
    prev = w._uninstall_on_main()
    logger.warning("cf_ray: rank %d: passing the deferred SIGTERM on", w.rank)
    if callable(prev) and prev is not _python_sigterm:
        prev(signal.SIGTERM, None)  # Ray's handler raises SystemExit: the worker process ends
    elif prev in (None, signal.SIG_DFL):
        os.kill(os.getpid(), signal.SIGTERM)


# -- Ray Train's signal ---------------------------------------------------------------------------------


def _ray_mode(wanted: str) -> str:
    if wanted == "auto":
        try:
            _read_mailbox()
            return "mailbox"
        except Exception:  # noqa: BLE001 - not inside Ray Train v2, or another layout
            pass
    try:
        import ray.train

        ray.train.get_context()
        if hasattr(ray.train, "get_preemption_info"):
            return "api"
    except Exception:  # noqa: BLE001
        pass
    return "off"


def _read_mailbox():
    """The ``PreemptionInfo`` Ray Train's watcher left on this worker (Ray 2.60's internal layout)."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


def _ray_default_deadline_s() -> float:
    try:
        from ray.train.v2._internal.constants import DEFAULT_PREEMPTION_DEADLINE_S

        return float(DEFAULT_PREEMPTION_DEADLINE_S)
    except Exception:  # noqa: BLE001
        return _RAY_DEFAULT_DEADLINE_S
