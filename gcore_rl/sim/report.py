"""Reports of simulation results: comparison tables (markdown, rich), a Gantt chart, a JSON dump."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from rich.table import Table

from gcore_rl.report.page import Section, figure_div, page
from gcore_rl.report.timeline import Marker, Span, category_of, timeline_figure
from gcore_rl.sim.results import SimResult
from gcore_rl.sim.scenario import Scenario

ROLE_COLOURS = {"rollout": "#4C72B0", "judge": "#DD8452", "reference": "#8172B3", "actor": "#55A868",
                "sync": "#C44E52", "swap": "#8C8C8C", "data": "#937860"}

COLUMNS = ("step s", "vs first", "generate", "judge", "data", "swap", "prepare+train", "sync", "waves",
           "idle %", "swap %", "samples/s")


def comparison_rows(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """One row per result: mean seconds per step of each phase group, utilisation and throughput.

    `vs first` compares each mean step time with the first strategy of the same variant.
    """
    baseline: dict[str, float] = {}
    rows = []
    for r in results:
        phases = r.mean_phases()
        util = r.utilisation()
        step = r.mean_step_seconds
        base = baseline.setdefault(r.variant, step)
        rows.append({
            "strategy": r.strategy, "variant": r.variant, "step s": step,
            "vs first": (step / base - 1.0) if base else 0.0,
            "generate": phases.get("rollout/generate", 0.0),
            "judge": phases.get("rollout/judge", 0.0) + phases.get("rollout/reference", 0.0),
            "data": phases.get("rollout/data", 0.0) + phases.get("update/data", 0.0),
            "swap": phases.get("swap", 0.0),
            "prepare+train": phases.get("update/prepare", 0.0) + phases.get("update/train", 0.0),
            "sync": phases.get("update/sync", 0.0),
            "waves": sum(s.waves for s in r.steps) / max(1, len(r.steps)),
            "idle %": 100.0 * util["idle"], "swap %": 100.0 * util["swap"],
            "samples/s": r.throughput()["samples_per_s"],
        })
    return rows


def _cell(key: str, value: Any) -> str:
    if key == "vs first":
        return f"{100.0 * value:+.1f}%"
    if key in ("idle %", "swap %"):
        return f"{value:.1f}"
    if key == "waves":
        return f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 0.05 or value == 0 else f"{value:.3f}"
    return str(value)


def markdown_table(results: Sequence[SimResult]) -> str:
    """A markdown table comparing the results (seconds are means per step)."""
    rows = comparison_rows(results)
    with_variant = any(r["variant"] for r in rows)
    head = ["strategy"] + (["variant"] if with_variant else []) + list(COLUMNS)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---"] * (len(head) - 1)) + "|"]
    for row in rows:
        cells = [row["strategy"]] + ([row["variant"]] if with_variant else []) + [_cell(k, row[k]) for k in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def data_plane_rows(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """One row per result whose prompts carry images: the data plane per step against the rest of the step.

    `rest s` is the step without its data plane (the GPUs' share); a driver or controller that loaded
    the next step's images while the GPUs work would hide its data plane while `data / rest` < 1, and
    falls behind the GPUs beyond it.
    """
    rows = []
    for r in results:
        if not r.steps or "images/count" not in r.steps[0].features:
            continue
        phases = r.mean_phases()
        data = phases.get("rollout/data", 0.0) + phases.get("update/data", 0.0)
        rest = r.mean_step_seconds - data
        images = sum(s.features["images/count"] for s in r.steps) / len(r.steps)
        rows.append({"strategy": r.strategy, "variant": r.variant, "gpus": r.gpus, "controllers": r.controllers,
                     "images per controller": images, "data s": data, "rest s": rest,
                     "data / rest": data / rest if rest > 0 else float("inf"), "step s": r.mean_step_seconds})
    return rows


def data_plane_markdown(results: Sequence[SimResult]) -> str:
    """`data_plane_rows` as a markdown table ("" when no result has images)."""
    rows = data_plane_rows(results)
    if not rows:
        return ""
    keys = ("gpus", "controllers", "images per controller", "data s", "rest s", "data / rest", "step s")
    lines = ["| strategy | variant | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for row in rows:
        cells = [f"{row[k]:.2f}" if k == "data / rest" else _cell(k, row[k]) for k in keys]
        lines.append(f"| {row['strategy']} | {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rich_table(results: Sequence[SimResult], title: str | None = None) -> Table:
    """The comparison as a `rich` table for the terminal."""
    rows = comparison_rows(results)
    with_variant = any(r["variant"] for r in rows)
    table = Table(title=title, show_lines=False)
    table.add_column("strategy", style="bold")
    if with_variant:
        table.add_column("variant")
    for key in COLUMNS:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(row["strategy"], *([row["variant"]] if with_variant else []), *(_cell(k, row[k]) for k in COLUMNS))
    return table


def gantt_png(result: SimResult, path: str | Path, steps: int = 3, max_devices: int = 16) -> Path:
    """Draw the per-device timeline of the first `steps` steps of the first slice (at most `max_devices` devices)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    shown = min(result.gpus // result.controllers, max_devices)
    until = result.steps[min(steps, len(result.steps)) - 1].end
    events = result.timeline.events(devices=range(0, shown), until=until)
    fig, ax = plt.subplots(figsize=(11, 0.3 * shown + 1.3))
    for role, colour in ROLE_COLOURS.items():
        spans = [(ev.device, ev.start, min(ev.end, until) - ev.start) for ev in events if ev.role == role]
        for device in {d for d, _, _ in spans}:
            ax.broken_barh([(s, w) for d, s, w in spans if d == device], (device - 0.4, 0.8), facecolor=colour,
                           edgecolor="white", linewidth=0.3)
    for record in result.steps[:steps]:
        ax.axvline(record.end, color="black", linewidth=0.6, linestyle=":")
    ax.set_ylim(shown - 0.5, -0.5)
    ax.set_xlim(0, until)
    ax.set_yticks(range(shown))
    ax.set_yticklabels([f"d{d}" for d in range(shown)], fontsize=7)
    ax.set_xlabel("simulated seconds (dotted: end of a step)")
    title = f"{result.scenario}: {result.label}, slice 0 ({shown} of {result.gpus} GPUs, {result.controllers} controllers)"
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=c, label=r) for r, c in ROLE_COLOURS.items()], fontsize=7,
              loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_spans(result: SimResult, steps: int = 3, max_devices: int = 16) -> tuple[list[Span], list[Marker]]:
    """The first `steps` steps of the first slice (at most `max_devices` devices) as report timeline spans,
    with the step ends and each dynamic split change marked (the same view `gcore-rl report` draws of a real run)."""
    shown = min(result.gpus // result.controllers, max_devices)
    records = result.steps[:steps]
    until = records[-1].end if records else 0.0
    spans = [Span(f"device {ev.device}", category_of(ev.role, ev.what), ev.what, ev.step, ev.start, min(ev.end, until))
             for ev in result.timeline.events(devices=range(0, shown), until=until)]
    markers = [Marker(record.end, f"end of step {record.step}", major=False) for record in records]
    markers += [Marker(now.start, f"step {now.step}: rollout devices {before.rollout_devices} → {now.rollout_devices}")
                for before, now in pairwise(records) if now.rollout_devices != before.rollout_devices]
    return spans, markers


def timeline_html(results: Sequence[SimResult], path: str | Path, steps: int = 3) -> Path:
    """One self-contained HTML page with each result's per-device timeline, drawn like a real run's report."""
    sections = []
    for result in results:
        spans, markers = timeline_spans(result, steps)
        title = f"{result.label}: slice 0 of {result.gpus} GPUs, {result.controllers} controller(s)"
        sections.append(Section(result.label, figure_div(timeline_figure(spans, markers, title, "simulated seconds"))))
    name = results[0].scenario if results else "simulation"
    path = Path(path)
    path.write_text(page(f"gcore-rl simulation: {name}", f"per-device timelines of the first {steps} steps", sections),
                    encoding="utf-8")
    return path


def results_json(results: Sequence[SimResult], path: str | Path, scenario: Scenario | None = None) -> Path:
    """Write every result (summary and step records) as JSON."""
    from gcore_rl.configlib import to_dict

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"scenario": to_dict(scenario) if scenario is not None else None,
               "results": [r.to_dict() for r in results]}
    path.write_text(json.dumps(payload, indent=1, default=float), encoding="utf-8")
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")


def summary_markdown(results: Sequence[SimResult], scenario: Scenario | None = None) -> str:
    """The summary page: scenario, comparison table, and the split chosen per step for dynamic."""
    lines = []
    if scenario is not None:
        lines.append(f"# Simulation: {scenario.name}\n")
        if scenario.description:
            lines.append(scenario.description.strip() + "\n")
        judge = scenario.models.judge
        lines.append(f"{scenario.gpus} x {scenario.hardware.preset}, {scenario.controllers} controller(s), "
                     f"{scenario.steps} steps; policy {scenario.models.policy.preset or 'custom'} "
                     f"(tp {scenario.models.policy.tp}), judge "
                     f"{(judge.preset or 'custom') + f' (tp {judge.tp})' if judge else 'none'}, "
                     f"reference {'yes' if scenario.models.reference else 'no'}; "
                     f"{scenario.workload.prompts_per_step} prompts x {scenario.workload.group_size} per step.\n")
    lines.append("Mean seconds per step on the critical path (`judge` under partial/dynamic/disaggregated is the "
                 "judge's tail after generation; disaggregated overlaps rollout with training, so its phases sum to "
                 "more than its step).\n")
    lines.append(markdown_table(results))
    for r in results:
        if r.strategy == "dynamic":
            splits = [s.rollout_devices for s in r.steps]
            lines.append(f"\n{r.label}: rollout devices per slice by step: {splits}\n")
            resplit = [(s.step, s.wave_splits) for s in r.steps if len(set(s.wave_splits)) > 1]
            if resplit:
                paid = sum(s.features.get("placement/wave_move_s", 0.0) for s in r.steps)
                lines.append(f"{r.label}: re-split between waves in {len(resplit)} step(s), moves costing "
                             f"{paid:.1f} s in all; per wave: "
                             + "; ".join(f"step {step}: {list(waves)}" for step, waves in resplit) + "\n")
    data_plane = data_plane_markdown(results)
    if data_plane:
        lines.append("\nThe data plane of the prompts' images (mean seconds per step; `images per controller`: the "
                     "busiest controller's shard, which a single driver handles `controllers` times over; a driver "
                     "that prefetched the next step's images would keep up while `data / rest` < 1):\n")
        lines.append(data_plane)
    return "\n".join(lines)


def write_report(results: Sequence[SimResult], out_dir: str | Path, scenario: Scenario | None = None,
                 gantt_steps: int = 3) -> dict[str, Path]:
    """Write summary.md, results.json, one gantt-<strategy>[-<variant>].png per result and timeline.html (every
    result's timeline, interactive, in the view of `gcore-rl report`) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"summary": out / "summary.md"}
    written["summary"].write_text(summary_markdown(results, scenario), encoding="utf-8")
    written["results"] = results_json(results, out / "results.json", scenario)
    for r in results:
        name = f"gantt-{r.strategy}" + (f"-{_slug(r.variant)}" if r.variant else "") + ".png"
        written[name] = gantt_png(r, out / name, steps=gantt_steps)
    written["timeline"] = timeline_html(results, out / "timeline.html", steps=gantt_steps)
    return written
