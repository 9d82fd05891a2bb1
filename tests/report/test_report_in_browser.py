"""A real run's report, opened in headless Chromium: every chart drawn, no console errors, text escaped.

The run is the CLI's own (`gcore-rl train`, three short steps, a report drawn after step 2 as well
as at the end), then `gcore-rl report` redraws it after a hostile completion was added to its
samples. The screenshot is left in the run directory (report.png) to look at.
"""

from __future__ import annotations

import json
import re

import chromium as module
import pytest
from chromium import chromium_or_skip, render, screenshot
from cli_helpers import NO_STOP, RECIPE, SHORT, gcore_rl, init_tiny

HOSTILE = "<script>document.title='pwned'</script><b id=\"injected\">bold</b>"
SECTIONS = ("Summary", "Learning curves", "Throughput and step time", "Per-device timeline", "Sample completions",
            "Config (config.yaml)", "Environment")


def test_the_report_of_a_real_run_renders_in_chromium(tmp_path):
    chromium = chromium_or_skip()
    tiny = init_tiny(tmp_path)
    run = tmp_path / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", "run.steps=3", "run.report_every=2", "run.save_final=false",
                    "data.eval_prompts=8", NO_STOP, *SHORT, f"run.output_dir={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"report: {run / 'report.html'}" in proc.stdout
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, 2, 3] and len(samples) == 3 * 4
    with (run / "samples.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "prompt": "1+1=", "completion": HOSTILE, "reward": 0.0}) + "\n")
    proc = gcore_rl("report", run, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    page = run / "report.html"
    assert str(page) in proc.stdout

    rendered = render(chromium, page)
    assert rendered.console == [], rendered.console
    dom = rendered.dom
    graphs = len(re.findall(r'class="plotly-graph-div', dom))
    assert graphs >= 8, "curves, throughput, step time, device time and the timeline"
    assert len(re.findall(r'class="plotly-graph-div js-plotly-plot"', dom)) == graphs, "a chart was not drawn"
    assert dom.count('class="main-svg"') >= 2 * graphs  # Plotly draws two layered SVGs per chart
    for section in SECTIONS:
        assert f"<h2>{section}</h2>" in dom
    for lane in ("device 0", "controller 0"):  # the timeline's lanes, as tick labels of its SVG
        assert re.search(rf'class="ytick".*?>{lane}</text>', dom), lane
    assert "<title>gcore-rl run report: run</title>" in dom, "the hostile completion's script ran"
    assert '<b id="injected">' not in dom and '&lt;b id="injected"&gt;bold&lt;/b&gt;' in dom

    shot = screenshot(chromium, page, run / "report.png")
    assert shot.stat().st_size > 50_000


def test_a_missing_browser_fails_under_ci_and_skips_elsewhere(monkeypatch):

    monkeypatch.setattr(module.shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y chromium"):
        module.chromium_or_skip()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        module.chromium_or_skip()
