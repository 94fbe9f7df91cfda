"""Builds notebooks/automatic_frequency.ipynb from the cells below (run it after editing them)."""

import os

import nbformat as nbf

CELLS = [
    ("md", """# Automatic checkpoint frequency with cf_ray

A small `TorchTrainer` run on a local Ray cluster, with `cf_ray.Adaptive`: the controller measures
iteration time, the stall each checkpoint costs the training thread and the persist time, on every
rank, and picks the shortest interval whose overhead stays within the budget. Then the same job
with a tighter budget, and what changed.

Runs top to bottom on a laptop (2 CPU workers). `CF_RAY_NOTEBOOK_SMALL=1` makes it smaller (CI)."""),
    ("code", """import os, tempfile
import ray
import cf_ray
from cf_ray import demo, report

SMALL = os.environ.get("CF_RAY_NOTEBOOK_SMALL") == "1"
root = tempfile.mkdtemp(prefix="cf_ray_notebook_")
job = dict(policy="adaptive", samples=6400 if SMALL else 25600, epochs=1, hidden=512, depth=3, batch_size=16)
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)"""),
    ("md", "## A run with the default budget (5 % of training time)"),
    ("code", """demo.run("budget5", root, dict(job, budget_pct=5.0))
run5 = cf_ray.Run(os.path.join(root, "storage"), "budget5")  # RunConfig(storage_path, name) of the job
profile5 = run5.profile()
profile5[["step", "kind", "interval", "stall_s", "copy_s", "persist_s", "bytes", "overhead_pct", "committed", "where"]]"""),
    ("md", """One row per checkpoint: the interval in force when it was taken, the training-thread stall
(synchronous part plus the guard's wait for the background copy), the background copy, the persist
(phase 2, in the holder actor) and the overhead the policy measured. The first checkpoint comes at
step 5, before anything is known; the interval is then tuned from measurements. The workers send
their timings every quarter of a second (`CF_RAY_POLL_INTERVAL_S`), so with iterations of a few tens
of milliseconds the first tuned interval comes a few dozen steps in."""),
    ("code", """fig = report.plot_profile(profile5, run5.iterations(), budget_pct=5.0)"""),
    ("md", "## The same job with a 1 % budget"),
    ("code", """demo.run("budget1", root, dict(job, budget_pct=1.0))
profile1 = cf_ray.Run(os.path.join(root, "storage"), "budget1").profile()
summary = {
    "budget 5 %": {"final interval": int(profile5["interval"].iloc[-1]), "checkpoints": len(profile5),
                   "median overhead %": float(profile5["overhead_pct"].median())},
    "budget 1 %": {"final interval": int(profile1["interval"].iloc[-1]), "checkpoints": len(profile1),
                   "median overhead %": float(profile1["overhead_pct"].median())},
}
import pandas as pd
pd.DataFrame(summary).T"""),
    ("md", """A tighter budget means fewer checkpoints: the interval grows until the measured overhead
fits. `cf_ray.Run` asks the run's controller while it is alive, and reads the profile saved with the
run (`profile.parquet` under `<storage_path>/<name>/cf_ray/`) afterwards: the same call works later,
by run name, after the cluster is gone."""),
    ("code", """assert summary["budget 1 %"]["checkpoints"] < summary["budget 5 %"]["checkpoints"]
ray.shutdown()"""),
]


def main() -> None:
    nb = nbf.v4.new_notebook()
    nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "automatic_frequency.ipynb")
    nbf.write(nb, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
