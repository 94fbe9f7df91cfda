"""An automatic interval a user can trust (issue 45), without Ray: on the trace simulator of
``test_policy`` with samples batched as the engine sends them (one a second per rank, each
covering every iteration since the last), :class:`Adaptive` finds what a checkpoint really costs
at every interval, 1 included; a change of one or two checkpoints' cost does not move the
interval; the overhead it reports is the job's time lost to checkpoints over its training time;
and failures shorten the interval against a prior whatever the cost measurements do."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import pytest
import test_policy as tp

from cf_ray.policy import Adaptive, PolicyWarning, RunEvent, RunEventKind, Sample

POLL_S = 1.0  # the engine's poll: one sample a second per rank, batching every iteration since the last


@pytest.fixture(autouse=True)
def engine_poll(monkeypatch):
    monkeypatch.setattr(tp, "POLL_S", POLL_S)


def ddp302_job(seed: int, slowdown: float = 0.5, iter_noise: float = 0.08, ckpt_noise: float = 0.3) -> tp.Trace:
    """The 302 MB DDP job: 0.29 s iterations, a 20 ms stall, copy 0.1 s and persist 0.2 s, during
    which the iterations run ``slowdown`` slower."""
    return tp.Trace(
        ranks=2,
        iter_s=0.293,
        stall_s=0.02,
        copy_s=0.1,
        nbytes=302_000_000,
        bw=1.5e9,
        slowdown=slowdown,
        iter_noise=iter_noise,
        ckpt_noise=ckpt_noise,
        seed=seed,
    )


def fast_job(seed: int = 0, slowdown: float = 0.45) -> tp.Trace:
    """A small model's job: 75 ms iterations, a 1.5 ms stall, copy and persist ~80 ms, during
    which the iterations run ``slowdown`` slower (the copy and the write compete for the cores)."""
    return tp.Trace(
        ranks=2,
        iter_s=0.075,
        stall_s=0.0015,
        copy_s=0.03,
        nbytes=50_000_000,
        bw=1e9,
        slowdown=slowdown,
        iter_noise=0.05,
        ckpt_noise=0.2,
        seed=seed,
    )


def short_job(seed: int, stall_s: float = 0.06) -> tp.Trace:
    """A notebook-sized job: 75 ms iterations whose checkpoints stall ``stall_s`` (a synchronous
    copy), then copy and persist ~80 ms in the background: at the first interval (5 steps) a
    checkpoint of 60 ms costs about 16 % of the training time."""
    return tp.Trace(
        ranks=2,
        iter_s=0.075,
        stall_s=stall_s,
        copy_s=0.03,
        nbytes=50_000_000,
        bw=1e9,
        iter_noise=0.05,
        ckpt_noise=0.2,
        seed=seed,
    )


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        return fn(*a, **kw)


def true_cost_s(trace: tp.Trace, every: int = 60) -> float:
    """What one checkpoint costs the job, from the simulator's ground truth at a wide interval."""
    run = tp.simulate(tp.FixedInterval(every=every), trace, 1800)
    return run.overhead_pct(200) / 100.0 * every * trace.iter_s


@pytest.mark.parametrize("budget", [2.0, 5.0, 20.0])
def test_a_job_whose_checkpoints_slow_every_iteration_keeps_its_budget(budget):
    # At short intervals every sample of a rank covers a checkpoint's copy or persist, so no
    # iteration is free of one to compare with: the slowdown must still be found and paid for.
    trace = fast_job()
    p = Adaptive(budget_pct=budget)
    run = quiet(tp.simulate, p, trace, 2000)
    assert run.overhead_pct(300) <= budget * 1.2, (run.changes, p.explain())
    cost = true_cost_s(trace)
    assert p.explain()["cost_s"] >= 0.6 * cost, p.explain()  # not the stall alone
    assert run.interval_at(2000) >= 0.8 * cost / (budget / 100 * trace.iter_s)


@pytest.mark.parametrize("stall_s", [0.06, 0.2])
@pytest.mark.parametrize("seed", range(4))
def test_a_short_run_widens_its_first_interval_at_the_first_poll_that_carries_a_cost(seed, stall_s):
    # 50 steps (under 4 s): the first interval governs most of the run. The first poll brings the
    # newest checkpoint's stall, the first one's persist time and an iteration time (its mean
    # includes warm-up iterations: the only one there is); the interval widens to what the budget
    # allows from then on, not a poll later.
    trace, budget = short_job(seed, stall_s), 5.0
    run = quiet(tp.simulate, Adaptive(budget_pct=budget), trace, 50)
    first, second, *rest = run.ckpt_steps()
    k_budget = trace.stall_s / (budget / 100 * trace.iter_s)  # the stall alone, against the budget
    assert (first, second) == (5, 10), run.ckpts  # the profiling checkpoint, and the one in flight at the poll
    assert all(step - second >= 0.8 * k_budget for step in rest), run.changes
    if stall_s < 0.1:  # (two 0.2 s checkpoints before the first poll are a quarter of such a run)
        assert run.overhead_pct(1) <= 1.6 * budget, run.changes  # at the first interval: about 3 x budget


@pytest.mark.parametrize("seed", range(3))
def test_the_first_decision_never_shortens_the_interval_on_a_cost_it_has_not_measured(seed):
    # Checkpoints whose copy and persist slow the iterations, sampled a second at a time: the first
    # samples span several checkpoints, so they cannot tell the slowdown; the stall alone (1.5 ms)
    # would ask for every step. The provisional interval widens or stays, never shortens.
    p = Adaptive(budget_pct=5.0)
    run = quiet(tp.simulate, p, fast_job(seed), 50)
    provisional = [k for _, k, phase in run.changes if phase == "provisional"]
    assert provisional and min(provisional) >= p.initial_interval(), run.changes


def test_stuck_at_one_step_widens():
    # The trap: the interval fell to 1 (every step a checkpoint, nothing ever free of one); the
    # policy must measure what that costs and widen under the budget.
    trace = fast_job(seed=3)
    p = Adaptive(budget_pct=20.0, min_interval=1, first_checkpoint_step=1)
    run = quiet(tp.simulate, p, trace, 1500)
    assert run.interval_at(1500) > 1, run.changes
    assert run.overhead_pct(600) <= 20.0 * 1.2, (run.changes, p.explain())


def _steady(p: Adaptive, steps: range, cost_of=lambda step: 0.2, k: int | None = None, seen=None) -> int | None:
    """Feed one sample per checkpoint (every 10 steps); returns the interval in force (and appends
    every one to ``seen``)."""
    for step in steps:
        s = Sample(
            rank=0,
            step=step,
            iter_s=0.5,
            iters=10,
            stall_s=cost_of(step),
            copy_s=0.2,
            persist_s=0.6,
            ckpt_step=step,
            overlapped=False,
        )
        k = p.plan([s], k) or k
        if seen is not None:
            seen.append(k)
    return k


@pytest.mark.parametrize("odd", [1, 2])
def test_a_cost_drift_of_one_or_two_checkpoints_does_not_move_the_interval(odd):
    # Goodput binds (a prior of one failure every 6 hours); one or two checkpoints then cost 1 %
    # of the usual (a GC pause missed, a timer's hiccup): not evidence of a new level.
    p = Adaptive(budget_pct=5.0, mtbf_s=6 * 3600)
    p.observe(RunEvent(kind=RunEventKind.START, time_unix=0.0, generation=1))
    k = _steady(p, range(10, 2001, 10))
    assert k is not None and p.explain()["binding"] == "goodput"
    lows = set(range(2010, 2010 + 10 * odd, 10))
    seen: list = []
    quiet(_steady, p, range(2010, 2301, 10), lambda step: 0.002 if step in lows else 0.2, k, seen)
    assert set(seen) == {k}, (seen, p.explain().get("last_change"))


def test_a_lasting_change_of_cost_is_followed():
    p = Adaptive(budget_pct=5.0)
    k = _steady(p, range(10, 1001, 10))
    assert k is not None
    k2 = quiet(_steady, p, range(1010, 1201, 10), lambda step: 0.8, k)
    assert k2 is not None and k2 > 2 * k


@pytest.mark.parametrize("seed,slowdown", [(0, 0.45), (1, 0.0), (2, 1.0)])
def test_measured_overhead_is_the_jobs_time_lost_over_its_training_time(seed, slowdown):
    trace = fast_job(seed, slowdown)
    p = Adaptive(budget_pct=5.0)
    run = quiet(tp.simulate, p, trace, 2500)
    truth = run.overhead_pct(1)
    e = p.explain()
    assert e["measured_overhead_pct"] == pytest.approx(truth, abs=3.0), (truth, e)
    # The profile table's row of the newest checkpoints says the same figure, not the cost over a
    # per-row baseline.
    rows = [p.checkpoint_stats(c["step"]) for c in run.ckpts[-10:]]
    rows = [r for r in rows if r and r["overhead_pct"] is not None]
    assert rows
    for r in rows:
        assert r["overhead_pct"] == pytest.approx(truth, abs=3.0), (truth, r)


def test_injected_failures_shorten_the_interval_against_a_prior():
    def run(failures: int) -> int:
        trace = fast_job(seed=5)
        p = Adaptive(budget_pct=5.0, mtbf_s=3600.0)
        p.observe(RunEvent(kind=RunEventKind.START, time_unix=0.0, generation=1))
        quiet(tp.simulate, p, trace, 1200)
        for i in range(failures):
            t = 60.0 + 20.0 * i
            p.observe(RunEvent(kind=RunEventKind.FAILURE, time_unix=t, generation=i + 2, source="memory"))
            p.observe(RunEvent(kind=RunEventKind.RESUMED, time_unix=t + 5, source="memory", recovery_s=5.0))
        p.observe(RunEvent(kind=RunEventKind.TICK, time_unix=150.0))
        quiet(p.plan, [], p.explain()["interval"])
        return p.explain()["interval"]

    assert run(3) < run(0)


def test_explain_says_why_with_the_numbers_it_used():
    trace = fast_job(seed=4)
    p = Adaptive(budget_pct=20.0)
    quiet(tp.simulate, p, trace, 1500)
    e = p.explain()
    # At this budget the interval is short: the cost comes from the cadence, against iterations
    # timed with nothing in flight in probe windows, and the reason quotes it.
    assert e["cost_source"] == "cadence", e
    c = e["cadence"]
    assert c["iter_s_under_interval"] > c["iter_s_nothing_in_flight"] > 0
    assert c["slowdown_s"] > 0 and c["slowdown_se_s"] < c["slowdown_s"]
    assert f"{e['cost_s']:.3g} s" in e["reason"] and f"{e['iter_s']:.3g} s" in e["reason"], e["reason"]
    assert f"{e['measured_overhead_pct']:.3g}%" in e["reason"]


def test_probe_windows_are_published_intervals_and_rare():
    # A probe is a longer interval the controller publishes (every rank adopts it with the schedule
    # version), and the runs spend at most about a tenth of their steps in one.
    trace = fast_job(seed=6)
    p = Adaptive(budget_pct=20.0)
    run = quiet(tp.simulate, p, trace, 3000)
    ks = run.intervals[600:]
    usual = max(set(ks), key=ks.count)
    probe_steps = sum(1 for k in ks if k > 3 * usual)
    assert 0 < probe_steps <= 0.15 * len(ks), (probe_steps, run.changes[-12:])


@pytest.mark.parametrize("seed", range(3))
def test_a_slowdown_the_samples_cannot_resolve_never_shortens_the_interval_below_what_it_costs(seed):
    # Samples come once a second (13 iterations each) while a checkpoint's copy and persist overlap
    # about one: the per-checkpoint records read a slowdown of about none. Until the cadence
    # measures it the copy and persist count as lost time, so no interval after the first
    # checkpoint is shorter than half what the budget allows for the true cost (a shortening to
    # 1-2 steps on the stall alone cost 20 % against a 2 % budget before), and the run keeps its
    # budget at each of them.
    trace = fast_job(seed)
    cost = true_cost_s(trace)
    finals = {}
    for budget in (2.0, 5.0, 20.0):
        p = Adaptive(budget_pct=budget)
        run = quiet(tp.simulate, p, trace, 420)
        k_true = cost / (budget / 100 * trace.iter_s)
        after_first = [k for step, k, _ in run.changes if step > 10]
        assert min(after_first) >= 0.5 * k_true, (budget, k_true, run.changes)
        assert run.overhead_pct(100) <= budget * 1.2, (budget, run.changes)
        finals[budget] = p.explain()["interval"]  # the rules' interval (a probe window may be open)
    assert finals[2.0] >= finals[5.0] >= finals[20.0], finals  # monotone in the budget


def test_explain_says_when_the_slowdown_is_not_measured_yet():
    p = Adaptive(budget_pct=5.0)
    quiet(tp.simulate, p, fast_job(seed=1), 30)
    e = p.explain()
    assert e["slowdown_measured"] is False, e
    assert "slowdown not measured yet" in e["reason"], e["reason"]


@pytest.mark.parametrize("seed", range(4))
def test_on_a_noisy_machine_a_figure_the_cadence_cannot_tell_from_none_does_not_shorten_the_interval(seed):
    # Iterations 60 % noisy (a busy machine): the cadence's slowdown comes with a standard error
    # larger than the copy and persist; it is no measure, and the interval errs wide.
    trace = dataclasses.replace(fast_job(seed), iter_noise=0.6)
    budget = 5.0
    k_true = true_cost_s(trace) / (budget / 100 * trace.iter_s)
    run = quiet(tp.simulate, Adaptive(budget_pct=budget), trace, 420)
    after_first = [k for step, k, _ in run.changes if step > 10]
    assert after_first and min(after_first) >= 0.5 * k_true, (k_true, run.changes)
    assert run.overhead_pct(100) <= budget * 1.2, run.changes


def _after_failures(seed: int, failures: int) -> tuple[int, list]:
    """The interval at the end of a run of the fast job under a prior of one failure every 10
    minutes, with ``failures`` restarts (5 s apart) after 300 steps, then 1,200 steps more; and the
    changes of the interval after step 400."""
    trace = fast_job(seed)
    p = Adaptive(budget_pct=5.0, mtbf_s=600.0)
    p.observe(RunEvent(kind=RunEventKind.START, time_unix=0.0, generation=1))
    quiet(tp.simulate, p, trace, 300)
    for i in range(failures):
        t = 300 * trace.iter_s + 5.0 * i
        p.observe(RunEvent(kind=RunEventKind.FAILURE, time_unix=t, generation=i + 2, source="memory"))
        p.observe(RunEvent(kind=RunEventKind.RESUMED, time_unix=t + 5, source="memory", recovery_s=5.0))
    run = quiet(tp.simulate, p, trace, 1500, start_step=300)
    return p.explain()["interval"], [c for c in run.changes if c[0] > 400]


@pytest.mark.parametrize("seed", range(8))
def test_after_failures_against_a_prior_the_interval_is_shorter_and_settles(seed):
    # Two failures in 10 s against a prior of one in 600 s: the goodput interval is about 0.6 of
    # what it is without them. The rule of evidence for the slowdown depends on the interval (with
    # long samples, per-checkpoint records count when checkpoints are four samples apart), so it
    # must not flip with the interval it sets: it flipped between 50 and 78 steps 15-25 times in
    # 1,200 steps before (every rise of the goodput interval then undid the shortening).
    (with_failures, changes), (without, _) = _after_failures(seed, 2), _after_failures(seed, 0)
    assert with_failures < without, (with_failures, without)
    assert len(changes) <= 2, changes


def test_a_sample_of_one_iteration_with_nothing_in_flight_is_not_the_jobs_clean_time():
    # A poll right after another (or the warm-up's end) gives a "clean" sample of one iteration; the
    # job's overhead compared the iterations before it with the mean of the clean time before them
    # and that one noisy iteration, and a real job read 3.5 % where it paid 6 % by its own samples.
    from cf_ray.policy._cadence import Cadence

    c = Cadence()
    c.interval(2)
    step = 0

    def add(iter_s, iters, clean):
        nonlocal step
        step += iters
        c.add(0, step, step - iters + 1, iter_s, iters, clean, stall=0.0)

    for _ in range(2):
        add(0.075, 13, True)
    for _ in range(4):
        add(0.085, 13, False)
    add(0.095, 1, True)
    for _ in range(4):
        add(0.085, 13, False)
    add(0.075, 13, True)
    paid = 100 * (8 * 13 * 0.010 + 0.020) / (11 * 13 * 0.075 + 0.075)
    assert c.job_overhead_pct({0}, 0.075, 0.05) == pytest.approx(paid, abs=1.0)


def test_the_checkpointers_work_at_every_step_counts_in_the_jobs_overhead():
    # No checkpoint in flight anywhere, 0.75 ms of the checkpointer's own work per 75 ms iteration:
    # the job paid 1 %, and no clean iteration time can show it (it is outside every iteration).
    from cf_ray.policy._cadence import Cadence

    c = Cadence()
    c.interval(50)
    for i in range(1, 11):
        c.add(0, 13 * i, 13 * i - 12, 0.075, 13, True, stall=0.0, step_s=0.00075)
    assert c.job_overhead_pct({0}, 0.075, 0.05) == pytest.approx(1.0, abs=0.01)


def test_a_cost_measured_on_few_checkpoints_is_as_uncertain_as_they_are():
    # Identical costs at the first checkpoints say nothing of how much the next one will differ
    # (a real 302 MB job's measured 0.13, 0.22, 0.02 and 0.39 s at one interval, each first read
    # as "+/- 0"): the policy must not weigh them as certain, or its rules meant to ignore noise
    # (widen only past the cost minus its error, shorten only on the cost plus it) act on one
    # checkpoint. The uncertainty falls as checkpoints agree.
    p = Adaptive(budget_pct=5.0)
    quiet(_steady, p, range(10, 41, 10))
    few = p.explain()
    assert few["cost_s"] == pytest.approx(0.2)
    assert few["cost_se_s"] >= 0.1 * few["cost_s"], few
    quiet(_steady, p, range(50, 401, 10))
    many = p.explain()
    assert 0 < many["cost_se_s"] < 0.5 * few["cost_se_s"], many
    # A level that scatters says so, whatever the prior.
    q = Adaptive(budget_pct=5.0)
    quiet(_steady, q, range(10, 401, 10), lambda step: 0.1 if step % 20 else 0.3)
    assert q.explain()["cost_se_s"] > many["cost_se_s"]


def start_up_job(seed: int) -> tp.Trace:
    """:func:`fast_job` whose first 40 steps run at 95 ms instead of 75 (the spare workers, the
    controller and the holder start beside training)."""
    return fast_job(seed).at(0, iter_s=0.095).at(40, iter_s=0.075)


@pytest.mark.parametrize("seed", range(8))
def test_a_slowdown_measured_against_the_runs_start_up_does_not_shorten_the_interval(seed, monkeypatch):
    # The run's first seconds are slower and the engine polls every 0.25 s until the controller
    # has the rank's bell, so the first iterations timed with nothing in flight are the
    # start-up's. Against them the copies' slowdown read as none and a 20 % budget went to every
    # step or two (30 % paid in a real run). The start-up's clean iterations are set aside once a
    # later one is timed, and the interval shortens only on a comparison no older than a probe
    # window before it (a probe window comes first, soon after the first decision).
    monkeypatch.setattr(tp, "EARLY_POLL_S", (2.0, 0.25))
    budget = 20.0
    k_true = true_cost_s(fast_job(seed)) / (budget / 100 * 0.075)
    p = Adaptive(budget_pct=budget)
    run = quiet(tp.simulate, p, start_up_job(seed), 420)
    shortest = min(k for step, k, _ in run.changes if step > 10)
    assert shortest >= 0.8 * k_true, (k_true, run.changes)
    assert run.overhead_pct(100) <= budget * 1.2, run.changes
    probes = [step for step, k, _ in run.changes if k > 3 * k_true]
    assert probes and probes[0] <= 120, run.changes  # not when the start-up's samples age out


@pytest.mark.parametrize("budget", [2.0, 5.0, 20.0])
def test_a_short_run_keeps_its_budget_while_its_slowdown_is_not_measured(budget, monkeypatch):
    # 420 steps of the fast job and the start-up job with the engine's first polls: at 2 % an
    # interval of 14 or 16 steps was kept for the whole run (3.3 % paid) while the per-checkpoint
    # figure read 0.015 s against 0.04 and the cadence could not tell its figure from none: the
    # copy and persist counted whole only where the interval was set, not where it was kept. Until
    # the slowdown is measured they count whole against the budget too (f3f0e3c: 5 of 8 seeds
    # within at 2 %, 7 of 8 at 5 %, on the fast job).
    monkeypatch.setattr(tp, "EARLY_POLL_S", (0.5, 0.25))
    for seed in range(8):
        for trace in (fast_job(seed), start_up_job(seed)):
            p = Adaptive(budget_pct=budget)
            run = quiet(tp.simulate, p, trace, 420)
            assert run.overhead_pct(100) <= budget * 1.2, (seed, run.changes, p.explain()["reason"])


@pytest.mark.parametrize("slowdown", [0.0, 0.5])
def test_explain_records_show_what_each_checkpoints_cost_was_read_from(slowdown):
    """A cost far from what the job paid can be traced: ``explain()["records"]`` has, per recent
    checkpoint, the cost the policy read and per rank the time its overlapped iterations took over
    the clean ones around them, and those read the slowdown the copy and persist really caused (none, or
    half of their time on a 302 MB job of 0.29 s iterations)."""
    trace = ddp302_job(3, slowdown=slowdown, iter_noise=0.05, ckpt_noise=0.2)
    policy = Adaptive(budget_pct=5)
    quiet(tp.simulate, policy, trace, 420, stagger=True)  # each rank's samples on its own clock
    records = policy.explain()["records"]
    json.dumps(records)  # a report a user can keep
    # Tuned checkpoints (the profiling ones may have had no baseline yet: 0 iterations measured).
    measured = [r for r in records if not r["profiling"] and any("excess_s" in x for x in r["ranks"])]
    assert len(measured) >= 3
    for rec in measured:
        assert rec["cost_s"] == policy.checkpoint_stats(rec["step"])["cost_s"]
        assert {x["rank"] for x in rec["ranks"]} == {0, 1}
        assert all(x["overlapped_iters"] >= 1 for x in rec["ranks"] if "excess_s" in x)
    excess = sorted(x["excess_s"] for r in measured for x in r["ranks"] if "excess_s" in x)
    paid = slowdown * (0.1 + 302e6 / 1.5e9)  # the iterations under copy and persist, slower by `slowdown`
    assert excess[len(excess) // 2] == pytest.approx(paid, abs=0.05)


def _estimator_two_ranks():
    """An estimator fed two ranks' clean 0.3 s iterations up to step 9 (one sample per 3 steps)."""
    from cf_ray.policy._estimator import Estimator

    est = Estimator(window=16, warmup_steps=2, drift_ratio=1.6)
    est.ingest([Sample(rank=r, step=s, iter_s=0.3, iters=3) for s in (3, 6, 9) for r in (0, 1)], 10, False)
    return est


def test_a_checkpoint_counts_as_measured_only_once_every_rank_timed_its_overlap():
    # A real 302 MB DDP job: rank 1 closed its overlap first and read 0.003 s of slowdown, rank 0
    # was still in its overlap (0.178 s): the cost read as 0.006 s, "measured", and a 2 % budget
    # went to 2 steps. The slowest rank's slowdown may be the one missing until every rank has it.
    est = _estimator_two_ranks()
    ckpt = {"ckpt_step": 10, "stall_s": 0.002, "nbytes": 150_000_000}
    feed = [
        Sample(rank=0, step=12, iter_s=0.35, iters=3, copy_s=0.12, **ckpt),
        Sample(rank=1, step=12, iter_s=0.301, iters=3, copy_s=0.0, **ckpt),
        *(Sample(rank=r, step=10, ckpt_step=10, persist_s=0.25) for r in (0, 1)),
        Sample(rank=1, step=15, iter_s=0.3, iters=3, ckpt_step=10),
    ]
    est.ingest(feed, 10, False)
    e = est.estimate()
    assert e is not None and not e.settled, "one rank's reading is not the checkpoint's cost"
    est.ingest([*feed, Sample(rank=0, step=15, iter_s=0.3, iters=3, ckpt_step=10)], 10, False)
    e = est.estimate()
    assert e is not None and e.settled
    assert e.cost == pytest.approx(0.002 + 3 * 0.05, rel=0.01)  # rank 0's: the slowest rank's


def test_a_rank_without_a_copy_of_its_own_times_the_slowest_ranks_copy_and_persist_as_overlapped():
    # Rank 0 copies 0.3 s and persists 0.5 s; rank 1 has nothing to copy (its own 0.5 s would end
    # its overlap at step 12). The collectives pass rank 0's slowdown on to rank 1: its iterations
    # until rank 0's copy and persist end (step 13) are its overlap, not the clean time its
    # baseline is made of.
    est = _estimator_two_ranks()
    ckpt = {"ckpt_step": 10, "stall_s": 0.002}
    feed = [
        Sample(rank=0, step=11, iter_s=0.3, iters=2, copy_s=0.3, **ckpt),
        Sample(rank=1, step=11, iter_s=0.3, iters=2, copy_s=0.0, **ckpt),
        *(Sample(rank=r, step=10, ckpt_step=10, persist_s=0.5) for r in (0, 1)),
        Sample(rank=1, step=12, iter_s=0.3, iters=1, ckpt_step=10),
        Sample(rank=1, step=14, iter_s=0.4, iters=2, ckpt_step=10),  # steps 13-14: rank 0's persist
        Sample(rank=1, step=17, iter_s=0.3, iters=3, ckpt_step=10),
    ]
    est.ingest(feed, 10, False)
    assert est.record(10).excess[1] == pytest.approx(0.2)


def ramp_job(seed: int) -> tp.Trace:
    """:func:`ddp302_job` as it runs here: its iterations start at 0.37 s and speed up over the
    first 60 steps (the spare workers, controller and holder starting beside training), and rank 1
    has nothing to copy."""
    trace = ddp302_job(seed).at(0, ranks=[1], copy_s=0.0)
    for step in range(0, 61, 4):
        trace.at(step, iter_s=0.37 - (0.37 - 0.293) * step / 60)
    return trace


@pytest.mark.parametrize("seed", range(8))
def test_a_job_still_speeding_up_after_its_start_keeps_a_2pct_budget(seed, monkeypatch):
    # Against the median of a rank's clean iterations, most of them from the slower start, the
    # overlapped iterations of the first checkpoints read as no slowdown (excess -0.05 to -0.27 s on
    # the real job, which went to 2 steps under a 2 % budget and paid +11 %); on the simulator 3 of
    # 8 seeds paid over 2.4 %. Each checkpoint's slowdown is read against the clean iterations on
    # both sides of its overlap.
    monkeypatch.setattr(tp, "EARLY_POLL_S", (0.5, 0.25))
    run = quiet(tp.simulate, Adaptive(budget_pct=2), ramp_job(seed), 260, stagger=True)
    assert run.overhead_pct(60) <= 2.0 * 1.2, run.changes


def test_readings_of_about_none_from_noisy_iterations_are_as_uncertain_as_those_iterations():
    # A real 302 MB DDP run: after a checkpoint that cost 0.22 s, two read 0.003 and 0.002 s (their
    # overlapped iterations no slower than the clean ones around them, whose samples scatter by
    # 13 ms); the cost's standard error, in proportion to the readings, said +/- 0.0008 s, and a
    # 2 % budget went to 2 steps. Each reading's noise (the scatter of the samples it was read
    # from) is the least a cost level is uncertain by.
    from cf_ray.policy._estimator import _level

    costs = [(22, 0.219), (39, 0.0028), (56, 0.0019)]
    mean, se, n = _level("cost_s", costs, {}, 16, 1.6, [0.09, 0.09, 0.09])
    assert n == 3 and mean == pytest.approx(0.0028)
    assert se >= 0.09 / 3**0.5 * 0.7
    # Readings from quiet iterations (no noise known, or little) keep the scatter they show.
    assert _level("cost_s", costs, {}, 16, 1.6, [0.001] * 3)[1] < 0.01


@pytest.mark.parametrize("seed", range(8))
def test_a_302mb_job_does_not_shorten_below_half_its_interval_on_noisy_readings(seed, monkeypatch):
    # Iterations scattering by 8 %, checkpoints' times by 30 %: readings of about none come by
    # chance, and on one seed in eight a 5 % budget went to 6 steps of the 12 it needs.
    monkeypatch.setattr(tp, "EARLY_POLL_S", (0.5, 0.25))
    trace = ddp302_job(seed)  # no slow start, both ranks copy
    k_true = true_cost_s(trace) / (5.0 / 100 * trace.iter_s)
    run = quiet(tp.simulate, Adaptive(budget_pct=5), trace, 260, stagger=True)
    shortest = min(k for step, k, _ in run.changes if step > 10)
    assert shortest >= 0.5 * k_true, (k_true, run.changes)


@pytest.mark.parametrize("seed", range(8))
def test_the_first_decision_on_an_unmeasured_slowdown_does_not_dip_far_below_the_provisional_interval(
    seed, monkeypatch
):
    # The copy and persist count whole until the slowdown is measured, but no wider than the cadence
    # can measure at: with samples a second apart the first tuned decision went from the provisional
    # 39-57 steps to 8 on every seed (6 on the real 302 MB runs), and the job paid for it until a
    # measurement widened it again. Now a quarter at most, as on a measured slowdown (or twice the
    # interval the cadence measures at, after a slow first persist), and no lower later in the run.
    monkeypatch.setattr(tp, "EARLY_POLL_S", (0.5, 0.25))
    monkeypatch.setattr(tp, "POLL_S", 1.0)
    run = quiet(tp.simulate, Adaptive(budget_pct=2), ddp302_job(seed), 120, stagger=True)
    phases = [phase for _, _, phase in run.changes]
    assert phases[:2] == ["provisional", "tuned"], run.changes
    provisional, first = run.changes[0][1], run.changes[1][1]
    assert provisional >= 30, run.changes  # the copy and persist counted whole: wide
    assert math.ceil(provisional / 4) <= first < provisional, run.changes
    assert min(k for _, k, _ in run.changes) >= math.ceil(provisional / 4), run.changes
