"""demo's training loop with what the spare-process test observes, from outside cf_ray's code.

``monkeypatch.setattr(demo, "train_loop_per_worker", spare_loop.loop)`` before ``demo.run``: each
rank writes its process id per attempt (``pid_rank{r}_gen{g}.json``) once restored, and the spare
it holds when it finishes (``spare_rank{r}_at_finish.json``); the rank that SIGKILLs itself
(demo's ``kill_after_handoff`` waits for the snapshot there) first waits until every rank of its
attempt has its spare process, and writes those spares (``spares.json``): the failure then comes
when the spares are there, as it does in a run that fails minutes in.
Importable by Ray's worker processes (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import cf_ray
from cf_ray import demo
from cf_ray._engine.worker.link import ray_train_spare


def loop(config: dict) -> None:
    out = config["out_dir"]
    restore, wait_snapshot, finish = (
        cf_ray.Checkpointer.restore,
        cf_ray.Checkpointer.wait_snapshot,
        cf_ray.Checkpointer.finish,
    )

    def restored(self):
        resume = restore(self)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"pid_rank{self.rank}_gen{self.generation}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "generation": self.generation}, f)
        return resume

    def spares_then_snapshot(self, timeout=None):
        spares = ray_train_spare._Me().dir
        deadline = time.monotonic() + 120
        records: list[dict] = []
        while time.monotonic() < deadline:
            ranks = {json.loads(p.read_text())["pid"] for p in Path(out).glob(f"pid_rank*_gen{self.generation}.json")}
            records = [r for r in (json.loads(p.read_text()) for p in spares.glob("*.json")) if r["for_pid"] in ranks]
            if len(ranks) == self.world_size and len(records) >= self.world_size:
                break
            time.sleep(0.2)
        with open(os.path.join(out, "spares.json"), "w") as f:
            json.dump(records, f)
        return wait_snapshot(self, timeout)

    def finished(self):
        self._restorer.spare.wait_ready(120)  # the spare made again after the restart is there
        with open(os.path.join(out, f"spare_rank{self.rank}_at_finish.json"), "w") as f:
            json.dump({"record": self._restorer.spare.record, "dir": str(ray_train_spare._Me().dir)}, f)
        return finish(self)

    cf_ray.Checkpointer.restore = restored
    cf_ray.Checkpointer.wait_snapshot = spares_then_snapshot
    cf_ray.Checkpointer.finish = finished
    # cf_ray asks for a spare 45 s after a restore, out of a real run's first minute; this run lasts
    # seconds, and the test is about what happens once the spares are there (twice: before the kill
    # and after the restart), not when they are asked for.
    ray_train_spare.FIRST_DELAY_S = 2.0
    demo.train_loop_per_worker(config)


def loop_ends_while_made(config: dict) -> None:
    """demo's loop where the run ends while rank 0's spare is being made: the spare is asked for at
    once (``FIRST_DELAY_S`` 0 in this worker), and rank 0 does not find it before its ``finish()``
    (as a loaded raylet that starts it late): its look-up sees the process (``made_rank0.json``: its
    pid, start, the job, raylet, spares' directory and the run's environment variables) and leaves it
    unclaimed; ``finish()`` comes once the process is there. Rank 1 makes no spare."""
    out = config["out_dir"]
    finish = cf_ray.Checkpointer.finish
    claim = ray_train_spare._claim
    made = os.path.join(out, "made_rank0.json")
    ray_train_spare.FIRST_DELAY_S = 0.0

    def unclaimed(me, since_ticks, rank, run=""):
        if os.path.exists(made):
            return None
        record = claim(me, since_ticks, rank, run)
        if record is not None:  # seen, and left as if not found yet
            (me.dir / f"{record['pid']}.json").unlink()
            with open(made + ".tmp", "w") as f:
                json.dump(dict(record, job=me.job, raylet=me.raylet, dir=str(me.dir), env_vars=me.env_vars), f)
            os.replace(made + ".tmp", made)
        return None

    def finished(self):
        deadline = time.monotonic() + 120
        while self.rank == 0 and not os.path.exists(made) and time.monotonic() < deadline:
            time.sleep(0.2)
        return finish(self)

    import ray.train

    os.makedirs(out, exist_ok=True)
    if ray.train.get_context().get_world_rank() == 0:
        ray_train_spare._claim = unclaimed
    else:
        ray_train_spare.FIRST_DELAY_S = 3600.0  # none within the run
    cf_ray.Checkpointer.finish = finished
    demo.train_loop_per_worker(config)
