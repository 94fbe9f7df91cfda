"""Where the seconds of a recovery go (issue #46): a real ``TorchTrainer`` job (2 workers, gloo, DDP)
in which rank 1 SIGKILLs itself right after a snapshot reached its holder, ``--kills`` times in one
``fit()``, and Ray Train restarts the group. Each recovery, from the kill to the first resumed
step, is cut into parts from timestamps that are observable without touching Ray:

* ``detect``: the kill to the Ray Train controller leaving ``RUNNING`` (its health-check poll saw
  the dead actor) — a Ray Train callback in the controller records every state change;
* ``teardown``: to the old worker group's shutdown done (process group destroyed, actors killed,
  placement group removed);
* ``reschedule``: to the new group's start (the controller's state machine);
* ``placement``: to the new rank processes created (their ``/proc`` start time; a process that
  Ray had started before, as an idle worker, makes this part negative, kept as measured: a spare
  process cf_ray made ready, ``cf_ray/_engine/worker/link/ray_train_spare.py``);
* ``actor_start``: to the new actors answering (Python and Ray started, Ray Train's worker made);
* ``process_group``: to the new group started (train context, ``init_process_group``);
* ``launch``: to the training function running on rank 0;
* ``imports``, ``model``, ``checkpointer``: the user's set-up before ``restore()`` on rank 0 (its
  imports of torch, Ray Train and cf_ray; the model wrapped in DDP and its optimizer; the
  ``Checkpointer``);
* ``restore``: cf_ray's ``restore()`` on rank 0 (its own phases beside it);
* ``first_step``: the first resumed step, to its end on rank 0.

``python -m benchmarks.recovery_breakdown --json benchmarks/results/recovery-DATE.json`` runs it with
the demo's model and the 302 MB state, each under every ``--settings`` (``ray``: Ray Train's defaults;
``cf_ray``: what cf_ray sets when it is imported in the driver, and the spare worker process each
rank keeps; ``cf_ray_no_spare``: the same without the spare) in one Ray session, and prints the
table of medians. With a spare, the rank that kills itself first waits until every rank's spare is
there and settled (a failure minutes into a run finds them ready); the ``spare`` column counts the
recoveries whose rank 0 ran in one. ``RAY_preload_python_modules`` (Ray's node setting, read by
``ray.init``) makes every worker process import those modules before it takes work, a spare too. The machine's load is printed beside it: figures from a shared machine are
marked so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

MODELS = {
    # the demo's model (cf_ray.demo.DEFAULTS: 3 x Linear(256) on 32 inputs) and its batch
    "demo": {"kind": "demo", "batch": 16},
    # the benchmark's reference job: 6 x Linear(2048) + Adam, 302 MB of state per rank
    "302mb": {"kind": "linear", "width": 2048, "layers": 6, "batch": 32},
}

PARTS = (
    "detect",
    "teardown",
    "reschedule",
    "placement",
    "actor_start",
    "process_group",
    "launch",
    "imports",
    "model",
    "checkpointer",
    "restore",
    "first_step",
)


class Timeline(ControllerCallback, WorkerGroupCallback):
    """Ray Train callback (in the controller process): appends each state change and each worker
    group start and shutdown, with the wall time, to a JSON-lines file."""

    def __init__(self, path: str):
        self.path = path

    def _log(self, event: str, **kw: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"ev": event, "t": time.time(), **kw}) + "\n")

    def after_controller_state_update(self, previous_state, current_state) -> None:
        self._log("state", prev=type(previous_state).__name__, next=type(current_state).__name__)

    def before_init_train_context(self, workers) -> dict:  # noqa: ARG002 - Ray's hook signature
        self._log("actors_ready")
        return {}

    def before_worker_group_start(self, worker_group_context) -> None:  # noqa: ARG002 - Ray's hook signature
        self._log("group_start_begin")

    def after_worker_group_start(self, worker_group) -> None:  # noqa: ARG002
        self._log("group_started")

    def before_worker_group_shutdown(self, worker_group) -> None:  # noqa: ARG002
        self._log("group_shutdown_begin")

    def after_worker_group_shutdown(self, worker_group_context) -> None:  # noqa: ARG002
        self._log("group_shutdown_done")


def _loop(cfg: dict) -> None:
    fn_t = time.time()
    import ray.train
    import ray.train.torch
    import torch

    import cf_ray
    from cf_ray._engine.worker.link import ray_train_spare
    from cf_ray._engine.worker.restore.restorer import process_start_unix

    imported_t = time.time()
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    out = Path(cfg["out_dir"])
    torch.manual_seed(0)
    m = cfg["model"]
    if m["kind"] == "demo":
        from cf_ray import demo

        model = demo.build_model(dict(demo.DEFAULTS))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(m["batch"], demo.DEFAULTS["dim"], generator=g), torch.randn(m["batch"], 1, generator=g)
    else:
        from benchmarks.savers import _build_model

        model = _build_model(m["width"], m["layers"])
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(m["batch"], m["width"], generator=g), torch.randn(m["batch"], m["width"], generator=g)
    model = ray.train.torch.prepare_model(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model_t = time.time()
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": opt},
        config=cf_ray.CheckpointConfig(
            policy=cf_ray.FixedInterval(every=cfg["interval"], persist_every=1), keep_last=2, final_model=None
        ),
    )
    restore_t = time.time()
    resume = ckpt.restore()
    restored_t = time.time()
    kills = len(list(out.glob("kill_*.json")))
    step, first_t = resume.step, None
    while step < cfg["steps"]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ckpt.step(opt)
        opt.zero_grad()
        step = ckpt.step_count
        if first_t is None:
            first_t = time.time()
            rec = {
                "rank": rank,
                "gen": resume.generation,
                "source": resume.source,
                "step": resume.step,
                "proc_start": process_start_unix(),
                "fn": fn_t,
                "imported": imported_t,
                "model": model_t,
                "restore_begin": restore_t,
                "restore_end": restored_t,
                "first_step": first_t,
                "restore_s": resume.seconds,
                "phases": resume.phases,
                "pid": os.getpid(),
                "spare": ray_train_spare.arrival(restart=resume.generation > 1),
            }
            with open(out / f"attempt_rank{rank}_gen{resume.generation}.json", "w") as f:
                json.dump(rec, f)
        if rank == 1 and kills < cfg["kills"] and step >= resume.step + cfg["gap"] and step % cfg["interval"] == 0:
            ckpt.wait_snapshot()  # the snapshot of this step is in the holder: the restore is from memory
            _wait_spares(2)
            with open(out / f"kill_{kills:03d}.json", "w") as f:
                json.dump({"t": time.time(), "step": step, "gen": resume.generation}, f)
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.finish()


def _wait_spares(ranks: int, timeout_s: float = 120.0) -> None:
    """With spares on, until every rank of the node has its spare and each has settled (its CPU
    time unchanged for a second: Python, Ray and any preloaded module imported), or ``timeout_s``."""
    from cf_ray._engine.worker.link import ray_train_spare

    if not ray_train_spare.enabled():
        return
    spares, deadline = ray_train_spare._Me().dir, time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(list(spares.glob("*.json"))) < ranks:
        time.sleep(0.2)
    pids = [int(p.stem) for p in spares.glob("*.json")]

    def cpu() -> list[int]:
        out = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out.append(int(fields[11]) + int(fields[12]))
            except (OSError, IndexError, ValueError):
                out.append(-1)
        return out

    last, still = cpu(), 0
    while time.monotonic() < deadline and still < 4:
        time.sleep(0.25)
        now = cpu()
        still, last = (still + 1 if now == last else 0), now


def breakdown(timeline: list[dict], kills: list[dict], attempts: list[dict]) -> list[dict]:
    """One row per kill: the parts (seconds) between the observed timestamps, and the total."""
    rows = []
    for kill in sorted(kills, key=lambda k: k["t"]):
        t = kill["t"]

        def first(pred, after: float) -> float | None:
            return next((e["t"] for e in timeline if e["t"] >= after and pred(e)), None)

        # every poll of a healthy group is a RUNNING -> RUNNING update: the first other one is the failure seen
        detect = first(lambda e: e["ev"] == "state" and e["prev"] == "RunningState" and e["next"] != "RunningState", t)
        shut = first(lambda e: e["ev"] == "group_shutdown_done", t)
        begin = first(lambda e: e["ev"] == "group_start_begin", t)
        ready = first(lambda e: e["ev"] == "actors_ready", t)
        started = first(lambda e: e["ev"] == "group_started", t)
        gen = kill["gen"] + 1
        ranks = [a for a in attempts if a["gen"] == gen]
        r0 = next((a for a in ranks if a["rank"] == 0), None)
        if None in (detect, shut, begin, ready, started) or r0 is None:
            rows.append({"kill_t": t, "incomplete": True})
            continue
        procs = max(a["proc_start"] for a in ranks)
        marks = [
            t,
            detect,
            shut,
            begin,
            procs,
            ready,
            started,
            r0["fn"],
            r0["imported"],
            r0["model"],
            r0["restore_begin"],
            r0["restore_end"],
            r0["first_step"],
        ]
        row: dict[str, Any] = {p: round(b - a, 3) for p, a, b in zip(PARTS, marks, marks[1:])}
        row.update(
            total=round(r0["first_step"] - t, 3),
            source=r0["source"],
            restored_step=r0["step"],
            killed_step=kill["step"],
            phases={k: round(v, 4) for k, v in r0["phases"].items()},
            processes_reused=any(a["proc_start"] < t for a in ranks),
            spare=r0.get("spare"),
        )
        rows.append(row)
    return rows


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


SETTINGS = {
    # Ray Train's own defaults, set (not removed: Ray's processes inherit the driver's environment of
    # ray.init, where cf_ray's values were already set by its import)
    "ray": {"CF_RAY_RAY_TRAIN_DEFAULTS": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"},
    # what cf_ray sets (cf_ray._engine.worker.link.ray_train_fast): nothing to do but import cf_ray in the driver
    "cf_ray": {},
    # the same, without the spare worker processes (ray_train_spare.py)
    "cf_ray_no_spare": {},
}
WORKER_ENV = {
    # the workers' environment (their runtime_env): cf_ray's spare is off where it is "0"
    "ray": {"CF_RAY_RAY_TRAIN_DEFAULTS": "0"},
    "cf_ray": {},
    "cf_ray_no_spare": {"CF_RAY_RAY_TRAIN_DEFAULTS": "0"},
}


def run_one(model: str, setting: str, kills: int, root: Path, gap: int, interval: int) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    from cf_ray._engine.worker.link import ray_train_fast

    name = f"{model}-{setting}"
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    saved = dict(os.environ)
    os.environ.update(SETTINGS[setting])
    applied = ray_train_fast.apply_driver_defaults(os.environ)  # what `import cf_ray` did, again for this setting
    cfg = {
        "out_dir": str(out),
        "model": MODELS[model],
        "kills": kills,
        "gap": gap,
        "interval": interval,
        "steps": (kills + 1) * (gap + interval) + 2 * interval,
    }
    try:
        TorchTrainer(
            _loop,
            train_loop_config=cfg,
            scaling_config=ray.train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=ray.train.RunConfig(
                name=name,
                storage_path=str(root / "storage"),
                failure_config=ray.train.FailureConfig(max_failures=kills + 2),
                callbacks=[Timeline(str(out / "timeline.jsonl"))],
                worker_runtime_env={"env_vars": WORKER_ENV[setting]},
            ),
        ).fit()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    kill_recs = [json.loads(p.read_text()) for p in sorted(out.glob("kill_*.json"))]
    attempts = [json.loads(p.read_text()) for p in sorted(out.glob("attempt_rank*_gen*.json"))]
    rows = breakdown(_read(out / "timeline.jsonl"), kill_recs, attempts)
    return {"model": model, "setting": setting, "env": applied, "rows": rows}


def medians(rows: list[dict]) -> dict:
    done = [r for r in rows if not r.get("incomplete")]
    return {p: round(statistics.median(r[p] for r in done), 3) for p in (*PARTS, "total")} if done else {}


def render(res: dict) -> str:
    head = "| model | settings | kills | " + " | ".join(PARTS) + " | total (min-max) | source | spare |"
    lines = [head, "|" + "---|" * (len(PARTS) + 6)]
    for run in res["runs"]:
        med = run["medians"]
        done = [r for r in run["rows"] if not r.get("incomplete")]
        if not med:
            lines.append(
                f"| {run['model']} | {run['setting']} | 0 | " + " | ".join("-" for _ in PARTS) + " | - | - | - |"
            )
            continue
        totals = [r["total"] for r in done]
        srcs = ",".join(sorted({r["source"] for r in done}))
        lines.append(
            f"| {run['model']} | {run['setting']} | {len(done)} | "
            + " | ".join(f"{med[p]:.2f}" for p in PARTS)
            + f" | **{med['total']:.2f}** ({min(totals):.2f}-{max(totals):.2f}) | {srcs}"
            + f" | {sum(r.get('spare') == 'taken' for r in done)}/{len(done)} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recovery_breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="demo,302mb", help="demo, 302mb (comma-separated)")
    p.add_argument(
        "--settings", default="ray,cf_ray", help="ray, cf_ray, cf_ray_no_spare (comma-separated; each model under each)"
    )
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs per fit (one recovery each)")
    p.add_argument("--gap", type=int, default=8, help="steps after each restore before the next kill")
    p.add_argument("--interval", type=int, default=5, help="checkpoint every this many steps")
    p.add_argument("--out", default="/tmp/cf_ray_recovery", help="working directory")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    import ray

    from benchmarks.bench import _REPO_ROOT
    from benchmarks.bytecode import precompile

    args = build_parser().parse_args(argv)
    precompile()  # as pip install would: the new processes do not compile cf_ray again at each restart
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": _REPO_ROOT + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": "1"}
    os.environ.update(env)
    load0 = os.getloadavg()
    t0 = time.time()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    runs = []
    try:
        for model in [m for m in args.models.split(",") if m]:
            for setting in [s for s in args.settings.split(",") if s]:
                run = run_one(model, setting, args.kills, root / f"r{len(runs)}", args.gap, args.interval)
                run["medians"] = medians(run["rows"])
                runs.append(run)
                print(f"{model}/{setting}: {run['medians']}", file=sys.stderr)
    finally:
        ray.shutdown()
    res = {
        "command": "python -m benchmarks.recovery_breakdown " + " ".join(argv if argv is not None else sys.argv[1:]),
        "parts": list(PARTS),
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        # Ray's node setting that imports these in every worker process before it takes work (spares too)
        "preload_python_modules": os.environ.get("RAY_preload_python_modules"),
        "wall_s": round(time.time() - t0, 1),
        "runs": runs,
    }
    print(render(res))
    print(f"load average at start {load0[0]:.1f}, at end {res['loadavg_end'][0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
