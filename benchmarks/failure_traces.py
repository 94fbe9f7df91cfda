"""Failure traces for the goodput simulator (``benchmarks/failure_sim.py``), and where each comes from.

A trace is a sorted list of :class:`Failure`: when (seconds from the start of the run) and what
failed — a training *process* (a SIGKILL, an OOM, a software fault: the node and its holder survive,
so cf_ray can restore from memory) or a *node* (a hardware fault, a preemption: everything on it is
lost, the restore comes from storage). Every generator is seeded, so a trace is the same on every run.

* :func:`poisson` — independent failures at a constant rate (the model behind Young/Daly).
* :func:`weibull` — bursty: times between failures drawn from a Weibull distribution of shape
  below 1 (a decreasing hazard: a failure is followed by more). Schroeder and Gibson found the
  time between failures of HPC nodes well fit by a Weibull of shape 0.7 to 0.8 ("A large-scale
  study of failures in high-performance computing systems", DSN 2006); :data:`WEIBULL_SHAPE` is 0.7.
* :func:`spot_pool` — preemptions of a pool of Google Compute Engine preemptible VMs, generated from
  what Google documents: Compute Engine *always* stops a preemptible VM 24 hours after it started
  (https://cloud.google.com/compute/docs/instances/preemptible, "Preemptible instance limitations"),
  and may stop it earlier; a stopped VM is replaced at once by a new one, with its own 24 hours.
  A pool started together for a job (the VMs' start times spread over ``launch_spread_s``) is
  therefore reclaimed in waves, one VM after another, once a day — every VM of the run's pool is a
  node of the run, so each reclaim is a failure of the run. The earlier, random preemptions are
  drawn at a constant rate per VM equal to AWS's worst published interruption band (the Spot
  Instance Advisor's "more than 20 %" of instances interrupted in a month,
  https://aws.amazon.com/ec2/spot/instance-advisor/; taken as 20 % a month). Google publishes no
  rate for them; Kadupitiya, Jadhao and Sharma measured their lifetimes to be bathtub-shaped
  ("Modeling the temporally constrained preemptions of transient cloud VMs", HPDC 2020), which the
  24-hour waves reproduce at the far end; the early end is not modelled.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PROCESS = "process"
"""A training process failed; its node (and the snapshots its holder keeps) survived."""
NODE = "node"
"""A node was lost with everything on it; the restore comes from storage."""

WEIBULL_SHAPE = 0.7
"""Shape of the bursty trace's Weibull (Schroeder and Gibson, DSN 2006: 0.7 to 0.8)."""

GCP_MAX_LIFETIME_S = 24 * 3600.0
"""Compute Engine stops every preemptible VM 24 hours after it started (Google's documentation)."""

SPOT_MONTHLY_INTERRUPTION = 0.20
"""Share of instances interrupted in a month: the Spot Instance Advisor's worst band (> 20 %)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """One failure of the run."""

    time_s: float
    """Seconds from the start of the run."""
    kind: str
    """:data:`PROCESS` or :data:`NODE`."""


def poisson(mtbf_s: float, horizon_s: float, seed: int, kind: str = PROCESS) -> list[Failure]:
    """Failures at a constant rate, one every ``mtbf_s`` seconds on average."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append(Failure(t, kind))


def weibull(
    mean_s: float, horizon_s: float, seed: int, shape: float = WEIBULL_SHAPE, kind: str = NODE
) -> list[Failure]:
    """Times between failures drawn from a Weibull of ``shape`` whose mean is ``mean_s``."""
    rng = random.Random(seed)
    scale = mean_s / math.gamma(1.0 + 1.0 / shape)
    out, t = [], 0.0
    while True:
        t += rng.weibullvariate(scale, shape)
        if t >= horizon_s:
            return out
        out.append(Failure(t, kind))


def spot_pool(
    nodes: int,
    horizon_s: float,
    seed: int,
    *,
    launch_spread_s: float = 600.0,
    max_lifetime_s: float = GCP_MAX_LIFETIME_S,
    monthly_interruption: float = SPOT_MONTHLY_INTERRUPTION,
) -> list[Failure]:
    """Preemptions of a pool of ``nodes`` preemptible VMs started together (see the module docstring).

    Each VM is preempted at ``min(its start + max_lifetime_s, its start + Exp(rate))`` with ``rate``
    the constant hazard that interrupts ``monthly_interruption`` of VMs in 30 days, and is replaced
    at once. All are nodes of the run.
    """
    rng = random.Random(seed)
    rate = -math.log(1.0 - monthly_interruption) / (30 * 86400.0)
    out = []
    for _ in range(nodes):
        start = rng.uniform(0.0, launch_spread_s)
        while True:
            end = start + min(max_lifetime_s, rng.expovariate(rate))
            if end >= horizon_s:
                break
            out.append(Failure(end, NODE))
            start = end
    out.sort(key=lambda f: f.time_s)
    return out


def describe(trace: list[Failure], horizon_s: float) -> dict:
    """Count, mean time between failures, and how bursty (coefficient of variation of the gaps)."""
    gaps = [b.time_s - a.time_s for a, b in zip(trace, trace[1:])]
    mean = horizon_s / len(trace) if trace else math.inf
    cv = None
    if len(gaps) >= 2:
        m = sum(gaps) / len(gaps)
        cv = math.sqrt(sum((g - m) ** 2 for g in gaps) / (len(gaps) - 1)) / m if m > 0 else None
    return {
        "failures": len(trace),
        "mtbf_s": mean if math.isfinite(mean) else None,
        "gap_cv": cv,
        "node_share": sum(f.kind == NODE for f in trace) / len(trace) if trace else None,
    }
