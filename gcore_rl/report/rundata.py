"""Reading what a training run wrote into its directory, for the report.

A run directory holds `metrics.jsonl` (one line per step, written by controller 0), the
per-device and per-controller timelines (`timeline/device-<d>.jsonl`,
`timeline/controller-<k>.jsonl`; see `gcore_rl.telemetry.timeline`), the resolved `config.yaml`,
`environment.json` (versions and devices, written at the start of the run), `samples.jsonl` (a
few completions per step) and, once the run ended, `summary.json`. Only `metrics.jsonl` is
required: everything else is shown when it is there. A file cut off mid-line (a run killed while
writing, or a report drawn while the run is going) keeps the lines it has, and `RunData.notes`
says what was left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from gcore_rl.errors import RunDirError
from gcore_rl.report.timeline import Marker, Span, category_of

METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
ENVIRONMENT = "environment.json"


@dataclass
class RunData:
    """Everything the report shows of one run (times in seconds since the first timeline event)."""

    path: Path
    metrics: list[dict[str, Any]]
    """The readable lines of metrics.jsonl, in order."""
    spans: list[Span] = field(default_factory=list)
    step_ends: dict[int, float] = field(default_factory=dict)
    """When each step's metrics line was written, on the timeline's clock."""
    config_text: str | None = None
    environment: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    """What could not be read (cut-off lines, missing steps), one sentence each."""


def read_jsonl(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """The JSON-object lines of `path`; each unreadable line is skipped and counted in `notes`."""
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad.append(number)
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad.append(number)
    if bad:
        where = "its last line" if bad == [len(lines)] else f"line(s) {', '.join(map(str, bad[:10]))}"
        notes.append(f"{path.name}: {where} could not be read (cut off while the run was writing?) and "
                     f"{'is' if len(bad) == 1 else 'are'} left out; the report shows the {len(records)} complete line(s).")
    return records


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory (RunDirError when it is not a directory or holds no metrics.jsonl)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"'{path}' is not a directory; give the output directory of a training run "
                          "(run.output_dir, e.g. runs/grpo-addition)")
    metrics_path = path / METRICS
    if not metrics_path.is_file():
        raise RunDirError(f"'{path}' holds no {METRICS}, so there is no run to report on; give the output "
                          f"directory of a `gcore-rl train` run (it writes '{metrics_path}' after its first step)")
    notes: list[str] = []
    metrics = [m for m in read_jsonl(metrics_path, notes) if isinstance(m.get("step"), int)]
    run = RunData(path=path, metrics=metrics, notes=notes)
    run.config_text = _read_text(path / "config.yaml")
    run.environment = _read_json(path / ENVIRONMENT, notes)
    run.summary = _read_json(path / "summary.json", notes)
    if (path / SAMPLES).is_file():
        run.samples = read_jsonl(path / SAMPLES, notes)
    run.spans, origin = _timeline(path / "timeline", notes)
    run.step_ends = {m["step"]: m["time"] - origin for m in metrics if isinstance(m.get("time"), (int, float))}
    _note_missing_steps(run)
    return run


def _timeline(folder: Path, notes: list[str]) -> tuple[list[Span], float]:
    """Spans of every device and controller, on a clock starting at the first event (and that start)."""
    raw: list[tuple[str, dict[str, Any]]] = []
    for owner in ("device", "controller"):
        files = sorted(folder.glob(f"{owner}-*.jsonl"), key=lambda p: _index(p.stem))
        for file in files:
            raw.extend((owner, event) for event in read_jsonl(file, notes))
    events = [(owner, e) for owner, e in raw if all(isinstance(e.get(k), (int, float)) for k in ("start", "end"))]
    if not events:
        return [], 0.0
    origin = min(e["start"] for _, e in events)
    spans = [Span(lane=f"{owner} {int(e.get(owner, 0))}", category=category_of(str(e.get("role", "")), str(e.get("what", ""))),
                  what=str(e.get("what", "")), step=int(e.get("step", 0)), start=e["start"] - origin, end=e["end"] - origin)
             for owner, e in events]
    return spans, origin


def _index(stem: str) -> int:
    tail = stem.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _note_missing_steps(run: RunData) -> None:
    """Say so when the run recorded fewer steps than it was asked for and has not finished."""
    if run.summary is not None or not run.config_text:
        return
    planned = _planned_steps(run.config_text)
    done = max((m["step"] for m in run.metrics), default=0)
    if planned is not None and done < planned:
        run.notes.append(f"metrics.jsonl holds {done} of the {planned} steps in config.yaml and the run wrote no "
                         "summary.json: the run is still going or was stopped; later steps are missing.")


def _planned_steps(config_text: str) -> int | None:
    try:
        config = yaml.safe_load(config_text)
    except yaml.YAMLError:
        return None
    steps = config.get("run", {}).get("steps") if isinstance(config, dict) else None
    return steps if isinstance(steps, int) else None


def _read_text(path: Path) -> str | None:
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None


def _read_json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):  # not JSON, not UTF-8 (both ValueErrors) or unreadable
        notes.append(f"{path.name} could not be read and is left out.")
        return None
    return value if isinstance(value, dict) else None


def timeline_window(run: RunData, steps: int) -> tuple[list[Span], list[Marker], str]:
    """The spans of the run's last `steps` steps, re-based to start at 0, with markers for the step ends
    and for each dynamic placement move (`placement/next_rollout_devices` differing from
    `placement/rollout_devices`: the new split takes effect at that step's weight sync), and a caption."""
    if not run.spans:
        return [], [], ""
    last = max(s.step for s in run.spans)
    first = max(last - steps + 1, 0)
    spans = [s for s in run.spans if s.step >= first]
    start = min(s.start for s in spans)
    shifted = [replace(s, start=s.start - start, end=s.end - start) for s in spans]
    end = max(s.end for s in shifted)
    markers = [Marker(t - start, f"end of step {step}", major=False)
               for step, t in run.step_ends.items() if step >= first and 0 <= t - start <= end * 1.01]
    for line in run.metrics:
        current, following = line.get("placement/rollout_devices"), line.get("placement/next_rollout_devices")
        step = line["step"]
        if isinstance(current, (int, float)) and isinstance(following, (int, float)) and current != following \
                and step >= first and step in run.step_ends:
            markers.append(Marker(run.step_ends[step] - start, f"step {step}: rollout devices {current:g} → {following:g}"))
    shown = "every step" if first <= min(s.step for s in run.spans) else f"steps {first}–{last} of 0–{last}"
    return shifted, markers, f"{shown} (step 0: the evaluation before training); dotted lines end a step"
