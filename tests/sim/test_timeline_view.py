"""The simulator's timeline drawn with the run report's timeline view (gcore_rl/report/timeline.py)."""

from __future__ import annotations

from gcore_rl.report.timeline import CATEGORIES, category_of
from gcore_rl.sim.report import timeline_html, timeline_spans
from gcore_rl.sim.simulator import run_scenario


def test_every_phase_of_either_timeline_has_a_colour(small):
    assert category_of("rollout", "rollout/generate") == "generate"
    assert category_of("rewards", "rollout/reward") == "score"
    assert category_of("actor", "update/prepare") == "prepare"
    assert category_of("swap", "swap/judge_wake") == "swap"
    results = run_scenario(small)
    for result in results:
        spans, _ = timeline_spans(result, steps=2)
        assert spans, result.label
        assert {s.category for s in spans} <= set(CATEGORIES) - {"idle"}, result.label


def test_the_simulated_timelines_form_one_page(small, tmp_path):
    results = run_scenario(small)
    page = timeline_html(results, tmp_path / "timeline.html", steps=2).read_text()
    assert page.count('class="plotly-graph-div') == len(results)
