"""Multi-turn (agentic) workloads in the simulator: engines whose trajectories wait for tools between turns,
turn-synchronous and asynchronous, against single-turn generation and hand-computed waits (simulated seconds:
deterministic model outputs)."""

from __future__ import annotations

import numpy as np
import pytest
from small_scenario import make_scenario

from gcore_rl.costmodel.agent import WaveTurns, run_agent_engines
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.decode import run_engines
from gcore_rl.costmodel.hardware import HARDWARE
from gcore_rl.costmodel.models import MODELS
from gcore_rl.errors import ConfigError
from gcore_rl.sim.simulator import simulate, workload_steps

H100 = HARDWARE["H100"]
MODEL = MODELS["Qwen2.5-7B"]
C = CostConstants()
MODES = pytest.mark.parametrize("synchronous", [True, False], ids=["turn-synchronous", "asynchronous"])


def turns(turn_tokens, answers=None, latency=None) -> WaveTurns:
    """Rows of trajectories: turn_tokens [S, T]; answers and latencies [S, T - 1] (zeros when not given)."""
    turn_tokens = np.asarray(turn_tokens, dtype=np.int64)
    gaps = (turn_tokens.shape[0], turn_tokens.shape[1] - 1)
    return WaveTurns(turn_tokens, np.zeros(gaps, np.int64) if answers is None else np.asarray(answers, np.int64),
                     np.zeros(gaps) if latency is None else np.asarray(latency, np.float64))


def agent_run(engine, context, trajectories, engines, synchronous, slots=64, prefill=None):
    prefill = np.zeros(engines) if prefill is None else prefill
    return run_agent_engines(np.asarray(engine), np.asarray(context), trajectories, engines, prefill, MODEL, H100, C,
                             1, slots, synchronous)


@MODES
@pytest.mark.parametrize("slots", [4, 64])
def test_one_turn_trajectories_cost_what_single_turn_generation_costs(synchronous, slots):
    rng = np.random.default_rng(3)
    n, engines = 40, 3
    engine = np.sort(rng.integers(0, engines, n))
    context, output = rng.integers(10, 400, n), rng.integers(1, 300, n)
    prefill = np.bincount(engine, weights=context, minlength=engines).astype(float)
    single = run_engines(engine, context, output, engines, prefill, MODEL, H100, C, 1, slots)
    agent = agent_run(engine, context, turns(output[:, None]), engines, synchronous, slots, prefill)
    np.testing.assert_allclose(agent.finish_seconds, single.finish_seconds, rtol=1e-9)
    np.testing.assert_allclose(agent.engine_seconds, single.engine_seconds, rtol=1e-9)
    np.testing.assert_allclose(agent.wall_seconds, single.engine_seconds, rtol=1e-9)
    np.testing.assert_array_equal(agent.token_steps, single.token_steps)
    np.testing.assert_allclose(agent.kv_token_steps, single.kv_token_steps, rtol=1e-12)
    np.testing.assert_array_equal(agent.compute_bound_steps, single.compute_bound_steps)


@MODES
def test_turns_answered_at_once_with_nothing_inserted_cost_one_turn_of_their_sum(synchronous):
    agent = agent_run([0], [300], turns([[50, 70, 30]]), 1, synchronous)
    single = run_engines(np.array([0]), np.array([300]), np.array([150]), 1, np.zeros(1), MODEL, H100, C, 1, 64)
    assert agent.finish_seconds[0] == pytest.approx(single.finish_seconds[0], rel=1e-12)
    assert agent.idle_seconds[0] == 0.0


def test_a_turn_synchronous_engine_waits_for_the_slowest_answer_of_each_turn():
    latency = [[1.0, 4.0], [3.0, 0.5], [2.0, 0.0]]  # the third trajectory ends after two turns
    trajectories = turns([[40, 30, 20], [60, 10, 50], [20, 80, 0]], answers=[[10, 5], [20, 7], [15, 0]],
                         latency=latency)
    run = agent_run([0, 0, 0], [100, 100, 100], trajectories, 1, synchronous=True)
    assert run.idle_seconds[0] == pytest.approx(3.0 + 4.0)  # turn 1's slowest answer, then turn 2's
    assert run.wall_seconds[0] == pytest.approx(run.engine_seconds[0] + 7.0)
    assert run.finish_seconds.max() == pytest.approx(run.wall_seconds[0])
    assert run.prefill_tokens[0] == 10 + 20 + 15 + 5 + 7  # every answer, once, and no prompt (none given)


def test_an_asynchronous_engine_idles_only_while_every_trajectory_waits():
    waits = turns([[10, 10]], latency=[[5.0]])
    alone = agent_run([0], [100], waits, 1, synchronous=False)
    assert alone.idle_seconds[0] == pytest.approx(5.0)
    # beside a trajectory that decodes for longer than the wait, the engine never idles
    busy = turns([[10, 10], [4000, 0]], latency=[[5.0], [0.0]])
    shared = agent_run([0, 0], [100, 100], busy, 1, synchronous=False)
    assert shared.finish_seconds[1] > 5.0
    assert shared.idle_seconds[0] == 0.0
    # the waiting trajectory's slot served a queued one meanwhile: with one slot, the second starts in the wait
    queued = agent_run([0, 0], [100, 100], turns([[10, 10], [20, 0]], latency=[[5.0], [0.0]]), 1,
                       synchronous=False, slots=1)
    assert queued.finish_seconds[1] < 5.0 < queued.finish_seconds[0]


def trace_waves(*overrides):
    scenario = make_scenario("models.judge=null", "workload.dynamic_sampling.enabled=false", *overrides)
    return workload_steps(scenario, "colocate")[0].waves[0]


AGENT = ("workload.agent.turns=4", "workload.agent.turns_min=2", "workload.agent.tool_seconds.median_s=2",
         "workload.agent.tool_seconds.sigma=1.5", "workload.agent.tool_seconds.max_s=30")


def test_a_multi_turn_workload_draws_turns_answers_and_latencies_of_their_own():
    wave, plain = trace_waves(*AGENT), trace_waves()
    t = wave.turns
    assert plain.turns is None
    assert t.turn_tokens.shape == (*wave.response_tokens.shape, 4)
    assert t.tool_seconds.shape == t.observation_tokens.shape == (*wave.response_tokens.shape, 3)
    assert {int(v) for v in np.unique(t.turns)} <= {2, 3, 4} and len(np.unique(t.turns)) > 1
    np.testing.assert_array_equal(wave.response_tokens, t.turn_tokens.sum(-1) + t.observation_tokens.sum(-1))
    # nothing is inserted or awaited after a trajectory's last turn; latencies stay within the timeout
    after_last = np.arange(3)[None, None, None, :] >= (t.turns - 1)[..., None]
    assert not t.observation_tokens[after_last].any() and not t.tool_seconds[after_last].any()
    assert t.tool_seconds.max() <= 30.0
    # the text draws are the single-turn workload's (the turns come from a generator of their own)
    np.testing.assert_array_equal(wave.prompt_tokens, plain.prompt_tokens)
    np.testing.assert_array_equal(wave.judge_output_tokens, plain.judge_output_tokens)


def colocate(*overrides):
    scenario = make_scenario("models.judge=null", "workload.dynamic_sampling.enabled=false", "steps=4", *AGENT,
                             *overrides)
    return simulate(scenario, "colocate")


def test_asynchronous_turns_hide_long_tailed_tool_waits_that_a_turn_synchronous_loop_pays():
    sync = colocate("workload.agent.synchronous_turns=true")
    free = colocate("workload.agent.synchronous_turns=false")
    assert free.mean_step_seconds < sync.mean_step_seconds
    assert free.utilisation()["idle"] < sync.utilisation()["idle"]
    waited = [sum(s.features["generate/idle_seconds"] for s in r.steps) for r in (sync, free)]
    assert waited[0] > waited[1] > 0
    # with answers that arrive at once, the turn barrier costs far less
    instant = [colocate(f"workload.agent.synchronous_turns={m}", "workload.agent.tool_seconds.median_s=0")
               for m in ("true", "false")]
    assert sync.mean_step_seconds - free.mean_step_seconds > instant[0].mean_step_seconds - instant[1].mean_step_seconds


def stream(partial: str, *overrides: str):
    scenario = make_scenario("models.judge=null", "workload.dynamic_sampling.enabled=false", "steps=6",
                             "placement.train_devices=2", "placement.max_staleness=1",
                             f"placement.partial_rollout={partial}", *AGENT, *overrides)
    return scenario, simulate(scenario, "streaming")


@pytest.mark.parametrize("partial", ["true", "false"])
def test_streaming_trains_every_multi_turn_sample_with_bounded_staleness(partial):
    scenario, result = stream(partial)
    per_step = scenario.workload.prompts_per_step * scenario.workload.group_size
    assert [s.features["stream/batch_samples"] for s in result.steps] == [per_step] * 6
    if partial == "false":  # a drain waits for trajectories that wait for answers too
        assert max(s.features["stream/staleness_max"] for s in result.steps) <= 1
    _, instant = stream(partial, "workload.agent.tool_seconds.median_s=0")
    assert instant.mean_step_seconds < result.mean_step_seconds


def test_agent_settings_that_cannot_hold_are_config_errors():
    with pytest.raises(ConfigError, match="turns_min"):
        make_scenario("workload.agent.turns=2", "workload.agent.turns_min=3")
    with pytest.raises(ConfigError, match="diffusion"):
        make_scenario("workload.kind=diffusion", "workload.agent.turns=2")
