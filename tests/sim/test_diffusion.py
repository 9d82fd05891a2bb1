"""The diffusion workload: its cost formulas against hand-computed values, how they scale, and the
strategies run on the shipped diffusion scenarios (pure functions of the scenario, no wall clock)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from small_scenario import make_scenario
from test_findings_doc import same_row

from gcore_rl.costmodel import cost, diffusion, phases
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.diffusion import DiffusionSettings
from gcore_rl.costmodel.hardware import HARDWARE
from gcore_rl.costmodel.models import MODELS
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.errors import ConfigError
from gcore_rl.sim import resolve_job
from gcore_rl.sim.report import markdown_table
from gcore_rl.sim.results import PHASES
from gcore_rl.sim.scenario import load_scenario
from gcore_rl.sim.simulator import run_scenario, simulate, workload_steps

REPO = Path(__file__).resolve().parents[2]
H100 = HARDWARE["H100"]
SD35 = MODELS["SD3.5-Medium"]
FLUX = MODELS["FLUX.1-dev"]
C = CostConstants()
NO_OVERHEAD = dataclasses.replace(C, step_overhead_s=0.0)
SD = DiffusionSettings()  # Flow-GRPO's SD3.5-M settings: 512 px, 10 steps, CFG, 9 trained steps
SCENARIOS = ("diffusion_sd35_64", "diffusion_flux_judge_64")


def settings(**changes) -> DiffusionSettings:
    return dataclasses.replace(SD, **changes)


# --------------------------------------------------------------------------- FLOPs by hand


def test_tokens_and_one_forward_by_hand():
    assert SD.image_tokens == (512 // 8 // 2) ** 2 == 1024
    assert SD.sequence_tokens == 1024 + 333
    S = 1357
    assert float(diffusion.forward_flops(SD35, S)) == pytest.approx(2 * 2.5e9 * S + 4 * 24 * 1536 * S * S, rel=1e-12)
    assert diffusion.image_tokens(720, 8, 2) == 45 ** 2  # FLUX at DanceGRPO's 720 px
    assert SD.image_bytes == 3 * 512 ** 2
    assert SD.trajectory_bytes == 2 * 16 * 64 ** 2 * 11


def test_resolution_doubled_gives_four_times_the_tokens_and_a_quadratic_attention_term():
    low, high = settings(resolution=512), settings(resolution=1024)
    assert high.image_tokens == 4 * low.image_tokens
    ratio = high.sequence_tokens / low.sequence_tokens
    assert float(diffusion.attention_flops(SD35, high.sequence_tokens)
                 / diffusion.attention_flops(SD35, low.sequence_tokens)) == pytest.approx(ratio ** 2, rel=1e-12)
    # the linear term grows with the tokens, the attention term with their square: the forward in between
    forward = float(diffusion.forward_flops(SD35, high.sequence_tokens) / diffusion.forward_flops(SD35, low.sequence_tokens))
    assert ratio < forward < ratio ** 2
    for image in (low, high):
        assert diffusion.image_tokens(image.resolution, 8, 2) == image.image_tokens


def test_doubling_denoising_steps_doubles_the_rollout_compute():
    assert float(diffusion.denoise_flops(settings(denoising_steps=20), SD35, 7)) == pytest.approx(
        2 * float(diffusion.denoise_flops(settings(denoising_steps=10), SD35, 7)), rel=1e-12)
    # seconds: the denoising part doubles, the VAE decode (once per image) does not change
    for steps in (10, 20):
        s = settings(denoising_steps=steps)
        seconds = float(diffusion.batch_seconds(9, s, SD35, H100, NO_OVERHEAD))
        vae = float(diffusion.vae_decode_seconds(9, s, H100, NO_OVERHEAD))
        assert seconds - vae == pytest.approx(float(diffusion.denoise_flops(s, SD35, 9)) / (0.5 * 989e12), rel=1e-12)


def test_cfg_doubles_the_rollout_forwards():
    on, off = settings(cfg=True), settings(cfg=False)
    assert float(diffusion.denoise_flops(on, SD35, 9)) == pytest.approx(2 * float(diffusion.denoise_flops(off, SD35, 9)))
    engine = np.zeros(9, dtype=np.int64)
    run_on = diffusion.denoise_engines(engine, 1, on, SD35, H100, NO_OVERHEAD)
    run_off = diffusion.denoise_engines(engine, 1, off, SD35, H100, NO_OVERHEAD)
    assert run_on.token_steps[0] == 2 * run_off.token_steps[0] == 2 * 9 * 10  # sequence-forwards
    assert run_on.steps[0] == run_off.steps[0] == 10  # the two branches share each batched forward
    vae = float(diffusion.vae_decode_seconds(9, on, H100, NO_OVERHEAD))
    assert run_on.decode_seconds[0] - vae == pytest.approx(2 * (run_off.decode_seconds[0] - vae), rel=1e-12)


def test_engines_denoise_in_batches_and_images_finish_with_their_batch():
    s = settings(batch_images=9)
    engine = np.array([0] * 20 + [1] * 3)
    run = diffusion.denoise_engines(engine, 3, s, SD35, H100, C)
    full, last = (float(diffusion.batch_seconds(n, s, SD35, H100, C)) for n in (9, 2))
    assert run.decode_seconds[0] == pytest.approx(2 * full + last)
    assert run.finish_seconds[:9] == pytest.approx([full] * 9)
    assert run.finish_seconds[18:20] == pytest.approx([2 * full + last] * 2)
    assert run.finish_seconds[20:] == pytest.approx([float(diffusion.batch_seconds(3, s, SD35, H100, C))] * 3)
    assert run.decode_seconds[2] == 0 and list(run.steps) == [30, 10, 0]
    # one batched forward of 18 sequences (9 images x CFG) is compute-bound on an H100
    compute = 18 * float(diffusion.forward_flops(SD35, s.sequence_tokens)) / (989e12 * 0.5)
    assert compute > SD35.weight_bytes / (0.75 * 3.35e12)
    assert float(diffusion.forward_seconds(18, s, SD35, H100, C)) == pytest.approx(compute + 0.003)


# --------------------------------------------------------------------------- the update


def test_training_and_reference_follow_their_flop_formulas():
    F = float(diffusion.forward_flops(SD35, SD.sequence_tokens))
    forwards = 100 * 9 * 2  # images x train_steps x CFG branches
    assert float(diffusion.train_seconds(100, SD, SD35, H100, C, devices=8)) == pytest.approx(
        3 * forwards * F / (0.4 * 989e12 * 8), rel=1e-12)
    assert float(diffusion.train_seconds(100, SD, SD35, H100, C, devices=8, recompute=True)) == pytest.approx(
        4 * forwards * F / (0.4 * 989e12 * 8), rel=1e-12)
    assert float(diffusion.reference_seconds(100, SD, SD35, H100, C, devices=8)) == pytest.approx(
        forwards * F / (0.45 * 989e12 * 8), rel=1e-12)
    assert float(diffusion.train_seconds(100, settings(train_cfg=False), SD35, H100, C, devices=8)) == pytest.approx(
        float(diffusion.train_seconds(100, SD, SD35, H100, C, devices=8)) / 2)


def job_for(name: str, *overrides: str):
    scenario = load_scenario(REPO / "scenarios" / f"{name}.yaml", ["steps=1", *overrides])
    return resolve_job(scenario), workload_steps(scenario)[0]


@pytest.mark.parametrize("name", SCENARIOS)
def test_train_steps_scale_the_update(name):
    job, work = job_for(name)
    base = phases.update_seconds(job, work, 8, passes=2)
    job2, work2 = job_for(name, "workload.diffusion.train_steps=4")
    job1, work1 = job_for(name, "workload.diffusion.train_steps=2")
    for (prepare, train), k in ((phases.update_seconds(job1, work1, 8, passes=2), 2),
                                (phases.update_seconds(job2, work2, 8, passes=2), 4)):
        assert train == pytest.approx(base[1] * k / 9, rel=1e-12)  # overheads are 0 by default
        assert prepare == pytest.approx(base[0] * k / 9, rel=1e-12)
    # the old log-probs come from the sampler: only the reference pass remains, and none without it
    assert phases.update_seconds(job, work, 8, passes=1)[0] == 0.0
    images = work.trained_groups * job.workload.group_size
    assert base[0] == pytest.approx(float(diffusion.reference_seconds(
        images, job.workload.diffusion, job.policy, job.hardware, job.costs, 8)), rel=1e-12)


# --------------------------------------------------------------------------- schema


@pytest.mark.parametrize(("overrides", "key"), [
    (["workload.kind=diffusion", "workload.diffusion.resolution=500"], "workload.diffusion.resolution"),
    (["workload.kind=diffusion", "workload.diffusion.train_steps=11"], "workload.diffusion.train_steps"),
    (["workload.kind=diffusion", "workload.diffusion.reward=vlm"], "workload.diffusion.reward"),
    (["workload.kind=diffusion", "models.judge=null", "strategies=[streaming]"], "strategies"),
    (["workload.kind=images"], "workload.kind"),
])
def test_bad_diffusion_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        make_scenario(*overrides)
    assert info.value.key == key


def test_reward_requests_scorer_and_judge():
    scenario = make_scenario("workload.kind=diffusion", "workload.judge_template_tokens=77", "steps=1")
    job = resolve_job(scenario)
    wave = workload_steps(scenario)[0].waves[0]
    assert (wave.response_tokens == 1024).all() and (wave.prompt_tokens == 333).all()
    context, output = phases.judge_requests(job, wave)
    assert (context == 257 + 77).all() and (output == 1).all()
    judge = make_scenario("workload.kind=diffusion", "workload.diffusion.reward=judge", "steps=1")
    job = resolve_job(judge)
    wave = workload_steps(judge)[0].waves[0]
    assert (phases.judge_requests(job, wave)[1] == wave.judge_output_tokens.ravel()).all()


# --------------------------------------------------------------------------- strategies


@pytest.fixture(scope="module")
def shipped():
    """Every strategy of both shipped diffusion scenarios, as `gcore-rl simulate ... --steps 3` runs them."""
    return {name: run_scenario(load_scenario(REPO / "scenarios" / f"{name}.yaml", ["steps=3"])) for name in SCENARIOS}


@pytest.mark.parametrize("name", SCENARIOS)
def test_strategies_run_the_diffusion_scenarios(shipped, name):
    results = shipped[name]
    assert [r.strategy for r in results] == ["colocate", "partial", "dynamic", "disaggregated", "interleave"]
    for r in results:
        assert len(r.steps) == 3
        for record in r.steps:
            assert math.isfinite(record.seconds) and record.seconds > 0
            assert record.phases["rollout/generate"] > 0 and record.phases["update/train"] > 0
            assert record.trained_samples > 0
            if r.strategy != "disaggregated":  # it overlaps the rollout with the previous update
                assert record.seconds == pytest.approx(sum(record.phases.get(k, 0.0) for k in PHASES), rel=1e-9)


@pytest.mark.parametrize("name", SCENARIOS)
def test_colocate_rollout_is_the_denoising_of_a_gpus_share_of_images(shipped, name):
    colocate = shipped[name][0]
    job, work = job_for(name)
    d = job.workload.diffusion
    images = work.trained_groups * job.workload.group_size // job.slice_devices  # per device, one wave
    batches = [d.batch_images] * (images // d.batch_images) + ([images % d.batch_images] if images % d.batch_images else [])
    expected = sum(float(diffusion.batch_seconds(b, d, job.policy, job.hardware, job.costs)) for b in batches)
    assert colocate.steps[0].phases["rollout/generate"] == pytest.approx(expected, rel=1e-12)
    assert colocate.steps[0].features["generate/token_steps"] == (
        work.trained_groups * job.workload.group_size * job.controllers * d.denoising_steps * d.sampling_branches)


def test_images_stream_to_the_reward_model_under_partial():
    scenario = load_scenario(REPO / "scenarios" / "diffusion_sd35_64.yaml", ["steps=1"])
    result = simulate(scenario, "partial")
    events = result.timeline.events()
    generate_end = max(e.end for e in events if e.what == "rollout/generate" and e.device < 8)
    judged = [e for e in events if e.what == "rollout/judge" and e.device < 8]
    assert min(e.start for e in judged) < generate_end  # scoring began while images were still denoising
    assert len(judged) > 4  # more batches than the 4 reward devices of slice 0: images arrived in several lots


def test_diffusion_leaves_the_text_workload_alone():
    # the small text scenario's run times before the diffusion workload was added (same code path for text),
    # moved since only by pricing the update at its slowest trainer rank (`phases.trainer_split`: the step's
    # rows split as the runtime splits them, cost imbalance 1.002-1.05 here), which added 1-3 ms per step
    golden = {"colocate": 68.35625932376843, "partial": 39.79043685912316, "dynamic": 39.79043685912316,
              "disaggregated": 17.36706006179873, "interleave": 68.36811065101193}
    scenario = make_scenario()
    assert scenario.workload.kind == "text"
    for strategy, seconds in golden.items():
        assert simulate(scenario, strategy).total_seconds == pytest.approx(seconds, rel=1e-12)
    streaming = make_scenario("models.judge=null", "strategies=[streaming]")
    assert simulate(streaming, "streaming").total_seconds == pytest.approx(9.593363792874085, rel=1e-12)


@pytest.mark.parametrize("name", SCENARIOS)
def test_docs_table_is_what_simulate_prints(shipped, name):
    documented = (REPO / "docs" / "simulator.md").read_text(encoding="utf-8").splitlines()
    rows = markdown_table(shipped[name]).splitlines()[2:]
    section = documented[next(i for i, line in enumerate(documented) if f"scenarios/{name}.yaml --steps 3" in line):]
    table = [line for line in section if line.startswith("| ")][1:len(rows) + 1]
    # within one unit of the last printed digit, as the findings tables (numpy's exp differs by CPU)
    assert len(table) == len(rows) and all(same_row(row, doc) for row, doc in zip(rows, table, strict=True)), (
        "docs/simulator.md's diffusion table is out of date:\n" + "\n".join(rows))


def test_one_image_is_the_fixed_part_of_a_diffusion_engine():
    job, work = job_for("diffusion_sd35_64")
    where = phases.DeviceRange(0, 4, 1)
    g = phases.generate(job, Timeline(job.gpus), 0, work.waves[0], np.zeros(job.controllers), where)
    one = float(diffusion.batch_seconds(1, job.workload.diffusion, job.policy, job.hardware, job.costs))
    assert g.fixed_seconds == pytest.approx(np.full((job.controllers, 4), one))
    assert (g.finish <= g.end[:, None] + 1e-12).all()
    assert cost.step_fixed_seconds(job.policy, job.costs) == pytest.approx(0.003)
