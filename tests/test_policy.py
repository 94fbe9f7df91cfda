"""Frequency policies, without Ray: the fixed ones, and :class:`Adaptive` on synthetic traces.

The traces run through a small simulator of synchronous data-parallel training (below) that
feeds the policy the way the controller does and measures the *true* checkpoint overhead of the
schedule it produces. Assertions are about what users rely on — overhead within the budget, the
interval the shortest that is, timing of widening and shortening, no oscillation, the CheckFreq
formula as a floor — judged against the simulator's ground truth (often by re-running the same
trace with a fixed interval), not against constants copied from the implementation.
"""

from __future__ import annotations

import collections
import json
import math
import pickle
import random
import time
import warnings
from dataclasses import dataclass, field

import pytest

from cf_ray.errors import ConfigError
from cf_ray.policy import Adaptive, AnyOf, EpochEnd, FixedInterval, FrequencyPolicy, PolicyWarning, Sample, SaveContext
from cf_ray.policy._rules import FIRST_SHORTEN

# ------------------------------------------------------------------------------------------------
# The trace simulator
# ------------------------------------------------------------------------------------------------

POLL_S = 0.25  # a rank sends a sample about this often (simulated seconds)
EARLY_POLL_S = (0.0, 0.25)  # for this long at the start, a sample this often (the engine's bell-less polls)
ADOPT_DELAY = 2  # steps between publication and adoption by every rank

_KEYS = ("iter_s", "stall_s", "copy_s", "nbytes", "bw", "slowdown")


@dataclass
class Trace:
    """Conditions over a run: defaults, then changes from a step on, for all or some ranks.

    Per step every rank computes for ``iter_s`` (x lognormal noise, x ``1 + slowdown`` while its
    own copy/persist is in flight); the collective makes the step as long as the slowest rank's
    stall + compute, and each rank reports that minus its own stall. A checkpoint stalls a rank for
    ``stall_s`` plus any wait for its previous copy+persist (one in flight), then copy (``copy_s``)
    and persist (``nbytes / bw``) run in the background.
    """

    ranks: int = 4
    iter_s: float = 0.05
    stall_s: float = 0.1
    copy_s: float = 0.05
    nbytes: int = 100_000_000
    bw: float = 1e9
    slowdown: float = 0.0
    iter_noise: float = 0.0
    ckpt_noise: float = 0.0
    wait_floor_s: float = 0.0  # every checkpoint reports at least this guard wait (the wait's own cost)
    seed: int = 0
    changes: list = field(default_factory=list)

    def at(self, step: int, ranks=None, **kw) -> Trace:
        assert set(kw) <= set(_KEYS), kw
        self.changes.append((step, ranks, kw))
        return self

    def cond(self, step: int, rank: int) -> dict:
        c = {k: getattr(self, k) for k in _KEYS}
        for s, ranks, kw in self.changes:
            if step >= s and (ranks is None or rank in ranks):
                c.update(kw)
        return c

    def bg_s(self, step: int, rank: int) -> float:
        """True copy + persist seconds of a checkpoint at ``step`` (no noise)."""
        c = self.cond(step, rank)
        return c["copy_s"] + c["nbytes"] / c["bw"]


@dataclass
class Run:
    ckpts: list  # dicts: step, interval, wait (max guard wait)
    changes: list  # (step, interval, phase) as published
    wall: list  # seconds per step
    clean: list  # seconds per step had nothing been checkpointed
    intervals: list  # the interval every rank used at each step
    start: int = 0  # the step the run resumed from (lists are indexed by step - start - 1)

    def overhead_pct(self, lo: int = 1, hi: int | None = None) -> float:
        """True overhead of steps lo..hi: extra wall time over the same steps without checkpoints."""
        lo = max(lo - self.start, 1)
        hi = len(self.wall) if hi is None else hi - self.start
        w, c = sum(self.wall[lo - 1 : hi]), sum(self.clean[lo - 1 : hi])
        return 100.0 * (w - c) / c

    def interval_at(self, step: int) -> int:
        return self.intervals[step - self.start - 1]

    def ckpt_steps(self, lo: int = 0, hi: int = 10**9) -> list[int]:
        return [c["step"] for c in self.ckpts if lo <= c["step"] < hi]

    def tuned_changes(self) -> list[int]:
        return [k for _, k, phase in self.changes if phase == "tuned"]


def simulate(
    policy,
    trace: Trace,
    steps: int,
    *,
    persist_via_controller=False,
    with_ckpt_step=True,
    report_wait=True,
    report_persist=True,
    history=256,
    start_step=0,
    samples_out=None,
    stagger=False,
) -> Run:
    """Train ``steps`` steps under ``policy`` the way cf_ray's engine and controller drive it.

    ``stagger``: each rank polls on its own clock (rank ``r`` a fraction ``r / ranks`` of a poll
    later), and the controller plans on each rank's sample as it comes, as the engine's ranks do;
    else every rank's sample comes at once."""
    rng = random.Random(trace.seed)
    R = trace.ranks
    t = 0.0
    published = policy.initial_interval()
    worker_interval = published
    adopt: list = []
    last_save = start_step
    bg_done = [0.0] * R
    last: list = [None] * R
    acc = [[0.0, 0] for _ in range(R)]
    stall_prev = None
    first_poll = EARLY_POLL_S[1] if EARLY_POLL_S[0] > 0 else POLL_S
    next_poll = [first_poll + (r * first_poll / R if stagger else 0.0) for r in range(R)]
    samples: collections.deque = collections.deque(maxlen=history)
    persist_pending: list = []
    run = Run([], [], [], [], [], start_step)

    def ln(sigma):
        return math.exp(rng.gauss(0.0, sigma)) if sigma else 1.0

    def emit(sample):
        samples.append(sample)
        if samples_out is not None:
            samples_out.append(sample)

    for step in range(start_step + 1, start_step + steps + 1):
        while adopt and adopt[0][0] <= step:
            worker_interval = adopt.pop(0)[1]
        comp, clean = [], []
        for r in range(R):
            c = trace.cond(step, r)
            base = c["iter_s"] * ln(trace.iter_noise)
            clean.append(base)
            comp.append(base * (1.0 + c["slowdown"]) if t < bg_done[r] else base)
        off = stall_prev or [0.0] * R
        wall = max(o + x for o, x in zip(off, comp))
        run.wall.append(wall)
        run.clean.append(max(clean))
        run.intervals.append(worker_interval)
        t += wall
        for r in range(R):
            acc[r][0] += wall - off[r]
            acc[r][1] += 1
        stall_prev = None
        ctx = SaveContext(step, 0, last_save, worker_interval, False)
        if policy.should_save(step, ctx):
            stalls, waits = [], []
            for r in range(R):
                c = trace.cond(step, r)
                wait = max(trace.wait_floor_s, bg_done[r] - t)
                stall = c["stall_s"] * ln(trace.ckpt_noise) + wait
                copy = c["copy_s"] * ln(trace.ckpt_noise)
                persist = c["nbytes"] / c["bw"] * ln(trace.ckpt_noise)
                bg_done[r] = t + stall + copy + persist
                prev = last[r]
                if prev is not None and not persist_via_controller and not prev["reported"]:
                    persist_pending.append((prev["done"], r, prev["ckpt_step"], prev["persist_s"]))
                last[r] = {
                    "reported": False,
                    "ckpt_step": step,
                    "stall_s": stall,
                    "wait_s": wait,
                    "copy_s": copy,
                    "persist_s": persist,
                    "nbytes": int(c["nbytes"]),
                    "done": bg_done[r],
                }
                if persist_via_controller:
                    persist_pending.append((bg_done[r], r, step, persist))
                stalls.append(stall)
                waits.append(wait)
            stall_prev = stalls
            last_save = step
            run.ckpts.append({"step": step, "interval": worker_interval, "wait": max(waits)})
        polling = [r for r in range(R) if t >= next_poll[r]]
        for group in [[r] for r in polling] if stagger else [polling] if polling else []:
            for r in group:
                next_poll[r] = t + (EARLY_POLL_S[1] if t < EARLY_POLL_S[0] else POLL_S)
                kw = {}
                if last[r] is not None:
                    L = last[r]
                    kw = {"stall_s": L["stall_s"], "copy_s": L["copy_s"], "nbytes": L["nbytes"]}
                    if report_wait:
                        kw["wait_s"] = L["wait_s"]
                    if with_ckpt_step:
                        kw["ckpt_step"] = L["ckpt_step"]
                    if report_persist and not persist_via_controller and t >= L["done"]:
                        kw["persist_s"] = L["persist_s"]
                        L["reported"] = True
                if acc[r][1]:
                    emit(Sample(rank=r, step=step, iter_s=acc[r][0] / acc[r][1], iters=acc[r][1], **kw))
                    acc[r] = [0.0, 0]
            for item in [x for x in persist_pending if x[0] <= t and report_persist]:
                persist_pending.remove(item)
                done, rr, cs, p = item
                emit(Sample(rank=rr, step=cs, ckpt_step=cs, persist_s=p))
            k = policy.plan(list(samples), published)
            if k is not None and k != published:
                published = k
                phase = policy.explain().get("phase") if hasattr(policy, "explain") else None
                run.changes.append((step, k, phase))
                adopt.append((step + ADOPT_DELAY, k))
    return run


def reversals(ks: list[int]) -> int:
    return sum(1 for a, b, c in zip(ks, ks[1:], ks[2:]) if (b - a) * (c - b) < 0)


def quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PolicyWarning)
        return fn(*a, **kw)


BUDGET = 5.0

# ------------------------------------------------------------------------------------------------
# Fixed policies and the protocol
# ------------------------------------------------------------------------------------------------


def test_fixed_policies_unchanged():
    f = FixedInterval(every=3)
    assert [s for s in range(1, 10) if f.should_save(s, SaveContext(s, 0, 0))] == [3, 6, 9]
    assert not f.should_save(3, SaveContext(3, 0, 0, epoch_end=True))
    assert f.plan([], None) is None and f.initial_interval() is None
    e = EpochEnd(every=2)
    assert e.should_save(10, SaveContext(10, 2, 0, epoch_end=True))
    assert not e.should_save(10, SaveContext(10, 1, 0, epoch_end=True))
    assert not e.should_save(10, SaveContext(10, 2, 0))
    for p in (f, e, Adaptive(), AnyOf(policies=[f, e])):
        assert isinstance(p, FrequencyPolicy)
        json.dumps(p.explain())
    with pytest.raises(ConfigError, match="every"):
        FixedInterval(every=0)
    assert FixedInterval(3) == f  # as the README's and the issue's `FixedInterval(k)` writes it
    with pytest.raises(ConfigError, match="every"):
        FixedInterval(0)
    with pytest.raises(ConfigError, match="at least one"):
        AnyOf(policies=[])


def test_anyof_forwards_the_adaptive_member():
    a = Adaptive(first_checkpoint_step=7)
    p = AnyOf(policies=[EpochEnd(), a])
    assert p.initial_interval() == 7
    assert p.should_save(3, SaveContext(3, 1, 0, epoch_end=True))  # EpochEnd
    assert p.should_save(7, SaveContext(7, 0, 0, 7)) and not p.should_save(6, SaveContext(6, 0, 0, 7))
    run = quiet(simulate, p, Trace(), 400)
    assert run.changes and p.explain()["policy"] == "AnyOf" and p.explain()["interval"] == run.changes[-1][1]
    step = run.ckpt_steps()[-2]
    assert p.checkpoint_stats(step) == a.checkpoint_stats(step) is not None
    state = json.loads(json.dumps(p.state_dict()))
    q = AnyOf(policies=[EpochEnd(), Adaptive(first_checkpoint_step=7)])
    q.load_state_dict(state)
    assert q.plan([], 7) == run.changes[-1][1]
    with pytest.raises(ConfigError, match="member"):
        q.load_state_dict({"members": []})


def test_a_policy_of_ones_own_overrides_only_should_save_and_the_controller_runs_it(tmp_path):
    """The base class declares every method the engine calls, with its default: a subclass that
    overrides ``should_save`` alone is planned, reported, saved and resized by the controller's
    schedule without a probe; an object that does not subclass it is refused, saying what to change."""
    import pyarrow.fs as pafs

    import cf_ray
    from cf_ray._engine.driver.schedule import ScheduleBook, checkpoint_stats, explain
    from cf_ray._engine.storage.fs import FsStorage
    from cf_ray.policy import RunEvent, RunEventKind

    class EveryPrime(FrequencyPolicy):
        def should_save(self, step, ctx):
            return step > 1 and all(step % d for d in range(2, int(step**0.5) + 1))

    p = EveryPrime()
    assert [s for s in range(1, 12) if p.should_save(s, SaveContext(s, 0, 0))] == [2, 3, 5, 7, 11]
    assert (p.initial_interval(), p.step_interval(), p.plan([], None), p.persist_cadence()) == (None, None, None, 1)
    assert (p.hazard(), p.explain(), p.checkpoint_stats(3), p.state_dict()) == (None, None, None, None)
    book = ScheduleBook(p, FsStorage(pafs.LocalFileSystem(), str(tmp_path)))
    book.observe(RunEvent(kind=RunEventKind.START, time_unix=0.0, generation=1))
    book.add_sample(Sample(rank=0, step=10, iter_s=0.1, iters=10))
    assert book.replan() is None and book.interval_in_force is None
    assert book.hazard()["failures"] == 0  # the controller's own estimate
    assert explain(p) is None and checkpoint_stats(p, 3) is None and book.state_bytes() is None
    assert book.reprofile_if_resized(1, 2) is not None  # a fresh copy: nothing to adopt, nothing fails
    assert cf_ray.CheckpointConfig(policy=p).policy is p
    # FixedInterval fixes its step interval on the ranks: what the profile's interval column says.
    assert ScheduleBook(FixedInterval(7), FsStorage(pafs.LocalFileSystem(), str(tmp_path))).interval_in_force == 7

    class DuckTyped:
        def should_save(self, step, ctx):
            return False

        def plan(self, samples, current):
            return None

        def initial_interval(self):
            return None

    for where in (lambda q: cf_ray.CheckpointConfig(policy=q), lambda q: AnyOf(policies=[q])):
        with pytest.raises(ConfigError, match="subclass cf_ray.policy.FrequencyPolicy"):
            where(DuckTyped())
    with pytest.raises(TypeError, match="should_save"):
        type("NoDecision", (FrequencyPolicy,), {})()


def test_a_policy_that_learns_is_one_class_the_controller_plans_saves_and_restores(tmp_path):
    """A learning policy written outside cf_ray (one class, no registration): the controller's
    schedule publishes what its ``plan`` learns, saves its ``state_dict`` with the run and loads it
    into the next controller's fresh copy, and reports its ``explain``."""
    import pyarrow.fs as pafs

    from cf_ray._engine.driver.schedule import ScheduleBook
    from cf_ray._engine.storage.fs import FsStorage

    class TenSeconds(FrequencyPolicy):
        """Checkpoint every ten seconds of training, from the ranks' iteration times."""

        def __init__(self):
            self.iter_s: float | None = None

        def should_save(self, step, ctx):
            return step - ctx.last_save_step >= (ctx.interval or 5)

        def initial_interval(self):
            return 5

        def plan(self, samples, current):
            times = [x.iter_s for x in samples if x.iters]
            if times:
                self.iter_s = sum(times) / len(times)
            return None if self.iter_s is None else max(1, round(10.0 / self.iter_s))

        def explain(self):
            return {"policy": "TenSeconds", "iter_s": self.iter_s}

        def state_dict(self):
            return {"iter_s": self.iter_s}

        def load_state_dict(self, state):
            self.iter_s = state["iter_s"]

    storage = FsStorage(pafs.LocalFileSystem(), str(tmp_path))
    book = ScheduleBook(TenSeconds(), storage)
    book.add_sample(Sample(rank=0, step=20, iter_s=0.5, iters=20))
    event = book.replan()
    assert event is not None and event.interval == 20 and event.why == {"policy": "TenSeconds", "iter_s": 0.5}
    book.save_state()
    again = ScheduleBook(TenSeconds(), storage)  # a restarted controller: the saved state is loaded
    assert again.policy.iter_s == 0.5 and again.replan() is not None and again.current_interval == 20


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"budget_pct": 0}, "budget_pct"),
        ({"budget_pct": 100}, "budget_pct"),
        ({"budget_pct": -5}, "budget_pct"),
        ({"budget_pct": 150}, "budget_pct"),
        ({"budget_pct": float("nan")}, "budget_pct"),
        ({"budget_pct": True}, "budget_pct"),
        ({"budget_pct": "5"}, "budget_pct"),
        ({"min_interval": 50, "max_interval": 10}, "min_interval=50 is above max_interval=10"),
        ({"min_interval": 0}, "min_interval"),
        ({"max_interval": 2.5}, "max_interval"),
        ({"first_checkpoint_step": 0}, "first_checkpoint_step"),
        ({"max_lost_s": 0}, "max_lost_s"),
        ({"max_lost_s": -1.0}, "max_lost_s"),
        ({"max_lost_s": float("inf")}, "max_lost_s"),
        ({"window": 0}, "window"),
        ({"headroom": 1.0}, "headroom"),
        ({"shrink_ratio": 1.0}, "shrink_ratio"),
        ({"drift_ratio": 1.0}, "drift_ratio"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_bad_configuration_is_refused_with_the_field_named(kwargs, field_name):
    with pytest.raises(ConfigError, match=field_name.replace("[", r"\[")) as e:
        Adaptive(**kwargs)
    assert repr(next(iter(kwargs.values())))[:3] in str(e.value)  # the value is named too


def test_should_save_is_a_pure_function_of_configuration_and_context():
    p = Adaptive(first_checkpoint_step=5)
    assert p.initial_interval() == 5
    fresh = [s for s in range(1, 12) if p.should_save(s, SaveContext(s, 0, 0, None))]
    assert fresh[0] == 5
    assert p.should_save(40, SaveContext(40, 0, 30, 10)) and not p.should_save(39, SaveContext(39, 0, 30, 10))
    assert not p.should_save(40, SaveContext(40, 0, 30, 10, epoch_end=True))
    assert Adaptive(min_interval=60).initial_interval() == 60  # never before min_interval
    assert Adaptive(max_interval=3).initial_interval() == 3
    # A worker's copy (pickled before anything was learnt) answers exactly like the controller's
    # copy after it has learnt a profile and loaded state.
    worker = pickle.loads(pickle.dumps(p))
    quiet(simulate, p, Trace(), 300)
    p.load_state_dict(p.state_dict())
    for s, last, k in [(5, 0, None), (5, 0, 5), (77, 30, 47), (76, 30, 47)]:
        ctx = SaveContext(s, 0, last, k)
        assert worker.should_save(s, ctx) == p.should_save(s, ctx)
    assert worker.initial_interval() == p.initial_interval()


# ------------------------------------------------------------------------------------------------
# Adaptive on synthetic traces
# ------------------------------------------------------------------------------------------------


def _fixed_overhead(trace: Trace, every: int, steps: int, lo: int = 200) -> float:
    return simulate(FixedInterval(every=every), trace, steps).overhead_pct(lo)


def test_steady_trace_within_budget_and_shortest_such_interval():
    trace = Trace()
    p = Adaptive(budget_pct=BUDGET)
    run = simulate(p, trace, 2500)
    k = run.interval_at(2500)
    assert len(run.changes) <= 2 and len(run.tuned_changes()) <= 1  # profile, then leave it alone
    assert run.overhead_pct(200) <= BUDGET
    # The oracle: the same trace with fixed intervals. k is within budget, a clearly shorter one is not.
    assert _fixed_overhead(trace, k, 2500) <= BUDGET
    assert _fixed_overhead(trace, int(k * 0.8), 2500) > BUDGET
    e = p.explain()
    assert e["phase"] == "tuned" and e["binding"] == "budget" and e["interval"] == k
    assert e["predicted_overhead_pct"] <= BUDGET
    assert abs(e["measured_overhead_pct"] - run.overhead_pct(200)) < 0.5


def test_checkfreq_formula_is_a_floor_and_is_met_when_persist_binds():
    # Stall tiny, persist long: one persist in flight is what decides.
    trace = Trace(stall_s=0.005, copy_s=0.1, nbytes=1_000_000_000, bw=1e9)
    p = Adaptive()
    run = simulate(p, trace, 2000)
    k = run.interval_at(2000)
    k_checkfreq = max(math.ceil(trace.bg_s(1000, 0) / trace.iter_s), 1)  # (t_full - t_stall) / t_iter
    assert k >= k_checkfreq
    assert k <= 1.25 * k_checkfreq + 1  # not wider than needed: the budget does not bind here
    assert p.explain()["binding"] == "persist_in_flight"
    assert p.explain()["checkfreq_interval"] == k_checkfreq
    assert max(c["wait"] for c in run.ckpts if c["step"] > 200) == 0.0  # never waits for a persist
    # And on a budget-bound trace the floor holds as well.
    trace = Trace()
    run = simulate(Adaptive(), trace, 800)
    assert run.interval_at(800) >= math.ceil(trace.bg_s(1, 0) / trace.iter_s)


def test_profiling_is_cheap_for_a_slow_job():
    # 10 s per iteration: CheckFreq would time ~100 iterations (17 minutes) before checkpointing.
    trace = Trace(iter_s=10.0, stall_s=10.0, copy_s=1.0, nbytes=4_000_000_000, bw=1e9)
    p = Adaptive(first_checkpoint_step=5)
    run = simulate(p, trace, 120)
    assert run.ckpt_steps()[0] == 5
    first_step, k, _ = run.changes[0]
    assert first_step <= 8  # tuned right after the first checkpoint's persist time is known
    assert len(run.changes) <= 2
    assert run.overhead_pct(first_step + ADOPT_DELAY + 30) <= BUDGET
    assert _fixed_overhead(trace, int(k * 0.8), 400, lo=40) > BUDGET


@pytest.mark.parametrize("floor_s", [0.0005, 0.005])
def test_a_guard_wait_the_persists_cannot_explain_does_not_widen_the_interval(floor_s):
    # Every checkpoint reports a small guard wait (the wait's own cost, a fraction of a millisecond in
    # the engine; or a few ms of a pause) while the persist takes 4 ms. Taken as "the previous persist
    # outlasted the interval", each wait made the interval its own lower bound: 3 -> 169 steps in
    # 1,500 (and a real run went from 5 to 60 right after its storage was fast again).
    trace = Trace(
        ranks=2,
        iter_s=0.035,
        stall_s=0.003,
        copy_s=0.001,
        nbytes=4_000_000,
        bw=1e9,
        iter_noise=0.05,
        wait_floor_s=floor_s,
    )
    p = Adaptive(budget_pct=5.0)
    run = quiet(simulate, p, trace, 1500)
    assert run.interval_at(1500) <= 6, run.changes
    assert max(k for s, k, _ in run.changes if s > 600) <= 30, run.changes  # probe windows only
    assert not p.explain()["background_from_waits"]


def test_iterations_slow_down_half_way_the_interval_follows_in_steps():
    trace = Trace().at(1500, iter_s=0.1)
    p = Adaptive()
    run = simulate(p, trace, 3000)
    k1, k2 = run.interval_at(1499), run.interval_at(3000)
    assert k2 < k1 * 0.6  # the same checkpoint cost is now spread over slower iterations
    shortened_at = next(s for s, k, _ in run.changes if s >= 1500)
    assert len(run.ckpt_steps(1500, shortened_at)) <= 3
    assert run.overhead_pct(200, 1499) <= BUDGET and run.overhead_pct(1500 + 4 * k1) <= BUDGET
    assert _fixed_overhead(Trace(iter_s=0.1), int(k2 * 0.8), 1500) > BUDGET  # still the shortest


def test_fast_disk_turning_slow_widens_at_once():
    trace = Trace(nbytes=500_000_000, bw=1e9).at(1000, bw=1e8)  # persist 0.5 s -> 5 s
    p = Adaptive()
    run = simulate(p, trace, 2500)
    k1, k2 = run.interval_at(999), run.interval_at(2500)
    assert k2 * trace.iter_s >= trace.bg_s(1500, 0) > k1 * trace.iter_s
    widened_at = next(s for s, k, _ in run.changes if s >= 1000)
    assert len(run.ckpt_steps(1000, widened_at + 1)) <= 2  # the first guard wait is enough evidence
    assert [c for c in run.ckpts if c["step"] > widened_at + ADOPT_DELAY and c["wait"] > 1e-9] == []
    assert p.explain()["binding"] == "persist_in_flight"
    assert run.overhead_pct(widened_at + k2) <= BUDGET


def test_one_straggler_rank_governs():
    base = Trace(nbytes=100_000_000, bw=1e9)
    straggler = Trace(nbytes=100_000_000, bw=1e9).at(0, ranks=[2], bw=2e8, stall_s=0.3)
    k_base = simulate(Adaptive(), base, 1500).interval_at(1500)
    p = Adaptive()
    run = simulate(p, straggler, 1500)
    k = run.interval_at(1500)
    assert k > 2 * k_base
    assert k * straggler.iter_s >= straggler.bg_s(1, 2)
    assert run.overhead_pct(300) <= BUDGET
    assert _fixed_overhead(straggler, k_base, 1500) > BUDGET  # ignoring rank 2 would break the budget
    # A rank that computes slower sets the iteration time (the collectives make every rank wait).
    p = Adaptive()
    simulate(p, Trace().at(0, ranks=[1], iter_s=0.08), 600)
    assert p.explain()["iter_s"] == pytest.approx(0.08, rel=0.05)
    # Without a collective that evens them out, the slowest rank's own time is the one used.
    p = Adaptive()
    feed = [Sample(rank=r, step=s, iter_s=0.08 if r == 2 else 0.05, iters=1) for s in range(3, 40) for r in range(4)]
    feed += [Sample(rank=r, step=40, ckpt_step=5, stall_s=0.1, persist_s=0.1) for r in range(4)]
    assert p.plan(feed, None) is not None
    assert p.explain()["slowest_rank"] == 2 and p.explain()["iter_s"] == 0.08


def test_interference_widens_then_shortens_again():
    # Another job shares the node from step 1000 to 2500: slower stalls, copies and disk.
    trace = (
        Trace()
        .at(1000, stall_s=0.4, copy_s=0.2, bw=3e8, iter_s=0.055)
        .at(2500, stall_s=0.1, copy_s=0.05, bw=1e9, iter_s=0.05)
    )
    p = Adaptive()
    run = simulate(p, trace, 4000)
    k0 = run.interval_at(999)
    widened = [(s, k) for s, k, _ in run.changes if 1000 <= s < 2500]
    assert widened and widened[0][1] > 2 * k0
    assert len(run.ckpt_steps(1000, widened[0][0] + 1)) <= 3
    shortened = [(s, k) for s, k, _ in run.changes if s >= 2500]
    assert shortened and abs(shortened[-1][1] - k0) <= 0.2 * k0
    assert len(run.ckpt_steps(2500, shortened[0][0] + 1)) <= 5
    assert len(run.changes) <= 4  # profile, widen, shorten: nothing in between
    k_mid = run.interval_at(2400)
    assert run.overhead_pct(widened[0][0] + k_mid, 2499) <= BUDGET
    assert run.overhead_pct(shortened[0][0] + 2 * k0) <= BUDGET
    assert p.explain()["drift"]  # explain() says a change of level was seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_oscillation_on_a_noisy_steady_trace(seed):
    trace = Trace(iter_noise=0.1, ckpt_noise=0.25, seed=seed)
    run = simulate(Adaptive(), trace, 4000)
    tuned = run.tuned_changes()
    assert reversals([k for _, k, _ in run.changes[1:]]) == 0 and len(tuned) <= 3
    assert run.overhead_pct(300) <= BUDGET


def test_slowdown_of_iterations_during_a_persist_is_part_of_the_cost():
    # Iterations run 50 % slower while a persist is in flight (shared PCIe/CPU/disk).
    trace = Trace(nbytes=500_000_000, bw=1e9, slowdown=0.5)
    p = Adaptive()
    run = simulate(p, trace, 3000)
    k = run.interval_at(3000)
    assert p.explain()["slowdown_s"] > p.explain()["stall_s"]
    assert run.overhead_pct(500) <= BUDGET
    stall_only = math.ceil(trace.stall_s / (BUDGET / 100 * trace.iter_s))  # what the stall alone asks for
    assert k > 1.5 * stall_only and _fixed_overhead(trace, stall_only, 3000) > BUDGET


@pytest.mark.parametrize("slowdown,warm_up", [(1.0, False), (0.3, False), (0.0, False), (1.0, True)])
def test_first_decision_does_not_undercut_the_slowdown_it_has_not_measured(slowdown, warm_up):
    # A stall of a few ms, a persist of ~1.5 iterations. With every core training (slowdown 1)
    # the iterations overlapping it run twice as slow, so a checkpoint costs about a whole
    # persist; with a core free (slowdown 0) it costs the stall. Until the first checkpoint's
    # overlap is over nothing tells the two apart. ``warm_up``: the first iterations of a job are
    # slower (allocator, caches; 0.59 s against 0.38 s on the benchmark's reference job), so the
    # overlapped ones compared with them look no slower — that is not a measured slowdown of 0.
    trace = Trace(ranks=2, iter_s=0.4, stall_s=0.005, copy_s=0.2, nbytes=300_000_000, bw=1e9, slowdown=slowdown)
    if warm_up:
        trace.iter_s = 0.6
        trace.at(7, iter_s=0.4)
    p = Adaptive(budget_pct=2.0)
    run = simulate(p, trace, 600)
    k = run.interval_at(600)
    first, second = run.ckpt_steps()[:2]
    # No checkpoint at an interval shorter than what the measurements settle on ...
    assert second - first >= 0.8 * k
    assert all(c["interval"] >= 0.8 * k for c in run.ckpts[1:])
    # ... and no long wait for the measurements either: the second checkpoint comes on time, at
    # the settled interval or, where that is far below the provisional one (a checkpoint that
    # costs its stall alone: 2 steps against 70), at the first measured decision's limit (a
    # quarter of the provisional: one decision on a checkpoint or two does not cut more), and the
    # next checkpoint decides: the settled interval follows right after it.
    provisional = run.changes[0][1]
    assert run.changes[1][1] >= math.ceil(provisional * FIRST_SHORTEN)  # one decision cuts 4x at most
    assert second <= first + max(k, math.ceil(provisional * FIRST_SHORTEN)) + 4 + ADOPT_DELAY
    assert next(step for step, kk, _ in run.changes if kk == k) <= second + 4 + ADOPT_DELAY
    # With the warm-up, the provisional interval is derived from the slow first iterations (it
    # predicts a checkpoint's cost as a share of 0.6 s iterations, not 0.4 s): up to a third short
    # until the settled one replaces it.
    assert run.overhead_pct(1, 200) <= (1.25 if warm_up else 1.1) * 2.0


def test_max_lost_s_wins_over_the_budget_and_says_so():
    p = Adaptive(max_lost_s=1.0)
    with pytest.warns(PolicyWarning, match="max_lost_s=1 wins over budget_pct=5") as rec:
        run = simulate(p, Trace(), 1500)
    assert len([w for w in rec if issubclass(w.category, PolicyWarning)]) == 1  # once
    k = run.interval_at(1500)
    assert k * 0.05 <= 1.0
    assert Adaptive().plan([], None) is None
    e = p.explain()
    assert e["binding"] == "max_lost_s" and e["conflicts"] and e["predicted_overhead_pct"] > BUDGET
    assert run.overhead_pct(200) > BUDGET  # the price the user asked for


def test_max_lost_s_cannot_beat_the_persist_time():
    trace = Trace(nbytes=2_000_000_000, bw=1e9)  # 2 s to persist
    p = Adaptive(max_lost_s=1.0)
    with pytest.warns(PolicyWarning, match="cannot be met.*persist time wins"):
        run = simulate(p, trace, 1500)
    assert run.interval_at(1500) * trace.iter_s >= trace.bg_s(1, 0)
    assert p.explain()["binding"] == "persist_in_flight"


def test_max_lost_s_shorter_than_one_iteration():
    p = Adaptive(max_lost_s=1.0)
    with pytest.warns(PolicyWarning, match="shorter than one iteration"):
        run = simulate(p, Trace(iter_s=2.0, stall_s=0.01, copy_s=0.01, nbytes=1000), 40)
    assert run.interval_at(40) == 1


def test_min_and_max_interval_win():
    run = simulate(Adaptive(min_interval=60), Trace(), 1000)
    assert run.ckpt_steps()[0] == 60 and min(run.intervals) >= 60
    p = Adaptive(max_interval=20)
    with pytest.warns(PolicyWarning, match="max_interval=20 wins over budget_pct"):
        run = simulate(p, Trace(), 600)
    assert max(run.intervals) <= 20 and p.explain()["binding"] == "max_interval"


# ------------------------------------------------------------------------------------------------
# Restart, robustness, cost
# ------------------------------------------------------------------------------------------------


def test_saved_profile_spares_a_restarted_job_the_profiling():
    trace = Trace()
    p = Adaptive()
    run = simulate(p, trace, 1500)
    k = run.interval_at(1500)
    state = json.loads(json.dumps(p.state_dict()))  # what the controller writes next to the run

    restarted = Adaptive()
    restarted.load_state_dict(state)
    assert restarted.initial_interval() == 5  # configuration only: every rank agrees without state
    assert restarted.plan([], 5) == k  # published at once, before any sample
    assert restarted.explain()["phase"] == "restored"
    again = Adaptive()
    again.load_state_dict(state)
    run = simulate(again, trace, 1500, start_step=1500)
    assert [c for _, c, _ in run.changes] == [k]  # no re-profiling, no retuning: nothing changed
    assert "confirmed" in again.explain().get("reason", "") or again.explain()["phase"] == "tuned"

    # A new budget re-derives the interval from the same profile.
    looser = Adaptive(budget_pct=10.0)
    looser.load_state_dict(state)
    assert looser.plan([], 5) == pytest.approx(k / 2, abs=1)

    # Conditions changed since the profile (a 10x slower disk): retuned as soon as measured.
    slow = Trace(nbytes=1_000_000_000, bw=1e8)
    again = Adaptive()
    again.load_state_dict(state)
    run = simulate(again, slow, 1500, start_step=1500)
    assert run.interval_at(3000) * slow.iter_s >= slow.bg_s(1, 0)
    assert len(run.ckpt_steps(1500, run.changes[-1][0] + 1)) <= 3

    with pytest.raises(ConfigError, match="version"):
        Adaptive().load_state_dict({"version": 99})
    empty = Adaptive()
    empty.load_state_dict(Adaptive().state_dict())  # nothing measured: profile as usual
    assert empty.plan([], 5) is None


def test_whole_history_and_new_samples_give_the_same_decisions():
    feed: list = []
    a = Adaptive()
    simulate(a, Trace(iter_noise=0.05, ckpt_noise=0.1), 1200, samples_out=feed)
    assert len(feed) > 500
    b, c = Adaptive(), Adaptive()
    history: list = []
    cur_b = cur_c = 5
    out_b, out_c = [], []
    for i in range(0, len(feed), 4):
        batch = feed[i : i + 4]
        history.extend(batch)
        kb = b.plan(history, cur_b)  # the whole history, growing
        kc = c.plan(batch, cur_c)  # only the new samples
        cur_b, cur_c = kb or cur_b, kc or cur_c
        out_b.append(kb)
        out_c.append(kc)
    assert out_b == out_c and any(out_b)


def test_plan_cost_does_not_grow_with_the_history():
    p = Adaptive()
    history = [Sample(rank=r, step=s, iter_s=0.05, iters=5) for s in range(5, 15_000, 5) for r in range(4)]
    p.plan(history, 5)
    t0 = time.process_time()
    for i in range(500):
        history.append(
            Sample(
                rank=i % 4,
                step=15_000 + i,
                iter_s=0.05,
                iters=5,
                ckpt_step=15_000,
                stall_s=0.1,
                copy_s=0.05,
                persist_s=0.1,
            )
        )
        p.plan(history, 5)
    assert time.process_time() - t0 < 1.0  # 12k-long history: O(n) per call would take far longer


def test_messy_samples_and_a_restart_inside_the_run_do_not_break_it():
    p = Adaptive()
    junk = [
        Sample(rank=0, step=3, iter_s=float("nan"), iters=3),
        Sample(rank=1, step=3, iter_s=-1.0, iters=2),
        Sample(rank=0, step=4, iter_s=0.1, iters=0),
        Sample(rank=2, step=4, stall_s=float("inf")),
        Sample(rank=3, step=4, ckpt_step=4, persist_s=-2.0, nbytes=-1),
    ]
    assert p.plan(junk, None) is None
    trace = Trace()
    simulate(p, trace, 800)
    k = p.explain()["interval"]
    # Every rank restarts from step 700 (a failure) and runs again: steps go back.
    run = simulate(p, trace, 800, start_step=700)
    assert abs(run.interval_at(800) - k) <= 0.2 * k and run.overhead_pct(200) <= BUDGET
    stats = p.checkpoint_stats(run.ckpt_steps()[-2])
    assert stats and all(v is None or v >= 0 for v in stats.values())


@pytest.mark.parametrize("mode", ["persist_from_controller", "no_ckpt_step", "no_wait_s", "stall_and_copy_only"])
def test_engine_variants_still_tune(mode):
    kw = {
        "persist_from_controller": {"persist_via_controller": True},
        "no_ckpt_step": {"with_ckpt_step": False, "persist_via_controller": True},
        "no_wait_s": {"report_wait": False},
        "stall_and_copy_only": {"with_ckpt_step": False, "report_wait": False, "report_persist": False},
    }[mode]
    trace = Trace(nbytes=500_000_000, bw=1e9)
    p = Adaptive()
    run = simulate(p, trace, 1500, **kw)
    k = run.interval_at(1500)
    assert run.overhead_pct(300) <= BUDGET and k * trace.iter_s >= trace.bg_s(1, 0)
    assert _fixed_overhead(trace, int(k * 0.7), 1500) > BUDGET


def test_explain_and_checkpoint_stats_are_json_and_truthful():
    p = Adaptive()
    assert p.explain()["phase"] == "profiling"
    trace = Trace(nbytes=300_000_000, bw=1e9)
    run = simulate(p, trace, 1000)
    e = json.loads(json.dumps(p.explain()))
    for key in (
        "phase",
        "interval",
        "target",
        "binding",
        "reason",
        "conflicts",
        "budget_pct",
        "iter_s",
        "cost_s",
        "background_s",
        "predicted_overhead_pct",
        "measured_overhead_pct",
        "lost_work_s",
        "checkfreq_interval",
        "last_change",
    ):
        assert key in e, key
    assert e["iter_s"] == pytest.approx(trace.iter_s, rel=0.02)
    assert e["background_s"] == pytest.approx(trace.bg_s(1, 0), rel=0.02)
    assert e["lost_work_s"] == pytest.approx(e["interval"] * trace.iter_s, rel=0.02)
    stats = p.checkpoint_stats(run.ckpt_steps()[-3])
    json.dumps(stats)
    assert stats["stall_s"] == pytest.approx(trace.stall_s) and stats["bytes"] == 4 * trace.nbytes
    # The job's time lost to checkpoints over its training time, as of that checkpoint.
    assert stats["overhead_pct"] == pytest.approx(run.overhead_pct(1), abs=1.0)
    assert p.checkpoint_stats(-1) is None


def test_a_checkpoint_straddling_the_end_of_slow_storage_does_not_hold_the_interval_wide():
    # Slow storage from step 1000 to 2500 (persist 0.1 s -> 1 s); the checkpoint taken as it ends
    # persists at an in-between speed. That one value must not keep the interval wide for the
    # ``window`` checkpoints it stays in the estimate (the e2e run: 29 -> 15 and no further).
    trace = Trace(stall_s=0.005, nbytes=100_000_000, bw=1e9).at(1000, bw=1e8).at(2500, bw=3e8).at(2524, bw=1e9)
    p = Adaptive()
    run = simulate(p, trace, 4000)
    k0, k_slow = run.interval_at(999), run.interval_at(2499)
    assert k_slow > 3 * k0
    ckpts_after = run.ckpt_steps(2524)
    assert run.interval_at(ckpts_after[5]) <= 1.25 * k0, (k0, k_slow, run.changes)
    assert run.interval_at(4000) <= 1.2 * k0


def _coalescing_run(
    policy, steps: int, slow_from: int, slow_to: int, fast_s=0.01, slow_s=0.91, iter_s=0.035, seed=0, poll_s=None
):
    """The engine and the holder as they are at intervals shorter than a persist: each rank
    reports only its newest checkpoint with each sample (one per ``POLL_S``), and the holder writes
    one snapshot at a time, the newest staged one, skipping the rest; persist times come from the
    controller once a written checkpoint is durable. Returns the published changes (step, from, to)
    and the steps whose persists were reported."""
    rng = random.Random(seed)
    poll_s = POLL_S if poll_s is None else poll_s
    cur = policy.initial_interval()
    samples, pending, changes, persisted = [], [], [], []
    t, next_poll, last_save, busy_until, staged = 0.0, poll_s, 0, 0.0, None
    acc = {r: [0, 0.0] for r in (0, 1)}
    newest: dict = {}
    for step in range(1, steps + 1):
        dt = iter_s * rng.uniform(0.9, 1.1)
        t += dt
        for r in acc:
            acc[r][0] += 1
            acc[r][1] += dt
        if step - last_save >= cur:
            last_save = step
            for r in acc:
                newest[r] = dict(ckpt_step=step, stall_s=0.003, copy_s=0.001, nbytes=10**6)
            staged = (step, slow_s if slow_from <= step < slow_to else fast_s)
        if staged and t >= busy_until:
            busy_until = t + staged[1]
            pending.append((busy_until, *staged))
            staged = None
        for item in [x for x in pending if x[0] <= t]:
            pending.remove(item)
            persisted.append(item[1])
            samples += [Sample(rank=r, step=item[1], ckpt_step=item[1], persist_s=item[2]) for r in acc]
        if t >= next_poll:
            next_poll = t + poll_s
            for r in acc:
                samples.append(
                    Sample(rank=r, step=step, iter_s=acc[r][1] / acc[r][0], iters=acc[r][0], **newest.get(r, {}))
                )
                acc[r] = [0, 0.0]
            k = policy.plan(samples[-256:], cur)
            if k is not None and k != cur:
                changes.append((step, cur, k))
                cur = k
    return changes, persisted


def _in_force(changes, step: int) -> int:
    """The interval in force at ``step`` of a :func:`_coalescing_run` of ``Adaptive(budget_pct=5.0)``."""
    k = Adaptive(budget_pct=5.0).initial_interval()
    for s, _, to in changes:
        if s <= step:
            k = to
    return k


@pytest.mark.parametrize("poll_s", [0.5, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_the_interval_storage_widened_comes_back_once_it_is_fast(seed, poll_s):
    # The e2e slow-storage run. With samples every ~14 steps (a busy machine) the interval storage
    # widened to (~29) is under two samples' span, so its checkpoints are set aside for their
    # slowdown: their persist times must still count (the slow ones no longer did: the interval
    # stayed at 29 to the end, persist_in_flight binding on 0.91 s), and the cost must not rest on
    # two old checkpoints for ever (no shortening ever had the three checkpoints of one level it
    # waits for). With samples every second, a slowdown not yet measured must not weigh the slow
    # persist whole (0.91 s against a 5 % budget: ~570 steps, no checkpoint left to measure by).
    changes, _ = _coalescing_run(Adaptive(budget_pct=5.0), 500, 60, 220, seed=seed, poll_s=poll_s)

    def at(step):
        return _in_force(changes, step)

    during = max(at(s) for s in range(60, 260))
    assert during * 0.035 >= 0.91, changes
    assert min(at(s) for s in range(280, 501)) <= during / 2, changes


@pytest.mark.parametrize("poll_s", [0.25, 0.5])
@pytest.mark.parametrize("seed", range(4))
def test_a_tenfold_fall_of_the_persist_shortens_at_the_second_fast_checkpoint(seed, poll_s):
    # Storage slow (0.91 s persists) and then fast (0.01 s) again: the persist is timed, not inferred,
    # and a fall of 90x seen at two checkpoints is evidence enough. Waiting for a third checkpoint of
    # the new level and then confirming at a fourth took 3.2-5.7 of the wide intervals to begin
    # coming back (a 750-step e2e run had too few of them left).
    changes, _ = _coalescing_run(Adaptive(budget_pct=5.0), 700, 60, 220, seed=seed, poll_s=poll_s)

    def at(step):
        return _in_force(changes, step)

    wide = at(220)
    assert wide * 0.035 >= 0.91, changes
    first = next((s for s, k0, k in changes if s > 220 and k < k0 == wide), None)
    assert first is not None and first - 220 <= 2.5 * wide, (wide, changes)


def test_persists_of_checkpoints_the_ranks_never_reported_still_count():
    # Storage slows down at step 60 while the interval is 2 and the persist ~25 steps: the holder
    # writes one snapshot in ~12. Those written are seldom the ones the ranks' samples named; their
    # persist times used to be dropped, and the widening waited for a lucky one (the e2e run
    # widened 5 slow persists late).
    changes, persisted = _coalescing_run(Adaptive(budget_pct=5.0), 400, 60, 220)
    slow = [s for s in persisted if 60 <= s < 220]
    widened = [(s, k) for s, k0, k in changes if 60 <= s < 220 and k > 3 * k0]
    assert widened, changes
    # Two slow persists make a change of level; the second is reported ~25 steps after it started.
    assert widened[0][0] <= slow[1] + 35, (changes, slow)
    assert widened[0][1] * 0.035 >= 0.91


class _Watched:
    """``policy`` as ``simulate`` drives it, keeping ``explain()`` after every plan."""

    def __init__(self, policy):
        self.policy, self.seen = policy, []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def plan(self, samples, current):
        k = self.policy.plan(samples, current)
        self.seen.append(self.policy.explain())
        return k


@pytest.mark.parametrize("seed", range(3))
def test_a_checkpoint_never_weighs_more_than_its_stall_and_its_copy_and_persist(seed):
    # A busy machine: the iteration time moves by 10-20 % under the checkpoints, for reasons of its
    # own. What the iterations around a checkpoint lose beyond its copy and persist is that, not the
    # checkpoint: counted, it read 0.1 s per checkpoint against a 5 ms copy and persist in the e2e
    # slow-storage run and held the interval at 108 steps after the storage was fast.
    trace = Trace(
        ranks=2, iter_s=0.035, stall_s=0.003, copy_s=0.001, nbytes=4_000_000, bw=1e9, iter_noise=0.15, seed=seed
    )
    for step in range(100, 1500, 100):
        trace.at(step, iter_s=0.035 * (1.2 if (step // 100) % 2 else 1.0))
    w = _Watched(Adaptive(budget_pct=5.0))
    quiet(simulate, w, trace, 1500)
    bound = 0.003 + 0.001 + 0.004  # stall + copy + persist (4 MB at 1 GB/s)
    costs = [e["cost_s"] for e in w.seen if e.get("cost_s") is not None]
    assert costs and max(costs) <= 1.5 * bound, max(costs)
