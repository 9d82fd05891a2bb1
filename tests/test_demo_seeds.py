"""The demos learn on every seed and thread count: `make demo` (SFT to its target, then GRPO raises held-out
accuracy ≥ 0.25), PPO, `make demo-vision`, reasoning-gym, reversal, the agent demo and LoRA; and their RL steps
stay healthy (issue 51: `flags`).

Slow (about 1–10 minutes per run on 2 cores): `make test-slow`. The same function writes the seed tables of
docs/getting-started.md and BENCHMARKS.md (`benchmarks/demo_seeds.py`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from gcore_rl.telemetry.health import HealthConfig, run_flags

_SPEC = importlib.util.spec_from_file_location(
    "demo_seeds", Path(__file__).resolve().parents[1] / "benchmarks" / "demo_seeds.py")
demo_seeds = sys.modules.setdefault("demo_seeds", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(demo_seeds)  # registered first: its dataclass looks its module up in sys.modules

TRUST_REGION = ("approx_kl", "reward/mean", "eval/accuracy")
"""Issue 51's criterion for every shipped recipe: each step inside the trust region, and the sampled reward and
held-out accuracy never far below the warm start's (gradient-norm spikes, which the clip absorbs, are reported
but allowed)."""


def flags(work: Path, run, keys: tuple[str, ...] | None = TRUST_REGION) -> list[str]:
    """The run report's flags of the RL stage of `run` (laid out in `work` by `demo_seeds.run_demo`), with the
    default `run.health` thresholds; only those of `keys` (None: every flag)."""
    metrics = [json.loads(line) for line in (work / "grpo" / "metrics.jsonl").read_text().splitlines()]
    return [str(flag) for flag in run_flags(metrics, HealthConfig(), accuracy_before=run.eval_before)
            if keys is None or flag.key in keys]


@pytest.mark.slow
@pytest.mark.parametrize("seed, threads", [
    (0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (4, 1), (5, 1)])
def test_demo_raises_held_out_accuracy_by_a_quarter(seed, threads, tmp_path):
    run = demo_seeds.run_demo(seed, threads, tmp_path)
    assert run.sft_accuracy >= 0.25  # the warm start stopped on its criterion, not on its cap
    assert run.rise >= 0.25, demo_seeds.table([run])
    assert run.eval_after >= 0.65  # GRPO stopped on its target, not on its cap
    # issue 51: `make demo`'s own run (seed 0, one thread) flags no step at all; every run stays in the trust region
    assert flags(tmp_path, run, keys=None if (seed, threads) == (0, 1) else TRUST_REGION) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed, threads", [(0, 1), (1, 1), (2, 1), (0, 2)])
def test_ppo_with_a_critic_raises_held_out_accuracy_by_a_fifth(seed, threads, tmp_path):
    """recipes/ppo_addition.yaml from the same warm start: the issue's criterion, a rise of at least 0.2."""
    run = demo_seeds.run_demo(seed, threads, tmp_path, recipe=demo_seeds.REPO / "recipes" / "ppo_addition.yaml")
    assert run.sft_accuracy >= 0.25
    assert run.rise >= 0.2, demo_seeds.table([run])
    assert run.eval_after >= 0.65  # PPO stopped on its target, not on its cap
    assert flags(tmp_path, run) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed, threads", [(0, 1), (1, 1), (2, 1), (0, 2)])
def test_vision_demo_raises_held_out_counting_accuracy_by_a_fifth(seed, threads, tmp_path):
    """`make demo-vision`: a tiny Qwen2-VL counting shapes; the issue's criterion, a rise of at least 0.2."""
    run = demo_seeds.run_demo(seed, threads, tmp_path, demo=demo_seeds.DEMOS["vision"])
    assert run.sft_accuracy >= 0.45  # the warm start met its criterion at its last step
    assert run.rise >= 0.2, demo_seeds.table([run])
    assert run.eval_after >= 0.8  # GRPO stopped on its target, not on its cap
    assert flags(tmp_path, run) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed, threads", [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)])
def test_a_reasoning_gym_task_raises_held_out_accuracy(seed, threads, tmp_path):
    """recipes/sft_gym_arithmetic.yaml then recipes/grpo_gym_arithmetic.yaml: reasoning-gym's basic_arithmetic,
    scored by its own scorer (the tasks extra)."""
    pytest.importorskip("reasoning_gym")
    run = demo_seeds.run_demo(seed, threads, tmp_path, demo=demo_seeds.DEMOS["gym"])
    assert run.sft_accuracy >= 0.25
    # a warm start can stop SFT well above 0.25 (seed 2 at one thread: 0.430), and GRPO stops at its first
    # evaluation at or above 0.65: a rise of 0.2 is what every such run must make (+0.246 there)
    assert run.rise >= 0.2, demo_seeds.table([run])
    assert run.eval_after >= 0.65  # GRPO stopped on its target, not on its cap
    # every step inside the trust region (the recipe's train.max_kl) and nothing the warm start had is lost
    assert flags(tmp_path, run, keys=TRUST_REGION) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed, threads", [(0, 1), (1, 1), (2, 1), (0, 2)])
def test_reversal_keeps_its_warm_start(seed, threads, tmp_path):
    """recipes/grpo_reversal.yaml from recipes/sft_reversal.yaml's warm start, which already reverses nearly every
    held-out string: a near-deterministic policy whose first full-size Adam steps once left the trust region."""
    run = demo_seeds.run_demo(seed, threads, tmp_path, demo=demo_seeds.DEMOS["reversal"])
    assert run.eval_before >= 0.95 and run.eval_after >= 0.95, demo_seeds.table([run])
    assert flags(tmp_path, run) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed, threads", [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2), (2, 2)])
def test_the_agent_demo_learns_through_the_tool(seed, threads, tmp_path):
    """`make demo-agent`: from a warm start that calls `mul` on about a quarter of its samples with valid calls,
    GRPO lifts held-out accuracy (4-digit products, which the model cannot compute) by at least 0.3 and the
    call rate to at least 0.9."""
    run = demo_seeds.run_demo(seed, threads, tmp_path, demo=demo_seeds.DEMOS["agent"])
    assert run.calls_first <= 0.35 and run.call_errors_first <= 0.1  # the warm start: few calls, nearly all valid
    assert run.rise >= 0.3, demo_seeds.table([run])
    assert run.calls_last >= 0.9
    assert flags(tmp_path, run) == []  # its entropy falls tenfold as it settles on the tool: reported, allowed


@pytest.mark.slow
def test_without_the_tool_the_agent_demo_cannot_rise(tmp_path):
    """The control: the same demo with a `mul` that never answers (benchmarks/agent_control.py)."""
    run = demo_seeds.run_demo(0, 1, tmp_path, demo=demo_seeds.DEMOS["agent"], rl_overrides=tuple(demo_seeds.CONTROL))
    assert run.rise < 0.05, demo_seeds.table([run])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lora_raises_held_out_accuracy_by_a_quarter(seed, tmp_path):
    """The same warm start, GRPO on rank-16 LoRA adapters (docs/memory.md): the issue's criterion, a rise of 0.25."""
    run = demo_seeds.run_demo(seed, 1, tmp_path, rl_overrides=tuple(demo_seeds.LORA))
    assert run.rise >= 0.25, demo_seeds.table([run])
