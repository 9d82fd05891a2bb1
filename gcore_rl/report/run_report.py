"""The HTML report of one training run: what it learned, how fast, where the time went, what it wrote.

`write_run_report(run_dir)` reads the run directory (report/rundata.py) and writes
`report.html` next to `metrics.jsonl`: a summary, the learning curves, the per-device timeline of
the last steps, throughput and step time, sample completions with their rewards, the resolved
config and the environment. It can be drawn while the run is going (`run.report_every`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from gcore_rl.configlib import from_dict
from gcore_rl.disk import DiskError, writing
from gcore_rl.errors import GcoreError
from gcore_rl.report.figures import curve_figures, device_time_figure, step_time_figure, throughput_figures
from gcore_rl.report.page import Section, caption, escape, facts, figure_div, figure_grid, page, table
from gcore_rl.report.rundata import RunData, load_run, timeline_window
from gcore_rl.report.timeline import timeline_figure
from gcore_rl.telemetry.health import Flag, HealthConfig, run_flags

REPORT = "report.html"
TIMELINE_STEPS = 8
"""Steps shown on the timeline (the last ones): enough to see a rhythm, few enough to read each span."""
SAMPLE_STEPS = 10
"""Steps whose sample completions are listed (the last ones)."""


def report_path(run_dir: str | Path) -> Path:
    """Where `write_run_report` writes by default."""
    return Path(run_dir) / REPORT


def write_run_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's report (default `RUN_DIR/report.html`, replaced atomically) and return its path.

    RunDirError when `run_dir` is not a run directory.
    """
    run = load_run(run_dir)
    target = Path(out) if out is not None else report_path(run_dir)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    html = run_report_html(run)
    try:
        with writing(target, "the run report", needed=len(html.encode())):
            target.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(html, encoding="utf-8")
            partial.replace(target)  # a browser reloading the report never sees half a file
    finally:
        partial.unlink(missing_ok=True)  # what a full disk left of it
    return target


def draw_run_report(run_dir: str | Path) -> Path | None:
    """`write_run_report` for a training run: a report that cannot be drawn never fails the run (its
    records are intact and `gcore-rl report RUN_DIR` can draw it later); a warning says why. Returns
    the report's path, or None when it was not written."""
    try:
        return write_run_report(run_dir)
    except DiskError as exc:  # said as a full or read-only disk is said everywhere, with the bytes
        print(f"warning: {exc} The run's records are intact: `gcore-rl report {run_dir}` draws the report once "
              "there is room", file=sys.stderr)
        return None
    except Exception as exc:  # the report is a view of the run, never a reason to fail it
        print(f"warning: could not draw the run report of {run_dir} ({type(exc).__name__}: {exc}); the run's "
              f"records are intact: `gcore-rl report {run_dir}` draws it again", file=sys.stderr)
        return None


def run_report_html(run: RunData) -> str:
    """The report as one HTML document."""
    health = run_health(run)
    flags = run_flags(run.metrics, health, _accuracy_before(run))
    sections = [_summary(run)]
    if flags:
        sections.append(_unhealthy(flags))
    if run.notes:
        sections.append(Section("Missing data", "<ul>" + "".join(f"<li>{escape(n)}</li>" for n in run.notes) + "</ul>",
                                "notes"))
    curves = curve_figures(run.metrics, flags, {"approx_kl": health.max_approx_kl,
                                                "clip_fraction": health.max_clip_fraction})
    if curves:
        sections.append(Section("Learning curves", figure_grid(curves)))
    spans, markers, shown = timeline_window(run, TIMELINE_STEPS)
    if spans:
        sections.append(Section("Per-device timeline", caption(f"What each device and controller did, {shown}. "
                                                               "Hover a bar for its phase, step and duration.")
                                + figure_div(timeline_figure(spans, markers, "One lane per device and controller"))))
    speed = throughput_figures(run.metrics) + [f for f in (step_time_figure(run.metrics),
                                                           device_time_figure(run.metrics)) if f is not None]
    if speed:
        sections.append(Section("Throughput and step time", figure_grid(speed)))
    if run.samples:
        sections.append(Section("Sample completions", _samples_table(run.samples)))
    if run.config_text is not None:
        sections.append(Section("Config (config.yaml)", f"<pre>{escape(run.config_text)}</pre>"))
    sections.append(Section("Environment", _environment(run.environment)))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return page(f"gcore-rl run report: {run.path.resolve().name}", f"{run.path.resolve()} · drawn {stamp}", sections)


SUMMARY_PAIRS = (("reward, first → last step", "first_reward", "last_reward"),
                 ("reward, mean of the first → last 10 steps", "first_rewards", "last_rewards"),
                 ("held-out accuracy, before → after", "eval_accuracy_before", "eval_accuracy_after"),
                 ("held-out reward, before → after", "eval_reward_before", "eval_reward_after"))
"""Figures of a run's summary.json shown as before → after: (label, key before, key after), where the summary has
them (a language run's `RunSummary`, a diffusion run's `FlowRunSummary`)."""


def _summary(run: RunData) -> Section:
    steps = [m["step"] for m in run.metrics]
    pairs: list[tuple[str, Any]] = [("steps recorded", f"{len(steps)}" + (f" (last: {steps[-1]})" if steps else ""))]
    if run.summary:
        s = run.summary
        pairs.append(("status", f"finished: {s.get('steps')} steps in {_num(s.get('wall_seconds'))} s"))
        pairs.extend((label, f"{_num(s.get(first))} → {_num(s.get(last))}") for label, first, last in SUMMARY_PAIRS
                     if first in s)
    else:
        pairs.append(("status", "no summary.json: still running, or stopped before the end"))
    last = run.metrics[-1] if run.metrics else {}
    for key in ("reward/mean", "accuracy", "eval/accuracy", "time/step", "placement/rollout_devices"):
        if isinstance(last.get(key), (int, float)):
            pairs.append((f"{key} (last step)", _num(last[key])))
    return Section("Summary", facts(pairs))


UNHEALTHY_LISTED = 20
"""Flags listed by name at the top of the report (the charts mark them all)."""


def _unhealthy(flags: list[Flag]) -> Section:
    """The steps past a health threshold (`telemetry.health`), at the top of the report."""
    shown = "".join(f"<li>{escape(str(flag))}</li>" for flag in flags[:UNHEALTHY_LISTED])
    more = f"<li>… and {len(flags) - UNHEALTHY_LISTED} more</li>" if len(flags) > UNHEALTHY_LISTED else ""
    keys = ", ".join(sorted({flag.key for flag in flags}))
    return Section(f"Unhealthy steps ({len(flags)})",
                   caption(f"Steps past a threshold of run.health ({keys}); each is a red cross on its chart. "
                           "gcore_rl/telemetry/health.py says why each threshold is where it is.")
                   + f"<ul>{shown}{more}</ul>", "notes")


def run_health(run: RunData) -> HealthConfig:
    """The run's health thresholds: `run.health` of its config.yaml, the defaults where it says nothing."""
    try:
        section = ((yaml.safe_load(run.config_text or "") or {}).get("run") or {}).get("health") or {}
        cfg = from_dict(HealthConfig, section)
    except (yaml.YAMLError, AttributeError, GcoreError):
        return HealthConfig()
    return cfg


def _accuracy_before(run: RunData) -> float | None:
    value = (run.summary or {}).get("eval_accuracy_before")
    return float(value) if isinstance(value, (int, float)) else None


def _num(value: Any) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:.4g}"


def _samples_table(samples: list[dict[str, Any]]) -> str:
    """The samples of the last `SAMPLE_STEPS` steps, newest first."""
    steps = sorted({s.get("step") for s in samples if isinstance(s.get("step"), int)})
    shown = set(steps[-SAMPLE_STEPS:])
    rows = [(s.get("step"), s.get("reward") if isinstance(s.get("reward"), (int, float)) else "",
             str(s.get("prompt", "")), str(s.get("completion", "")))
            for s in reversed(samples) if s.get("step") in shown]
    trajectory = next((s for s in reversed(samples) if isinstance(s.get("turns"), list)), None)
    return (caption(f"{len(rows)} completions of the last {len(shown)} step(s) (samples.jsonl; run.samples_per_step "
                    "per step), newest first")
            + table(("step", "reward", "prompt", "completion"), rows, text_columns=(2, 3))
            + (_trajectory(trajectory) if trajectory is not None else ""))


def _trajectory(sample: dict[str, Any]) -> str:
    """The newest multi-turn sample turn by turn: the policy's turns, and what was inserted between them (a tool's
    answers, never trained on) marked."""
    parts = []
    for segment in sample["turns"]:
        text = escape(str(segment.get("text", "")) if isinstance(segment, dict) else str(segment))
        inserted = isinstance(segment, dict) and segment.get("inserted")
        label = "inserted (tool, loss mask 0)" if inserted else "policy"
        style = "background:#FFF3E0;border-left:3px solid #EF6C00" if inserted else "border-left:3px solid #1565C0"
        parts.append(f'<div style="{style};padding:2px 6px;margin:2px 0"><small>{label}</small>'
                     f'<pre style="margin:0;white-space:pre-wrap">{text}</pre></div>')
    return (caption(f"A trajectory turn by turn (step {escape(str(sample.get('step')))}, reward "
                    f"{escape(str(sample.get('reward')))}): the policy's turns, and the tokens inserted between them")
            + "".join(parts))


def _environment(environment: dict[str, Any] | None) -> str:
    if environment is None:
        return caption("This run wrote no environment.json (runs started before reports existed do not).")
    pairs: list[tuple[str, Any]] = [("python", environment.get("python")), ("platform", environment.get("platform")),
                                    ("host", environment.get("host")), ("CPU cores", environment.get("cpu_count"))]
    gpus = environment.get("gpus") or []
    pairs.append(("GPUs", ", ".join(map(str, gpus)) + f" (CUDA {environment.get('cuda')})" if gpus else "none (CPU run)"))
    pairs.extend((name, version) for name, version in (environment.get("packages") or {}).items())
    return facts(pairs)
