"""Behaviour of the simulated placement strategies on a small scenario."""

from __future__ import annotations

import numpy as np
import pytest

from gcore_rl.costmodel import cost, phases
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.placement import rebalance as rebalancing
from gcore_rl.sim import resolve_job, strategies
from gcore_rl.sim.results import PHASES
from gcore_rl.sim.simulator import run_scenario, simulate, workload_steps


def phase_sum(record) -> float:
    return sum(record.phases.get(k, 0.0) for k in PHASES)


@pytest.mark.parametrize("strategy", ["colocate", "partial", "dynamic", "interleave"])
def test_time_shared_step_is_the_sum_of_its_phases(small, strategy):
    result = simulate(small, strategy)
    assert len(result.steps) == small.steps
    for record in result.steps:
        assert record.seconds == pytest.approx(phase_sum(record), rel=1e-9)
        assert record.phases["update/train"] > 0 and record.phases["rollout/generate"] > 0


def test_colocate_swaps_every_wave(small):
    result = simulate(small, "colocate")
    for record in result.steps:
        assert record.phases["swap"] > 0
        assert record.phases["rollout/judge"] > 0
    assert {ev.role for ev in result.timeline.events()} >= {"rollout", "judge", "actor", "swap", "sync"}


def test_partial_with_a_slow_judge_leaves_rollout_devices_idle(make):
    scenario = make("workload.judge_output_tokens.median=900", "workload.judge_output_tokens.max=1024",
                             "placement.rollout_devices=3")  # slices of 4: 3 rollout devices, 1 judge device
    result = simulate(scenario, "partial")
    timeline = result.timeline
    for record in result.steps:
        assert record.phases["rollout/judge"] > 0.5 * record.phases["rollout/generate"]  # the judge's tail
    rollout_busy = timeline.device_seconds("rollout")[[0, 1, 2]]
    rollout_phase = sum(r.rollout_seconds for r in result.steps)
    assert rollout_busy.max() < 0.7 * rollout_phase  # rollout devices wait for the judge


def test_dynamic_calls_the_shared_rebalancer(small, monkeypatch):
    calls = []

    def fake(history, rollout_devices, slice_devices, cfg, min_rollout=1, min_reward=1):
        calls.append((list(history), rollout_devices, slice_devices, cfg.unit, min_rollout, min_reward))
        return rebalancing.Decision(1, 0.0, 0.0, 1 - rollout_devices, "forced")

    monkeypatch.setattr(rebalancing, "rebalance", fake)
    result = simulate(small, "dynamic")
    assert len(calls) == small.steps
    history, rollout_devices, slice_devices, unit, _, _ = calls[0]
    assert (rollout_devices, slice_devices, unit) == (2, 4, 1)
    assert isinstance(history[0], rebalancing.RolloutLoad) and history[0].score_s > 0
    assert history[0].generate_fixed_s > 0 and history[0].score_fixed_s > 0
    assert len(calls[-1][0]) == small.steps  # one load per step so far
    assert [r.rollout_devices for r in result.steps] == [2, 1, 1]
    assert result.steps[0].decision == "forced"
    # device 1 turned from rollout to judge at step 1; a move costs it no more than any judge device (as in the runtime)
    wakes = {(e.step, e.device): e.end - e.start for e in result.timeline.events() if e.what == "swap/judge_wake"}
    assert wakes[(1, 1)] == pytest.approx(wakes[(1, 2)])
    # the sync of step 0 already loaded only the next split's rollout device (device 0 of each slice)
    synced = {e.device for e in result.timeline.events() if e.what == "swap/wake" and e.step == 0}
    assert synced == {0, 4}


def test_dynamic_feeds_the_rebalancer_fixed_parts_from_the_decode_model(make, monkeypatch):
    scenario = make("steps=2", "models.policy.preset=Qwen2.5-7B", "models.judge.preset=Qwen2.5-7B")
    job = resolve_job(scenario)
    loads = []
    real = rebalancing.rebalance

    def spy(history, *args, **kwargs):
        loads.append(history[-1])
        return real(history, *args, **kwargs)

    monkeypatch.setattr(rebalancing, "rebalance", spy)
    records = simulate(scenario, "dynamic").steps
    R, J = 2, 2  # devices per slice of 4
    assert len(loads) == len(records) == 2
    for load, record in zip(loads, records, strict=True):
        # each controller splits its slice's busy time (as RolloutLoad.from_devices); the load is their mean
        assert load.generate_fixed_s == pytest.approx(record.generate_fixed_seconds)
        assert load.score_fixed_s == pytest.approx(record.judge_fixed_seconds)
        assert load.generate_fixed_s > 0 and load.score_fixed_s > 0
        assert max(record.generate_device_seconds - R * load.generate_fixed_s, 0.0) <= load.generate_s + 1e-9
        assert load.generate_s < record.generate_device_seconds
        assert max(record.judge_device_seconds - J * load.score_fixed_s, 0.0) <= load.score_s + 1e-9
        assert 0 < load.score_s < record.judge_device_seconds
        assert load.swap_s == pytest.approx(phases.judge_wake_seconds(job) + phases.judge_offload_seconds(job))


@pytest.mark.parametrize("tp", [1, 2])
def test_fixed_parts_are_steps_times_the_batch_of_one_step(make, tp):
    scenario = make("models.policy.preset=Qwen2.5-7B", f"models.policy.tp={tp}", f"models.judge.tp={tp}", "steps=1")
    job = resolve_job(scenario)
    wave = workload_steps(scenario)[0].waves[0]
    where = phases.DeviceRange(0, 4, tp)
    g = phases.generate(job, Timeline(job.gpus), 0, wave, np.zeros(job.controllers), where)
    run = g.run
    kv_one = run.kv_token_steps / run.token_steps
    expected = run.steps * cost.decode_step_seconds(1, kv_one, job.policy, job.hardware, job.costs, tp)
    # seconds per device of each engine: every one of its tp devices spends them (busy counts tp times)
    assert g.fixed_seconds.ravel() == pytest.approx(expected)
    assert (g.fixed_seconds > 0).all() and (g.fixed_seconds.ravel() <= run.engine_seconds).all()
    assert g.device_seconds == pytest.approx(run.engine_seconds.reshape(job.controllers, -1).sum(axis=1) * tp)
    # what dynamic records per slice: the slowest engine's fixed seconds, as they are
    record = simulate(scenario, "dynamic").steps[0]
    assert record.generate_fixed_seconds <= record.generate_device_seconds / tp


def test_dynamic_moves_devices_to_a_slow_judge_and_beats_the_static_split(make):
    scenario = make("gpus=16", "controllers=1", "placement.rollout_devices=12", "models.policy.preset=Qwen2.5-7B",
                    "models.judge.preset=Qwen2.5-7B", "workload.judge_output_tokens.median=600",
                    "workload.judge_output_tokens.max=1024", "steps=4")
    partial, dynamic = run_scenario(scenario, ["partial", "dynamic"])
    splits = [r.rollout_devices for r in dynamic.steps]
    assert splits[0] == 12 and splits[-1] < 12
    assert all(b <= a for a, b in zip(splits, splits[1:], strict=False))  # only ever toward the judge
    assert dynamic.mean_step_seconds < 0.98 * partial.mean_step_seconds
    assert dynamic.steps[-1].rollout_seconds < partial.steps[-1].rollout_seconds


def test_dynamic_keeps_a_tail_bound_generation_where_busy_time_would_move(make):
    # long-tailed responses, few sequences per engine, a light judge: generation lasts as long as
    # the longest response on any split, so no split helps
    overrides = ["gpus=16", "workload.response_tokens.sigma=1.4", "workload.response_tokens.max=4096",
                 "workload.judge_output_tokens.median=64", "workload.judge_output_tokens.max=1024",
                 "workload.prompts_per_step=32", "steps=4"]
    scenario = make(*overrides, "placement.rollout_devices=4")
    job = resolve_job(scenario)
    partial, dynamic = run_scenario(scenario, ["partial", "dynamic"])
    assert [r.rollout_devices for r in dynamic.steps] == [4, 4, 4, 4]  # no device taken from generation
    assert dynamic.mean_step_seconds == pytest.approx(partial.mean_step_seconds)
    wider = run_scenario(make(*overrides, "placement.rollout_devices=7"), ["partial"])[0]
    assert wider.mean_step_seconds > 0.99 * partial.mean_step_seconds  # more rollout devices would not help
    # busy device-seconds alone (the rebalancer's inputs before fixed parts) would have moved devices
    swap = phases.judge_wake_seconds(job) + phases.judge_offload_seconds(job)
    busy_only = [rebalancing.RolloutLoad(generate_s=r.generate_device_seconds, score_s=r.judge_device_seconds,
                                         swap_s=swap) for r in partial.steps]
    moves = [rebalancing.rebalance(busy_only[: i + 1], 4, job.slice_devices, job.rebalance,
                                   min_rollout=job.policy_tp, min_reward=job.judge_tp).moved for i in range(4)]
    assert any(moves)


def test_dynamic_stays_put_when_balanced(make):
    scenario = make("steps=4", "rebalance.min_gain=0.3")
    partial, dynamic = run_scenario(scenario, ["partial", "dynamic"])
    assert [r.rollout_devices for r in dynamic.steps] == [2, 2, 2, 2]
    assert dynamic.mean_step_seconds == pytest.approx(partial.mean_step_seconds)


def test_disaggregated_overlaps_rollout_with_training(small):
    result = simulate(small, "disaggregated")
    later = result.steps[1:]
    assert all(r.seconds < phase_sum(r) for r in later)
    # trainer devices (0, 1) train while the generation devices (2, 3) roll out the next step
    events = result.timeline.events(devices=range(0, 4))
    train = [(e.start, e.end) for e in events if e.role == "actor" and e.what == "update/train"]
    rollout = [(e.start, e.end) for e in events if e.role == "rollout"]
    assert any(s1 < e2 and s2 < e1 for s1, e1 in train for s2, e2 in rollout)
    assert all(e.role != "swap" for e in events)  # nothing is offloaded


def test_controllers_divide_the_data_plane_time(make):
    base = ["workload.payload_bytes_per_prompt=1048576", "workload.dynamic_sampling.enabled=false", "steps=2",
            "gpus=8", "workload.prompts_per_step=32", "strategies=[colocate]"]
    one = simulate(make(*base, "controllers=1"), "colocate")
    four = simulate(make(*base, "controllers=4"), "colocate")
    for a, b in zip(one.steps, four.steps, strict=True):
        assert a.phases["rollout/data"] == pytest.approx(4 * b.phases["rollout/data"])
        assert a.phases["update/data"] == pytest.approx(4 * b.phases["update/data"])
    # 32 prompts + 128 completions for the judge, 1 MiB each, at 1.5 GB/s
    assert one.steps[0].phases["rollout/data"] == pytest.approx((32 + 128) * 2**20 / 1.5e9)


def test_interleave_runs_the_reference_beside_the_judge(small):
    colocate, interleave = run_scenario(small, ["colocate", "interleave"])
    roles = {e.role for e in interleave.timeline.events()}
    assert "reference" in roles
    for c, i in zip(colocate.steps, interleave.steps, strict=True):
        assert i.phases["update/prepare"] == pytest.approx(c.phases["update/prepare"] / 2)


def test_every_strategy_sees_the_same_work_and_runs_are_deterministic(small):
    first = run_scenario(small)
    again = run_scenario(small)
    assert [r.mean_step_seconds for r in first] == [r.mean_step_seconds for r in again]
    tokens = {tuple(s.generated_tokens for s in r.steps) for r in first}
    assert len(tokens) == 1


def test_utilisation_sums_to_one_and_features_are_reported(small):
    result = simulate(small, "partial")
    util = result.utilisation()
    assert sum(util.values()) == pytest.approx(1.0)
    assert 0 < util["idle"] < 1
    features = result.steps[0].features
    assert features["generate/decode_steps_max"] >= 1
    assert features["judge/batches"] >= 1
    assert result.throughput()["samples_per_s"] > 0
    assert np.isfinite(result.summary()["mean_step_s"])


def test_a_re_split_between_waves_pays_the_move_and_one_split_per_wave_equals_a_fixed_split(make):
    scenario = make("workload.valid_fraction.start=0.3", "workload.valid_fraction.end=0.3", "steps=2")
    job = resolve_job(scenario)
    work = next(w for w in workload_steps(scenario) if len(w.waves) >= 2)
    partial = strategies.Partial(job)
    fixed, _, _ = partial.rollout(work, 0.0, Timeline(job.gpus), 2)
    listed, _, _ = partial.rollout(work, 0.0, Timeline(job.gpus), [2] * len(work.waves))
    assert listed == pytest.approx(fixed)
    timeline = Timeline(job.gpus)
    moved, _, totals = partial.rollout(work, 0.0, timeline, [2, 1] + [1] * (len(work.waves) - 2))
    moves = [e for e in timeline.events() if e.what == "swap/wave_move"]
    assert moves and all(e.end - e.start == pytest.approx(strategies.wave_move_seconds(job)) for e in moves)
    assert totals.generate_fixed.shape == (job.controllers,)  # engines of two layouts, still one figure per slice
