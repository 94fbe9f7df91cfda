"""The driver-side controller: one Ray actor per run that schedules, commits and remembers.

How a run finds its controller: it is a *named, detached* actor,
``cf_ray.controller.<run key>`` in the ``cf_ray`` namespace (``CF_RAY_NAMESPACE``), where the run
key is derived from the run's storage location and name. Every worker's :class:`Checkpointer`
gets it with ``get_if_exists=True``, so the first worker of a run creates it and workers restarted
by Ray Train (same run) find the same one, with its schedule, its profile and its index of
in-memory snapshots intact. It uses ``num_cpus=0`` and never blocks a worker: workers poll it
with fire-and-forget calls and read the answers when they are ready.

When the driver restarts (a new ``trainer.fit()`` with the same ``RunConfig(name, storage_path)``),
a controller that is still alive (a long-lived cluster) is reused; otherwise a new one is created
and rebuilds what matters from storage: the committed checkpoints, the generation counter and the
saved profile (so the interval does not have to be profiled again from scratch). It exits on its
own ``CF_RAY_CONTROLLER_LINGER_S`` seconds after every rank has called ``Checkpointer.finish()``,
after writing the profile table to storage.

What it does:
* keeps the schedule: the policy's interval, published as numbered versions that the ranks adopt
  together (see ``_control.py``);
* tracks every section of every snapshot: staged in a holder (memory), durable (storage),
  failed or superseded; commits a checkpoint — writes its manifest — only when every section of
  that step and generation is durable; then applies keep-last clean-up and copies it to the
  upload tiers, on its maintenance thread (no clean-up between a restore plan and the restore);
* answers restore plans: the newest complete in-memory snapshot and the committed checkpoints;
* keeps the profile table (one row per checkpoint) and the events (restores, failures).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from cf_ray._engine import env as _env
from cf_ray._engine.format import manifest as mf
from cf_ray.policy import FrequencyPolicy, Sample
from cf_ray._engine.storage.fs import FileInfo, Storage

logger = logging.getLogger("cf_ray")


def run_key(storage_uri: str, run_name: str) -> str:
    """A short stable key for a run (actor names may not contain every character of a URI)."""
    digest = hashlib.sha1(f"{storage_uri}|{run_name}".encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_name)[:40]
    return f"{safe}-{digest}"


def controller_name(key: str) -> str:
    return f"cf_ray.controller.{key}"


@dataclass(slots=True)
class _Pending:
    generation: int
    step: int
    expected: set[str] | None = None
    staged: dict[str, str] = field(default_factory=dict)  # section -> holder name
    durable: dict[str, dict[str, FileInfo]] = field(default_factory=dict)
    persist_s: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    superseded: set[str] = field(default_factory=set)
    meta: dict = field(default_factory=dict)
    state: str = "pending"  # pending, committed, failed, superseded
    created: float = field(default_factory=time.time)
    persist_reported: bool = False  # the persist times went to the policy


def _per_holder_persist(p: _Pending) -> dict[str, float]:
    """Seconds each holder spent writing this checkpoint's sections (it writes them in turn)."""
    out: dict[str, float] = collections.defaultdict(float)
    for sec, secs in p.persist_s.items():
        out[p.staged.get(sec, "")] += secs
    return out


@dataclass(kw_only=True, slots=True)
class ControllerSettings:
    """What the controller needs from the user's CheckpointConfig (picklable, no live objects)."""

    policy: FrequencyPolicy
    keep_last: int | None
    tiers: list  # list[Storage]: upload destinations, fastest first
    upload_milestones_only: bool


class Controller:
    """The controller's logic (the Ray actor class is :data:`ControllerActor`)."""

    def __init__(self, key: str, storage: Storage, settings: ControllerSettings):
        self.key = key
        self.storage = storage
        self.settings = settings
        self.policy = settings.policy
        self._lock = threading.RLock()
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._unknown_seen: set[int] = set()  # uncommitted step directories of no known checkpoint
        self._restoring = False  # between prepare_restore() and restored(): no deletions
        self._rows: dict[tuple[int, int], dict] = {}
        self._events: list[dict] = []
        self._iters: collections.deque = collections.deque(maxlen=20000)
        self._samples: collections.deque = collections.deque(maxlen=256)
        self._failures: list[dict] = []
        self._finished: set[int] = set()
        self._world_size = None
        self._holders: set[str] = set()
        self._metrics = None
        self._requests: list[dict] = []  # checkpoint requests from cf_ray.preemption.notify_preemption
        self._request_seq = 0
        committed = mf.list_committed(storage)
        self._committed: dict[int, dict] = {}
        gens = [0]
        for c in committed:
            try:
                m = mf.read_manifest(storage, c.path)
            except Exception as e:  # noqa: BLE001 - a bad manifest is skipped, readers verify again
                logger.warning("cf_ray: ignoring %s: %s", c.path, e)
                continue
            self._committed[c.step] = {"path": c.path, "milestone": m.milestone, "generation": m.generation,
                                       "epoch": m.epoch}
            gens.append(m.generation)
        self.generation = max(gens)
        first = self.policy.initial_interval()
        self._schedules = [{"version": 0, "interval": first}]
        self._load_policy_state()
        self._maintenance: queue.Queue = queue.Queue()
        self._mthread = threading.Thread(target=self._maintain, name="cf_ray-maintenance", daemon=True)
        self._mthread.start()

    # -- generations and restore --------------------------------------------------------------
    def prepare_restore(self, world_size: int) -> dict:
        """Called by rank 0 at the start of every attempt: a new generation and a restore plan."""
        with self._lock:
            self.generation += 1
            # Until this attempt has restored, keep-last deletes nothing: the plan names checkpoints
            # that a late commit of the previous attempt would otherwise push out (keep_last=1).
            self._restoring = True
            self._reprofile_if_resized(world_size)
            self._world_size = world_size
            self._finished.clear()
            self._requests.clear()  # a notice for the previous attempt is moot
            memory = None
            for (gen, step), p in sorted(self._pending.items(), key=lambda kv: (kv[0][1], kv[0][0]), reverse=True):
                if p.expected and p.expected <= set(p.staged):
                    memory = {"generation": gen, "step": step, "sections": dict(p.staged),
                              "world_size": p.meta.get("world_size"), "epoch": p.meta.get("epoch"),
                              "replicated": p.meta.get("replicated", True)}
                    break
            storage_steps = sorted(self._committed, reverse=True)
        tiers = []
        for tier in self.settings.tiers:
            try:
                tiers.append(sorted((c.step for c in mf.list_committed(tier)), reverse=True))
            except Exception as e:  # noqa: BLE001 - an unreachable tier is not a reason to fail a restore
                logger.warning("cf_ray: cannot list upload tier %s: %s", tier.uri(), e)
                tiers.append([])
        return {"generation": self.generation, "memory": memory, "storage": storage_steps, "tiers": tiers,
                "schedules": list(self._schedules)}

    def restored(self, info: dict) -> None:
        """Rank 0 reports where the attempt resumed from.

        Snapshots of earlier generations past the restored step belong to a timeline that this
        attempt replays; they are not committed. Those at or before it are valid and may still
        commit (the holders keep writing them), which keeps a memory restore durable. Keep-last
        clean-up, held back since :meth:`prepare_restore`, runs again from here.
        """
        with self._lock:
            self._restoring = False
            self._maintenance.put(("retain",))  # what was deferred during the restore
            self._events.append(dict(info, event="restore", generation=self.generation, time=time.time()))
            for (gen, step), p in self._pending.items():
                if gen < self.generation and p.state == "pending" and step > info.get("step", 0):
                    p.state = "abandoned"
                    row = self._rows.get((gen, step))
                    if row is not None and row.get("deadline_unix") is not None:
                        row.update(made_deadline=False, where="abandoned",
                                   error="not durable when its attempt ended")

    # -- worker polls ----------------------------------------------------------------------------
    def sync(self, rank: int, generation: int, payload: dict) -> dict:
        """Non-blocking exchange with a worker: its samples in, the schedule and commit state out."""
        with self._lock:
            for s in payload.get("samples", ()):
                sample = Sample(**s)
                self._samples.append(sample)
                self._iters.append({"time": time.time(), "rank": rank, "step": sample.step,
                                    "iter_s": sample.iter_s, "iters": sample.iters})
            for st in payload.get("ckpt_stats", ()):
                row = self._row(generation, st["step"])
                for k in ("stall_s", "sync_s", "guard_s", "copy_s", "handoff_s"):
                    if k in st:
                        row.setdefault(f"_{k}", {})[rank] = st[k]
                if "nbytes" in st:
                    row.setdefault("_rank_bytes", {})[rank] = st["nbytes"]
            self._replan()
            adopted = payload.get("adopted_version", -1)
            latest = max(self._committed) if self._committed else 0
            return {
                "schedules": [s for s in self._schedules if s["version"] > adopted],
                "committed_step": latest,
                "failures": [f for f in self._failures if f["seq"] > payload.get("seen_failures", -1)],
                "requests": [r for r in self._requests if r["seq"] > payload.get("seen_requests", -1)],
            }

    def request_checkpoint(self, notice: dict) -> dict:
        """A preemption (or resize) notice from outside the workers, for every rank of this attempt
        (``cf_ray.preemption.notify_preemption``): ``deadline_unix`` and ``detail``."""
        with self._lock:
            self._request_seq += 1
            req = {"seq": self._request_seq, "deadline_unix": notice.get("deadline_unix"),
                   "detail": str(notice.get("detail", "")), "time": time.time(), "generation": self.generation}
            self._requests.append(req)
            self._events.append(dict(req, event="notice"))
            return dict(req)

    def _reprofile_if_resized(self, world_size: int) -> None:
        """A new number of workers: measure again (fresh samples, a fresh copy of the policy)."""
        if self._world_size is None or world_size == self._world_size:
            return
        self._samples.clear()
        try:
            import dataclasses

            self.policy = dataclasses.replace(self.policy) if dataclasses.is_dataclass(self.policy) else self.policy
        except Exception:  # noqa: BLE001 - keep the old one rather than fail a restore
            logger.warning("cf_ray: could not reset the policy for the new world size", exc_info=True)
        first = self.policy.initial_interval()
        if first != self._schedules[-1]["interval"]:
            self._schedules.append({"version": len(self._schedules), "interval": first})
        self._events.append({"event": "reprofile", "world_size": world_size, "previous_world_size": self._world_size,
                             "interval": first, "time": time.time()})

    def _replan(self) -> None:
        current = self._schedules[-1]["interval"]
        try:
            k = self.policy.plan(list(self._samples), current)
        except Exception:  # noqa: BLE001 - a policy bug must not stop checkpointing
            logger.exception("cf_ray: policy.plan failed; keeping interval %s", current)
            return
        if k is not None and k != current:
            self._schedules.append({"version": len(self._schedules), "interval": int(k)})
            self._events.append({"event": "interval", "interval": int(k), "previous": current, "time": time.time(),
                                 "why": _explain(self.policy)})

    # -- holders -----------------------------------------------------------------------------------
    def part_staged(self, generation: int, step: int, section: str, holder: str, nbytes: int, meta: dict) -> None:
        with self._lock:
            self._holders.add(holder)
            p = self._pend(generation, step)
            p.staged[section] = holder
            p.nbytes[section] = nbytes
            if meta.get("rank") == 0 or not p.meta:
                p.meta.update(meta)
            if p.expected is None and "world_size" in meta:
                w = int(meta["world_size"])
                p.expected = {mf.rank_section(r) for r in range(w)}
                if meta.get("replicated", True):
                    p.expected.add(mf.SHARED)
                # The controller is a threaded actor: a holder's part_durable calls may run before
                # the part_staged that says which sections to expect, so commit from here as well.
                self._report_persist(p)
                self._try_commit(p)
            if not meta.get("persist", True):
                p.superseded.add(section)
            row = self._row(generation, step)
            row.update({k: meta[k] for k in ("epoch", "kind", "milestone", "interval", "world_size") if k in meta})
            d = meta.get("deadline_unix")  # a just-in-time checkpoint: the earliest deadline any rank knows
            if d is not None and (row.get("deadline_unix") is None or d < row["deadline_unix"]):
                row.update(deadline_unix=d, notice_unix=meta.get("notice_unix"), notice_source=meta.get("notice_source"))

    def part_superseded(self, generation: int, step: int, section: str) -> None:
        with self._lock:
            p = self._pend(generation, step)
            p.superseded.add(section)
            if p.state == "pending":
                p.state = "superseded"
                self._row(generation, step).update(committed=False, where="memory-only",
                                                   error="superseded by a newer snapshot before it was persisted")

    def part_durable(self, generation: int, step: int, section: str, files: dict, persist_s: float) -> None:
        with self._lock:
            p = self._pend(generation, step)
            p.durable[section] = {k: FileInfo(int(v["size"]), int(v["crc32"])) for k, v in files.items()}
            p.persist_s[section] = persist_s
            self._report_persist(p)
            self._try_commit(p)

    def _report_persist(self, p: _Pending) -> None:
        """Workers cannot see phase 2: its times reach the policy from here, once every section of
        the checkpoint is durable (a small section durable first must not pass for the whole
        checkpoint's persist time)."""
        if p.persist_reported or p.expected is None or not p.expected <= set(p.durable):
            return
        p.persist_reported = True
        # A holder writes its sections one after the other: a rank's persist time is the time its
        # holder spent writing this checkpoint (what "one persist in flight" has to fit).
        per_holder = _per_holder_persist(p)
        for sec in sorted(p.persist_s):
            rank = mf.section_rank(sec)
            if sec == mf.SHARED and mf.rank_section(0) in p.persist_s:
                continue  # rank 0's sample comes with its own section (same holder)
            self._samples.append(Sample(rank=rank, step=p.step, ckpt_step=p.step,
                                        persist_s=per_holder[p.staged.get(sec, "")]))

    def part_failed(self, generation: int, step: int, section: str, error: str) -> None:
        with self._lock:
            p = self._pend(generation, step)
            p.failed[section] = error
            p.state = "failed"
            rank = mf.section_rank(section)
            failure = {"seq": len(self._failures), "step": step, "section": section, "rank": rank, "error": error,
                       "generation": generation}
            self._failures.append(failure)
            row = self._row(generation, step)
            row.update(committed=False, where="failed", error=f"{section}: {error}")
            if row.get("deadline_unix") is not None:
                row["made_deadline"] = False
            logger.warning("cf_ray: checkpoint of step %d not committed: %s failed: %s", step, section, error)
            self._record_metrics(generation, step)

    def _pend(self, generation: int, step: int) -> _Pending:
        p = self._pending.get((generation, step))
        if p is None:
            p = self._pending[(generation, step)] = _Pending(generation, step)
            # Keep the table small: forget old settled entries, never pending ones of this generation.
            if len(self._pending) > 64:
                for k in sorted(self._pending)[: len(self._pending) - 64]:
                    if self._pending[k].state != "pending":
                        del self._pending[k]
        return p

    def _row(self, generation: int, step: int) -> dict:
        row = self._rows.get((generation, step))
        if row is None:
            row = self._rows[(generation, step)] = {"step": step, "generation": generation, "committed": False,
                                                    "where": "pending", "error": None,
                                                    "interval": self._schedules[-1]["interval"]}
        return row

    def _try_commit(self, p: _Pending) -> None:
        if p.state not in ("pending",) or p.expected is None or not p.expected <= set(p.durable):
            return
        files: dict[str, FileInfo] = {}
        sections = {}
        for sec in sorted(p.expected):
            files.update(p.durable[sec])
            data, index = mf.section_files(p.generation, sec)
            sections[sec] = {"data": data, "index": index}
        m = mf.Manifest(step=p.step, epoch=int(p.meta.get("epoch", 0)), world_size=int(p.meta["world_size"]),
                        generation=p.generation, replicated=bool(p.meta.get("replicated", True)),
                        kind=str(p.meta.get("kind", "scheduled")), milestone=bool(p.meta.get("milestone", False)),
                        sections=sections, files=files, created_unix=time.time(),
                        extra={"data_world_size": p.meta.get("world_size")})
        directory = mf.step_dir(p.step)
        try:
            t0 = time.perf_counter()
            newest_before = max(self._committed) if self._committed else -1
            mf.commit(self.storage, directory, m) if p.step > newest_before else \
                self.storage.write_file(f"{directory}/{mf.MANIFEST}", [m.to_bytes()])
            commit_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a failed commit leaves the previous one the latest
            self.part_failed(p.generation, p.step, "manifest", f"{type(e).__name__}: {e}")
            return
        p.state = "committed"
        self._committed[p.step] = {"path": directory, "milestone": m.milestone, "generation": p.generation,
                                   "epoch": m.epoch}
        row = self._row(p.generation, p.step)
        row.update(committed=True, where=self.storage.uri(directory), error=None, commit_s=commit_s,
                   persist_s=max(_per_holder_persist(p).values()), bytes=sum(p.nbytes.values()),
                   epoch=m.epoch, kind=m.kind, milestone=m.milestone)
        row["durable_unix"] = time.time()
        if row.get("deadline_unix") is not None:
            row["made_deadline"] = row["durable_unix"] <= row["deadline_unix"]
        logger.info("cf_ray: committed step %d (%d bytes) at %s", p.step, row["bytes"], row["where"])
        self._record_metrics(p.generation, p.step)
        self._maintenance.put(("after_commit", p.step, m))

    # -- maintenance thread: retention and upload tiers ------------------------------------------------
    def _maintain(self) -> None:
        while True:
            item = self._maintenance.get()
            if item is None:
                self._maintenance.task_done()
                return
            try:
                if item[0] == "after_commit":
                    _, step, m = item
                    self._upload(step, m)
                    self._retain()
                elif item[0] == "retain":
                    self._retain()
                    for tier in self.settings.tiers:
                        self._retain_in(tier)
                elif item[0] == "save_profile":
                    self._save_profile()
            except Exception:  # noqa: BLE001 - a failed delete or upload never kills the thread
                logger.exception("cf_ray: maintenance after step %s failed", item[1] if len(item) > 1 else "?")
            finally:
                self._maintenance.task_done()

    def _upload(self, step: int, m: mf.Manifest) -> None:
        if not self.settings.tiers or (self.settings.upload_milestones_only and not m.milestone):
            return
        directory = mf.step_dir(step)
        for tier in self.settings.tiers:
            t0 = time.perf_counter()
            try:
                for name in m.files:
                    buf = mf.read_verified(self.storage, directory, m, name)
                    info = tier.write_file(f"{directory}/{name}", [buf])
                    if info != m.files[name]:
                        raise IOError(f"upload of {name} to {tier.uri()} wrote {info}, expected {m.files[name]}")
                mf.commit(tier, directory, m)  # the tier's own commit marker, written last
                self._events.append({"event": "upload", "step": step, "tier": tier.uri(directory),
                                     "seconds": time.perf_counter() - t0, "time": time.time()})
            except Exception as e:  # noqa: BLE001
                logger.warning("cf_ray: upload of step %d to %s failed: %s", step, tier.uri(), e)
                self._events.append({"event": "upload_failed", "step": step, "tier": tier.uri(), "error": str(e),
                                     "time": time.time()})
            else:
                self._retain_in(tier)

    def _retain(self) -> None:
        with self._lock:
            if self._restoring:
                return  # deferred until restored()
            committed = [(s, c["milestone"]) for s, c in self._committed.items()]
            doomed = mf.to_delete(committed, self.settings.keep_last)
            # The index is updated *before* deleting, so a concurrent restore plan never names a
            # checkpoint that is being deleted (the same order as Ray's checkpoint manager).
            for s in doomed:
                self._committed.pop(s, None)
            newest = max(self._committed) if self._committed else None
        for s in doomed:
            self._delete(self.storage, mf.step_dir(s))
        if newest is None:
            return
        # Directories without a manifest older than the newest commit are dead: a crashed writer's
        # leftovers, failed or superseded snapshots. Checkpoints commit out of step order when a
        # rank's section arrives late at its holder, so an older one may still be in flight, or may
        # commit between this listing and the check below: the check asks what the step is *now*
        # (a step committed since the listing was deleted here once — a milestone, in CI). A step
        # this controller has no record of may be one whose part_staged has not run yet (the actor
        # is threaded): it is deleted only if a later pass still finds it unknown and uncommitted.
        leftovers = mf.list_uncommitted(self.storage)
        with self._lock:
            states: dict[int, set[str]] = {}
            for (_, step), p in self._pending.items():
                states.setdefault(step, set()).add(p.state)
            unknown = {step for _, step in leftovers if step not in states and step not in self._committed}
            dead = [name for name, step in leftovers if step < newest and step not in self._committed and (
                step in self._unknown_seen if step in unknown else "pending" not in states[step])]
            self._unknown_seen = unknown
        for name in dead:
            self._delete(self.storage, f"{mf.CHECKPOINTS}/{name}")

    def _retain_in(self, tier: Storage) -> None:
        if self._restoring:
            return  # deferred until restored()
        committed = []
        for c in mf.list_committed(tier):
            try:
                committed.append((c.step, mf.read_manifest(tier, c.path).milestone))
            except Exception:  # noqa: BLE001
                continue
        for s in mf.to_delete(committed, self.settings.keep_last):
            self._delete(tier, mf.step_dir(s))

    @staticmethod
    def _delete(storage: Storage, path: str) -> None:
        try:
            storage.delete_dir(path)
        except Exception as e:  # noqa: BLE001 - a failed delete is logged, never fatal
            logger.warning("cf_ray: could not delete %s: %s", storage.uri(path), e)

    def _record_metrics(self, generation: int, step: int) -> None:
        """Export the row to Ray metrics (dashboard, Prometheus); never fails the caller."""
        try:
            if self._metrics is None:
                from cf_ray.report import CheckpointMetrics

                self._metrics = CheckpointMetrics(run=self.key)
            row = next((r for r in self.profile_rows() if r["step"] == step and r["generation"] == generation), None)
            if row is not None:
                self._metrics.record(row)
        except Exception:  # noqa: BLE001
            logger.debug("cf_ray: metrics export failed", exc_info=True)

    # -- the profile ---------------------------------------------------------------------------------
    def profile_rows(self) -> list[dict]:
        with self._lock:
            iter_s = _recent_iter_s(self._samples)
            out = []
            for (gen, step), row in sorted(self._rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                r = {k: v for k, v in row.items() if not k.startswith("_")}
                stalls = row.get("_stall_s") or {}
                guards = row.get("_guard_s") or {}
                # Training-thread stall per rank: the synchronous part plus the guard's wait for the copy.
                stall = max((v + guards.get(r, 0.0) for r, v in stalls.items()), default=None)
                r["stall_s"] = stall
                r["copy_s"] = _max(row.get("_copy_s"))
                r["sync_s"] = _max(row.get("_sync_s"))
                r["guard_s"] = _max(row.get("_guard_s"))
                if "bytes" not in r and row.get("_rank_bytes"):
                    r["bytes"] = sum(row["_rank_bytes"].values())
                interval = r.get("interval")
                stats = _checkpoint_stats(self.policy, step)
                if stats and stats.get("overhead_pct") is not None:
                    r["overhead_pct"] = stats["overhead_pct"]
                elif stall is not None and interval and iter_s:
                    r["overhead_pct"] = 100.0 * stall / (interval * iter_s)
                out.append(r)
            return out

    def iteration_rows(self) -> list[dict]:
        with self._lock:
            return list(self._iters)

    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def explain(self) -> Any:
        """Why the interval is what it is (the policy's ``explain()``), for users and notebooks."""
        with self._lock:
            return _explain(self.policy)

    def record_event(self, event: dict) -> None:
        with self._lock:
            self._events.append(dict(event, time=event.get("time", time.time())))

    def summary(self) -> dict:
        with self._lock:
            return {"generation": self.generation, "committed_steps": sorted(self._committed),
                    "interval": self._schedules[-1]["interval"], "schedules": list(self._schedules),
                    "failures": list(self._failures), "events": list(self._events),
                    "pending": sorted(k[1] for k, p in self._pending.items() if p.state == "pending")}

    def maintenance_idle(self) -> bool:
        """True when no upload or clean-up is queued or running."""
        return self._maintenance.unfinished_tasks == 0

    def pending_steps(self, generation: int) -> list[int]:
        with self._lock:
            return sorted(k[1] for k, p in self._pending.items() if k[0] == generation and p.state == "pending"
                          and not p.superseded)

    def finish(self, rank: int, world_size: int) -> None:
        with self._lock:
            self._finished.add(rank)
            done = len(self._finished) >= world_size
        if done:
            self._save_profile()
            threading.Thread(target=self._linger_then_exit, name="cf_ray-linger", daemon=True).start()

    def save_profile(self) -> None:
        self._save_profile()

    def _save_profile(self) -> None:
        try:
            from cf_ray import report

            report.save_profile(self.storage, self.profile_rows(), self.iteration_rows())
        except Exception as e:  # noqa: BLE001 - the profile is a report, never a reason to fail
            logger.warning("cf_ray: could not save the profile table: %s", e)
        self._save_policy_state()

    def _save_policy_state(self) -> None:
        if not hasattr(self.policy, "state_dict"):
            return
        try:
            import json

            self.storage.write_file("policy_state.json", [json.dumps(self.policy.state_dict()).encode()])
        except Exception as e:  # noqa: BLE001
            logger.warning("cf_ray: could not save the policy state: %s", e)

    def _load_policy_state(self) -> None:
        if not hasattr(self.policy, "load_state_dict") or not self.storage.exists("policy_state.json"):
            return
        try:
            import json

            self.policy.load_state_dict(json.loads(bytes(self.storage.read_file("policy_state.json"))))
            first = self.policy.initial_interval()
            self._schedules = [{"version": 0, "interval": first}]
        except Exception as e:  # noqa: BLE001 - a stale or damaged profile means: profile again
            logger.warning("cf_ray: ignoring the saved policy state: %s", e)

    def _linger_then_exit(self) -> None:
        time.sleep(_env.get_float(_env.LINGER_S))
        with self._lock:
            if self._finished and len(self._finished) >= (self._world_size or 1):
                self.shutdown()

    def shutdown(self) -> None:
        """Kill this run's holders and exit (used at the end of a run and by tests)."""
        for name in list(self._holders):
            try:
                ray.kill(ray.get_actor(name, namespace=_env.namespace()))
            except Exception:  # noqa: BLE001
                pass
        self._maintenance.put(None)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def _checkpoint_stats(policy, step: int) -> dict | None:
    try:
        return policy.checkpoint_stats(step) if hasattr(policy, "checkpoint_stats") else None
    except Exception:  # noqa: BLE001 - a report, never a failure
        return None


def _explain(policy) -> Any:
    try:
        return policy.explain() if hasattr(policy, "explain") else None
    except Exception:  # noqa: BLE001
        return None


def _max(d: dict | None) -> float | None:
    return max(d.values()) if d else None


def _recent_iter_s(samples) -> float | None:
    per_rank: dict[int, list[float]] = {}
    for s in samples:
        if s.iters > 0 and s.iter_s > 0:
            per_rank.setdefault(s.rank, []).append(s.iter_s)
    if not per_rank:
        return None
    # The slowest rank governs.
    return max(sum(v[-8:]) / len(v[-8:]) for v in per_rank.values())


ControllerActor = ray.remote(num_cpus=0, max_concurrency=32, max_restarts=0)(Controller)


def get_or_create_controller(key: str, storage: Storage, settings: ControllerSettings):
    # On the head node when there is one: the worker that creates it may be on a spot node that is
    # about to go, and the controller must outlive it (soft: anywhere if the head cannot take it).
    head = _head_node_id()
    extra = {}
    if head is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        extra["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=head, soft=True)
    return ControllerActor.options(
        name=controller_name(key), namespace=_env.namespace(), lifetime="detached", get_if_exists=True, **extra,
    ).remote(key, storage, settings)


def _head_node_id() -> str | None:
    try:
        for n in ray.nodes():
            if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {}):
                return n["NodeID"]
    except Exception:  # noqa: BLE001 - placement is a preference only
        pass
    return None


def get_controller(key: str):
    """The live controller of a run, or ``None``."""
    try:
        return ray.get_actor(controller_name(key), namespace=_env.namespace())
    except ValueError:
        return None
