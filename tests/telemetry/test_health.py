"""Health checks of a run's updates: each rule against hand-made metrics lines, the console's one warning per
rule, and the report listing and marking a KL spike."""

from __future__ import annotations

import json

import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.report.run_report import write_run_report
from gcore_rl.telemetry.health import Flag, HealthConfig, HealthWatch, run_flags, step_flags

HEALTHY = {"approx_kl": 0.02, "clip_fraction": 0.1, "entropy": 1.0, "grad_norm": 2.0, "reward/mean": 0.3}


def _lines(*changes: dict) -> list[dict]:
    return [{"step": i + 1, **HEALTHY, **change} for i, change in enumerate(changes)]


@pytest.mark.parametrize("change, flagged", [
    ({"approx_kl": 1.03}, Flag(4, "approx_kl", 1.03, 0.1, True)),
    ({"clip_fraction": 0.35}, Flag(4, "clip_fraction", 0.35, 0.3, True)),
    ({"entropy": 0.05}, Flag(4, "entropy", 0.05, 0.1, False)),  # a tenth of the first step's 1.0
    ({"grad_norm": 25.0}, Flag(4, "grad_norm", 25.0, 20.0, True)),  # 10 x the median 2.0 of the steps before
    ({"reward/mean": 0.2}, Flag(4, "reward/mean", 0.2, 0.25, False)),  # 0.05 below the first step's 0.3
    ({"eval/accuracy": 0.1}, Flag(4, "eval/accuracy", 0.1, 0.15, False)),  # 0.05 below 0.2 before training
])
def test_each_rule_flags_the_step_past_its_threshold_and_nothing_else(change, flagged):
    lines = _lines({}, {}, {}, change)
    flags = run_flags(lines, HealthConfig(), accuracy_before=0.2)
    assert len(flags) == 1
    assert flags[0].key == flagged.key and flags[0].step == 4 and flags[0].above == flagged.above
    assert flags[0].value == pytest.approx(flagged.value) and flags[0].threshold == pytest.approx(flagged.threshold)


def test_a_healthy_run_and_edges_are_not_flagged():
    lines = _lines({}, {}, {}, {"approx_kl": 0.1, "clip_fraction": 0.3, "reward/mean": 0.25, "grad_norm": 20.0})
    assert run_flags(lines, HealthConfig(), accuracy_before=None) == []
    assert step_flags([], {"step": 1, "grad_norm": 1e9}, HealthConfig()) == []  # no history: no spike to measure
    near_zero = [{"step": s + 1, "grad_norm": g} for s, g in enumerate([0.09, 0.1, 0.05, 1.45, 12.0])]
    assert [f.step for f in run_flags(near_zero, HealthConfig())] == [5]  # the median counts as 1: 10 > 1.45
    growing = [{"step": s + 1, "grad_norm": 0.5 * 1.25**s} for s in range(30)]  # 0.5 -> 320: learning, no spike
    assert run_flags(growing, HealthConfig()) == []


def test_the_console_warns_once_per_rule():
    watch = HealthWatch(HealthConfig())
    printed = [watch.warnings(watch.check(line))
               for line in _lines({"approx_kl": 1.0}, {"approx_kl": 0.5}, {"clip_fraction": 0.9})]
    assert [len(p) for p in printed] == [1, 0, 1]
    assert "step 1: approx_kl 1 > 0.1" in printed[0][0] and "run.health.max_approx_kl" in printed[0][0]


def test_a_reward_drop_inside_the_sampling_noise_is_not_flagged():
    """PPO's recipe with its actor frozen: 0.211 -> 0.125 over 256 samples each is within three standard errors
    of the difference (0.099); the demo's first update, 0.207 -> 0.058 over ~700 samples, is not."""
    frozen = [{"step": 1, "reward/mean": 0.211, "reward/std": 0.408, "reward/count": 256},
              {"step": 2, "reward/mean": 0.125, "reward/std": 0.331, "reward/count": 256}]
    assert run_flags(frozen, HealthConfig()) == []
    wrecked = [{"step": 1, "reward/mean": 0.207, "reward/std": 0.405, "reward/count": 728},
               {"step": 2, "reward/mean": 0.058, "reward/std": 0.234, "reward/count": 704}]
    [flag] = run_flags(wrecked, HealthConfig())
    assert flag.key == "reward/mean" and flag.threshold == pytest.approx(0.207 - 3 * (0.405**2 / 728 + 0.234**2 / 704) ** 0.5)


def test_a_resumed_watch_keeps_the_runs_start_and_what_it_warned_of():
    lines = _lines({"approx_kl": 1.0}, {}, {}, {"approx_kl": 0.5}, {"reward/mean": 0.2})
    watch = HealthWatch(HealthConfig(), history=lines[:3])
    assert watch.warnings(watch.check(lines[3])) == []  # approx_kl was warned of before the resume
    [warning] = watch.warnings(watch.check(lines[4]))
    assert "step 5: reward/mean 0.2 < 0.25" in warning  # measured against the run's first step, not the resumed one


def test_thresholds_must_be_numbers():
    with pytest.raises(ConfigError, match="max_approx_kl"):
        HealthConfig(max_approx_kl=-1).validate()


def test_the_report_lists_and_marks_a_kl_spike(tmp_path):
    lines = _lines({"approx_kl": 1.03}, {}, {})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    html = write_run_report(tmp_path).read_text()
    assert "Unhealthy steps (1)" in html and "step 1: approx_kl 1.03 &gt; 0.1" in html
    assert "approx_kl: unhealthy" in html and "approx_kl threshold" in html  # the cross and the dashed line
    (tmp_path / "config.yaml").write_text("run:\n  health:\n    max_approx_kl: 2.0\n")
    assert "Unhealthy steps" not in write_run_report(tmp_path).read_text()  # the run's own threshold
