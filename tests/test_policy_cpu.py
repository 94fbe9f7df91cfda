"""The CPU a checkpoint's background work takes from training: where training leaves no core idle,
the copy thread's and the holder's writer's CPU is training time lost, whatever the iterations
around the checkpoint read (a sample of a second holds a slowdown of a tenth of one in its noise).
The policy counts it as a floor of the cost; with idle cores it counts none of it."""

from __future__ import annotations

import math

import pytest

from cf_ray.policy import Adaptive, Sample
from cf_ray.policy._estimator import Estimator

ITER_S = 0.27
STALL_S = 0.002
COPY_CPU_S, PERSIST_CPU_S = 0.15, 0.05


def _drive(budget: float, steps: int, segment, changes: list | None = None) -> tuple[int, dict]:
    """Two ranks under ``Adaptive(budget_pct=budget)`` for ``steps`` steps, a checkpoint at every
    interval the policy plans; ``segment(rank, last, step)`` gives a rank's samples for the steps
    after checkpoint ``last`` (0: none yet) up to ``step``. Returns the interval in force at the end
    and ``explain()``; each change of the interval is appended to ``changes`` (if given) as
    (interval, ``explain()`` then)."""
    p = Adaptive(budget_pct=budget)
    k = p.initial_interval() or 1
    last = 0
    samples: list[Sample] = []
    for step in range(1, steps + 1):
        if step - last < k:
            continue
        for rank in (0, 1):
            samples += segment(rank, last, step)
        last = step
        new = p.plan(samples[-256:], k)
        if new is not None and new != k:
            if changes is not None:
                changes.append((new, p.explain()))
            k = new
    return k, p.explain()


def _run(idle_cpus: float | None, budget: float = 2.0, steps: int = 1200) -> tuple[int, dict]:
    """Two ranks of a 302 MB-like job whose iterations never read slower around a checkpoint (one
    sample per checkpoint, its iterations clean), each reporting its copy's CPU and its idle cores
    per rank; the controller's sample brings the holder's write CPU with the persist. Returns the
    interval in force at the end and ``explain()``."""

    def segment(rank: int, last: int, step: int) -> list[Sample]:
        out = [
            Sample(
                rank=rank,
                step=step,
                iter_s=ITER_S,
                iters=step - last,
                stall_s=STALL_S,
                copy_s=0.1,
                copy_cpu_s=COPY_CPU_S,
                nbytes=151_000_000,
                ckpt_step=last or None,
                overlapped=False,
                idle_cpus=idle_cpus,
            )
        ]
        if last:
            out.append(Sample(rank=rank, step=last, ckpt_step=last, persist_s=0.2, persist_cpu_s=PERSIST_CPU_S))
        return out

    return _drive(budget, steps, segment)


def test_a_checkpoint_whose_background_cpu_finds_no_idle_core_costs_that_cpu():
    # The iterations read no slowdown; the copy and the write take 0.2 s of CPU on cores training
    # keeps busy (0.1 idle cores per rank): 0.18 s of it is training time lost.
    k, e = _run(idle_cpus=0.1)
    taken = 0.9 * (COPY_CPU_S + PERSIST_CPU_S)
    assert e["cpu_taken_s"] == pytest.approx(taken, rel=0.01), e
    assert e["cost_s"] == pytest.approx(STALL_S + taken, rel=0.01), e
    assert e["cost_source"] == "CPU taken from training"
    assert "CPU taken from training" in e["reason"]
    # The budget holds on that cost: 0.182 s per checkpoint at 2 % of 0.27 s iterations.
    assert k >= math.floor((STALL_S + taken) / (0.02 * ITER_S)), e
    assert 100.0 * e["cost_s"] / (k * ITER_S) <= 2.0 * 1.2
    records = [r for r in e["records"] if r["cpu_taken_s"] is not None]
    assert records and all(x.get("copy_cpu_s") == COPY_CPU_S for r in records for x in r["ranks"])


def test_with_idle_cores_the_background_cpu_takes_nothing_from_training():
    _, busy = _run(idle_cpus=0.1)
    _, e = _run(idle_cpus=1.5)
    assert e["cpu_taken_s"] == 0.0
    assert e["cost_source"] != "CPU taken from training"
    assert e["cost_s"] == pytest.approx(STALL_S, rel=0.05), e
    # The budget alone would take a checkpoint at every step or two: the interval the rules aim at
    # is far shorter than where the CPU counts (one persist in flight then decides).
    assert e["target"] < busy["target"] / 4, (e["target"], busy["target"])


def test_without_cpu_figures_the_cost_is_what_the_iterations_read():
    # An engine that reports no idle cores (not Linux) or no CPU: no floor, as before.
    k, e = _run(idle_cpus=None)
    assert e["cpu_taken_s"] is None
    assert e["cost_s"] == pytest.approx(STALL_S, rel=0.05), e


def test_the_slowest_ranks_share_counts_and_only_the_cpu_that_found_no_idle_core():
    # Rank 0 copies 0.1 s of CPU with no idle core; rank 1 copies 0.3 s of CPU with 1.5 idle cores
    # per rank (its copy runs beside training): the checkpoint cost 0.1 s of training time, not 0.3.
    est = Estimator(window=16, warmup_steps=2, drift_ratio=1.6)
    idle = {0: 0.0, 1: 1.5}
    cpu = {0: 0.1, 1: 0.3}
    feed = [Sample(rank=r, step=s, iter_s=0.3, iters=3, idle_cpus=idle[r]) for s in (3, 6, 9) for r in (0, 1)]
    feed += [
        Sample(rank=r, step=12, iter_s=0.3, iters=3, ckpt_step=10, stall_s=0.002, copy_s=0.1, copy_cpu_s=cpu[r])
        for r in (0, 1)
    ]
    est.ingest(feed, 10, False)
    rec = est.record(10)
    assert rec is not None
    assert rec.cpu_taken({0: 0.0, 1: 1.5}) == pytest.approx(0.1)
    e = est.estimate()
    assert e is not None and e.detail.cpu == pytest.approx(0.1)
    assert e.cost == pytest.approx(0.102) and e.cost_source == "CPU taken from training"


# -- the training thread's wait for a CPU (Sample.queue_s) ------------------------------------------------

QUEUE_S = 0.02  # the training thread's wait per iteration with nothing in flight


def _run_queued(extra_s: float | None, budget: float = 2.0, steps: int = 1500) -> tuple[int, dict]:
    """Two ranks whose iterations read no slower while a checkpoint's copy and persist run (the
    iterations after them are as slow: a machine whose every iteration the background work touches),
    but whose training thread waits ``extra_s`` more for a CPU over the three iterations a copy and
    persist overlap (``None``: no wait reported). Returns the interval at the end and ``explain()``."""

    def segment(rank: int, last: int, step: int) -> list[Sample]:
        n, out = step - last, []
        common = dict(rank=rank, iter_s=ITER_S, stall_s=STALL_S, copy_s=0.1, nbytes=151_000_000)
        common["ckpt_step"] = last or None
        if last and n >= 6:
            q = None if extra_s is None else QUEUE_S + extra_s / 3
            out.append(Sample(step=last + 3, iters=3, overlapped=True, queue_s=q, **common))
            out.append(Sample(rank=rank, step=last, ckpt_step=last, persist_s=0.2))
            n -= 3
        q = None if extra_s is None else QUEUE_S
        out.append(Sample(step=step, iters=n, overlapped=False, queue_s=q, **common))
        return out

    return _drive(budget, steps, segment)


def test_what_training_waits_for_a_cpu_while_a_copy_runs_is_cost_the_iteration_times_miss():
    k, e = _run_queued(extra_s=0.15)
    assert e["queued_s"] == pytest.approx(0.15, rel=0.01), e
    assert e["cost_s"] == pytest.approx(STALL_S + 0.15, rel=0.01), e
    assert e["cost_source"] == "training's wait for a CPU"
    assert "training's wait for a CPU" in e["reason"]
    assert k >= math.floor((STALL_S + 0.15) / (0.02 * ITER_S)), e
    records = [r for r in e["records"] if r["queued_s"] is not None]
    assert records and all(r["queued_s"] == pytest.approx(0.15) for r in records), records


def test_no_extra_wait_or_no_wait_reported_adds_nothing():
    _, waited = _run_queued(extra_s=0.15)
    for extra in (0.0, None):
        _, e = _run_queued(extra_s=extra)
        assert not e["queued_s"], e  # 0, or none where the interval left no checkpoint its own iterations
        assert e["cost_source"] != "training's wait for a CPU"
        assert e["target"] < waited["target"] / 4, (e["target"], waited["target"])


def test_the_wait_counts_no_more_than_the_copy_and_persist_lasted_and_not_from_coarse_checkpoints():
    est = Estimator(window=16, warmup_steps=2, drift_ratio=1.6)
    feed = [Sample(rank=0, step=s, iter_s=0.3, iters=3, queue_s=0.01) for s in (3, 6, 9)]
    # Checkpoint 10: its copy and persist lasted 0.3 s; the overlapped iterations waited 0.2 s per
    # iteration more than with nothing in flight (something else loaded the machine meanwhile).
    feed += [
        Sample(
            rank=0, step=13, iter_s=0.3, iters=3, ckpt_step=10, stall_s=0.002, copy_s=0.1, overlapped=True, queue_s=0.21
        ),
        Sample(rank=0, step=10, ckpt_step=10, persist_s=0.2),
        Sample(rank=0, step=16, iter_s=0.3, iters=3, ckpt_step=10, overlapped=False, queue_s=0.01),
    ]
    est.ingest(feed, 10, False)
    rec = est.record(10)
    assert rec is not None and rec.taken.queued[0] == pytest.approx(0.6)
    assert rec.queue_taken() == pytest.approx(0.3)  # at most its copy + persist
    e = est.estimate()
    assert e is not None and e.detail.queued == pytest.approx(0.3)
    rec.coarse = True  # its samples covered other checkpoints too: their wait is not its own
    est.rev += 1
    e = est.estimate()
    assert e is not None and e.detail.queued is None


# -- a floor is no evidence of room ------------------------------------------------------------------------


def _run_never_clean(budget: float, steps: int = 800) -> tuple[list[tuple[int, dict]], dict]:
    """Two ranks of an MLP-like job (0.09 s iterations, a 0.11 s copy and persist) whose every
    sample overlaps a checkpoint's copy or persist (long samples, each sharing a checkpoint with the
    next): no iteration is ever timed with nothing in flight, so nothing measures what a checkpoint
    slows, and the only cost is the CPU the copy and write take where no core is idle (a floor).
    Returns the changes of the interval after the first tuned decision (interval, ``explain()``)
    and the last ``explain()``."""

    def segment(rank: int, last: int, step: int) -> list[Sample]:
        out = [
            Sample(
                rank=rank,
                step=step,
                iter_s=0.09,
                iters=step - last,
                stall_s=STALL_S,
                copy_s=0.05,
                copy_cpu_s=0.03,
                nbytes=25_000_000,
                ckpt_step=last or None,
                overlapped=True,
                idle_cpus=0.1,
            )
        ]
        if last:
            out.append(Sample(rank=rank, step=last, ckpt_step=last, persist_s=0.06, persist_cpu_s=0.01))
        return out

    changes: list[tuple[int, dict]] = []
    _, e = _drive(budget, steps, segment, changes)
    return changes, e


@pytest.mark.parametrize("budget", [5.0, 20.0])
def test_a_cost_that_is_only_a_floor_never_shortens_the_interval(budget):
    changes, e = _run_never_clean(budget)
    # After six checkpoints with none told apart the floor decides (the cost counts as measured),
    # but it is a floor: nothing says the interval has room. The interval set before that holds
    # (probe windows aside, which lengthen it for one interval); it never goes shorter.
    first = changes[0][0]
    assert e["slowdown_evidence"] == "unseen", e
    assert e["cost_source"] == "CPU taken from training"
    assert [k for k, _ in changes if k < first] == [], [(k, x["reason"]) for k, x in changes]
    assert not any(x["reason"].startswith("headroom") for _, x in changes)
    held = [x for _, x in changes if "would rest on a floor of the cost" in x["reason"]]
    # At 20 % the budget alone asks for 3 steps: the rule that holds says so, with the cost's source.
    if budget == 20.0:
        assert held and "CPU taken from training" in held[0]["reason"], [x["reason"] for _, x in changes]
