"""Moving devices between the controllers' slices: dynamic placement's finer move across slices (simulator).

Every slice holds D devices and the step waits for the slowest slice's rollout. When one
controller's shard is persistently heavier (another task, longer answers), a device moved from a
light slice to the heavy one shortens the step; when the slowest slice is only the one that drew
the longest answers this step, a move made after the step helps the next no more than chance.

The policy (`plan_move`, pure): after every step each controller replays its own counted work on
one device fewer and one more than it holds (`slice_seconds`: the simulator's phase model, each
size at its best split) and the slices share these tables (they are all-reduced like the rest of
the rebalancer's figures). Averaged over the last `window` steps, a persistent imbalance remains
and noise shrinks. The move that helps the slowest slice most is taken only if that slice was the
slowest in most of those steps and the move's predicted saving per step, over `horizon` steps,
exceeds what it costs (`move_seconds`: the device's engine changes
slice and both slices' FSDP groups re-shard their training state).

`run` plays the policy over a scenario's steps next to equal slices, on the same work. It is a
study: the trainer keeps equal slices (each slice holds an FSDP group that a move would rebuild).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.rollout import feasible_splits, replay_rollout, wave_move_seconds
from gcore_rl.costmodel.work import StepWork
from gcore_rl.sim.scenario import Scenario, resolve_job
from gcore_rl.sim.simulator import workload_steps
from gcore_rl.sim.strategies import slices_of


@dataclass(frozen=True)
class SliceMoveSettings:
    """How the policy decides (`plan_move`)."""

    window: int = 4  # steps of replayed work averaged into the prediction (>= 2: the standard error needs two)
    horizon: int = 5  # steps a move must pay for itself within
    spread: int = 2  # most moves a slice may gain or lose against its D devices
    persistence: float = 1.0  # share of the window's steps in which the receiver must have been the slowest slice

    def __post_init__(self) -> None:
        if self.window < 2 or self.horizon < 1 or self.spread < 0 or not 0 < self.persistence <= 1:
            raise ValueError(f"need window >= 2, horizon >= 1, spread >= 0 and persistence in (0, 1], got {self}")


@dataclass(frozen=True)
class SliceMove:
    """One unit of devices (an engine's worth: the lcm of the policy's and the judge's tp) moved from
    slice `donor` to slice `receiver` for the next step."""

    donor: int
    receiver: int
    saving_s: float  # seconds per step the move would have saved, mean over the window's steps
    bound_s: float  # ... one standard error below the mean (what the move is judged on)
    move_s: float  # what the move costs the step it happens in


def move_seconds(job: Job) -> float:
    """A device changing slice: its engine loads the policy from host and wakes (`wave_move_seconds`:
    it was not synced in its new slice), while both slices re-shard their FSDP training state over
    the network (each device receives about its new shard, state / D bytes)."""
    state = job.policy.params * job.costs.trainer_state_bytes_per_param
    return wave_move_seconds(job) + state / job.slice_devices / job.hardware.network_bandwidth


def slice_seconds(job: Job, work: StepWork, k: int, sizes: Sequence[int]) -> dict[int, float]:
    """Slice k's rollout phase of `work` alone on n devices, for each n of `sizes`, at n's best split
    (every device generates when the job has no judge)."""
    single, one = slices_of(job, work, [k])
    out = {}
    for n in sizes:
        sub = dataclasses.replace(single, gpus=n)
        out[n] = min(replay_rollout(sub, one, feasible_splits(sub) if job.judge is not None else [n]).values())
    return out


Tables = Sequence[Mapping[int, float]]  # per slice: rollout seconds of one step's work on n devices


def step_seconds(tables: Tables, sizes: Sequence[int]) -> float | None:
    """The step's rollout phase (its slowest slice) with slice k on `sizes[k]` devices; None where a table lacks a size."""
    if any(n not in table for table, n in zip(tables, sizes, strict=True)):
        return None
    return max(table[n] for table, n in zip(tables, sizes, strict=True))


def plan_move(recent: Sequence[Tables], sizes: Sequence[int], settings: SliceMoveSettings, move_s: float,
              unit: int = 1, remaining: int | None = None) -> SliceMove | None:
    """The move for the next step, if any: `unit` devices to the slowest slice from the slice whose
    loss of them leaves the shortest step.

    `recent`: the last steps' tables, oldest first (`recent[t][k][n]`: slice k's rollout seconds of
    step t's work on n devices). A configuration's predicted step is the mean over the last
    `settings.window` steps of each step's slowest slice (the mean of a maximum, so the noise of
    which slice drew the longest answers counts against a move instead of for it). Taken only if
    the receiver was the slowest slice in at least `settings.persistence` of those steps (a
    heavier shard, not one step's luck), every one of them has the sizes the move needs, and the
    saving per step (the window's per-step savings, their mean less one standard error) times the
    horizon (`settings.horizon`, or the `remaining` steps of the run if fewer) exceeds `move_s`.

    A step's table holds only the sizes around the sizes it ran with, so after a move the next one
    waits until `settings.window` steps have the new neighbours (a cool-down of `window` steps)."""
    window = list(recent[-settings.window:])
    if len(window) < settings.window:
        return None
    K = len(sizes)
    if any(sizes[k] not in t[k] for t in window for k in range(K)):
        return None
    slowest = [max(range(K), key=lambda k, t=t: t[k][sizes[k]]) for t in window]
    receiver = max(range(K), key=slowest.count)  # ties: the lowest index
    if slowest.count(receiver) < settings.persistence * settings.window:
        return None

    def per_step(config: Sequence[int]) -> np.ndarray | None:
        steps = [step_seconds(t, config) for t in window]
        return None if any(x is None for x in steps) else np.asarray(steps, dtype=np.float64)

    now = per_step(sizes)
    if now is None:
        return None
    options: dict[int, np.ndarray] = {}
    for donor in range(K):
        if donor != receiver:
            config = list(sizes)
            config[receiver] += unit
            config[donor] -= unit
            if (after := per_step(config)) is not None:
                options[donor] = now - after
    if not options:
        return None
    donor = max(options, key=lambda k: float(options[k].mean()))
    gains = options[donor]  # [window] seconds the move would have saved in each of the last steps
    # one standard error below the mean: a saving the window's noise could explain does not count
    bound = float(gains.mean() - (gains.std(ddof=1) / np.sqrt(len(gains)) if len(gains) > 1 else 0.0))
    horizon = settings.horizon if remaining is None else min(settings.horizon, remaining)
    if bound * horizon <= move_s:
        return None
    return SliceMove(donor=donor, receiver=receiver, saving_s=float(gains.mean()), bound_s=bound, move_s=move_s)


@dataclass
class SliceMoveRun:
    """Per step, the slowest slice's rollout phase with equal slices and under the policy (its move's
    cost included in the step it happens in), the slice sizes each step ran with, and the moves."""

    equal_s: list[float] = field(default_factory=list)
    moved_s: list[float] = field(default_factory=list)
    sizes: list[tuple[int, ...]] = field(default_factory=list)
    moves: list[SliceMove | None] = field(default_factory=list)

    @property
    def saving(self) -> float:
        """The policy's rollout phase over the run against equal slices (-0.02: 2 % shorter)."""
        return sum(self.moved_s) / sum(self.equal_s) - 1.0


def run(scenario: Scenario, settings: SliceMoveSettings = SliceMoveSettings()) -> SliceMoveRun:
    """The policy over the scenario's steps, next to equal slices on the same work."""
    job = resolve_job(scenario)
    D, K, u = job.slice_devices, job.controllers, job.rebalance.unit
    smallest = job.policy_tp + (job.judge_tp if job.judge is not None else 0)  # one engine of each
    reach = {D + i * u for i in range(-settings.spread, settings.spread + 1) if D + i * u >= smallest}
    sizes, pending = [D] * K, 0.0
    recent: list[list[dict[int, float]]] = []
    out = SliceMoveRun()
    for step, work in enumerate(workload_steps(scenario)):
        near = [{n for n in (sizes[k] - u, sizes[k], sizes[k] + u) if n in reach} for k in range(K)]
        tables = [slice_seconds(job, work, k, sorted(near[k] | {D})) for k in range(K)]
        out.equal_s.append(max(t[D] for t in tables))
        out.moved_s.append(max(tables[k][sizes[k]] for k in range(K)) + pending)
        out.sizes.append(tuple(sizes))
        recent = [*recent, tables][-settings.window:]
        move = plan_move(recent, sizes, settings, move_seconds(job), u, scenario.steps - step - 1)
        out.moves.append(move)
        pending = 0.0
        if move is not None:
            sizes[move.donor] -= u
            sizes[move.receiver] += u
            pending = move.move_s
    return out

