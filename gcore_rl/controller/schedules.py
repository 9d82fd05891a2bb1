"""When a controller's rollouts are made relative to its updates: the step schedule, apart from the step.

`run_controller` (controller/loop.py) calls the same `Schedule` methods at the same points of every step;
`schedule_for` picks one of three by the plan's traits and the staleness bound k = `placement.max_staleness`:

- `Synchronous`: step t rolls out with the weights of update t-1, trains, and the sync brings update t
  into the engines. Every plan whose trainers share devices with generation (`colocate`, `partial`,
  `interleave`, `dynamic`).
- `OneStepOff` (`disaggregated`, k = 1): the next rollout is made in the main thread, on the engines'
  old weights, while the trainers update on step t:

      step t:  current = ahead.pop(0) or roll_out(t)         # made with the weights of an earlier step
               start_update(current)                          # the trainers work from here ...
               while len(ahead) < k:                          # ... while the controller rolls out
                   ahead.append(roll_out(next step))          #     up to step t+k, with the weights of t-1
               finish_train; sync_weights(t)

- `Producing` (`disaggregated`, k > 1): a `RolloutProducer` thread (controller/producer.py) makes
  rollout s with exactly the weights of update max(0, s-1-k), which the main thread only publishes
  (`SliceClient.publish`); the trainers start each update as soon as its rollout is queued, and a slow
  rollout stalls them only once the queue has run dry (benchmarks/staleness.py). Evaluations and
  checkpoints first wait until the producer has made every rollout the published versions allow
  (`settle`), so the queue, the data sampler and the engines' weights are those of the schedule.

So every rollout uses the engines' weights when it starts, and the rollout of step s trained at step s
(trainer version s-1) was made with weights of version ≥ s-1-k: no trained sample lags the trainer by
more than k updates (`rollout/staleness_max` ≤ k; after the first k steps it is exactly k). Each schedule
depends on step numbers only, never on timing, so a run is reproducible and an exact resume keeps the
queue (`queued`, saved in the checkpoint and handed back to `schedule_for`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gcore_rl.controller.handles import WorkerHandle
from gcore_rl.controller.producer import RolloutProducer
from gcore_rl.controller.program import ControllerContext, StepRollout
from gcore_rl.controller.slice import SliceClient, reduce_stats
from gcore_rl.telemetry.metrics import PhaseTimer

RollOut = Callable[[int, PhaseTimer], StepRollout]
"""Makes step s's rollout (the rollout phase with that step's seeds), timing its phases on the given timer."""


class Schedule(Protocol):
    """The schedule's part of a step, called by `run_controller` in this order:
    `take` → (the update starts) `during_update` → (it ends) `sync` → `settle` before an evaluation or a
    checkpoint (which saves `queued`) → `step_done`; `stop` on every way out."""

    own: Sequence[WorkerHandle] | None
    """The devices the main thread calls (`begin_step`, utilisation); None: the whole slice."""

    def take(self, step: int) -> StepRollout:
        """The rollout step `step` trains on."""
        ...

    def during_update(self, step: int) -> dict[str, float]:
        """Work done while the trainers update on `step` (rollouts made ahead); its placement metrics."""
        ...

    def sync(self, step: int) -> None:
        """Hand update `step`'s weights to the engines that need them (now, or when their rollout starts)."""
        ...

    def settle(self, step: int) -> None:
        """Bring the rollout devices to a known point: an evaluation or a checkpoint follows."""
        ...

    def queued(self) -> list[StepRollout]:
        """The rollouts made for later steps, in step order (what a checkpoint keeps)."""
        ...

    def step_done(self, step: int) -> None:
        """Step `step` is recorded (and saved): rollouts that need its weights may start."""
        ...

    def devices(self, slice_devices: dict[str, float], rollout: StepRollout) -> dict[str, float]:
        """The slice's device figures of the step from those of `own` (`slice_devices`) and the rollout's."""
        ...

    def stop(self, reraise: bool = True) -> None:
        """End the schedule's work; with `reraise`, raise an error its work had."""
        ...


class Synchronous:
    """Roll out, then train, then sync (see the module docstring). `queue`: rollouts already made for the
    next steps (a resumed run's), taken first."""

    own = None

    def __init__(self, roll_out: RollOut, timer: PhaseTimer, workers: SliceClient, queue: list[StepRollout] = ()):
        self.roll_out = roll_out
        self.timer = timer
        self.workers = workers
        self.queue = list(queue)

    def take(self, step: int) -> StepRollout:
        return self.queue.pop(0) if self.queue else self.roll_out(step, self.timer)

    def during_update(self, step: int) -> dict[str, float]:
        return {}

    def sync(self, step: int) -> None:
        self.workers.sync_weights(step)

    def settle(self, step: int) -> None:
        pass

    def queued(self) -> list[StepRollout]:
        return list(self.queue)

    def step_done(self, step: int) -> None:
        pass

    def devices(self, slice_devices: dict[str, float], rollout: StepRollout) -> dict[str, float]:
        return slice_devices

    def stop(self, reraise: bool = True) -> None:
        pass


class OneStepOff(Synchronous):
    """Rollouts made ahead in the main thread while the trainers update, up to k steps (see the module
    docstring); also past the last step when a later save is due, so a run resumed with more steps
    continues as if it had never stopped."""

    def __init__(self, roll_out: RollOut, timer: PhaseTimer, workers: SliceClient, queue: list[StepRollout],
                 k: int, steps: int, due: Callable[[int], bool]):
        super().__init__(roll_out, timer, workers, queue)
        self.k = k
        self.steps = steps
        self.due = due

    def during_update(self, step: int) -> dict[str, float]:
        saves = any(self.due(later) for later in range(step, self.steps + 1))
        for ahead_step in range(step + len(self.queue) + 1, rollouts_ahead_until(step, self.k, self.steps, saves) + 1):
            self.queue.append(self.roll_out(ahead_step, self.timer))
        return {"placement/rollouts_ahead": float(len(self.queue))}


def rollouts_ahead_until(step: int, max_staleness: int, steps: int, saves: bool) -> int:
    """The last step whose rollout is made during step `step`'s update under bounded staleness
    `max_staleness` (k): step + k, but not past the run's last step `steps` unless the run `saves` at
    this step or a later one (a run resumed from that save with more steps then finds the queue the
    longer run would have had: each rollout made during the same step, with the same weights)."""
    return step + max_staleness if saves else min(step + max_staleness, steps)


GENERATION_DEVICES = "generation_devices/"
"""Prefix of the rollout devices' utilisation in a producer's rollout statistics (`Producing.devices`)."""


class Producing:
    """Rollouts made ahead by a `RolloutProducer` thread (see the module docstring): the main thread calls
    only the trainers; the producer owns the rollout-phase devices."""

    def __init__(self, producer: RolloutProducer, timer: PhaseTimer, workers: SliceClient):
        self.producer = producer
        self.timer = timer
        self.workers = workers
        self.own = workers.updaters

    @classmethod
    def start(cls, ctx: ControllerContext, roll_out: RollOut, timer: PhaseTimer, on_span: Callable, done: int,
              queue: list[StepRollout], k: int, last: int) -> Producing:
        """Start the producer where the run stands: `done` steps finished, `queue` made for the next ones.
        It rolls out up to step `last`; its phases go to `on_span` (the controller's timeline), and each
        rollout carries its own `time/*` figures and its devices' utilisation in its statistics."""
        workers = ctx.workers
        rollout_timer = PhaseTimer(on_span=on_span, clock=ctx.clock)

        def produce(step: int) -> StepRollout:
            rollout_timer.reset()
            workers.begin_step(step, workers.generation)
            started = ctx.clock()
            rollout = roll_out(step, rollout_timer)
            rollout.stats.update(rollout_timer.timings())
            devices = workers.utilisation(ctx.clock() - started, workers.generation)
            rollout.stats.update({f"{GENERATION_DEVICES}{key}": value for key, value in devices.items()})
            return rollout

        ready = {done + 1 + i: rollout for i, rollout in enumerate(queue)}
        producer = RolloutProducer(produce, workers.load_published, first=done + 1 + len(queue), last=last, k=k,
                                   loaded=done, ready=ready)
        return cls(producer, timer, workers)

    def take(self, step: int) -> StepRollout:
        with self.timer.phase("rollout/queue"):  # the trainers wait for a rollout made ahead
            return self.producer.take(step)

    def during_update(self, step: int) -> dict[str, float]:
        return {"placement/rollouts_ahead": float(self.producer.ahead(step))}

    def sync(self, step: int) -> None:
        self.producer.publish(step, self.workers.publish(step))

    def settle(self, step: int) -> None:
        with self.timer.phase("rollout/queue"):  # the rollout devices, idle, take this update's weights
            self.producer.settle(step)

    def queued(self) -> list[StepRollout]:
        return self.producer.queued()

    def step_done(self, step: int) -> None:
        self.producer.permit(step)

    def devices(self, slice_devices: dict[str, float], rollout: StepRollout) -> dict[str, float]:
        """The trainers' figures (over the step) and the rollout devices' (measured by the producer over the
        rollout, carried in its statistics, which this takes them out of), averaged over all devices as
        `SliceClient.utilisation` averages them."""
        generation = {key.removeprefix(GENERATION_DEVICES): rollout.stats.pop(key)
                      for key in [k for k in rollout.stats if k.startswith(GENERATION_DEVICES)]}
        return reduce_stats([slice_devices] * len(self.workers.updaters) + [generation] * len(self.workers.generation))

    def stop(self, reraise: bool = True) -> None:
        self.producer.stop(reraise)


def schedule_for(ctx: ControllerContext, roll_out: RollOut, timer: PhaseTimer, on_span: Callable, *, k: int,
                 steps: int, due: Callable[[int], bool], done: int, queue: list[StepRollout]) -> Schedule:
    """The schedule of a controller's run (see the module docstring), from where the run stands: `done`
    steps finished and `queue` rolled out for the next ones. `k`: `placement.max_staleness`; `steps`: the
    run's last step; `due(s)`: whether step s saves a checkpoint (the queue then reaches past the last step)."""
    traits = ctx.plan.traits
    if not traits.overlaps_steps:
        return Synchronous(roll_out, timer, ctx.workers, queue)
    if not (traits.publishes_weights and k > 1):
        return OneStepOff(roll_out, timer, ctx.workers, queue, k, steps, due)
    last = max([steps] + [s + k for s in range(done + 1, steps + 1) if due(s)])
    return Producing.start(ctx, roll_out, timer, on_span, done, queue, k, last)
