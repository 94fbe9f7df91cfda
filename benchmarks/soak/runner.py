"""``cf-ray soak`` / ``python -m benchmarks.soak``: draws fault schedules from seeds, runs each against an
uninterrupted reference on one multi-node test cluster, checks every run, writes the JSON and prints
the table.

One ``ray.cluster_utils.Cluster`` for the whole soak (a head with no CPUs and three 1-CPU worker
nodes on loopback: each run's two ranks take two of them, the third is where a restarted rank may
land; a node lost is replaced after its schedule). The reference run (the same job without faults)
is run once per configuration and kept under ``<out>/reference/<config digest>/``. Each schedule is
one ``TorchTrainer.fit()`` of the demo's loop (``cf_ray/demo.py``) under a fresh run name, watched
by a :class:`~.monitor.Monitor` while an :class:`~.inject.Injector` injects its faults; then the
checks (``checks.py``). ``<out>/soak.json`` is written again after every schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import glob
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.soak import checks, procs, report
from benchmarks.soak import storage as soak_storage
from benchmarks.soak.inject import Injector
from benchmarks.soak.monitor import LogTail, Monitor, RunPaths
from benchmarks.soak.schedule import KINDS, Schedule, draw

SCHEMA = "cf_ray.soak/1"
_MiB = 1024 * 1024
OBJECT_STORE_BYTES = 150 * _MiB
#: Seconds without a step of the newest attempt (not on the way to a restart) that count as a stall:
#: training stood still, and cf_ray must have said something meanwhile.
STALL_S = 10.0

#: The job (the demo's loop, ``cf_ray/demo.py``; ``tests/test_engine_e2e.py``'s SMALL is ``quick``).
#: ``step_sleep`` paces the steps so that faults land between checkpoints; it changes no number.
PRESETS: dict[str, dict[str, Any]] = {
    # tests/test_engine_e2e.py's SMALL: 26 steps, a checkpoint every 5, sections of one block.
    "quick": dict(samples=202, epochs=2, batch_size=8, hidden=64, depth=2, interval=5, keep_last=3, step_sleep=0.1),
    # The same run with a wider model (the shared section spans four 256 KiB blocks), a checkpoint
    # every 4 steps, and milestones (pinned in their slots until written) at steps 12 and 24.
    "standard": dict(
        samples=202,
        epochs=2,
        batch_size=8,
        hidden=256,
        depth=2,
        interval=4,
        keep_last=3,
        milestone_every=12,
        step_sleep=0.1,
    ),
}
#: The keys of a preset that change the numbers (the reference is shared by configurations equal on these).
_MATH = ("samples", "epochs", "batch_size", "hidden", "depth", "seed", "lr")


def total_steps(cfg: dict) -> int:
    per_rank = -(-cfg["samples"] // 2)
    return -(-per_rank // cfg["batch_size"]) * cfg["epochs"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cf-ray soak",
        description="Fault soak: seeded fault schedules (process kills, a rank's spare process killed, a node lost, storage errors and "
        "hangs, bits flipped in memory, on disk and on the wire), each run checked against an "
        "uninterrupted reference.",
        epilog="example:\n  cf-ray soak --seeds 200 --out results/soak   # the full soak, ~2 h on 2 cores\n"
        "  cf-ray soak --seeds 3 --preset quick --out /tmp/soak",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seeds", type=int, default=3, help="how many schedules (seeds --first .. --first+N-1)")
    p.add_argument("--first", type=int, default=1, help="the first seed (default 1)")
    p.add_argument("--seed", type=int, action="append", help="run this seed (repeatable; overrides --seeds)")
    p.add_argument("--out", default=os.path.join(os.getcwd(), "cf_ray_runs", "soak"), help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="standard")
    p.add_argument("--kinds", default=",".join(KINDS), help="draw only these fault kinds (comma-separated)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds one schedule may take before it is a hang")
    p.add_argument("--keep", action="store_true", help="keep every run's files (default: only failed runs')")
    p.add_argument("--json", help="the JSON file (default: <out>/soak.json)")
    return p


def _env(control: str) -> dict[str, str]:
    from benchmarks.bench import _ray_env

    return dict(
        _ray_env(),
        CF_RAY_CONTROLLER_LINGER_S="2",
        CF_RAY_REAPER_INTERVAL_S="1",
        RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="30",
        SOAK_CONTROL_DIR=control,
        SOAK_SPARE_DELAY_S="0",  # a spare in every attempt of its short runs (probes.SPARE_DELAY_ENV)
    )


def _commit() -> str | None:
    """The git commit of the checkout the soak runs from (``None`` outside one): which code a part of
    a soak run in several parts tested."""
    import subprocess

    try:
        got = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return got.stdout.strip() or None


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def state_digests(path: str) -> dict[str, str]:
    """SHA-256 of the final model and of the optimizer state (every tensor's bytes, in key order)."""
    import torch

    state = torch.load(path, weights_only=True)
    out = {}
    for key in ("model", "optimizer"):
        h = hashlib.sha256()

        def walk(v, h=h):
            if isinstance(v, torch.Tensor):
                h.update(str((v.dtype, tuple(v.shape))).encode())
                h.update(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            elif isinstance(v, dict):
                for k in sorted(v, key=str):
                    h.update(str(k).encode())
                    walk(v[k])
            elif isinstance(v, list | tuple):
                for x in v:
                    walk(x)
            else:
                h.update(repr(v).encode())

        walk(state.get(key))
        out[key] = h.hexdigest()[:16]
    return out


def _read_ids(out_dir: str) -> dict[tuple[int, int], list[dict]]:
    files = {}
    for f in glob.glob(os.path.join(out_dir, "ids_rank*_gen*.jsonl")):
        base = os.path.basename(f)
        rank, gen = int(base.split("_")[1].removeprefix("rank")), int(base.rsplit("gen", 1)[1].split(".")[0])
        lines = []
        for line in open(f):
            try:
                lines.append(json.loads(line))
            except ValueError:  # the last line of a killed attempt
                pass
        files[(rank, gen)] = lines
    return files


def _resumes(out_dir: str) -> list[dict]:
    out = []
    for f in glob.glob(os.path.join(out_dir, "resume_rank*_gen*.json")):
        base = os.path.basename(f)
        rank, gen = int(base.split("_")[1].removeprefix("rank")), int(base.rsplit("gen", 1)[1].split(".")[0])
        try:
            out.append(dict(json.load(open(f)), rank=rank, generation=gen))
        except ValueError:
            pass
    return sorted(out, key=lambda r: (r["generation"], r["rank"]))


class Soak:
    """One soak: a cluster, a reference, schedules."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args, self.argv = args, argv
        self.cfg = dict(PRESETS[args.preset], seed=0)
        self.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        self.out = Path(args.out).resolve()
        self.control = str(self.out / "control")
        self.records: list[dict] = []
        self.json_path = Path(args.json).resolve() if args.json else self.out / "soak.json"
        self.tc = None
        self.logs: LogTail | None = None

    # -- cluster --------------------------------------------------------------------------------
    def start(self) -> None:
        import ray

        from benchmarks.cluster import _TestCluster

        if ray.is_initialized():
            raise SystemExit("cf-ray soak starts its own test cluster: call it without Ray initialised")
        self.out.mkdir(parents=True, exist_ok=True)
        os.makedirs(self.control, exist_ok=True)
        hook = {"worker_process_setup_hook": "benchmarks.soak.probes.install"}
        self.tc = _TestCluster(3, OBJECT_STORE_BYTES, _env(self.control), runtime_env=hook)
        self.logs = LogTail(self.tc.cluster.head_node.get_logs_dir_path())

    def stop(self) -> None:
        if self.tc is not None:
            self.tc.shutdown()

    def _remove_node(self, node_id: str) -> None:
        assert self.tc is not None
        self.tc.cluster.remove_node(self.tc.node(node_id), allow_graceful=False)
        self.tc.nodes_removed += 1

    def _keep_three_nodes(self) -> None:
        import ray

        assert self.tc is not None
        while len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]) < 3:
            self.tc.add()
            self.tc.nodes_added += 1
            self.tc.cluster.wait_for_nodes()

    # -- the reference --------------------------------------------------------------------------
    def reference(self) -> dict:
        import torch

        from cf_ray import demo

        math = {k: self.cfg.get(k, demo.DEFAULTS.get(k)) for k in _MATH} | {"torch": torch.__version__}
        d = self.out / "reference" / _digest(math)
        meta = d / "meta.json"
        if meta.exists():
            return json.loads(meta.read_text())
        shutil.rmtree(d, ignore_errors=True)
        t0 = time.time()
        demo.run("reference", str(d), self._run_cfg(None, str(d)), max_failures=0)
        out = d / "out" / "reference"
        ids = _read_ids(str(out))
        rec = checks.lineage(ids)
        once = checks.exactly_once(rec, rec, self.cfg["samples"], self.cfg["epochs"])
        if not once["ok"]:
            raise RuntimeError(f"the reference run is not exactly once: {once}")
        ref = {
            "dir": str(d),
            "final_state": str(out / "final_state.pt"),
            "digests": state_digests(str(out / "final_state.pt")),
            "lineage": [[r, s, e, ids_] for (r, s), (e, ids_) in sorted(rec.items())],
            "math": math,
            "seconds": time.time() - t0,
        }
        meta.write_text(json.dumps(ref))
        return ref

    def _run_cfg(self, schedule: Schedule | None, root: str) -> dict:
        import pyarrow.fs as pafs

        cfg = {k: v for k, v in self.cfg.items()}
        cfg.update(storage_path=os.path.join(root, "ckpt"), release_after_fit_s=5.0)
        if schedule is not None and schedule.soak_fs:
            cfg["storage_filesystem"] = pafs.PyFileSystem(soak_storage.SoakStorage(self.control))
        return cfg

    # -- one schedule ---------------------------------------------------------------------------
    def _reset_control(self) -> None:
        for sub in ("arm", "at"):
            shutil.rmtree(os.path.join(self.control, sub), ignore_errors=True)
            os.makedirs(os.path.join(self.control, sub))
        for f in glob.glob(os.path.join(self.control, "*")):
            if os.path.isfile(f):
                os.unlink(f)

    def run_schedule(self, seed: int, ref: dict) -> dict:
        from cf_ray import demo

        assert self.logs is not None
        t0, since = time.time(), procs.now_ticks()
        sched = draw(seed, total_steps(self.cfg), kinds=self.kinds)
        name = f"soak{seed}"
        root = str(self.out / "runs" / name)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        self._reset_control()
        paths = RunPaths(name, root, self.control)
        fitted: dict[str, Any] = {}

        def fit() -> None:
            try:
                demo.run(name, root, self._run_cfg(sched, root), max_failures=sched.kills + 2)
            except BaseException as e:  # noqa: BLE001 - recorded: a run that fails is a finding
                fitted["error"] = f"{type(e).__name__}: {e}"

        mon = Monitor(paths, logs=self.logs)
        mark = self.logs.mark()
        trainer = threading.Thread(target=fit, name=f"soak-fit-{seed}", daemon=True)
        mon.start()
        trainer.start()
        inj = Injector(paths, mon, self.logs, trainer.is_alive, self._remove_node)
        faults = [inj.inject(f) for f in sched.faults]
        trainer.join(max(1.0, self.args.timeout - (time.time() - t0)))
        hung = trainer.is_alive()
        if hung:
            self._abort()
            trainer.join(120)
        fit_s = time.time() - t0
        if not hung:
            time.sleep(0.5)  # the final checkpoint's commit reaches the holders (they free what it supersedes)
            mon.final_memory()
        mon.stop()
        soak_storage.clear_rule(self.control)
        for g in glob.glob(os.path.join(self.control, "gate.*")):
            os.unlink(g)
        for f in faults:
            inj.collect(f)
            f["log_lines"] = self.logs.since(f.pop("log_mark", mark), limit=40)
        snap = mon.snapshot()
        snap["stalls"] = mon.stalls(STALL_S)
        rec = self._check(seed, sched, paths, ref, snap, faults, fitted.get("error"), hung)
        if not rec["ok"]:
            rec["log_lines"] = self.logs.since(mark, limit=80)
        rec["durations"] = {"fit_s": round(fit_s, 1), "total_s": round(time.time() - t0, 1)}
        leftovers = self._wait_actors_gone(name)
        if leftovers:
            rec["leftover_actors"] = leftovers
        rec["checks"]["no_orphans"] = orphans = self._orphans(leftovers, since)
        if not orphans["ok"]:
            rec["ok"] = False
            rec.setdefault("log_lines", self.logs.since(mark, limit=80))
        self._keep_three_nodes()
        rec["durations"]["with_cleanup_s"] = round(time.time() - t0, 1)
        if rec["ok"] and not self.args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            rec["kept"] = root
        return rec

    def safe_schedule(self, seed: int, ref: dict) -> dict:
        """:meth:`run_schedule`; an error of the soak itself (not of the run) is recorded as such, the
        run is ended and the cluster put back in shape, and the soak goes on."""
        t0 = time.time()
        try:
            return self.run_schedule(seed, ref)
        except Exception as e:  # noqa: BLE001 - recorded: the soak goes on with the next seed
            import traceback

            self._abort()
            self._wait_actors_gone(f"soak{seed}")
            self._keep_three_nodes()
            return {
                "seed": seed,
                "ok": False,
                "soak_error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
                "faults": [],
                "checks": {},
                "durations": {"with_cleanup_s": round(time.time() - t0, 1)},
            }

    def _check(self, seed, sched, paths, ref, mon, faults, fit_error, hung) -> dict:
        from cf_ray import demo

        out = paths.out
        result = None
        if os.path.exists(os.path.join(out, "result.json")):
            result = json.load(open(os.path.join(out, "result.json")))
        resumes = _resumes(out)
        final = os.path.join(out, "final_state.pt")
        res: dict[str, Any] = {}
        steps = total_steps(self.cfg)
        finished = result is not None and result.get("steps") == steps and not fit_error and not hung
        res["finished"] = {"ok": finished, "error": fit_error, "hung": hung, "steps": result and result.get("steps")}
        if os.path.exists(final):
            digests = state_digests(final)
            res["bitwise"] = {"ok": demo.states_equal(ref["final_state"], final), "digests": digests}
        else:
            res["bitwise"] = {"ok": False, "digests": None, "why": "no final state (the run did not finish)"}
        reference = {(r, s): (e, i) for r, s, e, i in ref["lineage"]}
        rec = checks.lineage(_read_ids(out))
        res["exactly_once"] = checks.exactly_once(rec, reference, self.cfg["samples"], self.cfg["epochs"])
        listed, quarantined, problems = self._storage_state(paths.ckpt_root)
        damaged = {f["landed"]["step"] for f in faults if f["kind"] == "file_flip" and "step" in f["landed"]}
        res["committed_kept"] = checks.committed_kept(
            mon["committed_seen"],
            listed,
            quarantined,
            problems,
            self.cfg["keep_last"],
            damaged,
            self.cfg.get("milestone_every"),
        )
        workers: dict[int, dict[int, int]] = {}  # generation -> rank -> pid, as the monitor saw them placed
        for p in mon["placements"]:
            for rank, (pid, _node, gen) in p["workers"].items():
                workers.setdefault(int(gen), {}).setdefault(int(rank), int(pid))
        run = {
            "resumes": resumes,
            "result": result,
            "fit_error": fit_error,
            "quarantined": quarantined,
            "workers": workers,
        }
        for f in faults:
            f.update(checks.judge(f, run))
        silent = [f["id"] for f in faults if f["outcome"] == "silent"]
        stalls = [dict(x, lines=(x["lines"] or [])[:5]) for x in mon["stalls"]]
        quiet = [x for x in stalls if not x["lines"]]
        res["no_silent"] = {"ok": not silent and not quiet, "silent": silent, "silent_stalls": quiet, "stalls": stalls}
        sizes: dict[str, int] = {}
        for s in mon["memory"]:
            for sec, d in s["sections"].items():
                sizes[sec] = max(sizes.get(sec, 0), d["slot_size"])
        res["memory"] = checks.memory_bounded(mon, sizes)
        res["memory"]["slot_sizes"] = sizes
        ok = all(c["ok"] for c in res.values())
        return {
            "seed": seed,
            "name": paths.name,
            "ok": ok,
            "schedule": sched.as_dict(),
            "faults": faults,
            "checks": res,
            "resumes": resumes,
            "committed_seen": {str(k): v for k, v in sorted(mon["committed_seen"].items())},
            "committed_end": listed,
            "quarantined": {str(k): v for k, v in quarantined.items()},
            "generations": max((r["generation"] for r in resumes), default=0),
            "failures_reported": (result or {}).get("failures"),
            "monitor_errors": mon["errors"],
            "placements": mon["placements"][-3:],
        }

    @staticmethod
    def _storage_state(ckpt_root: str) -> tuple[list[int], dict[int, str], dict[int, list[str]]]:
        from cf_ray._engine.format.catalog import list_committed
        from cf_ray._engine.storage.backends import open_storage
        from cf_ray._verify import verify_run
        from cf_ray.load import open_run, quarantined_checkpoints

        if not os.path.isdir(ckpt_root):
            return [], {}, {}
        try:  # every full checkpoint on storage (list_checkpoints shows the final step's as the final model)
            listed = sorted(c.step for c in list_committed(open_run(ckpt_root)[0], skip_quarantined=True))
        except Exception:  # noqa: BLE001 - nothing committed
            listed = []
        try:
            quarantined = {int(k): str(v) for k, v in quarantined_checkpoints(ckpt_root).items()}
        except Exception:  # noqa: BLE001
            quarantined = {}
        problems: dict[int, list[str]] = {}
        try:
            for c in verify_run(open_storage(ckpt_root)):
                if c.problems and not c.vanished and c.kind != "final":
                    problems.setdefault(c.step, []).extend(c.problems)
        except Exception as e:  # noqa: BLE001 - nothing to verify
            if listed:
                problems[-1] = [repr(e)]
        return listed, quarantined, problems

    def _raylets(self) -> set[str]:
        """The pids of the soak cluster's live raylets (a spare's claim and process name theirs)."""
        assert self.tc is not None
        return {
            str(proc.pid)
            for node in self.tc.cluster.list_all_nodes()
            for kind, proc in node.live_processes()
            if kind == "raylet"
        }

    def _orphans(self, actors: list[str], since_ticks: int, timeout_s: float = 15.0) -> dict:
        """:func:`checks.no_orphans` once the run's spare processes had ``timeout_s`` to go (a rank's
        ``finish()`` ends its spare; one being made is ended when it is found); then whatever is left
        is ended and its claim removed (recorded), so that the next schedule starts without it."""
        import ray

        job, tmp, raylets = ray.get_runtime_context().get_job_id(), tempfile.gettempdir(), self._raylets()

        def left() -> tuple[list[dict], list[int]]:
            return procs.job_spares(job, tmp, raylets), procs.idle_workers_of_job(job, since_ticks, raylets)

        deadline = time.time() + timeout_s
        claims, idle = left()
        while (claims or idle) and time.time() < deadline:
            time.sleep(0.5)
            claims, idle = left()
        got = checks.no_orphans(actors, claims, idle)
        if claims or idle:
            got["ended"] = {str(p): procs.signal_pid(p) for p in got["spare_processes"]}
            for c in claims:
                with contextlib.suppress(OSError):
                    os.unlink(c["file"])
        return got

    @staticmethod
    def _abort() -> None:
        """A run that did not end within the timeout: its Ray Train controller and workers are killed."""
        from benchmarks.soak import procs

        for a in procs.alive_actors():
            if a.cls in ("TrainController", "RayTrainWorker"):
                procs.signal_pid(a.pid)

    def _wait_actors_gone(self, name: str, timeout_s: float = 20.0) -> list[str]:
        import ray

        def mine() -> list[str]:
            return [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith((f"cf_ray.controller.{name}-", f"cf_ray.holder.{name}-"))
            ]

        deadline = time.time() + timeout_s
        while time.time() < deadline and mine():
            time.sleep(0.25)
        left = mine()
        for n in left:
            try:
                ray.kill(ray.get_actor(n, namespace="cf_ray"), no_restart=True)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        return left

    # -- the whole soak -------------------------------------------------------------------------
    def seeds(self) -> list[int]:
        if self.args.seed:
            return list(self.args.seed)
        return list(range(self.args.first, self.args.first + self.args.seeds))

    def write(self, ref: dict, t_start: float, done: bool) -> dict:
        import ray
        import torch

        import cf_ray
        from benchmarks.bench import _host

        doc = {
            "schema": SCHEMA,
            "meta": {
                "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "command": "cf-ray soak " + shlex.join(self.argv),
                "preset": self.args.preset,
                "config": self.cfg,
                "kinds": list(self.kinds),
                "host": _host(),
                "versions": {"cf_ray": cf_ray.__version__, "ray": ray.__version__, "torch": torch.__version__},
                "commit": _commit(),
                "loadavg": os.getloadavg(),
                "wall_s": round(time.time() - t_start, 1),
                "complete": done,
            },
            "reference": {k: ref[k] for k in ("digests", "math", "seconds", "dir")},
            "summary": report.summarise(self.records),
            "schedules": self.records,
        }
        tmp = f"{self.json_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, default=str)
        os.replace(tmp, self.json_path)
        return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    from benchmarks.bytecode import precompile

    precompile()  # every run's workers import cf_ray: not compiled again in each
    soak = Soak(args, argv)
    bad = [k for k in soak.kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"unknown fault kind(s) {bad}: use some of {', '.join(KINDS)}")
    t_start = time.time()
    soak.start()
    try:
        ref = soak.reference()
        print(
            f"cf_ray soak: {len(soak.seeds())} schedules, preset {args.preset}; reference {ref['digests']}", flush=True
        )
        for seed in soak.seeds():
            rec = soak.safe_schedule(seed, ref)
            soak.records.append(rec)
            print(report.line(rec), flush=True)
            soak.write(ref, t_start, done=False)
        doc = soak.write(ref, t_start, done=True)
    finally:
        soak.stop()
    text = report.render(doc)
    (soak.out / "soak.md").write_text(text + "\n")
    print(text)
    print(f"JSON: {soak.json_path}")
    return 0 if all(r["ok"] for r in soak.records) else 1


__all__ = ["PRESETS", "Soak", "main", "parser", "total_steps"]
