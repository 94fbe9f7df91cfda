"""``python -m benchmarks.policy_sim``: ``Adaptive`` on the trace simulator, the figures of the
choosing-when-to-checkpoint guide's "Does it keep the budget" tables.

The simulator is the one the policy's tests use (``tests/test_policy.py``), fed as the controller
feeds it (a sample a second per rank, each covering every iteration since the last); the job is
``tests/test_policy_trust.py``'s fast job: 75 ms iterations, a 1.5 ms stall, a copy and persist of
~80 ms that slow the iterations they overlap by 45 %. Deterministic: the figures do not depend on
the machine. Per budget and run length, five seeds: the interval in force at the end, the shortest
interval after the first checkpoint, the job's overhead after step 100 (against the same trace with
no checkpoint), and ``explain()["measured_overhead_pct"]`` against the job's own figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import warnings

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def run(budgets=(2.0, 5.0, 20.0), steps=(420, 2000), seeds=range(5)) -> list[dict]:
    sys.path.insert(0, str(TESTS))
    import test_policy as tp
    import test_policy_trust as trust

    from cf_ray.policy import Adaptive, PolicyWarning

    tp.POLL_S = trust.POLL_S
    rows = []
    for n in steps:
        for budget in budgets:
            for seed in seeds:
                trace = trust.fast_job(seed)
                p = Adaptive(budget_pct=budget)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", PolicyWarning)
                    r = tp.simulate(p, trace, n)
                e = p.explain()
                after = [k for step, k, _ in r.changes if step > 10]
                rows.append(
                    {
                        "steps": n,
                        "budget": budget,
                        "seed": seed,
                        "interval": e["interval"],  # the rules' (a probe window may be open)
                        "shortest": min(after) if after else r.interval_at(n),
                        "overhead_pct": r.overhead_pct(100),
                        "measured_overhead_pct": e.get("measured_overhead_pct"),
                        "job_overhead_pct": r.overhead_pct(1),
                        "true_budget_interval": trust.true_cost_s(trace) / (budget / 100 * trace.iter_s),
                    }
                )
    return rows


def render(rows: list[dict]) -> str:
    out = [
        "| steps | budget | intervals at the end, five seeds | shortest after the first checkpoint "
        "| overhead after step 100 | `measured_overhead_pct` against the job's, worst |",
        "|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["steps"], r["budget"]) for r in rows})
    for steps, budget in keys:
        rs = [r for r in rows if r["steps"] == steps and r["budget"] == budget]
        ovh = [r["overhead_pct"] for r in rs]
        off = [
            abs(r["measured_overhead_pct"] - r["job_overhead_pct"])
            for r in rs
            if r["measured_overhead_pct"] is not None
        ]
        out.append(
            f"| {steps} | {budget:g} % | {', '.join(str(r['interval']) for r in rs)} "
            f"| {min(r['shortest'] for r in rs)} (budget's, true cost: {rs[0]['true_budget_interval']:.1f}) "
            f"| {min(ovh):.1f} - {max(ovh):.1f} % | {max(off):.1f} points |"
            if off
            else f"| {steps} | {budget:g} % | {', '.join(str(r['interval']) for r in rs)} | | | |"
        )
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="420,2000", help="run lengths, comma-separated (default: %(default)s)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = run(steps=[int(x) for x in a.steps.split(",")])
    print(render(rows))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
