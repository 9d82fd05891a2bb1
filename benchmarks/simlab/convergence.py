"""Does dynamic placement find the best split from any start? A fixed sweep in the simulator.

One *cell* is a scenario (GPUs, judge size, response-length tail) and a starting split. For each
scenario every static split is simulated (`partial` at R = 1 .. D - 1 rollout devices per slice,
every one on the same work), and `dynamic` is run from each start. A cell is judged on how the
run *ends*: the mean step time over its last `tail_steps` steps, against the same steps of

- the best static split (the fastest over the exhaustive search), which it must come within
  `tolerance` of, and
- the static split it started from, which it must never end slower than.

`settled_step` is the first step from which dynamic's split no longer changed (how many steps it
took). The sweep the project ships (`CELLS`) is what `docs/simulator-findings.md` reports and the `slow`
test `tests/sim/test_convergence.py` checks; `benchmarks/dynamic_sweep.py` writes the table and
the heat map.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gcore_rl.sim.results import SimResult
from gcore_rl.sim.scenario import Scenario, load_scenario, resolve_job
from gcore_rl.sim.simulator import simulate, workload_steps

#: judge models by size relative to the 7B policy (Qwen2.5 shapes; 32B on two devices per engine)
JUDGES: dict[str, tuple[str, ...]] = {
    "0.5x": ("models.judge.preset=Qwen2.5-3B", "models.judge.tp=1"),
    "1x": ("models.judge.preset=Qwen2.5-7B", "models.judge.tp=1"),
    "2x": ("models.judge.preset=Qwen2.5-14B", "models.judge.tp=1"),
    "4x": ("models.judge.preset=Qwen2.5-32B", "models.judge.tp=2"),
}

#: response-length tails: the base scenario's, and a longer one (larger log-normal sigma, 16k cap)
TAILS: dict[str, tuple[str, ...]] = {
    "base": (),
    "long": ("workload.response_tokens.sigma=1.1", "workload.response_tokens.max=16384"),
}

#: cluster sizes: one 16-GPU slice; eight 8-GPU slices; 64 8-GPU slices (prompts scaled with the GPUs)
SIZES: dict[str, tuple[str, ...]] = {
    "16": ("gpus=16", "controllers=1", "workload.prompts_per_step=128"),
    "64": ("gpus=64", "controllers=8", "workload.prompts_per_step=512"),
    "512": ("gpus=512", "controllers=64", "workload.prompts_per_step=4096"),
}

BASE_SCENARIO = "scenarios/gpus64_judge.yaml"


@dataclass(frozen=True)
class Cell:
    """One scenario of the sweep (its starts are every `Start` of the scenario)."""

    size: str
    judge: str
    tail: str

    def overrides(self) -> list[str]:
        return [*SIZES[self.size], *JUDGES[self.judge], *TAILS[self.tail]]


#: the shipped sweep: 16 and 64 GPUs x every judge x both tails, plus 512-GPU cells at 1x and 4x
CELLS: tuple[Cell, ...] = (
    *(Cell(size, judge, tail) for size in ("16", "64") for judge in JUDGES for tail in TAILS),
    Cell("512", "1x", "base"), Cell("512", "4x", "base"),
)


@dataclass(frozen=True)
class Outcome:
    """Dynamic from one start on one cell, against the exhaustive static search on the same work.

    Times are mean step seconds over the last `tail_steps` steps (`*_all`: over the whole run).
    """

    cell: Cell
    start: int
    slice_devices: int
    splits: tuple[int, ...]
    dynamic_s: float
    best_split: int
    best_s: float
    start_s: float
    dynamic_all_s: float
    best_all_s: float
    settled_step: int

    @property
    def vs_best(self) -> float:
        """Dynamic's end against the best static split (+0.02: 2 % slower)."""
        return self.dynamic_s / self.best_s - 1.0

    @property
    def vs_start(self) -> float:
        """Dynamic's end against staying at the start split (negative: faster)."""
        return self.dynamic_s / self.start_s - 1.0


def _tail_mean(result: SimResult, tail_steps: int) -> float:
    return float(np.mean([r.seconds for r in result.steps[-tail_steps:]]))


def with_split(scenario: Scenario, rollout_devices: int) -> Scenario:
    return dataclasses.replace(scenario, placement=dataclasses.replace(scenario.placement, rollout_devices=rollout_devices))


def feasible_starts(scenario: Scenario) -> list[int]:
    """Every split the engines fit: rollout devices in whole policy engines, judge in whole judge engines."""
    job = resolve_job(scenario)
    D = job.slice_devices
    return [r for r in range(job.policy_tp, D) if r % job.policy_tp == 0 and (D - r) % job.judge_tp == 0]


def run_cell(cell: Cell, base: str = BASE_SCENARIO, tail_steps: int = 5,
             extra: Sequence[str] = ()) -> list[Outcome]:
    """The exhaustive static search and dynamic from the lowest, middle and highest feasible start."""
    scenario = load_scenario(base, [*cell.overrides(), *extra])
    works = workload_steps(scenario)
    splits = feasible_starts(scenario)
    static = {r: simulate(with_split(scenario, r), "partial", works=works) for r in splits}
    tail = {r: _tail_mean(res, tail_steps) for r, res in static.items()}
    best = min(tail, key=tail.get)
    starts = sorted({splits[0], splits[len(splits) // 2], splits[-1]})
    out = []
    for start in starts:
        dyn = simulate(with_split(scenario, start), "dynamic", works=works)
        trace = tuple(int(r.rollout_devices) for r in dyn.steps)
        settled = next(i for i in range(len(trace)) if len(set(trace[i:])) == 1)
        out.append(Outcome(cell=cell, start=start, slice_devices=scenario.slice_devices, splits=trace,
                           dynamic_s=_tail_mean(dyn, tail_steps), best_split=best, best_s=tail[best],
                           start_s=tail[start], dynamic_all_s=dyn.mean_step_seconds,
                           best_all_s=static[best].mean_step_seconds, settled_step=settled))
    return out


def run_sweep(cells: Sequence[Cell] = CELLS, base: str = BASE_SCENARIO, extra: Sequence[str] = ()) -> list[Outcome]:
    return [o for cell in cells for o in run_cell(cell, base, extra=extra)]


def markdown_table(outcomes: Sequence[Outcome]) -> str:
    """One row per cell and start: the split trace, the end against the best and the start split."""
    lines = ["| GPUs | judge | tail | start | splits (first..last) | settled at step | best static | "
             "dynamic end s | best end s | vs best | vs start |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        D = o.slice_devices
        trace = " ".join(str(r) for r in _compress(o.splits))
        lines.append(f"| {o.cell.size} | {o.cell.judge} | {o.cell.tail} | {o.start}+{D - o.start} | {trace} | "
                     f"{o.settled_step} | {o.best_split}+{D - o.best_split} | {o.dynamic_s:.1f} | {o.best_s:.1f} | "
                     f"{o.vs_best:+.1%} | {o.vs_start:+.1%} |")
    return "\n".join(lines)


def _compress(trace: Sequence[int]) -> list[int]:
    """The split trace without repeats (8 8 7 7 6 -> 8 7 6)."""
    return [r for i, r in enumerate(trace) if i == 0 or r != trace[i - 1]]
