"""Every placement strategy on Ray: one controller × 2 logical devices, the judge in the loop, 2 steps
(`dynamic`: 2 controllers × 3 devices, against `partial` with the same slow judge, and with a real judge that
does more work than the policy: the default suite's run of two controllers side by side on Ray).

One Ray instance serves the module (the runtime leaves a Ray it did not start running).
"""

from __future__ import annotations

import json
import time

import pytest

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.controller.handles import RayHandle
from gcore_rl.controller.slice import SliceClient
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model, write_tiny_reward_model
from gcore_rl.placement.plan import WorkerSpec, plan
from gcore_rl.records import Completion, RewardInput, Verdict
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.runtime.driver import run_job

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_instance():
    ray.init(num_cpus=2, resources={"device": 6}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    small = TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64)
    return (write_tiny_model(root / "base", small),
            write_tiny_model(root / "judge", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, seed=5)),
            write_tiny_reward_model(root / "rm", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, seed=6)))


def _run(tmp_path, models, strategy, *extra, rm_weight: float = 0.0, devices: int = 2, steps: int = 2,
         judge_model=None, controllers: int = 1):
    """Run `strategy` on `controllers` × `devices` devices for `steps` steps, 4 prompts per controller and step
    (`judge_model`: another judge than the module's); returns the metric lines, the roles each device's timeline
    shows, and the timelines."""
    base, judge, rm = models
    judge = judge_model or judge
    with_rm = ["reward_model.enabled=true", f"reward_model.model_path={rm}", f"reward_model.weight={rm_weight}"]
    cfg = load_config(JobConfig, None, [
        f"model.path={base}", f"run.output_dir={tmp_path / strategy}", f"run.steps={steps}", f"run.prompts_per_step={4 * controllers}",
        "sampling.n=2", "sampling.max_new_tokens=6", "data.eval_prompts=4", "run.progress=false",
        "runtime.kind=ray", f"runtime.controllers={controllers}", f"runtime.devices_per_controller={devices}", "runtime.threads_per_process=1",
        f"placement.strategy={strategy}", "judge.enabled=true", f"judge.model_path={judge}", "judge.weight=2.0",
        "judge.unparsed_score=0.25", "reward.rules.0.weight=0.0", *(with_rm if rm_weight else []), *extra,
    ])
    run_job(cfg)
    out = tmp_path / strategy
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timelines = {d: [json.loads(x) for x in (out / "timeline" / f"device-{d}.jsonl").read_text().splitlines()]
                 for d in range(controllers * devices)}
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    for line in lines:
        # reward = 0 × rule + 2 × judge score (+ the weighted reward-model score): the models really are the reward
        rm_part = rm_weight * line["reward_model/mean_score"] if rm_weight else 0.0
        assert line["reward/mean"] == pytest.approx(2.0 * line["judge/mean_score"] + rm_part)
        assert "judge/unparsed" in line and line["util/busy_fraction"] > 0
    assert (out / "final" / "model.safetensors").is_file()
    return lines, {d: {e["role"] for e in events} for d, events in timelines.items()}, timelines


def test_colocate_every_role_on_every_device_taking_turns(ray_instance, tmp_path, models):
    lines, roles, _ = _run(tmp_path, models, "colocate")
    assert all(r == {"rollout", "judge", "actor", "swap"} for r in roles.values())
    assert all(line["rollout/staleness_max"] == 0 and line["memory/engine_released_mib"] > 0 for line in lines)
    assert all(line["rollout/logprob_gap_max"] < 1e-4 for line in lines)


def test_partial_splits_rollout_and_reward_devices_and_trains_on_all(ray_instance, tmp_path, models):
    lines, roles, _ = _run(tmp_path, models, "partial", rm_weight=0.5)
    assert roles[0] == {"rollout", "actor", "swap"}
    assert roles[1] == {"judge", "reward_model", "actor", "swap"}  # judge and scalar RM share the reward devices
    assert all(0.0 < line["reward_model/mean_score"] < 1.0 for line in lines)  # sigmoid of the head's logit
    assert all(line["rollout/staleness_max"] == 0 for line in lines)


def test_disaggregated_overlaps_next_rollout_with_training(ray_instance, tmp_path, models):
    # from step 2 on, the controller starts the step's update, then rolls out the next step on the generation
    # device (step 1 rolls out its own batch first). Both spans get injected lengths (the update 1 s, the judge
    # 0.1 s per sample: 0.4 s or more per rollout), so they meet unless starting one takes the other's whole
    # length; the tiny model's own update and generation take milliseconds, which a loaded machine could reorder
    lines, roles, timelines = _run(tmp_path, models, "disaggregated", "train.added_seconds_per_update=1.0",
                                   "judge.added_seconds_per_sample=0.1", steps=3)
    assert roles[0] == {"actor"}  # training devices never generate
    assert roles[1] == {"rollout", "judge", "swap"}  # one generation device: rollout and judge take turns
    # step 1 trains on fresh samples; later steps on samples drawn while the step before trained (one update stale)
    assert [line["rollout/staleness_max"] for line in lines] == [0.0, 1.0, 1.0]
    # engine/trainer parity is measured on fresh rows; stale rows divide by the engine's (behaviour) log-probs
    assert all(line["rollout/logprob_gap_max"] < 1e-4 for line in lines)
    for trainer, generator in ((0, 1),):
        train = [e for e in timelines[trainer] if e["what"] == "update/train" and e["step"] == 2]
        # step 2 has no rollout of its own: what its generation device does in it is step 3's rollout
        rollout = [e for e in timelines[generator] if e["what"] in ("rollout/generate", "rollout/judge") and e["step"] == 2]
        assert train and {e["what"] for e in rollout} == {"rollout/generate", "rollout/judge"}
        start, end = min(e["start"] for e in rollout), max(e["end"] for e in rollout)
        assert any(start < t["end"] and t["start"] < end for t in train), (start, end, train)


def test_interleave_scores_and_computes_reference_logprobs_at_the_same_time(ray_instance, tmp_path, models):
    # every device generates; then the judge scores on one half of each slice while the reference computes log-probs
    # on the other. The judge sleeps an injected 0.1 s per sample (8 samples per slice and step: 0.8 s); the scoring
    # goes out first and the reference right after it, so the reference starts while the judge is still at work
    # unless a call waits 0.8 s to start (read from the recorded timelines). Its own ~10 ms pass may end before the
    # judge's wake does, so the test asks when it started, not that the two spans intersect.
    lines, roles, timelines = _run(tmp_path, models, "interleave", "algo.kl_coef=0.05",
                                   "judge.added_seconds_per_sample=0.1", "data.eval_prompts=0")
    assert roles[0] == {"rollout", "judge", "actor", "swap"}
    assert roles[1] == {"rollout", "reference", "actor", "swap"}
    for first in (0,):
        for step in (1, 2):
            judge = [(e["start"], e["end"]) for e in timelines[first] if e["role"] == "judge" and e["step"] == step]
            reference = [(e["start"], e["end"]) for e in timelines[first + 1]
                         if e["role"] == "reference" and e["step"] == step]
            assert judge and reference
            assert any(b0 < a1 for _, a1 in judge for b0, _ in reference), (first, step, judge, reference)
    # the reference of the rollout phase is the policy's start: before the first update the KL to it is float noise
    assert 0.0 <= lines[0]["kl"] < 1e-5


@pytest.mark.slow
def test_dynamic_moves_devices_to_a_slow_judge_and_judges_on_two(ray_instance, tmp_path, models):
    # 3 devices per slice, starting as partial's 2 rollout + 1 judge; the judge sleeps an injected 0.05 s per
    # sample (12 samples per slice and step: 0.6 s), generation takes a few milliseconds. Only deterministic
    # signals are asserted (counted splits and roles, the injected sleep as a lower bound, overlap read from
    # the timelines), never one measured duration against another, which a loaded machine can reorder.
    per_sample_s, samples_per_slice = 0.05, 12
    slow = ["placement.rollout_devices=2", f"judge.added_seconds_per_sample={per_sample_s}", "data.eval_prompts=0",
            "run.prompts_per_step=12"]
    static, _, static_timelines = _run(tmp_path, models, "partial", *slow, devices=3, steps=4, controllers=2)
    lines, _, timelines = _run(tmp_path, models, "dynamic", *slow, devices=3, steps=4, controllers=2)
    # every controller computed the same split from the all-reduced load: 2 -> 1 rollout device after step 1
    assert [line["placement/rollout_devices"] for line in lines] == [2.0, 1.0, 1.0, 1.0]
    # the scoring work the rebalancer saw includes at least the injected sleep, however it was split
    injected = per_sample_s * samples_per_slice
    assert all(line["placement/score_device_s"] >= injected * (1 - 1e-6) for line in lines)
    for first in (0, 3):  # slice 0 = devices 0-2, slice 1 = devices 3-5
        moved = {e["step"]: set() for e in timelines[first + 1]}
        for e in timelines[first + 1]:
            moved[e["step"]].add(e["role"])
        assert "rollout" in moved[1] and "judge" not in moved[1]
        assert all("judge" in moved[s] and "rollout" not in moved[s] for s in (2, 3, 4))
        for step in (2, 3, 4):
            # two judges work at the same time: a judge span of the moved device overlaps one of the old judge's
            spans = [[(e["start"], e["end"]) for e in timelines[d] if e["role"] == "judge" and e["step"] == step]
                     for d in (first + 1, first + 2)]
            assert spans[0] and spans[1]
            assert any(a0 < b1 and b0 < a1 for a0, a1 in spans[0] for b0, b1 in spans[1]), (first, step, spans)
        # under partial one device per slice judges, in every step
        judges = {d for d in range(first, first + 3) for e in static_timelines[d] if e["role"] == "judge"}
        assert judges == {first + 2}
    assert all(line["rollout/logprob_gap_max"] < 1e-4 for line in lines)  # the engine that generates got the weights
    # the run's report marks the move on its per-device timeline (escaped text of the marker's label)
    report = (tmp_path / "dynamic" / "report.html").read_text(encoding="utf-8")
    assert any(label in report for label in (r"step 1: rollout devices 2 \u2192 1", "step 1: rollout devices 2 → 1"))


def test_dynamic_gives_a_device_to_a_judge_that_reasons_longer_on_a_larger_model(ray_instance, tmp_path, models):
    # No injected sleep: the judge is a real model, 4 layers twice as wide as the 2-layer policy, that writes up to
    # 96 tokens per verdict (greedy; a random model seldom stops early) where the policy writes at most 6 per
    # completion; 12 samples per step. Starting from 2 rollout devices + 1 judge, the split moves toward the judge.
    # Asserted: the splits the controller chose and counted work, never one measured duration against another.
    # One controller (three actors on two cores); the slow test below runs two side by side.
    judge = write_tiny_model(tmp_path / "deep_judge", TinyModelConfig(hidden_size=64, num_layers=4, intermediate_size=128,
                                                                       seed=5))
    verdict_tokens, completion_tokens, samples_per_slice = 96, 6, 12
    lines, _, timelines = _run(tmp_path, models, "dynamic", "placement.rollout_devices=2", "data.eval_prompts=0",
                               "run.prompts_per_step=6", f"judge.max_new_tokens={verdict_tokens}", devices=3,
                               judge_model=judge)
    seen = [{k.removeprefix("placement/"): round(v, 4) for k, v in line.items() if k.startswith("placement/")}
            for line in lines]
    # 2 -> 1 rollout device after step 1, and the slice stays there
    assert [(line["rollout_devices"], line["next_rollout_devices"]) for line in seen] == [(2.0, 1.0), (1.0, 1.0)], seen
    for line in seen:
        assert line["moved_devices"] == abs(line["next_rollout_devices"] - line["rollout_devices"])
        assert line["move_swap_s"] == (line["swap_s"] if line["moved_devices"] else 0.0)
        assert line["predicted_rollout_s"] > 0 and line["next_predicted_rollout_s"] > 0
        # the work behind the load, counted: the judge read and wrote far more tokens than the policy generated
        assert line["judged_samples"] == samples_per_slice
        assert line["policy_tokens"] <= samples_per_slice * completion_tokens
        assert line["judge_tokens"] >= samples_per_slice * verdict_tokens / 2 >= 8 * line["policy_tokens"], seen
        assert line["judge_prefill_tokens"] > line["policy_prefill_tokens"]
    assert seen[0]["next_predicted_rollout_s"] < seen[0]["predicted_rollout_s"]  # a move is made for a predicted gain
    step_two = [{e["role"] for e in timelines[d] if e["step"] == 2} for d in (1, 2)]  # the moved device judges too
    assert all("judge" in roles and "rollout" not in roles for roles in step_two), step_two


@pytest.mark.slow
def test_dynamic_replaying_counted_work_gives_the_judge_a_device_with_no_timing_in_the_forecast(ray_instance, tmp_path,
                                                                                                models):
    # The same real judge, forecast by replaying each step's counted tokens (placement.forecast.model=replay) with
    # constants under which a decode step costs its tokens (no per-step overhead, a slow device; prefill a hundred
    # times cheaper per token): the forecast is a function of the token counts alone, and it puts the judge first.
    judge = write_tiny_model(tmp_path / "deep_judge", TinyModelConfig(hidden_size=64, num_layers=4, intermediate_size=128,
                                                                       seed=5))
    costs = tmp_path / "costs.yaml"
    costs.write_text("costs: {step_overhead_s: 0.0, decode_mfu: 1.0e-4, prefill_mfu: 1.0e-2, engine_wake_s: 0.0}\n")
    lines, _, _ = _run(tmp_path, models, "dynamic", "placement.rollout_devices=2", "data.eval_prompts=0",
                       "run.prompts_per_step=12", "judge.max_new_tokens=96", "placement.forecast.model=replay",
                       f"placement.forecast.costs={costs}", devices=3, judge_model=judge, controllers=2)
    first = lines[0]
    assert first["placement/forecast/1/max"] < first["placement/forecast/2/max"], first
    # the first decision rests on the forecast alone (one measured split: its ratio scales every split alike);
    # later ones may return when the measurement at the new split says it ran slower, as on 2 shared cores it may
    assert (first["placement/rollout_devices"], first["placement/next_rollout_devices"]) == (2.0, 1.0)
    # the forecasts moved only with the counted work: the same tokens in both steps give the same forecast
    assert lines[1]["placement/judge_tokens"] == first["placement/judge_tokens"]
    assert lines[1]["placement/forecast/1/max"] == pytest.approx(first["placement/forecast/1/max"], rel=0.05)


def _fake_workers():
    """Fake rollout and judge workers, defined here so Ray ships them by value to its workers."""

    class _SlowRollout:
        """Streams three chunks of one completion each; before the last it waits until the judge has been
        called (for at most `wait_s`), noting when each chunk was yielded. A client that held finished
        completions back until generation ended would make it wait out `wait_s` and then see the judge
        called after the last chunk, so the outcome does not depend on how fast the machine is."""

        def __init__(self, judge, wait_s: float = 60.0):
            self.judge, self.wait_s = judge, wait_s
            self.times = []

        def generate_stream(self, prompt_ids, sampling, seed):
            for index in range(3):
                if index == 2:
                    deadline = time.monotonic() + self.wait_s
                    while not ray.get(self.judge.judge_calls.remote()) and time.monotonic() < deadline:
                        time.sleep(0.05)
                self.times.append(time.time())
                yield [Completion(prompt_index=0, sample_index=index, prompt_ids=[1], token_ids=[2], logprobs=[0.0],
                                  finish_reason="stop")]

        def chunk_times(self):
            return self.times

    class _TimedJudge:
        def __init__(self):
            self.calls = []

        def score_samples(self, samples):
            self.calls.append((time.time(), len(samples)))
            return {"judge": [Verdict(score=10.0, reward=1.0, parsed=True, text="10") for _ in samples]}

        def judge_calls(self):
            return self.calls

    return _SlowRollout, _TimedJudge


def test_finished_completions_reach_the_judge_while_generation_goes_on(ray_instance):
    slow_rollout, timed_judge = _fake_workers()
    judge = ray.remote(timed_judge).options(num_cpus=0).remote()
    rollout = ray.remote(slow_rollout).options(num_cpus=0).remote(judge)
    specs = [WorkerSpec(0, 0, ("rollout",), None, 0, False, False), WorkerSpec(1, 0, ("judge",), None, 0, False, False)]
    ray.get([rollout.chunk_times.remote(), judge.judge_calls.remote()])  # both actors are up
    client = SliceClient([RayHandle(rollout), RayHandle(judge)], specs, plan("partial", 2, ["rollout", "judge"], rollout_devices=1))
    result = client.rollout_and_score([[1]], SamplingConfig(n=3), seed=0,
                                      on_finished=lambda chunk: [RewardInput("p", "c", {}) for _ in chunk])
    calls = ray.get(judge.judge_calls.remote())
    chunk_times = ray.get(rollout.chunk_times.remote())
    assert sorted(result.scores["judge"]) == [(0, 0), (0, 1), (0, 2)]
    assert [c.sample_index for c in result.completions] == [0, 1, 2]
    # the first completion was judged while the rollout device was still generating the last one
    assert calls[0][1] == 1 and calls[0][0] < chunk_times[-1]
