"""The Markdown tables and the plot of ``cf-ray bench`` (from a results object or JSON)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.results import BACKGROUND_PARTS, LABELS, TRAIN_PARTS, VARIANTS, _fmt


def render_markdown(results: dict, *, heading: str = "##") -> str:
    meta, lim, cfg = results["meta"], results["limits"], results["config"]
    lines = []
    m = cfg["model"]
    parallel = {"fsdp2": "FSDP2 (fully_shard, each worker saves its shards)"}.get(cfg.get("parallel", "ddp"), "DDP")
    lines.append(
        f"Model ({parallel}): {m['layers']} x Linear({m['width']}, {m['width']}) + Adam, {m['params'] / 1e6:.1f} M "
        f"parameters, {m['state_bytes'] / 1e6:.0f} MB of state, batch {m['batch']}, "
        f"{cfg['iters']} iterations per segment, {cfg['rounds']} round(s). "
        f"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={meta['env'].get('RAY_TRAIN_HEALTH_CHECK_INTERVAL_S')} "
        "for every variant (Ray's default 2 s would throttle its own report)."
    )
    lines.append(
        f"Load average at start {meta['loadavg_start'][0]:.2f}, at end {meta['loadavg_end'][0]:.2f} "
        "(other jobs share this machine: timings are noisy; compare variants within one run)."
    )
    lines.append("")
    for setting in results["settings"]:
        sid = setting["setting"]
        vs = [v for v in results["variants"] if v["setting"] == sid]
        if not vs:
            continue
        drift = setting.get("baseline_drift_pct")
        lines.append(f"{heading}# {setting['desc']}")
        lines.append("")
        lines.append(
            f"Baseline {setting['baseline_iter_mean_s']:.3f} s/iteration (mean of "
            f"{len(setting.get('baseline_segment_means_s') or [])} no-checkpoint segments); **drift** between them "
            f"{_fmt(drift, '.1f')} % (max-min), trend {_fmt(setting.get('baseline_trend_pct_per_min'), '+.2f')} %/min, "
            f"one segment's noise {_fmt(setting.get('baseline_noise_pct'), '.1f')} % (each interior baseline "
            "predicted from its neighbours). "
            + (
                "Each overhead is against the mean of the baseline segments (cf_ray.bench/1: one round, no interval)."
                if results.get("schema") == "cf_ray.bench/1"
                else "Each overhead is against the baseline interpolated at the time its window ran; its interval "
                "is the 95 % Student-t interval over rounds."
            )
            + (
                f" Each worker holds {setting['rank_state_bytes'] / 1e6:.0f} MB of the state (its shards)."
                if setting.get("rank_state_bytes") and setting["rank_state_bytes"] != setting.get("state_bytes")
                else ""
            )
        )
        lines.append("")
        lines.append(
            "| variant | k | iteration mean s | overhead % [95 % interval] (min–max over rounds) | rounds "
            "| stall/ckpt ms | CPU ms/iter: worker 0 (+ holder + controller) | ckpts in windows / committed "
            "| peak private RSS/worker MB | written GB |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for v in vs:
            k = v["k"] if v["k"] else (f"auto→{v.get('chosen_interval')}" if v["variant"] == "cf_auto" else "–")
            if v.get("probe") is not None:
                k = f"{v['k']} (= auto{'' if v['probe'] == 0 else ' − 1'})"
            iv = v.get("overhead_interval") or {}
            ovh = (
                "–"
                if v["variant"] == "none"
                else f"{_fmt(v['overhead_pct'], '+.1f')} [{_fmt(iv.get('lo'), '+.1f')}, {_fmt(iv.get('hi'), '+.1f')}] "
                f"({_fmt(iv.get('min'), '+.1f')}–{_fmt(iv.get('max'), '+.1f')})"
            )
            stall = v.get("stall_per_ckpt_s")
            actors = ""
            if v.get("holder_cpu_ms_per_iter") is not None:
                actors = f" (+ {v['holder_cpu_ms_per_iter']:.0f} + {v.get('controller_cpu_ms_per_iter', 0):.0f})"
            lines.append(
                f"| {v['label']} | {k} | {v['iter_mean_s']:.3f} | {ovh} | {v['rounds']} "
                f"| {_fmt(None if stall is None else stall * 1e3, '.1f')} "
                f"| {_fmt((v.get('worker_cpu_ms_per_iter') or [None])[0], '.0f')}{actors} "
                f"| {v.get('checkpoints_window', v['checkpoints_taken'])}/{v['checkpoints_committed']} "
                f"| {' / '.join(f'{x:.0f}' for x in v['peak_private_mb_per_worker'])} "
                f"| {v['bytes_written'] / 1e9:.2f} |"
            )
        lines.append("")
        cfb = [v for v in vs if v.get("cpu_breakdown")]
        if cfb:
            parts = [p for p in TRAIN_PARTS + BACKGROUND_PARTS if any(p in v["cpu_breakdown"] for v in cfb)]
            lines.append(
                "cf_ray's time per checkpoint, rank 0, CPU ms (wall ms where it differs by more than 1 ms: a wait), "
                "by part (training thread: "
                + ", ".join(p for p in parts if p in TRAIN_PARTS)
                + "; snapshot thread: "
                + ", ".join(p for p in parts if p in BACKGROUND_PARTS)
                + "; `cf_ray/_engine/worker/cpu_budget.py`), and the holder's and controller's CPU per checkpoint:"
            )
            lines.append("")
            lines.append("| variant | k | " + " | ".join(parts) + " | total (ms/iter) | holder | controller |")
            lines.append("|---|---|" + "---|" * (len(parts) + 3))
            for v in cfb:
                b = v["cpu_breakdown"]
                cells = []
                for p in parts:
                    x = b.get(p)
                    if x is None:
                        cells.append("–")
                        continue
                    c = f"{x['cpu_ms_per_ckpt']:.1f}"
                    if x["wall_ms_per_ckpt"] - x["cpu_ms_per_ckpt"] > 1.0:
                        c += f" ({x['wall_ms_per_ckpt']:.0f})"
                    cells.append(c)
                lines.append(
                    f"| {v['label']} | {v['k'] or v.get('chosen_interval')} | "
                    + " | ".join(cells)
                    + f" | {b['total']['cpu_ms_per_ckpt']:.1f} ({b['total']['cpu_ms_per_iter']:.1f}) "
                    f"| {_fmt(v.get('holder_cpu_ms_per_ckpt'), '.0f')} | {_fmt(v.get('controller_cpu_ms_per_ckpt'), '.0f')} |"
                )
            lines.append("")
    skipped = [s for s in results.get("skipped", [])]
    if skipped:
        lines.append(
            "Not run: " + "; ".join(f"{s['setting']} {s['variant']} k={s['k']} ({s['reason']})" for s in skipped) + "."
        )
        lines.append("")
    lines.append(f"{heading}# Machine limits (same run)")
    lines.append("")
    lines.append("| figure | value |")
    lines.append("|---|---|")
    lines.append(f"| host memcpy, one thread | {lim['memcpy_gbps']:.2f} GB/s |")
    lines.append(
        f"| storage write + fsync ({lim['storage_test_bytes'] / 1e9:.2f} GB, 16 MiB chunks) "
        f"| {lim['storage_write_fsync_gbps']:.2f} GB/s |"
    )
    lines.append(f"| CRC-32 as cf_ray computes it (ISA-L), one thread | {lim['crc32_gbps']:.2f} GB/s |")
    if lim.get("memcpy_gbps_during_direct_write"):
        lines.append(
            f"| host memcpy, one thread, while an O_DIRECT write (as the holder persists) runs at "
            f"{_fmt(lim.get('direct_write_gbps'), '.2f')} GB/s | {lim['memcpy_gbps_during_direct_write']:.2f} GB/s |"
        )
    if lim.get("first_touch_gbps"):
        lines.append(f"| first touch of newly allocated memory (page faults) | {lim['first_touch_gbps']:.2f} GB/s |")
    for v in results["variants"]:
        if v["variant"].startswith("cf_") and v.get("stall_per_ckpt_s") is not None:
            held = v.get("rank_state_bytes") or v["state_bytes"]
            ideal = held / (lim["memcpy_gbps"] * 1e9)
            what = "state" if held == v["state_bytes"] else "state per worker"
            lines.append(
                f"| {v['id']}: stall {v['stall_per_ckpt_s'] * 1e3:.1f} ms vs {what}/memcpy "
                f"{ideal * 1e3:.1f} ms | {v['stall_per_ckpt_s'] / ideal:.2f}x |"
            )
        if v["variant"].startswith("cf_") and v.get("persist_s_median"):
            ideal = (v.get("snapshot_bytes") or v["state_bytes"]) / (lim["storage_write_fsync_gbps"] * 1e9)
            lines.append(
                f"| {v['id']}: persist {v['persist_s_median']:.2f} s vs bytes/storage "
                f"{ideal:.2f} s | {100 * ideal / v['persist_s_median']:.0f} % of storage bandwidth |"
            )
    lines.append("")
    rec = results.get("recovery")
    if rec:
        lines.append(
            f"{heading}# Recovery (rank 1 SIGKILLed mid-interval, "
            f"{(rec.get('state_bytes') or 0) / 1e9:.2f} GB of state)"
        )
        lines.append("")
        lines.append(
            "| restore from | kill → first resumed iteration s | kill → restart s | restore s "
            "| iterations lost (interval) |"
        )
        lines.append("|---|---|---|---|---|")
        for source in ("memory", "storage"):
            r = rec.get(source) or {}
            if "restore_s" not in r:
                lines.append(f"| {source} | {r.get('error', 'not run')} | | | |")
                continue
            lines.append(
                f"| {source} (got: {r['resume_source']}) | {r['kill_to_first_iteration_s']:.2f} "
                f"| {r['kill_to_restart_s']:.2f} | {r['restore_s']:.2f} "
                f"| {r['iterations_lost']} ({r['interval']}) |"
            )
        lines.append("")
    lines.append(f"{heading}# Targets")
    lines.append("")
    lines.append(
        "Verdicts from intervals: *met* when the whole 95 % interval is on the right side of the bound, *missed* "
        "when it is wholly on the wrong side, *within noise* otherwise; comparisons between variants are judged on "
        "their per-round differences. Figures that are not timings are judged on their value."
    )
    lines.append("")
    lines.append("| setting | target | measured [interval] | bound | verdict |")
    lines.append("|---|---|---|---|---|")
    for t in results.get("targets", []):
        meas, bound = t["measured"], t["bound"]
        spec = ".0f" if t["id"] in ("memory",) else (".3f" if t["id"] in ("stall",) else ".2f")
        if t["id"].startswith("lost"):
            spec = "d"
        lo, hi = t.get("interval") or (None, None)
        shown = _fmt(meas, spec)
        if t.get("interval_method") not in (None, "value") and lo is not None and hi is not None:
            shown += f" [{_fmt(lo, spec)}, {_fmt(hi, spec)}]"
        verdict = t.get("verdict") or {True: "met", False: "missed", None: "n/a"}[t["met"]]
        if verdict == "missed":
            verdict = "**missed**"
        lines.append(
            f"| {t['setting']} | {t['target']} | {shown} | {_fmt(bound, spec)} "
            f"| {verdict}{' — ' + t['note'] if t['note'] else ''} |"
        )
    lines.append("")
    return "\n".join(lines)


def render_readme(results: dict) -> str:
    """The performance tables of docs/benchmarks/single-node.md, generated from a results JSON (the plot
    is referred to as ``overhead.png``: copy it beside the page, to ``docs/benchmarks/``)."""
    meta = results["meta"]
    host = meta["host"]
    head = [
        "## Performance",
        "",
        f"Measured {meta['date']} on {host['cpu']} ({host['cores']} cores, {host['mem_gb']:.0f} GB RAM, "
        f"{host['platform']}) with `{meta['command']}` — cf_ray {meta['versions']['cf_ray']}, "
        f"Ray {meta['versions']['ray']}, torch {meta['versions']['torch']}, preset `{meta['preset']}`, "
        f"{meta['wall_s'] / 60:.1f} min.",
        "",
    ]
    body = render_markdown(results, heading="##")
    plot = "" if not meta.get("plot") else f"\n![overhead against k]({Path(meta['plot']).name})\n"
    return "\n".join(head) + body + plot


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    settings = results["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), squeeze=False)
    markers = {
        "ray_sync": "s",
        "ray_async": "D",
        "dcp_async": "^",
        "cf_fixed": "o",
        "cf_auto": "*",
        "cf_held": "P",
        "floor_copy": "x",
    }
    for ax, setting in zip(axes[0], settings):
        vs = [v for v in results["variants"] if v["setting"] == setting["setting"]]
        for variant in VARIANTS[1:]:
            pts = sorted(
                (v["k"] or v.get("chosen_interval") or 1, v["overhead_pct"])
                for v in vs
                if v["variant"] == variant and v.get("probe") is None
            )
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(
                xs,
                ys,
                marker=markers[variant],
                ms=12 if variant == "cf_auto" else 6,
                linestyle="" if variant == "cf_auto" else "-",
                label=LABELS[variant],
            )
        probes = sorted((v["k"], v["overhead_pct"]) for v in vs if v.get("probe") is not None)
        if probes:
            ax.plot(
                *zip(*probes),
                marker="x",
                ms=8,
                linestyle="",
                color="black",
                label="FixedInterval at Adaptive's k and k−1 (steady state)",
            )
        budget = results["config"].get("budget_pct")
        if budget:
            ax.axhline(budget, color="red", lw=0.8, ls="--", label=f"budget {budget:g} %")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint interval k (iterations)")
        ax.set_ylabel("overhead vs no checkpoint (%)")
        ax.set_title(setting["desc"], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"cf_ray bench ({results['meta']['preset']}, {results['meta']['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
