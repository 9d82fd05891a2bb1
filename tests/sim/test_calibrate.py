"""Calibration: held-out steps are predicted within what the injected noise allows; constants are
recovered where the telemetry determines them, and reported as held where it does not; run
directories are read.

Synthetic telemetry is priced by `predict` with known constants (`TRUE`) and multiplied by
1 + SIGMA x N(0, 1) noise drawn from a fixed-seed `numpy.random.Generator` (never the global
`random`, which pytest-randomly reseeds per test).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.data.balance import balance_rows, imbalance
from gcore_rl.errors import ConfigError
from gcore_rl.sim.calibrate import (
    RunTelemetry,
    StepSample,
    balance_table,
    calibrate,
    predict,
    read_run,
    resolve_hardware,
)

HW = resolve_hardware("cpu")
POLICY = ModelSpec("policy", params=8.0e5, layers=2, hidden=64, kv_heads=4, head_dim=16, vocab=99, bytes_per_param=4)
JUDGE = ModelSpec("judge", params=3.0e6, layers=6, hidden=64, kv_heads=4, head_dim=16, vocab=99, bytes_per_param=4)
TRUE = CostConstants(decode_mfu=0.13, step_overhead_s=0.004, layer_overhead_s=0.002, prefill_mfu=0.2, logprob_mfu=0.05,
                     train_mfu=0.03, pass_overhead_s=0.1, train_pass_overhead_s=0.3, optimizer_step_s=0.3,
                     sync_overhead_s=0.03, engine_wake_s=0.01)
PHASES = ("generate", "judge", "prepare", "train", "sync", "swap")
ENGINE = ("decode_mfu", "prefill_mfu", "step_overhead_s", "layer_overhead_s")
NOT_MEASURED = {"decode_bandwidth_efficiency", "controller_bandwidth", "trainer_state_bytes_per_param"}
SIGMA = 0.02  # relative noise on every measured phase

# Held-out tolerance. A least-squares fit of p constants to m steps with relative noise SIGMA predicts
# a new step with relative error of standard deviation SIGMA x sqrt(h), h being the step's leverage;
# for a step drawn like the fitted ones h averages p / m and stays below 2 p / m. The phase with the
# fewest steps per constant is train (p = 3 over m = 24; the engine fits 4 over 2 x 24), so
# 5 SIGMA sqrt(2 x 3 / 24) = 5 % bounds every held-out step with a 5-standard-deviation margin.
FIT_STEPS, HELD_OUT_STEPS = range(2, 26), range(26, 38)
HELD_OUT_TOL = 5 * SIGMA * math.sqrt(2 * 3 / len(FIT_STEPS))


def varied_work(rng: np.random.Generator) -> dict[str, float]:
    """One step's work where every count varies on its own (batch sizes, lengths, micro-batches), so
    each constant multiplies something the others do not."""
    work: dict[str, float] = {}
    for role in ("rollout", "judge"):
        steps, batch, prefills = rng.integers(6, 17), rng.integers(8, 65), rng.integers(1, 4)
        work |= {f"work/{role}/decode_steps": steps, f"work/{role}/tokens": batch * steps * rng.uniform(0.5, 1.0),
                 f"work/{role}/prefills": prefills, f"work/{role}/prefill_tokens": prefills * rng.integers(50, 400)}
    return work | {
        "work/judge/samples": 32,
        "work/actor/tokens": rng.uniform(2000, 6000), "work/actor/prepare_tokens": rng.uniform(2000, 6000),
        "work/actor/micro_batches": rng.integers(1, 5), "work/actor/prepare_micro_batches": rng.integers(1, 5),
        "work/actor/optimiser_steps": rng.integers(1, 4),
        "work/sync/bytes": 3.2e6, "work/swap/wakes": rng.integers(1, 3), "work/swap/sleeps": 1,
        "work/swap/released_bytes": 3.2e6,
    }


def collinear_work(rng: np.random.Generator) -> dict[str, float]:
    """Work as a real CPU run has it: one model (one layer count), two micro-batches and one optimiser
    step every step, trained tokens within 0.3 % of each other."""
    work = varied_work(rng)
    work = {k: v for k, v in work.items() if not k.startswith("work/judge/")}
    return work | {"work/actor/micro_batches": 2, "work/actor/optimiser_steps": 1,
                   "work/actor/tokens": 4000 * rng.uniform(0.997, 1.003)}


def telemetry(work, steps, sigma: float, seed: int, judge: ModelSpec | None = JUDGE,
              true: CostConstants = TRUE) -> RunTelemetry:
    """Steps whose phases are priced with `true` (times 1 + sigma N(0, 1)); `work(rng)` draws each step's work."""
    rng = np.random.default_rng(seed)
    shell = RunTelemetry("synthetic", POLICY, judge, ppo_epochs=1, judge_added_s_per_sample=0.001, samples=[])
    samples = []
    for step in steps:
        sample = StepSample(step, {}, {k: float(v) for k, v in work(rng).items()})
        seconds = {phase: t * (1 + sigma * rng.standard_normal()) for phase in PHASES
                   if (t := predict(sample, phase, shell, HW, true)) is not None}
        samples.append(dataclasses.replace(sample, seconds=seconds))
    return dataclasses.replace(shell, samples=samples)


def held_out_errors(fit: RunTelemetry, held_out: RunTelemetry, constants: CostConstants) -> dict[str, float]:
    """Per phase, the largest relative error of the prediction against the noise-free truth over the held-out steps."""
    worst: dict[str, float] = {}
    for sample in held_out.samples:
        for phase in sample.seconds:
            truth = predict(sample, phase, fit, HW, TRUE)
            error = abs(predict(sample, phase, fit, HW, constants) / truth - 1)
            worst[phase] = max(worst.get(phase, 0.0), error)
    return worst


def test_held_out_steps_are_predicted_within_the_noise():
    fit = telemetry(varied_work, FIT_STEPS, SIGMA, seed=11)
    held_out = telemetry(varied_work, HELD_OUT_STEPS, SIGMA, seed=12)
    result = calibrate(fit, HW)
    assert [p.phase for p in result.phases] == list(PHASES)
    errors = held_out_errors(fit, held_out, result.constants)
    assert set(errors) == set(PHASES)
    assert all(error < HELD_OUT_TOL for error in errors.values()), errors
    # the defaults (GPU figures) would not: the fit is what makes the prediction
    assert max(held_out_errors(fit, held_out, CostConstants()).values()) > 10 * HELD_OUT_TOL
    assert "costs:" in result.constants_yaml() and "| generate |" in result.table()


def test_noise_free_well_posed_telemetry_gives_back_every_constant():
    """Two layer counts, varying batch sizes, lengths and counts: every measured constant is identifiable.

    Without noise the fit is exact up to rounding amplified by the design's conditioning (well under
    1e4 here) and the decode MFU's search tolerance (1e-10 in ln MFU): 1e-8 relative.
    """
    result = calibrate(telemetry(varied_work, FIT_STEPS, 0.0, seed=5), HW)
    assert set(result.held) == NOT_MEASURED
    for name in result.fitted:
        assert getattr(result.constants, name) == pytest.approx(getattr(TRUE, name), rel=1e-8), name
    assert all(p.error < 1e-8 and p.held_out_error < 1e-8 for p in result.phases)


def test_noisy_well_posed_telemetry_recovers_constants_within_their_standard_errors():
    """Each fitted constant lies within 4 of its reported standard errors (residual spread x
    conditioning) of the truth, and those errors are small enough for the check to mean something."""
    result = calibrate(telemetry(varied_work, FIT_STEPS, SIGMA, seed=7), HW)
    assert set(result.held) == NOT_MEASURED
    for fit in result.constant_fits:
        if fit.fitted:
            true = getattr(TRUE, fit.name)
            assert 0 < fit.standard_error < 0.25 * true, fit
            assert abs(fit.value - true) <= 4 * fit.standard_error, fit


def test_collinear_telemetry_reports_what_it_merged_and_still_predicts_held_out_steps():
    """One layer count: only step_overhead_s + layers x layer_overhead_s is determined. Constant
    micro-batch and optimiser-step counts with near-constant tokens: only the train phase's total.
    The fit says so, holds the rest at the prior (0 here), folds their cost into the fitted ones,
    and predicts held-out steps (which share the collinearity) as well as a well-posed fit would."""
    fit = telemetry(collinear_work, FIT_STEPS, SIGMA, seed=3, judge=None)
    held_out = telemetry(collinear_work, HELD_OUT_STEPS, SIGMA, seed=4, judge=None)
    base = CostConstants(layer_overhead_s=0.0, train_pass_overhead_s=0.0, optimizer_step_s=0.0)
    result = calibrate(fit, HW, base)
    notes = {c.name: c.note for c in result.constant_fits if not c.fitted}
    assert set(notes) == NOT_MEASURED | {"layer_overhead_s", "train_pass_overhead_s", "optimizer_step_s"}
    assert "not separable from step_overhead_s" in notes["layer_overhead_s"]
    assert "two depths" in notes["layer_overhead_s"]
    assert "not separable from train_mfu" in notes["train_pass_overhead_s"]
    assert "not separable from train_mfu" in notes["optimizer_step_s"]
    for name in ("layer_overhead_s", "train_pass_overhead_s", "optimizer_step_s"):
        assert getattr(result.constants, name) == 0.0
        assert f"{name}: 0.0  # held: not separable" in result.constants_yaml()
    # the merged constant: step_overhead_s carries the per-layer cost of the one model
    merged = next(c for c in result.constant_fits if c.name == "step_overhead_s")
    combined = TRUE.step_overhead_s + POLICY.layers * TRUE.layer_overhead_s
    assert abs(merged.value - combined) <= 4 * merged.standard_error
    errors = held_out_errors(fit, held_out, result.constants)
    assert set(errors) == set(PHASES) - {"judge"}
    assert all(error < HELD_OUT_TOL for error in errors.values()), errors


def test_exactly_collinear_columns_give_one_answer_without_noise():
    """The merged constant is exact: the split no longer depends on rounding (and so on the BLAS)."""
    result = calibrate(telemetry(collinear_work, FIT_STEPS, 0.0, seed=3, judge=None), HW,
                       CostConstants(layer_overhead_s=0.0))
    assert "layer_overhead_s" in result.held
    combined = TRUE.step_overhead_s + POLICY.layers * TRUE.layer_overhead_s
    assert result.constants.step_overhead_s == pytest.approx(combined, rel=1e-8)
    assert result.constants.decode_mfu == pytest.approx(TRUE.decode_mfu, rel=1e-8)


def test_a_constant_the_noise_hides_is_held_not_fitted():
    """Wakes vary (1, 1, 2, 2, ...), so their column is separable, but they cost nothing here and the
    swaps carry a +-2 % error that is balanced against the wake counts: the fitted wake is 0 with a
    non-zero standard error, which the telemetry cannot tell from 0, so it is held and says so."""
    no_wake = dataclasses.replace(TRUE, engine_wake_s=0.0)
    run = telemetry(varied_work, FIT_STEPS, 0.0, seed=7, true=no_wake)
    samples = []
    for i, s in enumerate(run.samples):
        work = {**s.work, "work/swap/wakes": 1.0 + (i // 2) % 2}
        swap = predict(dataclasses.replace(s, work=work), "swap", run, HW, no_wake) * (1 + SIGMA * (-1) ** i)
        samples.append(StepSample(s.step, {**s.seconds, "swap": swap}, work))
    result = calibrate(dataclasses.replace(run, samples=samples), HW)
    wake = next(c for c in result.constant_fits if c.name == "engine_wake_s")
    assert not wake.fitted and wake.value == CostConstants().engine_wake_s
    assert "this telemetry does not determine it" in wake.note


FIT_IN_A_SUBPROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from test_calibrate import HW, SIGMA, FIT_STEPS, collinear_work, telemetry, varied_work
from gcore_rl.sim.calibrate import calibrate
out = {{}}
for name, work, judge in (("varied", varied_work, True), ("collinear", collinear_work, False)):
    run = telemetry(work, FIT_STEPS, SIGMA, seed=3, **({{}} if judge else {{"judge": None}}))
    result = calibrate(run, HW)
    out[name] = [[c.name, c.value, c.fitted] for c in result.constant_fits]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_fit_does_not_depend_on_the_thread_count(tmp_path):
    """The same telemetry fitted with BLAS/OpenMP on 1 and on 2 threads gives the same constants and statuses."""
    from pathlib import Path

    script = FIT_IN_A_SUBPROCESS.format(tests=str(Path(__file__).parent))
    answers = []
    for threads in ("1", "2"):
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
        answers.append(json.loads(done.stdout))
    for name in ("varied", "collinear"):
        for (n1, v1, f1), (n2, v2, f2) in zip(answers[0][name], answers[1][name], strict=True):
            assert (n1, f1) == (n2, f2)
            assert v1 == pytest.approx(v2, rel=1e-9, abs=1e-15), n1


def test_a_stalled_step_does_not_pull_the_fit():
    run = telemetry(varied_work, FIT_STEPS, 0.0, seed=5)
    samples = list(run.samples)
    stalled = samples[3]
    samples[3] = dataclasses.replace(stalled, seconds={**stalled.seconds, "train": stalled.seconds["train"] * 8})
    result = calibrate(dataclasses.replace(run, samples=samples), HW)
    for name in ("train_mfu", "train_pass_overhead_s", "optimizer_step_s"):
        assert getattr(result.constants, name) == pytest.approx(getattr(TRUE, name), rel=1e-8), name


def test_read_run_names_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="no config.yaml"):
        read_run(tmp_path)
    (tmp_path / "config.yaml").write_text("model: {path: nowhere}\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    (tmp_path / "timeline").mkdir()
    with pytest.raises(ConfigError, match="config.json"):
        read_run(tmp_path)
    with pytest.raises(ConfigError, match="--hardware"):
        resolve_hardware("TPU")


def test_cli_calibrates_a_real_run(tmp_path, capsys):
    from gcore_rl.cli import main
    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.runtime.driver import run_job

    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    run = tmp_path / "run"
    run_job(load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={run}", "run.steps=5", "run.prompts_per_step=4", "sampling.n=4",
        "sampling.max_new_tokens=6", "data.eval_prompts=0", "run.progress=false", "runtime.threads_per_process=1",
        "run.save_final=false"]))
    capsys.readouterr()
    assert main(["simulate", "--calibrate", str(run), "--constants-out", str(tmp_path / "costs.yaml")]) == 0
    out = capsys.readouterr().out
    for phase in ("generate", "train", "sync", "swap"):
        assert f"| {phase} |" in out
    # every constant says whether the run determined it; which ones a 4-step run on a loaded machine
    # determines depends on the noise, but one model (one layer count) never separates layer_overhead_s
    written = (tmp_path / "costs.yaml").read_text()
    lines = written.splitlines()
    assert lines[0] == "costs:" and len(lines) == 1 + len(dataclasses.fields(CostConstants))
    assert all(" # fitted on " in line or " # held: " in line for line in lines[1:]), written
    assert "  layer_overhead_s: 0.0  # held: " in written and written in out
    # one trainer rank: the runtime's split is even every step
    split = next(line for line in out.splitlines() if line.startswith("| train/cost_imbalance |"))
    assert "| 1.0000 | 1.0000 |" in split, out  # replayed from the run's lengths/ record
    assert (run / "lengths" / "controller-0.jsonl").read_text().count('"groups": 1') == 5


def test_balance_table_gives_the_median_of_the_measured_split():
    model = ModelSpec("m", params=1e6, layers=2, hidden=8, kv_heads=1, head_dim=8, vocab=10)
    samples = [StepSample(step, {}, {}, {"train/cost_imbalance": value, "train/token_imbalance": 1.0})
               for step, value in ((2, 1.5), (3, 1.0), (4, 1.2))]
    table = balance_table(RunTelemetry("run", model, None, 1, 0.0, samples)).splitlines()
    assert table[2] == "| train/cost_imbalance | 3 | 1.2000 | n/a (no row lengths recorded) |"
    assert table[3] == "| train/token_imbalance | 3 | 1.0000 | n/a (no row lengths recorded) |"
    older = [StepSample(s.step, {}, {}) for s in samples]  # a run from before the metrics
    assert balance_table(RunTelemetry("run", model, None, 1, 0.0, older)) is None


def test_the_predicted_split_replays_the_recorded_rows_through_the_simulators_split():
    """Two controllers' recorded rows (tokens, trainer groups) per step: the prediction is the mean over
    controllers of the runtime's own rule (`balance_rows`) under the simulator's cost, median over steps."""
    model = ModelSpec("m", params=1e6, layers=2, hidden=8, kv_heads=1, head_dim=8, vocab=10)
    rows = {2: [([512, 64, 64, 64], 2), ([8, 8, 8, 8], 2)], 3: [([100, 100, 10, 10], 2), ([30, 20, 10, 5], 1)],
            4: [([40, 40, 40, 40], 4), ([1, 2, 3, 4], 2)]}
    samples = [StepSample(step, {}, {}, {"train/cost_imbalance": 1.0, "train/token_imbalance": 1.0}, splits)
               for step, splits in rows.items()]
    expected = {"train/cost_imbalance": [], "train/token_imbalance": []}
    for splits in rows.values():
        for key, weigh in (("train/cost_imbalance", model.sequence_cost), ("train/token_imbalance", float)):
            expected[key].append(sum(imbalance([weigh(t) for t in tokens], balance_rows([weigh(t) for t in tokens], groups))
                                     for tokens, groups in splits) / len(splits))
    table = balance_table(RunTelemetry("run", model, None, 1, 0.0, samples)).splitlines()
    assert table[2].endswith(f"| {statistics.median(expected['train/cost_imbalance']):.4f} |")
    assert table[3].endswith(f"| {statistics.median(expected['train/token_imbalance']):.4f} |")
    # by hand, largest-first: step 2 splits 512+64 | 64+64 (576 over a mean of 352 = 18/11) and 8+8 | 8+8;
    # step 3 100+10 | 100+10 and one group; step 4 one row per group, and 4+1 | 3+2
    assert expected["train/token_imbalance"] == pytest.approx([(18 / 11 + 1) / 2, 1.0, 1.0])
    assert expected["train/cost_imbalance"][0] > expected["train/token_imbalance"][0]  # attention weighs long rows more


def test_cli_refuses_options_that_calibration_would_ignore(tmp_path):
    from gcore_rl.cli import main

    assert main(["simulate", "scenarios/gpus8_judge.yaml", "--calibrate", str(tmp_path)]) == 2
    assert main(["simulate", "scenarios/gpus8_judge.yaml", "--hardware", "H100"]) == 2


def test_calibration_prices_the_update_as_the_simulator_does():
    """The same work and constants give the same prepare and train seconds in `predict` and the simulator:
    both price the slowest trainer rank, the mean rank's tokens times the split's `train/cost_imbalance`."""
    from small_scenario import make_scenario

    from gcore_rl.costmodel import phases
    from gcore_rl.sim import resolve_job
    from gcore_rl.sim.simulator import workload_steps
    from gcore_rl.training.shapes import forward_micro_batches, update_shape

    scenario = make_scenario("workload.micro_batch_size=3", "workload.mini_batches=2", "costs.pass_overhead_s=0.2",
                             "costs.train_pass_overhead_s=0.5", "costs.optimizer_step_s=0.7")
    job, work = resolve_job(scenario), workload_steps(scenario)[0]
    devices = job.slice_devices
    prepare, train = phases.update_seconds(job, work, devices, passes=2)
    split = phases.trainer_split(job, work, devices)
    slowest = int(np.argmax(split.rank_tokens))  # the slice whose slowest rank the simulator prices
    tokens = float(work.trained_tokens[slowest])
    rows = -(-work.trained_groups * job.workload.group_size // devices)
    steps, micro = update_shape(rows, 3, 2, job.workload.ppo_epochs)
    sample = StepSample(1, {}, {"work/actor/tokens": tokens / devices, "work/actor/prepare_tokens": 2 * tokens / devices,
                                "work/actor/micro_batches": micro, "work/actor/optimiser_steps": steps,
                                "work/actor/prepare_micro_batches": 2 * forward_micro_batches(rows, 3)},
                        {"train/cost_imbalance": float(split.cost_imbalance[slowest])})
    run = RunTelemetry("sim", job.policy, None, job.workload.ppo_epochs, 0.0, [])
    assert predict(sample, "prepare", run, job.hardware, job.costs) == pytest.approx(prepare, rel=1e-12)
    assert predict(sample, "train", run, job.hardware, job.costs) == pytest.approx(train, rel=1e-12)
    assert micro > 1 and steps == 2 and sample.slowest_rank > 1.0
    # a run that predates the imbalance metrics is priced at its mean rank
    even = StepSample(1, {}, sample.work)
    assert predict(even, "train", run, job.hardware, job.costs) < predict(sample, "train", run, job.hardware, job.costs)
