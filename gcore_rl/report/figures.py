"""Charts of a run's step metrics: learning curves, throughput, step time by phase, device time by role.

Each function takes the lines of `metrics.jsonl` (dicts with "step" and metric keys) and returns
Plotly figures (plain `{"data", "layout"}` dicts: building `plotly.graph_objects` validates every
attribute and costs seconds per report) only for the keys the run recorded: a metric the run did
not write is left out, never drawn as zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gcore_rl.report.timeline import CATEGORIES, Figure, category_of
from gcore_rl.telemetry.health import Flag

Metrics = Sequence[dict[str, Any]]

#: learning-curve panels: title and the metric keys drawn in it (whichever exist)
CURVE_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reward", ("reward/mean", "reward/greedy_mean", "reward/judge_mean", "reward/reward_model_mean")),
    ("Accuracy", ("accuracy", "eval/accuracy")),
    ("Loss", ("loss", "pg_loss", "kl_loss", "entropy_loss")),
    ("KL to the old / reference policy", ("approx_kl", "kl", "kl_divergence", "kl_probe_max")),
    ("Entropy", ("entropy",)),
    ("Clip fraction", ("clip_fraction",)),
    ("Response length (tokens)", ("response_length/mean", "response_length/max")),
    ("Gradient norm", ("grad_norm", "critic/grad_norm")),
    ("Critic: value loss (PPO)", ("critic/value_loss",)),
    ("Critic: explained variance of the returns (PPO)", ("critic/explained_variance",)),
)


def series(metrics: Metrics, key: str) -> tuple[list[int], list[float]]:
    """Steps and values of `key` over the lines that hold a number for it."""
    steps, values = [], []
    for line in metrics:
        value = line.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(line["step"])
            values.append(float(value))
    return steps, values


def _chart(title: str, y_title: str = "") -> Figure:
    axis = {"gridcolor": "#EEEEEE", "zeroline": False}
    return {"data": [], "layout": {
        "title": {"text": title, "font": {"size": 13}, "x": 0.01, "xanchor": "left"}, "height": 300, "plot_bgcolor": "white",
        "margin": {"l": 55, "r": 15, "t": 40, "b": 40}, "hovermode": "x unified",
        "legend": {"orientation": "h", "y": -0.3, "font": {"size": 10}},
        "xaxis": {**axis, "title": {"text": "step"}}, "yaxis": {**axis, "title": {"text": y_title}}}}


def _line_chart(title: str, metrics: Metrics, keys: Sequence[str], y_title: str = "") -> Figure | None:
    """One line per key that has at least one value, or None when none has."""
    fig = _chart(title, y_title)
    for key in keys:
        steps, values = series(metrics, key)
        if steps:
            fig["data"].append({"type": "scatter", "x": steps, "y": values, "name": key, "marker": {"size": 5},
                                "mode": "lines+markers" if len(steps) < 30 else "lines"})
    return _finish(fig)


def _finish(fig: Figure) -> Figure | None:
    """None for a chart without data; otherwise a step axis with whole-number ticks, the legend only
    when there are several series."""
    if not fig["data"]:
        return None
    steps = [x for trace in fig["data"] for x in trace["x"]]
    layout = fig["layout"]
    if max(steps) - min(steps) <= 12:
        layout["xaxis"]["dtick"] = 1
    layout["showlegend"] = len(fig["data"]) > 1
    if layout["showlegend"]:
        layout["height"], layout["margin"]["b"] = 330, 80
    return fig


def curve_figures(metrics: Metrics, flags: Sequence[Flag] = (), limits: dict[str, float] | None = None) -> list[Figure]:
    """The learning-curve panels of `CURVE_PANELS` that have data; each flagged step (`telemetry.health`) is a
    red cross on its metric's panel, and each fixed threshold of `limits` (metric key → value) a dashed line."""
    figures = []
    for title, keys in CURVE_PANELS:
        fig = _line_chart(title, metrics, keys)
        if fig is not None:
            _mark_health(fig, keys, flags, limits or {})
            figures.append(fig)
    return figures


def _mark_health(fig: Figure, keys: Sequence[str], flags: Sequence[Flag], limits: dict[str, float]) -> None:
    steps = [x for trace in fig["data"] for x in trace["x"]]
    for key in keys:
        if key in limits and any(trace["name"] == key for trace in fig["data"]):
            fig["data"].append({"type": "scatter", "x": [min(steps), max(steps)], "y": [limits[key]] * 2,
                                "mode": "lines", "name": f"{key} threshold",
                                "line": {"dash": "dash", "color": "#C62828", "width": 1}})
        marked = [flag for flag in flags if flag.key == key]
        if marked:
            fig["data"].append({"type": "scatter", "x": [f.step for f in marked], "y": [f.value for f in marked],
                                "mode": "markers", "name": f"{key}: unhealthy", "text": [str(f) for f in marked],
                                "marker": {"symbol": "x", "size": 10, "color": "#C62828"}})
    fig["layout"]["showlegend"] = len(fig["data"]) > 1


def samples_per_second(metrics: Metrics) -> list[dict[str, Any]]:
    """Lines with `throughput/samples_per_s`: completions rewarded in the step (`reward/count`, summed over
    controllers) over the step's wall time (`time/step`), where both were recorded."""
    out = []
    for line in metrics:
        count, seconds = line.get("reward/count"), line.get("time/step")
        if isinstance(count, (int, float)) and isinstance(seconds, (int, float)) and seconds > 0:
            out.append({"step": line["step"], "throughput/samples_per_s": count / seconds})
    return out


def throughput_figures(metrics: Metrics) -> list[Figure]:
    """Samples/s and generated tokens/s per step (whichever can be computed)."""
    figures = [_line_chart("Samples per second (reward/count ÷ time/step)", samples_per_second(metrics),
                           ["throughput/samples_per_s"]),
               _line_chart("Generated tokens per second", metrics, ["throughput/tokens_per_s"])]
    return [fig for fig in figures if fig is not None]


def phase_keys(metrics: Metrics) -> list[str]:
    """The `time/<phase>` keys the run recorded, in first-seen order (`time/step` last)."""
    keys: dict[str, None] = {}
    for line in metrics:
        keys.update((k, None) for k in line if k.startswith("time/") and k != "time/step")
    return list(keys) + ["time/step"]


def step_time_figure(metrics: Metrics) -> Figure | None:
    """Seconds per step of each timed phase (a nested phase such as `time/rollout/reward` also counts in its parent)."""
    return _line_chart("Step time by phase (seconds; nested phases also count in their parent)", metrics,
                       phase_keys(metrics), "seconds")


def device_time_figure(metrics: Metrics) -> Figure | None:
    """Stacked bars: each step's device seconds by role, swapping, waiting and idle (the `util/*` split,
    which adds up to the step's time on a device)."""
    keys: dict[str, None] = {}
    for line in metrics:
        keys.update((k, None) for k in line if k.startswith("util/") and k.endswith("_s"))
    fig = _chart("Device time by role (seconds per step, averaged over devices)", "seconds")
    for key in keys:
        steps, values = series(metrics, key)
        if steps:
            role = key.removeprefix("util/").removesuffix("_s").removesuffix("/busy")
            category = category_of(role, "")
            colour, label = CATEGORIES[category if category in CATEGORIES else "idle"]
            fig["data"].append({"type": "bar", "x": steps, "y": values, "marker": {"color": colour},
                                "name": role if category == "idle" and role != "idle" else label})
    fig["layout"]["barmode"] = "stack"
    return _finish(fig)
