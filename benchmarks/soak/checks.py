"""The checks the soak makes of every run, and how it decides whether each injected fault was seen.
Pure functions of what the run left (its records, the monitor's, the reference's): no Ray here.

Checks (each ``{"ok": bool, ...}``):

* ``finished``: ``fit()`` returned, and rank 0 finished every step.
* ``bitwise``: the final model and optimizer state equal the reference run's, tensor by tensor (the
  SHA-256 of each is kept in the JSON; the demo's loop draws dropout masks from the restored RNG, so
  a wrong RNG shows in the weights).
* ``exactly_once``: the samples of the attempts that count (a later attempt replaces what an earlier
  one logged from its restore point on) are every sample once per epoch, and the same at every step
  as in the reference.
* ``committed_kept``: every checkpoint seen committed during the run (the monitor lists the manifests
  every 50 ms) is still listed, unquarantined and intact (``cf-ray verify``) at the end, unless
  keep-last removed it by design (it is not a milestone and ``keep_last`` newer ones that are not are
  listed) or the soak itself damaged it (``file_flip``).
* ``no_silent``: every fault the soak injected was seen (:func:`judge`).
* ``no_orphans``: after the run, nothing of it is left: no named actor of cf_ray's (controller,
  holders), no claim file of a spare worker process, no idle Ray worker of the job started during the
  run (a spare process a rank made and nobody ended).
* ``memory``: in every sample taken once the newest attempt had committed (1 s after) with all its
  ranks placed, and in one taken after the run ended (before its holders go), each holder's
  resident slot memory and its own ``held_bytes()`` are at most the bound of issue 23: three slot
  files per section of the ranks on its node (two alternating, a spare for a pinned or protected
  step) and two copies per section of the other nodes' ranks.
"""

from __future__ import annotations

import re
from typing import Any

#: Log lines that say a restore or a write found damaged bytes (not the success line that names
#: "verified against their fingerprints").
_DAMAGE = re.compile(r"\bblock|CRC|checksum|mismatch|corrupt|damage|differs|integrity|(?<!connection )refus", re.I)
_SETTLE_S = 1.0
_SLACK_BYTES = 64 * 1024


def lineage(ids_files: dict[tuple[int, int], list[dict]]) -> dict[tuple[int, int], tuple[int, list[int]]]:
    """``(rank, step) -> (epoch, ids)`` of the attempts that count, from ``{(rank, generation): lines}``:
    a later generation replaces what an earlier one logged."""
    rec: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for (rank, _gen), lines in sorted(ids_files.items(), key=lambda kv: kv[0][1]):
        for r in lines:
            rec[(rank, r["step"])] = (r["epoch"], r["ids"])
    return rec


def exactly_once(rec: dict, reference: dict, samples: int, epochs: int) -> dict:
    bad = []
    for epoch in range(epochs):
        ids = sorted(i for (e, batch) in rec.values() if e == epoch for i in batch)
        if ids != list(range(samples)):
            seen = set(ids)
            bad.append(
                {
                    "epoch": epoch,
                    "duplicated": len(ids) - len(seen),
                    "skipped": len(set(range(samples)) - seen),
                }
            )
    differ = sorted(k for k in set(rec) | set(reference) if rec.get(k) != reference.get(k))
    return {
        "ok": not bad and not differ,
        "epochs_wrong": bad,
        "steps_differ_from_reference": [list(k) for k in differ[:10]],
    }


def committed_kept(
    seen: dict[int, float],
    listed: list[int],
    quarantined: dict[int, str],
    problems: dict[int, list[str]],
    keep_last: int | None,
    damaged_by_soak: set[int],
    milestone_every: int | None = None,
) -> dict:
    """See the module doc; ``problems``: what ``cf-ray verify`` found per step at the end. Keep-last
    keeps the newest ``keep_last`` checkpoints that are not milestones, and every milestone."""

    def milestone(step: int) -> bool:
        return bool(milestone_every) and step % int(milestone_every) == 0

    lost, by_design, damaged = [], [], []
    listed_set = set(listed)
    for step in sorted(seen):
        if step in damaged_by_soak:
            damaged.append(step)
            continue
        if step in listed_set and step not in quarantined and not problems.get(step):
            continue
        newer = sum(1 for s in listed_set if s > step and not milestone(s))
        if step not in listed_set and keep_last is not None and newer >= keep_last and not milestone(step):
            by_design.append(step)
            continue
        why = "quarantined: " + quarantined[step] if step in quarantined else "; ".join(problems.get(step, []))
        lost.append({"step": step, "why": why or "no longer listed"})
    return {"ok": not lost, "lost": lost, "removed_by_keep_last": by_design, "damaged_by_the_soak": damaged}


def memory_bounded(mon: dict, slot_sizes: dict[str, int], world: int = 2) -> dict:
    """Check the monitor's memory samples (module doc); ``slot_sizes``: section -> slot file bytes.
    Samples taken while not every rank of the newest attempt was placed (a restart) are not checked."""
    first_commit = _first_commits(mon)
    worst: dict[str, Any] = {"ratio": 0.0}
    over = []
    checked = 0
    for s in mon["memory"]:
        t0 = first_commit.get(s["generation"])
        settled = t0 is not None and s["t"] >= t0 + _SETTLE_S and s.get("ranks_placed", world) >= world
        if not (settled or s.get("final")):
            continue
        checked += 1
        bound = memory_bound(s["ranks_on_node"], slot_sizes)
        held = max(s["memfd_resident"], reported_total(s.get("reported")))
        ratio = held / bound if bound else 0.0
        if ratio > worst["ratio"]:
            worst = {"ratio": round(ratio, 3), "held": held, "bound": bound, "sample": s}
        if held > bound and len(over) < 5:
            over.append({"held": held, "bound": bound, "sample": s})
    return {"ok": not over, "samples_checked": checked, "over": over, "worst": worst}


def memory_bound(ranks_on_node: list[int], slot_sizes: dict[str, int]) -> int:
    own = {f"rank_{r:05d}" for r in ranks_on_node} | ({"shared"} if 0 in ranks_on_node else set())
    return _SLACK_BYTES + sum((3 if sec in own else 2) * size for sec, size in slot_sizes.items())


def reported_total(reported: dict | None) -> int:
    """Bytes a holder says it holds (``held_bytes()``): every byte count but what it ``copied`` so far."""
    if not reported:
        return 0
    return sum(
        int(v) for k, v in reported.items() if isinstance(v, int | float) and k != "copied" and "sections" not in k
    )


def _first_commits(mon: dict) -> dict[int, float]:
    """generation -> when the monitor first saw a checkpoint committed after that attempt started."""
    out = {}
    for gen, start in mon["gen_start"].items():
        after = [t for t in mon["committed_seen"].values() if t >= start]
        if after:
            out[int(gen)] = min(after)
    return out


def no_orphans(actors: list[str], claims: list[dict], idle: list[int]) -> dict:
    """After the run (given the time its controller, holders and spares take to go): no named actor of
    cf_ray's of the run, no spare claim file of the run's job (``claims``: :func:`procs.job_spares`),
    and no idle Ray worker of the job started during the run (``idle``: a spare left, claimed or not).
    """
    spares = sorted({int(c.get("pid", 0)) for c in claims if c.get("alive")} | set(idle))
    return {
        "ok": not actors and not claims and not spares,
        "actors": actors,
        "claims": [{k: c.get(k) for k in ("pid", "for_pid", "rank", "alive", "idle", "file")} for c in claims],
        "spare_processes": spares,
    }


# -- was each fault seen? -------------------------------------------------------------------------------
def judge(fault: dict, run: dict) -> dict:
    """``{"outcome": seen|silent|unexercised|not_injected, "evidence": [...]}`` for one fault.

    ``run``: ``resumes`` (every rank's Resume per attempt), ``result`` (rank 0's records: failures,
    events, profile; None when the run did not finish), ``fit_error``, ``quarantined``; the fault's
    own ``log_lines`` (cf_ray's lines written after it was injected) and ``landed``.
    """
    if not fault.get("injected"):
        return {"outcome": "not_injected", "evidence": []}
    kind, gen = fault["kind"], fault.get("generation", 0)
    lines = fault.get("log_lines", [])
    result = run.get("result") or {}
    failures, events, profile = result.get("failures", []), result.get("events", []), result.get("profile", [])
    evidence: list[str] = []
    if run.get("fit_error"):
        evidence.append(f"the run failed: {run['fit_error'][:200]}")
    later = [r for r in run.get("resumes", []) if r.get("generation", 0) > gen]
    exercised = True
    if kind in ("worker_kill", "node_loss", "spare_kill"):
        evidence += [
            f"attempt {r['generation']} rank {r['rank']} restored ({r['source']}, step {r['step']})" for r in later[:2]
        ]
        if kind != "node_loss":
            said = spare_said(fault, run)
            if said is not None:
                if not said["ok"]:  # the restart's report of its spare is missing or wrong: a silent fallback
                    return {"outcome": "silent", "evidence": [f"spare: {said['why']}"], "spare": said}
                evidence.append(f"spare: {said['why']}")
                if kind == "spare_kill":
                    evidence += _lines(lines, r"fast path not taken")
                return {"outcome": "seen" if later else "silent", "evidence": evidence[:8], "spare": said}
    elif kind == "holder_kill":
        evidence += _lines(lines, r"holder")
        evidence += [f"failure: {f}" for f in failures if "holder" in str(f.get("error", "")).lower()][:3]
    elif kind == "controller_kill":
        evidence += _lines(lines, r"controller")
    elif kind == "storage_error":
        fid = fault["id"]
        writes = [w for w in fault["landed"].get("storage_writes", []) if w.get("outcome") == "refused"]
        exercised = bool(writes)
        evidence += [
            f"failure: step {f.get('step')} {f.get('section')}" for f in failures if fid in str(f.get("error"))
        ][:3]
        evidence += [f"event: {e.get('event')}" for e in events if fid in str(e)][:3]
        evidence += [ln for ln in lines if fid in ln][:3]
    elif kind == "storage_hang":
        writes = [w for w in fault["landed"].get("storage_writes", []) if w.get("outcome") == "blocked"]
        blocked = {w["step"]: w["blocked_s"] for w in writes if w.get("blocked_s", 0) >= 0.5}
        exercised = bool(blocked)
        for row in profile:
            b = blocked.get(row.get("step"))
            if b and max(_persists(row)) >= 0.5 * b:
                evidence.append(
                    f"profile: step {row['step']} took {max(_persists(row)):.1f} s to persist (blocked {b:.1f} s)"
                )
            elif b and (row.get("commit_s") or 0.0) >= 0.5 * b:  # the blocked write was the manifest
                evidence.append(
                    f"profile: step {row['step']} took {row['commit_s']:.1f} s to commit (blocked {b:.1f} s)"
                )
        evidence += [f"failure: step {f.get('step')}" for f in failures if f.get("step") in blocked][:3]
        evidence += [f"event: {e['event']}" for e in events if str(e.get("event", "")).startswith("durab")][:3]
        evidence += _lines(lines, r"durab|free slot|stall|hang|slow|not answer")
    else:  # the flips
        steps = _flipped_steps(fault)
        detected = [e for e in events if _names_damage(e, steps)]
        evidence += [f"event: {_short(e)}" for e in detected[:3]]
        evidence += [
            f"failure: step {f.get('step')}: {str(f.get('error'))[:120]}"
            for f in failures
            if f.get("step") in steps and _DAMAGE.search(str(f.get("error")))
        ][:3]
        evidence += [ln for ln in _lines(lines, _DAMAGE.pattern) if "verified against" not in ln]
        if kind == "file_flip":
            q = run.get("quarantined", {})
            evidence += [f"quarantined: step {s} ({q[s]})" for s in steps if s in q]
        if kind == "stream_flip":
            flip = fault["landed"].get("flip") or {}
            # A transfer that broke after the flip for another reason (the node it read from was
            # removed: the soak's next step) never handed those bytes to anyone: not exercised. One
            # that a check ended (a block mismatch) was, and must be reported.
            broke = flip.get("then_failed") and not _DAMAGE.search(str(flip["then_failed"]))
            exercised = bool(flip) and not broke
            evidence += [
                f"profile: step {r.get('step')} replica_error {r['replica_error']}"
                for r in profile
                if r.get("replica_error") and _DAMAGE.search(str(r["replica_error"]))
            ][:2]
            if not exercised:  # no flipped byte reached anyone: whatever else was said is not of it
                return {"outcome": "unexercised", "evidence": []}
            # The reader was the holder of the node the soak removed (seed 103: it was still copying
            # a peer's section 0.9 s after its raylet was gone): its copy, and its refusal of the
            # flipped bytes, went down with the node; no process alive received either.
            removed = (fault["landed"].get("on_the_node") or {}).get("holder") or []
            if not evidence and removed and flip.get("pid") == removed[0]:
                said = flip.get("then_failed") or "kept, then lost with its node"
                return {
                    "outcome": "unexercised",
                    "evidence": [f"read by the removed node's holder (pid {removed[0]}): {said}"],
                }
        else:
            source = "memory" if kind == "slot_flip" else "storage"
            used = [r for r in later if r.get("step") in steps and r.get("source") == source]
            exercised = bool(used or detected or len(evidence) > int(bool(run.get("fit_error"))))
    if not exercised and not evidence:
        return {"outcome": "unexercised", "evidence": []}
    return {"outcome": "seen" if evidence else "silent", "evidence": evidence[:8]}


def spare_said(fault: dict, run: dict) -> dict | None:
    """What the restart after a worker kill said of its spare process (the ``spare`` field of the
    next attempt's ``restore`` event: rank 0's), against where rank 0 of that attempt ran. ``None``
    when there is nothing to judge (no kill landed, or no restore event of the next attempt).

    ``ok`` is false when the restart said nothing of its spare, or said ``not taken`` while rank 0 ran
    in a spare that was claimed and idle at the kill. ``taken`` in another process is no contradiction:
    a spare being made at the kill may be claimed after it, by a rank Ray Train had not torn down yet
    (seed 31); the record says so. A spare that was not ready at the kill (made after the restore, the
    kill came first) fails nothing either (``ready_at_kill``)."""
    landed = fault.get("landed", {})
    if fault.get("point") in ("mid_restore", "while_made"):  # the second kill's restart is the one
        probe = landed.get("probe") or {}
        if not probe.get("pid") or not landed.get("signalled"):
            return None
        base = probe.get("generation") or ((landed.get("first_kill") or {}).get("generation", 0) + 1)
        spares = landed.get("spares_at_kill")
    else:
        killed = landed.get("killed") or {}
        if not killed.get("signalled"):
            return None
        base, spares = killed.get("generation", 0), killed.get("spares_at_kill")
    nxt = int(base) + 1
    events = ((run.get("result") or {}).get("events")) or []
    ev = next((e for e in events if e.get("event") == "restore" and e.get("generation") == nxt), None)
    if ev is None:
        return None
    said = ev.get("spare")
    ready = sorted(int(c["pid"]) for c in spares or () if c.get("idle"))
    r0 = ((run.get("workers") or {}).get(nxt) or {}).get(0)
    expected = None if r0 is None or spares is None else ("taken" if r0 in ready else "not taken")
    out = {"attempt": nxt, "said": said, "rank0_pid": r0, "ready_at_kill": ready, "expected": expected}
    if not said:
        return dict(out, ok=False, why=f"attempt {nxt}'s restart said nothing of its spare process")
    if expected == "taken" and said != "taken":
        return dict(
            out, ok=False, why=f"attempt {nxt} said {said!r}, but rank 0 (pid {r0}) ran in a spare ready at the kill"
        )
    note = "" if ready else " (no spare was ready at the kill)"
    if expected == "not taken" and said == "taken":
        note = " (a spare claimed after the kill: being made then)"
    return dict(out, ok=True, why=f"attempt {nxt} said {said!r}{note}")


def _flipped_steps(fault: dict) -> set[int]:
    landed = fault.get("landed", {})
    if fault["kind"] == "slot_flip":
        return {f["step"] for f in landed.get("flips", []) + landed.get("copies", []) if f.get("done")}
    if fault["kind"] == "file_flip":
        return {landed["step"]} if "step" in landed else set()
    return set()


def _names_damage(event: dict, steps: set[int]) -> bool:
    name = str(event.get("event", ""))
    if name in ("integrity_failure", "distrusted", "quarantined"):
        return not steps or event.get("step") in steps
    if name == "restore_fallback":
        return bool(event.get("corrupt") or event.get("verification") or _DAMAGE.search(str(event)))
    return False


def _short(e: dict) -> str:
    return ", ".join(
        f"{k}={v}"
        for k, v in e.items()
        if k in ("event", "step", "section", "how", "source", "where", "blocks", "reason")
    )


def _persists(row: dict) -> list[float]:
    """The durations a profile row gives for persisting (``persist_s``, ``max_persist_s``, ...)."""
    return [v for k, v in row.items() if isinstance(v, int | float) and "persist" in k and k.endswith("_s")] or [0.0]


def _lines(lines: list[str], pattern: str) -> list[str]:
    rx = re.compile(pattern, re.I)
    return [ln for ln in lines if rx.search(ln)][:3]


__all__ = [
    "committed_kept",
    "exactly_once",
    "judge",
    "lineage",
    "memory_bound",
    "memory_bounded",
    "no_orphans",
    "reported_total",
    "spare_said",
]
