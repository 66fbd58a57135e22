"""Benchmark output: the result file (JSON), a readable table, ratios between targets, PNG plots.

A result file holds one target's runs: {"label", "target", "date", "machine", "options",
"runs": [{"concurrency", "request_rate", "summary", "records"}]}.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from cluster.bench.metrics import RequestRecord


def machine() -> dict:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return {"cpu": cpu, "nproc": os.cpu_count(), "python": platform.python_version()}


def save_rows(path: str | Path, rows: list[dict], **meta) -> None:
    """A benchmark script's rows as JSON, with the date and the machine."""
    save({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), **meta, "rows": rows}, path)


def markdown_rows(headers: list[str], lines: list[list[str]]) -> str:
    """A Markdown table: the first column left-aligned, the others right-aligned (numbers)."""
    out = ["| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
    return "\n".join(out + ["| " + " | ".join(line) + " |" for line in lines])


def result_file(label: str, target: str, options: dict, runs: list[dict]) -> dict:
    return {"label": label, "target": target, "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
            "options": options, "runs": runs}


def save(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def _load_label(run: dict) -> str:
    if run.get("concurrency"):
        return f"c={run['concurrency']}"
    rate = run.get("request_rate")
    return "rate=inf" if rate is None else f"rate={rate:g}/s"


def table(result: dict) -> str:
    """One row per run: throughput, latency medians and tails (ms), failures, goodput."""
    header = (f"{'load':>10} {'ok':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'p95':>7} {'p99':>7} "
              f"{'TPOT p50':>9} {'p95':>7} {'p99':>7} {'ITL p50':>8} {'E2E p50':>8} {'goodput':>8} failures")
    lines = [f"{result['label']}  ({result['target']})", header]
    for run in result["runs"]:
        s = run["summary"]
        goodput = f"{s['goodput']:.2f}" if "goodput" in s else "-"
        failures = ",".join(f"{k}:{v}" for k, v in s["failures"].items()) or "-"
        lines.append(
            f"{_load_label(run):>10} {s['completed']:>5} {s['request_throughput']:>7.2f} {s['output_throughput']:>9.1f} "
            f"{s['ttft_ms']['median']:>9.1f} {s['ttft_ms']['p95']:>7.1f} {s['ttft_ms']['p99']:>7.1f} "
            f"{s['tpot_ms']['median']:>9.1f} {s['tpot_ms']['p95']:>7.1f} {s['tpot_ms']['p99']:>7.1f} "
            f"{s['itl_ms']['median']:>8.1f} {s['e2e_ms']['median']:>8.1f} {goodput:>8} {failures}"
        )
        if "probe" in s:
            p = s["probe"]
            lines.append(f"{'':>10} probe: {p['checked']} checked, {p['mismatches']} mismatches, {p['cross_talk']} cross-talk")
    return "\n".join(lines)


def ratios(reference: dict, other: dict) -> list[dict]:
    """reference vs other at each load both ran: output tok/s reference/other (above 1: the
    reference is faster), TTFT and TPOT medians other/reference (above 1: the reference is quicker)."""
    by_load = {_load_label(run): run["summary"] for run in other["runs"]}
    rows = []
    for run in reference["runs"]:
        mine, theirs = run["summary"], by_load.get(_load_label(run))
        if theirs is None or not theirs["completed"] or not mine["completed"]:
            continue
        rows.append({
            "load": _load_label(run),
            "output_throughput": mine["output_throughput"] / theirs["output_throughput"],
            "ttft_median": theirs["ttft_ms"]["median"] / mine["ttft_ms"]["median"],
            "tpot_median": theirs["tpot_ms"]["median"] / mine["tpot_ms"]["median"],
        })
    return rows


def ratio_table(reference: dict, others: list[dict]) -> str:
    lines = []
    for other in others:
        lines.append(f"{reference['label']} vs {other['label']}: throughput x (higher is better for "
                     f"{reference['label']}), TTFT/TPOT x = {other['label']} / {reference['label']}")
        lines.append(f"{'load':>10} {'out tok/s x':>12} {'TTFT p50 x':>11} {'TPOT p50 x':>11}")
        for row in ratios(reference, other):
            lines.append(f"{row['load']:>10} {row['output_throughput']:>12.2f} {row['ttft_median']:>11.2f} {row['tpot_median']:>11.2f}")
    return "\n".join(lines)


def markdown(results: list[dict]) -> str:
    """Targets side by side, load by load: output tok/s, TTFT p50/p95 and TPOT p50/p95 (ms)."""
    loads = list(dict.fromkeys(_load_label(run) for result in results for run in result["runs"]))
    lines = ["| load | target | out tok/s | TTFT p50 | TTFT p95 | TPOT p50 | TPOT p95 | ok |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for load in loads:
        for result in results:
            for run in result["runs"]:
                if _load_label(run) != load:
                    continue
                s = run["summary"]
                lines.append(f"| {load} | {result['label']} | {s['output_throughput']:.1f} | {s['ttft_ms']['median']:.0f} | "
                             f"{s['ttft_ms']['p95']:.0f} | {s['tpot_ms']['median']:.1f} | {s['tpot_ms']['p95']:.1f} | "
                             f"{s['completed']}/{s['requests']} |")
    return "\n".join(lines)


def ramp_table(result: dict) -> str:
    """The ramp's timeline as a markdown table."""
    names = sorted({n for row in result["timeline"] for n in row["replicas"]})
    headers = ["t (s)", "users", "started", "failed", "TTFT p50 (ms)", "TTFT p95 (ms)", "TPOT p50 (ms)",
               *[f"{n} replicas" for n in names], "nodes", "waiting"]
    lines = [[f"{r['t_s']:.0f}", str(r["users"]), str(r["started"]), str(r["failed"]), f"{r['ttft_p50_ms']:.0f}",
              f"{r['ttft_p95_ms']:.0f}", f"{r['tpot_p50_ms']:.1f}", *[str(r["replicas"].get(n, "")) for n in names],
              str(r["nodes"] if r["nodes"] is not None else ""), str(r["waiting"] if r["waiting"] is not None else "")]
             for r in result["timeline"]]
    return markdown_rows(headers, lines)


def plot_ramp(results: list[dict], directory: str | Path, prefix: str = "bench") -> list[Path]:
    """The ramps' timelines in one PNG: users, replicas and nodes; TTFT p95; queue."""
    from cluster.bench.ramp import plot_timelines

    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"{prefix}_ramp.png"
    plot_timelines(results, path)
    return [path]


def plot(results: list[dict], directory: str | Path, prefix: str = "bench") -> list[Path]:
    """Latency CDFs (TTFT, TPOT, E2E) of every target at its highest load, and, when runs span
    several concurrencies, output throughput and TPOT median against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for result in results:
        run = result["runs"][-1]
        ok = [record for record in (RequestRecord(**r) for r in run["records"]) if record.ok]
        series = {
            "TTFT (ms)": [r.ttft * 1000 for r in ok],
            "TPOT (ms)": [r.tpot * 1000 for r in ok if r.tpot is not None],
            "E2E (ms)": [r.e2e * 1000 for r in ok],
        }
        for ax, (name, values) in zip(axes, series.items()):
            values = sorted(values)
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                    label=f"{result['label']} {_load_label(run)}")
            ax.set_xlabel(name)
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    written.append(directory / f"{prefix}_latency_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    if any(len({run.get("concurrency") for run in result["runs"]}) > 1 for result in results):
        fig, (ax_tput, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4))
        for result in results:
            runs = [run for run in result["runs"] if run.get("concurrency")]
            levels = [run["concurrency"] for run in runs]
            ax_tput.plot(levels, [run["summary"]["output_throughput"] for run in runs], marker="o", label=result["label"])
            ax_tpot.plot(levels, [run["summary"]["tpot_ms"]["median"] for run in runs], marker="o", label=result["label"])
        for ax, name in ((ax_tput, "output tokens/s"), (ax_tpot, "TPOT median (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        ax_tput.legend(fontsize=8)
        fig.tight_layout()
        written.append(directory / f"{prefix}_throughput_vs_concurrency.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
