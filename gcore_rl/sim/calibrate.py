"""Calibration: fit the simulator's cost constants to a real run and compare predicted with measured phases.

A `gcore-rl train` run leaves, per step, how long every device spent in each phase
(`timeline/device-<d>.jsonl`) and how much work it did there (`work/<role>/<count>` in
`metrics.jsonl`: decode steps, prefilled and generated tokens, trained tokens, micro-batches,
synced bytes, swaps). Calibration prices that work with the cost formulas of `gcore_rl.costmodel.cost`
and fits the constants the formulas leave open (`CostConstants`), phase by phase:

| phase | measured (per device and step) | formula fitted |
|---|---|---|
| generate, judge | `rollout/generate`, `rollout/judge` | forwards (decode steps + prefills) x (step_overhead_s + layers x layer_overhead_s) + decode roofline(decode_mfu) + prefill(prefill_mfu); policy and judge share the constants (one engine) |
| prepare | `update/prepare` | forward micro-batches x pass_overhead_s + 2 N tokens x i / (logprob_mfu peak) |
| train | `update/train` | micro-batches x train_pass_overhead_s + optimiser steps x optimizer_step_s + 6 N tokens x i / (train_mfu peak) |
| sync | `update/sync` | sync_overhead_s + bytes / link |
| swap | `swap/sleep` + `swap/wake` | wakes x engine_wake_s + released bytes x 2 / host link (out and back) |

The update is priced at its slowest trainer rank, as the simulator prices it (`phases.trainer_split`):
i is the step's `train/cost_imbalance` (largest rank's estimated cost over the mean rank's, as the
runtime split the rows; 1 where the run does not report it), and the tokens are the mean rank's.
With K > 1 controllers `metrics.jsonl` holds both as means over the controllers, so calibration
prices the mean controller's slowest rank where the simulator takes the slowest of all.

Each phase is a small least-squares problem in the constants that enter linearly (overheads, and
1 / MFU − 1, so a fitted MFU stays at most 1), solved with `scipy.optimize.nnls` (every constant
>= 0) and refitted once without outlying steps (more than 4 median absolute deviations off: on a
shared machine another process can stall a step). The decode MFU enters through a max(memory,
compute) roofline and is searched (log grid, then a bounded scalar search), the linear constants
fitted at every trial.

Only what the telemetry determines is fitted. A constant's column (what it multiplies, step by
step; for the decode MFU, d seconds / d ln MFU) must keep an independent part after projecting out
the columns of the constants fitted before it, large enough that its share of the measured time is
known to within half (`_tolerance`: twice the noise per step over the time explained, never below
sqrt(eps)). Otherwise the constant is held at its prior (`base`, the defaults unless given) and the
report names the constants it cannot be told from and the telemetry that would separate them (e.g.
`layer_overhead_s` needs engines of two depths: with one model, only step_overhead_s + layers x
layer_overhead_s is determined, and step_overhead_s carries it). A constant whose fitted value has a
standard error as large as the value is held too (`_settle`). Constants are taken in a fixed
priority order (FLOP terms first, `ENGINE_CONSTANTS`, `LINEAR_CONSTANTS`), so the answer does not
depend on pivoting, the BLAS or the thread count. `Calibration.constant_fits` says per constant
whether it was fitted (with its standard error) or held, and why; `constants_yaml` writes it as
comments.

Step 1 is left out (first allocations), and so are steps that ended with an evaluation (its
generation is timed under the step but is not part of the step's work counters). The report gives,
per phase, the median over steps of the measured and predicted seconds with the constants fitted on
every step, and again with constants fitted on the odd steps and evaluated on the even ones (held
out).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.optimize
import yaml

from gcore_rl.costmodel import cost
from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import HARDWARE, Hardware
from gcore_rl.costmodel.models import ModelSpec, model_spec_from_folder
from gcore_rl.costmodel.phases import split_rows
from gcore_rl.errors import ConfigError

PHASE_EVENTS = {
    "generate": ("rollout/generate",),
    "judge": ("rollout/judge",),
    "prepare": ("update/prepare",),
    "train": ("update/train",),
    "sync": ("update/sync", "rollout/load_weights"),
    "swap": ("swap/sleep", "swap/wake"),
}
"""Timeline events that make up each calibrated phase."""

BALANCE_KEYS = ("train/cost_imbalance", "train/token_imbalance")
"""The runtime's measure of its split of each step's rows over the trainer ranks (`SliceClient.start_train`)."""


@dataclass(frozen=True)
class StepSample:
    """What one device did in one phase of one step, on average over the devices that did it.

    `seconds` is measured; `work` holds the `work/<role>/<count>` counters of the step and `balance`
    its `BALANCE_KEYS` (none in a run that predates them).
    """

    step: int
    seconds: dict[str, float]
    work: dict[str, float]
    balance: dict[str, float] = dataclasses.field(default_factory=dict)
    splits: list[tuple[list[int], int]] = dataclasses.field(default_factory=list)
    """Each controller's split of the step (`lengths/controller-<i>.jsonl`): its trained rows' tokens and
    its number of trainer groups (none in a run that predates the record)."""

    @property
    def slowest_rank(self) -> float:
        """The slowest trainer rank's work over the mean rank's (`train/cost_imbalance`; 1 when not reported)."""
        return self.balance.get("train/cost_imbalance", 1.0)


@dataclass(frozen=True)
class RunTelemetry:
    """A run's models, job settings and per-step samples (step 1 excluded)."""

    run_dir: str
    policy: ModelSpec
    judge: ModelSpec | None
    ppo_epochs: int
    judge_added_s_per_sample: float
    samples: list[StepSample]


@dataclass(frozen=True)
class PhaseFit:
    """Measured and predicted median seconds of one phase (per device and step, over the steps compared)."""

    phase: str
    measured_s: float
    predicted_s: float
    held_out_measured_s: float
    held_out_predicted_s: float

    @property
    def error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s if self.measured_s > 0 else 0.0

    @property
    def held_out_error(self) -> float:
        m = self.held_out_measured_s
        return abs(self.held_out_predicted_s - m) / m if m > 0 else 0.0


# ---------------------------------------------------------------------------------------- reading


def read_run(run_dir: str | Path) -> RunTelemetry:
    """Load a run directory's config, models and per-step phase times and work (raises ConfigError)."""
    root = Path(run_dir)
    for name in ("config.yaml", "metrics.jsonl", "timeline"):
        if not (root / name).exists():
            raise ConfigError("--calibrate", f"{root} is not a finished gcore-rl run directory: it has no {name}")
    cfg = yaml.safe_load((root / "config.yaml").read_text())
    policy = _model_spec(cfg["model"]["path"], "model.path")
    judge_cfg = cfg.get("judge") or {}
    judge = _model_spec(judge_cfg["model_path"], "judge.model_path") if judge_cfg.get("enabled") else None
    metrics = {row["step"]: row for row in map(json.loads, (root / "metrics.jsonl").read_text().splitlines())}
    seconds = _phase_seconds(root / "timeline")
    splits = _splits(root / "lengths")
    # an evaluation at the end of a step is timed under that step but not counted in its work: skip those steps
    samples = [StepSample(step, seconds.get(step, {}), {k: v for k, v in row.items() if k.startswith("work/") and v is not None},
                          {k: row[k] for k in BALANCE_KEYS if row.get(k) is not None}, splits.get(step, []))
               for step, row in sorted(metrics.items()) if step > 1 and "eval/accuracy" not in row]
    if len(samples) < 2:
        raise ConfigError("--calibrate", f"{root} has {len(samples) + 1} step(s); calibration needs at least 3 "
                          "(step 1 is left out, and the held-out check needs odd and even steps)")
    if not any(s.work for s in samples):
        raise ConfigError("--calibrate", f"{root}/metrics.jsonl has no work/<role>/<count> counters; "
                          "the run predates them, so run it again with this version")
    return RunTelemetry(str(root), policy, judge, int(cfg.get("train", {}).get("ppo_epochs", 1)),
                        float(judge_cfg.get("added_seconds_per_sample", 0.0) or 0.0), samples)


def _model_spec(path: str, key: str) -> ModelSpec:
    return model_spec_from_folder(path, "--calibrate", f" (the run's {key}); calibrate from the directory the run was started in")


def _splits(folder: Path) -> dict[int, list[tuple[list[int], int]]]:
    """Per step, every controller's (trained rows' tokens, trainer groups) from `lengths/` (empty when absent)."""
    out: dict[int, list[tuple[list[int], int]]] = defaultdict(list)
    for path in sorted(folder.glob("controller-*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[int(record["step"])].append(([int(t) for t in record["tokens"]], int(record["groups"])))
    return out


def _phase_seconds(timeline: Path) -> dict[int, dict[str, float]]:
    """Per step, the mean over devices (that did the phase) of each phase's seconds."""
    per_device: dict[tuple[int, int, str], float] = defaultdict(float)
    for path in sorted(timeline.glob("device-*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            for phase, whats in PHASE_EVENTS.items():
                if event["what"] in whats:
                    per_device[(event["step"], event["device"], phase)] += event["end"] - event["start"]
    grouped: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (step, _, phase), value in per_device.items():
        grouped[step][phase].append(value)
    return {step: {phase: sum(v) / len(v) for phase, v in phases.items()} for step, phases in grouped.items()}


# ---------------------------------------------------------------------------------------- fitting

NUMERIC_TOL = float(np.sqrt(np.finfo(np.float64).eps))
"""Smallest independent part (relative to its norm) a column must keep after projecting out the
columns fitted before it: below sqrt(eps) the split between them would be rounding error, amplified
by more than 1 / sqrt(eps), and would depend on the BLAS and the CPU."""

OUTLIER_MADS = 4.0
"""A step whose residual lies further than this many median absolute deviations from the median
residual is left out of the refit (another process stalled it on a shared machine)."""

ENGINE_CONSTANTS = ("decode_mfu", "prefill_mfu", "step_overhead_s", "layer_overhead_s")
LINEAR_CONSTANTS = {
    "prepare": ("logprob_mfu", "pass_overhead_s"),
    "train": ("train_mfu", "train_pass_overhead_s", "optimizer_step_s"),
    "sync": ("sync_overhead_s",),
    "swap": ("engine_wake_s",),
}
"""The constants each phase fits, in priority order: when the telemetry cannot tell two of them
apart, the earlier one is fitted and the later one is held (at `base`). FLOP terms come first: their
defaults are GPU figures, while the overheads they are confused with default to 0 (or 3 ms per
forward), so holding an overhead never claims more time than was measured."""

NEEDS = {
    "decode_mfu": "compute-bound decode steps whose batch (generated tokens per decode step) varies",
    "prefill_mfu": "prompt tokens that vary independently of the number of forwards and generated tokens",
    "step_overhead_s": "forward counts that vary independently of the tokens they process",
    "layer_overhead_s": "engines of two depths (a judge with another layer count than the policy)",
    "logprob_mfu": "re-scored tokens that vary independently of the forward micro-batches",
    "pass_overhead_s": "forward micro-batch counts that vary independently of the re-scored tokens",
    "train_mfu": "trained tokens that vary independently of micro-batches and optimiser steps",
    "train_pass_overhead_s": "micro-batch counts that vary independently of trained tokens and optimiser steps",
    "optimizer_step_s": "optimiser-step counts that vary independently of micro-batches and trained tokens",
    "sync_overhead_s": "a step with a weight sync",
    "engine_wake_s": "a step with an engine wake",
}
"""What telemetry each fitted constant needs to be identifiable (named when it is held)."""


@dataclass(frozen=True)
class ConstantFit:
    """How calibration set one constant: fitted to the telemetry, or held at its prior (`base`).

    `standard_error` is the fitted value's standard error (residual spread x conditioning), NaN when
    held or when no step is left over to estimate the spread; `note` says which phases fitted it,
    or why it was held and what telemetry would identify it.
    """

    name: str
    value: float
    fitted: bool
    standard_error: float
    note: str


@dataclass(frozen=True)
class Calibration:
    """Fitted constants (on all steps), how each was set, and the per-phase comparison."""

    hardware: Hardware
    constants: CostConstants
    phases: list[PhaseFit]
    constant_fits: list[ConstantFit]

    @property
    def fitted(self) -> list[str]:
        """Names of the constants the telemetry determined."""
        return [c.name for c in self.constant_fits if c.fitted]

    @property
    def held(self) -> list[str]:
        """Names of the constants held at their prior (not identifiable from this run, or not measured)."""
        return [c.name for c in self.constant_fits if not c.fitted]

    def table(self) -> str:
        """A markdown table of predicted vs measured seconds per phase."""
        lines = ["| phase | measured s | predicted s | error | held-out measured s | held-out predicted s | held-out error |",
                 "|---|---|---|---|---|---|---|"]
        for p in self.phases:
            lines.append(f"| {p.phase} | {p.measured_s:.4f} | {p.predicted_s:.4f} | {p.error:.1%} | "
                         f"{p.held_out_measured_s:.4f} | {p.held_out_predicted_s:.4f} | {p.held_out_error:.1%} |")
        return "\n".join(lines)

    def constants_yaml(self) -> str:
        """The constants as a scenario's `costs:` section, each commented with whether it was fitted or held."""
        lines = ["costs:"]
        for c in self.constant_fits:
            value = yaml.safe_dump(float(f"{c.value:.6g}")).splitlines()[0]
            error = f", standard error {c.standard_error:.2g}" if math.isfinite(c.standard_error) else ""
            lines.append(f"  {c.name}: {value}  # {c.note}{error}" if c.fitted else f"  {c.name}: {value}  # held: {c.note}")
        return "\n".join(lines) + "\n"


def balance_table(run: RunTelemetry) -> str | None:
    """A markdown table of the runtime's split of the rows over the trainer ranks (`BALANCE_KEYS`, median
    over the calibrated steps) beside the simulator's prediction; None when the run does not report them.

    The prediction replays each controller's recorded rows (`lengths/`) through the simulator's own split
    (`phases.split_rows`: `balance_rows` over the simulator's `ModelSpec.sequence_cost`) and averages over
    the controllers, as the run's metric does; it reads n/a for a run that predates that record.
    """
    predicted = _predicted_balance(run)
    lines = []
    for key in BALANCE_KEYS:
        values = [s.balance[key] for s in run.samples if key in s.balance]
        if values:
            guess = f"{predicted[key]:.4f}" if key in predicted else "n/a (no row lengths recorded)"
            lines.append(f"| {key} | {len(values)} | {float(np.median(values)):.4f} | {guess} |")
    if not lines:
        return None
    return "\n".join(["| trainer split | steps | measured (median) | predicted |", "|---|---|---|---|", *lines])


def _predicted_balance(run: RunTelemetry) -> dict[str, float]:
    """Median over the steps with recorded splits of the simulator's imbalance (mean over controllers)."""
    per_step: dict[str, list[float]] = {key: [] for key in BALANCE_KEYS}
    for sample in run.samples:
        if not sample.splits:
            continue
        splits = [split_rows(np.array([tokens], dtype=float), groups, run.policy.sequence_cost)
                  for tokens, groups in sample.splits]
        per_step["train/cost_imbalance"].append(float(np.mean([s.cost_imbalance[0] for s in splits])))
        per_step["train/token_imbalance"].append(float(np.mean([s.token_imbalance[0] for s in splits])))
    return {key: float(np.median(values)) for key, values in per_step.items() if values}


def calibrate(run: RunTelemetry, hardware: Hardware, base: CostConstants | None = None) -> Calibration:
    """Fit the constants on every step and on the odd steps; compare with the measured phases.

    `base` holds the priors: the values of the constants the telemetry cannot determine.
    """
    base = base or CostConstants()
    constants, phases, fits = _fit(run.samples, run, hardware, base)
    odd = [s for s in run.samples if s.step % 2]
    even = [s for s in run.samples if not s.step % 2]
    held_constants, _, _ = _fit(odd, run, hardware, base)
    compared = []
    for phase in phases:
        measured, predicted = _compare(run.samples, run, hardware, constants, phase)
        held_measured, held_predicted = _compare(even, run, hardware, held_constants, phase)
        compared.append(PhaseFit(phase, measured, predicted, held_measured, held_predicted))
    return Calibration(hardware, constants, compared, fits)


@dataclass(frozen=True)
class _Design:
    """One phase's least-squares problem: measured ~ known + columns @ coefficients.

    A column is what its constant multiplies in every step; the coefficient of an overhead is the
    overhead, that of an MFU is 1 / MFU - 1 >= 0 (the term at MFU 1 is part of `known`, so a fitted
    MFU never exceeds 1).
    """

    names: tuple[str, ...]
    columns: np.ndarray
    known: np.ndarray
    measured: np.ndarray


@dataclass(frozen=True)
class _Solution:
    coefficients: np.ndarray  # every column's; a held one at its prior
    keep: np.ndarray  # steps left after dropping outliers
    residual: np.ndarray  # measured - predicted, every step


@dataclass(frozen=True)
class _Separation:
    free: list[int]  # columns the data determine, in priority order
    confounded: dict[int, list[int] | None]  # held column -> the free columns it cannot be told from (None: all zero)


def _coefficient(name: str, value: float) -> float:
    return 1.0 / value - 1.0 if name.endswith("_mfu") else value


def _constant(name: str, coefficient: float) -> float:
    return 1.0 / (1.0 + coefficient) if name.endswith("_mfu") else coefficient


def nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares (`scipy.optimize.nnls`) on columns scaled to unit norm.

    Unweighted, so with a constant column the fitted mean equals the measured mean. A zero column
    gets coefficient 0.
    """
    norms = np.linalg.norm(features, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    solution, _ = scipy.optimize.nnls(features / scale, target)
    return solution / scale


def robust_nnls(features: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`nnls`, refitted once without the steps whose residual lies more than `OUTLIER_MADS` median
    absolute deviations from the median residual (a step slowed by another process on a shared
    machine would otherwise pull every constant). Returns the coefficients and the steps kept."""
    coefficients = nnls(features, target)
    residual = target - features @ coefficients
    deviation = np.abs(residual - np.median(residual))
    floor = 1e-9 * float(np.sqrt(np.mean(target ** 2)))  # a residual this small is rounding: nothing to drop
    keep = deviation <= OUTLIER_MADS * max(float(np.median(deviation)), floor)
    if 2 <= keep.sum() < len(keep):
        return nnls(features[keep], target[keep]), keep
    return coefficients, np.ones(len(target), dtype=bool)


def _solve(design: _Design, prior: np.ndarray, free: Sequence[int], robust: bool = True) -> _Solution:
    """Fit the `free` columns with the others held at their `prior` coefficients (`robust_nnls`, or plain
    `nnls`, which is continuous in the data, for a search to run on)."""
    free = list(free)
    held = [j for j in range(len(design.names)) if j not in free]
    target = design.measured - design.known - design.columns[:, held] @ prior[held]
    coefficients = prior.copy()
    keep = np.ones(len(target), dtype=bool)
    if free:
        if robust:
            coefficients[free], keep = robust_nnls(design.columns[:, free], target)
        else:
            coefficients[free] = nnls(design.columns[:, free], target)
    residual = design.measured - design.known - design.columns @ coefficients
    return _Solution(coefficients, keep, residual)


def _separate(columns: np.ndarray, tol: float) -> _Separation:
    """Which columns (in priority order) the data can tell apart.

    A column is free when, scaled to unit norm, it keeps an independent part larger than `tol` after
    projecting out the free columns before it (Gram-Schmidt in a fixed order: the answer does not
    depend on pivoting); otherwise it is confounded with the free columns that reproduce it (none:
    the noise alone swamps it). An all-zero column multiplies nothing.
    """
    free: list[int] = []
    confounded: dict[int, list[int] | None] = {}
    units = np.zeros_like(columns)
    for j in range(columns.shape[1]):
        norm = float(np.linalg.norm(columns[:, j]))
        if not norm > 0:
            confounded[j] = None
            continue
        units[:, j] = columns[:, j] / norm
        weights = np.zeros(0)
        independent = 1.0
        if free:
            weights, *_ = np.linalg.lstsq(units[:, free], units[:, j], rcond=None)
            independent = float(np.linalg.norm(units[:, j] - units[:, free] @ weights))
        if independent > tol:
            free.append(j)
        else:
            big = np.abs(weights) > 1e-3 * np.abs(weights).max() if free else np.zeros(0, dtype=bool)
            confounded[j] = [free[i] for i in np.flatnonzero(big)]
    return _Separation(free, confounded)


def _tolerance(residual: np.ndarray, explained: np.ndarray, parameters: int) -> float:
    """How independent a column must be for its share of the measured time to be determined.

    A column whose independent part (relative to its norm) is r has a coefficient whose standard
    error, times the column's norm, is sigma / r, sigma being the noise per step (estimated from the
    residual with `parameters` fitted). A column is kept only when that uncertainty is at most half
    of the time the columns explain, |explained|: r >= 2 sigma / |explained|. Never below `NUMERIC_TOL`.
    """
    spare = len(residual) - parameters
    scale = float(np.linalg.norm(explained))
    if spare <= 0 or not scale > 0:
        return NUMERIC_TOL
    sigma = float(np.linalg.norm(residual)) / math.sqrt(spare)
    return max(NUMERIC_TOL, 2.0 * sigma / scale)


def _standard_errors(jacobian: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """Standard errors of the coefficients of the `jacobian`'s columns, heteroscedasticity-consistent (HC3):
    the square roots of the diagonal of (J^T J)^-1 J^T diag(r_i^2 / (1 - h_i)^2) J (J^T J)^-1, h_i the
    leverage of step i. Timing noise grows with a phase's length, so one pooled spread would understate
    the errors of constants that long steps determine. NaN without a step to spare."""
    rows, columns = jacobian.shape
    if columns == 0 or rows <= columns:
        return np.full(columns, math.nan)
    norms = np.linalg.norm(jacobian, axis=0)
    q, r = np.linalg.qr(jacobian / norms)
    leverage = np.clip(np.sum(q ** 2, axis=1), 0.0, 1.0 - 1e-12)
    inverse_r = np.linalg.pinv(r)  # J / norms = Q R, so (J^T J)^-1 J^T = R^-1 Q^T (scaled)
    sandwich = inverse_r @ q.T * (residual / (1.0 - leverage))
    return np.sqrt(np.sum(sandwich ** 2, axis=1)) / norms


@dataclass(frozen=True)
class _PhaseResult:
    """The phases one fit covered and how it set each of their constants."""

    phases: list[str]
    constants: dict[str, ConstantFit]


_Estimate = tuple[dict[int, float], dict[int, float]]  # column -> constant's value, column -> its standard error


def _settle(free: Sequence[int], estimate: Callable[[list[int]], _Estimate]
            ) -> tuple[list[int], _Estimate, dict[int, tuple[float, float]]]:
    """Fit the `free` columns; while some fitted constant's standard error is as large as its value
    (the data cannot tell an overhead from 0, or pin an MFU to better than +-100 %), hold the loosest
    and fit again. Returns the columns left free, their estimate, and the held ones' (value, error)."""
    free = list(free)
    loose: dict[int, tuple[float, float]] = {}
    while True:
        values, errors = estimate(free)
        undetermined = [j for j in free if errors[j] > 0 and errors[j] >= abs(values[j])]
        if not undetermined:
            return free, (values, errors), loose
        j = max(undetermined, key=lambda i: errors[i] / max(abs(values[i]), 1e-300))
        loose[j] = (values[j], errors[j])
        free.remove(j)


def _describe(names: Sequence[str], base: CostConstants, free: Sequence[int], estimate: _Estimate,
              separation: _Separation, loose: dict[int, tuple[float, float]], phases: str) -> dict[str, ConstantFit]:
    """A `ConstantFit` per constant of one phase fit: fitted, or held and why."""
    values, errors = estimate
    out = {}
    for j, name in enumerate(names):
        if j in free:
            out[name] = ConstantFit(name, float(values[j]), True, float(errors[j]), f"fitted on {phases}")
            continue
        if j in loose:
            why = (f"fitted as {loose[j][0]:.3g} with standard error {loose[j][1]:.2g}, as large as the value: "
                   "this telemetry does not determine it")
        elif separation.confounded.get(j) is None:
            why = "multiplies nothing in this telemetry"
        elif partners := [names[i] for i in separation.confounded[j]]:
            why = f"not separable from {', '.join(partners)} in this telemetry"
        else:
            why = "the steps are too few or too noisy to determine it"
        out[name] = ConstantFit(name, float(getattr(base, name)), False, math.nan, f"{why}; needs {NEEDS[name]}")
    return out


def _fit(samples: Sequence[StepSample], run: RunTelemetry, hw: Hardware, base: CostConstants
         ) -> tuple[CostConstants, list[str], list[ConstantFit]]:
    results = [r for r in [_fit_engine(samples, run, hw, base),
                           *(_fit_linear(phase, samples, run, hw, base) for phase in LINEAR_CONSTANTS)] if r]
    settled: dict[str, ConstantFit] = {}
    phases: list[str] = []
    for result in results:
        settled.update(result.constants)
        phases += result.phases
    constants = dataclasses.replace(base, **{name: fit.value for name, fit in settled.items()})
    fits = []
    for name in (f.name for f in dataclasses.fields(CostConstants)):
        why = "no phase of this run measures it" if name not in NEEDS else f"the run has no telemetry with {NEEDS[name]}"
        fits.append(settled.get(name) or ConstantFit(name, float(getattr(base, name)), False, math.nan, why))
    return constants, phases, fits


def _fit_linear(phase: str, samples: Sequence[StepSample], run: RunTelemetry, hw: Hardware, base: CostConstants
                ) -> _PhaseResult | None:
    """Fit one phase whose cost is linear in its coefficients (prepare, train, sync, swap)."""
    names = LINEAR_CONSTANTS[phase]
    rows = [(r, s.seconds[phase]) for s in samples
            if phase in s.seconds and (r := _linear_terms(phase, s, run, hw)) is not None]
    if not rows:
        return None
    design = _Design(names, np.array([r[0][1] for r in rows], dtype=np.float64).reshape(len(rows), len(names)),
                     np.array([r[0][0] for r in rows], dtype=np.float64), np.array([r[1] for r in rows], dtype=np.float64))
    prior = np.array([_coefficient(n, getattr(base, n)) for n in names])
    numeric = _separate(design.columns, NUMERIC_TOL)
    first = _solve(design, prior, numeric.free)
    explained = (design.measured - design.known)[first.keep]
    separation = _separate(design.columns[first.keep],
                           _tolerance(first.residual[first.keep], explained, len(numeric.free)))

    def estimate(free: list[int]) -> _Estimate:
        solution = _solve(design, prior, free)
        errors = _standard_errors(design.columns[solution.keep][:, free], solution.residual[solution.keep])
        coefficients = {j: float(solution.coefficients[j]) for j in free}
        return ({j: _constant(names[j], x) for j, x in coefficients.items()},
                {j: _constant_error(names[j], coefficients[j], e) for j, e in zip(free, errors, strict=True)})

    free, fitted, loose = _settle(separation.free, estimate)
    return _PhaseResult([phase], _describe(names, base, free, fitted, separation, loose, phase))


def _constant_error(name: str, coefficient: float, error: float) -> float:
    """A coefficient's standard error carried to its constant (MFU = 1 / (1 + x): dMFU = dx / (1 + x)^2)."""
    return error / (1.0 + coefficient) ** 2 if name.endswith("_mfu") else error


def _linear_terms(phase: str, sample: StepSample, run: RunTelemetry, hw: Hardware) -> tuple[float, list[float]] | None:
    """(known seconds, columns) of one step of a linear phase, None when the step has no such work."""
    w, n, peak = sample.work, run.policy.params, hw.peak_flops
    if phase == "prepare" and "work/actor/prepare_tokens" in w:
        compute = 2 * n * w["work/actor/prepare_tokens"] * sample.slowest_rank / peak
        return compute, [compute, w.get("work/actor/prepare_micro_batches", 0.0)]
    if phase == "train" and "work/actor/tokens" in w:
        compute = 6 * n * run.ppo_epochs * w["work/actor/tokens"] * sample.slowest_rank / peak
        return compute, [compute, w.get("work/actor/micro_batches", 0.0), w.get("work/actor/optimiser_steps", 0.0)]
    if phase == "sync" and "work/sync/bytes" in w:
        return w["work/sync/bytes"] / hw.interconnect_bandwidth, [1.0]
    if phase == "swap" and ("work/swap/wakes" in w or "work/swap/sleeps" in w):
        return 2 * w.get("work/swap/released_bytes", 0.0) / hw.host_link_bandwidth, [w.get("work/swap/wakes", 0.0)]
    return None


DECODE_MFU_GRID = np.logspace(-5, 0, 41)
"""Where the decode MFU search starts (it enters through max(memory, compute), not linearly); the
best grid point is refined by a bounded scalar search between its neighbours."""


def _fit_engine(samples: Sequence[StepSample], run: RunTelemetry, hw: Hardware, base: CostConstants
                ) -> _PhaseResult | None:
    """Fit the engine constants on the generate and judge phases together (policy and judge share one engine).

    The decode MFU is searched (grid, then refined); for each trial the linear constants are fitted.
    Which constants are free is decided at the first search's optimum, with the decode MFU's column
    being d(predicted seconds) / d(ln MFU); the search is then repeated with only those free.
    """
    keys = [(s, phase, role, model) for s in samples
            for phase, role, model in (("generate", "rollout", run.policy), ("judge", "judge", run.judge))
            if phase in s.seconds and model is not None and f"work/{role}/decode_steps" in s.work]
    if not keys:
        return None
    names = ENGINE_CONSTANTS[1:]
    columns = np.array([_engine_terms(s.work, role, model, hw, base)[1] for s, _, role, model in keys])
    measured = np.array([s.seconds[phase] for s, phase, _, _ in keys])
    added = np.array([run.judge_added_s_per_sample * s.work.get("work/judge/samples", 0.0) if phase == "judge" else 0.0
                      for s, phase, _, _ in keys])
    other = added + columns[:, 0]  # prefill at MFU 1; the fit adds the excess
    prior = np.array([_coefficient(n, getattr(base, n)) for n in names])

    def decode(mfu: float) -> np.ndarray:
        c = dataclasses.replace(base, decode_mfu=mfu)
        return np.array([_engine_terms(s.work, role, model, hw, c)[0] for s, _, role, model in keys])

    def design(mfu: float) -> _Design:
        return _Design(names, columns, other + decode(mfu), measured)

    def sensitivity(mfu: float, h: float = 1e-4) -> np.ndarray:
        """-d(decode seconds) / d(ln MFU), by central difference."""
        return (decode(mfu * math.exp(-h)) - decode(mfu * math.exp(h))) / (2 * h)

    def loss(log_mfu: float, free: Sequence[int]) -> float:
        residual = _solve(design(math.exp(log_mfu)), prior, free, robust=False).residual
        return float(np.sum(np.minimum(residual ** 2, 16 * np.median(residual ** 2))))  # outliers capped, not dropped

    numeric = _separate(columns, NUMERIC_TOL)
    mfu = _search(lambda x: loss(x, numeric.free))
    first = _solve(design(mfu), prior, numeric.free)
    explained = (measured - other)[first.keep]  # what the decode term and the fitted columns account for
    separation = _separate(np.column_stack([sensitivity(mfu), columns])[first.keep],
                           _tolerance(first.residual[first.keep], explained, len(numeric.free) + 1))

    def estimate(free: list[int]) -> _Estimate:
        linear = [j - 1 for j in free if j > 0]
        decode_free = 0 in free
        mfu = _search(lambda x: loss(x, linear)) if decode_free else base.decode_mfu
        solution = _solve(design(mfu), prior, linear)
        rows = solution.keep
        jacobian = np.column_stack([sensitivity(mfu)[rows][:, None]] * decode_free + [columns[rows][:, linear]])
        errors = list(_standard_errors(jacobian, solution.residual[rows]))
        values, constant_errors = {}, {}
        if decode_free:
            values[0], constant_errors[0] = mfu, mfu * errors.pop(0)  # the column is per ln MFU
        for j, error in zip(linear, errors, strict=True):
            x = float(solution.coefficients[j])
            values[j + 1], constant_errors[j + 1] = _constant(names[j], x), _constant_error(names[j], x, error)
        return values, constant_errors

    free, fitted, loose = _settle(separation.free, estimate)
    phases = [p for p in ("generate", "judge") if any(phase == p for _, phase, _, _ in keys)]
    return _PhaseResult(phases, _describe(ENGINE_CONSTANTS, base, free, fitted, separation, loose, ", ".join(phases)))


def _search(loss: Callable[[float], float]) -> float:
    """The decode MFU minimising `loss(ln MFU)`: the best point of `DECODE_MFU_GRID`, refined between its neighbours."""
    grid = np.log(DECODE_MFU_GRID)
    values = [loss(float(x)) for x in grid]
    best = int(np.argmin(values))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    refined = scipy.optimize.minimize_scalar(loss, bounds=(low, high), method="bounded", options={"xatol": 1e-10})
    x = float(refined.x) if refined.fun < values[best] else float(grid[best])
    return float(math.exp(x))


def _engine_terms(work: dict, role: str, model: ModelSpec, hw: Hardware, c: CostConstants) -> tuple[float, list[float]]:
    """Decode roofline seconds (fixed costs excluded) and the linear columns
    [prefill seconds at MFU 1, forwards (decode steps + prefills), forwards x layers]."""
    steps = work[f"work/{role}/decode_steps"]
    tokens = work.get(f"work/{role}/tokens", 0.0)
    prefill_tokens = work.get(f"work/{role}/prefill_tokens", 0.0)
    active = tokens / steps if steps > 0 else 0.0
    # KV tokens each sequence starts with: the prefill width, i.e. prefilled tokens per prefilled row where
    # the run counts rows; older runs count only prefill forwards, which overstates it by the rows per forward
    rows = work.get(f"work/{role}/prefill_rows") or work.get(f"work/{role}/prefills", 1.0)
    prompt = prefill_tokens / max(rows, 1.0)
    no_overhead = dataclasses.replace(c, step_overhead_s=0.0, layer_overhead_s=0.0)
    decode, _ = cost.decode_segment_seconds(0.0, steps, active, active * prompt, model, hw, no_overhead)
    prefill = float(cost.prefill_seconds(prefill_tokens, model, hw, dataclasses.replace(c, prefill_mfu=1.0)))
    forwards = steps + work.get(f"work/{role}/prefills", 0.0)
    return float(decode), [prefill, forwards, forwards * model.layers]


def predict(sample: StepSample, phase: str, run: RunTelemetry, hw: Hardware, c: CostConstants) -> float | None:
    """Predicted seconds of `phase` in one step from its work and the constants (None without work)."""
    w = sample.work
    if phase in ("generate", "judge"):
        role, model = ("rollout", run.policy) if phase == "generate" else ("judge", run.judge)
        if model is None or f"work/{role}/decode_steps" not in w:
            return None
        decode, (prefill, forwards, layer_forwards) = _engine_terms(w, role, model, hw, c)
        extra = run.judge_added_s_per_sample * w.get("work/judge/samples", 0.0) if phase == "judge" else 0.0
        return decode + forwards * c.step_overhead_s + layer_forwards * c.layer_overhead_s + prefill / c.prefill_mfu + extra
    if phase == "prepare" and "work/actor/prepare_tokens" in w:
        return float(cost.logprob_seconds(w["work/actor/prepare_tokens"] * sample.slowest_rank, run.policy, hw, c, devices=1,
                                          micro_batches=w.get("work/actor/prepare_micro_batches", 0.0)))
    if phase == "train" and "work/actor/tokens" in w:
        return float(cost.train_seconds(w["work/actor/tokens"] * sample.slowest_rank, run.policy, hw, c, devices=1,
                                        epochs=run.ppo_epochs,
                                        micro_batches=w.get("work/actor/micro_batches", 0.0),
                                        optimiser_steps=w.get("work/actor/optimiser_steps", 0.0)))
    if phase == "sync" and "work/sync/bytes" in w:
        return c.sync_overhead_s + w["work/sync/bytes"] / hw.interconnect_bandwidth
    if phase == "swap" and ("work/swap/wakes" in w or "work/swap/sleeps" in w):
        return w.get("work/swap/wakes", 0.0) * c.engine_wake_s + 2 * w.get("work/swap/released_bytes", 0.0) / hw.host_link_bandwidth
    return None


def _compare(samples, run, hw, c, phase) -> tuple[float, float]:
    pairs = [(s.seconds[phase], p) for s in samples if phase in s.seconds
             and (p := predict(s, phase, run, hw, c)) is not None]
    if not pairs:
        return math.nan, math.nan
    measured, predicted = zip(*pairs, strict=True)
    return float(np.median(measured)), float(np.median(predicted))


def resolve_hardware(name: str) -> Hardware:
    """A hardware preset by name (`cpu` for this project's CPU runs), as `--hardware` takes it."""
    if name not in HARDWARE:
        raise ConfigError("--hardware", f"unknown hardware '{name}'; presets are {', '.join(sorted(HARDWARE))}")
    return HARDWARE[name]
