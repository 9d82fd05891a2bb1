"""The run's replay forecast (`placement.forecast.model=replay`): a controller's counted work, replayed
through the simulator's phase model at every split of its slice, is the simulator's own prediction,
and it sends devices to the side with more divisible work."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import yaml

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.controller.forecast import RolloutForecaster
from gcore_rl.controller.program import wave_work
from gcore_rl.costmodel.replay import (
    fit_engine,
    fit_time_scales,
    replay_busy,
    replay_rollout,
    scaled_job,
    step_work,
)
from gcore_rl.errors import ConfigError
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.placement.rebalance import RebalanceConfig, RolloutLoad, rebalance
from gcore_rl.records import Completion, EngineRounds, Verdict, WaveWork
from gcore_rl.sim.workload import Wave


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("forecast")
    policy = write_tiny_model(root / "policy", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    judge = write_tiny_model(root / "judge", TinyModelConfig(hidden_size=64, num_layers=4, intermediate_size=128, seed=5))
    # per-token work dominates a decode step (no per-step overhead, a slow device), so tokens divide over devices;
    # prefill is a hundred times cheaper per token than decoding, as on real engines
    costs = root / "costs.yaml"
    costs.write_text(yaml.safe_dump({"costs": {"step_overhead_s": 0.0, "decode_mfu": 1e-4, "prefill_mfu": 1e-2,
                                               "engine_wake_s": 0.0}}))
    return policy, judge, costs


def _cfg(folders, *extra: str) -> JobConfig:
    policy, judge, costs = folders
    return load_config(JobConfig, None, [f"model.path={policy}", "judge.enabled=true", f"judge.model_path={judge}",
                                         "sampling.n=2", "placement.forecast.model=replay",
                                         f"placement.forecast.costs={costs}", *extra])


def _wave(verdict_tokens: int) -> WaveWork:
    return WaveWork(prompt_tokens=(5, 7, 6, 5), response_tokens=(6, 4, 6, 5, 3, 6, 6, 2),
                    verdict_tokens=(verdict_tokens,) * 8, judge_prompt_tokens=(40,) * 8)


def test_the_forecast_is_the_simulators_replay_of_the_counted_work(folders):
    forecaster = RolloutForecaster.from_config(_cfg(folders), slice_devices=4)
    waves = [_wave(96), _wave(64)]
    out = forecaster.forecast(waves)
    assert sorted(out) == ["forecast/1/max", "forecast/2/max", "forecast/3/max", "forecast/judge_time_scale",
                           "forecast/policy_time_scale"]
    assert out["forecast/policy_time_scale"] == out["forecast/judge_time_scale"] == 1.0  # nothing measured to fit
    # the judge template the forecaster infers: the judge prompt's 40 tokens less the prompt and completion it quotes
    quoted = [40 - (5, 7, 6, 5)[i // 2] - r for i, r in enumerate(_wave(0).response_tokens)]
    template = round(sum(quoted) / len(quoted))
    job = replace(forecaster.job, workload=replace(forecaster.job.workload, judge_template_tokens=template))
    direct = replay_rollout(job, step_work(waves, 2), [1, 2, 3])
    assert [out[f"forecast/{r}/max"] for r in (1, 2, 3)] == pytest.approx([direct[r] for r in (1, 2, 3)], rel=1e-12)
    vector = forecaster.vector(out)
    assert vector == tuple(out[f"forecast/{r}/max"] for r in (1, 2, 3))
    assert math.isinf(forecaster.vector({})[0])  # a split nobody replayed is never chosen


def _best(vector: tuple[float, ...]) -> int:
    return min(range(1, len(vector) + 1), key=lambda r: vector[r - 1])


def test_long_verdicts_send_devices_to_the_judge_and_long_responses_to_rollout(folders):
    policy, _, _ = folders
    forecaster = RolloutForecaster.from_config(_cfg(folders), slice_devices=4)
    heavy_judge = forecaster.vector(forecaster.forecast([_wave(400)]))
    assert _best(heavy_judge) == 1  # one rollout device, three judges
    # a judge of the policy's size that answers in one token, after 400-token completions
    same_size = RolloutForecaster.from_config(_cfg(folders, f"judge.model_path={policy}"), slice_devices=4)
    long_responses = WaveWork(prompt_tokens=(5, 7, 6, 5, 6, 5), response_tokens=(400,) * 12, verdict_tokens=(1,) * 12,
                              judge_prompt_tokens=(410,) * 12)
    heavy_policy = same_size.vector(same_size.forecast([long_responses]))
    assert _best(heavy_policy) == 3
    # the rebalancer, fed the forecast, moves toward it from the middle
    load = RolloutLoad(generate_s=1.0, score_s=1.0, forecast=heavy_judge, phase_s=heavy_judge[1], rollout_devices=2)
    assert rebalance([load], 2, 4, RebalanceConfig()).rollout_devices == 1


def test_the_counted_work_of_a_wave_is_prompt_major():
    completions = [Completion(prompt_index=p, sample_index=s, prompt_ids=[1] * (3 + p), token_ids=[2] * (1 + p + 2 * s),
                              logprobs=[0.0] * (1 + p + 2 * s), finish_reason="stop")
                   for p, s in [(1, 1), (0, 0), (1, 0), (0, 1)]]  # in finish order
    verdicts = [Verdict(score=1.0, reward=0.1, parsed=True, text="1", prompt_tokens=30 + i, tokens=10 + i) for i in range(4)]
    work = wave_work([[1] * 3, [1] * 4], completions, [verdicts])
    assert work.prompt_tokens == (3, 4)
    assert work.response_tokens == (1, 3, 2, 4)  # (0,0) (0,1) (1,0) (1,1)
    assert work.verdict_tokens == (11, 13, 12, 10) and work.judge_prompt_tokens == (31, 33, 32, 30)
    sim = step_work([work], group_size=2).waves[0]
    assert isinstance(sim, Wave) and sim.response_tokens.tolist() == [[[1, 3], [2, 4]]]


def test_counters_model_builds_no_forecaster_and_a_bad_costs_file_is_named(folders, tmp_path):
    assert RolloutForecaster.from_config(_cfg(folders, "placement.forecast.model=counters"), 4) is None
    bad = tmp_path / "costs.yaml"
    bad.write_text("hardware: {preset: H100}\n")
    with pytest.raises(ConfigError) as info:
        _cfg(folders, f"placement.forecast.costs={bad}")
    assert info.value.key == "placement.forecast.costs" and "costs:" in info.value.message


def test_rebalance_split_follows_the_replayed_forecast_over_busy_time(folders):
    # busy time says the judge keeps up (stay at 2 + 1); the replay of 400-token verdicts says give it a device
    from test_rebalance_split import ONE_CONTROLLER, PhaseSeconds, _dynamic_slice

    from gcore_rl.controller.rebalancing import rebalance_split

    cfg, ctx = _dynamic_slice(judge_s=0.25)
    forecaster = RolloutForecaster.from_config(_cfg(folders), slice_devices=3)
    loads: list[RolloutLoad] = []
    metrics = rebalance_split(cfg, ctx, loads, ONE_CONTROLLER, PhaseSeconds(0.3), [_wave(400)], forecaster)
    assert len(loads[0].forecast) == 2 and loads[0].forecast[0] < loads[0].forecast[1]
    assert metrics["placement/forecast/1/max"] == loads[0].forecast[0]
    assert (metrics["placement/rollout_devices"], metrics["placement/next_rollout_devices"]) == (2.0, 1.0)
    # the prediction is corrected by measured / forecast at the split that ran (0.3 s against the forecast at 2)
    assert metrics["placement/predicted_rollout_s"] == pytest.approx(0.3)


def _measured(job, work, rollout_devices: int, policy_scale: float, judge_scale: float) -> RolloutLoad:
    """The load a run would measure if its engines were `policy_scale` / `judge_scale` times the constants' cost."""
    generate, score = replay_busy(scaled_job(job, policy_scale, judge_scale), work, rollout_devices)
    return RolloutLoad(generate_s=generate, score_s=score, generate_busy_s=generate, score_busy_s=score,
                       rollout_devices=rollout_devices)


def test_the_fitted_time_scales_are_the_machines_whatever_split_measured_them(folders):
    forecaster = RolloutForecaster.from_config(_cfg(folders), slice_devices=4)
    work = step_work([_wave(96), _wave(64)], 2)
    job = replace(forecaster.job, workload=replace(forecaster.job.workload, judge_template_tokens=25))
    for split in (1, 2, 3):  # busy time moves with the split; the scales fitted from it do not
        load = _measured(job, work, split, 3.0, 0.5)
        policy, judge = fit_time_scales(job, work, split, load.generate_busy_s, load.score_busy_s)
        assert (policy, judge) == pytest.approx((3.0, 0.5), rel=1e-3)
    assert fit_time_scales(job, work, 2, 0.0, 0.0) == (1.0, 1.0)  # nothing measured: the constants as they are


def test_a_judge_measured_slower_than_the_constants_say_gets_more_devices(folders):
    policy_path, _, _ = folders
    # a judge of the policy's size answering in one token: by the constants the policy's long responses
    # are the work, and three of four devices should generate
    long_responses = WaveWork(prompt_tokens=(5, 7, 6, 5, 6, 5), response_tokens=(400,) * 12, verdict_tokens=(1,) * 12,
                              judge_prompt_tokens=(410,) * 12)
    cfg = _cfg(folders, f"judge.model_path={policy_path}", "placement.forecast.calibrate_window=3")
    plain = RolloutForecaster.from_config(cfg, slice_devices=4)
    assert _best(plain.vector(plain.forecast([long_responses]))) == 3  # nothing measured yet: the constants
    # measured at 2 + 2: the judge's engines are 300x slower than the constants (a CPU judge without batching)
    forecaster = RolloutForecaster.from_config(cfg, slice_devices=4)
    work = step_work([long_responses], 2)
    job = replace(forecaster.job, workload=replace(forecaster.job.workload, judge_template_tokens=0))
    out = forecaster.forecast([long_responses], _measured(job, work, 2, 1.0, 300.0))
    assert out["forecast/judge_time_scale"] == pytest.approx(300.0, rel=1e-2)
    assert out["forecast/policy_time_scale"] == pytest.approx(1.0, rel=1e-2)
    assert _best(forecaster.vector(out)) == 1
    # the scales are the median of the window: one odd step does not swing them
    forecaster.forecast([long_responses], _measured(job, work, 2, 1.0, 1.0))
    forecaster.forecast([long_responses], _measured(job, work, 2, 1.0, 300.0))
    assert forecaster.time_scales()[1] == pytest.approx(300.0, rel=1e-2)


def _rounds(step_s: float, token_s: float, prefill_token_s: float, batches: list[int], prefills: int = 2,
            prefill_tokens: int = 300) -> EngineRounds:
    """What an engine with these costs reports: its rounds on a known line, busy time with its prefills."""
    seconds = [step_s + token_s * b for b in batches]
    rounds = EngineRounds.of_call(batches, seconds, decode_steps=len(batches) + 3, tokens=sum(batches) + 7,
                                  prefills=prefills, prefill_tokens=prefill_tokens)
    decode = step_s * (rounds.decode_steps + prefills) + token_s * rounds.tokens
    return replace(rounds, busy_s=decode + prefill_token_s * prefill_tokens)


def test_the_engine_fit_recovers_the_costs_behind_the_rounds():
    # rounds on the line 4 ms + 0.5 ms per sequence, prefill 0.02 ms per token position, over two devices' sums
    fit = fit_engine(_rounds(0.004, 5e-4, 2e-5, [8, 7, 5, 2]) + _rounds(0.004, 5e-4, 2e-5, [6, 6, 3, 1, 1]))
    assert (fit.step_s, fit.token_s, fit.prefill_token_s) == pytest.approx((0.004, 5e-4, 2e-5), rel=1e-9)
    assert fit_engine(_rounds(0.004, 5e-4, 0.0, [4, 4, 4, 4])) is None  # one batch size: no line through it
    assert fit_engine(EngineRounds()) is None
    # a line that would go below zero keeps both terms non-negative
    falling = fit_engine(_rounds(0.01, -1e-3, 0.0, [1, 2, 3, 4]))
    assert falling.token_s == 0.0 and falling.step_s == pytest.approx(0.01 - 2.5e-3)


def test_a_judge_whose_step_is_fixed_cost_gains_nothing_from_a_second_device(folders):
    # the same counted work; only how the judge's decode step divides between its fixed and per-sequence cost
    # differs. All per-sequence: a second judge device halves its work, and the judge gets the devices.
    # All fixed: another device saves the judge nothing, so rollout keeps them.
    cfg = _cfg(folders, "placement.forecast.engine_window=2")
    waves = [_wave(96), _wave(64)]
    policy = _rounds(0.002, 2e-4, 1e-5, [8, 6, 4, 2])
    best = {}
    for name, judge in (("per-sequence", _rounds(0.0, 2e-3, 1e-5, [8, 6, 4, 2])),
                        ("fixed", _rounds(1e-2, 0.0, 1e-5, [8, 6, 4, 2]))):
        forecaster = RolloutForecaster.from_config(cfg, slice_devices=4)
        out = forecaster.forecast(waves, rounds={"rollout": policy, "judge": judge})
        assert out["forecast/judge_token_s"] == pytest.approx(judge.batch_seconds / judge.batch_sq if name ==
                                                              "per-sequence" else 0.0, abs=1e-12)
        assert out["forecast/policy_step_s"] == pytest.approx(0.002, rel=1e-9)
        best[name] = _best(forecaster.vector(out))
    assert best["per-sequence"] < best["fixed"], best
    # without rounds (engine_window=0) the forecaster keeps the formulas and reports no fit
    plain = RolloutForecaster.from_config(_cfg(folders), slice_devices=4)
    assert not any("_step_s" in key for key in plain.forecast(waves, rounds={"judge": policy}))
