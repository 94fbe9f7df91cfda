"""What ``cf-ray bench`` makes of the segments' files: one object per variant with its overhead per
round and the interval over rounds (``stats.py``), cf_ray's per-checkpoint CPU breakdown and its
actors' CPU, the targets with their verdicts, and the Markdown tables and plot.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks import stats
from cf_ray._engine.memory.slots import HEADER_BYTES
from cf_ray._engine.node.slot_store import SLOTS_PER_SECTION

_PROBE_TAG = {0: "@auto", -1: "@auto-1"}
_PROBE_LABEL = {0: " at Adaptive's k", -1: " at Adaptive's k−1"}
VARIANTS = ("none", "ray_sync", "ray_async", "dcp_async", "cf_fixed", "cf_auto", "cf_held", "floor_copy")
LABELS = {
    "none": "no checkpoint",
    "ray_sync": "Ray SYNC (torch.save + report)",
    "ray_async": "Ray ASYNC upload",
    "dcp_async": "DCP async_save",
    "cf_fixed": "cf_ray FixedInterval",
    "cf_auto": "cf_ray Adaptive",
    "cf_held": "cf_ray FixedInterval, one in --held-persist-every persisted",
    "floor_copy": "one memcpy of the state, nothing else (floor)",
}
_MiB = 1024 * 1024


def _read_profile_from_storage(storage_path: str, run_name: str) -> list[dict] | None:
    """The profile rows saved by the controller, through cf_ray.report when it exists."""
    try:
        from cf_ray import report
    except ImportError:
        return None
    fn = getattr(report, "read_run_profile", None)
    if fn is None:
        return None
    try:
        got = fn(storage_path, run_name)
    except Exception:  # noqa: BLE001 - the in-loop controller rows are the fallback
        return None
    if hasattr(got, "to_dict"):
        got = got.to_dict("records")
    if isinstance(got, list) and got and isinstance(got[0], dict) and "persist_s" in got[0]:
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in got]
    return None


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs), "mean": statistics.fmean(xs)}


#: Parts of the checkpoint path on the training thread (per step) and on the snapshot thread (per
#: snapshot); ``cf_ray/_engine/worker/cpu_budget.py`` says what each one is.
TRAIN_PARTS = (
    "capture_late", "guard", "timing", "preemption", "agreement", "register", "policy", "begin", "prepare",
    "poll", "watchdog",
)  # fmt: skip
BACKGROUND_PARTS = ("copy", "crc", "seal_wait", "fingerprint", "index", "handoff")


def _breakdown(segs: list[tuple[dict, list[dict]]], rank: int = 0) -> dict | None:
    """Rank ``rank``'s checkpoint-path budget per checkpoint and per iteration, over every window:
    training-thread parts over the windows, background parts from each window's start to its drain's
    end (their calls are the snapshots they worked on)."""
    recs = [ranks[rank] for _, ranks in segs if len(ranks) > rank and ranks[rank].get("budget_window") is not None]
    if not recs:
        return None
    iters = sum(len(r["iter_s"]) for r in recs)
    ckpts = sum(r.get("ckpts_window") or 0 for r in recs)
    out: dict[str, Any] = {}
    for part in TRAIN_PARTS + BACKGROUND_PARTS:
        src = "budget_window" if part in TRAIN_PARTS else "budget_to_drain"
        cpu = sum((r[src].get(part) or {}).get("cpu_s", 0.0) for r in recs)
        wall = sum((r[src].get(part) or {}).get("wall_s", 0.0) for r in recs)
        calls = sum((r[src].get(part) or {}).get("calls", 0) for r in recs)
        if not calls and not wall:
            continue
        per_ckpt_n = ckpts if part in TRAIN_PARTS else max(calls, 1)
        per_ckpt_cpu = 1e3 * cpu / max(per_ckpt_n, 1)
        out[part] = {
            "thread": "training" if part in TRAIN_PARTS else "snapshot",
            "cpu_ms_per_ckpt": per_ckpt_cpu,
            "wall_ms_per_ckpt": 1e3 * wall / max(per_ckpt_n, 1),
            "cpu_ms_per_iter": 1e3 * cpu / iters if part in TRAIN_PARTS else per_ckpt_cpu * ckpts / max(iters, 1),
        }
    out["total"] = {
        "cpu_ms_per_ckpt": sum(v["cpu_ms_per_ckpt"] for v in out.values()),
        "cpu_ms_per_iter": sum(v["cpu_ms_per_iter"] for v in out.values()),
    }
    return out


def _actors(segs: list[tuple[dict, list[dict]]]) -> dict:
    """The holder's and the controller's CPU: per checkpoint over whole segments (set-up to drained),
    per iteration over the windows (what competed with training)."""
    out: dict[str, Any] = {}
    seg_recs = [ranks[0] for _, ranks in segs if ranks[0].get("actors_cpu_segment_s")]
    taken = sum(r.get("checkpoints_taken") or 0 for r in seg_recs)
    win_recs = [ranks[0] for _, ranks in segs if ranks[0].get("actors_cpu_window_s")]
    iters = sum(len(r["iter_s"]) for r in win_recs)
    for who in ("holder", "controller"):
        if seg_recs and taken:
            out[f"{who}_cpu_ms_per_ckpt"] = 1e3 * sum(r["actors_cpu_segment_s"].get(who, 0.0) for r in seg_recs) / taken
        if win_recs and iters:
            out[f"{who}_cpu_ms_per_iter"] = 1e3 * sum(r["actors_cpu_window_s"].get(who, 0.0) for r in win_recs) / iters
    if "holder_cpu_ms_per_iter" in out and "controller_cpu_ms_per_iter" in out:
        out["cf_actors_cpu_ms_per_iter"] = out["holder_cpu_ms_per_iter"] + out["controller_cpu_ms_per_iter"]
    return out


def _aggregate_setting(
    setting: str, workers: int, desc: str, seg_dir: Path, plan: list[dict], storage_path: str
) -> tuple[list[dict], dict]:
    """One object per (variant, k) of this setting, from the segments' per-rank JSON files; each
    overhead per round against the baseline interpolated at the time its window ran (``stats.py``)."""
    recs: dict[str, list[dict]] = {}
    for seg in plan:
        ranks = []
        for r in range(workers):
            p = seg_dir / f"{seg['name']}.rank{r}.json"
            if p.exists():
                ranks.append(json.loads(p.read_text()))
        if ranks:
            recs[seg["name"]] = ranks
    # Probe segments' k is resolved at run time (the interval Adaptive chose).
    plan = [
        dict(s, k=recs[s["name"]][0]["k"]) if s.get("probe") is not None else s
        for s in plan
        if s.get("probe") is None or s["name"] in recs
    ]

    def mid(rec: dict) -> float:
        return (rec["wall_start"] + rec.get("wall_end", rec["wall_start"])) / 2

    base_segs = [recs[s["name"]] for s in plan if s["variant"] == "none" and s["name"] in recs]
    points = [(mid(r[0]), statistics.fmean(r[0]["iter_s"])) for r in base_segs if r[0]["iter_s"]]
    base_times = [t for ranks in base_segs for t in ranks[0]["iter_s"]]
    base_mean = statistics.fmean(base_times) if base_times else float("nan")
    noise = stats.noise_pct(points)
    drift = stats.drift_pct([v for _, v in sorted(points)])
    fallback = noise if noise is not None else (drift / 2 if drift is not None else None)
    state_bytes = next(iter(recs.values()))[0]["state_bytes"] if recs else 0
    # What one worker holds (FSDP2: its shards; DDP: the whole state), the largest over ranks.
    rank_state_bytes = max(
        (rec.get("rank_state_bytes", rec["state_bytes"]) for ranks in recs.values() for rec in ranks),
        default=0,
    )

    def key_of(s: dict) -> tuple:
        # A probe's k is Adaptive's choice of its round: the probes of every round are one variant.
        return (s["variant"], s["k"] if s.get("probe") is None else None, s.get("probe"))

    keys = []
    for s in plan:
        if key_of(s) not in keys:
            keys.append(key_of(s))
    out = []
    for variant, k, probe in keys:
        segs = [(s, recs[s["name"]]) for s in plan if key_of(s) == (variant, k, probe) and s["name"] in recs]
        if not segs:
            continue
        if probe is not None:
            k = segs[-1][1][0]["k"]
        times = [t for _, ranks in segs for t in ranks[0]["iter_s"]]
        n = len(times)
        mean = statistics.fmean(times)
        per_round = {}
        for s, ranks in segs:
            r0 = ranks[0]
            b = stats.baseline_at(mid(r0), points) if points else base_mean
            per_round[str(s["round"])] = 100.0 * (statistics.fmean(r0["iter_s"]) / b - 1.0)
        iv = stats.interval(list(per_round.values()), fallback)
        drain = sum(ranks[0]["drain_s"] for _, ranks in segs)
        obj: dict[str, Any] = {
            "id": f"{setting}/{variant}" + (f"/k{k}" if k and probe is None else "") + _PROBE_TAG.get(probe, ""),
            "setting": setting,
            "workers": workers,
            "setting_desc": desc,
            "variant": variant,
            "label": LABELS[variant] + ("" if probe is None else _PROBE_LABEL[probe]),
            "k": k or None,
            "probe": probe,
            "k_per_round": {str(s["round"]): r[0]["k"] for s, r in segs} if probe is not None else None,
            "rounds": len(segs),
            "iterations": n,
            "iter_median_s": statistics.median(times),
            "iter_min_s": min(times),
            "iter_max_s": max(times),
            "iter_mean_s": mean,
            # The mean over rounds of each round's overhead against the baseline of its time.
            "overhead_pct": iv["mean"] if variant != "none" else 0.0,
            "overhead_interval": iv,
            "overhead_pct_pooled": 100.0 * (mean / base_mean - 1.0),
            "overhead_incl_drain_pct": 100.0 * ((sum(times) + drain) / n / base_mean - 1.0),
            "overhead_pct_per_round": per_round,
            "iter_mean_s_per_round": {str(s["round"]): statistics.fmean(r[0]["iter_s"]) for s, r in segs},
            "drain_s": drain / len(segs),
            "setup_s": statistics.fmean(r[0]["setup_s"] for _, r in segs),
            "lead_iterations": segs[0][1][0].get("lead"),
            # CPU time is far less sensitive than wall time to other jobs on the machine.
            "worker_cpu_ms_per_iter": [1e3 * sum(r[w]["cpu_s"] for _, r in segs) / n for w in range(len(segs[0][1]))],
            "worker_cpu_ms_per_iter_per_round": {
                str(s["round"]): 1e3 * r[0]["cpu_s"] / len(r[0]["iter_s"]) for s, r in segs
            },
            "train_thread_cpu_ms_per_iter": [
                1e3 * sum(r[w]["train_thread_cpu_s"] for _, r in segs) / n for w in range(len(segs[0][1]))
            ],
            "state_bytes": state_bytes,
            "rank_state_bytes": rank_state_bytes,
            "segments": [s["name"] for s, _ in segs],
        }
        # Stall per checkpoint on the training thread; ranks wait for each other, the max governs.
        per_rank: dict[int, list[float]] = {}
        for _, ranks in segs:
            for rec in ranks:
                if variant.startswith("cf_"):
                    parts = rec.get("budget_window") or {}
                    stall = sum((parts.get(p) or {}).get("wall_s", 0.0) for p in ("begin", "guard"))
                    cnt = rec.get("ckpts_window") or 0
                else:
                    stall, cnt = sum(rec["stall_s"]), len(rec["stall_s"])
                acc = per_rank.setdefault(rec["rank"], [0.0, 0])
                acc[0] += stall
                acc[1] += cnt
        per_ckpt = {r: v[0] / v[1] for r, v in per_rank.items() if v[1]}
        obj["stall_per_ckpt_s"] = max(per_ckpt.values()) if per_ckpt else None
        obj["stall_per_ckpt_s_by_rank"] = [per_ckpt[r] for r in sorted(per_ckpt)]
        obj["checkpoints_window"] = sum(ranks[0].get("ckpts_window") or 0 for _, ranks in segs)
        taken = sum(ranks[0].get("checkpoints_taken", 0) for _, ranks in segs)
        committed = sum(ranks[0].get("checkpoints_committed", 0) for _, ranks in segs)
        written = sum(rec.get("bytes_written", 0) for _, ranks in segs for rec in ranks)
        obj["checkpoints_taken"] = taken
        if variant.startswith("cf_"):
            rows_all, intervals = [], []
            src = "controller"
            for s, ranks in segs:
                rows = _read_profile_from_storage(storage_path, s["name"])
                if rows is not None:
                    src = "cf_ray.report.read_run_profile"
                else:
                    rows = ranks[0].get("profile_rows") or []
                rows_all += rows
                summ = ranks[0].get("controller_summary") or {}
                intervals.append(summ.get("interval"))
                obj.setdefault("schedules", []).append(summ.get("schedules"))
                if variant == "cf_auto":  # why the policy chose each interval (its explain())
                    obj.setdefault("interval_events", []).append(
                        [
                            {k: e.get(k) for k in ("previous", "interval", "why")}
                            for e in summ.get("events", [])
                            if e.get("event") == "interval"
                        ]
                    )
            obj.update(_actors(segs))
            obj["cpu_breakdown"] = _breakdown(segs)
            done = [r for r in rows_all if r.get("committed")]
            committed = len(done)
            written = sum(int(r.get("bytes") or 0) for r in done)
            persist = [r["persist_s"] for r in done if r.get("persist_s")]
            gbps = [r["bytes"] / r["persist_s"] / 1e9 for r in done if r.get("persist_s") and r.get("bytes")]
            obj.update(
                profile_source=src,
                persist_s_median=statistics.median(persist) if persist else None,
                persist_gbps_median=statistics.median(gbps) if gbps else None,
                snapshot_bytes=statistics.median([r["bytes"] for r in done]) if done else None,
                not_committed=sum(1 for r in rows_all if not r.get("committed")),
                copy_s_median=_median_of(rows_all, "copy_s"),
                chosen_interval=intervals[-1] if variant == "cf_auto" else k,
                chosen_intervals=intervals if variant == "cf_auto" else None,
            )
            # Passes over the state on the host per checkpoint (#14), from the copies cf_ray
            # instruments (workers and holders): bytes copied, and bytes read again to checksum.
            counted = [r for r in done if r.get("copied_bytes") is not None and r.get("bytes")]
            if counted:
                obj["host_copied_x"] = statistics.median(r["copied_bytes"] / r["bytes"] for r in counted)
                obj["host_crc_reread_x"] = statistics.median(
                    (r.get("crc_read_bytes") or 0) / r["bytes"] for r in counted
                )
                obj["host_passes"] = obj["host_copied_x"] + obj["host_crc_reread_x"]
            held = [ranks[0].get("holder_held") for _, ranks in segs if ranks[0].get("holder_held")]
            if held:
                most = max(held, key=lambda h: h["slots"] + h["copies"])
                obj["held_bytes"] = most["slots"] + most["copies"]
                # What slots hold beyond their snapshots' bytes: each of a section's slots has a header
                # page, and the two resident ones round their bytes up to a page (``slot_size``).
                sections = most.get("sections", 0) + most.get("copied_sections", 0)
                obj["held_slot_pages_bytes"] = sections * (SLOTS_PER_SECTION + 2) * HEADER_BYTES
        else:
            obj["ckpt_bytes"] = max((rec.get("ckpt_bytes", 0) for _, ranks in segs for rec in ranks), default=0)
        obj["checkpoints_committed"] = committed
        obj["bytes_written"] = written
        # Memory per worker: VmRSS also counts object-store pages the worker has mapped (shared
        # memory, owned by the store, kept mapped across segments); the private (anonymous) part
        # is what the process itself holds, measured above its value before the model was built.
        nranks = len(segs[0][1])
        obj["peak_rss_mb_per_worker"] = [max(r[w]["peak_rss"] for _, r in segs) / _MiB for w in range(nranks)]
        obj["peak_private_mb_per_worker"] = [max(r[w]["peak_rss_anon"] for _, r in segs) / _MiB for w in range(nranks)]
        obj["peak_private_above_start_mb"] = (
            max(rec["peak_rss_anon"] - rec["anon_before_model"] for _, ranks in segs for rec in ranks) / _MiB
        )
        obj["peak_rss_shmem_mb"] = max(rec["peak_rss_shmem"] for _, ranks in segs for rec in ranks) / _MiB
        obj["iter_s_by_segment"] = {s["name"]: [round(t, 5) for t in r[0]["iter_s"]] for s, r in segs}
        out.append(obj)
    entered = [ranks[0].get("loop_entered") for ranks in recs.values() if ranks[0].get("loop_entered")]
    first = next(iter(recs.values()))[0] if recs else {}
    extra = {
        "loop_entered": min(entered) if entered else None,
        "baseline_iter_mean_s": base_mean,
        "baseline_drift_pct": drift,
        "baseline_noise_pct": noise,
        "baseline_trend_pct_per_min": _trend(points),
        "state_bytes": state_bytes,
        "rank_state_bytes": rank_state_bytes,
        "baseline_segment_means_s": [v for _, v in sorted(points)],
        "baseline_segment_times": [t for t, _ in sorted(points)],
        "warmup_iters": first.get("warmup_iters"),
        "warmup_s": first.get("warmup_s"),
    }
    return out, extra


def _trend(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of the baseline over time, in % of its mean per minute."""
    if len(points) < 2:
        return None
    ts, vs = zip(*points)
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    if not den:
        return None
    slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den
    return 100.0 * slope * 60.0 / mv


def _median_of(rows: list[dict], key: str):
    xs = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def _recovery_summary(seg_dir: Path, workers: int) -> dict:
    state_file = seg_dir / "recovery_state.json"
    if not state_file.exists():
        return {"error": "the recovery job wrote no state"}
    state = json.loads(state_file.read_text())
    out: dict[str, Any] = {}
    for source in ("memory", "storage"):
        info = state.get(source, {})
        ranks = []
        for r in range(workers):
            p = seg_dir / f"recovery-{source}.rank{r}.json"
            if p.exists():
                ranks.append(json.loads(p.read_text()))
        if not ranks or not info.get("killed"):
            out[source] = {"error": "did not complete", "state": info}
            continue
        r0 = ranks[0]
        kill = info["kill_time"]
        first = max(r["first_iteration_end"] for r in ranks if r.get("first_iteration_end"))
        out[source] = {
            "kill_step": info["kill_step"],
            "resume_step": r0["resume_step"],
            "resume_source": r0["resume_source"],
            "iterations_lost": info["kill_step"] - r0["resume_step"],
            "interval": info["interval"],
            "kill_to_first_iteration_s": first - kill,
            "kill_to_restart_s": min(r["attempt_start"] for r in ranks) - kill,
            "restore_s": max(r["resume_seconds"] for r in ranks),
            "restore_s_by_rank": [r["resume_seconds"] for r in ranks],
            "state_bytes": info.get("state_bytes"),
        }
        out["state_bytes"] = info.get("state_bytes")
    m, s = out.get("memory", {}), out.get("storage", {})
    if m.get("restore_s") and s.get("restore_s"):
        out["restore_speedup"] = s["restore_s"] / m["restore_s"]
    return out


def _targets(results: dict) -> list[dict]:
    """Each of cf_ray's goals with the measured value, its interval across rounds and the verdict:
    ``met``, ``missed`` or ``within noise`` (``stats.judge``); figures that are not timings (bytes,
    passes, bandwidth) are judged on their value (``method: "value"``)."""
    lim = results["limits"]
    out = []
    prefix = "FSDP2: " if results.get("config", {}).get("parallel") == "fsdp2" else ""

    def add(tid, setting, text, iv, bound, sense="le", note=""):
        if not isinstance(iv, dict):  # a plain value: judged as it is
            val = iv
            iv = {"mean": val, "lo": val, "hi": val, "n": 1, "method": "value"}
        verdict = stats.judge(iv, bound, sense=sense) if bound is not None else stats.NA
        out.append(
            {
                "id": tid,
                "setting": setting,
                "target": prefix + text,
                "measured": iv.get("mean"),
                "interval": [iv.get("lo"), iv.get("hi")],
                "interval_method": iv.get("method"),
                "rounds": iv.get("n"),
                "bound": bound,
                "verdict": verdict,
                "met": {stats.MET: True, stats.MISSED: False}.get(verdict),
                "note": note,
            }
        )

    by = {v["id"]: v for v in results["variants"]}
    settings = {s["setting"]: s for s in results.get("settings", [])}

    def fallback(setting: str) -> float | None:
        s = settings.get(setting) or {}
        if s.get("baseline_noise_pct") is not None:
            return s["baseline_noise_pct"]
        return s["baseline_drift_pct"] / 2 if s.get("baseline_drift_pct") is not None else None

    def diff(setting, a: dict, b: dict, scale_b: float = 1.0, key="overhead_pct_per_round") -> dict:
        """Interval of the per-round differences a - scale_b * b (paired by round)."""
        ra, rb = a.get(key) or {}, b.get(key) or {}
        common = sorted(set(ra) & set(rb), key=int)
        d = [ra[r] - scale_b * rb[r] for r in common]
        fb = fallback(setting)
        return stats.interval(d, None if fb is None else fb * math.sqrt(1 + scale_b**2))

    for setting in sorted({v["setting"] for v in results["variants"]}):
        s = settings.get(setting) or {}
        add(
            "drift",
            setting,
            "baseline drift reported (no-checkpoint segments, max-min over mean)",
            s.get("baseline_drift_pct"),
            None,
            note=f"noise of one segment (interpolation miss, RMS): {_fmt(s.get('baseline_noise_pct'), '.1f')} %; "
            f"trend {_fmt(s.get('baseline_trend_pct_per_min'), '+.2f')} %/min",
        )
        auto = by.get(f"{setting}/cf_auto")
        if auto:
            add(
                "auto_overhead",
                setting,
                "cf_ray Adaptive overhead (2 % budget) <= 3 %",
                auto["overhead_interval"],
                3.0,
                note=f"intervals chosen: {auto.get('chosen_intervals')}; whole window, from a fresh Checkpointer",
            )
        budget = results["config"].get("budget_pct")
        for at in (v for v in results["variants"] if v["setting"] == setting and v.get("probe") == 0):
            k = at["k"]
            add(
                "auto_within_budget",
                setting,
                f"FixedInterval at Adaptive's k (last {k}): overhead <= budget",
                at["overhead_interval"],
                budget,
                note=f"k per round {at.get('k_per_round')}; {at['iterations']} iterations",
            )
            below = by.get(f"{setting}/cf_fixed@auto-1")
            if below:
                add(
                    "auto_shortest",
                    setting,
                    "Adaptive's k is the shortest within budget: overhead at k-1 > budget",
                    below["overhead_interval"],
                    budget,
                    sense="ge",
                    note=f"k per round {below.get('k_per_round')}; {below['iterations']} iterations",
                )
        k1 = by.get(f"{setting}/cf_fixed/k1")
        floor = by.get(f"{setting}/floor_copy/k1")
        if k1 is not None and setting in ("w1", "w2"):
            cap = 10.0 if setting == "w1" else 30.0
            add(
                "k1_overhead",
                setting,
                f"k=1: cf_ray overhead <= {cap:.0f} %",
                k1["overhead_interval"],
                cap,
                note=f"one memcpy of the state per step and nothing else (floor_copy): {floor['overhead_pct']:+.1f} %"
                if floor
                else "",
            )
        if k1 is not None and floor is not None:
            add(
                "k1_cpu_above_floor",
                setting,
                "k=1: worker CPU per iteration above floor_copy <= 15 ms",
                diff(setting, k1, floor, key="worker_cpu_ms_per_iter_per_round"),
                15.0,
                note="rank 0's process CPU per iteration, paired by round; cf_ray's breakdown: "
                + ", ".join(
                    f"{p} {v['cpu_ms_per_iter']:.1f}"
                    for p, v in (k1.get("cpu_breakdown") or {}).items()
                    if p != "total" and v["cpu_ms_per_iter"] >= 0.5
                ),
            )
        ks = sorted(
            {
                v["k"]
                for v in results["variants"]
                if v["setting"] == setting and v["variant"] == "cf_fixed" and v.get("probe") is None
            }
        )
        for k in ks:
            cf = by[f"{setting}/cf_fixed/k{k}"]
            for other, text, scale in (
                ("ray_sync", f"k={k}: cf_ray overhead <= 1/5 of Ray SYNC", 0.2),
                ("ray_async", f"k={k}: cf_ray overhead < Ray ASYNC", 1.0),
                ("dcp_async", f"k={k}: cf_ray overhead < DCP async_save", 1.0),
            ):
                o = by.get(f"{setting}/{other}/k{k}")
                if o is None:
                    continue
                add(
                    f"vs_{other}",
                    setting,
                    text + " (per-round difference <= 0)",
                    diff(setting, cf, o, scale),
                    0.0,
                    note=f"cf_ray {_pct(cf['overhead_pct'])}, {other} {_pct(o['overhead_pct'])}",
                )
        cfs = [v for v in results["variants"] if v["setting"] == setting and v["variant"].startswith("cf_")]
        if cfs and lim.get("memcpy_gbps"):
            worst = max(
                (v for v in cfs if v.get("stall_per_ckpt_s") is not None),
                key=lambda v: v["stall_per_ckpt_s"],
                default=None,
            )
            if worst:
                # A worker snapshots what it holds: the whole state (DDP) or its shards (FSDP2).
                held = worst.get("rank_state_bytes") or worst["state_bytes"]
                ideal = held / (lim["memcpy_gbps"] * 1e9)
                what = "state" if held == worst["state_bytes"] else "state per worker"
                add(
                    "stall",
                    setting,
                    f"stall per checkpoint <= 1.5 x {what} / memcpy bandwidth",
                    worst["stall_per_ckpt_s"],
                    1.5 * ideal,
                    note=f"worst: {worst['id']}; {what}/memcpy = {ideal * 1e3:.1f} ms",
                )
            passes = [v for v in cfs if v.get("host_passes") is not None]
            if passes:
                worst_p = max(passes, key=lambda v: v["host_passes"])
                add(
                    "host_passes",
                    setting,
                    "passes over the state per checkpoint on the host <= 1.5",
                    worst_p["host_passes"],
                    1.5,
                    note=f"worst: {worst_p['id']}; copied {worst_p['host_copied_x']:.2f}x + read again to "
                    f"checksum {worst_p['host_crc_reread_x']:.2f}x (instrumented, workers + holders)",
                )
            held_v = [v for v in cfs if v.get("held_bytes") is not None]
            if held_v:
                worst_h = max(held_v, key=lambda v: v["held_bytes"])
                # Two snapshots: the state's tensors and what a snapshot carries besides (RNG states,
                # data positions), and the slots' header pages.
                snap = max(worst_h["state_bytes"], worst_h.get("snapshot_bytes") or 0)
                pages = worst_h.get("held_slot_pages_bytes") or 0
                add(
                    "held",
                    setting,
                    "host memory held for snapshots per node <= 2 x state",
                    worst_h["held_bytes"] / _MiB,
                    (2 * snap + pages) / _MiB,
                    note=f"worst: {worst_h['id']}; the holder's slots (resident) + object-store copies, MB; bound: "
                    f"2 x {snap / _MiB:.2f} MB a snapshot + {pages // 1024} KiB of the slots' header pages",
                )
            gb = [v["persist_gbps_median"] for v in cfs if v.get("persist_gbps_median")]
            if gb:
                bw = statistics.median(gb)
                need = 0.85 * lim["storage_write_fsync_gbps"]
                add(
                    "persist_bw",
                    setting,
                    "persist at >= 85 % of storage write+fsync bandwidth",
                    bw,
                    need,
                    sense="ge",
                    note=f"median over cf_ray checkpoints; storage {lim['storage_write_fsync_gbps']:.2f} GB/s",
                )
            worst_mem = max(cfs, key=lambda v: v["peak_private_above_start_mb"])
            base = by.get(f"{setting}/none")
            if base is not None:
                held_by_worker = (worst_mem.get("rank_state_bytes") or worst_mem["state_bytes"]) / _MiB
                delta = worst_mem["peak_private_above_start_mb"] - base["peak_private_above_start_mb"]
                add(
                    "memory",
                    setting,
                    "peak private RSS per worker, with cf_ray minus without, <= 1.1 x state",
                    delta,
                    1.1 * held_by_worker,
                    note=f"worst: {worst_mem['id']}: {worst_mem['peak_private_above_start_mb']:.0f} MB; no "
                    f"checkpointing: {base['peak_private_above_start_mb']:.0f} MB (private RSS above the "
                    "worker's before the model was built)",
                )
    rec = results.get("recovery") or {}
    if rec.get("restore_speedup"):
        add(
            "restore_speedup",
            "recovery",
            "restore from memory >= 3 x faster than from storage",
            rec["restore_speedup"],
            3.0,
            sense="ge",
            note=f"state {rec.get('state_bytes', 0) / 1e9:.2f} GB",
        )
    for source in ("memory", "storage"):
        r = rec.get(source) or {}
        if "iterations_lost" in r:
            add(
                f"lost_{source}",
                "recovery",
                f"iterations lost <= interval (restore from {source})",
                r["iterations_lost"],
                r["interval"],
            )
    return out


def _fmt(x, spec=".3f", none="–"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _pct(v) -> str:
    """An overhead in percent, or why there is none (no fit without checkpoints to compare with)."""
    return "n/a (no baseline fit)" if v is None else f"{v:+.1f} %"
