"""The vision-language workload (`workload.images`): its numbers against hand-computed values, the text
workload left alone, the single driver against K controllers, and the fit of the CPU constants (pure
functions of the scenario and of synthetic data; nothing here times anything)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from small_scenario import make_scenario
from test_findings_doc import same_row

from gcore_rl.costmodel import phases, vision
from gcore_rl.costmodel.hardware import HARDWARE
from gcore_rl.costmodel.models import MODELS
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.costmodel.vision import ImageSettings
from gcore_rl.errors import ConfigError
from gcore_rl.sim import resolve_job
from gcore_rl.sim.report import data_plane_markdown, data_plane_rows, markdown_table, summary_markdown
from gcore_rl.sim.scenario import load_scenario, variants
from gcore_rl.sim.simulator import run_scenario, simulate, workload_steps

REPO = Path(__file__).resolve().parents[2]
PEAK = HARDWARE["H100"].peak_flops
N = MODELS["Qwen2.5-0.5B"].params  # the small scenario's policy
# one 448 px image: resized to 448 (16 x 28), (448 / 14)^2 = 1024 patches, 1024 / 2^2 = 256 tokens,
# and Qwen2-VL's ViT (675 M parameters, 32 blocks of width 1280) over 1024 patches
PATCHES, TOKENS = 1024, 256
F_V = 2 * 675e6 * PATCHES + 4 * 32 * 1280 * PATCHES ** 2
ONE_IMAGE = ("workload.images.per_prompt=1", "workload.images.sides=[448]")


def image_scenario(*overrides: str):
    return make_scenario(*ONE_IMAGE, *overrides)


# --------------------------------------------------------------------------- the text workload is untouched


def test_no_images_leaves_the_text_workload_alone():
    # run times and data plane of the small scenario with a 3 MB payload per prompt, computed by the code
    # before the vision workload was added (the data plane then returned plain floats), moved since only by
    # pricing the update at its slowest trainer rank (`phases.trainer_split`, as in test_diffusion.py)
    golden = {"colocate": 68.91825932376844, "partial": 40.352436859123166, "dynamic": 40.352436859123166,
              "disaggregated": 17.801060061798726, "interleave": 68.93011065101194}
    # per_prompt 0 turns every other image setting off
    scenario = make_scenario("workload.payload_bytes_per_prompt=3000000", "workload.images.sides=[1024]",
                             "workload.images.cpu_workers=3", "workload.images.tokens_per_image=99")
    assert not scenario.workload.images.enabled
    for strategy, seconds in golden.items():
        result = simulate(scenario, strategy)
        # 1e-9: float64 sums of a few hundred terms, whatever order a numpy build adds them in, agree far closer
        assert result.total_seconds == pytest.approx(seconds, rel=1e-9)
        first = result.steps[0]
        assert (first.phases["rollout/data"], first.phases["update/data"]) == pytest.approx((0.1, 0.064), rel=1e-9)
        assert first.features["data/bytes_per_controller"] == 246e6
        assert not any(key.startswith("images/") for key in first.features)
    assert all(wave.images is None for work in workload_steps(scenario) for wave in work.waves)


def test_images_leave_the_text_draws_alone_and_add_their_tokens_to_the_prompts():
    text, images = workload_steps(make_scenario()), workload_steps(image_scenario())
    for plain, seen in zip(text, images, strict=True):
        for a, b in zip(plain.waves, seen.waves, strict=True):
            np.testing.assert_array_equal(a.response_tokens, b.response_tokens)  # the same draws
            np.testing.assert_array_equal(b.prompt_tokens - a.prompt_tokens, TOKENS)
            np.testing.assert_array_equal(b.images.patches, PATCHES)
        rows = plain.trained_groups * 4  # group_size 4
        np.testing.assert_array_equal(seen.trained_tokens - plain.trained_tokens, rows * TOKENS)
        np.testing.assert_allclose(seen.trained_images.flops, rows * F_V, rtol=1e-12)
        np.testing.assert_array_equal(seen.trained_images.patches, plain.trained_groups * PATCHES)  # shipped once per group


# --------------------------------------------------------------------------- one image, by hand


def test_resized_side_and_tokens_by_hand():
    s = ImageSettings()
    assert float(vision.image_tokens(448, s)) == 256 and float(vision.image_patches(448, s)) == 1024
    assert float(vision.resized_side(1024, 14, 2, 3136, 12845056)) == 1036  # round(1024 / 28) = 37
    assert float(vision.image_tokens(1024, s)) == 37 * 37
    assert float(vision.resized_side(20, 14, 2, 3136, 12845056)) == 56  # up to min_pixels = 56^2
    assert float(vision.resized_side(4000, 14, 2, 3136, 28 * 28 * 1280)) == 28 * 35  # floor(sqrt(1003520) / 28) = 35
    assert float(vision.image_tokens(4000, dataclasses.replace(s, tokens_per_image=300))) == 300
    assert float(vision.vision_flops(PATCHES, s)) == pytest.approx(F_V, rel=1e-12)
    assert float(vision.cpu_seconds(2, 0.5, s)) == pytest.approx(
        2 * (s.decode_seconds_per_image + s.preprocess_seconds_per_image)
        + 0.5 * (s.decode_seconds_per_megapixel + s.preprocess_seconds_per_megapixel), rel=1e-12)


def test_resized_side_is_the_image_processors():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sides = [*range(1, 4200, 7), 14, 28, 42, 70, 1001, 1002, 3584, 3585, 3598]
    for min_pixels, max_pixels in ((56 * 56, 12845056), (56 * 56, 28 * 28 * 1280), (512 * 512, 1024 * 1024)):
        ours = vision.resized_side(sides, 14, 2, min_pixels, max_pixels)
        theirs = [smart_resize(s, s, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)[0] for s in sides]
        np.testing.assert_array_equal(ours, theirs)


def test_image_tokens_raise_the_prefill_by_the_hand_computed_amount():
    text, images = resolve_job(make_scenario()), resolve_job(image_scenario())
    wave_text, wave_images = workload_steps(make_scenario())[0].waves[0], workload_steps(image_scenario())[0].waves[0]
    where = phases.DeviceRange(0, text.slice_devices)  # 4 engines of one device per slice
    runs = [phases.generate(job, Timeline(job.gpus), 0, wave, np.zeros(job.controllers), where).run
            for job, wave in ((text, wave_text), (images, wave_images))]
    prompts = np.bincount(phases._split_evenly(wave_text.prompts, where.engines), minlength=where.engines)
    prompts = np.tile(prompts, text.controllers)  # [K * E] prompts each engine prefills
    extra = prompts * (2 * N * TOKENS + F_V) / (0.5 * PEAK)  # prefill_mfu 0.5, tp 1
    np.testing.assert_allclose(runs[1].prefill_seconds - runs[0].prefill_seconds, extra, rtol=1e-9)
    np.testing.assert_array_equal(runs[1].decode_seconds >= runs[0].decode_seconds, True)  # a longer KV cache


@pytest.mark.parametrize("frozen", [False, True])
def test_image_tokens_raise_the_update_by_the_hand_computed_amount(frozen):
    # rows of one length, so that both splits over the trainer ranks are even (`phases.trainer_split`)
    even = ("workload.prompt_tokens.sigma=0", "workload.response_tokens.sigma=0")
    text = resolve_job(make_scenario(*even))
    images = resolve_job(image_scenario(f"workload.images.train_vision_tower={str(not frozen).lower()}", *even))
    plain, seen = workload_steps(make_scenario(*even))[0], workload_steps(image_scenario(*even))[0]
    D, passes = text.slice_devices, 2  # old log-probs and the reference
    rows = plain.trained_groups * 4
    assert phases.trainer_split(images, seen, D).cost_imbalance.max() == 1.0
    prepare_text, train_text = phases.update_seconds(text, plain, D, passes)
    prepare, train = phases.update_seconds(images, seen, D, passes)
    tokens = rows * TOKENS
    # log-prob passes: 2 N per added token and one vision forward per row, at logprob_mfu 0.45, over D devices
    assert prepare - prepare_text == pytest.approx(passes * (2 * N * tokens + rows * F_V) / (0.45 * PEAK * D), rel=1e-9)
    # training: 6 N per added token; the tower trained = 3 forwards per row, frozen = its forward only (train_mfu 0.4)
    tower = 1 if frozen else 3
    assert train - train_text == pytest.approx((6 * N * tokens + tower * rows * F_V) / (0.4 * PEAK * D), rel=1e-9)


def test_a_text_only_judge_reads_the_prompt_without_its_image_tokens():
    wave_text, wave_images = workload_steps(make_scenario())[0].waves[0], workload_steps(image_scenario())[0].waves[0]
    text_context, _ = phases.judge_requests(resolve_job(make_scenario()), wave_text)
    seen, _ = phases.judge_requests(resolve_job(image_scenario()), wave_images)  # a multimodal judge (the default)
    blind, _ = phases.judge_requests(resolve_job(image_scenario("workload.judge_reads_payload=false")), wave_images)
    np.testing.assert_array_equal(seen - text_context, TOKENS)
    np.testing.assert_array_equal(blind, text_context)


# --------------------------------------------------------------------------- the data plane


def test_a_controllers_data_plane_by_hand():
    scenario = image_scenario("workload.images.cpu_workers=2", "models.judge=null")
    job, wave = resolve_job(scenario), workload_steps(scenario)[0].waves[0]
    s = job.workload.images
    per_image = s.decode_seconds_per_image + s.preprocess_seconds_per_image + 0.448 ** 2 * (
        s.decode_seconds_per_megapixel + s.preprocess_seconds_per_megapixel)
    expected = wave.prompts * (per_image / 2 + PATCHES * 4704 / 1.5e9)  # 2 workers; pixels once to the engines
    np.testing.assert_allclose(phases.wave_data_seconds(job, wave), expected, rtol=1e-12)


@pytest.mark.parametrize("controllers", [2, 4, 8])
def test_a_single_driver_takes_k_times_a_controllers_data_plane(controllers):
    scenario = image_scenario(f"controllers={controllers}", "workload.images.per_prompt_max=3",
                              "workload.images.sides=[300,700]", "workload.payload_bytes_per_prompt=1000",
                              "strategies=[colocate]")
    driver = dataclasses.replace(scenario, workload=dataclasses.replace(scenario.workload, single_driver=True))
    own, one = resolve_job(scenario), resolve_job(driver)
    work = workload_steps(scenario)[0]
    equal = dataclasses.replace(work.waves[0], images=work.waves[0].images.take([0] * controllers))  # equal shards
    np.testing.assert_allclose(phases.wave_data_seconds(one, equal), controllers * phases.wave_data_seconds(own, equal),
                               rtol=1e-12)
    # unequal shards: the driver does the sum, every controller its own share
    np.testing.assert_allclose(phases.wave_data_seconds(one, work.waves[0]),
                               phases.wave_data_seconds(own, work.waves[0]).sum(), rtol=1e-12)
    assert phases.update_data_seconds(one, work) == pytest.approx(
        float(phases.slice_data_seconds(own, phases.update_payload_bytes(own, work)).sum()), rel=1e-12)


def test_the_single_driver_shows_in_the_simulated_step():
    fixed = ("controllers=4", "workload.prompts_per_step=32", "strategies=[colocate]", "models.judge=null")
    own = simulate(image_scenario(*fixed), "colocate")
    one = simulate(image_scenario(*fixed, "workload.single_driver=true"), "colocate")
    for a, b in zip(own.steps, one.steps, strict=True):  # 1 image of 448 px everywhere: equal shards
        assert b.phases["rollout/data"] == pytest.approx(4 * a.phases["rollout/data"], rel=1e-9)
        assert b.phases["update/data"] == pytest.approx(4 * a.phases["update/data"], rel=1e-9)
        assert b.seconds > a.seconds
        assert a.features["images/count"] == sum(w.prompts for w in workload_steps(image_scenario(*fixed))[a.step].waves)
    rows = data_plane_rows([own, one])
    assert rows[1]["data s"] == pytest.approx(4 * rows[0]["data s"], rel=1e-9)
    assert rows[1]["rest s"] == pytest.approx(rows[0]["rest s"], rel=1e-9)  # the GPUs' share does not change
    assert "data / rest" in summary_markdown([own, one])
    assert "data / rest" not in summary_markdown([simulate(make_scenario(*fixed), "colocate")])  # text only


# --------------------------------------------------------------------------- draws, settings, scenarios


def test_images_per_prompt_are_drawn_in_range():
    settings = ImageSettings(per_prompt=1, per_prompt_max=3, sides=(448, 896))
    drawn = vision.draw_images(np.random.default_rng(0), settings, (4, 500))
    assert set(np.unique(drawn.count)) == {1, 2, 3}
    assert abs(drawn.count.mean() - 2.0) < 0.1
    per_image = drawn.tokens / drawn.count
    assert per_image.min() >= 256 and per_image.max() <= 1024  # 448 px: 256 tokens; 896 px: 1024


def test_bad_image_settings_name_their_key():
    with pytest.raises(ConfigError, match="per_prompt_max"):
        make_scenario("workload.images.per_prompt=2", "workload.images.per_prompt_max=1")
    with pytest.raises(ConfigError, match="images.per_prompt"):
        make_scenario("workload.kind=diffusion", "workload.images.per_prompt=1", "models.judge=null")
    with pytest.raises(ConfigError, match="sides"):
        make_scenario("workload.images.sides=[]")


def test_keys_joined_by_commas_sweep_together():
    scenario = make_scenario('sweep={"gpus,controllers": [[8, 2], [16, 4]], "workload.single_driver": [false, true]}')
    labels = [label for label, _ in variants(scenario)]
    assert labels[0] == "gpus=8 controllers=2 workload.single_driver=False" and len(labels) == 4
    assert [(v.gpus, v.controllers) for _, v in variants(scenario)][2:] == [(16, 4), (16, 4)]
    with pytest.raises(ConfigError, match="sweep.gpus,controllers"):
        variants(make_scenario('sweep={"gpus,controllers": [[8, 2, 1]]}'))


def test_the_vision_scenarios_run():
    single = load_scenario(REPO / "scenarios" / "vision_qwen2vl_7b_64.yaml", ["steps=2"])
    results = run_scenario(single)
    assert [r.strategy for r in results] == ["colocate", "partial", "dynamic", "disaggregated"]
    assert all(r.mean_phases()["rollout/data"] > 0 and r.steps[0].features["images/count"] > 0 for r in results)
    sweep = load_scenario(REPO / "scenarios" / "vision_qwen2vl_7b_sweep.yaml")
    cells = [(v.gpus, v.controllers, v.workload.prompts_per_step, v.workload.single_driver) for _, v in variants(sweep)]
    assert cells == [(g, g // 8, 8 * g, d) for g in (64, 128, 256, 512) for d in (False, True)]
    assert "EXTRAPOLATION" in sweep.description


# --------------------------------------------------------------------------- the fit of the CPU constants


def test_the_fit_recovers_known_constants():
    megapixels = np.array([0.004, 0.016, 0.066, 0.147, 0.262, 0.59, 1.05])
    exact = 4e-4 + 0.05 * megapixels
    line = vision.fit_seconds_per_megapixel(megapixels, exact)
    assert (line.intercept, line.slope) == pytest.approx((4e-4, 0.05), rel=1e-9)
    np.testing.assert_allclose(line.relative_errors(megapixels, exact), 0.0, atol=1e-9)
    # +-1 % multiplicative noise moves the fitted line by about as much, and never by more than the noise's bound
    noisy = exact * (1 + 0.01 * np.array([1, -1, 1, -1, 1, -1, 1]))
    line = vision.fit_seconds_per_megapixel(megapixels, noisy)
    assert np.abs(line.relative_errors(megapixels, exact)).max() < 0.02
    with pytest.raises(ValueError):
        vision.fit_seconds_per_megapixel([0.1, 0.1], [1.0, 1.1])


def test_docs_tables_are_what_simulate_prints():
    scenario = load_scenario(REPO / "scenarios" / "vision_qwen2vl_7b_64.yaml", ["steps=3"])
    results = run_scenario(scenario)
    documented = (REPO / "docs" / "simulator.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(documented) if "scenarios/vision_qwen2vl_7b_64.yaml --steps 3`" in line)
    section = [line for line in documented[start:] if line.startswith("| ")]
    for printed in (markdown_table(results), data_plane_markdown(results)):
        rows = printed.splitlines()[2:]
        table = section[1:len(rows) + 1]  # after the header row
        # within one unit of the last printed digit, as the findings tables (numpy's exp differs by CPU)
        assert len(table) == len(rows) and all(same_row(row, doc) for row, doc in zip(rows, table, strict=True)), (
            "docs/simulator.md's vision table is out of date:\n" + "\n".join(rows))
        section = section[len(rows) + 1:]  # the next table starts with its header
