"""The per-device timeline figure, one function for real runs and for the simulator.

A timeline is a list of `Span`s (one interval of one lane: a device, or a controller's own work)
and of `Marker`s (moments worth a vertical line, such as a dynamic placement move). Each span is
coloured by what the device was doing (`CATEGORIES`); the gaps between a lane's spans are drawn
as idle. Real runs get their spans from `timeline/*.jsonl` (report/rundata.py), the simulator from
its `Timeline` (sim/report.py), so the two pictures can be laid side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Figure = dict[str, Any]
"""A Plotly figure as plain data: `{"data": [traces], "layout": {...}}`."""

#: colour and legend label of each kind of work, in legend order
CATEGORIES: dict[str, tuple[str, str]] = {
    "generate": ("#4C72B0", "generate"),
    "score": ("#E5AE38", "score (rewards, reward model)"),
    "judge": ("#DD8452", "judge"),
    "reference": ("#8172B3", "reference log-probs"),
    "prepare": ("#8DCB8A", "prepare (old / ref log-probs)"),
    "train": ("#2E8B57", "train"),
    "sync": ("#C44E52", "weight sync"),
    "swap": ("#7F7F7F", "sleep / wake (swap)"),
    "data": ("#937860", "data transfer"),
    "wait": ("#C9B8E0", "wait for other controllers"),
    "idle": ("#EDEDED", "idle"),
}

_CATEGORY_OF_PHASE = {
    "rollout/generate": "generate", "rollout/load_weights": "sync", "rollout/judge": "judge",
    "rollout/reward_model": "score", "rollout/reward": "score", "rollout/reference": "reference",
    "rollout/wait": "wait", "update/prepare": "prepare", "update/train": "train", "update/sync": "sync",
    "update/data": "data", "rollout/data": "data",
}
_CATEGORY_OF_ROLE = {"rollout": "generate", "rewards": "score", "reward_model": "score", "actor": "train"}


@dataclass(frozen=True)
class Span:
    """One interval [start, end) in seconds of one lane ("device 3", "controller 0")."""

    lane: str
    category: str
    what: str
    step: int
    start: float
    end: float


@dataclass(frozen=True)
class Marker:
    """A moment on the time axis with a label (a placement move, the end of a step)."""

    time: float
    label: str
    major: bool = True
    """Major markers (placement moves) are drawn solid and labelled; minor ones (step ends) dotted."""


def category_of(role: str, what: str) -> str:
    """The colour category of a timeline event: by its phase (`what`), else by its role."""
    if what in _CATEGORY_OF_PHASE:
        return _CATEGORY_OF_PHASE[what]
    if what.startswith("swap/"):
        return "swap"
    if what.startswith("rollout/"):  # a reward model of a registered kind (`rollout/<kind>`) scores
        return "score"
    return _CATEGORY_OF_ROLE.get(role, role if role in CATEGORIES else "idle")


def idle_gaps(spans: Sequence[Span], until: float) -> list[Span]:
    """The gaps of each lane between 0 and `until` that no span covers, as idle spans (pure)."""
    by_lane: dict[str, list[Span]] = {}
    for span in spans:
        by_lane.setdefault(span.lane, []).append(span)
    gaps = []
    for lane, lane_spans in by_lane.items():
        covered = 0.0
        for span in sorted(lane_spans, key=lambda s: s.start):
            if span.start > covered:
                gaps.append(Span(lane, "idle", "idle", span.step, covered, span.start))
            covered = max(covered, span.end)
        if until > covered:
            gaps.append(Span(lane, "idle", "idle", -1, covered, until))
    return gaps


def lane_order(lanes: set[str]) -> list[str]:
    """Devices first, then controllers, each by number ("device 10" after "device 9")."""
    def key(lane: str) -> tuple[int, int, str]:
        kind, _, number = lane.partition(" ")
        return (0 if kind == "device" else 1, int(number) if number.isdigit() else 0, lane)

    return sorted(lanes, key=key)


def timeline_figure(spans: Sequence[Span], markers: Sequence[Marker] = (), title: str = "",
                    time_label: str = "seconds since the first event shown") -> Figure:
    """A Gantt chart: one row per lane, one horizontal bar per span, coloured by category.

    Hovering a bar shows its phase, step and duration; markers are vertical lines (placement moves
    labelled at the top). Idle gaps of device lanes are filled in up to the last span's end.
    """
    until = max((s.end for s in spans), default=0.0)
    # a controller between its own spans is driving its devices, not idle: only device lanes get idle bars
    everything = list(spans) + idle_gaps([s for s in spans if s.lane.startswith("device")], until)
    lanes = lane_order({s.lane for s in everything})
    data = []
    for category, (colour, label) in CATEGORIES.items():
        chosen = [s for s in everything if s.category == category]
        if chosen:
            data.append({
                "type": "bar", "orientation": "h", "name": label, "y": [s.lane for s in chosen],
                "x": [s.end - s.start for s in chosen], "base": [s.start for s in chosen],
                "marker": {"color": colour, "line": {"width": 0}},
                "customdata": [[s.what, s.step, s.end - s.start] for s in chosen],
                "hovertemplate": "%{y}<br>%{customdata[0]} (step %{customdata[1]})<br>"
                                 "%{base:.3f} s + %{customdata[2]:.3f} s<extra></extra>"})
    shapes = [{"type": "line", "xref": "x", "yref": "paper", "x0": m.time, "x1": m.time, "y0": 0, "y1": 1,
               "line": {"color": "black", "width": 1.5} if m.major else {"color": "#999999", "width": 0.6, "dash": "dot"}}
              for m in markers]
    annotations = [{"x": m.time, "y": 1.0, "xref": "x", "yref": "paper", "yanchor": "bottom", "text": m.label,
                    "showarrow": False, "font": {"size": 10}} for m in markers if m.major]
    layout = {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"}, "barmode": "overlay", "bargap": 0.25,
        "height": max(320, 110 + 30 * len(lanes)), "margin": {"l": 100, "r": 20, "t": 60, "b": 50},
        "plot_bgcolor": "white", "hovermode": "closest", "legend": {"font": {"size": 11}, "traceorder": "normal"},
        "shapes": shapes, "annotations": annotations,
        "yaxis": {"categoryorder": "array", "categoryarray": list(reversed(lanes)), "showgrid": False},
        "xaxis": {"title": {"text": time_label}, "range": [0, until * 1.01 if until > 0 else 1], "showgrid": True,
                  "gridcolor": "#EEEEEE", "zeroline": False}}
    return {"data": data, "layout": layout}
