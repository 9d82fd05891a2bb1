"""Rollouts made ahead in a thread of the controller: bounded staleness k > 1 that shortens steps.

Under `disaggregated` with `placement.max_staleness` k > 1, a `RolloutProducer` rolls out steps
first, first + 1, ... in a background thread while the controller's main thread trains, publishes
and records. The schedule stays a function of step numbers (so a run is reproducible and resumes
exactly): the rollout of step s uses exactly the weights of update v(s) = max(0, s - 1 - k). The
main thread only *publishes* each update's weights (`SliceClient.publish`, references to buckets
in the object store) and permits version v; the producer loads v(s) into the rollout devices just
before rollout s (`SliceClient.load_published`), whatever the trainers are doing. So rollout s may
start as soon as update s - 1 - k is published: when generation has a long tail, finished rollouts
queue up to k steps ahead and a slow one no longer stalls the trainer, as long as the mean rollout
keeps up with the mean update.

The main thread takes rollout t for step t (`take`), and when it must see the rollout devices at
a known point (a held-out evaluation, a checkpoint, the end of the run) it waits until every
rollout permitted so far is made (`wait_idle`): the producer is then blocked on the next version,
no rollout is half made, and the data sampler and the queue are as the schedule says.

Only the producer calls the rollout-phase devices while it runs (their `begin_step` included), and
only the main thread calls the trainers: Ray actors run one call at a time, so a call from the
main thread to a busy rollout device would wait for its rollout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gcore_rl.controller.program import StepRollout


class RolloutProducer:
    """Makes the rollouts of steps `first` .. `last` in order, rollout s with the weights of version
    max(0, s - 1 - `k`), in a thread of its own.

    Args:
        roll_out: makes step s's rollout (`rollout_phase` with that step's seeds); called in the thread.
        load: `load(buckets, version)` loads published weights into the rollout devices
            (`SliceClient.load_published`); called in the thread before the first rollout that needs a
            version other than the one loaded, and by `settle`.
        first, last: the steps to roll out (`last` < `first`: none).
        k: the staleness bound, `placement.max_staleness`.
        loaded: the version the rollout devices hold now (every version up to it counts as published).
        ready: rollouts already made (resumed from a checkpoint), by step.
    """

    def __init__(self, roll_out: Callable[[int], StepRollout], load: Callable[[list, int], None], first: int,
                 last: int, k: int, loaded: int, ready: dict[int, StepRollout] | None = None):
        self._roll_out = roll_out
        self._load = load
        self._buckets: dict[int, list] = {}  # published versions not loaded yet: their buckets' references
        self.k = k
        self.last = last
        self.loaded = loaded
        self._permitted = loaded
        self._ready: dict[int, StepRollout] = dict(ready or {})
        self._next = first
        self._busy = False
        self._stopping = False
        self._error: BaseException | None = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def version_for(self, step: int) -> int:
        """The weights version the rollout of `step` is made with."""
        return max(0, step - 1 - self.k)

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    step = self._next
                    self._changed.wait_for(lambda s=step: self._stopping or self._may_start(s))
                    if self._stopping:
                        return
                    self._busy = True
                self._load_version(self.version_for(step))
                rollout = self._roll_out(step)
                with self._changed:
                    self._ready[step] = rollout
                    self._next = step + 1
                    self._busy = False
                    self._changed.notify_all()
        except BaseException as err:  # handed to the main thread, which raises it where it waits
            with self._changed:
                self._error = err
                self._busy = False
                self._changed.notify_all()

    def _load_version(self, version: int) -> None:
        """Have the rollout devices hold `version`; forget the published versions before it."""
        if version != self.loaded:
            self._load(self._buckets[version], version)
            self.loaded = version
        with self._changed:
            for old in [v for v in self._buckets if v < version]:
                del self._buckets[old]

    def _may_start(self, step: int) -> bool:
        return step <= self.last and self._permitted >= self.version_for(step)

    # ---- the main thread ----------------------------------------------------------------

    def publish(self, version: int, buckets: list) -> None:
        """The weights of update `version`, published (`SliceClient.publish`); rollouts may use them once permitted."""
        with self._changed:
            self._buckets[version] = buckets

    def settle(self, version: int) -> None:
        """Wait until the producer is idle (`wait_idle`), then load `version` into the rollout devices (a
        published one, the next a rollout needs): for an evaluation or a checkpoint at this point."""
        self.wait_idle()
        self._load_version(version)

    def permit(self, version: int) -> None:
        """Version `version` is published: rollouts that need it may start."""
        with self._changed:
            self._permitted = max(self._permitted, version)
            self._changed.notify_all()

    def take(self, step: int) -> StepRollout:
        """The rollout of `step`, once made (raises the producer's error if it failed)."""
        with self._changed:
            self._changed.wait_for(lambda: step in self._ready or self._error is not None)
            if step not in self._ready:  # a rollout made before the failure is still handed over
                self._raise()
            return self._ready.pop(step)

    def wait_idle(self) -> None:
        """Wait until every rollout the permitted versions allow is made (the producer waits for a version)."""
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or (
                not self._busy and not self._may_start(self._next)))
            self._raise()

    def queued(self) -> list[StepRollout]:
        """The rollouts made and not taken yet, in step order (what a checkpoint keeps)."""
        with self._changed:
            return [self._ready[s] for s in sorted(self._ready)]

    def ahead(self, step: int) -> int:
        """Rollouts the schedule makes for steps after `step` before update `step` is published: min(k, last - step)."""
        return max(0, min(self.k, self.last - step))

    def stop(self, reraise: bool = True) -> None:
        """Stop after the rollout in progress (if any) and wait for the thread; then, with `reraise`, raise the
        producer's error if it had one (without: on a way out that already carries an error)."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join()
        if reraise:
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error
