"""The simulator held against published step times: verl's DAPO runs of Qwen2.5-Math-7B on H20 GPUs.

Source: verl's documentation, "Recipe: Fully Async Policy Trainer" (docs/advance/fully_async.md in
github.com/volcengine/verl), "Asynchronous Training on 7B Model": colocated synchronous runs on
32 / 64 / 128 GPUs and fully-async runs with rollout:train GPUs 16:16 / 32:32 / 64:64, each the
mean over 400 steps of 512 prompts x 16 samples (scenarios/published_verl_dapo7b_h20.yaml has the
setup and the sources of each setting).

One input per run is not published: the response lengths, which drift over the 400 steps and
differ between the runs (the same page's require_batches ablation changes `update_actor` 1.9x on
the same 128 GPUs through the lengths alone). Each run's median response length is therefore
read from its own reported `update_actor` (`fit_response_median`: the length at which the
simulator's training phase takes the reported time), and the other figures of the run, above
all the step time and the generation phase, are predicted from it. `update_actor` is thus an
input, not a test; the step time is the test, together with the sign of async vs colocate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import brentq, least_squares

from gcore_rl.costmodel import phases
from gcore_rl.sim.results import SimResult
from gcore_rl.sim.scenario import Scenario, load_scenario, resolve_job
from gcore_rl.sim.simulator import simulate, workload_steps

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "published_verl_dapo7b_h20.yaml"

#: verl's phases, as the simulator's (colocate's `gen` wraps the engine wake and the weight load too)
PHASE_MAP = {
    "colocate": {"gen": ("rollout/generate", "swap", "update/sync"), "old_log_prob": ("update/prepare",),
                 "update_actor": ("update/train",)},
    "streaming": {"gen": ("rollout/generate",), "update_actor": ("update/prepare", "update/train")},
}


@dataclass(frozen=True)
class PublishedRun:
    """One reported run: its placement, the overrides that restate its setup, and its mean phase seconds."""

    label: str
    strategy: str  # colocate | streaming
    gpus: int
    reported: dict[str, float]  # step, gen, old_log_prob (colocate), update_actor
    overrides: tuple[str, ...] = ()

    def scenario(self, extra: Sequence[str] = ()) -> Scenario:
        """The scenario of this run (the base file with its overrides and `extra`)."""
        return load_scenario(SCENARIO, [f"gpus={self.gpus}", "sweep={}", f"strategies=[{self.strategy}]",
                                        *self.overrides, *extra])


# `fully_async_policy` rows: require_batches 4, trigger_parameter_sync_step 4 (so 4 local updates on a
# quarter of the 512 prompts each between syncs), staleness_threshold 0.5, partial_rollout True, old
# log-probs from the rollout engines; the experiment scripts (recipe/fully_async_policy/exp/...)
# run the trainer without gradient checkpointing and without parameter or optimiser offload.
ASYNC_SETTINGS = ("placement.max_staleness=0.5", "placement.partial_rollout=true", "placement.train_chunks=4",
          "placement.recompute_logprobs=false", "workload.gradient_checkpointing=false")

VERL_DAPO7B_H20: tuple[PublishedRun, ...] = (
    PublishedRun("colocate sync, 32 GPUs", "colocate", 32,
                 {"step": 790.10, "gen": 357.41, "old_log_prob": 107.71, "update_actor": 313.81}),
    PublishedRun("fully_async 16:16", "streaming", 32,
                 {"step": 294.77, "gen": 21.26, "update_actor": 269.80}, ("placement.train_devices=16", *ASYNC_SETTINGS)),
    PublishedRun("colocate sync, 64 GPUs", "colocate", 64,
                 {"step": 365.28, "gen": 150.72, "old_log_prob": 70.26, "update_actor": 133.41}),
    PublishedRun("fully_async 32:32", "streaming", 64,
                 {"step": 189.26, "gen": 28.46, "update_actor": 156.98}, ("placement.train_devices=32", *ASYNC_SETTINGS)),
    PublishedRun("colocate sync, 128 GPUs", "colocate", 128,
                 {"step": 356.30, "gen": 177.85, "old_log_prob": 53.92, "update_actor": 113.81}),
    PublishedRun("fully_async 64:64", "streaming", 128,
                 {"step": 150.63, "gen": 33.14, "update_actor": 113.16}, ("placement.train_devices=64", *ASYNC_SETTINGS)),
)


def training_seconds(scenario: Scenario, strategy: str) -> float:
    """Mean seconds per step of the phases verl reports as `update_actor`, from the work alone (no schedule)."""
    job = resolve_job(scenario)
    devices = job.slice_devices if strategy == "colocate" else job.train_devices
    total = 0.0
    works = workload_steps(scenario, strategy)
    for work in works:
        passes = 1 + job.reference if strategy == "colocate" else job.reference + job.recompute_logprobs
        prepare, train = phases.update_seconds(job, work, devices, passes)
        total += train + (prepare if strategy == "streaming" else 0.0)
    return total / len(works)


def fit_response_median(run: PublishedRun, extra: Sequence[str] = ()) -> float:
    """The response-length median (tokens) at which the run's simulated `update_actor` equals the reported one."""
    def gap(log_median: float) -> float:
        scenario = run.scenario(extra=[*extra, f"workload.response_tokens.median={float(np.exp(log_median))}"])
        return np.log(training_seconds(scenario, run.strategy) / run.reported["update_actor"])

    return float(np.exp(brentq(gap, np.log(50.0), np.log(20000.0), xtol=1e-3)))


@dataclass(frozen=True)
class Comparison:
    """A published run beside its prediction (seconds per step, verl's phase names)."""

    run: PublishedRun
    response_median: float  # fitted input
    response_mean: float  # mean response tokens of the simulated work
    predicted: dict[str, float]

    def ratio(self, phase: str) -> float:
        return self.predicted[phase] / self.run.reported[phase]


def verl_figures(result: SimResult, strategy: str) -> dict[str, float]:
    """Mean seconds per step of verl's figures (step and its phases) over the simulated steady state: every
    step but the first (a streaming run's first batch is generated with nothing to overlap; the
    published means are over 400 steps)."""
    steps = result.steps[1:] or result.steps
    figures = {name: float(np.mean([sum(s.phases.get(p, 0.0) for p in keys) for s in steps]))
               for name, keys in PHASE_MAP.get(strategy, {}).items()}
    figures["step"] = float(np.mean([s.seconds for s in steps]))
    return figures


def compare(run: PublishedRun, extra: Sequence[str] = ()) -> Comparison:
    """Fit the run's response length, simulate it, and map the simulated phases onto verl's."""
    median = fit_response_median(run, extra)
    scenario = run.scenario(extra=[*extra, f"workload.response_tokens.median={median}"])
    works = workload_steps(scenario, run.strategy)
    predicted = verl_figures(simulate(scenario, run.strategy, works=works), run.strategy)
    mean = float(np.mean(np.concatenate([w.response_tokens.ravel() for work in works for w in work.waves])))
    return Comparison(run, median, mean, predicted)


def compare_all(runs: Sequence[PublishedRun] = VERL_DAPO7B_H20, extra: Sequence[str] = ()) -> list[Comparison]:
    return [compare(run, extra) for run in runs]


@dataclass(frozen=True)
class EngineFit:
    """Cost constants of the H20 engines and forward pass, fitted on published runs.

    `decode_mfu` and `step_overhead_s` set a generation phase made of a compute-bound bulk (many
    sequences, priced by decode_mfu) and a latency-bound tail (the longest sequences decoding
    nearly alone, priced per step by step_overhead_s + the weight read): they are fitted to the
    colocate runs' `gen` and the async runs' step (which generation bounds when the rollout
    devices cannot keep up with the trainer). `logprob_mfu` is fitted to the colocate runs'
    `old_log_prob`. `residuals`: log(predicted / reported) of each fitted figure; `runs`: the
    labels of the runs fitted on.
    """

    decode_mfu: float
    step_overhead_s: float
    logprob_mfu: float
    residuals: tuple[float, ...] = ()
    runs: tuple[str, ...] = ()

    def overrides(self) -> list[str]:
        return [f"costs.decode_mfu={self.decode_mfu:.4g}", f"costs.step_overhead_s={self.step_overhead_s:.4g}",
                f"costs.logprob_mfu={self.logprob_mfu:.4g}"]


#: `fit_engine_constants()` on all six runs (benchmarks/sim_findings.py --only v prints it;
#: tests/sim/test_published.py checks that a refit gives the same within its tolerance)
VERL_H20_FIT = EngineFit(decode_mfu=0.1323, step_overhead_s=0.004458, logprob_mfu=0.227)

def _engine_constants(x: np.ndarray) -> list[str]:
    return [f"costs.decode_mfu={float(np.exp(x[0]))}", f"costs.step_overhead_s={float(np.exp(x[1]))}"]


def fitted_figure(run: PublishedRun) -> str:
    """The figure of `run` the engine fit matches: colocate `gen`, the async step."""
    return "gen" if run.strategy == "colocate" else "step"


def fit_engine_constants(runs: Sequence[PublishedRun] = VERL_DAPO7B_H20, extra: Sequence[str] = ()) -> EngineFit:
    """Fit decode_mfu and step_overhead_s (least squares on log ratios of each run's `fitted_figure`) and
    logprob_mfu (the geometric mean of the colocate runs' `old_log_prob` ratios), each run at its own length.

    The training constants are not fitted: `train_mfu` and the response length enter `update_actor`
    only as their ratio, so the length is read from `update_actor` at the assumed `train_mfu`.
    """
    lengths = [f"workload.response_tokens.median={fit_response_median(run, extra)}" for run in runs]

    def figure(run: PublishedRun, length: str, name: str, constants: Sequence[str]) -> float:
        result = simulate(run.scenario(extra=[*extra, length, *constants]), run.strategy)
        return verl_figures(result, run.strategy)[name]

    def residuals(x: np.ndarray) -> np.ndarray:
        return np.array([np.log(figure(run, length, fitted_figure(run), _engine_constants(x))
                                / run.reported[fitted_figure(run)]) for run, length in zip(runs, lengths, strict=True)])

    fit = least_squares(residuals, np.log([0.3, 0.005]), bounds=(np.log([0.01, 1e-5]), np.log([1.0, 0.1])),
                        diff_step=1e-3)
    colocate = [(run, length) for run, length in zip(runs, lengths, strict=True) if run.strategy == "colocate"]
    base = runs[0].scenario(extra=extra).costs.logprob_mfu
    ratios = [figure(run, length, "old_log_prob", ()) / run.reported["old_log_prob"] for run, length in colocate]
    logprob_mfu = min(1.0, base * float(np.exp(np.mean(np.log(ratios))))) if ratios else base  # time ~ 1 / MFU
    return EngineFit(decode_mfu=float(np.exp(fit.x[0])), step_overhead_s=float(np.exp(fit.x[1])),
                     logprob_mfu=logprob_mfu, residuals=tuple(float(r) for r in fit.fun),
                     runs=tuple(run.label for run in runs))


def cross_validate(runs: Sequence[PublishedRun] = VERL_DAPO7B_H20, extra: Sequence[str] = ()
                   ) -> list[tuple[EngineFit, list[Comparison]]]:
    """Leave one GPU count out: fit on the runs at the other GPU counts, predict the runs at this one."""
    out = []
    for gpus in sorted({run.gpus for run in runs}):
        fit = fit_engine_constants([run for run in runs if run.gpus != gpus], extra)
        held = [compare(run, [*extra, *fit.overrides()]) for run in runs if run.gpus == gpus]
        out.append((fit, held))
    return out


def markdown_table(comparisons: Sequence[Comparison]) -> str:
    """One row per run: fitted length, then reported / predicted / ratio for step and gen, and async vs colocate."""
    head = ["run", "fitted response median (mean)", "step reported", "step predicted", "pred/rep",
            "gen reported", "gen predicted", "old_log_prob rep / pred"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        rep, pred = c.run.reported, c.predicted
        logprob = (f"{rep['old_log_prob']:.1f} / {pred['old_log_prob']:.1f}" if "old_log_prob" in rep else "-")
        lines.append(f"| {c.run.label} | {c.response_median:.0f} ({c.response_mean:.0f}) | {rep['step']:.1f} | "
                     f"{pred['step']:.1f} | {c.ratio('step'):.2f} | {rep['gen']:.1f} | {pred['gen']:.1f} | {logprob} |")
    return "\n".join(lines)


def speedups(comparisons: Sequence[Comparison]) -> list[tuple[int, float, float]]:
    """(GPUs, reported colocate/async step ratio, predicted ratio) for every GPU count with both kinds of run."""
    by_gpus: dict[int, dict[str, Comparison]] = {}
    for c in comparisons:
        by_gpus.setdefault(c.run.gpus, {})[c.run.strategy] = c
    out = []
    for gpus, pair in sorted(by_gpus.items()):
        if {"colocate", "streaming"} <= pair.keys():
            colo, stream = pair["colocate"], pair["streaming"]
            out.append((gpus, colo.run.reported["step"] / stream.run.reported["step"],
                        colo.predicted["step"] / stream.predicted["step"]))
    return out


def main() -> None:
    """`python benchmarks/simlab/published.py`: the six runs against the simulator with the stored fit (about 15 s)."""
    comparisons = compare_all(extra=VERL_H20_FIT.overrides())
    print(f"verl DAPO Qwen2.5-Math-7B on H20 ({SCENARIO.name}); engine constants: {' '.join(VERL_H20_FIT.overrides())}\n")
    print(markdown_table(comparisons))
    print("\n| GPUs | colocate / async step, reported | predicted |\n|---|---|---|")
    for gpus, reported, predicted in speedups(comparisons):
        print(f"| {gpus} | {reported:.2f} | {predicted:.2f} |")


if __name__ == "__main__":
    main()


__all__ = ["VERL_DAPO7B_H20", "Comparison", "PublishedRun", "compare", "compare_all", "fit_response_median",
           "markdown_table", "speedups"]
