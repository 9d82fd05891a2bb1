"""The run report without a browser: what is read from a run directory, what is drawn, what is escaped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcore_rl.algos.dynamic_sampling import Group, StepBatch
from gcore_rl.controller.program import GroupPayload
from gcore_rl.controller.samples import pick_samples
from gcore_rl.errors import RunDirError
from gcore_rl.records import Completion
from gcore_rl.report.figures import curve_figures, samples_per_second
from gcore_rl.report.run_report import draw_run_report, run_report_html, write_run_report
from gcore_rl.report.rundata import load_run, timeline_window
from gcore_rl.report.timeline import Span, idle_gaps

HOSTILE = "<script>document.title='pwned'</script><b>bold</b>"


def _jsonl(path: Path, rows: list[dict], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)


def _run_dir(root: Path, tail: str = "") -> Path:
    """A two-step run of one device and one controller; under dynamic placement step 1 moves the split 1 → 2."""
    t0 = 1000.0
    _jsonl(root / "metrics.jsonl", [
        {"step": 1, "time": t0 + 1.0, "reward/mean": 0.25, "entropy": 2.0, "reward/count": 8, "time/step": 1.0,
         "placement/rollout_devices": 1.0, "placement/next_rollout_devices": 2.0},
        {"step": 2, "time": t0 + 2.0, "reward/mean": 0.5, "entropy": 1.9, "reward/count": 8, "time/step": 0.5,
         "placement/rollout_devices": 2.0, "placement/next_rollout_devices": 2.0},
    ], tail)
    _jsonl(root / "timeline" / "device-0.jsonl", [
        {"step": 1, "device": 0, "role": "rollout", "what": "rollout/generate", "start": t0, "end": t0 + 0.4},
        {"step": 1, "device": 0, "role": "actor", "what": "update/train", "start": t0 + 0.5, "end": t0 + 0.9},
        {"step": 2, "device": 0, "role": "swap", "what": "swap/wake", "start": t0 + 1.1, "end": t0 + 1.2},
    ], '{"step": 2, "device": 0, "ro')
    _jsonl(root / "timeline" / "controller-0.jsonl", [
        {"step": 1, "controller": 0, "role": "rewards", "what": "rollout/reward", "start": t0 + 0.4, "end": t0 + 0.45}])
    _jsonl(root / "samples.jsonl", [{"step": 2, "prompt": "1+1=", "completion": HOSTILE, "reward": 1.0}])
    return root


def test_a_run_directory_is_read_with_its_timelines_on_one_clock(tmp_path):
    run = load_run(_run_dir(tmp_path))
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert {s.lane for s in run.spans} == {"device 0", "controller 0"}
    assert min(s.start for s in run.spans) == 0.0
    assert run.step_ends == {1: 1.0, 2: 2.0}
    assert [n for n in run.notes if n.startswith("device-0.jsonl: its last line")], run.notes
    assert {s.category for s in run.spans} == {"generate", "train", "swap", "score"}


def test_a_cut_off_metrics_line_is_left_out_and_said(tmp_path):
    run = load_run(_run_dir(tmp_path, tail='{"step": 3, "rew'))
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert any(n.startswith("metrics.jsonl: its last line") for n in run.notes)
    assert "Missing data" in run_report_html(run)


def test_not_a_run_directory_names_the_path(tmp_path):
    with pytest.raises(RunDirError, match="holds no metrics.jsonl"):
        load_run(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="is not a directory"):
        load_run(tmp_path / "file")


def test_a_report_that_cannot_be_drawn_warns_and_never_fails_the_run(tmp_path, capsys):
    assert draw_run_report(tmp_path) is None  # no metrics.jsonl: the training run goes on, the warning says why
    assert "holds no metrics.jsonl" in capsys.readouterr().err and not (tmp_path / "report.html").exists()


def test_a_full_disk_is_named_for_the_report_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    """`gcore-rl report` on a full disk: a `DiskError` naming the report's path and the room; after a run, a
    warning with the same paragraph. No half-written file is left, and an earlier report stays as it was."""
    import errno

    from gcore_rl.disk import DiskError

    run_dir = _run_dir(tmp_path)
    earlier = write_run_report(run_dir).read_bytes()
    real_write = Path.write_text

    def full(path, *args, **kwargs):
        if path.name.endswith(".tmp"):
            real_write(path, "<html>half", encoding="utf-8")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskError, match=r"could not write the run report '.*report.html': the disk is full"):
        write_run_report(run_dir)
    assert draw_run_report(run_dir) is None
    warning = capsys.readouterr().err
    assert "the disk is full" in warning and f"gcore-rl report {run_dir}" in warning
    assert (run_dir / "report.html").read_bytes() == earlier
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_an_unreadable_environment_file_is_left_out_and_said(tmp_path):
    root = _run_dir(tmp_path)
    (root / "environment.json").write_bytes(b"\xff\xfe not utf-8")
    run = load_run(root)
    assert run.environment is None and any("environment.json" in n for n in run.notes)


def test_completions_are_escaped(tmp_path):
    html = run_report_html(load_run(_run_dir(tmp_path)))
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;&lt;b&gt;bold&lt;/b&gt;" in html
    assert HOSTILE not in html


def test_only_recorded_metrics_are_drawn():
    metrics = [{"step": 1, "reward/mean": 0.1, "entropy": None}, {"step": 2, "reward/mean": 0.2}]
    figures = curve_figures(metrics)
    assert [fig["layout"]["title"]["text"] for fig in figures] == ["Reward"]
    assert [trace["name"] for trace in figures[0]["data"]] == ["reward/mean"]
    assert samples_per_second([{"step": 1, "reward/count": 8, "time/step": 2.0}, {"step": 2}]) == [
        {"step": 1, "throughput/samples_per_s": 4.0}]


def test_idle_gaps_fill_each_lane_up_to_the_end():
    spans = [Span("device 0", "train", "update/train", 1, 1.0, 2.0), Span("device 0", "sync", "update/sync", 1, 1.5, 3.0)]
    gaps = idle_gaps(spans, until=4.0)
    assert [(g.start, g.end) for g in gaps] == [(0.0, 1.0), (3.0, 4.0)]


def test_placement_moves_and_step_ends_are_marked(tmp_path):
    run = load_run(_run_dir(tmp_path))
    spans, markers, _ = timeline_window(run, steps=8)
    assert len(spans) == len(run.spans)
    moves = [m for m in markers if m.major]
    assert [(m.time, m.label) for m in moves] == [(1.0, "step 1: rollout devices 1 → 2")]
    # step 2 ended after the last recorded span (its events were cut off): no marker past the axis
    assert sorted(m.time for m in markers if not m.major) == [1.0]


def test_samples_are_spread_over_the_groups_and_skip_padding():
    def completion(i: int) -> Completion:
        return Completion(prompt_index=0, prompt_ids=[1], token_ids=[i], logprobs=[0.0], finish_reason="stop", sample_index=i)

    groups = [Group(key=k, rewards=(float(k), float(k) + 0.5), payload=GroupPayload(row_id=k, completions=[completion(0), completion(1)]))
              for k in range(3)]
    batch = StepBatch(groups=groups, mask=[True, True, False], waves=1, generated_groups=3, valid_fraction_observed=1.0)
    assert [reward for _, reward in pick_samples(batch, 3)] == [0.0, 1.0, 0.5]
    assert pick_samples(batch, 0) == []


def test_the_report_replaces_the_file_whole(tmp_path):
    run_dir = _run_dir(tmp_path / "run")
    path = write_run_report(run_dir)
    assert path == run_dir / "report.html"
    assert path.read_text().count('class="plotly-graph-div') >= 3
    assert [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")] == []
