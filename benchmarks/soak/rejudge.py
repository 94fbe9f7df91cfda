"""Judge schedules of a soak again with this checkout's judge (``checks.judge``), on the files the soak
kept of their runs (a run that failed a check keeps ``OUT/runs/soak<seed>/``).

After a change to the judge, a schedule it misjudged is judged again on its own evidence — the same
records, logs and result — rather than run again (a rerun draws other timings, and may not land the
fault the same way). Each record keeps what it was judged before (``rejudged``: the commit and the
earlier outcomes); the summary is counted again::

    python -m benchmarks.soak.rejudge OUT/soak.json --seed 103 [--json FILE]   # default: in place
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.soak import checks, report


def _commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "-C", here, "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def rejudge(doc: dict, out_dir: str, seeds: set[int], commit: str) -> list[dict]:
    """Judge the faults of ``seeds`` again in ``doc`` (changed in place); returns, per schedule, its
    seed and its faults' outcomes before and after. A seed whose run files were not kept is an error."""
    changes = []
    for rec in doc["schedules"]:
        if rec["seed"] not in seeds or rec.get("soak_error"):
            continue
        run_dir = os.path.join(out_dir, "runs", rec["name"])
        if not os.path.isdir(run_dir):
            raise FileNotFoundError(f"{run_dir}: the soak did not keep this run's files (it passed, or --out differs)")
        result_path = os.path.join(run_dir, "out", rec["name"], "result.json")
        result = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
        run = {  # as the runner gives it to the judge (runner._check)
            "resumes": rec.get("resumes", []),
            "result": result,
            "fit_error": rec["checks"]["finished"].get("error"),
            "quarantined": {int(k): v for k, v in rec.get("quarantined", {}).items()},
        }
        before = {f["id"]: f.get("outcome") for f in rec["faults"]}
        for fault in rec["faults"]:
            fault.pop("outcome", None)
            fault.pop("evidence", None)
            fault.update(checks.judge(fault, run))
        no_silent = rec["checks"]["no_silent"]
        no_silent["silent"] = [f["id"] for f in rec["faults"] if f["outcome"] == "silent"]
        no_silent["ok"] = not no_silent["silent"] and not no_silent.get("silent_stalls")
        rec["ok"] = all(c["ok"] for c in rec["checks"].values())
        rec["rejudged"] = {"at": commit, "before": before}
        changes.append({"seed": rec["seed"], "before": before, "after": {f["id"]: f["outcome"] for f in rec["faults"]}})
    doc["summary"] = report.summarise(doc["schedules"])
    doc["meta"]["rejudged"] = sorted({*doc["meta"].get("rejudged", []), *(c["seed"] for c in changes)})
    return changes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak.rejudge", description=__doc__.split("\n\n")[0])
    ap.add_argument("soak_json", help="OUT/soak.json of the soak (its runs are under OUT/runs/)")
    ap.add_argument("--seed", type=int, action="append", required=True, help="a seed to judge again (repeatable)")
    ap.add_argument("--json", help="where to write the result (default: over soak_json)")
    args = ap.parse_args(argv)
    with open(args.soak_json) as f:
        doc = json.load(f)
    try:
        changes = rejudge(doc, os.path.dirname(os.path.abspath(args.soak_json)), set(args.seed), _commit())
    except FileNotFoundError as e:
        print(f"cf_ray soak rejudge: {e}", file=sys.stderr)
        return 2
    for c in changes:
        print(f"seed {c['seed']}: {c['before']} -> {c['after']}")
    with open(args.json or args.soak_json, "w") as f:
        json.dump(doc, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["rejudge"]
