"""The soak's tables: counts per check, per fault kind and per injection point (where each landed),
from the schedules' records (``soak.json``). No Ray, no torch: ``python -m benchmarks.soak.report
soak.json`` prints them again; with several files (soaks of other seeds of the same job, e.g. a long
soak run in parts with ``--first``) it merges them, and ``--json OUT`` writes the merged document."""

from __future__ import annotations

import collections
import json
import statistics
import sys

CHECKS = ("finished", "bitwise", "exactly_once", "committed_kept", "no_silent", "memory", "no_orphans")
#: Checks a soak made only from some commit on: a record of an earlier soak without one is not counted for it.
_LATER_CHECKS = frozenset({"no_orphans"})


def _failed(rec: dict) -> list[str]:
    """The checks ``rec`` failed (one it was not made, being older than the check, is not failed)."""
    return [
        c
        for c in CHECKS
        if not rec["checks"].get(c, {}).get("ok") and not (c in _LATER_CHECKS and c not in rec["checks"])
    ]


OUTCOMES = ("seen", "silent", "unexercised", "not_injected")


def _aimed(fault: dict) -> bool:
    """Whether the fault landed at the point it was drawn for (not a fallback to "at the step")."""
    point = str(fault.get("landed", {}).get("point", ""))
    if fault["kind"] == "spare_kill":  # a spare found and killed first; a rank held right after its restore
        return bool(fault.get("injected")) and point.startswith(("rank ", "right after the restore"))
    if fault["point"] in ("step", "outage", "stall", "then_kill", "then_node_loss"):
        return bool(fault.get("injected"))
    if fault["point"] == "mid_restore":
        return point.startswith("mid-restore")
    return bool(fault.get("injected")) and not point.startswith("at the step")


def summarise(records: list[dict]) -> dict:
    checks = {c: {"pass": 0, "fail": 0} for c in CHECKS}
    kinds: dict[str, collections.Counter] = {}
    points: dict[str, collections.Counter] = {}
    for r in records:
        if r.get("soak_error"):  # the soak itself failed on this seed: no verdict on cf_ray
            continue
        for c in CHECKS:
            if c in r["checks"] or c not in _LATER_CHECKS:
                checks[c]["pass" if r["checks"].get(c, {}).get("ok") else "fail"] += 1
        for f in r["faults"]:
            kinds.setdefault(f["kind"], collections.Counter())["drawn"] += 1
            kinds[f["kind"]][f.get("outcome", "not_injected")] += 1
            key = f"{f['kind']}@{f['point']}"
            points.setdefault(key, collections.Counter())["drawn"] += 1
            points[key]["aimed" if _aimed(f) else "missed"] += 1
    totals = [r["durations"]["with_cleanup_s"] for r in records if "durations" in r]
    return {
        "schedules": len(records),
        "ok": sum(1 for r in records if r["ok"]),
        "checks": checks,
        "kinds": {k: dict(v) for k, v in sorted(kinds.items())},
        "points": {k: dict(v) for k, v in sorted(points.items())},
        "failed_seeds": {str(r["seed"]): _failed(r) for r in records if not r["ok"] and not r.get("soak_error")},
        "soak_errors": {str(r["seed"]): r["soak_error"] for r in records if r.get("soak_error")},
        "seconds_per_schedule": {
            "median": round(statistics.median(totals), 1) if totals else None,
            "max": round(max(totals), 1) if totals else None,
        },
        # The four numbers (issue 23: all 0 when done).
        "not_bitwise": checks["bitwise"]["fail"],
        "samples_wrong": checks["exactly_once"]["fail"],
        "committed_lost": sum(len(r["checks"].get("committed_kept", {}).get("lost", [])) for r in records),
        "silent_faults": sum(1 for r in records for f in r["faults"] if f.get("outcome") == "silent"),
        "silent_stalls": sum(len(r["checks"].get("no_silent", {}).get("silent_stalls", [])) for r in records),
    }


def line(rec: dict) -> str:
    if rec.get("soak_error"):
        return f"  seed {rec['seed']:>4}: SOAK ERROR {rec['soak_error']}"
    faults = ", ".join(f"{f['kind']}@{f['point']}:{f.get('outcome')}" for f in rec["faults"])
    bad = _failed(rec)
    took = rec.get("durations", {}).get("with_cleanup_s")
    return f"  seed {rec['seed']:>4}: {'ok  ' if rec['ok'] else 'FAIL'} {took:>5.0f} s  [{faults}]" + (
        f"  failed: {', '.join(bad)}" if bad else ""
    )


def render(doc: dict) -> str:
    s = doc["summary"]
    meta = doc.get("meta", {})
    out = [
        f"## cf_ray fault soak: {s['schedules']} schedules, {s['ok']} passed every check",
        "",
        f"{meta.get('command', '')} — preset {meta.get('preset')}, {meta.get('date')}, "
        f"{s['seconds_per_schedule']['median']} s per schedule (median, max {s['seconds_per_schedule']['max']} s)",
        "",
        "| not bitwise | duplicated or skipped samples | committed checkpoints lost | silent faults |",
        "|---|---|---|---|",
        f"| {s['not_bitwise']} | {s['samples_wrong']} | {s['committed_lost']} | {s['silent_faults']} |",
        "",
        f"Training stood still 10 s or more with nothing said: {s.get('silent_stalls', 0)} times.",
        "",
        "| check | passed | failed |",
        "|---|---|---|",
    ]
    out += [f"| {c} | {v['pass']} | {v['fail']} |" for c, v in s["checks"].items()]
    out += ["", "| fault | drawn | " + " | ".join(OUTCOMES) + " |", "|---|---|" + "---|" * len(OUTCOMES)]
    for k, v in s["kinds"].items():
        out.append(f"| {k} | {v.get('drawn', 0)} | " + " | ".join(str(v.get(o, 0)) for o in OUTCOMES) + " |")
    out += ["", "| injection point | drawn | landed there | fell back |", "|---|---|---|---|"]
    for k, v in s["points"].items():
        out.append(f"| {k} | {v.get('drawn', 0)} | {v.get('aimed', 0)} | {v.get('missed', 0)} |")
    if s.get("soak_errors"):
        out += [
            "",
            "The soak itself failed on seeds (no verdict): "
            + "; ".join(f"{k}: {v}" for k, v in s["soak_errors"].items()),
        ]
    rejudged = [r for r in doc.get("schedules", []) if r.get("rejudged")]
    if rejudged:
        out += [
            "",
            "Judged again on their kept files by a later judge (`benchmarks.soak.rejudge`; before: after): "
            + "; ".join(
                f"{r['seed']} at {r['rejudged'].get('at')} ("
                + ", ".join(
                    f"{k} {v}: {f['outcome']}"
                    for f in r["faults"]
                    for k, v in r["rejudged"]["before"].items()
                    if k == f["id"] and v != f["outcome"]
                )
                + ")"
                for r in rejudged
            ),
        ]
    if meta.get("superseded"):
        out += [
            "",
            "Run again after a fix (the last run counts; what each earlier run failed): "
            + "; ".join(
                f"{k}: " + ", ".join(",".join(o["failed"]) or "passed" for o in v)
                for k, v in meta["superseded"].items()
            ),
        ]
    if s["failed_seeds"]:
        out += [
            "",
            "Failed schedules (seed: checks): "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in s["failed_seeds"].items()),
        ]
    return "\n".join(out)


def merge(docs: list[tuple[str, dict]], latest: bool = False) -> dict:
    """One soak document from several ``(path, document)``: soaks of the same job (preset, numbers
    and reference digests equal) over seeds that do not overlap. Raises ``ValueError`` saying which
    files differ or which seed is in two of them.

    ``latest``: a seed may be in several (a schedule run again after a fix): the record of the last
    document given counts, and each earlier one is kept in ``meta["superseded"]`` (its file, whether
    it passed, the checks it failed, its commit), so the table says what the newest code does and
    the JSON what the soak found on the way."""
    (first_path, first), rest = docs[0], docs[1:]
    for path, doc in rest:
        for what, get in (
            ("preset", lambda d: d.get("meta", {}).get("preset")),
            ("reference digests", lambda d: d.get("reference", {}).get("digests")),
        ):
            if get(doc) != get(first):
                raise ValueError(
                    f"{path} and {first_path} are soaks of different jobs ({what}: {get(doc)!r} against "
                    f"{get(first)!r}): merge only soaks of one preset and one reference"
                )
    seen: dict[int, str] = {}
    by_seed: dict[int, dict] = {}
    superseded: dict[str, list[dict]] = {}
    for path, doc in docs:
        for r in doc["schedules"]:
            if r["seed"] in seen:
                if not latest:
                    raise ValueError(
                        f"seed {r['seed']} is in {seen[r['seed']]} and in {path}: merge soaks of different seeds "
                        "(run the later part with --first past the earlier one's last seed), or pass --latest "
                        "to count the last run of each seed"
                    )
                old = by_seed[r["seed"]]
                superseded.setdefault(str(r["seed"]), []).append(
                    {
                        "file": seen[r["seed"]],
                        "ok": old["ok"],
                        "failed": _failed({"checks": old.get("checks", {})}),
                        "commit": old.get("_commit"),
                    }
                )
            seen[r["seed"]] = path
            by_seed[r["seed"]] = dict(r, _commit=doc.get("meta", {}).get("commit"))
    records = [by_seed[k] for k in sorted(by_seed)]
    for r in records:
        r.pop("_commit", None)
    metas = [d.get("meta", {}) for _, d in docs]
    meta = dict(
        metas[0],
        command=" + ".join(str(m.get("command", "")) for m in metas),
        date=" .. ".join(sorted({str(m.get("date", ""))[:10] for m in metas})),
        parts=[dict(m, file=p) for m, (p, _) in zip(metas, docs, strict=True)],
        wall_s=round(sum(float(m.get("wall_s") or 0) for m in metas), 1),
        complete=all(m.get("complete") for m in metas),
    )
    if latest:
        meta["superseded"] = superseded
    return dict(first, meta=meta, summary=summarise(records), schedules=records)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = None
    latest = "--latest" in argv
    argv = [a for a in argv if a != "--latest"]
    if "--json" in argv:
        i = argv.index("--json")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    docs = []
    for path in argv:
        with open(path) as f:
            docs.append((path, json.load(f)))
    try:
        doc = docs[0][1] if len(docs) == 1 else merge(docs, latest=latest)
    except ValueError as e:
        print(f"cf_ray soak report: {e}", file=sys.stderr)
        return 2
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, default=str)
    print(render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CHECKS", "line", "merge", "render", "summarise"]
