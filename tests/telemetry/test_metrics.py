import io
import json
import math
import re
import time

import pytest
import torch
from rich.console import Console

from gcore_rl.telemetry.metrics import MetricsWriter, PhaseTimer, read_metrics
from gcore_rl.telemetry.progress import TrainProgress, format_stats


def test_metrics_writer_lines_parse_and_nan_is_null(tmp_path):
    before = time.time()
    with MetricsWriter(tmp_path / "metrics.jsonl") as writer:
        writer.write(1, {"loss": 0.5, "n": 3, "bad": math.nan, "big": math.inf})
        writer.write(2, {"loss": 0.25})
    after = time.time()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])  # strict JSON: no NaN tokens
    assert first["step"] == 1 and first["loss"] == 0.5 and first["n"] == 3
    assert first["bad"] is None and first["big"] is None
    assert before <= first["time"] <= after  # wall-clock time of the write
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_metrics_writer_appends_and_accepts_directory(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write(1, {"x": 1.0})
    with MetricsWriter(tmp_path) as writer:
        assert writer.path == tmp_path / "metrics.jsonl"
        writer.write(2, {"x": 2.0})
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0]


def test_metrics_writer_rejects_reserved_names(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as writer, pytest.raises(ValueError):
        writer.write(1, {"step": 3})


def test_read_metrics_skips_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 1}]


def test_phase_timer_accumulates_nested_phases():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("step"):
            with timer.phase("generate"):
                time.sleep(0.01)
    t = timer.timings()
    assert set(t) == {"time/step", "time/generate"}
    assert t["time/generate"] >= 0.02
    assert t["time/step"] >= t["time/generate"]
    assert set(timer.timings(prefix="")) == {"step", "generate"}
    timer.reset()
    assert timer.timings() == {}


def test_phase_timer_counts_on_exception():
    timer = PhaseTimer()
    with pytest.raises(RuntimeError), timer.phase("boom"):
        raise RuntimeError
    assert "time/boom" in timer.timings()


def test_train_progress_plain_lines():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with TrainProgress(3, enabled=False, console=console) as progress:
        for step in range(1, 4):
            progress.update(step, {"reward/mean": 0.4123, "accuracy": 0.375, "loss": 1.0})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/3 reward=0.412 acc=0.38 ")


def test_train_progress_disabled_default_console_prints_plain_lines(capsys):
    # no console given: the default one writes to stdout; disabled means one plain line per step, no bar,
    # and a step without metrics or with a NaN reward still gets its line
    with TrainProgress(2, enabled=False) as progress:
        assert not progress.interactive
        progress.update(1, {})
        progress.update(2, {"reward/mean": math.nan})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"step 1/2 \d+\.\ds \(\d+\.\ds total\)", lines[0])
    assert lines[1].startswith("step 2/2 reward=nan ")


def test_train_progress_live_bar_runs():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with TrainProgress(2, console=console) as progress:
        assert progress.interactive
        progress.update(1, {"reward/mean": 0.5})
        progress.update(2, {"reward/mean": 0.75, "accuracy": 0.5})
    assert "step 2/2" in buf.getvalue()


def test_format_stats():
    assert format_stats({"reward/mean": 0.4123, "accuracy": 0.375}) == "reward=0.412 acc=0.38"
    assert format_stats({"loss": 1.0}) == ""


def test_each_phase_reports_its_own_peak_and_the_process_keeps_its_lifetime_peak():
    """`PhasePeaks` resets the high-water mark between phases (/proc/self/clear_refs): a phase that allocated
    200 MB reports it, the small phase after it does not, and `peak_rss_mib` still knows the large one."""
    import numpy as np

    from gcore_rl.telemetry.metrics import PhasePeaks, peak_rss_mib, reset_peak_rss

    if not reset_peak_rss():
        pytest.skip("this system cannot reset a process's VmHWM")
    peaks = PhasePeaks()
    block = np.ones(200_000_000 // 8)
    del block
    peaks.close("update/train")
    block = np.ones(20_000_000 // 8)
    del block
    peaks.close("rollout/generate")
    taken = peaks.take()
    large, small = taken["memory/rss_peak_mib/update_train_max"], taken["memory/rss_peak_mib/rollout_generate_max"]
    assert large - small > 150  # the 200 MB block is in the first phase's peak alone
    assert peak_rss_mib() >= large and peaks.take() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_each_phase_reports_its_own_cuda_peak():
    """On a CUDA device `PhasePeaks` also takes each phase's peak of allocated device memory, reset between
    phases, and keeps the device's lifetime peak in `memory/cuda_peak_allocated_mib_max`."""
    from gcore_rl.telemetry.metrics import PhasePeaks

    device = torch.device("cuda")
    peaks = PhasePeaks(device)
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    del block
    peaks.close("update/train")
    block = torch.empty(16 * 2**20, dtype=torch.uint8, device=device)
    del block
    peaks.close("rollout/generate")
    taken = peaks.take()
    large, small = taken["memory/cuda_peak_mib/update_train_max"], taken["memory/cuda_peak_mib/rollout_generate_max"]
    assert large - small >= 240 and small >= 16
    assert taken["memory/cuda_peak_allocated_mib_max"] >= large
