"""Builds notebooks/automatic_frequency.ipynb from the cells below, executes it and saves it with its outputs.

    .venv/bin/python notebooks/make_notebook.py            # after editing a cell: rebuild, run (~4 min), save

The notebook is committed with its outputs, so that the tables and plots show where the repository
is browsed. ``tests/test_notebooks.py`` checks that they came from the current code: the committed
cells are the ones below, and a fresh execution gives the same outputs in the cells tagged
``deterministic`` and outputs of the same kinds (tables with the same columns, plots) in the others.
What the cells print to stderr (Ray's log lines) is left out of the committed copy, except a
traceback (of a cell or of a thread): it stays, the script exits 1, and the committed copy fails
its test.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import nbformat as nbf

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "automatic_frequency.ipynb")

#: The tag of the code cells whose outputs do not depend on timing: compared exactly with the committed ones.
DETERMINISTIC = "deterministic"

#: (kind, source[, tag]) of every cell, in order.
CELLS = [
    (
        "md",
        """# Automatic checkpoint frequency with cf_ray

A small `TorchTrainer` job on a local Ray cluster (2 CPU workers, about four minutes on a laptop),
written the way you would write your own:

1. **your `train_loop_per_worker`** with a `cf_ray.Checkpointer` and the automatic policy
   `cf_ray.Adaptive`, which measures iteration time, the stall each checkpoint costs the training
   thread and the persist time on every rank, and picks the shortest interval whose overhead stays
   within a budget;
2. **a failure** injected from this notebook: a worker process SIGKILLs itself at a step chosen
   below; Ray Train restarts the workers and cf_ray resumes them where the last checkpoint left off;
3. **the profile table and the plots** of the run, from `cf_ray.Run`: its checkpoints, and where its
   wall time went (productive training and the badput: checkpoint save, restore, wasted progress,
   recovery, start-up);
4. **an interrupted kernel**: the same job with a tighter budget, interrupted mid-run and started
   again, resumes where it was;
5. **the effect of the budget**: the time the job lost to checkpoints under two budgets, against
   the same job without checkpoints, and how many it took; then what `cf-ray bench --budgets`
   measured on jobs long enough for the policy to tune (the guide's figures);
6. the run's checkpoints checked and exported with the `cf-ray` command.""",
    ),
    (
        "code",
        """%matplotlib inline
import json, os, signal, tempfile, threading, time

import pandas as pd
import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import cf_ray
from cf_ray import report

root = tempfile.mkdtemp(prefix="cf_ray_notebook_")
storage_path = os.path.join(root, "runs")  # RunConfig(storage_path=...) of every run below
_ = ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)""",
        DETERMINISTIC,
    ),
    (
        "md",
        """## 1. Your training loop

This is the function you write. cf_ray adds three things to an ordinary DDP loop: a
`Checkpointer` that tracks the model, the optimizer and the sampler's position; `restore()` at the
start, which returns where this attempt resumes (`fresh` the first time); and `step(optimizer)` in
place of `optimizer.step()`. `finish()` at the end writes the consolidated model.

A few lines are there for this notebook only: rank 0 appends where each attempt started to a file
and, at the end, how long its training loop took (the workers' output is not shown here); rank 1
SIGKILLs itself at step `fail_at` in the first attempt: the failure; and `budget_pct=None` runs the
job without a checkpoint before `finish()` (a `FixedInterval` longer than the run), the baseline of
section 5.""",
    ),
    (
        "code",
        """def train_loop_per_worker(config):
    import json, os, signal, time

    import ray.train
    import ray.train.torch
    import torch

    import cf_ray
    from cf_ray.data import ResumableDistributedSampler

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(config["samples"], 32, generator=g)
    dataset = torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(32, 1, generator=g)))
    sampler = ResumableDistributedSampler(dataset, rank=rank, world_size=world, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    budget_pct = config["budget_pct"]  # None: no checkpoint before finish() (for this notebook: the baseline)
    policy = cf_ray.Adaptive(budget_pct=budget_pct) if budget_pct else cf_ray.FixedInterval(every=10**9)
    ckpt = cf_ray.Checkpointer(
        {"model": model, "optimizer": optimizer},
        data={"sampler": sampler},
        config=cf_ray.CheckpointConfig(policy=policy),
    )
    resume = ckpt.restore()  # fresh, or where the last attempt left off (a holder's memory, or storage)
    if rank == 0:  # for this notebook: where each attempt started
        with open(config["attempts_log"], "a") as f:
            f.write(json.dumps({"attempt": resume.generation, "source": resume.source, "step": resume.step}) + "\\n")

    started = time.perf_counter()
    for epoch in range(resume.epoch, config["epochs"]):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            ckpt.step(optimizer)
            optimizer.zero_grad()
            if rank == 1 and ckpt.step_count == config["fail_at"] and resume.generation == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # for this notebook: the failure
        ckpt.end_epoch()
    if rank == 0:  # for this notebook: how long this attempt's training loop took
        with open(config["trained_log"], "w") as f:
            json.dump({"steps": ckpt.step_count, "train_s": time.perf_counter() - started}, f)
    ckpt.finish()""",
        DETERMINISTIC,
    ),
    (
        "md",
        """`fit` below is the usual `TorchTrainer` boilerplate: 2 workers, `RunConfig(storage_path, name)`
names the run (and where its checkpoints go), `FailureConfig(max_failures=2)` lets Ray Train
restart the workers after a failure. `attempts(name)` reads where each attempt started,
`trained(name)` how many steps the run took and how long its last attempt's training loop took.""",
    ),
    (
        "code",
        """def fit(name, **config):
    config = {"samples": 12800, "epochs": 1, "budget_pct": 5.0, "fail_at": None,  # 400 steps per worker
              "attempts_log": os.path.join(root, f"{name}.attempts.jsonl"),
              "trained_log": os.path.join(root, f"{name}.trained.json"), **config}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, name=name, failure_config=FailureConfig(max_failures=2)),
    )
    return trainer.fit()


def attempts(name):
    return pd.read_json(os.path.join(root, f"{name}.attempts.jsonl"), lines=True)


def trained(name):
    with open(os.path.join(root, f"{name}.trained.json")) as f:
        return json.load(f)""",
        DETERMINISTIC,
    ),
    (
        "md",
        """## 2. A failure, and the resume

400 steps per worker with the default budget (5 % of training time); rank 1 is killed at step
`fail_at`. Ray Train restarts both workers, and `ckpt.restore()` in the second attempt returns the
newest checkpoint: from a holder's memory when its snapshot is at least as new as storage's.""",
    ),
    (
        "code",
        """fail_at = 250
result = fit("budget5", budget_pct=5.0, fail_at=fail_at)
attempts("budget5")""",
    ),
    (
        "code",
        """a = attempts("budget5")
print("attempts:", len(a))
print("the second resumed from a checkpoint taken before the failure:", 0 < a["step"].iloc[1] <= fail_at)
print("it ran to the end:", result.error is None)""",
        DETERMINISTIC,
    ),
    (
        "md",
        """## 3. The profile table and the plot

`cf_ray.Run(storage_path, name)` is the run's handle on the driver: while the job runs (and a while
after) it asks the run's controller; later it reads the table the run saved next to its
checkpoints, so the same call works in another session. One row per checkpoint: the interval in
force when it was taken, the training-thread stall, the background copy, the persist (phase 2, in
the holder actor), the overhead the policy measured, and whether it committed.""",
    ),
    (
        "code",
        """run5 = cf_ray.Run(storage_path, "budget5")
profile5 = run5.profile()
profile5[["step", "kind", "generation", "interval", "stall_s", "copy_s", "persist_s", "bytes", "overhead_pct",
          "committed"]]""",
    ),
    (
        "md",
        """The first checkpoint comes at step 5, before anything is known; then the interval is tuned from
measurements (the workers send their timings every quarter of a second, so the first tuned
interval comes a few dozen steps in). Generation 2 is the attempt after the failure. In the plot:
the slowest rank's iteration time, every checkpoint as a vertical line (green: committed), and the
measured overhead against the budget.""",
    ),
    ("code", """fig = report.plot_profile(profile5, run5.iterations(), budget_pct=5.0)"""),
    (
        "md",
        """Where the run's wall time went, as the controller measured it (the categories of Google's ML
Goodput Measurement): productive training, and the badput — the training thread's checkpoint
stalls, the restores, the work redone after the failure, the recovery (Ray Train noticing the
failure and starting the workers again), the start-up. The same figures are the Ray metrics
`cf_ray_productive_seconds` and `cf_ray_badput_seconds{category=...}` while the run lives, and
`goodput.json` next to the profile afterwards. The controller also counted the failure, in a
`failure_rate` event (`run5.events()`, from the controller while the run lives, from storage after
it): how many failures in how much time up. The policy's interval takes the rate into account,
but one failure in a few seconds is an observation, not an estimate of how often a job fails.""",
    ),
    (
        "code",
        """split5 = run5.goodput()
fig = report.plot_badput({"budget5": split5})
rate = [e for e in run5.events() if e.get("event") == "failure_rate"][-1]
print(f"failures counted: {rate['failures']} in {rate['exposure_s']:.0f} s up"
      + (" (too few for a failure rate: the policy reads them as one every "
         f"{rate['exposure_s'] / rate['failures']:.0f} s until more time up says otherwise)" if rate["failures"] < 3 else ""))
report.badput_frame(split5).round(3)""",
    ),
    (
        "md",
        """## 4. Interrupt the kernel, run the cell again: it resumes

The same job with a 1 % budget. **Interrupt the kernel** while the next cell runs
(the ■ button, or `I, I`): Ray Train aborts the fit and stops the workers, and the cell ends with
`SystemExit`. **Run the cell again**: the run's `storage_path` and `name` are the same, so the new
attempt resumes from the newest checkpoint the interrupted one committed, in memory (while the
run's cf_ray controller lingers, `CF_RAY_CONTROLLER_LINGER_S`, 120 s by default) or on storage.

Here a thread presses the button for you: it waits until `cf_ray.Run(...).checkpoints()` lists a
committed checkpoint at step 40 or later, then sends SIGINT to this process, as Jupyter's
interrupt does. The workers train on for the second or so that Ray Train's abort takes, far from
the run's 400 steps. The cell after it is the same cell, run again.""",
    ),
    (
        "code",
        """def press_interrupt(name, past_step, pressed, stop):  # for this notebook: what the ■ button does
    run = cf_ray.Run(storage_path, name)
    while not stop.wait(0.1):  # until the fit below returns
        steps = [c.step for c in run.checkpoints() if c.kind != "final"]  # committed, read from storage
        if steps and max(steps) >= past_step:
            pressed["step"] = max(steps)
            os.kill(os.getpid(), signal.SIGINT)
            return


pressed, stop = {}, threading.Event()
threading.Thread(target=press_interrupt, args=("budget1", 40, pressed, stop), daemon=True).start()
try:
    fit("budget1", budget_pct=1.0)
    print("not interrupted: the run ended before it committed a checkpoint at step 40")
except (KeyboardInterrupt, SystemExit, ray.exceptions.RayActorError) as e:  # without the try: shown as an error
    print(f"interrupted ({type(e).__name__}) once step {pressed['step']} was committed")
finally:
    stop.set()""",
    ),
    (
        "code",
        """result = fit("budget1", budget_pct=1.0)  # the same cell, run again
a = attempts("budget1")
print(f"the new attempt resumed at step {a['step'].iloc[-1]} of {trained('budget1')['steps']}, "
      f"from {a['source'].iloc[-1]}")
a""",
    ),
    (
        "code",
        """a = attempts("budget1")
print("attempts:", len(a))
print("the second resumed mid-run, from a checkpoint the interrupted one committed:",
      0 < a["step"].iloc[1] < trained("budget1")["steps"])
print("it ran to the end:", result.error is None)""",
        DETERMINISTIC,
    ),
    (
        "md",
        """## 5. The effect of the budget

The budget bounds the training time that checkpoints cost: under `Adaptive(budget_pct=5)` the job
should train at most about 5 % longer than the same job without checkpoints, and a tighter budget
should mean fewer checkpoints (a longer interval), not a slower job. The runs above cannot show it
(one had a failure, the other an interruption), so the same job runs again without either, in
three settings: with no checkpoint before `finish()` (`budget_pct=None`), the baseline, and with
budgets of 5 % and 1 %. Rank 0 times its training loop (the first step to the last; start-up and `finish()`
left out), and each run's overhead is its time over the baseline's.

Each setting runs twice, the rounds in opposite orders, and the faster of its two runs counts:
whatever else runs on the machine only ever adds time. Runs of 400 steps (a few seconds each) are
still a rough measure: a few points of noise either way are likely on a shared machine, and the
policy starts at an interval of 5 steps and measures before it sets its own, which a run of a few
seconds may end before (the intervals in the table say whether it did). The benchmarks in
`benchmarks/` measure overheads over many interleaved rounds, with confidence intervals.""",
    ),
    (
        "code",
        """settings = {"no checkpoints": None, "budget 5 %": 5.0, "budget 1 %": 1.0}
runs = {label: [] for label in settings}
for round_, order in enumerate((list(settings), list(settings)[::-1])):
    for label in order:
        name = f"{label.replace(' ', '').replace('%', '')}-{round_}"  # e.g. budget5-1
        fit(name, budget_pct=settings[label])
        profile = cf_ray.Run(storage_path, name).profile()
        scheduled = profile[profile["kind"] == "scheduled"]  # the policy's checkpoints (not finish()'s)
        runs[label].append({"train_s": trained(name)["train_s"], "checkpoints": int(scheduled["step"].nunique()),
                            "interval": scheduled["interval"].median()})
baseline_s = min(r["train_s"] for r in runs["no checkpoints"])
effects = pd.DataFrame.from_dict(
    {label: {"budget %": settings[label],
             "checkpoints (each run)": ", ".join(str(r["checkpoints"]) for r in rs),
             "median interval (each run)": ", ".join("-" if pd.isna(r["interval"]) else f"{r['interval']:g}" for r in rs),
             "training time (s, faster run)": round(min(r["train_s"] for r in rs), 2),
             "overhead % (vs no checkpoints)": round(100 * (min(r["train_s"] for r in rs) / baseline_s - 1), 1)}
     for label, rs in runs.items()},
    orient="index")
effects""",
    ),
    (
        "code",
        """o5, o1 = (effects.loc[f"budget {b} %", "overhead % (vs no checkpoints)"] for b in (5, 1))
c5, c1 = ([r["checkpoints"] for r in runs[f"budget {b} %"]] for b in (5, 1))
print(f"training time over the baseline's: {o5:+.1f} % under the 5 % budget, {o1:+.1f} % under the 1 % one "
      "(the faster of two runs each, on a machine shared with whatever else runs)")
print("each within its budget:", o5 <= 5 and o1 <= 1)
print(f"the tighter budget took fewer checkpoints in both rounds: {all(a < b for a, b in zip(c1, c5))} "
      f"({c1} vs {c5})")""",
    ),
    (
        "md",
        """Runs this short say little about the budget: a few seconds of training end before the policy has
measured a checkpoint's cost against iterations with nothing in flight, so the interval stays at or
near its first 5 steps and the overhead above is that interval's, not the budget's. What the budget
does on jobs long enough to tune is measured by `cf-ray bench --budgets` (two jobs: a 302 MB DDP
model at ~0.35 s per iteration and a 50 MB MLP at ~75 ms; budgets 2, 5 and 20 %; five rounds, each
fit beside the same job without cf_ray in the same Ray session, on a quiet 2-core machine). The
cell below reads its committed results, the same files and figures as the
[choosing-when-to-checkpoint guide](../docs/guides/choosing-when-to-checkpoint.md): the interval each
round settled on, the overhead the job paid after warm-up against its round's fit without cf_ray
(and against its round's fit with cf_ray attached and no checkpoint), and the overhead cf_ray
reported (`explain()["measured_overhead_pct"]`), then each target's verdict. This is the run of
the rules in force now (the CPU a checkpoint's background work takes from busy cores, and the
training thread's extra wait for a core while it runs, counted in its cost; a cost no comparison
measured never shortens the interval): both jobs, every budget, the kill arms, and in every round a fit with cf_ray attached
that takes no checkpoint (what cf_ray costs beside its checkpoints, and how far one fit scatters
from the next on this machine).""",
    ),
    (
        "code",
        """import pathlib

results = pathlib.Path(cf_ray.__file__).resolve().parents[1] / "benchmarks" / "results"
name = "budgets-full-2026-12-08.json"
bench = json.loads((results / name).read_text())
for shape, base in bench["baseline"].items():
    print(f"{name}: {shape} without cf_ray {1e3 * base['iter_s_mean']:.1f} ms per iteration, "
          f"{base['spread_pct']:.1f} % apart over the rounds")
for shape, attached in bench["attached_no_checkpoint"].items():
    print(f"    {shape} with cf_ray attached and no checkpoint: {attached['mean_pct']:+.1f} % on average")
for key, verdict in bench["verdicts"].items():
    print(f"    {key}: {'met' if verdict['met'] else 'missed'}")
fits = sorted((t for t in bench["table"] if t["arm"].startswith("b")), key=lambda t: (t["budget"], t["round"]))
bench_rows = []
for shape, budget in dict.fromkeys((t["shape"], t["budget"]) for t in fits):
    ts = [t for t in fits if (t["shape"], t["budget"]) == (shape, budget)]
    bench_rows.append({"job": shape, "budget %": budget,
                       "interval (each round)": ", ".join(str(t["interval"]) for t in ts),
                       "paid % after warm-up": ", ".join(f"{t['overhead_after_warmup_pct']:+.1f}" for t in ts),
                       "paid % vs cf_ray attached": ", ".join(f"{t['over_attached_after_warmup_pct']:+.1f}" for t in ts),
                       "reported %": ", ".join(f"{t['measured_overhead_pct']:+.1f}" for t in ts)})
pd.DataFrame(bench_rows)""",
        DETERMINISTIC,
    ),
    (
        "md",
        """## 6. The run from the shell: `cf-ray verify` and `cf-ray export`

`cf-ray verify RUN` reads every file of every committed checkpoint and checks it against the
manifest (size and CRC-32, and the manifest's own checksum) without loading a tensor: one line per
checkpoint, exit status 1 if anything is damaged. `cf-ray export RUN --to torch DIR` writes the
model (here the final one) for other tools; `--to safetensors` writes `model.safetensors`.
`cli.main([...])` is the same as the command in a shell.""",
    ),
    (
        "code",
        """from cf_ray import cli

cli.main(["verify", os.path.join(storage_path, "budget5")])""",
    ),
    (
        "code",
        """exported = os.path.join(root, "exported")
cli.main(["export", os.path.join(storage_path, "budget5"), "--to", "torch", exported])""",
    ),
    (
        "code",
        """model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 1))
model.load_state_dict(torch.load(os.path.join(exported, "model.pt"), weights_only=True))""",
        DETERMINISTIC,
    ),
    ("code", """ray.shutdown()""", DETERMINISTIC),
]


def build() -> nbf.NotebookNode:
    """The notebook, without outputs."""
    nb = nbf.v4.new_notebook()
    for kind, src, *tags in CELLS:
        cell = nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src)
        if tags:
            cell.metadata["tags"] = list(tags)
        nb.cells.append(cell)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: a re-run changes only what the outputs change
    return nb


def execute(nb: nbf.NotebookNode, workdir: str | None = None, timeout_s: int = 600) -> nbf.NotebookNode:
    """Run every cell in a fresh kernel (``cwd``: ``workdir``), as a user would, top to bottom; a
    cell that runs longer than ``timeout_s`` fails the execution."""
    import nbclient

    workdir = workdir or tempfile.mkdtemp(prefix="cf_ray_nb_")
    nbclient.NotebookClient(
        nb, timeout=timeout_s, kernel_name="python3", record_timing=False, resources={"metadata": {"path": workdir}}
    ).execute()
    return nb


#: What, in any output, says that something failed, whichever cell or thread printed it.
FAILURE_MARKS = ("Traceback (most recent call last)", "Exception in thread", "IProgress not found")


def failures(nb: nbf.NotebookNode) -> list[str]:
    """What went wrong in an executed notebook: every error output, and every stream (stdout or
    stderr: a background thread's traceback lands in whichever cell runs) that holds a traceback or
    a warning of a missing package; ``[]`` when the run was clean."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        for o in cell.outputs:
            if o.output_type == "error":
                out.append(f"{first!r}: {o.ename}: {o.evalue}")
            elif o.output_type == "stream" and any(m in o.text for m in FAILURE_MARKS):
                out.append(f"{first!r}: {o.name}: {o.text.strip()[-2000:]}")
    return out


def without_logs(nb: nbf.NotebookNode) -> None:
    """Drop what the cells printed to stderr: Ray's and the kernel's log lines (timestamps, hosts),
    not part of the story. A stream that holds a failure (:data:`FAILURE_MARKS`) stays, so that a
    committed copy with it fails its test instead of hiding it."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [
                o
                for o in cell.outputs
                if not (o.output_type == "stream" and o.name == "stderr") or any(m in o.text for m in FAILURE_MARKS)
            ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-execute", action="store_true", help="write the cells without outputs (not for committing)")
    p.add_argument("--out", default=PATH, help=f"where to write it (default: {os.path.relpath(PATH)})")
    args = p.parse_args(argv)
    nb = build()
    failed: list[str] = []
    if not args.no_execute:
        execute(nb)
        failed = failures(nb)
        without_logs(nb)
    nbf.write(nb, args.out)
    print("wrote", args.out, f"({os.path.getsize(args.out) / 1e3:.0f} kB)")
    if failed:
        print("the run failed; do not commit it:\n" + "\n".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
