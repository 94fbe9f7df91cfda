"""Injects a schedule's faults into a training run, from outside its processes, and records where each
one landed (the point it was meant for, and what was true when it hit).

Every fault waits until the newest attempt of the run has logged its step, then acts:

=================  ==============================================================================
worker_kill        SIGKILL of rank r's worker: at the step; ``mid_copy``: once the ``mid_copy`` probe
                   holds its snapshot thread inside the copy into the slot; ``mid_persist``: once the
                   soak's storage holds the holder's write of rank r's section open; ``mid_restore``:
                   a first SIGKILL, then the restarted rank r SIGKILLed inside its restore (the
                   ``restore`` probe holds it before the first ``load_state_dict``)
holder_kill        SIGKILL of the holder of rank r's node: at the step, or while storage holds one of
                   its writes open
controller_kill    SIGKILL of the run's controller: at the step, or while storage holds its manifest
                   write open (mid-commit)
node_loss          ``Cluster.remove_node`` of rank r's node (raylet, object store, worker, holder)
storage_error      every checkpoint write refused for ``seconds`` (an ``OSError`` naming the fault)
storage_hang       every checkpoint write blocked for ``seconds``
slot_flip          every training worker SIGSTOPped; one bit flipped in both slots of a section (the
                   newest two fills: whichever the restore takes) through ``/proc/<holder>/fd/<n>``;
                   rank r SIGKILLed; the others SIGCONTinued
file_flip          workers SIGSTOPped; one bit flipped in the newest committed checkpoint's data file
                   of a section; every holder of the run and rank r SIGKILLed (memory gone: the
                   restore reads storage); the others SIGCONTinued
stream_flip        the ``stream_flip`` probe armed (the next direct transfer gets a bit flipped as it
                   lands), then rank r's node removed
spare_kill         ``then_kill``: SIGKILL of the spare process rank r made ready for the next attempt
                   (its claim file names the rank's worker; waited for up to :data:`SPARE_WAIT_S`,
                   else the idle ``ray::IDLE`` worker of its node and job that no claim names), then of
                   rank r's worker; ``while_made``: a first SIGKILL, then the restarted rank r SIGKILLed
                   right after its restore returned (the ``restore`` probe armed ``after``), while
                   its spare is being made
=================  ==============================================================================

Every kill of a training worker records the spares claimed on the nodes of the run's workers at
that moment (``spares_at_kill``): whether the restart could take one.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from benchmarks.soak import probes, procs
from benchmarks.soak import storage as soak_storage
from benchmarks.soak.monitor import LogTail, Monitor, RunPaths, wait_for
from benchmarks.soak.schedule import Fault

#: Longest wait for a fault's step (the run may also end first).
STEP_WAIT_S = 240.0
#: Longest wait for a probe or a storage gate to report its point.
POINT_WAIT_S = 60.0
#: Longest wait for rank r's spare to be claimed before ``spare_kill`` kills whatever it finds.
SPARE_WAIT_S = 20.0


def _section(fault: Fault) -> str:
    return "shared" if fault.params.get("section", "shared") == "shared" else f"rank_{fault.rank:05d}"


class Injector:
    """Args:
    run: the run's paths (its control directory too).
    monitor: the run's monitor (steps, placement).
    logs: the log tail (a mark per fault).
    alive: whether the run is still training (its ``fit()`` has not returned).
    remove_node: removes a node by its id (the cluster's; called on this thread).
    """

    def __init__(
        self,
        run: RunPaths,
        monitor: Monitor,
        logs: LogTail,
        alive: Callable[[], bool],
        remove_node: Callable[[str], None],
    ):
        self.run, self.mon, self.logs, self.alive, self.remove_node = run, monitor, logs, alive, remove_node
        self.nodes_removed: list[str] = []

    # -- the schedule ----------------------------------------------------------------------------
    def inject(self, fault: Fault) -> dict:
        """Wait for the fault's step, inject it; the record of what happened."""
        rec: dict[str, Any] = {**fault.as_dict(), "injected": False, "landed": {}}
        reached = wait_for(lambda: self.mon.newest_step() >= fault.step, STEP_WAIT_S, alive=self.alive)
        if not reached or not self.alive():
            rec["landed"] = {"not_injected": "the run ended or never reached the step"}
            return rec
        rec["log_mark"] = self.logs.mark()
        rec["generation"] = self.mon.newest_generation()
        rec["t_inject"] = time.time()
        rec["committed_before"] = self.mon.committed()
        try:
            getattr(self, f"_{fault.kind}")(fault, rec)
        except Exception as e:  # noqa: BLE001 - recorded: a fault the soak could not inject is reported
            rec["landed"]["inject_error"] = f"{type(e).__name__}: {e}"
        rec["t_done"] = time.time()
        return rec

    # -- helpers ---------------------------------------------------------------------------------
    def _worker(self, rank: int, timeout_s: float = 30.0) -> tuple[int, str, int] | None:
        """(pid, node, generation) of rank ``rank``'s worker of the newest attempt."""
        got: dict = {}

        def found() -> bool:
            w = self.mon.placement().workers.get(rank)
            if w is not None and w[2] >= self.mon.newest_generation():
                got["w"] = w
                return True
            return False

        wait_for(found, timeout_s, alive=self.alive, every_s=0.1)
        return got.get("w")

    def _kill_rank(self, rank: int, rec: dict, key: str = "killed") -> int | None:
        w = self._worker(rank)
        if w is None:
            rec["landed"][key] = {"error": f"no worker of rank {rank} found"}
            return None
        pid, node, gen = w
        slots = self._rank_slots(rank, node)
        spares = self._spares_now(also=pid)
        ok = procs.signal_pid(pid)
        rec["landed"][key] = {
            "rank": rank,
            "pid": pid,
            "node": node,
            "generation": gen,
            "step": self.mon.newest_step(gen),
            "signalled": ok,
            "slots_at_kill": slots,
            "spares_at_kill": spares,
        }
        return pid

    def _spares_now(self, also: int | None = None) -> list[dict]:
        """The spares claimed for the run's job on every node now (each: its pid, the worker and rank
        it was made for, its directory, whether it is alive and idle); the job is read from a worker
        of the run (``also``, or one placed)."""
        for pid in ([also] if also else []) + self._pids_of_workers():
            where = procs.spares_dir(pid)
            if where is not None:  # every node's claims of the run's job: <tmp>/cf_ray-spares/*-<job>
                tmp, job = os.path.dirname(os.path.dirname(where)), os.path.basename(where).rsplit("-", 1)[1]
                return [
                    {k: c.get(k) for k in ("pid", "for_pid", "rank", "alive", "idle")}
                    | {"dir": os.path.basename(os.path.dirname(c["file"]))}
                    for c in procs.job_spares(job, tmp)
                ]
        return []

    def _rank_slots(self, rank: int, node: str) -> list[dict]:
        """The slot headers of rank ``rank``'s sections in its node's holder (what a kill interrupted)."""
        holder = self.mon.placement().holders.get(node)
        if holder is None:
            return []
        mine = {f"rank_{rank:05d}"} | ({"shared"} if rank == 0 else set())
        return [
            {"section": s.section, "state": procs.slot_state_name(s.state), "step": s.step, "generation": s.generation}
            for s in procs.slots_of(holder[0])
            if s.section in mine and not s.copy
        ]

    def _arm(self, probe: str, spec: dict) -> None:
        probes.arm(self.run.control, probe, spec)

    def _disarm(self, probe: str) -> None:
        try:
            os.unlink(os.path.join(self.run.control, "arm", f"{probe}.json"))
        except FileNotFoundError:
            pass

    def _at(self, fault: Fault, suffix: str = "") -> dict | None:
        return probes.fired(self.run.control, fault.id, suffix)

    def _wait_at(self, fault: Fault, timeout_s: float = POINT_WAIT_S) -> dict | None:
        got: dict = {}

        def seen() -> bool:
            a = self._at(fault)
            if a is not None:
                got["at"] = a
            return a is not None

        wait_for(seen, timeout_s, alive=self.alive, every_s=0.005)
        return got.get("at")

    def _gate(self, fault: Fault, match: str) -> dict | None:
        """Hold the first checkpoint write matching ``match`` open; its ``at`` record (pid, path)."""
        soak_storage.write_rule(self.run.control, {"fault": fault.id, "mode": "gate", "match": match, "hold_s": 30.0})
        at = self._wait_at(fault)
        if at is None:
            soak_storage.clear_rule(self.run.control)
        return at

    def _release(self, fault: Fault) -> None:
        try:
            os.unlink(os.path.join(self.run.control, f"gate.{fault.id}"))
        except FileNotFoundError:
            pass

    def _pids_of_workers(self) -> list[int]:
        return [pid for pid, _, _ in self.mon.placement().workers.values()]

    # -- the kinds -------------------------------------------------------------------------------
    def _worker_kill(self, fault: Fault, rec: dict) -> None:
        landed = rec["landed"]
        if fault.point == "step":
            landed["point"] = "at the step"
            rec["injected"] = self._kill_rank(fault.rank, rec) is not None
        elif fault.point == "mid_copy":
            self._arm("mid_copy", {"fault": fault.id, "rank": fault.rank, "min_step": fault.step})
            at = self._wait_at(fault)
            self._disarm("mid_copy")
            if at is None:
                landed["point"] = "at the step (the mid_copy probe did not fire)"
                rec["injected"] = self._kill_rank(fault.rank, rec) is not None
                return
            landed["probe"] = at
            node = self.mon.placement().workers.get(fault.rank, (0, "", 0))[1]
            landed["signalled"] = procs.signal_pid(int(at["pid"]))
            landed["point"] = f"mid-copy of step {at.get('step')}: {at.get('point')}"
            time.sleep(0.2)
            landed["slots_after_kill"] = self._rank_slots(fault.rank, node) if node else []
            rec["injected"] = landed["signalled"]
        elif fault.point == "mid_persist":
            at = self._gate(fault, rf"checkpoints/step_\d+/[^/]*rank_{fault.rank:05d}\.")
            if at is None:
                landed["point"] = "at the step (no write of the rank's section was seen)"
                rec["injected"] = self._kill_rank(fault.rank, rec) is not None
                return
            landed["writing"] = at
            rec["injected"] = self._kill_rank(fault.rank, rec) is not None
            landed["point"] = f"while the holder wrote {os.path.basename(at['path'])} of step {at.get('step')}"
            time.sleep(0.3)
            self._release(fault)
        elif fault.point == "mid_restore":
            self._arm("restore", {"fault": fault.id, "rank": fault.rank})
            first = self._kill_rank(fault.rank, rec, key="first_kill")
            if first is None:
                self._disarm("restore")
                return
            got: dict = {}

            def restoring() -> bool:
                got["at"], got["done"] = self._at(fault), self._at(fault, ".done")
                return got["at"] is not None or got["done"] is not None

            wait_for(restoring, STEP_WAIT_S, alive=self.alive, every_s=0.005)
            self._disarm("restore")
            if got.get("at") is not None:
                landed["probe"] = got["at"]
                landed["spares_at_kill"] = self._spares_now(also=int(got["at"]["pid"]))
                landed["signalled"] = procs.signal_pid(int(got["at"]["pid"]))
                landed["point"] = f"mid-restore: {got['at'].get('point')}"
                rec["injected"] = landed["signalled"]
            elif got.get("done") is not None:
                landed["probe"] = got["done"]
                landed["spares_at_kill"] = self._spares_now(also=int(got["done"]["pid"]))
                landed["signalled"] = procs.signal_pid(int(got["done"]["pid"]))
                landed["point"] = "after the restore (it loaded nothing: a fresh start)"
                rec["injected"] = landed["signalled"]
            else:
                landed["point"] = "no restore seen after the first kill"
                rec["injected"] = True  # the first kill was

    def _holder_kill(self, fault: Fault, rec: dict) -> None:
        landed = rec["landed"]
        if fault.point == "mid_persist":
            at = self._gate(fault, rf"checkpoints/step_\d+/[^/]*(rank_{fault.rank:05d}|shared)\.")
            if at is not None:
                holders = {pid: node for node, (pid, _) in self.mon.placement().holders.items()}
                landed["writing"] = at
                landed["is_holder"] = int(at["pid"]) in holders
                landed["signalled"] = procs.signal_pid(int(at["pid"]))
                landed["point"] = f"while it wrote {os.path.basename(at['path'])} of step {at.get('step')}"
                rec["injected"] = landed["signalled"]
                self._release(fault)
                return
            landed["point"] = "at the step (no write seen)"
        w = self._worker(fault.rank)
        place = self.mon.placement()
        holder = place.holders.get(w[1]) if w else None
        if holder is None:
            landed["error"] = f"no holder on rank {fault.rank}'s node"
            return
        slots = [s.as_dict() for s in procs.slots_of(holder[0])]
        landed.setdefault("point", "at the step")
        landed.update(holder=holder[1], pid=holder[0], slots_at_kill=slots, signalled=procs.signal_pid(holder[0]))
        rec["injected"] = landed["signalled"]

    def _controller_kill(self, fault: Fault, rec: dict) -> None:
        landed = rec["landed"]
        if fault.point == "mid_commit":
            at = self._gate(fault, r"checkpoints/step_\d+/[^/]*MANIFEST")
            if at is not None:
                ctl = self.mon.placement().controller
                landed.update(writing=at, is_controller=bool(ctl and ctl[0] == int(at["pid"])))
                landed["signalled"] = procs.signal_pid(int(at["pid"]))
                landed["point"] = f"mid-commit: while it wrote the manifest of step {at.get('step')}"
                rec["injected"] = landed["signalled"]
                self._release(fault)
                return
            landed["point"] = "at the step (no manifest write seen)"
        ctl = self.mon.placement().controller
        if ctl is None:
            landed["error"] = "no controller found"
            return
        landed.setdefault("point", "at the step")
        landed.update(pid=ctl[0], node=ctl[1], signalled=procs.signal_pid(ctl[0]))
        rec["injected"] = landed["signalled"]

    def _node_loss(self, fault: Fault, rec: dict) -> None:
        w = self._worker(fault.rank)
        if w is None:
            rec["landed"]["error"] = f"no worker of rank {fault.rank}"
            return
        place = self.mon.placement()
        on_it = {
            "ranks": sorted(r for r, (_, node, _) in place.workers.items() if node == w[1]),
            "holder": place.holders.get(w[1]),
            "controller": bool(place.controller and place.controller[1] == w[1]),
        }
        self.remove_node(w[1])
        self.nodes_removed.append(w[1])
        rec["landed"].update(point="at the step", node=w[1], on_the_node=on_it, step=self.mon.newest_step())
        rec["injected"] = True

    def _storage_error(self, fault: Fault, rec: dict) -> None:
        self._outage(fault, rec, "error")

    def _storage_hang(self, fault: Fault, rec: dict) -> None:
        self._outage(fault, rec, "hang")

    def _outage(self, fault: Fault, rec: dict, mode: str) -> None:
        seconds = float(fault.params["seconds"])
        rule = {"fault": fault.id, "mode": mode, "until": time.time() + seconds}
        soak_storage.write_rule(self.run.control, rule)
        rec["landed"].update(point=f"every checkpoint write {mode}s for {seconds:.1f} s", until=rule["until"])
        rec["injected"] = True

    def _slot_flip(self, fault: Fault, rec: dict) -> None:
        section = _section(fault)
        place = self.mon.placement()
        stopped = [pid for pid in self._pids_of_workers() if procs.signal_pid(pid, signal.SIGSTOP)]
        try:
            ready = []
            for _, (hpid, hname) in place.holders.items():
                for s in procs.slots_of(hpid):
                    if s.section == section and procs.slot_state_name(s.state) == "READY":
                        ready.append((s, hname))
            own = sorted((x for x in ready if not x[0].copy), key=lambda x: (x[0].generation, x[0].step))[-2:]
            flips = [dict(procs.flip_slot(s, float(fault.params["where"])), holder=h) for s, h in own]
            copies = [dict(procs.flip_slot(s, float(fault.params["where"])), holder=h) for s, h in ready if s.copy]
            rec["landed"].update(
                point=f"{section}: both slots of the pair (steps {[s.step for s, _ in own]}), then rank {fault.rank} killed",
                section=section,
                flips=flips,
                copies=copies,
            )
            rec["injected"] = any(f["done"] for f in flips + copies)
            self._kill_rank(fault.rank, rec)
        finally:
            _continue(stopped, rec)

    def _file_flip(self, fault: Fault, rec: dict) -> None:
        section = _section(fault)
        place = self.mon.placement()
        stopped = [pid for pid in self._pids_of_workers() if procs.signal_pid(pid, signal.SIGSTOP)]
        try:
            committed = self.mon.committed()
            if not committed:
                rec["landed"]["error"] = "nothing committed yet"
                return
            step = committed[-1]
            d = os.path.join(self.run.ckpt_root, "checkpoints", f"step_{step:012d}")
            files = sorted(glob.glob(os.path.join(d, f"g*.{section}.bin")))
            if not files:
                rec["landed"]["error"] = f"no data file of {section} in {d}"
                return
            flip = procs.flip_file(files[-1], float(fault.params["where"]))
            killed = {name: procs.signal_pid(pid) for _, (pid, name) in place.holders.items()}
            rec["landed"].update(
                point=f"{section} of committed step {step}; every holder and rank {fault.rank} killed",
                step=step,
                section=section,
                flip=flip,
                holders_killed=killed,
            )
            rec["injected"] = True
            self._kill_rank(fault.rank, rec)
        finally:
            _continue(stopped, rec)

    def _stream_flip(self, fault: Fault, rec: dict) -> None:
        self._arm("stream_flip", {"fault": fault.id, "where": fault.params["where"]})
        self._node_loss(fault, rec)
        rec["landed"]["point"] = "the next direct transfer (armed), then rank's node removed"

    def _spare_kill(self, fault: Fault, rec: dict) -> None:
        landed = rec["landed"]
        if fault.point == "while_made":
            self._while_made(fault, rec)
            return
        w = self._worker(fault.rank)
        if w is None:
            landed["error"] = f"no worker of rank {fault.rank} found"
            return
        pid = w[0]
        where, ids = procs.spares_dir(pid), procs.ray_ids(pid)
        got: dict = {}

        def claimed() -> bool:
            got["spares"] = [c for c in procs.spares_of(pid, where) if c["idle"]]
            return bool(got["spares"])

        t0 = time.time()
        wait_for(claimed, SPARE_WAIT_S, alive=self.alive, every_s=0.1)
        spares = [c["pid"] for c in got.get("spares", [])]
        how = "claimed"
        if not spares and ids is not None:  # none claimed yet: the one the raylet is starting for it
            spares, how = procs.unclaimed_idle(*ids, where, procs.start_ticks(pid) or 0), "unclaimed idle"
        landed["waited_s"] = round(time.time() - t0, 2)
        landed["spare_pids"] = spares
        landed["spare_signalled"] = {str(p): procs.signal_pid(p) for p in spares}
        wait_for(lambda: all(procs.start_ticks(p) is None for p in spares), 5.0, every_s=0.01)  # dead first
        if spares:
            landed["point"] = f"rank {fault.rank}'s spare(s) {spares} ({how}) killed, then its worker"
        else:
            landed["point"] = f"at the step (no spare of rank {fault.rank} within {SPARE_WAIT_S:.0f} s)"
        rec["injected"] = self._kill_rank(fault.rank, rec) is not None

    def _while_made(self, fault: Fault, rec: dict) -> None:
        landed = rec["landed"]
        self._arm("restore", {"fault": fault.id, "rank": fault.rank, "after": True})
        if self._kill_rank(fault.rank, rec, key="first_kill") is None:
            self._disarm("restore")
            return
        at = self._wait_at(fault, STEP_WAIT_S)
        self._disarm("restore")
        if at is None:
            landed["point"] = "no restore seen after the first kill"
            rec["injected"] = True  # the first kill was
            return
        pid = int(at["pid"])
        where, ids, since = procs.spares_dir(pid), procs.ray_ids(pid), procs.start_ticks(pid) or 0
        landed["probe"] = at
        landed["spares_before_kill"] = procs.spares_of(pid, where)
        landed["spares_at_kill"] = self._spares_now(also=pid)
        landed["signalled"] = procs.signal_pid(pid)
        landed["point"] = f"right after the restore of attempt {at.get('generation')}: its spare being made"
        rec["injected"] = landed["signalled"]
        if ids is not None:  # what the raylet started for the dead rank, a few seconds later
            time.sleep(3.0)
            landed["unclaimed_idle_after_kill"] = procs.unclaimed_idle(*ids, where, since)

    def collect(self, rec: dict) -> None:
        """After the run: the probes' and storage's records of this fault."""
        fault_id = rec["id"]
        if rec["kind"] == "stream_flip":
            self._disarm("stream_flip")
            at = self._at(Fault(id=fault_id, kind="", point="", step=0))
            rec["landed"]["flip"] = at
        events = [e for e in soak_storage.read_events(self.run.control) if e.get("fault") == fault_id]
        if events:
            rec["landed"]["storage_writes"] = events


def _continue(stopped: list[int], rec: dict) -> None:
    """Every worker a flip stopped goes on but the one it killed (rank r too when the fault went no
    further than the stop: it was left stopped for good, and the soak recorded its own hang as
    cf_ray's)."""
    killed = (rec["landed"].get("killed") or {}).get("pid")
    for pid in stopped:
        if pid != killed:
            procs.signal_pid(pid, signal.SIGCONT)


__all__ = ["Injector"]
