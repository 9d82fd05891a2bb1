"""The rollout producer (bounded staleness k > 1 in a thread of the controller): its schedule, checked with
fake rollouts that block until the test lets them finish, so every assertion is about the order of events
(no timing): rollout s uses version max(0, s-1-k), starts as soon as that version is permitted, and a slow
rollout does not keep the trainer from taking an earlier one."""

from __future__ import annotations

import threading

import pytest

from gcore_rl.controller.producer import RolloutProducer

WAIT = 30.0  # seconds a test waits for an event before failing (never reached when the producer is right)


class Fakes:
    """`roll_out` and `load` for a producer: each rollout blocks until `release(step)`; both log what they did."""

    def __init__(self, fail_at: int | None = None):
        self.log: list[tuple[str, int]] = []
        self.started = {s: threading.Event() for s in range(1, 20)}
        self.gates = {s: threading.Event() for s in range(1, 20)}
        self.fail_at = fail_at
        self.versions: dict[int, int] = {}  # step -> the version loaded when its rollout ran
        self.loaded = 0

    def roll_out(self, step: int) -> str:
        self.log.append(("rollout", step))
        self.versions[step] = self.loaded
        self.started[step].set()
        assert self.gates[step].wait(WAIT)
        if step == self.fail_at:
            raise RuntimeError(f"rollout {step} broke")
        return f"rollout-{step}"

    def load(self, buckets: list, version: int) -> None:
        assert buckets == [f"weights-{version}"]
        self.log.append(("load", version))
        self.loaded = version

    def release(self, *steps: int) -> None:
        for step in steps:
            self.gates[step].set()


def producer(fakes: Fakes, k: int, last: int, **kw) -> RolloutProducer:
    return RolloutProducer(fakes.roll_out, fakes.load, first=kw.pop("first", 1), last=last, k=k,
                           loaded=kw.pop("loaded", 0), **kw)


def publish(p: RolloutProducer, version: int, permit: bool = True) -> None:
    p.publish(version, [f"weights-{version}"])
    if permit:
        p.permit(version)


def test_rollouts_run_ahead_with_the_scheduled_versions_and_a_slow_one_does_not_block_an_earlier_take():
    fakes = Fakes()
    p = producer(fakes, k=2, last=6)
    try:
        fakes.release(1, 2)
        assert p.take(1) == "rollout-1"
        assert p.take(2) == "rollout-2"
        # rollout 3 (version 0) starts without waiting for any update; rollout 4 needs version 1
        assert fakes.started[3].wait(WAIT)
        assert not fakes.started[4].is_set()
        publish(p, 1)
        fakes.release(3)
        assert p.take(3) == "rollout-3"
        assert fakes.started[4].wait(WAIT)  # made with version 1, while the trainer works on step 3
        publish(p, 2)
        publish(p, 3)
        # rollout 4 is slow: the trainer could not take 5 before it, but taking 4 itself waits only for 4
        fakes.release(4, 5, 6)
        assert [p.take(s) for s in (4, 5, 6)] == ["rollout-4", "rollout-5", "rollout-6"]
        p.stop()
    finally:
        p.stop(reraise=False)
        for gate in fakes.gates.values():
            gate.set()
    assert fakes.versions == {1: 0, 2: 0, 3: 0, 4: 1, 5: 2, 6: 3}
    # each version loaded once, just before the first rollout that needs it
    assert fakes.log == [("rollout", 1), ("rollout", 2), ("rollout", 3), ("load", 1), ("rollout", 4), ("load", 2),
                         ("rollout", 5), ("load", 3), ("rollout", 6)]


@pytest.mark.parametrize("k", [2, 3])
def test_no_rollout_is_older_than_k_versions_and_settle_leaves_a_quiet_queue_for_a_checkpoint(k):
    fakes = Fakes()
    for gate in fakes.gates.values():
        gate.set()
    p = producer(fakes, k=k, last=8)
    try:
        for step in range(1, 6):
            assert p.take(step) == f"rollout-{step}"
            publish(p, step, permit=False)
            p.settle(step)  # an evaluation or a save: everything version step-1 allows is made, version step loaded
            assert sorted(int(r.split("-")[1]) for r in p.queued()) == list(range(step + 1, min(step + k, 8) + 1))
            assert fakes.loaded == step and p.ahead(step) == min(k, 8 - step)
            p.permit(step)
        p.stop()
    finally:
        p.stop(reraise=False)
    for step, version in fakes.versions.items():
        assert version == max(0, step - 1 - k)


def test_a_resumed_producer_starts_after_the_queued_rollouts_with_the_loaded_weights():
    fakes = Fakes()
    for gate in fakes.gates.values():
        gate.set()
    fakes.loaded = 4
    p = producer(fakes, k=2, last=9, first=7, loaded=4, ready={5: "saved-5", 6: "saved-6"})
    try:
        assert [p.take(5), p.take(6)] == ["saved-5", "saved-6"]
        assert p.take(7) == "rollout-7"  # version 4, already loaded: no load
        publish(p, 5)
        assert p.take(8) == "rollout-8"
        p.stop()
    finally:
        p.stop(reraise=False)
    assert fakes.log == [("rollout", 7), ("load", 5), ("rollout", 8)]


def test_a_failed_rollout_is_raised_where_the_trainer_waits_and_stop_does_not_wait_for_versions():
    fakes = Fakes(fail_at=2)
    p = producer(fakes, k=2, last=5)
    try:
        fakes.release(1, 2)
        assert p.take(1) == "rollout-1"
        with pytest.raises(RuntimeError, match="rollout 2 broke"):
            p.take(2)
    finally:
        p.stop(reraise=False)
    waiting = Fakes()
    q = producer(waiting, k=1, last=5)  # rollouts 1 and 2 (version 0), then it waits for version 1, never published
    waiting.release(1, 2)
    assert [q.take(1), q.take(2)] == ["rollout-1", "rollout-2"]
    q.stop()  # returns: a producer waiting for a version stops at once
    assert waiting.log == [("rollout", 1), ("rollout", 2)]
