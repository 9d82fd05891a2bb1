"""Calibration: fit the simulator's cost constants to a real run and compare predicted with measured phases.

A `gcore-rl train` run leaves, per step, how long every device spent in each phase
(`timeline/device-<d>.jsonl`) and how much work it did there (`work/<role>/<count>` in
`metrics.jsonl`: decode steps, prefilled and generated tokens, trained tokens, micro-batches,
synced bytes, swaps). Calibration prices that work with the cost formulas of `gcore_rl.sim.cost`
and fits the constants the formulas leave open (`CostConstants`), phase by phase:

| phase | measured (per device and step) | formula fitted |
|---|---|---|
| generate, judge | `rollout/generate`, `rollout/judge` | forwards (decode steps + prefills) x (step_overhead_s + layers x layer_overhead_s) + decode roofline(decode_mfu) + prefill(prefill_mfu); policy and judge share the constants (one engine) |
| prepare | `update/prepare` | forward micro-batches x pass_overhead_s + 2 N tokens / (logprob_mfu peak) |
| train | `update/train` | micro-batches x train_pass_overhead_s + optimiser steps x optimizer_step_s + 6 N tokens / (train_mfu peak) |
| sync | `update/sync` | sync_overhead_s + bytes / link |
| swap | `swap/sleep` + `swap/wake` | wakes x engine_wake_s + released bytes x 2 / host link (out and back) |

Each fit is a small non-negative least-squares problem in the constants that enter linearly
(overheads, and 1 / MFU − 1, so a fitted MFU stays at most 1), refitted once without outlying steps (more than 4 median absolute deviations
off: on a shared machine another process can stall a step); the decode MFU enters through a
max(memory, compute) roofline and is found by a search over a log grid. Step 1 is left out (first
allocations), and so are steps that ended with an evaluation (its generation is timed under the
step but is not part of the step's work counters). The report gives, per phase, the median over steps of the measured and predicted
seconds with the constants fitted on every step, and again with constants fitted on the odd steps
and evaluated on the even ones (held out).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from gcore_rl.errors import ConfigError
from gcore_rl.sim import cost
from gcore_rl.sim.cost import CostConstants
from gcore_rl.sim.hardware import HARDWARE, Hardware
from gcore_rl.sim.models import ModelSpec

PHASE_EVENTS = {
    "generate": ("rollout/generate",),
    "judge": ("rollout/judge",),
    "prepare": ("update/prepare",),
    "train": ("update/train",),
    "sync": ("update/sync", "rollout/load_weights"),
    "swap": ("swap/sleep", "swap/wake"),
}
"""Timeline events that make up each calibrated phase."""

DECODE_MFU_GRID = np.logspace(-5, 0, 41)


@dataclass(frozen=True)
class StepSample:
    """What one device did in one phase of one step, on average over the devices that did it.

    `seconds` is measured; `work` holds the `work/<role>/<count>` counters of the step.
    """

    step: int
    seconds: dict[str, float]
    work: dict[str, float]


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


@dataclass(frozen=True)
class Calibration:
    """Fitted constants (on all steps) and the per-phase comparison."""

    hardware: Hardware
    constants: CostConstants
    phases: list[PhaseFit]

    def table(self) -> str:
        """A markdown table of predicted vs measured seconds per phase."""
        lines = ["| phase | measured s | predicted s | error | held-out measured s | held-out predicted s | held-out error |",
                 "|---|---|---|---|---|---|---|"]
        for p in self.phases:
            lines.append(f"| {p.phase} | {p.measured_s:.4f} | {p.predicted_s:.4f} | {p.error:.1%} | "
                         f"{p.held_out_measured_s:.4f} | {p.held_out_predicted_s:.4f} | {p.held_out_error:.1%} |")
        return "\n".join(lines)

    def constants_yaml(self) -> str:
        """The fitted constants as a scenario's `costs:` section."""
        values = {k: float(f"{float(v):.6g}") for k, v in dataclasses.asdict(self.constants).items()}
        return yaml.safe_dump({"costs": values}, sort_keys=False)


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
    # an evaluation at the end of a step is timed under that step but not counted in its work: skip those steps
    samples = [StepSample(step, seconds.get(step, {}), {k: v for k, v in row.items() if k.startswith("work/") and v is not None})
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
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError("--calibrate", f"the run's {key} ({path}) has no config.json to read the model's shape from; "
                          "calibrate from the directory the run was started in")
    return ModelSpec.from_hf_config(json.loads(config.read_text()), name=Path(path).name)


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


def robust_nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """`nnls`, refitted once without the steps whose residual lies more than 4 MADs from the median
    residual (a step slowed by another process on a shared machine would otherwise pull every constant)."""
    coef = nnls(features, target)
    residual = target - features @ coef
    spread = np.median(np.abs(residual - np.median(residual)))
    keep = np.abs(residual - np.median(residual)) <= 4 * max(spread, 1e-12)
    return nnls(features[keep], target[keep]) if 2 <= keep.sum() < len(keep) else coef


def nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns, by trying every subset of them.

    Unweighted, so with a constant column the fitted mean equals the measured mean.
    """
    a, b = features, target
    best, best_loss = np.zeros(features.shape[1]), float(np.sum(b ** 2))
    for size in range(1, features.shape[1] + 1):
        for cols in itertools.combinations(range(features.shape[1]), size):
            solution, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(solution < 0):
                continue
            full = np.zeros(features.shape[1])
            full[list(cols)] = solution
            loss = float(np.sum((a @ full - b) ** 2))
            if loss < best_loss - 1e-15:
                best, best_loss = full, loss
    return best


@dataclass(frozen=True)
class _Model:
    """One phase's cost as `offset(c) + features @ coefficients`, the coefficients mapping onto constants."""

    phase: str
    rows: Callable[[StepSample], tuple[float, list[float]] | None]  # (known seconds, linear features) or None
    apply: Callable[[np.ndarray, dict], None]  # write the fitted coefficients into the constants' fields


def calibrate(run: RunTelemetry, hardware: Hardware, base: CostConstants | None = None) -> Calibration:
    """Fit the constants on every step and on the odd steps; compare with the measured phases."""
    base = base or CostConstants()
    constants, phases = _fit(run.samples, run, hardware, base)
    odd = [s for s in run.samples if s.step % 2]
    even = [s for s in run.samples if not s.step % 2]
    held_constants, _ = _fit(odd, run, hardware, base)
    fits = []
    for phase in phases:
        measured, predicted = _compare(run.samples, run, hardware, constants, phase)
        held_measured, held_predicted = _compare(even, run, hardware, held_constants, phase)
        fits.append(PhaseFit(phase, measured, predicted, held_measured, held_predicted))
    return Calibration(hardware, constants, fits)


def _fit(samples: Sequence[StepSample], run: RunTelemetry, hw: Hardware, base: CostConstants
         ) -> tuple[CostConstants, list[str]]:
    fields: dict = {}
    phases = []
    best = None
    for mfu in DECODE_MFU_GRID:  # the engine phases: decode MFU by search, the rest linear
        trial = dataclasses.replace(base, decode_mfu=float(mfu))
        rows = _engine_rows(samples, run, hw, trial)
        if not rows:
            break
        known, feats, target = (np.array(x) for x in zip(*rows, strict=True))
        coef = robust_nnls(feats, target - known) if np.any(target - known > 0) else np.zeros(feats.shape[1])
        residual = known + feats @ coef - target
        loss = float(np.sum(np.minimum(residual ** 2, 16 * np.median(residual ** 2))))  # outliers capped
        if best is None or loss < best[0]:
            best = (loss, float(mfu), coef)
    if best is not None:
        _, mfu, (overhead, layer_overhead, prefill_excess) = best
        fields.update(decode_mfu=mfu, step_overhead_s=float(overhead), layer_overhead_s=float(layer_overhead),
                      prefill_mfu=_mfu(prefill_excess))
        phases += [p for p in ("generate", "judge") if any(p in s.seconds for s in samples)]
    constants = dataclasses.replace(base, **fields)
    for model in _linear_models(run, hw):
        rows = [(r, s.seconds[model.phase]) for s in samples if model.phase in s.seconds and (r := model.rows(s)) is not None]
        if not rows:
            continue
        known = np.array([r[0][0] for r in rows])
        feats = np.array([r[0][1] for r in rows])
        target = np.array([r[1] for r in rows])
        coef = robust_nnls(feats, np.maximum(target - known, 0.0))
        model.apply(coef, fields)
        constants = dataclasses.replace(constants, **fields)
        phases.append(model.phase)
    return constants, phases


def _mfu(excess: float) -> float:
    """An MFU from its fitted excess x = 1 / MFU − 1 >= 0 (the fit adds the term at MFU 1 as known time,
    so a fitted MFU never exceeds 1 and predictions use exactly what was fitted)."""
    return float(1.0 / (1.0 + excess))


def _engine_rows(samples: Sequence[StepSample], run: RunTelemetry, hw: Hardware, c: CostConstants):
    """(known seconds, [forwards, forwards x layers, prefill seconds at MFU 1], measured) for the engine phases."""
    rows = []
    for s in samples:
        for phase, role, model in (("generate", "rollout", run.policy), ("judge", "judge", run.judge)):
            if phase not in s.seconds or model is None or f"work/{role}/decode_steps" not in s.work:
                continue
            known, feats = _engine_terms(s.work, role, model, hw, c)
            known += feats[2]  # prefill at MFU 1; the fit adds the excess
            if phase == "judge":
                known += run.judge_added_s_per_sample * s.work.get("work/judge/samples", 0.0)
            rows.append((known, feats, s.seconds[phase]))
    return rows


def _engine_terms(work: dict, role: str, model: ModelSpec, hw: Hardware, c: CostConstants) -> tuple[float, list[float]]:
    """Decode roofline seconds (fixed costs excluded) and the linear features
    [forwards (decode steps + prefills), forwards x layers, prefill seconds at MFU 1]."""
    steps = work[f"work/{role}/decode_steps"]
    tokens = work.get(f"work/{role}/tokens", 0.0)
    prefill_tokens = work.get(f"work/{role}/prefill_tokens", 0.0)
    active = tokens / steps if steps > 0 else 0.0
    prompt = prefill_tokens / max(work.get(f"work/{role}/prefills", 1.0), 1.0)
    no_overhead = dataclasses.replace(c, step_overhead_s=0.0, layer_overhead_s=0.0)
    decode, _ = cost.decode_segment_seconds(0.0, steps, active, active * prompt, model, hw, no_overhead)
    prefill = float(cost.prefill_seconds(prefill_tokens, model, hw, dataclasses.replace(c, prefill_mfu=1.0)))
    forwards = steps + work.get(f"work/{role}/prefills", 0.0)
    return float(decode), [forwards, forwards * model.layers, prefill]


def _linear_models(run: RunTelemetry, hw: Hardware) -> list[_Model]:
    n = run.policy.params
    peak = hw.peak_flops

    def prepare(s: StepSample):
        if "work/actor/prepare_tokens" not in s.work:
            return None
        compute = 2 * n * s.work["work/actor/prepare_tokens"] / peak
        return compute, [s.work.get("work/actor/prepare_micro_batches", 0.0), compute]

    def set_prepare(coef, fields):
        fields.update(pass_overhead_s=float(coef[0]), logprob_mfu=_mfu(coef[1]))

    def train(s: StepSample):
        if "work/actor/tokens" not in s.work:
            return None
        compute = 6 * n * run.ppo_epochs * s.work["work/actor/tokens"] / peak
        return compute, [s.work.get("work/actor/micro_batches", 0.0), s.work.get("work/actor/optimiser_steps", 0.0), compute]

    def set_train(coef, fields):
        fields.update(train_pass_overhead_s=float(coef[0]), optimizer_step_s=float(coef[1]), train_mfu=_mfu(coef[2]))

    def sync(s: StepSample):
        if "work/sync/bytes" not in s.work:
            return None
        return s.work["work/sync/bytes"] / hw.interconnect_bandwidth, [1.0]

    def set_sync(coef, fields):
        fields.update(sync_overhead_s=float(coef[0]))

    def swap(s: StepSample):
        if "work/swap/wakes" not in s.work and "work/swap/sleeps" not in s.work:
            return None
        moved = s.work.get("work/swap/released_bytes", 0.0)
        return 2 * moved / hw.host_link_bandwidth, [s.work.get("work/swap/wakes", 0.0)]

    def set_swap(coef, fields):
        fields.update(engine_wake_s=float(coef[0]))

    return [_Model("prepare", prepare, set_prepare), _Model("train", train, set_train),
            _Model("sync", sync, set_sync), _Model("swap", swap, set_swap)]


def predict(sample: StepSample, phase: str, run: RunTelemetry, hw: Hardware, c: CostConstants) -> float | None:
    """Predicted seconds of `phase` in one step from its work and the constants (None without work)."""
    w = sample.work
    if phase in ("generate", "judge"):
        role, model = ("rollout", run.policy) if phase == "generate" else ("judge", run.judge)
        if model is None or f"work/{role}/decode_steps" not in w:
            return None
        decode, (forwards, layer_forwards, prefill) = _engine_terms(w, role, model, hw, c)
        extra = run.judge_added_s_per_sample * w.get("work/judge/samples", 0.0) if phase == "judge" else 0.0
        return decode + forwards * c.step_overhead_s + layer_forwards * c.layer_overhead_s + prefill / c.prefill_mfu + extra
    if phase == "prepare" and "work/actor/prepare_tokens" in w:
        return float(cost.logprob_seconds(w["work/actor/prepare_tokens"], run.policy, hw, c, devices=1,
                                          micro_batches=w.get("work/actor/prepare_micro_batches", 0.0)))
    if phase == "train" and "work/actor/tokens" in w:
        return float(cost.train_seconds(w["work/actor/tokens"], run.policy, hw, c, devices=1, epochs=run.ppo_epochs,
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
